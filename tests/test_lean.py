"""vramplan's own CPU decoder step (runtime.lean): transformers' logits and tokens on every architecture it runs, the
bytes unchanged by its fused calls, the planner's rule and price, and `vramplan run` taking it (and --eager not)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_tiny_model, tiny_config, tiny_config_dict
from cli_helpers import isolate, run_cli
from vramplan.planner.lean import LEAN_CPU_PER_LAYER_FACTOR, decodes_lean, lean_refusal
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.runtime import cpu_kernel
from vramplan.runtime.generate import generate, prefill, synthetic_prompt
from vramplan.runtime.kvcache import make_cache
from vramplan.runtime.lean import LeanDecoder, LeanUnsupported, structure_refusal
from vramplan.runtime.load import load_model
from vramplan.runtime.tensors import count_tensor_bytes

W4A8 = SCHEMES["cpu-w4a8"]
# hidden 256 and an MLP of 384: every projection takes the kernel's groups of 128
TINY = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
ARCHS = {"llama": {}, "qwen2": {"attention_bias": True}, "qwen3": {}, "mistral": {"sliding_window": None}}


@pytest.fixture
def kernel():
    if (why := cpu_kernel.unavailable()) is not None:
        pytest.skip(f"cpu-w4a8's kernel is not available here: {why}")


def _model(arch: str, seed: int = 0, **overrides):
    config = {**tiny_config_dict(arch, **TINY, **overrides), **ARCHS[arch]}  # (a None kept: no sliding window)
    model = load_model(config, scheme=W4A8, dummy_weights=True, seed=seed, device="cpu").model
    if arch == "qwen2":  # dummy biases are zeros: give them values, so that the fused bias is tested
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(torch.randn(proj.bias.shape, dtype=proj.bias.dtype) * 0.5)
    return model


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_its_logits_and_tokens_are_transformers_own(arch):
    model = _model(arch, seed=3)
    prompt = synthetic_prompt(21, model.config.vocab_size, seed=4)
    with torch.no_grad():  # chunks of 8: a causal first chunk, then chunks under a mask over the cache before them
        want = prefill(model, prompt, make_cache(KV_SCHEMES["bf16"], model.config), 8)
        lean = LeanDecoder(model, max_len=40)
        got = prefill(model, prompt, lean, 8)
        again = prefill(model, prompt, make_cache(KV_SCHEMES["bf16"], model.config), 8)  # the fused views
        whole = prefill(model, prompt, lean, 64)
    assert torch.equal(got, want) and torch.equal(again, want)  # the same ops in the same dtypes: the same bits
    assert torch.allclose(whole, want, atol=0.05 * want.abs().max().item())  # one chunk: SDPA's other path
    eager = generate(model, prompt, max_new_tokens=12, prefill_chunk=8)
    ours = generate(model, prompt, max_new_tokens=12, prefill_chunk=8, static=lean)
    assert ours.tokens == eager.tokens


@pytest.mark.usefixtures("kernel")
def test_the_fused_calls_add_no_byte_and_keep_the_modules_working():
    model = _model("qwen2", seed=1)
    before = count_tensor_bytes(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, TINY["hidden_size"], dtype=torch.bfloat16)
    alone = q_proj(x)
    lean = LeanDecoder(model, max_len=16)
    assert count_tensor_bytes(model) == before  # the modules hold views of the one concatenated matrix
    rows = lean.layers[0].qkv
    assert rows.fused and q_proj.codes.untyped_storage().data_ptr() == rows.codes.untyped_storage().data_ptr()
    assert torch.equal(q_proj(x), alone)
    q, k, v = rows(x)  # one kernel call: each output row is its own dot product, so exactly the three calls
    assert torch.equal(q, alone) and torch.equal(k, model.model.layers[0].self_attn.k_proj(x))
    assert lean.layers[0].gate_up.fused
    assert lean.keys.shape == (model.config.num_hidden_layers, 2, 16, 64)  # [layers, kv heads, tokens, head dim]


def test_what_it_refuses_and_why():
    from vramplan.planner.sources import model_spec

    dense, bf16 = model_spec("qwen2.5-0.5b"), KV_SCHEMES["bf16"]
    assert lean_refusal(dense, W4A8, bf16) is None
    assert "runs cpu-w4a8 only" in lean_refusal(dense, SCHEMES["quanto-int4"], bf16)
    moe = model_spec("qwen3-30b-a3b")
    assert "not qwen3_moe" in lean_refusal(moe, W4A8, bf16)
    assert "dense models" in lean_refusal(__import__("dataclasses").replace(dense, moe=moe.moe), W4A8, bf16)
    assert "not gemma2" in lean_refusal(model_spec("gemma-2-9b"), W4A8, bf16)
    assert "unquantized cache" in lean_refusal(dense, W4A8, KV_SCHEMES["quanto-int4"])
    assert not decodes_lean(dense, W4A8, bf16, on_gpu=False, compiled=False, eager=True)
    assert not decodes_lean(dense, W4A8, bf16, on_gpu=False, compiled=True, eager=False)
    assert not decodes_lean(dense, W4A8, bf16, on_gpu=True, compiled=False, eager=False)
    sliding = tiny_config("mistral", **TINY, sliding_window=64)
    from transformers import AutoModelForCausalLM
    assert structure_refusal(AutoModelForCausalLM.from_config(sliding)) == "a sliding window"
    with pytest.raises(LeanUnsupported, match="gemma2 is not one of"):
        LeanDecoder(AutoModelForCausalLM.from_config(tiny_config("gemma2", **TINY)), max_len=8)


def test_the_planner_prices_its_layers_and_says_so():
    from dataclasses import replace

    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    base = resolve_profile("cpu-ddr5-desktop")[0]
    hw = replace(base, host=replace(base.host, cpu_decode_int4_a8_bytes_per_s=20e9))
    spec = model_spec("qwen2.5-0.5b")
    lean = plan(spec, hw, Request(context=4096, quant=("cpu-w4a8",)))
    eager = plan(spec, hw, Request(context=4096, quant=("cpu-w4a8",), eager=True))
    assert lean.choice == eager.choice
    lean_layer, eager_layer = (next(v.value for k, v in p.constants.items() if k.endswith("_per_layer_s"))
                               for p in (lean, eager))
    assert lean_layer == pytest.approx(eager_layer * LEAN_CPU_PER_LAYER_FACTOR)
    assert lean.chosen.speed.decode_tokens_per_s > eager.chosen.speed.decode_tokens_per_s
    assert any("vramplan's own decoder step" in r for r in lean.reasons)
    assert any("transformers' forward, not vramplan's own decoder step: --eager asks for it" in r
               for r in eager.reasons)
    quantized_kv = plan(spec, hw, Request(context=4096, quant=("cpu-w4a8",), kv_dtype=("quanto-int4",)))
    assert quantized_kv.fits and any("not vramplan's own decoder step: vramplan's own decoder step keeps an "
                                     "unquantized cache" in r for r in quantized_kv.reasons)
    assert "LEAN_CPU_PER_LAYER_FACTOR" in lean.chosen.speed.terms["efficiency_source"]


@pytest.mark.usefixtures("kernel")
def test_run_takes_it_and_eager_runs_transformers_forward(tmp_path, monkeypatch, capsys):
    import yaml

    from conftest import run_profile

    isolate(tmp_path, monkeypatch)
    d = yaml.safe_load(open(run_profile()).read())
    d["name"] = "lean-here"
    d["host"]["cpu_decode_int4_a8"] = "12 GB/s"
    profile = tmp_path / "lean-here.yaml"
    profile.write_text(yaml.safe_dump(d, sort_keys=False))
    model = save_tiny_model(tiny_config("qwen3", **TINY), tmp_path / "tiny")
    runs = {}
    for extra in ((), ("--eager",)):
        code, out, err = run_cli(capsys, "run", "--model", model, "--quant", "cpu-w4a8", "-H", profile, "-n", "6",
                                 "--prompt-tokens", "9", "--json", *extra)
        assert code == 0, err
        runs[extra] = json.loads(out)
    lean, eager = runs[()], runs[("--eager",)]
    assert any("vramplan's own decoder step (runtime.lean)" in n for n in lean["notes"])
    assert not any("runtime.lean" in n for n in eager["notes"])
    assert lean["tokens"] == eager["tokens"]  # the same model, the same greedy tokens
