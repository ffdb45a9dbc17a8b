"""Pieces every builder shares: the tensor inventory, self-attention, per-layer windows, the decoder loop.

`build_decoder` walks the decoder layers of a `<Arch>ForCausalLM`: embeddings, then per layer the
attention (an `MHA` or an MLA), the feed-forward block (a callable that adds its tensors and says
whether the layer is a routed-expert layer) and the layer's norms, then the final norm and lm_head.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Protocol

from ..record import record
from ..errors import ConfigError
from ..modelspec import AttentionLayout, Kind, ModelSpec, MoEInfo, Role, TensorSpec
from .config import Cfg


class Inventory:
    """Collects tensors in transformers' order."""

    def __init__(self) -> None:
        self.tensors: list[TensorSpec] = []

    def add(self, name: str, shape: tuple[int, ...], role: Role, kind: Kind, layer: int | None = None, *,
            transposed: bool = False) -> None:
        self.tensors.append(TensorSpec(name=name, shape=tuple(shape), role=role, kind=kind, layer=layer,
                                       transposed=transposed))

    def linear(self, name: str, out_f: int, in_f: int, role: Role, layer: int | None, bias: bool = False) -> None:
        self.add(f"{name}.weight", (out_f, in_f), role, Kind.LINEAR, layer)
        if bias:
            self.add(f"{name}.bias", (out_f,), role, Kind.BIAS, layer)

    def norm(self, name: str, dim: int, layer: int | None, bias: bool = False) -> None:
        self.add(f"{name}.weight", (dim,), Role.NORM, Kind.NORM, layer)
        if bias:  # nn.LayerNorm
            self.add(f"{name}.bias", (dim,), Role.NORM, Kind.NORM, layer)

    def gated_mlp(self, prefix: str, hidden: int, inter: int, layer: int, bias: bool = False) -> None:
        self.linear(f"{prefix}.gate_proj", inter, hidden, Role.MLP, layer, bias)
        self.linear(f"{prefix}.up_proj", inter, hidden, Role.MLP, layer, bias)
        self.linear(f"{prefix}.down_proj", hidden, inter, Role.MLP, layer, bias)

    def router(self, name: str, experts: int, hidden: int, layer: int, bias: bool = False) -> None:
        """A router's [E, H] weight (and [E] bias): held by a router module that quantizers leave alone."""
        self.add(f"{name}.weight", (experts, hidden), Role.ROUTER, Kind.ROUTER, layer)
        if bias:
            self.add(f"{name}.bias", (experts,), Role.ROUTER, Kind.ROUTER, layer)

    def fused_experts(self, prefix: str, n: int, hidden: int, inter: int, layer: int, *, transposed: bool = False,
                      bias: bool = False) -> None:
        """transformers 5: one gate_up and one down parameter for all experts, not nn.Linear.

        Most models store them [E, 2I, H] and [E, H, I] (out, in); gpt_oss and llama4 store them
        transposed, [E, H, 2I] and [E, I, H]. gpt_oss adds a bias per expert.
        """
        gate_up = (n, hidden, 2 * inter) if transposed else (n, 2 * inter, hidden)
        down = (n, inter, hidden) if transposed else (n, hidden, inter)
        self.add(f"{prefix}.gate_up_proj", gate_up, Role.EXPERT, Kind.EXPERTS, layer, transposed=transposed)
        if bias:
            self.add(f"{prefix}.gate_up_proj_bias", (n, 2 * inter), Role.EXPERT, Kind.EXPERTS_BIAS, layer)
        self.add(f"{prefix}.down_proj", down, Role.EXPERT, Kind.EXPERTS, layer, transposed=transposed)
        if bias:
            self.add(f"{prefix}.down_proj_bias", (n, hidden), Role.EXPERT, Kind.EXPERTS_BIAS, layer)


# ------------------------------------------------------------------ attention
def head_dim(c: Cfg, default: int | None = None) -> int:
    """The config's head_dim; else the architecture's default; else hidden_size / num_attention_heads."""
    if c.has("head_dim"):
        return c.int("head_dim")
    if default is not None:
        return default
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    if hidden % heads:
        raise ConfigError(f"{c.where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}; set "
                          "head_dim")
    return hidden // heads


def kv_heads(c: Cfg) -> int:
    heads = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    if heads % kv:
        raise ConfigError(f"{c.where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return kv


class AttentionBlock(Protocol):
    def add(self, inv: Inventory, layer: int, prefix: str) -> None: ...

    def layout(self, window: int | None, chunked: bool = False) -> AttentionLayout: ...


@record(kw_only=True)
class MHA:
    """Multi-head attention with GQA: q/k/v/o projections (or phi3's fused qkv) and their options."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: tuple[int, int] | None = None  # widths of q_norm and k_norm
    fused_qkv: bool = False  # phi3: one qkv_proj
    sinks: bool = False  # gpt_oss: one learned attention-sink logit per head

    def add(self, inv: Inventory, layer: int, prefix: str) -> None:
        p = f"{prefix}.self_attn"
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.sinks:
            inv.add(f"{p}.sinks", (self.heads,), Role.ATTENTION, Kind.OTHER, layer)
        if self.fused_qkv:
            inv.linear(f"{p}.qkv_proj", q_out + 2 * kv_out, self.hidden, Role.ATTENTION, layer)
        else:
            inv.linear(f"{p}.q_proj", q_out, self.hidden, Role.ATTENTION, layer, self.qkv_bias)
            inv.linear(f"{p}.k_proj", kv_out, self.hidden, Role.ATTENTION, layer, self.qkv_bias)
            inv.linear(f"{p}.v_proj", kv_out, self.hidden, Role.ATTENTION, layer, self.qkv_bias)
        inv.linear(f"{p}.o_proj", self.hidden, q_out, Role.ATTENTION, layer, self.o_bias)
        if self.qk_norm is not None:
            inv.norm(f"{p}.q_norm", self.qk_norm[0], layer)
            inv.norm(f"{p}.k_norm", self.qk_norm[1], layer)

    def layout(self, window: int | None, chunked: bool = False) -> AttentionLayout:
        return AttentionLayout(kind="mha", num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                               window=window, chunked=chunked and window is not None)


def mha(c: Cfg, *, head_dim_default: int | None = None, bias: bool = False,
        o_bias: bool | None = None, qk_norm: str | None = None, **options) -> MHA:
    """MHA from the config. bias: q/k/v biases (o_proj too unless o_bias says otherwise).

    qk_norm: None, "head" (RMSNorm over head_dim, qwen3-style) or "all_heads" (over all heads, olmo2-style).
    """
    heads = c.int("num_attention_heads")
    kv = kv_heads(c)
    d = head_dim(c, head_dim_default)
    norms = {None: None, "head": (d, d), "all_heads": (heads * d, kv * d)}[qk_norm]
    return MHA(hidden=c.int("hidden_size"), heads=heads, kv_heads=kv, head_dim=d, qkv_bias=bias,
               o_bias=bias if o_bias is None else o_bias, qk_norm=norms, **options)


# ------------------------------------------------------------------ windows per layer
# The config field that bounds what a layer type keeps in the cache. transformers' DynamicCache gives
# "sliding_attention" and "chunked_attention" layers the same DynamicSlidingWindowLayer, with
# sliding_window = attention_chunk_size for chunked ones (cache_utils.get_layer_types_and_kwargs), so a
# chunked layer never holds more than attention_chunk_size tokens: a window for the planner.
WINDOW_FIELD = {"full_attention": None, "sliding_attention": "sliding_window",
                "chunked_attention": "attention_chunk_size"}
SLIDING, FULL, CHUNKED = "sliding_attention", "full_attention", "chunked_attention"

LayerTypeRule = Callable[[int], str]


def all_sliding(i: int) -> str:
    """mistral, mixtral, phi3, starcoder2, ...: every layer slides when the config sets a window."""
    return SLIDING


def sliding_unless_every(pattern: int) -> LayerTypeRule:
    """Every `pattern`-th layer is global, the others slide (gemma2: 2, cohere2/exaone4: 4, gemma3: 6)."""
    return lambda i: SLIDING if (i + 1) % pattern else FULL


def rope_layers(c: Cfg, n_layers: int) -> list[int]:
    """`no_rope_layers` (smollm3, llama4): despite the name, 1 marks a layer that uses RoPE.

    Default, as both config classes derive it: every `no_rope_layer_interval`-th layer (4) is NoPE.
    """
    given = c.int_list("no_rope_layers")
    if not given:
        interval = c.int("no_rope_layer_interval", 4)
        return [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(given) != n_layers or not set(given) <= {0, 1}:
        raise ConfigError(f"{c.where}: no_rope_layers must list one flag (0 or 1) per layer ({n_layers})")
    return given


def window_per_layer(c: Cfg, n_layers: int, rule: LayerTypeRule | None) -> list[tuple[int | None, bool]]:
    """Tokens each layer's cache keeps at most (None: all), from `layer_types` or else the architecture's rule, and
    whether that window is a chunk (chunked_attention) rather than a sliding window.

    The rule is what the architecture's config class derives when layer_types is absent; a rule's
    sliding or chunked layer without a window in the config is a full-attention layer.
    """
    types = c.str_list("layer_types", n_layers)
    explicit = types is not None
    if types is None:
        if rule is None:
            return [(None, False)] * n_layers
        types = [rule(i) for i in range(n_layers)]
    out: list[tuple[int | None, bool]] = []
    for t in types:
        if t not in WINDOW_FIELD:
            raise ConfigError(f"{c.where}: unsupported layer type {t!r} (expected one of {', '.join(WINDOW_FIELD)})")
        field = WINDOW_FIELD[t]
        window = c.int(field, None) if field is not None else None
        if field is not None and window is None and explicit:
            raise ConfigError(f"{c.where}: layer_types has {t} but no {field}")
        out.append((window, t == CHUNKED and window is not None))
    return out


# ------------------------------------------------------------------ feed-forward blocks
FFN = Callable[[Inventory, int, str], bool]  # adds one layer's MLP/MoE tensors; True for a routed-expert layer


def dense_ffn(c: Cfg, *, inter: int | None = None, style: str = "gated", bias: bool = False,
              prefix: str = "mlp") -> FFN:
    """A dense MLP (width `inter`, default intermediate_size): gate/up/down ("gated"), one fused
    gate_up ("fused": glm4, phi3) or c_fc/c_proj ("fc": starcoder2)."""
    hidden = c.int("hidden_size")
    inter = c.int("intermediate_size") if inter is None else inter

    def add(inv: Inventory, i: int, p: str) -> bool:
        m = f"{p}.{prefix}"
        if style == "gated":
            inv.gated_mlp(m, hidden, inter, i, bias)
        elif style == "fused":
            inv.linear(f"{m}.gate_up_proj", 2 * inter, hidden, Role.MLP, i, bias)
            inv.linear(f"{m}.down_proj", hidden, inter, Role.MLP, i, bias)
        else:
            inv.linear(f"{m}.c_fc", inter, hidden, Role.MLP, i, bias)
            inv.linear(f"{m}.c_proj", hidden, inter, Role.MLP, i, bias)
        return False
    return add


# ------------------------------------------------------------------ the decoder
PRE_POST_NORMS = ("input_layernorm", "post_attention_layernorm")


def build_decoder(c: Cfg, name: str, *, arch: str, attn: AttentionBlock, ffn: FFN, norms=PRE_POST_NORMS,
                  norm_bias: bool = False, window_rule: LayerTypeRule | None = None, tie_default: bool = False,
                  head_bias: bool = False, moe: MoEInfo | None = None, notes=(), intermediate: int | None = None
                  ) -> ModelSpec:
    """The tensors of `<Arch>ForCausalLM` and its per-layer KV layout.

    moe: the experts' facts; its moe_layers are filled from the layers whose ffn says so.
    norm_bias: the norms are nn.LayerNorm (weight and bias), final norm included.
    """
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    inv = Inventory()
    inv.add("model.embed_tokens.weight", (c.int("vocab_size"), hidden), Role.EMBEDDING, Kind.EMBEDDING)
    tied = c.bool("tie_word_embeddings", tie_default)  # a tied lm_head has no tensor of its own
    moe_layers = []
    for i in range(n):
        p = f"model.layers.{i}"
        attn.add(inv, i, p)
        if ffn(inv, i, p):
            moe_layers.append(i)
        for norm in norms:
            inv.norm(f"{p}.{norm}", hidden, i, norm_bias)
    inv.norm("model.norm", hidden, None, norm_bias)
    if not tied:
        inv.linear("lm_head", c.int("vocab_size"), hidden, Role.LM_HEAD, None, head_bias)
    elif head_bias:  # tying shares the weight only: the bias stays a parameter of its own
        inv.add("lm_head.bias", (c.int("vocab_size"),), Role.LM_HEAD, Kind.BIAS)
    layouts = tuple(attn.layout(w, ch) for w, ch in window_per_layer(c, n, window_rule))
    if moe is not None:
        if moe.experts_per_token > moe.num_experts:
            raise ConfigError(f"{c.where}: num_experts_per_tok {moe.experts_per_token} exceeds the number of experts "
                              f"{moe.num_experts}")
        moe = replace(moe, moe_layers=tuple(moe_layers))
    return ModelSpec(
        name=name,
        model_type=c.d["model_type"],
        architecture=arch,
        num_layers=n,
        hidden_size=hidden,
        vocab_size=c.int("vocab_size"),
        intermediate_size=intermediate if intermediate is not None else c.int("intermediate_size"),
        max_context=c.int("max_position_embeddings", 0),
        dtype=c.dtype(),
        tie_word_embeddings=tied,
        tensors=tuple(inv.tensors),
        attention=layouts,
        moe=moe,
        notes=tuple(notes),
        config=c.d,
    )


def with_notes(spec: ModelSpec, *notes: str) -> ModelSpec:
    return replace(spec, notes=spec.notes + tuple(notes))
