"""`run` on real (tiny) transformers models saved with save_pretrained: the runtime in-process against one
shared bf16 reference, and the command line end to end (smoke tests, signals, refusals)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vramplan.planner.errors import PlanError, VramplanError  # noqa: E402
from conftest import run_profile  # noqa: E402
from vramplan.planner.profiles import resolve_profile  # noqa: E402
from vramplan.planner.request import Request  # noqa: E402
from vramplan.planner.search import plan  # noqa: E402
from vramplan.planner.sources import load_spec, resolve_model  # noqa: E402
from vramplan.runtime.execute import RunReport, execute  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HW = run_profile()  # a CPU-only profile within this machine: plans run on this machine's CPU whatever it is

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


def run_here(model_dir, *, context=256, prompt_tokens=24, new_tokens=4, **req) -> RunReport:
    source = resolve_model(str(model_dir))
    spec = load_spec(source)
    hw = resolve_profile(HW)[0]
    p = plan(spec, hw, Request(context=context, **req))
    assert p.fits, p.reasons
    return execute(p, spec, hw, source, dummy_weights=False, prompt_text=None, prompt_tokens=prompt_tokens,
                   max_new_tokens=new_tokens)


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """The bf16 run every quantized one is compared with (computed once)."""
    return run_here(tiny_dirs["llama"], quant=("bf16",), kv_dtype=("bf16",))


@pytest.mark.parametrize("arch", sorted(TINY))
def test_run_reports_predicted_and_measured(tiny_dirs, arch):
    r = run_here(tiny_dirs[arch], prompt_tokens=40, new_tokens=6, prefill_chunk=16, quant=("bf16",),
                 kv_dtype=("bf16",))
    m, d = r.measured, r.to_dict()
    assert m.decode_tokens_per_s > 0 and m.ttft_s > 0 and m.peak_ram_bytes > 50 * 2**20
    assert m.peak_vram_bytes is None and r.error_pct["peak_vram_bytes"] is None  # no GPU here
    assert m.generated_tokens == 6 == len(r.tokens) and r.prompt_tokens == 40
    assert r.plan.choice.weight_quant == "bf16" and not r.interrupted
    assert r.error_pct["ttft_s"] == pytest.approx(100 * (m.ttft_s - r.predicted.ttft_s) / r.predicted.ttft_s)
    assert m.load_average_1m is None or m.load_average_1m >= 0
    # the JSON contract, and a round trip
    for key in ("decode_tokens_per_s", "ttft_s", "peak_vram_bytes", "peak_ram_bytes"):
        assert key in d["predicted"] and key in d["measured"] and key in d["error_pct"]
    assert RunReport.from_dict(json.loads(json.dumps(d))).to_dict() == d


@pytest.mark.parametrize("quant", ["quanto-int8", "quanto-int4", "bnb-nf4", "bnb-int8"])
def test_run_quantized_on_cpu_agrees_with_bf16(tiny_dirs, reference, quant):
    got = run_here(tiny_dirs["llama"], quant=(quant,), kv_dtype=("bf16",))
    assert got.plan.choice.weight_quant == quant and got.measured.generated_tokens == 4
    # random tiny weights give flat logits, so only the first greedy token is compared here;
    # tests/test_runtime_core.py compares logits with justified tolerances
    assert got.tokens[0] == reference.tokens[0]


def test_an_interrupted_run_keeps_what_it_measured(tiny_dirs, monkeypatch):
    from vramplan.runtime import execute as ex

    real = ex._Streamer.push
    seen = []

    def push(self, token_id):
        real(self, token_id)
        seen.append(token_id)
        if len(seen) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(ex._Streamer, "push", push)
    r = run_here(tiny_dirs["llama"], new_tokens=50, quant=("bf16",), kv_dtype=("bf16",))
    assert r.interrupted and r.stopped_reason == "interrupted"
    assert r.tokens == seen and r.measured.generated_tokens == 3
    assert r.measured.decode_tokens_per_s > 0 and r.measured.peak_ram_bytes > 0
    assert any("interrupted" in n for n in r.notes)


def test_the_context_is_enforced_before_loading(tiny_dirs, monkeypatch):
    from vramplan.runtime import load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("loaded despite the context"))
    with pytest.raises(VramplanError, match="more than the plan's context of 64"):
        run_here(tiny_dirs["llama"], context=64, prompt_tokens=80)
    with pytest.raises(VramplanError, match=r"plus 100000 new tokens exceed the plan's context"):
        run_here(tiny_dirs["llama"], context=256, prompt_tokens=8, new_tokens=100000)


def test_oom_replans_with_a_lower_budget():
    """The OOM path, without a GPU: a plan for a 24 GiB card and a peak that overshot it."""
    from vramplan.planner.sources import model_spec
    from vramplan.runtime.execute import Measured, _replan_after_oom

    spec = model_spec("llama-3.1-8b")
    hw = resolve_profile("rtx-4090")[0]
    first = plan(spec, hw, Request(context=32768, quant=("bf16",)))
    gpu = first.memory.gpu
    planned = gpu.total_bytes - gpu.headroom_bytes
    report = RunReport(plan=first, measured=Measured(peak_vram_bytes=planned + 6 * 2**30))
    again = _replan_after_oom(report, spec, hw, "CUDA out of memory")
    assert again is not None and again.request.vram_budget_bytes == gpu.capacity_bytes - 6 * 2**30
    assert again.choice.gpu_layers < 32  # bf16 was forced: the smaller budget must offload
    assert again.memory.gpu.total_bytes <= again.request.vram_budget_bytes
    assert "prediction wrong by" in report.notes[0] and report.replans and not report.errors  # survived: no error
    # another process took memory the profile promised: the budget drops to what the device has free
    report = RunReport(plan=first, measured=Measured(peak_vram_bytes=planned + 2**30))
    again = _replan_after_oom(report, spec, hw, "CUDA out of memory", free_bytes=6 * 2**30)
    assert again.request.vram_budget_bytes == 6 * 2**30 + gpu.cuda_context_bytes
    assert "free now, measured" in report.replans[0]["reason"]


# ---------------------------------------------------------------- the command line
def run_cli(*args, stdin=None, **kw):
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT,
                          input=stdin, timeout=600, **kw)


def test_cli_run_streams_reports_and_saves(tiny_dirs, tmp_path):
    out = tmp_path / "run.json"
    r = run_cli("run", "--model", str(tiny_dirs["llama"]), "-c", "128", "--prompt-tokens", "16",
                "--max-new-tokens", "3", "--quant", "bf16", "-H", HW, "--save", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "predicted vs measured" in r.stderr and len(r.stdout.split()) == 3  # three token ids streamed
    saved = json.loads(out.read_text())
    assert saved["measured"]["generated_tokens"] == 3 and saved["interrupted"] is False


def test_cli_saved_plan_runs_and_foreign_plans_are_refused(tiny_dirs, tmp_path):
    plan_path = tmp_path / "plan.yaml"
    r = run_cli("plan", "--model", str(tiny_dirs["llama"]), "-c", "256", "-H", HW, "--save", str(plan_path))
    assert r.returncode == 0, r.stderr
    r = run_cli("run", "--model", str(tiny_dirs["llama"]), "--plan", str(plan_path), "-H", HW, "--prompt-tokens", "8",
                "--max-new-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["plan"]["choice"] == yaml.safe_load(plan_path.read_text())["choice"]
    r = run_cli("run", "--model", str(tiny_dirs["qwen2"]), "--plan", str(plan_path), "-H", HW, "--prompt-tokens", "8")
    assert r.returncode == 2 and "made for model" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("run", "--model", str(tiny_dirs["llama"]), "--plan", str(plan_path), "-H", "rtx-4090",
                "--prompt-tokens", "8")  # a profile of another machine: refused before anything loads
    assert r.returncode == 2 and "--hardware rtx-4090 describes more than this machine has" in r.stderr
    other = tmp_path / "other.yaml"  # a plan for another machine (the shipped profile's hardware fingerprint)
    r = run_cli("plan", "--model", str(tiny_dirs["llama"]), "-c", "256", "-H", "cpu-ddr5-desktop", "--save", str(other))
    assert r.returncode == 0, r.stderr
    r = run_cli("run", "--model", str(tiny_dirs["llama"]), "--plan", str(other), "-H", HW, "--prompt-tokens", "8")
    assert r.returncode == 2 and "made for hardware 'cpu-ddr5-desktop'" in r.stderr, r.stderr
    r = run_cli("run", "--model", str(tiny_dirs["llama"]), "--plan", str(plan_path), "-H", HW, "--quant", "bf16",
                "--context", "1k")
    assert r.returncode == 2 and "--plan fixes the configuration; drop --context, --quant" in r.stderr


def test_cli_sigterm_reports_and_saves_what_it_measured(tmp_path):
    out = tmp_path / "run.json"
    # a real size (dummy weights), so that the run is still generating when the signal comes
    proc = subprocess.Popen([sys.executable, "cli.py", "run", "--model", "qwen2.5-0.5b", "--dummy-weights", "-c", "1k",
                             "--prompt-tokens", "8", "--max-new-tokens", "1000", "--quant", "bf16", "-H", HW,
                             "--json", "--save", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    head = []
    for line in proc.stderr:  # progress lines: wait until generation has started
        head.append(line)
        if "prefill" in line:
            break
    time.sleep(2)  # a few tokens in
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, ("".join(head) + stderr)[-2000:]
    d = json.loads(stdout)
    assert d["interrupted"] is True and d["stopped_reason"] == "interrupted"
    assert json.loads(out.read_text())["tokens"] == d["tokens"]
    assert d["measured"]["peak_ram_bytes"] > 0


@pytest.mark.parametrize("args", [
    ["--model", "qwen2.5-0.5b", "--prompt-tokens", "8"],  # catalog: no weights without --dummy-weights
    ["--model", "{llama}", "--prompt", "hello"],  # no tokenizer saved
    ["--model", "{llama}", "--max-new-tokens", "0"],
    ["--model", "{llama}", "--temperature", "nan"],
    ["--model", "{llama}", "--plan", "{tmp}/missing.yaml"],
    ["--model", "{llama}", "--plan", "{tmp}/nothing.yaml"],
    ["--model", "{llama}", "--plan", "{tmp}/edited.yaml"],
    ["--model", "{llama}", "-c", "64", "--prompt-tokens", "80"],
    ["--model", "{llama}", "-c", "256", "--prompt-tokens", "8", "-n", "100000"],
    ["--model", "{llama}", "--prompt-tokens", "8", "--save", "{tmp}"],  # a directory
    ["--model", "{llama}", "--prompt-tokens", "8", "--save", "{tmp}/file.txt/run.json"],  # under a file
    ["--model", "{pickled}", "--prompt-tokens", "8"],
])
def test_cli_refusals_are_one_line_exit_2(tiny_dirs, tmp_path, args):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    (tmp_path / "file.txt").write_text("x")
    spec = load_spec(resolve_model(str(tiny_dirs["llama"])))
    nothing = plan(spec, resolve_profile(HW)[0], Request(context=256, ram_budget_bytes=1024))
    assert not nothing.fits
    (tmp_path / "nothing.yaml").write_text(yaml.safe_dump(nothing.to_dict()))
    good = plan(spec, resolve_profile(HW)[0], Request(context=256)).to_dict()
    good["choice"]["weight_quant"] = "int3"
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(good))
    args = [a.format(llama=tiny_dirs["llama"], tmp=tmp_path, pickled=pickled) for a in args]
    r = run_cli("run", *args, "-H", HW)
    assert r.returncode == 2, (args, r.stderr[-1500:])
    assert "Traceback" not in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error:")]) == 1
    assert not list(tmp_path.glob(".*.tmp")) and not (tmp_path / "run.json").exists()


def test_load_plan_refuses_what_cannot_run(tmp_path):
    from vramplan.planner.plan import load_plan

    (tmp_path / "deep.yaml").write_text("[" * 5000 + "]" * 5000)
    (tmp_path / "dup.yaml").write_text("schema_version: 1\nschema_version: 1\n")
    for name in ("deep.yaml", "dup.yaml"):
        with pytest.raises(PlanError):
            load_plan(tmp_path / name)
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "absent.yaml")
