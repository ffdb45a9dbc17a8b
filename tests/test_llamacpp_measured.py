"""vramplan's llama.cpp memory rules against what a real llama-server reported when it ran vramplan's exported commands
(bench/llamacpp_serve.py, committed as bench/results/llamacpp-serve-cpu-dev.json: six models on a CPU build).

The predictions are recomputed from the rules as they are now, so a change to the rules that drifts from what
llama.cpp does fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.architectures import spec_from_config
from planner.engines import llamacpp_rules as rules
from planner.engines.llamacpp import llama_server_command, plan_llamacpp
from planner.profile_yaml import load_profile
from planner.request import Request
from planner.units import MiB

ROOT = Path(__file__).resolve().parents[1]
RESULTS = json.loads((ROOT / "bench" / "results" / "llamacpp-serve-cpu-dev.json").read_text())
HW = load_profile(ROOT / "bench" / "results" / RESULTS["profile"])
# llama.cpp logs buffer sizes in MiB with two decimals
LOGGED = 0.005 * MiB
# The compute buffer is an estimate (llama.cpp sizes it by allocating its graph): never under, at most this much over.
COMPUTE_OVER_MAX = 0.10
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
    assert working_set <= predicted <= max(working_set * (1 + RAM_OVER_MAX), working_set + rules.PROCESS_BASE_RAM_CPU_BUILD)
