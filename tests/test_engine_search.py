"""Each engine's own best answer (issue 37): every row of the engine table is that engine's own search over its formats,
caches and placements under the request's preference and quality floor (planner.engine's one loop), the same
computation as `--engine X` (or, for vLLM, as `--emit vllm`), and no engine says "fits" over what it would allocate."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.planner.engine import request_for
from vramplan.planner.engines import BY_NAME, emit, plan_for_engine
from vramplan.planner.engines.vllm import vllm_best
from vramplan.planner.errors import VramplanError
from vramplan.planner.profile_yaml import profile_from_dict, profile_to_dict
from vramplan.planner.profiles import list_profiles, resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import catalog, model_spec
from vramplan.planner.units import GiB

RTX4090 = resolve_profile("rtx-4090")[0]


def two_3090s():
    d = profile_to_dict(resolve_profile("rtx-3090")[0])
    d["name"], d["gpus"][0]["count"] = "rtx-3090-x2", 2
    return profile_from_dict(d)


def row(p, engine: str):
    return next(e for e in p.engines if e.engine == engine)


# ---------------------------------------------------------------- the three requests
@pytest.mark.parametrize("model, hw, req, ft, kv, gpu_layers, decode_over", [
    ("qwen3-32b", RTX4090, Request(context=32768), "Q4_K_M", "q8_0", 64, 30.0),
    ("qwen2.5-7b", RTX4090, Request(context=131072, vram_budget_bytes=8 * GiB), "Q4_K_M", "q4_0", 28, 30.0),
    ("llama-3.1-70b", two_3090s(), Request(context=32768), "Q4_K_M", "q8_0", 79, 8.0),
])
def test_the_requests_that_were_wrong_come_out_right(model, hw, req, ft, kv, gpu_layers, decode_over):
    """The table once translated vramplan's pick (bnb-nf4 -> Q4_K_M with an f16 cache, 54/64 layers) and called vramplan
    fastest; llama.cpp's own search keeps a q8_0 / q4_0 cache and every layer it can on the GPU."""
    p = plan_for_engine(model_spec(model), hw, req)
    ll = row(p, "llama.cpp")
    assert (ll.weight_quant, ll.kv_dtype, ll.gpu_layers) == (ft, kv, gpu_layers)
    assert ll.decode_tokens_per_s > decode_over
    assert p.fastest_engine.engine in ("llama.cpp", "ollama")
    assert p.fastest_engine.decode_tokens_per_s > p.predicted.decode_tokens_per_s


# ---------------------------------------------------------------- every row is that engine planned alone
MODELS = [e.id for e in catalog()]
PROFILES = [e.name for e in list_profiles() if e.profile is not None]


def _same_row(a, b) -> None:
    keys = ("weight_quant", "kv_dtype", "fits", "gpu_layers", "expert_layers_on_cpu", "decode_tokens_per_s", "ttft_s",
            "max_context_tokens")
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), profile=st.sampled_from(PROFILES),
       context=st.sampled_from([4096, 32768, 131072]), prefer=st.sampled_from(["balanced", "speed", "quality"]))
def test_every_row_equals_the_engine_planned_alone(model, profile, context, prefer):
    spec, hw = model_spec(model), resolve_profile(profile)[0]
    req = Request(context=context, prefer=prefer, allow_context_overflow=True)
    p = plan_for_engine(spec, hw, req)
    for engine in ("llama.cpp", "ollama", "transformers"):
        try:
            alone = plan_for_engine(spec, hw, request_for(engine, req, hw)[0])
        except VramplanError as e:  # an engine that refuses this model: its row says so
            assert not row(p, engine).fits and str(e) in row(p, engine).reason
            continue
        _same_row(row(p, engine), row(alone, engine))
        assert row(alone, "vramplan").engine == "vramplan"  # and that plan has every engine's row too
    v = vllm_best(spec, hw, req)
    assert row(p, "vllm").weight_quant == (v.fmt.name if v.fmt is not None else "-")
    export = emit("vllm", spec, hw, p)
    assert export.fits == row(p, "vllm").fits
    if export.fits:
        assert export.details["weight_format"] == row(p, "vllm").weight_quant


# ---------------------------------------------------------------- no engine fits over what it allocates
def _within(c, hw) -> None:
    mem = c.memory
    for g in mem.gpus:
        assert g.total_bytes <= g.capacity_bytes, c.reason
    assert mem.cpu.total_bytes <= mem.cpu.capacity_bytes, c.reason
    if hw.unified_memory:  # one pool: both sides together
        assert mem.gpu_total_bytes + mem.cpu.total_bytes <= hw.host.ram_bytes, c.reason


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), profile=st.sampled_from(PROFILES),
       context=st.sampled_from([4096, 32768, 131072]), engine=st.sampled_from(["llama.cpp", "ollama", "transformers"]))
def test_no_engine_fits_over_its_capacity(model, profile, context, engine):
    spec, hw = model_spec(model), resolve_profile(profile)[0]
    req = request_for(engine, Request(context=context, allow_context_overflow=True), hw)[0]
    try:
        p = BY_NAME[engine].plan(spec, hw, req)
    except VramplanError:
        return  # the engine refuses the model (no GGUF mapping): no verdict to check
    for c in p.candidates:
        if c.fits:
            _within(c, hw)


@pytest.mark.parametrize("profile", ["apple-m2-ultra-192gb", "apple-m2-max-96gb"])
@pytest.mark.parametrize("model", ["deepseek-r1", "llama-3.1-70b", "qwen3-235b-a22b"])
def test_unified_memory_holds_both_sides_for_every_engine(profile, model):
    hw = resolve_profile(profile)[0]
    for engine in ("vramplan", "llama.cpp", "ollama", "transformers"):
        p = BY_NAME[engine].plan(model_spec(model), hw, request_for(engine, Request(context=8192), hw)[0])
        for c in p.candidates:
            if c.fits:
                _within(c, hw)


@pytest.mark.parametrize("model, hw, ctx", [("llama-3.1-70b", "rtx-4090", 32768), ("qwen3-30b-a3b", "rtx-3060-12gb",
                                                                                 65536),
                                            ("mixtral", "l4", 8192), ("llama-3.1-405b", "h200", 131072)])
def test_one_device_packing_by_prefix_sums_is_the_slot_by_slot_packing(model, hw, ctx):
    """llama.cpp's placement on one GPU: the prefix-sum path answers every (-ngl, --n-cpu-moe) as the slot-by-slot
    packing into devices does."""
    from vramplan.planner.engines import llamacpp
    from vramplan.planner.engines import llamacpp_rules as rules

    spec, profile = model_spec(model), resolve_profile(hw)[0]
    req = Request(context=ctx, engine="llama.cpp")
    for ft, kv in (("Q4_K_M", "q8_0"), ("Q8_0", "f16")):
        fp = llamacpp.footprint(spec, profile, req, rules.gguf_model(spec, ft), kv)
        assert len(fp.usable) == 1 and fp.with_logits >= fp.scratch
        moe = [0, 1, spec.num_layers // 2, spec.num_layers] if spec.moe is not None else [0]
        fits = 0
        for g in range(spec.num_layers + 1):
            for m in moe:
                fast, slow = fp.pack(g, m), fp._pack_in_order(g, m)
                assert fast == slow, (ft, kv, g, m)
                fits += fast is not None
        assert 0 < fits  # some placements fit, so both answers were compared where it matters
