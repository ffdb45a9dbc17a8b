"""`vramplan run --engine llama.cpp`: the GGUF header read for the file type, the CLI's checks, and (where a built
llama-server and a GGUF file are given by $VRAMPLAN_LLAMA_SERVER and $VRAMPLAN_TEST_GGUF with
$VRAMPLAN_TEST_GGUF_MODEL) a real run."""

from __future__ import annotations

import json
import os
import struct

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli
from vramplan.planner.errors import VramplanError
from vramplan.runtime.llamacpp_run import gguf_file_type


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path, file_type: int | None, *, magic: bytes = b"GGUF") -> None:
    """A GGUF v3 header as llama.cpp's gguf.cpp writes it: strings, an array of strings, an array of floats, a
    uint64 and a bool before `general.file_type` (a uint32), then a string after it; no tensors."""
    kvs = [("general.architecture", 8, _string("llama")),
           ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + _string("a") + _string("bc") + _string("<s>")),
           ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0.0, 1.0, 2.0)),
           ("llama.context_length", 10, struct.pack("<Q", 8192)),
           ("general.quantized", 7, b"\x01")]
    if file_type is not None:
        kvs.append(("general.file_type", 4, struct.pack("<I", file_type)))
    kvs.append(("general.name", 8, _string("tiny")))
    body = b"".join(_string(k) + struct.pack("<I", t) + v for k, t, v in kvs)
    path.write_bytes(magic + struct.pack("<IQQ", 3, 0, len(kvs)) + body)


@pytest.mark.parametrize("ftype, name", [(15, "Q4_K_M"), (2, "Q4_0"), (7, "Q8_0"), (32, "BF16"), (1, "F16")])
def test_the_file_type_is_read_from_the_gguf_header_past_strings_and_arrays(tmp_path, ftype, name):
    write_gguf(tmp_path / "m.gguf", ftype)
    assert gguf_file_type(tmp_path / "m.gguf") == name


def test_a_file_that_is_not_a_usable_gguf_is_a_one_line_error(tmp_path):
    write_gguf(tmp_path / "bad.gguf", 15, magic=b"GGML")
    with pytest.raises(VramplanError, match="not a GGUF file"):
        gguf_file_type(tmp_path / "bad.gguf")
    write_gguf(tmp_path / "none.gguf", None)
    with pytest.raises(VramplanError, match="no general.file_type"):
        gguf_file_type(tmp_path / "none.gguf")
    write_gguf(tmp_path / "odd.gguf", 24)  # IQ1_S: not a type vramplan sizes
    with pytest.raises(VramplanError, match="not one vramplan sizes"):
        gguf_file_type(tmp_path / "odd.gguf")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(VramplanError, match="cannot read its GGUF header"):
        gguf_file_type(tmp_path / "short.gguf")


def test_run_with_llamacpp_needs_a_gguf_and_a_server_and_says_so(tmp_path, monkeypatch, capsys):
    isolate(tmp_path, monkeypatch)
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # no prompt piped in
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", "qwen2.5-0.5b")
    assert "--gguf PATH" in assert_one_line_error(code, err)
    write_gguf(tmp_path / "m.gguf", 2)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", "qwen2.5-0.5b", "--gguf",
                           tmp_path / "m.gguf")
    assert "llama-server at" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", "qwen2.5-0.5b", "--gguf",
                           tmp_path / "m.gguf", "--quant", "Q8_0")
    assert "is Q4_0" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "run", "--model", "qwen2.5-0.5b", "--gguf", tmp_path / "m.gguf")
    assert "--engine llama.cpp" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "run", "--engine", "ollama", "--model", "qwen2.5-0.5b")
    assert "vramplan or llama.cpp" in assert_one_line_error(code, err)


@pytest.mark.skipif(not (os.environ.get("VRAMPLAN_LLAMA_SERVER") and os.environ.get("VRAMPLAN_TEST_GGUF")),
                    reason="needs a built llama-server ($VRAMPLAN_LLAMA_SERVER) and a GGUF file ($VRAMPLAN_TEST_GGUF, "
                           "converted from $VRAMPLAN_TEST_GGUF_MODEL)")
def test_a_real_llama_server_run_reports_predicted_and_measured(tmp_path, monkeypatch, capsys):
    server, gguf = os.environ["VRAMPLAN_LLAMA_SERVER"], os.environ["VRAMPLAN_TEST_GGUF"]
    isolate(tmp_path, monkeypatch)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", server)
    code, out, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model",
                             os.environ.get("VRAMPLAN_TEST_GGUF_MODEL", "qwen2.5-0.5b"), "--gguf", gguf,
                             "--prompt-tokens", "32", "-n", "8", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["measured"]["generated_tokens"] == 8 and d["measured"]["decode_tokens_per_s"] > 0
    assert d["measured"]["peak_ram_bytes"] > 0 and d["predicted"]["decode_tokens_per_s"] > 0
    assert d["plan"]["request"]["engine"] == "llama.cpp" and len(d["measured"]["token_timestamps_s"]) >= 8


def test_calibrate_with_llamacpp_checks_its_inputs_before_any_server(tmp_path, monkeypatch, capsys):
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.sources import model_spec
    from vramplan.runtime.llamacpp_calibrate import calibrate_llamacpp

    isolate(tmp_path, monkeypatch)
    write_gguf(tmp_path / "m.gguf", 2)
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b,llama-3.2-1b",
                           "--gguf", tmp_path / "m.gguf")
    assert "one --models entry per --gguf file (2 models, 1 files)" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b",
                           "--gguf", tmp_path / "M-missing.gguf")
    assert "--gguf " + str(tmp_path / "M-missing.gguf") + ": no such file" in assert_one_line_error(code, err)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b",
                           "--gguf", tmp_path / "m.gguf")
    assert "llama-server at" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "calibrate", "--gguf", tmp_path / "m.gguf")
    assert "go with --engine llama.cpp" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b", "--gguf",
                           tmp_path / "m.gguf", "--quants", "bf16", "--repeats", "2")
    assert "--quants, --repeats: not for --engine llama.cpp" in assert_one_line_error(code, err)
    with pytest.raises(VramplanError, match="has a GPU"):  # the fit's model is every layer on the CPU
        calibrate_llamacpp(resolve_profile("h100-sxm")[0], [(model_spec("qwen2.5-0.5b"), str(tmp_path / "m.gguf"))],
                           tmp_path / "server")


@pytest.mark.skipif(not (os.environ.get("VRAMPLAN_LLAMA_SERVER") and os.environ.get("VRAMPLAN_TEST_GGUF")),
                    reason="needs a built llama-server ($VRAMPLAN_LLAMA_SERVER) and a GGUF file ($VRAMPLAN_TEST_GGUF, "
                           "converted from $VRAMPLAN_TEST_GGUF_MODEL)")
def test_calibrate_with_a_real_llama_server_fits_what_llamacpp_plans_then_use(tmp_path, monkeypatch, capsys):
    from vramplan.planner.engines.llamacpp import plan_llamacpp
    from vramplan.planner.profile_yaml import loads_profile
    from vramplan.planner.request import Request
    from vramplan.planner.sources import model_spec

    gguf, model = os.environ["VRAMPLAN_TEST_GGUF"], os.environ.get("VRAMPLAN_TEST_GGUF_MODEL", "qwen2.5-0.5b")
    server = os.environ["VRAMPLAN_LLAMA_SERVER"]
    isolate(tmp_path, monkeypatch)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", server)
    code, _, err = run_cli(capsys, "probe", "--save", tmp_path / "here.yaml")
    assert code == 0, err
    code, out, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--hardware", tmp_path / "here.yaml",
                             "--models", model, "--gguf", gguf, "--prompts", "32,96", "--new-tokens", "8",
                             "--save", tmp_path / "cal.yaml", "--json")
    assert code == 0, err
    d = json.loads(out)
    file_type = gguf_file_type(gguf)
    assert {(r["file_type"], r["prompt_tokens"]) for r in d["runs"]} == {(file_type, 32), (file_type, 96)}
    hw = loads_profile((tmp_path / "cal.yaml").read_text())
    p = plan_llamacpp(model_spec(model), hw, Request(context=104, prompt_tokens=96, engine="llama.cpp",
                                                     quant=(file_type,)))
    assert p.chosen.speed.terms["efficiency_source"].startswith("calibrated")
