"""The calibration fit recovers known efficiencies from synthetic runs, stays within physics, says when it
cannot, and the planner uses what it stored."""

from __future__ import annotations

import dataclasses

import pytest

from vramplan.planner.calibration import RESIDUAL_WARN_PCT, Sample, fit
from vramplan.planner.hardware import MAX_EFFICIENCY
from vramplan.planner.profile_yaml import dumps_profile, loads_profile
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec
from vramplan.planner.speed import DEFAULT_PREFILL_ATTENTION_EFFICIENCY

BW, PEAK = 30e9, 0.4e12


def synth(weights, flops_attn, layers, *, eff=0.6, attn_eff=0.02, per_layer=700e-6, per_token=0.0, quant="bf16",
          kv_dtype="bf16", update_bytes=0.0, update_eff=0.3, noise=1.0):
    t = (weights / (BW * eff) + flops_attn / (PEAK * attn_eff) + layers * per_layer + per_token
         + update_bytes / (BW * update_eff)) * noise
    return Sample(device="cpu", backend="torch" if quant == "bf16" else "quanto", quant=quant,
                  bandwidth_bytes_per_s=BW, peak_flops=PEAK, matmul_peak_flops=PEAK, bytes_read_per_token=weights,
                  kv_bytes_per_token=1e6,
                  attention_flops_per_token=flops_attn, attention_impl="sdpa", num_layers=layers,
                  decode_s_per_token=t, prefill_flops=1e12, prefill_chunks=1,
                  prefill_s=1e12 / (PEAK * 0.9) + layers * per_layer + per_token, kv_dtype=kv_dtype,
                  kv_update_bytes_per_token=update_bytes)


def matrix(**kw):
    return [synth(w, a, L, **kw) for w, L in ((1e9, 24), (2.5e9, 16)) for a in (1e7, 2e8, 5e8)]


def test_fit_recovers_the_constants_it_was_made_with():
    result = fit(matrix(), measured_at="2026-11-21", versions={"torch": "x"})
    cal = result.calibration
    e = cal.lookup("cpu", "torch", "bf16")
    assert e.bandwidth_efficiency == pytest.approx(0.6, rel=1e-3)
    assert e.per_layer_overhead_s == pytest.approx(700e-6, rel=1e-3)
    assert e.per_token_overhead_s == 0.0  # two depths only: no per-token constant
    assert e.compute_efficiency == pytest.approx(0.9, rel=1e-2)
    attn = cal.lookup("cpu", "attn-sdpa", "bf16")
    assert attn.compute_efficiency == pytest.approx(0.02, rel=1e-3)
    assert attn.bandwidth_efficiency is None  # compute-bound runs do not measure the cache's read bandwidth
    assert max(v for k, v in cal.residuals) < 1e-6
    assert result.warnings == ()


def test_three_depths_fit_a_per_token_constant():
    runs = [synth(w, a, L, per_token=20e-3) for w, L in ((1e9, 24), (2.5e9, 16), (4e9, 32)) for a in (1e7, 3e8)]
    e = fit(runs, measured_at="2026-11-21", versions={}).calibration.lookup("cpu", "torch", "bf16")
    assert e.per_token_overhead_s == pytest.approx(20e-3, rel=1e-3)


def test_an_impossible_efficiency_is_held_at_one_and_said():
    # runs that read weights at 1.5 x the profile's bandwidth: the profile's figure is wrong, not physics
    result = fit(matrix(eff=1.5), measured_at="2026-11-21", versions={})
    e = result.calibration.lookup("cpu", "torch", "bf16")
    assert e.bandwidth_efficiency == MAX_EFFICIENCY
    assert any("faster than the profile's peak bandwidth" in w and "probe again" in w for w in result.warnings)
    # the other constants are refitted around the bound, and the profile still loads
    again = loads_profile(dumps_profile(dataclasses.replace(resolve_profile("cpu-ddr5-desktop")[0],
                                                            calibration=result.calibration)))
    assert again.calibration == result.calibration


def test_a_fit_that_misses_its_runs_warns():
    noisy = [dataclasses.replace(s, decode_s_per_token=s.decode_s_per_token * (1.6 if i % 2 else 0.6))
             for i, s in enumerate(matrix())]
    result = fit(noisy, measured_at="2026-11-21", versions={})
    median = dict(result.calibration.residuals)["cpu/torch/bf16: decode_abs_pct_median"]
    assert median > RESIDUAL_WARN_PCT
    assert any("misses its own runs" in w for w in result.warnings)


def test_quantized_kv_runs_fit_the_update_efficiency():
    runs = matrix() + [synth(1e9, 5e8, 24, kv_dtype="fp8", update_bytes=b, update_eff=0.25) for b in (2e8, 4e8)]
    cal = fit(runs, measured_at="2026-11-21", versions={}).calibration
    e = cal.lookup("cpu", "kv-update", "fp8")
    assert e.bandwidth_efficiency == pytest.approx(0.25, rel=1e-3) and e.compute_efficiency is None
    # a KV dtype whose runs are no slower than the bf16 model is reported, not stored
    result = fit(matrix() + [synth(1e9, 5e8, 24, kv_dtype="quanto-int4", update_bytes=0.0)],
                 measured_at="2026-11-21", versions={})
    assert result.calibration.lookup("cpu", "kv-update", "quanto-int4") is None
    assert any("not measurable" in w for w in result.warnings)


def test_no_runs_is_an_error_not_zeros():
    with pytest.raises(ValueError, match="every calibration run failed"):
        fit([], measured_at="2026-11-21", versions={})


def test_plans_use_the_calibration_and_say_so():
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("qwen2.5-0.5b")
    req = Request(context=1024, quant=("bf16",), kv_dtype=("bf16",))
    before = plan(spec, hw, req)
    cal = dataclasses.replace(fit(matrix(), measured_at="2026-11-21", versions={}).calibration,
                              runtime_ram_bytes=300 * 2**20)
    after = plan(spec, dataclasses.replace(hw, calibration=cal), req)
    assert before.predicted.terms["efficiency_source"] == "default"
    assert after.predicted.terms["efficiency_source"] == "calibrated 2026-11-21"
    assert after.predicted.decode_tokens_per_s != before.predicted.decode_tokens_per_s
    d = after.to_dict()
    assert d["memory"]["cpu"]["runtime_base_bytes"] == 300 * 2**20
    assert "calibration.runtime_ram" in d["constants"]["runtime_base_ram_bytes"]["from"]


def test_an_uncalibrated_scheme_borrows_the_entry_of_one_with_the_same_backend_and_bits():
    """fp16 runs bf16's kernels on the same bytes: on a machine calibrated in bf16 only, fp16 is predicted from bf16's
    entry and says so (an H200 calibrated bf16 at 15.7 tok/s on Llama-3.1-8B; fp16 was predicted at 121 by default).
    A scheme with no such sibling (quanto-int8 here) keeps the defaults."""
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("qwen2.5-0.5b")
    cal = fit(matrix(), measured_at="2026-11-21", versions={}).calibration
    assert {e.quant for e in cal.entries if e.backend == "torch"} == {"bf16"}
    calibrated = dataclasses.replace(hw, calibration=cal)
    runs = {q: plan(spec, calibrated, Request(context=1024, quant=(q,), kv_dtype=("bf16",))) for q in ("bf16", "fp16")}
    source = runs["fp16"].predicted.terms["efficiency_source"]
    assert source == "calibrated 2026-11-21 (bf16's entry: same backend and bits)"
    assert runs["fp16"].predicted.decode_tokens_per_s == pytest.approx(runs["bf16"].predicted.decode_tokens_per_s)
    other = plan(spec, calibrated, Request(context=1024, quant=("quanto-int8",), kv_dtype=("bf16",)))
    assert other.predicted.terms["efficiency_source"] == "default"


def test_quantized_kv_is_predicted_slower_on_a_cpu_when_its_update_costs_more():
    """The dequantize-every-step cost is in the model: on a CPU, whose attention is compute-bound, a smaller cache
    saves nothing and its update traffic only adds time."""
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("qwen2.5-0.5b")
    speeds = {}
    for kv in ("bf16", "fp8", "quanto-int4", "quanto-int2"):
        p = plan(spec, hw, Request(context=8192, prompt_tokens=6000, quant=("bf16",), kv_dtype=(kv,)))
        speeds[kv] = p.predicted.decode_tokens_per_s
        assert (p.predicted.terms["kv_update_s"] > 0) == (kv != "bf16")
    assert speeds["bf16"] > max(speeds["fp8"], speeds["quanto-int4"], speeds["quanto-int2"])


# ---------------------------------------------------------------- routed experts
def test_fit_experts_recovers_bandwidth_and_per_call_cost():
    from vramplan.planner.calibration import ExpertSample, fit_experts

    bw, eff, call = 40e9, 0.6, 50e-6
    samples = [ExpertSample(device="cpu", quant="quanto-int4", bandwidth_bytes_per_s=bw, bytes_read=b * k, calls=k,
                            seconds=b * k / (bw * eff) + k * call)
               for b in (0.4e6, 2.5e6) for k in (2, 8)]
    entry, residuals, warnings = fit_experts(samples)
    assert entry.backend == "experts" and entry.quant == "quanto-int4" and not warnings
    assert entry.bandwidth_efficiency == pytest.approx(eff, rel=1e-4)
    assert entry.per_layer_overhead_s == pytest.approx(call, rel=1e-4)
    assert max(residuals.values()) < 1e-3


def test_moe_decode_prices_each_routed_expert_and_the_calibration_replaces_the_default():
    """Qwen3-30B-A3B on a CPU: 48 MoE layers x 8 routed experts a token; the per-call cost adds 384 calls a step."""
    from vramplan.planner.hardware import Calibration, CalibrationEntry

    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("Qwen/Qwen3-30B-A3B")
    req = Request(context=1024, prompt_tokens=32, quant=("quanto-int4",), kv_dtype=("bf16",))

    def step_s(entries) -> tuple[float, dict]:
        h = (dataclasses.replace(hw, calibration=Calibration(measured_at="2026-11-23", entries=entries)) if entries
             else hw)
        p = plan(spec, h, req)
        return 1.0 / p.chosen.speed.decode_tokens_per_s, p.chosen.speed.terms

    base_s, terms = step_s(())
    assert terms["experts_efficiency_source"] == "default" and terms["per_expert_call_s"] == 40e-6
    weights = CalibrationEntry(device="cpu", backend="quanto", quant="quanto-int4", bandwidth_efficiency=0.5,
                               compute_efficiency=0.3)

    def experts(eff, call):
        return CalibrationEntry(device="cpu", backend="experts", quant="quanto-int4", bandwidth_efficiency=eff,
                                compute_efficiency=None, per_layer_overhead_s=call)

    a, terms = step_s((weights, experts(0.5, 0.0)))
    b, _ = step_s((weights, experts(0.5, 100e-6)))
    assert terms["experts_efficiency_source"].startswith("calibrated")
    assert b - a == pytest.approx(48 * 8 * 100e-6, rel=1e-9)
    c, _ = step_s((weights, experts(0.25, 0.0)))  # half the efficiency: the experts' byte time doubles
    expert_bytes = 48 * 8 * 3 * 2048 * 768 / 2  # int4 payload alone (scales on top): a lower bound of the change
    assert c - a > expert_bytes / (hw.host.ram_bandwidth_bytes_per_s * 0.5)


# ---------------------------------------------------------------- prefill attention
def prefill_runs(matmul_eff, attention_eff, *, quant="bf16", impl="sdpa", prompts=(64, 640, 2048), per_layer=700e-6):
    """Runs whose TTFT is matmul FLOPs at one efficiency plus causal attention FLOPs (prompt^2) at another."""
    out = []
    decode = [(w, a, L) for w, L in ((1e9, 24), (2.5e9, 16)) for a in (1e7, 5e8)]  # what the decode fit needs
    for p, (w, a, L) in zip([q for q in prompts for _ in decode], decode * len(prompts)):
        matmul, attention = 1e9 * p, 4.0 * 14 * 64 * L * p * (p + 1) / 2
        s = synth(w, a, L, quant=quant, per_layer=per_layer)
        t = matmul / (PEAK * matmul_eff) + attention / (PEAK * attention_eff) + L * per_layer
        out.append(dataclasses.replace(s, prefill_flops=matmul + attention, prefill_attention_flops=attention,
                                       prefill_s=t, attention_impl=impl, label=f"prompt {p}"))
    return out


def test_prefill_fit_tells_the_attention_kernel_from_the_matmuls():
    """One attention efficiency shared by every scheme (the same kernel on bf16 activations), a matmul one per scheme:
    the joint fit recovers all three, and the attention one is stored as its own entry."""
    runs = prefill_runs(0.6, 0.17) + prefill_runs(0.3, 0.17, quant="quanto-int4")
    result = fit(runs, measured_at="2026-11-23", versions={})
    cal = result.calibration
    assert cal.lookup("cpu", "torch", "bf16").compute_efficiency == pytest.approx(0.6, rel=1e-3)
    assert cal.lookup("cpu", "quanto", "quanto-int4").compute_efficiency == pytest.approx(0.3, rel=1e-3)
    e = cal.lookup("cpu", "prefill-attn-sdpa", "bf16")
    assert e.compute_efficiency == pytest.approx(0.17, rel=1e-3) and e.bandwidth_efficiency is None
    residuals = dict(cal.residuals)
    assert residuals["cpu/torch/bf16: prefill_abs_pct_max"] < 1e-3
    assert result.warnings == ()
    # one efficiency for both (what the fit did before) misses the long prompt by far more
    one = fit([dataclasses.replace(s, prefill_attention_flops=0.0) for s in runs], measured_at="2026-11-23",
              versions={}).calibration
    assert dict(one.residuals)["cpu/torch/bf16: prefill_abs_pct_max"] > 10


def test_an_unmeasurable_prefill_attention_keeps_the_default_and_stores_nothing():
    # short prompts only: attention is under 3 % of the FLOPs, so the matmul efficiency is fitted with the
    # default attention efficiency taken out, and no attention entry is invented
    runs = prefill_runs(0.6, DEFAULT_PREFILL_ATTENTION_EFFICIENCY["cpu"], prompts=(16, 64, 128))
    cal = fit(runs, measured_at="2026-11-23", versions={}).calibration
    assert cal.lookup("cpu", "prefill-attn-sdpa", "bf16") is None
    assert cal.lookup("cpu", "torch", "bf16").compute_efficiency == pytest.approx(0.6, rel=1e-3)
    # runs stored before the attention FLOPs were recorded still fit (as all matmul)
    old = [dataclasses.replace(s, prefill_attention_flops=0.0) for s in prefill_runs(0.6, 0.6)]
    assert fit(old, measured_at="2026-11-23", versions={}).calibration.lookup("cpu", "torch", "bf16") \
        .compute_efficiency == pytest.approx(0.6, rel=1e-3)


def test_prefill_attention_faster_than_peak_is_held_and_said():
    result = fit(prefill_runs(0.6, 1.8), measured_at="2026-11-23", versions={})
    assert result.calibration.lookup("cpu", "prefill-attn-sdpa", "bf16").compute_efficiency == MAX_EFFICIENCY
    assert any("prefill attention ran faster than the profile's peak compute" in w for w in result.warnings)


def test_ttft_prices_prefill_attention_at_its_own_efficiency():
    """TTFT grows with the prompt squared through attention; a calibrated attention efficiency replaces the default,
    and the plan says which it used."""
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("qwen3-0.6b")

    def ttft(hw, prompt):
        p = plan(spec, hw, Request(context=8192, prompt_tokens=prompt, quant=("bf16",), kv_dtype=("bf16",)))
        return p.predicted.ttft_s, p.predicted.terms

    short, terms = ttft(hw, 512)
    long, _ = ttft(hw, 4096)
    assert terms["prefill_attention_efficiency"] == DEFAULT_PREFILL_ATTENTION_EFFICIENCY["cpu"]
    # superlinear: 8x the tokens, and attention's prompt^2 on top; priced at the matmuls' efficiency it was 11.4x, and
    # the default prices attention below them (0.40 of the peak against bf16's 0.57)
    assert long / short > 11.4 + 0.5
    cal = fit(prefill_runs(0.6, 0.05) + prefill_runs(0.3, 0.05, quant="quanto-int4"), measured_at="2026-11-23",
              versions={}).calibration
    slow, terms = ttft(dataclasses.replace(hw, calibration=cal), 4096)
    assert terms["prefill_attention_efficiency"] == pytest.approx(0.05, rel=1e-3)
    assert "prefill attention calibrated 2026-11-23 (prefill-attn-sdpa)" in terms["kv_efficiency_source"]
    assert slow > long


def test_each_attention_implementation_gets_its_own_prefill_efficiency():
    runs = prefill_runs(0.6, 0.17) + prefill_runs(0.6, 0.05, quant="quanto-int4", impl="eager")
    cal = fit(runs, measured_at="2026-11-23", versions={}).calibration
    assert cal.lookup("cpu", "prefill-attn-sdpa", "bf16").compute_efficiency == pytest.approx(0.17, rel=1e-3)
    assert cal.lookup("cpu", "prefill-attn-eager", "bf16").compute_efficiency == pytest.approx(0.05, rel=1e-3)
    # eager runs too short to measure theirs share SDPA's figure, as the speed model borrows it
    runs = prefill_runs(0.6, 0.17) + prefill_runs(0.3, 0.17, quant="quanto-int4", impl="eager", prompts=(16, 64))
    cal = fit(runs, measured_at="2026-11-23", versions={}).calibration
    assert cal.lookup("cpu", "prefill-attn-eager", "bf16") is None
    assert cal.lookup("cpu", "quanto", "quanto-int4").compute_efficiency == pytest.approx(0.3, rel=1e-3)


def test_runs_saved_before_prefill_attention_was_counted_get_it_counted_on_load():
    from vramplan.planner.sources import model_spec
    from vramplan.planner.work import prefill_attention_flop
    from vramplan.runtime.calibrate import RunRecord

    s = dataclasses.asdict(prefill_runs(0.6, 0.17, prompts=(2048,))[0])
    del s["prefill_attention_flops"]
    old = {"model": "Qwen/Qwen2.5-0.5B", "quant": "bf16", "kv_dtype": "bf16", "prompt": 2048, "new_tokens": 8,
           "decode_tokens_per_s": 10.0, "ttft_s": 4.0, "peak_rss_bytes": 1, "sample": s}
    got = RunRecord.from_dict(old).sample.prefill_attention_flops
    assert got == prefill_attention_flop(model_spec("qwen2.5-0.5b"), 2048) > 0


def test_quantized_kv_update_has_a_fixed_cost_per_layer_measured_against_the_same_bf16_run():
    """A quantized cache costs its update traffic plus a fixed cost per layer (the dequantize/cat/quantize ops); runs of
    two cache sizes tell them apart. The extra time is taken against the measured bf16-cache run of the same model and
    context, so the bf16 model's own misses (here +-15 % noise) do not leak into the KV figures."""
    bf16 = [dataclasses.replace(s, decode_s_per_token=s.decode_s_per_token * (1.15 if i % 2 else 0.85))
            for i, s in enumerate(matrix())]
    kv = []
    for s in bf16:
        update = s.attention_flops_per_token * 4.0  # traffic grows with the cache, like the attention FLOPs
        extra = update / (BW * 0.3) + s.num_layers * 250e-6
        kv.append(dataclasses.replace(s, kv_dtype="quanto-int4", kv_update_bytes_per_token=update,
                                      decode_s_per_token=s.decode_s_per_token + extra))
    cal = fit(bf16 + kv, measured_at="2026-11-23", versions={}).calibration
    e = cal.lookup("cpu", "kv-update", "quanto-int4")
    assert e.bandwidth_efficiency == pytest.approx(0.3, rel=1e-3)
    assert e.per_layer_overhead_s == pytest.approx(250e-6, rel=1e-3)
    # and the speed model charges it per layer of quantized cache, on top of the traffic
    hw = dataclasses.replace(resolve_profile("cpu-ddr5-desktop")[0], calibration=cal)
    p = plan(model_spec("qwen2.5-0.5b"), hw, Request(context=4096, quant=("bf16",), kv_dtype=("quanto-int4",)))
    assert p.predicted.terms["kv_update_per_layer_s"] == pytest.approx(250e-6, rel=1e-3)
    assert p.predicted.terms["kv_update_s"] > 24 * 250e-6


def test_the_same_weights_with_eager_attention_fit_the_eager_kernel_apart():
    """The calibration runs its first model with eager attention too (gemma2's kernel): one weights efficiency,
    an attention efficiency per implementation, each stored under its own entry for decode and for prefill."""
    sdpa = matrix()
    eager = [synth(w, a, L, attn_eff=0.05) for w, L in ((1e9, 24), (2.5e9, 16)) for a in (1e7, 2e8, 5e8)]
    eager = [dataclasses.replace(s, attention_impl="eager") for s in eager]
    result = fit(sdpa + eager, measured_at="2026-11-23", versions={})
    cal = result.calibration
    assert cal.lookup("cpu", "torch", "bf16").bandwidth_efficiency == pytest.approx(0.6, rel=1e-3)
    assert cal.lookup("cpu", "attn-sdpa", "bf16").compute_efficiency == pytest.approx(0.02, rel=1e-3)
    assert cal.lookup("cpu", "attn-eager", "bf16").compute_efficiency == pytest.approx(0.05, rel=1e-3)
    assert result.warnings == ()
    # a gemma2 plan (eager: softcapping) now uses the eager figure, not SDPA's
    hw = dataclasses.replace(resolve_profile("cpu-ddr5-desktop")[0], calibration=cal)
    p = plan(model_spec("gemma-2-2b"), hw, Request(context=2048, quant=("bf16",), kv_dtype=("bf16",)))
    assert p.predicted.terms["attention_compute_efficiency"] == pytest.approx(0.05, rel=1e-3)
    assert "(attn-eager)" in p.predicted.terms["kv_efficiency_source"]


def test_the_warm_up_runs_at_the_shortest_timed_prompt_so_the_first_timed_prefill_is_warm(monkeypatch):
    """A GPU loads a kernel the first time a shape needs it: an 8-token warm-up left the first timed prefill cold (an
    H200 took 0.46 s for a 512-token prefill once, then 0.05 s for 2048). The warm-up runs the shortest timed prompt."""
    import vramplan.runtime.generate as generate_module
    from conftest import tiny_config_dict
    from vramplan.planner.architectures import spec_from_config
    from vramplan.runtime.calibrate import CPU_MATRIX, _run_model

    lengths = []
    real = generate_module.generate

    def spy(model, ids, **kwargs):
        lengths.append(int(ids.shape[-1]))
        return real(model, ids, **kwargs)

    monkeypatch.setattr(generate_module, "generate", spy)
    config = tiny_config_dict("llama")
    spec = spec_from_config(config, name="tiny")
    matrix = dataclasses.replace(CPU_MATRIX, new_tokens=3, repeats=1)
    results, _ = _run_model(config, spec, "bf16", [(24, "bf16", "sdpa"), (40, "bf16", "sdpa")], matrix, "cpu", 0,
                            lambda _: None)
    assert lengths == [24, 24, 40] and len(results) == 2


def test_the_allocator_reserve_a_run_used_is_its_peak_vram_beyond_the_counted_bytes():
    """The H200's Llama-3.1-8B bnb-nf4 run: 7,298,088,960 B at its peak against 7,672,829,440 predicted with the
    default 512 MiB reserve, so 155 MiB of the reserve was used; no VRAM (a CPU run): nothing measured."""
    from vramplan.runtime.calibrate import allocator_excess

    assert allocator_excess(7_298_088_960, 7_672_829_440, 512 * 2**20) == 162_130_432
    assert allocator_excess(None, 7_672_829_440, 512 * 2**20) is None
    assert allocator_excess(5 * 2**30, None, 0) is None


def test_a_measured_allocator_reserve_replaces_the_default_and_its_note(monkeypatch):
    """calibrate() on a machine whose fresh runs measured the allocator's reserve (a GPU's, given here: this machine
    has none) stores it in the profile's overheads and replaces the probe's "not measured" note; the real matrix runs
    (one tiny model on the CPU)."""
    import vramplan.runtime.calibrate as calibrate_module

    hw = resolve_profile("cpu-ddr5-desktop")[0]
    hw = dataclasses.replace(hw, notes=hw.notes + ("allocator reserve 512.00 MiB is vramplan's default, not measured",))
    monkeypatch.setattr(calibrate_module, "measure_runtime_ram", lambda hw, matrix, progress=None: (300 << 20,
                                                                                                   155 << 20, []))
    matrix = calibrate_module.Matrix(models=("qwen2.5-0.5b",), quants=("bf16",), prompts=(16, 32), new_tokens=3,
                                     repeats=1, experts=False, eager=False)
    result = calibrate_module.calibrate(hw, matrix)
    assert result.profile.overheads.allocator_reserve_bytes == 155 << 20
    assert result.profile.calibration.runtime_ram_bytes == 300 << 20
    reserve_notes = [n for n in result.profile.notes if n.startswith("allocator reserve")]
    assert reserve_notes == ["allocator reserve 155.00 MiB measured by vramplan calibrate: the median over fresh runs "
                             "of the peak VRAM beyond the plan's weights, KV cache, workspace and CUDA context"]


def test_runs_of_the_same_point_from_two_calls_keep_the_fastest():
    """--add-runs merges an earlier call's runs: a point measured twice keeps its fastest decode (and fastest TTFT),
    as the repeats of one call do; other points are all kept."""
    from vramplan.runtime.calibrate import RunRecord, fastest_per_point

    def record(model, prompt, tok_s, ttft, impl="sdpa"):
        sample = dataclasses.replace(synth(1e9, 1e6, 16), decode_s_per_token=1 / tok_s, prefill_s=ttft,
                                     attention_impl=impl)
        return RunRecord(model=model, quant="bf16", kv_dtype="bf16", prompt=prompt, new_tokens=24,
                         decode_tokens_per_s=tok_s, ttft_s=ttft, peak_rss_bytes=1, sample=sample)

    slow_early, fast_late = record("m1", 512, 20.0, 0.05), record("m1", 512, 100.0, 0.08)
    others = [record("m1", 2048, 90.0, 0.1), record("m1", 512, 50.0, 0.2, impl="eager"), record("m2", 512, 30.0, 0.3)]
    kept = fastest_per_point([slow_early, *others, fast_late])
    assert len(kept) == 4 and all(o in kept for o in others)
    merged = next(r for r in kept if r.model == "m1" and r.prompt == 512 and r.sample.attention_impl == "sdpa")
    assert merged.decode_tokens_per_s == 100.0 and merged.sample.decode_s_per_token == 1 / 100.0
    assert merged.ttft_s == merged.sample.prefill_s == 0.05


def test_a_compiled_cpu_decode_uses_the_weights_own_calibration():
    """On a CPU there is no dispatch to drop, and compiling measured within 6 % of eager: a calibrated CPU profile's
    bf16 entry prices --compile too, not the defaults."""
    cal = fit(matrix(), measured_at="2026-11-21", versions={"torch": "x"}).calibration
    hw = dataclasses.replace(resolve_profile("cpu-ddr5-desktop")[0], calibration=cal)
    spec = model_spec("qwen2.5-0.5b")
    eager, compiled = (plan(spec, hw, Request(context=2048, quant=("bf16",), kv_dtype=("bf16",), compiled=c))
                       for c in (False, True))
    assert compiled.predicted.decode_tokens_per_s == pytest.approx(eager.predicted.decode_tokens_per_s)
    assert compiled.chosen.speed.terms["efficiency_source"].startswith("calibrated")


def test_runs_saved_before_the_cpu_peaks_are_fitted_with_a_warning():
    """A CPU run without matmul_peak_flops was saved (and measured) before the fp32 kernels: fitting it beside new runs
    says so."""
    old = [dataclasses.replace(s, matmul_peak_flops=None) for s in matrix()]
    result = fit(old, measured_at="2026-11-26", versions={})
    assert any(w.startswith("6 CPU runs were saved before the CPU fp32 kernels") for w in result.warnings)
    assert not any("saved before" in w for w in fit(matrix(), measured_at="2026-11-26", versions={}).warnings)
