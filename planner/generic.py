"""Any decoder transformers knows, without a hand-written builder: a ModelSpec from a flat tensor list.

Two paths list the tensors. From safetensors headers (`spec_from_headers`, here and pure): shapes and
dtypes are exact, the decoder layer comes from the stack `<prefix>.layers.N.` (or `h.N.`, `blocks.N.`)
that holds num_hidden_layers layers, and roles and kinds are read from the names (`classify`). From
transformers on the meta device (runtime/inventory.py): kinds from the module types. Both hand
`spec_from_tensors` TensorSpecs; the KV layout comes from the config alone (`attention_layouts`,
following the cache transformers builds). Layers that keep a recurrent or state-space state instead of
a KV cache are refused (`refuse_unmodelled_state`): that state is not modelled.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Mapping, Sequence

from .architectures.common import CHUNKED, FULL, SLIDING, window_per_layer
from .architectures.config import Cfg, json_text
from .architectures.fp32 import keep_in_fp32
from .errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from .modelspec import (INVENTORY_HEADERS, AttentionLayout, Kind, ModelSpec, MoEInfo, Role, TensorSpec)

# Model types whose layers (some or all) carry a recurrent / state-space / linear-attention state.
STATEFUL_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "zamba", "zamba2", "bamba", "granitemoehybrid",
    "nemotron_h", "qwen3_next", "lfm2", "lfm2_moe", "rwkv", "recurrent_gemma", "xlstm", "minimax", "kimi_linear",
    "olmo_hybrid", "bailing_hybrid", "plamo2",
})
# Config fields only such models have (state sizes, per-layer block patterns).
STATE_CONFIG_KEYS = ("ssm_state_size", "mamba_d_state", "mamba_d_conv", "layers_block_type", "hybrid_override_pattern",
                     "linear_num_key_heads", "linear_num_value_heads", "attn_layer_indices", "attn_layer_period",
                     "block_types", "conv_L_cache")
ATTENTION_LAYER_TYPES = (FULL, SLIDING, CHUNKED)
# model_type -> the config flag under which its attention caches K and V broadcast to every query head, whatever
# the projections' width (FalconAttention._split_heads with new_decoder_architecture).
KV_BROADCAST_FLAGS = {"falcon": "new_decoder_architecture"}

# Config fields under their names across families (transformers' attribute_map, read from config.json).
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "model_dim")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
INTERMEDIATE_KEYS = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", "d_ff")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "num_experts_per_token", "moe_top_k", "top_k", "num_selected_experts")
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")

# Names of the decoder-layer stack, and of modules by what they hold.
STACK_RE = re.compile(r"^(?P<prefix>(?:.*\.)?(?:layers|h|blocks|block|layer|decoder_layers))\.(?P<index>\d+)\.")
ROUTER_MODULES = {"gate", "router", "gating", "moe_gate"}
BUFFER_LEAVES = {"inv_freq", "masked_bias"}
LM_HEAD_MODULES = {"lm_head", "embed_out", "output"}
EMBEDDING_MODULES = {"wte", "wpe", "word_embeddings", "tok_embeddings", "embeddings", "embedding"}


# ------------------------------------------------------------------ what is not modelled
def refuse_unmodelled_state(config: dict, where: str) -> None:
    """Raise for models whose layers keep a recurrent, state-space or linear-attention state (not a KV cache)."""
    mt = config.get("model_type")
    types = config.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ConfigError(f"{where}: field 'layer_types' must list one string per layer, got {json_text(types)}")
    other = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES}) if types else []
    keys = [k for k in STATE_CONFIG_KEYS if config.get(k) is not None]
    if mt in STATEFUL_MODEL_TYPES or other or keys:
        why = (f"model_type {mt!r} keeps" if mt in STATEFUL_MODEL_TYPES else
               f"layer types {', '.join(map(str, other))} keep" if other else
               f"config fields {', '.join(keys)} describe")
        raise UnsupportedArchitectureError(
            f"{where}: {why} a recurrent / state-space state, not a KV cache; vramplan does not model that state, "
            "so it cannot plan this model")


# ------------------------------------------------------------------ config fields
def config_int(c: Cfg, keys: Sequence[str], default=..., *, minimum: int = 1):
    """The first of `keys` the config sets (checked by Cfg.int); `default` when none is set."""
    key = next((k for k in keys if c.has(k)), None)
    if key is None:
        if default is ...:
            raise ConfigError(f"{c.where}: config sets none of {', '.join(keys)}")
        return default
    return c.int(key, minimum=minimum)


def kv_heads(c: Cfg, heads: int) -> int:
    """KV heads as the config gives them: multi-query (falcon's old layout, gpt_bigcode) is one."""
    if c.d.get("multi_query") and not c.d.get("new_decoder_architecture"):
        return 1
    return config_int(c, KV_HEAD_KEYS, heads)


def attention_layouts(config: dict, where: str) -> tuple[AttentionLayout, ...]:
    """One layout per decoder layer, as the config gives it (`spec_from_tensors` then checks the K/V widths
    against the projections): MLA's latent when the config has kv_lora_rank; else GQA with head_dim (or
    hidden / heads), windows per `layer_types` or, without them, transformers' own rule
    (cache_utils.get_layer_types_and_kwargs): sliding_window set -> every layer slides, else
    attention_chunk_size -> chunked, else full (qwen's use_sliding_window: false turns the window off)."""
    c = Cfg(config, where)
    n = config_int(c, LAYER_KEYS)
    heads = config_int(c, HEAD_KEYS)
    if c.has("kv_lora_rank"):
        nope, rope = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim")
        # v_head_dim: the MLA families transformers has copy deepseek_v3's attention, expansion included
        mla = AttentionLayout(kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope,
                              mla_cache_dim=c.int("kv_lora_rank") + rope, mla_rope_dim=rope,
                              v_head_dim=c.int("v_head_dim") if c.has("v_head_dim") else None)
        return (mla,) * n
    if c.has("head_dim"):
        head_dim = c.int("head_dim")
    else:
        hidden = config_int(c, HIDDEN_KEYS)
        if hidden % heads:
            raise ConfigError(f"{where}: hidden size {hidden} is not divisible by {heads} heads; set head_dim")
        head_dim = hidden // heads
    flag = KV_BROADCAST_FLAGS.get(c.d.get("model_type"))
    kv = heads if flag and c.d.get(flag) else kv_heads(c, heads)
    slides = c.has("sliding_window") and c.d.get("use_sliding_window") is not False
    rule = (lambda i: SLIDING) if slides else (lambda i: CHUNKED) if c.has("attention_chunk_size") else None
    return tuple(AttentionLayout(kind="mha", num_heads=heads, num_kv_heads=kv, head_dim=head_dim, window=w, chunked=ch)
                 for w, ch in window_per_layer(c, n, rule))


# Attention projections by module name: K and V apart, K and V fused, or Q, K and V fused.
Q_MODULES = ("q_proj", "query", "q", "wq", "q_lin", "query_proj")
K_MODULES = ("k_proj", "key", "k", "wk", "k_lin", "key_proj")
V_MODULES = ("v_proj", "value", "v", "wv", "v_lin", "value_proj")
KV_MODULES = ("kv_proj",)
QKV_MODULES = ("query_key_value", "qkv_proj", "qkv", "c_attn", "wqkv", "Wqkv", "W_pack", "in_proj")


def kv_width(layer_tensors: Iterable[TensorSpec], hidden: int, q_width: int) -> int | None:
    """Elements K and V take per token in one layer, from the widths of its attention projections (what the cache
    stores), or None when no projection is named so. q_width: the width of Q in a fused QKV without a q_proj."""
    proj = {t.name.split(".")[-2]: t for t in layer_tensors
            if t.role is Role.ATTENTION and t.name.endswith(".weight") and len(t.shape) == 2}

    def out(names: Sequence[str]) -> int | None:
        t = next((proj[m] for m in names if m in proj), None)
        if t is None:
            return None
        rows, cols = t.shape  # nn.Linear is [out, in]; gpt2's Conv1D [in, out]
        return cols if rows == hidden and cols != hidden else rows

    k, v, kv, qkv = out(K_MODULES), out(V_MODULES), out(KV_MODULES), out(QKV_MODULES)
    if k is not None and v is not None:
        return k + v
    if kv is not None:
        return kv
    if qkv is not None:
        return qkv - (out(Q_MODULES) or q_width)
    return None


def _layouts_from_projections(tensors: Sequence[TensorSpec], layouts: tuple[AttentionLayout, ...], hidden: int,
                              where: str) -> tuple[tuple[AttentionLayout, ...], list[str]]:
    """The config's layouts, with the K/V width the projections have where the config says otherwise (a field
    the architecture ignores, a head_dim it derives its own way)."""
    by_layer: dict[int, list[TensorSpec]] = {}
    for t in tensors:
        if t.layer is not None:
            by_layer.setdefault(t.layer, []).append(t)
    out, changed = [], {}
    for i, a in enumerate(layouts):
        width = kv_width(by_layer.get(i, ()), hidden, a.num_heads * a.head_dim) if a.kind == "mha" else None
        if width is None or width == a.kv_elements_per_token:
            out.append(a)
            continue
        if width <= 0 or width % 2:
            raise ConfigError(f"{where}: layer {i}'s attention projections give K and V {width} elements per token: "
                              "cannot count its KV cache")
        kv, head_dim = (width // (2 * a.head_dim), a.head_dim) if width % (2 * a.head_dim) == 0 else (1, width // 2)
        out.append(replace(a, num_kv_heads=kv, head_dim=head_dim))
        changed[i] = (a.kv_elements_per_token, width)
    notes = []
    if changed:
        (was, now), n = next(iter(changed.values())), len(changed)
        notes.append(f"KV cache: the attention projections of {n} layers hold {now} K+V elements per token, not the "
                     f"{was} the config's KV heads x head_dim give: the projections' width is counted")
    return tuple(out), notes


# ------------------------------------------------------------------ names -> roles and kinds
def _modules(name: str) -> list[str]:
    return name.split(".")[:-1]


def _is_norm(module: str) -> bool:
    return "norm" in module.lower() or re.fullmatch(r"ln(_.*|\d*)", module) is not None


def is_routed_expert(name: str) -> bool:
    """Inside a routed-experts module (`experts`, never `shared_experts`)."""
    return "experts" in _modules(name)


def classify(name: str, shape: tuple[int, ...], in_layer: bool, moe: bool) -> tuple[Role, Kind]:
    """Role and kind of a checkpoint tensor from its name: routed experts (in an `experts` module or any 3-D
    tensor; fused or per expert, counted as Kind.EXPERTS, which no quantizer touches, as transformers 5 fuses
    them), norms, routers, attention, else the MLP; outside the layers the lm_head, norms and embeddings. `moe`:
    the model has routed experts (a module named `gate` or `router` is then a router). A persistent buffer saved
    under a name not known as one (inv_freq, masked_bias) counts as a parameter; its bytes are exact either way."""
    modules, leaf = _modules(name), name.rsplit(".", 1)[-1]
    if not in_layer:
        if modules and modules[-1] in LM_HEAD_MODULES or (not modules and leaf.startswith("lm_head")):
            return Role.LM_HEAD, Kind.BIAS if leaf.endswith("bias") else Kind.LINEAR
        if any(_is_norm(m) for m in modules):
            return Role.NORM, Kind.NORM
        if leaf == "inv_freq":
            return Role.EMBEDDING, Kind.BUFFER
        if any("embed" in m or m in EMBEDDING_MODULES for m in modules):
            return Role.EMBEDDING, Kind.EMBEDDING
        return Role.EMBEDDING, Kind.OTHER
    if any(_is_norm(m) for m in modules):
        return Role.NORM, Kind.NORM
    if leaf == "e_score_correction_bias":  # a router buffer (deepseek-style), a parameter in ernie's moe_statics
        return Role.ROUTER, Kind.ROUTER if "moe_statics" in modules else Kind.BUFFER
    router = moe and any(m in ROUTER_MODULES for m in modules)
    if router or moe and modules and modules[-1].endswith("expert_gate"):
        return Role.ROUTER, Kind.ROUTER if router else (Kind.BIAS if leaf == "bias" else Kind.LINEAR)
    if is_routed_expert(name) or len(shape) == 3:
        return Role.EXPERT, Kind.EXPERTS_BIAS if leaf.endswith("bias") else Kind.EXPERTS
    role = Role.ATTENTION if any("attn" in m or "attention" in m for m in modules) else Role.MLP
    if leaf in BUFFER_LEAVES or leaf == "bias" and len(shape) > 2:  # gpt2's causal-mask buffer "attn.bias"
        return role, Kind.BUFFER
    if leaf == "weight" and len(shape) == 2:
        return role, Kind.LINEAR
    if leaf == "bias" and len(shape) == 1:
        return role, Kind.BIAS
    return role, Kind.OTHER


def decoder_stack(names: Iterable[str], num_layers: int, where: str) -> str:
    """The prefix of the stack holding layers 0..num_layers-1 (`model.layers`): of the stacks that do, the
    one with the fewest other indices (a vision tower's or MTP layers), then the shortest prefix."""
    stacks: dict[str, set[int]] = {}
    for name in names:
        m = STACK_RE.match(name)
        if m:
            stacks.setdefault(m["prefix"], set()).add(int(m["index"]))
    want = set(range(num_layers))
    full = [(len(idx - want), len(p), p) for p, idx in stacks.items() if want <= idx]
    if not full:
        found = ", ".join(f"{p} ({len(idx)} layers)" for p, idx in stacks.items()) or "none"
        raise CheckpointError(f"{where}: no stack of the config's {num_layers} decoder layers in the tensor names "
                              f"(stacks found: {found})")
    return min(full)[2]


def layer_of(name: str, stack: str) -> int | None:
    if not name.startswith(stack + "."):
        return None
    return int(name[len(stack) + 1:].split(".", 1)[0])


# ------------------------------------------------------------------ the spec
def spec_from_headers(config: dict, header: Mapping, *, name: str, source: str, where: str,
                      transformers_version: str | None = None) -> ModelSpec:
    """The inventory of a checkpoint's safetensors headers (name -> HeaderTensor, names as transformers' ForCausalLM
    gives them); tied embeddings when it holds no lm_head. Tensors of layers beyond num_hidden_layers (MTP heads)
    are not the model's. Router tensors held in fp32 as `transformers_version` holds them (architectures/fp32.py)."""
    refuse_unmodelled_state(config, where)
    n = config_int(Cfg(config, where), LAYER_KEYS)
    stack = decoder_stack(header, n, where)
    moe = any(is_routed_expert(k) or len(h.shape) == 3 for k, h in header.items())
    entries = []
    for key, h in header.items():
        layer = layer_of(key, stack)
        if layer is not None and layer >= n:
            continue
        role, kind = classify(key, h.shape, layer is not None, moe)
        entries.append((key, tuple(h.shape), role, kind, layer, h.dtype))
    tensors = [TensorSpec(name=k, shape=shape, role=role, kind=kind, layer=layer, dtype=dtype)
               for k, shape, role, kind, layer, dtype in _fuse_per_expert(entries)]
    tied = not any(t.role is Role.LM_HEAD and t.kind is Kind.LINEAR for t in tensors)
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else f"{config['model_type']}"
    spec = spec_from_tensors(config, tensors, name=name, source=source, where=where, inventory=INVENTORY_HEADERS,
                             architecture=arch, tied=tied)
    return keep_in_fp32(spec, transformers_version)


_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")
# Per-expert checkpoint names of the projections transformers 5 fuses into gate_up_proj [E, 2I, H] (gate rows
# first) and down_proj [E, H, I] when it loads them (its weight conversions; mixtral's w1/w3/w2).
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


def _fuse_per_expert(entries: list[tuple]) -> list[tuple]:
    """A checkpoint that stores each routed expert's matrices apart (experts.{e}.gate_proj.weight, ...) is loaded by
    transformers 5 into fused 3-D experts: count them as it holds them, so quantized bytes are those of the fused
    layout the runtime quantizes (the parameters are the same). Entries: (name, shape, role, kind, layer, dtype)."""
    groups: dict[str, dict[str, list[tuple]]] = {}
    rest = []
    for entry in entries:
        m = _PER_EXPERT.match(entry[0])
        if m and entry[3] is Kind.EXPERTS and len(entry[1]) == 2:
            groups.setdefault(m["prefix"], {}).setdefault(m["proj"], []).append(entry)
        else:
            rest.append(entry)
    fused = []
    for prefix, projs in groups.items():
        gate = next((g for g in _GATE if g in projs), None)
        up = next((u for u in _UP if u in projs), None)
        if gate and up:  # one gate_up_proj, gate rows first
            g, u = projs.pop(gate), projs.pop(up)
            fused.append(_stacked(f"{prefix}.gate_up_proj", g, (g[0][1][0] + u[0][1][0], g[0][1][1])))
        down = next((d for d in _DOWN if d in projs), None)
        if down:
            fused.append(_stacked(f"{prefix}.down_proj", projs.pop(down), None))
        fused += [_stacked(f"{prefix}.{proj}", items, None) for proj, items in projs.items()]
    return rest + fused


def _stacked(name: str, items: list[tuple], matrix: tuple[int, int] | None) -> tuple:
    """One fused [E, out, in] entry for the per-expert `items` (E = the distinct expert indices)."""
    _, shape, role, kind, layer, dtype = items[0]
    experts = len({_PER_EXPERT.match(i[0])["expert"] for i in items})
    return (name, (experts, *(matrix or shape)), role, kind, layer, dtype)


def _mark_transposed_experts(tensors: Sequence[TensorSpec]) -> list[TensorSpec]:
    """Fused experts stored [E, in, out] (gpt_oss, llama4: gate_up [E, H, 2I], down [E, I, H]) rather than
    [E, out, in] (gate_up [E, 2I, H], down [E, H, I]): the hidden size is gate_up's middle axis and down's last
    one only in the transposed layout. The quantized bytes depend on which axis the output rows are."""
    fused = {t.name: t for t in tensors if t.kind is Kind.EXPERTS and len(t.shape) == 3}
    transposed = set()
    for name, t in fused.items():
        if name.endswith("gate_up_proj"):
            down = fused.get(name.removesuffix("gate_up_proj") + "down_proj")
            if down is not None and t.shape[1] == down.shape[2]:
                transposed |= {name, down.name}
    return [replace(t, transposed=True) if t.name in transposed else t for t in tensors]


def spec_from_tensors(config: dict, tensors: Sequence[TensorSpec], *, name: str, source: str, where: str,
                      inventory: str, architecture: str, tied: bool) -> ModelSpec:
    """A ModelSpec from a tensor list (layers, roles and kinds set) and the config's sizes and KV layout; the
    callers have refused models with unmodelled state (refuse_unmodelled_state) first."""
    c = Cfg(config, where)
    n = config_int(c, LAYER_KEYS)
    hidden = config_int(c, HIDDEN_KEYS)
    tensors = _mark_transposed_experts(tensors)
    missing = sorted(set(range(n)) - {t.layer for t in tensors})
    if missing:
        raise CheckpointError(f"{where}: the config has {n} decoder layers but layers {missing[:5]} hold no tensors")
    layouts, kv_notes = attention_layouts(config, where), []
    flag = KV_BROADCAST_FLAGS.get(config.get("model_type"))
    if not (flag and config.get(flag)):
        layouts, kv_notes = _layouts_from_projections(tensors, layouts, hidden, where)
    embedding = next((t for t in tensors if t.kind is Kind.EMBEDDING and len(t.shape) == 2), None)
    vocab = c.int("vocab_size") if c.has("vocab_size") else embedding.shape[0] if embedding else 0
    notes = [f"inventory from {inventory}: model_type {config.get('model_type')!r} has no hand-written builder; "
             + ("roles and kinds read from the tensor names" if inventory == INVENTORY_HEADERS
                else "kinds from the modules transformers builds, roles from their names"), *kv_notes]
    unnamed = [t.name for t in tensors if t.layer is None and t.kind is Kind.OTHER]
    if unnamed:
        notes.append(f"{len(unnamed)} tensors outside the decoder layers are not recognised by name and are counted "
                     f"unquantized with the embeddings: {', '.join(unnamed[:3])}")
    if layouts[0].kind == "mha" and c.has("sliding_window") and not any(a.window for a in layouts):
        notes.append("the config's sliding_window is off (use_sliding_window: false): every layer keeps the full "
                     "context in its KV cache")
    return ModelSpec(
        name=name, model_type=str(config.get("model_type")), architecture=architecture, num_layers=n,
        hidden_size=hidden, vocab_size=vocab, intermediate_size=_intermediate(c, tensors, hidden),
        max_context=config_int(c, CONTEXT_KEYS, 0, minimum=0), dtype=c.dtype(), tie_word_embeddings=tied,
        tensors=tuple(tensors), attention=layouts, moe=_moe(c, tensors, hidden), source=source,
        notes=tuple(notes), inventory=inventory, config=config)


def _intermediate(c: Cfg, tensors: Sequence[TensorSpec], hidden: int) -> int:
    """The config's MLP width, else the widest non-hidden dimension of layer 0's MLP weights."""
    key = next((k for k in INTERMEDIATE_KEYS if c.has(k)), None)
    if key is not None:
        return c.int(key)
    dims = [d for t in tensors if t.layer == 0 and t.role is Role.MLP and t.kind is Kind.LINEAR
            for d in t.shape if d != hidden]
    return max(dims, default=0)


def _moe(c: Cfg, tensors: Sequence[TensorSpec], hidden: int) -> MoEInfo | None:
    """Routed experts' facts from their tensors (count, width, layers) and the config (top-k, shared experts)."""
    experts = [t for t in tensors if t.role is Role.EXPERT and t.kind is not Kind.EXPERTS_BIAS and len(t.shape) >= 2]
    if not experts:
        return None
    fused = [t for t in experts if len(t.shape) == 3]
    if fused:
        count = fused[0].shape[0]
    else:
        ids = {int(m.group(1)) for t in experts if (m := re.search(r"(?:^|\.)experts\.(\d+)\.", t.name))}
        count = max(ids) + 1 if ids else 1
    widths = [d for t in experts for d in (t.shape[1:] if len(t.shape) == 3 else t.shape) if d != hidden]
    shared = config_int(c, SHARED_EXPERT_KEYS, None, minimum=0)
    if shared is None:
        shared = int(any("shared_expert" in t.name for t in tensors))
    k = config_int(c, TOP_K_KEYS)
    if k > count:
        raise ConfigError(f"{c.where}: {k} experts per token but {count} experts")
    return MoEInfo(num_experts=count, experts_per_token=k, num_shared_experts=shared,
                   moe_layers=tuple(sorted({t.layer for t in experts})),
                   expert_intermediate_size=min(widths, default=hidden))
