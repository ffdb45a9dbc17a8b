"""Compiled decode (runtime.compiled): a static cache and a torch.compile'd decode step give the tokens eager decode
gives, through the same generation loop, after an untimed warm-up that compiles; and the planner prices it."""

from __future__ import annotations

import pytest
import torch

from conftest import compiled_and_eager_tokens, tiny_config_dict
from vramplan.planner.quant import SCHEMES
from vramplan.runtime.generate import generate, synthetic_prompt, warm_up
from vramplan.runtime.load import load_model


@pytest.fixture(scope="module")
def tiny_fp32():
    return load_model(tiny_config_dict("llama"), scheme=SCHEMES["bf16"], dummy_weights=True, seed=2,
                      compute_dtype="fp32").model


def test_compiled_decode_gives_the_eager_tokens(tiny_fp32):
    from vramplan.runtime.compiled import StaticDecoder

    prompt = synthetic_prompt(20, 512, seed=4)
    eager = generate(tiny_fp32, prompt, max_new_tokens=10, prefill_chunk=8)
    static = StaticDecoder(tiny_fp32, max_len=20 + 10, device=torch.device("cpu"))
    assert warm_up(tiny_fp32, prompt, 8, static=static) > 0  # compiles, untimed
    compiled = generate(tiny_fp32, prompt, max_new_tokens=10, prefill_chunk=8, static=static)
    assert compiled.tokens == eager.tokens and len(compiled.tokens) == 10
    again = generate(tiny_fp32, prompt, max_new_tokens=10, prefill_chunk=8, static=static)  # the cache was emptied
    assert again.tokens == eager.tokens


def test_quantized_experts_decode_inside_the_compiled_graph():
    """An MoE's quantized routed experts (runtime.experts.QuantizedExperts) take their unrolled forward inside the
    compiled decode step (fullgraph=True: no break at the routing) and give eager decode's tokens."""
    model = load_model(tiny_config_dict("mixtral"), scheme=SCHEMES["quanto-int4"], dummy_weights=True, seed=2).model
    assert any(type(m).__name__ == "QuantizedExperts" for m in model.modules())
    compiled, eager = compiled_and_eager_tokens(model, 12, 6)
    assert compiled == eager and len(compiled) == 6


def test_the_static_cache_refuses_positions_past_its_length(tiny_fp32):
    from vramplan.runtime.compiled import StaticDecoder

    static = StaticDecoder(tiny_fp32, max_len=8, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="holds 8 tokens"):
        static.static_forward(synthetic_prompt(9, 512), 0)


def test_the_planner_prices_a_compiled_decode_without_dispatch_and_only_what_compiles():
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    spec, hw = model_spec("llama-3.1-8b"), resolve_profile("h100-sxm")[0]
    eager, compiled = (plan(spec, hw, Request(context=8192, compiled=c, eager=not c)) for c in (False, True))
    default = plan(spec, hw, Request(context=8192))  # on a GPU the default prices compiled too, and keeps the faster
    assert default.decode_compiled and not default.request.compiled and default.chosen.compiled
    assert default.predicted.decode_tokens_per_s == compiled.predicted.decode_tokens_per_s
    assert not eager.decode_compiled and not any(c.compiled for c in eager.candidates)
    assert compiled.choice.weight_quant in ("bf16", "fp16") and compiled.choice.gpu_layers == 32
    assert compiled.chosen.speed.terms["dispatch_per_layer_s"] == 0 < eager.chosen.speed.terms["dispatch_per_layer_s"]
    assert "public_fit compiled bf16" in compiled.chosen.speed.terms["efficiency_source"]
    assert compiled.predicted.decode_tokens_per_s > 2 * eager.predicted.decode_tokens_per_s  # 122.6 vs 39.9
    refused = {c.weight_quant: c.reason for c in compiled.candidates if not c.fits}
    assert "--compile runs bf16 weights" in refused["bnb-nf4"]
    # 8 GiB of VRAM for a 16 GB model: eager splits it over GPU and RAM; compiled refuses the split
    small = dict(context=4096, vram_budget_bytes=8 << 30, quant=("bf16",), kv_dtype=("bf16",))
    split = plan(spec, resolve_profile("rtx-4090")[0], Request(**small))
    assert split.fits and 0 < split.choice.gpu_layers < 32
    one = plan(spec, resolve_profile("rtx-4090")[0], Request(**small, compiled=True))
    assert not one.fits and "--compile needs every layer on one device" in one.candidates[0].reason


def test_compile_from_the_cli(capsys, monkeypatch):
    import io

    from cli_helpers import assert_one_line_error, run_cli

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, out, _ = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "-H", "h100-sxm", "--context", "8k", "--compile",
                           "--json")
    import json

    d = json.loads(out)
    assert code == 0 and d["request"]["compiled"] is True and d["choice"]["weight_quant"] in ("bf16", "fp16")
    code, _, err = run_cli(capsys, "run", "--model", "qwen2.5-0.5b", "--engine", "llama.cpp", "--compile",
                           "--gguf", "x.gguf")
    assert "--compile is vramplan's torch runtime's decode mode" in assert_one_line_error(code, err)


def test_a_short_compiled_run_still_warms_up(tmp_path, capsys, monkeypatch):
    """One new token: the static cache still has room for the warm-up's decode steps."""
    import io
    import json

    from cli_helpers import run_cli

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config_dict("llama")))
    code, out, err = run_cli(capsys, "run", "--model", model, "--dummy-weights", "--compile", "--context", "64",
                             "--prompt-tokens", "8", "--max-new-tokens", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["measured"]["generated_tokens"] == 1


def test_the_planner_keeps_compile_on_gpu_0_of_several():
    from dataclasses import replace

    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    h100 = resolve_profile("h100-sxm")[0]
    two = h100.replace(name="h100-x2", gpus=(replace(h100.gpus[0], count=2),))
    p = plan(model_spec("llama-3.1-8b"), two, Request(context=8192, compiled=True))
    assert p.fits and p.choice.gpu_layers_per_device[0] == 32


def test_a_compiled_default_that_fails_falls_back_to_eager(tmp_path, capsys, monkeypatch):
    """A plan that decodes compiled by default (a GPU's, here forged on this CPU) whose compile fails runs eager and
    says so; the same failure under --compile is a one-line error."""
    import io
    import json

    from cli_helpers import assert_one_line_error, run_cli
    from vramplan.runtime import compiled

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config_dict("llama")))
    code, out, err = run_cli(capsys, "plan", "--model", model, "--context", "64", "--compile", "--json")
    d = json.loads(out)
    assert code == 0 and d["decode_compiled"] is True
    d["request"]["compiled"] = False  # compiled by the plan's default, not forced
    forged = tmp_path / "plan.json"
    forged.write_text(json.dumps(d))

    def broken(self, *a, **k):
        raise RuntimeError("no graph here")

    monkeypatch.setattr(compiled.StaticDecoder, "__init__", broken)
    run = ("run", "--model", model, "--dummy-weights", "--prompt-tokens", "8", "--max-new-tokens", "2", "--json")
    code, out, err = run_cli(capsys, *run, "--plan", forged)
    report = json.loads(out)
    assert code == 0 and report["measured"]["generated_tokens"] == 2, err
    assert any("the compiled decode the plan chose failed here (RuntimeError: no graph here): decoding eager" in n
               for n in report["notes"])
    code, out, err = run_cli(capsys, *run, "--context", "64", "--compile")
    assert "--compile failed here (RuntimeError: no graph here)" in assert_one_line_error(code, err)


def test_eager_from_the_cli(capsys):
    import json

    from cli_helpers import assert_one_line_error, run_cli

    base = ("plan", "--model", "llama-3.1-8b", "-H", "h100-sxm", "--context", "8k", "--json")
    code, out, _ = run_cli(capsys, *base)
    default = json.loads(out)
    code, out, _ = run_cli(capsys, *base, "--eager")
    eager = json.loads(out)
    assert default["decode_compiled"] is True and eager["decode_compiled"] is False
    assert eager["predicted"]["decode_tokens_per_s"] < default["predicted"]["decode_tokens_per_s"]
    assert "--eager" in next(e["how"] for e in eager["engines"] if e["engine"] == "vramplan")
    code, out, err = run_cli(capsys, *base, "--eager", "--compile")
    assert "--compile and --eager contradict each other" in assert_one_line_error(code, err)


def test_the_compiled_default_is_cudas_only():
    """No compiled decode is measured on Apple's GPUs (no CUDA graphs, and vramplan's runtime does not run there): an
    Apple plan stays eager; --eager is refused for engines that decode their own way."""
    import pytest

    from vramplan.planner.errors import PlanError
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    p = plan(model_spec("qwen2.5-0.5b"), resolve_profile("apple-m4-max-128gb")[0], Request(context=8192))
    assert p.fits and not p.decode_compiled and not any(c.compiled for c in p.candidates)
    with pytest.raises(PlanError, match="--eager is vramplan's runtime's decode mode"):
        Request(context=8192, engine="llama.cpp", eager=True)


def test_inductor_keeps_what_it_compiled_in_vramplans_cache(monkeypatch, tmp_path):
    """The next run reuses the compiled step: inductor's cache goes to vramplan's cache unless the user named one."""
    from vramplan.runtime.compiled import inductor_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # restored after the test, whatever inductor_cache sets
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    assert inductor_cache() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache() == str(tmp_path / "mine")
