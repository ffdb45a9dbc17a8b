"""Engine exports as string contracts, and each engine's own memory rules.

The exports read only a plan's choice and request, so the golden cases build their vramplan plans by
hand (a Choice per case): they test the exporters, not vramplan's search, which changes on its own.
The llama.cpp and Ollama exports re-plan by llama.cpp's rules (planner/gguf.py bytes); the vLLM export
plans vLLM's layout. Every expected string below is exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.choice import Choice, ComputeDevice, OffloadMode
from planner.engines import emit, plan_for_engine
from planner.engines import llamacpp_rules as rules
from planner.engines.llamacpp import LlamaCppChoice
from planner.engines.ollama import ollama_tag
from planner.engines.vllm import VLLMModel, pp_partitions, search, weight_format
from planner.errors import PlanError
from planner.gguf import gguf_tensors
from planner.memory import CPUMemory, MemoryBreakdown
from planner.plan import Candidate, Plan, hardware_ref, model_ref
from planner.profiles import resolve_profile
from planner.request import Request
from planner.sources import model_spec
from planner.speed import SpeedEstimate
from planner.units import MiB

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
  --gpu-memory-utilization 0.91 \
  --kv-cache-dtype fp8""",
        ['vLLM per GPU (1 TP x 1 PP on 1 node(s)): 0.91 x 23.99 GiB = weights 14.96 GiB + profile-run peak 506.50 MiB '
         '+ non-torch 163.84 MiB + KV pool 6.22 GiB; the rest holds the CUDA context 500.00 MiB, CUDA graphs 1.00 GiB '
         'and your headroom 512.00 MiB',
         'the KV pool is cut in 16-token blocks; 2.00 GiB hold 1 sequence(s) of 32768 tokens; the pool holds about 3',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures above '
         'are estimates (see the assumptions)']),
    ('dense-8b-24gb', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-8B-BF16.gguf \
  -c 32768 \
  -ngl 33 \
  -fa on \
  -ctk q8_0 \
  -ctv q8_0""",
        ["vramplan's plan: bf16 + fp8 KV, 32/32 layers on the GPU; llama.cpp runs GGUF: closest file type BF16, cache "
         "q8_0, placed by llama.cpp's own rules",
         "GGUF BF16: Llama-3.1-8B-BF16.gguf, 16,068,898,016 B (14.97 GiB; planner/gguf.py: llama-quantize's tensor "
         "types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-8B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py, then llama-quantize <f16.gguf> '
         'Llama-3.1-8B-BF16.gguf BF16',
         'all 32 layers and the output layer on the GPU (-ngl 33): GPU 0: 16.25 GiB of 22.50 GiB usable (weights 13.98 '
         'GiB + KV 2.12 GiB + compute 149.96 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin 1.00 GiB); '
         'RAM 1.23 GiB of 64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the plan '
         'sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in what "
         "the plan leaves free",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 "
         "records) of llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group F16"]),
    ('dense-8b-24gb', 'ollama'): (
        r"""# ollama pull llama3.1:8b-text-fp16
FROM llama3.1:8b-text-fp16
PARAMETER num_ctx 32768
PARAMETER num_gpu 33""",
        ["vramplan's plan: bf16 + fp8 KV, 32/32 layers on the GPU; llama.cpp runs GGUF: closest file type BF16, cache "
         "q8_0, placed by llama.cpp's own rules",
         "Ollama quant fp16; tag by ollama.com/library's naming convention: check it is published",
         "num_gpu 33 of 33 layers (the output layer counts as one): GGUF BF16 bytes by planner/gguf.py, kept free per "
         "GPU: Ollama's minimum 457 MiB + OLLAMA_GPU_OVERHEAD 0 (llama.cpp itself keeps its --fit margin of 1 GiB)",
         'server environment (not a Modelfile setting): OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE=q8_0 ollama '
         'serve',
         'ollama pull llama3.1:8b-text-fp16']),
    ('dense-8b-24gb', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM

device_map = {"": 0}
model = AutoModelForCausalLM.from_pretrained(
    "meta-llama/Llama-3.1-8B",
    device_map=device_map,
    dtype=torch.bfloat16,
)

# the plan's fp8 KV cache: generate(..., cache=cache) (past_key_values=cache before transformers 5.24)
from transformers.cache_utils import QuantizedCache
cache = QuantizedCache(backend="fp8", config=model.config)""",
        ["the plan's fp8 KV cache: generate(..., cache=cache) (past_key_values=cache before transformers 5.24)"]),
    ('70b-offloaded', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-70B \
  --max-model-len 8192 \
  --gpu-memory-utilization 0.91 \
  --kv-cache-dtype auto \
  --quantization bitsandbytes \
  --cpu-offload-gb 19""",
        ['vLLM fits 1 node(s) only with 19 GiB of weights per GPU in RAM (--cpu-offload-gb), copied to the GPU on '
         'every forward pass; without offload it needs 2 nodes of rtx-4090',
         'vLLM per GPU (1 TP x 1 PP on 1 node(s)): 0.91 x 23.99 GiB = weights 17.80 GiB + profile-run peak 754.50 MiB '
         '+ non-torch 163.84 MiB + KV pool 3.13 GiB; the rest holds the CUDA context 500.00 MiB, CUDA graphs 1.00 GiB '
         'and your headroom 512.00 MiB',
         'the KV pool is cut in 16-token blocks; 2.50 GiB hold 1 sequence(s) of 8192 tokens; the pool holds about 1',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures above '
         'are estimates (see the assumptions)',
         "vLLM's in-flight bitsandbytes is NF4 with double quantization whatever the plan's variant"]),
    ('70b-offloaded', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-70B-Q4_K_M.gguf \
  -c 8192 \
  -ngl 43 \
  -fa on""",
        ["vramplan's plan: bnb-nf4 + bf16 KV, 40/80 layers on the GPU; llama.cpp runs GGUF: closest file type Q4_K_M, "
         "cache f16, placed by llama.cpp's own rules",
         "GGUF Q4_K_M: Llama-3.1-70B-Q4_K_M.gguf, 42,520,400,320 B (39.60 GiB; planner/gguf.py: llama-quantize's "
         "tensor types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-70B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py, then llama-quantize <f16.gguf> '
         'Llama-3.1-70B-Q4_K_M.gguf Q4_K_M',
         'layers 38-79 and the output layer on the GPU, 0-37 computed by the CPU (-ngl 43): GPU 0: 22.43 GiB of 22.50 '
         'GiB usable (weights 20.88 GiB + KV 1.31 GiB + compute 241.96 MiB) (usable = memory - CUDA context 500.00 MiB '
         '- --fit margin 1.00 GiB); RAM 20.39 GiB of 64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the plan '
         'sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in what "
         "the plan leaves free",
         'llama.cpp computes the 38 layers left in RAM on the CPU (it does not stream them to the GPU)',
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 "
         "records) of llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q4"]),
    ('70b-offloaded', 'ollama'): (
        r"""# ollama pull llama3.1:70b-text-q4_K_M
FROM llama3.1:70b-text-q4_K_M
PARAMETER num_ctx 8192
PARAMETER num_gpu 43""",
        ["vramplan's plan: bnb-nf4 + bf16 KV, 40/80 layers on the GPU; llama.cpp runs GGUF: closest file type Q4_K_M, "
         "cache f16, placed by llama.cpp's own rules",
         "Ollama quant q4_K_M; tag by ollama.com/library's naming convention: check it is published",
         "num_gpu 43 of 81 layers (the output layer counts as one): GGUF Q4_K_M bytes by planner/gguf.py, kept free "
         "per GPU: Ollama's minimum 457 MiB + OLLAMA_GPU_OVERHEAD 0 (llama.cpp itself keeps its --fit margin of 1 GiB)",
         'ollama pull llama3.1:70b-text-q4_K_M']),
    ('70b-offloaded', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

quantization_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=False,
    bnb_4bit_compute_dtype=torch.bfloat16,
    llm_int8_enable_fp32_cpu_offload=True,
)
device_map = {"": 0}  # later, longer entries override earlier ones
device_map |= {f"model.layers.{i}": "cpu" for i in range(40, 80)}
device_map["model.embed_tokens"] = "cpu"
model = AutoModelForCausalLM.from_pretrained(
    "meta-llama/Llama-3.1-70B",
    quantization_config=quantization_config,
    device_map=device_map,
    dtype=torch.bfloat16,
)""",
        ["transformers' bitsandbytes offload keeps the CPU-mapped layers unquantized (bf16) in RAM, unlike vramplan's "
         "runtime, which keeps all 80 layers quantized",
         "the 40 CPU-mapped layers are copied to the GPU on every forward by accelerate (no prefetch); vramplan's "
         "runtime has them streamed to the GPU with prefetch"]),
    ('moe-experts-in-ram', 'vllm'): (
        r"""vllm serve Qwen/Qwen3-30B-A3B \
  --max-model-len 16384 \
  --gpu-memory-utilization 0.91 \
  --kv-cache-dtype auto \
  --pipeline-parallel-size 3 \
  --distributed-executor-backend ray""",
        ['needs 3 nodes of rtx-4090 (--nodes 1 given): run it on 3',
         'start a Ray cluster over the 3 nodes first (ray start --head on one, ray start --address=<head>:6379 on the '
         'others); TP inside each node, PP across nodes',
         'vLLM per GPU (1 TP x 3 PP on 3 node(s)): 0.91 x 23.99 GiB = weights 19.15 GiB + profile-run peak 420.75 MiB '
         '+ non-torch 1.00 GiB + KV pool 1.27 GiB; the rest holds the CUDA context 500.00 MiB, CUDA graphs 1.00 GiB '
         'and your headroom 512.00 MiB',
         'the KV pool is cut in 16-token blocks; 512.50 MiB hold 1 sequence(s) of 16384 tokens; the pool holds about 2',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures above '
         'are estimates (see the assumptions)',
         'vLLM has no expert offload: every GPU holds its TP share of all experts']),
    ('moe-experts-in-ram', 'llama.cpp'): (
        r"""llama-server \
  -m Qwen3-30B-A3B-BF16.gguf \
  -c 16384 \
  -ngl 49 \
  --n-cpu-moe 32 \
  -fa on""",
        ["vramplan's plan: bf16 + bf16 KV, 48/48 layers on the GPU; llama.cpp runs GGUF: closest file type BF16, cache "
         "f16, placed by llama.cpp's own rules",
         "GGUF BF16: Qwen3-30B-A3B-BF16.gguf, 61,095,806,112 B (56.90 GiB; planner/gguf.py: llama-quantize's tensor "
         "types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Qwen3-30B-A3B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py, then llama-quantize <f16.gguf> '
         'Qwen3-30B-A3B-BF16.gguf BF16',
         'all 48 layers and the output layer on the GPU (-ngl 49), experts of the first 32 of 48 MoE layers (layers '
         '0-31) in RAM (--n-cpu-moe 32): GPU 0: 21.88 GiB of 22.50 GiB usable (weights 20.31 GiB + KV 1.50 GiB + '
         'compute 70.32 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin 1.00 GiB); RAM 36.90 GiB of '
         '64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the plan '
         'sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in what "
         "the plan leaves free",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 "
         "records) of llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group F16"]),
    ('moe-experts-in-ram', 'ollama'): (
        r"""# ollama pull qwen3:30b-a3b-fp16
FROM qwen3:30b-a3b-fp16
PARAMETER num_ctx 16384
PARAMETER num_gpu 19""",
        ["vramplan's plan: bf16 + bf16 KV, 48/48 layers on the GPU; llama.cpp runs GGUF: closest file type BF16, cache "
         "f16, placed by llama.cpp's own rules",
         "Ollama quant fp16; tag by ollama.com/library's naming convention: check it is published",
         "num_gpu 19 of 49 layers (the output layer counts as one): GGUF BF16 bytes by planner/gguf.py, kept free per "
         "GPU: Ollama's minimum 457 MiB + OLLAMA_GPU_OVERHEAD 0 (llama.cpp itself keeps its --fit margin of 1 GiB)",
         'llama.cpp would keep the experts of 32 layers in RAM (--n-cpu-moe); a Modelfile has no such setting: Ollama '
         'offloads whole layers instead',
         'ollama pull qwen3:30b-a3b-fp16']),
    ('moe-experts-in-ram', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM

device_map = {"": 0}  # later, longer entries override earlier ones
device_map |= {f"model.layers.{i}.mlp.experts": "cpu" for i in range(48)}  # routed experts in RAM
model = AutoModelForCausalLM.from_pretrained(
    "Qwen/Qwen3-30B-A3B",
    device_map=device_map,
    dtype=torch.bfloat16,
)""",
        ["the experts of 48 layers are mapped to the CPU: accelerate copies them to the GPU on every forward, where "
         "vramplan's runtime computes them on the CPU"]),
    ('two-gpus', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-70B \
  --max-model-len 8192 \
  --gpu-memory-utilization 0.91 \
  --kv-cache-dtype auto \
  --quantization bitsandbytes \
  --tensor-parallel-size 2""",
        ['vLLM per GPU (2 TP x 1 PP on 1 node(s)): 0.91 x 23.99 GiB = weights 18.40 GiB + profile-run peak 566.50 MiB '
         '+ non-torch 1.00 GiB + KV pool 1.87 GiB; the rest holds the CUDA context 500.00 MiB, CUDA graphs 1.00 GiB '
         'and your headroom 512.00 MiB',
         'the KV pool is cut in 16-token blocks; 1.25 GiB hold 1 sequence(s) of 8192 tokens; the pool holds about 1',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures above '
         'are estimates (see the assumptions)']),
    ('two-gpus', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-70B-Q4_K_M.gguf \
  -c 8192 \
  -ngl 81 \
  -ts 43,38 \
  -fa on""",
        ["vramplan's plan: bnb-nf4-dq + bf16 KV, 80/80 layers on the GPU; llama.cpp runs GGUF: closest file type "
         "Q4_K_M, cache f16, placed by llama.cpp's own rules",
         "GGUF Q4_K_M: Llama-3.1-70B-Q4_K_M.gguf, 42,520,400,320 B (39.60 GiB; planner/gguf.py: llama-quantize's "
         "tensor types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-70B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py, then llama-quantize <f16.gguf> '
         'Llama-3.1-70B-Q4_K_M.gguf Q4_K_M',
         'all 80 layers and the output layer on the GPU (-ngl 81): GPU 0: 22.10 GiB of 22.50 GiB usable (weights 20.53 '
         'GiB + KV 1.34 GiB + compute 240.00 MiB); GPU 1: 19.91 GiB of 22.50 GiB usable (weights 18.52 GiB + KV 1.16 '
         'GiB + compute 241.96 MiB) (usable = memory - CUDA context 500.00 MiB - --fit margin 1.00 GiB); RAM 821.58 '
         'MiB of 64.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the plan '
         'sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in what "
         "the plan leaves free",
         "llama.cpp speed on the GPU is predicted with constants fitted to public measurements (16 "
         "records) of llama.cpp's CUDA backend on GDDR GPUs, GGUF file-type group Q4"]),
    ('two-gpus', 'ollama'): (
        r"""# ollama pull llama3.1:70b-text-q4_K_M
FROM llama3.1:70b-text-q4_K_M
PARAMETER num_ctx 8192
PARAMETER num_gpu 81""",
        ["vramplan's plan: bnb-nf4-dq + bf16 KV, 80/80 layers on the GPU; llama.cpp runs GGUF: closest file type "
         "Q4_K_M, cache f16, placed by llama.cpp's own rules",
         "Ollama quant q4_K_M; tag by ollama.com/library's naming convention: check it is published",
         "num_gpu 81 of 81 layers (the output layer counts as one): GGUF Q4_K_M bytes by planner/gguf.py, kept free "
         "per GPU: Ollama's minimum 457 MiB + OLLAMA_GPU_OVERHEAD 0 (llama.cpp itself keeps its --fit margin of 1 GiB)",
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
        []),
    ('cpu-only', 'vllm'): (
        "",
        ["vLLM: hardware 'cpu-epyc-server' has no GPU; vramplan plans vLLM on CUDA GPUs only (vLLM's CPU and Apple "
         "backends are not planned)",
         'no vllm serve command']),
    ('cpu-only', 'llama.cpp'): (
        r"""llama-server \
  -m Llama-3.1-8B-BF16.gguf \
  -c 8192 \
  -ngl 0 \
  -fa on""",
        ["vramplan's plan: bf16 + bf16 KV, 0/32 layers on the GPU; llama.cpp runs GGUF: closest file type BF16, cache "
         "f16, placed by llama.cpp's own rules",
         "GGUF BF16: Llama-3.1-8B-BF16.gguf, 16,068,898,016 B (14.97 GiB; planner/gguf.py: llama-quantize's tensor "
         "types)",
         'where to get it: GGUF repositories are conventionally named like bartowski/Llama-3.1-8B-GGUF (a naming '
         'convention, not a promise that it exists), or convert: convert_hf_to_gguf.py, then llama-quantize <f16.gguf> '
         'Llama-3.1-8B-BF16.gguf BF16',
         'all 32 layers computed by the CPU (no GPU): RAM 16.15 GiB of 768.00 GiB',
         '-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); the plan '
         'sized the cache with it',
         "llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default 8192 MiB: that fits in what "
         "the plan leaves free",
         "llama.cpp speed is predicted with vramplan's roofline; uncalibrated for llama.cpp"]),
    ('cpu-only', 'ollama'): (
        r"""# ollama pull llama3.1:8b-text-fp16
FROM llama3.1:8b-text-fp16
PARAMETER num_ctx 8192
PARAMETER num_gpu 0""",
        ["vramplan's plan: bf16 + bf16 KV, 0/32 layers on the GPU; llama.cpp runs GGUF: closest file type BF16, cache "
         "f16, placed by llama.cpp's own rules",
         "Ollama quant fp16; tag by ollama.com/library's naming convention: check it is published",
         "num_gpu 0 of 33 layers (the output layer counts as one): GGUF BF16 bytes by planner/gguf.py, kept free per "
         "GPU: Ollama's minimum 457 MiB + OLLAMA_GPU_OVERHEAD 0 (llama.cpp itself keeps its --fit margin of 1 GiB)",
         'ollama pull llama3.1:8b-text-fp16']),
    ('cpu-only', 'transformers'): (
        r"""import torch
from transformers import AutoModelForCausalLM

device_map = "cpu"
model = AutoModelForCausalLM.from_pretrained(
    "meta-llama/Llama-3.1-8B",
    device_map=device_map,
    dtype=torch.bfloat16,
)""",
        []),
    ('405b-two-nodes', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-405B \
  --max-model-len 32768 \
  --gpu-memory-utilization 0.97 \
  --kv-cache-dtype auto \
  --tensor-parallel-size 8 \
  --pipeline-parallel-size 2 \
  --distributed-executor-backend ray""",
        ['start a Ray cluster over the 2 nodes first (ray start --head on one, ray start --address=<head>:6379 on the '
         'others); TP inside each node, PP across nodes',
         'vLLM per GPU (8 TP x 2 PP on 2 node(s)): 0.97 x 79.65 GiB = weights 47.25 GiB + profile-run peak 2.32 GiB + '
         'non-torch 1.00 GiB + KV pool 26.69 GiB; the rest holds the CUDA context 500.00 MiB, CUDA graphs 1.00 GiB and '
         'your headroom 512.00 MiB',
         'the KV pool is cut in 16-token blocks; 1008.49 MiB hold 1 sequence(s) of 32768 tokens; the pool holds about '
         '27',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures above '
         'are estimates (see the assumptions)']),
    ('405b-one-node', 'vllm'): (
        r"""vllm serve meta-llama/Llama-3.1-405B \
  --max-model-len 32768 \
  --gpu-memory-utilization 0.97 \
  --kv-cache-dtype auto \
  --tensor-parallel-size 8 \
  --pipeline-parallel-size 2 \
  --distributed-executor-backend ray""",
        ['needs 2 nodes of h100-sxm-x8 (--nodes 1 given): run it on 2',
         'start a Ray cluster over the 2 nodes first (ray start --head on one, ray start --address=<head>:6379 on the '
         'others); TP inside each node, PP across nodes',
         'vLLM per GPU (8 TP x 2 PP on 2 node(s)): 0.97 x 79.65 GiB = weights 47.25 GiB + profile-run peak 2.32 GiB + '
         'non-torch 1.00 GiB + KV pool 26.69 GiB; the rest holds the CUDA context 500.00 MiB, CUDA graphs 1.00 GiB and '
         'your headroom 512.00 MiB',
         'the KV pool is cut in 16-token blocks; 1008.49 MiB hold 1 sequence(s) of 32768 tokens; the pool holds about '
         '27',
         'vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures above '
         'are estimates (see the assumptions)']),
}


FITS = {"moe-experts-in-ram": {"vllm": False}, "cpu-only": {"vllm": False}, "405b-one-node": {"vllm": False}}


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
    from planner.engines.common import assumption_notes

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
    from planner.engines.llamacpp import llama_server_command

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
    from planner.engines.llamacpp import footprint

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
    assert m._page(1, 0) == 2 * 16 * 8 * 128 * 2  # K and V, block 16, 8 KV heads x 128, bf16
    assert m._page(16, 0) == 2 * 16 * 1 * 128 * 2  # TP beyond the KV heads: one replicated head per rank
    assert m._blocks_per_sequence(0) == 32768 // 16
    lay = m.layout(1, 1, 1)
    assert lay.kv_per_sequence_bytes == 4 * 1024**3 and lay.null_block_bytes == 32 * m._page(1, 0)
    assert lay.gpu_memory_utilization == 0.91  # (24564 MiB - 512 headroom - 500 context - 1024 graphs) / 24564
    assert lay.weights_bytes == 8_030_261_248 * 2


def test_vllm_search_takes_tp_inside_a_node_then_pp_over_nodes():
    spec = model_spec("llama-3.1-70b")
    m = VLLMModel(spec, TWO_4090, Request(context=8192), weight_format("bnb-nf4-dq"), "auto")
    lay = search(m, 2)
    assert (lay.tp, lay.pp, lay.nodes) == (2, 1, 1)
    big = VLLMModel(model_spec("llama-3.1-405b"), H100_X8, Request(context=32768), weight_format("bf16"), "auto")
    lay = search(big, 8)
    assert (lay.tp, lay.pp, lay.nodes) == (8, 2, 2)


def test_vllm_weight_formats():
    assert weight_format("bf16").args == () and weight_format("fp16").args == ("--dtype", "float16")
    assert weight_format("bnb-int8").args == ("--quantization", "fp8")
    assert weight_format("quanto-int4").args == ("--quantization", "bitsandbytes")
    assert "no quanto" in weight_format("quanto-int4").note and weight_format("bnb-nf4-dq").note == ""


# ---------------------------------------------------------------- Ollama tags, transformers, dispatch
def test_ollama_tags_follow_the_library_convention():
    assert ollama_tag(LLAMA_8B, "Q4_K_M")[0] == "llama3.1:8b-text-q4_K_M"
    assert ollama_tag(LLAMA_8B, "IQ4_XS")[0] == "llama3.1:8b-text-q4_K_S"
    tag, said = ollama_tag(model_spec("qwen3-8b"), "Q6_K")
    assert tag == "qwen3:8b-q4_K_M" and "closest published to Q6_K: q6_K is not" in said
    tag, said = ollama_tag(model_spec("microsoft/Phi-4-mini-instruct"), "Q4_K_M")
    assert tag is None and said.startswith("no known Ollama library tag for microsoft/Phi-4-mini-instruct: FROM the "
                                           "GGUF converted from the planned checkpoint")


def test_transformers_quanto_cannot_split_and_says_so():
    spec, hw, p = CASES["70b-offloaded"]()
    p = replace(p, chosen=replace(p.chosen, choice=replace(p.choice, weight_quant="quanto-int4"),
                                  weight_quant="quanto-int4"))
    export = emit("transformers", spec, hw, p)
    assert not export.fits and "quanto loader refuses a device_map with CPU entries" in export.notes[0]
    assert 'QuantoConfig(\n    weights="int4",\n)' in export.text


def test_emit_refuses_what_the_plan_cannot_feed():
    from planner.engines import check_emit

    with pytest.raises(PlanError, match="--emit vllm needs vramplan's plan"):
        check_emit("vllm", "llama.cpp")
    with pytest.raises(PlanError, match="unknown --emit engine"):
        check_emit("tgi", "vramplan")
    check_emit("ollama", "llama.cpp")


def test_llamacpp_export_caps_the_prompt_cache_at_what_the_plan_leaves_free():
    """llama-server keeps finished prompts' KV state in RAM up to --cache-ram (8192 MiB by default): where the plan
    leaves less free, the command caps it there; where it leaves nothing, it is disabled."""
    from planner.engines.llamacpp import llama_server_command

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


def test_ollama_keeps_its_runner_rules():
    """Ollama's runner is not llama-server: a unified pool of its parallel sequences, logits rows for a whole batch in
    the graph, one output row per sequence, its own assumed process RAM."""
    from planner.engines import llamacpp
    from planner.engines.ollama import RUNNER_BASE_RAM_ASSUMED, runner_slots

    req = Request(context=8192, engine="llama.cpp", quant=("Q4_K_M",), kv_dtype=("f16",))
    model = rules.gguf_model(LLAMA_8B, "Q4_K_M")
    fp = llamacpp.footprint(LLAMA_8B, RTX4090, req, model, "f16", slots=runner_slots(req),
                            base_ram_bytes=RUNNER_BASE_RAM_ASSUMED)
    p, _ = fp.place(expert_offload=False)
    assert p.gpu_layers == 32
    # RAM: the token embedding, one output row of logits, the runner
    assert fp.host_total(p) == model.token_embd_bytes + 128256 * 4 + RUNNER_BASE_RAM_ASSUMED
    assert fp.with_logits - fp.scratch == 128256 * 512 * 4
