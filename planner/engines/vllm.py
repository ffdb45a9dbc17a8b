"""vLLM's memory rules and the `vllm serve` command for a plan, with TP/PP over GPUs and nodes (Ray).

How vLLM (0.1x, V1 engine) sizes memory, per GPU worker (vllm/v1/worker/gpu_worker.py):
  requested = total_memory x gpu_memory_utilization                                  (init_device)
  KV pool   = requested - (weights + torch activation peak of a profile run + non-torch increase)
                                                                    (determine_available_memory)
The CUDA context exists before the snapshot and CUDA graphs are captured after the KV cache is
allocated (compile_or_warm_up_model; counted inside `requested` only with
VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1, default 0): both must fit in the (1 - utilization)
left over. The pool is cut into blocks of `block_size` tokens; it must hold at least one request of
max_model_len (kv_cache_utils.check_enough_kv_cache_memory) or vLLM refuses to start.
The profile-run peak, the non-torch memory and the CUDA graphs are measured by vLLM at start-up;
here they are estimates, named as assumptions and said so in the output. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..choice import OffloadMode
from ..hardware import HardwareProfile
from ..memory import gpu_capacity
from ..modelspec import Kind, ModelSpec, Role, TensorSpec, dtype_bytes
from ..plan import Plan
from ..quant import SCHEMES
from ..request import Request
from ..units import GiB, format_bytes
from .common import EngineConstant, Export, assumption_notes, commented, floor_to, gib, shell_command

ENGINE = "vllm"
VLLM = "vllm-project/vllm"
GPU_WORKER = f"{VLLM} vllm/v1/worker/gpu_worker.py @ 35d5cda123ec28581759b6d34cde8052314fb1e6"
CACHE_PY = f"{VLLM} vllm/config/cache.py @ c1d86421174a87056edc90a41dc9942391509e84"
CUDA_PY = f"{VLLM} vllm/platforms/cuda.py @ 1c0d9ecf5bad600df3e001bf642dd48c5ed25cc6"
ARG_UTILS = f"{VLLM} vllm/engine/arg_utils.py @ 99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b"
VOCAB_PY = (f"{VLLM} vllm/model_executor/layers/vocab_parallel_embedding.py @ "
            "7f5d141a0abde5fdedc220f55d9f19831c9a5b9e")
DIST_UTILS = f"{VLLM} vllm/distributed/utils.py @ 5a6541db9bfa77756459722f69e8c89a0b47a14d"
KV_INTERFACE = f"{VLLM} vllm/v1/kv_cache_interface.py @ bc8282e61df21719b12b391c3a976b1c900dfbb4"
KV_UTILS = f"{VLLM} vllm/v1/core/kv_cache_utils.py @ bbf906a88ba1a39104884c88c9811a4f968e4659"
ENVS_PY = f"{VLLM} vllm/envs.py @ f218f9c24d224800e0ea4488aa71bd8215c8bdcd"
BNB_LOADER = (f"{VLLM} vllm/model_executor/model_loader/bitsandbytes_loader.py @ "
              "c9e9c484932eb025a29752972a29047802bc1bbb")

# Fraction of each GPU's memory vLLM may use unless told (CacheConfig.gpu_memory_utilization default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Tokens per KV block on CUDA (CUDA_PY check_and_update_config: block_size 16 when unset; MLA models get 64 for
# the FlashMLA backend below compute capability 10).
BLOCK_SIZE = 16
BLOCK_SIZE_MLA = 64
# EngineArgs.get_batch_defaults (ARG_UTILS), usage context OPENAI_API_SERVER: GPUs with at least
# 70 GiB that are not A100s get 8192 batched tokens and 1024 sequences, others 2048 and 256.
LARGE_GPU_BYTES = 70 * GiB
BATCHED_TOKENS = {"large": 8192, "other": 2048}
MAX_NUM_SEQS = {"large": 1024, "other": 256}
# Embeddings and lm_head are vocab-parallel, each rank holding its share of the vocabulary padded to a multiple
# of this (VOCAB_PY: DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size).
VOCAB_PADDING = 64
# Bytes per element of the KV cache: "auto" is the model dtype, "fp8" (= fp8_e4m3) one byte (CacheConfig.cache_dtype).
KV_CACHE_BYTES = {"auto": 2, "fp8": 1}
# Nodes to try before saying a model needs more.
MAX_NODES_SEARCHED = 64
# In-flight quantization: bitsandbytes quantizes to NF4 with double quantization (BNB_LOADER:
# quantize_4bit(..., compress_statistics=True, quant_type="nf4")); only pre-quantized checkpoints load 8-bit bnb
# (docs.vllm.ai/en/latest/features/quantization/bnb/). --quantization fp8 quantizes every Linear but lm_head to
# FP8 E4M3 with a per-tensor scale (docs.vllm.ai/en/stable/features/quantization/fp8/; runs as W8A16 Marlin below
# compute capability 8.9).
FP8_SCALE_BYTES = 4

# Estimates of what vLLM measures (assumptions):
# - profile run: max_num_batched_tokens through the model, then the sampler on min(max_num_seqs, tokens) rows;
#   alive at the peak: these many hidden-size rows, the fused gate_up + activation rows, q/k/v, and the fp32
#   logits this many times (logits, softmax/probs).
PROFILE_HIDDEN_COPIES_ASSUMED = 4
PROFILE_MLP_COPIES_ASSUMED = 3
PROFILE_LOGITS_COPIES_ASSUMED = 2
# - non-torch memory (NCCL, cuBLAS workspaces) beyond the context: 0.16 GiB in the single-GPU logs of
#   kubernetes-sigs/gateway-api-inference-extension#550 and generative-computing/mellea#416; more with
#   NCCL between ranks (assumed).
NON_TORCH_SINGLE_GPU_BYTES = int(0.16 * GiB)
NON_TORCH_DISTRIBUTED_BYTES_ASSUMED = 1 * GiB
# - CUDA graphs (captured after the KV cache, outside gpu_memory_utilization by default): vLLM logs "Graph
#   capturing finished ... took 0.21 GiB" for Llama-3.2-1B (vllm-project/vllm#11349) and 0.13 GiB for a 1B-class
#   model (mellea#416); larger models capture larger intermediates: 1 GiB per GPU assumed.
CUDAGRAPH_BYTES_ASSUMED = 1 * GiB


def constants(hw: HardwareProfile) -> dict[str, EngineConstant]:
    return {
        "default_gpu_memory_utilization": EngineConstant(DEFAULT_GPU_MEMORY_UTILIZATION, f"{CACHE_PY}: CacheConfig"),
        "block_size": EngineConstant(BLOCK_SIZE, f"{CUDA_PY}: check_and_update_config"),
        "max_num_batched_tokens": EngineConstant(_batched_tokens(hw), f"{ARG_UTILS}: get_batch_defaults "
                                                 "(OPENAI_API_SERVER)"),
        "max_num_seqs": EngineConstant(_max_num_seqs(hw), f"{ARG_UTILS}: get_batch_defaults"),
        "vocab_padding": EngineConstant(VOCAB_PADDING, f"{VOCAB_PY}: DEFAULT_VOCAB_PADDING_SIZE"),
        "cuda_context_bytes": EngineConstant(hw.overheads.cuda_context_bytes if hw.has_gpu else 0,
                                             f"profile {hw.name}: overheads.cuda_context"),
        "profile_run_copies": EngineConstant(f"{PROFILE_HIDDEN_COPIES_ASSUMED} hidden, {PROFILE_MLP_COPIES_ASSUMED} "
                                             f"MLP, {PROFILE_LOGITS_COPIES_ASSUMED} fp32 logits rows per token",
                                             "estimate of vLLM's measured profile-run activation peak",
                                             assumption=True),
        "non_torch_bytes": EngineConstant(NON_TORCH_SINGLE_GPU_BYTES, "vLLM start-up logs (single GPU): "
                                          "kubernetes-sigs/gateway-api-inference-extension#550, "
                                          "generative-computing/mellea#416"),
        "non_torch_distributed_bytes": EngineConstant(NON_TORCH_DISTRIBUTED_BYTES_ASSUMED, "NCCL buffers between "
                                                      "ranks, measured by vLLM at start-up", assumption=True),
        "cudagraph_bytes": EngineConstant(CUDAGRAPH_BYTES_ASSUMED, "CUDA graph pool per GPU, measured by vLLM "
                                          "(capture_model), outside gpu_memory_utilization unless "
                                          f"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 ({ENVS_PY}; default 0)",
                                          assumption=True),
    }


def _large(hw: HardwareProfile) -> bool:
    g = hw.gpu
    return g is not None and g.memory_bytes >= LARGE_GPU_BYTES and "a100" not in g.name.lower()


def _batched_tokens(hw: HardwareProfile) -> int:
    return BATCHED_TOKENS["large" if _large(hw) else "other"]


def _max_num_seqs(hw: HardwareProfile) -> int:
    return MAX_NUM_SEQS["large" if _large(hw) else "other"]


# ---------------------------------------------------------------- weights as vLLM stores them
@dataclass(frozen=True)
class WeightFormat:
    """How vLLM would hold the plan's weights: its flags and bytes per tensor."""

    name: str  # "bf16", "fp16", "fp8", "bitsandbytes"
    args: tuple[str, ...]
    note: str = ""

    def tensor_bytes(self, t: TensorSpec) -> int:
        in_layer_linear = t.layer is not None and t.kind in (Kind.LINEAR, Kind.EXPERTS)
        if self.name == "fp8" and in_layer_linear:
            return t.numel + FP8_SCALE_BYTES
        if self.name == "bitsandbytes" and t.kind is Kind.LINEAR and t.layer is not None:
            return SCHEMES["bnb-nf4-dq"].tensor_bytes(t)  # bitsandbytes' own NF4 + double-quant layout
        return t.numel * 2  # the model dtype: bf16 or fp16


def weight_format(scheme: str) -> WeightFormat:
    """The vLLM weights closest to a vramplan scheme."""
    if scheme == "fp16":
        return WeightFormat("fp16", ("--dtype", "float16"))
    if scheme == "bf16":
        return WeightFormat("bf16", ())
    if SCHEMES[scheme].bits == 8:
        return WeightFormat("fp8", ("--quantization", "fp8"), note=(
            f"vLLM quantizes bitsandbytes in flight to 4-bit only (8-bit needs a pre-quantized checkpoint) and has no "
            f"quanto: {scheme} maps to --quantization fp8 (FP8 E4M3 weights, per-tensor scale; W8A16 Marlin below "
            "compute capability 8.9)"))
    note = ("vLLM's in-flight bitsandbytes is NF4 with double quantization whatever the plan's variant"
            if scheme.startswith("bnb-") and scheme != "bnb-nf4-dq" else "")
    if scheme.startswith("quanto"):
        note = f"vLLM has no quanto: {scheme} maps to in-flight bitsandbytes NF4 (double quantization)"
    return WeightFormat("bitsandbytes", ("--quantization", "bitsandbytes"), note=note)


def _tp_fraction(spec: ModelSpec, t: TensorSpec, tp: int) -> float:
    """The share of a tensor one TP rank holds: linears and experts sharded, K/V replicated once TP exceeds the KV
    heads (ModelConfig.get_num_kv_heads: max(1, kv_heads // tp)), vocab-parallel embeddings, the rest replicated."""
    if t.role in (Role.EMBEDDING, Role.LM_HEAD) and len(t.shape) == 2:
        vocab = t.shape[0]
        return (math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING / tp) / vocab
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


# ---------------------------------------------------------------- one layout's memory
@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int
    pp: int
    nodes: int
    gpu_memory_utilization: float
    weights_bytes: int  # the fullest rank's
    activation_bytes: int
    non_torch_bytes: int
    kv_pool_bytes: int  # requested - weights - activation - non_torch
    kv_per_sequence_bytes: int  # blocks for one max_model_len request on the fullest rank's layers
    null_block_bytes: int  # the block BlockPool holds back
    batch: int
    cpu_offload_bytes: int = 0

    @property
    def kv_needed_bytes(self) -> int:
        return self.kv_per_sequence_bytes * self.batch + self.null_block_bytes

    @property
    def fits(self) -> bool:
        return self.gpu_memory_utilization > 0 and self.kv_pool_bytes >= self.kv_needed_bytes

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_model_len the pool holds at once."""
        return max(0, self.kv_pool_bytes - self.null_block_bytes) // max(1, self.kv_per_sequence_bytes)


class VLLMModel:
    """vLLM's bytes for one model, weight format, KV cache dtype and request on one profile."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, req: Request, fmt: WeightFormat, kv_cache: str):
        self.spec, self.hw, self.req, self.fmt, self.kv_cache = spec, hw, req, fmt, kv_cache
        g = hw.gpu
        self.total = g.memory_bytes
        capacity = gpu_capacity(hw, req, 0)
        outside = req.headroom_bytes + hw.overheads.cuda_context_bytes + CUDAGRAPH_BYTES_ASSUMED
        self.utilization = min(1.0, floor_to((capacity - outside) / self.total, 0.01))
        self.layer_tensors = [spec.layer_tensors(i) for i in range(spec.num_layers)]
        self.tokens = _batched_tokens(hw)

    def _rank_weights(self, tp: int, layers: range, first: bool, last: bool) -> int:
        spec = self.spec
        total = sum(self.fmt.tensor_bytes(t) * _tp_fraction(spec, t, tp) for i in layers for t in self.layer_tensors[i])
        for t in spec.non_layer_tensors():  # the embedding on the first stage; lm_head (a tied embedding) and norm last
            on_first = t.role is Role.EMBEDDING
            on_last = t.role is not Role.EMBEDDING or spec.tie_word_embeddings
            if (on_first and first) or (on_last and last):
                total += self.fmt.tensor_bytes(t) * _tp_fraction(spec, t, tp)
        return int(total)

    def _activation(self, tp: int, last: bool) -> int:
        spec, T = self.spec, self.tokens
        act = dtype_bytes(spec.dtype if spec.dtype in ("bfloat16", "float16") else "bfloat16")
        a = spec.attention[0]
        qkv = (a.num_heads + 2 * max(1, a.num_kv_heads // tp) * tp) * a.head_dim // tp
        rows = (PROFILE_HIDDEN_COPIES_ASSUMED * spec.hidden_size + qkv
                + PROFILE_MLP_COPIES_ASSUMED * spec.mlp_width // tp)
        logits = min(_max_num_seqs(self.hw), T) * spec.vocab_size * 4 * PROFILE_LOGITS_COPIES_ASSUMED if last else 0
        return int(T * rows * act + logits)

    def _page(self, tp: int, i: int) -> int:
        """KV_INTERFACE AttentionSpec.real_page_size_bytes of layer i on one rank (MLA: one latent row, no K/V pair)."""
        a = self.spec.attention[i]
        b = KV_CACHE_BYTES[self.kv_cache]
        if a.kind == "mla":
            return BLOCK_SIZE_MLA * a.kv_elements_per_token * b
        return 2 * BLOCK_SIZE * max(1, a.num_kv_heads // tp) * a.head_dim * b

    def _blocks_per_sequence(self, i: int) -> int:
        """KV_INTERFACE Full/SlidingWindowSpec.max_memory_usage_bytes, in blocks, for one max_model_len request
        (what KV_UTILS check_enough_kv_cache_memory requires, besides the null block)."""
        a, ctx = self.spec.attention[i], self.req.context
        block = BLOCK_SIZE_MLA if a.kind == "mla" else BLOCK_SIZE
        if a.window is None:
            return math.ceil(ctx / block)
        return math.ceil(min(a.window - 1 + self.tokens, ctx) / block) + 1

    def layout(self, tp: int, pp: int, nodes: int, cpu_offload_bytes: int = 0) -> Layout:
        """The fullest pipeline stage's rank decides."""
        parts = pp_partitions(self.spec.num_layers, pp)
        worst = None
        start = 0
        for s, n in enumerate(parts):
            layers = range(start, start + n)
            start += n
            w = max(0, self._rank_weights(tp, layers, s == 0, s == pp - 1) - cpu_offload_bytes)
            act = self._activation(tp, s == pp - 1)
            non_torch = NON_TORCH_SINGLE_GPU_BYTES if tp * pp == 1 else NON_TORCH_DISTRIBUTED_BYTES_ASSUMED
            pool = int(self.utilization * self.total) - w - act - non_torch
            per_seq = sum(self._blocks_per_sequence(i) * self._page(tp, i) for i in layers)
            null_block = sum(self._page(tp, i) for i in layers)
            lay = Layout(tp=tp, pp=pp, nodes=nodes, gpu_memory_utilization=self.utilization, weights_bytes=w,
                         activation_bytes=act, non_torch_bytes=non_torch, kv_pool_bytes=pool,
                         kv_per_sequence_bytes=per_seq, null_block_bytes=null_block, batch=self.req.batch,
                         cpu_offload_bytes=cpu_offload_bytes)
            if worst is None or lay.kv_pool_bytes - lay.kv_needed_bytes < worst.kv_pool_bytes - worst.kv_needed_bytes:
                worst = lay
        return worst


def tp_sizes(spec: ModelSpec, gpus: int) -> list[int]:
    """TP sizes vLLM accepts on `gpus` GPUs: they must divide the attention heads
    (ModelConfig.verify_with_parallel_config)."""
    heads = spec.attention[0].num_heads
    return [t for t in range(1, gpus + 1) if heads % t == 0]


def search(m: VLLMModel, gpus_per_node: int, max_nodes: int = MAX_NODES_SEARCHED) -> Layout | None:
    """The smallest layout that fits: one node with the fewest GPUs (TP first, then PP inside the node), else TP over
    each node's GPUs and PP over nodes."""
    spec = m.spec
    tps = tp_sizes(spec, gpus_per_node)
    single = sorted(((tp, pp) for tp in tps for pp in range(1, gpus_per_node // tp + 1)),
                    key=lambda x: (x[0] * x[1], x[1]))
    for tp, pp in single:
        if pp <= spec.num_layers and (lay := m.layout(tp, pp, 1)).fits:
            return lay
    tp = max(tps)
    for nodes in range(2, max_nodes + 1):
        pp = nodes * (gpus_per_node // tp)
        if pp > spec.num_layers:
            break
        if (lay := m.layout(tp, pp, nodes)).fits:
            return lay
    return None


def offloaded_layout(m: VLLMModel, gpus_per_node: int, nodes: int, ram_bytes: int) -> Layout | None:
    """The most parallel layout on `nodes` nodes with just enough weights in RAM (--cpu-offload-gb, in GiB steps)."""
    tp = max(tp_sizes(m.spec, gpus_per_node))
    pp = nodes * (gpus_per_node // tp)
    base = m.layout(tp, pp, nodes)
    missing = base.kv_needed_bytes - base.kv_pool_bytes
    offload = math.ceil(missing / GiB) * GiB
    if missing <= 0 or offload >= base.weights_bytes or offload * gpus_per_node > ram_bytes:
        return None
    lay = m.layout(tp, pp, nodes, cpu_offload_bytes=offload)
    return lay if lay.fits else None


# ---------------------------------------------------------------- the command
def _scheme_and_kv(p: Plan) -> tuple[str, str]:
    if p.fits:
        return p.choice.weight_quant, p.choice.kv_dtype
    r = p.request
    return (r.quant[0] if r.quant else "bf16"), (r.kv_dtype[0] if r.kv_dtype else "bf16")


def export_vllm(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> Export:
    consts = constants(hw)
    req = p.request
    if not hw.has_gpu or hw.accelerator != "cuda":
        why = "has no GPU" if not hw.has_gpu else f"has a {hw.accelerator} GPU"
        notes = [f"vLLM: hardware {hw.name!r} {why}; vramplan plans vLLM on CUDA GPUs only (vLLM's CPU and Apple "
                 "backends are not planned)"]
        return Export(engine=ENGINE, fits=False, text=commented(notes, "# no vllm serve command"), notes=tuple(notes))
    scheme, kv = _scheme_and_kv(p)
    fmt = weight_format(scheme)
    kv_cache = "fp8" if kv == "fp8" else "auto"
    m = VLLMModel(spec, hw, req, fmt, kv_cache)
    gpus = hw.gpu_count
    best = search(m, gpus)
    needed = best.nodes if best is not None else None
    notes = []
    lay = best
    if best is None or best.nodes > req.nodes:
        offloads = p.fits and p.choice.offload is not OffloadMode.NONE
        alt = offloaded_layout(m, gpus, req.nodes, hw.host.ram_bytes) if offloads else None
        if alt is not None:
            lay = alt
            notes.append(f"vLLM fits {req.nodes} node(s) only with {gib(alt.cpu_offload_bytes, 0)} of weights per GPU "
                         "in RAM (--cpu-offload-gb), copied to the GPU on every forward pass" +
                         (f"; without offload it needs {needed} nodes of {hw.name}" if needed else ""))
    if lay is None:
        notes.append(f"vLLM: no layout of up to {MAX_NODES_SEARCHED} nodes of {hw.name} holds {spec.name} at "
                     f"{req.context} tokens x {req.batch}")
        notes += assumption_notes(consts)
        return Export(engine=ENGINE, fits=False, text=commented(notes, "# no vllm serve command"), notes=tuple(notes),
                      constants=consts, details={"nodes_needed": None})
    if lay.cpu_offload_bytes == 0 and lay.nodes > req.nodes:
        notes.append(f"needs {lay.nodes} nodes of {hw.name} (--nodes {req.nodes} given): run it on {lay.nodes}")
    argv = ["vllm", "serve", spec.name, "--max-model-len", str(req.context),
            "--gpu-memory-utilization", f"{lay.gpu_memory_utilization:.2f}", "--kv-cache-dtype", kv_cache, *fmt.args]
    if lay.tp > 1:
        argv += ["--tensor-parallel-size", str(lay.tp)]
    if lay.pp > 1:
        argv += ["--pipeline-parallel-size", str(lay.pp)]
    if lay.nodes > 1:
        argv += ["--distributed-executor-backend", "ray"]
        notes.append(f"start a Ray cluster over the {lay.nodes} nodes first (ray start --head on one, ray start "
                     "--address=<head>:6379 on the others); TP inside each node, PP across nodes")
    if lay.cpu_offload_bytes:
        argv += ["--cpu-offload-gb", str(lay.cpu_offload_bytes // GiB)]
    notes += _differences(spec, hw, p, m, lay, fmt, kv, consts)
    return Export(engine=ENGINE, fits=lay.fits and lay.nodes <= req.nodes,
                  text=commented(notes, shell_command(argv)), notes=tuple(notes), constants=consts,
                  details={"argv": argv, "tensor_parallel_size": lay.tp, "pipeline_parallel_size": lay.pp,
                           "nodes": lay.nodes, "nodes_needed": needed,
                           "gpu_memory_utilization": lay.gpu_memory_utilization,
                           "per_gpu": {"weights_bytes": lay.weights_bytes, "activation_bytes": lay.activation_bytes,
                                       "non_torch_bytes": lay.non_torch_bytes, "kv_pool_bytes": lay.kv_pool_bytes,
                                       "kv_needed_bytes": lay.kv_needed_bytes,
                                       "cpu_offload_bytes": lay.cpu_offload_bytes},
                           "max_concurrency": lay.max_concurrency})


def _differences(spec, hw, p: Plan, m: VLLMModel, lay: Layout, fmt: WeightFormat, kv: str, consts) -> list[str]:
    req = p.request
    out = [f"vLLM per GPU ({lay.tp} TP x {lay.pp} PP on {lay.nodes} node(s)): {lay.gpu_memory_utilization:.2f} x "
           f"{format_bytes(m.total)} = weights {format_bytes(lay.weights_bytes)} + profile-run peak "
           f"{format_bytes(lay.activation_bytes)} + non-torch {format_bytes(lay.non_torch_bytes)} + KV pool "
           f"{format_bytes(lay.kv_pool_bytes)}; the rest holds the CUDA context "
           f"{format_bytes(hw.overheads.cuda_context_bytes)}, CUDA graphs {format_bytes(CUDAGRAPH_BYTES_ASSUMED)} and "
           f"your headroom {format_bytes(req.headroom_bytes)}",
           f"the KV pool is cut in {BLOCK_SIZE_MLA if spec.attention[0].kind == 'mla' else BLOCK_SIZE}-token blocks; "
           f"{format_bytes(lay.kv_needed_bytes)} hold {req.batch} "
           f"sequence(s) of {req.context} tokens; the pool holds about {lay.max_concurrency}",
           "vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures "
           "above are estimates (see the assumptions)"]
    if fmt.note:
        out.append(fmt.note)
    if kv.startswith("quanto"):
        out.append(f"vLLM has no quanto KV cache: the plan's {kv} becomes --kv-cache-dtype auto (the model dtype)")
    if p.fits and p.choice.expert_placement not in (None, "gpu"):
        out.append("vLLM has no expert offload: every GPU holds its TP share of all experts")
    if spec.moe is not None and fmt.name == "bitsandbytes":
        out.append("MoE experts are counted unquantized: vLLM's bitsandbytes support for fused experts varies by model")
    if p.fits and p.choice.offload is not OffloadMode.NONE and not lay.cpu_offload_bytes:
        out.append(f"vramplan's runtime offloads {p.choice.offloaded_layers} layers on {hw.name}; vLLM spreads the "
                   "model over GPUs instead")
    out += assumption_notes(consts)
    return out
