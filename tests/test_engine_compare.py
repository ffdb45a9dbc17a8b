"""One answer across engines (planner.engines.compare): `vramplan plan` plans the same request by vramplan's,
llama.cpp's, Ollama's and vLLM's rules, one object per engine in one shape, and names the fastest here and why."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cli_helpers import run_cli
from vramplan.planner.engines import ENGINES as REGISTRY
from vramplan.planner.engines import compare, plan_for_engine
from vramplan.planner.engines.vllm import VLLMModel, search, vllm_layout, weight_format
from vramplan.planner.engines.vllm_rules import tp_fraction
from vramplan.planner.gguf import gguf_tensors
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec
from vramplan.planner.speed import compiled_scheme, estimate_compiled

ENGINES = ["vramplan", "llama.cpp", "ollama", "vllm", "transformers"]
H100 = resolve_profile("h100-sxm")[0]
H100_X8 = H100.replace(name="h100-sxm-x8", gpus=(replace(H100.gpus[0], count=8),))


def _plan(model: str, hardware: str, context: int, **kw):
    spec, hw = model_spec(model), resolve_profile(hardware)[0]
    req = Request(context=context, **kw)
    return spec, hw, req, plan_for_engine(spec, hw, req)


def test_every_engine_answers_in_one_shape_and_the_fastest_is_the_largest_prediction():
    spec, hw, req, p = _plan("llama-3.1-8b", "h200", 8192)
    rows = p.engines
    assert [r.engine for r in rows] == ENGINES and all(r.fits for r in rows)
    assert [e.name for e in REGISTRY] == ENGINES
    for r in rows:
        assert {"weight_quant", "kv_dtype", "placement", "decode_tokens_per_s", "ttft_s", "how", "speed_from"} <= set(
            r.to_dict())
    own = rows[0]
    assert own.decode_tokens_per_s == p.predicted.decode_tokens_per_s
    assert own.weight_quant == p.choice.weight_quant
    # plain transformers, resident, runs vramplan's eager kernels: vramplan's own eager prediction (vramplan's plan on
    # this GPU decodes compiled by default: faster than plain transformers)
    eager = plan_for_engine(spec, hw, replace(req, eager=True))
    assert p.decode_compiled and not eager.decode_compiled
    assert rows[4].decode_tokens_per_s == eager.predicted.decode_tokens_per_s < own.decode_tokens_per_s
    for r in rows[1:]:
        assert r.decode_vs_plan == pytest.approx(r.decode_tokens_per_s / p.predicted.decode_tokens_per_s)
    # vLLM on one GPU is priced as a compiled decode of its bits with the profile's fitted compiled constants
    vllm = rows[3]
    assert vllm.placement.startswith("TP 1 x PP 1")
    compiled = estimate_compiled(spec, hw, p.request, compiled_scheme(16))
    assert vllm.decode_tokens_per_s == pytest.approx(compiled.decode_tokens_per_s)
    best = max(rows, key=lambda r: r.decode_tokens_per_s)  # (a tie keeps the first: vramplan before transformers)
    assert p.fastest_engine.engine == best.engine and p.fastest_engine.why


def test_llamacpp_row_is_llamacpps_own_plan():
    """The row is llama.cpp's own search over its file types and caches (what `--engine llama.cpp` plans), not a
    translation of vramplan's pick."""
    from vramplan.planner.engines.llamacpp import plan_llamacpp

    spec, hw, req, p = _plan("qwen3-30b-a3b", "rtx-3060-12gb", 32768)
    row = p.engines[1]
    own = plan_llamacpp(spec, hw, Request(context=32768, engine="llama.cpp"))
    assert (row.weight_quant, row.kv_dtype) == (own.choice.weight_quant, own.choice.kv_dtype)
    assert row.decode_tokens_per_s == own.chosen.speed.decode_tokens_per_s
    assert row.expert_layers_on_cpu == own.choice.expert_layers_on_cpu > 0


def test_without_a_gpu_vllm_says_why_and_the_others_run_on_the_cpu():
    _, _, _, p = _plan("qwen2.5-0.5b", "cpu-ddr5-desktop", 4096)
    rows = {r.engine: r for r in p.engines}
    assert not rows["vllm"].fits and "no GPU" in rows["vllm"].reason
    assert rows["vramplan"].placement == rows["llama.cpp"].placement == "on the CPU"


def test_vllm_speed_is_not_invented_where_no_compiled_constants_or_several_gpus():
    _, _, _, p = _plan("llama-3.1-8b", "rtx-3090", 8192)
    vllm = p.engines[3]
    assert vllm.fits and vllm.decode_tokens_per_s is None and "no compiled-decode constants" in vllm.speed_from
    spec, hw = model_spec("llama-3.1-70b"), H100_X8
    q = plan_for_engine(spec, hw, Request(context=8192, quant=("bf16",)))  # bf16: more than one H100 holds
    vllm = q.engines[3]
    assert vllm.fits and not vllm.placement.startswith("TP 1 x PP 1")
    assert vllm.decode_tokens_per_s is None and "multi-GPU" in vllm.speed_from


def test_vllm_max_context_is_what_its_kv_pool_holds():
    spec, hw, req, p = _plan("llama-3.1-8b", "rtx-3090", 8192)
    lay = vllm_layout(spec, hw, p).layout  # vLLM's rules, recomputed here
    per_token = lay.kv_per_sequence_bytes / 8192
    got = p.engines[3].max_context_tokens
    assert got == int((lay.kv_pool_bytes - lay.null_block_bytes) // per_token) or abs(
        got - (lay.kv_pool_bytes - lay.null_block_bytes) / per_token) < 1


def test_vllm_layer_bytes_cached_per_tp_size_equal_the_direct_sum():
    spec, hw = model_spec("llama-3.1-70b"), H100_X8
    req = Request(context=8192)
    m = VLLMModel(spec, hw, req, weight_format("bf16", spec), "auto")
    direct = sum(m.fmt.tensor_bytes(t) * tp_fraction(spec, t, 4) for i in range(10, 30) for t in m.layer_tensors[i])
    nonlayer = m._rank_weights(4, range(10, 30), False, False)
    assert nonlayer == int(direct)
    assert search(m, hw.gpu_count).tp >= 1


def test_gguf_tensors_are_reused_for_the_same_spec_only():
    spec = model_spec("llama-3.2-1b")
    first = gguf_tensors(spec, "Q4_K_M")
    assert gguf_tensors(spec, "Q4_K_M") is first
    other = model_spec("llama-3.2-3b")
    assert gguf_tensors(other, "Q4_K_M") is not first and gguf_tensors(spec, "Q8_0") is not first


def test_a_tie_is_called_a_tie():
    """An engine predicted within compare.TIE of the plan is a tie, not a win, whatever else differs."""
    from vramplan.planner.engines.common import EngineAnswer

    spec, hw, req, p = _plan("llama-3.1-8b", "rtx-4090", 8192)
    mine = p.predicted.decode_tokens_per_s
    rows = (*p.engines[:1], EngineAnswer(engine="llama.cpp", weight_quant="Q8_0", kv_dtype="f16", fits=True, how="-",
                                         decode_tokens_per_s=1.03 * mine))
    best = compare.fastest(p, rows)
    assert best.engine == "llama.cpp" and best.decode_vs_plan < compare.TIE and best.why.startswith("a tie")


def test_a_faster_engine_comes_with_how_to_run_it():
    """Where another engine is faster, the fastest line says how to run its answer: llama.cpp through `vramplan run
    --engine llama.cpp`, Ollama and vLLM through their exports; a tie says nothing of the kind."""
    from vramplan.planner.engines.common import EngineAnswer

    spec, hw, req, p = _plan("llama-3.1-8b", "rtx-4090", 8192)
    mine = p.predicted.decode_tokens_per_s
    for engine, hint in (("llama.cpp", "vramplan run --engine llama.cpp --model MODEL.gguf"),
                         ("ollama", "vramplan plan --emit ollama"), ("vllm", "vramplan plan --emit vllm")):
        rows = (*p.engines[:1], EngineAnswer(engine=engine, weight_quant="Q8_0", kv_dtype="f16", fits=True, how="-",
                                             decode_tokens_per_s=2 * mine))
        assert hint in compare.fastest(p, rows).why
    tie = (*p.engines[:1], EngineAnswer(engine="llama.cpp", weight_quant="Q8_0", kv_dtype="f16", fits=True, how="-",
                                        decode_tokens_per_s=1.01 * mine))
    assert "to run it here" not in compare.fastest(p, tie).why


def test_plan_shows_the_engines_table_and_its_json_one_object_per_engine(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--hardware", "h200", "--context", "8k")
    assert code == 0 and "the same request by each engine's own rules" in out + err
    assert "fastest here:" in out + err
    code, out, _ = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--hardware", "h200", "--context", "8k", "--json")
    d = json.loads(out)
    assert [e["engine"] for e in d["engines"]] == ENGINES and d["fastest_engine"]["engine"] in ENGINES


def test_search_alone_is_unchanged_by_the_comparison():
    spec, hw = model_spec("llama-3.1-8b"), resolve_profile("h200")[0]
    req = Request(context=8192)
    assert plan(spec, hw, req).choice == plan_for_engine(spec, hw, req).choice


def test_plain_transformers_with_a_split_is_not_priced_and_with_quanto_refused():
    """transformers' own search with the scheme and cache forced: a bitsandbytes split through accelerate is not priced;
    quanto refuses the device_map; a split whose CPU-mapped layers bitsandbytes keeps in bf16 overflows the RAM."""
    hw = resolve_profile("rtx-4090")[0]
    for model, quant, refused in (("qwen2.5-32b", "bnb-nf4", None), ("qwen2.5-32b", "quanto-int4", "quanto"),
                                  ("llama-3.1-70b", "bnb-nf4", "(bf16): RAM needs")):
        p = plan_for_engine(model_spec(model), hw, Request(context=32768, quant=(quant,), kv_dtype=("bf16",)))
        row = p.engines[4]
        assert row.fits is (refused is None), row
        if refused is None:
            assert row.gpu_layers < row.total_layers and row.decode_tokens_per_s is None
            assert "accelerate" in row.speed_from
        else:
            assert refused in row.reason


def test_emit_goes_through_the_registry_and_any_plan_feeds_any_export():
    """Every export is that engine's own answer to the plan's request, so a llama.cpp plan feeds vLLM's and
    transformers' exports too (its GGUF vocabulary put in their words)."""
    from vramplan.planner.engines import emit

    for engine in ("vramplan", "llama.cpp"):
        spec, hw, req, p = _plan("llama-3.1-8b", "rtx-4090", 8192, engine=engine)
        for e in REGISTRY[1:]:
            assert emit(e.name, spec, hw, p).engine == e.name
