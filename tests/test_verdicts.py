"""A plan never says "fits" over any device's capacity: a property over models x profiles x contexts x schemes,
plus the cases that once did (no-GPU machines over their RAM, unified-memory profiles)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.planner.published_scheme import published_scheme
from vramplan.planner.errors import PlanError
from vramplan.planner.profile_yaml import profile_from_dict
from vramplan.planner.profiles import list_profiles, resolve_profile
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.planner.request import Request
from vramplan.planner.search import device_refusal, plan
from vramplan.planner.sources import catalog, model_spec
from vramplan.planner.units import GiB

MODELS = [e.id for e in catalog()]
PROFILES = [e.name for e in list_profiles() if e.profile is not None]
CONTEXTS = [1, 512, 4096, 32768, 131072, 1 << 20]


def _within_capacity(candidate) -> None:
    mem = candidate.memory
    assert mem is not None, candidate
    if mem.gpu is not None:
        assert mem.gpu.total_bytes <= mem.gpu.capacity_bytes, candidate.reason
    assert mem.cpu.total_bytes <= mem.cpu.capacity_bytes, candidate.reason
    assert candidate.speed is not None and candidate.speed.decode_tokens_per_s > 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), profile=st.sampled_from(PROFILES), context=st.sampled_from(CONTEXTS),
       batch=st.sampled_from([1, 4]), quant=st.sampled_from([None, *SCHEMES]), kv=st.sampled_from([None, *KV_SCHEMES]))
def test_no_candidate_fits_over_any_capacity(model, profile, context, batch, quant, kv):
    req = Request(context=context, batch=batch, quant=(quant,) if quant else (), kv_dtype=(kv,) if kv else (),
                  allow_context_overflow=True)  # capacity, not the model's trained length, is under test
    hw = resolve_profile(profile)[0]
    if quant and published_scheme(model_spec(model)) is not None:  # a published checkpoint keeps its format
        with pytest.raises(PlanError, match="planned as stored|does not run on|no probe record"):  # the device first
            plan(model_spec(model), hw, req)
        return
    if quant and (why := device_refusal(SCHEMES[quant], hw)):  # a scheme that cannot run there (cpu-w4a8 where the
        with pytest.raises(PlanError, match=re.escape(why)):   # profile has no record of its kernel): bad input
            plan(model_spec(model), hw, req)
        return
    p = plan(model_spec(model), hw, req)
    for c in p.candidates:
        if c.fits:
            _within_capacity(c)
    assert p.fits == any(c.fits for c in p.candidates)
    if p.fits:
        _within_capacity(p.chosen)
        d = p.to_dict()["memory"]
        assert d["cpu"]["free_bytes"] >= 0 and (d["gpu"] is None or d["gpu"]["free_bytes"] >= 0)


def _cpu_machine(ram: str) -> object:
    return profile_from_dict({
        "schema_version": 1, "name": "cpu-box", "description": "a CPU box", "source": "test", "gpus": [],
        "host": {"ram": ram, "ram_bandwidth": "25 GB/s", "cpu_cores": 2, "cpu_bf16_compute": "0.4 TFLOPS"},
        "link": None, "overheads": {"cuda_context": "0 B", "allocator_reserve": "0 B", "kernel_launch": "0 us"}})


def test_a_cpu_machine_over_its_ram_picks_what_fits_or_says_nothing_fits():
    hw = _cpu_machine("24104 MiB")  # 23.54 GiB, the dev machine
    p = plan(model_spec("llama-3.1-8b"), hw, Request(context=131072))
    bf16 = next(c for c in p.candidates if (c.weight_quant, c.kv_dtype) == ("bf16", "bf16"))
    # 128k tokens x 128 KiB per token = 16 GiB of KV in RAM, beside 14.96 GiB of weights
    assert not bf16.fits and bf16.memory.cpu.kv_cache_bytes == 131072 * 131072
    assert "RAM needs" in bf16.reason
    assert p.fits and (p.choice.weight_quant, p.choice.kv_dtype) != ("bf16", "bf16")
    assert p.memory.cpu.total_bytes <= p.memory.cpu.capacity_bytes
    p = plan(model_spec("llama-3.1-8b"), hw, Request(context=10 * 1024 * 1024, allow_context_overflow=True))
    assert not p.fits and p.reasons[0].startswith("nothing fits") and "RAM needs" in p.reasons[0]
    assert p.alternatives and all(a.max_context_tokens < 10 * 1024 * 1024 for a in p.alternatives)


def test_a_cpu_machine_chooses_what_fits_in_its_ram():
    p = plan(model_spec("qwen2.5-32b"), resolve_profile("cpu-ddr5-desktop")[0], Request(context=32768))
    assert p.fits and p.choice.weight_quant != "bf16"  # bf16 needs 70.6 GiB of 64
    bf16 = next(c for c in p.candidates if (c.weight_quant, c.kv_dtype) == ("bf16", "bf16"))
    assert not bf16.fits and bf16.memory.cpu.total_bytes > 64 * GiB


def test_unified_memory_profiles_plan_without_a_link():
    hw = resolve_profile("apple-m2-max-96gb")[0]
    p = plan(model_spec("llama-3.1-70b"), hw, Request(context=32768))
    assert p.fits and p.choice.offload in ("none", "cpu") and p.choice.compute_device == "mps"
    assert all(c.choice is None or c.choice.offload != "stream" for c in p.candidates)
