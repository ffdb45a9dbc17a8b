"""planner/gguf.py against ggml's block layouts, llama-quantize's own choices and published GGUF files.

- Block layouts: bytes per block as the structs in ggml-common.h add up.
- Type selection: tests/data/gguf_golden.json holds what llama.cpp's convert_hf_to_gguf.py and
  llama-quantize (commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f) wrote for small random models,
  read back with gguf-py (bench/gguf_golden.py made it); every tensor's name, shape and type and
  the bytes of the data section must match exactly. The file types llama-quantize makes only with
  an importance matrix (IQ1-IQ2, IQ3_XXS, IQ3_XS, Q2_K_S) were written with one (every value 1.0:
  the types do not depend on its values); gpt_oss is a random gpt-oss in bf16, gpt_oss_mxfp4 the
  same with its experts stored MXFP4 as openai's checkpoints store them.
- Published files: exact byte sizes of GGUF files on the Hugging Face hub, as pinned in public
  repositories (sources next to each number); gguf_file_bytes must be within 1 %.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import vramplan.planner.gguf as gguf
from vramplan.planner.architectures import spec_from_config
from vramplan.planner.errors import PlanError, UnsupportedArchitectureError
from vramplan.planner.gguf import (
    GGML_TYPES,
    GGUF_FILE_TYPES,
    fallback_type,
    gguf_file_bytes,
    gguf_file_size,
    gguf_layer_bytes,
    gguf_non_layer_bytes,
    gguf_tensors,
    tensor_info_bytes,
    use_more_bits,
)
from vramplan.planner.sources import model_spec

GOLDEN = json.loads((Path(__file__).parent / "data" / "gguf_golden.json").read_text())


def _types(spec, file_type, fragment, imatrix=False):
    """{layer: ggml type} of the tensors whose GGUF name contains `fragment`."""
    return {t.layer: t.ggml_type for t in gguf_tensors(spec, file_type, imatrix=imatrix) if fragment in t.name}


def _tiny(**overrides):
    config = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False)
    config.update(overrides)
    return spec_from_config(config, name="tiny")


# ------------------------------------------------------------------ block layouts
# (elements per block, bytes per block) from ggml-common.h's static_asserts.
GGML_COMMON_BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
    "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8), "F64": (1, 8), "Q8_1": (32, 36), "Q8_K": (256, 292),
    "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110),
    "IQ1_S": (256, 50), "IQ1_M": (256, 56), "TQ1_0": (256, 54), "TQ2_0": (256, 66), "MXFP4": (32, 17),
    "NVFP4": (64, 36), "Q1_0": (128, 18), "Q2_0": (64, 18),
}


def test_block_layouts_match_ggml_common():
    assert {n: (t.block_elements, t.block_bytes) for n, t in GGML_TYPES.items()} == GGML_COMMON_BLOCKS


def test_row_bytes_and_bits_per_weight():
    assert GGML_TYPES["Q4_K"].row_bytes(4096) == 16 * 144
    assert GGML_TYPES["Q8_0"].row_bytes(4096) == 128 * 34
    assert GGML_TYPES["F32"].row_bytes(7) == 28
    assert GGML_TYPES["Q4_K"].bits_per_weight == 4.5
    assert GGML_TYPES["Q6_K"].bits_per_weight == 6.5625
    assert GGML_TYPES["IQ4_XS"].bits_per_weight == 4.25
    with pytest.raises(ValueError):
        GGML_TYPES["Q4_K"].row_bytes(320)


def test_every_file_type_default_is_a_known_type_and_ids_are_llama_h():
    ids = {f.name: f.ftype_id for f in GGUF_FILE_TYPES.values()}
    assert ids["Q4_K_M"] == 15 and ids["Q8_0"] == 7 and ids["IQ4_XS"] == 30 and ids["Q2_K"] == 10
    assert gguf.gguf_file_type("q4_k_m").default_type == "Q4_K"
    with pytest.raises(PlanError, match="Q4_K_M"):
        gguf.gguf_file_type("Q4_K_XL")


# ------------------------------------------------------------------ fallback for rows not made of whole blocks
@pytest.mark.parametrize("target,row,expected", [
    ("Q4_K", 4096, "Q4_K"),
    ("Q4_K", 320, "Q5_0"), ("Q5_K", 320, "Q5_1"), ("Q6_K", 320, "Q8_0"),
    ("Q2_K", 320, "Q4_0"), ("Q3_K", 320, "Q4_0"), ("IQ4_XS", 320, "IQ4_NL"),
    ("Q4_K", 336, "F16"), ("Q8_0", 336, "F16"), ("Q4_0", 336, "F16"),
])
def test_fallback_type(target, row, expected):
    assert fallback_type(target, row) == expected


def test_rows_of_320_fall_back_in_a_model():
    spec = _tiny(intermediate_size=320)  # ffn_down rows are 320 long; gate/up rows 512
    assert set(_types(spec, "Q4_K_S", "ffn_down").values()) == {"Q5_1", "Q5_0"}  # Q5_K first 1/8, Q4_K after
    assert set(_types(spec, "Q4_K_S", "ffn_gate").values()) == {"Q4_K"}


def test_qwen25_05b_hidden_896_falls_back_and_tied_embedding_is_q8_0():
    spec = model_spec("qwen2.5-0.5b")  # hidden 896 = 3.5 x 256, tied embeddings
    tensors = {t.name: t for t in gguf_tensors(spec, "Q4_K_M")}
    assert "output.weight" not in tensors
    assert tensors["token_embd.weight"].ggml_type == "Q8_0"  # output rule: 896 % 256 != 0 -> Q8_0
    assert tensors["blk.0.attn_q.weight"].ggml_type == "Q5_0"
    assert tensors["blk.0.attn_v.weight"].ggml_type == "Q8_0"  # Q6_K (use_more_bits) -> Q8_0
    assert tensors["blk.0.ffn_down.weight"].ggml_type == "Q6_K"  # rows of 4864 = 19 x 256


# ------------------------------------------------------------------ the layer counters
def test_use_more_bits_layers_of_a_32_layer_model():
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_llama_31_8b_q4_k_m_attn_v_and_ffn_down_follow_use_more_bits():
    spec = model_spec("llama-3.1-8b")
    six = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for fragment in ("attn_v", "ffn_down"):
        types = _types(spec, "Q4_K_M", fragment)
        assert [i for i, t in sorted(types.items()) if t == "Q6_K"] == six
        assert {t for i, t in types.items() if i not in six} == {"Q4_K"}
    assert set(_types(spec, "Q4_K_M", "attn_q.").values()) == {"Q4_K"}


def test_q3_k_m_counters():
    spec = model_spec("llama-3.1-8b")
    attn_v = _types(spec, "Q3_K_M", "attn_v")
    assert [attn_v[i] for i in range(4)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]  # i_attention_wv < 2
    ffn_down = _types(spec, "Q3_K_M", "ffn_down")
    assert [ffn_down[i] for i in range(3)] == ["Q5_K", "Q5_K", "Q4_K"]  # i_layer < 32/16
    assert set(_types(spec, "Q3_K_M", "attn_output").values()) == {"Q4_K"}


def test_q4_k_s_and_iq4_xs_first_layers():
    spec = model_spec("llama-3.1-8b")
    attn_v = _types(spec, "Q4_K_S", "attn_v")
    assert [attn_v[i] for i in (0, 3, 4)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert set(_types(spec, "IQ4_XS", "attn_v").values()) == {"Q5_K"}  # n_gqa = 4
    down = _types(spec, "IQ4_XS", "ffn_down")
    assert [down[i] for i in (3, 4)] == ["Q5_K", "IQ4_XS"]
    assert set(_types(spec, "IQ4_XS", "ffn_down", imatrix=True).values()) == {"IQ4_XS"}


def test_q2_k_gqa_condition():
    assert set(_types(model_spec("llama-3.1-8b"), "Q2_K", "attn_v").values()) == {"Q4_K"}  # n_gqa 4
    assert set(_types(model_spec("llama-2-7b"), "Q2_K", "attn_v").values()) == {"Q3_K"}  # n_gqa 1


def test_80_layer_llama_and_qwen2_get_the_70b_attn_v_bump():
    for name in ("llama-3.1-70b", "qwen2.5-72b"):
        spec = model_spec(name)
        assert set(_types(spec, "Q4_K_M", "attn_v").values()) == {"Q5_K", "Q6_K"}
        assert set(_types(spec, "Q3_K_M", "attn_v").values()) == {"Q5_K"}


# ------------------------------------------------------------------ mixture of experts
def test_mixtral_eight_experts():
    spec = model_spec("mixtral-8x7b")
    tensors = {t.name: t for t in gguf_tensors(spec, "Q4_K_M")}
    assert tensors["blk.0.attn_v.weight"].ggml_type == "Q8_0"
    assert tensors["blk.0.attn_k.weight"].ggml_type == "Q8_0"
    assert tensors["blk.0.attn_output.weight"].ggml_type == "Q5_K"
    assert tensors["blk.0.ffn_gate_inp.weight"].ggml_type == "F32"
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (4096, 14336, 8)
    assert tensors["blk.0.ffn_down_exps.weight"].shape == (14336, 4096, 8)
    down = _types(spec, "Q4_K_M", "ffn_down_exps")
    assert [i for i, t in sorted(down.items()) if t == "Q6_K"] == [i for i in range(32) if use_more_bits(i, 32)]


def test_qwen3_moe_experts_are_split_and_router_stays_f32():
    spec = model_spec("qwen3-30b-a3b")
    tensors = {t.name: t for t in gguf_tensors(spec, "Q4_K_M")}
    gate, up = tensors["blk.7.ffn_gate_exps.weight"], tensors["blk.7.ffn_up_exps.weight"]
    assert gate.hf_name == up.hf_name == "model.layers.7.mlp.experts.gate_up_proj"
    assert gate.shape == up.shape == (2048, 768, 128)
    assert gate.nbytes == 128 * 768 * GGML_TYPES["Q4_K"].row_bytes(2048)
    router = tensors["blk.7.ffn_gate_inp.weight"]
    assert (router.ggml_type, router.shape, router.nbytes) == ("F32", (2048, 128), 2048 * 128 * 4)
    assert tensors["blk.0.attn_v.weight"].ggml_type == "Q6_K"  # 128 experts: no 8-expert rule


def test_deepseek_v3_mla_shared_experts_and_dense_layers():
    spec = model_spec("deepseek-v3")
    tensors = {t.name: t for t in gguf_tensors(spec, "Q4_K_M")}
    k_b, v_b = tensors["blk.5.attn_k_b.weight"], tensors["blk.5.attn_v_b.weight"]
    assert k_b.shape == (128, 512, 128) and v_b.shape == (512, 128, 128)
    assert k_b.ggml_type == "Q5_0"  # rows of qk_nope_head_dim 128: Q4_K -> Q5_0
    assert v_b.ggml_type == "Q4_K"
    assert tensors["blk.5.exp_probs_b.bias"].ggml_type == "F32"
    assert tensors["blk.0.ffn_down.weight"].ggml_type == "Q6_K"  # dense layer 0, use_more_bits
    assert tensors["blk.3.ffn_down_shexp.weight"].ggml_type == "Q6_K"  # layer from the name: 3 < 61/8
    assert tensors["blk.3.ffn_down_exps.weight"].shape == (2048, 7168, 256)
    assert not any(t.layer == 61 for t in tensors.values())  # the MTP layer is skipped by convert
    assert not any("attn_kv_b" in n for n in tensors)


def test_phi3_fused_qkv_counts_as_attn_v():
    spec = model_spec("phi-3-mini-4k-instruct")
    qkv = _types(spec, "Q4_K_M", "attn_qkv")
    assert [i for i, t in sorted(qkv.items()) if t == "Q6_K"] == [i for i in range(32) if use_more_bits(i, 32)]
    up = next(t for t in gguf_tensors(spec, "Q4_K_M") if t.name == "blk.0.ffn_up.weight")
    assert up.shape == (3072, 16384) and up.hf_name == "model.layers.0.mlp.gate_up_proj.weight"


def test_gemma_tied_embedding_gets_the_output_rule():
    spec = model_spec("gemma-2-2b")
    tensors = {t.name: t for t in gguf_tensors(spec, "Q4_K_M")}
    assert "output.weight" not in tensors and tensors["token_embd.weight"].ggml_type == "Q6_K"
    assert {"blk.0.post_attention_norm.weight", "blk.0.ffn_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(tensors)


def test_f16_file_keeps_router_norms_and_biases_f32():
    spec = model_spec("qwen3-30b-a3b")
    types = {t.name: t.ggml_type for t in gguf_tensors(spec, "F16")}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ffn_up_exps.weight"] == "F16" and types["output.weight"] == "F16"


def test_unmapped_tensor_is_named_in_the_error():
    spec = _tiny()
    from dataclasses import replace

    from vramplan.planner.modelspec import Kind, Role, TensorSpec
    odd = TensorSpec(name="model.layers.0.mlp.mystery.weight", shape=(4, 4), role=Role.MLP, kind=Kind.LINEAR, layer=0)
    with pytest.raises(UnsupportedArchitectureError, match="model.layers.0.mlp.mystery.weight"):
        gguf_tensors(replace(spec, tensors=spec.tensors + (odd,)), "Q4_K_M")


# ------------------------------------------------------------------ bytes, layers, file
def test_llama_31_8b_q4_k_m_non_layer_split():
    parts = gguf_non_layer_bytes(model_spec("llama-3.1-8b"), "Q4_K_M")
    assert parts.token_embd_bytes == 128256 * 16 * 144  # Q4_K
    assert parts.output_bytes == 128256 * 16 * 210  # Q6_K
    assert parts.output_norm_bytes == 4096 * 4
    assert parts.other_bytes == 64 * 4  # rope_freqs: head_dim / 2 F32 factors


def test_layers_and_non_layer_bytes_add_up_to_the_tensor_data():
    spec = model_spec("qwen3-30b-a3b")
    size = gguf_file_size(spec, "Q4_K_M")
    assert sum(gguf_layer_bytes(spec, "Q4_K_M")) + gguf_non_layer_bytes(spec, "Q4_K_M").total_bytes \
        == size.tensor_data_bytes
    assert size.file_bytes == size.header_bytes + size.tensor_data_bytes + size.padding_bytes
    assert size.header_bytes % gguf.GGUF_ALIGNMENT == 0


def test_tensor_info_bytes_follow_gguf_write_out():
    t = gguf.GGUFTensor(name="blk.0.attn_q.weight", hf_name=None, ggml_type="Q4_K", shape=(4096, 4096),
                        nbytes=0, layer=0)
    # name (u64 length + 19 bytes), n_dims u32, two i64 dims, type i32, offset u64
    assert tensor_info_bytes((t,)) == 8 + 19 + 4 + 16 + 4 + 8


def test_metadata_estimate_uses_the_tokenizer_family():
    assert gguf.tokenizer_family(model_spec("llama-3.1-8b")) == "llama3-bpe"
    assert gguf.tokenizer_family(model_spec("qwen2.5-7b")) == "bpe"
    assert gguf.tokenizer_family(model_spec("llama-2-7b")) == "spm"
    assert gguf.metadata_bytes_estimate(model_spec("llama-2-7b")) == \
        round(32000 * gguf.TOKENIZER_BYTES_PER_TOKEN["spm"]) + gguf.MODEL_METADATA_BYTES


# ------------------------------------------------------------------ published files (exact byte counts)
PUBLISHED = [
    # bartowski/Meta-Llama-3.1-8B-Instruct-GGUF @ bf5b95e96dac0462e2a09145ec66cae9a3f12067,
    # sha256 7b064f5842bf9532c91456deda288a1b672397a54fa729aa665952863033557c: 4,920,739,232 bytes
    # (pinned with that sha256 and revision in several public repositories, e.g. a test asserting
    # {"filename": "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "size": 4920739232}).
    ("llama-3.1-8b", "Q4_K_M", 4_920_739_232),
    # Qwen/Qwen2.5-7B-Instruct-GGUF @ bb5d59e06d9551d752d08b292a50eb208b07ab1f, split in two:
    # qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf 3,993,201,344 B (sha256 dfce12e3...)
    # + -00002-of-00002.gguf 689,872,288 B (sha256 539cf93f...); the second part's own header
    # (split keys, 24-byte preamble) is a few hundred bytes more than one file would have.
    ("qwen2.5-7b", "Q4_K_M", 3_993_201_344 + 689_872_288),
    # Qwen/Qwen3-30B-A3B-GGUF @ dae61f032d7880e6effe712505db4de5d06d6549, Qwen3-30B-A3B-Q4_K_M.gguf,
    # sha256 0d003f6662faee786ed5da3e31b29c978de5ae5d275c8794c606a7f3c01aa8f5: 18,556,685,824 bytes.
    ("qwen3-30b-a3b", "Q4_K_M", 18_556_685_824),
    # Qwen/Qwen3-30B-A3B-GGUF @ e4d4bafdfb96a411a163846265362aceb0b9c63a, Qwen3-30B-A3B-Q8_0.gguf,
    # sha256 4ad960d180b16f56024f5b704697e5dd5b0837167c2e515ef0569abfc599743c: 32,483,931,648 bytes.
    ("qwen3-30b-a3b", "Q8_0", 32_483_931_648),
    # Qwen/Qwen3-8B-GGUF, Qwen3-8B-Q4_K_M.gguf: 5,027,783,488 bytes (a model catalog pinning the file).
    ("qwen3-8b", "Q4_K_M", 5_027_783_488),
    # GPT4All's model list: Meta-Llama-3.1-8B-Instruct-128k-Q4_0.gguf, md5 8a9c75bcd8a66b7693f158ec96924eeb,
    # "filesize": "4661212096".
    ("llama-3.1-8b", "Q4_0", 4_661_212_096),
    # bartowski/Qwen2.5-0.5B-Instruct-GGUF, Qwen2.5-0.5B-Instruct-Q4_K_M.gguf: 397,808,192 bytes
    # (hidden 896: most tensors take the fallback types; tied embedding).
    ("qwen2.5-0.5b", "Q4_K_M", 397_808_192),
]
# The bar is 1 %; these files come within 0.002 %, so 0.1 % still leaves room for the metadata estimate.
PUBLISHED_TOLERANCE = 0.001


@pytest.mark.parametrize("model,file_type,published_bytes", PUBLISHED)
def test_file_bytes_match_published_gguf_files(model, file_type, published_bytes):
    ours = gguf_file_bytes(model_spec(model), file_type)
    assert abs(ours - published_bytes) / published_bytes < PUBLISHED_TOLERANCE, (ours, published_bytes)


def test_qwen_official_small_gguf_carries_a_separate_output_tensor():
    """Qwen/Qwen2.5-3B-Instruct-GGUF qwen2.5-3b-instruct-q4_k_m.gguf (sha256 626b4a66...): 2,104,932,768 bytes.

    Qwen2.5-3B ties its embeddings, yet Qwen's file is 175 MB larger than a tied conversion: it
    holds an output.weight of its own (Q6_K) and so a Q4_K token_embd. Planned untied, it matches.
    """
    config = dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768)
    published = 2_104_932_768
    untied = gguf_file_bytes(spec_from_config({**config, "tie_word_embeddings": False}), "Q4_K_M")
    tied = gguf_file_bytes(spec_from_config({**config, "tie_word_embeddings": True}), "Q4_K_M")
    assert abs(untied - published) / published < PUBLISHED_TOLERANCE
    # output.weight takes the Q6_K bytes the tied token_embd had; token_embd adds its Q4_K bytes
    assert published - tied == pytest.approx(151936 * 2048 * 4.5 / 8, rel=1e-4)


def test_llama_31_8b_q4_k_m_tensor_count_and_data():
    # The same file is described publicly as "292 tensors, 4685 MiB of tensor data".
    spec = model_spec("llama-3.1-8b")
    assert len(gguf_tensors(spec, "Q4_K_M")) == 292
    assert round(gguf_file_size(spec, "Q4_K_M").tensor_data_bytes / 2**20) == 4685


# ------------------------------------------------------------------ golden data from llama.cpp itself
GOLDEN_RUNS = [(case, ft) for case, data in GOLDEN["cases"].items() for ft in data["file_types"]]


@pytest.mark.parametrize("case,file_type", GOLDEN_RUNS)
def test_types_match_llama_quantize(case, file_type):
    data = GOLDEN["cases"][case]
    observed = data["file_types"][file_type]
    spec = spec_from_config(data["config"], name=case)
    ours = gguf_tensors(spec, file_type)
    assert [(t.name, list(t.shape)) for t in ours] == [tuple(x) for x in data["tensors"]]
    assert " ".join(t.ggml_type for t in ours) == observed["types"]
    assert sum(t.nbytes for t in ours) == observed["tensor_bytes"]
    size = gguf_file_size(spec, file_type)
    assert size.tensor_data_bytes + size.padding_bytes == observed["data_section_bytes"]


def test_golden_data_covers_every_file_type_and_the_rules():
    assert GOLDEN["llama_cpp_commit"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    for name, data in GOLDEN["cases"].items():
        # A checkpoint storing its experts MXFP4: llama.cpp writes convert's F16 file and llama-quantize's MXFP4_MOE
        # from it; every other file type it refuses ("requantizing from type mxfp4 is disabled"), and planner/gguf.py
        # keeps those experts MXFP4 there as the published gpt-oss files do.
        expected = {"F16", "MXFP4_MOE"} if name == "gpt_oss_mxfp4" else set(GGUF_FILE_TYPES)
        assert set(data["file_types"]) == expected, name
    all_types = {t for data in GOLDEN["cases"].values() for o in data["file_types"].values()
                 for t in o["types"].split()}
    assert {"Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "F16", "Q3_K", "Q6_K"} <= all_types  # fallbacks and bumps seen
    assert {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4"} <= all_types


# ------------------------------------------------------------------ purity
def test_gguf_module_imports_only_stdlib_and_planner():
    tree = ast.parse(Path(gguf.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names), imported


@pytest.mark.parametrize("file_type", ["Q4_K_M", "IQ2_XXS", "Q8_0", "MXFP4_MOE", "Q3_K_M"])
@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v3", "gemma-3-27b-it"])
def test_sums_without_records_are_the_tensors_sums(model, file_type):
    """The planner's fast path (bytes per kind of layer from each group's row bytes, no GGUFTensor records) sums
    what gguf_tensors lists: per layer, the routed experts' per layer, and each tensor outside the layers."""
    from vramplan.planner.sources import model_spec

    spec = model_spec(model)
    gguf.forget_tensors()
    sums = gguf.gguf_sums(spec, file_type)
    tensors = gguf.gguf_tensors(spec, file_type)
    layers, experts = [0] * spec.num_layers, [0] * spec.num_layers
    for t in tensors:
        if t.layer is not None:
            layers[t.layer] += t.nbytes
            experts[t.layer] += t.nbytes if "_exps." in t.name else 0
    assert sums.layers == tuple(layers) and sums.experts == tuple(experts)
    assert sums.outside == tuple((t.name, t.nbytes) for t in tensors if t.layer is None)
    if file_type in ("Q4_K_M", "Q3_K_M"):
        assert len(set(sums.layers)) > 1  # use_more_bits: the layers' types differ there


@pytest.mark.parametrize("file_type", ["Q4_K_M", "IQ2_XXS", "F16"])
def test_file_size_without_records_is_the_records_size(file_type):
    """gguf_file_size sums the tensors gguf_tensors lists (data, alignment padding, tensor infos)."""
    from vramplan.planner.sources import model_spec

    spec = model_spec("qwen3-30b-a3b")
    tensors = gguf.gguf_tensors(spec, file_type)
    size = gguf.gguf_file_size(spec, file_type)
    assert size.tensor_data_bytes == sum(t.nbytes for t in tensors)
    assert size.padding_bytes == sum(-(-t.nbytes // 32) * 32 - t.nbytes for t in tensors)
    meta = gguf.metadata_bytes_estimate(spec)
    assert size.header_bytes == -(-(gguf.GGUF_HEADER_BYTES + meta + gguf.tensor_info_bytes(tensors)) // 32) * 32


def _grouped_types(spec, inv, ft, imatrix) -> list[str]:
    """Each tensor's type as the planner takes it: its group's."""
    types = gguf._select_group_types(spec, inv, ft, imatrix)
    return [types[g] for g in inv.group_of]


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-72B",
                                   "mistralai/Mixtral-8x7B-v0.1", "deepseek-ai/DeepSeek-V3", "openai/gpt-oss-20b",
                                   "google/gemma-3-27b-it", "Qwen/Qwen3-30B-A3B", "microsoft/Phi-3-mini-4k-instruct",
                                   "meta-llama/Llama-3.2-1B", "google/gemma-2-2b"])
def test_types_by_group_equal_the_tensor_by_tensor_walk(model):
    """gguf._select_group_types types each group of alike tensors once (_alike); every file type, with and without an
    imatrix, gives each tensor the type llama-quantize's walk gives it (_select_types_each, the rules in their order)
    and refuses the same files. The whole catalog agreed when this was written."""
    spec = model_spec(model)
    inv = gguf._inventory(spec)
    assert len(inv.firsts) < len(inv.sources) // 4  # the grouping is worth its while
    for name in gguf.GGUF_FILE_TYPES:
        ft = gguf.gguf_file_type(name)
        for imatrix in (False, True):
            outcomes = []
            for select in (gguf._select_types_each, _grouped_types):
                try:
                    outcomes.append(select(spec, inv, ft, imatrix))
                except PlanError as err:
                    outcomes.append(str(err))
            assert outcomes[0] == outcomes[1], (model, name, imatrix)
