"""The memory model: every byte a placement puts on the GPU and in RAM, by named term.

A placement runs the first `gpu_layers` decoder layers on the GPU; the rest are
offloaded: "stream" keeps their (still quantized) weights in pinned RAM and copies them
into two GPU slot buffers each forward pass, with their KV cache on the GPU; "cpu"
computes them on the CPU with their KV cache in RAM. Where the non-layer tensors go:
- lm_head and the final norm stay on the GPU: lm_head is read in full for every token
  (as many bytes as a decoder layer or more); streaming it would cost the most.
- the input embedding stays on the GPU when the whole model fits; with any offload it
  moves to RAM: a lookup reads only `batch x tokens` rows, so the table (up to 2.8 GB for
  Gemma-3's 262k vocabulary) is the cheapest VRAM to give back. Tied embeddings share
  lm_head's tensor and stay on the GPU with it.
Pure: no torch.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from itertools import accumulate

from .memo import ObjectMemo
from .record import record
from .capacity import capacity
from .hardware import HardwareProfile
from .modelspec import AttentionLayout, ModelSpec, Role, dtype_bytes
from .choice import Choice, OffloadMode
from .quant import KVScheme, WeightScheme, cpu_head_bytes, cpu_head_scheme, kv_bytes_per_layer
from .request import Request

# Copies of the hidden state alive at once during a layer's forward (residual, normed input,
# attention output, MLP output), in the compute dtype.
ACTIVATION_HIDDEN_COPIES = 4
# MLP intermediates alive at once: gate, up, and their product.
ACTIVATION_MLP_COPIES = 3
# Logits of the last position: the model's compute dtype, then an fp32 upcast for sampling.
LOGITS_BYTES_PER_ELEMENT = 2 + 4
# torch's CPU SDPA has no fused kernel when V's head dim differs from Q/K's (MLA: qk_nope + qk_rope != v_head_dim): it
# falls back to the math path, which upcasts Q, K and V to fp32 and materialises the scores [batch, heads, queries,
# context], beside transformers' boolean mask [batch, 1, queries, context] of a chunk after the first. Peak RSS growth
# of one call (torch 2.13, 2-core dev VM, bf16 inputs, a boolean mask): 263 MiB for 2 heads x 2048 queries x 6000
# keys (48/32 dims), 389 MiB for 32 heads x 1 query x 6000 keys (192/128), 156 MiB for 8 heads x 512 x 3000 (96/64):
# 2.5-2.8 fp32 copies of the scores and 1.65 of the expanded K and V. Counted: 3 score copies (the scores, their
# softmax, one more temporary), which also covers a whole tiny deepseek_v3 prefill of 4096 tokens in 2048-token
# chunks (peak RSS +156-198 MiB over runs, planned 214 MiB: tests/test_mla.py). On a GPU the memory-efficient
# kernel takes these shapes without the scores: CPU-only terms.
SDPA_MATH_SCORE_FP32_COPIES = 3.0
SDPA_MATH_KV_FP32_COPIES = 1.65
FP32_BYTES = 4
BOOL_MASK_BYTES = 1
CPU_ONLY_WORKSPACE_TERMS = ("sdpa_math_fallback", "head_pack")


@record
class WeightCosts:
    """Stored bytes of one weight scheme, per decoder layer and outside the layers (context-free)."""

    layers: tuple[int, ...]  # stored bytes of each decoder layer
    embed_bytes: int  # input embedding (0 when tied: counted in head_bytes)
    head_bytes: int  # lm_head (or the tied embedding) + final norm
    experts: tuple[int, ...] = ()  # of each layer's bytes, its routed experts' (0 for dense layers)
    head_read_bytes: int | None = None  # what a decode step reads of head_bytes (None: all of it)

    @property
    def total_bytes(self) -> int:
        return sum(self.layers) + self.embed_bytes + self.head_bytes


def weight_costs(spec: ModelSpec, scheme: WeightScheme, cpu_only: bool = False) -> WeightCosts:
    """`cpu_only`: the model runs on a machine without a GPU, where a scheme may store lm_head its own way
    (quant.cpu_head_scheme); a tied embedding then stays for the lookup and the head is a second, quantized copy."""
    load = scheme.compute_dtype
    embed = head = 0
    lm_head = None  # the matrix the logits read: lm_head, or the tied embedding
    for t in spec.non_layer_tensors():
        b = scheme.tensor_bytes(t, load)
        if t.role is Role.EMBEDDING and not spec.tie_word_embeddings:
            embed += b
        else:
            head += b  # lm_head, final norm, tied embedding
            lm_head = t if t.role in (Role.LM_HEAD, Role.EMBEDDING) else lm_head
    head_read = None
    head_scheme = cpu_head_scheme(scheme, lm_head.shape[-1]) if cpu_only and lm_head is not None else None
    if head_scheme is not None:
        stored, quantized = scheme.tensor_bytes(lm_head, load), cpu_head_bytes(lm_head, head_scheme)
        head_read = head - stored + quantized
        head += quantized if spec.tie_word_embeddings else quantized - stored
    return WeightCosts(layers=tuple(spec.per_layer(lambda ts: scheme.bytes_of(ts, load))), embed_bytes=embed,
                       head_bytes=head, experts=tuple(spec.per_layer(
                           lambda ts: scheme.bytes_of([t for t in ts if t.role is Role.EXPERT], load))),
                       head_read_bytes=head_read)


@record
class LayerCosts:
    """Per-layer bytes for one scheme x KV dtype at one context and batch."""

    weights: tuple[int, ...]  # stored bytes of each decoder layer
    kv: tuple[int, ...]  # KV-cache bytes of each layer at the request's context x batch
    embed_bytes: int  # input embedding (0 when tied: counted in head_bytes)
    head_bytes: int  # lm_head (or the tied embedding) + final norm
    experts: tuple[int, ...] = ()  # of each layer's weights, its routed experts' bytes
    head_read_bytes: int | None = None  # what a decode step reads of head_bytes (None: all of it)

    @property
    def head_read(self) -> int:
        return self.head_bytes if self.head_read_bytes is None else self.head_read_bytes


def layer_costs(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, req: Request,
                weights: WeightCosts | None = None) -> LayerCosts:
    w = weights if weights is not None else weight_costs(spec, scheme)
    return LayerCosts(weights=w.layers, kv=tuple(kv_bytes_per_layer(spec, kv, req.context, req.batch)),
                      embed_bytes=w.embed_bytes, head_bytes=w.head_bytes, experts=w.experts,
                      head_read_bytes=w.head_read_bytes)


def _prefix(values: tuple[int, ...]) -> list[int]:
    return list(accumulate(values, initial=0))


def _weight_sums(weights: tuple[int, ...], experts: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """Prefix sums of the layers' weights and routed experts, and the largest layer from each on (0 past the last:
    what a stream slot must hold); the same for a scheme's weights at every context the search probes, so the last
    few are kept."""
    return _WEIGHT_SUMS.get((weights, experts), (), lambda: (
        _prefix(weights), _prefix(experts), list(accumulate(reversed(weights), max, initial=0))[::-1]))


_WEIGHT_SUMS = ObjectMemo(64)


@lru_cache(maxsize=16)
def _zeros(n: int) -> tuple[int, ...]:
    """No routed experts in n layers (one tuple per n: _weight_sums knows it by its id)."""
    return (0,) * n


def workspace_bytes(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, req: Request,
                    context: int | None = None, int8_path: str | None = None) -> dict:
    """Activation memory of one prefill chunk, by term. The largest phase: decode needs less."""
    ctx = req.context if context is None else context
    act = dtype_bytes(scheme.compute_dtype)
    tokens = min(req.prefill_chunk, ctx) * req.batch
    a = spec.attention[0]
    if a.kind == "mla":
        qkv_width = a.num_heads * a.head_dim * 3
    else:
        qkv_width = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    # Appending to a layer's cache (torch.cat, or a quantized cache's dequantized copy) holds one
    # full-precision copy of that layer's K and V at the whole context.
    largest_layer_kv = (max(a.cached_tokens(ctx) * a.kv_elements_per_token for a, _ in spec.attention_groups)
                        * req.batch * act)
    terms = {
        "hidden_states": int(tokens * spec.hidden_size * act * ACTIVATION_HIDDEN_COPIES),
        "qkv": int(tokens * qkv_width * act),
        "mlp_intermediate": int(tokens * spec.mlp_width * act * ACTIVATION_MLP_COPIES),
        "logits": int(req.batch * spec.vocab_size * LOGITS_BYTES_PER_ELEMENT),
        "kv_append_copy": int(largest_layer_kv),
        "dequant_temp": scheme.matmul_temp_bytes(spec),
    }
    # MLA as transformers runs it (AttentionLayout.expands_cache): each layer in turn expands its whole cached context
    # into kv_b_proj's output and a key tensor, in the compute dtype, at every decode step and every prefill chunk
    expanded = max(a.cached_tokens(ctx) * a.expanded_elements_per_token for a, _ in spec.attention_groups)
    if expanded:
        terms["mla_expanded_kv"] = int(expanded * req.batch * act)
    math = max((_chunk_scores(a, ctx, req.prefill_chunk) * (a.num_heads * SDPA_MATH_SCORE_FP32_COPIES * FP32_BYTES
                                                             + BOOL_MASK_BYTES)
                + a.num_heads * a.cached_tokens(ctx) * (a.head_dim + a.value_dim) * SDPA_MATH_KV_FP32_COPIES
                * FP32_BYTES for a, _ in spec.attention_groups if a.value_dim != a.head_dim), default=0.0)
    if math:
        terms["sdpa_math_fallback"] = int(math * req.batch)
    head = cpu_head_scheme(scheme, spec.hidden_size)
    if head is not None and head.activation_bits == 8 and int8_path != "int_mm":  # (`int8_path`: the profile's record)
        # loading, fbgemm's prepack of lm_head (runtime.cpu_paths.FbgemmInt8Dynamic) holds its int8 rows and a quantized
        # copy of them beside the packed rows it makes: 2 x vocab x hidden bytes for a moment (Llama-3.2-1B's 262 MB
        # head: +535 MB of peak RSS where the packed rows keep 270, on the 2-core Xeon AMX VM, 2026-11-29; without this
        # term 12 runs of its quanto-w8a8 peaked at 2.56-2.98 GiB where 2.69 were planned)
        terms["head_pack"] = 2 * spec.vocab_size * spec.hidden_size
    return terms


def _chunk_scores(a: AttentionLayout, prompt: int, chunk: int) -> int:
    """The most attention scores per head one prefill chunk computes: its queries x the keys cached so far."""
    return max(min(chunk, prompt - start) * a.cached_tokens(min(prompt, start + chunk))
               for start in range(0, prompt, chunk))


@record
class GPUMemory:
    """Bytes a placement puts on the GPU, by named term, and the capacity it must fit in."""

    weights_bytes: int
    kv_cache_bytes: int
    stream_buffers_bytes: int
    workspace_bytes: int
    cuda_context_bytes: int
    allocator_reserve_bytes: int
    headroom_bytes: int
    capacity_bytes: int

    TERMS = ("weights_bytes", "kv_cache_bytes", "stream_buffers_bytes", "workspace_bytes", "cuda_context_bytes",
             "allocator_reserve_bytes", "headroom_bytes")

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, t) for t in self.TERMS)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes

    def to_dict(self) -> dict:
        return _device_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPUMemory":
        return cls(**{k: d[k] for k in (*cls.TERMS, "capacity_bytes")})


@record
class CPUMemory:
    """Bytes a placement puts in host RAM, by named term, and the capacity it must fit in."""

    weights_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    runtime_base_bytes: int
    capacity_bytes: int

    TERMS = ("weights_bytes", "kv_cache_bytes", "workspace_bytes", "runtime_base_bytes")

    total_bytes = GPUMemory.total_bytes
    free_bytes = GPUMemory.free_bytes

    def to_dict(self) -> dict:
        return _device_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CPUMemory":
        return cls(**{k: d[k] for k in (*cls.TERMS, "capacity_bytes")})


def _device_dict(m) -> dict:
    return {**{t: getattr(m, t) for t in m.TERMS}, "total_bytes": m.total_bytes, "capacity_bytes": m.capacity_bytes,
            "free_bytes": m.free_bytes}


@record(kw_only=True)
class MemoryBreakdown:
    """Every byte of one placement, per device: each GPU (none on a machine without one) and the host RAM."""

    gpus: tuple[GPUMemory, ...]
    cpu: CPUMemory
    workspace_terms: dict  # the workspace's own terms (on a GPU without CPU_ONLY_WORKSPACE_TERMS)

    @property
    def gpu(self) -> GPUMemory | None:
        """GPU 0 (the JSON's `memory.gpu`, kept for one-GPU readers), or None without a GPU."""
        return self.gpus[0] if self.gpus else None

    @property
    def gpu_total_bytes(self) -> int:
        return sum(g.total_bytes for g in self.gpus)

    @property
    def over(self) -> str | None:
        """The first device whose total exceeds its capacity ("gpu", "gpu1", ..., then "cpu"), or None."""
        for d, g in enumerate(self.gpus):
            if g.free_bytes < 0:
                return "gpu" if d == 0 else f"gpu{d}"
        if self.cpu.free_bytes < 0:
            return "cpu"
        return None

    @property
    def fits(self) -> bool:
        return self.over is None

    def device(self, name: str) -> GPUMemory | CPUMemory:
        """The breakdown `over` names."""
        return self.cpu if name == "cpu" else self.gpus[int(name[3:] or 0)]

    def to_dict(self) -> dict:
        return {"gpu": self.gpu.to_dict() if self.gpu is not None else None, "gpus": [g.to_dict() for g in self.gpus],
                "cpu": self.cpu.to_dict(), "workspace_terms": dict(self.workspace_terms)}

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryBreakdown":
        gpus = d.get("gpus") or ([d["gpu"]] if d.get("gpu") else [])
        return cls(gpus=tuple(GPUMemory.from_dict(g) for g in gpus), cpu=CPUMemory.from_dict(d["cpu"]),
                   workspace_terms=dict(d.get("workspace_terms") or {}))


def gpu_capacity(hw: HardwareProfile, req: Request, device: int = 0) -> int:
    """What GPU `device` may hold (planner.capacity, where every engine's capacity comes from); 0 without a GPU."""
    gpus = capacity(hw, req).gpus
    return gpus[device] if gpus else 0


def gpu_capacities(hw: HardwareProfile, req: Request) -> list[int]:
    """gpu_capacity of every GPU device, in device order."""
    return list(capacity(hw, req).gpus)


def ram_capacity(hw: HardwareProfile, req: Request, gpu_total: int = 0) -> int:
    """What the host may hold beside `gpu_total` bytes on the GPUs (planner.capacity: on unified memory, less them)."""
    return capacity(hw, req).ram_left(gpu_total)


def embeddings_on_gpu(gpu_layers: int, num_layers: int, tied: bool) -> bool:
    """The input embedding stays on the GPU when every layer does, or when it is lm_head's (tied) tensor."""
    return gpu_layers >= num_layers or tied


@record
class Placement:
    """Where the layers go, as the memory and speed models need it (a Choice without the scheme names).

    split: resident decoder layers per GPU, in device order (layers 0..split[0]-1 on GPU 0, the next split[1] on
    GPU 1, ...); empty on a machine without a GPU. The other layers are offloaded in `mode`: streamed layers run
    on GPU 0, and GPU 0 also holds the input embedding (when on a GPU), lm_head and the final norm.
    expert_layers_on_cpu: how many MoE layers (the first ones) keep their routed experts in RAM, computed by the CPU
    (the Choice's field of that name; its indices are the Choice's expert_layers_in_ram).
    """

    split: tuple[int, ...]
    mode: OffloadMode = OffloadMode.NONE
    expert_layers_on_cpu: int = 0

    @property
    def n(self) -> int:
        return sum(self.split)

    @classmethod
    def of(cls, c: Choice) -> "Placement":
        return cls(split=tuple(c.gpu_layers_per_device) if c.on_gpu else (), mode=c.offload,
                   expert_layers_on_cpu=c.expert_layers_on_cpu)


class Footprint:
    """The bytes of every placement of one scheme x KV dtype x request, per device, in O(devices) each.

    The one memory formula: the search checks placements with it and the plan prints its
    breakdown, so a verdict and the numbers shown beside it cannot disagree.
    """

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, req: Request, costs: LayerCosts, workspace: dict):
        self.L = spec.num_layers
        self.hw = hw
        self.req = req
        self.costs = costs
        self.tied = spec.tie_word_embeddings
        self.gpu_count = len(hw.devices)
        self.workspace = dict(workspace)
        self.ws = sum(v for k, v in workspace.items() if k not in CPU_ONLY_WORKSPACE_TERMS)  # on a GPU
        self.ws_cpu = sum(workspace.values())
        self.pw, self.px, self.suffix_max_w = _weight_sums(costs.weights, costs.experts or _zeros(self.L))
        self.pkv = _prefix(costs.kv)
        moe = sorted(spec.moe.moe_layers) if spec.moe is not None else []
        self.expert_end = [0] + [i + 1 for i in moe]  # with e layers' experts in RAM: layers before expert_end[e]
        o = hw.overheads
        self.gpu_fixed = (o.cuda_context_bytes, o.allocator_reserve_bytes, req.headroom_bytes)
        self.cap = capacity(hw, req)
        self.capacities = self.cap.gpus

    @property
    def moe_layers(self) -> int:
        return len(self.expert_end) - 1

    def moe_layers_before(self, n: int) -> int:
        """How many MoE layers are among the first n decoder layers."""
        return bisect_right(self.expert_end, n) - 1

    def embeddings_on_gpu(self, n: int) -> bool:
        return self.gpu_count > 0 and embeddings_on_gpu(n, self.L, self.tied)

    def _experts_in_ram(self, a: int, b: int, e: int) -> int:
        """Bytes of routed experts in RAM among layers [a, b) when the first e MoE layers keep theirs there."""
        end = self.expert_end[e]
        return self.px[min(b, end)] - self.px[min(a, end)]

    def _gpu_terms(self, d: int, start: int, count: int, n: int, mode: OffloadMode, e: int) -> tuple[int, ...]:
        """GPUMemory.TERMS of GPU d holding layers [start, start + count), of n resident in all."""
        if d > 0 and count == 0:
            return (0,) * len(GPUMemory.TERMS)  # a GPU the run does not touch
        costs, end = self.costs, start + count
        stream = d == 0 and mode is OffloadMode.STREAM and n < self.L
        weights = self.pw[end] - self.pw[start] - self._experts_in_ram(start, end, e)
        kv = self.pkv[end] - self.pkv[start]
        if d == 0:
            weights += costs.head_bytes + (costs.embed_bytes if self.embeddings_on_gpu(n) else 0)
            if stream:
                kv += self.pkv[self.L] - self.pkv[n]  # streamed layers keep their KV on the GPU they run on
        return (weights, kv, 2 * self.suffix_max_w[n] if stream else 0, self.ws, *self.gpu_fixed)

    def _cpu_terms(self, p: Placement) -> tuple[int, ...]:
        """CPUMemory.TERMS, in order: what the offloaded layers (all of them without a GPU) and the experts kept in
        RAM leave there."""
        costs, L, n = self.costs, self.L, p.n
        on_gpu = self.gpu_count > 0
        computes_here = not on_gpu or (p.mode is OffloadMode.CPU and n < L)  # these keep KV and activations here
        weights = (self.pw[L] - self.pw[n] + self._experts_in_ram(0, n, p.expert_layers_on_cpu)
                   + (0 if self.embeddings_on_gpu(n) else costs.embed_bytes) + (0 if on_gpu else costs.head_bytes))
        activations = computes_here and (n < L or not on_gpu) or p.expert_layers_on_cpu > 0
        workspace = (self.ws_cpu if computes_here else self.ws) if activations else 0  # attention here, or experts
        return (weights, self.pkv[L] - self.pkv[n] if computes_here else 0, workspace,
                self.req.runtime_base_ram_bytes)

    def _gpus(self, p: Placement) -> tuple[GPUMemory, ...]:
        out, start = [], 0
        for d in range(self.gpu_count):
            count = p.split[d] if d < len(p.split) else 0
            out.append(GPUMemory(*self._gpu_terms(d, start, count, p.n, p.mode, p.expert_layers_on_cpu),
                                 capacity_bytes=self.capacities[d]))
            start += count
        return tuple(out)

    def split_for(self, n: int, mode: OffloadMode, e: int = 0, *, best_effort: bool = False) -> tuple[int, ...] | None:
        """The n resident layers over the GPUs, each taking as many as fit in device order (uneven cards get uneven
        shares), or None when they do not fit. With `best_effort`, layers that fit nowhere go to the last GPU (a
        split to show how far over it is)."""
        if self.gpu_count == 0:
            return () if n == 0 else None
        if self.gpu_count == 1:  # the loop below, for one GPU: it holds all n (fits is monotone in the layers)
            fits_all = sum(self._gpu_terms(0, 0, n, n, mode, e)) <= self.capacities[0]
            return (n,) if fits_all or best_effort else None
        split, start, ok = [], 0, True
        for d in range(self.gpu_count):

            def fits(k: int, d: int = d, start: int = start) -> bool:
                return sum(self._gpu_terms(d, start, k, n, mode, e)) <= self.capacities[d]

            if not fits(0):
                ok = False
                split.append(0)
                continue
            lo, hi = 0, n - start  # the most layers this GPU takes: fits() holds up to some k, then fails
            if fits(hi):
                lo = hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            split.append(lo)
            start += lo
        if ok and start == n:
            return tuple(split)
        if not best_effort:
            return None
        split[-1] += n - start
        return tuple(split)

    def over(self, p: Placement) -> str | None:
        """The first device over capacity ("gpu", "gpu1", ..., then "cpu") for `p`, or None when it fits."""
        return self.breakdown_of(p).over

    def breakdown_of(self, p: Placement) -> MemoryBreakdown:
        gpus = self._gpus(p)
        gpu_total = sum(g.total_bytes for g in gpus)
        cpu = CPUMemory(*self._cpu_terms(p), capacity_bytes=self.cap.ram_left(gpu_total))
        return MemoryBreakdown(gpus=gpus, cpu=cpu, workspace_terms=self.workspace)

    def breakdown(self, c: Choice) -> MemoryBreakdown:
        return self.breakdown_of(Placement.of(c))

    def fits(self, c: Choice) -> bool:
        return self.breakdown(c).fits
