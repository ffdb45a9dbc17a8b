"""vLLM's rules, as vLLM 0.33.0 applies them: the values `vllm serve` accepts, the weights it holds per tensor, the
tensor-parallel sizes it accepts, its batch defaults, its longest --max-model-len and its KV cache groups.

Every rule was read in the vllm-0.33.0 wheel (pip download vllm==0.33.0; vllm/_version.py: __commit_id__
'g4ba787ec9'); each names its file. Memory per GPU worker (vllm/v1/worker/gpu_worker.py, init_device and
determine_available_memory; vllm/v1/worker/utils.py request_memory; vllm/utils/mem_utils.py memory_profiling):
  snapshot  taken after the CUDA context, NCCL and the cuBLAS handles exist: those stay outside the budget
  requested = ceil(total_memory x gpu_memory_utilization)        (the snapshot's free memory must cover it)
  KV pool   = requested - (weights + non-torch growth since the snapshot + persistent torch memory)
              - transient peak of the profile run - CUDA-graph estimate (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1)
The pool must hold one request of max_model_len plus the null block (vllm/v1/core/kv_cache_planning.py
get_kv_cache_configs) or vLLM refuses to start. Pure: no torch.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from ..record import record
from ..architectures.config import weight_block_size
from ..hardware import GPUSpec
from ..published import Published, is_quantized, published, stored_bytes
from ..modelspec import Kind, ModelSpec, Role, TensorSpec
from ..units import GiB

VLLM_VERSION = "0.33.0"
VLLM_GIT = "4ba787ec9"  # the wheel's vllm/_version.py __commit_id__ ('g' + the short hash)


def src(path: str) -> str:
    """Where a rule comes from: a file of vLLM 0.33.0."""
    return f"vllm-project/vllm {path} @ v{VLLM_VERSION} ({VLLM_GIT})"


GPU_WORKER = src("vllm/v1/worker/gpu_worker.py")
WORKER_UTILS = src("vllm/v1/worker/utils.py")
CACHE_PY = src("vllm/config/cache.py")
CONFIG_VLLM = src("vllm/config/vllm.py")
CONFIG_MODEL = src("vllm/config/model.py")
CONFIG_QUANT = src("vllm/config/quantization.py")
CONFIG_OFFLOAD = src("vllm/config/offload.py")
CONFIG_PARALLEL = src("vllm/config/parallel.py")
ARG_UTILS = src("vllm/engine/arg_utils.py")
ENVS_PY = src("vllm/envs.py")
QUANT_INIT = src("vllm/model_executor/layers/quantization/__init__.py")
ONLINE_BASE = src("vllm/model_executor/layers/quantization/online/base.py")
ONLINE_MXFP4 = src("vllm/model_executor/layers/quantization/online/mxfp4.py")
FP8_PY = src("vllm/model_executor/layers/quantization/fp8.py")
MXFP4_PY = src("vllm/model_executor/layers/quantization/mxfp4.py")
WEIGHT_UTILS = src("vllm/model_executor/model_loader/weight_utils.py")
LINEAR_PY = src("vllm/model_executor/layers/linear.py")
FUSED_MOE_CONFIG = src("vllm/model_executor/layers/fused_moe/config.py")
VOCAB_PY = src("vllm/model_executor/layers/vocab_parallel_embedding.py")
DIST_UTILS = src("vllm/distributed/utils.py")
UVA_PY = src("vllm/model_executor/offloader/uva.py")
KV_INTERFACE = src("vllm/v1/kv_cache_interface.py")
KV_PLANNING = src("vllm/v1/core/kv_cache_planning.py")
FLASHMLA_PY = src("vllm/v1/attention/backends/mla/flashmla.py")
FLASHATTN_MLA_PY = src("vllm/v1/attention/backends/mla/flashattn_mla.py")
FLASHINFER_MLA_PY = src("vllm/v1/attention/backends/mla/flashinfer_mla.py")
CUTLASS_MLA_PY = src("vllm/v1/attention/backends/mla/cutlass_mla.py")
TRITON_MLA_PY = src("vllm/v1/attention/backends/mla/triton_mla.py")
PLATFORM_CUDA = src("vllm/platforms/cuda.py")
PLATFORM_INTERFACE = src("vllm/platforms/interface.py")
ATTENTION_BACKEND_PY = src("vllm/v1/attention/backend.py")
ENVS = ENVS_PY
MXFP4_ORACLE = src("vllm/model_executor/layers/fused_moe/oracle/mxfp4.py")
TRITON_MOE_PY = src("vllm/model_executor/layers/fused_moe/experts/gpt_oss_triton_kernels_moe.py")
TRTLLM_MXFP4_PY = src("vllm/model_executor/layers/fused_moe/experts/trtllm_mxfp4_moe.py")
FI_CUTLASS_MOE_PY = src("vllm/model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py")
MARLIN_MOE_PY = src("vllm/model_executor/layers/fused_moe/experts/marlin_moe.py")

# ---------------------------------------------------------------- what `vllm serve` accepts
# QuantizationMethods (QUANT_INIT): --quantization values 0.33 knows; any other stops vLLM with "Unknown quantization
# method" (CONFIG_MODEL _verify_quantization). bitsandbytes is gone.
QUANTIZATION_METHODS = ("awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4",
                        "modelopt_mxfp8", "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming",
                        "compressed-tensors", "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4",
                        "gpt_oss_mxfp4", "deepseek_v4_fp8", "online", "fp8_per_tensor", "fp8_per_block",
                        "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8")
# Refused unless --allow-deprecated-quantization (QUANT_INIT DEPRECATED_QUANTIZATION_METHODS).
DEPRECATED_QUANTIZATION_METHODS = ("fbgemm_fp8", "fp_quant")
# The names that quantize a bf16/fp16 checkpoint while it loads (CONFIG_QUANT _ONLINE_SHORTHANDS; mxfp4 and mxfp8 only
# where the checkpoint has no quantization_config: _DEFERRED_ONLINE_SHORTHANDS). `--quantization fp8` still works on
# such a checkpoint but is deprecated for it: WEIGHT_UTILS get_quant_config warns and maps it to fp8_per_tensor.
ONLINE_QUANTIZATION = ("fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "mxfp8", "mxfp4",
                       "int8_per_channel_weight_only", "nvfp4_per_token")
# CacheDType (CACHE_PY): --kv-cache-dtype values.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                   "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                   "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head",
                   "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
# ModelDType (CONFIG_MODEL): --dtype values.
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# DistributedExecutorBackend (CONFIG_PARALLEL): --distributed-executor-backend values.
DISTRIBUTED_EXECUTOR_BACKENDS = ("ray", "mp", "uni", "external_launcher")
# The `vllm serve` options the export writes, as EngineArgs.add_cli_args (ARG_UTILS) spells them.
SERVE_OPTIONS = ("--max-model-len", "--gpu-memory-utilization", "--kv-cache-dtype", "--quantization", "--dtype",
                 "--tensor-parallel-size", "--pipeline-parallel-size", "--distributed-executor-backend",
                 "--cpu-offload-gb", "--cpu-offload-params")
# Set to 1 to serve a --max-model-len beyond the model's derived length (ENVS_PY; CONFIG_MODEL _get_and_verify_max_len
# raises otherwise).
ALLOW_LONG_MAX_MODEL_LEN = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"

# ---------------------------------------------------------------- memory constants
# CacheConfig.gpu_memory_utilization default (CACHE_PY).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# CacheConfig.DEFAULT_BLOCK_SIZE (CACHE_PY): tokens per KV block for standard attention, sliding-window layers included.
BLOCK_SIZE = 16
# Bytes per KV element: "auto" is the model dtype, "fp8" (= fp8_e4m3) one byte (CACHE_PY CacheDType).
KV_CACHE_BYTES = {"auto": 2, "fp8": 1}
# Embeddings and lm_head are vocab-parallel, each rank holding its share of the vocabulary padded to a multiple of
# this (VOCAB_PY DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size).
VOCAB_PADDING = 64
# EngineArgs.get_batch_defaults (ARG_UTILS), usage context OPENAI_API_SERVER (`vllm serve`), by the memory NVML
# reports: >= 160 GiB: 16384 batched tokens, 1024 sequences; >= 70 GiB and not an A100 nor a GB10 (compute
# capability 12.1): 8192 and 1024; others 2048 and 256.
HUGE_GPU_BYTES = 160 * GiB
LARGE_GPU_BYTES = 70 * GiB
BATCH_DEFAULTS = {"huge": (16384, 1024), "large": (8192, 1024), "other": (2048, 256)}
# The online quantization configs' get_min_capability (ONLINE_BASE: 75, as 7.5); pre-quantized checkpoints: Fp8Config
# 75 (FP8_PY), Mxfp4Config 80 (MXFP4_PY).
MIN_CAPABILITY = {"fp8_per_tensor": 75, "mxfp4": 75, "checkpoint-fp8": 75, "checkpoint-mxfp4": 80}
# MXFP4: 4-bit values, two per byte, and one e8m0 scale byte per block of 32 along the input (ONLINE_MXFP4
# MXFP4_BLOCK_SIZE, mxfp4_quantize); fp8_per_tensor: one byte per weight and one fp32 scale per tensor.
MXFP4_BLOCK = 32
# Pre-quantized checkpoints vLLM loads as they are, counted as stored (planner/published.py), and the least compute
# capability of the slowest kernel vLLM has for each (x10: each QuantizationConfig's get_min_capability, as read in
# vLLM's tree before 0.33.0 and not rechecked there: awq 75, gptq 60, fbgemm_fp8 80, compressed-tensors 70; the Marlin
# kernels vLLM prefers need 80).
STORED_CAPABILITY = {"awq": 75, "gptq": 60, "fbgemm_fp8": 80, "compressed-tensors": 70}
FP8_SCALE_BYTES = 4
# Models whose max_position_embeddings is already the scaled length (CONFIG_MODEL _get_and_verify_max_len: rope
# scaling of these types leaves it as is; gemma3's is never scaled again); any other rope type multiplies it by factor.
ROPE_TYPES_UNSCALED = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})


def batch_tier(gpu: GPUSpec) -> str:
    if gpu.memory_bytes >= HUGE_GPU_BYTES:
        return "huge"
    gb10 = gpu.compute_capability == "12.1"
    return "large" if gpu.memory_bytes >= LARGE_GPU_BYTES and "a100" not in gpu.name.lower() and not gb10 else "other"


def max_num_seqs(gpu: GPUSpec) -> int:
    return BATCH_DEFAULTS[batch_tier(gpu)][1]


def max_num_batched_tokens(gpu: GPUSpec, max_model_len: int) -> int:
    """The default, capped at max_num_seqs x max_model_len (ARG_UTILS _set_default_max_num_seqs_and_batched_tokens_args;
    chunked prefill is on by default for decoders, so max_model_len does not raise it)."""
    tokens, seqs = BATCH_DEFAULTS[batch_tier(gpu)]
    return min(tokens, seqs * max_model_len)


def max_in_flight_tokens(pp: int, batched_tokens: int) -> int:
    """CONFIG_VLLM max_in_flight_tokens = max_concurrent_batches x max_num_batched_tokens: async scheduling is on by
    default (uniproc, mp and Ray executors support it) and the V2 model runner is the default, so pp + 1 batches."""
    return (pp + 1) * batched_tokens


# ---------------------------------------------------------------- tensor parallelism
def tp_sizes(spec: ModelSpec, gpus: int) -> list[int]:
    """TP sizes vLLM accepts on `gpus` GPUs: they divide the attention heads (CONFIG_MODEL
    verify_with_parallel_config), the KV heads or are a multiple of them (LINEAR_PY QKVParallelLinear: divide(tp, kv)
    or divide(kv, tp), an assertion), every MLP width: the dense intermediate size (MergedColumnParallelLinear /
    RowParallelLinear divide it) and the routed experts' (FUSED_MOE_CONFIG: intermediate_size % tp_size == 0), and the
    vocabulary padded to a multiple of 64 (VOCAB_PY: see vocab_sizes)."""
    return [t for t in range(1, gpus + 1) if not tp_refusal(spec, t)]


def tp_refusal(spec: ModelSpec, tp: int) -> str:
    """Why vLLM refuses this TP size ('' where it accepts it)."""
    for a in spec.attention:
        if a.num_heads % tp:
            return f"{a.num_heads} attention heads are not divisible by {tp}"
        kv = a.num_kv_heads
        if a.kind != "mla" and kv and (tp % kv if tp >= kv else kv % tp):
            return f"{kv} KV heads: {tp} neither divides them nor is a multiple of them"
    for w in sorted(mlp_widths(spec)):
        if w % tp:
            return f"MLP width {w} is not divisible by {tp}"
    for vocab in sorted(vocab_sizes(spec)):
        padded = padded_vocab(vocab)
        if padded % tp:
            return (f"the vocabulary ({vocab}, padded to {padded}) is not divisible by {tp}: vLLM pads it to a "
                    f"multiple of {VOCAB_PADDING} only, then shards it evenly")
    return ""


def padded_vocab(vocab: int) -> int:
    """VOCAB_PY pad_vocab_size (lines 95-97): the vocabulary rounded up to a multiple of VOCAB_PADDING, whatever the TP
    size."""
    return math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING


def vocab_sizes(spec: ModelSpec) -> set[int]:
    """The vocabularies vLLM shards over TP (VocabParallelEmbedding, ParallelLMHead): the rows of the embedding and of
    the LM head. VOCAB_PY VocabParallelEmbedding.__init__ (lines 252-306) pads each to VOCAB_PADDING and takes
    divide(padded, tp_size), which asserts "... is not divisible by ..." (DIST_UTILS ensure_divisibility, lines 51-55,
    130-134): a TP size that does not divide the padded vocabulary stops vLLM while it builds the model."""
    out = {t.shape[0] for t in spec.non_layer_tensors() if t.role in (Role.EMBEDDING, Role.LM_HEAD)
           and len(t.shape) == 2}
    return out or ({spec.vocab_size} if spec.vocab_size else set())


def mlp_widths(spec: ModelSpec) -> set[int]:
    """The intermediate sizes TP shards: each dense (or shared-expert) MLP's down-projection input, and the routed
    experts' intermediate size."""
    out = set().union(*spec.per_layer(lambda tensors: {
        t.shape[1] for t in tensors if t.role is Role.MLP and t.kind is Kind.LINEAR and len(t.shape) == 2
        and t.shape[0] == spec.hidden_size}))
    if spec.moe is not None and spec.moe.expert_intermediate_size:
        out.add(spec.moe.expert_intermediate_size)
    return out


def tp_fraction(spec: ModelSpec, t: TensorSpec, tp: int) -> float:
    """The share of a tensor one TP rank holds: linears and experts sharded, K/V replicated once TP exceeds the KV
    heads (CONFIG_MODEL get_num_kv_heads: max(1, kv_heads // tp)), vocab-parallel embeddings, the rest replicated."""
    if t.role in (Role.EMBEDDING, Role.LM_HEAD) and len(t.shape) == 2:
        vocab = t.shape[0]
        return (padded_vocab(vocab) / tp) / vocab
    if t.kind not in (Kind.LINEAR, Kind.EXPERTS, Kind.BIAS):
        return 1.0
    kv = spec.attention[t.layer].num_kv_heads if t.layer is not None else 0
    if kv and any(p in t.name for p in ("k_proj", "v_proj")) and tp > kv:
        return 1.0 / kv
    return 1.0 / tp


def pp_partitions(num_layers: int, pp: int) -> list[int]:
    """DIST_UTILS get_pp_indices: an even split, the remainder to the stages before the last."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


# ---------------------------------------------------------------- the longest --max-model-len
def derived_max_model_len(spec: ModelSpec) -> tuple[int, str]:
    """The length vLLM derives from config.json (CONFIG_MODEL _get_and_verify_max_len), and why:
    max_position_embeddings, times the rope scaling factor unless the rope type keeps it (ROPE_TYPES_UNSCALED) or the
    model is a gemma3. The tokenizer's model_max_length, which can lower it, is not known here. 0: no length given."""
    base = spec.max_context
    if not base:
        return 0, "no max_position_embeddings"
    cfg = spec.config.get("text_config") if isinstance(spec.config.get("text_config"), dict) else spec.config
    if "gemma3" in spec.model_type:
        return base, f"max_position_embeddings {base}"
    factor = 1.0
    for key in ("rope_scaling", "rope_parameters"):
        r = cfg.get(key)
        entries = [r] if isinstance(r, dict) and not all(isinstance(v, dict) for v in r.values()) else (
            [v for v in r.values() if isinstance(v, dict)] if isinstance(r, dict) else [])
        for e in entries:
            kind = e.get("rope_type") or e.get("type") or "default"
            f = e.get("factor")
            if kind not in ROPE_TYPES_UNSCALED and isinstance(f, (int, float)) and not isinstance(f, bool):
                factor = float(f)
    if factor != 1.0:
        return int(base * factor), f"max_position_embeddings {base} x rope factor {factor:g}"
    return base, f"max_position_embeddings {base}"


# ---------------------------------------------------------------- weights as vLLM holds them
@record
class WeightFormat:
    """How vLLM holds the weights: its flags, which tensors are quantized and how (`encoding`: None, "fp8-tensor",
    "fp8-block" or "mxfp4"), and the least compute capability it runs on (x10, vLLM's get_min_capability)."""

    name: str  # "bf16", "fp16", "fp8_per_tensor", "mxfp4", "checkpoint-fp8", "checkpoint-mxfp4"
    args: tuple[str, ...] = ()
    encoding: str | None = None
    quantized_kinds: tuple[Kind, ...] = (Kind.LINEAR, Kind.EXPERTS)
    fp8_block: tuple[int, int] | None = None
    min_capability: int | None = None
    note: str = ""
    stored: Published | None = None  # encoding "stored": a published checkpoint, counted as planner/published.py does

    @property
    def online(self) -> bool:
        """Quantized by vLLM while it loads a bf16/fp16 checkpoint (the weights wait on the meta device)."""
        return self.name in ONLINE_QUANTIZATION

    def tensor_bytes(self, t: TensorSpec) -> int:
        if self.stored is not None:  # vLLM repacks some layouts (Marlin) at load: the same bytes, reordered
            return stored_bytes(self.stored, t) if is_quantized(self.stored, t) else t.numel * 2
        if self.encoding is None or t.layer is None or t.kind not in self.quantized_kinds:
            return t.numel * 2  # the model dtype: bf16 or fp16
        out, inp = t.matrix_shape
        matrices = t.shape[0] if t.kind is Kind.EXPERTS else 1
        if self.encoding == "mxfp4":
            return matrices * (out * math.ceil(inp / 2) + out * math.ceil(inp / MXFP4_BLOCK))
        if self.encoding == "fp8-block":
            bo, bi = self.fp8_block
            return t.numel + matrices * math.ceil(out / bo) * math.ceil(inp / bi) * FP8_SCALE_BYTES
        return t.numel + matrices * FP8_SCALE_BYTES  # fp8-tensor


def checkpoint_quantization(spec: ModelSpec) -> str | None:
    """The quant_method of a pre-quantized checkpoint (config.json quantization_config), None for a bf16/fp16 one."""
    q = spec.config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    return str(q.get("quant_method") or "unknown")


def checkpoint_format(spec: ModelSpec) -> WeightFormat | None:
    """A pre-quantized checkpoint vLLM loads as it is (no --quantization: a different one stops vLLM with "Quantization
    method specified in the model config ... does not match", CONFIG_MODEL _verify_quantization), where vramplan
    sizes its layout: fp8 (per tensor, or block-scaled with weight_block_size: DeepSeek-V3) and mxfp4 (gpt-oss: the
    routed experts only, modules_to_not_convert keeps attention, router and embeddings in bf16). None otherwise."""
    method = checkpoint_quantization(spec)
    if method == "fp8":
        block = weight_block_size(spec.config, spec.source or spec.name)
        return WeightFormat("checkpoint-fp8", (), "fp8-block" if block else "fp8-tensor",
                            fp8_block=block, min_capability=MIN_CAPABILITY["checkpoint-fp8"])
    if method == "mxfp4":
        return WeightFormat("checkpoint-mxfp4", (), "mxfp4", quantized_kinds=(Kind.EXPERTS,),
                            min_capability=MIN_CAPABILITY["checkpoint-mxfp4"])
    if method in STORED_CAPABILITY:
        pub = published(spec.config, spec.source or spec.name)
        return WeightFormat(f"checkpoint-{pub.name}", (), "stored", stored=pub,
                            min_capability=STORED_CAPABILITY[method])
    return None


def online_format(scheme: str, bits: int) -> WeightFormat:
    """The vLLM weights closest to a vramplan scheme, on a bf16/fp16 checkpoint."""
    if scheme == "fp16":
        return WeightFormat("fp16", ("--dtype", "float16"))
    if scheme == "bf16":
        return WeightFormat("bf16")
    if bits == 8:
        return WeightFormat("fp8_per_tensor", ("--quantization", "fp8_per_tensor"), "fp8-tensor",
                            min_capability=MIN_CAPABILITY["fp8_per_tensor"], note=(
                                f"vLLM {VLLM_VERSION} has no bitsandbytes and no quanto: {scheme} maps to "
                                "--quantization fp8_per_tensor (FP8 E4M3 weights quantized while loading, a per-tensor "
                                "scale; `fp8` is its deprecated name; W8A16 Marlin below compute capability 8.9)"))
    return WeightFormat("mxfp4", ("--quantization", "mxfp4"), "mxfp4", min_capability=MIN_CAPABILITY["mxfp4"], note=(
        f"vLLM {VLLM_VERSION} has no bitsandbytes and no quanto: {scheme} maps to --quantization mxfp4 (MXFP4 weights "
        "quantized while loading: 4-bit values with a power-of-two scale per 32, 0.53 B/param; W4A16 Marlin where "
        "FlashInfer's FP4 kernels do not run); its power-of-two scales round more coarsely than NF4's"))


# ---------------------------------------------------------------- the attention backend and its KV block
# A profile without a compute capability is priced as vLLM runs on Hopper (what the backend and MoE rules assume).
UNKNOWN_CAPABILITY_ASSUMED = (9, 0)


def attention_backend(gpu: GPUSpec, mla: bool, kv_cache: str, qk_nope_head_dim: int | None = None) -> tuple[str, int]:
    """The attention backend vLLM picks on this GPU and the KV block size that follows it: (name, tokens per block).

    PLATFORM_CUDA _get_backend_priorities (lines 84-181) lists the backends by compute capability; the first one valid
    for the model and cache dtype wins, and PLATFORM_INTERFACE update_block_size_for_backend (lines 750-790) sets the
    block to its preferred size (ATTENTION_BACKEND_PY get_preferred_block_size: DEFAULT_BLOCK_SIZE, 16, where the
    backend takes it, else its smallest kernel block). MLA:
      Hopper (9.x): FLASH_ATTN_MLA (FLASHATTN_MLA_PY: capability 9 only, bf16/fp16 caches only, MultipleOf(16)) -> 16;
        an fp8 cache falls to FLASHMLA (FLASHMLA_PY: capability 9 or 10, kernel block [64]) -> 64.
      Blackwell (10.x): FLASHINFER_MLA (FLASHINFER_MLA_PY: capability 10, blocks [32, 64], qk_nope_head_dim 64, 128 or
        192) -> 32; other MLA dims fall to CUTLASS_MLA (CUTLASS_MLA_PY: capability 10, [128]) -> 128.
      Others (8.x, 12.x, 7.5): TRITON_MLA (TRITON_MLA_PY: any capability, MultipleOf(16)) -> 16.
    Standard attention takes 16 everywhere (FLASH_ATTN and TRITON_ATTN MultipleOf(16); FLASHINFER [16, 32, 64] first on
    10.x); the FA4 head-256 page of 128 and the Hopper FA4 fp8 head-512 page of 64 need FA4 on a path vLLM does not
    pick by default. Unknown capability: Hopper's answer."""
    major = (gpu.capability or UNKNOWN_CAPABILITY_ASSUMED)[0]
    if not mla:
        return ("FLASHINFER" if major == 10 else "FLASH_ATTN" if major >= 8 else "TRITON_ATTN"), BLOCK_SIZE
    if major == 9:
        return ("FLASH_ATTN_MLA", 16) if kv_cache == "auto" else ("FLASHMLA", 64)
    if major == 10:
        return ("FLASHINFER_MLA", 32) if qk_nope_head_dim in (64, 128, 192) else ("CUTLASS_MLA", 128)
    return "TRITON_MLA", 16


# ---------------------------------------------------------------- the MoE backend of MXFP4 experts
def mxfp4_moe_backend(gpu: GPUSpec) -> tuple[str, int, int]:
    """The MoE kernel vLLM runs MXFP4 experts with (bf16 activations, as gpt-oss declares none), and the multiples it
    pads each rank's intermediate and hidden sizes to: (name, intermediate multiple, hidden multiple).

    MXFP4_ORACLE select_mxfp4_moe_backend takes the first supported of _get_priority_backends_for_gpt_oss (lines
    402-435; _filter_by_activation keeps the bf16-activation ones): FLASHINFER_TRTLLM_MXFP4_BF16 on the 10.x family
    (TRTLLM_MXFP4_PY _supports_current_device), the OAI TRITON kernels from 9.0 to 12.x (TRITON_MOE_PY
    _triton_kernel_moe_supports_current_device) except 12.x, where it is moved behind MARLIN, FLASHINFER_CUTLASS with
    bf16 activations on 9.0 only (behind TRITON; FI_CUTLASS_MOE_PY _supports_quant_scheme), then MARLIN from 7.5
    (MARLIN_MOE_PY). mxfp4_round_up_hidden_size_and_intermediate_size (lines 837-916) pads: TRTLLM and MARLIN
    intermediate to 128 and hidden to 256; any other (TRITON) intermediate to 64."""
    cc = gpu.capability or UNKNOWN_CAPABILITY_ASSUMED
    if cc[0] == 10:
        return "FLASHINFER_TRTLLM_MXFP4_BF16", 128, 256
    if (9, 0) <= cc < (12, 0):
        return "TRITON", 64, 1
    return "MARLIN", 128, 256


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def mxfp4_expert_rank_bytes(spec: ModelSpec, t: TensorSpec, tp: int, gpu: GPUSpec) -> int | None:
    """One TP rank's bytes of an MXFP4 expert tensor as vLLM allocates it: the rank's intermediate size and the hidden
    size padded to the MoE backend's multiples (mxfp4_moe_backend; Mxfp4MoEMethod.create_weights, MXFP4_PY, allocates
    the padded shapes and loads the checkpoint into them), 4-bit values and one scale byte per 32 along the input.
    None where the tensor's dimensions are not the hidden and (a multiple of) the expert intermediate size (w13: gate
    and up, [k x intermediate, hidden]; w2: down, [hidden, intermediate])."""
    inter = spec.moe.expert_intermediate_size if spec.moe is not None else None
    if not inter or inter % tp:
        return None
    _, inter_multiple, hidden_multiple = mxfp4_moe_backend(gpu)

    rank_inter = round_up(inter // tp, inter_multiple)
    rows, cols = t.matrix_shape
    if any(k in t.name for k in ("down", "w2")):  # [hidden, intermediate]
        if rows != spec.hidden_size or cols != inter:
            return None
        out, inp = round_up(rows, hidden_multiple), rank_inter
    else:  # gate, up or both fused: [k x intermediate, hidden]
        if cols != spec.hidden_size or rows % inter:
            return None
        out, inp = (rows // inter) * rank_inter, round_up(cols, hidden_multiple)
    return t.shape[0] * (out * math.ceil(inp / 2) + out * math.ceil(inp / MXFP4_BLOCK))


# ---------------------------------------------------------------- the KV cache
@record
class LayerKV:
    """One attention layer's KV spec on one rank (KV_INTERFACE FullAttentionSpec / SlidingWindowSpec /
    ChunkedLocalAttentionSpec / MLAAttentionSpec): its window (None: full attention), bytes of one block (page),
    tokens per block, and whether the window is llama4's attention chunk."""

    window: int | None
    page_bytes: int
    block_size: int
    chunked: bool = False

    def blocks(self, max_model_len: int, in_flight_tokens: int) -> int:
        """Blocks one max_model_len request holds (KV_INTERFACE max_memory_usage_bytes / page): full attention every
        token; a sliding window its window - 1 plus the tokens in flight, never more than max_model_len, + 1 for a
        window that starts inside a block (SlidingWindowSpec.max_admission_blocks_per_request); a chunk (llama4) its
        chunk plus the tokens in flight, never more than max_model_len, without the extra block
        (ChunkedLocalAttentionSpec.max_admission_blocks_per_request, lines 861-888). The hybrid allocator that keeps
        chunks apart is on by default: VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE defaults to 1 (ENVS_PY;
        CONFIG_VLLM would turn it off at 0)."""
        if self.window is None:
            return math.ceil(max_model_len / self.block_size)
        if self.chunked:
            return math.ceil(min(self.window + in_flight_tokens, max_model_len) / self.block_size)
        tokens = min(self.window - 1 + in_flight_tokens, max_model_len)
        return math.ceil(tokens / self.block_size) + 1


@record
class KVGroup:
    """Layers that share one KV cache spec after vLLM's page unification."""

    spec: LayerKV  # after page unification
    layers: tuple[int, ...]


def kv_groups(layers: list[LayerKV]) -> list[KVGroup]:
    """KV_PLANNING get_kv_cache_groups with the hybrid allocator (on by default on CUDA): one group when every layer has
    the same spec or the same window (UniformTypeKVCacheSpecs); otherwise pages unified to the largest (a smaller page
    scales its block size by the ratio, else is padded: unify_kv_cache_spec_page_size), layers bucketed by spec, and
    each bucket split into groups of `group_size` layers, the last one padded (_get_kv_cache_groups_uniform_page_size):
    group_size is the smallest bucket, or the largest where it is under 1.5 x the smallest; layer i of a bucket goes to
    its group i mod the bucket's group count."""
    if len(set(layers)) <= 1 or len({(x.window, x.chunked) for x in layers}) == 1:
        return [KVGroup(layers[0], tuple(range(len(layers))))] if layers else []
    top = max(x.page_bytes for x in layers)
    unified = []
    for x in layers:
        if x.page_bytes == top:
            unified.append(x)
        elif top % x.page_bytes == 0:
            unified.append(LayerKV(x.window, top, x.block_size * (top // x.page_bytes), x.chunked))
        else:
            unified.append(LayerKV(x.window, top, x.block_size, x.chunked))
    buckets: dict[LayerKV, list[int]] = {}
    for i, x in enumerate(unified):
        buckets.setdefault(x, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for spec, idx in buckets.items():
        n = math.ceil(len(idx) / group_size)
        groups += [KVGroup(spec, tuple(idx[i::n])) for i in range(n)]
    return groups


def _layers_within(layers: tuple[int, ...], stage: range) -> int:
    """How many of a group's layers (ascending: kv_groups makes them so) the stage holds; by bisection for a stage of
    consecutive layers (a search over pipeline sizes asks for every stage of each)."""
    if stage.step == 1:
        return bisect_left(layers, stage.stop) - bisect_left(layers, stage.start)
    return sum(1 for i in layers if i in stage)


def kv_request_bytes(groups: list[KVGroup], stage_layers: range, max_model_len: int,
                     in_flight_tokens: int) -> tuple[int, int]:
    """(bytes one max_model_len request needs, bytes of one pool block) on the rank holding `stage_layers`
    (KV_PLANNING _max_memory_usage_bytes_from_groups over the groups projected to the rank: a block holds each group's
    pages of its layers on the rank, the widest group decides; a request takes blocks from every group, empty ones
    included). The pool also keeps one block back, the null block (get_kv_cache_configs)."""
    per_block = max((g.spec.page_bytes * _layers_within(g.layers, stage_layers) for g in groups), default=0)
    blocks = sum(g.spec.blocks(max_model_len, in_flight_tokens) for g in groups)
    return per_block * blocks, per_block
