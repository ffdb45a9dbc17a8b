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

from dataclasses import dataclass

from .hardware import HardwareProfile
from .modelspec import ModelSpec, Role, dtype_bytes
from .choice import Choice, OffloadMode
from .quant import KVScheme, WeightScheme, kv_bytes_per_layer
from .request import Request

# Copies of the hidden state alive at once during a layer's forward (residual, normed input,
# attention output, MLP output), in the compute dtype.
ACTIVATION_HIDDEN_COPIES = 4
# MLP intermediates alive at once: gate, up, and their product.
ACTIVATION_MLP_COPIES = 3
# Logits of the last position: the model's compute dtype, then an fp32 upcast for sampling.
LOGITS_BYTES_PER_ELEMENT = 2 + 4


@dataclass(frozen=True)
class WeightCosts:
    """Stored bytes of one weight scheme, per decoder layer and outside the layers (context-free)."""

    layers: tuple[int, ...]  # stored bytes of each decoder layer
    embed_bytes: int  # input embedding (0 when tied: counted in head_bytes)
    head_bytes: int  # lm_head (or the tied embedding) + final norm

    @property
    def total_bytes(self) -> int:
        return sum(self.layers) + self.embed_bytes + self.head_bytes


def weight_costs(spec: ModelSpec, scheme: WeightScheme) -> WeightCosts:
    load = scheme.compute_dtype
    embed = head = 0
    for t in spec.non_layer_tensors():
        b = scheme.tensor_bytes(t, load)
        if t.role is Role.EMBEDDING and not spec.tie_word_embeddings:
            embed += b
        else:
            head += b  # lm_head, final norm, tied embedding
    return WeightCosts(layers=tuple(spec.per_layer(lambda ts: scheme.bytes_of(ts, load))), embed_bytes=embed,
                       head_bytes=head)


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer bytes for one scheme x KV dtype at one context and batch."""

    weights: tuple[int, ...]  # stored bytes of each decoder layer
    kv: tuple[int, ...]  # KV-cache bytes of each layer at the request's context x batch
    embed_bytes: int  # input embedding (0 when tied: counted in head_bytes)
    head_bytes: int  # lm_head (or the tied embedding) + final norm


def layer_costs(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, req: Request,
                weights: WeightCosts | None = None) -> LayerCosts:
    w = weights if weights is not None else weight_costs(spec, scheme)
    return LayerCosts(weights=w.layers, kv=tuple(kv_bytes_per_layer(spec, kv, req.context, req.batch)),
                      embed_bytes=w.embed_bytes, head_bytes=w.head_bytes)


def _prefix(values: tuple[int, ...]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def workspace_bytes(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, req: Request, context: int | None = None) -> dict:
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
    largest_layer_kv = max(a.cached_tokens(ctx) * a.kv_elements_per_token for a, _ in spec.attention_groups) * req.batch * act
    terms = {
        "hidden_states": int(tokens * spec.hidden_size * act * ACTIVATION_HIDDEN_COPIES),
        "qkv": int(tokens * qkv_width * act),
        "mlp_intermediate": int(tokens * spec.mlp_width * act * ACTIVATION_MLP_COPIES),
        "logits": int(req.batch * spec.vocab_size * LOGITS_BYTES_PER_ELEMENT),
        "kv_append_copy": int(largest_layer_kv),
        "dequant_temp": scheme.matmul_temp_bytes(spec),
    }
    return terms


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Every byte of one placement, per device; `gpu` is None on a machine without a GPU."""

    gpu: GPUMemory | None
    cpu: CPUMemory
    workspace_terms: dict  # the workspace's own terms (the same on whichever device computes)

    @property
    def over(self) -> str | None:
        """The first device whose total exceeds its capacity ("gpu", then "cpu"), or None when both fit."""
        if self.gpu is not None and self.gpu.free_bytes < 0:
            return "gpu"
        if self.cpu.free_bytes < 0:
            return "cpu"
        return None

    @property
    def fits(self) -> bool:
        return self.over is None

    def to_dict(self) -> dict:
        return {"gpu": self.gpu.to_dict() if self.gpu is not None else None, "cpu": self.cpu.to_dict(),
                "workspace_terms": dict(self.workspace_terms)}

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryBreakdown":
        return cls(gpu=GPUMemory.from_dict(d["gpu"]) if d.get("gpu") else None, cpu=CPUMemory.from_dict(d["cpu"]),
                   workspace_terms=dict(d.get("workspace_terms") or {}))


def gpu_capacity(hw: HardwareProfile, req: Request) -> int:
    if req.vram_budget_bytes is not None:
        return req.vram_budget_bytes
    return hw.gpu.memory_bytes if hw.gpu is not None else 0


def ram_capacity(hw: HardwareProfile, req: Request, gpu_total: int = 0) -> int:
    if req.ram_budget_bytes is not None:
        return req.ram_budget_bytes
    # Unified memory: what the GPU side holds comes out of the same RAM.
    return hw.host.ram_bytes - (gpu_total if hw.unified_memory else 0)


def embeddings_on_gpu(gpu_layers: int, num_layers: int, tied: bool) -> bool:
    """The input embedding stays on the GPU when every layer does, or when it is lm_head's (tied) tensor."""
    return gpu_layers >= num_layers or tied


class Footprint:
    """The bytes of every placement of one scheme x KV dtype x request, per device, in O(1) each.

    The one memory formula: the search checks placements with it and the plan prints its
    breakdown, so a verdict and the numbers shown beside it cannot disagree. A placement is
    (gpu_layers, offload mode) on a machine with a GPU, (0, NONE) without one.
    """

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, req: Request, costs: LayerCosts, workspace: dict):
        self.L = spec.num_layers
        self.hw = hw
        self.req = req
        self.costs = costs
        self.tied = spec.tie_word_embeddings
        self.on_gpu = hw.has_gpu
        self.workspace = dict(workspace)
        self.ws = sum(workspace.values())
        self.pw = _prefix(costs.weights)
        self.pkv = _prefix(costs.kv)
        suffix = [0] * (self.L + 1)
        for i in range(self.L - 1, -1, -1):
            suffix[i] = max(suffix[i + 1], costs.weights[i])
        self.suffix_max_w = suffix  # the largest layer from i on: what a stream slot must hold
        o = hw.overheads
        self.gpu_fixed = (o.cuda_context_bytes, o.allocator_reserve_bytes, req.headroom_bytes)
        self.gpu_capacity = gpu_capacity(hw, req)

    def embeddings_on_gpu(self, n: int) -> bool:
        return self.on_gpu and embeddings_on_gpu(n, self.L, self.tied)

    def _gpu_terms(self, n: int, mode: OffloadMode) -> tuple[int, ...]:
        """GPUMemory.TERMS, in order, for n layers on the GPU."""
        costs = self.costs
        stream = mode is OffloadMode.STREAM and n < self.L
        kv_layers = n if (mode is OffloadMode.CPU and n < self.L) else self.L  # streamed layers keep KV on the GPU
        weights = self.pw[n] + costs.head_bytes + (costs.embed_bytes if self.embeddings_on_gpu(n) else 0)
        return (weights, self.pkv[kv_layers], 2 * self.suffix_max_w[n] if stream else 0, self.ws, *self.gpu_fixed)

    def _cpu_terms(self, n: int, mode: OffloadMode) -> tuple[int, ...]:
        """CPUMemory.TERMS, in order: what the layers from n on (all of them without a GPU) leave in RAM."""
        costs, L = self.costs, self.L
        computes_here = not self.on_gpu or (mode is OffloadMode.CPU and n < L)  # these keep KV and activations here
        weights = (self.pw[L] - self.pw[n] + (0 if self.embeddings_on_gpu(n) else costs.embed_bytes)
                   + (0 if self.on_gpu else costs.head_bytes))
        return (weights, self.pkv[L] - self.pkv[n] if computes_here else 0, self.ws if computes_here else 0,
                self.req.runtime_base_ram_bytes)

    def over(self, n: int, mode: OffloadMode) -> str | None:
        """The first device over capacity ("gpu", then "cpu") with n layers on the GPU, or None when it fits."""
        gpu_total = sum(self._gpu_terms(n, mode)) if self.on_gpu else 0
        if gpu_total > self.gpu_capacity:
            return "gpu"
        if sum(self._cpu_terms(n, mode)) > ram_capacity(self.hw, self.req, gpu_total):
            return "cpu"
        return None

    def breakdown(self, c: Choice) -> MemoryBreakdown:
        n, mode = (c.gpu_layers, c.offload) if c.on_gpu else (0, OffloadMode.NONE)
        gpu = GPUMemory(*self._gpu_terms(n, mode), capacity_bytes=self.gpu_capacity) if self.on_gpu else None
        cpu = CPUMemory(*self._cpu_terms(n, mode),
                        capacity_bytes=ram_capacity(self.hw, self.req, gpu.total_bytes if gpu is not None else 0))
        return MemoryBreakdown(gpu=gpu, cpu=cpu, workspace_terms=self.workspace)

    def fits(self, c: Choice) -> bool:
        return self.breakdown(c).fits
