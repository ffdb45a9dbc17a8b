"""Engine exports as string contracts, and each engine's own memory rules.

The exports read only a plan's choice and request, so the golden cases build their vramplan plans by
hand (a Choice per case): they test the exporters, not vramplan's search, which changes on its own.
The llama.cpp and Ollama exports re-plan by llama.cpp's rules (planner/gguf.py bytes); the vLLM export
plans vLLM's layout. Every expected string below is exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from vramplan.planner.choice import Choice, ComputeDevice, OffloadMode
from vramplan.planner.engines import emit, plan_for_engine
from vramplan.planner.engines import llamacpp_rules as rules
from vramplan.planner.engines.llamacpp import QUALITY_STAND_IN, LlamaCppChoice
from vramplan.planner.engines.ollama import ollama_tag, published_file_types
from vramplan.planner.engines.vllm import VLLMModel, pp_partitions, search, weight_format
from vramplan.planner.engines.vllm_rules import LayerKV
from vramplan.planner.errors import PlanError
from vramplan.planner.gguf import GGUF_FILE_TYPES, gguf_tensors
from vramplan.planner.memory import CPUMemory, MemoryBreakdown
from vramplan.planner.plan import Candidate, Plan, hardware_ref, model_ref
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import model_spec
from vramplan.planner.speed import SpeedEstimate
from vramplan.planner.units import MiB

RTX4090 = resolve_profile("rtx-4090")[0]
TWO_4090 = RTX4090.replace(name="rtx-4090-x2", gpus=(replace(RTX4090.gpus[0], count=2),))
H100 = resolve_profile("h100-sxm")[0]
H100_X8 = H100.replace(name="h100-sxm-x8", gpus=(replace(H100.gpus[0], count=8),))
CPU_SERVER = resolve_profile("cpu-epyc-server")[0]


def hand_plan(model: str, hw, req: Request, **choice) -> tuple:
    """A vramplan plan whose chosen placement is `choice` (memory and speed are not what exports read)."""
    spec = model_spec(model)
    c = Choice(total_layers=spec.num_layers, **choice)
    mem = MemoryBreakdown(gpus=(), cpu=CPUMemory(weights_bytes=0, kv_cache_bytes=0, workspace_bytes=0,
                                                  runtime_base_bytes=0, capacity_bytes=1), workspace_terms={})
    speed = SpeedEstimate(decode_tokens_per_s=1.0, decode_tokens_per_s_full_context=1.0, ttft_s=1.0,
                          prefill_tokens_per_s=1.0, ceiling_decode_tokens_per_s=1.0, terms={})
    cand = Candidate(weight_quant=c.weight_quant, kv_dtype=c.kv_dtype, quality_cost_pct=0.0, fits=True, choice=c,
                     memory=mem, speed=speed)
    return spec, hw, Plan(model=model_ref(spec), hardware=hardware_ref(hw), request=req, chosen=cand, reasons=[],
                          candidates=[cand])


GPU = dict(compute_device=ComputeDevice.CUDA)
CASES = {
    # a dense 8B on a 24 GB card: bf16 weights, fp8 KV, every layer on the GPU
    "dense-8b-24gb": lambda: hand_plan("llama-3.1-8b", RTX4090, Request(context=32768), weight_quant="bf16",
                                       kv_dtype="fp8", gpu_layers=32, offload=OffloadMode.NONE,
                                       embeddings_on_gpu=True, **GPU),
    # a 70B offloaded: nf4 weights, 40 of 80 layers streamed
    "70b-offloaded": lambda: hand_plan("llama-3.1-70b", RTX4090, Request(context=8192), weight_quant="bnb-nf4",
                                       kv_dtype="bf16", gpu_layers=40, offload=OffloadMode.STREAM,
                                       embeddings_on_gpu=False, **GPU),
    # an MoE with every routed expert in RAM, the rest on the GPU
    "moe-experts-in-ram": lambda: hand_plan("qwen3-30b-a3b", RTX4090, Request(context=16384), weight_quant="bf16",
                                            kv_dtype="bf16", gpu_layers=48, offload=OffloadMode.NONE,
                                            embeddings_on_gpu=True, moe_layers=48, expert_layers_on_cpu=48, **GPU),
    # two GPUs: 40 + 40 layers of a 70B in nf4
    "two-gpus": lambda: hand_plan("llama-3.1-70b", TWO_4090, Request(context=8192), weight_quant="bnb-nf4-dq",
                                  kv_dtype="bf16", gpu_layers=80, offload=OffloadMode.NONE, embeddings_on_gpu=True,
                                  gpu_layers_per_device=(40, 40), **GPU),
    # a machine without a GPU
    "cpu-only": lambda: hand_plan("llama-3.1-8b", CPU_SERVER, Request(context=8192), weight_quant="bf16",
                                  kv_dtype="bf16", gpu_layers=0, offload=OffloadMode.NONE, embeddings_on_gpu=False,
                                  compute_device=ComputeDevice.CPU),
    # 405B in bf16 needs two 8 x H100 nodes for vLLM; the user has two
    "405b-two-nodes": lambda: hand_plan("llama-3.1-405b", H100_X8, Request(context=32768, nodes=2), weight_quant="bf16",
                                        kv_dtype="bf16", gpu_layers=126, offload=OffloadMode.NONE,
                                        embeddings_on_gpu=True, **GPU),
}


def export_text(case: str, engine: str) -> str:
    spec, hw, p = CASES[case]()
    return emit(engine, spec, hw, p).text


def body(text: str) -> str:
    """The export without its leading comment lines (the notes)."""
    lines = text.splitlines()
    while lines and lines[0].startswith("# ") and not lines[0].startswith("# ollama pull"):
        lines.pop(0)
    return "\n".join(lines)


def notes(text: str) -> list[str]:
    return [ln[2:] for ln in text.splitlines() if ln.startswith("# ") and not ln.startswith("# assumption")]
CASES["405b-one-node"] = lambda: hand_plan("llama-3.1-405b", H100_X8, Request(context=32768, nodes=1),
                                           weight_quant="bf16", kv_dtype="bf16", gpu_layers=126,
                                           offload=OffloadMode.NONE, embeddings_on_gpu=True, **GPU)


GOLDEN = {
    ('dense-8b-24gb', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-8B \
  --max-model-len 32768 \
  --gpu-memory-utilization 0.92 \
  --kv-cache-dtype auto""",
        ["vLLM's own choice among 6 formats x caches: no speed is predicted for what runs here: the most of the "
         "model on the GPU among the options that keep the quality floor, then the best quality (~0.0 % perplexity "
         "over bf16)",
         "vLLM 0.33.0 per GPU (1 TP x 1 PP on 1 node(s)): 0.92 x 23.49 GiB (CUDA's total) = weights 14.96 GiB + "
         "profile-run peak 506.50 MiB + non-torch 163.84 MiB + CUDA graphs 1.00 GiB + KV pool 5.00 GiB; the rest "
         "holds the CUDA context 500.00 MiB and your headroom 512.00 MiB",
         "--gpu-memory-utilization 0.92, vLLM's default: the KV pool holds the request; this GPU allows up to 0.95 "
         "(more pool, more sequences at once)",
         'the KV pool is cut in 16-token blocks (FLASH_ATTN, the attention backend vLLM picks on compute capability '
         '8.9 with this cache); 4.00 GiB hold 1 sequence(s) of 32768 tokens; the pool holds about 1',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures '
         'above are estimates (see the assumptions)']),
    ('dense-8b-24gb', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-8B-Q8_0.gguf \
  -c 32768 \
  -ngl 33 \
  -fa on""",
        ["GGUF Q8_0: Llama-3.1-8B-Q8_0.gguf, 8,540,777,696 B (7.95 GiB; planner/gguf.py: llama-quantize's tensor "
         "types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-8B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py <the meta-llama/Llama-3.1-8B '
         'checkpoint directory>, then llama-quantize <f16.gguf> Llama-3.1-8B-Q8_0.gguf Q8_0',
         'all 32 layers and the output layer on the GPU (-ngl 33): GPU 0: 11.57 GiB of 22.50 GiB usable (weights '
         '7.43 GiB + KV 4.00 GiB + compute 149.96 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin '
         '1.00 GiB); RAM 790.27 MiB of 64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the '
         'plan sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in "
         "what the plan leaves free",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q8_0"]),
    ('dense-8b-24gb', 'ollama'): (
        r"""# ollama pull llama3.1:8b-text-q8_0
FROM llama3.1:8b-text-q8_0
PARAMETER num_ctx 32768""",
        ["Ollama v0.32.15: llama-server (llama.cpp b10488) started with Ollama's launch settings and placed by its "
         "--fit: llama.cpp's plan for that launch (vramplan's llama.cpp rules follow llama.cpp 0c1e57098)",
         "Ollama quant q8_0 (GGUF Q8_0); tag by ollama.com/library's naming convention: check it is published",
         "all 32 layers and the output layer on the GPU (-ngl 33): GPU 0: 11.72 GiB of 22.50 GiB usable (weights "
         "7.43 GiB + KV 4.00 GiB + compute 296.49 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin "
         "1.00 GiB); RAM 8.90 GiB of 64.00 GiB (by llama.cpp's rules; --fit chooses -ngl itself)",
         "no num_gpu: with num_gpu set Ollama passes -ngl, and llama.cpp's --fit then leaves the placement to it "
         "(common/fit.cpp: \"n_gpu_layers already set by user\")",
         "num_batch 1024: Ollama's automatic choice for 32768 tokens of context (server/sched.go "
         "automaticGenerationBatch: predicted VRAM 11.95 GiB of 23.50 GiB free)",
         "Ollama will start: llama-server --model '<llama3.1:8b-text-q8_0 blob>' -c 32768 -np 1 --flash-attn auto -b "
         "1024 -ub 1024",
         "llama-server keeps finished prompts' KV state in RAM up to its --cache-ram default of 8192 MiB: Ollama "
         "passes no --cache-ram, so the plan counts it in RAM",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q8_0",
         'ollama pull llama3.1:8b-text-q8_0']),
    ('dense-8b-24gb', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM

device_map = {"": 0}
model = AutoModelForCausalLM.from_pretrained(
    "meta-llama/Llama-3.1-8B",
    device_map=device_map,
    dtype=torch.bfloat16,
)""",
        ["bf16 + bf16 KV: every layer on the GPU: vramplan's speed model: the same eager kernels as vramplan's "
         "runtime"]),
    ('70b-offloaded', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-70B \
  --max-model-len 8192 \
  --gpu-memory-utilization 0.91 \
  --kv-cache-dtype auto \
  --quantization mxfp4 \
  --pipeline-parallel-size 3 \
  --distributed-executor-backend ray""",
        ["vLLM's weight offload copies each layer's parameters to RAM as the layer is built (vllm-project/vllm "
         "vllm/model_executor/offloader/uva.py @ v0.33.0 (4ba787ec9)), before --quantization mxfp4 has quantized "
         "them (they are still on the meta device then): the two do not combine, so no --cpu-offload-gb here",
         'needs 3 nodes of rtx-4090 (--nodes 1 given): run it on 3',
         'start a Ray cluster over the 3 nodes first (ray start --head on one, ray start --address=<head>:6379 on '
         'the others); TP inside each node, PP across nodes',
         "vLLM 0.33.0 per GPU (1 TP x 3 PP on 3 node(s)): 0.91 x 23.49 GiB (CUDA's total) = weights 13.39 GiB + "
         "profile-run peak 504.00 MiB + non-torch 563.20 MiB + CUDA graphs 1.00 GiB + KV pool 5.94 GiB; the rest "
         "holds the CUDA context 500.00 MiB, NCCL 1.00 GiB and your headroom 512.00 MiB",
         "--gpu-memory-utilization 0.91, below vLLM's default 0.92: the CUDA context, NCCL and your headroom leave "
         "no more",
         'the KV pool is cut in 16-token blocks (FLASH_ATTN, the attention backend vLLM picks on compute capability '
         '8.9 with this cache); 865.69 MiB hold 1 sequence(s) of 8192 tokens; the pool holds about 7',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures '
         'above are estimates (see the assumptions)',
         "vLLM 0.33.0 has no bitsandbytes and no quanto: mxfp4 maps to --quantization mxfp4 (MXFP4 weights quantized "
         "while loading: 4-bit values with a power-of-two scale per 32, 0.53 B/param; W4A16 Marlin where "
         "FlashInfer's FP4 kernels do not run); its power-of-two scales round more coarsely than NF4's",
         "vramplan's runtime offloads 40 layers on rtx-4090; vLLM spreads the model over GPUs instead"]),
    ('70b-offloaded', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-70B-Q5_K_M.gguf \
  -c 8192 \
  -ngl 37 \
  -fa on""",
        ["GGUF Q5_K_M: Llama-3.1-70B-Q5_K_M.gguf, 49,949,823,424 B (46.52 GiB; planner/gguf.py: llama-quantize's "
         "tensor types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-70B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py <the meta-llama/Llama-3.1-70B '
         'checkpoint directory>, then llama-quantize <f16.gguf> Llama-3.1-70B-Q5_K_M.gguf Q5_K_M',
         'layers 44-79 and the output layer on the GPU, 0-43 computed by the CPU (-ngl 37): GPU 0: 22.46 GiB of '
         '22.50 GiB usable (weights 21.10 GiB + KV 1.12 GiB + compute 241.96 MiB) (usable = memory - CUDA context '
         '500.00 MiB - --fit margin 1.00 GiB); RAM 27.27 GiB of 64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the '
         'plan sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in "
         "what the plan leaves free",
         "llama.cpp decodes the 44 layers left in RAM on the CPU; a prompt's ubatches of 32+ tokens copy their "
         "weights to the GPU (op offload)",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q8_0 (Q5_K_M borrows the Q8_0 group's)",
         'prompt processing with weights in RAM: llama.cpp runs each ubatch of at least 32 tokens on the GPU (op '
         'offload), copying 24.74 GiB of weights from RAM for each of its 16 ubatches: TTFT 52.14 s = GPU 16.72 s + '
         'link 35.42 s at 12 GB/s (pageable: mmapped weights), not the 549.45 s the CPU would take; the KV rows of '
         'layers in RAM crossing the link are not counted']),
    ('70b-offloaded', 'ollama'): (
        r"""# ollama pull llama3.1:70b-text-q6_K
FROM llama3.1:70b-text-q6_K
PARAMETER num_ctx 8192""",
        ["Ollama v0.32.15: llama-server (llama.cpp b10488) started with Ollama's launch settings and placed by its "
         "--fit: llama.cpp's plan for that launch (vramplan's llama.cpp rules follow llama.cpp 0c1e57098)",
         "Ollama quant q6_K (GGUF Q6_K); tag by ollama.com/library's naming convention: check it is published",
         "layers 49-79 and the output layer on the GPU, 0-48 computed by the CPU (-ngl 32): GPU 0: 22.27 GiB of "
         "22.50 GiB usable (weights 21.07 GiB + KV 992.00 MiB + compute 240.49 MiB) (usable = memory - CUDA context "
         "500.00 MiB - --fit margin 1.00 GiB); RAM 42.98 GiB of 64.00 GiB (by llama.cpp's rules; --fit chooses -ngl "
         "itself)",
         "no num_gpu: with num_gpu set Ollama passes -ngl, and llama.cpp's --fit then leaves the placement to it "
         "(common/fit.cpp: \"n_gpu_layers already set by user\")",
         "num_batch 512: Ollama's automatic choice for 8192 tokens of context (server/sched.go "
         "automaticGenerationBatch: predicted VRAM 56.41 GiB of 23.50 GiB free)",
         "Ollama will start: llama-server --model '<llama3.1:70b-text-q6_K blob>' -c 8192 -np 1 --flash-attn auto -b "
         "512 -ub 512",
         "llama-server keeps finished prompts' KV state in RAM up to its --cache-ram default of 8192 MiB: Ollama "
         "passes no --cache-ram, so the plan counts it in RAM",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q8_0 (Q6_K borrows the Q8_0 group's)",
         'prompt processing with weights in RAM: llama.cpp runs each ubatch of at least 32 tokens on the GPU (op '
         'offload), copying 32.03 GiB of weights from RAM for each of its 16 ubatches: TTFT 62.58 s = GPU 16.72 s + '
         'link 45.86 s at 12 GB/s (pageable: mmapped weights), not the 609.99 s the CPU would take; the KV rows of '
         'layers in RAM crossing the link are not counted',
         'this plan fits but is not usable as it stands: decode 0.86 tok/s is under 1 tok/s (the thresholds: '
         '--min-tok-s / --max-ttft; a shorter context or prompt, or a smaller format, changes it)',
         'ollama pull llama3.1:70b-text-q6_K']),
    ('70b-offloaded', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

quantization_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16,
    llm_int8_enable_fp32_cpu_offload=True,
)
device_map = {"": 0}  # later, longer entries override earlier ones
device_map |= {f"model.layers.{i}": "cpu" for i in range(44, 80)}
device_map["model.embed_tokens"] = "cpu"
model = AutoModelForCausalLM.from_pretrained(
    "meta-llama/Llama-3.1-70B",
    quantization_config=quantization_config,
    device_map=device_map,
    dtype=torch.bfloat16,
)

# the plan's quanto-int4 KV cache: generate(..., cache=cache) (past_key_values=cache before transformers 5.24)
from transformers.cache_utils import QuantizedCache
cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=64, residual_length=128)""",
        ["bnb-nf4-dq + quanto-int4 KV: an accelerate device_map: 36 layers mapped to the CPU; not predicted: "
         "accelerate's offload is not modeled (5-17x slower than vramplan's stream engine, measured on an H200)",
         "transformers' bitsandbytes offload keeps the CPU-mapped modules unquantized in RAM (60.33 GiB in all), "
         "unlike vramplan's runtime, which keeps them quantized",
         "the 36 CPU-mapped layers are copied to the GPU on every forward by accelerate (no prefetch), where "
         "vramplan's runtime streams them with prefetch or computes them on the CPU",
         "the plan's quanto-int4 KV cache: generate(..., cache=cache) (past_key_values=cache before transformers "
         "5.24)"]),
    ('moe-experts-in-ram', 'vllm'): (
        r"""vllm serve Qwen/Qwen3-30B-A3B \
  --max-model-len 16384 \
  --gpu-memory-utilization 0.94 \
  --kv-cache-dtype auto \
  --cpu-offload-gb 38 \
  --cpu-offload-params experts""",
        ["vLLM's own choice among 6 formats x caches: no speed is predicted for what runs here: the most of the "
         "model on the GPU among the options that keep the quality floor, then the best quality (~0.0 % perplexity "
         "over bf16)",
         'vLLM fits 1 node(s) only with 38 GiB of routed experts per GPU in RAM (--cpu-offload-gb: pinned RAM the '
         'GPU reads over the host link on every forward pass); without offload it needs 4 nodes of rtx-4090',
         "vLLM 0.33.0 per GPU (1 TP x 1 PP on 1 node(s)): 0.94 x 23.49 GiB (CUDA's total) = weights 18.87 GiB + "
         "profile-run peak 420.75 MiB + non-torch 163.84 MiB + CUDA graphs 1.00 GiB + KV pool 1.64 GiB; the rest "
         "holds the CUDA context 500.00 MiB and your headroom 512.00 MiB",
         "--gpu-memory-utilization 0.94, above vLLM's default 0.92: at the default the KV pool falls 341.65 MiB "
         "short of the 1.50 GiB this request needs",
         'the KV pool is cut in 16-token blocks (FLASH_ATTN, the attention backend vLLM picks on compute capability '
         '8.9 with this cache); 1.50 GiB hold 1 sequence(s) of 16384 tokens; the pool holds about 1',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures '
         'above are estimates (see the assumptions)']),
    ('moe-experts-in-ram', 'llama.cpp'): (
        r"""llama-server \
  -m Qwen3-30B-A3B-Q6_K.gguf \
  -c 16384 \
  -ngl 49 \
  --n-cpu-moe 5 \
  -fa on""",
        ["GGUF Q6_K: Qwen3-30B-A3B-Q6_K.gguf, 25,092,535,456 B (23.37 GiB; planner/gguf.py: llama-quantize's tensor "
         "types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Qwen3-30B-A3B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py <the Qwen/Qwen3-30B-A3B '
         'checkpoint directory>, then llama-quantize <f16.gguf> Qwen3-30B-A3B-Q6_K.gguf Q6_K',
         'all 48 layers and the output layer on the GPU (-ngl 49), experts of the first 5 of 48 MoE layers (layers '
         '0-4) in RAM (--n-cpu-moe 5): GPU 0: 22.39 GiB of 22.50 GiB usable (weights 20.82 GiB + KV 1.50 GiB + '
         'compute 70.32 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin 1.00 GiB); RAM 2.86 GiB of '
         '64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the '
         'plan sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in "
         "what the plan leaves free",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q8_0 (Q6_K borrows the Q8_0 group's)",
         'prompt processing with weights in RAM: llama.cpp runs each ubatch of at least 32 tokens on the GPU (op '
         'offload), copying 2.31 GiB of weights from RAM for each of its 32 ubatches: TTFT 9.77 s = GPU 3.17 s + '
         'link 6.61 s at 12 GB/s (pageable: mmapped weights), not the 8.08 s the CPU would take; the KV rows of '
         'layers in RAM crossing the link are not counted']),
    ('moe-experts-in-ram', 'ollama'): (
        r"""# ollama pull qwen3:30b-a3b-q4_K_M
FROM qwen3:30b-a3b-q4_K_M
PARAMETER num_ctx 16384""",
        ["Ollama v0.32.15: llama-server (llama.cpp b10488) started with Ollama's launch settings and placed by its "
         "--fit: llama.cpp's plan for that launch (vramplan's llama.cpp rules follow llama.cpp 0c1e57098)",
         "Ollama quant q4_K_M (GGUF Q4_K_M); tag by ollama.com/library's naming convention: check it is published",
         "all 48 layers and the output layer on the GPU (-ngl 49): GPU 0: 18.68 GiB of 22.50 GiB usable (weights "
         "17.11 GiB + KV 1.50 GiB + compute 68.58 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin "
         "1.00 GiB); RAM 8.54 GiB of 64.00 GiB (by llama.cpp's rules; --fit chooses -ngl itself)",
         "no num_gpu: with num_gpu set Ollama passes -ngl, and llama.cpp's --fit then leaves the placement to it "
         "(common/fit.cpp: \"n_gpu_layers already set by user\")",
         "num_batch 512: Ollama's automatic choice for 16384 tokens of context (server/sched.go "
         "automaticGenerationBatch: predicted VRAM 18.03 GiB of 23.50 GiB free)",
         "Ollama will start: llama-server --model '<qwen3:30b-a3b-q4_K_M blob>' -c 16384 -np 1 --flash-attn auto -b "
         "512 -ub 512",
         "llama-server keeps finished prompts' KV state in RAM up to its --cache-ram default of 8192 MiB: Ollama "
         "passes no --cache-ram, so the plan counts it in RAM",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q4",
         'ollama pull qwen3:30b-a3b-q4_K_M']),
    ('moe-experts-in-ram', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM

device_map = {"": 0}  # later, longer entries override earlier ones
device_map |= {f"model.layers.{i}.mlp.experts": "cpu" for i in range(32)}  # routed experts in RAM
model = AutoModelForCausalLM.from_pretrained(
    "Qwen/Qwen3-30B-A3B",
    device_map=device_map,
    dtype=torch.bfloat16,
)""",
        ["bf16 + bf16 KV: the experts of 32 layers mapped to the CPU; not predicted: accelerate's offload is not "
         "modeled (5-17x slower than vramplan's stream engine, measured on an H200)",
         "the experts of 32 layers are mapped to the CPU: accelerate copies them to the GPU on every forward, where "
         "vramplan's runtime computes them on the CPU"]),
    ('two-gpus', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-70B \
  --max-model-len 8192 \
  --gpu-memory-utilization 0.91 \
  --kv-cache-dtype auto \
  --quantization fp8_per_tensor \
  --tensor-parallel-size 2 \
  --pipeline-parallel-size 2 \
  --distributed-executor-backend ray""",
        ["vLLM's weight offload copies each layer's parameters to RAM as the layer is built (vllm-project/vllm "
         "vllm/model_executor/offloader/uva.py @ v0.33.0 (4ba787ec9)), before --quantization fp8_per_tensor has "
         "quantized them (they are still on the meta device then): the two do not combine, so no --cpu-offload-gb "
         "here",
         'needs 2 nodes of rtx-4090-x2 (--nodes 1 given): run it on 2',
         'start a Ray cluster over the 2 nodes first (ray start --head on one, ray start --address=<head>:6379 on '
         'the others); TP inside each node, PP across nodes',
         "vLLM 0.33.0 per GPU (2 TP x 2 PP on 2 node(s)): 0.91 x 23.49 GiB (CUDA's total) = weights 16.92 GiB + "
         "profile-run peak 566.50 MiB + non-torch 563.20 MiB + CUDA graphs 1.00 GiB + KV pool 2.35 GiB; the rest "
         "holds the CUDA context 500.00 MiB, NCCL 1.00 GiB and your headroom 512.00 MiB",
         "--gpu-memory-utilization 0.91, below vLLM's default 0.92: the CUDA context, NCCL and your headroom leave "
         "no more",
         'the KV pool is cut in 16-token blocks (FLASH_ATTN, the attention backend vLLM picks on compute capability '
         '8.9 with this cache); 641.25 MiB hold 1 sequence(s) of 8192 tokens; the pool holds about 3',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures '
         'above are estimates (see the assumptions)',
         'vLLM 0.33.0 has no bitsandbytes and no quanto: fp8_per_tensor maps to --quantization fp8_per_tensor (FP8 '
         'E4M3 weights quantized while loading, a per-tensor scale; `fp8` is its deprecated name; W8A16 Marlin below '
         'compute capability 8.9)']),
    ('two-gpus', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-70B-Q4_K_M.gguf \
  -c 8192 \
  -ngl 81 \
  -ts 43,38 \
  -fa on""",
        ["GGUF Q4_K_M: Llama-3.1-70B-Q4_K_M.gguf, 42,520,400,320 B (39.60 GiB; planner/gguf.py: llama-quantize's "
         "tensor types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-70B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py <the meta-llama/Llama-3.1-70B '
         'checkpoint directory>, then llama-quantize <f16.gguf> Llama-3.1-70B-Q4_K_M.gguf Q4_K_M',
         'all 80 layers and the output layer on the GPU (-ngl 81): GPU 0: 22.10 GiB of 22.50 GiB usable (weights '
         '20.53 GiB + KV 1.34 GiB + compute 240.00 MiB); GPU 1: 19.91 GiB of 22.50 GiB usable (weights 18.52 GiB + '
         'KV 1.16 GiB + compute 241.96 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin 1.00 GiB); RAM '
         '821.58 MiB of 64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the '
         'plan sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in "
         "what the plan leaves free",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q4"]),
    ('two-gpus', 'ollama'): (
        r"""# ollama pull llama3.1:70b-text-q4_K_M
FROM llama3.1:70b-text-q4_K_M
PARAMETER num_ctx 8192""",
        ["Ollama v0.32.15: llama-server (llama.cpp b10488) started with Ollama's launch settings and placed by its "
         "--fit: llama.cpp's plan for that launch (vramplan's llama.cpp rules follow llama.cpp 0c1e57098)",
         "Ollama quant q4_K_M (GGUF Q4_K_M); tag by ollama.com/library's naming convention: check it is published",
         "all 80 layers and the output layer on the GPU (-ngl 81): GPU 0: 22.10 GiB of 22.50 GiB usable (weights "
         "20.53 GiB + KV 1.34 GiB + compute 240.00 MiB); GPU 1: 19.91 GiB of 22.50 GiB usable (weights 18.52 GiB + "
         "KV 1.16 GiB + compute 240.49 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin 1.00 GiB); RAM "
         "8.93 GiB of 64.00 GiB (by llama.cpp's rules; --fit chooses -ngl itself)",
         "no num_gpu: with num_gpu set Ollama passes -ngl, and llama.cpp's --fit then leaves the placement to it "
         "(common/fit.cpp: \"n_gpu_layers already set by user\")",
         "num_batch 512: Ollama's automatic choice for 8192 tokens of context (server/sched.go "
         "automaticGenerationBatch: predicted VRAM 42.10 GiB of 47.00 GiB free)",
         "Ollama will start: llama-server --model '<llama3.1:70b-text-q4_K_M blob>' -c 8192 -np 1 --flash-attn auto "
         "-b 512 -ub 512",
         "llama-server keeps finished prompts' KV state in RAM up to its --cache-ram default of 8192 MiB: Ollama "
         "passes no --cache-ram, so the plan counts it in RAM",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 records) of "
         "llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q4",
         'ollama pull llama3.1:70b-text-q4_K_M']),
    ('two-gpus', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

quantization_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16,
)
device_map = {"": 0}  # later, longer entries override earlier ones
device_map |= {f"model.layers.{i}": 1 for i in range(40, 80)}
model = AutoModelForCausalLM.from_pretrained(
    "meta-llama/Llama-3.1-70B",
    quantization_config=quantization_config,
    device_map=device_map,
    dtype=torch.bfloat16,
)""",
        ["bnb-nf4-dq + bf16 KV: every layer on the GPU: vramplan's speed model: the same eager kernels as vramplan's "
         "runtime"]),
    ('cpu-only', 'vllm'): (
        r"""""",
        ["vLLM: hardware 'cpu-epyc-server' has no GPU; vramplan plans vLLM on CUDA GPUs only (vLLM's CPU and Apple "
         "backends are not planned)",
         'no vllm serve command']),
    ('cpu-only', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-8B-Q8_0.gguf \
  -c 8192 \
  -ngl 0 \
  -fa on \
  -ctk q8_0 \
  -ctv q8_0""",
        ["GGUF Q8_0: Llama-3.1-8B-Q8_0.gguf, 8,540,777,696 B (7.95 GiB; planner/gguf.py: llama-quantize's tensor "
         "types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-8B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py <the meta-llama/Llama-3.1-8B '
         'checkpoint directory>, then llama-quantize <f16.gguf> Llama-3.1-8B-Q8_0.gguf Q8_0',
         'all 32 layers computed by the CPU (no GPU): RAM 8.67 GiB of 768.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the '
         'plan sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in "
         "what the plan leaves free",
         "llama.cpp speed is predicted with vramplan's roofline; uncalibrated for llama.cpp"]),
    ('cpu-only', 'ollama'): (
        r"""# ollama pull llama3.1:8b-text-q8_0
FROM llama3.1:8b-text-q8_0
PARAMETER num_ctx 8192""",
        ["Ollama v0.32.15: llama-server (llama.cpp b10488) started with Ollama's launch settings and placed by its "
         "--fit: llama.cpp's plan for that launch (vramplan's llama.cpp rules follow llama.cpp 0c1e57098)",
         "Ollama quant q8_0 (GGUF Q8_0); tag by ollama.com/library's naming convention: check it is published",
         'all 32 layers computed by the CPU (no GPU): RAM 17.38 GiB of 768.00 GiB',
         "num_batch 1024: Ollama's automatic choice for 8192 tokens of context (server/sched.go "
         "automaticGenerationBatch: no GPU: the context alone decides)",
         "Ollama will start: llama-server --model '<llama3.1:8b-text-q8_0 blob>' -c 8192 -np 1 --flash-attn auto -b "
         "1024 -ub 1024",
         "llama-server keeps finished prompts' KV state in RAM up to its --cache-ram default of 8192 MiB: Ollama "
         "passes no --cache-ram, so the plan counts it in RAM",
         "llama.cpp speed is predicted with vramplan's roofline; uncalibrated for llama.cpp",
         'ollama pull llama3.1:8b-text-q8_0']),
    ('cpu-only', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM

device_map = "cpu"
model = AutoModelForCausalLM.from_pretrained(
    "meta-llama/Llama-3.1-8B",
    device_map=device_map,
    dtype=torch.bfloat16,
)""",
        ["bf16 + bf16 KV: on the CPU; not predicted: on the CPU vramplan calls torch's kernels itself (bf16 by GEMV, "
         "quanto's int8/int4 without its dispatch, lm_head in int8 rows), plain transformers does not (it decoded at "
         "0.69-1.04x of vramplan's speed in the two runs of bench/results/vs-engines-cpu-dev*.md, 0.59-0.97x in "
         "three runs before them)"]),
    ('405b-two-nodes', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-405B \
  --max-model-len 32768 \
  --gpu-memory-utilization 0.92 \
  --kv-cache-dtype auto \
  --tensor-parallel-size 8 \
  --pipeline-parallel-size 2 \
  --distributed-executor-backend ray""",
        ["vLLM's own choice among 6 formats x caches: no speed is predicted for what runs here: the most of the "
         "model on the GPU among the options that keep the quality floor, then the best quality (~0.0 % perplexity "
         "over bf16)",
         'start a Ray cluster over the 2 nodes first (ray start --head on one, ray start --address=<head>:6379 on '
         'the others); TP inside each node, PP across nodes',
         "vLLM 0.33.0 per GPU (8 TP x 2 PP on 2 node(s)): 0.92 x 79.15 GiB (CUDA's total) = weights 47.25 GiB + "
         "profile-run peak 2.32 GiB + non-torch 563.20 MiB + CUDA graphs 1.00 GiB + KV pool 21.70 GiB; the rest "
         "holds the CUDA context 500.00 MiB, NCCL 1.00 GiB and your headroom 512.00 MiB",
         "--gpu-memory-utilization 0.92, vLLM's default: the KV pool holds the request; this GPU allows up to 0.97 "
         "(more pool, more sequences at once)",
         'the KV pool is cut in 16-token blocks (FLASH_ATTN, the attention backend vLLM picks on compute capability '
         '9.0 with this cache); 1008.49 MiB hold 1 sequence(s) of 32768 tokens; the pool holds about 22',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures '
         'above are estimates (see the assumptions)']),
    ('405b-one-node', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-405B \
  --max-model-len 32768 \
  --gpu-memory-utilization 0.92 \
  --kv-cache-dtype auto \
  --quantization fp8_per_tensor \
  --tensor-parallel-size 8""",
        ["vLLM's own choice among 6 formats x caches: no speed is predicted for what runs here: the most of the "
         "model on the GPU among the options that keep the quality floor, then the best quality (~0.5 % perplexity "
         "over bf16)",
         "vLLM 0.33.0 per GPU (8 TP x 1 PP on 1 node(s)): 0.92 x 79.15 GiB (CUDA's total) = weights 47.74 GiB + "
         "profile-run peak 2.32 GiB + non-torch 563.20 MiB + CUDA graphs 1.00 GiB + KV pool 21.20 GiB; the rest "
         "holds the CUDA context 500.00 MiB, NCCL 1.00 GiB and your headroom 512.00 MiB",
         "--gpu-memory-utilization 0.92, vLLM's default: the KV pool holds the request; this GPU allows up to 0.97 "
         "(more pool, more sequences at once)",
         'the KV pool is cut in 16-token blocks (FLASH_ATTN, the attention backend vLLM picks on compute capability '
         '9.0 with this cache); 1.97 GiB hold 1 sequence(s) of 32768 tokens; the pool holds about 10',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures '
         'above are estimates (see the assumptions)',
         'vLLM 0.33.0 has no bitsandbytes and no quanto: fp8_per_tensor maps to --quantization fp8_per_tensor (FP8 '
         'E4M3 weights quantized while loading, a per-tensor scale; `fp8` is its deprecated name; W8A16 Marlin below '
         'compute capability 8.9)']),
}


# vLLM's own search: no format of a 70B fits one 24 GB card (70b-offloaded) or two (two-gpus) within vLLM's rules on
# one node; 405B fits one node of 8 H100s in fp8 (bf16 needs two); a CPU has no vLLM.
FITS = {"70b-offloaded": {"vllm": False}, "two-gpus": {"vllm": False}, "cpu-only": {"vllm": False}}


@pytest.mark.parametrize("case, engine", list(GOLDEN), ids=lambda x: x)
def test_export_is_the_golden_text(case, engine):
    spec, hw, p = CASES[case]()
    export = emit(engine, spec, hw, p)
    expected_body, expected_notes = GOLDEN[(case, engine)]
    assert body(export.text) == expected_body
    assert notes(export.text) == expected_notes
    assert export.fits is FITS.get(case, {}).get(engine, True)
    # every assumption the export used is said, in the text, once
    said = [ln[2:] for ln in export.text.splitlines() if ln.startswith("# assumption")]
    assert said == [f"assumption: {n}" for n in _assumed(export)]
    assert export.text.endswith("\n") and export.to_dict()["text"] == export.text


def _assumed(export) -> list[str]:
    from vramplan.planner.engines.common import assumption_notes

    return [n.removeprefix("assumption: ") for n in assumption_notes(export.constants)]


# ---------------------------------------------------------------- llama.cpp's rules
LLAMA_8B = model_spec("llama-3.1-8b")


def test_llamacpp_plan_uses_planner_gguf_sizes():
    """plan --engine llama.cpp for Llama-3.1-8B Q4_K_M: the file planner/gguf.py sizes, every tensor byte placed."""
    req = Request(context=8192, engine="llama.cpp", quant=("q4_k_m",), kv_dtype=("f16",))
    p = plan_for_engine(LLAMA_8B, RTX4090, req)
    assert p.fits and p.choice.weight_quant == "Q4_K_M" and p.choice.kv_dtype == "f16"
    data = sum(t.nbytes for t in gguf_tensors(LLAMA_8B, "Q4_K_M"))  # untied: no duplicated output
    assert p.memory.gpu.weights_bytes + p.memory.cpu.weights_bytes == data
    assert p.memory.cpu.weights_bytes == next(t.nbytes for t in gguf_tensors(LLAMA_8B, "Q4_K_M")
                                              if t.name == "token_embd.weight")  # dev_input: always in RAM
    assert "GGUF Q4_K_M: 4,920,741,088 B file" in p.reasons[-1]
    export = emit("llama.cpp", LLAMA_8B, RTX4090, p)
    assert export.details["gguf_file_bytes"] == 4_920_741_088 and export.details["ngl"] == 33
    assert p.to_dict()["choice"]["engine"] == "llama.cpp"
    assert p.warnings[0].startswith("llama.cpp speed on the GPU is predicted with constants fitted to public "
                                    "measurements (")  # the RTX 4090 profile's public_fit
    assert p.predicted.decode_tokens_per_s > 0


def test_llamacpp_kv_rows_follow_ggml_block_layouts():
    req = Request(context=4096, engine="llama.cpp")
    # 8 KV heads x 128 = 1024 values per row: f16 2048 B, q8_0 32 blocks x 34 B, q4_0 32 blocks x 18 B; K and V
    assert rules.kv_bytes_per_layer(LLAMA_8B, "f16", req) == [2 * 4096 * 2048] * 32
    assert rules.kv_bytes_per_layer(LLAMA_8B, "q8_0", req) == [2 * 4096 * 1088] * 32
    assert rules.kv_bytes_per_layer(LLAMA_8B, "q4_0", req) == [2 * 4096 * 576] * 32
    # sliding-window layers keep window x the slots sharing a stream + n_ubatch cells, padded to 256 (gemma-2-9b:
    # window 4096, 8 KV heads x 256). No -np: llama-server's 4 auto slots share one unified pool.
    gemma = model_spec("gemma-2-9b")
    row = 8 * 256 * 2
    kv = rules.kv_bytes_per_layer(gemma, "f16", Request(context=32768, engine="llama.cpp"))
    assert kv[0] == 2 * (4 * 4096 + 512) * row and kv[1] == 2 * 32768 * row
    kv = rules.kv_bytes_per_layer(gemma, "f16", Request(context=8192, engine="llama.cpp"))
    assert kv[0] == kv[1] == 2 * 8192 * row  # 4 x 4096 + 512 > 8192: the window layers keep every cell
    # -np 3: a stream of -c / 3 cells per slot, padded to 256; the window layers keep window + n_ubatch per stream
    kv = rules.kv_bytes_per_layer(gemma, "f16", Request(context=10000, batch=3, engine="llama.cpp"))
    assert kv[1] == 2 * 3 * 10240 * row and kv[0] == 2 * 3 * 4608 * row


def test_llamacpp_compute_buffer_estimate():
    # no -np: 4 auto slots in one 8192-cell pool, a logits row reserved per slot
    req = Request(context=8192, engine="llama.cpp")
    scratch = 512 * (4 * 4096 + 3 * 14336) * 4 + 512 * 8192 * 2
    assert rules.compute_buffer_bytes(LLAMA_8B, req, with_logits=False) == scratch
    assert rules.compute_buffer_bytes(LLAMA_8B, req, with_logits=True) == scratch + 128256 * 4 * 4
    # -np 2: the mask spans one slot's stream; two logits rows
    req = Request(context=8192, batch=2, engine="llama.cpp")
    scratch = 512 * (4 * 4096 + 3 * 14336) * 4 + 512 * 8192 * 2
    assert rules.compute_buffer_bytes(LLAMA_8B, req, with_logits=True) == scratch + 128256 * 2 * 4
    # gemma-2: a mask per cache (window and global)
    gemma = model_spec("gemma-2-9b")
    req = Request(context=32768, engine="llama.cpp")
    mask = 512 * (32768 + 16896) * 2
    assert rules.compute_buffer_bytes(gemma, req, with_logits=False) == 512 * (4 * 3584 + 3 * 14336) * 4 + mask


def test_llamacpp_tied_output_stays_the_token_embd_in_ram():
    """A tied model's output layer on a GPU is a copy of token_embd; in RAM (-ngl 0) it is token_embd itself
    (measured: llama.cpp maps the file once, bench/results/llamacpp-serve-cpu-dev.md)."""
    spec = model_spec("qwen3-0.6b")
    model = rules.gguf_model(spec, "Q4_K_M")
    data = sum(t.nbytes for t in gguf_tensors(spec, "Q4_K_M"))
    assert model.tied_copy_bytes == model.token_embd_bytes > 0
    assert model.total_bytes == data + model.token_embd_bytes
    p = plan_for_engine(spec, CPU_SERVER,
                        Request(context=4096, engine="llama.cpp", quant=("Q4_K_M",), kv_dtype=("f16",)))
    assert p.memory.cpu.weights_bytes == data


def test_llamacpp_quality_cost_is_the_perplexity_readme_delta():
    assert rules.quality_cost_pct("Q4_K_M", "f16") == pytest.approx(100 * 0.175482 / 6.231634)
    assert rules.quality_cost_pct("Q8_0", "q4_0") == pytest.approx(100 * 0.002650 / 6.231634 + 1.0)
    # tools/perplexity/README.md, "LLaMA 3 8b Scoreboard", imatrix None: q4_0 6.700147 - 0.468514 = the f16 reference
    assert rules.quality_cost_pct("Q4_0", "f16") == pytest.approx(100 * 0.468514 / 6.231634)
    assert rules.quality_cost_pct("Q3_K_S", "f16") == pytest.approx(100 * 1.632152 / 6.231634)
    # every file type has a row but those with none published (rules.NO_PERPLEXITY_ROW): they rank by a stand-in
    assert set(rules.FILE_TYPE_DELTA_PPL) == set(GGUF_FILE_TYPES) - set(rules.NO_PERPLEXITY_ROW)
    assert all(QUALITY_STAND_IN[t] in rules.FILE_TYPE_DELTA_PPL for t in rules.NO_PERPLEXITY_ROW)


@pytest.mark.parametrize("file_type", list(GGUF_FILE_TYPES))
def test_llamacpp_plans_every_gguf_file_type(file_type):
    """`vramplan plan --engine llama.cpp --quant Q4_0` (llama-bench's default type) and --quant Q3_K_S crashed with a
    KeyError: every file type llama-quantize writes plans, exports, and sizes its file by planner/gguf.py's bytes."""
    from vramplan.planner.gguf import gguf_file_bytes

    req = Request(context=4096, engine="llama.cpp", quant=(file_type,), kv_dtype=("f16",))
    p = plan_for_engine(LLAMA_8B, RTX4090, req)
    assert p.fits and p.choice.weight_quant == file_type
    e = emit("llama.cpp", LLAMA_8B, RTX4090, p)
    assert e.details["gguf_file_bytes"] == gguf_file_bytes(LLAMA_8B, file_type)
    assert e.details["argv"][2] == f"Llama-3.1-8B-{file_type}.gguf"
    assert emit("ollama", LLAMA_8B, RTX4090, p).fits


def test_ggml_block_layouts_are_ggml_type_traits():
    """ggml/src/ggml.c type_traits: blck_size QK4_0 = QK8_0 = 32, QK_K = 256, type_size = sizeof(block_*) as the
    static_asserts of ggml/src/ggml-common.h add up (ggml_half 2 B, K_SCALE_SIZE 12)."""
    from vramplan.planner.gguf import GGML_TYPES

    traits = {"Q4_0": (32, 2 + 16), "Q4_1": (32, 4 + 16), "Q5_0": (32, 2 + 4 + 16), "Q5_1": (32, 4 + 4 + 16),
              "Q8_0": (32, 2 + 32), "Q2_K": (256, 4 + 16 + 64), "Q3_K": (256, 2 + 64 + 32 + 12),
              "Q4_K": (256, 4 + 12 + 128), "Q5_K": (256, 4 + 12 + 128 + 32), "Q6_K": (256, 2 + 16 + 192),
              "IQ4_NL": (32, 2 + 16), "IQ4_XS": (256, 2 + 2 + 4 + 128)}
    assert {k: (GGML_TYPES[k].block_elements, GGML_TYPES[k].block_bytes) for k in traits} == traits
    assert [GGML_TYPES[k].block_bytes for k in ("Q4_0", "Q3_K", "Q8_0")] == [18, 110, 34]
    # a Q4_0 row of 4096 values: 128 blocks of 18 B
    assert GGML_TYPES["Q4_0"].row_bytes(4096) == 128 * 18


def test_llamacpp_window_caches_with_many_slots():
    """Gemma-3-27B at -np 16, 8192 tokens a slot (-c 131072), checked against llama.cpp's source (not run: no
    llama-server is built here). llama_context (src/llama-context.cpp): n_ctx = GGML_PAD(131072, 256); no unified KV
    (-np given), so n_ctx_seq = GGML_PAD(131072 / 16, 256) = 8192 cells a stream, 16 streams. llama_kv_cache_iswa
    (src/llama-kv-cache-iswa.cpp): size_swa = GGML_PAD(min(8192, n_swa 1024 x 1 + n_ubatch 512), 256) = 1536 cells a
    stream. Rows: 16 KV heads x 128 x f16 = 4096 B, K and V."""
    gemma = model_spec("google/gemma-3-27b-it")
    windows = [a.window for a in gemma.attention]
    assert windows.count(1024) == 52 and windows.count(None) == 10  # every 6th of 62 layers is global
    req = Request(context=8192, batch=16, engine="llama.cpp")
    kv = rules.kv_bytes_per_layer(gemma, "f16", req)
    row = 16 * 128 * 2
    assert kv[5] == 2 * 16 * 8192 * row == 1 << 30  # a global layer: 1 GiB
    assert kv[0] == 2 * 16 * 1536 * row == 192 << 20  # a window layer: 192 MiB
    assert sum(kv) == 10 * (1 << 30) + 52 * (192 << 20)  # 19.75 GiB
    # without -np: 4 auto slots share one unified 8192-cell pool; the window cache is sized for all four:
    # GGML_PAD(min(8192, 1024 x 4 + 512), 256) = 4608 cells
    kv = rules.kv_bytes_per_layer(gemma, "f16", Request(context=8192, engine="llama.cpp"))
    assert kv[0] == 2 * 4608 * row and kv[5] == 2 * 8192 * row
    # a context checkpoint (--ctx-checkpoints) holds at most one sequence's window caches: 52 x 1536 cells x 4096 B
    assert rules.checkpoint_bytes_max(gemma, "f16", req, rules.llama_server_slots(req)) == 52 * 1536 * 2 * row
    # -ub 2048 (Ollama's num_batch for long contexts) widens every window cache: 1024 + 2048 = 3072 cells a stream
    slots = rules.Slots(count=16, unified=False, logit_rows=16, output_rows=16, n_ubatch=2048)
    assert rules.kv_bytes_per_layer(gemma, "f16", req, slots)[0] == 2 * 16 * 3072 * row


def test_llamacpp_prompt_processing_with_layers_in_ram_runs_on_the_gpu():
    """Op offload (ggml-backend.cpp, ggml-cuda.cu GGML_OP_OFFLOAD_MIN_BATCH 32): each ubatch of 32+ tokens runs on the
    GPU and copies the weights in RAM over the link (pageable: mmap); decode stays on the CPU."""
    from vramplan.planner.engines import llamacpp

    spec = model_spec("llama-3.1-70b")
    req = Request(context=8192, engine="llama.cpp", quant=("Q4_K_M",), kv_dtype=("f16",))
    p = llamacpp.plan_llamacpp(spec, RTX4090, req)
    c, t = p.choice, p.chosen.speed.terms
    assert c.gpu_layers == 42  # layers 0-37 in RAM
    model = rules.gguf_model(spec, "Q4_K_M")
    in_ram = sum(model.layers[:38])
    assert t["op_offload_bytes_per_ubatch"] == in_ram and t["op_offload_ubatches"] == 8192 // 512
    assert t["op_offload_link_s"] == pytest.approx(16 * in_ram / RTX4090.link.h2d_pageable_bytes_per_s)
    # the GPU's share is the prompt with every layer on the GPU
    resident = replace(c, gpu_layers=80, gpu_layers_per_device=(80,), offload=OffloadMode.NONE)
    fp = llamacpp.footprint(spec, RTX4090, req, model, "f16")
    from vramplan.planner.speed import estimate

    fast_hw = llamacpp.speed_hardware(RTX4090, spec, "Q4_K_M", "f16")[0]  # the constants llama.cpp's plans use
    gpu = estimate(rules.as_run(spec), fast_hw, replace(req, prefill_chunk=512), llamacpp.SPEED_SCHEME,
                   llamacpp.kv_scheme("f16"), resident, llamacpp.gguf_layer_costs(fp),
                   llamacpp.gguf_read_bytes(spec, model, 1))
    assert t["op_offload_gpu_s"] == pytest.approx(gpu.ttft_s)
    assert p.chosen.speed.ttft_s == pytest.approx(gpu.ttft_s + t["op_offload_link_s"])
    assert p.chosen.speed.ttft_s < t["ttft_s_without_op_offload"] / 10  # not CPU-bound
    assert any(w.startswith("prompt processing with weights in RAM: llama.cpp runs each ubatch of at least 32 tokens "
                            "on the GPU (op offload)") for w in p.warnings)
    # a prompt of fewer than 32 tokens stays on the CPU; so does decode
    short = llamacpp.plan_llamacpp(spec, RTX4090, replace(req, prompt_tokens=16))
    assert "op_offload_link_s" not in short.chosen.speed.terms
    assert short.chosen.speed.decode_tokens_per_s_full_context == p.chosen.speed.decode_tokens_per_s_full_context
    # 8200 tokens: 16 full ubatches and 8 tokens on the CPU
    tail = llamacpp.plan_llamacpp(spec, RTX4090, replace(req, context=8704, prompt_tokens=8200)).chosen.speed.terms
    assert tail["op_offload_ubatches"] == 16 and tail["op_offload_cpu_tail_s"] > 0
    # an MoE's experts in RAM: only the experts a ubatch reaches cross (all 128 of Qwen3-30B-A3B's at 512 tokens)
    q = llamacpp.plan_llamacpp(QWEN_MOE, RTX4090, Request(context=16384, engine="llama.cpp", quant=("BF16",),
                                                          kv_dtype=("f16",)))
    moe = rules.gguf_model(QWEN_MOE, "BF16")
    reached = 1 - (1 - 8 / 128) ** 512
    assert q.chosen.speed.terms["op_offload_bytes_per_ubatch"] == pytest.approx(
        sum(moe.experts[i] for i in q.choice.expert_layers_in_ram) * reached)


def test_llamacpp_choice_names_and_ngl_with_several_gpus():
    c = LlamaCppChoice(weight_quant="Q4_K_M", kv_dtype="q8_0", gpu_layers=40, total_layers=80,
                       offload=OffloadMode.CPU, compute_device=ComputeDevice.CUDA, embeddings_on_gpu=False,
                       gpu_layers_per_device=(20, 20))
    assert c.to_dict()["engine"] == "llama.cpp" and c.offloaded_layers == 40
    with pytest.raises(PlanError, match="unknown GGUF file type"):
        replace(c, weight_quant="bnb-nf4")
    with pytest.raises(PlanError, match="llama.cpp KV cache type"):
        replace(c, kv_dtype="fp8")
    with pytest.raises(PlanError, match="summing to gpu_layers"):
        replace(c, gpu_layers_per_device=(20, 19))
    from vramplan.planner.engines.llamacpp import llama_server_command

    p = replace(CASES["two-gpus"]()[2], request=Request(context=4096, engine="llama.cpp"))
    p = replace(p, chosen=replace(p.chosen, choice=c, weight_quant=c.weight_quant, kv_dtype=c.kv_dtype))
    argv = llama_server_command(model_spec("llama-3.1-70b"), p)
    # the output layer is the last GPU slot: 20 + 21 slots, -ngl counts it
    assert argv[argv.index("-ngl") + 1] == "41" and argv[argv.index("-ts") + 1] == "20,21"
    assert argv[argv.index("-ctk") + 1] == "q8_0"


def test_llamacpp_moe_keeps_the_fewest_experts_in_ram():
    spec = model_spec("qwen3-30b-a3b")
    p = plan_for_engine(spec, RTX4090, Request(context=16384, engine="llama.cpp", quant=("Q8_0",),
                                               kv_dtype=("f16",)))
    c = p.choice
    assert c.gpu_layers == 48 and 0 < c.expert_layers_on_cpu < 48
    from vramplan.planner.engines.llamacpp import footprint

    fp = footprint(spec, RTX4090, p.request, rules.gguf_model(spec, "Q8_0"), "f16")
    assert fp.pack(48, c.expert_layers_on_cpu) is not None and fp.pack(48, c.expert_layers_on_cpu - 1) is None


def test_llamacpp_refuses_what_llamacpp_cannot_do():
    with pytest.raises(PlanError, match="no stream mode"):
        plan_for_engine(LLAMA_8B, RTX4090, Request(context=4096, engine="llama.cpp", offload="stream"))
    with pytest.raises(PlanError, match="unknown GGUF file type"):
        Request(context=4096, engine="llama.cpp", quant=("bnb-nf4",))
    with pytest.raises(PlanError, match="unknown llama.cpp KV cache type"):
        Request(context=4096, engine="llama.cpp", kv_dtype=("fp8",))


def test_request_nodes_and_engine():
    r = Request(context=4096, engine="llama.cpp", quant=("q4_k_m", "IQ4_XS"), nodes=3)
    assert r.quant == ("Q4_K_M", "IQ4_XS") and r.nodes == 3
    assert Request.from_dict(r.to_dict()) == r
    assert Request.from_dict({"context": 4096}).nodes == 1  # plans saved before these fields
    with pytest.raises(PlanError, match="engine must be one of vramplan, llama.cpp"):
        Request(context=4096, engine="vllm")
    with pytest.raises(PlanError, match="number of nodes must be between 1 and 1024"):
        Request(context=4096, nodes=0)


# ---------------------------------------------------------------- vLLM's rules
def test_vllm_pipeline_partitions_as_get_pp_indices():
    assert pp_partitions(32, 4) == [8, 8, 8, 8]
    assert pp_partitions(22, 4) == [5, 6, 6, 5]
    assert pp_partitions(61, 4) == [15, 15, 16, 15]
    assert pp_partitions(3, 2) == [2, 1]


def test_vllm_kv_pages_blocks_and_tp_replication():
    m = VLLMModel(LLAMA_8B, RTX4090, Request(context=32768), weight_format("bf16"), "auto")
    page = 2 * 16 * 8 * 128 * 2  # K and V, block 16, 8 KV heads x 128, bf16
    assert m.layer_kv(1)[0] == LayerKV(None, page, 16)
    assert m.layer_kv(16)[0] == LayerKV(None, page // 8, 16)  # TP beyond the KV heads: one replicated head per rank
    assert m.layer_kv(1)[0].blocks(32768, 4096) == 32768 // 16
    lay = m.layout(1, 1, 1)
    assert lay.kv_per_sequence_bytes == 4 * 1024**3 and lay.null_block_bytes == 32 * page
    # (24052 MiB CUDA reports - 512 headroom - 500 context) / 24052: CUDA graphs are inside the budget since vLLM 0.21
    assert lay.gpu_memory_utilization == 0.95
    assert lay.weights_bytes == 8_030_261_248 * 2


def test_vllm_search_takes_tp_inside_a_node_then_pp_over_nodes():
    spec = model_spec("llama-3.1-70b")
    m = VLLMModel(spec, TWO_4090, Request(context=2048), weight_format("bnb-nf4-dq"), "auto")
    lay = search(m, 2)
    assert (lay.tp, lay.pp, lay.nodes) == (2, 1, 1)
    big = VLLMModel(model_spec("llama-3.1-405b"), H100_X8, Request(context=32768), weight_format("bf16"), "auto")
    lay = search(big, 8)
    assert (lay.tp, lay.pp, lay.nodes) == (8, 2, 2)


def test_vllm_weight_formats():
    assert weight_format("bf16").args == () and weight_format("fp16").args == ("--dtype", "float16")
    assert weight_format("bnb-int8").args == ("--quantization", "fp8_per_tensor")
    assert weight_format("quanto-int4").args == ("--quantization", "mxfp4")
    assert "no quanto" in weight_format("quanto-int4").note and "no bitsandbytes" in weight_format("bnb-nf4-dq").note


# ---------------------------------------------------------------- Ollama tags, transformers, dispatch
def test_ollama_tags_follow_the_library_convention():
    assert ollama_tag(LLAMA_8B, "Q4_K_M")[0] == "llama3.1:8b-text-q4_K_M"
    assert ollama_tag(LLAMA_8B, "Q4_0")[0] == "llama3.1:8b-text-q4_0"
    assert ollama_tag(LLAMA_8B, "Q3_K_S")[0] == "llama3.1:8b-text-q3_K_S"
    # what the Ollama plan tries for a planned file type: the published quants of at most its size, largest first
    # IQ4_XS and IQ4_NL have no tags: the largest quant of at most their size (Llama-3-8B: 4.14 and 4.35 GiB)
    assert published_file_types(LLAMA_8B, "IQ4_XS")[:2] == ("Q3_K_L", "Q3_K_M")
    assert published_file_types(LLAMA_8B, "IQ4_NL")[:2] == ("Q4_0", "Q3_K_L")
    assert published_file_types(LLAMA_8B, "BF16")[0] == "F16"  # the library's fp16 tags are F16 GGUFs
    assert published_file_types(model_spec("qwen3-8b"), "Q6_K") == ("Q4_K_M",)
    assert published_file_types(model_spec("qwen3-8b"), "Q2_K") == ("Q4_K_M",)  # none that small: the smallest
    tag, said = ollama_tag(model_spec("microsoft/Phi-4-mini-instruct"), "Q4_K_M")
    assert tag is None and said.startswith("no known Ollama library tag for microsoft/Phi-4-mini-instruct: FROM the "
                                           "GGUF converted from the planned checkpoint")


def test_ollama_from_names_the_planned_model_base_or_instruct():
    """A base (pretrained) checkpoint is never exported as a chat / instruct tag: it gets the library's -text tag, or
    its own GGUF when the library has none."""
    from vramplan.planner.engines.ollama import INSTRUCT_ONLY, LIBRARY

    instruct = ("-Instruct", "-it", "-chat", "Qwen/Qwen3-", "microsoft/phi-4", "deepseek-ai/DeepSeek-R1",
                "deepseek-ai/DeepSeek-V3", "Phi-3-mini-4k-instruct", "openai/gpt-oss-")
    for hub_id, (_, stem, _) in LIBRARY.items():
        post_trained = any(x in hub_id for x in instruct)
        assert post_trained or "-text" in stem, hub_id
        assert not post_trained or "-text" not in stem, hub_id
    for hub_id in INSTRUCT_ONLY:
        tag, said = ollama_tag(replace(LLAMA_8B, name=hub_id), "Q4_K_M")
        assert tag is None and "is the instruct model, a different one" in said
    text = export_text("70b-offloaded", "ollama")  # meta-llama/Llama-3.1-70B, the base model
    assert "FROM llama3.1:70b-text-q" in text and "instruct" not in body(text)


def test_transformers_quanto_cannot_split_and_says_so():
    """Plain transformers' own search with --quant quanto-int4 for a 70B on a 4090: quanto's loader refuses the
    device_map a split needs, so nothing fits, and the export says why."""
    spec, hw, p = CASES["70b-offloaded"]()
    p = replace(p, request=replace(p.request, quant=("quanto-int4",)))
    export = emit("transformers", spec, hw, p)
    assert not export.fits and "quanto loader refuses a device_map with CPU entries" in export.text
    spec8 = model_spec("llama-3.1-8b")
    small = plan_for_engine(spec8, hw, Request(context=8192, quant=("quanto-int4",)))
    assert 'QuantoConfig(\n    weights="int4",\n)' in emit("transformers", spec8, hw, small).text


def test_emit_refuses_what_the_plan_cannot_feed():
    from vramplan.planner.engines import check_emit

    with pytest.raises(PlanError, match="unknown --emit engine"):
        check_emit("tgi", "vramplan")
    for planning in ("vramplan", "llama.cpp", "ollama", "transformers"):  # every export plans the request its way
        for engine in ("vllm", "llama.cpp", "ollama", "transformers"):
            check_emit(engine, planning)


def test_llamacpp_export_caps_the_prompt_cache_at_what_the_plan_leaves_free():
    """llama-server keeps finished prompts' KV state in RAM up to --cache-ram (8192 MiB by default): where the plan
    leaves less free, the command caps it there; where it leaves nothing, it is disabled."""
    from vramplan.planner.engines.llamacpp import llama_server_command

    spec = model_spec("qwen3-0.6b")
    req = Request(context=4096, engine="llama.cpp", quant=("Q4_K_M",), kv_dtype=("f16",))
    roomy = plan_for_engine(spec, CPU_SERVER, req)
    assert "--cache-ram" not in llama_server_command(spec, roomy)
    need = roomy.memory.cpu.total_bytes
    tight = plan_for_engine(spec, CPU_SERVER, replace(req, ram_budget_bytes=need + 1000 * MiB + 123))
    argv = llama_server_command(spec, tight)
    assert argv[argv.index("--cache-ram") + 1] == "1000"
    full = plan_for_engine(spec, CPU_SERVER, replace(req, ram_budget_bytes=need))
    assert llama_server_command(spec, full)[-2:] == ["--cache-ram", "0"]
    assert "disabled (--cache-ram 0)" in emit("llama.cpp", spec, CPU_SERVER, full).text


def test_llamacpp_drops_the_windows_llamacpp_drops():
    """llama.cpp keeps sliding windows only for the architectures that set one (gemma2, gpt-oss, ...): phi3's window
    is dropped ("Phi SWA is currently disabled", src/models/phi3.cpp) and its layers cache the whole context."""
    phi3 = model_spec("microsoft/Phi-3-mini-4k-instruct")
    assert phi3.attention[0].window == 2047 and rules.window(phi3, phi3.attention[0]) is None
    req = Request(context=4096, batch=2, engine="llama.cpp")
    assert rules.kv_bytes_per_layer(phi3, "f16", req) == [2 * 2 * 4096 * 3072 * 2] * 32  # 2 slots x 4096 cells
    assert rules.as_run(phi3).attention[0].window is None
    gemma = model_spec("gemma-2-9b")
    assert rules.window(gemma, gemma.attention[0]) == 4096 and rules.as_run(gemma) is gemma


# ---------------------------------------------------------------- Ollama: llama-server as Ollama starts it
QWEN_MOE = model_spec("Qwen/Qwen3-30B-A3B")


def test_ollama_modelfile_leaves_the_placement_to_llamacpp_fit():
    """Qwen3-30B-A3B bf16 at 32k on a 4090: the Modelfile of Ollama's earlier estimator pinned num_gpu 19 (30 whole
    layers on the CPU); with num_gpu set Ollama passes -ngl and llama.cpp's --fit aborts. Now no num_gpu, and the plan
    is llama.cpp's for Ollama's launch: every layer on the GPU, the experts of 33 layers in RAM, as --emit llama.cpp."""
    spec, hw, p = hand_plan("Qwen/Qwen3-30B-A3B", RTX4090, Request(context=32768, quant=("bf16",)), weight_quant="bf16",
                            kv_dtype="bf16", gpu_layers=48, offload=OffloadMode.NONE, embeddings_on_gpu=True,
                            moe_layers=48, **GPU)
    o, ll = emit("ollama", spec, hw, p), emit("llama.cpp", spec, hw, p)
    assert "num_gpu" not in body(o.text) and body(o.text).splitlines()[1:] == ["FROM qwen3:30b-a3b-fp16",
                                                                               "PARAMETER num_ctx 32768"]
    assert o.details["fit_ngl"] == ll.details["ngl"] == 49
    assert o.details["fit_expert_layers_on_cpu"] == ll.details["expert_layers_on_cpu"] == 33
    assert o.details["llama_server_argv"] == ["llama-server", "--model", "<qwen3:30b-a3b-fp16 blob>", "-c", "32768",
                                              "-np", "1", "--flash-attn", "auto", "-b", "512", "-ub", "512"]
    assert o.notes[0].startswith("Ollama v0.32.15: llama-server (llama.cpp b10488)")
    assert o.details["ollama_version"] == "v0.32.15" and o.constants["ollama_version"].value == "v0.32.15"


def test_ollama_plan_is_llamacpp_under_ollamas_launch():
    """-np numParallel: one stream of num_ctx cells per slot and one logits row per slot (llama-server's graph), not a
    unified pool with 512 logits rows; -c num_ctx x numParallel; -ub num_batch."""
    from vramplan.planner.engines import llamacpp
    from vramplan.planner.engines.ollama import OLLAMA_SERVE_RAM_ASSUMED, ollama_launch, plan_ollama

    req = Request(context=8192, batch=4, engine="llama.cpp", quant=("Q4_K_M",), kv_dtype=("f16",))
    launch = ollama_launch(LLAMA_8B, RTX4090, req, "Q4_K_M")
    assert (launch.num_ctx, launch.num_parallel, launch.num_batch) == (8192, 4, 1024)  # 32768 tokens > 4096
    assert launch.argv("m.gguf", "q8_0") == ["llama-server", "--model", "m.gguf", "-c", "32768", "-np", "4",
                                             "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--flash-attn",
                                             "auto", "-b", "1024", "-ub", "1024"]
    server = launch.server(True)
    assert server.slots == rules.Slots(count=4, unified=False, logit_rows=4, output_rows=4, n_ubatch=1024)
    assert server.margin_bytes == rules.FIT_TARGET_MARGIN_BYTES
    # llama-server, ollama serve, and the prompt cache Ollama lets llama-server grow to its --cache-ram default
    assert server.base_ram_bytes == (rules.PROCESS_BASE_RAM_GPU_ASSUMED + OLLAMA_SERVE_RAM_ASSUMED
                                     + rules.PROMPT_CACHE_DEFAULT_MIB * MiB)
    # the KV cache: 4 streams of 8192 cells, as llama-server -c 32768 -np 4
    assert rules.kv_bytes_per_layer(LLAMA_8B, "f16", req, server.slots) == [2 * 4 * 8192 * 2048] * 32
    # the compute buffer: a 1024-token ubatch, a mask over one stream, 4 logits rows
    scratch = 1024 * (4 * 4096 + 3 * 14336) * 4 + 1024 * 8192 * 2
    assert rules.compute_buffer_bytes(LLAMA_8B, req, with_logits=True, slots=server.slots) == scratch + 128256 * 4 * 4
    q = plan_ollama(LLAMA_8B, RTX4090, req)
    same = llamacpp.plan_llamacpp(LLAMA_8B, RTX4090, req, server)
    assert q.chosen.to_dict() == same.chosen.to_dict() and q.chosen.choice.gpu_layers == 32
    assert q.request.engine == "ollama" and "prompt_cache_bytes" in q.constants


@pytest.mark.parametrize("context, predicted_gib, available_gib, want", [
    # server/sched_test.go TestAutomaticGenerationBatch @ v0.32.15, the cases with flash attention not disabled
    (4096, 0, 0, 512),  # small context keeps default
    (32768, 0, 0, 1024),  # medium context uses 1024 with unknown memory
    (131072, 8, 14, 2048),  # large context uses 2048 with headroom
    (131072, 9, 14, 1024),  # large context steps down to 1024 without 2048 headroom
    (131072, 8, 11, 1024),  # large context steps down to 1024 for headroom
    (32768, 8500 / 1024, 11, 512),  # medium context steps down to 512 for headroom
])
def test_ollama_automatic_num_batch_is_ollamas(context, predicted_gib, available_gib, want):
    from vramplan.planner.engines.ollama import auto_num_batch

    assert auto_num_batch(context, int(predicted_gib * 2**30), int(available_gib * 2**30)) == want


def test_ollama_predicted_vram_and_gpu_choice():
    """llm.PredictServerVRAM: the GGUF's size + an f16 KV of 2 x layers x the fewest KV heads x hidden / the most heads
    x context x 2; Ollama runs a model on one GPU of several when 80 % of its free memory holds that."""
    from vramplan.planner.engines.ollama import ollama_launch, predicted_server_vram
    from vramplan.planner.gguf import gguf_file_bytes

    size = gguf_file_bytes(LLAMA_8B, "Q4_K_M")
    assert predicted_server_vram(LLAMA_8B, size, 8192) == size + 2 * 32 * 8 * (4096 // 32) * 8192 * 2
    req = Request(context=8192, engine="llama.cpp")
    one = ollama_launch(LLAMA_8B, TWO_4090, req, "Q4_K_M")
    assert one.single_gpu_of == 2 and len(one.hardware.devices) == 1
    assert one.available_bytes == RTX4090.gpus[0].memory_bytes - RTX4090.overheads.cuda_context_bytes
    both = ollama_launch(model_spec("llama-3.1-70b"), TWO_4090, req, "Q4_K_M")
    assert both.single_gpu_of == 0 and len(both.hardware.devices) == 2


# Flag names and accepted values of the versions the exports follow: llama.cpp common/arg.cpp @ 0c1e57098 (the options
# and, for -fa and -ctk/-ctv, what they accept: "[on|off|auto]", kv_cache_types), Ollama api/types.go Options (the
# Modelfile's PARAMETER names) and envconfig/config.go @ v0.32.15.
LLAMA_SERVER_FLAGS = {"-m": None, "--model": None, "-c": int, "-ngl": int, "-ts": str, "--n-cpu-moe": int,
                      "-fa": ("on", "off", "auto"), "--flash-attn": ("on", "off", "auto"),
                      "-ctk": ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"),
                      "-ctv": ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"),
                      "--cache-type-k": ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"),
                      "--cache-type-v": ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"),
                      "-np": int, "--cache-ram": int, "-b": int, "-ub": int, "--split-mode": ("none", "layer", "row"),
                      "--main-gpu": int}
OLLAMA_PARAMETERS = ("num_ctx", "num_batch", "num_gpu", "num_thread", "num_keep", "num_predict")
OLLAMA_ENV = ("OLLAMA_KV_CACHE_TYPE", "OLLAMA_NUM_PARALLEL", "OLLAMA_FLASH_ATTENTION", "OLLAMA_SCHED_SPREAD")


def _check_flags(argv: list[str]) -> None:
    i = 1
    while i < len(argv):
        flag, value = argv[i], argv[i + 1]
        accepted = LLAMA_SERVER_FLAGS[flag]
        if accepted is int:
            assert int(value) >= 0, (flag, value)
        elif isinstance(accepted, tuple):
            assert value in accepted, (flag, value)
        i += 2


@pytest.mark.parametrize("case", ["dense-8b-24gb", "70b-offloaded", "moe-experts-in-ram", "two-gpus", "cpu-only"])
def test_exported_flags_are_that_versions(case):
    spec, hw, p = CASES[case]()
    _check_flags(emit("llama.cpp", spec, hw, p).details["argv"])
    o = emit("ollama", spec, hw, p)
    _check_flags(o.details["llama_server_argv"])
    for line in body(o.text).splitlines():
        if line.startswith("PARAMETER "):
            assert line.split()[1] in OLLAMA_PARAMETERS
    for note in o.notes:
        if note.startswith("server environment"):
            names = [w.split("=")[0] for w in note.split(": ", 1)[1].split() if "=" in w]
            assert names and set(names) <= set(OLLAMA_ENV)
            assert all(w.split("=")[1] in LLAMA_SERVER_FLAGS["-ctk"] for w in note.split() if
                       w.startswith("OLLAMA_KV_CACHE_TYPE="))
