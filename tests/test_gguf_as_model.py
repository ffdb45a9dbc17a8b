"""`--model FILE.gguf` (issue 38, step 2): the model its metadata describes, planned by llama.cpp and Ollama in the
file's own type with the file's own tensor bytes (planner/gguf_model.py reads it; tests/test_gguf_model.py tests the
reading), the other engines planning the model it was converted from. Files are written by gguf-py."""

from __future__ import annotations

import json
import shlex

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli
from test_gguf_model import LLAMA, _q4_k_m, load_gguf_model, metadata, write_gguf


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "my model's-Q4_K_M.gguf"  # a name a shell would split
    write_gguf(path, "llama", _q4_k_m(LLAMA), metadata("llama", LLAMA, "Q4_K_M"))
    return path


def test_llamacpp_plans_the_file_as_it_is(capsys, gguf):
    code, out, err = run_cli(capsys, "plan", "--model", gguf, "-H", "rtx-4090", "--context", "1k", "--engine",
                             "llama.cpp", "--json")
    assert code == 0, err
    d = json.loads(out)
    m = load_gguf_model(gguf)
    assert d["choice"]["weight_quant"] == "Q4_K_M"
    # every byte of the file's tensors is placed: the layers and the output on the GPU, token_embd in RAM
    assert d["memory"]["gpus"][0]["weights_bytes"] + d["memory"]["cpu"]["weights_bytes"] == m.tensor_bytes
    assert "a Q4_K_M GGUF file (llama)" in err


def test_the_exports_name_the_file_quoted(capsys, gguf):
    code, out, err = run_cli(capsys, "plan", "--model", gguf, "-H", "rtx-4090", "--context", "1k", "--emit",
                             "llama.cpp")
    assert code == 0, err
    assert f"-m {shlex.quote(str(gguf))}" in out
    assert "its own tensors' types and bytes" in out and "where to get it" not in out
    code, out, err = run_cli(capsys, "plan", "--model", gguf, "-H", "rtx-4090", "--context", "1k", "--emit", "ollama")
    assert code == 0, err
    assert "FROM " in out and "nothing to pull" in out and "llama-quantize" not in out


def test_the_engine_table_plans_the_file_for_llamacpp_and_ollama(capsys, gguf):
    code, out, err = run_cli(capsys, "plan", "--model", gguf, "-H", "rtx-4090", "--context", "1k", "--json")
    assert code == 0, err
    d = json.loads(out)
    rows = {e["engine"]: e["weight_quant"] for e in d["engines"]}
    assert rows["llama.cpp"] == rows["ollama"] == "Q4_K_M"
    assert rows["vramplan"] == "bnb-nf4"  # its scheme nearest Q4_K_M on a CUDA GPU, and the plan says why
    assert any("vramplan's runtime loads the model's safetensors checkpoint, not the GGUF" in w for w in d["warnings"])


def test_another_file_type_is_another_file(capsys, gguf):
    code, out, err = run_cli(capsys, "plan", "--model", gguf, "-H", "rtx-4090", "--engine", "llama.cpp", "-q", "Q8_0")
    line = assert_one_line_error(code, err)
    assert "is a Q4_K_M GGUF file: --quant Q8_0 would be another file" in line


def test_a_broken_gguf_as_model_is_one_line(capsys, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    code, out, err = run_cli(capsys, "plan", "--model", bad, "-H", "rtx-4090")
    assert_one_line_error(code, err)
    code, out, err = run_cli(capsys, "plan", "--model", tmp_path / "none.gguf", "-H", "rtx-4090")
    assert "no such file" in assert_one_line_error(code, err)
