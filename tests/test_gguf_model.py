"""planner/gguf_model.py: a GGUF file read back as the model it holds.

Files are written by gguf-py's GGUFWriter (llama.cpp's own writer) into tmp_path: tensors named as convert_hf_to_gguf.py
names them (written out by hand here, not taken from planner/gguf.py), Q8_0 / Q4_0 data quantized by gguf-py itself,
the K-quant and IQ types (which gguf-py cannot quantize) as raw bytes of the type's block size. Expected bytes come from
gguf-py's GGML_QUANT_SIZES, not from the planner's table."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # noqa: E402 - gguf-py writes the files
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from vramplan.planner.architectures import BUILDERS, spec_from_config  # noqa: E402
from vramplan.planner.errors import CheckpointError, UnsupportedArchitectureError, VramplanError  # noqa: E402
from vramplan.planner.gguf import GGUF_ARCHITECTURES, GGUF_FILE_TYPES  # noqa: E402
from vramplan.planner.gguf_model import (  # noqa: E402
    GGUF_MODEL_TYPES, gguf_split_paths, layer_bytes, load_gguf_model, read_gguf_model)

# ------------------------------------------------------------------ the models (HF config.json dicts)
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=2048, rope_theta=500000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False)
QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=256, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                 num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps",
              "tie_word_embeddings")


def llama_tensors(c: dict, types: dict[str, str] | None = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, ggml type, ne) of a llama as convert_hf_to_gguf.py writes it; ne is ggml order (row length
    first). `types`: the type of a name fragment ("attn_q": "Q8_0"), F32 for 1-D tensors, Q8_0 for the rest."""
    h, v = c["hidden_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = [("token_embd.weight", (h, v))]
    for n in range(c["num_hidden_layers"]):
        b = f"blk.{n}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, q)), (b + "attn_k.weight", (h, kv)),
                (b + "attn_v.weight", (h, kv)), (b + "attn_output.weight", (q, h)), (b + "ffn_norm.weight", (h,))]
        out += _ffn(c, b)
    out.append(("output_norm.weight", (h,)))
    if not c.get("tie_word_embeddings"):
        out.append(("output.weight", (h, v)))
    types = types or {}

    def type_of(name: str, ne: tuple[int, ...]) -> str:
        if len(ne) == 1 or "ffn_gate_inp" in name:
            return "F32"
        return next((t for frag, t in types.items() if frag in name), "Q8_0")
    return [(name, type_of(name, ne), ne) for name, ne in out]


def _ffn(c: dict, b: str) -> list:
    h = c["hidden_size"]
    if "num_experts" in c:  # Qwen3-MoE: q/k norms, a router and the experts as 3-D tensors
        e, w = c["num_experts"], c["moe_intermediate_size"]
        return [(b + "attn_q_norm.weight", (c["head_dim"],)), (b + "attn_k_norm.weight", (c["head_dim"],)),
                (b + "ffn_gate_inp.weight", (h, e)), (b + "ffn_gate_exps.weight", (h, w, e)),
                (b + "ffn_up_exps.weight", (h, w, e)), (b + "ffn_down_exps.weight", (w, h, e))]
    i = c["intermediate_size"]
    return [(b + "ffn_gate.weight", (h, i)), (b + "ffn_up.weight", (h, i)), (b + "ffn_down.weight", (i, h))]


def nbytes(ggml_type: str, ne: tuple[int, ...]) -> int:
    """ggml_nbytes by gguf-py's own block sizes."""
    block, size = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, ggml_type)]
    return int(np.prod(ne[1:], dtype=np.int64)) * (ne[0] // block) * size


def metadata(arch: str, c: dict, file_type: str | None = "Q8_0") -> list:
    """The keys convert_hf_to_gguf.py writes for the config (GGUFWriter method, value)."""
    meta = [("add_block_count", c["num_hidden_layers"]), ("add_context_length", c["max_position_embeddings"]),
            ("add_embedding_length", c["hidden_size"]), ("add_feed_forward_length", c["intermediate_size"]),
            ("add_head_count", c["num_attention_heads"]), ("add_head_count_kv", c["num_key_value_heads"]),
            ("add_rope_freq_base", c["rope_theta"]), ("add_layer_norm_rms_eps", c["rms_norm_eps"]),
            ("add_key_length", c["head_dim"]), ("add_value_length", c["head_dim"]),
            ("add_token_list", [f"t{i}" for i in range(c["vocab_size"])])]
    if file_type is not None:
        meta.append(("add_file_type", GGUF_FILE_TYPES[file_type].ftype_id))
    if "num_experts" in c:
        meta += [("add_expert_count", c["num_experts"]), ("add_expert_used_count", c["num_experts_per_tok"]),
                 ("add_expert_feed_forward_length", c["moe_intermediate_size"])]
    return meta


def _data(ggml_type: str, ne: tuple[int, ...], rng) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """Real data: floats, gguf-py's own Q8_0 / Q4_0 quantization, else raw bytes of the type's size."""
    shape = tuple(reversed(ne))
    values = rng.standard_normal(shape).astype(np.float32)
    if ggml_type == "F32":
        return values, None
    if ggml_type == "F16":
        return values.astype(np.float16), None
    qtype = getattr(GGMLQuantizationType, ggml_type)
    if ggml_type in ("Q8_0", "Q4_0"):
        return gguf.quants.quantize(values, qtype), qtype
    block, size = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, (*shape[:-1], ne[0] // block * size), dtype=np.uint8), qtype


def write_gguf(path, arch: str, tensors, meta=(), *, split: tuple[int, int, int] | None = None) -> None:
    """A GGUF file by GGUFWriter; `split`: (split.no, split.count, split.tensors.count) as gguf-split writes them."""
    w = gguf.GGUFWriter(str(path), arch)
    if split is not None:
        w.add_uint16("split.no", split[0])
        w.add_uint16("split.count", split[1])
        w.add_int32("split.tensors.count", split[2])
    for method, value in meta:
        getattr(w, method)(value)
    rng = np.random.default_rng(0)
    for name, ggml_type, ne in tensors:
        data, raw = _data(ggml_type, ne, rng)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Q4_K_M-like mixture: attn_v and ffn_down in a K-quant of 256-element rows where the rows allow it.
Q4_K_M_TYPES = {"ffn_down": "Q6_K", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_output": "Q4_0", "ffn_gate": "Q4_0",
                "ffn_up": "Q4_0", "token_embd": "Q4_0", "output.weight": "Q6_K"}


def _q4_k_m(c):
    """llama's tensors with Q4_K_M's kinds of types; output (rows of 64) falls back to Q8_0 as llama-quantize's
    tensor_type_fallback would."""
    return [(n, "Q8_0" if n == "output.weight" else t, ne) for n, t, ne in llama_tensors(c, Q4_K_M_TYPES)]


# ------------------------------------------------------------------ a tiny llama
def test_a_quantized_llama_rebuilds_its_config_and_counts_its_own_bytes(tmp_path):
    path = tmp_path / "tiny-llama-Q4_K_M.gguf"
    tensors = _q4_k_m(LLAMA)
    write_gguf(path, "llama", tensors, metadata("llama", LLAMA, "Q4_K_M"))
    m = load_gguf_model(path)
    assert (m.architecture, m.model_type, m.file_type, m.splits) == ("llama", "llama", "Q4_K_M", 1)
    assert {k: m.config[k] for k in SHAPE_KEYS} == {k: LLAMA[k] for k in SHAPE_KEYS}
    assert m.path_name == path.name and m.file_bytes == os.path.getsize(path)
    assert [(t.name, t.ggml_type, t.shape) for t in m.tensors] == tensors
    assert m.tensor_bytes == sum(nbytes(t, ne) for _, t, ne in tensors)
    assert {t.name: t.nbytes for t in m.tensors} == {n: nbytes(t, ne) for n, t, ne in tensors}
    assert {t.ggml_type for t in m.tensors} == {"Q4_0", "Q6_K", "Q8_0", "F32"}
    # the rebuilt config gives the same model the original config does, tensor for tensor
    original, rebuilt = spec_from_config(LLAMA, name="a"), spec_from_config(m.config, name="a")
    assert [(t.name, t.shape) for t in rebuilt.tensors] == [(t.name, t.shape) for t in original.tensors]
    assert rebuilt.attention == original.attention
    by_name = {t.name: t for t in m.tensors}
    assert by_name["blk.1.attn_q.weight"].hf_name == "model.layers.1.self_attn.q_proj.weight"
    assert by_name["blk.1.attn_q.weight"].layer == 1 and by_name["output.weight"].layer is None
    assert any("llama.block_count=2" in n for n in m.notes)


def test_layer_bytes_split_the_file_by_decoder_layer(tmp_path):
    path = tmp_path / "tiny.gguf"
    tensors = _q4_k_m(LLAMA)
    write_gguf(path, "llama", tensors, metadata("llama", LLAMA, "Q4_K_M"))
    per = layer_bytes(load_gguf_model(path))
    assert set(per) == {None, 0, 1}
    for layer in (0, 1):
        assert per[layer] == sum(nbytes(t, ne) for n, t, ne in tensors if n.startswith(f"blk.{layer}."))
    assert per[None] == sum(nbytes(t, ne) for n, t, ne in tensors if not n.startswith("blk."))
    assert sum(per.values()) == load_gguf_model(path).tensor_bytes


def test_tied_embeddings_are_a_file_without_output_weight(tmp_path):
    c = {**LLAMA, "tie_word_embeddings": True}
    path = tmp_path / "tied.gguf"
    write_gguf(path, "llama", llama_tensors(c), metadata("llama", c, "Q8_0"))
    m = load_gguf_model(path)
    assert m.config["tie_word_embeddings"] is True and "output.weight" not in {t.name for t in m.tensors}
    assert spec_from_config(m.config).tie_word_embeddings
    assert any("tied embeddings" in n for n in m.notes)


def test_an_unquantized_file_says_its_dtype_and_a_quantized_one_does_not(tmp_path):
    path = tmp_path / "f16.gguf"
    write_gguf(path, "llama", llama_tensors(LLAMA, {"": "F16"}), metadata("llama", LLAMA, "F16"))
    m = load_gguf_model(path)
    assert m.file_type == "F16" and m.config["torch_dtype"] == "float16"
    path = tmp_path / "nofiletype.gguf"
    write_gguf(path, "llama", llama_tensors(LLAMA), metadata("llama", LLAMA, None))
    m = load_gguf_model(path)
    assert m.file_type is None and "torch_dtype" not in m.config


def test_low_bit_iq_types_are_counted_as_stored(tmp_path):
    """IQ2_XXS (256-element blocks of 66 bytes) where rows allow, as an IQ2_XXS file holds it."""
    path = tmp_path / "tiny-IQ2_XXS.gguf"
    tensors = llama_tensors(LLAMA, {"ffn_down": "IQ2_XXS", "token_embd": "Q4_0"})
    write_gguf(path, "llama", tensors, metadata("llama", LLAMA, "IQ2_XXS"))
    m = load_gguf_model(path)
    assert m.file_type == "IQ2_XXS"
    down = next(t for t in m.tensors if t.name == "blk.0.ffn_down.weight")
    assert (down.ggml_type, down.nbytes) == ("IQ2_XXS", 64 * 66)
    assert m.tensor_bytes == sum(nbytes(t, ne) for _, t, ne in tensors)


# ------------------------------------------------------------------ a tiny Qwen3-MoE
def test_a_qwen3_moe_rebuilds_its_experts(tmp_path):
    path = tmp_path / "tiny-qwen3moe.gguf"
    tensors = llama_tensors(QWEN3_MOE)
    write_gguf(path, "qwen3moe", tensors, metadata("qwen3moe", QWEN3_MOE))
    m = load_gguf_model(path)
    assert (m.architecture, m.model_type) == ("qwen3moe", "qwen3_moe")
    for key in (*SHAPE_KEYS, "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        assert m.config[key] == QWEN3_MOE[key], key
    spec = spec_from_config(m.config)
    assert [(t.name, t.shape) for t in spec.tensors] == [(t.name, t.shape) for t in spec_from_config(QWEN3_MOE).tensors]
    assert spec.moe.num_experts == 4 and spec.moe.moe_layers == (0, 1)
    assert m.tensor_bytes == sum(nbytes(t, ne) for _, t, ne in tensors)
    exps = next(t for t in m.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert exps.shape == (64, 32, 4) and exps.hf_name == "model.layers.0.mlp.experts.gate_up_proj"


# ------------------------------------------------------------------ split files
def _write_split(tmp_path, prefix: str = "tiny") -> tuple[list, list]:
    """The tiny llama in two parts as gguf-split writes them: the metadata in the first."""
    tensors = _q4_k_m(LLAMA)
    half = len(tensors) // 2
    paths = [tmp_path / f"{prefix}-0000{i}-of-00002.gguf" for i in (1, 2)]
    write_gguf(paths[0], "llama", tensors[:half], metadata("llama", LLAMA, "Q4_K_M"), split=(0, 2, len(tensors)))
    write_gguf(paths[1], "llama", tensors[half:], split=(1, 2, len(tensors)))
    return paths, tensors


def test_a_split_file_is_found_from_any_part_and_read_whole(tmp_path):
    paths, tensors = _write_split(tmp_path)
    assert gguf_split_paths(str(paths[1])) == [str(p) for p in paths]
    assert gguf_split_paths(str(tmp_path / "plain.gguf")) == [str(tmp_path / "plain.gguf")]
    m = load_gguf_model(paths[0])
    assert m.splits == 2 and m.file_bytes == sum(os.path.getsize(p) for p in paths)
    assert [t.name for t in m.tensors] == [n for n, _, _ in tensors]
    assert m.tensor_bytes == sum(nbytes(t, ne) for _, t, ne in tensors)
    assert {k: m.config[k] for k in SHAPE_KEYS} == {k: LLAMA[k] for k in SHAPE_KEYS}


def test_a_missing_split_part_is_named(tmp_path):
    paths, _ = _write_split(tmp_path)
    paths[1].unlink()
    with pytest.raises(CheckpointError) as e:
        gguf_split_paths(str(paths[0]))
    _one_line(e, str(paths[1]))


def test_parts_given_wrongly_are_refused(tmp_path):
    paths, _ = _write_split(tmp_path)
    with pytest.raises(CheckpointError) as e:  # the first part alone: split.count says 2
        read_gguf_model([paths[0]], str(paths[0]))
    _one_line(e, "split into 2 files")
    with pytest.raises(CheckpointError) as e:  # out of order
        read_gguf_model([paths[1], paths[0]], str(paths[0]))
    _one_line(e, "expected part 1 of 2")


# ------------------------------------------------------------------ refusals
def _one_line(excinfo, *fragments: str) -> None:
    text = str(excinfo.value)
    assert "\n" not in text and text, text
    for f in fragments:
        assert f in text, (f, text)


def test_an_unsupported_architecture_names_itself_and_the_supported_ones(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, "mamba", llama_tensors(LLAMA), metadata("mamba", LLAMA))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_gguf_model(path)
    _one_line(e, "'mamba'", "llama", "qwen3moe", "deepseek2")


def test_a_truncated_file_is_one_line(tmp_path):
    path = tmp_path / "cut.gguf"
    write_gguf(path, "llama", llama_tensors(LLAMA), metadata("llama", LLAMA))
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError) as e:
        load_gguf_model(path)
    _one_line(e, str(path), "truncated")


def test_tensors_unlike_the_metadata_are_refused(tmp_path):
    path = tmp_path / "wrong.gguf"
    c = {**LLAMA, "num_key_value_heads": 4}  # the tensors of 4 kv heads, the metadata says 2
    write_gguf(path, "llama", llama_tensors(c), metadata("llama", LLAMA))
    with pytest.raises(CheckpointError) as e:
        load_gguf_model(path)
    _one_line(e, "blk.0.attn_k.weight", "[64, 64]", "[64, 32]")
    path = tmp_path / "extra.gguf"
    write_gguf(path, "llama", [*llama_tensors(LLAMA), ("blk.0.mystery.weight", "F32", (64,))], metadata("llama", LLAMA))
    with pytest.raises(CheckpointError) as e:
        load_gguf_model(path)
    _one_line(e, "blk.0.mystery.weight")


def test_missing_shape_metadata_is_named(tmp_path):
    path = tmp_path / "nometa.gguf"
    write_gguf(path, "llama", llama_tensors(LLAMA), [m for m in metadata("llama", LLAMA) if m[0] != "add_head_count"])
    with pytest.raises(CheckpointError) as e:
        load_gguf_model(path)
    _one_line(e, "llama.attention.head_count")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    outcome: list = []

    def attempt() -> None:
        try:
            load_gguf_model(fifo)
        except VramplanError as e:
            outcome.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert outcome and isinstance(outcome[0], CheckpointError)
    assert "FIFO" in str(outcome[0]) and "\n" not in str(outcome[0])
    split_fifo = tmp_path / "x-00002-of-00002.gguf"
    os.mkfifo(split_fifo)
    (tmp_path / "x-00001-of-00002.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError) as e:
        gguf_split_paths(str(tmp_path / "x-00001-of-00002.gguf"))
    _one_line(e, str(split_fifo), "FIFO")


def test_bytes_read_elsewhere_come_in_as_read_callbacks(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", llama_tensors(LLAMA), metadata("llama", LLAMA))
    data = path.read_bytes()
    m = read_gguf_model([(lambda offset, n: data[offset:offset + n], len(data), "hub:tiny.gguf")], "hub:tiny.gguf")
    local = load_gguf_model(path)
    assert (m.config, m.tensors, m.file_bytes, m.path_name) == (local.config, local.tensors, len(data), "hub:tiny.gguf")


def test_every_mapped_architecture_is_one_planner_gguf_converts_back():
    """Each general.architecture maps to a model_type with a builder whose GGUF architecture is that one."""
    for arch, model_type in GGUF_MODEL_TYPES.items():
        assert model_type in BUILDERS and GGUF_ARCHITECTURES[model_type] == arch, arch


# ------------------------------------------------------------------ every architecture, round trip
# Tiny configs of each mapped model_type; the file's tensors are those planner/gguf.py names for the config (the tests
# above write llama's and Qwen3-MoE's by hand), the metadata what convert_hf_to_gguf.py writes for the config.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
ROUND_TRIP = {
    "llama": dict(head_dim=16, intermediate_size=128),
    "mistral": dict(intermediate_size=128, sliding_window=8),
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(intermediate_size=128, tie_word_embeddings=True),
    "qwen3": dict(head_dim=32, intermediate_size=128),
    "qwen3_moe": dict(head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, mlp_only_layers=[0]),
    "gemma2": dict(head_dim=32, intermediate_size=128, sliding_window=8, tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=32, intermediate_size=128, sliding_window=8, tie_word_embeddings=True),
    "phi3": dict(intermediate_size=128, sliding_window=8),
    "gpt_oss": dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
}


def convert_metadata(c: dict, arch: str) -> list:
    """The shape keys convert_hf_to_gguf.py writes for config `c` (TextModel.set_gguf_parameters and the
    architecture's own additions)."""
    meta = [("add_block_count", c["num_hidden_layers"]), ("add_context_length", c["max_position_embeddings"]),
            ("add_embedding_length", c["hidden_size"]), ("add_feed_forward_length", c["intermediate_size"]),
            ("add_head_count", c["num_attention_heads"]), ("add_head_count_kv", c["num_key_value_heads"]),
            ("add_rope_freq_base", c["rope_theta"]), ("add_layer_norm_rms_eps", c["rms_norm_eps"]),
            ("add_file_type", GGUF_FILE_TYPES["F16"].ftype_id)]
    if "head_dim" in c:
        meta += [("add_key_length", c["head_dim"]), ("add_value_length", c["head_dim"])]
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    if experts:
        meta += [("add_expert_count", experts), ("add_expert_used_count", c["num_experts_per_tok"]),
                 ("add_expert_feed_forward_length", c.get("moe_intermediate_size") or c["intermediate_size"])]
    if arch in ("gemma2", "gemma3", "gpt-oss", "phi3"):
        meta.append(("add_sliding_window", c.get("sliding_window") or 0))
    if arch == "phi3":
        meta.append(("add_rope_dimension_count", c["hidden_size"] // c["num_attention_heads"]))
    if arch == "deepseek2":  # conversion/deepseek.py: MLA written as MQA
        rope, kv = c["qk_rope_head_dim"], c["kv_lora_rank"]
        meta = [m for m in meta if m[0] != "add_head_count_kv"]
        meta += [("add_head_count_kv", 1), ("add_key_length", kv + rope), ("add_value_length", kv),
                 ("add_key_length_mla", c["qk_nope_head_dim"] + rope), ("add_value_length_mla", c["v_head_dim"]),
                 ("add_rope_dimension_count", rope), ("add_q_lora_rank", c["q_lora_rank"]), ("add_kv_lora_rank", kv),
                 ("add_leading_dense_block_count", c["first_k_dense_replace"]),
                 ("add_expert_shared_count", c["n_shared_experts"])]
    return meta


@pytest.mark.parametrize("model_type", sorted(ROUND_TRIP))
def test_every_architecture_round_trips_through_a_gguf_file(tmp_path, model_type):
    from vramplan.planner.gguf import gguf_tensors

    c = {"model_type": model_type, **TINY, **ROUND_TRIP[model_type]}
    spec = spec_from_config(c, name="tiny")
    arch = GGUF_ARCHITECTURES[model_type]
    tensors = [(t.name, t.ggml_type, t.shape) for t in gguf_tensors(spec, "F16")]
    path = tmp_path / f"{model_type}.gguf"
    write_gguf(path, arch, tensors, convert_metadata(c, arch))
    m = load_gguf_model(path)
    expected_type = "llama" if model_type == "mistral" else model_type
    assert (m.architecture, m.model_type, m.file_type) == (arch, expected_type, "F16")
    rebuilt = spec_from_config(m.config, name="tiny")
    assert [(t.name, t.shape) for t in rebuilt.tensors] == [(t.name, t.shape) for t in spec.tensors]
    if model_type != "mistral":  # convert writes no window for llama-architecture files: llama.cpp attends to all
        assert rebuilt.attention == spec.attention
    assert (rebuilt.moe is None) == (spec.moe is None) and (not spec.moe or rebuilt.moe == spec.moe)
    assert m.tensor_bytes == sum(nbytes(t, ne) for _, t, ne in tensors)


def test_an_older_deepseek_file_keeps_kv_b_whole(tmp_path):
    """Before llama.cpp wrote MLA as MQA, convert kept kv_b_proj whole (attn_kv_b) and wrote the per-head sizes in
    key_length / value_length with head_count_kv = heads."""
    from vramplan.planner.gguf import gguf_tensors

    c = {"model_type": "deepseek_v3", **TINY, **ROUND_TRIP["deepseek_v3"]}
    spec = spec_from_config(c, name="tiny")
    heads, rank = c["num_attention_heads"], c["kv_lora_rank"]
    tensors = []
    for t in gguf_tensors(spec, "F16"):
        if t.name.endswith("attn_k_b.weight"):
            tensors.append((t.name.replace("attn_k_b", "attn_kv_b"), "F16",
                            (rank, heads * (c["qk_nope_head_dim"] + c["v_head_dim"]))))
        elif not t.name.endswith("attn_v_b.weight"):
            tensors.append((t.name, t.ggml_type, t.shape))
    meta = [m for m in convert_metadata(c, "deepseek2")
            if m[0] not in ("add_head_count_kv", "add_key_length", "add_value_length", "add_key_length_mla",
                            "add_value_length_mla")]
    meta += [("add_head_count_kv", heads), ("add_key_length", c["qk_nope_head_dim"] + c["qk_rope_head_dim"]),
             ("add_value_length", c["v_head_dim"])]
    path = tmp_path / "old-deepseek.gguf"
    write_gguf(path, "deepseek2", tensors, meta)
    m = load_gguf_model(path)
    assert [(t.name, t.shape) for t in spec_from_config(m.config).tensors] == [(t.name, t.shape) for t in spec.tensors]
    kv_b = next(t for t in m.tensors if t.name == "blk.0.attn_kv_b.weight")
    assert kv_b.hf_name == "model.layers.0.self_attn.kv_b_proj.weight"
    assert m.tensor_bytes == sum(nbytes(t, ne) for _, t, ne in tensors)
