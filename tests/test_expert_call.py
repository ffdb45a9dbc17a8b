"""The CPU's routed-expert call, timed by the probe and priced by the speed model (issue 41: CPU defaults follow the
machine): a profile's host.cpu_expert_call prices an eager MoE decode's calls; a prefill's and a compiled decode's keep
the default, as the plan's constants say."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import run_profile
from vramplan.planner.profile_yaml import loads_profile, profile_to_dict
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec
from vramplan.planner.speed import DEFAULT_CPU_EXPERT_CALL_S

ROOT = Path(__file__).resolve().parents[1]


def test_a_profile_carries_the_call_and_refuses_a_bad_one():
    d = yaml.safe_load(Path(run_profile()).read_text())
    d["host"]["cpu_expert_call"] = "268 us"
    hw = loads_profile(yaml.safe_dump(d))
    assert hw.host.cpu_expert_call_s == pytest.approx(268e-6)
    assert loads_profile(yaml.safe_dump(profile_to_dict(hw))).host.cpu_expert_call_s == pytest.approx(268e-6)
    d["host"]["cpu_expert_call"] = "-1 us"
    with pytest.raises(Exception, match="cpu_expert_call"):
        loads_profile(yaml.safe_dump(d))


def test_an_eager_moe_decode_pays_the_measured_call_and_its_prefill_the_default():
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    assert hw.host.cpu_expert_call_s is None
    spec = model_spec("qwen3-30b-a3b")
    req = Request(context=4096, prompt_tokens=64, quant=("quanto-int4",), kv_dtype=("bf16",))
    slow = replace(hw, host=replace(hw.host, cpu_expert_call_s=10 * DEFAULT_CPU_EXPERT_CALL_S))
    base, measured = plan(spec, hw, req), plan(spec, slow, req)
    terms = measured.chosen.speed.terms
    assert terms["per_expert_call_s"] == pytest.approx(10 * DEFAULT_CPU_EXPERT_CALL_S)
    assert terms["prefill_per_expert_call_s"] == DEFAULT_CPU_EXPERT_CALL_S
    assert "host.cpu_expert_call" in terms["experts_efficiency_source"]
    # 48 MoE layers x 8 routed experts a token, each call 9 x the default dearer
    step = 1 / measured.predicted.decode_tokens_per_s - 1 / base.predicted.decode_tokens_per_s
    assert step == pytest.approx(48 * 8 * 9 * DEFAULT_CPU_EXPERT_CALL_S, rel=1e-6)
    assert measured.predicted.ttft_s == pytest.approx(base.predicted.ttft_s, rel=1e-9)
    consts = measured.constants
    assert consts["cpu_eager_decode_expert_call_s"].value == pytest.approx(10 * DEFAULT_CPU_EXPERT_CALL_S)
    compiled = plan(spec, slow, replace(req, compiled=True))  # the unrolled experts, in the graph: the default
    assert compiled.decode_compiled and compiled.chosen.speed.terms["per_expert_call_s"] == DEFAULT_CPU_EXPERT_CALL_S


def test_the_probe_times_the_call():
    torch = pytest.importorskip("torch")
    from vramplan.runtime.probe.measure import measure_cpu_expert_call

    m = measure_cpu_expert_call(torch, repeats=3, calls=5)
    assert m.unit == "s" and 1e-6 < m.value < 0.1 and len(m.samples) == 3
    assert "QuantizedExperts (quanto-int4" in m.method


def test_the_epyc_profile_records_its_probes_call():
    hw = loads_profile((ROOT / "bench" / "results" / "profile-cpu-epyc-avx2.yaml").read_text())
    assert hw.host.cpu_expert_call_s == pytest.approx(268e-6)


@pytest.mark.parametrize("hw_name", ["cpu-ddr5-desktop", "rtx-3060-12gb"])
def test_llama_cpp_pays_no_cost_per_expert(hw_name):
    """ggml computes a layer's routed experts in one op (mul_mat_id): llama.cpp's plans price the experts' bytes and no
    per-expert call, uncalibrated as calibrated, whatever the probe timed of torch's eager call."""
    from vramplan.planner.engines import BY_NAME

    hw = resolve_profile(hw_name)[0]
    slow = replace(hw, host=replace(hw.host, cpu_expert_call_s=1e-3))
    req = Request(context=8192, engine="llama.cpp", quant=("Q4_K_M",), kv_dtype=("f16",))
    a, b = (BY_NAME["llama.cpp"].plan(model_spec("qwen3-30b-a3b"), h, req).chosen.speed for h in (hw, slow))
    assert a.terms["per_expert_call_s"] == 0 and "mul_mat_id" in a.terms["experts_efficiency_source"]
    assert a.decode_tokens_per_s == b.decode_tokens_per_s


def test_unquantized_experts_pay_one_call_a_layer():
    """bf16 / fp16 experts run transformers' grouped call (grouped_mm by default in transformers 5): one fixed cost a
    layer, whatever the number of experts routed; vramplan's quantized experts loop over them and pay one each. On the
    AVX2 EPYC VM a 1.9 GB Qwen3-MoE-shaped bf16 model decoded 15.6-17.5 tok/s, predicted 13.6 with a call per expert
    and 15.7 with one a layer (2026-11-29)."""
    from vramplan.planner.quant import KV_SCHEMES, SCHEMES
    from vramplan.planner.speed import _rates

    hw = resolve_profile("cpu-ddr5-desktop")[0]
    spec = model_spec("qwen3-30b-a3b")
    for name, grouped in (("bf16", True), ("quanto-int8", False)):
        rates = _rates(hw, "cpu", spec, SCHEMES[name], KV_SCHEMES["bf16"])
        assert rates.experts.grouped is grouped
        one, eight = rates.experts_s(0.0, 1.0), rates.experts_s(0.0, 8.0)
        assert (eight == one) if grouped else (eight == 8 * one)


def test_vllms_fused_moe_groups_every_format_and_vramplans_unrolled_experts_do_not():
    """vLLM's fused MoE kernels run a layer's experts in one call whatever the format; vramplan's compiled int8-wo /
    int4-wo experts are unrolled, a call each (runtime.experts.QuantizedExperts.unrolled_forward)."""
    from vramplan.planner.engines import vllm
    from vramplan.planner.quant import KV_SCHEMES, compiled_scheme
    from vramplan.planner.speed import _rates

    hw, spec = resolve_profile("h200")[0], model_spec("qwen3-30b-a3b")
    for bits in ((16,), (8,), (4, 32)):
        assert _rates(hw, 0, spec, compiled_scheme(*bits, groups_experts=True), KV_SCHEMES["bf16"]).experts.grouped
    assert not _rates(hw, 0, spec, compiled_scheme(8), KV_SCHEMES["bf16"]).experts.grouped
    assert _rates(hw, 0, spec, compiled_scheme(16), KV_SCHEMES["bf16"]).experts.grouped  # transformers' grouped_mm
    answer = vllm.answer(spec, hw, Request(context=8192), None)  # its own search: fp8 / int8 only if faster now
    assert answer.fits and answer.decode_tokens_per_s


def test_plain_transformers_leaves_an_moes_experts_as_loaded():
    """transformers 5's bitsandbytes and quanto loaders swap nn.Linear layers only: an MoE's fused experts stay bf16 and
    run grouped. Plain transformers' row counts them so (it said 16.85 GiB of GPU weights for Qwen3-30B-A3B nf4, where
    about 56 GiB are stored: a false fit on a 24 GB card), while vramplan's own runtime quantizes them per expert."""
    from vramplan.planner.engines import BY_NAME
    from vramplan.planner.engines.hf_transformers import as_transformers_loads
    from vramplan.planner.quant import SCHEMES

    spec, hw = model_spec("qwen3-30b-a3b"), resolve_profile("h200")[0]
    experts = [t for i in range(spec.num_layers) for t in spec.layer_tensors(i) if t.role.name == "EXPERT"]
    for name in ("bnb-nf4", "quanto-int8"):
        loads = as_transformers_loads(SCHEMES[name])
        assert loads is as_transformers_loads(SCHEMES[name]) and loads.groups_experts
        assert loads.bytes_of(experts) == SCHEMES["bf16"].bytes_of(experts) > 1.9 * SCHEMES[name].bytes_of(experts)
    row = BY_NAME["transformers"].plan(spec, hw, Request(context=8192, engine="transformers", quant=("bnb-nf4",),
                                                         kv_dtype=("bf16",)))
    mine = plan(spec, hw, Request(context=8192, quant=("bnb-nf4",), kv_dtype=("bf16",)))
    assert row.chosen.memory.gpu.weights_bytes > 3 * mine.chosen.memory.gpu.weights_bytes
    small = resolve_profile("rtx-4090")[0]
    nf4 = BY_NAME["transformers"].plan(spec, small, Request(context=8192, engine="transformers", quant=("bnb-nf4",),
                                                            kv_dtype=("bf16",)))
    assert not nf4.fits or nf4.chosen.choice.expert_layers_on_cpu  # never every expert on a 24 GB card
