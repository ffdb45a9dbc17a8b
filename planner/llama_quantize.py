"""llama-quantize's choice of a ggml type for each tensor (src/llama-quant.cpp at the commit planner/gguf.py names):
tensor categories, which tensors it quantizes, the per-file-type mixture rules with their counters, the row-length
fallbacks and the importance-matrix requirement. planner/gguf.py walks a model's tensors with them. Pure: stdlib and
planner only.
"""

from __future__ import annotations

from collections import Counter

from .record import record
from .errors import PlanError
from .ggml_types import GGML_TYPES


# tensor_get_category: the first matching substring decides (order as in llama-quant.cpp).
CATEGORY_PATTERNS = (
    ("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
    ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
    ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"),
)
ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")  # category_is_attn_v
# tensor_allows_quantization: name fragments never quantized (architecture-independent ones).
NEVER_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "time_mix_first.weight",
    "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
    "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
NEVER_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")  # LLM_TENSOR_POS_EMBD, TOKEN_TYPES
# tensor_type_fallback: the type a row length that is no whole number of blocks falls back to (256-element IQ types to
# IQ4_NL, the 2- and 3-bit K and ternary types to Q4_0; a 32-element type keeps itself, then F16).
FALLBACK_TYPES = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
                  "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_0": "Q4_0", "Q2_K": "Q4_0",
                  "Q3_K": "Q4_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# llama_tensor_get_type_impl's lists of file types (llama-quant.cpp), by the rule that names them:
# the output (and a tied token_embd) is Q5_K for these, Q6_K for the others;
OUTPUT_Q5_K_FILE_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
# an untied token_embd takes these types (the other file types leave it at their default);
TOKEN_EMBD_TYPES = {"IQ2_XXS": "Q2_K", "IQ2_XS": "Q2_K", "IQ1_S": "Q2_K", "IQ1_M": "Q2_K", "IQ2_S": "IQ3_S",
                    "IQ2_M": "IQ3_S", "IQ3_XXS": "IQ3_S", "TQ1_0": "Q4_K", "TQ2_0": "Q4_K"}
# the 1- and 2-bit IQ mixtures have rules of their own for attn_v, attn_k, ffn_down and attn_output (and no others);
LOW_BIT_IQ_FILE_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
IQ2_S_LIKE = ("IQ2_S", "IQ2_M")  # ... where these two take IQ3_S and the others Q2_K
# the rule sets that move attn_output to Q5_K in 8-expert models;
EIGHT_EXPERT_ATTN_OUTPUT_Q5_K = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M",
                                 "IQ3_S", "IQ3_M", "IQ4_XS")
# attn_output of the other models.
ATTN_OUTPUT_TYPES = {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}
# tensor_requires_imatrix: llama-quantize refuses ("this quantization requires an imatrix!") to write a tensor other
# than token_embd / output in these types without an importance matrix; Q2_K too, in a Q2_K_S file.
IMATRIX_REQUIRED_TYPES = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S")


def tensor_category(name: str) -> str:
    """tensor_get_category: 'output', 'token_embd', 'attn_v', 'ffn_down', ... or 'other'."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for fragment, category in CATEGORY_PATTERNS:
        if fragment in name:
            return category
    return "other"


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one larger than 1 (at least 1)."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization for the default parameters (quantize_output_tensor, not only_copy)."""
    if ggml_n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    return not any(f in name for f in NEVER_QUANTIZED) and name not in NEVER_QUANTIZED_NAMES


def requires_imatrix(name: str, ggml_type: str, file_type: str) -> bool:
    """tensor_requires_imatrix: whether llama-quantize needs an importance matrix to write this tensor in this type."""
    if tensor_category(name) in ("token_embd", "output"):
        return False
    return ggml_type in IMATRIX_REQUIRED_TYPES or (ggml_type == "Q2_K" and file_type == "Q2_K_S")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The Q4_K_M / Q5_K_M rule: the first and last eighth and every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def fallback_type(type_name: str, row_elements: int) -> str:
    """tensor_type_fallback: a type whose block does not divide the row length is demoted."""
    t = GGML_TYPES[type_name]
    if row_elements % t.block_elements == 0:
        return type_name
    demoted = FALLBACK_TYPES.get(type_name, type_name if t.block_elements <= 32 else None)
    if demoted is None:
        raise PlanError(f"no tensor type fallback is defined for type {type_name}")
    return demoted if row_elements % GGML_TYPES[demoted].block_elements == 0 else "F16"


@record(kw_only=True)
class _ModelFacts:
    """The hparams llama_tensor_get_type_impl reads."""

    arch: str
    n_layer: int  # n_layer_all: GGUF block_count
    n_expert: int  # 0 for dense models
    n_gqa: int  # n_head / n_head_kv of layer 0 as the GGUF stores them
    is_70b: bool  # model.type == LLM_TYPE_70B


class _QuantizeState:
    """quantize_state_impl: the counters llama-quantize advances tensor by tensor."""

    def __init__(self, facts: _ModelFacts, categories: tuple[str, ...] | Counter, imatrix: bool) -> None:
        """`categories`: every tensor's (or how many tensors each has)."""
        counts = categories if isinstance(categories, Counter) else Counter(categories)
        self.facts = facts
        self.has_imatrix = imatrix
        self.n_attention_wv = sum(counts[c] for c in ATTN_V_LIKE)
        self.has_tied_embeddings = not counts["output"]
        self.n_ffn_down = facts.n_layer  # n_ffn_down = n_ffn_gate = n_ffn_up = n_layer_all
        self.i_attention_wv = 0
        self.i_ffn_down = 0
        self.i_ffn_gate = 0
        self.i_ffn_up = 0

    def layer_info(self, counter: int, name: str) -> tuple[int, int]:
        """With experts the layer comes from the name; otherwise from the running counter."""
        if self.facts.n_expert > 1:
            return int(name.split(".")[1]), self.n_ffn_down
        return counter, self.n_ffn_down


def _output_type(ftype: str, new_type: str, row: int) -> str:
    """The output tensor (and a tied token_embd)."""
    if ftype == "MXFP4_MOE" or row % GGML_TYPES[new_type].block_elements:
        return "Q8_0"
    if ftype in OUTPUT_Q5_K_FILE_TYPES:
        return "Q5_K"
    return new_type if new_type == "Q8_0" else "Q6_K"


def _low_bit_iq_type(qs: _QuantizeState, ftype: str, new_type: str, category: str) -> str:
    """The IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S / IQ2_M rules (no LLM_TYPE_70B or 8-expert Q8_0 attn_v here;
    ffn_down counts tensors, experts' and shared experts' alike, against n_layer / 8)."""
    f = qs.facts
    if category in ATTN_V_LIKE:
        qs.i_attention_wv += 1
        if f.n_gqa >= 4 or f.n_expert >= 4:
            return "Q4_K"
        return "IQ3_S" if ftype in IQ2_S_LIKE else "Q2_K"
    if f.n_expert == 8 and category == "attn_k":
        return "Q4_K"
    if category == "ffn_down":
        first = qs.i_ffn_down < qs.n_ffn_down // 8
        qs.i_ffn_down += 1
        return ("IQ3_S" if ftype in IQ2_S_LIKE else "Q2_K") if first else new_type
    if category == "attn_output":
        if f.n_expert == 8:
            return "Q5_K"
        return "IQ2_XXS" if ftype in ("IQ1_S", "IQ1_M") else "IQ3_S" if ftype in IQ2_S_LIKE else new_type
    return new_type


def _attn_v_type(qs: _QuantizeState, ftype: str, new_type: str) -> str:
    f = qs.facts
    i, n = qs.i_attention_wv, qs.n_attention_wv
    if ftype == "Q2_K":
        new_type = "Q4_K" if f.n_gqa >= 4 else "Q3_K"
    elif ftype == "Q2_K_S" and f.n_gqa >= 4:
        new_type = "Q4_K"
    elif ftype == "IQ3_XXS":
        new_type = "Q4_K" if f.n_gqa >= 4 else "IQ3_XXS" if qs.has_imatrix else "IQ3_S"
    elif ftype in ("IQ3_XS", "IQ3_S") and f.n_gqa >= 4:
        new_type = "Q4_K"
    elif ftype == "IQ3_M":
        new_type = "Q4_K"
    elif ftype == "Q3_K_M":
        new_type = "Q5_K" if i < 2 else "Q4_K"
    elif ftype == "Q3_K_L":
        new_type = "Q5_K"
    elif ftype in ("IQ4_NL", "IQ4_XS") and f.n_gqa >= 4:
        new_type = "Q5_K"
    elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
        new_type = "Q6_K"
    elif ftype == "Q4_K_S" and i < 4:
        new_type = "Q5_K"
    if f.is_70b and new_type in ("Q3_K", "Q4_K"):
        new_type = "Q5_K"
    if f.n_expert == 8:
        new_type = "Q8_0"
    qs.i_attention_wv += 1
    return new_type


def _ffn_down_type(qs: _QuantizeState, ftype: str, new_type: str, name: str) -> str:
    i, n = qs.layer_info(qs.i_ffn_down, name)
    if ftype == "Q2_K":
        new_type = "Q3_K"
    elif ftype == "Q2_K_S":
        if i < n // 8:
            new_type = "Q4_K"
    elif ftype == "IQ3_XXS" and not qs.has_imatrix:
        new_type = "Q4_K" if i < n // 8 else "Q3_K"
    elif ftype == "Q3_K_M":
        new_type = "Q5_K" if i < n // 16 else "Q4_K"
    elif ftype == "IQ3_M" and (i < n // 8 or (qs.facts.n_expert == 8 and use_more_bits(i, n))):
        new_type = "Q4_K"
    elif ftype == "Q3_K_L":
        new_type = "Q5_K"
    elif ftype == "Q4_K_M":
        if use_more_bits(i, n):
            new_type = "Q6_K"
    elif i < n // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not qs.has_imatrix:
        new_type = "Q5_K"
    elif ftype == "Q5_K_M" and use_more_bits(i, n):
        new_type = "Q6_K"
    elif ftype == "Q4_K_S" and i < n // 8:
        new_type = "Q5_K"
    elif ftype in ("Q4_0", "Q5_0") and qs.has_imatrix and i < n // 8:
        new_type = "Q4_1" if ftype == "Q4_0" else "Q5_1"
    qs.i_ffn_down += 1
    return new_type


def _attn_output_type(qs: _QuantizeState, ftype: str, new_type: str) -> str:
    if qs.facts.n_expert == 8:
        return "Q5_K" if ftype in EIGHT_EXPERT_ATTN_OUTPUT_Q5_K else new_type
    return ATTN_OUTPUT_TYPES.get(ftype, new_type)


def _gate_up_type(qs: _QuantizeState, ftype: str, new_type: str, name: str, category: str) -> str:
    """ffn_gate / ffn_up: IQ3_XS takes IQ3_XXS for the layers between the first and the last eighth."""
    counter = qs.i_ffn_gate if category == "ffn_gate" else qs.i_ffn_up
    i, n = qs.layer_info(counter, name)
    if category == "ffn_gate":
        qs.i_ffn_gate += 1
    else:
        qs.i_ffn_up += 1
    return "IQ3_XXS" if ftype == "IQ3_XS" and n // 8 <= i < 7 * n // 8 else new_type


def _mixture_type(qs: _QuantizeState, ftype: str, new_type: str, name: str, shape: tuple[int, ...],
                  category: str) -> str:
    """llama_tensor_get_type_impl, its branches in its order, for the file types in GGUF_FILE_TYPES."""
    if category == "output" or (qs.has_tied_embeddings and category == "token_embd"):
        return _output_type(ftype, new_type, shape[0])
    if ftype == "MXFP4_MOE":  # 3-D tensors (ne[2] > 1: the routed experts) MXFP4, every other one Q8_0
        return "MXFP4" if len(shape) > 2 and shape[2] > 1 else "Q8_0"
    if category == "token_embd":
        return TOKEN_EMBD_TYPES.get(ftype, new_type)
    if ftype in LOW_BIT_IQ_FILE_TYPES:
        return _low_bit_iq_type(qs, ftype, new_type, category)
    if category in ATTN_V_LIKE:  # attn_qkv is attn_v-like: the later ATTENTION_QKV branch is never reached
        return _attn_v_type(qs, ftype, new_type)
    if category == "attn_k":
        return "Q8_0" if qs.facts.n_expert == 8 else {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(ftype, new_type)
    if category == "attn_q":
        return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(ftype, new_type)
    if category == "ffn_down":
        return _ffn_down_type(qs, ftype, new_type, name)
    if category == "attn_output":
        return _attn_output_type(qs, ftype, new_type)
    if category in ("ffn_gate", "ffn_up"):
        return _gate_up_type(qs, ftype, new_type, name, category)
    return new_type
