"""`--model org/repo:Q4_K_M`: a GGUF file on the hub, named as llama.cpp's -hf and Ollama's hf.co/ name it (issue 38,
step 2). A real HTTP server on loopback (tests/fake_hub.py) serves the hub's endpoints; only the header's bytes are
read, by range reads; the plan is the file's own, and the exports fetch it the engines' own way."""

from __future__ import annotations

import json

import pytest

from fake_hub import FakeHub, cli, hub_env, one_line_error
from test_gguf_model import LLAMA, _q4_k_m, load_gguf_model, metadata, write_gguf
from vramplan.planner.errors import CheckpointError
from vramplan.runtime.hub_gguf import choose_files, is_hub_gguf

REPO = "someone/Tiny-Llama-GGUF"


@pytest.fixture
def hub(tmp_path):
    path = tmp_path / "Tiny-Llama-Q4_K_M.gguf"
    write_gguf(path, "llama", _q4_k_m(LLAMA), metadata("llama", LLAMA, "Q4_K_M"))
    with FakeHub() as h:
        h.add(REPO, {"Tiny-Llama-Q4_K_M.gguf": path.read_bytes(), "README.md": b"# tiny\n"})
        h.file_bytes = len(path.read_bytes())
        h.model = load_gguf_model(path)
        yield h


def test_a_hub_gguf_plans_from_its_header_alone(hub, tmp_path):
    env = hub_env(tmp_path, hub)
    r = cli(env, "plan", "--model", f"{REPO}:Q4_K_M", "-H", "rtx-4090", "--context", "1k", "--engine", "llama.cpp",
            "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["choice"]["weight_quant"] == "Q4_K_M"
    assert d["memory"]["gpus"][0]["weights_bytes"] + d["memory"]["cpu"]["weights_bytes"] == hub.model.tensor_bytes
    ranges = [q for q in hub.requests() if q.range]
    assert ranges and all(q.range.startswith("bytes=") for q in ranges)  # header reads only, by ranges


def test_the_exports_fetch_it_the_engines_own_way(hub, tmp_path):
    env = hub_env(tmp_path, hub)
    r = cli(env, "plan", "--model", f"{REPO}:q4_k_m", "-H", "rtx-4090", "--context", "1k", "--emit", "llama.cpp")
    assert r.returncode == 0, r.stderr
    assert f"-hf {REPO}:q4_k_m" in r.stdout and " -m " not in r.stdout
    r = cli(env, "plan", "--model", f"{REPO}:Q4_K_M", "-H", "rtx-4090", "--context", "1k", "--emit", "ollama")
    assert r.returncode == 0, r.stderr
    assert f"FROM hf.co/{REPO}:Q4_K_M" in r.stdout


def test_a_tag_no_file_carries_is_one_line_naming_the_files(hub, tmp_path):
    r = cli(hub_env(tmp_path, hub), "plan", "--model", f"{REPO}:IQ2_XXS", "-H", "rtx-4090")
    line = one_line_error(r)
    assert "no file of someone/Tiny-Llama-GGUF carries 'IQ2_XXS'" in line and "Tiny-Llama-Q4_K_M.gguf" in line


def test_choosing_files():
    files = ["a/M-Q4_K_M-00002-of-00002.gguf", "a/M-Q4_K_M-00001-of-00002.gguf", "M-Q4_K_S.gguf",
             "mmproj-M-Q4_K_M.gguf", "M-IQ2_XXS.gguf", "UD-IQ1_S/M-UD-IQ1_S-00001-of-00001.gguf"]
    assert choose_files("r", "Q4_K_M", files) == ["a/M-Q4_K_M-00001-of-00002.gguf", "a/M-Q4_K_M-00002-of-00002.gguf"]
    assert choose_files("r", "q4_k_s", files) == ["M-Q4_K_S.gguf"]
    assert choose_files("r", "UD-IQ1_S", files) == ["UD-IQ1_S/M-UD-IQ1_S-00001-of-00001.gguf"]
    with pytest.raises(CheckpointError, match="split in 2 parts, but the repository lists 1"):
        choose_files("r", "Q4_K_M", files[1:])
    assert is_hub_gguf("org/repo:Q4_K_M") and not is_hub_gguf("./x:Q4") and not is_hub_gguf("org/repo")


def test_a_gguf_only_repo_without_a_type_says_how_to_name_one(hub, tmp_path):
    line = one_line_error(cli(hub_env(tmp_path, hub), "plan", "--model", REPO, "-H", "rtx-4090"))
    assert "has only GGUF weight files" in line and f"--model {REPO}:Q4_K_M" in line
