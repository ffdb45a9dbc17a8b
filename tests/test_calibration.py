"""The calibration fit recovers known efficiencies from synthetic runs, and the planner uses them."""

from __future__ import annotations

import dataclasses

import pytest

from planner.calibration import Sample, fit
from planner.profiles import resolve_profile
from planner.request import Request
from planner.search import plan
from planner.sources import model_spec

BW, PEAK = 30e9, 0.4e12


def synth(weights, flops_attn, layers, *, eff=0.6, attn_eff=0.02, per_layer=700e-6, per_token=0.0, quant="bf16"):
    t = weights / (BW * eff) + flops_attn / (PEAK * attn_eff) + layers * per_layer + per_token
    return Sample(device="cpu", backend="torch" if quant == "bf16" else "quanto", quant=quant,
                  bandwidth_bytes_per_s=BW, peak_flops=PEAK, bytes_read_per_token=weights, kv_bytes_per_token=1e6,
                  attention_flops_per_token=flops_attn, attention_impl="sdpa", num_layers=layers,
                  decode_s_per_token=t, prefill_flops=1e12, prefill_chunks=1,
                  prefill_s=1e12 / (PEAK * 0.9) + layers * per_layer + per_token)


def test_fit_recovers_the_constants_it_was_made_with():
    runs = [synth(w, a, L) for w, L in ((1e9, 24), (2.5e9, 16)) for a in (1e7, 2e8, 5e8)]
    cal = fit(runs, measured_at="2026-11-21", versions={"torch": "x"})
    e = cal.lookup("cpu", "torch", "bf16")
    assert e.bandwidth_efficiency == pytest.approx(0.6, rel=1e-3)
    assert e.per_layer_overhead_s == pytest.approx(700e-6, rel=1e-3)
    assert e.per_token_overhead_s == 0.0  # two depths only: no per-token constant
    assert e.compute_efficiency == pytest.approx(0.9, rel=1e-2)
    attn = cal.lookup("cpu", "attn-sdpa", "bf16")
    assert attn.compute_efficiency == pytest.approx(0.02, rel=1e-3)
    assert max(v for k, v in cal.residuals) < 1e-6


def test_three_depths_fit_a_per_token_constant():
    runs = [synth(w, a, L, per_token=20e-3) for w, L in ((1e9, 24), (2.5e9, 16), (4e9, 32)) for a in (1e7, 3e8)]
    e = fit(runs, measured_at="2026-11-21", versions={}).lookup("cpu", "torch", "bf16")
    assert e.per_token_overhead_s == pytest.approx(20e-3, rel=1e-3)


def test_plans_use_the_calibration_and_say_so():
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("qwen2.5-0.5b")
    req = Request(context=1024, quant=("bf16",), kv_dtype=("bf16",))
    before = plan(spec, hw, req)
    runs = [synth(w, a, L) for w, L in ((1e9, 24), (2.5e9, 16)) for a in (1e7, 2e8, 5e8)]
    cal = dataclasses.replace(fit(runs, measured_at="2026-11-21", versions={}), runtime_ram_bytes=300 * 2**20)
    after = plan(spec, dataclasses.replace(hw, calibration=cal), req)
    assert before.predicted.terms["efficiency_source"] == "default"
    assert after.predicted.terms["efficiency_source"] == "calibrated 2026-11-21"
    assert after.predicted.decode_tokens_per_s != before.predicted.decode_tokens_per_s
    d = after.to_dict()
    assert d["memory"]["cpu"]["runtime_base_bytes"] == 300 * 2**20
    assert "calibration.runtime_ram" in d["constants"]["runtime_base_ram_bytes"]["from"]
