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
from .modelspec import Kind, ModelSpec, Role, dtype_bytes
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
class LayerCosts:
    """Per-layer bytes for one scheme x KV dtype at one context and batch; precomputed for the search."""

    weights: tuple[int, ...]  # stored bytes of each decoder layer
    kv: tuple[int, ...]  # KV-cache bytes of each layer at the request's context x batch
    embed_bytes: int  # input embedding (0 when tied: counted in head_bytes)
    head_bytes: int  # lm_head (or the tied embedding) + final norm
    tied: bool

    def prefix(self, values: tuple[int, ...]) -> list[int]:
        out = [0]
        for v in values:
            out.append(out[-1] + v)
        return out


def layer_costs(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, req: Request) -> LayerCosts:
    load = scheme.compute_dtype
    weights = tuple(spec.per_layer(lambda ts: scheme.bytes_of(ts, load)))
    kvs = tuple(kv_bytes_per_layer(spec, kv, req.context, req.batch))
    embed = head = 0
    for t in spec.non_layer_tensors():
        b = scheme.tensor_bytes(t, load)
        if t.role is Role.EMBEDDING and not spec.tie_word_embeddings:
            embed += b
        else:
            head += b  # lm_head, final norm, tied embedding
    return LayerCosts(weights=weights, kv=kvs, embed_bytes=embed, head_bytes=head, tied=spec.tie_word_embeddings)


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
    inter = spec._cached("_ws_intermediate", lambda: _mlp_width(spec))
    # Appending to a layer's cache (torch.cat, or a quantized cache's dequantized copy) holds one
    # full-precision copy of that layer's K and V at the whole context.
    largest_layer_kv = max(a.cached_tokens(ctx) * a.kv_elements_per_token for a, _ in spec.attention_groups) * req.batch * act
    terms = {
        "hidden_states": int(tokens * spec.hidden_size * act * ACTIVATION_HIDDEN_COPIES),
        "qkv": int(tokens * qkv_width * act),
        "mlp_intermediate": int(tokens * inter * act * ACTIVATION_MLP_COPIES),
        "logits": int(req.batch * spec.vocab_size * LOGITS_BYTES_PER_ELEMENT),
        "kv_append_copy": int(largest_layer_kv),
        "dequant_temp": scheme.matmul_temp_bytes(spec),
    }
    return terms


def _mlp_width(spec: ModelSpec) -> int:
    """Widest MLP intermediate per token: dense layers, or top-k experts' intermediates."""
    inter = spec.intermediate_size
    if spec.moe is not None:
        moe_inter = max((t.shape[1] // 2 for t in spec.tensors if t.kind is Kind.EXPERTS and "gate_up" in t.name), default=0)
        inter = max(inter if len(spec.moe.moe_layers) < spec.num_layers else 0, moe_inter * spec.moe.experts_per_token)
    return inter


@dataclass(frozen=True, kw_only=True)
class Placement:
    gpu_layers: int
    offload: str  # "none", "stream" or "cpu"
    compute_device: str  # "cuda" or "cpu" (a machine without a GPU)
    embeddings_on_gpu: bool


def place(spec: ModelSpec, n_gpu: int, mode: str, has_gpu: bool) -> Placement:
    if not has_gpu:
        return Placement(gpu_layers=0, offload="none", compute_device="cpu", embeddings_on_gpu=False)
    full = n_gpu >= spec.num_layers
    return Placement(gpu_layers=min(n_gpu, spec.num_layers), offload="none" if full else mode, compute_device="cuda",
                     embeddings_on_gpu=full or spec.tie_word_embeddings)


def gpu_capacity(hw: HardwareProfile, req: Request) -> int:
    if req.vram_budget_bytes is not None:
        return req.vram_budget_bytes
    return hw.gpu.memory_bytes if hw.gpu is not None else 0


def ram_capacity(hw: HardwareProfile, req: Request, gpu_total: int = 0) -> int:
    if req.ram_budget_bytes is not None:
        return req.ram_budget_bytes
    # Unified memory: what the GPU side holds comes out of the same RAM.
    return hw.host.ram_bytes - (gpu_total if hw.unified_memory else 0)


def memory_breakdown(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
                     p: Placement, costs: LayerCosts, ws: dict) -> dict:
    """Bytes per device by named term, with totals and capacities."""
    L = spec.num_layers
    n = p.gpu_layers
    ws_total = sum(ws.values())
    off = range(n, L)
    off_weights = sum(costs.weights[i] for i in off)
    if p.compute_device == "cpu":
        gpu = None
        cpu_terms = {
            "weights_bytes": sum(costs.weights) + costs.embed_bytes + costs.head_bytes,
            "kv_cache_bytes": sum(costs.kv),
            "workspace_bytes": ws_total,
            "runtime_base_bytes": req.runtime_base_ram_bytes,
        }
    else:
        gpu_kv_layers = range(L) if p.offload in ("none", "stream") else range(n)
        gpu_terms = {
            "weights_bytes": sum(costs.weights[:n]) + costs.head_bytes + (costs.embed_bytes if p.embeddings_on_gpu else 0),
            "kv_cache_bytes": sum(costs.kv[i] for i in gpu_kv_layers),
            "stream_buffers_bytes": 2 * max((costs.weights[i] for i in off), default=0) if p.offload == "stream" else 0,
            "workspace_bytes": ws_total,
            "cuda_context_bytes": hw.overheads.cuda_context_bytes,
            "allocator_reserve_bytes": hw.overheads.allocator_reserve_bytes,
            "headroom_bytes": req.headroom_bytes,
        }
        gpu_total = sum(gpu_terms.values())
        gpu = {**gpu_terms, "total_bytes": gpu_total, "capacity_bytes": gpu_capacity(hw, req)}
        gpu["free_bytes"] = gpu["capacity_bytes"] - gpu_total
        cpu_terms = {
            "weights_bytes": off_weights + (0 if p.embeddings_on_gpu else costs.embed_bytes),
            "kv_cache_bytes": sum(costs.kv[i] for i in off) if p.offload == "cpu" else 0,
            "workspace_bytes": ws_total if p.offload == "cpu" and n < L else 0,
            "runtime_base_bytes": req.runtime_base_ram_bytes,
        }
    cpu_total = sum(cpu_terms.values())
    cpu = {**cpu_terms, "total_bytes": cpu_total,
           "capacity_bytes": ram_capacity(hw, req, gpu["total_bytes"] if gpu else 0)}
    cpu["free_bytes"] = cpu["capacity_bytes"] - cpu_total
    return {"gpu": gpu, "cpu": cpu, "workspace_terms": ws}


class FitTotals:
    """GPU and RAM totals of every placement in O(1) each, from prefix sums (the search scans them all).

    Must agree with memory_breakdown term for term; tests/test_planner.py checks both on every n.
    """

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, req: Request, costs: LayerCosts, ws_total: int):
        self.L = spec.num_layers
        self.costs = costs
        self.pw = costs.prefix(costs.weights)
        self.pkv = costs.prefix(costs.kv)
        suffix = [0] * (self.L + 1)
        for i in range(self.L - 1, -1, -1):
            suffix[i] = max(suffix[i + 1], costs.weights[i])
        self.suffix_max_w = suffix
        self.ws = ws_total
        o = hw.overheads
        self.gpu_fixed = o.cuda_context_bytes + o.allocator_reserve_bytes + req.headroom_bytes + ws_total + costs.head_bytes
        self.base_ram = req.runtime_base_ram_bytes
        self.tied = spec.tie_word_embeddings

    def gpu_total(self, n: int, mode: str) -> int:
        c = self.costs
        full = n >= self.L
        emb_on_gpu = full or self.tied
        kv = self.pkv[self.L] if (full or mode == "stream") else self.pkv[n]
        slots = 2 * self.suffix_max_w[n] if (mode == "stream" and not full) else 0
        return self.pw[n] + (c.embed_bytes if emb_on_gpu else 0) + kv + slots + self.gpu_fixed

    def cpu_total(self, n: int, mode: str) -> int:
        c = self.costs
        full = n >= self.L
        emb_on_gpu = full or self.tied
        off_w = self.pw[self.L] - self.pw[n]
        kv = (self.pkv[self.L] - self.pkv[n]) if (mode == "cpu" and not full) else 0
        ws = self.ws if (mode == "cpu" and not full) else 0
        return off_w + (0 if emb_on_gpu else c.embed_bytes) + kv + ws + self.base_ram
