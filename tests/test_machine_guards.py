"""Guards between vramplan and the machine it runs on: calibrate plans before it loads and refuses another machine's
profile, the cached quick probe expires and says when it could not be cached, and a hub that trickles is cut off."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli as main
from fake_hub import FakeHub
from vramplan.planner.profile_yaml import load_profile
from vramplan.planner.sources import load_spec, resolve_model
from vramplan.runtime import this_machine
from vramplan.runtime.calibrate import CPU_MATRIX, DoesNotFitError, Matrix, check_fits, point_request

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch)


def subprocess_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VRAMPLAN_", "HF_"))}
    env.update(VRAMPLAN_CACHE_DIR=str(tmp_path / "cache"), VRAMPLAN_CONFIG_DIR=str(tmp_path / "config"), **extra)
    return env


def idle(profile):
    """`profile` without the note a busy probe leaves (the shared test machine is often busy)."""
    return profile.replace(notes=tuple(n for n in profile.notes if not n.startswith("measured while the machine")))


def cache_an_idle_probe() -> Path:
    """Probe, and cache the result as if it were taken on an idle machine; the cache file."""
    path = this_machine.store(idle(this_machine.this_machine(refresh=True).profile))
    assert path is not None and this_machine.busy_note(load_profile(path)) is None
    return path


# ---------------------------------------------------------------- 1. calibrate plans every point before loading
def test_calibrate_refuses_a_named_model_that_cannot_fit_before_loading_anything(tmp_path):
    """The audit: `calibrate --models llama-3.1-405b --prompts 16` grew until the OOM killer came. Now it plans first:
    one line naming the model, the scheme, what it needs and what the machine has; exit 1 like run's "nothing fits";
    no torch imported, no load, in about the time of a quick probe."""
    code = ("import sys, time; t = time.perf_counter(); sys.argv = ['vramplan'] + sys.argv[1:]\n"
            "import cli\n"
            "try:\n    cli.main()\n"
            "finally:\n    print('torch' in sys.modules, round(time.perf_counter() - t, 2), file=sys.stdout)\n")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "calibrate", "--models", "llama-3.1-405b", "--prompts", "16"],
                       cwd=ROOT, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: calibrate: meta-llama/Llama-3.1-405B bf16 at a 16-token "
                                                   "prompt does not fit"), r.stderr
    assert "RAM needs" in lines[0] and "> capacity" in lines[0] and "nothing was loaded" in lines[0]
    imported_torch, _ = r.stdout.split()
    assert imported_torch == "False"  # nothing was loaded: not even torch
    assert elapsed < 15  # a quick probe and four plans (about 2 s here); the OOM took minutes


def test_check_fits_keeps_what_fits_and_drops_an_auto_point_that_does_not():
    """The default matrix fits this 2-core CPU machine (qwen2.5-0.5b, llama-3.2-1b up to 4096 tokens) and is kept
    whole; a model of an automatic matrix that does not fit is left out with a warning, not run."""
    here = idle(this_machine.this_machine().profile)
    kept, warnings = check_fits(here, CPU_MATRIX, on_gpu=False)
    assert kept == CPU_MATRIX and warnings == []
    big = Matrix(models=("qwen2.5-0.5b", "llama-3.1-405b"), quants=("bf16", "quanto-int4"), prompts=(64, 1024),
                 new_tokens=8)
    kept, warnings = check_fits(here, big, on_gpu=False)  # named=(): the matrix was not the user's
    assert kept.skip == (("llama-3.1-405b", "bf16"), ("llama-3.1-405b", "quanto-int4"))
    assert len(warnings) == 2 and all("left out of the calibration: meta-llama/Llama-3.1-405B" in w
                                      and "at a 64-token prompt does not fit" in w for w in warnings)
    with pytest.raises(DoesNotFitError, match="405B bf16 at a 64-token prompt") as e:
        check_fits(here, big, named=("qwen2.5-0.5b", "llama-3.1-405b"), on_gpu=False)
    assert e.value.exit_code == 1


def test_a_calibration_point_on_a_gpu_must_hold_every_layer_there():
    """calibrate loads the whole model on the GPU: a point fits only if it fits there, not by offloading."""
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.search import plan

    hw = resolve_profile("rtx-3060-12gb")[0]
    spec = load_spec(resolve_model("llama-3.1-8b"))
    m = Matrix(models=("llama-3.1-8b",), quants=("bf16", "bnb-nf4"), prompts=(512,), new_tokens=8)
    assert plan(spec, hw, point_request(spec, "bf16", 512, m, on_gpu=False)).fits  # offloaded, it would "fit"
    kept, warnings = check_fits(hw, m, on_gpu=True)
    assert kept.skip == (("llama-3.1-8b", "bf16"),) and "GPU needs" in warnings[0]


@pytest.mark.slow
def test_a_model_that_fits_still_calibrates_against_a_profile_saved_here(tmp_path):
    """End to end, a tiny Llama config (calibrate takes a directory with config.json) at a 16-token prompt, with this
    machine's `probe --save` profile (which the same-machine check must accept)."""
    from conftest import tiny_config_dict

    env = subprocess_env(tmp_path)
    tiny = tmp_path / "tiny-llama"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(tiny_config_dict("llama")))
    saved = tmp_path / "here.yaml"
    r = subprocess.run([sys.executable, "cli.py", "probe", "--quick", "--save", str(saved)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "cli.py", "calibrate", "--hardware", str(saved), "--models", str(tiny),
                        "--quants", "bf16", "--prompts", "16", "--new-tokens", "2", "--repeats", "1",
                        "--kv-dtypes", "none", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert {(x["model"], x["quant"], x["prompt"]) for x in result["runs"]} == {(str(tiny), "bf16", 16)}
    assert any(e["backend"] == "torch" for e in result["profile"]["calibration"]["entries"])


# ---------------------------------------------------------------- 2. calibrate refuses another machine's profile
def test_calibrate_refuses_a_profile_of_other_hardware(capsys):
    """`calibrate --hardware h100-sxm` on this CPU machine would store the CPU's fits as an H100's: refused, one line,
    exit 2, naming what differs."""
    code, _, err = main(capsys, "calibrate", "--hardware", "h100-sxm", "--models", "qwen2.5-0.5b")
    assert_one_line_error(code, err)
    line = " ".join(err.split())
    assert "--hardware h100-sxm: its hardware is not this machine's" in line
    assert "GPUs 1x NVIDIA H100 80GB HBM3" in line and "(this machine: no GPU)" in line
    assert "RAM 2.00 TiB" in line and "112 CPU cores" in line


def test_a_profile_saved_here_is_this_machine_and_others_are_not(capsys, tmp_path):
    saved = tmp_path / "here.yaml"
    code, _, err = main(capsys, "probe", "--quick", "--save", str(saved))
    assert code == 0, err
    here = this_machine.this_machine_profile()
    assert this_machine.differences(load_profile(saved), here) == []
    # RAM a little off (the kernel reserves differ between boots) is the same machine; a quarter off is not
    ram = here.host.ram_bytes
    near = here.replace(host=dataclasses.replace(here.host, ram_bytes=int(ram * 0.98)))
    far = here.replace(host=dataclasses.replace(here.host, ram_bytes=int(ram * 0.75)))
    assert this_machine.differences(near, here) == []
    assert [d.split(" (")[0] for d in this_machine.differences(far, here)] == [f"RAM {_gib(int(ram * 0.75))}"]


def _gib(n: int) -> str:
    from vramplan.planner.units import format_bytes

    return format_bytes(n)


# ---------------------------------------------------------------- 3. the cached quick probe expires
def _plan_says(capsys) -> str:
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "--context", "1k", "--json")
    assert code == 0, err
    return next(ln for ln in err.splitlines() if ln.startswith("hardware: this machine"))


def test_a_young_idle_cache_is_used_as_it_is(capsys):
    path = cache_an_idle_probe()
    before = path.read_bytes()
    said = _plan_says(capsys)
    assert f"quick probe cached in {path}" in said and "taken now" not in said
    assert path.read_bytes() == before


def test_an_old_cached_probe_is_measured_again(capsys):
    path = cache_an_idle_probe()
    eight_days_ago = time.time() - 8 * 86400
    os.utime(path, (eight_days_ago, eight_days_ago))
    said = _plan_says(capsys)
    assert "quick probe taken now (the cached one was 8.0 days old (limit 7 days" in said, said
    assert f"cached in {path}" in said
    assert time.time() - path.stat().st_mtime < 60  # the cache holds the new probe


def test_the_max_age_can_be_set_in_days(capsys, monkeypatch):
    path = cache_an_idle_probe()
    two_days_ago = time.time() - 2 * 86400
    os.utime(path, (two_days_ago, two_days_ago))
    assert "taken now" not in _plan_says(capsys)
    monkeypatch.setenv("VRAMPLAN_PROBE_MAX_AGE_DAYS", "1")
    assert "the cached one was 2.0 days old (limit 1 days" in _plan_says(capsys)
    monkeypatch.setenv("VRAMPLAN_PROBE_MAX_AGE_DAYS", "soon")
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "-c", "1k")
    assert_one_line_error(code, err)
    assert "VRAMPLAN_PROBE_MAX_AGE_DAYS='soon'" in err


def test_a_probe_cached_before_the_fp32_and_int8_figures_is_measured_again(capsys):
    path = cache_an_idle_probe()
    old = load_profile(path)
    this_machine.store(old.replace(host=dataclasses.replace(old.host, cpu_fp32_flops=None, cpu_int8_ops=None),
                                   notes=tuple(n for n in old.notes if not n.startswith("CPU fp32"))))
    said = _plan_says(capsys)
    assert "quick probe taken now (the cached one predates the CPU's fp32 and int8 matmul figures" in said, said
    assert "CPU fp32 compute" in path.read_text()  # the new probe's note
    assert "taken now" not in _plan_says(capsys)  # and it is used from then on


def test_a_probe_cached_while_busy_is_measured_again(capsys):
    path = cache_an_idle_probe()
    busy = load_profile(path)
    busy = busy.replace(notes=busy.notes + ("measured while the machine was busy (load average 9.00 on 2 cores): the "
                                            "RAM bandwidth and CPU compute measured may be low; measure again when it "
                                            "is idle",))
    this_machine.store(busy)
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    said = _plan_says(capsys)
    assert "quick probe taken now (the cached one was taken while the machine was busy, 60 min ago" in said, said
    assert "load average 9.00" not in path.read_text()  # replaced by the new probe
    assert time.time() - path.stat().st_mtime < 60


def test_a_busy_probe_is_used_with_a_warning_until_it_is_old_enough_to_retry(capsys):
    """On a machine that stays busy, probing for every plan would cost each a second: a busy probe is retried only
    after BUSY_PROBE_RETRY_S; until then it is used, and the warning says it was taken under load."""
    path = cache_an_idle_probe()
    busy = load_profile(path)
    this_machine.store(busy.replace(notes=busy.notes + ("measured while the machine was busy (load average 9.00 on 2 "
                                                        "cores): measure again when it is idle",)))
    code, _, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "--context", "1k", "--json")
    assert code == 0, err
    assert f"quick probe cached in {path}" in err and "taken now" not in err
    assert "warning: this machine's cached probe was measured while the machine was busy (load average 9.00" in err


def test_an_unwritable_cache_still_plans_and_says_it_did_not_cache(capsys, monkeypatch, tmp_path):
    """Tests run as root, whom chmod does not stop: the cache directory lies under a regular file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(blocker / "cache"))
    code, out, err = main(capsys, "plan", "--model", "qwen2.5-0.5b", "--context", "1k", "--json")
    assert code == 0, err
    assert json.loads(out)["fits"] is True
    said = next(ln for ln in err.splitlines() if ln.startswith("hardware: this machine"))
    assert "quick probe taken now" in said and "not cached:" in said and "Not a directory" in said, said
    assert "cached in" not in said


# ---------------------------------------------------------------- 4. a trickling hub is cut off
class TricklingHub(FakeHub):
    """The fake hub, except that GET of one file answers its headers, then one byte every `interval_s` for ever
    (until the client hangs up, the hub is closed, or `give_up_s` passes: the handler thread ends by itself)."""

    def __init__(self, trickled: str, interval_s: float = 0.5, give_up_s: float = 60.0) -> None:
        super().__init__()
        self.trickled, self.interval_s, self.give_up_s = trickled, interval_s, give_up_s
        self.closing = threading.Event()
        self.trickle_started = threading.Event()
        self.trickle_ended = threading.Event()

    def __exit__(self, *exc) -> None:
        self.closing.set()
        super().__exit__(*exc)

    def _resolve(self, h, req, repo_id, rev, filename, head) -> None:
        if head or filename != self.trickled:
            return super()._resolve(h, req, repo_id, rev, filename, head)
        self.trickle_started.set()
        try:
            repo = self.repos[repo_id]
            h.send_response(200)
            h.send_header("X-Repo-Commit", repo.sha)
            h.send_header("Content-Length", str(10**9))
            h.end_headers()
            t0 = time.monotonic()
            while not self.closing.is_set() and time.monotonic() - t0 < self.give_up_s:
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(self.interval_s)
        except OSError:  # the client hung up (BrokenPipeError, ConnectionResetError)
            req.aborted = True
        finally:
            self.trickle_ended.set()


def test_a_hub_that_trickles_is_cut_off_at_the_deadline(tmp_path):
    """config.json arrives one byte every 0.5 s for ever: a socket read timeout never fires. The CLI ends with one
    line within the deadline (2 s here, from the environment) plus its own start-up, and the server's handler thread
    stops once the CLI is gone."""
    from test_hub import llama_files

    files, _ = llama_files()
    deadline_s = 2.0
    with TricklingHub("config.json") as hub:
        hub.add("acme/tiny-llama", files)
        env = subprocess_env(tmp_path, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"),
                             HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                             VRAMPLAN_HUB_DEADLINE_S=str(deadline_s))
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "cli.py", "plan", "--model", "acme/tiny-llama", "-H", "rtx-4090"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        elapsed = time.perf_counter() - t0
        assert hub.trickle_started.is_set()
        assert r.returncode == 2, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert (f"error: cannot reach the Hugging Face hub at {hub.url} for acme/tiny-llama/config.json (Timeout: no "
                "complete answer within 2 s; $VRAMPLAN_HUB_DEADLINE_S changes the limit)" in lines[0]), lines[0]
        assert elapsed < deadline_s + 8  # start-up (imports) and the model info on a busy 2-core machine
        assert hub.trickle_ended.wait(5)  # the client hung up: the handler thread is gone without any help


def test_the_hub_deadline_env_must_be_a_positive_number(tmp_path):
    r = subprocess.run([sys.executable, "cli.py", "plan", "--model", "acme/none", "-H", "rtx-4090"], cwd=ROOT,
                       env=subprocess_env(tmp_path, VRAMPLAN_HUB_DEADLINE_S="0", HF_HOME=str(tmp_path / "hf"),
                                          HF_ENDPOINT="http://127.0.0.1:9"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "VRAMPLAN_HUB_DEADLINE_S='0': expected a number of seconds > 0" in r.stderr


def test_probe_says_when_it_could_not_refresh_the_cache(capsys, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(blocker / "cache"))
    code, _, err = main(capsys, "probe", "--quick", "--json")
    assert code == 0, err
    assert "this machine's cached profile not refreshed:" in err and "Not a directory" in err
    assert "refreshed: " not in err.replace("not refreshed: ", "")
