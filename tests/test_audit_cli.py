"""The hostile audit's findings in the command line and the engines' rows (issue 36): a false "fits", saving over an
input, a run on another machine's profile, exit codes with closed or full streams, the Python API's errors, and the
exports of a local model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error, isolate, run_cli
from conftest import run_profile
from vramplan.planner.errors import PlanError
from vramplan.planner.published_scheme import published_scheme
from vramplan.planner.modelspec import Role
from vramplan.planner.profiles import list_profiles, resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import catalog, model_spec

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "planner" / "catalog" / "Qwen--Qwen2.5-0.5B.json"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


# ---------------------------------------------------------------- the transformers row over RAM (HIGH 4)
def test_the_transformers_plan_counts_bitsandbytes_cpu_modules_unquantized(capsys):
    """Plain transformers' own search: a bitsandbytes split of Llama-3.1-70B over a 4090 keeps the CPU-mapped layers
    in bf16, so it fits only with few of them (or not at all); whatever its row chose stays within the 64 GiB."""
    from vramplan.planner.engines.hf_transformers import transformers_plan

    spec, hw = model_spec("llama-3.1-70b"), resolve_profile("rtx-4090")[0]
    p = transformers_plan(spec, hw, Request(context=8192, quant=("bnb-nf4",), engine="transformers"))
    refused = [c for c in p.candidates if not c.fits and "unquantized (bf16): RAM needs" in c.reason]
    assert refused or not p.fits
    if p.fits and p.choice.gpu_layers < p.choice.total_layers:
        assert _bf16_ram_of_cpu_modules(spec, p.choice) <= hw.host.ram_bytes
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-70b", "--context", "8k", "-H", "rtx-4090",
                             "--emit", "transformers")
    assert "transformers' bitsandbytes offload keeps the CPU-mapped modules unquantized" in out or code == 1


def _bf16_ram_of_cpu_modules(spec, choice) -> int:
    """Counted from the tensors alone: 2 bytes a parameter of every tensor of a CPU-mapped decoder layer, and of the
    routed experts kept in RAM of the resident ones."""
    in_ram = set(choice.expert_layers_in_ram)
    total = 0
    for t in spec.tensors:
        if t.layer is None or not t.is_parameter:
            continue
        if t.layer >= choice.gpu_layers or (t.role is Role.EXPERT and t.layer in in_ram):
            total += t.numel * 2
    return total


MODELS = [e.id for e in catalog()]
PROFILES = [e.name for e in list_profiles() if e.profile is not None]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), profile=st.sampled_from(PROFILES),
       context=st.sampled_from([4096, 8192, 32768, 131072]),
       quant=st.sampled_from([None, "bnb-nf4", "bnb-int8", "bnb-nf4-dq"]))
def test_no_transformers_plan_fits_over_ram_with_bitsandbytes_offload(model, profile, context, quant):
    from vramplan.planner.engines.hf_transformers import transformers_plan

    spec, hw = model_spec(model), resolve_profile(profile)[0]
    if quant and hw.accelerator != "cuda":  # bitsandbytes runs on CUDA here: a forced bnb scheme elsewhere is refused
        return
    if quant and published_scheme(spec) is not None:  # a published checkpoint keeps its format: another is refused
        with pytest.raises(PlanError, match="planned as stored"):
            transformers_plan(spec, hw, Request(context=context, quant=(quant,), engine="transformers"))
        return
    p = transformers_plan(spec, hw, Request(context=context, quant=(quant,) if quant else (), engine="transformers",
                                            allow_context_overflow=True))
    if not (p.fits and p.choice.weight_quant.startswith("bnb-") and p.choice.on_gpu):
        return
    c = p.choice
    if c.gpu_layers == c.total_layers and not c.expert_layers_on_cpu:
        return
    assert _bf16_ram_of_cpu_modules(spec, c) <= p.memory.cpu.capacity_bytes


# ---------------------------------------------------------------- saving over an input, however it was named (HIGH 6)
def _own_profile(tmp_path: Path, name: str = "mine") -> Path:
    """A profile in the user's profile directory (isolate's $VRAMPLAN_CONFIG_DIR/profiles), found by name."""
    d = tmp_path / "config" / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "profiles" / "rtx-4090.yaml").read_text().replace("name: rtx-4090", f"name: {name}")
    (d / f"{name}.yaml").write_text(text)
    return d / f"{name}.yaml"


@pytest.mark.parametrize("how", ["path", "symlink", "dotdot"])
def test_save_never_replaces_the_profile_the_plan_read(capsys, tmp_path, how):
    profile = _own_profile(tmp_path)
    before = profile.read_text()
    target = {"path": profile, "dotdot": profile.parent / ".." / "profiles" / profile.name}.get(how)
    if how == "symlink":
        target = tmp_path / "link.yaml"
        target.symlink_to(profile)
    for hardware in ("mine", str(profile)):  # named by name, and by path
        code, _, err = run_cli(capsys, "plan", "--model", "qwen2.5-0.5b", "-H", hardware, "--save", target)
        assert "is also the --hardware input" in assert_one_line_error(code, err)
    assert profile.read_text() == before


# ---------------------------------------------------------------- run on another machine's profile (MEDIUM 3)
@pytest.mark.parametrize("engine", ["vramplan", "llama.cpp"])
def test_run_refuses_a_profile_with_more_than_this_machine_has(tmp_path, engine):
    """Refused in one line before anything loads: no torch imported, no llama-server started."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # never read: the hardware is refused first
    extra = ("--gguf", str(gguf), "--llama-server", "/nonexistent/llama-server") if engine == "llama.cpp" else ()
    code = ("import sys, cli\n"
            "try:\n"
            "    cli.main(sys.argv[1:])\n"
            "finally:\n"
            "    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code, "run", "--model", "qwen2.5-0.5b", "--dummy-weights", "-H",
                        "h100-sxm", "--engine", engine, "--prompt-tokens", "8", *extra], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "VRAMPLAN_CACHE_DIR": str(tmp_path / "cache")})
    msg = assert_one_line_error(r.returncode, r.stderr)
    assert "--hardware h100-sxm describes more than this machine has" in msg and "NVIDIA H100" in msg
    assert "torch imported: False" in r.stderr


def test_a_profile_within_this_machine_is_taken(capsys):
    """Less than this machine has (a CPU-only profile, less RAM) plans a run; the refusal is about the plan itself."""
    code, _, err = run_cli(capsys, "run", "--model", "qwen2.5-0.5b", "--dummy-weights", "-H", run_profile(),
                           "--expert-placement", "2", "--prompt-tokens", "8")
    assert "has no GPU" in assert_one_line_error(code, err)


# ---------------------------------------------------------------- exit codes with closed or full streams (MEDIUM 6-7)
def _vramplan(tmp_path, *argv, **kw) -> subprocess.Popen:
    env = {**os.environ, "VRAMPLAN_CACHE_DIR": str(tmp_path / "cache"), "VRAMPLAN_CONFIG_DIR": str(tmp_path / "cfg")}
    return subprocess.Popen([sys.executable, "-m", "vramplan", *argv], cwd=tmp_path, env=env, **kw)


def test_a_reader_that_closes_stdout_keeps_nothing_fits_exit_1(tmp_path):
    p = _vramplan(tmp_path, "plan", "--model", "llama-3.1-405b", "-H", "rtx-3060-12gb", "--ram-budget", "8GiB",
                  "--all", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # `| head -1`
    assert p.wait(timeout=60) == 1
    assert b"Traceback" not in p.stderr.read()


def test_a_full_stderr_does_not_change_the_exit_code(tmp_path):
    with open("/dev/full", "w") as full:
        fits = _vramplan(tmp_path, "plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090", stdout=subprocess.DEVNULL,
                         stderr=full)
        bad = _vramplan(tmp_path, "plan", "--model", "qwen2.5-0.5b", "-H", "no-such-profile",
                        stdout=subprocess.DEVNULL, stderr=full)
        assert fits.wait(timeout=60) == 0 and bad.wait(timeout=60) == 2


@pytest.mark.parametrize("value, traceback", [("0", False), ("no", False), ("off", False), ("false", False),
                                              ("1", True), ("yes", True)])
def test_vramplan_debug_zero_is_off(tmp_path, value, traceback):
    r = subprocess.run([sys.executable, "-m", "vramplan", "plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090",
                        "--context", "lots"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "VRAMPLAN_DEBUG": value, "VRAMPLAN_CACHE_DIR": str(tmp_path)})
    assert r.returncode != 0 and ("Traceback" in r.stderr) is traceback


def test_sigterm_during_start_up_is_an_interrupt(tmp_path):
    """SIGTERM while the CLI is still importing: exit 130 and "interrupted", as Ctrl-C, not SIGTERM's 143."""
    import signal
    import time

    p = _vramplan(tmp_path, "plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090", stdout=subprocess.DEVNULL,
                  stderr=subprocess.PIPE, text=True)
    # wait until vramplan's own code runs (its SIGTERM handler is the first thing console() sets), then signal
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and p.poll() is None:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            break
        caught = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            break
        time.sleep(0.002)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 130 and "interrupted" in p.stderr.read()


# ---------------------------------------------------------------- the Python API (MEDIUM 12)
@pytest.mark.parametrize("call", [
    lambda v: v.plan(None, "rtx-4090"), lambda v: v.plan("qwen2.5-0.5b", 5), lambda v: v.model(5),
    lambda v: v.hardware(5), lambda v: v.plan("qwen2.5-0.5b", "rtx-4090", context=[1]),
    lambda v: v.plan("qwen2.5-0.5b", "rtx-4090", quant=5), lambda v: v.plan("qwen2.5-0.5b", "rtx-4090", nope=1),
    lambda v: v.model("qwen2.5-0.5b", revision=3)])
def test_the_python_api_raises_its_own_errors(call):
    import vramplan
    from vramplan.planner.errors import VramplanError

    with pytest.raises(VramplanError):
        call(vramplan)


# ---------------------------------------------------------------- small refusals (LOW)
@pytest.mark.parametrize("argv, says", [
    (["--prefer", ""], "--prefer is empty"), (["--offload", " "], "--offload is empty"),
    (["--engine", ""], "--engine is empty"),
    (["--expert-placement", "\u0663"], "--expert-placement must be gpu or cpu"),
    (["-q", "quanto-w8a8"], "quanto-w8a8 does not run on cuda"),
    (["--vram-budget", "1PiB"], "exceeds the GPU's 23.99 GiB"), (["--vram-budget", "2PiB"], "max 1 PiB"),
])
def test_refused_in_one_line_exit_2(capsys, argv, says):
    model = "qwen3-30b-a3b" if "--expert-placement" in argv else "qwen2.5-0.5b"
    code, _, err = run_cli(capsys, "plan", "--model", model, "-H", "rtx-4090", *argv)
    assert says in assert_one_line_error(code, err)


@pytest.mark.parametrize("argv, ngl, cpu_moe", [(["--model", "llama-3.1-8b", "--gpu-layers", "10"], "11", None),
                                                (["--model", "qwen3-30b-a3b", "--expert-placement", "5"], None, "5")])
def test_emit_llama_cpp_keeps_a_forced_placement(capsys, argv, ngl, cpu_moe):
    code, out, err = run_cli(capsys, "plan", *argv, "-H", "rtx-4090", "--emit", "llama.cpp", "--json")
    assert code == 0, err
    argv = json.loads(out)["emit"]["details"]["argv"]
    if ngl:
        assert argv[argv.index("-ngl") + 1] == ngl
    if cpu_moe:
        assert argv[argv.index("--n-cpu-moe") + 1] == cpu_moe


def test_a_plan_for_other_hardware_names_both_profiles(capsys, tmp_path):
    saved = tmp_path / "p.yaml"
    assert run_cli(capsys, "plan", "--model", "qwen2.5-0.5b", "-H", "cpu-ddr5-desktop", "--save", saved)[0] == 0
    code, _, err = run_cli(capsys, "run", "--model", "qwen2.5-0.5b", "--dummy-weights", "-H", run_profile(),
                           "--plan", saved, "--prompt-tokens", "8")
    msg = assert_one_line_error(code, err)
    assert "made for hardware 'cpu-ddr5-desktop'" in msg and "not for 'cpu-ddr5-desktop-here'" in msg
    assert "this machine" not in msg


def test_the_ollama_plan_counts_the_prompt_cache_ollama_lets_grow(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--context", "8k",
                             "--emit", "ollama", "--json")
    assert code == 0, err
    e = json.loads(out)["emit"]
    assert e["constants"]["prompt_cache_bytes"]["value"] == 8 << 30
    ram = e["details"]["plan"]["memory"]["cpu"]
    assert ram["total_bytes"] >= 8 << 30 and ram["free_bytes"] >= 0


def test_probe_save_says_how_to_use_the_file_quoted(capsys, tmp_path):
    target = tmp_path / "my box$(x).yaml"
    code, _, err = run_cli(capsys, "probe", "--quick", "--save", target)
    assert code == 0, err
    assert f"--hardware '{target}'" in err


def test_an_unknown_calibration_backend_is_refused(capsys, tmp_path):
    text = (ROOT / "bench" / "results" / "profile-cpu-dev-calibrated.yaml").read_text()
    first = text.index("backend: ", text.index("entries:"))
    name = text[first:].split("\n", 1)[0].split(": ", 1)[1]
    bad = tmp_path / "typo.yaml"
    bad.write_text(text[:first] + "backend: quantoo" + text[first + len("backend: ") + len(name):])
    code, _, err = run_cli(capsys, "profiles", "validate", bad)
    assert code == 1 and "unknown calibration backend 'quantoo'" in err
