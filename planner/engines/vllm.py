"""The `vllm serve` command for a plan, by vLLM 0.33.0's own rules (planner/engines/vllm_rules.py): weights, budget
and KV cache per GPU, TP/PP over GPUs and nodes (Ray), weights in RAM when the nodes are too few.

Per GPU worker (vllm_rules' docstring has the sources):
  outside gpu_memory_utilization:  CUDA context, NCCL buffers (both before vLLM's memory snapshot), your headroom
  inside:  weights + profile-run peak + non-torch growth + CUDA graphs (estimated and subtracted since
           VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1) + the KV pool
The pool must hold one request of max_model_len in every KV cache group, plus the null block. The profile-run peak,
the non-torch growth, NCCL and the CUDA graphs are measured by vLLM at start-up; here they are estimates, named as
assumptions and said so in the output. Pure.
"""

from __future__ import annotations

import math
from itertools import accumulate
from dataclasses import dataclass, field, replace

from ..record import record
from ..choice import OffloadMode
from ..hardware import HardwareProfile
from ..capacity import capacity
from ..memory import gpu_capacity
from ..modelspec import Kind, ModelSpec, Role, TensorSpec, dtype_bytes
from ..plan import Candidate, Plan
from ..preference import choose_by_preference
from ..quant import SCHEMES
from ..request import Request
from ..speed import compiled_scheme, estimate_compiled, fitted_entry
from ..units import GiB, MiB, format_bytes
from . import vllm_rules as rules
from .common import (EngineAnswer, EngineConstant, Export, assumption_notes, commented, floor_to, gib,
                     model_location, shell_command)
from .vllm_rules import (KV_CACHE_BYTES, VLLM_VERSION, LayerKV, WeightFormat, kv_groups,
                         kv_request_bytes, pp_partitions, tp_fraction, tp_sizes)

ENGINE = "vllm"
# Nodes to try before saying a model needs more.
MAX_NODES_SEARCHED = 64

# Estimates of what vLLM measures (assumptions):
# - profile run: max_num_batched_tokens through the model, then the sampler on min(max_num_seqs, tokens) rows;
#   alive at the peak: these many hidden-size rows, the fused gate_up + activation rows, q/k/v, and the fp32
#   logits this many times (logits, softmax/probs).
PROFILE_HIDDEN_COPIES_ASSUMED = 4
PROFILE_MLP_COPIES_ASSUMED = 3
PROFILE_LOGITS_COPIES_ASSUMED = 2
# - non-torch memory that grows after the snapshot (attention workspaces, lazily connected NCCL channels): 0.16 GiB in
#   the single-GPU logs of kubernetes-sigs/gateway-api-inference-extension#550 and generative-computing/mellea#416;
#   0.55 GiB at TP 2 in llm-d's table (planner/public_gpu/records.jsonl llmd-h100-llama33-70b-fp8-tp2; vLLM version
#   not stated).
NON_TORCH_SINGLE_GPU_BYTES = int(0.16 * GiB)
NON_TORCH_DISTRIBUTED_BYTES_ASSUMED = int(0.55 * GiB)
# - NCCL's communicators, set up before the snapshot (gpu_worker init_device: "NCCL buffers are allocated before we
#   measure"), so outside the budget: llm-d's H100 runs start with 78.57 of 79.18 GiB free at TP 1 and 77.64 at TP 2
#   (records llmd-h100-llama31-8b, llmd-h100-llama33-70b-fp8-tp2): 0.93 GiB more, rounded up.
NCCL_BYTES_ASSUMED = 1 * GiB
# - vLLM's total is CUDA's (MemorySnapshot: torch.accelerator.get_memory_info), less than the NVML total a profile
#   holds: llm-d's H100 logs say 79.18 GiB total (NVML: 81559 MiB = 79.65 GiB), vllm-project/vllm#10517's RTX 3090
#   23.58 GiB (NVML: 24.00 GiB): 0.42-0.47 GiB hidden, rounded up.
CUDA_HIDDEN_BYTES_ASSUMED = 512 * MiB
# - CUDA graphs, estimated by vLLM before the KV cache (profile_cudagraph_memory) and subtracted from it: vLLM logs 0.10
#   to 1.03 GiB in llm-d's table (0.6B to 120B models); 1 GiB per GPU assumed.
CUDAGRAPH_BYTES_ASSUMED = 1 * GiB


def constants(hw: HardwareProfile, distributed: bool = True) -> dict[str, EngineConstant]:
    """The constants an export used (the NCCL and distributed ones only with several ranks)."""
    g = hw.gpu
    out = {
        "vllm_version": EngineConstant(VLLM_VERSION, rules.src("vllm/_version.py")),
        "default_gpu_memory_utilization": EngineConstant(rules.DEFAULT_GPU_MEMORY_UTILIZATION,
                                                         f"{rules.CACHE_PY}: CacheConfig"),
        "block_size": EngineConstant(rules.BLOCK_SIZE, f"{rules.CACHE_PY}: CacheConfig.DEFAULT_BLOCK_SIZE (an MLA "
                                     "backend may raise it: vllm_rules.attention_backend)"),
        "vocab_padding": EngineConstant(rules.VOCAB_PADDING, f"{rules.VOCAB_PY}: DEFAULT_VOCAB_PADDING_SIZE"),
        "cuda_context_bytes": EngineConstant(hw.overheads.cuda_context_bytes if hw.has_gpu else 0,
                                             f"profile {hw.name}: overheads.cuda_context"),
        "profile_run_copies": EngineConstant(f"{PROFILE_HIDDEN_COPIES_ASSUMED} hidden, {PROFILE_MLP_COPIES_ASSUMED} "
                                             f"MLP, {PROFILE_LOGITS_COPIES_ASSUMED} fp32 logits rows per token",
                                             "estimate of vLLM's measured profile-run activation peak",
                                             assumption=True),
        "non_torch_bytes": EngineConstant(NON_TORCH_SINGLE_GPU_BYTES, "vLLM start-up logs (single GPU): "
                                          "kubernetes-sigs/gateway-api-inference-extension#550, "
                                          "generative-computing/mellea#416"),
        "cuda_hidden_bytes": EngineConstant(CUDA_HIDDEN_BYTES_ASSUMED, "NVML's total less CUDA's, which vLLM uses: "
                                            "0.47 GiB on llm-d's H100s, 0.42 GiB on a 3090 (vllm-project/vllm#10517)",
                                            assumption=True),
        "cudagraph_bytes": EngineConstant(CUDAGRAPH_BYTES_ASSUMED, "CUDA graphs per GPU, estimated by vLLM and taken "
                                          "from the KV pool (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 by default, "
                                          "vllm/envs.py)", assumption=True),
    }
    if distributed:
        out["non_torch_distributed_bytes"] = EngineConstant(NON_TORCH_DISTRIBUTED_BYTES_ASSUMED, "non-torch growth "
                                                            "after the snapshot at TP 2 (llm-d's table, vLLM version "
                                                            "not stated)", assumption=True)
        out["nccl_bytes"] = EngineConstant(NCCL_BYTES_ASSUMED, "NCCL, set up before vLLM's snapshot: outside "
                                           "gpu_memory_utilization (vllm/v1/worker/gpu_worker.py init_device); 0.93 "
                                           "GiB in llm-d's TP 1 vs TP 2 start-up free memory", assumption=True)
    if g is not None:
        tokens, seqs = rules.BATCH_DEFAULTS[rules.batch_tier(g)]
        out["max_num_batched_tokens"] = EngineConstant(tokens, f"{rules.ARG_UTILS}: get_batch_defaults "
                                                       "(OPENAI_API_SERVER)")
        out["max_num_seqs"] = EngineConstant(seqs, f"{rules.ARG_UTILS}: get_batch_defaults")
    return out


def weight_format(scheme: str, spec: ModelSpec | None = None) -> WeightFormat | None:
    """How vLLM holds the weights of a plan in `scheme`: a pre-quantized checkpoint as it is (None where vramplan does
    not size its layout), else the scheme's closest online format (vllm_rules)."""
    if spec is not None and rules.checkpoint_quantization(spec) is not None:
        return rules.checkpoint_format(spec)
    return rules.online_format(scheme, SCHEMES[scheme].bits)


# ---------------------------------------------------------------- one layout's memory
@record(kw_only=True)
class Layout:
    """One vLLM layout: tensor and pipeline parallel sizes, nodes, and its memory per GPU."""

    tp: int
    pp: int
    nodes: int
    gpu_memory_utilization: float
    weights_bytes: int  # the fullest rank's
    activation_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int
    kv_pool_bytes: int  # requested - weights - activation - non_torch - cudagraph
    kv_per_sequence_bytes: int  # one max_model_len request, every KV cache group, on the fullest rank's layers
    null_block_bytes: int  # the block BlockPool holds back
    batch: int
    cpu_offload_bytes: int = 0
    cpu_offload_params: tuple[str, ...] = ()

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
        self.total = g.memory_bytes - CUDA_HIDDEN_BYTES_ASSUMED  # what vLLM multiplies gpu_memory_utilization by
        self.capacity = gpu_capacity(hw, req, 0)
        self.layer_tensors = [spec.layer_tensors(i) for i in range(spec.num_layers)]
        self._kv_groups: dict[int, list] = {}  # per TP size: the layout search tries each size at several stages
        self._per_layer: dict[int, list[float]] = {}
        self._prefix: dict[int, list[float]] = {}  # per TP size: the layers' bytes summed from the first
        self.tokens = rules.max_num_batched_tokens(g, req.context)

    def utilization(self, distributed: bool) -> float:
        """The --gpu-memory-utilization that leaves the CUDA context, NCCL (with several ranks) and the headroom
        outside vLLM's budget, of what CUDA reports."""
        outside = self.req.headroom_bytes + self.hw.overheads.cuda_context_bytes + (
            NCCL_BYTES_ASSUMED if distributed else 0)
        return min(1.0, floor_to((min(self.capacity, self.total) - outside) / self.total, 0.01))

    def _rank_bytes(self, t: TensorSpec, tp: int) -> float:
        """One TP rank's bytes of a tensor: MXFP4 experts padded as the MoE backend pads them, the rest its share."""
        if self.fmt.encoding == "mxfp4" and t.kind is Kind.EXPERTS:
            padded = rules.mxfp4_expert_rank_bytes(self.spec, t, tp, self.hw.gpu)
            if padded is not None:
                return padded
        return self.fmt.tensor_bytes(t) * tp_fraction(self.spec, t, tp)

    def _layer_weights(self, tp: int) -> list[float]:
        """Each decoder layer's bytes on one rank at this TP size (computed once per size: the layout search asks for
        every range of layers at every size), once per distinct layer (ModelSpec.per_layer: equal shapes, kinds and
        roles; the K/V heads a rank keeps follow the shapes)."""
        if tp not in self._per_layer:
            self._per_layer[tp] = self.spec.per_layer(lambda tensors: sum(self._rank_bytes(t, tp) for t in tensors))
        return self._per_layer[tp]

    def _rank_weights(self, tp: int, layers: range, first: bool, last: bool) -> int:
        spec = self.spec
        if tp not in self._prefix:  # a stage's layers by prefix sums: a search over pipeline sizes asks for every stage
            self._prefix[tp] = list(accumulate(self._layer_weights(tp), initial=0))
        total = self._prefix[tp][layers.stop] - self._prefix[tp][layers.start]
        for t in spec.non_layer_tensors():  # the embedding on the first stage; lm_head (a tied embedding) and norm last
            on_first = t.role is Role.EMBEDDING
            on_last = t.role is not Role.EMBEDDING or spec.tie_word_embeddings
            if (on_first and first) or (on_last and last):
                total += self.fmt.tensor_bytes(t) * tp_fraction(spec, t, tp)
        return int(total)

    def _rank_expert_weights(self, tp: int, layers: range) -> int:
        """The routed experts' bytes on one rank: what --cpu-offload-params experts can move to RAM."""
        return int(sum(self._rank_bytes(t, tp) for i in layers for t in self.layer_tensors[i]
                       if t.kind is Kind.EXPERTS))

    def _activation(self, tp: int, last: bool) -> int:
        spec, T = self.spec, self.tokens
        act = dtype_bytes(spec.dtype if spec.dtype in ("bfloat16", "float16") else "bfloat16")
        a = spec.attention[0]
        qkv = (a.num_heads + 2 * max(1, a.num_kv_heads // tp) * tp) * a.head_dim // tp
        rows = (PROFILE_HIDDEN_COPIES_ASSUMED * spec.hidden_size + qkv
                + PROFILE_MLP_COPIES_ASSUMED * spec.mlp_width // tp)
        logits = min(rules.max_num_seqs(self.hw.gpu), T) * spec.vocab_size * 4 * PROFILE_LOGITS_COPIES_ASSUMED \
            if last else 0
        return int(T * rows * act + logits)

    def attention_backend(self) -> tuple[str, int]:
        """The attention backend vLLM picks here and its KV block (vllm_rules.attention_backend)."""
        a = self.spec.attention[0]
        nope = a.head_dim - a.mla_rope_dim if a.kind == "mla" and a.mla_rope_dim is not None else None
        return rules.attention_backend(self.hw.gpu, a.kind == "mla", self.kv_cache, nope)

    def layer_kv(self, tp: int) -> list[LayerKV]:
        """Each layer's KV spec on one rank (KV_INTERFACE real_page_size_bytes: K and V of max(1, kv_heads // tp)
        heads per token; MLA one latent row of kv_lora_rank + rope dims, replicated on every rank), in blocks of the
        attention backend's size."""
        b = KV_CACHE_BYTES[self.kv_cache]
        block = self.attention_backend()[1]
        out = []
        for a in self.spec.attention:
            if a.kind == "mla":
                out.append(LayerKV(None, block * a.kv_elements_per_token * b, block))
            else:
                out.append(LayerKV(a.window, 2 * block * max(1, a.num_kv_heads // tp) * a.head_dim * b, block,
                                   a.chunked))
        return out

    def layout(self, tp: int, pp: int, nodes: int, cpu_offload_bytes: int = 0,
               cpu_offload_params: tuple[str, ...] = (), util: float | None = None) -> Layout:
        """The fullest pipeline stage's rank decides; at `util`, or at the most the GPU leaves (utilization)."""
        if tp not in self._kv_groups:
            self._kv_groups[tp] = kv_groups(self.layer_kv(tp))
        groups = self._kv_groups[tp]
        in_flight = rules.max_in_flight_tokens(pp, self.tokens)
        distributed = tp * pp > 1
        util = self.utilization(distributed) if util is None else util
        parts = pp_partitions(self.spec.num_layers, pp)
        worst = None
        start = 0
        for s, n in enumerate(parts):
            layers = range(start, start + n)
            start += n
            w = max(0, self._rank_weights(tp, layers, s == 0, s == pp - 1) - cpu_offload_bytes)
            act = self._activation(tp, s == pp - 1)
            non_torch = NON_TORCH_DISTRIBUTED_BYTES_ASSUMED if distributed else NON_TORCH_SINGLE_GPU_BYTES
            pool = math.ceil(util * self.total) - w - act - non_torch - CUDAGRAPH_BYTES_ASSUMED
            per_seq, per_block = kv_request_bytes(groups, layers, self.req.context, in_flight)
            lay = Layout(tp=tp, pp=pp, nodes=nodes, gpu_memory_utilization=util, weights_bytes=w,
                         activation_bytes=act, non_torch_bytes=non_torch, cudagraph_bytes=CUDAGRAPH_BYTES_ASSUMED,
                         kv_pool_bytes=pool, kv_per_sequence_bytes=per_seq, null_block_bytes=per_block,
                         batch=self.req.batch, cpu_offload_bytes=cpu_offload_bytes,
                         cpu_offload_params=cpu_offload_params)
            if worst is None or lay.kv_pool_bytes - lay.kv_needed_bytes < worst.kv_pool_bytes - worst.kv_needed_bytes:
                worst = lay
        return worst


def settled(m: VLLMModel, lay: Layout | None) -> Layout | None:
    """A layout that fits, at vLLM's default --gpu-memory-utilization where its KV pool still holds the request,
    else at the least utilization (in 0.01 steps) that holds it: what the GPU leaves beyond it stays free for other
    processes."""
    if lay is None or not lay.fits or lay.gpu_memory_utilization <= rules.DEFAULT_GPU_MEMORY_UTILIZATION:
        return lay
    args = (lay.tp, lay.pp, lay.nodes, lay.cpu_offload_bytes, lay.cpu_offload_params)
    short = lay.kv_needed_bytes - lay.kv_pool_bytes  # <= 0: what the layout has to spare at its utilization
    u = max(rules.DEFAULT_GPU_MEMORY_UTILIZATION,
            math.ceil(round((lay.gpu_memory_utilization * m.total + short) / m.total, 6) * 100) / 100)
    while u < lay.gpu_memory_utilization:
        if (tried := m.layout(*args, util=u)).fits:
            return tried
        u = round(u + 0.01, 2)
    return lay


# vLLM's guidance for one model replica (docs/serving/parallelism_scaling.md, "Distributed inference strategies for a
# single-model replica"): one GPU where the model fits on one; else tensor parallel over the node's GPUs; else TP over
# each node's GPUs and pipeline parallel over the nodes.
PARALLELISM_GUIDE = "vLLM docs serving/parallelism_scaling.md (single-model replica strategies)"


def search(m: VLLMModel, gpus_per_node: int, max_nodes: int = MAX_NODES_SEARCHED) -> Layout | None:
    """The layout vLLM's guide gives (PARALLELISM_GUIDE): one GPU if the model fits on it; else every GPU of the node,
    TP as large as vLLM accepts (tp_sizes) and PP over the rest; else the other single-node layouts, fewest GPUs first;
    else TP over each node's GPUs and PP over nodes."""
    spec = m.spec
    tps = tp_sizes(spec, gpus_per_node)
    whole_node = [(tp, gpus_per_node // tp) for tp in sorted(tps, reverse=True) if gpus_per_node % tp == 0]
    single = [(1, 1), *whole_node, *sorted(((tp, pp) for tp in tps for pp in range(1, gpus_per_node // tp + 1)),
                                           key=lambda x: (x[0] * x[1], x[1]))]
    single = list(dict.fromkeys(single))
    for tp, pp in single:
        if pp <= spec.num_layers and (lay := m.layout(tp, pp, 1)).fits:
            return settled(m, lay)
    tp = max(tps)
    for nodes in range(2, max_nodes + 1):
        pp = nodes * (gpus_per_node // tp)
        if pp > spec.num_layers:
            break
        if (lay := m.layout(tp, pp, nodes)).fits:
            return settled(m, lay)
    return None


def offloaded_layout(m: VLLMModel, gpus_per_node: int, nodes: int, ram_bytes: int,
                     params: tuple[str, ...] = ()) -> Layout | None:
    """The most parallel layout on `nodes` nodes with just enough weights in RAM, in GiB steps: --cpu-offload-gb (UVA,
    CONFIG_OFFLOAD / UVA_PY: pinned RAM the GPU reads in place, parameters taken in model order until the amount is
    reached), only the parameters named by --cpu-offload-params (e.g. the routed experts) when `params` is given."""
    tp = max(tp_sizes(m.spec, gpus_per_node))
    pp = nodes * (gpus_per_node // tp)
    if pp > m.spec.num_layers:
        return None
    base = m.layout(tp, pp, nodes)
    missing = base.kv_needed_bytes - base.kv_pool_bytes
    offload = math.ceil(missing / GiB) * GiB
    parts = pp_partitions(m.spec.num_layers, pp)
    movable = base.weights_bytes if not params else min(
        m._rank_expert_weights(tp, range(sum(parts[:s]), sum(parts[:s + 1]))) for s in range(pp))
    if missing <= 0 or offload >= movable or offload * gpus_per_node > ram_bytes:
        return None
    lay = m.layout(tp, pp, nodes, cpu_offload_bytes=offload, cpu_offload_params=params)
    return settled(m, lay) if lay.fits else None


# ---------------------------------------------------------------- the command
def _refuse(notes: list[str], consts=None, **details) -> Export:
    return Export(engine=ENGINE, fits=False, text=commented(notes, "# no vllm serve command"), notes=tuple(notes),
                  constants=consts or {}, details=details)


def _cannot_run(spec: ModelSpec, hw: HardwareProfile, fmt: WeightFormat | None) -> str:
    """Why vLLM 0.33 cannot run these weights on this GPU ('' where it can)."""
    method = rules.checkpoint_quantization(spec)
    if fmt is None and method is not None:
        if method not in rules.QUANTIZATION_METHODS:
            return (f"{spec.name}'s checkpoint is quantized with {method}, which vLLM {VLLM_VERSION} does not know "
                    f"(QuantizationMethods, {rules.QUANT_INIT}): vLLM cannot run it")
        return (f"{spec.name}'s checkpoint is quantized with {method}: vLLM loads it as it is, in a layout vramplan "
                "does not size; no command is written")
    cc = hw.gpu.capability
    if fmt is not None and fmt.min_capability and cc is not None:
        if 10 * cc[0] + cc[1] < fmt.min_capability:
            return (f"vLLM {VLLM_VERSION}'s {fmt.name} needs compute capability {fmt.min_capability / 10:g} or "
                    f"more; {hw.gpu.name} has {hw.gpu.compute_capability}: vLLM cannot run this plan on this card")
    return ""


# OLLAMA-like vocabulary of the request: vLLM's formats are its own names (planner.formats); a --quant or --kv-dtype
# given in another engine's words is its nearest vLLM format.
ONLINE_FORMATS = ("bf16", "fp8_per_tensor", "mxfp4")
ONLINE_BITS = {"bf16": 16, "fp16": 16, "fp8_per_tensor": 8, "mxfp4": 4}
KV_CACHES = ("auto", "fp8")


@dataclass(kw_only=True)
class VLLMAnswer:
    """One vLLM weight format x KV cache for a request: the layout chosen (None: none), the nodes it needs without
    weight offload, its quality cost and predicted speed (None where vramplan does not predict vLLM's decode), and the
    notes so far; `refused` says why no command can be written."""

    fmt: WeightFormat | None = None
    kv_cache: str = "auto"
    model: VLLMModel | None = None
    layout: Layout | None = None
    needed: int | None = None
    notes: list = field(default_factory=list)
    refused: str = ""
    no_gpu: bool = False  # refused before anything of vLLM's applies: no CUDA GPU
    quality_cost_pct: float = 0.0
    speed: object = None  # a SpeedEstimate, or None
    speed_from: str = ""

    @property
    def fits(self) -> bool:
        return not self.refused and self.layout is not None and self.layout.fits and \
            self.layout.nodes <= self.model.req.nodes


def vllm_formats(spec: ModelSpec, hw: HardwareProfile, req: Request) -> tuple[list[WeightFormat], list[str], list[str]]:
    """The weight formats and KV caches vLLM's own search tries for the request, and how a forced --quant or --kv-dtype
    was put in vLLM's words: a pre-quantized checkpoint as it is (vLLM refuses another --quantization), else every
    online format of a bf16/fp16 checkpoint."""
    from ..formats import KV, WEIGHTS, nearest

    notes = []
    names = tuple(dict.fromkeys(nearest(q, WEIGHTS, req.engine, ENGINE) for q in req.quant)) or ONLINE_FORMATS
    kvs = tuple(dict.fromkeys(nearest(k, KV, req.engine, ENGINE) for k in req.kv_dtype)) or KV_CACHES
    if req.quant and names != req.quant:
        notes.append(f"--quant {','.join(req.quant)} as vLLM's {','.join(names)}")
    if rules.checkpoint_quantization(spec) is not None:
        return [weight_format("bf16", spec)], list(kvs), notes
    sources = dict(zip(names, req.quant)) if req.quant else {}
    return [rules.online_format(sources.get(n, n) if n not in ("bf16", "fp16") else n, ONLINE_BITS[n]) for n in names
            ], list(kvs), notes


def vllm_option(spec: ModelSpec, hw: HardwareProfile, req: Request, fmt: WeightFormat | None,
                kv_cache: str) -> VLLMAnswer:
    """One format x cache: the smallest layout that fits on the nodes given, else with weights in RAM
    (--cpu-offload-gb; routed experts first) where the format allows it, priced where vramplan can."""
    if why := _cannot_run(spec, hw, fmt):
        return VLLMAnswer(fmt=fmt, kv_cache=kv_cache, refused=why)
    m = VLLMModel(spec, hw, req, fmt, kv_cache)
    best = search(m, hw.gpu_count)
    needed = best.nodes if best is not None else None
    notes: list[str] = []
    lay = best
    if best is None or best.nodes > req.nodes:
        lay, said = _with_offload(m, hw, best, needed)
        notes += said
    a = VLLMAnswer(fmt=fmt, kv_cache=kv_cache, model=m, layout=lay, needed=needed, notes=notes,
                   quality_cost_pct=_quality(spec, fmt, kv_cache))
    if lay is None:
        a.refused = (f"vLLM: no layout of up to {MAX_NODES_SEARCHED} nodes of {hw.name} holds {spec.name} at "
                     f"{req.context} tokens x {req.batch}")
    elif a.fits:
        a.speed, a.speed_from = _price(spec, hw, req, fmt, lay)
    return a


def _quality(spec: ModelSpec, fmt: WeightFormat, kv_cache: str) -> float:
    """Perplexity over bf16 (planner.formats): a pre-quantized checkpoint is the model as published (0)."""
    from ..formats import KV, WEIGHTS, format_of

    weights = (fmt.stored.quality.ppl_increase_pct if fmt.stored is not None else 0.0 if fmt.name.startswith(
        "checkpoint") else format_of(ENGINE, WEIGHTS, fmt.name).quality_cost_pct)
    return weights + format_of(ENGINE, KV, kv_cache).quality_cost_pct


def _price(spec: ModelSpec, hw: HardwareProfile, req: Request, fmt: WeightFormat, lay: Layout):
    """(speed, where it comes from): a compiled decode of the same bits where vLLM runs on one GPU and the profile has
    fitted compiled constants (the defaults would price CUDA graphs below eager decode); else (None, why not)."""
    bits = COMPILED_BITS.get(fmt.name) or ((min(fmt.stored.bits, 8), fmt.stored.group_size if fmt.stored.bits == 4
                                            else None) if fmt.stored is not None and fmt.stored.bits in (4, 8)
                                           else None)
    if bits is None:
        return None, f"not predicted: no compiled decode of {fmt.name}"
    if lay.tp * lay.pp * lay.nodes > 1 or lay.cpu_offload_bytes:
        return None, "not predicted: vramplan has no model of vLLM's multi-GPU or offloaded decode"
    # (vLLM's fused MoE kernels run a layer's routed experts in one call, in every format)
    if fitted_entry(hw, "gpu", scheme := compiled_scheme(*bits, groups_experts=True)) is None:
        return None, (f"not predicted: profile {hw.name} has no compiled-decode constants for {scheme.name} (the "
                      "public compiled runs are on HBM GPUs)")
    return estimate_compiled(spec, hw, req, scheme), SPEED_FROM


def vllm_best(spec: ModelSpec, hw: HardwareProfile, req: Request) -> VLLMAnswer:
    """vLLM's own answer to the request: every format x cache it can run here, the one the request's preference picks
    among those that fit (its quality floor, planner.preference), else the first one asked for, with why."""
    if not hw.has_gpu or hw.accelerator != "cuda":
        why = "has no GPU" if not hw.has_gpu else f"has a {hw.accelerator} GPU"
        return VLLMAnswer(no_gpu=True, refused=f"vLLM: hardware {hw.name!r} {why}; vramplan plans vLLM on CUDA GPUs "
                                               "only (vLLM's CPU and Apple backends are not planned)")
    fmts, kvs, said = vllm_formats(spec, hw, req)
    options = [vllm_option(spec, hw, req, f, k) for f in fmts for k in kvs]
    cands = [Candidate(weight_quant=o.fmt.name if o.fmt else "-", kv_dtype=o.kv_cache,
                       quality_cost_pct=o.quality_cost_pct, fits=o.fits, speed=o.speed, reason=_placement(o))
             for o in options]
    if not any(c.fits for c in cands):
        laid = [o for o in options if o.layout is not None]  # the fewest nodes, then the best quality
        best = min(laid, key=lambda o: (o.layout.nodes, o.quality_cost_pct)) if laid else options[0]
    else:
        if not any(c.fits and c.speed is not None for c in cands):  # nothing priced: the quality floor, then
            floor = req.balanced_max_quality_cost_pct                   # weights in RAM only if need be
            kept = [c for c in cands if c.fits and c.quality_cost_pct <= floor] or [c for c in cands if c.fits]
            resident = [c for c, o in zip(cands, options) if c in kept and not o.layout.cpu_offload_bytes]
            cands = [c if c in (resident or kept) else replace(c, fits=False) for c in cands]
        chosen, reasons = choose_by_preference(cands, req)
        best = options[cands.index(chosen)]
        best.notes = [*said, f"vLLM's own choice among {len(options)} formats x caches: {reasons[0]}", *best.notes]
    return best


def _placement(o: VLLMAnswer) -> str:
    lay = o.layout
    if lay is None:
        return o.refused
    return (f"TP {lay.tp} x PP {lay.pp}" + (f" over {lay.nodes} nodes" if lay.nodes > 1 else "")
            + (f", {format_bytes(lay.cpu_offload_bytes)}/GPU in RAM" if lay.cpu_offload_bytes else "")
            + f", utilization {lay.gpu_memory_utilization:.2f}")


def vllm_layout(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> VLLMAnswer:
    """vLLM's own answer to a plan's request (its row in the engine table and what --emit vllm writes)."""
    return vllm_best(spec, hw, p.request)


def export_vllm(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> Export:
    req = p.request
    a = vllm_layout(spec, hw, p)
    if a.refused:
        if a.no_gpu:  # no CUDA GPU: nothing of vLLM's applies
            return _refuse([a.refused])
        consts = constants(hw)
        return _refuse(a.notes + [a.refused, *assumption_notes(consts)], consts, nodes_needed=None)
    lay, fmt, kv_cache, m, needed, notes = a.layout, a.fmt, a.kv_cache, a.model, a.needed, list(a.notes)
    consts = constants(hw, distributed=lay.tp * lay.pp > 1)
    if lay.cpu_offload_bytes == 0 and lay.nodes > req.nodes:
        notes.append(f"needs {lay.nodes} nodes of {hw.name} (--nodes {req.nodes} given): run it on {lay.nodes}")
    argv = _argv(spec, req, lay, fmt, kv_cache)
    if lay.nodes > 1:
        notes.append(f"start a Ray cluster over the {lay.nodes} nodes first (ray start --head on one, ray start "
                     "--address=<head>:6379 on the others); TP inside each node, PP across nodes")
    notes += _differences(spec, hw, p, m, lay, fmt, kv_cache, consts)
    return Export(engine=ENGINE, fits=a.fits,
                  text=commented(notes, shell_command(argv)), notes=tuple(notes), constants=consts,
                  details={"vllm_version": VLLM_VERSION, "argv": argv, "tensor_parallel_size": lay.tp,
                           "pipeline_parallel_size": lay.pp, "nodes": lay.nodes, "nodes_needed": needed,
                           "gpu_memory_utilization": lay.gpu_memory_utilization,
                           "weight_format": fmt.name, "kv_cache_dtype": kv_cache,
                           "per_gpu": {"weights_bytes": lay.weights_bytes, "activation_bytes": lay.activation_bytes,
                                       "non_torch_bytes": lay.non_torch_bytes,
                                       "cudagraph_bytes": lay.cudagraph_bytes, "kv_pool_bytes": lay.kv_pool_bytes,
                                       "kv_needed_bytes": lay.kv_needed_bytes,
                                       "cpu_offload_bytes": lay.cpu_offload_bytes},
                           "max_concurrency": lay.max_concurrency})


def vllm_command(spec: ModelSpec, p: Plan, a: VLLMAnswer) -> list[str]:
    """The `vllm serve` argv of an answer with a layout."""
    return _argv(spec, p.request, a.layout, a.fmt, a.kv_cache)


def _with_offload(m: VLLMModel, hw: HardwareProfile, best: Layout | None,
                  needed: int | None) -> tuple[Layout | None, list[str]]:
    """Where the nodes given are too few: vLLM's weight offload on those nodes (an MoE's routed experts first), if it
    fits; else the layout without it."""
    req = m.req
    if m.fmt.online:
        return best, [f"vLLM's weight offload copies each layer's parameters to RAM as the layer is built "
                      f"({rules.UVA_PY}), before --quantization {m.fmt.name} has quantized them (they are still on "
                      "the meta device then): the two do not combine, so no --cpu-offload-gb here"]
    ram = capacity(hw, req).ram_bytes
    tries = [("experts",), ()] if m.spec.moe is not None else [()]
    alt = next((lay for params in tries if (lay := offloaded_layout(m, hw.gpu_count, req.nodes, ram, params=params))
                is not None), None)
    if alt is None:
        return best, []
    what = "of routed experts" if alt.cpu_offload_params else "of weights"
    return alt, [f"vLLM fits {req.nodes} node(s) only with {gib(alt.cpu_offload_bytes, 0)} {what} per GPU in RAM "
                 "(--cpu-offload-gb: pinned RAM the GPU reads over the host link on every forward pass)"
                 + (f"; without offload it needs {needed} nodes of {hw.name}" if needed else "")]


def _argv(spec: ModelSpec, req: Request, lay: Layout, fmt: WeightFormat, kv_cache: str) -> list[str]:
    limit, _ = rules.derived_max_model_len(spec)
    env = [f"{rules.ALLOW_LONG_MAX_MODEL_LEN}=1"] if limit and req.context > limit else []
    argv = [*env, "vllm", "serve", model_location(spec), "--max-model-len", str(req.context),
            "--gpu-memory-utilization", f"{lay.gpu_memory_utilization:.2f}", "--kv-cache-dtype", kv_cache, *fmt.args]
    if lay.tp > 1:
        argv += ["--tensor-parallel-size", str(lay.tp)]
    if lay.pp > 1:
        argv += ["--pipeline-parallel-size", str(lay.pp)]
    if lay.nodes > 1:
        argv += ["--distributed-executor-backend", "ray"]
    if lay.cpu_offload_bytes:
        argv += ["--cpu-offload-gb", str(lay.cpu_offload_bytes // GiB)]
        if lay.cpu_offload_params:
            argv += ["--cpu-offload-params", *lay.cpu_offload_params]
    return argv


def _differences(spec, hw, p: Plan, m: VLLMModel, lay: Layout, fmt: WeightFormat, kv: str, consts) -> list[str]:
    req = p.request
    nccl = NCCL_BYTES_ASSUMED if lay.tp * lay.pp > 1 else 0
    groups = kv_groups(m.layer_kv(lay.tp))
    local = ("chunked layers keep one chunk" if any(a.chunked for a in spec.attention)
             else "sliding-window layers keep window - 1")
    most = m.utilization(lay.tp * lay.pp > 1)
    default = rules.DEFAULT_GPU_MEMORY_UTILIZATION
    if lay.gpu_memory_utilization < default:
        util = (f"--gpu-memory-utilization {lay.gpu_memory_utilization:.2f}, below vLLM's default {default:.2f}: the "
                "CUDA context" + (", NCCL" if lay.tp * lay.pp > 1 else "") + " and your headroom leave no more")
    elif lay.gpu_memory_utilization == default:
        util = (f"--gpu-memory-utilization {default:.2f}, vLLM's default: the KV pool holds the request"
                + (f"; this GPU allows up to {most:.2f} (more pool, more sequences at once)" if most > default else ""))
    else:
        at_default = m.layout(lay.tp, lay.pp, lay.nodes, lay.cpu_offload_bytes, lay.cpu_offload_params, util=default)
        util = (f"--gpu-memory-utilization {lay.gpu_memory_utilization:.2f}, above vLLM's default {default:.2f}: "
                f"at the default the KV pool falls "
                f"{format_bytes(at_default.kv_needed_bytes - at_default.kv_pool_bytes)} short of the "
                f"{format_bytes(at_default.kv_needed_bytes)} this request needs")
    out = [f"vLLM {VLLM_VERSION} per GPU ({lay.tp} TP x {lay.pp} PP on {lay.nodes} node(s)): "
           f"{lay.gpu_memory_utilization:.2f} x {format_bytes(m.total)} (CUDA's total) = weights "
           f"{format_bytes(lay.weights_bytes)} + profile-run peak {format_bytes(lay.activation_bytes)} + non-torch "
           f"{format_bytes(lay.non_torch_bytes)} + CUDA graphs {format_bytes(lay.cudagraph_bytes)} + KV pool "
           f"{format_bytes(lay.kv_pool_bytes)}; the rest holds the CUDA context "
           f"{format_bytes(hw.overheads.cuda_context_bytes)}" + (f", NCCL {format_bytes(nccl)}" if nccl else "")
           + f" and your headroom {format_bytes(req.headroom_bytes)}",
           util,
           "the KV pool is cut in {1}-token blocks ({0}, the attention backend vLLM picks on compute capability "
           "{2} with this cache)".format(*m.attention_backend(), hw.gpu.compute_capability or "unknown")
           + (f" over {len(groups)} KV cache groups ({local} + {rules.max_in_flight_tokens(lay.pp, m.tokens)} tokens "
              "in flight)" if len(groups) > 1 else "")
           + f"; {format_bytes(lay.kv_needed_bytes)} hold {req.batch} sequence(s) of {req.context} tokens; the pool "
           f"holds about {lay.max_concurrency}",
           "vLLM measures the profile-run peak, the non-torch memory and the CUDA graphs at start-up: the figures "
           "above are estimates (see the assumptions)"]
    limit, why = rules.derived_max_model_len(spec)
    if limit and req.context > limit:
        out.append(f"--max-model-len {req.context} is beyond the {limit} vLLM derives ({why}): it starts only with "
                   f"{rules.ALLOW_LONG_MAX_MODEL_LEN}=1 ({rules.CONFIG_MODEL}: _get_and_verify_max_len)")
    if fmt.name.startswith("checkpoint"):
        out.append(f"{spec.name}'s checkpoint is pre-quantized ({rules.checkpoint_quantization(spec)}): vLLM loads it "
                   "as it is, without --quantization")
    if fmt.note:
        out.append(fmt.note)
    if p.fits and p.choice.expert_placement not in (None, "gpu") and not lay.cpu_offload_params:
        out.append("the plan keeps routed experts in RAM; vLLM holds every GPU's TP share of them on the GPU here "
                   "(its --cpu-offload-gb with --cpu-offload-params experts moves them to RAM when the GPUs are too "
                   "few)")
    if p.fits and p.choice.offload is not OffloadMode.NONE and not lay.cpu_offload_bytes:  # vramplan's own plan
        out.append(f"vramplan's runtime offloads {p.choice.offloaded_layers} layers on {hw.name}; vLLM spreads the "
                   "model over GPUs instead")
    out += assumption_notes(consts)
    return out


# vLLM weight formats -> the compiled decode whose bytes and constants price them (bits, int4 group)
COMPILED_BITS = {"bf16": (16, None), "fp16": (16, None), "fp8_per_tensor": (8, None), "checkpoint-fp8": (8, None),
                 "mxfp4": (4, 32), "checkpoint-mxfp4": (4, 32)}
SPEED_FROM = ("a compiled decode of the same bits (CUDA graphs; constants fitted on gpt-fast and torchao's published "
              "runs: an assumption for vLLM, whose own decode is not fitted)")


def answer(spec: ModelSpec, hw: HardwareProfile, req: Request, plan_decode: float | None) -> EngineAnswer:
    """vLLM's row: its own choice among its formats x caches (vllm_best, what --emit vllm writes), priced as a compiled
    decode of its weights' bits where it runs on one GPU and the profile has fitted compiled constants; not predicted
    across GPUs or with weights in RAM."""
    a = vllm_best(spec, hw, req)
    fmt = a.fmt.name if a.fmt is not None else "-"
    out = EngineAnswer(engine=ENGINE, weight_quant=fmt, kv_dtype=a.kv_cache, fits=False,
                       how="vramplan plan --emit vllm", notes=tuple(n for n in a.notes if n.startswith("--quant")))
    if a.refused:
        out.reason = a.refused
        return out
    lay = a.layout
    out.fits, out.placement, out.quality_cost_pct = a.fits, _placement(a), a.quality_cost_pct
    if not out.fits:
        out.reason = f"needs {lay.nodes} nodes of {hw.name} (--nodes {req.nodes})"
        return out
    out.max_context_tokens = max_context(spec, lay, req)
    if a.speed is None:
        out.speed_from = a.speed_from
    else:
        out.with_speed(a.speed, out.max_context_tokens, a.speed_from, plan_decode)
    return out


def max_context(spec: ModelSpec, lay: Layout, req: Request) -> int | None:
    """The longest single sequence the KV pool holds: the pool over the bytes a token takes, for a model whose layers
    all attend to the whole context (a sliding window's blocks do not grow with it: not counted, None)."""
    if any(getattr(a, "window", None) for a in spec.attention) or lay.kv_per_sequence_bytes <= 0:
        return None
    tokens = (lay.kv_pool_bytes - lay.null_block_bytes) * req.context // lay.kv_per_sequence_bytes
    limit, _ = rules.derived_max_model_len(spec)  # vLLM's own limit, not vramplan's
    return int(min(tokens, limit) if limit else tokens)
