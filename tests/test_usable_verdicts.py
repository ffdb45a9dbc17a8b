"""Verdicts that tell usable from possible (issue 40): a plan that fits but decodes under the request's
usable_min_decode_tok_s, or whose first token comes after usable_max_ttft_s, says so in its verdict and its JSON;
times over a minute read in minutes, hours or days; a quality past the floor is warned about."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli
from vramplan.planner.errors import PlanError
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec
from vramplan.planner.units import format_duration

SLOW = ("--model", "llama-3.1-70b", "-H", "rtx-3090", "--context", "128k", "--prefer", "quality")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


def test_a_plan_too_slow_to_use_says_so(capsys):
    code, out, err = run_cli(capsys, "plan", *SLOW, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["fits"] and d["usable"] is False
    assert any("tok/s is under 1 tok/s" in w for w in d["unusable_because"])
    assert any(w.startswith("this plan fits but is not usable as it stands") for w in d["warnings"])
    code, out, err = run_cli(capsys, "plan", *SLOW)
    assert "plan (fits, too slow to use):" in out and " min for 131072 prompt tokens" in out


def test_the_thresholds_are_the_requests():
    spec, hw = model_spec("llama-3.1-70b"), resolve_profile("rtx-3090")[0]
    req = Request(context=131072, prefer="quality", usable_min_decode_tok_s=0.01, usable_max_ttft_s=1e6)
    p = plan(spec, hw, req)
    assert p.fits and p.unusable == [] and p.to_dict()["usable"] is True
    with pytest.raises(PlanError, match="least usable decode speed"):
        Request(context=8192, usable_min_decode_tok_s=-1)


def test_the_thresholds_are_flags(capsys):
    """--min-tok-s and --max-ttft set the request's thresholds; a bad duration is a one-line error."""
    base = ("plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--context", "8k", "--json")
    code, out, err = run_cli(capsys, *base, "--min-tok-s", "500")
    d = json.loads(out)
    assert code == 0 and d["fits"] and d["usable"] is False and "under 500 tok/s" in d["unusable_because"][0]
    code, out, err = run_cli(capsys, *base, "--max-ttft", "1m", "--min-tok-s", "0.5")
    d = json.loads(out)
    assert d["request"]["usable_max_ttft_s"] == 60.0 and d["request"]["usable_min_decode_tok_s"] == 0.5
    code, out, err = run_cli(capsys, *base, "--max-ttft", "soon")
    assert "--max-ttft 'soon'" in assert_one_line_error(code, err)


def test_a_usable_plan_stays_quiet(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--context", "8k", "--json")
    d = json.loads(out)
    assert d["usable"] is True and d["unusable_because"] == []
    assert not any("not usable" in w or "quality floor" in w for w in d["warnings"])


def test_prefer_speed_past_the_quality_floor_is_warned_about(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-70b", "-H", "rtx-4090", "--context", "32k",
                             "--engine", "llama.cpp", "--prefer", "speed", "--json")
    d = json.loads(out)
    assert d["quality_cost_pct"] > 8
    assert any("past the 8 % quality floor" in w and "--prefer balanced keeps the floor" in w for w in d["warnings"])


@pytest.mark.parametrize("s,text", [(14.123, "14.12 s"), (59.99, "59.99 s"), (90, "1.5 min"), (7845.12, "2.2 h"),
                                    (573867.14, "6.6 days")])
def test_durations_read_as_people_read_them(s, text):
    assert format_duration(s) == text


def test_version(capsys):
    code, out, err = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("vramplan ") and len(out.splitlines()) == 1


def test_gpus_plans_n_of_the_profiles_gpu(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-70b", "-H", "rtx-3090", "--gpus", "2", "--context",
                             "32k", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["hardware"]["name"] == "rtx-3090-x2" and len(d["memory"]["gpus"]) == 2
    for bad in (("-H", "cpu-epyc-server", "--gpus", "2"), ("-H", "rtx-3090", "--gpus", "0")):
        code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", *bad)
        assert code == 2 and err.count("error:") == 1 and "--gpus" in err


def test_budgets_as_people_write_them(capsys):
    """A 4090 owner types 24GiB (the card has 23.99): planned at the card's size, with a note; 24GB is read as
    decimal gigabytes and said so; past 1 % over, it is refused."""
    base = ("plan", "--model", "qwen2.5-32b", "--context", "32k", "-H", "rtx-4090", "--json")
    code, out, err = run_cli(capsys, *base, "--vram-budget", "24GiB")
    d = json.loads(out)
    assert code == 0 and any("is the GPU's own 23.99 GiB as written" in w for w in d["warnings"])
    assert d["memory"]["gpus"][0]["capacity_bytes"] == 24564 * 2**20
    code, out, err = run_cli(capsys, *base, "--vram-budget", "24GB")
    assert code == 0 and "--vram-budget 24GB read as decimal units: 22.35 GiB" in err
    code, out, err = run_cli(capsys, *base, "--vram-budget", "24.5GiB")
    assert code == 2 and "exceeds the GPU's 23.99 GiB" in err


def test_profiles_validate_by_name_and_over_every_directory(capsys, tmp_path, monkeypatch):
    code, out, err = run_cli(capsys, "profiles", "validate", "rtx-4090")
    assert code == 0 and out.startswith("ok: rtx-4090 (rtx-4090) = ")
    mine = tmp_path / "team"
    mine.mkdir()
    (mine / "broken.yaml").write_text("schema_version: 1\nname: broken\n")
    monkeypatch.setenv("VRAMPLAN_PROFILES", str(mine))
    code, out, err = run_cli(capsys, "profiles", "validate")  # no argument: every file of the search directories
    assert code == 1 and "broken.yaml" in err and "ok: " in out and "rtx-4090.yaml" in out


BAD_PROFILE = """\
schema_version: 1
name: bad
description: x
source: y
gpus:
  - name: A
    memory: "lots"
    memory_bandwidth: "1000 GB/s"
    bf16_compute: "100 TFLOPS"
    colour: red
host:
  ram: "64 GiB"
  ram_bandwidth: "fast"
  cpu_cores: 8
overheads:
  cuda_context: "500 MiB"
  allocator_reserve: "256 MiB"
  kernel_launch: "5 us"
notes: [1]
"""


def test_every_error_of_a_profile_at_once(capsys, tmp_path):
    """profiles validate lists each error of a file in one pass (unknown and missing keys, bad values, in every
    section); a command that reads the profile gives the first in one line and counts the rest."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_PROFILE)
    code, out, err = run_cli(capsys, "profiles", "validate", bad)
    errors = [ln for ln in err.splitlines() if ln.startswith("invalid:")]
    assert code == 1 and len(errors) == 5, err
    for where in ('gpus[0]: unknown key "colour"', "gpus[0].memory: expected a size", 'host: missing required key '
                  '"cpu_bf16_compute"', "host.ram_bandwidth: expected a bandwidth", "notes[0]: expected a string"):
        assert any(where in e for e in errors), where
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "-H", bad)
    line = assert_one_line_error(code, err)
    assert 'unknown key "colour"' in line and f"(and 4 more errors: `vramplan profiles validate {bad}`" in line


def test_an_error_is_listed_once(capsys, tmp_path):
    """A missing section is one error, however many times its mapping is read."""
    import yaml

    d = yaml.safe_load((resolve_profile("rtx-4090")[1]).read_text())
    del d["host"]
    bad = tmp_path / "nohost.yaml"
    bad.write_text(yaml.safe_dump(d))
    code, out, err = run_cli(capsys, "profiles", "validate", bad)
    assert code == 1 and [ln for ln in err.splitlines() if ln.startswith("invalid:")] == [
        f'invalid: {bad}: missing required key "host"']
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "-H", bad)
    assert "more error" not in assert_one_line_error(code, err)


def test_a_saved_profile_is_named_after_its_file():
    """calibrate --save and probe --save name the profile after the file: two team profiles never share a name."""
    from vramplan.cli import named_after
    from vramplan.planner.profiles import resolve_profile

    hw = resolve_profile("rtx-4090")[0]
    assert named_after(hw, "team/x-calibrated.yaml").name == "x-calibrated"
    assert named_after(hw, "team/my node!.yaml").name == "my-node"
    assert named_after(hw, "team/---.yaml").name == "rtx-4090"


def test_a_typical_prompts_ttft_beside_the_whole_contexts(capsys):
    """By default a plan is timed at a prompt of the whole context; beside it, the TTFT of a typical 1024-token prompt
    (request.TYPICAL_PROMPT_TOKENS), the same as timing that plan at --prompt-tokens 1024."""
    from vramplan.planner.plan import Plan
    from vramplan.planner.request import TYPICAL_PROMPT_TOKENS

    base = ("plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--context", "32k")
    code, out, err = run_cli(capsys, *base, "--json")
    d = json.loads(out)
    typical = d["typical_prompt_ttft"]
    assert typical["prompt_tokens"] == TYPICAL_PROMPT_TOKENS == 1024 and typical["ttft_s"] < d["predicted"]["ttft_s"]
    q, kv = d["choice"]["weight_quant"], d["choice"]["kv_dtype"]
    code, out, err = run_cli(capsys, *base, "--json", "--prompt-tokens", "1024", "--quant", q, "--kv-dtype", kv)
    timed = json.loads(out)
    assert timed["predicted"]["ttft_s"] == pytest.approx(typical["ttft_s"], rel=1e-9)
    assert timed["typical_prompt_ttft"] is None  # a prompt given: no second one
    assert Plan.from_dict(d).typical_prompt_ttft == (1024, typical["ttft_s"])
    code, out, err = run_cli(capsys, *base)
    assert "prompt tokens (the whole context; " in out and "for a typical 1024-token prompt)" in out


def test_a_typical_prompts_ttft_keeps_the_chosen_placement():
    """Mixtral at 8k on a 4090 keeps some layers' experts in RAM; the 1024-token prompt is timed on that placement (the
    fastest placement for a short prompt alone may be another)."""
    p = plan(model_spec("mixtral-8x7b-v0.1"), resolve_profile("rtx-4090")[0], Request(context=8192))
    assert p.fits and p.choice.expert_layers_on_cpu > 0
    assert p.typical_prompt_ttft is not None and p.typical_prompt_ttft[1] < p.predicted.ttft_s
