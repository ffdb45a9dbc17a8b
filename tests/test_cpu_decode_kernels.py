"""Which CPU decode kernel is fast depends on the CPU: the full probe times each scheme's kernel (one row by a weight
matrix in RAM), the profile keeps the rates, and the speed model prices each CPU scheme by its own kernel's rate where
the profile has one, instead of one machine's defaults."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vramplan.planner.hardware import CPU_DECODE_KERNELS, CPU_DECODE_PATHS
from vramplan.planner.profile_yaml import dumps_profile, loads_profile
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.quant import SCHEMES
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec


def _with_rates(**rates):
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    return replace(hw, host=replace(hw.host, **{f"cpu_decode_{k}_bytes_per_s": v for k, v in rates.items()}))


def test_the_probe_times_every_schemes_kernel():
    torch = pytest.importorskip("torch")
    from vramplan.runtime.probe.measure import PATH_MARGIN, measure_cpu_decode_kernels

    from vramplan.runtime.cpu_paths import fbgemm_available

    got, paths = measure_cpu_decode_kernels(torch, repeats=1, nbytes=4 << 20)
    timed_paths = {"bf16_mv", "bf16_linear", "int8_dynamic_int_mm"} | ({"int8_dynamic_fbgemm"} if fbgemm_available()
                                                                        else set())
    assert set(got) == set(CPU_DECODE_KERNELS) | timed_paths
    assert all(m.value > 0 and m.unit == "B/s" and "one row" in m.method for m in got.values())
    assert set(paths) == set(CPU_DECODE_PATHS) and all(p in CPU_DECODE_PATHS[k] for k, p in paths.items())
    for kernel, path in paths.items():  # the kernel's rate is its recorded path's, which is at least near the fastest
        assert got[kernel].value == got[f"{kernel}_{path}"].value
        assert got[kernel].value * PATH_MARGIN >= max(got[f"{kernel}_{p}"].value for p in CPU_DECODE_PATHS[kernel]
                                                     if f"{kernel}_{p}" in got)


def test_a_profile_keeps_the_rates():
    hw = _with_rates(bf16=14e9, int8=9e9, int4=5.3e9, int8_dynamic=1.9e9)
    again = loads_profile(dumps_profile(hw), "test")
    assert again.host == hw.host and again.host.decode_kernel_rate("int8_dynamic") == 1.9e9
    assert "cpu_decode_int8_dynamic: 1.9 GB/s" in dumps_profile(hw)


def test_each_scheme_is_priced_by_its_own_kernels_rate():
    """The rates an AVX2 EPYC without VNNI measured (2 threads): int8 x int8 streams 1.9 GB/s where int8 rows stream
    9.0. With them quanto-w8a8 is priced below quanto-int8; with the reverse (a VNNI Xeon's order), above."""
    spec = model_spec("llama-3.2-1b")
    req = Request(context=4096, kv_dtype=("bf16",))

    def decode(hw) -> dict[str, float]:
        return {c.weight_quant: c.speed.decode_tokens_per_s for c in plan(spec, hw, req).candidates
                if c.fits and c.weight_quant.startswith("quanto")}

    slow_dynamic = decode(_with_rates(bf16=14e9, int8=9e9, int4=5.3e9, int8_dynamic=1.9e9))
    fast_dynamic = decode(_with_rates(bf16=14e9, int8=9e9, int4=5.3e9, int8_dynamic=20e9))
    assert slow_dynamic["quanto-w8a8"] < slow_dynamic["quanto-int8"]
    assert fast_dynamic["quanto-w8a8"] > fast_dynamic["quanto-int8"]
    assert slow_dynamic["quanto-int8"] == fast_dynamic["quanto-int8"]  # each scheme its own kernel only
    hw = _with_rates(int8_dynamic=1.9e9)
    p = plan(spec, hw, Request(context=4096, quant=("quanto-w8a8",), kv_dtype=("bf16",)))
    assert "host.cpu_decode_int8_dynamic 1.9 GB/s" in p.chosen.speed.terms["efficiency_source"]
    unmeasured = plan(spec, hw, Request(context=4096, quant=("quanto-int8",), kv_dtype=("bf16",)))
    assert unmeasured.chosen.speed.terms["efficiency_source"] == "default"
    assert set(CPU_DECODE_KERNELS.values()) <= set(SCHEMES)  # every kernel prices a scheme that exists


def test_llama_cpp_is_never_priced_by_torchs_kernel_rates():
    """llama.cpp's CPU rows are ggml's kernels: the probe's timings of torch's kernels leave them alone (they once
    priced llama.cpp's bf16-named speed scheme by torch's bf16 GEMV rate, which halved its predicted decode on the
    AVX2 EPYC VM: Llama-3.2-1B Q8_0 5.2 tok/s predicted, 11.6 measured)."""
    from vramplan.planner.engines import BY_NAME

    slow, plain = _with_rates(bf16=1e9, int8=1e9, int4=1e9), resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("llama-3.2-1b")
    for q in ("BF16", "Q8_0", "Q4_0"):
        req = Request(context=4096, engine="llama.cpp", quant=(q,), kv_dtype=("f16",))
        a, b = (BY_NAME["llama.cpp"].plan(spec, hw, req).chosen.speed for hw in (slow, plain))
        assert a.decode_tokens_per_s == b.decode_tokens_per_s and "cpu_decode" not in a.terms["efficiency_source"]
    # while vramplan's own bf16 rows follow the rate
    mine = [plan(spec, hw, Request(context=4096, quant=("bf16",))).predicted for hw in (slow, plain)]
    assert mine[0].decode_tokens_per_s < mine[1].decode_tokens_per_s


def test_the_probe_reads_each_matrix_from_ram_past_the_last_level_cache(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from vramplan.runtime.probe import measure

    for i, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "491520K"), (1, "32K")]):  # sysfs, as Linux has it
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{i}" / "size").write_text(f"{size}\n")
    monkeypatch.setattr(measure, "_CACHE_DIR", str(tmp_path / "absent"))
    assert measure.last_level_cache_bytes() is None
    monkeypatch.setattr(measure, "_CACHE_DIR", str(tmp_path))
    assert measure.last_level_cache_bytes() == 491520 * 1024  # the 2-core Xeon VM's L3: 64 MiB matrices stayed in it
    monkeypatch.setattr(measure, "FLUSH_MAX_BYTES", 8 << 20)  # capped
    got, _ = measure.measure_cpu_decode_kernels(torch, repeats=1, nbytes=4 << 20)
    assert got and all("8.00 MiB read before each (the last-level cache)" in m.method for m in got.values())
    got, _ = measure.measure_cpu_decode_kernels(torch, repeats=1, nbytes=4 << 20, flush_bytes=None)
    assert not any("read before each" in m.method for m in got.values())


def test_the_probe_times_a_layers_fixed_cost_per_scheme_and_the_planner_prices_it():
    """The full probe's tiny-model timing of a decoder layer's fixed cost replaces the speed model's default (fitted
    on one machine) scheme by scheme, and vramplan's own decoder step is priced by the ratio of its two timings."""
    from vramplan.planner.hardware import CPU_LAYER_COSTS

    base = resolve_profile("cpu-ddr5-desktop")[0]
    costs = {"int8": 325e-6, "int4_a8": 291e-6, "lean": 215e-6}
    hw = replace(base, host=replace(base.host, cpu_decode_int4_a8_bytes_per_s=18e9,
                                    **{f"cpu_layer_{k}_s": v for k, v in costs.items()}))
    again = loads_profile(dumps_profile(hw), "test")
    assert again.host == hw.host and "cpu_layer_lean: 215 us" in dumps_profile(hw)
    assert set(CPU_LAYER_COSTS) == {*CPU_DECODE_KERNELS, "lean"}
    spec = model_spec("qwen2.5-0.5b")

    def per_layer(profile, quant, **kw) -> float:
        p = plan(spec, profile, Request(context=4096, quant=(quant,), kv_dtype=("bf16",), **kw))
        return next(c.value for k, c in p.constants.items() if k.endswith("_per_layer_s"))

    assert per_layer(hw, "quanto-int8") == pytest.approx(325e-6)  # the record
    assert per_layer(hw, "quanto-int4") == per_layer(base, "quanto-int4")  # no record: the default
    assert per_layer(hw, "cpu-w4a8", eager=True) == pytest.approx(291e-6)
    assert per_layer(hw, "cpu-w4a8") == pytest.approx(215e-6)  # lean: 291 x (215 / 291)
    p = plan(spec, hw, Request(context=4096, quant=("cpu-w4a8",), kv_dtype=("bf16",)))
    assert "host.cpu_layer_lean 215 us over host.cpu_layer_int4_a8 291 us" in p.chosen.speed.terms["efficiency_source"]


def test_the_probe_measures_every_layer_cost_it_can():
    torch = pytest.importorskip("torch")
    from vramplan.runtime import cpu_kernel
    from vramplan.runtime.probe.measure import measure_cpu_layer_costs

    got, skipped = measure_cpu_layer_costs(torch, {})
    assert set(got) | set(skipped) == {*CPU_DECODE_KERNELS, "lean"} and not set(got) & set(skipped)
    assert cpu_kernel.unavailable() is None or {"int4_a8", "lean"} <= set(skipped)
    assert all("busy machine" in why or "kernel" in why for why in skipped.values())  # no scheme failed
    assert all(0 < m.value < 0.1 and m.unit == "s" and len(m.samples) == 2 and "tiny Llama" in m.method
               for m in got.values())


def test_a_noisy_lean_timing_leaves_the_default_and_the_head_pack_follows_the_int8_path():
    from vramplan.planner.lean import LEAN_CPU_PER_LAYER_FACTOR
    from vramplan.planner.memory import workspace_bytes
    from vramplan.planner.quant import KV_SCHEMES
    from vramplan.planner.speed_cpu import lean_factor

    base = resolve_profile("cpu-ddr5-desktop")[0]
    noisy = replace(base, host=replace(base.host, cpu_layer_int4_a8_s=100e-6, cpu_layer_lean_s=300e-6))
    assert lean_factor(noisy) == (LEAN_CPU_PER_LAYER_FACTOR, "planner.lean.LEAN_CPU_PER_LAYER_FACTOR")
    spec, req, bf16 = model_spec("llama-3.2-1b"), Request(context=4096), KV_SCHEMES["bf16"]
    pack = 2 * spec.vocab_size * spec.hidden_size  # lm_head's int8 rows and their quantized copy, beside the packed
    for quant in ("quanto-w8a8", "cpu-w4a8"):
        assert workspace_bytes(spec, SCHEMES[quant], bf16, req)["head_pack"] == pack
        assert workspace_bytes(spec, SCHEMES[quant], bf16, req, int8_path="fbgemm")["head_pack"] == pack
        assert "head_pack" not in workspace_bytes(spec, SCHEMES[quant], bf16, req, int8_path="int_mm")
    assert "head_pack" not in workspace_bytes(spec, SCHEMES["quanto-int8"], bf16, req)  # int8 rows: no packing
    int_mm = replace(base, host=replace(base.host, cpu_decode_int4_a8_bytes_per_s=18e9,
                                        cpu_decode_int8_dynamic_path="int_mm"))
    fbgemm = replace(int_mm, host=replace(int_mm.host, cpu_decode_int8_dynamic_path="fbgemm"))
    rams = [plan(spec, hw, Request(context=4096, quant=("quanto-w8a8",))).memory.cpu.total_bytes
            for hw in (int_mm, fbgemm)]
    assert rams[1] - rams[0] == pack
