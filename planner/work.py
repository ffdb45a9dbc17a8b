"""What one step of a model moves and computes, per layer: weight bytes read at decode, cached KV elements, attention
and matmul FLOPs, MLA's expansion, routed experts reached. Counts from the model's shapes and the request, no speeds:
planner.speed divides them by a device's rates."""

from __future__ import annotations

import math
from functools import cached_property

from .memo import ObjectMemo
from .record import record
from .modelspec import ModelSpec, Role, dtype_bytes
from .quant import KVScheme, WeightScheme, layer_kv_bytes
from .memory import LayerCosts

# Per-spec figures (and per spec and prompt, and a decode's work) the search asks for at every placement it prices,
# kept for the last few.
_SPEC_MEMO = ObjectMemo(256)


def _per_spec(fn):
    """`fn(spec, *args)` computed once per spec and arguments, as a tuple (callers share it)."""
    def memoized(spec: ModelSpec, *args) -> tuple[float, ...]:
        return _SPEC_MEMO.get((spec,), (fn.__name__, *args), lambda: tuple(fn(spec, *args)))
    memoized.__doc__, memoized.__name__ = fn.__doc__, fn.__name__
    return memoized


@_per_spec
def prefill_expand_flop_per_layer(spec: ModelSpec, prompt: int, chunk: int) -> list[float]:
    """FLOPs of the MLA expansions of a chunked prefill per layer (and sequence): each chunk expands the context so
    far, min(prompt, (k + 1) x chunk) tokens for chunk k."""
    chunks = -(-prompt // chunk)
    expanded = chunk * (chunks - 1) * chunks // 2 + prompt  # sum of min(prompt, (k + 1) x chunk): every chunk full
    return spec.per_attention_layout(lambda a: a.expand_flop_per_token * expanded)  # but the last, which ends it


def active_fraction(spec: ModelSpec, batch: int) -> float:
    """Fraction of routed-expert bytes a decode step reads: distinct experts hit by `batch` tokens."""
    if spec.moe is None:
        return 1.0
    e, k = spec.moe.num_experts, spec.moe.experts_per_token
    return 1.0 - (1.0 - k / e) ** batch


def experts_touched(spec: ModelSpec, tokens: int) -> float:
    """Distinct routed experts `tokens` routed tokens reach in one MoE layer (expected, uniform routing)."""
    if spec.moe is None:
        return 0.0
    return spec.moe.num_experts * active_fraction(spec, tokens)


@record
class ReadBytes:
    """Weight bytes one decode step reads per layer, and of those the routed experts' (MoE: only the experts the
    batch routes to)."""

    total: list[float]
    experts: list[float]


def read_bytes_per_layer(spec: ModelSpec, scheme: WeightScheme, batch: int) -> ReadBytes:
    """The weight bytes a decode step of `batch` tokens reads per layer; one object per spec, scheme and batch (the
    last few kept: the decode work built from it is known by it)."""
    return _SPEC_MEMO.get((spec, scheme), ("read_bytes", batch), lambda: _read_bytes_per_layer(spec, scheme, batch))


def _read_bytes_per_layer(spec: ModelSpec, scheme: WeightScheme, batch: int) -> ReadBytes:
    frac = active_fraction(spec, batch)

    def experts(tensors) -> float:
        return sum(scheme.tensor_bytes(t, scheme.compute_dtype) * frac for t in tensors if t.role is Role.EXPERT)

    def total(tensors) -> float:
        return experts(tensors) + sum(scheme.tensor_bytes(t, scheme.compute_dtype) for t in tensors
                                      if t.role is not Role.EXPERT)

    return ReadBytes(total=spec.per_layer(total), experts=spec.per_layer(experts))




@_per_spec
def matmul_flop_per_layer(spec: ModelSpec) -> list[float]:
    """Matmul FLOPs per token in each decoder layer: 2 x its active weights (routed experts: top-k of E)."""
    frac = spec.moe.experts_per_token / spec.moe.num_experts if spec.moe is not None else 1.0
    return spec.per_layer(lambda ts: 2.0 * sum(t.numel * (frac if t.role is Role.EXPERT else 1.0) for t in ts
                                               if t.is_parameter))


def head_flop(spec: ModelSpec) -> float:
    """lm_head's FLOPs for one position (only the last prompt position goes through it)."""
    return 2.0 * spec.hidden_size * spec.vocab_size


@_per_spec
def prefill_attention_flop_per_layer(spec: ModelSpec, prompt: int) -> list[float]:
    """QK^T and AV FLOPs for a causal prefill of `prompt` tokens, per layer (windows capped)."""
    out = []
    for a in spec.attention:
        # sum over positions p of min(p, window): QK^T and AV, 2 FLOPs per MAC
        if a.window is None or prompt <= a.window:
            pairs = prompt * (prompt + 1) / 2
        else:
            w = a.window
            pairs = w * (w + 1) / 2 + (prompt - w) * w
        out.append(2.0 * a.num_heads * (a.head_dim + a.value_dim) * pairs)
    return out


def prefill_attention_flop(spec: ModelSpec, prompt: int, batch: int = 1) -> float:
    """Of a prefill's FLOPs, the attention kernels' (QK^T and AV over the causal pairs) in every layer."""
    return sum(prefill_attention_flop_per_layer(spec, prompt)) * batch


def prefill_flop(spec: ModelSpec, prompt: int, batch: int = 1) -> float:
    """FLOPs of a prefill of `prompt` tokens x `batch` sequences: every layer's matmuls and attention, and lm_head
    for the last position."""
    matmul = sum(matmul_flop_per_layer(spec)) * prompt + head_flop(spec)
    return matmul * batch + prefill_attention_flop(spec, prompt, batch)


@record
class LayoutWork:
    """What one layer of an attention layout moves and computes at one decode step."""

    kv_read: float  # the attention kernel's read of the cache, in the compute dtype
    kv_stored: float  # the cache as stored (what a bandwidth roofline must read)
    kv_update: float  # a quantized cache's extra update traffic
    attention_flop: float
    expand_flop: float  # MLA expansion's FLOPs (0: none)
    expand_bytes: float  # MLA expansion's bytes moved


@record(kw_only=True)
class DecodeWork:
    """What one decode step at one context moves and computes, per layer: the weights from the per-layer reads, the
    attention once per distinct layout (spec.attention_groups), `layout(i)` for layer i."""

    weights_bytes: list[float]  # read per layer (MoE: the routed experts only)
    expert_bytes: list[float]  # of those, the routed experts'
    touched: float  # routed experts computed in a layer with experts (distinct experts the batch reaches)
    layouts: tuple[LayoutWork, ...]  # per distinct attention layout
    layout_of: tuple[int, ...]  # each layer's index into layouts
    head_bytes: float  # lm_head (or the tied embedding) and the final norm

    def layout(self, i: int) -> LayoutWork:
        return self.layouts[self.layout_of[i]]

    def expert_calls(self, i: int) -> float:
        """Routed experts computed in layer i."""
        return self.touched if self.expert_bytes[i] else 0.0

    def per_layer(self, name: str) -> list[float]:
        """One LayoutWork figure for every layer (kv_read, attention_flop, ...)."""
        values = [getattr(w, name) for w in self.layouts]
        return [values[g] for g in self.layout_of]

    @cached_property
    def kinds(self) -> tuple[int, ...]:
        """Per layer, which of the distinct layers it is (equal work, so equal time on one device): a model has one
        to a few (dense and MoE layers, sliding and full attention), and the decode time of each is priced once."""
        return _kinds(self.weights_bytes, self.expert_bytes, self.layout_of)

    @cached_property
    def first_of_kind(self) -> tuple[int, ...]:
        """For each kind (its number), the first layer of that kind: the one whose work prices them all. One object for
        equal kinds, as the kinds are."""
        kinds = self.kinds
        if type(kinds) is not tuple:
            return _first_of(kinds)
        first = _FIRSTS.get(kinds)
        if first is None:
            first = _FIRSTS[kinds] = _first_of(kinds)
        return first


def _first_of(kinds) -> tuple[int, ...]:
    first: dict[int, int] = {}
    for i, k in enumerate(kinds):
        first.setdefault(k, i)
    return tuple(first[k] for k in range(len(first)))


def _kinds(weights_bytes: list[float], expert_bytes: list[float], layout_of: tuple[int, ...]) -> tuple[int, ...]:
    """DecodeWork's kinds, found once for the same per-layer lists (a decode's work at every context shares its reads'
    lists), and one object for equal kinds (every scheme of a model has the same, most often): what is grouped by
    them is then found once (speed._Layout.grouped)."""
    def make():
        seen: dict[tuple, int] = {}
        kinds = tuple(seen.setdefault(key, len(seen)) for key in zip(weights_bytes, expert_bytes, layout_of))
        if len(_EQUAL_KINDS) > 256:
            _EQUAL_KINDS.clear()
            _FIRSTS.clear()
        return _EQUAL_KINDS.setdefault(kinds, kinds)
    return _KINDS.get((weights_bytes, expert_bytes, layout_of), (), make)


_KINDS = ObjectMemo(64)
_EQUAL_KINDS: dict[tuple[int, ...], tuple[int, ...]] = {}
_FIRSTS: dict[tuple[int, ...], tuple[int, ...]] = {}


def decode_work(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, batch: int, context: int,
                costs: LayerCosts, read: ReadBytes | None = None) -> DecodeWork:
    """What a decode step at `context` moves and computes per layer; the same work for equal arguments is built once
    (the search prices many placements of one scheme and cache at the same two contexts)."""
    read = read if read is not None else read_bytes_per_layer(spec, scheme, batch)
    key = ("decode_work", scheme.compute_dtype, batch, context, costs.head_read)
    return _SPEC_MEMO.get((spec, read, kv), key, lambda: _decode_work(spec, scheme, kv, batch, context, costs, read))


def _decode_work(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, batch: int, context: int,
                 costs: LayerCosts, read: ReadBytes) -> DecodeWork:
    compute_bytes = dtype_bytes(scheme.compute_dtype)

    def layout(a) -> LayoutWork:
        tokens = a.cached_tokens(context) * batch
        elements = tokens * a.kv_elements_per_token
        stored = float(math.ceil(layer_kv_bytes(a, kv, context, batch)))
        # an expanding MLA layer's kernel reads the expanded K and V, in the compute dtype, not the cache
        read = (a.attention_read_elements_per_token * tokens * compute_bytes if a.expands_cache
                else elements * compute_bytes if kv.dequantizes_whole_layer else stored)
        return LayoutWork(kv_read=read, kv_stored=stored, kv_update=elements * kv.update_extra_bytes_per_element,
                          attention_flop=2.0 * a.num_heads * (a.head_dim + a.value_dim) * tokens,
                          expand_flop=a.expand_flop_per_token * tokens,
                          expand_bytes=float(a.expand_traffic_elements_per_token * tokens) * compute_bytes)

    return DecodeWork(weights_bytes=read.total, expert_bytes=read.experts, touched=experts_touched(spec, batch),
                      layouts=tuple(layout(a) for a, _ in spec.attention_groups), layout_of=spec.attention_group_of,
                      head_bytes=float(costs.head_read))


@_per_spec
def expert_flop_share(spec: ModelSpec) -> list[float]:
    """Of each layer's prefill FLOPs, the routed experts' share (their matmuls; attention stays with the layer)."""
    if spec.moe is None:
        return [0.0] * spec.num_layers
    frac = spec.moe.experts_per_token / spec.moe.num_experts
    experts = spec.per_layer(lambda ts: 2.0 * frac * sum(t.numel for t in ts if t.role is Role.EXPERT))
    matmul = matmul_flop_per_layer(spec)
    return [e / m if m else 0.0 for e, m in zip(experts, matmul)]


def prefill_kinds(spec: ModelSpec, prompt: int, chunk: int
                  ) -> tuple[list[int], list[tuple[float, float, float, float]]]:
    """Per layer, which kind of prefill work it does (its number), and each kind's work for one sequence: matmul FLOPs
    per token, MLA expansion FLOPs and attention FLOPs of the whole prompt, and the routed experts' share of the
    matmuls. Equal layers (of a model's few kinds) are priced once."""
    def make():
        seen: dict[tuple, int] = {}
        kinds = [seen.setdefault(key, len(seen)) for key in zip(
            matmul_flop_per_layer(spec), prefill_expand_flop_per_layer(spec, prompt, chunk),
            prefill_attention_flop_per_layer(spec, prompt), expert_flop_share(spec))]
        return kinds, list(seen)
    return _SPEC_MEMO.get((spec,), ("prefill_kinds", prompt, chunk), make)
