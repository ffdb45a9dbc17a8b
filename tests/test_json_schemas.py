"""Every --json output has a schema_version and matches the JSON Schema shipped for it (planner/schemas, printed
by `vramplan schema NAME`): outputs of requests the schemas were not inferred from (tests/make_json_schemas.py)."""

from __future__ import annotations

import json
from importlib import resources

import pytest

jsonschema = pytest.importorskip("jsonschema")

from cli_helpers import assert_one_line_error, isolate, run_cli  # noqa: E402
from vramplan.cli import SCHEMAS  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


def schema(name: str) -> dict:
    return json.loads(resources.files("vramplan.planner.schemas").joinpath(f"{name}.schema.json").read_text())


def check(name: str, data) -> None:
    jsonschema.Draft202012Validator(schema(name)).validate(data)


@pytest.mark.parametrize("name", SCHEMAS)
def test_each_schema_is_a_valid_schema_and_printed_by_the_cli(name, capsys):
    jsonschema.Draft202012Validator.check_schema(schema(name))
    code, out, err = run_cli(capsys, "schema", name)
    assert code in (0, None) and json.loads(out) == schema(name)
    assert schema(name)["required"][0] == "schema_version" or "schema_version" in schema(name)["required"]


def test_an_unknown_schema_is_a_one_line_error(capsys):
    code, out, err = run_cli(capsys, "schema", "plans")
    assert "no schema named 'plans'" in assert_one_line_error(code, err)


PLANS = [("phi-4", "16k", "l4", ()), ("qwen3-8b", "32k", "a10g", ("--engine", "llama.cpp")),
         ("mistral-7b-v0.3", "32k", "apple-m4-max-128gb", ("--engine", "ollama")),
         ("qwen3-235b-a22b", "32k", "h200", ("--gpus", "2")), ("llama-3.1-405b", "128k", "rtx-3060-12gb", ()),
         ("gpt-oss-20b", "8k", "rtx-4060-laptop-8gb", ("--prefer", "speed")),
         ("qwen2.5-7b", "128k", "rtx-4060-ti-16gb", ("--prompt-tokens", "2000", "--batch", "4"))]


@pytest.mark.parametrize("model, ctx, hw, extra", PLANS, ids=[p[0] for p in PLANS])
def test_plans_match_their_schema(model, ctx, hw, extra, capsys):
    code, out, err = run_cli(capsys, "plan", "--model", model, "--context", ctx, "-H", hw, "--json", *extra)
    d = json.loads(out)
    assert d["schema_version"] == 1
    check("plan", d)


def test_the_other_commands_match_their_schemas(capsys):
    for name, argv in (("models", ("models",)), ("inspect", ("inspect", "--model", "phi-4")),
                       ("inspect", ("inspect", "--model", "mixtral")),
                       ("profiles-list", ("profiles", "list")), ("profiles-show", ("profiles", "show", "l40s")),
                       ("probe", ("probe", "--quick"))):
        code, out, err = run_cli(capsys, *argv, "--json")
        d = json.loads(out)
        assert code in (0, None) and d["schema_version"] == 1, (name, err)
        check(name, d)


def test_a_schema_rejects_what_breaks_it(capsys):
    """The schemas can fail: a plan without `fits`, or with a speed as a string, does not validate."""
    code, out, err = run_cli(capsys, "plan", "--model", "phi-4", "--context", "8k", "-H", "l4", "--json")
    d = json.loads(out)
    for broken in ({k: v for k, v in d.items() if k != "fits"}, {**d, "predicted": {**d["predicted"],
                                                                                     "ttft_s": "fast"}}):
        with pytest.raises(jsonschema.ValidationError):
            check("plan", broken)


def test_a_run_report_matches_its_schema(capsys):
    pytest.importorskip("torch")
    code, out, err = run_cli(capsys, "run", "--model", "qwen2.5-0.5b", "--dummy-weights", "--context", "256",
                             "--prompt-tokens", "16", "--max-new-tokens", "2", "--json")
    d = json.loads(out)
    assert code in (0, None) and d["schema_version"] == 1, err
    check("run", d)
    assert "print as token ids: the model has no tokenizer (dummy weights are random" in err  # why ids, not words
