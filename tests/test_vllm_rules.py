"""vLLM 0.33.0's rules as the vLLM export applies them (planner/engines/vllm_rules.py): worked numbers from vLLM's own
formulas, and the flags the export writes checked against what `vllm serve` 0.33.0 accepts.

The worked KV numbers were also produced by vLLM 0.33.0's own planning functions (tests/test_vllm_reference.py runs
them where vllm is installed)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from vramplan.planner.choice import Choice, ComputeDevice, OffloadMode
from vramplan.planner.engines import emit
from vramplan.planner.engines import vllm_rules as rules
from vramplan.planner.engines.vllm import (CUDA_HIDDEN_BYTES_ASSUMED, CUDAGRAPH_BYTES_ASSUMED, NCCL_BYTES_ASSUMED,
                                  NON_TORCH_DISTRIBUTED_BYTES_ASSUMED)
from vramplan.planner.engines.vllm import constants
from vramplan.planner.memory import CPUMemory, MemoryBreakdown
from vramplan.planner.modelspec import Kind
from vramplan.planner.plan import Candidate, Plan, hardware_ref, model_ref
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.quant import SCHEMES
from vramplan.planner.request import Request
from vramplan.planner.sources import model_spec
from vramplan.planner.speed import SpeedEstimate
from vramplan.planner.units import GiB, MiB

RTX4090 = resolve_profile("rtx-4090")[0]
RTX4090_X8 = RTX4090.replace(name="rtx-4090-x8", gpus=(replace(RTX4090.gpus[0], count=8),))
TWO_4090 = RTX4090.replace(name="rtx-4090-x2", gpus=(replace(RTX4090.gpus[0], count=2),))
H100 = resolve_profile("h100-sxm")[0]
A100 = resolve_profile("a100-80gb-sxm")[0]


def export(model, hw, req: Request, quant: str = "bf16", kv: str = "bf16", **choice):
    """vLLM's export of a plan that runs `model` (a name or a ModelSpec) whole on the GPU in `quant` (exports read only
    the plan's choice and request)."""
    spec = model_spec(model) if isinstance(model, str) else model
    fields = dict(gpu_layers=spec.num_layers, offload=OffloadMode.NONE, embeddings_on_gpu=True) | choice
    c = Choice(total_layers=spec.num_layers, weight_quant=quant, kv_dtype=kv, compute_device=ComputeDevice.CUDA,
               **fields)
    mem = MemoryBreakdown(gpus=(), cpu=CPUMemory(weights_bytes=0, kv_cache_bytes=0, workspace_bytes=0,
                                                  runtime_base_bytes=0, capacity_bytes=1), workspace_terms={})
    speed = SpeedEstimate(decode_tokens_per_s=1.0, decode_tokens_per_s_full_context=1.0, ttft_s=1.0,
                          prefill_tokens_per_s=1.0, ceiling_decode_tokens_per_s=1.0, terms={})
    cand = Candidate(weight_quant=quant, kv_dtype=kv, quality_cost_pct=0.0, fits=True, choice=c, memory=mem,
                     speed=speed)
    req = replace(req, quant=req.quant or (quant,), kv_dtype=req.kv_dtype or (kv,))  # vLLM searches what is forced
    p = Plan(model=model_ref(spec), hardware=hardware_ref(hw), request=req, chosen=cand, reasons=[], candidates=[cand])
    return emit("vllm", spec, hw, p)


def note(e, prefix: str) -> str:
    return next(n for n in e.notes if n.startswith(prefix))


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# ---------------------------------------------------------------- what vLLM 0.33.0 accepts
def test_the_rules_name_their_version():
    e = export("llama-3.1-8b", RTX4090, Request(context=8192))
    assert rules.VLLM_VERSION == "0.33.0" and e.details["vllm_version"] == "0.33.0"
    assert e.notes[0].startswith("vLLM's own choice among 1 formats x caches")  # the forced bf16
    assert e.notes[1].startswith("vLLM 0.33.0 per GPU")
    assert rules.GPU_WORKER == "vllm-project/vllm vllm/v1/worker/gpu_worker.py @ v0.33.0 (4ba787ec9)"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_scheme_exports_a_quantization_033_knows(scheme):
    """bitsandbytes left QuantizationMethods: `--quantization bitsandbytes` stops vLLM 0.33 with "Unknown quantization
    method". Every scheme maps to an online method a bf16 checkpoint takes, none deprecated."""
    assert "bitsandbytes" not in rules.QUANTIZATION_METHODS
    e = export("llama-3.1-8b", H100, Request(context=8192), quant=scheme)
    q = option(e.details["argv"], "--quantization")
    if SCHEMES[scheme].bits >= 16:
        assert q is None
    else:
        assert q in rules.QUANTIZATION_METHODS and q in rules.ONLINE_QUANTIZATION
        assert q not in rules.DEPRECATED_QUANTIZATION_METHODS
        assert q != "fp8"  # on a bf16 checkpoint, deprecated for fp8_per_tensor (weight_utils get_quant_config)


FLAG_CASES = [
    ("llama-3.1-8b", RTX4090, Request(context=32768), "bf16", "fp8", {}),
    ("llama-3.1-8b", RTX4090, Request(context=8192), "fp16", "bf16", {}),
    ("llama-3.1-70b", TWO_4090, Request(context=4096), "bnb-nf4-dq", "bf16", {}),
    ("llama-3.1-70b", RTX4090, Request(context=8192, nodes=4), "bnb-int8", "bf16", {}),
    ("qwen3-30b-a3b", RTX4090, Request(context=16384), "bf16", "bf16", dict(moe_layers=48, expert_layers_on_cpu=48)),
    ("microsoft/Phi-3-mini-4k-instruct", RTX4090, Request(context=8192, allow_context_overflow=True), "bf16", "bf16",
     {}),
]


@pytest.mark.parametrize("model, hw, req, quant, kv, choice", FLAG_CASES, ids=lambda x: getattr(x, "name", None))
def test_the_flags_written_are_those_of_vllm_serve_033(model, hw, req, quant, kv, choice):
    e = export(model, hw, req, quant, kv, **choice)
    argv = e.details["argv"]
    env = []
    while "=" in argv[0]:
        env.append(argv.pop(0).split("=")[0])
    assert set(env) <= {rules.ALLOW_LONG_MAX_MODEL_LEN}
    assert argv[:3] == ["vllm", "serve", model_spec(model).name]
    values = {"--kv-cache-dtype": rules.KV_CACHE_DTYPES, "--dtype": rules.MODEL_DTYPES,
              "--quantization": rules.QUANTIZATION_METHODS,
              "--distributed-executor-backend": rules.DISTRIBUTED_EXECUTOR_BACKENDS}
    flags = [a for a in argv[3:] if a.startswith("--")]
    assert set(flags) <= set(rules.SERVE_OPTIONS), flags
    for flag, accepted in values.items():
        assert option(argv, flag) in (None, *accepted)
    assert 0 < float(option(argv, "--gpu-memory-utilization")) <= 1
    assert int(option(argv, "--max-model-len")) == req.context
    assert (option(argv, "--cpu-offload-params") or "experts") == "experts"


# ---------------------------------------------------------------- the budget
def test_cuda_graphs_come_out_of_the_kv_pool():
    """vLLM 0.33 estimates the CUDA graphs and takes them from the KV pool (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS
    defaults to 1): KV = ceil(CUDA's total x utilization) - weights - profile peak - non-torch - graphs. Llama-3.1-8B
    in bf16 on a 4090: the utilization stays at vLLM's default 0.92 while its pool holds the request, and goes up to
    what leaves only the CUDA context and the headroom outside (0.95) when it does not."""
    cuda_total = 24564 * MiB - CUDA_HIDDEN_BYTES_ASSUMED  # what torch.accelerator.get_memory_info reports
    most = math.floor((cuda_total - 512 * MiB - 500 * MiB) / cuda_total * 100) / 100
    assert most == 0.95
    e = export("llama-3.1-8b", RTX4090, Request(context=32768))
    u = e.details["gpu_memory_utilization"]
    assert u == rules.DEFAULT_GPU_MEMORY_UTILIZATION == 0.92
    assert "this GPU allows up to 0.95" in note(e, "--gpu-memory-utilization 0.92, vLLM's default")
    for ctx, least in ((40960, 0.93), (45056, 0.95)):  # the least utilization whose pool holds the request
        high = export("llama-3.1-8b", RTX4090, Request(context=ctx))
        assert high.details["gpu_memory_utilization"] == least and high.fits
        assert not export("llama-3.1-8b", RTX4090, Request(context=ctx)).details["per_gpu"]["cpu_offload_bytes"]
        assert "above vLLM's default 0.92" in note(high, f"--gpu-memory-utilization {least:.2f}")
    g = e.details["per_gpu"]
    requested = math.ceil(cuda_total * u)  # vllm/v1/worker/utils.py request_memory
    pool = requested - g["weights_bytes"] - g["activation_bytes"] - g["non_torch_bytes"] - CUDAGRAPH_BYTES_ASSUMED
    assert g["cudagraph_bytes"] == CUDAGRAPH_BYTES_ASSUMED and g["kv_pool_bytes"] == pool
    assert e.fits and pool >= g["kv_needed_bytes"]
    assert cuda_total - requested >= RTX4090.overheads.cuda_context_bytes + 512 * MiB
    # at 48k the graphs take what the KV cache needed: one 4090 does not hold it (vramplan's export for graphs outside
    # the budget wrote utilization 0.91 and said it fitted with 0.22 GiB to spare)
    e = export("llama-3.1-8b", RTX4090, Request(context=49152))
    assert e.details["nodes_needed"] == 2 and e.details["per_gpu"]["cpu_offload_bytes"] > 0  # fits with weights in RAM
    assert not export("llama-3.1-8b", RTX4090, Request(context=49152, ram_budget_bytes=0)).fits


def test_nccl_is_outside_the_budget_and_the_distributed_rest_inside():
    """NCCL is set up before vLLM's memory snapshot (gpu_worker init_device), so it must fit beside the CUDA context in
    what gpu_memory_utilization leaves; what grows after the snapshot counts inside. Qwen2.5-14B in bf16 on two 4090s
    runs at TP 2."""
    e = export("qwen2.5-14b", TWO_4090, Request(context=8192))
    assert e.details["tensor_parallel_size"] == 2
    total = 24564 * MiB - CUDA_HIDDEN_BYTES_ASSUMED
    u = e.details["gpu_memory_utilization"]
    assert u == math.floor((total - 512 * MiB - 500 * MiB - NCCL_BYTES_ASSUMED) / total * 100) / 100 == 0.91
    assert "below vLLM's default 0.92: the CUDA context, NCCL" in note(e, "--gpu-memory-utilization 0.91")
    g = e.details["per_gpu"]
    assert g["non_torch_bytes"] == NON_TORCH_DISTRIBUTED_BYTES_ASSUMED
    assert g["kv_pool_bytes"] == (math.ceil(total * u) - g["weights_bytes"] - g["activation_bytes"]
                                  - g["non_torch_bytes"] - g["cudagraph_bytes"])
    assert "NCCL 1.00 GiB and your headroom" in note(e, "vLLM 0.33.0 per GPU")
    assert "nccl_bytes" in e.constants and "nccl_bytes" not in export("llama-3.1-8b", RTX4090,
                                                                      Request(context=8192)).constants


def test_default_utilization_and_batch_defaults():
    assert constants(RTX4090)["default_gpu_memory_utilization"].value == 0.92  # CacheConfig
    b200 = H100.replace(name="b200", gpus=(replace(H100.gpus[0], name="NVIDIA B200", memory_bytes=180 * GiB),))
    gb10 = H100.replace(name="gb10", gpus=(replace(H100.gpus[0], name="NVIDIA GB10", memory_bytes=128 * GiB,
                                                   compute_capability="12.1"),))
    tiers = {hw.name: (constants(hw)["max_num_batched_tokens"].value, constants(hw)["max_num_seqs"].value)
             for hw in (RTX4090, A100, H100, gb10, b200)}
    assert tiers == {"rtx-4090": (2048, 256), "a100-80gb-sxm": (2048, 256), "h100-sxm": (8192, 1024),
                     "gb10": (2048, 256), "b200": (16384, 1024)}
    # capped at max_num_seqs x max_model_len
    assert rules.max_num_batched_tokens(RTX4090.gpu, 4) == 1024 and rules.max_num_batched_tokens(RTX4090.gpu, 9) == 2048


# ---------------------------------------------------------------- tensor parallelism
def test_tp_divides_the_kv_heads_and_the_mlp_width():
    """QKVParallelLinear asserts divide(kv, tp) or divide(tp, kv); the MLPs divide the intermediate size. Qwen2.5-32B
    (40 heads, 8 KV heads) at 128k on eight 4090s: TP 5 divides the heads only, and vLLM stops on an assertion."""
    qwen = model_spec("qwen2.5-32b")
    assert rules.tp_sizes(qwen, 8) == [1, 2, 4, 8]
    assert rules.tp_refusal(qwen, 5) == "8 KV heads: 5 neither divides them nor is a multiple of them"
    small = model_spec("qwen2.5-0.5b")  # 14 heads, 2 KV heads, intermediate 4864
    assert rules.tp_refusal(small, 14) == "MLP width 4864 is not divisible by 14" and rules.tp_refusal(small, 2) == ""
    moe = model_spec("qwen3-30b-a3b")  # 32 heads, 4 KV heads, experts' intermediate 768
    assert rules.mlp_widths(moe) == {768} and rules.tp_sizes(moe, 8) == [1, 2, 4, 8]
    e = export("qwen2.5-32b", RTX4090_X8, Request(context=131072))
    assert e.details["tensor_parallel_size"] in (1, 2, 4, 8) and e.fits


# ---------------------------------------------------------------- the KV cache
def test_sliding_windows_keep_the_tokens_in_flight():
    """SlidingWindowSpec.max_admission_blocks_per_request: min(window - 1 + in-flight tokens, max_model_len) in blocks,
    + 1; in flight: (pp + 1) x max_num_batched_tokens (async scheduling, V2 model runner)."""
    assert rules.max_in_flight_tokens(1, 2048) == 4096 and rules.max_in_flight_tokens(2, 8192) == 3 * 8192
    layer = rules.LayerKV(4096, 131072, 16)
    assert layer.blocks(8192, 4096) == math.ceil(8191 / 16) + 1 == 513
    assert layer.blocks(32768, 4096) == math.ceil((4095 + 4096) / 16) + 1
    assert rules.LayerKV(None, 131072, 16).blocks(8192, 4096) == 512


def test_hybrid_kv_groups_as_the_hybrid_allocator_pads_and_sums_them():
    """Gemma-2-9B at 8k on a 4090: 21 sliding (4096) + 21 full layers, 8 KV heads x 256 in bf16: two groups of 21
    layers; a pool block holds 21 pages of 2 x 16 x 8 x 256 x 2 B; one request takes 512 full + 513 sliding blocks; the
    null block on top."""
    e = export("gemma-2-9b", RTX4090, Request(context=8192))
    page = 2 * 16 * 8 * 256 * 2
    assert e.details["per_gpu"]["kv_needed_bytes"] == (512 + 513) * 21 * page + 21 * page == 2_824_077_312
    # Gemma-3-27B at 32k on an H100 (8192 batched tokens): 52 sliding (1024) + 10 full layers, 16 KV heads x 128:
    # groups of 10 layers, the 52 sliding ones in 6 (8 padding layers); 2048 full blocks + 6 x (ceil((1023 + 16384) /
    # 16) + 1) sliding blocks of 10 pages each
    e = export("gemma-3-27b", H100, Request(context=32768))
    page = 2 * 16 * 16 * 128 * 2
    assert e.details["per_gpu"]["kv_needed_bytes"] == (2048 + 6 * 1089) * 10 * page + 10 * page == 11_249_909_760
    assert "over 7 KV cache groups" in note(e, "the KV pool is cut")


def test_kv_groups_split_padded_and_projected_per_stage():
    full, slide = rules.LayerKV(None, 100, 16), rules.LayerKV(1024, 100, 16)
    layers = [slide if (i + 1) % 6 else full for i in range(62)]
    groups = rules.kv_groups(layers)
    assert [len(g.layers) for g in groups] == [9, 9, 9, 9, 8, 8, 10] and groups[-1].spec == full
    assert groups[0].layers == tuple(i for i in range(62) if (i + 1) % 6)[0::6]
    per_seq, per_block = rules.kv_request_bytes(groups, range(31), 32768, 16384)  # the first of two PP stages
    assert per_block == max(sum(100 for i in g.layers if i < 31) for g in groups)
    assert per_seq == per_block * (2048 + 6 * 1089)  # every group's blocks, the stage's share of pages
    # the same window everywhere, pages alike or not: one group (uniform spec / UniformTypeKVCacheSpecs)
    assert len(rules.kv_groups([full] * 4)) == 1 and len(rules.kv_groups([full, rules.LayerKV(None, 50, 16)])) == 1
    # a smaller page is unified by a larger block: 50 B per 16 tokens becomes 100 B per 32
    mixed = rules.kv_groups([slide, rules.LayerKV(None, 50, 16)])
    assert {g.spec for g in mixed} == {slide, rules.LayerKV(None, 100, 32)}


# Llama-4-Scout's text config (meta-llama/Llama-4-Scout-17B-16E-Instruct config.json, text_config): 48 layers, every
# 4th NoPE with full attention, the others attending in chunks of 8192.
SCOUT = dict(model_type="llama4_text", hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=48, attention_chunk_size=8192, num_local_experts=16, num_experts_per_tok=1,
             intermediate_size=8192, intermediate_size_mlp=16384, vocab_size=202048, interleave_moe_layer_step=1,
             max_position_embeddings=10485760, tie_word_embeddings=False, torch_dtype="bfloat16")


def test_chunked_local_attention_keeps_one_chunk_and_the_tokens_in_flight():
    """ChunkedLocalAttentionSpec.max_admission_blocks_per_request (kv_cache_interface.py 861-888): min(chunk + in-flight
    tokens, max_model_len) in blocks, with no extra block: not a sliding window of the same size."""
    chunk, slide = rules.LayerKV(8192, 65536, 16, True), rules.LayerKV(8192, 65536, 16)
    assert chunk.blocks(131072, 16384) == (8192 + 16384) // 16 == 1536
    assert slide.blocks(131072, 16384) == math.ceil((8191 + 16384) / 16) + 1 == 1537
    assert chunk.blocks(4096, 16384) == 4096 // 16  # never more than max_model_len
    assert len(rules.kv_groups([chunk, slide])) == 2  # a chunk and a window of one size are two specs
    from vramplan.planner.architectures import spec_from_config
    from vramplan.planner.engines.vllm import VLLMModel, weight_format
    spec = spec_from_config(SCOUT, name="llama-4-scout-text")
    m = VLLMModel(spec, H100, Request(context=131072), weight_format("bf16"), "auto")
    layers = m.layer_kv(1)
    assert [x.chunked for x in layers] == [(i + 1) % 4 != 0 for i in range(48)]
    page = 2 * 16 * 8 * 128 * 2
    assert layers[0] == rules.LayerKV(8192, page, 16, True) and layers[3] == rules.LayerKV(None, page, 16)
    # 36 chunked layers in 3 groups of 12 beside the 12 full ones: 8192 full blocks + 3 x (8192 + 16384) / 16
    groups = rules.kv_groups(layers)
    assert sorted(len(g.layers) for g in groups) == [12, 12, 12, 12]
    per_seq, per_block = rules.kv_request_bytes(groups, range(48), 131072, rules.max_in_flight_tokens(1, m.tokens))
    assert m.tokens == 8192 and per_block == 12 * page and per_seq == (8192 + 3 * 1536) * 12 * page


def test_attention_backend_and_its_block_follow_the_gpu_and_the_cache():
    """platforms/cuda.py _get_backend_priorities and each backend's kernel blocks: MLA on Hopper takes FlashAttention
    MLA's 16 with a bf16 cache and FlashMLA's 64 with fp8; Blackwell FlashInfer MLA's 32 (CUTLASS MLA's 128 for other
    head dims); Ampere and consumer Blackwell Triton MLA's 16; standard attention 16 everywhere."""
    gpu = H100.gpu
    b200 = replace(gpu, name="NVIDIA B200", compute_capability="10.0")
    assert rules.attention_backend(gpu, True, "auto", 128) == ("FLASH_ATTN_MLA", 16)
    assert rules.attention_backend(gpu, True, "fp8", 128) == ("FLASHMLA", 64)
    assert rules.attention_backend(b200, True, "auto", 128) == ("FLASHINFER_MLA", 32)
    assert rules.attention_backend(b200, True, "fp8", 96) == ("CUTLASS_MLA", 128)
    assert rules.attention_backend(A100.gpu, True, "fp8", 128) == ("TRITON_MLA", 16)
    assert rules.attention_backend(RTX4090.gpu, False, "auto") == ("FLASH_ATTN", 16)
    assert rules.attention_backend(b200, False, "fp8") == ("FLASHINFER", 16)
    # DeepSeek-V3 at 32k on 8 H200s: one request is 32768 / block blocks of 576 latent elements per token and layer
    h200 = resolve_profile("h200")[0]
    h200x8 = h200.replace(name="h200-x8", gpus=(replace(h200.gpu, count=8),))
    for kv, block in (("bf16", 16), ("fp8", 64)):
        e = export("deepseek-v3", h200x8, Request(context=32768), kv=kv)
        assert f"cut in {block}-token blocks" in note(e, "the KV pool is cut")
        assert "(8 TP x 1 PP on 1 node(s))" in note(e, "vLLM 0.33.0 per GPU")  # the node's GPUs, as vLLM's guide says
        page = block * 576 * (1 if kv == "fp8" else 2) * 61  # the latent row of every layer, on every TP rank
        assert e.details["per_gpu"]["kv_needed_bytes"] == (32768 // block + 1) * page  # + the null block


def test_mxfp4_experts_are_padded_as_the_moe_backend_pads_them():
    """gpt-oss-120b's experts (2880 hidden, 2880 intermediate, 128 experts): the OAI Triton kernels on Hopper pad each
    rank's intermediate size to 64 only; Marlin (Ampere) and FlashInfer TRT-LLM (Blackwell) pad it to 128 and the
    hidden size to 256 (fused_moe/oracle/mxfp4.py mxfp4_round_up_hidden_size_and_intermediate_size)."""
    spec = model_spec("gpt-oss-120b")
    up, down = (t for t in spec.layer_tensors(0) if t.kind is Kind.EXPERTS)

    def size(rows, cols):
        return 128 * (rows * cols // 2 + rows * cols // 32)

    assert rules.mxfp4_expert_rank_bytes(spec, up, 1, H100.gpu) == size(5760, 2880)  # no padding at TP 1
    assert rules.mxfp4_expert_rank_bytes(spec, down, 1, H100.gpu) == size(2880, 2880)
    assert rules.mxfp4_expert_rank_bytes(spec, up, 2, H100.gpu) == size(2 * 1472, 2880)  # 1440 -> 1472
    assert rules.mxfp4_expert_rank_bytes(spec, down, 2, H100.gpu) == size(2880, 1472)
    assert rules.mxfp4_expert_rank_bytes(spec, up, 1, A100.gpu) == size(2 * 2944, 3072)
    assert rules.mxfp4_expert_rank_bytes(spec, down, 1, A100.gpu) == size(3072, 2944)
    assert rules.mxfp4_moe_backend(replace(H100.gpu, compute_capability="10.0"))[0] == "FLASHINFER_TRTLLM_MXFP4_BF16"
    assert rules.mxfp4_moe_backend(replace(H100.gpu, compute_capability="12.0"))[0] == "MARLIN"
    # the export's weights follow: 36 layers of padded experts on the A100, 6.0 GiB more than on the H100
    weights = {hw.name: export("gpt-oss-120b", hw, Request(context=8192)).details["per_gpu"]["weights_bytes"]
               for hw in (H100, A100)}
    extra = 36 * (size(2 * 2944, 3072) + size(3072, 2944) - size(5760, 2880) - size(2880, 2880))
    assert weights[A100.name] - weights[H100.name] == extra


# ---------------------------------------------------------------- weights
def test_weight_bytes_per_format():
    spec = model_spec("llama-3.1-8b")
    q = next(t for t in spec.tensors if t.name.endswith("layers.0.self_attn.q_proj.weight"))  # [4096, 4096]
    assert rules.online_format("bnb-nf4", 4).tensor_bytes(q) == 4096 * 2048 + 4096 * 128  # MXFP4: 4 bits + e8m0/32
    assert rules.online_format("bnb-int8", 8).tensor_bytes(q) == 4096 * 4096 + 4  # FP8 + a per-tensor fp32 scale
    emb = next(t for t in spec.tensors if t.layer is None and t.kind.value == "embedding")
    assert rules.online_format("bnb-nf4", 4).tensor_bytes(emb) == emb.numel * 2  # embeddings stay bf16
    ds = rules.checkpoint_format(model_spec("deepseek-v3"))  # fp8 with 128 x 128 block scales
    assert ds.tensor_bytes(q) == 4096 * 4096 + 32 * 32 * 4 and ds.args == ()


def test_prequantized_checkpoints_load_as_they_are():
    e = export("gpt-oss-20b", H100, Request(context=32768), quant="bnb-nf4")
    assert option(e.details["argv"], "--quantization") is None and e.fits
    assert "--quant bnb-nf4 as vLLM's mxfp4" in e.notes
    assert "openai/gpt-oss-20b's checkpoint is pre-quantized (mxfp4): vLLM loads it as it is, without --quantization" \
        in e.notes
    spec = model_spec("llama-3.1-8b")
    bnb = replace(spec, config={**spec.config, "quantization_config": {"quant_method": "bitsandbytes"}})
    out = export(bnb, RTX4090, Request(context=8192))
    assert not out.fits and "quantized with bitsandbytes, which vLLM 0.33.0 does not know" in out.notes[0]
    assert out.text.endswith("# no vllm serve command\n") and "argv" not in out.details
    # a refusal with a GPU still names vLLM's constants and assumptions (only a machine without one has none)
    assert out.constants and out.details == {"nodes_needed": None} and any("assumption:" in n for n in out.notes)


def test_online_quantization_needs_compute_capability_75():
    old = RTX4090.replace(name="v100-like", gpus=(replace(RTX4090.gpus[0], name="V100", compute_capability="7.0"),))
    e = export("llama-3.1-8b", old, Request(context=8192), quant="bnb-nf4")
    assert not e.fits and "mxfp4 needs compute capability 7.5 or more" in e.notes[0]
    assert "vLLM cannot run this plan on this card" in e.notes[0]
    assert export("llama-3.1-8b", old, Request(context=8192)).fits  # bf16 needs no quantization method


# ---------------------------------------------------------------- offload and long contexts
def test_routed_experts_stay_in_ram_with_cpu_offload_params():
    e = export("qwen3-30b-a3b", RTX4090, Request(context=16384), moe_layers=48, expert_layers_on_cpu=48)
    argv = e.details["argv"]
    assert option(argv, "--cpu-offload-params") == "experts" and e.fits
    gb = int(option(argv, "--cpu-offload-gb"))
    assert e.details["per_gpu"]["cpu_offload_bytes"] == gb * GiB
    assert not any("no expert offload" in n for n in e.notes)


def test_online_quantization_is_not_offloaded():
    """Online-quantized weights wait on the meta device while vLLM's offloader copies parameters to RAM (UVAOffloader
    cannot copy a meta tensor): a 4-bit 70B on one 4090 needs nodes, not --cpu-offload-gb."""
    e = export("llama-3.1-70b", RTX4090, Request(context=8192), quant="bnb-nf4-dq", gpu_layers=40,
               offload=OffloadMode.STREAM, embeddings_on_gpu=False)
    assert "--cpu-offload-gb" not in e.details["argv"] and not e.fits and e.details["nodes"] == 3
    assert "the two do not combine" in e.notes[0]


def test_max_model_len_past_the_model_needs_the_env():
    e = export("microsoft/Phi-3-mini-4k-instruct", RTX4090, Request(context=8192, allow_context_overflow=True))
    assert e.details["argv"][0] == "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
    assert e.text.splitlines()[-4].startswith("VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve")
    assert export("llama-3.1-8b", RTX4090, Request(context=131072)).details["argv"][0] == "vllm"
    # rope types that keep max_position_embeddings (llama3, yarn) and gemma3; others multiply it by the factor
    assert rules.derived_max_model_len(model_spec("llama-3.1-8b"))[0] == 131072
    assert rules.derived_max_model_len(model_spec("deepseek-v3"))[0] == 163840
    spec = model_spec("qwen2.5-7b")
    linear = replace(spec, config={**spec.config, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert rules.derived_max_model_len(linear) == (2 * spec.max_context,
                                                   f"max_position_embeddings {spec.max_context} x rope factor 2")


def test_layouts_follow_vllms_parallelism_guide():
    """One GPU where the model fits on one; else TP over every GPU of the node (docs/serving/parallelism_scaling.md):
    405B on eight H100s is TP 8 on one node, not the six GPUs of TP 2 x PP 3 that also hold it."""
    h100x8 = H100.replace(name="h100-x8", gpus=(replace(H100.gpu, count=8),))
    e = export("llama-3.1-405b", h100x8, Request(context=32768), quant="bnb-int8")
    assert (e.details["tensor_parallel_size"], e.details["pipeline_parallel_size"], e.details["nodes"]) == (8, 1, 1)
    e = export("llama-3.1-8b", h100x8, Request(context=32768))
    assert (e.details["tensor_parallel_size"], e.details["pipeline_parallel_size"]) == (1, 1)
