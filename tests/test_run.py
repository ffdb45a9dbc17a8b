"""`vramplan run` end to end on real (tiny) transformers models saved with save_pretrained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=512),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=512),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=512, sliding_window=32),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    out = {}
    for arch, kw in TINY.items():
        cfg = transformers.AutoConfig.for_model(arch, **kw)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        d = tmp_path_factory.mktemp(arch)
        model.save_pretrained(d)
        out[arch] = d
    return out


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT,
                          input=stdin, timeout=600)


def run_json(*args):
    r = run_cli("run", *args, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_run_reports_predicted_and_measured(tiny_dirs, arch):
    d = run_json("--model", str(tiny_dirs[arch]), "-c", "256", "--prompt-tokens", "40", "--prefill-chunk", "16",
                 "--max-new-tokens", "6", "--quant", "bf16", "--kv-dtype", "bf16")
    for key in ("decode_tokens_per_s", "ttft_s", "peak_vram_bytes", "peak_ram_bytes"):
        assert key in d["predicted"] and key in d["measured"] and key in d["error_pct"]
    m = d["measured"]
    assert m["decode_tokens_per_s"] > 0 and m["ttft_s"] > 0 and m["peak_ram_bytes"] > 50 * 2**20
    assert m["peak_vram_bytes"] is None and d["error_pct"]["peak_vram_bytes"] is None  # no GPU here
    assert m["generated_tokens"] == 6 == len(d["tokens"]) and d["prompt_tokens"] == 40
    assert d["plan"]["choice"]["weight_quant"] == "bf16"
    assert d["error_pct"]["ttft_s"] == pytest.approx(
        100 * (m["ttft_s"] - d["predicted"]["ttft_s"]) / d["predicted"]["ttft_s"])


@pytest.mark.parametrize("quant", ["quanto-int8", "quanto-int4", "bnb-nf4", "bnb-int8"])
def test_run_quantized_on_cpu_agrees_with_bf16(tiny_dirs, quant):
    args = ["--model", str(tiny_dirs["llama"]), "-c", "128", "--prompt-tokens", "24", "--max-new-tokens", "3"]
    ref = run_json(*args, "--quant", "bf16")
    got = run_json(*args, "--quant", quant)
    assert got["plan"]["choice"]["weight_quant"] == quant
    assert got["measured"]["generated_tokens"] == 3
    # random tiny weights give flat logits, so only the first greedy token is compared here;
    # tests/test_runtime_core.py compares logits with justified tolerances
    assert got["tokens"][0] == ref["tokens"][0]


def test_saved_plan_runs_and_foreign_plans_are_refused(tiny_dirs, tmp_path):
    plan_path = tmp_path / "plan.yaml"
    r = run_cli("plan", "--model", str(tiny_dirs["llama"]), "-c", "256", "--save", str(plan_path))
    assert r.returncode == 0, r.stderr
    d = run_json("--model", str(tiny_dirs["llama"]), "--plan", str(plan_path), "--prompt-tokens", "8",
                 "--max-new-tokens", "2")
    assert d["plan"]["choice"] == yaml.safe_load(plan_path.read_text())["choice"]
    # another model
    r = run_cli("run", "--model", str(tiny_dirs["qwen2"]), "--plan", str(plan_path), "--prompt-tokens", "8")
    assert r.returncode == 2 and "made for model" in r.stderr and "Traceback" not in r.stderr
    # another machine
    gpu_plan = tmp_path / "gpu.yaml"
    assert run_cli("plan", "--model", str(tiny_dirs["llama"]), "-c", "256", "-H", "rtx-4090",
                   "--save", str(gpu_plan)).returncode == 0
    r = run_cli("run", "--model", str(tiny_dirs["llama"]), "--plan", str(gpu_plan), "--prompt-tokens", "8")
    assert r.returncode == 2 and "made for hardware" in r.stderr


def test_refusals_are_one_line_exit_2(tiny_dirs, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    cases = [
        ["--model", str(pickled), "--prompt-tokens", "8"],
        ["--model", "qwen2.5-0.5b", "--prompt-tokens", "8"],  # catalog: no weights without --dummy-weights
        ["--model", str(tiny_dirs["llama"]), "--prompt", "hello"],  # no tokenizer saved
        ["--model", str(tiny_dirs["llama"]), "--max-new-tokens", "0"],
        ["--model", str(tiny_dirs["llama"]), "--plan", str(tmp_path / "missing.yaml")],
    ]
    for args in cases:
        r = run_cli("run", *args)
        assert r.returncode == 2, (args, r.stderr[-1500:])
        assert "Traceback" not in r.stderr, args


def test_oom_replans_with_a_lower_budget():
    """The OOM path, without a GPU: a plan for a 24 GiB card and a peak that overshot it."""
    from planner.profiles import resolve_profile
    from planner.request import Request
    from planner.search import plan
    from planner.sources import model_spec
    from runtime.execute import RunReport, _replan_after_oom

    spec = model_spec("llama-3.1-8b")
    hw = resolve_profile("rtx-4090")[0]
    first = plan(spec, hw, Request(context=32768, quant=("bf16",)))
    gpu = first.to_dict()["memory"]["gpu"]
    planned = gpu["total_bytes"] - gpu["headroom_bytes"]
    report = RunReport(plan={}, predicted={}, measured={}, error_pct={})
    peaks = SimpleNamespace(peak_vram_bytes=planned + 6 * 2**30)
    again = _replan_after_oom(first, spec, hw, peaks, "CUDA out of memory", report)
    assert again is not None and again.request.vram_budget_bytes == gpu["capacity_bytes"] - 6 * 2**30
    assert again.choice.gpu_layers < 32  # bf16 was forced: the smaller budget must offload
    assert again.to_dict()["memory"]["gpu"]["total_bytes"] <= again.request.vram_budget_bytes
    assert "prediction wrong by" in report.notes[0] and report.replans
