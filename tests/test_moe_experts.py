"""Routed MoE experts quantized per expert (runtime/experts.py) against the planner and against bf16.

Tiny MoE models (hidden 64, 2 layers, 4 experts, top-2, expert width 128 so that a down projection
takes quanto int4's group-128 path and a gate_up its group-64 one) of the MoE families in both
layouts: standard [E, out, in] (mixtral, qwen3_moe, qwen2_moe with a shared expert, deepseek_v3 with
shared experts and dense first layers) and transposed [E, in, out] (gpt_oss, with biases and its
clamped GLU; llama4, whose experts take pre-scaled rows).

Tolerances, and why:
- an expert's matrix is quantized by the library's own quantizer into exactly the tensors the library's
  Linear layer holds for the same matrix (checked byte for byte), so its reconstruction error
  is the dense layers' one (tests/test_runtime_core.py: int8 < 1 %, NF4 < 10 %, quanto int4 < 11 %,
  FP4 < 13.5 % on Gaussian weights).
- the experts' forward against transformers' eager forward run on the dequantized weights isolates the
  routing and gating math from the quantization error: what remains is the kernels' own rounding.
  bnb 4-bit dequantizes to the activations' dtype, so in fp32 both sides agree to fp32 roundoff
  (bound 1e-5, measured 1.4e-7); quanto's kernels run in bf16 (bound 1e-2, a few bf16 roundoffs of
  3.9e-3, measured up to 5.9e-3); bnb int8 also quantizes the activations to int8 per row (bound 3e-2,
  measured up to 1.6e-2).
- logits of a 32-token prompt, mean over positions of the relative error vs the bf16 model, as for
  dense models: int8 < 4 % and 4-bit < 30 % (measured up to 2.5 % and 18.7 %, gpt_oss the worst): the
  experts are most of each layer's weights and their error enters the residual stream like a dense
  MLP's; weight errors measured here are the dense ones (int8 0.6-0.7 %, NF4 9.1-9.3 %, FP4 12.0-12.3 %,
  quanto int4 8.9-10.3 %).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TINY_COMMON, save_tiny_model
from vramplan.planner.architectures import spec_from_config
from vramplan.planner.memory import weight_costs
from vramplan.planner.modelspec import Kind
from vramplan.planner.quant import SCHEMES
from vramplan.runtime.experts import QuantizedExperts, QuantizedRowExperts, quantize_experts
from vramplan.runtime.generate import synthetic_prompt
from vramplan.runtime.load import load_model
from vramplan.runtime.tensors import count_tensor_bytes, module_leaves

QUANTIZED = ["bnb-int8", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "bnb-fp4-dq", "quanto-int8", "quanto-int4"]
MOE = dict(num_experts_per_tok=2)
TINY_MOE: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, intermediate_size=128, **MOE),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=128, **MOE),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=128, shared_expert_intermediate_size=128, **MOE),
    "gpt_oss": dict(num_local_experts=4, intermediate_size=128, sliding_window=8, **MOE),
    "deepseek_v3": dict(n_routed_experts=4, moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=16,
                        qk_rope_head_dim=32, v_head_dim=32, head_dim=None, num_key_value_heads=2, **MOE),
    "llama4_text": dict(num_local_experts=4, intermediate_size=128, intermediate_size_mlp=256, num_experts_per_tok=1,
                        attention_chunk_size=16),
}
PROMPT = synthetic_prompt(32, 512, seed=1)


def moe_config(arch: str, **overrides) -> dict:
    """The full config.json transformers writes for a tiny MoE model (what the planner reads)."""
    from transformers import AutoConfig

    values = {k: v for k, v in {**TINY_COMMON, **TINY_MOE[arch], **overrides}.items() if v is not None}
    return AutoConfig.for_model(arch, **values).to_dict()


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """Tiny bf16 MoE checkpoints with transformers' own (Gaussian) init, saved as safetensors."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("tiny-moe")
    out = {}
    for arch in TINY_MOE:
        config = moe_config(arch)
        out[arch] = save_tiny_model(AutoConfig.for_model(config.pop("model_type"), **config), root / arch)
    return out


def _experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedExperts)]


def _gaussian_experts(arch: str, seed: int = 0, **overrides):
    """One layer's experts module as transformers builds it, weights ~ N(0, 0.02), biases ~ N(0, 0.02)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = moe_config(arch, **overrides)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    name, experts = next((n, m) for n, m in model.named_modules() if n.endswith("experts") and hasattr(m, "down_proj"))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    return experts


# --- exact bytes -----------------------------------------------------------------------


@pytest.mark.parametrize("quant", QUANTIZED)
@pytest.mark.parametrize("arch", sorted(TINY_MOE))
def test_planned_bytes_equal_allocated_bytes_per_experts_tensor(arch, quant):
    """Every fused experts tensor: the planner's bytes == the bytes its quantized projection holds; and in total."""
    import transformers

    config = moe_config(arch)
    spec = spec_from_config(config, name=arch, transformers_version=transformers.__version__)  # fp32 routers
    loaded = load_model(config, scheme=SCHEMES[quant], dummy_weights=True, seed=1)
    model = loaded.model
    experts = _experts_modules(model)
    assert len(experts) == len(spec.moe.moe_layers)
    for name, module in experts:
        for projection in ("gate_up", "down"):
            t = spec.tensor(f"{name}.{projection}_proj")
            assert t.kind is Kind.EXPERTS
            held = count_tensor_bytes(getattr(module, projection))
            assert held == {"cpu": SCHEMES[quant].tensor_bytes(t)}, (name, projection)
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary_emb" in n)
    planned = weight_costs(spec, SCHEMES[quant], cpu_only=True).total_bytes  # on the CPU: its lm_head (cpu_head)
    assert planned == sum(loaded.weights_bytes_by_device.values()) - buffers


def test_bf16_leaves_the_experts_as_transformers_builds_them():
    model = load_model(moe_config("mixtral"), scheme=SCHEMES["bf16"], dummy_weights=True).model
    assert not _experts_modules(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.ndim == 3


@pytest.mark.parametrize("quant", QUANTIZED)
def test_expert_nbytes_is_one_experts_share_of_the_plan(quant):
    """A token routed to expert e reads expert_nbytes: the planned bytes less the shared tables, over E."""
    config = moe_config("gpt_oss")
    spec = spec_from_config(config, name="gpt_oss")
    model = load_model(config, scheme=SCHEMES[quant], dummy_weights=True).model
    module = model.model.layers[0].mlp.experts
    scheme = SCHEMES[quant]
    shared = scheme.fixed_bytes_per_tensor if scheme.backend == "bnb" and scheme.bits == 4 else 0
    per_tensor = [(scheme.tensor_bytes(spec.tensor(f"model.layers.0.mlp.experts.{p}")) - shared) / 4
                  for p in ("gate_up_proj", "down_proj")]
    biases = 2 * (2 * 128 + 64)  # bf16 gate_up [2I] + down [H] of one expert
    assert module.expert_nbytes == sum(per_tensor) + biases


# --- the library's own quantization --------------------------------------------------


def _library_tensors(quant: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors the library's own Linear layer holds for the same [out, in] matrix, by our buffer names."""
    from vramplan.runtime.quantize import backend

    scheme = SCHEMES[quant]
    linear = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype))
    linear[0].weight.data.copy_(weight)
    backend(scheme).quantize(linear, scheme, torch.bfloat16, "cpu")
    w = linear[0].weight
    if scheme.backend == "bnb" and scheme.bits == 4:
        qs = w.quant_state
        out = {"packed": w.data.view(-1), "absmax": qs.absmax, "code": qs.code}
        if scheme.double_quant:
            out.update(nested_absmax=qs.state2.absmax, offset=qs.offset, nested_code=qs.state2.code)
        return out
    if scheme.backend == "bnb":
        return {"data": w.data, "scb": w.SCB}
    if scheme.bits == 8:
        return {"data": w._data, "scale": w._scale}
    return {"data": w._data._data, "scale_shift": w._scale_shift}  # TinyGemmWeightQBitsTensor


@pytest.mark.parametrize("quant", QUANTIZED)
def test_each_expert_is_quantized_exactly_as_the_library_quantizes_a_linear(quant):
    """Byte for byte. Experts [64, 256]: quanto's QLinear takes groups of 128 there (ours, the same tinygemm layout)."""
    experts = _gaussian_experts("mixtral", intermediate_size=256)
    source = experts.down_proj.detach().clone()
    module = QuantizedExperts(experts, SCHEMES[quant], "cpu")
    for e in range(source.shape[0]):
        for name, want in _library_tensors(quant, source[e]).items():
            ours = getattr(module.down, name)
            ours = ours if name.endswith("code") else ours[e]
            assert ours.dtype == want.dtype and torch.equal(ours, want.reshape(ours.shape)), (e, name)


WEIGHT_ERROR_BOUNDS = {
    "bnb-int8": 0.01, "quanto-int8": 0.01,
    "bnb-nf4": 0.10, "bnb-nf4-dq": 0.10, "quanto-int4": 0.11,
    "bnb-fp4": 0.135, "bnb-fp4-dq": 0.135,
}


@pytest.mark.parametrize("quant", QUANTIZED)
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_expert_weights_reconstruct_within_format_error(arch, quant):
    experts = _gaussian_experts(arch)
    transposed = arch == "gpt_oss"
    sources = {p: getattr(experts, f"{p}_proj").detach().float().clone() for p in ("gate_up", "down")}
    module = QuantizedExperts(experts, SCHEMES[quant], "cpu")
    errors = []
    for projection, fused in sources.items():
        for e in range(fused.shape[0]):
            want = fused[e].t() if transposed else fused[e]
            got = getattr(module, projection).dequantize(e)
            errors.append(float((got - want).norm() / want.norm()))
    assert max(errors) < WEIGHT_ERROR_BOUNDS[quant], errors
    if quant not in ("bnb-int8", "quanto-int8"):  # 4-bit formats cannot pass for 8-bit ones
        assert min(errors) > 0.05


# --- forward ---------------------------------------------------------------------------

FORWARD_BOUNDS = {"bnb-int8": 3e-2, "quanto-int8": 1e-2, "quanto-int4": 1e-2,
                  "bnb-nf4": 1e-5, "bnb-nf4-dq": 1e-5, "bnb-fp4": 1e-5, "bnb-fp4-dq": 1e-5}


def _routing(tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    return index, weights


@pytest.mark.parametrize("quant", QUANTIZED)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_forward_is_transformers_eager_math_on_the_dequantized_weights(arch, quant):
    experts = _gaussian_experts(arch)
    reference = copy.deepcopy(experts).float()
    module = QuantizedExperts(experts, SCHEMES[quant], "cpu")
    transposed = arch == "gpt_oss"
    with torch.no_grad():
        for projection in ("gate_up", "down"):
            dq = torch.stack([getattr(module, projection).dequantize(e) for e in range(module.num_experts)])
            getattr(reference, f"{projection}_proj").copy_(dq.transpose(1, 2) if transposed else dq)
    hidden = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    index, weights = _routing(12, 4, 2, seed=2)
    dtype = torch.float32 if SCHEMES[quant].backend == "bnb" and SCHEMES[quant].bits == 4 else torch.bfloat16
    with torch.no_grad():
        want = reference(hidden, index, weights)
        got = module(hidden.to(dtype), index, weights).float()
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < FORWARD_BOUNDS[quant]


@pytest.mark.parametrize("quant", QUANTIZED)
def test_only_the_routed_experts_are_read(quant):
    """Experts 1 and 3 poisoned (NaN in every float tensor of theirs): tokens routed to 0 and 2 never see it."""
    module = QuantizedExperts(_gaussian_experts("gpt_oss"), SCHEMES[quant], "cpu")
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    index = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2], [0, 2]])
    weights = torch.full((6, 2), 0.5)
    with torch.no_grad():
        clean = module(hidden, index, weights)
        poisoned = 0
        for leaf in module_leaves(module):
            t = leaf.tensor
            if t.ndim >= 1 and t.shape[0] == 4 and t.is_floating_point():
                t[1] = float("nan")
                t[3] = float("nan")
                poisoned += 1
        assert poisoned >= 3  # a scale or absmax of each projection, and the biases
        assert torch.equal(module(hidden, index, weights), clean)
        assert module(hidden, torch.tensor([[1, 0]] * 6), weights).isnan().all()  # the poison is real


def test_llama4_row_experts_skip_routed_out_rows():
    """llama4's experts take [E * T, H] rows pre-scaled by router scores; zero rows are routed out."""
    experts = _gaussian_experts("llama4_text")
    reference = copy.deepcopy(experts).float()
    module = QuantizedRowExperts(experts, SCHEMES["bnb-nf4"], "cpu")
    with torch.no_grad():
        for projection in ("gate_up", "down"):
            dq = torch.stack([getattr(module, projection).dequantize(e) for e in range(4)])
            getattr(reference, f"{projection}_proj").copy_(dq.transpose(1, 2))
        rows = torch.randn(4, 5, 64, generator=torch.Generator().manual_seed(4))
        rows[1] = 0  # expert 1: no token
        rows[2, ::2] = 0
        want = reference(rows.reshape(-1, 64))
        got = module(rows.reshape(-1, 64))
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert torch.equal(got.view(4, 5, 64)[1], torch.zeros(5, 64))


LOGIT_ERROR_BOUNDS = {"bnb-int8": 0.04, "quanto-int8": 0.04, "bnb-nf4": 0.30, "quanto-int4": 0.30}


# bitsandbytes 0.50.2 on the CPU fails in dense Linear layers of two of these models (not in the experts):
BNB_CPU_LIMITS = {
    ("deepseek_v3", "bnb-int8"): "its CPU int8_vectorwise_quant takes the row absmax over dim 1, and deepseek_v3's "
                                 "kv_b_proj gets a 4-D input",
    ("qwen2_moe", "bnb-nf4"): "its AVX512-BF16 CPU repacking of a Linear4bit needs out_features % 32 == 0, and "
                              "qwen2_moe's shared_expert_gate is [1, H]",
}


def _bnb_cpu_limit_applies(arch: str, quant: str) -> bool:
    """The 4-bit limit is in bitsandbytes' AVX512-BF16 repacking: CPUs without that instruction set never hit it."""
    if (arch, quant) == ("qwen2_moe", "bnb-nf4"):
        import bitsandbytes.nn.modules as bnb_modules

        return bool(bnb_modules.has_avx512bf16())
    return True


@pytest.mark.parametrize("arch,quant", [
    pytest.param(a, q, marks=pytest.mark.xfail(_bnb_cpu_limit_applies(a, q), strict=True, reason=BNB_CPU_LIMITS[a, q]))
    if (a, q) in BNB_CPU_LIMITS else (a, q) for a in sorted(TINY_MOE) for q in LOGIT_ERROR_BOUNDS])
def test_quantized_moe_logits_close_to_bf16(moe_checkpoints, arch, quant):
    ref = load_model(moe_checkpoints[arch], scheme=SCHEMES["bf16"]).model
    loaded = load_model(moe_checkpoints[arch], scheme=SCHEMES[quant])
    assert _experts_modules(loaded.model)  # the checkpoint path quantizes the experts too
    with torch.no_grad():
        want = ref(PROMPT).logits[0].float()
        got = loaded.model(PROMPT).logits[0].float()
    error = float(((got - want).norm(dim=-1) / want.norm(dim=-1)).mean())
    assert 0 < error < LOGIT_ERROR_BOUNDS[quant]


# --- what stays unquantized, and the modules around the experts ---------------------


def test_routers_stay_in_the_compute_dtype_and_shared_experts_are_quantized():
    model = load_model(moe_config("qwen2_moe"), scheme=SCHEMES["bnb-nf4"], dummy_weights=True).model
    mlp = model.model.layers[0].mlp
    assert mlp.gate.weight.dtype == torch.bfloat16  # the router: a bare weight, as transformers leaves it
    assert type(mlp.shared_expert.down_proj).__name__ == "Linear4bit"  # a plain Linear MLP
    assert type(mlp.shared_expert_gate).__name__ == "Linear4bit"  # an nn.Linear [1, H]: transformers' bnb takes it


@pytest.mark.parametrize("quant", ["quanto-int8", "bnb-nf4"])
def test_llama4_router_keeps_its_class_and_the_model_runs(moe_checkpoints, quant):
    """llama4's router subclasses nn.Linear: quanto would swap it for a QLinear and lose its top-k."""
    for loaded in (load_model(moe_config("llama4_text"), scheme=SCHEMES[quant], dummy_weights=True),
                   load_model(moe_checkpoints["llama4_text"], scheme=SCHEMES[quant])):
        moe = loaded.model.model.layers[0].feed_forward
        assert type(moe.router).__name__ == "Llama4Router" and moe.router.weight.dtype == torch.bfloat16
        with torch.no_grad():
            assert loaded.model(PROMPT).logits.isfinite().all()


def test_offload_engine_streams_and_clones_quantized_experts():
    """The offload engine packs each offloaded layer, experts included, into one buffer and clones a layer for its
    slots: logits stay bit-identical to the model's own (device=cpu: the same code, plain copies)."""
    from vramplan.runtime.offload import apply_offload

    model = load_model({**moe_config("mixtral"), "num_hidden_layers": 3}, scheme=SCHEMES["bnb-nf4"],
                       dummy_weights=True).model
    with torch.no_grad():
        want = model(PROMPT).logits
    with apply_offload(model, gpu_layers=1, mode="stream", device="cpu") as engine:
        with torch.no_grad():
            got = model(PROMPT).logits
        assert engine.host_bytes > 0
    assert torch.equal(got, want)


def test_quantize_experts_replaces_only_fused_experts_and_only_when_quantized():
    experts = _gaussian_experts("mixtral")
    parent = torch.nn.Module()
    parent.block = torch.nn.Module()
    parent.block.experts = experts
    parent.block.gate = torch.nn.Linear(64, 4)
    assert quantize_experts(parent, SCHEMES["bf16"], "cpu") == 0 and parent.block.experts is experts
    assert quantize_experts(parent, SCHEMES["quanto-int8"], "cpu") == 1
    assert isinstance(parent.block.experts, QuantizedExperts) and type(parent.block.gate) is torch.nn.Linear
    assert not any(p.ndim == 3 for p in parent.parameters())  # the bf16 experts are gone


# --- dummy builds never hold the bf16 experts of more than one layer --------------------


def test_dummy_build_quantizes_experts_layer_by_layer():
    """10 layers x 8 experts of 3 x 1024 x 1024: 480 MiB of experts in bf16, 48 MiB per layer; quanto int4 keeps
    about a quarter. The build's peak RSS stays below the quantized model + 2 layers in bf16 (measured: + 1.1 in a
    fresh process with a fixed mmap threshold, within 0.3 MB over 5 runs), less than half the bf16 model."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = moe_config("qwen3_moe", hidden_size=1024, moe_intermediate_size=1024, num_experts=8, num_hidden_layers=10,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    spec = spec_from_config(config, name="moe-build")
    bf16_bytes = SCHEMES["bf16"].bytes_of(spec.tensors)
    quantized_bytes = weight_costs(spec, SCHEMES["quanto-int4"], cpu_only=True).total_bytes
    layer_bf16 = spec.layer_bytes(0, "bfloat16")
    # a fresh process: RSS in a long test session carries what earlier tests left in the allocator
    root = Path(__file__).resolve().parents[1]
    script = f"""
import json, sys
sys.path[:0] = [{str(root)!r}, {str(root / "tests")!r}]
from vramplan.planner.quant import SCHEMES
from vramplan.runtime.load import load_model
from vramplan.runtime.measure import PeakMemorySampler
config = json.loads({json.dumps(json.dumps(config))})
warm = json.loads({json.dumps(json.dumps(moe_config("qwen3_moe")))})
load_model(warm, scheme=SCHEMES["quanto-int4"], dummy_weights=True)  # imports, first calls
with PeakMemorySampler(interval_s=0.002) as sampler:
    loaded = load_model(config, scheme=SCHEMES["quanto-int4"], dummy_weights=True)
rotary = sum(b.numel() * b.element_size() for n, b in loaded.model.named_buffers() if "rotary_emb" in n)
print(json.dumps({{"weights": sum(loaded.weights_bytes_by_device.values()) - rotary,
                  "peak": sampler.result.rss_delta_bytes}}))
"""
    # glibc otherwise raises its mmap threshold after the first large free and keeps later freed layers in the heap:
    # RSS would then count memory the build has let go. Fixed, every tensor-sized block is returned when freed.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["weights"] == quantized_bytes
    peak = got["peak"]
    assert peak < quantized_bytes + 2 * layer_bf16, (peak, quantized_bytes, layer_bf16)
    assert peak < bf16_bytes / 2 and bf16_bytes > 3.5 * quantized_bytes


# --- devices -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTIZED)
def test_experts_move_between_cpu_and_cuda_as_a_whole(quant):
    """Quantized on the CPU, moved to CUDA (quanto int4 repacks for tinygemm's CUDA layout) and back: the same
    weights on both devices, the CUDA forward close to the CPU one."""
    module = QuantizedExperts(_gaussian_experts("gpt_oss"), SCHEMES[quant], "cpu")
    before = [module.down.dequantize(e) for e in range(4)]
    hidden = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    index, weights = _routing(8, 4, 2, seed=6)
    with torch.no_grad():
        on_cpu = module(hidden, index, weights).float()
        module.to("cuda")
        assert {leaf.tensor.device.type for leaf in module_leaves(module)} == {"cuda"}
        on_cuda = module(hidden.cuda(), index.cuda(), weights.cuda()).float().cpu()
        # same values; CUDA divides by a scalar as a multiply by its reciprocal (bnb-int8's SCB / 127): 1 ulp apart
        assert all(torch.allclose(module.down.dequantize(e).cpu(), before[e], rtol=1e-6, atol=0) for e in range(4))
        module.to("cpu")
        assert torch.equal(module(hidden, index, weights).float(), on_cpu)
    assert float((on_cuda - on_cpu).norm() / on_cpu.norm()) < 3e-2


def test_the_calibration_times_routed_experts_per_scheme():
    """`vramplan calibrate`'s experts micro-benchmark: both expert sizes x both k, bytes = k x one expert's bytes as
    the quantized module holds them, and a fit with a positive per-call cost and an efficiency within (0, 1]."""
    from vramplan.planner.calibration import fit_experts
    from vramplan.planner.profiles import resolve_profile
    from vramplan.runtime.calibrate import EXPERT_SHAPES, EXPERT_TOP_K, measure_experts

    hw = resolve_profile("cpu-ddr5-desktop")[0]
    samples, warnings = measure_experts(hw, ("quanto-int4",), "cpu")
    assert not warnings and len(samples) == len(EXPERT_SHAPES) * len(EXPERT_TOP_K)
    small, big = samples[0], samples[-1]
    assert small.calls == min(EXPERT_TOP_K) and big.calls == max(EXPERT_TOP_K)
    assert big.bytes_read / big.calls > small.bytes_read / small.calls  # the larger expert reads more
    assert all(s.seconds > 0 for s in samples)
    entry, _, _ = fit_experts(samples)
    assert 0 < entry.bandwidth_efficiency <= 1 and entry.per_layer_overhead_s >= 0
