"""vramplan's llama.cpp rules against what a real llama-server reported when it ran vramplan's exported commands
(bench/llamacpp_serve.py, committed as bench/results/llamacpp-serve-cpu-dev.json: thirteen runs of five models on a CPU
build), and its speed against the same runs with the efficiencies `--fit` fitted to them.

The predictions are recomputed from the rules as they are now, so a change to the rules that drifts from what
llama.cpp does fails here."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from vramplan.planner.architectures import spec_from_config
from vramplan.planner.engines import llamacpp_rules as rules
from vramplan.planner.engines.llamacpp import (LLAMA_CPP_BACKENDS, SPEED_LABEL, llama_server_command, plan_llamacpp,
                                               speed_hardware)
from vramplan.planner.engines.llamacpp_fit import ServerRun, fit_llamacpp, with_llamacpp_calibration
from vramplan.planner.profile_yaml import load_profile
from vramplan.planner.request import Request
from vramplan.planner.units import MiB

ROOT = Path(__file__).resolve().parents[1]
RESULTS = json.loads((ROOT / "bench" / "results" / "llamacpp-serve-cpu-dev.json").read_text())
HW = load_profile(ROOT / "bench" / "results" / RESULTS["profile"])
# llama.cpp logs buffer sizes in MiB with two decimals
LOGGED = 0.005 * MiB
# The compute buffer is an estimate (llama.cpp sizes it by allocating its graph): never under, at most this much over
# (measured 2-11 % over on the 13 runs).
COMPUTE_OVER_MAX = 0.12
# RAM: never under the working set (peak RSS less the stale mapped pages of the repacked tensors), at most this much
# over (or the process base itself, on a small model).
RAM_OVER_MAX = 0.15


def _case(name: str):
    r = RESULTS["cases"][name]
    spec = spec_from_config(r["config"], name=r["model"])
    req = Request(context=r["context"], batch=r["batch"], prompt_tokens=r["prompt_tokens"], engine="llama.cpp",
                  quant=(r["file_type"],), kv_dtype=(r["kv_type"],))
    return r, spec, req


def _buffers(r: dict, kind: str) -> float:
    return sum(v for k, v in r["measured"]["buffers_mib"].items() if k.endswith(f" {kind}")) * MiB


@pytest.mark.parametrize("name", list(RESULTS["cases"]))
def test_the_measured_command_is_what_the_export_writes(name):
    r, spec, req = _case(name)
    assert llama_server_command(spec, plan_llamacpp(spec, HW, req)) == r["exported_command"]


@pytest.mark.parametrize("name", list(RESULTS["cases"]))
def test_kv_and_output_buffers_are_exact(name):
    """Gemma-2's window layers included: llama-server's 4 auto slots share the pool, so they keep 4 windows."""
    r, spec, req = _case(name)
    slots = rules.llama_server_slots(req)
    assert abs(sum(rules.kv_bytes_per_layer(spec, r["kv_type"], req)) - _buffers(r, "KV")) <= LOGGED
    assert abs(rules.output_buffer_bytes(spec, slots) - _buffers(r, "output")) <= LOGGED


@pytest.mark.parametrize("name", list(RESULTS["cases"]))
def test_compute_buffer_estimate_is_a_close_upper_bound(name):
    r, spec, req = _case(name)
    predicted, measured = rules.compute_buffer_bytes(spec, req, with_logits=True), _buffers(r, "compute")
    assert measured <= predicted <= measured * (1 + COMPUTE_OVER_MAX)


@pytest.mark.parametrize("name", list(RESULTS["cases"]))
def test_planned_ram_covers_the_working_set(name):
    """The plan's RAM (the GGUF tensors once, even a tied output; KV; compute and output buffers; the process) against
    the server's peak RSS after its first prompt (before its prompt cache holds anything) less the page cache the
    repacked tensors left behind."""
    r, spec, req = _case(name)
    cpu = plan_llamacpp(spec, HW, req).chosen.memory.cpu
    predicted = cpu.weights_bytes + cpu.kv_cache_bytes + cpu.workspace_bytes + cpu.runtime_base_bytes
    m = r["measured"]
    working_set = m["runs"][0]["rss"]["VmHWM"] - m["buffers_mib"].get("CPU_REPACK model", 0) * MiB
    slack = max(working_set * RAM_OVER_MAX, rules.PROCESS_BASE_RAM_CPU_BUILD)
    assert working_set <= predicted <= working_set + slack


# ---------------------------------------------------------------- speed
def _runs(names) -> list[ServerRun]:
    runs = []
    for name in names:
        r, spec, _ = _case(name)
        for run in r["measured"]["runs"]:
            t = run["timings"]
            runs.append(ServerRun(spec=spec, file_type=r["file_type"], kv_type=r["kv_type"],
                                  prompt=run["prompt_tokens"], new_tokens=r["n_predict"],
                                  decode_s_per_token=t["predicted_ms"] / 1000 / t["predicted_n"],
                                  prefill_s=t["prompt_ms"] / 1000))
    return runs


def test_the_profile_holds_the_fit_of_the_committed_runs():
    """bench/llamacpp_serve.py --fit wrote these entries: refitting the committed runs gives them again (the f16-cache
    runs' weights and attention, then each quantized cache's attention)."""
    bare = replace(HW, calibration=replace(HW.calibration, entries=tuple(
        e for e in HW.calibration.entries if e.backend not in LLAMA_CPP_BACKENDS)))
    refit, _ = fit_llamacpp(bare, _runs(RESULTS["fit"]["cases"]), commit=RESULTS["llama_cpp_commit"],
                            measured_at="2026-11-24")
    mine = sorted((e for e in HW.calibration.entries if e.backend in LLAMA_CPP_BACKENDS), key=lambda e: e.key)
    again = sorted((e for e in refit.calibration.entries if e.backend in LLAMA_CPP_BACKENDS), key=lambda e: e.key)
    assert {e.quant for e in mine if e.backend == "attn-llama.cpp"} == {"bf16", "q8_0", "q4_0"}
    assert again == mine


def test_llamacpp_speed_uses_only_llamacpp_entries():
    """The torch runtime's calibrated kernels (attn-sdpa, bf16 ...) never stand in for llama.cpp's: without llama.cpp
    entries its speed uses the defaults; with them, a file type without its own entry borrows another's."""
    spec = _case("qwen3-0.6b-q4km-f16")[1]
    bare = replace(HW, calibration=replace(HW.calibration, entries=tuple(
        e for e in HW.calibration.entries if e.backend not in LLAMA_CPP_BACKENDS)))
    assert bare.calibration.lookup("cpu", "attn-sdpa", "bf16") is not None
    view, label = speed_hardware(bare, spec, "Q4_K_M")
    assert view.calibration is None and label == SPEED_LABEL
    view, label = speed_hardware(HW, spec, "Q4_K_M")
    keys = {e.key for e in view.calibration.entries}
    assert keys == {("cpu", "llama.cpp", "bf16"), ("cpu", "experts", "bf16"), ("cpu", "attn-sdpa", "bf16"),
                    ("cpu", "prefill-attn-sdpa", "bf16")}
    assert view.calibration.lookup("cpu", "llama.cpp", "bf16").per_layer_overhead_s == pytest.approx(
        HW.calibration.lookup("cpu", "llama.cpp", "Q4_K_M").per_layer_overhead_s)
    assert "calibrated on llama.cpp" in label and "borrows" not in label
    assert "Q5_K_M borrows" in speed_hardware(HW, spec, "Q5_K_M")[1]
    # a quantized cache uses its own attention entries, under the keys the speed model reads
    view, label = speed_hardware(HW, spec, "Q4_K_M", "q4_0")
    assert view.calibration.lookup("cpu", "prefill-attn-sdpa", "bf16").compute_efficiency == \
        HW.calibration.lookup("cpu", "prefill-attn-llama.cpp", "q4_0").compute_efficiency
    assert "borrows" not in label
    again = with_llamacpp_calibration(HW, replace(HW.calibration, entries=tuple(
        e for e in HW.calibration.entries if e.backend in LLAMA_CPP_BACKENDS)), RESULTS["llama_cpp_commit"])
    assert sorted(e.key for e in again.calibration.entries) == sorted(e.key for e in HW.calibration.entries)


@pytest.mark.parametrize("name", RESULTS["fit"]["cases"])
def test_calibrated_speed_on_the_runs_it_was_fitted_to(name):
    """Decode within 20 % and TTFT within 10 % on the fitted runs (one sequence each, best of two requests; held-out
    runs are in bench/results/llamacpp-serve-cpu-dev.md)."""
    r, spec, req = _case(name)
    for run in r["measured"]["runs"]:
        t = run["timings"]
        speed = plan_llamacpp(spec, HW, replace(req, batch=1, prompt_tokens=run["prompt_tokens"])).chosen.speed
        decode = t["predicted_n"] / (t["predicted_ms"] / 1000)
        assert abs(speed.decode_tokens_per_s - decode) <= 0.20 * decode
        assert abs(speed.ttft_s - t["prompt_ms"] / 1000) <= 0.10 * t["prompt_ms"] / 1000


def test_a_gpu_profile_says_its_gpu_has_no_llamacpp_entries():
    from vramplan.planner.profiles import resolve_profile

    gpu = replace(resolve_profile("rtx-4090")[0], calibration=HW.calibration)
    spec = _case("qwen3-0.6b-q4km-f16")[1]
    _, label = speed_hardware(gpu, spec, "Q4_K_M")
    assert "none for the GPU: its defaults there" in label
    with pytest.raises(ValueError, match="has a GPU"):
        fit_llamacpp(gpu, _runs(["qwen3-0.6b-q4km-f16"]), commit="x", measured_at="2026-11-24")
