"""cpu-w4a8: vramplan's own CPU kernel (runtime.cpu_kernel), 4-bit weights in groups of 128 times int8 activations per
group, built with the machine's C compiler. Its product against the recipe written out, its bytes against the
planner's, its tokens compiled against eager, where the planner offers it, and what a machine without the kernel is
told."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import assert_compiled_steps_near_eager, save_tiny_model, tiny_config, tiny_config_dict
from cli_helpers import assert_one_line_error, isolate, run_cli
from vramplan.planner.errors import PlanError, VramplanError
from vramplan.planner.modelspec import Role
from vramplan.planner.quant import CPU_W4A8_GROUP, SCHEMES
from vramplan.runtime import cpu_kernel
from vramplan.runtime.cpu_paths import fbgemm_available
from vramplan.runtime.load import load_model
from vramplan.runtime.weight_only import group_quantize

W4A8 = SCHEMES["cpu-w4a8"]


@pytest.fixture
def kernel():
    """Skips where the kernel cannot be built (built at the first use, in the session's cache: not at collection)."""
    if (why := cpu_kernel.unavailable()) is not None:
        pytest.skip(f"cpu-w4a8's kernel is not available here: {why}")

# hidden 256 and an MLP of 384: every projection takes groups of 128; 320 leaves the down projection in bf16
TINY = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _recipe(x: torch.Tensor, layer: cpu_kernel.W4A8Linear) -> torch.Tensor:
    """The product written out: each input row to int8 per group (absmax / 127 in fp32, x times its inverse rounded to
    nearest even, as the kernel's vcvtps2dq), exact integer sums, in float64."""
    g = layer.group_size
    xf = x.float().reshape(x.shape[0], -1, g)
    step = xf.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round(xf * inv).clamp(-127, 127)
    return (q * step).reshape(x.shape[0], -1).double() @ layer.dequantize().double().t()


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("n, k", [(64, 256), (30, 384), (7, 128)])  # whole row tiles of 4, and short ones
def test_the_kernel_computes_the_recipe_in_fp32_and_bf16(rows, n, k):
    torch.manual_seed(rows * 100 + n)
    layer = cpu_kernel.W4A8Linear.from_linear(torch.nn.Linear(k, n, bias=False))
    x = torch.randn(rows, k)
    x[0, :CPU_W4A8_GROUP] = 0  # a group of zeros: a zero step, no division by it
    ref = _recipe(x, layer)
    got = cpu_kernel.w4a8_mm(x, layer.codes, layer.scale_zeros, layer.group_size)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert torch.allclose(got.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    xb = x.bfloat16()
    got = cpu_kernel.w4a8_mm(xb, layer.codes, layer.scale_zeros, layer.group_size)
    ref = _recipe(xb.float(), layer)
    assert got.dtype == torch.bfloat16  # rounded once, to nearest even: within half a bf16 step of the fp32 sums
    assert ((got.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6 * ref.abs().max()).all()


def test_the_layout_holds_the_codes_and_the_values_of_group_quantize():
    torch.manual_seed(3)
    codes = torch.randint(0, 16, (5, 256), dtype=torch.int32)
    packed = cpu_kernel.pack_codes(codes)
    assert packed.shape == (5, 128) and packed.dtype == torch.uint8
    assert torch.equal(cpu_kernel.unpack_codes(packed), codes)
    assert packed[0, 0] == codes[0, 0] | codes[0, 16] << 4  # ggml's Q4_0 order: 0-15 low nibbles, 16-31 high
    linear = torch.nn.Linear(256, 24, bias=True).to(torch.bfloat16)
    layer = cpu_kernel.W4A8Linear.from_linear(linear)
    q, sz = group_quantize(linear.weight.float(), CPU_W4A8_GROUP)
    values = (q.float() - 8) * sz[..., 0].t().float().repeat_interleave(128, 1) \
        + sz[..., 1].t().float().repeat_interleave(128, 1)
    assert torch.equal(layer.dequantize(), values) and layer.bias is linear.bias.detach() or \
        torch.equal(layer.bias, linear.bias)
    nbytes = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scale_zeros))
    assert nbytes == 24 * 256 // 2 + 24 * 2 * 4  # codes + a bf16 scale and zero per group: the planner's count


@pytest.mark.usefixtures("kernel")
@pytest.mark.skipif(not fbgemm_available(), reason="lm_head takes quanto-w8a8's int8 path, counted as fbgemm packs it")
@pytest.mark.parametrize("intermediate", [384, 320])
def test_a_loaded_model_holds_the_bytes_the_planner_counts(intermediate):
    from vramplan.planner.architectures import spec_from_config
    from vramplan.planner.memory import weight_costs

    config = tiny_config_dict("llama", **{**TINY, "intermediate_size": intermediate})
    loaded = load_model(config, scheme=W4A8, dummy_weights=True, seed=1, device="cpu",
                        cpu_paths={"int8_dynamic": "fbgemm"})
    layers = [m for m in loaded.model.modules() if isinstance(m, cpu_kernel.W4A8Linear)]
    # 7 projections a layer; an MLP input of 320 is no whole number of groups: the down projection stays bf16
    assert len(layers) == config["num_hidden_layers"] * (7 if intermediate == 384 else 6)
    spec = spec_from_config(config, name="tiny-llama")
    rotary = sum(b.numel() * b.element_size() for n, b in loaded.model.named_buffers() if n.endswith("inv_freq"))
    assert sum(loaded.weights_bytes_by_device.values()) - rotary == weight_costs(spec, W4A8, cpu_only=True).total_bytes
    assert any("vramplan's AVX2 kernel" in n for n in loaded.notes)


@pytest.mark.usefixtures("kernel")
def test_a_compiled_decode_computes_the_eager_logits():
    """The compiled step (the kernel as the custom op vramplan::w4a8_linear inside inductor's graph) against eager
    steps of the same tokens. Quantizing activations turns an input's last-bit difference (inductor's fused norms, the
    head's fp32 input in the static decoder) into a step of the int8 grid: about 2 % of the largest logit here, where
    bf16 agrees to 0.5 %, so a tiny random model's near-tied tokens may part (half of six seeds, quanto-w8a8's one of
    three); a wrong product would be off by the logits' own size."""
    model = load_model(tiny_config_dict("llama", **TINY), scheme=W4A8, dummy_weights=True, seed=3, device="cpu").model
    assert_compiled_steps_near_eager(model, 6)


@pytest.mark.usefixtures("kernel")
def test_a_product_refuses_tensors_of_another_layout():
    layer = cpu_kernel.W4A8Linear.from_linear(torch.nn.Linear(256, 8))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernel.w4a8_mm(torch.randn(1, 128), layer.codes, layer.scale_zeros, 128)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernel.w4a8_mm(torch.randn(1, 256), layer.codes, layer.scale_zeros.float(), 128)


@pytest.mark.usefixtures("kernel")
def test_prefill_and_decode_rows_agree_with_the_one_row_product():
    """A prefill's rows (the tiled path) give each row's decode product (the streaming path): the same sums."""
    torch.manual_seed(7)
    layer = cpu_kernel.W4A8Linear.from_linear(torch.nn.Linear(384, 30))
    x = torch.randn(7, 384)
    together = layer(x)
    apart = torch.cat([layer(x[i:i + 1]) for i in range(7)])
    assert torch.allclose(together, apart, atol=1e-5, rtol=0)


def _with_kernel_rate(name: str, rate: float | None):
    from vramplan.planner.profiles import resolve_profile

    hw = resolve_profile(name)[0]
    return dataclasses.replace(hw, host=dataclasses.replace(hw.host, cpu_decode_int4_a8_bytes_per_s=rate))


def test_the_planner_offers_it_only_where_the_probe_timed_its_kernel_for_dense_and_moe_models():
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    spec = model_spec("qwen2.5-0.5b")
    req = Request(context=4096, quant=("cpu-w4a8", "quanto-int4"))
    without = plan(spec, _with_kernel_rate("cpu-ddr5-desktop", None), req)
    refused = next(c for c in without.candidates if c.weight_quant == "cpu-w4a8")
    assert not refused.fits and "host.cpu_decode_int4_a8" in refused.reason
    hw = _with_kernel_rate("cpu-ddr5-desktop", 20e9)
    got = plan(spec, hw, Request(context=4096, quant=("cpu-w4a8",)))
    assert got.fits and got.choice.weight_quant == "cpu-w4a8" and not got.choice.on_gpu
    assert "host.cpu_decode_int4_a8 20.0 GB/s" in got.chosen.speed.terms["efficiency_source"]  # its rate
    faster = plan(spec, _with_kernel_rate("cpu-ddr5-desktop", 40e9), Request(context=4096, quant=("cpu-w4a8",)))
    assert faster.chosen.speed.decode_tokens_per_s > got.chosen.speed.decode_tokens_per_s
    moe_spec = model_spec("qwen3-30b-a3b")
    moe = plan(moe_spec, _with_kernel_rate("cpu-ddr5-desktop", 20e9), Request(context=4096, quant=("cpu-w4a8",)))
    assert moe.fits and moe.choice.weight_quant == "cpu-w4a8"  # the routed experts in the kernel's layout too
    experts = [t for t in moe_spec.tensors if t.role is Role.EXPERT]
    e, n = experts[0].shape[0], experts[0].matrix_shape[0] * experts[0].matrix_shape[1]
    assert W4A8.touches(experts[0]) and W4A8.tensor_bytes(experts[0]) == e * (n // 2 + n // CPU_W4A8_GROUP * 4)
    with pytest.raises(PlanError, match="does not run on cuda"):
        plan(spec, _with_kernel_rate("rtx-4090", 20e9), Request(context=4096, quant=("cpu-w4a8",)))
    assert W4A8.quality.ppl_increase_pct > SCHEMES["quanto-int4"].quality.ppl_increase_pct
    assert "5.73" in W4A8.quality.source and "7.581" in W4A8.quality.source


def test_a_machine_without_the_kernel_gets_the_reason(monkeypatch):
    cpu_kernel._load.cache_clear()
    try:
        monkeypatch.setenv("CC", "/nonexistent/vramplan-test-cc")
        monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(__import__("tempfile").mkdtemp()))
        reason = cpu_kernel.unavailable()
        assert reason is not None
        if "AVX2" not in reason and "x86-64" not in reason:  # (on such a CPU that is the reason)
            assert "could not be built" in reason or "did not build" in reason
        with pytest.raises(VramplanError, match="cpu-w4a8 cannot run here"):
            load_model(tiny_config_dict("llama", **TINY), scheme=W4A8, dummy_weights=True, device="cpu")
    finally:
        cpu_kernel._load.cache_clear()


def test_the_quick_probe_estimates_the_kernel_where_it_can_build(monkeypatch):
    from vramplan.runtime.probe.core import probe
    from vramplan.runtime.probe.host import W4A8_FLAGS, c_compiler, read_host

    flags = set(read_host().cpu_flags)
    host = probe(quick=True).profile.host
    can = W4A8_FLAGS <= flags and c_compiler() is not None and __import__("platform").machine() == "x86_64"
    assert (host.cpu_decode_int4_a8_bytes_per_s is not None) == can
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert probe(quick=True).profile.host.cpu_decode_int4_a8_bytes_per_s is None  # no compiler: no rate


@pytest.mark.usefixtures("kernel")
def test_run_and_the_transformers_export_from_the_cli(tmp_path, monkeypatch, capsys):
    import yaml

    from conftest import run_profile

    isolate(tmp_path, monkeypatch)
    d = yaml.safe_load(open(run_profile()).read())
    d["name"] = "w4a8-here"
    profile = tmp_path / "w4a8-here.yaml"
    profile.write_text(yaml.safe_dump(d, sort_keys=False))
    model = save_tiny_model(tiny_config("llama", **TINY), tmp_path / "tiny")
    code, out, err = run_cli(capsys, "run", "--model", model, "--quant", "cpu-w4a8", "-H", profile, "-n", "4",
                             "--prompt-tokens", "8")
    line = assert_one_line_error(code, err)
    assert "cpu-w4a8" in line and "host.cpu_decode_int4_a8" in line
    d["host"]["cpu_decode_int4_a8"] = "12 GB/s"
    profile.write_text(yaml.safe_dump(d, sort_keys=False))
    code, out, err = run_cli(capsys, "run", "--model", model, "--quant", "cpu-w4a8", "-H", profile, "-n", "4",
                             "--prompt-tokens", "8", "--json")
    assert code == 0, err
    assert "vramplan's AVX2 kernel" in out
    code, out, err = run_cli(capsys, "plan", "--model", model, "--quant", "cpu-w4a8", "-H", profile, "--emit",
                             "transformers")
    assert code == 0, err
    assert "as transformers's quanto-int4" in out  # plain transformers has no such kernel: its nearest scheme
    code, out, err = run_cli(capsys, "plan", "--model", model, "--quant", "cpu-w4a8", "-H", profile, "--engine",
                             "transformers")
    assert "nothing fits" in out and "cpu-w4a8 is vramplan's own CPU kernel: plain transformers has none" in out


# hidden 128 and an expert width of 256: both expert projections take groups of 128
TINY_MOE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.mark.usefixtures("kernel")
@pytest.mark.skipif(not fbgemm_available(), reason="lm_head takes quanto-w8a8's int8 path, counted as fbgemm packs it")
def test_moe_experts_take_the_kernel_and_the_bytes_the_planner_counts():
    from vramplan.planner.architectures import spec_from_config
    from vramplan.planner.memory import weight_costs
    from vramplan.runtime.experts import QuantizedExperts, W4A8Matrices

    config = tiny_config_dict("mixtral", **TINY_MOE)
    loaded = load_model(config, scheme=W4A8, dummy_weights=True, seed=2, device="cpu",
                        cpu_paths={"int8_dynamic": "fbgemm"})
    experts = [m for m in loaded.model.modules() if isinstance(m, QuantizedExperts)]
    assert experts and all(type(x.gate_up) is W4A8Matrices and type(x.down) is W4A8Matrices for x in experts)
    spec = spec_from_config(config, name="tiny-moe")
    rotary = sum(b.numel() * b.element_size() for n, b in loaded.model.named_buffers() if n.endswith("inv_freq"))
    assert sum(loaded.weights_bytes_by_device.values()) - rotary == weight_costs(spec, W4A8, cpu_only=True).total_bytes
    down = experts[0].down
    x = torch.randn(3, down.in_features)
    for e in range(down.num_experts):
        ref = _recipe(x, cpu_kernel.W4A8Linear(down.codes[e], down.scale_zeros[e], down.group_size, None))
        got = down.matmul(x, e)
        assert torch.allclose(got.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


@pytest.mark.usefixtures("kernel")
def test_a_compiled_moe_decode_computes_the_eager_logits():
    """The unrolled experts forward inside the compiled step, each expert's slices read at the index on the host, the
    kernel as the custom op (see the dense test for the tolerance)."""
    model = load_model(tiny_config_dict("mixtral", **TINY_MOE), scheme=W4A8, dummy_weights=True, seed=3,
                       device="cpu").model
    assert_compiled_steps_near_eager(model, 4)

