"""Every GGUF file type: the IQ1-IQ3, TQ, Q2_K_S and MXFP4_MOE mixtures of planner/gguf.py, their quality costs, and
what planning with them changes (issue 38, step 3).

Expectations are worked out by hand from llama.cpp's source at 0c1e57098bba43ac29e6e3b677cdceebdd22334f (the tree the
llama-cpp-python 0.3.36 sdist vendors); "quant.cpp:N" is src/llama-quant.cpp line N there:
- 490-511 the output (and a tied token_embd): MXFP4_MOE Q8_0; a row not of whole blocks Q8_0; IQ1_S, IQ1_M, IQ2_XXS,
  IQ2_XS, IQ2_S, IQ2_M, IQ3_XXS Q5_K; the rest Q6_K;
- 512-524 MXFP4_MOE: ne[2] > 1 (the routed experts) MXFP4, every other tensor Q8_0;
- 525-542 an untied token_embd: Q2_K (IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M), IQ3_S (IQ2_S, IQ2_M, IQ3_XXS), Q4_K (TQ1_0,
  TQ2_0);
- 543-566 IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M: attn_v Q4_K with GQA >= 4 or >= 4 experts (else IQ3_S for
  IQ2_S/IQ2_M, Q2_K); attn_k Q4_K with 8 experts; the first n_layer/8 ffn_down tensors (a running count) IQ3_S / Q2_K;
  attn_output Q5_K with 8 experts, else IQ2_XXS (IQ1_*) or IQ3_S (IQ2_S/IQ2_M);
- 567-604 attn_v: Q2_K_S Q4_K (GQA >= 4); IQ3_XXS Q4_K (GQA >= 4) else IQ3_XXS with an imatrix, IQ3_S without; IQ3_XS
  and IQ3_S Q4_K (GQA >= 4); IQ3_M Q4_K; then LLM_TYPE_70B lifts Q3_K/Q4_K to Q5_K and 8 experts make it Q8_0;
- 605-623 attn_k (8 experts Q8_0, IQ3_XS IQ3_XXS, IQ3_XXS IQ2_S) and attn_q (IQ3_XS IQ3_XXS, IQ3_XXS IQ2_S);
- 624-668 ffn_down: Q2_K_S Q4_K below n/8; IQ3_XXS without an imatrix Q4_K below n/8 else Q3_K; IQ3_M Q4_K below n/8 or,
  with 8 experts, where use_more_bits;
- 669-688 attn_output: with 8 experts Q5_K for the IQ3 types too; else IQ3_XXS IQ3_S, IQ3_M Q4_K;
- 696-711 ffn_gate / ffn_up: IQ3_XS IQ3_XXS for the layers in [n/8, 7n/8);
- 390-441 tensor_type_fallback (256-element IQ types to IQ4_NL, TQ to Q4_0), 856-876 tensor_requires_imatrix, 881-925
  llama_ftype_get_default_type.
tests/data/gguf_golden.json has every one of these file types as llama-quantize itself wrote it for small models.
"""

from __future__ import annotations

import math

import pytest

from vramplan.planner.errors import PlanError
from vramplan.planner.gguf import (GGML_TYPES, GGUF_FILE_TYPES, gguf_file_bytes, gguf_file_size, gguf_tensors,
                                   use_more_bits)
from vramplan.planner.engines import llamacpp_rules as rules
from vramplan.planner.sources import model_spec

GiB = 1024**3
NEW_FILE_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
                  "TQ1_0", "TQ2_0", "MXFP4_MOE", "Q2_K_S")


def _by_kind(spec, file_type, **kw) -> dict[str, dict[int | None, str]]:
    """{tensor name without 'blk.N.': {layer: ggml type}}."""
    out: dict[str, dict[int | None, str]] = {}
    for t in gguf_tensors(spec, file_type, **kw):
        kind = t.name.split(".", 2)[2] if t.layer is not None else t.name
        out.setdefault(kind, {})[t.layer] = t.ggml_type
    return out


def _layers_of(types: dict[int | None, str], ggml_type: str) -> list[int]:
    return sorted(i for i, t in types.items() if t == ggml_type)


# ------------------------------------------------------------------ ids and block layouts
def test_file_type_ids_and_default_types_are_llama_h_and_llama_quant():
    """include/llama.h llama_ftype; llama-quant.cpp llama_ftype_get_default_type (IQ2_S's default is IQ2_XS, IQ2_M's
    IQ2_S, IQ3_XS's and IQ3_M's IQ3_S)."""
    got = {n: (GGUF_FILE_TYPES[n].ftype_id, GGUF_FILE_TYPES[n].default_type) for n in NEW_FILE_TYPES}
    assert got == {"IQ1_S": (24, "IQ1_S"), "IQ1_M": (31, "IQ1_M"), "IQ2_XXS": (19, "IQ2_XXS"),
                   "IQ2_XS": (20, "IQ2_XS"), "IQ2_S": (28, "IQ2_XS"), "IQ2_M": (29, "IQ2_S"),
                   "IQ3_XXS": (23, "IQ3_XXS"), "IQ3_XS": (22, "IQ3_S"), "IQ3_S": (26, "IQ3_S"),
                   "IQ3_M": (27, "IQ3_S"), "TQ1_0": (36, "TQ1_0"), "TQ2_0": (37, "TQ2_0"),
                   "MXFP4_MOE": (38, "MXFP4"), "Q2_K_S": (21, "Q2_K")}
    assert GGUF_FILE_TYPES["IQ4_NL"].ftype_id == 25 and GGUF_FILE_TYPES["IQ4_XS"].ftype_id == 30


def test_block_layouts_add_up_to_the_structs_of_ggml_common():
    """ggml/src/ggml-common.h, each struct's static_assert (ggml_half 2 B, QK_K 256, QK_MXFP4 32, IQ3S_N_SCALE
    QK_K/64), and the bits per weight tools/quantize/quantize.cpp quotes for the type a file is made of."""
    blocks = {
        "IQ1_S": (256, 2 + 256 // 8 + 256 // 16),  # d, qs[QK_K/8], qh[QK_K/32] uint16
        "IQ1_M": (256, 256 // 8 + 256 // 16 + 256 // 32),  # qs, qh, scales (no d: it lives in the scales)
        "IQ2_XXS": (256, 2 + 256 // 8 * 2),  # d, qs[QK_K/8] uint16
        "IQ2_XS": (256, 2 + 256 // 8 * 2 + 256 // 32),  # d, qs, scales[QK_K/32]
        "IQ2_S": (256, 2 + 256 // 4 + 256 // 16),  # d, qs[QK_K/4], qh[QK_K/32], scales[QK_K/32]
        "IQ3_XXS": (256, 2 + 3 * (256 // 8)),  # d, qs[3*QK_K/8]
        "IQ3_S": (256, 2 + 13 * (256 // 32) + 256 // 64),  # d, qs, qh, signs, scales[IQ3S_N_SCALE]
        "IQ4_NL": (32, 2 + 32 // 2),
        "IQ4_XS": (256, 2 + 2 + 256 // 64 + 256 // 2),
        "TQ1_0": (256, 2 + 256 // 64 + (256 - 4 * 256 // 64) // 5),  # qs (5 trits a byte), qh, d
        "TQ2_0": (256, 2 + 256 // 4),
        "MXFP4": (32, 1 + 32 // 2),  # an E8M0 exponent, 16 bytes of 4-bit values
    }
    assert {n: (GGML_TYPES[n].block_elements, GGML_TYPES[n].block_bytes) for n in blocks} == blocks
    bpw = {n: GGML_TYPES[n].bits_per_weight for n in blocks}
    # quantize.cpp QUANT_OPTIONS: IQ2_XXS " 2.06 bpw", IQ2_XS " 2.31", IQ1_S " 1.56", IQ1_M " 1.75", TQ1_0 " 1.69",
    # TQ2_0 " 2.06", IQ3_XXS " 3.06", IQ3_S " 3.44", IQ4_NL " 4.50", IQ4_XS " 4.25"
    quoted = {"IQ2_XXS": 2.06, "IQ2_XS": 2.31, "IQ1_S": 1.56, "IQ1_M": 1.75, "TQ1_0": 1.69, "TQ2_0": 2.06,
              "IQ3_XXS": 3.06, "IQ3_S": 3.44, "IQ4_NL": 4.50, "IQ4_XS": 4.25}
    assert {n: round(bpw[n], 2) for n in quoted} == quoted
    assert bpw["MXFP4"] == 4.25 and bpw["IQ2_S"] == 2.5625
    assert GGML_TYPES["IQ1_S"].row_bytes(4096) == 16 * 50 and GGML_TYPES["MXFP4"].row_bytes(2880) == 90 * 17


# ------------------------------------------------------------------ per-tensor types on real architectures
def test_llama_31_8b_iq1_and_iq2_mixtures():
    """Llama-3.1-8B: 32 layers, GQA 4 (32 / 8 heads), untied output, hidden 4096 (whole 256-blocks). quant.cpp 490-511:
    output Q5_K; 525-542: token_embd Q2_K / IQ3_S; 543-566: attn_v Q4_K (GQA >= 4), the first 32/8 = 4 ffn_down
    tensors Q2_K / IQ3_S, attn_output IQ2_XXS (IQ1_*) / IQ3_S (IQ2_S, IQ2_M) / the default."""
    spec = model_spec("llama-3.1-8b")
    expected = {  # file type: (default, token_embd, first four ffn_down, attn_output)
        "IQ1_S": ("IQ1_S", "Q2_K", "Q2_K", "IQ2_XXS"), "IQ1_M": ("IQ1_M", "Q2_K", "Q2_K", "IQ2_XXS"),
        "IQ2_XXS": ("IQ2_XXS", "Q2_K", "Q2_K", "IQ2_XXS"), "IQ2_XS": ("IQ2_XS", "Q2_K", "Q2_K", "IQ2_XS"),
        "IQ2_S": ("IQ2_XS", "IQ3_S", "IQ3_S", "IQ3_S"), "IQ2_M": ("IQ2_S", "IQ3_S", "IQ3_S", "IQ3_S"),
    }
    for file_type, (default, embd, first_down, attn_out) in expected.items():
        k = _by_kind(spec, file_type)
        assert k["output.weight"] == {None: "Q5_K"}, file_type
        assert k["token_embd.weight"] == {None: embd}, file_type
        assert set(k["attn_v.weight"].values()) == {"Q4_K"}, file_type
        assert _layers_of(k["ffn_down.weight"], first_down) == [0, 1, 2, 3], file_type
        assert _layers_of(k["ffn_down.weight"], default) == list(range(4, 32)), file_type
        assert set(k["attn_output.weight"].values()) == {attn_out}, file_type
        for other in ("attn_q.weight", "attn_k.weight", "ffn_gate.weight", "ffn_up.weight"):
            assert set(k[other].values()) == {default}, (file_type, other)
        assert k["rope_freqs.weight"] == {None: "F32"} and set(k["attn_norm.weight"].values()) == {"F32"}


def test_llama_31_8b_iq3_mixtures():
    """quant.cpp 567-604 (attn_v Q4_K with GQA 4), 605-623 (IQ3_XS: attn_q/attn_k IQ3_XXS; IQ3_XXS: IQ2_S), 624-668
    (IQ3_M: ffn_down Q4_K below 32/8), 669-688 (IQ3_XXS attn_output IQ3_S, IQ3_M Q4_K), 696-711 (IQ3_XS: ffn_gate and
    ffn_up IQ3_XXS for layers 4-27); output Q5_K for IQ3_XXS only, Q6_K for the others (490-511); token_embd IQ3_S for
    IQ3_XXS by its rule, and IQ3_S for the others as their default (525-542)."""
    spec = model_spec("llama-3.1-8b")
    k = _by_kind(spec, "IQ3_XXS")  # an imatrix is required (IQ3_XXS / IQ2_S tensors): ffn_down keeps IQ3_XXS
    assert (k["output.weight"], k["token_embd.weight"]) == ({None: "Q5_K"}, {None: "IQ3_S"})
    assert [set(k[n].values()) for n in ("attn_v.weight", "attn_q.weight", "attn_k.weight", "attn_output.weight",
                                         "ffn_down.weight", "ffn_gate.weight")] == [
        {"Q4_K"}, {"IQ2_S"}, {"IQ2_S"}, {"IQ3_S"}, {"IQ3_XXS"}, {"IQ3_XXS"}]
    k = _by_kind(spec, "IQ3_XS")
    assert (k["output.weight"], k["token_embd.weight"]) == ({None: "Q6_K"}, {None: "IQ3_S"})
    assert [set(k[n].values()) for n in ("attn_v.weight", "attn_q.weight", "attn_k.weight", "attn_output.weight",
                                         "ffn_down.weight")] == [{"Q4_K"}, {"IQ3_XXS"}, {"IQ3_XXS"}, {"IQ3_S"},
                                                                 {"IQ3_S"}]
    for gate_up in ("ffn_gate.weight", "ffn_up.weight"):
        assert _layers_of(k[gate_up], "IQ3_XXS") == list(range(4, 28))
        assert _layers_of(k[gate_up], "IQ3_S") == [0, 1, 2, 3, 28, 29, 30, 31]
    k = _by_kind(spec, "IQ3_S")
    assert k["output.weight"] == {None: "Q6_K"} and set(k["attn_v.weight"].values()) == {"Q4_K"}
    assert {t for n, types in k.items() if n not in ("output.weight", "attn_v.weight") and "norm" not in n
            and n != "rope_freqs.weight" for t in types.values()} == {"IQ3_S"}
    k = _by_kind(spec, "IQ3_M")
    assert set(k["attn_v.weight"].values()) == set(k["attn_output.weight"].values()) == {"Q4_K"}
    assert _layers_of(k["ffn_down.weight"], "Q4_K") == [0, 1, 2, 3]
    assert _layers_of(k["ffn_down.weight"], "IQ3_S") == list(range(4, 32))


def test_llama_31_8b_q2_k_s_tq_and_mxfp4_moe():
    """Q2_K_S (quant.cpp 570-571, 628-630): attn_v Q4_K (GQA 4), ffn_down Q4_K below 32/8, attn_output left Q2_K.
    TQ1_0 / TQ2_0: only token_embd (Q4_K, 539-541) and output (Q6_K) differ. MXFP4_MOE on a dense model: no tensor has
    ne[2] > 1, so every quantized tensor and the output are Q8_0 (497-499, 512-524): Q8_0's file, byte for byte."""
    spec = model_spec("llama-3.1-8b")
    k = _by_kind(spec, "Q2_K_S")
    assert set(k["attn_v.weight"].values()) == {"Q4_K"} and set(k["attn_output.weight"].values()) == {"Q2_K"}
    assert _layers_of(k["ffn_down.weight"], "Q4_K") == [0, 1, 2, 3]
    assert _layers_of(k["ffn_down.weight"], "Q2_K") == list(range(4, 32))
    assert k["output.weight"] == {None: "Q6_K"} and k["token_embd.weight"] == {None: "Q2_K"}
    for tq in ("TQ1_0", "TQ2_0"):
        k = _by_kind(spec, tq)
        assert (k["token_embd.weight"], k["output.weight"]) == ({None: "Q4_K"}, {None: "Q6_K"})
        assert {t for n, types in k.items() if n.endswith(("proj.weight", "attn_q.weight", "attn_k.weight",
                "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
                for t in types.values()} == {tq}
    assert [t.ggml_type for t in gguf_tensors(spec, "MXFP4_MOE")] == [t.ggml_type for t in gguf_tensors(spec, "Q8_0")]


def test_llama_31_70b_gets_the_70b_attn_v_bump_outside_the_low_bit_iq_rules():
    """Llama-3.1-70B is LLM_TYPE_70B (80 layers, GQA 8): in the attn_v branch (quant.cpp 567-604) Q4_K becomes Q5_K, so
    Q2_K_S, IQ3_XXS, IQ3_XS, IQ3_S and IQ3_M write attn_v Q5_K; the 1-2 bit IQ branch (543-566) has no such bump:
    attn_v stays Q4_K. Its ffn_down count: 80/8 = 10 tensors."""
    spec = model_spec("llama-3.1-70b")
    for file_type in ("Q2_K_S", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M"):
        assert set(_by_kind(spec, file_type)["attn_v.weight"].values()) == {"Q5_K"}, file_type
    k = _by_kind(spec, "IQ2_XXS")
    assert set(k["attn_v.weight"].values()) == {"Q4_K"}
    assert _layers_of(k["ffn_down.weight"], "Q2_K") == list(range(10))


def test_mixtral_eight_experts_under_the_iq_rules():
    """Mixtral-8x7B (8 experts, GQA 4). IQ2_XXS (543-566): attn_v Q4_K (not the 8-expert Q8_0 of the attn_v branch),
    attn_k Q4_K, attn_output Q5_K, the first 32/8 ffn_down_exps Q2_K. IQ3_M: attn_v Q4_K then Q8_0 (8 experts), attn_k
    Q8_0, attn_output Q5_K (669-688), ffn_down_exps Q4_K where i < 4 or use_more_bits (624-668). IQ3_XS: attn_k Q8_0,
    attn_q IQ3_XXS, the experts' gate/up IQ3_XXS in layers 4-27, the layer read from the tensor's name."""
    spec = model_spec("mixtral-8x7b")
    k = _by_kind(spec, "IQ2_XXS")
    assert [set(k[n].values()) for n in ("attn_v.weight", "attn_k.weight", "attn_output.weight", "attn_q.weight")] == [
        {"Q4_K"}, {"Q4_K"}, {"Q5_K"}, {"IQ2_XXS"}]
    assert _layers_of(k["ffn_down_exps.weight"], "Q2_K") == [0, 1, 2, 3]
    k = _by_kind(spec, "IQ3_M")
    assert [set(k[n].values()) for n in ("attn_v.weight", "attn_k.weight", "attn_output.weight")] == [
        {"Q8_0"}, {"Q8_0"}, {"Q5_K"}]
    assert _layers_of(k["ffn_down_exps.weight"], "Q4_K") == [i for i in range(32) if use_more_bits(i, 32)]
    k = _by_kind(spec, "IQ3_XS")
    assert set(k["attn_k.weight"].values()) == {"Q8_0"} and set(k["attn_q.weight"].values()) == {"IQ3_XXS"}
    assert _layers_of(k["ffn_gate_exps.weight"], "IQ3_XXS") == list(range(4, 28))
    assert k["ffn_gate_inp.weight"] == dict.fromkeys(range(32), "F32")


def test_deepseek_r1_iq1_s_counts_shared_expert_ffn_down_tensors():
    """DeepSeek-R1 (61 layers, the first 3 dense, MLA, 256 experts + 1 shared). IQ1_S's first-eighth rule counts
    ffn_down tensors, not layers (quant.cpp 553-558, ++qs.i_ffn_down): 61/8 = 7 of them, in the loader's order
    blk.0-2.ffn_down, blk.3.ffn_down_exps, blk.3.ffn_down_shexp, blk.4.ffn_down_exps, blk.4.ffn_down_shexp, are Q2_K.
    No attn_v-like tensor (kv_b is split into attn_k_b / attn_v_b); attn_k_b's rows of 128 fall back to IQ4_NL
    (390-441); attn_output IQ2_XXS; the router F32; token_embd Q2_K; output Q5_K."""
    spec = model_spec("deepseek-r1")
    k = _by_kind(spec, "IQ1_S")
    assert _layers_of(k["ffn_down.weight"], "Q2_K") == [0, 1, 2]
    assert _layers_of(k["ffn_down_exps.weight"], "Q2_K") == _layers_of(k["ffn_down_shexp.weight"], "Q2_K") == [3, 4]
    assert _layers_of(k["ffn_down_exps.weight"], "IQ1_S") == list(range(5, 61))
    assert [set(k[n].values()) for n in ("attn_k_b.weight", "attn_v_b.weight", "attn_output.weight",
                                         "attn_q_b.weight", "ffn_gate_exps.weight", "ffn_gate_inp.weight")] == [
        {"IQ4_NL"}, {"IQ1_S"}, {"IQ2_XXS"}, {"IQ1_S"}, {"IQ1_S"}, {"F32"}]
    assert (k["token_embd.weight"], k["output.weight"]) == ({None: "Q2_K"}, {None: "Q5_K"})


def test_qwen3_moe_iq2_attn_v_takes_q4_k_for_many_experts():
    """Qwen3-30B-A3B: 128 experts (>= 4) and GQA 8: attn_v Q4_K (quant.cpp 546-547); 48/8 = 6 ffn_down_exps Q2_K."""
    k = _by_kind(model_spec("qwen3-30b-a3b"), "IQ2_XS")
    assert set(k["attn_v.weight"].values()) == {"Q4_K"} and set(k["attn_k.weight"].values()) == {"IQ2_XS"}
    assert _layers_of(k["ffn_down_exps.weight"], "Q2_K") == list(range(6))


# ------------------------------------------------------------------ the importance matrix
def test_the_file_types_llama_quantize_makes_only_with_an_imatrix():
    """tensor_requires_imatrix (quant.cpp 856-876): IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S (and so IQ2_M, IQ3_XXS and
    IQ3_XS, which write such tensors) and Q2_K tensors of a Q2_K_S file. Without one llama-quantize refuses: a PlanError
    naming the tensor; by default the file is sized as made with one."""
    spec = model_spec("llama-3.1-8b")
    for file_type in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"):
        with pytest.raises(PlanError, match=f"{file_type} requires an importance matrix"):
            gguf_tensors(spec, file_type, imatrix=False)
        assert gguf_tensors(spec, file_type) == gguf_tensors(spec, file_type, imatrix=True)
    for file_type in ("IQ3_S", "IQ3_M", "TQ1_0", "TQ2_0", "MXFP4_MOE", "IQ4_XS", "Q4_K_M"):
        assert gguf_tensors(spec, file_type) == gguf_tensors(spec, file_type, imatrix=False)
    # with one, IQ3_XXS keeps attn_v at IQ3_XXS on a model of GQA < 4 (quant.cpp 573-574): Llama-2-7B has none
    k = _by_kind(model_spec("llama-2-7b"), "IQ3_XXS")
    assert set(k["attn_v.weight"].values()) == {"IQ3_XXS"} and set(k["ffn_down.weight"].values()) == {"IQ3_XXS"}


# ------------------------------------------------------------------ gpt-oss and MXFP4
def test_gpt_oss_tensors_as_convert_writes_them():
    """conversion/gpt_oss.py and gguf-py (MODEL_ARCH.GPT_OSS): attention with biases and attn_sinks, the router
    ffn_gate_inp (F32 with its bias), gate_up split into ffn_gate_exps / ffn_up_exps (and their biases), the experts
    kept MXFP4 as the checkpoint stores them, post_attention_layernorm as post_attention_norm. MXFP4_MOE: every other
    quantized tensor, token_embd and output Q8_0 (quant.cpp 497-499, 512-524)."""
    spec = model_spec("gpt-oss-120b")
    ts = {t.name: t for t in gguf_tensors(spec, "MXFP4_MOE") if t.layer in (0, None)}
    assert {n: (t.shape, t.ggml_type) for n, t in ts.items()} == {
        "token_embd.weight": ((2880, 201088), "Q8_0"), "output.weight": ((2880, 201088), "Q8_0"),
        "output_norm.weight": ((2880,), "F32"),
        "blk.0.attn_norm.weight": ((2880,), "F32"), "blk.0.post_attention_norm.weight": ((2880,), "F32"),
        "blk.0.attn_q.weight": ((2880, 4096), "Q8_0"), "blk.0.attn_q.bias": ((4096,), "F32"),
        "blk.0.attn_k.weight": ((2880, 512), "Q8_0"), "blk.0.attn_k.bias": ((512,), "F32"),
        "blk.0.attn_v.weight": ((2880, 512), "Q8_0"), "blk.0.attn_v.bias": ((512,), "F32"),
        "blk.0.attn_output.weight": ((4096, 2880), "Q8_0"), "blk.0.attn_output.bias": ((2880,), "F32"),
        "blk.0.attn_sinks.weight": ((64,), "F32"),
        "blk.0.ffn_gate_inp.weight": ((2880, 128), "F32"), "blk.0.ffn_gate_inp.bias": ((128,), "F32"),
        "blk.0.ffn_gate_exps.weight": ((2880, 2880, 128), "MXFP4"), "blk.0.ffn_gate_exps.bias": ((2880, 128), "F32"),
        "blk.0.ffn_up_exps.weight": ((2880, 2880, 128), "MXFP4"), "blk.0.ffn_up_exps.bias": ((2880, 128), "F32"),
        "blk.0.ffn_down_exps.weight": ((2880, 2880, 128), "MXFP4"), "blk.0.ffn_down_exps.bias": ((2880, 128), "F32"),
    }
    # the checkpoint's MXFP4 experts stay MXFP4 in every file type (convert writes them raw; llama-quantize would not
    # requantize them without --allow-requantize); the rest follows the file type's rules: IQ2_XXS, GQA 8 -> attn_v
    # Q4_K, whose rows of 2880 (11.25 blocks of 256) fall back to Q5_0, as IQ2_XXS falls back to IQ4_NL (quant.cpp
    # 390-441)
    k = _by_kind(spec, "IQ2_XXS")
    assert set(k["ffn_up_exps.weight"].values()) == {"MXFP4"} and set(k["attn_v.weight"].values()) == {"Q5_0"}
    assert set(k["attn_q.weight"].values()) == {"IQ4_NL"} and set(k["attn_output.weight"].values()) == {"IQ2_XXS"}
    assert set(_by_kind(spec, "F16")["ffn_down_exps.weight"].values()) == {"MXFP4"}


# llama-bench's size column is llama_model_size, every tensor's bytes, in GiB to two decimals; params its elements.
# https://community.frame.work/t/will-the-ai-max-395-128gb-be-able-to-run-gpt-oss-120b/73280/26 :
#   "ggml-org_gpt-oss-120b-GGUF_gpt-oss-120b-mxfp4-00001-of-00003.gguf | gpt-oss ?B MXFP4 MoE | 59.02 GiB | 116.83 B"
#   "gpt-oss-120b-F16.gguf (unsloth) | gpt-oss ?B F16 | 60.87 GiB | 116.83 B"
# gpt-oss-20b, llama-bench tables in public benchmark logs: "gpt-oss 20B MXFP4 MoE | 11.27 GiB | 20.91 B",
# "GPT-OSS 20B F16 | 12.83 GiB | 20.91 B".
GPT_OSS_PUBLISHED = [("gpt-oss-120b", "MXFP4_MOE", 59.02, 116.83), ("gpt-oss-120b", "F16", 60.87, 116.83),
                     ("gpt-oss-20b", "MXFP4_MOE", 11.27, 20.91), ("gpt-oss-20b", "F16", 12.83, 20.91)]


@pytest.mark.parametrize("model,file_type,gib,billions", GPT_OSS_PUBLISHED)
def test_gpt_oss_sizes_match_llama_bench_on_the_published_files(model, file_type, gib, billions):
    spec = model_spec(model)
    tensors = gguf_tensors(spec, file_type)
    assert round(gguf_file_size(spec, file_type).tensor_data_bytes / GiB, 2) == gib
    assert round(sum(t.numel for t in tensors) / 1e9, 2) == billions


# bartowski's Llama-3.1-70B imatrix quants (Llama-3.1-Nemotron-70B, the same shapes), file sizes in GB as his model
# card lists them, transcribed at https://ozeki.chat/p_8590-understanding-ai-model-files.html :
# "Llama-3.1-70B-IQ4_XS.gguf IQ4_XS 37.90GB", "Llama-3.1-70B-IQ3_M.gguf IQ3_M 31.94GB".
@pytest.mark.parametrize("file_type,gb", [("IQ4_XS", 37.90), ("IQ3_M", 31.94)])
def test_llama_70b_iq_files_match_published_sizes(file_type, gb):
    assert round(gguf_file_bytes(model_spec("llama-3.1-70b"), file_type, imatrix=True) / 1e9, 2) == gb


# ------------------------------------------------------------------ quality costs
# tools/perplexity/README.md "LLaMA 3 8b Scoreboard" (MEASURED_COMMIT's tree), the ΔPPL column of each row:
# | iq3_M    | WT 10m | 3.53 | 6.898327 | 0.666694 |     | iq2_M   | WT 10m | 2.74 | 8.600799  | 2.369166  |
# | iq3_S    | WT 10m | 3.42 | 6.965501 | 0.733867 |     | q2_K_S  | WT 10m | 2.96 | 9.323778  | 3.092145  |
# | iq3_XS   | WT 10m | 3.28 | 7.163043 | 0.931409 |     | iq2_S   | WT 10m | 2.56 | 9.650781  | 3.419148  |
# | iq3_XXS  | WT 10m | 3.05 | 7.458436 | 1.226803 |     | iq2_XS  | WT 10m | 2.43 | 10.761424 | 4.529791  |
# | iq1_M    | WT 10m | 2.01 | 25.493722| 19.262089|     | iq2_XXS | WT 10m | 2.24 | 14.091782 | 7.860148  |
# | iq1_S    | WT 10m | 1.88 | 60.694593| 54.462959|
README_ROWS = {"IQ3_M": 0.666694, "IQ3_S": 0.733867, "IQ3_XS": 0.931409, "IQ3_XXS": 1.226803, "IQ2_M": 2.369166,
               "Q2_K_S": 3.092145, "IQ2_S": 3.419148, "IQ2_XS": 4.529791, "IQ2_XXS": 7.860148, "IQ1_M": 19.262089,
               "IQ1_S": 54.462959}


def test_every_new_file_type_has_its_readme_row_or_says_why_not():
    assert {t: rules.FILE_TYPE_DELTA_PPL[t] for t in README_ROWS} == README_ROWS
    assert all(rules.FILE_TYPE_PPL_IMATRIX[t] == "WT 10m" for t in README_ROWS)
    # each row is PPL - ΔPPL = the f16 reference of the others (6.231634), to the table's last digit
    for ppl, delta in ((6.898327, 0.666694), (14.091782, 7.860148), (60.694593, 54.462959), (9.323778, 3.092145)):
        assert ppl - delta == pytest.approx(rules.LLAMA3_8B_F16_PPL, abs=2e-6)
    assert rules.quality_cost_pct("IQ2_XXS", "f16") == pytest.approx(100 * 7.860148 / 6.231634)
    assert set(rules.NO_PERPLEXITY_ROW) == {"TQ1_0", "TQ2_0", "MXFP4_MOE"}
    assert set(GGUF_FILE_TYPES) == set(rules.FILE_TYPE_DELTA_PPL) | set(rules.NO_PERPLEXITY_ROW)
    assert not set(rules.NO_PERPLEXITY_ROW) & set(rules.FILE_TYPE_DELTA_PPL)


def test_planned_file_types_run_best_quality_first_and_all_have_a_cost():
    costs = [rules.FILE_TYPE_DELTA_PPL[t] for t in rules.PLANNED_FILE_TYPES]
    assert costs == sorted(costs)
    assert {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
            "Q2_K_S"} <= set(rules.PLANNED_FILE_TYPES)
    assert not set(rules.PLANNED_FILE_TYPES) & set(rules.NO_PERPLEXITY_ROW)
    # the balanced floor (8 %) keeps IQ4_XS (3.7 %) and leaves out every 3-bit and smaller type (IQ3_M 10.7 %)
    assert [t for t in rules.PLANNED_FILE_TYPES if rules.quality_cost_pct(t, "f16") <= 8.0] == [
        "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS"]


def test_file_types_run_largest_to_smallest_on_a_dense_model():
    """GGUF_FILE_TYPES's order (what a speed entry is borrowed by) is by size, MXFP4_MOE placed by its experts."""
    spec = model_spec("llama-3.1-8b")
    order = [t for t in GGUF_FILE_TYPES if t not in ("MXFP4_MOE", "Q5_1", "Q4_1", "IQ4_NL")]
    sizes = [gguf_file_size(spec, t).tensor_data_bytes for t in order]
    assert sizes == sorted(sizes, reverse=True)


# ------------------------------------------------------------------ what planning with them changes
def test_llama_31_70b_at_iq2_xxs_runs_entirely_on_an_rtx_4090():
    """Needs the new file types in planner/engines/llamacpp.py's FIT_GROUPS (the speed model's groups)."""
    from vramplan.planner.engines.llamacpp import plan_llamacpp
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request

    p = plan_llamacpp(model_spec("llama-3.1-70b"), resolve_profile("rtx-4090")[0],
                      Request(context=4096, engine="llama.cpp", quant=("IQ2_XXS",)))
    assert p.fits and p.choice.weight_quant == "IQ2_XXS"
    assert p.choice.gpu_layers == p.choice.total_layers == 80
    assert math.isclose(gguf_file_bytes(model_spec("llama-3.1-70b"), "IQ2_XXS") / 1e9, 19.10, abs_tol=0.005)


def test_deepseek_r1_plans_on_a_192_gb_mac_at_a_1_or_2_bit_type():
    """Nothing fit before (Q2_K, the smallest planned type, needs more than the Mac has). Needs the FIT_GROUPS change
    too. Every candidate that runs is an IQ1/IQ2 type; balanced picks the best quality within reach of the fastest."""
    from vramplan.planner.engines.llamacpp import plan_llamacpp
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request

    p = plan_llamacpp(model_spec("deepseek-r1"), resolve_profile("apple-m2-ultra-192gb")[0],
                      Request(context=4096, engine="llama.cpp"))
    assert p.fits
    runs = {c.weight_quant for c in p.candidates if c.fits}
    assert {"IQ1_S", "IQ1_M", "IQ2_XXS"} <= runs <= {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"}
    assert p.choice.weight_quant in runs
