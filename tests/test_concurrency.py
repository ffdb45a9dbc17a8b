"""plan --concurrency: how many sequences of the context each engine runs at once with the format it chose for one,
and their aggregate decode (planner/concurrency.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cli_helpers import isolate, run_cli
from vramplan.planner.concurrency import concurrency, most_sequences
from vramplan.planner.engines import BY_NAME, ENGINES, plan_for_engine, vllm
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import model_spec


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


def _most(model: str, hardware: str, context: int, engine: str):
    """`engine`'s one-sequence plan of `model` and its most_sequences answer."""
    spec, hw = model_spec(model), resolve_profile(hardware)[0]
    plan_fn = BY_NAME[engine].plan
    one = plan_fn(spec, hw, Request(context=context, engine=engine))
    return spec, hw, plan_fn, one, most_sequences(plan_fn, spec, hw, one.request, one)


@pytest.mark.parametrize("engine", ["vramplan", "llama.cpp"])
def test_the_count_is_the_largest_batch_that_keeps_the_placement(engine):
    """n sequences plan with the chosen format and at least its GPU layers; n + 1 do not."""
    spec, hw, plan_fn, one, (n, best, why) = _most("llama-3.1-8b", "a100-80gb-sxm", 8192, engine)
    assert n > 1 and best.request.batch == n and best.chosen.weight_quant == one.chosen.weight_quant
    forced = replace(one.request, quant=(one.chosen.weight_quant,), kv_dtype=(one.chosen.kv_dtype,))
    at_n = plan_fn(spec, hw, replace(forced, batch=n), contexts=False)
    more = plan_fn(spec, hw, replace(forced, batch=n + 1), contexts=False)
    assert at_n.fits and at_n.choice.gpu_layers >= one.choice.gpu_layers
    assert not more.fits or more.choice.gpu_layers < one.choice.gpu_layers
    assert why.startswith("fits only with") or "nothing fits" in why or "does not fit" in why


def test_every_engine_answers_and_vllm_counts_its_pool():
    spec, hw = model_spec("llama-3.1-8b"), resolve_profile("a100-80gb-sxm")[0]
    req = Request(context=8192)
    p = plan_for_engine(spec, hw, req)
    rows = {c.engine: c for c in concurrency(ENGINES, spec, hw, req, p)}
    assert set(rows) == {e.name for e in ENGINES}
    a = vllm.vllm_best(spec, hw, req)
    most = a.model.layout(a.layout.tp, a.layout.pp, a.layout.nodes)
    assert rows["vllm"].sequences == most.max_concurrency > 1 and rows["vllm"].aggregate_decode_tokens_per_s is None
    v = rows["vramplan"]
    assert v.weight_quant == p.chosen.weight_quant and v.aggregate_decode_tokens_per_s > p.predicted.decode_tokens_per_s


def test_the_cli_prints_and_writes_it(capsys):
    base = ("plan", "--model", "qwen2.5-0.5b", "--context", "2k", "-H", "rtx-4090", "--concurrency")
    code, out, err = run_cli(capsys, *base, "--json")
    d = json.loads(out)
    assert [c["engine"] for c in d["concurrency"]] == [e.name for e in ENGINES]
    assert all(c["sequences"] >= 1 for c in d["concurrency"])
    code, out, err = run_cli(capsys, *base)
    assert "sequences of 2k tokens at once" in out and "tok/s together" in out
    code, out, err = run_cli(capsys, *base[:-1], "--json")
    assert "concurrency" not in json.loads(out)  # only when asked for


def test_a_published_checkpoint_counts_in_its_own_format():
    """gpt-oss-20b's stored MXFP4 is not a --quant: the count is still the largest batch of that format."""
    spec, hw = model_spec("gpt-oss-20b"), resolve_profile("h100-sxm")[0]
    req = Request(context=32768)
    p = plan_for_engine(spec, hw, req)
    rows = {c.engine: c for c in concurrency(ENGINES, spec, hw, req, p)}
    assert rows["vramplan"].weight_quant == p.chosen.weight_quant and rows["vramplan"].sequences > 1


@pytest.mark.parametrize("engine", ["vramplan", "llama.cpp", "transformers"])
def test_more_sequences_never_move_experts_or_layers_off_the_gpu(engine):
    """An MoE whose batch fits only with more layers' routed experts in RAM is not counted at that batch."""
    spec, hw, plan_fn, one, (n, best, why) = _most("qwen3-30b-a3b", "rtx-4090", 32768, engine)
    assert best.choice.expert_layers_on_cpu <= one.choice.expert_layers_on_cpu
    assert best.choice.gpu_layers >= one.choice.gpu_layers
    assert why and "do not fit" not in why  # the reason for n + 1, in its own words


def test_the_section_is_there_when_the_plan_does_not_fit(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-405b", "--context", "8k", "-H", "rtx-4090",
                             "--quant", "bf16", "--concurrency", "--json")
    d = json.loads(out)
    assert code == 1 and not d["fits"] and len(d["concurrency"]) == len(ENGINES)
    assert d["concurrency"][0]["sequences"] == 0
