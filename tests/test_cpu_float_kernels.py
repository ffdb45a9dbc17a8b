"""The CPU where bf16 is converted in software: a prefill's bf16 matmuls in fp32 blocks (runtime.quantize.Bf16Rows),
decode attention with the query packed by KV group (runtime.attention), and the peaks the planner prices them against
(planner.speed.cpu_float_peak / cpu_matmul_peak: the profile's measured fp32 and int8 matmuls)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import tiny_config_dict
from vramplan.planner.errors import ProfileError
from vramplan.planner.profile_yaml import dumps_profile, loads_profile
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.quant import SCHEMES
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec
from vramplan.planner.speed import cpu_float_peak, cpu_matmul_peak
from vramplan.runtime import quantize
from vramplan.runtime.attention import PACKED_SDPA, attention_name, pack_single_queries
from vramplan.runtime.generate import generate, synthetic_prompt
from vramplan.runtime.load import load_model
from vramplan.runtime.quantize import Bf16Rows


# ---------------------------------------------------------------- bf16 prefill in fp32 blocks


def _linear(n_in: int, n_out: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("rows,bias", [(8, True), (37, False), (128, True)])
def test_a_prefill_of_bf16_rows_multiplies_in_fp32_blocks_and_rounds_once(monkeypatch, rows, bias):
    """Several rows: the fp32 product of the bf16 operands, rounded once to bf16, whatever the blocks (small ones here,
    so that the last block is partial); F.linear's bf16 GEMM also sums in fp32, so at most the last bit differs."""
    monkeypatch.setattr(quantize, "FP32_BLOCK_BYTES", 4 * 96 * 10)  # 10 rows of 96 inputs a block: 7 blocks of 70
    monkeypatch.setattr(Bf16Rows, "FP32_PREFILL", True)  # (a CPU without native bf16)
    lin = _linear(96, 70, bias, rows)
    x = torch.randn(1, rows, 96).to(torch.bfloat16)
    out = Bf16Rows.of(lin)(x)
    exact = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 70)
    assert torch.allclose(out.float(), exact, rtol=2 ** -8, atol=1e-6)  # one rounding to bf16
    reference = lin(x)
    ulp = (reference.float().abs() * 2 ** -7).clamp_min(1e-30)
    assert ((out.float() - reference.float()).abs() <= ulp).all()


def test_fewer_rows_than_the_fp32_threshold_keep_f_linear_and_one_row_its_gemv(monkeypatch):
    lin = _linear(64, 48, True, 0)
    rows = Bf16Rows.of(lin)
    few = torch.randn(1, Bf16Rows.FP32_MIN_ROWS - 1, 64).to(torch.bfloat16)
    assert torch.equal(rows(few), lin(few))
    many = torch.randn(1, Bf16Rows.FP32_MIN_ROWS, 64).to(torch.bfloat16)
    monkeypatch.setattr(Bf16Rows, "FP32_PREFILL", True)
    assert torch.equal(rows(many), quantize._fp32_blocks(lin.weight, many, lin.bias))
    monkeypatch.setattr(Bf16Rows, "FP32_PREFILL", False)  # where bf16 is native, its GEMM
    assert torch.equal(rows(many), lin(many))
    monkeypatch.setattr(Bf16Rows, "FP32_PREFILL", None)  # decided by this CPU at the first prefill
    rows(many)
    from vramplan.runtime.cpu_paths import native_bf16
    assert Bf16Rows.FP32_PREFILL is (not native_bf16())


# ---------------------------------------------------------------- decode attention, packed by KV group


def _tiny_gqa(**overrides) -> dict:
    return tiny_config_dict("llama", num_attention_heads=4, num_key_value_heads=2, **overrides)


def test_a_model_on_the_cpu_alone_decodes_with_packed_queries_and_the_same_tokens(monkeypatch):
    from vramplan.runtime import attention

    loaded = load_model(_tiny_gqa(), scheme=SCHEMES["bf16"], dummy_weights=True, seed=3)
    model = loaded.model
    assert model.config._attn_implementation == PACKED_SDPA and attention_name(model) == "sdpa"
    assert any("groups the query heads that share a KV head" in n for n in loaded.notes)
    ids = synthetic_prompt(40, model.config.vocab_size, 5)
    packed_shapes = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: packed_shapes.append(tuple(q.shape)) or sdpa(q, *a, **kw))
    packed = generate(model, ids, max_new_tokens=12, prefill_chunk=16)
    monkeypatch.undo()
    # (torch's SDPA, which transformers' prefill calls too): every decode step of both layers took the packed path, 2
    # KV heads x 2 queries each, none the 4 heads of one query
    decode = [shape for shape in packed_shapes if shape[2] <= 2]
    assert set(decode) == {(1, 2, 2, model.config.head_dim)} and len(decode) >= 2 * 11
    model.set_attn_implementation("sdpa")  # transformers' own: enable_gqa when there is no mask
    stock = generate(model, ids, max_new_tokens=12, prefill_chunk=16)
    assert packed.tokens == stock.tokens


def test_packed_attention_is_sdpa_of_the_same_tensors_and_defers_everything_else(monkeypatch):
    """One query over a grouped cache: the SDPA of the packed query equals the per-head SDPA; a mask, several queries
    or a model without groups go to transformers' function, as they came."""
    import transformers.integrations.sdpa_attention as sa

    from vramplan.runtime.attention import packed_sdpa_forward

    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 1, 16, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 50, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    out, _ = packed_sdpa_forward(module, q, k, v, None, scaling=0.25)
    per_head = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                              v.double().repeat_interleave(3, 1), scale=0.25)
    assert out.shape == (1, 1, 6, 16)
    assert torch.allclose(out.double(), per_head.transpose(1, 2), atol=1e-2)
    deferred = []
    monkeypatch.setattr(sa, "sdpa_attention_forward", lambda *a, **kw: deferred.append(a[1].shape) or ("stock", None))
    packed_sdpa_forward(module, q, k, v, torch.ones(1, 1, 1, 50, dtype=torch.bool))
    packed_sdpa_forward(module, torch.randn(1, 6, 4, 16).to(torch.bfloat16), k, v, None)
    packed_sdpa_forward(module, q, k, v, None, s_aux=torch.zeros(6))  # sinks, even all zero
    module.num_key_value_groups = 1
    packed_sdpa_forward(module, q[:, :2], k, v, None)
    assert deferred == [(1, 6, 1, 16), (1, 6, 4, 16), (1, 6, 1, 16), (1, 2, 1, 16)]


def test_calibration_switching_between_eager_and_sdpa_keeps_sdpa_packed_on_the_cpu():
    from vramplan.runtime.attention import use_attention

    model = load_model(_tiny_gqa(), scheme=SCHEMES["bf16"], dummy_weights=True).model
    use_attention(model, "eager", "cpu")
    assert model.config._attn_implementation == "eager" and attention_name(model) == "eager"
    use_attention(model, "sdpa", "cpu")
    assert model.config._attn_implementation == PACKED_SDPA and attention_name(model) == "sdpa"


def test_an_eager_model_keeps_its_attention():
    model = load_model(_tiny_gqa(), scheme=SCHEMES["bf16"], dummy_weights=True).model
    model.set_attn_implementation("eager")
    assert not pack_single_queries(model) and model.config._attn_implementation == "eager"


# ---------------------------------------------------------------- the peaks the planner prices them against


def _cpu_profile(**host):
    hw = resolve_profile("cpu-ddr5-desktop")[0]
    return dataclasses.replace(hw, host=dataclasses.replace(hw.host, **host))


def test_cpu_kernels_compute_against_the_faster_float_peak_and_w8a8_against_int8():
    slow_bf16 = _cpu_profile(cpu_bf16_flops=60e9, cpu_fp32_flops=350e9, cpu_int8_ops=1.2e12).host
    assert cpu_float_peak(slow_bf16) == (350e9, "host.cpu_fp32_compute")
    assert cpu_matmul_peak(slow_bf16, SCHEMES["quanto-int4"]) == (350e9, "host.cpu_fp32_compute")
    assert cpu_matmul_peak(slow_bf16, SCHEMES["quanto-w8a8"]) == (1.2e12, "host.cpu_int8_compute")
    native = _cpu_profile(cpu_bf16_flops=2e12, cpu_fp32_flops=1e12).host  # AVX512-BF16 / AMX: bf16 is the faster
    assert cpu_float_peak(native) == (2e12, "host.cpu_bf16_compute")
    assert cpu_matmul_peak(native, SCHEMES["quanto-w8a8"]) == (2e12, "host.cpu_bf16_compute")  # no int8 figure
    # torch's int8 / int4 weight-only kernels multiply in fp32 whatever bf16 does (the Xeon AMX VM: 133-158 GFLOP/s)
    assert cpu_matmul_peak(native, SCHEMES["quanto-int8"]) == (1e12, "host.cpu_fp32_compute")
    assert cpu_matmul_peak(native, SCHEMES["bf16"]) == (2e12, "host.cpu_bf16_compute")  # oneDNN's native bf16
    # fp16 and bitsandbytes keep the bf16 figure their default efficiencies were set against
    assert cpu_matmul_peak(slow_bf16, SCHEMES["fp16"]) == (60e9, "host.cpu_bf16_compute")
    assert cpu_matmul_peak(slow_bf16, SCHEMES["bnb-nf4"]) == (60e9, "host.cpu_bf16_compute")
    datasheet = _cpu_profile().host
    assert datasheet.cpu_fp32_flops is None
    assert cpu_matmul_peak(datasheet, SCHEMES["bf16"]) == (datasheet.cpu_bf16_flops, "host.cpu_bf16_compute")


def test_a_plan_prices_the_prefill_against_the_profiles_measured_peaks_and_says_which():
    spec = model_spec("qwen2.5-0.5b")
    req = Request(context=4096, prompt_tokens=2048, quant=("bf16",), kv_dtype=("bf16",))
    bf16_only = plan(spec, _cpu_profile(cpu_bf16_flops=60e9), req)
    with_fp32 = plan(spec, _cpu_profile(cpu_bf16_flops=60e9, cpu_fp32_flops=360e9), req)
    assert with_fp32.predicted.ttft_s < bf16_only.predicted.ttft_s / 4
    assert with_fp32.predicted.terms["matmul_peak_from"] == "host.cpu_fp32_compute"
    assert with_fp32.predicted.terms["matmul_peak_flops"] == 360e9
    assert bf16_only.predicted.terms["matmul_peak_from"] == "host.cpu_bf16_compute"
    assert with_fp32.constants["cpu_fp32_flops"].value == 360e9
    assert "cpu_fp32_flops" not in bf16_only.constants
    w8a8 = Request(context=4096, prompt_tokens=2048, quant=("quanto-w8a8",), kv_dtype=("bf16",))
    slow, fast = (plan(spec, _cpu_profile(cpu_bf16_flops=60e9, cpu_fp32_flops=360e9, cpu_int8_ops=ops), w8a8)
                  for ops in (0.6e12, 1.2e12))
    assert fast.predicted.terms["matmul_peak_from"] == "host.cpu_int8_compute"
    assert fast.predicted.ttft_s < slow.predicted.ttft_s  # twice the int8 rate: the matmuls' share halves


def test_the_fp32_and_int8_figures_round_trip_through_yaml_and_are_checked():
    hw = _cpu_profile(cpu_fp32_flops=350e9, cpu_int8_ops=1.166e12)
    text = dumps_profile(hw)
    assert "cpu_fp32_compute: 0.35 TFLOPS" in text and "cpu_int8_compute: 1.166 TFLOPS" in text
    back = loads_profile(text)
    assert back.host.cpu_fp32_flops == pytest.approx(350e9) and back.host.cpu_int8_ops == pytest.approx(1.166e12)
    assert loads_profile(dumps_profile(_cpu_profile())).host.cpu_int8_ops is None  # written as null
    with pytest.raises(ProfileError, match="cpu_fp32"):
        loads_profile(text.replace("cpu_fp32_compute: 0.35 TFLOPS", "cpu_fp32_compute: fast"))


def test_llama_cpp_runs_are_fitted_against_the_peaks_its_plans_are_priced_with():
    from vramplan.planner.engines.llamacpp import SPEED_SCHEME
    from vramplan.planner.engines.llamacpp_fit import ServerRun, calibration_sample

    hw = _cpu_profile(cpu_bf16_flops=60e9, cpu_fp32_flops=360e9)
    run = ServerRun(spec=model_spec("qwen2.5-0.5b"), file_type="Q8_0", kv_type="f16", prompt=256, new_tokens=16,
                    decode_s_per_token=0.04, prefill_s=1.0)
    sample = calibration_sample(hw, run)
    assert sample.peak_flops == cpu_float_peak(hw.host)[0] == 360e9
    assert sample.matmul_peak_flops == cpu_matmul_peak(hw.host, SPEED_SCHEME)[0] == 360e9
