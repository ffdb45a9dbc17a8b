"""A model's exact weight inventory, counted from its config.json.

`ModelSpec` holds every weight tensor of the transformers model a config describes
(name, shape, layer, role, kind) plus the attention layout needed for the KV cache.
The builders per architecture live in planner/architectures/; the generic paths for any other
decoder in planner/generic.py (safetensors headers) and runtime/inventory.py (transformers on the
meta device); this module holds the data types and the arithmetic over them. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import field
from functools import cached_property
from enum import Enum
from typing import Iterable

from .record import record
from .errors import ConfigError

# Bytes per element of the dtypes a checkpoint or a cache may hold.
DTYPE_BYTES: dict[str, float] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
# Short names accepted everywhere a dtype is asked for.
DTYPE_ALIASES = {
    "fp64": "float64",
    "f64": "float64",
    "fp32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
    "f8_e4m3": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
    # safetensors header spellings
    "F64": "float64",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def canonical_dtype(name: str) -> str:
    """'bf16', 'BF16', 'torch.bfloat16' -> 'bfloat16'. Unknown names raise ConfigError."""
    key = str(name).strip()
    key = key.removeprefix("torch.")
    if key in DTYPE_BYTES:
        return key
    if key in DTYPE_ALIASES:
        return DTYPE_ALIASES[key]
    if key.lower() in DTYPE_ALIASES:
        return DTYPE_ALIASES[key.lower()]
    raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")


def dtype_bytes(name: str) -> float:
    return DTYPE_BYTES[canonical_dtype(name)]


# Which path produced a ModelSpec's tensor inventory (ModelSpec.inventory).
INVENTORY_HAND_WRITTEN = "hand-written (planner/architectures)"
INVENTORY_HEADERS = "safetensors headers"
INVENTORY_META_DEVICE = "transformers meta device"


class Role(str, Enum):
    ATTENTION = "attention"
    MLP = "mlp"  # dense MLPs and always-active shared experts
    EXPERT = "expert"  # routed experts: only top-k of them run per token
    ROUTER = "router"
    NORM = "norm"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"


class Kind(str, Enum):
    """What kind of module holds the tensor; decides what a quantizer touches."""

    LINEAR = "linear"  # nn.Linear weight [out, in]
    BIAS = "bias"  # nn.Linear bias
    EXPERTS = "experts"  # fused 3D routed-expert weight [E, out, in] or [E, in, out] (transformers 5: not an nn.Linear)
    EXPERTS_BIAS = "experts_bias"  # fused per-expert bias [E, out] (gpt_oss): routed, never quantized
    ROUTER = "router"  # router weight [E, H] or bias held by a router module that quantizers leave alone
    NORM = "norm"
    EMBEDDING = "embedding"
    BUFFER = "buffer"  # persistent buffer saved in the checkpoint (not a parameter)
    OTHER = "other"  # any other parameter a quantizer leaves alone (gpt_oss attention sinks [heads])


@record(kw_only=True)
class TensorSpec:
    """One parameter tensor of the model: its name, shape, role, dtype and layer."""

    name: str
    shape: tuple[int, ...]
    role: Role
    kind: Kind
    layer: int | None = None  # decoder layer index; None for embeddings, final norm, lm_head
    dtype: str | None = None  # dtype on disk when a checkpoint header said so
    held_dtype: str | None = None  # dtype transformers holds it in whatever the load dtype (fp32 routers: fp32.py)
    transposed: bool = False  # Kind.EXPERTS stored [E, in, out] (gpt_oss, llama4) rather than [E, out, in]
    # Bytes a pre-quantized checkpoint's safetensors headers hold for this parameter (its packed weight and side
    # tensors: planner/published.py owner_of), where they were read and differ from its format's rule; None otherwise.
    stored_bytes: int | None = None

    def __post_init__(self) -> None:
        if any((not isinstance(d, int)) or d <= 0 for d in self.shape):  # () is a scalar parameter
            raise ConfigError(f"tensor {self.name}: bad shape {self.shape}")
        if self.kind is Kind.EXPERTS and len(self.shape) != 3:
            raise ConfigError(f"tensor {self.name}: fused experts are [E, out, in], got {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_parameter(self) -> bool:
        return self.kind is not Kind.BUFFER

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(out, in) of the matrix a matmul reads: an nn.Linear weight, or one routed expert's slice of a fused
        Kind.EXPERTS tensor, whichever way it is stored."""
        if self.kind is Kind.EXPERTS:
            _, a, b = self.shape
            return (b, a) if self.transposed else (a, b)
        if len(self.shape) != 2:
            raise ValueError(f"tensor {self.name} {self.shape} is not a matrix")
        return self.shape

    def bytes(self, dtype: str) -> int:
        return int(self.numel * dtype_bytes(dtype))


@record(kw_only=True)
class AttentionLayout:
    """What one decoder layer keeps in the KV cache, per token."""

    kind: str  # "mha" (incl. GQA/MQA) or "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int  # K/V head dim for mha; for mla the q/k head dim (nope + rope)
    window: int | None = None  # sliding window: the cache never holds more tokens
    chunked: bool = False  # the window is llama4's attention chunk (a token sees its chunk only), not a sliding one
    mla_cache_dim: int | None = None  # mla: kv_lora_rank + qk_rope_head_dim
    mla_rope_dim: int | None = None  # mla: qk_rope_head_dim (the part of K shared by every head, cached as is)
    v_head_dim: int | None = None  # mla: V's head dim (K's is head_dim = qk_nope + qk_rope)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements cached per token for this layer (K and V together)."""
        if self.kind == "mla":
            assert self.mla_cache_dim is not None
            return self.mla_cache_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """V's head dim: head_dim, except in MLA layers that say otherwise."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @property
    def expands_cache(self) -> bool:
        """True for an MLA layer as transformers runs it (deepseek_v2/v3 `expand_kv`, 5.17-5.24): the cache holds the
        compressed latent, and every forward up-projects the whole cached context to full K and V."""
        return self.kind == "mla" and self.mla_rope_dim is not None and self.v_head_dim is not None

    def _mla_dims(self) -> tuple[int, int, int, int]:
        """(kv_lora_rank, qk_nope, qk_rope, v) of an MLA layer."""
        assert self.mla_cache_dim is not None and self.mla_rope_dim is not None and self.v_head_dim is not None
        rope = self.mla_rope_dim
        return self.mla_cache_dim - rope, self.head_dim - rope, rope, self.v_head_dim

    @property
    def expanded_elements_per_token(self) -> int:
        """Per cached token, the elements the expansion materialises (0 without one): kv_b_proj's output, heads x
        (nope + v), whose v part is the value states, and the key tensor built from it, heads x (nope + rope)."""
        if not self.expands_cache:
            return 0
        _, nope, rope, v = self._mla_dims()
        return self.num_heads * ((nope + v) + (nope + rope))

    @property
    def expand_flop_per_token(self) -> float:
        """Per cached token, the expansion's FLOPs: kv_b_proj, [kv_lora_rank] -> [heads x (nope + v)]."""
        if not self.expands_cache:
            return 0.0
        lora, nope, _, v = self._mla_dims()
        return 2.0 * lora * self.num_heads * (nope + v)

    @property
    def expand_traffic_elements_per_token(self) -> int:
        """Per cached token, the elements the expansion reads and writes: the latent and k_rot read (kv_lora_rank +
        rope), kv_b_proj's output written (heads x (nope + v)), k_nope read back and the key written (heads x nope,
        heads x (nope + rope)). The attention kernel's read of K and V is the KV read (`attention_read_...`)."""
        if not self.expands_cache:
            return 0
        lora, nope, rope, v = self._mla_dims()
        return lora + rope + self.num_heads * ((nope + v) + nope + (nope + rope))

    @property
    def attention_read_elements_per_token(self) -> int:
        """Per cached token, the K and V elements the attention kernel reads: the cache itself, or for an expanding
        MLA layer the expanded K (heads x (nope + rope)) and V (heads x v)."""
        if self.expands_cache:
            return self.num_heads * (self.head_dim + self.value_dim)
        return self.kv_elements_per_token

    @property
    def family(self) -> str:
        """MLA (a compressed latent), MQA (one K/V head), GQA (K/V heads shared by groups of heads) or MHA."""
        if self.kind == "mla":
            return "MLA"
        if self.num_kv_heads == 1 and self.num_heads > 1:
            return "MQA"
        return "GQA" if self.num_kv_heads < self.num_heads else "MHA"

    def cached_tokens(self, context: int) -> int:
        return context if self.window is None else min(context, self.window)


@record(kw_only=True)
class MoEInfo:
    """A mixture of experts' routing: experts per layer and per token, shared experts, MoE layers."""

    num_experts: int
    experts_per_token: int
    num_shared_experts: int = 0
    moe_layers: tuple[int, ...] = ()
    expert_intermediate_size: int | None = None  # I of one routed expert (gate_up is 2I wide, in either layout)


@record(kw_only=True)
class ModelSpec:
    """A model's exact inventory, from its config and tensor headers: every tensor, the attention layouts, the
    limits."""

    name: str
    model_type: str
    architecture: str  # transformers class, e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    max_context: int
    dtype: str  # checkpoint dtype (config's torch_dtype / dtype), canonical
    tie_word_embeddings: bool
    tensors: tuple[TensorSpec, ...]
    attention: tuple[AttentionLayout, ...]  # one per decoder layer
    moe: MoEInfo | None = None
    source: str = ""  # where the spec came from: catalog, a directory, the HF cache
    location: str = ""  # what an engine loads it by: a local directory's absolute path, else the hub id (the name)
    notes: tuple[str, ...] = ()
    checkpoint_bytes: int | None = None  # exact bytes of the tensors on disk (safetensors headers)
    inventory: str = INVENTORY_HAND_WRITTEN  # which path listed the tensors (the INVENTORY_* names above)
    config: dict = field(default_factory=dict, compare=False, repr=False)
    # The GGUF file the model was read from (planner.gguf_model.GGUFModel): llama.cpp's plans take its own tensors
    gguf: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.attention) != self.num_layers:
            raise ConfigError(f"{self.name}: {len(self.attention)} attention layouts for {self.num_layers} layers")

    # ------------------------------------------------------------ parameters
    # Derived values are cached_property: the search asks for them thousands of times, and a frozen
    # dataclass's __dict__ still takes them (dataclasses.replace builds a new instance, without them).
    @cached_property
    def params_total(self) -> int:
        return sum(t.numel for t in self.tensors if t.is_parameter)

    @cached_property
    def params_active(self) -> int:
        """Parameters touched per token: routed experts count only top-k of E."""
        if self.moe is None:
            return self.params_total
        frac = self.moe.experts_per_token / self.moe.num_experts
        total = 0.0
        for t in self.tensors:
            if not t.is_parameter:
                continue
            total += t.numel * frac if t.role is Role.EXPERT else t.numel
        return int(round(total))

    def params_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {r.value: 0 for r in Role}
        for t in self.tensors:
            if t.is_parameter:
                out[t.role.value] += t.numel
        return {k: v for k, v in out.items() if v}

    # ------------------------------------------------------------ tensors
    def layer_tensors(self, layer: int) -> tuple[TensorSpec, ...]:
        return self._tensors_by_layer[layer]

    def non_layer_tensors(self) -> tuple[TensorSpec, ...]:
        return self._tensors_by_layer[None]

    @cached_property
    def _tensors_by_layer(self) -> dict[int | None, tuple[TensorSpec, ...]]:
        groups: dict[int | None, list[TensorSpec]] = {i: [] for i in range(self.num_layers)}
        groups[None] = []
        for t in self.tensors:
            groups[t.layer].append(t)
        return {k: tuple(v) for k, v in groups.items()}

    @cached_property
    def _layer_signatures(self) -> tuple[tuple, ...]:
        return tuple(tuple((t.shape, t.kind, t.role, t.transposed) for t in self.layer_tensors(i))
                     for i in range(self.num_layers))

    def layer_signature(self, layer: int) -> tuple:
        """Identical signatures mean identical per-layer byte counts under any scheme."""
        return self._layer_signatures[layer]

    @cached_property
    def mlp_width(self) -> int:
        """The widest MLP intermediate one token makes in a layer: dense or shared-expert MLPs (the input width
        of their projections back to the hidden size) plus, in MoE layers, top-k routed experts' intermediates."""
        moe_layers = set(self.moe.moe_layers) if self.moe is not None else set()
        routed = (self.moe.experts_per_token * (self.moe.expert_intermediate_size or 0)) if self.moe else 0

        def width(i: int) -> int:
            down = sum(t.shape[1] for t in self.layer_tensors(i)
                       if t.role is Role.MLP and t.kind is Kind.LINEAR and len(t.shape) == 2
                       and t.shape[0] == self.hidden_size)
            return down + (routed if i in moe_layers else 0)

        return max((width(i) for i in range(self.num_layers)), default=self.intermediate_size)

    @cached_property
    def largest_layer_linear_numel(self) -> int:
        """Elements of the largest nn.Linear weight inside the decoder layers (0 without any)."""
        return max((t.numel for t in self.tensors if t.kind is Kind.LINEAR and t.layer is not None), default=0)

    @cached_property
    def largest_expert_matrix_numel(self) -> int:
        """Elements of one routed expert's largest matrix (its slice of a fused gate_up or down; 0 without any)."""
        return max((math.prod(t.matrix_shape) for t in self.tensors if t.kind is Kind.EXPERTS), default=0)

    def per_layer(self, fn) -> list:
        """fn(layer tensors) for every layer, computed once per distinct layer signature."""
        values = [fn(self.layer_tensors(i)) for i in self._signature_groups[0]]
        return [values[g] for g in self._signature_groups[1]]

    @cached_property
    def _signature_groups(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(a representative layer of each distinct signature, each layer's signature group)."""
        index: dict = {}
        first, group = [], []
        for i in range(self.num_layers):
            sig = self.layer_signature(i)
            if sig not in index:
                index[sig] = len(first)
                first.append(i)
            group.append(index[sig])
        return tuple(first), tuple(group)

    @cached_property
    def attention_groups(self) -> tuple[tuple[AttentionLayout, int], ...]:
        """Distinct attention layouts with how many layers have each."""
        counts: dict[AttentionLayout, int] = {}
        for a in self.attention:
            counts[a] = counts.get(a, 0) + 1
        return tuple(counts.items())

    @cached_property
    def attention_group_of(self) -> tuple[int, ...]:
        """Each layer's index into attention_groups (per-layer figures computed once per distinct layout)."""
        index = {a: g for g, (a, _) in enumerate(self.attention_groups)}
        return tuple(index[a] for a in self.attention)

    def per_attention_layout(self, fn) -> list:
        """fn(layout) for every layer, computed once per distinct layout."""
        values = [fn(a) for a, _ in self.attention_groups]
        return [values[g] for g in self.attention_group_of]

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    # ------------------------------------------------------------ bytes
    def layer_bytes(self, layer: int, dtype: str | None = None) -> int:
        """Bytes of one decoder layer's tensors, every tensor in `dtype` (default: checkpoint dtype)."""
        return sum(t.bytes(dtype or self.dtype) for t in self.layer_tensors(layer))

    def weight_bytes(self, dtype: str | None = None) -> int:
        """All tensors in one dtype (tied embeddings counted once)."""
        return sum(t.bytes(dtype or self.dtype) for t in self.tensors)

    # ------------------------------------------------------------ KV cache
    def kv_bytes_per_token_per_layer(self, dtype_bytes_per_element: float = 2.0) -> tuple[float, ...]:
        return tuple(a.kv_elements_per_token * dtype_bytes_per_element for a in self.attention)

    def kv_bytes_per_token(self, dtype_bytes_per_element: float = 2.0) -> float:
        """KV bytes per token summed over layers, as if the context were within every window."""
        return sum(self.kv_bytes_per_token_per_layer(dtype_bytes_per_element))

    def kv_cache_elements(self, context: int, layers: Iterable[int] | None = None) -> int:
        """Cached elements for `context` tokens (batch 1), sliding windows capped."""
        idx = range(self.num_layers) if layers is None else layers
        return sum(self.attention[i].cached_tokens(context) * self.attention[i].kv_elements_per_token for i in idx)

    @property
    def attention_impl(self) -> str:
        """The attention kernel transformers 5 runs: gemma2's logit softcapping forces eager, else SDPA."""
        if self.model_type == "gemma2" and self.config.get("attn_logit_softcapping", 50.0) is not None:
            return "eager"
        return "sdpa"

    @property
    def sliding_window_layers(self) -> int:
        return sum(1 for a in self.attention if a.window is not None)

    def summary(self) -> dict:
        """The facts `vramplan inspect --json` prints."""
        ckpt = self.dtype
        weight_bytes = {d: self.weight_bytes(d) for d in ("float32", "bfloat16", "float16")}
        out = {
            "name": self.name,
            "source": self.source,
            "inventory": self.inventory,
            "model_type": self.model_type,
            "architecture": self.architecture,
            "checkpoint_dtype": ckpt,
            "params_total": self.params_total,
            "params_active": self.params_active,
            "params_by_role": self.params_by_role(),
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention": _attention_summary(self.attention),
            "kv_bytes_per_token": int(self.kv_bytes_per_token(2.0)),
            "kv_bytes_per_token_per_layer": [int(x) for x in self.kv_bytes_per_token_per_layer(2.0)],
            "sliding_window_layers": self.sliding_window_layers,
            "weight_bytes": {"bf16": weight_bytes["bfloat16"], "fp16": weight_bytes["float16"],
                             "fp32": weight_bytes["float32"]},
            "layer_bytes_bf16": [self.layer_bytes(i, "bfloat16") for i in range(self.num_layers)],
            "non_layer_bytes_bf16": sum(t.bytes("bfloat16") for t in self.non_layer_tensors()),
            "num_tensors": len(self.tensors),
            "notes": list(self.notes),
        }
        if self.checkpoint_bytes is not None:
            out["weight_bytes"]["checkpoint"] = self.checkpoint_bytes
        if self.moe is not None:
            out["moe"] = {
                "num_experts": self.moe.num_experts,
                "experts_per_token": self.moe.experts_per_token,
                "num_shared_experts": self.moe.num_shared_experts,
                "moe_layers": len(self.moe.moe_layers),
            }
        return out


def _attention_summary(layouts: tuple[AttentionLayout, ...]) -> dict:
    a = layouts[0]
    windows = sorted({x.window for x in layouts if x.window is not None})
    out = {
        "kind": a.kind,
        "family": a.family,
        "num_heads": a.num_heads,
        "num_kv_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "sliding_windows": windows,
    }
    if a.kind == "mla":
        out["mla_cache_dim"] = a.mla_cache_dim
    return out


def context_limit(spec: ModelSpec) -> tuple[int, str]:
    """The longest context the model is made for (0: its config does not say), and why: max_position_embeddings, or
    longer where a rope scaling (YaRN, dynamic, linear, longrope) names the original length it extends by `factor`.
    A scaling without `original_max_position_embeddings` (gemma-3, Llama-3.1) is already counted in
    max_position_embeddings, so it extends nothing."""
    base = spec.max_context
    cfg = spec.config.get("text_config") if isinstance(spec.config.get("text_config"), dict) else spec.config
    why = f"max_position_embeddings {base}"
    best = base
    for key in ("rope_scaling", "rope_parameters"):
        r = cfg.get(key)
        entries = [r] if isinstance(r, dict) and ("factor" in r or "rope_type" in r or "type" in r) else (
            [v for v in r.values() if isinstance(v, dict)] if isinstance(r, dict) else [])
        for e in entries:
            kind, factor = e.get("rope_type") or e.get("type"), e.get("factor")
            original = e.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
            if kind in (None, "default", "llama3") or isinstance(factor, bool) or not isinstance(factor, (int, float)):
                continue
            if isinstance(original, int) and not isinstance(original, bool) and factor > 1:
                extended = int(original * factor)
                if extended > best:
                    best, why = extended, f"{key} {kind} x{factor:g} of {original} tokens"
    return best, why
