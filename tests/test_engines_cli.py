"""`vramplan plan --emit / --engine / --nodes`: stdout is the export (or JSON with an "emit" object), bad values are
one-line errors with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import isolate, run_cli as main
from vramplan.planner.engines import emit, plan_for_engine
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import model_spec


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch)


ROOT = Path(__file__).resolve().parents[1]
PLAN = ("plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--context", "8k")


def test_engine_llamacpp_json_is_a_plan(capsys):
    code, out, _ = main(capsys, *PLAN, "--engine", "llama.cpp", "--quant", "Q4_K_M", "--json")
    d = json.loads(out)
    assert code == 0 and d["fits"] and d["request"]["engine"] == "llama.cpp"
    assert d["choice"]["weight_quant"] == "Q4_K_M" and d["choice"]["engine"] == "llama.cpp"
    assert [c["kv_dtype"] for c in d["candidates"]] == ["f16", "q8_0", "q4_0"]
    assert d["memory"]["gpu"]["headroom_bytes"] == 1024**3  # llama.cpp's --fit margin, not vramplan's headroom
    assert d["predicted"]["decode_tokens_per_s"] > 0 and "emit" not in d
    assert d["constants"]["fit_target_margin_bytes"]["value"] == 1024**3


def test_emit_prints_the_export_alone(capsys):
    code, out, err = main(capsys, *PLAN, "--emit", "VLLM")
    spec, hw = model_spec("llama-3.1-8b"), resolve_profile("rtx-4090")[0]
    expected = emit("vllm", spec, hw, plan_for_engine(spec, hw, Request(context=8192))).text
    assert code == 0 and out == expected and "vllm serve meta-llama/Llama-3.1-8B" in out
    assert "vllm export of meta-llama/Llama-3.1-8B: fits" in err


def test_emit_with_json_adds_an_emit_object(capsys):
    code, out, _ = main(capsys, *PLAN, "--engine", "llama.cpp", "--emit", "ollama", "--json")
    d = json.loads(out)
    assert code == 0 and d["emit"]["engine"] == "ollama" and d["emit"]["fits"]
    assert d["emit"]["text"].splitlines()[-2] == f"FROM {d['emit']['details']['tag']}"
    assert d["emit"]["text"].splitlines()[-1] == "PARAMETER num_ctx 8192"
    # Ollama's version and launch, llama.cpp's --fit margin (Ollama's old 457 MiB minimum is only logged now)
    assert d["emit"]["constants"]["ollama_version"]["value"] == "v0.32.15"
    assert d["emit"]["constants"]["fit_target_margin_bytes"]["value"] == 1024**3
    assert "minimum_memory_bytes" not in d["emit"]["constants"]
    assert d["emit"]["details"]["plan"]["request"]["engine"] == "ollama"  # Ollama's own plan of the request


def test_emit_exit_code_follows_the_export(capsys):
    code, out, _ = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", "cpu-epyc-server", "--emit", "vllm")
    assert code == 1 and out.startswith("# vLLM: hardware 'cpu-epyc-server' has no GPU")


@pytest.mark.parametrize("extra, says", [
    (("--engine", "tgi"), "the engine must be one of vramplan, llama.cpp, ollama, transformers, got 'tgi'"),
    (("--nodes", "0"), "the number of nodes must be between 1 and 1024, got 0"),
    (("--emit", "tgi"), "--emit 'tgi': choose one of vllm, llama.cpp, ollama, transformers"),
    (("--engine", "ollama", "--gpu-layers", "3"), "Ollama places layers by llama.cpp's --fit itself"),
    (("--engine", "llama.cpp", "--quant", "bnb-nf4"), "unknown GGUF file type 'BNB-NF4'"),
    (("--engine", "llama.cpp", "--kv-dtype", "fp8"), "unknown llama.cpp KV cache type 'fp8'"),
    (("--engine", "llama.cpp", "--offload", "stream"), "it has no stream mode"),
])
def test_bad_engine_options_are_one_line_exit_2(capsys, extra, says):
    code, out, err = main(capsys, *PLAN, *extra)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and out == "" and len(errors) == 1 and "Traceback" not in err
    assert says in " ".join(err.split()), err


def test_a_saved_llamacpp_plan_is_refused_by_run_in_one_line(capsys, tmp_path):
    saved = tmp_path / "llama.yaml"
    code, _, _ = main(capsys, *PLAN, "--engine", "llama.cpp", "--quant", "Q4_K_M", "--save", str(saved))
    assert code == 0 and saved.is_file()
    code, out, err = main(capsys, "run", "--model", "llama-3.1-8b", "--plan", str(saved), "--dummy-weights",
                      "--prompt", "hello")
    last = err.strip().splitlines()[-1]
    assert code == 2, err
    assert last.startswith("error: ") and "follows llama.cpp's rules" in last and "Traceback" not in err


def test_llamacpp_plan_on_two_gpus_has_a_breakdown_per_gpu(capsys, tmp_path):
    import yaml

    doc = yaml.safe_load((ROOT / "profiles" / "rtx-4090.yaml").read_text())
    doc["name"], doc["gpus"][0]["count"] = "two-4090s", 2
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    code, out, _ = main(capsys, "plan", "--model", "llama-3.1-70b", "-H", str(tmp_path / "two.yaml"), "--context",
                        "8k", "--engine", "llama.cpp", "--quant", "Q4_K_M", "--json")
    d = json.loads(out)
    gpus = d["memory"]["gpus"]
    assert code == 0 and d["choice"]["gpu_layers"] == 80 and len(gpus) == 2 and d["memory"]["gpu"] == gpus[0]
    per = d["choice"]["gpu_layers_per_device"]
    assert len(per) == 2 and all(per) and sum(per) == 80
    for g in gpus:
        assert g["total_bytes"] <= g["capacity_bytes"] and g["headroom_bytes"] == 1024**3  # --fit margin per device
