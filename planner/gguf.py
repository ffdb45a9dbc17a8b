"""llama.cpp GGUF sizing, tensor by tensor: which ggml type `llama-quantize` gives each tensor, and its bytes.

`gguf_tensors(spec, "Q4_K_M")` lists the tensors of the GGUF file that convert_hf_to_gguf.py
followed by `llama-quantize <f16.gguf> <out.gguf> Q4_K_M` writes for the model a ModelSpec
describes: GGUF name, transformers name, ggml type, shape (ggml order: ne[0] is the row length),
exact data bytes and decoder layer. `gguf_file_bytes` adds GGUF's per-tensor alignment padding,
the exact header and tensor-info bytes, and an estimate of the key/value metadata (the tokenizer
is not derivable from config.json: see `metadata_bytes_estimate`). Pure: stdlib and planner only.

Tied embeddings follow the spec: a tied model has no output.weight and its token_embd takes the
output rules. Some published files of tied models (Qwen's own Qwen2.5-0.5B/3B GGUFs) carry a
separate output.weight all the same; plan those with tie_word_embeddings false.

Sources followed (llama.cpp commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f, 2026-10-01, the
tree vendored by the llama-cpp-python 0.3.36 sdist on PyPI):
- src/llama-quant.cpp: tensor_get_category, tensor_allows_quantization, tensor_type_fallback,
  llama_tensor_get_type_impl (the per-ftype mixture rules, `use_more_bits`, the attn_v / ffn_down /
  ffn_gate / ffn_up counters, n_gqa / n_expert conditions, the LLM_TYPE_70B bump; the IQ1-IQ3, TQ,
  Q2_K_S and MXFP4_MOE mixtures), llama_tensor_get_type, tensor_requires_imatrix (the file types
  llama-quantize makes only with an importance matrix), llama_ftype_get_default_type,
  init_quantize_state_counters (n_ffn_down = n_ffn_gate = n_ffn_up = n_layer_all,
  has_tied_embeddings), GGUF_DEFAULT_ALIGNMENT padding after every tensor.
- src/llama-model-loader.h: weight_name_comparer (tensors are visited by layer, then by name;
  the counters depend on that order).
- src/models/llama.cpp, src/models/qwen2.cpp: which models are LLM_TYPE_70B.
- ggml/src/ggml-common.h (block structs and their static_asserts), ggml/include/ggml.h (type ids),
  include/llama.h (llama_ftype ids).
- ggml/src/gguf.cpp: gguf_write_out (header, key/value and tensor-info encoding, alignment).
- convert_hf_to_gguf.py with conversion/base.py (prepare_tensors: 1-D tensors, norms, biases and
  ffn_gate_inp stay F32), conversion/llama.py (rope_freqs for llama3 RoPE), conversion/qwen.py
  (transformers-5 fused experts split into ffn_gate_exps + ffn_up_exps), conversion/deepseek.py
  (kv_b_proj split into attn_k_b / attn_v_b, MTP layers skipped), conversion/gemma.py (gemma3
  token_embd trimmed to the tokenizer's vocabulary), conversion/phi.py (rope_factors_long/short),
  conversion/gpt_oss.py (an MXFP4 checkpoint's experts written as they are stored, gate_up and its
  bias split, sinks named attn_sinks.weight), gguf-py/gguf/constants.py and tensor_mapping.py (GGUF
  tensor names).

Every llama_ftype but Q1_0, Q2_0 and NVFP4 (ggml types no published file of a supported model
uses) is in GGUF_FILE_TYPES. A tensor the checkpoint stores quantized (gpt-oss's MXFP4 experts)
keeps its type in every file type, as the published files do; llama-quantize itself would need
--allow-requantize to change it. Left out, since no supported model_type converts to them: the
falcon / glm5-next / bailingmoe3 special cases; and the options a default run does not use:
--pure, --tensor-type / --output-tensor-type / --token-embedding-type overrides, --allow-requantize,
and convert's optional q/k/v and gate/up fusion (off by default).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

from .record import record
from .errors import PlanError, UnsupportedArchitectureError
from .modelspec import ModelSpec, TensorSpec
from .llama_quantize import (ATTN_V_LIKE, _ModelFacts, _QuantizeState, _mixture_type, allows_quantization,  # noqa: F401
                             fallback_type, ggml_n_dims, requires_imatrix, tensor_category, use_more_bits)
from .ggml_types import (GGML_HALF_BYTES, GGML_TYPES, GGUF_FILE_TYPES, QK_K, GGMLType, GGUFFileType,  # noqa: F401
                         gguf_file_type)

# ------------------------------------------------------------------ HF -> GGUF tensor inventory
# general.architecture that convert_hf_to_gguf.py writes for each transformers model_type.
GGUF_ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama",
    "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss",
}

# Per-layer module (after "model.layers.N.") -> GGUF name (after "blk.N."), gguf-py tensor_mapping.py.
LAYER_MODULE_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",  # phi3 keeps q, k and v fused
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # phi3 keeps gate and up fused in one [2I, H] ffn_up
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# Gemma 2/3 have a norm after attention and one before the MLP: the first is not ffn_norm there.
GEMMA_LAYER_MODULE_NAMES = {**LAYER_MODULE_NAMES, "post_attention_layernorm": "post_attention_norm"}
# gpt-oss (gguf-py constants.py MODEL_ARCH.GPT_OSS lists ATTN_POST_NORM, not FFN_NORM, so tensor_mapping.py maps its
# post_attention_layernorm to post_attention_norm; mlp.router is FFN_GATE_INP, "# openai-moe").
GPT_OSS_LAYER_MODULE_NAMES = {**GEMMA_LAYER_MODULE_NAMES, "mlp.router": "ffn_gate_inp"}
# The checkpoint formats whose routed experts convert_hf_to_gguf.py writes as they are stored, whatever --outtype says:
# conversion/gpt_oss.py skips dequant_model for an MXFP4 checkpoint and repacks each *_blocks/*_scales pair as ggml
# MXFP4 (repack_mxfp4, generate_extra_tensors).
STORED_EXPERT_TYPES = {("gpt_oss", "mxfp4"): "MXFP4"}
NON_LAYER_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
# The tokenizer shipped with every Gemma 3 model has this many tokens; convert trims token_embd's
# padding rows beyond it (config vocab_size 262208).
GEMMA3_TOKENIZER_VOCAB = 262144


class _Source(NamedTuple):
    """A tensor as convert_hf_to_gguf.py writes it, before llama-quantize. A named tuple, not a record: a 405B model has
    1138 of them, made on every plan, and a tuple is made several times faster than a frozen dataclass."""

    name: str
    hf_name: str | None  # None for tensors convert generates (rope_freqs, rope factors)
    shape: tuple[int, ...]  # ggml order
    layer: int | None
    f32: bool  # convert stores it as F32 whatever --outtype is
    stored: str | None = None  # convert writes it in this quantized ggml type as the checkpoint holds it (MXFP4)


def _forced_f32(gguf_name: str, ndim: int) -> bool:
    """conversion/base.py prepare_tensors: 1-D tensors, norms, biases and routers stay F32."""
    return ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight") \
        or ".ffn_gate_inp." in gguf_name


def _source(name: str, hf_name: str | None, torch_shape: tuple[int, ...], layer: int | None,
            stored: str | None = None) -> _Source:
    return _Source(name=name, hf_name=hf_name, shape=tuple(reversed(torch_shape)), layer=layer,
                   f32=_forced_f32(name, len(torch_shape)), stored=stored)


def stored_expert_type(spec: ModelSpec) -> str | None:
    """The ggml type a pre-quantized checkpoint's routed experts keep in the GGUF (STORED_EXPERT_TYPES), or None."""
    q = spec.config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    return STORED_EXPERT_TYPES.get((spec.model_type, method))


def _layer_sources(spec: ModelSpec, t: TensorSpec) -> list[_Source]:
    prefix = f"model.layers.{t.layer}."
    if not t.name.startswith(prefix):
        raise UnsupportedArchitectureError(f"{spec.name}: tensor {t.name} has no GGUF name (layer {t.layer})")
    rest = t.name[len(prefix):]
    blk = f"blk.{t.layer}."
    stored = stored_expert_type(spec) if rest.startswith("mlp.experts.") else None
    if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] ([E, H, 2I] transposed): convert splits it into gate and up
        e, two_i, h = (t.shape[0], t.shape[2], t.shape[1]) if t.transposed else t.shape
        half = (e, two_i // 2, h)
        return [_source(blk + "ffn_gate_exps.weight", t.name, half, t.layer, stored),
                _source(blk + "ffn_up_exps.weight", t.name, half, t.layer, stored)]
    if rest == "mlp.experts.down_proj":  # [E, H, I] ([E, I, H] transposed: conversion/gpt_oss.py transposes it)
        shape = (t.shape[0], t.shape[2], t.shape[1]) if t.transposed else t.shape
        return [_source(blk + "ffn_down_exps.weight", t.name, shape, t.layer, stored)]
    if rest == "mlp.experts.gate_up_proj_bias":  # [E, 2I], gate and up interleaved: conversion/gpt_oss.py splits it
        e, two_i = t.shape
        return [_source(blk + "ffn_gate_exps.bias", t.name, (e, two_i // 2), t.layer),
                _source(blk + "ffn_up_exps.bias", t.name, (e, two_i // 2), t.layer)]
    if rest == "mlp.experts.down_proj_bias":
        return [_source(blk + "ffn_down_exps.bias", t.name, t.shape, t.layer)]
    if rest == "self_attn.sinks":  # conversion/gpt_oss.py filter_tensors names it sinks.weight: ATTN_SINKS
        return [_source(blk + "attn_sinks.weight", t.name, t.shape, t.layer)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [_source(blk + "exp_probs_b.bias", t.name, t.shape, t.layer)]
    if rest == "self_attn.kv_b_proj.weight":
        return _split_kv_b(spec, t, blk)
    module, _, suffix = rest.rpartition(".")
    table = (GEMMA_LAYER_MODULE_NAMES if spec.model_type in ("gemma2", "gemma3_text") else
             GPT_OSS_LAYER_MODULE_NAMES if spec.model_type == "gpt_oss" else LAYER_MODULE_NAMES)
    if module not in table or suffix not in ("weight", "bias"):
        raise UnsupportedArchitectureError(f"{spec.name} ({spec.model_type}): tensor {t.name} has no known GGUF name")
    return [_source(f"{blk}{table[module]}.{suffix}", t.name, t.shape, t.layer)]


def _split_kv_b(spec: ModelSpec, t: TensorSpec, blk: str) -> list[_Source]:
    """conversion/deepseek.py: kv_b_proj [H*(nope+v), r] -> attn_k_b [H, r, nope] (transposed) + attn_v_b [H, v, r]."""
    nope = int(spec.config["qk_nope_head_dim"])
    v_dim = int(spec.config["v_head_dim"])
    rank = t.shape[1]
    heads = t.shape[0] // (nope + v_dim)
    if heads * (nope + v_dim) != t.shape[0]:
        raise UnsupportedArchitectureError(f"{spec.name}: {t.name} rows {t.shape[0]} are not heads x (nope + v)")
    return [_source(blk + "attn_k_b.weight", t.name, (heads, rank, nope), t.layer),
            _source(blk + "attn_v_b.weight", t.name, (heads, v_dim, rank), t.layer)]


def _non_layer_source(spec: ModelSpec, t: TensorSpec) -> _Source:
    name = NON_LAYER_NAMES.get(t.name)
    if name is None:
        raise UnsupportedArchitectureError(f"{spec.name} ({spec.model_type}): tensor {t.name} has no known GGUF name")
    shape = t.shape
    if name == "token_embd.weight" and spec.model_type == "gemma3_text":
        shape = (min(shape[0], GEMMA3_TOKENIZER_VOCAB), shape[1])
    return _source(name, t.name, shape, None)


def _rope_parameters(config: dict) -> dict:
    """RoPE settings: transformers 5 `rope_parameters` (maybe per attention type) or the older `rope_scaling`."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return {}
    full = params.get("full_attention")
    return full if isinstance(full, dict) else params


def _generated_sources(spec: ModelSpec) -> list[_Source]:
    """Tensors convert_hf_to_gguf.py adds that the checkpoint lacks (RoPE frequency factors)."""
    rope = _rope_parameters(spec.config)
    rope_type = str(rope.get("rope_type", rope.get("type", ""))).lower()
    heads = spec.attention[0].num_heads
    if spec.model_type in ("llama", "mistral", "mixtral") and rope_type == "llama3":
        head_dim = spec.config.get("head_dim") or spec.hidden_size // heads
        return [_source("rope_freqs.weight", None, (head_dim // 2,), None)]
    if spec.model_type == "phi3" and rope.get("long_factor"):
        partial = float(spec.config.get("partial_rotary_factor", 1.0))
        rope_dims = int(partial * spec.hidden_size) // heads
        return [_source(f"rope_factors_{kind}.weight", None, (rope_dims // 2,), None) for kind in ("long", "short")]
    return []


_new = tuple.__new__  # a _Source made without its generated __new__'s call: 1138 of them for a 405B model


def _ordered(spec: ModelSpec) -> tuple[tuple[_Source, ...], tuple[bool, ...], tuple[str, ...]]:
    """The spec's converted tensors in the loader's order (llama_model_loader::weight_name_comparer: by block number,
    -1 outside blocks, then by name), with each one's tensor_allows_quantization and tensor_get_category. A layer
    like one converted before is its tensors renamed, in the same order (one "blk.N." prefix sorts as its names do),
    with the same facts: no rule reads the block number."""
    if spec.model_type not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{spec.name}: no GGUF mapping for model_type {spec.model_type!r}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    outside = sorted(_generated_sources(spec) + [_non_layer_source(spec, t) for t in spec.non_layer_tensors()],
                     key=lambda s: s.name)
    sources = list(outside)
    quantizable = [allows_quantization(s.name, s.shape) for s in outside]
    categories = [tensor_category(s.name) for s in outside]
    # per layer template: its tensors sorted, as (name after "blk.N.", name after "model.layers.N." or None, shape,
    # f32, stored), and their facts
    templates: dict[tuple, tuple[list[tuple], list[bool], list[str]]] = {}
    for i in range(spec.num_layers):
        tensors = spec.layer_tensors(i)
        prefix = f"model.layers.{i}."
        key = tuple((t.name.removeprefix(prefix), t.shape, t.transposed) for t in tensors)
        t_ = templates.get(key)
        if t_ is None:
            converted = sorted((s for t in tensors for s in _layer_sources(spec, t)), key=lambda s: s.name)
            blk = f"blk.{i}."
            t_ = templates[key] = (
                [(c.name.removeprefix(blk), c.hf_name.removeprefix(prefix) if c.hf_name else None, c.shape, c.f32,
                  c.stored) for c in converted],
                [allows_quantization(c.name, c.shape) for c in converted],
                [tensor_category(c.name) for c in converted])
        rows, q, cats = t_
        blk = f"blk.{i}."
        sources.extend(_new(_Source, (blk + name, prefix + hf if hf is not None else None, shape, i, f32, stored))
                       for name, hf, shape, f32, stored in rows)
        quantizable.extend(q)
        categories.extend(cats)
    return tuple(sources), tuple(quantizable), tuple(categories)


# ------------------------------------------------- llama-quantize type selection (its rules: planner/llama_quantize.py)
def _model_facts(spec: ModelSpec) -> _ModelFacts:
    arch = GGUF_ARCHITECTURES[spec.model_type]
    a = spec.attention[0]
    n_head_kv = 1 if a.kind == "mla" else a.num_kv_heads  # conversion/deepseek.py writes MLA as MQA
    n_expert = spec.moe.num_experts if spec.moe else 0
    # src/models/llama.cpp (8-expert models are typed 8x7B / 8x22B) and src/models/qwen2.cpp
    is_70b = spec.num_layers == 80 and (
        (arch == "llama" and n_expert != 8 and a.num_heads != n_head_kv) or arch == "qwen2")
    return _ModelFacts(arch=arch, n_layer=spec.num_layers, n_expert=n_expert, n_gqa=a.num_heads // n_head_kv,
                       is_70b=is_70b)


@record(kw_only=True)
class _Inventory:
    """A model's tensors as llama-quantize visits them, each with what does not depend on the file type."""

    sources: tuple[_Source, ...]  # in the loader's order
    quantizable: tuple[bool, ...]  # tensor_allows_quantization
    categories: tuple[str, ...]  # tensor_get_category
    rows: tuple[tuple[int, int], ...]  # (rows: the product of ne[1:], row length ne[0]) of each
    # Tensors llama_tensor_get_type gives one type in every file type (_alike): the number of each one's group, and
    # per group its first tensor and the quantize counters (attn_v, ffn_down, ffn_gate, ffn_up) as it finds them.
    group_of: tuple[int, ...]
    firsts: tuple[int, ...]
    counters: tuple[tuple[int, int, int, int], ...]
    info_bytes: int  # the tensor infos in the file's header (tensor_info_bytes), the same in every file type
    category_counts: Counter  # how many tensors each category has
    # The decoder layers by their tensors' (group, rows, routed experts?): each layer's kind, and each kind's tensors;
    # the tensors outside the layers as (name, group, rows); and every (group, rows) with how many tensors have it.
    layer_kind_of: tuple[int, ...]
    layer_kinds: tuple[tuple[tuple[int, int, bool], ...], ...]
    outside: tuple[tuple[str, int, int], ...]
    sized: tuple[tuple[int, int, int], ...]


# The counter each category advances in quantize_state_impl (llama_tensor_get_type_impl), by its index in a
# _QuantizeState's (i_attention_wv, i_ffn_down, i_ffn_gate, i_ffn_up).
COUNTER_OF = {**{c: 0 for c in ATTN_V_LIKE}, "ffn_down": 1, "ffn_gate": 2, "ffn_up": 3}


def _position(i: int, n: int) -> tuple[bool, ...]:
    """Every test of a counter or layer i of n that llama_tensor_get_type_impl makes (i < 2, i < 4, the first
    sixteenth, the first eighth, the middle, use_more_bits): layers alike in all of them get the same types."""
    return (i < 2, i < 4, i < n // 16, i < n // 8, n // 8 <= i < 7 * n // 8, use_more_bits(i, n))


def _alike(spec: ModelSpec, sources, quantizable, categories) -> tuple[tuple[int, ...], tuple[int, ...],
                                                                       tuple[tuple[int, int, int, int], ...]]:
    """Group the tensors whose type and row size cannot differ in any file type: the same row length, category,
    stored and forced types, expert shape, and position of their counter (and, with experts, of their layer:
    _QuantizeState.layer_info) in every test the rules make. tests/test_gguf.py checks the grouped types equal
    llama-quantize's tensor-by-tensor walk (_select_types_each) for every file type."""
    n_layer, n_wv = spec.num_layers, sum(1 for c in categories if c in ATTN_V_LIKE)
    experts = spec.moe is not None and spec.moe.num_experts > 1
    counts = [0, 0, 0, 0]
    seen: dict[tuple, int] = {}
    group_of, firsts, counters = [], [], []
    for k, (src, q, cat) in enumerate(zip(sources, quantizable, categories)):
        key: tuple = ((q, src.shape[0], src.stored, src.f32) if not q  # the row length: one row size per group
                      else (q, src.shape[0], cat, len(src.shape) > 2 and src.shape[2] > 1, src.stored))
        c = COUNTER_OF.get(cat) if q else None
        if c is not None:
            key += (_position(counts[c], n_wv if c == 0 else n_layer),)
            if experts and c:
                key += (_position(int(src.name.split(".")[1]), n_layer),)
        g = seen.get(key)
        if g is None:
            g = seen[key] = len(firsts)
            firsts.append(k)
            counters.append(tuple(counts))
        group_of.append(g)
        if c is not None:
            counts[c] += 1
    return tuple(group_of), tuple(firsts), tuple(counters)


def _inventory(spec: ModelSpec) -> _Inventory:
    """The spec's converted tensors, sorted as the loader sorts them; the last few kept, keyed by the spec object."""
    hit = _INVENTORY_MEMO.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    sources, quantizable, categories = _ordered(spec)
    group_of, firsts, counters = _alike(spec, sources, quantizable, categories)
    shapes = [s.shape for s in sources]
    row_of = {sh: (math.prod(sh[1:]), sh[0]) for sh in set(shapes)}  # a model has few distinct shapes
    rows = tuple(map(row_of.__getitem__, shapes))
    per_layer: list[list[tuple[int, int, bool]]] = [[] for _ in range(spec.num_layers)]
    outside = []
    for src, g, (n, _) in zip(sources, group_of, rows):
        if src.layer is None:
            outside.append((src.name, g, n))
        else:
            per_layer[src.layer].append((g, n, "_exps." in src.name))  # llama.cpp's is_expert_tensor
    kinds: dict[tuple, int] = {}
    layer_kind_of = tuple(kinds.setdefault(tuple(t), len(kinds)) for t in per_layer)
    inv = _Inventory(sources=sources, quantizable=quantizable, categories=categories, rows=rows,
                     group_of=group_of, firsts=firsts, counters=counters,
                     info_bytes=_infos_bytes([s.name for s in sources], shapes), category_counts=Counter(categories),
                     layer_kind_of=layer_kind_of, layer_kinds=tuple(kinds), outside=tuple(outside),
                     sized=tuple((g, n, k) for (g, n), k in Counter((g, n) for g, (n, _) in zip(group_of, rows))
                                 .items()))
    if len(_INVENTORY_MEMO) >= INVENTORY_MEMO_SIZE:
        _INVENTORY_MEMO.pop(next(iter(_INVENTORY_MEMO)))
    _INVENTORY_MEMO[id(spec)] = (spec, inv)  # the spec held with it: its id cannot be reused while the entry lives
    return inv


INVENTORY_MEMO_SIZE = 4
_INVENTORY_MEMO: dict[int, tuple[ModelSpec, _Inventory]] = {}


def _tensor_type(qs: _QuantizeState, file_type: GGUFFileType, s: _Source, quantizable: bool, category: str) -> str:
    """llama_tensor_get_type for one tensor, the state's counters where the walk has them."""
    default = GGML_TYPES[file_type.default_type]
    if not quantizable:
        return s.stored or ("F32" if s.f32 else default.name)
    new_type = default.name
    if default.quantized:
        new_type = _mixture_type(qs, file_type.name, new_type, s.name, s.shape, category)
        new_type = fallback_type(new_type, s.shape[0])
    return s.stored or new_type


def _select_types_each(spec: ModelSpec, inv: _Inventory, file_type: GGUFFileType, imatrix: bool) -> list[str]:
    """llama_tensor_get_type for every tensor, visited in the loader's order (the counters depend on it).

    A tensor convert wrote pre-quantized (`stored`: gpt-oss's MXFP4 experts) keeps its type: llama-quantize would refuse
    to change it ("requantizing from type mxfp4 is disabled" without --allow-requantize), and the published gpt-oss
    GGUFs keep their experts MXFP4 at every file type (unsloth/gpt-oss-120b-GGUF: Q2_K to F16 all 58-61 GB)."""
    qs = _QuantizeState(_model_facts(spec), inv.category_counts, imatrix)
    return [_tensor_type(qs, file_type, s, q, c) for s, q, c in zip(inv.sources, inv.quantizable, inv.categories)]


def _select_group_types(spec: ModelSpec, inv: _Inventory, file_type: GGUFFileType, imatrix: bool) -> list[str]:
    """Each group of alike tensors (_alike) typed once, by its first tensor with the counters the walk has there: a
    405B model's 1138 tensors are 30-some groups."""
    qs = _QuantizeState(_model_facts(spec), inv.category_counts, imatrix)
    group_types = []
    for k, counters in zip(inv.firsts, inv.counters):
        qs.i_attention_wv, qs.i_ffn_down, qs.i_ffn_gate, qs.i_ffn_up = counters
        group_types.append(_tensor_type(qs, file_type, inv.sources[k], inv.quantizable[k], inv.categories[k]))
    return group_types


def _imatrix_needed(inv: _Inventory, group_types: list[str], file_type: str) -> str | None:
    """The first tensor llama-quantize cannot write without an importance matrix, as 'name (type)'; None if none."""
    needs = {g for g, (k, ty) in enumerate(zip(inv.firsts, group_types))
             if inv.quantizable[k] and requires_imatrix(inv.sources[k].name, ty, file_type)}
    for s, g in zip(inv.sources, inv.group_of):
        if g in needs:
            return f"{s.name} ({group_types[g]})"
    return None


# ------------------------------------------------------------------ public API
@record(kw_only=True)
class GGUFTensor:
    """One tensor of the GGUF file."""

    name: str  # GGUF name, e.g. "blk.0.attn_v.weight"
    hf_name: str | None  # transformers parameter it comes from; None when convert generates it
    ggml_type: str
    shape: tuple[int, ...]  # ggml order (ne): shape[0] is the row length, reversed from PyTorch
    nbytes: int  # ggml_nbytes: exact data bytes, without the file's alignment padding
    layer: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def gguf_tensors(spec: ModelSpec, file_type: str, *, imatrix: bool | None = None) -> tuple[GGUFTensor, ...]:
    """Every tensor of the file `llama-quantize ... <file_type>` writes, in the file's order.

    `imatrix`: quantized with an importance matrix (--imatrix). It changes IQ4_XS/IQ4_NL ffn_down and Q4_0/Q5_0
    ffn_down in the first eighth of the layers, and IQ3_XXS's attn_v and ffn_down; the other file types do not depend
    on it. None (the default): as llama-quantize lets the file be made, without one unless it refuses to write some
    tensor without one (tensor_requires_imatrix: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, IQ3_XXS, IQ3_XS,
    Q2_K_S). False for such a file type is the PlanError llama-quantize's refusal is.
    """
    if spec.gguf is not None and spec.gguf.file_type == file_type:  # planned from this very file: its own tensors
        return spec.gguf.tensors
    key = (id(spec), file_type, imatrix)
    hit = _TENSORS_MEMO.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    inv, types, nbytes = _typed(spec, file_type, imatrix)
    tensors = tuple(GGUFTensor(name=s.name, hf_name=s.hf_name, ggml_type=ty, shape=s.shape, layer=s.layer, nbytes=n)
                    for s, ty, n in zip(inv.sources, types, nbytes))
    if len(_TENSORS_MEMO) >= TENSORS_MEMO_SIZE:
        _TENSORS_MEMO.pop(next(iter(_TENSORS_MEMO)))
    _TENSORS_MEMO[key] = (spec, tensors)  # the spec held with it: its id cannot be reused while the entry lives
    return tensors


def _typed(spec: ModelSpec, file_type: str, imatrix: bool | None) -> tuple[_Inventory, tuple[str, ...],
                                                                           tuple[int, ...]]:
    """The inventory, each tensor's ggml type and its data bytes (ggml_nbytes) in the file `file_type`."""
    inv, group_types, row_bytes = _group_typed(spec, file_type, imatrix)
    return (inv, tuple(group_types[g] for g in inv.group_of),
            tuple(rows * row_bytes[g] for (rows, _), g in zip(inv.rows, inv.group_of)))


def _group_typed(spec: ModelSpec, file_type: str, imatrix: bool | None) -> tuple[_Inventory, list[str], list[int]]:
    """The inventory, and per group of alike tensors (_alike) its ggml type and the bytes of one of its rows in the
    file `file_type`; memoized."""
    key = (id(spec), file_type, imatrix)
    hit = _TYPES_MEMO.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    ft = gguf_file_type(file_type)
    inv = _inventory(spec)
    types = _select_group_types(spec, inv, ft, bool(imatrix))
    needed = None if imatrix else _imatrix_needed(inv, types, ft.name)
    if needed is not None and imatrix is False:
        raise PlanError(f"llama-quantize {ft.name} requires an importance matrix (--imatrix): without one it refuses "
                        f"to write {needed}")
    if needed is not None:
        types = _select_group_types(spec, inv, ft, True)
    row_bytes = [GGML_TYPES[ty].row_bytes(inv.rows[k][1]) for ty, k in zip(types, inv.firsts)]  # one row length
    out = (inv, types, row_bytes)
    if len(_TYPES_MEMO) >= TENSORS_MEMO_SIZE:
        _TYPES_MEMO.pop(next(iter(_TYPES_MEMO)))
    _TYPES_MEMO[key] = (spec, out)
    return out


@record(kw_only=True)
class GGUFSums:
    """A file's data bytes summed where the llama.cpp planner places them: per decoder layer (and of those its routed
    experts', llama.cpp's is_expert_tensor: "_exps." in the name), and each tensor outside the layers by name."""

    layers: tuple[int, ...]
    experts: tuple[int, ...]
    outside: tuple[tuple[str, int], ...]


def gguf_sums(spec: ModelSpec, file_type: str) -> GGUFSums:
    """The file's tensors' bytes summed per layer without building their records (the llama.cpp planner tries every
    file type): from the tensors of the file the spec was read from, else once per kind of layer (a model has a few)
    from the row bytes of each group of alike tensors."""
    if spec.gguf is not None and spec.gguf.file_type == file_type:
        layers, experts = [0] * spec.num_layers, [0] * spec.num_layers
        outside = []
        for t in spec.gguf.tensors:
            if t.layer is None:
                outside.append((t.name, t.nbytes))
            else:
                layers[t.layer] += t.nbytes
                experts[t.layer] += t.nbytes if "_exps." in t.name else 0
        return GGUFSums(layers=tuple(layers), experts=tuple(experts), outside=tuple(outside))
    inv, _, row_bytes = _group_typed(spec, file_type, None)
    kinds = [(sum(n * row_bytes[g] for g, n, _ in k), sum(n * row_bytes[g] for g, n, e in k if e))
             for k in inv.layer_kinds]
    return GGUFSums(layers=tuple(kinds[k][0] for k in inv.layer_kind_of),
                    experts=tuple(kinds[k][1] for k in inv.layer_kind_of),
                    outside=tuple((name, n * row_bytes[g]) for name, g, n in inv.outside))


_TYPES_MEMO: dict[tuple[int, str, bool | None], tuple[ModelSpec, tuple]] = {}


# One plan asks for the same file's tensors several times (llama.cpp's plan, Ollama's launch and plan, the file
# size): 7-20 ms each for a 405B model. The last few answers are kept, keyed by the spec object they were made for:
# enough for every file type a llama.cpp plan tries (planner/engines/llamacpp_rules.py PLANNED_FILE_TYPES, 18).
TENSORS_MEMO_SIZE = 24
_TENSORS_MEMO: dict[tuple[int, str, bool | None], tuple[ModelSpec, tuple[GGUFTensor, ...]]] = {}


def forget_tensors() -> None:
    """Empty the memos of gguf_tensors (what a fresh process starts with: bench/plan_speed.py times that)."""
    _TENSORS_MEMO.clear()
    _TYPES_MEMO.clear()
    _INVENTORY_MEMO.clear()


def gguf_layer_bytes(spec: ModelSpec, file_type: str, *, imatrix: bool | None = None) -> list[int]:
    """Data bytes of each decoder layer's tensors (ggml_nbytes, what a backend buffer holds)."""
    out = [0] * spec.num_layers
    for t in gguf_tensors(spec, file_type, imatrix=imatrix):
        if t.layer is not None:
            out[t.layer] += t.nbytes
    return out


@record(kw_only=True)
class GGUFNonLayerBytes:
    """Data bytes outside the decoder layers."""

    token_embd_bytes: int
    output_bytes: int  # 0 when the output projection is tied to token_embd
    output_norm_bytes: int
    other_bytes: int  # tensors convert generates (rope_freqs, rope factors)

    @property
    def total_bytes(self) -> int:
        return self.token_embd_bytes + self.output_bytes + self.output_norm_bytes + self.other_bytes


def gguf_non_layer_bytes(spec: ModelSpec, file_type: str, *, imatrix: bool | None = None) -> GGUFNonLayerBytes:
    by_name = {t.name: t.nbytes for t in gguf_tensors(spec, file_type, imatrix=imatrix) if t.layer is None}
    named = ("token_embd.weight", "output.weight", "output_norm.weight")
    return GGUFNonLayerBytes(
        token_embd_bytes=by_name.get("token_embd.weight", 0),
        output_bytes=by_name.get("output.weight", 0),
        output_norm_bytes=by_name.get("output_norm.weight", 0),
        other_bytes=sum(v for k, v in by_name.items() if k not in named),
    )


# ------------------------------------------------------------------ the file: header, metadata, padding
GGUF_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT (general.alignment unset)
GGUF_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version u32, n_tensors i64, n_kv i64
# Tokenizer metadata (tokenizer.ggml.tokens / token_type / merges / scores, a gguf string being a
# u64 length + bytes) cannot be derived from config.json. Bytes per vocabulary entry, measured on
# the vocab-only GGUFs llama.cpp ships in models/ (tokenizer.* bytes / token count):
TOKENIZER_BYTES_PER_TOKEN = {
    # ggml-vocab-llama-bpe.gguf (Llama 3): 7,817,598 B / 128,256 tokens, 280,147 merges
    "llama3-bpe": 60.95,
    # ggml-vocab-qwen2.gguf: 5,928,217 B / 151,936 tokens, 151,387 merges (deepseek-llm: 38.77)
    "bpe": 39.02,
    # ggml-vocab-llama-spm.gguf (Llama 2, Mistral): 723,363 B / 32,000 tokens, scores, no merges (phi-3: 22.62)
    "spm": 22.61,
}
SPM_MAX_VOCAB = 32768  # sentencepiece vocabularies of the supported families are at most this large
# general.* and <arch>.* hyperparameter keys (~30-40 keys, ~2 KiB) plus a chat template (~1-5 KiB
# in instruct models): an estimate, not derivable from config.json.
MODEL_METADATA_BYTES = 8 * 1024


def tokenizer_family(spec: ModelSpec) -> str:
    """Which TOKENIZER_BYTES_PER_TOKEN row a model's tokenizer is closest to."""
    if spec.model_type in ("gemma2", "gemma3_text") or spec.vocab_size <= SPM_MAX_VOCAB:
        return "spm"
    if spec.model_type == "llama":
        return "llama3-bpe"
    return "bpe"


def metadata_bytes_estimate(spec: ModelSpec) -> int:
    """Key/value metadata: vocab_size x bytes per token of the tokenizer family + MODEL_METADATA_BYTES."""
    per_token = TOKENIZER_BYTES_PER_TOKEN[tokenizer_family(spec)]
    return math.ceil(spec.vocab_size * per_token) + MODEL_METADATA_BYTES


def tensor_info_bytes(tensors: tuple[GGUFTensor, ...]) -> int:
    """gguf_write_out: per tensor a string name (u64 + bytes), n_dims u32, ne i64 each, type i32, offset u64."""
    return sum(_info_bytes(t.name, t.shape) for t in tensors)


# A tensor info in a GGUF header: the name's length (8) and bytes, n_dims (4), 8 per dimension, the type (4), the
# data offset (8).
INFO_FIXED_BYTES = 8 + 4 + 4 + 8


def _info_bytes(name: str, shape: tuple[int, ...]) -> int:
    return INFO_FIXED_BYTES + len(name.encode()) + 8 * ggml_n_dims(shape)


def _infos_bytes(names: list[str], shapes: list[tuple[int, ...]]) -> int:
    """sum(_info_bytes(name, shape)) over the tensors, each distinct shape's dimensions counted once."""
    return (INFO_FIXED_BYTES * len(names) + sum(map(len, map(str.encode, names)))
            + sum(8 * ggml_n_dims(sh) * k for sh, k in Counter(shapes).items()))


def _pad(n: int, alignment: int = GGUF_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


@record(kw_only=True)
class GGUFFileSize:
    """A GGUF file's bytes: exact tensor data and tensor infos, estimated key/value metadata."""

    tensor_data_bytes: int  # sum of ggml_nbytes
    padding_bytes: int  # zeros after each tensor up to GGUF_ALIGNMENT
    header_bytes: int  # header + tensor infos + the metadata estimate, padded to GGUF_ALIGNMENT
    metadata_estimate_bytes: int  # the estimated part of header_bytes

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.tensor_data_bytes + self.padding_bytes


def gguf_file_size(spec: ModelSpec, file_type: str, *, imatrix: bool | None = None) -> GGUFFileSize:
    if spec.gguf is not None and spec.gguf.file_type == file_type:  # planned from this very file
        nbytes, infos = [t.nbytes for t in spec.gguf.tensors], tensor_info_bytes(spec.gguf.tensors)
        data, padded = sum(nbytes), sum(_pad(n) for n in nbytes)
    else:  # what gguf_tensors lists, without building its records (Ollama sizes every tag it tries)
        inv, _, row_bytes = _group_typed(spec, file_type, imatrix)
        infos = inv.info_bytes
        data = sum(k * n * row_bytes[g] for g, n, k in inv.sized)
        padded = sum(k * _pad(n * row_bytes[g]) for g, n, k in inv.sized)
    metadata = metadata_bytes_estimate(spec)
    header = _pad(GGUF_HEADER_BYTES + metadata + infos)
    return GGUFFileSize(tensor_data_bytes=data, padding_bytes=padded - data, header_bytes=header,
                        metadata_estimate_bytes=metadata)


def gguf_file_bytes(spec: ModelSpec, file_type: str, *, imatrix: bool | None = None) -> int:
    """Size of the single-file GGUF `llama-quantize` writes (metadata estimated: see metadata_bytes_estimate)."""
    return gguf_file_size(spec, file_type, imatrix=imatrix).file_bytes
