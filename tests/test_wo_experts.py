"""int8-wo and int4-wo on an MoE: the routed experts quantized per expert for torch's weight-only kernels
(runtime.experts.TorchInt8Matrices / TorchInt4Matrices), counted by the planner byte for byte, and decoded inside the
compiled step both ways a graph reads an expert: at the index read on the host (the CPU's way) and by gathering the
slices at the index tensor (CUDA's: no host sync in the graph). The CUDA kernels run in the GPU tests."""

from __future__ import annotations

import pytest
import torch

from conftest import compiled_and_eager_tokens, tiny_config_dict
from vramplan.planner.architectures import spec_from_config
from vramplan.planner.quant import SCHEMES
from vramplan.runtime.experts import PlainMatrices, QuantizedExperts, TorchInt4Matrices, TorchInt8Matrices
from vramplan.runtime.load import load_model

WO = ("int8-wo", "int4-wo")
# hidden 128 and expert width 256: tinygemm takes both projections (in a multiple of 128, out of 16)
WIDE_MOE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _model(scheme: str, **overrides):
    config = tiny_config_dict("mixtral", **{**WIDE_MOE, **overrides})
    return config, load_model(config, scheme=SCHEMES[scheme], dummy_weights=True, seed=2, device="cpu",
                              cpu_alone=False).model


@pytest.mark.parametrize("scheme", WO)
@pytest.mark.parametrize("overrides", [{}, dict(intermediate_size=96)])
def test_each_layer_holds_the_bytes_the_planner_counts(scheme, overrides):
    config, model = _model(scheme, **overrides)
    spec = spec_from_config(config, name="tiny-moe")
    s = SCHEMES[scheme]
    for i, layer in enumerate(model.model.layers):
        assert _tensor_bytes(layer) == sum(s.tensor_bytes(t) for t in spec.layer_tensors(i))
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == 2
    kinds = {type(experts[0].gate_up), type(experts[0].down)}
    if scheme == "int8-wo":
        assert kinds == {TorchInt8Matrices}
    elif not overrides:
        assert kinds == {TorchInt4Matrices}
    else:  # an expert width of 96 is no whole tinygemm tile: the down projection stays in bf16, as counted
        assert kinds == {TorchInt4Matrices, PlainMatrices} and type(experts[0].down) is PlainMatrices


@pytest.mark.parametrize("scheme", WO)
def test_each_expert_multiplies_by_its_dequantized_matrix_either_way(scheme):
    _, model = _model(scheme)
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    for e in range(experts.num_experts):
        ref = x.float() @ experts.gate_up.dequantize(e).t()
        by_index = experts.gate_up.matmul(x, e).float()
        gathered = experts.gate_up.matmul(x, torch.tensor([e])).float()
        assert torch.allclose(by_index, ref, atol=0.02 * ref.abs().max().item())
        assert torch.equal(gathered, by_index)


@pytest.mark.parametrize("scheme", WO)
@pytest.mark.parametrize("gather", [False, True])
def test_the_compiled_decode_gives_the_eager_tokens(scheme, gather):
    """fullgraph=True: the experts' unrolled forward holds no graph break, read at the index (the CPU's way) or
    gathered at the index tensor (CUDA's way, forced here)."""
    _, model = _model(scheme)
    for m in model.modules():
        if isinstance(m, QuantizedExperts):
            assert m.gathers is False  # on the CPU: the index read on the host
            m.gather_override = gather
    compiled, eager = compiled_and_eager_tokens(model, 12, 6)
    assert compiled == eager and len(compiled) == 6


def test_the_planner_quantizes_an_moes_experts_and_compiles_it():
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    spec, hw = model_spec("qwen3-30b-a3b"), resolve_profile("h200")[0]
    bf16 = plan(spec, hw, Request(context=8192, quant=("bf16",), kv_dtype=("bf16",)))
    for scheme, share in (("int8-wo", 0.55), ("int4-wo", 0.32)):
        p = plan(spec, hw, Request(context=8192, quant=(scheme,), kv_dtype=("bf16",)))
        assert p.fits and p.chosen.compiled, p.chosen.reason
        assert p.chosen.memory.gpu.weights_bytes < share * bf16.chosen.memory.gpu.weights_bytes  # experts at its bits
        # int4's routed experts, gathered for tinygemm in the graph, are priced at three passes over their bytes (by
        # design, unmeasured); int8's gather fuses into its matmul: one
        source = p.chosen.speed.terms["experts_efficiency_source"]
        assert ("GATHERED_INT4_EXPERT_PASSES" in source) == (scheme == "int4-wo")
    # on a 24 GB card: every layer and expert on the GPU, compiled, where bf16 keeps most layers' experts in RAM
    small = resolve_profile("rtx-4090")[0]
    int4 = plan(spec, small, Request(context=8192, quant=("int4-wo",), kv_dtype=("bf16",)))
    assert int4.fits and int4.chosen.compiled and not int4.chosen.choice.expert_layers_on_cpu
    bf16 = plan(spec, small, Request(context=8192, quant=("bf16",), kv_dtype=("bf16",)))
    assert bf16.chosen.choice.expert_layers_on_cpu
    assert int4.predicted.decode_tokens_per_s > 2 * bf16.predicted.decode_tokens_per_s
    llama4 = spec_from_config(tiny_config_dict("llama", model_type="llama4_text", num_local_experts=4,
                                               num_experts_per_tok=1, intermediate_size_mlp=128), name="tiny-llama4")
    rows = plan(llama4, hw, Request(context=256, quant=("int4-wo",), kv_dtype=("bf16",)))
    assert not rows.fits and "row-wise experts module" in rows.candidates[0].reason
    assert "int4-wo decodes compiled only" in rows.candidates[0].reason


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", WO)
def test_on_a_gpu_the_experts_gather_inside_one_cuda_graph(scheme):
    """CUDA's layouts and the gathered read: each expert's product matches the CPU layout's dequantized matrix, and
    the compiled step (reduce-overhead) gives eager's tokens with no step left out of CUDA graphs (no host read of
    an expert index)."""
    from torch._dynamo.utils import counters

    config = tiny_config_dict("mixtral", **WIDE_MOE)
    model = load_model(config, scheme=SCHEMES[scheme], dummy_weights=True, seed=2, device="cuda:0").model
    cpu = load_model(config, scheme=SCHEMES[scheme], dummy_weights=True, seed=2, device="cpu", cpu_alone=False).model
    gpu_experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    cpu_experts = [m for m in cpu.modules() if isinstance(m, QuantizedExperts)]
    assert gpu_experts and all(m.gathers for m in gpu_experts)
    for e in range(gpu_experts[0].num_experts):  # the same codes in either layout
        assert torch.allclose(gpu_experts[0].down.dequantize(e).cpu(), cpu_experts[0].down.dequantize(e), atol=1e-2)
    counters.clear()
    compiled, eager = compiled_and_eager_tokens(model, 12, 6, device="cuda")
    assert compiled == eager
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_only_vramplans_gathered_int4_experts_pay_the_extra_passes():
    """The three passes price vramplan's int4-wo experts gathered for tinygemm, and only them: not another engine's
    compiled 4-bit format (vLLM's fused MoE kernels, gpt-oss' mxfp4), not int8-wo, and not experts tinygemm cannot
    take (they stay in bf16)."""
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.quant import KV_SCHEMES, compiled_scheme
    from vramplan.planner.sources import model_spec
    from vramplan.planner.speed import _rates

    hw, kv = resolve_profile("h200")[0], KV_SCHEMES["bf16"]
    moe = model_spec("qwen3-30b-a3b")
    narrow = spec_from_config(tiny_config_dict("mixtral", **{**WIDE_MOE, "intermediate_size": 96}), name="tiny")

    def gathered(spec, scheme) -> bool:
        return "GATHERED_INT4_EXPERT_PASSES" in _rates(hw, 0, spec, scheme, kv).experts.source

    assert gathered(moe, compiled_scheme(4, 64, True))
    assert not gathered(moe, compiled_scheme(4, 32))  # vLLM's mxfp4 stand-in
    assert not gathered(moe, compiled_scheme(8))
    assert not gathered(narrow, compiled_scheme(4, 64, True))
    assert compiled_scheme(4, 64, True) is compiled_scheme(4, 64, True)  # one object: the speed memos key by identity
