"""quanto-w8a8: quanto's int8 rows multiplied by int8 activations quantized per token (runtime.quantize.Int8Dynamic,
runtime.experts.int8_dynamic_mm), on the CPU; its bytes, where the planner offers it, and the compiled CPU decode of
the quanto schemes (runtime.compiled with the direct kernels)."""

from __future__ import annotations

import pytest

from vramplan.planner.errors import PlanError
import torch

from conftest import assert_compiled_steps_near_eager, tiny_config_dict
from vramplan.planner.errors import VramplanError
from vramplan.planner.quant import SCHEMES
from vramplan.runtime.cpu_paths import fbgemm_available
from vramplan.runtime.experts import int8_dynamic_mm
from vramplan.runtime.generate import generate, synthetic_prompt, warm_up
from vramplan.runtime.load import load_model


def _reference_w8a8(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The recipe written out in float64: each row of x to int8 by its absmax / 127, exact integer sums, both scales."""
    xd = x.double()
    step = xd.abs().amax(dim=-1, keepdim=True).clamp_min(1e-300) / 127
    q = torch.round(xd / step).clamp(-127, 127)
    return (q @ data.double().t()) * step * scale.double().reshape(1, -1)


@pytest.mark.parametrize("rows,k,n", [(1, 896, 64), (5, 100, 7), (3, 17, 16)])
def test_int8_dynamic_mm_is_the_per_token_recipe(rows, k, n):
    g = torch.Generator().manual_seed(rows * k + n)
    x = (torch.randn(rows, k, generator=g) * 3).to(torch.bfloat16)
    x[0, 0] = 40.0  # an outlier sets its row's step
    data = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, generator=g) / 100).to(torch.bfloat16)
    out = int8_dynamic_mm(x, data, scale)
    ref = _reference_w8a8(x, data, scale)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    # the int32 sums are exact; what differs is fp32 rounding of the step and the products (and a rare tie of round)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    zeros = int8_dynamic_mm(torch.zeros(2, k, dtype=torch.bfloat16), data, scale)
    assert torch.equal(zeros, torch.zeros(2, n))


def test_int8_dynamic_mm_differs_from_weight_only_by_the_activation_rounding():
    """Not weight-only int8 under another name: the result moves by the activations' int8 rounding, by a small
    relative amount."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, generator=g).to(torch.bfloat16)
    data = torch.randint(-127, 128, (256, 512), dtype=torch.int8, generator=g)
    scale = torch.full((256,), 0.01, dtype=torch.bfloat16)
    weight_only = torch._weight_int8pack_mm(x, data, scale).float()
    dynamic = int8_dynamic_mm(x, data, scale)
    rel = ((dynamic - weight_only).norm() / weight_only.norm()).item()
    assert 1e-4 < rel < 2e-2


FBGEMM = pytest.mark.skipif(not fbgemm_available(), reason="this torch has no fbgemm (x86 builds do)")


@pytest.fixture(scope="module")
def tiny_models():
    """bf16, quanto-int8, and quanto-w8a8 by each int8 x int8 path ("quanto-w8a8" by _int_mm, "w8a8-fbgemm")."""
    config = tiny_config_dict("llama", tie_word_embeddings=False)
    models = {q: load_model(config, scheme=SCHEMES[q], dummy_weights=True, seed=3, device="cpu",
                            cpu_paths={"int8_dynamic": "int_mm"}) for q in ("bf16", "quanto-int8", "quanto-w8a8")}
    if fbgemm_available():
        models["w8a8-fbgemm"] = load_model(config, scheme=SCHEMES["quanto-w8a8"], dummy_weights=True, seed=3,
                                           device="cpu", cpu_paths={"int8_dynamic": "fbgemm"})
    return models


def test_w8a8_loads_every_linear_and_the_head_as_int8_dynamic(tiny_models):
    from vramplan.runtime.quantize import Int8Dynamic, Int8Rows
    from vramplan.runtime.tensors import count_tensor_bytes

    w8a8, int8 = tiny_models["quanto-w8a8"], tiny_models["quanto-int8"]
    dynamic = [n for n, m in w8a8.model.named_modules() if type(m) is Int8Dynamic]
    rows = [n for n, m in int8.model.named_modules() if type(m) is Int8Rows]
    assert dynamic == rows and "lm_head" in dynamic and len(dynamic) == 2 * 7 + 1
    assert any("its input quantized per token" in n for n in w8a8.notes)
    assert any("int8_dynamic by int_mm (the profile)" in n for n in w8a8.notes)
    assert count_tensor_bytes(w8a8.model) == count_tensor_bytes(int8.model)  # the same bytes: only the matmul differs


@FBGEMM
def test_w8a8_by_fbgemm_packs_every_linear_and_the_head_and_counts_their_bytes(tiny_models):
    from vramplan.planner.quant import fbgemm_linear_bytes
    from vramplan.runtime.cpu_paths import FbgemmInt8Dynamic
    from vramplan.runtime.quantize import Int8Rows
    from vramplan.runtime.tensors import count_tensor_bytes

    fb, int8 = tiny_models["w8a8-fbgemm"], tiny_models["quanto-int8"]
    packed = {n: m for n, m in fb.model.named_modules() if type(m) is FbgemmInt8Dynamic}
    rows = {n: m for n, m in int8.model.named_modules() if type(m) is Int8Rows}
    assert packed.keys() == rows.keys() and "lm_head" in packed
    assert any("int8_dynamic by fbgemm (the profile)" in n for n in fb.notes)
    for name, m in packed.items():  # the packed rows are quanto's int8 rows and scales (the same seed: the same)
        data, scale = m.unpacked()
        assert torch.equal(data, rows[name].data) and torch.allclose(scale, rows[name].scale.float(), rtol=1e-6)
    # no int8 rows kept beside the packed ones (quanto's fp32 scalars are); the packed bytes counted as
    # planner.quant.fbgemm_linear_bytes
    extra = sum(fbgemm_linear_bytes(m.out_features, m.in_features) - m.out_features * (m.in_features + 2)
                for m in packed.values())
    assert count_tensor_bytes(fb.model)["cpu"] == count_tensor_bytes(int8.model)["cpu"] + extra


@FBGEMM
def test_fbgemm_path_is_per_token_at_seven_bits():
    """Each token quantized by its own absmax: a small-valued token beside an outlier token keeps its precision (one
    scale for the whole input would round it to nothing), within 7-bit steps of the exact product."""
    from vramplan.runtime.cpu_paths import FbgemmInt8Dynamic

    g = torch.Generator().manual_seed(0)
    data = torch.randint(-127, 128, (48, 256), dtype=torch.int8, generator=g)
    scale = (torch.rand(48, generator=g) / 100).to(torch.bfloat16)
    m = FbgemmInt8Dynamic(data, scale, None)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    x[1] *= 1000  # an outlier token
    x[2] /= 1000  # a small one
    out = m(x).float()
    exact = x.double() @ (data.double() * scale.double().reshape(-1, 1)).t()
    for r in range(3):
        rel = ((out[r].double() - exact[r]).norm() / exact[r].norm()).item()
        assert rel < 0.03, (r, rel)
    alone = m(x[2:3]).float()
    assert ((alone[0] - out[2]).norm() / out[2].norm()).item() < 0.03  # as alone, up to the shared 7-bit grid
    assert torch.equal(m(torch.zeros(2, 256, dtype=torch.bfloat16)), torch.zeros(2, 48, dtype=torch.bfloat16))


def test_w8a8_logits_stay_near_bf16_and_near_weight_only_int8(tiny_models):
    ids = synthetic_prompt(12, 512, seed=1)
    with torch.no_grad():
        logits = {q: m.model(ids).logits.float() for q, m in tiny_models.items()}

    def rel(a, b):
        return ((logits[a] - logits[b]).norm() / logits[b].norm()).item()

    assert rel("quanto-w8a8", "bf16") < 0.05 and rel("quanto-int8", "bf16") < 0.05
    assert rel("quanto-w8a8", "quanto-int8") > 1e-4  # it did quantize the activations
    if "w8a8-fbgemm" in logits:  # 7-bit activations: further from int8 weight-only than _int_mm's 8, still near bf16
        assert rel("w8a8-fbgemm", "bf16") < 0.05 and rel("w8a8-fbgemm", "quanto-int8") > 1e-4


def test_w8a8_refuses_anything_but_the_cpu_alone_before_building(monkeypatch):
    import vramplan.runtime.load as load

    monkeypatch.setattr(load, "build_dummy", lambda *a, **k: pytest.fail("built before refusing"))
    with pytest.raises(VramplanError, match="runs on the CPU alone"):
        load.load_model(tiny_config_dict("llama"), scheme=SCHEMES["quanto-w8a8"], dummy_weights=True, device="cpu",
                        cpu_alone=False)


def test_w8a8_experts_multiply_int8_tokens():
    from vramplan.runtime.experts import ExpertMatrices, QuantizedExperts, QuantoInt8Matrices, QuantoW8A8Matrices

    loaded = load_model(tiny_config_dict("mixtral"), scheme=SCHEMES["quanto-w8a8"], dummy_weights=True, device="cpu")
    experts = [m for m in loaded.model.modules() if isinstance(m, QuantizedExperts)]
    matrices = [m for e in experts for m in e.children() if isinstance(m, ExpertMatrices)]
    assert len(matrices) == 2 * len(experts) and all(type(m) is QuantoW8A8Matrices for m in matrices)
    e = matrices[0]
    x = torch.randn(3, e.in_features).to(torch.bfloat16)
    out = e.matmul(x, 1)
    assert torch.equal(out, int8_dynamic_mm(x, e.data[1], e.scale[1]).to(torch.bfloat16))
    weight_only = QuantoInt8Matrices.matmul(e, x, 1)  # the same bytes multiplied with bf16 activations
    assert not torch.equal(out, weight_only)
    with torch.no_grad():
        assert torch.isfinite(loaded.model(synthetic_prompt(6, 512)).logits).all()


# ---------------------------------------------------------------- the planner


def test_the_planner_counts_w8a8_as_fbgemm_packs_it_and_offers_it_only_without_a_gpu():
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    from vramplan.planner.modelspec import Kind
    from vramplan.planner.quant import fbgemm_linear_bytes

    spec = model_spec("qwen2.5-0.5b")
    w8a8, int8 = SCHEMES["quanto-w8a8"], SCHEMES["quanto-int8"]
    linears = [t for t in spec.tensors if int8.touches(t)]
    assert linears and all(t.kind is Kind.LINEAR for t in linears)
    # hidden 896 pads to 1024 in fbgemm's blocks; 12 bytes a row against quanto's 2-byte scale; both keep quanto's 8
    assert w8a8.bytes_of(spec.tensors) - int8.bytes_of(spec.tensors) == sum(
        fbgemm_linear_bytes(*t.matrix_shape) + 8 - int8.tensor_bytes(t) for t in linears)
    assert fbgemm_linear_bytes(896, 896) == 896 * (1024 + 12) and fbgemm_linear_bytes(10, 4096) == 10 * 4108
    assert w8a8.quality.ppl_increase_pct > int8.quality.ppl_increase_pct and "7.581" in w8a8.quality.source
    cpu = plan(spec, resolve_profile("cpu-ddr5-desktop")[0], Request(context=4096, quant=("quanto-w8a8",)))
    assert cpu.fits and cpu.choice.weight_quant == "quanto-w8a8" and not cpu.choice.on_gpu
    with pytest.raises(PlanError, match="quanto-w8a8 does not run on cuda"):  # forced alone on a GPU: bad input
        plan(spec, resolve_profile("rtx-4090")[0], Request(context=4096, quant=("quanto-w8a8",)))
    gpu = plan(spec, resolve_profile("rtx-4090")[0], Request(context=4096, quant=("quanto-w8a8", "bf16")))
    assert gpu.fits and "quanto-w8a8 does not run on cuda" in gpu.candidates[0].reason


def test_a_calibration_of_weight_only_int8_does_not_stand_in_for_w8a8():
    from dataclasses import replace

    from vramplan.planner.hardware import Calibration, CalibrationEntry
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.speed import efficiency

    hw = resolve_profile("cpu-ddr5-desktop")[0]
    entry = CalibrationEntry(device="cpu", backend="quanto", quant="quanto-int8", bandwidth_efficiency=0.11,
                             compute_efficiency=None, per_layer_overhead_s=1e-3, per_token_overhead_s=1e-3)
    hw = replace(hw, calibration=Calibration(measured_at="2026-11-26", entries=(entry,)))
    assert efficiency(hw, "cpu", SCHEMES["quanto-int8"]).bandwidth == 0.11
    assert efficiency(hw, "cpu", SCHEMES["quanto-w8a8"]).bandwidth != 0.11
    assert efficiency(hw, "cpu", SCHEMES["quanto-w8a8"]).source == "default"


def test_compile_on_a_cpu_takes_the_quanto_schemes_and_their_experts_but_not_on_a_gpu():
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    cpu = resolve_profile("cpu-ddr5-desktop")[0]
    dense = model_spec("qwen2.5-0.5b")
    for q in ("quanto-int8", "quanto-int4", "quanto-w8a8"):
        p = plan(dense, cpu, Request(context=4096, compiled=True, quant=(q,), kv_dtype=("bf16",)))
        assert p.fits and p.choice.weight_quant == q
    moe = plan(model_spec("qwen3-30b-a3b"), cpu, Request(context=4096, compiled=True, quant=("quanto-int8",),
                                                         kv_dtype=("bf16",)))
    assert moe.fits and moe.decode_compiled  # the experts' unrolled forward, in the graph (tests/test_compiled.py)
    from vramplan.planner.architectures import spec_from_config
    from conftest import tiny_config_dict
    llama4 = spec_from_config(tiny_config_dict("llama", model_type="llama4_text", num_local_experts=4,
                                               num_experts_per_tok=1, intermediate_size_mlp=128), name="tiny-llama4")
    rows = plan(llama4, cpu, Request(context=256, compiled=True, quant=("quanto-int8",), kv_dtype=("bf16",)))
    assert not rows.fits and "row-wise experts module" in rows.candidates[0].reason
    gpu = plan(dense, resolve_profile("rtx-4090")[0], Request(context=4096, compiled=True, quant=("quanto-int8",),
                                                              kv_dtype=("bf16",)))
    assert not gpu.fits and "unmeasured on a GPU" in gpu.candidates[0].reason


# ---------------------------------------------------------------- compiled decode on the CPU


@pytest.mark.parametrize("quant, path", [("quanto-int8", None), ("quanto-w8a8", "int_mm"),
                                         pytest.param("quanto-w8a8", "fbgemm", marks=FBGEMM), ("quanto-int4", None)])
def test_a_compiled_cpu_decode_of_the_quanto_schemes_gives_the_eager_results(quant, path):
    """inductor compiles through the direct kernels (Int8Rows' _weight_int8pack_mm, Int8Dynamic's _int_mm and its
    per-token quantization, fbgemm's packed rows through a custom op, Int4Groups' _weight_int4pack_mm_for_cpu;
    quanto's own QLinear where a layer keeps it) and gives the tokens eager gives, on a tiny model (at real sizes they
    part at the random weights' near-ties: bench/results/compiled-cpu-cpu-dev.md)."""
    from vramplan.runtime.compiled import StaticDecoder
    from vramplan.runtime.cpu_paths import FbgemmInt8Dynamic
    from vramplan.runtime.quantize import Int4Groups, Int8Dynamic, Int8Rows

    # hidden 256: the MLP's inputs (256, 512) take tinygemm's groups of 128, so int4 has Int4Groups layers too
    model = load_model(tiny_config_dict("llama", hidden_size=256, intermediate_size=512), scheme=SCHEMES[quant],
                       dummy_weights=True, seed=5, device="cpu", cpu_paths={"int8_dynamic": path} if path else None
                       ).model
    kinds = {type(m) for m in model.modules() if m is not model.lm_head}
    assert kinds & {Int8Rows, Int8Dynamic, Int4Groups, FbgemmInt8Dynamic}
    assert path is None or (FbgemmInt8Dynamic in kinds) == (path == "fbgemm")
    if quant == "quanto-w8a8":  # activations quantized: an input's last-bit difference (inductor's fused norms) is a
        assert_compiled_steps_near_eager(model, 6)  # step of the int8 grid, so near-tied tokens may part (seen on the
        return  # AVX-512 Xeon VM with fbgemm at the 7th token): each step's logits against eager's, fed the same tokens
    prompt = synthetic_prompt(16, 512, seed=2)
    eager = generate(model, prompt, max_new_tokens=8, prefill_chunk=16)
    static = StaticDecoder(model, max_len=16 + 8, device=torch.device("cpu"))
    assert warm_up(model, prompt, 16, static=static) > 0
    compiled = generate(model, prompt, max_new_tokens=8, prefill_chunk=16, static=static)
    assert compiled.tokens == eager.tokens and len(compiled.tokens) == 8


def test_a_compiled_cpu_decode_is_priced_with_its_measured_per_layer_factor():
    from dataclasses import replace

    from vramplan.planner.hardware import Calibration, CalibrationEntry
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec
    from vramplan.planner.speed import COMPILED_CPU_PER_LAYER_FACTOR, efficiency

    cpu, dense = resolve_profile("cpu-ddr5-desktop")[0], model_spec("qwen2.5-0.5b")
    ask = dict(context=4096, quant=("quanto-w8a8",), kv_dtype=("bf16",))
    eager, compiled = (plan(dense, cpu, Request(**ask, compiled=c)) for c in (False, True))
    factor = COMPILED_CPU_PER_LAYER_FACTOR["quanto-w8a8"]
    assert 0 < factor < 1
    e, c = eager.chosen.speed.terms, compiled.chosen.speed.terms
    assert c["per_layer_s"] == pytest.approx(e["per_layer_s"] * factor)
    assert "COMPILED_CPU_PER_LAYER_FACTOR[quanto-w8a8]" in c["efficiency_source"]
    assert c["kv_efficiency"] == e["kv_efficiency"]  # attention is not what compiling changes here
    assert compiled.predicted.decode_tokens_per_s > eager.predicted.decode_tokens_per_s
    shown = {k: v for k, v in compiled.constants.items() if k.endswith("per_layer_s")}
    assert shown and all(v.value == pytest.approx(c["per_layer_s"]) for v in shown.values())
    # a calibrated per-layer cost is scaled too, not clamped away
    entry = CalibrationEntry(device="cpu", backend="quanto", quant="quanto-w8a8", bandwidth_efficiency=0.5,
                             compute_efficiency=None, per_layer_overhead_s=40e-6)
    calibrated = replace(cpu, calibration=Calibration(measured_at="2026-11-26", entries=(entry,)))
    w8a8 = SCHEMES["quanto-w8a8"]
    assert efficiency(calibrated, "cpu", w8a8, compiled=True).per_layer_s == pytest.approx(40e-6 * factor)
    # bf16 and every GPU plan: no factor
    assert efficiency(cpu, "cpu", SCHEMES["bf16"], compiled=True) == efficiency(cpu, "cpu", SCHEMES["bf16"])
    gpu, int8 = resolve_profile("rtx-4090")[0], SCHEMES["quanto-int8"]
    assert efficiency(gpu, "gpu", int8, compiled=True) == efficiency(gpu, "gpu", int8)


def test_w8a8_reads_its_cache_as_weight_only_int8_does():
    """Its matmuls' efficiency is its own; attention and the cache update are quanto-int8's."""
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec
    from vramplan.planner.speed import weight_only_sibling

    assert weight_only_sibling(SCHEMES["quanto-w8a8"]) is SCHEMES["quanto-int8"]
    assert weight_only_sibling(SCHEMES["quanto-int4"]) is SCHEMES["quanto-int4"]
    cpu, dense = resolve_profile("cpu-ddr5-desktop")[0], model_spec("qwen2.5-0.5b")
    terms = {q: plan(dense, cpu, Request(context=32768, quant=(q,), kv_dtype=("bf16",))).chosen.speed.terms
             for q in ("quanto-int8", "quanto-w8a8")}
    assert terms["quanto-w8a8"]["kv_efficiency"] == terms["quanto-int8"]["kv_efficiency"]
    assert terms["quanto-w8a8"]["bandwidth_efficiency"] > terms["quanto-int8"]["bandwidth_efficiency"]


def test_calibrating_a_gpu_profile_on_its_cpu_leaves_out_the_cpu_scheme():
    """A GPU profile calibrated where torch cannot reach CUDA runs the CPU matrix; quanto-w8a8, which the planner never
    offers on that profile, is skipped there, not refused."""
    from vramplan.planner.profiles import resolve_profile
    from vramplan.runtime.calibrate import CPU_MATRIX, check_fits

    assert "quanto-w8a8" in CPU_MATRIX.quants
    matrix = type(CPU_MATRIX)(models=("qwen2.5-0.5b",), quants=CPU_MATRIX.quants, prompts=(64,), new_tokens=8)
    kept, warnings = check_fits(resolve_profile("rtx-4090")[0], matrix, named=("qwen2.5-0.5b",), on_gpu=False)
    assert ("qwen2.5-0.5b", "quanto-w8a8") in kept.skip and warnings == []
    assert not any(q != "quanto-w8a8" and ("qwen2.5-0.5b", q) in kept.skip for q in CPU_MATRIX.quants)
