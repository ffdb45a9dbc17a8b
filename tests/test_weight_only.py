"""int8-wo and int4-wo (runtime.weight_only): torch's weight-only kernels, gpt-fast's path. On the CPU: each layer's
bytes are the planner's count, the products are the dequantized matrices', and the decode step compiles (fullgraph,
inductor) and gives the eager tokens. The planner decodes them compiled only, on a CUDA GPU. The CUDA kernels and the
CUDA graph are tested on a GPU (`-m gpu`, bench/gpu_validate.sh call A)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config_dict
from vramplan.planner.architectures import spec_from_config
from vramplan.planner.errors import PlanError
from vramplan.planner.quant import SCHEMES, tinygemm_packs
from vramplan.runtime.generate import generate, synthetic_prompt, warm_up
from vramplan.runtime.load import load_model
from vramplan.runtime.weight_only import Int4WeightOnly, Int8WeightOnly, quantize_linears

WO = ("int8-wo", "int4-wo")
# hidden 128: tinygemm takes every projection (in_features a multiple of 128); the conftest's 64 leaves q/k/v/o in bf16
WIDE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


@pytest.mark.parametrize("scheme", WO)
@pytest.mark.parametrize("overrides", [{}, WIDE])
def test_each_layer_holds_the_bytes_the_planner_counts(scheme, overrides):
    config = tiny_config_dict("llama", **overrides)
    spec = spec_from_config(config, name="tiny")
    s = SCHEMES[scheme]
    model = load_model(config, scheme=s, dummy_weights=True, seed=1, device="cpu", cpu_alone=False).model
    layers = model.model.layers
    for i, layer in enumerate(layers):
        assert _tensor_bytes(layer) == sum(s.tensor_bytes(t) for t in spec.layer_tensors(i))
    kinds = {type(m).__name__ for m in layers[0].modules()}
    assert ("Int8WeightOnly" if scheme == "int8-wo" else "Int4WeightOnly") in kinds
    # what tinygemm cannot take stays a plain linear: q/k/v/o at hidden 64
    assert ("Linear" in kinds) == (scheme == "int4-wo" and not overrides)
    assert type(model.lm_head) is torch.nn.Linear  # lm_head stays in the load dtype, as the planner counts it


def test_the_products_are_the_dequantized_matrices():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=True, dtype=torch.bfloat16)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    for q in (Int8WeightOnly.from_linear(linear, "cpu"), Int4WeightOnly.from_linear(linear, 64, "cpu")):
        ref = x.float() @ q.dequantize().t() + linear.bias.float()
        assert torch.allclose(q(x).float(), ref, atol=0.05 * ref.abs().max().item())
        # and close to the original weights: int8 within 1 %, int4 within 10 % of the output's scale
        exact = x.float() @ linear.weight.float().t() + linear.bias.float()
        error = (q(x).float() - exact).abs().max() / exact.abs().max()
        assert error < (0.01 if isinstance(q, Int8WeightOnly) else 0.1), (type(q).__name__, float(error))
    assert tinygemm_packs(384, 256, 64) and not tinygemm_packs(384, 192, 64) and not tinygemm_packs(12, 256, 64)


@pytest.mark.parametrize("scheme", WO)
def test_the_compiled_decode_gives_the_eager_tokens(scheme):
    from vramplan.runtime.compiled import StaticDecoder

    config = tiny_config_dict("llama", **WIDE)
    model = load_model(config, scheme=SCHEMES[scheme], dummy_weights=True, seed=3, device="cpu",
                       cpu_alone=False).model
    prompt = synthetic_prompt(16, 512, seed=5)
    eager = generate(model, prompt, max_new_tokens=8, prefill_chunk=8)
    static = StaticDecoder(model, max_len=16 + 8, device=torch.device("cpu"))  # fullgraph=True: no graph break
    assert warm_up(model, prompt, 8, static=static) > 0
    compiled = generate(model, prompt, max_new_tokens=8, prefill_chunk=8, static=static)
    assert compiled.tokens == eager.tokens and len(compiled.tokens) == 8


def test_quantize_linears_leaves_lm_head_and_counts_what_it_swaps():
    config = tiny_config_dict("llama", **WIDE)
    model = load_model(config, scheme=SCHEMES["bf16"], dummy_weights=True, seed=1, device="cpu", cpu_alone=False).model
    assert quantize_linears(model.model.layers, SCHEMES["int8-wo"], "cpu") == 2 * 7  # q k v o gate up down
    assert type(model.lm_head) is torch.nn.Linear


def test_a_checkpoint_loads_quantized_layer_by_layer(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], scheme=SCHEMES["int8-wo"], device="cpu", cpu_alone=False)
    assert sum(isinstance(m, Int8WeightOnly) for m in loaded.model.modules()) == 2 * 7
    assert any("int8-wo" in n for n in loaded.notes)


def test_the_planner_decodes_them_compiled_on_a_cuda_gpu_only():
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    spec, hw = model_spec("llama-3.1-8b"), resolve_profile("h200")[0]
    p = plan(spec, hw, Request(context=8192, quant=("int8-wo",), kv_dtype=("bf16",)))
    assert p.fits and p.chosen.compiled and p.decode_compiled
    assert "public_fit compiled int8-wo" in p.chosen.speed.terms["efficiency_source"]
    bf16 = plan(spec, hw, Request(context=8192, quant=("bf16",), kv_dtype=("bf16",)))
    assert p.predicted.decode_tokens_per_s > 1.15 * bf16.predicted.decode_tokens_per_s  # fewer bytes, same graph
    eager = plan(spec, hw, Request(context=8192, quant=("int8-wo",), eager=True))
    assert not eager.fits and "decodes compiled only" in eager.candidates[0].reason
    cache = plan(spec, hw, Request(context=8192, quant=("int4-wo",), kv_dtype=("fp8",)))
    assert not cache.fits and "with a bf16 cache only" in cache.candidates[0].reason
    with pytest.raises(PlanError, match="int8-wo does not run on cpu"):
        plan(spec, resolve_profile("cpu-ddr5-desktop")[0], Request(context=8192, quant=("int8-wo",)))
    on_cpu = [c for c in plan(spec, resolve_profile("cpu-ddr5-desktop")[0], Request(context=8192)).candidates
              if c.weight_quant in WO]
    assert on_cpu and all(not c.fits and "does not run on cpu" in c.reason for c in on_cpu)
    moe = plan(model_spec("qwen3-30b-a3b"), hw, Request(context=8192, quant=("int8-wo",), kv_dtype=("bf16",)))
    assert moe.fits and moe.chosen.compiled  # its experts quantized too (tests/test_wo_experts.py)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", WO)
def test_on_a_gpu_the_kernels_match_and_the_graph_replays(scheme):
    """The CUDA layouts (_convert_weight_to_int4pack, the fused int8 product) and a CUDA-graph decode: the products
    match the dequantized matrices, and the compiled tokens are the eager ones."""
    from vramplan.runtime.compiled import StaticDecoder

    torch.manual_seed(0)
    linear = torch.nn.Linear(4096, 1024, dtype=torch.bfloat16)
    q = (Int8WeightOnly.from_linear(linear, "cuda") if scheme == "int8-wo"
         else Int4WeightOnly.from_linear(linear, 64, "cuda"))
    x = torch.randn(3, 4096, dtype=torch.bfloat16, device="cuda")
    cpu = (Int8WeightOnly.from_linear(linear, "cpu") if scheme == "int8-wo"
           else Int4WeightOnly.from_linear(linear, 64, "cpu"))
    assert torch.allclose(q.dequantize().cpu(), cpu.dequantize(), atol=1e-2)  # the same codes, either layout
    ref = x.float() @ q.dequantize().t() + linear.bias.float().cuda()
    assert torch.allclose(q(x).float(), ref, atol=0.05 * ref.abs().max().item())
    config = tiny_config_dict("llama", **WIDE)
    model = load_model(config, scheme=SCHEMES[scheme], dummy_weights=True, seed=3, device="cuda:0").model
    prompt = synthetic_prompt(16, 512, seed=5).cuda()
    eager = generate(model, prompt, max_new_tokens=8, prefill_chunk=8)
    static = StaticDecoder(model, max_len=24, device=torch.device("cuda"))
    warm_up(model, prompt, 8, static=static)
    assert generate(model, prompt, max_new_tokens=8, prefill_chunk=8, static=static).tokens == eager.tokens


def test_what_runs_them_never_prices_or_runs_them_eager():
    """The run's prediction is the plan's decode mode (compiled here, as the plan chose it), plain transformers
    refuses them (its generate() is eager), and a GPU older than tinygemm's sm80 refuses int4-wo."""
    from dataclasses import replace

    from vramplan.planner.engines import BY_NAME, plan_for_engine
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec
    from vramplan.runtime.execute import predicted_for_run

    spec, hw = model_spec("llama-3.1-8b"), resolve_profile("h200")[0]
    for quant in ("int8-wo", "bf16"):  # a compiled-only scheme, and bf16's compiled default
        p = plan(spec, hw, Request(context=4096, prompt_tokens=1024, quant=(quant,), kv_dtype=("bf16",)))
        assert p.decode_compiled
        run = predicted_for_run(p, spec, hw, 1024, 1024 + 32)
        assert run.decode_tokens_per_s == pytest.approx(p.predicted.decode_tokens_per_s, rel=0.02)
    t = BY_NAME["transformers"].plan(spec, hw, Request(context=4096, quant=("int8-wo",), engine="transformers"))
    assert not t.fits and "generate() runs eager" in t.candidates[0].reason
    assert plan_for_engine(spec, hw, Request(context=4096, quant=("int8-wo",))).fits
    old = replace(hw, gpus=(replace(hw.gpus[0], compute_capability="7.5"),))
    with pytest.raises(PlanError, match="int4-wo needs compute capability 8.0 or newer"):
        plan(spec, old, Request(context=4096, quant=("int4-wo",)))
    assert all(not c.fits for c in plan(spec, old, Request(context=4096)).candidates if c.weight_quant == "int4-wo")
    assert plan(spec, old, Request(context=4096, quant=("int8-wo",), kv_dtype=("bf16",))).fits


def test_blocks_of_rows_pack_into_the_whole_matrixs_layout(monkeypatch):
    """int4 rows quantized a block at a time (ROWS_PER_BLOCK) give the products of the matrix packed whole."""
    from vramplan.runtime import weight_only

    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 320, bias=False, dtype=torch.bfloat16)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    whole = Int4WeightOnly.from_linear(linear, 64, "cpu")(x)
    monkeypatch.setattr(weight_only, "ROWS_PER_BLOCK", 64)
    assert torch.equal(Int4WeightOnly.from_linear(linear, 64, "cpu")(x), whole)
