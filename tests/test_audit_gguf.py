"""Issue 36's GGUF findings: planner/gguf_file.py's header parser against gguf-py (llama.cpp's own Python reader and
writer), hostile headers refused in one line, non-regular files refused without blocking, and a GGUF file checked
against --model before anything starts.

Files are real: written by gguf-py's GGUFWriter (large ones sparse: the header written, the data a hole), or built by
hand with struct where a header must lie."""

from __future__ import annotations

import json
import os
import random
import stat
import struct
import threading

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # noqa: E402 - gguf-py writes and reads the reference files
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from cli_helpers import assert_one_line_error, isolate, run_cli  # noqa: E402
from conftest import run_profile, tiny_config_dict  # noqa: E402
from vramplan.planner.errors import CheckpointError  # noqa: E402
from vramplan.planner.gguf import GGML_TYPES, GGUF_ARCHITECTURES, GGUF_FILE_TYPES, gguf_tensors  # noqa: E402
from vramplan.planner.gguf_file import (  # noqa: E402
    ARRAY_HEAD_ITEMS, READ_CHUNK_BYTES, TENSOR_BYTES_TOLERANCE, GGUFArray, GGUFLongString, as_gguf_tensors,
    check_gguf_matches, parse_gguf_header)
from vramplan.planner.sources import model_spec  # noqa: E402
from vramplan.runtime.llamacpp_run import read_gguf  # noqa: E402

HW = run_profile()  # a CPU-only profile within this machine (what `run` takes), with fixed speed constants


# ------------------------------------------------------------------ writing GGUF files with gguf-py
def _byte_shape(ggml_type: str, ne: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 array shape GGUFWriter takes for raw data of this type and ggml shape: rows, then a row's bytes."""
    return (*reversed(ne[1:]), GGML_TYPES[ggml_type].row_bytes(ne[0]))


def write_gguf(path, arch: str, tensors, *, metadata=(), sparse: bool = False, alignment: int | None = None) -> None:
    """A GGUF file by gguf-py's GGUFWriter: `tensors` (name, ggml type, ne) as raw bytes of the type's block layout
    (zeros), `metadata` calls (GGUFWriter method, *arguments). `sparse`: the header only, the data a hole of its
    size."""
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for method, *args in metadata:
        getattr(w, method)(*args)
    data_bytes = 0
    for name, ggml_type, ne in tensors:
        shape = _byte_shape(ggml_type, ne)
        raw = getattr(GGMLQuantizationType, ggml_type)
        nbytes = int(np.prod(shape))
        if sparse:
            w.add_tensor_info(name, shape, np.dtype(np.uint8), nbytes, raw_dtype=raw)
        else:
            w.add_tensor(name, np.zeros(shape, np.uint8), raw_shape=shape, raw_dtype=raw)
        data_bytes += -(-nbytes // w.data_alignment) * w.data_alignment
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if sparse:
        w.write_ti_data_to_file()
        w.close()
        header = os.path.getsize(path)
        os.truncate(path, -(-header // w.data_alignment) * w.data_alignment + data_bytes)
    else:
        w.write_tensors_to_file()
        w.close()


def model_metadata(spec, file_type: str, **overrides) -> dict:
    """What convert_hf_to_gguf.py writes about a model's shape (and a small tokenizer)."""
    a = spec.attention[0]
    meta = {"block_count": ("add_block_count", spec.num_layers),
            "embedding_length": ("add_embedding_length", spec.hidden_size),
            "feed_forward_length": ("add_feed_forward_length", spec.intermediate_size),
            "head_count": ("add_head_count", a.num_heads), "head_count_kv": ("add_head_count_kv", a.num_kv_heads),
            "context_length": ("add_context_length", spec.max_context or 4096),
            "file_type": ("add_file_type", GGUF_FILE_TYPES[file_type].ftype_id),
            "tokens": ("add_token_list", [f"t{i}" for i in range(spec.vocab_size)])}
    meta.update(overrides)
    return meta


def write_model_gguf(path, spec, file_type: str, *, sparse: bool = False, tensors=None, arch: str | None = None,
                     **metadata) -> list:
    """The GGUF file llama-quantize writes for `spec` at `file_type` as planner/gguf.py predicts it (or `tensors`),
    written by GGUFWriter; its tensors (name, type, ne)."""
    tensors = tensors or [(t.name, t.ggml_type, t.shape) for t in gguf_tensors(spec, file_type)]
    write_gguf(path, arch or GGUF_ARCHITECTURES[spec.model_type], tensors,
               metadata=model_metadata(spec, file_type, **metadata).values(), sparse=sparse)
    return tensors


def tiny_model_dir(tmp_path, arch: str = "qwen2", name: str | None = None, **overrides):
    """A model directory holding only the tests' tiny config.json of `arch`: (its path, its spec)."""
    d = tmp_path / (name or f"tiny-{arch}")
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config_dict(arch, **overrides)))
    return d, model_spec(str(d))


def parse_file(path, *, log: list | None = None):
    """parse_gguf_header over a file, recording each read's size in `log`."""
    data = path.read_bytes()

    def read(offset: int, n: int) -> bytes:
        if log is not None:
            log.append(n)
        return data[offset:offset + n]

    return parse_gguf_header(read, len(data), str(path))


# ------------------------------------------------------------------ the ggml type table
# Where gguf-py 0.19.0 (PyPI) differs from ggml-common.h at llama.cpp 0c1e570: its Q8_1 is the old layout (two fp32
# halves: 40 bytes; block_q8_1 is 2*sizeof(ggml_half) + QK8_1 = 36, as the gguf-py vendored at 0c1e570 says); and it
# has no Q2_0 (type 42) yet.
GGUF_PY_STALE = {"Q8_1": (32, 40)}
# ggml.h's enum ggml_type at 0c1e570 runs 0-42; these ids are removed (blck_size 0 in ggml.c's type_traits).
REMOVED_TYPE_IDS = {4, 5, 31, 32, 33, 36, 37, 38}


def test_every_ggml_type_is_in_the_table_with_gguf_pys_id_and_block_layout():
    ours = {n: (t.type_id, t.block_elements, t.block_bytes) for n, t in GGML_TYPES.items()}
    for t in GGMLQuantizationType:
        theirs = (t.value, *GGML_QUANT_SIZES[t])
        if GGUF_PY_STALE.get(t.name) != theirs[1:]:
            assert ours.get(t.name) == theirs, t.name
    assert sorted(t.type_id for t in GGML_TYPES.values()) == sorted(set(range(43)) - REMOVED_TYPE_IDS)
    assert ours["Q2_0"] == (42, 64, 18) and ours["Q8_1"] == (9, 32, 36)


# ------------------------------------------------------------------ parsing what gguf-py writes
QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS",
             "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
             "Q1_0", "Q8_K", "BF16", "F16", "F32", "F64", "I8", "I16", "I32", "I64"]


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_tensor_matches_gguf_pys_reader(tmp_path, alignment):
    """Tensors of every type gguf-py knows, 1-D to 4-D, written by GGUFWriter: name, type, shape, offset and bytes as
    GGUFReader sees them."""
    tensors = []
    for i, ty in enumerate(t for t in QUANTIZED if hasattr(GGMLQuantizationType, t)):  # older gguf-py lack some
        row = GGML_TYPES[ty].block_elements * (1 + i % 3)
        ne = [(row,), (row, 3), (row, 2, 5), (row, 1, 2, 3)][i % 4]
        tensors.append((f"blk.{i % 2}.t{i}.weight", ty, ne))
    write_gguf(tmp_path / "m.gguf", "llama", tensors, alignment=alignment,
               metadata=[("add_string", "general.name", "tiny"), ("add_bool", "x.flag", True),
                         ("add_float32", "x.ratio", 0.5), ("add_uint64", "x.big", 2**40),
                         ("add_int32", "x.neg", -7), ("add_array", "x.list", [1, 2, 3])])
    h = read_gguf(tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert [(t.name, t.ggml_type, t.shape, h.data_start + t.offset, t.nbytes) for t in h.tensors] == [
        (t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.data_offset), int(t.n_bytes))
        for t in r.tensors]
    assert h.alignment == (alignment or 32) and h.version == 3 and h.file_bytes == (tmp_path / "m.gguf").stat().st_size
    assert h.metadata["general.name"] == "tiny" and h.metadata["x.flag"] is True and h.metadata["x.ratio"] == 0.5
    assert h.metadata["x.big"] == 2**40 and h.metadata["x.neg"] == -7
    assert h.metadata["x.list"] == GGUFArray(item_type="i32", length=3, head=(1, 2, 3))
    assert h.tensor_bytes == sum(int(t.n_bytes) for t in r.tensors)
    assert [t.layer for t in h.tensors[:3]] == [0, 1, 0]


def test_a_models_file_reads_its_shape_and_keeps_a_big_tokenizer_short(tmp_path):
    d, spec = tiny_model_dir(tmp_path, "qwen2", vocab_size=4000)
    write_model_gguf(tmp_path / "m.gguf", spec, "Q4_K_M", tokens=("add_token_list", [f"tok{i}" for i in range(4000)]),
                     chat=("add_chat_template", "x" * (2 * 1024 * 1024)))
    log: list[int] = []
    h = parse_file(tmp_path / "m.gguf", log=log)
    assert (h.architecture, h.file_type, h.block_count, h.embedding_length, h.feed_forward_length) == (
        "qwen2", "Q4_K_M", 2, 64, 256)
    assert (h.head_count, h.head_count_kv, h.context_length, h.expert_count) == (2, 1, 512, None)
    tokens = h.metadata["tokenizer.ggml.tokens"]
    assert tokens.length == 4000 and len(tokens.head) == ARRAY_HEAD_ITEMS and tokens.head[:2] == ("tok0", "tok1")
    assert h.metadata["tokenizer.chat_template"] == GGUFLongString(length=2 * 1024 * 1024)  # kept as its length
    assert max(log) <= READ_CHUNK_BYTES  # the 2 MiB template was skipped, never read
    assert h.tensor_bytes == sum(t.nbytes for t in gguf_tensors(spec, "Q4_K_M"))
    predicted = gguf_tensors(spec, "Q4_K_M")
    assert [(t.name, t.ggml_type, t.shape, t.nbytes, t.layer) for t in as_gguf_tensors(h)] == [
        (t.name, t.ggml_type, t.shape, t.nbytes, t.layer) for t in predicted]


# ------------------------------------------------------------------ hostile headers, built by hand
def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, type_id: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<i", type_id) + payload


def _header(n_tensors: int, n_kv: int, body: bytes, *, magic: bytes = b"GGUF", version: int = 3) -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def _tensor(name: str, ne: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}q", *ne) + struct.pack("<iQ", type_id,
                                                                                                    offset)


PAD = b"\0" * 64  # bytes after a lying length, so that only the length can be wrong
ARCH = _kv("general.architecture", 8, _str("llama"))
HOSTILE = {
    "key length 2^62": (_header(0, 1, struct.pack("<Q", 2**62) + PAD), "key 0 claims"),
    "key length 2^64-1": (_header(0, 1, struct.pack("<Q", 2**64 - 1) + PAD), "key 0 claims"),
    "key length past the end": (_header(0, 1, struct.pack("<Q", 1000) + PAD), "the file ends"),
    "a key longer than the spec's": (_header(0, 1, struct.pack("<Q", 2**16) + b"k" * 2**16), "longest key"),
    "string length 2^63": (_header(0, 1, _kv("general.name", 8, struct.pack("<Q", 2**63) + PAD)), "claims"),
    "array length 2^63": (_header(0, 1, _kv("a.list", 9, struct.pack("<iQ", 6, 2**63) + PAD)), "claims"),
    "string array length 2^63": (_header(0, 1, _kv("a.list", 9, struct.pack("<iQ", 8, 2**63) + PAD)), "claims"),
    "a kept array string past the end": (_header(0, 1, _kv("a.list", 9, struct.pack("<iQ", 8, 2) + _str("ok")
                                                           + struct.pack("<Q", 2**20) + PAD)), "the file ends"),
    "a skipped array string past the end": (_header(0, 1, _kv("a.list", 9, struct.pack("<iQ", 8, 1026)
                                                              + _str("a") * 1025 + struct.pack("<Q", 2**20) + PAD)),
                                            "past the file's end"),
    "a skipped array string of 2^40": (_header(0, 1, _kv("a.list", 9, struct.pack("<iQ", 8, 1026)
                                                         + _str("a") * 1025 + struct.pack("<Q", 2**40) + PAD)),
                                       "more than llama.cpp reads"),
    "5,000 nested arrays": (_header(0, 1, _kv("a.list", 9, struct.pack("<iQ", 9, 1) * 5000 + PAD)), "nests arrays"),
    "2^62 key/values claimed": (_header(0, 2**62, PAD), "cannot fit"),
    "2^62 tensors claimed": (_header(2**62, 0, PAD), "cannot fit"),
    "a negative count": (_header(2**64 - 1, 0, PAD), "negative"),
    "an unknown value type": (_header(0, 1, _kv("a.x", 13, PAD)), "unknown value type 13"),
    "bad magic": (_header(0, 0, PAD, magic=b"GGML"), "not a GGUF file"),
    "version 1": (_header(0, 0, PAD, version=1), "GGUF version 1"),
    "a big-endian file": (_header(0, 0, PAD, version=3 << 24), "byte order"),
    "an empty key": (_header(0, 1, _kv("", 4, PAD)), "empty"),
    "a key twice": (_header(0, 2, _kv("a.x", 4, b"\1\0\0\0") + _kv("a.x", 4, b"\1\0\0\0")), "appears twice"),
    "alignment 3": (_header(0, 1, _kv("general.alignment", 4, struct.pack("<I", 3))), "power of two"),
    "n_dims 5": (_header(1, 1, ARCH + _tensor("t", (32, 1, 1, 1, 1)) + PAD), "5 dimensions"),
    "a negative dimension": (_header(1, 1, ARCH + _tensor("t", (-32,)) + PAD), "impossible shape"),
    "an unknown ggml type": (_header(1, 1, ARCH + _tensor("t", (32,), type_id=99) + PAD), "unknown ggml type 99"),
    "a removed ggml type": (_header(1, 1, ARCH + _tensor("t", (32,), type_id=4) + PAD), "unknown ggml type 4"),
    "rows of part blocks": (_header(1, 1, ARCH + _tensor("t", (33,), type_id=2) + PAD), "not whole"),
    "a 64-byte tensor name": (_header(1, 1, ARCH + _tensor("t" * 64, (32,)) + PAD), "GGML_MAX_NAME"),
    "a tensor twice": (_header(2, 1, ARCH + _tensor("t", (8,)) + _tensor("t", (8,), offset=32) + PAD),
                       "appears twice"),
    "data past the end": (_header(1, 1, ARCH + _tensor("t", (1024, 1024))) + b"\0" * 64, "runs past the end"),
    "an offset out of order": (_header(1, 1, ARCH + _tensor("t", (8,), offset=64)) + b"\0" * 256, "data offset 64"),
    "an empty file": (b"", "not a GGUF file"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_header_is_a_one_line_error_naming_the_file_without_big_reads(tmp_path, case):
    data, says = HOSTILE[case]
    (tmp_path / "evil.gguf").write_bytes(data)
    log: list[int] = []
    with pytest.raises(CheckpointError) as e:
        parse_file(tmp_path / "evil.gguf", log=log)
    message = str(e.value)
    assert str(tmp_path / "evil.gguf") in message and "\n" not in message
    assert any(s in message for s in says.split("|")), message
    assert max(log, default=0) <= READ_CHUNK_BYTES  # nothing asked for by a claimed length


@pytest.mark.parametrize("case", ["key length 2^62", "key length 2^64-1", "string length 2^63", "array length 2^63",
                                  "5,000 nested arrays", "bad magic", "n_dims 5", "an unknown ggml type",
                                  "data past the end"])
def test_a_hostile_header_through_the_cli_is_one_line(tmp_path, monkeypatch, capsys, case):
    isolate(tmp_path, monkeypatch)
    d, _ = tiny_model_dir(tmp_path)
    (tmp_path / "evil.gguf").write_bytes(HOSTILE[case][0])
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", d, "--gguf", tmp_path / "evil.gguf",
                           "-H", HW, "--prompt-tokens", "8")
    assert str(tmp_path / "evil.gguf") in assert_one_line_error(code, err)


def test_every_truncation_of_a_real_file_is_a_one_line_error(tmp_path):
    """Every cut inside the header, and every 97th inside the data: refused until the last tensor's data is whole."""
    d, spec = tiny_model_dir(tmp_path)
    write_model_gguf(tmp_path / "m.gguf", spec, "Q8_0", tokens=("add_token_list", [f"t{i}" for i in range(16)]))
    data = (tmp_path / "m.gguf").read_bytes()
    h = parse_file(tmp_path / "m.gguf")
    whole = h.data_start + max(t.offset + t.nbytes for t in h.tensors)
    for cut in [*range(h.data_start + 1), *range(h.data_start + 1, whole, 97)]:
        with pytest.raises(CheckpointError, match="cut.gguf"):
            parse_gguf_header(lambda o, n: data[o:min(o + n, cut)], cut, "cut.gguf")
    assert parse_gguf_header(lambda o, n: data[o:min(o + n, whole)], whole, "cut.gguf").tensors == h.tensors


def test_a_file_that_shrinks_under_the_reader_is_a_one_line_error(tmp_path):
    d, spec = tiny_model_dir(tmp_path)
    write_model_gguf(tmp_path / "m.gguf", spec, "Q8_0")
    data = (tmp_path / "m.gguf").read_bytes()
    with pytest.raises(CheckpointError, match="the file ended at byte 100"):  # its size said more than it holds
        parse_gguf_header(lambda o, n: data[o:min(o + n, 100)], len(data), "shrunk.gguf")


def test_random_corruption_is_only_ever_a_checkpoint_error(tmp_path):
    """Bytes of a real header overwritten at random (lengths, counts, types, anywhere): parsed, or one CheckpointError;
    never another exception, never a read beyond a chunk."""
    d, spec = tiny_model_dir(tmp_path)
    write_model_gguf(tmp_path / "m.gguf", spec, "Q4_K_M")
    good = (tmp_path / "m.gguf").read_bytes()
    header_end = parse_file(tmp_path / "m.gguf").data_start
    rng = random.Random(36)
    outcomes = {"parsed": 0, "refused": 0}
    for _ in range(400):
        data = bytearray(good)
        at = rng.randrange(header_end)
        data[at:at + 8] = rng.choice([struct.pack("<Q", rng.choice([2**62, 2**63, 2**64 - 1, 5000, 0])),
                                      bytes([rng.randrange(256)]), struct.pack("<i", rng.randrange(-3, 50))])
        data = bytes(data)
        sizes: list[int] = []

        def read(o, n, data=data, sizes=sizes):
            sizes.append(n)
            return data[o:o + n]

        try:
            parse_gguf_header(read, len(data), "fuzz.gguf")
            outcomes["parsed"] += 1
        except CheckpointError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
        assert max(sizes) <= READ_CHUNK_BYTES
    assert outcomes["parsed"] and outcomes["refused"]  # both roads taken


# ------------------------------------------------------------------ files that are no regular file
def _run_with_deadline(fn, timeout_s: float, unblock) -> object:
    """fn() in a thread (its result, or its exception raised here); if it is still running after `timeout_s`,
    `unblock()` frees it and the test fails."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the test's thread
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        unblock()
        t.join(5)
        pytest.fail(f"still blocked after {timeout_s} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _open_writer(fifo):
    """Opening the FIFO's write end frees a reader blocked in open()."""
    def unblock():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    return unblock


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("command", ["run", "calibrate"])
def test_a_fifo_as_gguf_is_refused_at_once_saying_what_it_is(tmp_path, monkeypatch, capsys, command):
    isolate(tmp_path, monkeypatch)
    d, _ = tiny_model_dir(tmp_path)
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    argv = (["run", "--engine", "llama.cpp", "--model", d, "--gguf", fifo, "-H", HW, "--prompt-tokens", "8"]
            if command == "run" else ["calibrate", "--engine", "llama.cpp", "--models", d, "--gguf", fifo])
    code, _, err = _run_with_deadline(lambda: run_cli(capsys, *argv), 30, _open_writer(fifo))
    assert f"--gguf {fifo} is a FIFO, not a regular file" in assert_one_line_error(code, err)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_read_gguf_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        _run_with_deadline(lambda: read_gguf(fifo), 30, _open_writer(fifo))


@pytest.mark.parametrize("kind", ["a directory", "a character device"])
def test_a_directory_or_device_as_gguf_says_what_it_is(tmp_path, monkeypatch, capsys, kind):
    isolate(tmp_path, monkeypatch)
    d, _ = tiny_model_dir(tmp_path)
    path = tmp_path if kind == "a directory" else "/dev/null"
    if kind == "a character device" and not (os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode)):
        pytest.skip("no /dev/null character device")
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", d, "--gguf", path, "-H", HW,
                           "--prompt-tokens", "8")
    assert f"--gguf {path} is {kind}, not a regular file" in assert_one_line_error(code, err)


def test_a_llama_server_that_is_no_executable_says_so(tmp_path, monkeypatch, capsys):
    isolate(tmp_path, monkeypatch)
    d, spec = tiny_model_dir(tmp_path)
    write_model_gguf(tmp_path / "m.gguf", spec, "Q8_0")
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    text.chmod(0o644)
    script = tmp_path / "script"  # executable, but no program: exec refuses it
    script.write_bytes(b"\x7fELF not really\n")
    script.chmod(0o755)
    base = ["run", "--engine", "llama.cpp", "--model", d, "--gguf", tmp_path / "m.gguf", "-H", HW,
            "--prompt-tokens", "8", "--llama-server"]
    for server, says in ((text, "is not executable"), (tmp_path, "is a directory, not a llama-server"),
                         (tmp_path / "nothing", "was not found"), (script, "could not be started")):
        code, _, err = run_cli(capsys, *base, server)
        line = assert_one_line_error(code, err)
        assert f"llama-server at {server}" in line and says in line, line


# ------------------------------------------------------------------ the file against --model
def _fake_server_that_must_not_start(tmp_path, monkeypatch):
    marker = tmp_path / "server-started"
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\ntouch {marker}\n")
    server.chmod(0o755)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", str(server))
    return marker


def test_another_models_big_file_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """The audit's case: Llama-3.1-8B's GGUF (sparse: 4.6 GiB that take no disk) run as qwen2.5-0.5b."""
    isolate(tmp_path, monkeypatch)
    marker = _fake_server_that_must_not_start(tmp_path, monkeypatch)
    write_model_gguf(tmp_path / "big.gguf", model_spec("llama-3.1-8b"), "Q4_K_M", sparse=True,
                     tokens=("add_token_list", ["a", "b"]))
    assert read_gguf(tmp_path / "big.gguf").tensor_bytes > 4 * 2**30
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", "qwen2.5-0.5b", "--gguf",
                           tmp_path / "big.gguf", "-H", HW, "--prompt-tokens", "8")
    line = assert_one_line_error(code, err)
    spec = model_spec("qwen2.5-0.5b")
    assert (f"{tmp_path / 'big.gguf'} is a 'llama' model with 32 layers of width 4096; --model {spec.name} is a "
            "'qwen2' model with 24 layers of width 896") in line
    assert not marker.exists()


@pytest.mark.parametrize("what, file_arch, overrides, says", [
    ("architecture", "llama", {}, "is a 'llama' model with 2 layers of width 64; --model"),
    ("layers", None, {"num_hidden_layers": 3}, "with 3 layers of width 64; --model"),
    ("width", None, {"hidden_size": 128, "head_dim": 64}, "with 2 layers of width 128; --model"),
    ("tensor bytes", None, {"intermediate_size": 1024}, "beyond the 10% tolerance"),
])
def test_a_file_of_another_model_is_refused_naming_what_differs(tmp_path, monkeypatch, capsys, what, file_arch,
                                                                 overrides, says):
    isolate(tmp_path, monkeypatch)
    marker = _fake_server_that_must_not_start(tmp_path, monkeypatch)
    d, spec = tiny_model_dir(tmp_path, "qwen2")
    _, other = tiny_model_dir(tmp_path, "qwen2", name="other", **overrides)
    write_model_gguf(tmp_path / "m.gguf", other, "Q8_0", arch=file_arch)
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", d, "--gguf", tmp_path / "m.gguf",
                           "-H", HW, "--prompt-tokens", "8")
    line = assert_one_line_error(code, err)
    assert says in line and str(tmp_path / "m.gguf") in line, line
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        check_gguf_matches(read_gguf(tmp_path / "m.gguf"), spec)


def test_the_tensor_bytes_tolerance_is_named_and_holds_both_ways(tmp_path):
    _, spec = tiny_model_dir(tmp_path, "qwen2")
    planned = [(t.name, t.ggml_type, t.shape) for t in gguf_tensors(spec, "Q8_0")]
    total = sum(t.nbytes for t in gguf_tensors(spec, "Q8_0"))
    # one tensor stored wider than llama-quantize's rule: a re-tuned mixture within the tolerance passes
    widened = [(n, "F16" if n == "blk.0.ffn_up.weight" else ty, ne) for n, ty, ne in planned]
    write_model_gguf(tmp_path / "ok.gguf", spec, "Q8_0", tensors=widened)
    h = read_gguf(tmp_path / "ok.gguf")
    assert 0 < h.tensor_bytes - total <= TENSOR_BYTES_TOLERANCE * total
    check_gguf_matches(h, spec)
    # every layer tensor in F32: far beyond
    write_model_gguf(tmp_path / "wide.gguf", spec, "Q8_0", tensors=[(n, "F32", ne) for n, _, ne in planned])
    with pytest.raises(CheckpointError, match=r"\+\d+%, beyond the 10% tolerance"):
        check_gguf_matches(read_gguf(tmp_path / "wide.gguf"), spec)


def test_a_tied_models_file_with_its_own_output_weight_is_its_file(tmp_path):
    """Qwen's own GGUFs of tied models carry output.weight all the same: left out of the comparison."""
    _, spec = tiny_model_dir(tmp_path, "qwen2", tie_word_embeddings=True, vocab_size=4096)
    planned = [(t.name, t.ggml_type, t.shape) for t in gguf_tensors(spec, "Q8_0")]
    assert "output.weight" not in [n for n, _, _ in planned]
    write_model_gguf(tmp_path / "m.gguf", spec, "Q8_0", tensors=planned + [("output.weight", "F32", (64, 4096))])
    check_gguf_matches(read_gguf(tmp_path / "m.gguf"), spec)


def test_a_file_without_tensors_or_shape_keys_is_refused(tmp_path):
    _, spec = tiny_model_dir(tmp_path, "qwen2")
    write_gguf(tmp_path / "vocab.gguf", "qwen2", [], metadata=model_metadata(spec, "Q8_0").values())
    with pytest.raises(CheckpointError, match="holds no tensors"):
        check_gguf_matches(read_gguf(tmp_path / "vocab.gguf"), spec)
    write_gguf(tmp_path / "bare.gguf", "qwen2", [(t.name, t.ggml_type, t.shape) for t in gguf_tensors(spec, "Q8_0")])
    with pytest.raises(CheckpointError, match="cannot tell which model"):
        check_gguf_matches(read_gguf(tmp_path / "bare.gguf"), spec)


def test_the_models_own_file_plans(tmp_path):
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.runtime.llamacpp_run import plan_for_file

    _, spec = tiny_model_dir(tmp_path, "qwen2")
    write_model_gguf(tmp_path / "m.gguf", spec, "Q4_K_M")
    p = plan_for_file(spec, resolve_profile(HW)[0], Request(context=256, engine="llama.cpp"), tmp_path / "m.gguf", 8,
                      prompt_given=False)
    assert p.fits and p.choice.weight_quant == "Q4_K_M"
