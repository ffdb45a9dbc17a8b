"""Per-architecture builders: config.json (a dict) -> ModelSpec.

Each builder lists the tensors that transformers 5 creates for `<Arch>ForCausalLM`,
with the names `named_parameters()` gives them, checked tensor by tensor against
transformers on the meta device (tests/test_architectures.py). Quirks handled:
tied embeddings (no lm_head tensor), qkv biases (qwen2), explicit head_dim (qwen3,
gemma), GQA, fused projections (phi3), sliding-window layers (gemma2 alternating,
gemma3 5 local : 1 global, mistral/phi3 windows), MoE with fused 3D expert tensors,
shared experts and dense first layers (deepseek_v3), MLA (deepseek_v3).
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import ConfigError, UnsupportedArchitectureError
from .modelspec import AttentionLayout, Kind, ModelSpec, MoEInfo, Role, TensorSpec, canonical_dtype


class Cfg:
    """Typed, checked access to a config dict; every problem is a ConfigError naming the field."""

    def __init__(self, d: dict, where: str):
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: config is not a JSON object")
        self.d = d
        self.where = where

    # transformers' attribute_map: the same field under another name, depending on who saved the config
    ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",),
               "n_routed_experts": ("num_local_experts",), "num_nextn_predict_layers": ("num_mtp_layers",)}

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def _get(self, key: str):
        v = self.d.get(key)
        for alt in self.ALIASES.get(key, ()) if v is None else ():
            v = self.d.get(alt)
            if v is not None:
                break
        return v

    def int(self, key: str, default: Any = ..., *, minimum: int = 1) -> int:
        v = self._get(key)
        if v is None:
            if default is ...:
                raise ConfigError(f"{self.where}: missing required field {key!r}")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise ConfigError(f"{self.where}: field {key!r} must be an integer, got {v!r}")
        if v < minimum:
            raise ConfigError(f"{self.where}: field {key!r} must be >= {minimum}, got {v}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: field {key!r} must be true or false, got {v!r}")
        return v

    def int_list(self, key: str) -> list[int]:
        v = self.d.get(key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ConfigError(f"{self.where}: field {key!r} must be a list of integers, got {v!r}")
        return v

    def dtype(self) -> str:
        v = self.d.get("dtype") or self.d.get("torch_dtype") or "float32"
        if not isinstance(v, str):
            raise ConfigError(f"{self.where}: field 'torch_dtype' must be a string, got {v!r}")
        return canonical_dtype(v)


class _Inventory:
    """Collects tensors in transformers' order."""

    def __init__(self) -> None:
        self.tensors: list[TensorSpec] = []

    def add(self, name: str, shape: tuple[int, ...], role: Role, kind: Kind, layer: int | None = None) -> None:
        self.tensors.append(TensorSpec(name=name, shape=tuple(shape), role=role, kind=kind, layer=layer))

    def linear(self, name: str, out_f: int, in_f: int, role: Role, layer: int | None, bias: bool = False) -> None:
        self.add(f"{name}.weight", (out_f, in_f), role, Kind.LINEAR, layer)
        if bias:
            self.add(f"{name}.bias", (out_f,), role, Kind.BIAS, layer)

    def norm(self, name: str, dim: int, layer: int | None, role: Role = Role.NORM) -> None:
        self.add(f"{name}.weight", (dim,), role, Kind.NORM, layer)

    def gated_mlp(self, prefix: str, hidden: int, inter: int, layer: int, role: Role = Role.MLP, bias: bool = False) -> None:
        self.linear(f"{prefix}.gate_proj", inter, hidden, role, layer, bias)
        self.linear(f"{prefix}.up_proj", inter, hidden, role, layer, bias)
        self.linear(f"{prefix}.down_proj", hidden, inter, role, layer, bias)

    def fused_experts(self, prefix: str, n: int, hidden: int, inter: int, layer: int) -> None:
        # transformers 5: one [E, 2I, H] gate_up and one [E, H, I] down parameter, not nn.Linear.
        self.add(f"{prefix}.gate_up_proj", (n, 2 * inter, hidden), Role.EXPERT, Kind.EXPERTS, layer)
        self.add(f"{prefix}.down_proj", (n, hidden, inter), Role.EXPERT, Kind.EXPERTS, layer)


# ------------------------------------------------------------------ shared pieces
def _head_dim(c: Cfg, default: int | None = None) -> int:
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    if c.has("head_dim"):
        return c.int("head_dim")
    if default is not None:
        return default
    if hidden % heads:
        raise ConfigError(f"{c.where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim")
    return hidden // heads


def _kv_heads(c: Cfg) -> int:
    heads = c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    if heads % kv:
        raise ConfigError(f"{c.where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return kv


def _window_per_layer(c: Cfg, n_layers: int, default_types: Callable[[int], bool] | None) -> list[int | None]:
    """Sliding window per layer from `layer_types` when given, else from the architecture's rule."""
    window = c.int("sliding_window", None) if c.has("sliding_window") else None
    types = c.d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers:
            raise ConfigError(f"{c.where}: layer_types must list one type per layer ({n_layers})")
        out = []
        for t in types:
            if t == "sliding_attention":
                if window is None:
                    raise ConfigError(f"{c.where}: layer_types has sliding_attention but no sliding_window")
                out.append(window)
            elif t == "full_attention":
                out.append(None)
            else:
                raise ConfigError(f"{c.where}: unsupported layer type {t!r} (expected full_attention or sliding_attention)")
        return out
    if window is None or default_types is None:
        return [None] * n_layers
    return [window if default_types(i) else None for i in range(n_layers)]


def _embeddings_and_head(inv: _Inventory, c: Cfg, tie_default: bool, prefix: str = "model") -> bool:
    """Adds the input embedding; returns whether lm_head is tied (then it has no tensor of its own)."""
    inv.add(f"{prefix}.embed_tokens.weight", (c.int("vocab_size"), c.int("hidden_size")), Role.EMBEDDING, Kind.EMBEDDING)
    return c.bool("tie_word_embeddings", tie_default)


def _finish(inv: _Inventory, c: Cfg, tied: bool, prefix: str = "model") -> None:
    inv.norm(f"{prefix}.norm", c.int("hidden_size"), None)
    if not tied:
        inv.add("lm_head.weight", (c.int("vocab_size"), c.int("hidden_size")), Role.LM_HEAD, Kind.LINEAR)


def _mha_attention(inv, c, layer, p, *, head_dim, q_bias, kv_bias, o_bias, qk_norm):
    hidden = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    kv = _kv_heads(c)
    inv.linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden, Role.ATTENTION, layer, q_bias)
    inv.linear(f"{p}.self_attn.k_proj", kv * head_dim, hidden, Role.ATTENTION, layer, kv_bias)
    inv.linear(f"{p}.self_attn.v_proj", kv * head_dim, hidden, Role.ATTENTION, layer, kv_bias)
    inv.linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim, Role.ATTENTION, layer, o_bias)
    if qk_norm:
        inv.norm(f"{p}.self_attn.q_norm", head_dim, layer)
        inv.norm(f"{p}.self_attn.k_norm", head_dim, layer)


def _layouts(c: Cfg, n: int, head_dim: int, windows: list[int | None]) -> tuple[AttentionLayout, ...]:
    heads = c.int("num_attention_heads")
    kv = _kv_heads(c)
    return tuple(AttentionLayout(kind="mha", num_heads=heads, num_kv_heads=kv, head_dim=head_dim, window=w) for w in windows)


# Beyond these a config is corrupt, not big (the largest public models have ~130 layers, 256 experts).
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16


def _spec(c: Cfg, *, name, arch, inv, layouts, tied, moe=None, notes=(), intermediate=None) -> ModelSpec:
    return ModelSpec(
        name=name,
        model_type=c.d["model_type"],
        architecture=arch,
        num_layers=c.int("num_hidden_layers"),
        hidden_size=c.int("hidden_size"),
        vocab_size=c.int("vocab_size"),
        intermediate_size=intermediate if intermediate is not None else c.int("intermediate_size"),
        max_context=c.int("max_position_embeddings", 0, minimum=0),
        dtype=c.dtype(),
        tie_word_embeddings=tied,
        tensors=tuple(inv.tensors),
        attention=layouts,
        moe=moe,
        notes=tuple(notes),
        config=c.d,
    )


# ------------------------------------------------------------------ dense families
def _dense(c: Cfg, name: str, *, arch: str, head_dim_default=None, tie_default=False, q_bias=False, kv_bias=False,
           o_bias=False, mlp_bias=False, qk_norm=False, sandwich_norms=False, window_rule=None) -> ModelSpec:
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    inter = c.int("intermediate_size")
    hd = _head_dim(c, head_dim_default)
    inv = _Inventory()
    tied = _embeddings_and_head(inv, c, tie_default)
    for i in range(n):
        p = f"model.layers.{i}"
        _mha_attention(inv, c, i, p, head_dim=hd, q_bias=q_bias, kv_bias=kv_bias, o_bias=o_bias, qk_norm=qk_norm)
        inv.gated_mlp(f"{p}.mlp", hidden, inter, i, bias=mlp_bias)
        inv.norm(f"{p}.input_layernorm", hidden, i)
        inv.norm(f"{p}.post_attention_layernorm", hidden, i)
        if sandwich_norms:
            inv.norm(f"{p}.pre_feedforward_layernorm", hidden, i)
            inv.norm(f"{p}.post_feedforward_layernorm", hidden, i)
    _finish(inv, c, tied)
    windows = _window_per_layer(c, n, window_rule)
    return _spec(c, name=name, arch=arch, inv=inv, layouts=_layouts(c, n, hd, windows), tied=tied)


def _qwen_window_rule(c: Cfg):
    if not c.bool("use_sliding_window", False):
        return None
    mwl = c.int("max_window_layers", c.int("num_hidden_layers"), minimum=0)
    return lambda i: i >= mwl


def _qwen_windows_enabled(c: Cfg) -> Cfg:
    """Qwen configs carry a sliding_window value even when use_sliding_window is false: drop it then."""
    if not c.bool("use_sliding_window", False) and c.d.get("layer_types") is None:
        d = dict(c.d)
        d["sliding_window"] = None
        return Cfg(d, c.where)
    return c


def build_llama(c: Cfg, name: str) -> ModelSpec:
    ab = c.bool("attention_bias", False)
    return _dense(c, name, arch="LlamaForCausalLM", q_bias=ab, kv_bias=ab, o_bias=ab, mlp_bias=c.bool("mlp_bias", False))


def build_mistral(c: Cfg, name: str) -> ModelSpec:
    return _dense(c, name, arch="MistralForCausalLM", window_rule=lambda i: True)


def build_qwen2(c: Cfg, name: str) -> ModelSpec:
    rule = _qwen_window_rule(c)
    return _dense(_qwen_windows_enabled(c), name, arch="Qwen2ForCausalLM", q_bias=True, kv_bias=True, window_rule=rule)


def build_qwen3(c: Cfg, name: str) -> ModelSpec:
    ab = c.bool("attention_bias", False)
    rule = _qwen_window_rule(c)
    return _dense(_qwen_windows_enabled(c), name, arch="Qwen3ForCausalLM", head_dim_default=128, q_bias=ab, kv_bias=ab,
                  o_bias=ab, qk_norm=True, window_rule=rule)


def build_gemma2(c: Cfg, name: str) -> ModelSpec:
    ab = c.bool("attention_bias", False)
    return _dense(c, name, arch="Gemma2ForCausalLM", head_dim_default=256, tie_default=True, q_bias=ab, kv_bias=ab,
                  o_bias=ab, sandwich_norms=True, window_rule=lambda i: bool((i + 1) % 2))


def build_gemma3_text(c: Cfg, name: str) -> ModelSpec:
    ab = c.bool("attention_bias", False)
    pattern = c.int("_sliding_window_pattern", None) or c.int("sliding_window_pattern", 6)
    return _dense(c, name, arch="Gemma3ForCausalLM", head_dim_default=256, tie_default=True, q_bias=ab, kv_bias=ab,
                  o_bias=ab, qk_norm=True, sandwich_norms=True, window_rule=lambda i: bool((i + 1) % pattern))


def build_gemma3(c: Cfg, name: str) -> ModelSpec:
    """The multimodal gemma3 config: plan the text part (vision tower and projector are not counted)."""
    text = c.d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{c.where}: gemma3 config has no text_config object")
    d = dict(text)
    d.setdefault("model_type", "gemma3_text")
    d.setdefault("torch_dtype", c.d.get("dtype") or c.d.get("torch_dtype"))
    if "tie_word_embeddings" not in d and "tie_word_embeddings" in c.d:
        d["tie_word_embeddings"] = c.d["tie_word_embeddings"]
    spec = build_gemma3_text(Cfg(d, c.where + ":text_config"), name)
    return _with_notes(spec, "gemma3: text part only (Gemma3ForCausalLM); the vision tower is not counted")


def build_phi3(c: Cfg, name: str) -> ModelSpec:
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    inter = c.int("intermediate_size")
    heads = c.int("num_attention_heads")
    kv = _kv_heads(c)
    hd = _head_dim(c)
    inv = _Inventory()
    tied = _embeddings_and_head(inv, c, False)
    for i in range(n):
        p = f"model.layers.{i}"
        inv.linear(f"{p}.self_attn.o_proj", hidden, heads * hd, Role.ATTENTION, i)
        inv.linear(f"{p}.self_attn.qkv_proj", heads * hd + 2 * kv * hd, hidden, Role.ATTENTION, i)
        inv.linear(f"{p}.mlp.gate_up_proj", 2 * inter, hidden, Role.MLP, i)
        inv.linear(f"{p}.mlp.down_proj", hidden, inter, Role.MLP, i)
        inv.norm(f"{p}.input_layernorm", hidden, i)
        inv.norm(f"{p}.post_attention_layernorm", hidden, i)
    _finish(inv, c, tied)
    windows = _window_per_layer(c, n, lambda i: True)
    return _spec(c, name=name, arch="Phi3ForCausalLM", inv=inv, layouts=_layouts(c, n, hd, windows), tied=tied)


# ------------------------------------------------------------------ mixture of experts
def build_mixtral(c: Cfg, name: str) -> ModelSpec:
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    inter = c.int("intermediate_size")
    experts = c.int("num_local_experts")
    k = c.int("num_experts_per_tok")
    hd = _head_dim(c)
    inv = _Inventory()
    tied = _embeddings_and_head(inv, c, False)
    for i in range(n):
        p = f"model.layers.{i}"
        _mha_attention(inv, c, i, p, head_dim=hd, q_bias=False, kv_bias=False, o_bias=False, qk_norm=False)
        inv.add(f"{p}.mlp.gate.weight", (experts, hidden), Role.ROUTER, Kind.ROUTER, i)
        inv.fused_experts(f"{p}.mlp.experts", experts, hidden, inter, i)
        inv.norm(f"{p}.input_layernorm", hidden, i)
        inv.norm(f"{p}.post_attention_layernorm", hidden, i)
    _finish(inv, c, tied)
    windows = _window_per_layer(c, n, lambda i: True)
    moe = MoEInfo(num_experts=experts, experts_per_token=_check_k(c, k, experts), moe_layers=tuple(range(n)))
    return _spec(c, name=name, arch="MixtralForCausalLM", inv=inv, layouts=_layouts(c, n, hd, windows), tied=tied, moe=moe)


def build_qwen3_moe(c: Cfg, name: str) -> ModelSpec:
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    inter = c.int("intermediate_size")
    moe_inter = c.int("moe_intermediate_size")
    experts = c.int("num_experts")
    k = c.int("num_experts_per_tok")
    step = c.int("decoder_sparse_step", 1)
    dense_only = set(c.int_list("mlp_only_layers"))
    ab = c.bool("attention_bias", False)
    hd = _head_dim(c)
    c_attn = _qwen_windows_enabled(c)
    inv = _Inventory()
    tied = _embeddings_and_head(inv, c, False)
    moe_layers = []
    for i in range(n):
        p = f"model.layers.{i}"
        _mha_attention(inv, c, i, p, head_dim=hd, q_bias=ab, kv_bias=ab, o_bias=ab, qk_norm=True)
        if i not in dense_only and (i + 1) % step == 0:
            moe_layers.append(i)
            inv.fused_experts(f"{p}.mlp.experts", experts, hidden, moe_inter, i)
            inv.add(f"{p}.mlp.gate.weight", (experts, hidden), Role.ROUTER, Kind.ROUTER, i)
        else:
            inv.gated_mlp(f"{p}.mlp", hidden, inter, i)
        inv.norm(f"{p}.input_layernorm", hidden, i)
        inv.norm(f"{p}.post_attention_layernorm", hidden, i)
    _finish(inv, c, tied)
    windows = _window_per_layer(c_attn, n, _qwen_window_rule(c))
    moe = MoEInfo(num_experts=experts, experts_per_token=_check_k(c, k, experts), moe_layers=tuple(moe_layers))
    return _spec(c, name=name, arch="Qwen3MoeForCausalLM", inv=inv, layouts=_layouts(c, n, hd, windows), tied=tied, moe=moe)


def build_deepseek_v3(c: Cfg, name: str) -> ModelSpec:
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    inter = c.int("intermediate_size")
    moe_inter = c.int("moe_intermediate_size")
    experts = c.int("n_routed_experts")
    shared = c.int("n_shared_experts", 0, minimum=0)
    k = c.int("num_experts_per_tok")
    first_dense = c.int("first_k_dense_replace", 0, minimum=0)
    heads = c.int("num_attention_heads")
    q_lora = c.int("q_lora_rank", None)
    kv_lora = c.int("kv_lora_rank")
    nope = c.int("qk_nope_head_dim")
    rope = c.int("qk_rope_head_dim")
    v_dim = c.int("v_head_dim")
    ab = c.bool("attention_bias", False)
    qk = nope + rope
    inv = _Inventory()
    tied = _embeddings_and_head(inv, c, False)
    moe_layers = []
    for i in range(n):
        p = f"model.layers.{i}.self_attn"
        if q_lora is None:
            inv.linear(f"{p}.q_proj", heads * qk, hidden, Role.ATTENTION, i)
        else:
            inv.linear(f"{p}.q_a_proj", q_lora, hidden, Role.ATTENTION, i, ab)
            inv.norm(f"{p}.q_a_layernorm", q_lora, i)
            inv.linear(f"{p}.q_b_proj", heads * qk, q_lora, Role.ATTENTION, i)
        inv.linear(f"{p}.kv_a_proj_with_mqa", kv_lora + rope, hidden, Role.ATTENTION, i, ab)
        inv.norm(f"{p}.kv_a_layernorm", kv_lora, i)
        inv.linear(f"{p}.kv_b_proj", heads * (nope + v_dim), kv_lora, Role.ATTENTION, i)
        inv.linear(f"{p}.o_proj", hidden, heads * v_dim, Role.ATTENTION, i, ab)
        m = f"model.layers.{i}.mlp"
        if i >= first_dense:
            moe_layers.append(i)
            inv.fused_experts(f"{m}.experts", experts, hidden, moe_inter, i)
            inv.add(f"{m}.gate.weight", (experts, hidden), Role.ROUTER, Kind.ROUTER, i)
            inv.add(f"{m}.gate.e_score_correction_bias", (experts,), Role.ROUTER, Kind.BUFFER, i)
            if shared:
                inv.gated_mlp(f"{m}.shared_experts", hidden, moe_inter * shared, i)
        else:
            inv.gated_mlp(m, hidden, inter, i)
        inv.norm(f"model.layers.{i}.input_layernorm", hidden, i)
        inv.norm(f"model.layers.{i}.post_attention_layernorm", hidden, i)
    _finish(inv, c, tied)
    layouts = tuple(
        AttentionLayout(kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=qk, mla_cache_dim=kv_lora + rope)
        for _ in range(n)
    )
    moe = MoEInfo(num_experts=experts, experts_per_token=_check_k(c, k, experts), num_shared_experts=shared,
                  moe_layers=tuple(moe_layers))
    notes = [
        "MLA: the KV cache counts the compressed latent (kv_lora_rank + qk_rope_head_dim) per token per layer, "
        "as vLLM/SGLang store it; transformers' eager cache stores the decompressed K and V instead",
    ]
    if c.int("num_nextn_predict_layers", 0, minimum=0):
        notes.append("the multi-token-prediction layer in the checkpoint is not loaded by transformers and is not counted")
    return _spec(c, name=name, arch="DeepseekV3ForCausalLM", inv=inv, layouts=layouts, tied=tied, moe=moe, notes=notes)


def _check_k(c: Cfg, k: int, experts: int) -> int:
    if k > experts:
        raise ConfigError(f"{c.where}: num_experts_per_tok {k} exceeds the number of experts {experts}")
    return k


def _with_notes(spec: ModelSpec, *notes: str) -> ModelSpec:
    from dataclasses import replace

    return replace(spec, notes=spec.notes + tuple(notes))


BUILDERS: dict[str, Callable[[Cfg, str], ModelSpec]] = {
    "llama": build_llama,
    "mistral": build_mistral,
    "mixtral": build_mixtral,
    "qwen2": build_qwen2,
    "qwen3": build_qwen3,
    "qwen3_moe": build_qwen3_moe,
    "gemma2": build_gemma2,
    "gemma3_text": build_gemma3_text,
    "gemma3": build_gemma3,
    "phi3": build_phi3,
    "deepseek_v3": build_deepseek_v3,
}
SUPPORTED_MODEL_TYPES = tuple(BUILDERS)


def spec_from_config(config: dict, *, name: str = "model", source: str = "", where: str | None = None) -> ModelSpec:
    """Build the exact inventory of the model a config.json describes."""
    where = where or name
    c = Cfg(config, where)
    for key, limit in (("num_hidden_layers", MAX_LAYERS), ("num_local_experts", MAX_EXPERTS),
                       ("num_experts", MAX_EXPERTS), ("n_routed_experts", MAX_EXPERTS)):
        v = config.get(key)
        if isinstance(v, int) and v > limit:
            raise ConfigError(f"{where}: {key}={v} is beyond any real model (max {limit}); corrupt config?")
    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise ConfigError(f"{where}: config has no model_type")
    builder = BUILDERS.get(mt)
    if builder is None:
        raise UnsupportedArchitectureError(
            f"{where}: unsupported architecture model_type={mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        spec = builder(c, name)
    except (KeyError, TypeError, ZeroDivisionError) as e:  # a malformed config, never a crash
        raise ConfigError(f"{where}: malformed config ({type(e).__name__}: {e})") from e
    from dataclasses import replace

    return replace(spec, source=source)
