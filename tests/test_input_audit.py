"""Input the audit found accepted or reported unclearly: ambiguous model names, bad model configs, non-finite or
absurd quantities, oversized and shadowed profiles, file text shown through rich markup, and the length of the
default plan report."""

from __future__ import annotations

import json
import re

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli as main
from vramplan.planner.quant import KV_SCHEMES, SCHEMES


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


# ------------------------------------------------------------------ 1. model names
def test_a_name_cut_short_is_refused_with_the_candidates(capsys):
    code, out, err = main(capsys, "plan", "--model", "llama-3.1-4", "-H", "rtx-4090")
    msg = assert_one_line_error(code, err)
    assert "ambiguous" in msg and out == ""
    listed = re.findall(r"meta-llama/Llama-3\.[12]-\d+B", msg)
    assert "meta-llama/Llama-3.1-405B" in listed and "meta-llama/Llama-3.1-8B" in listed and len(set(listed)) >= 3


@pytest.mark.parametrize("name", ["llama-3.1", "meta-llama/llama-3.1", "gemma-2", "qwen3-235b"])
def test_a_name_of_several_models_is_refused(capsys, name):
    code, _, err = main(capsys, "inspect", "--model", name)
    assert "several catalog models" in assert_one_line_error(code, err)


@pytest.mark.parametrize("name, model_id", [
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),  # the hub id
    ("META-LLAMA/LLAMA-3.1-8B", "meta-llama/Llama-3.1-8B"),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),  # the alias README uses
    ("Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),  # the hub id's name without its org
    ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B"),
    ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B"),
    ("Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B"),  # exact, though the -Instruct-2507 id contains it
])
def test_exact_names_resolve_silently(capsys, name, model_id):
    code, out, err = main(capsys, "inspect", "--model", name, "--json")
    assert code == 0, err
    assert json.loads(out)["name"] == model_id and "resolved" not in err


def test_a_unique_whole_word_name_resolves_and_says_so(capsys):
    code, out, err = main(capsys, "plan", "--model", "mixtral", "-H", "h100-sxm", "--json")  # README's example
    assert code == 0, err
    assert json.loads(out)["model"]["id"] == "mistralai/Mixtral-8x7B-v0.1"
    assert "resolved to mistralai/Mixtral-8x7B-v0.1" in err


def test_an_org_name_the_catalog_lacks_is_not_completed(capsys):
    code, _, err = main(capsys, "inspect", "--model", "meta-llama/Llama-2-7b")
    msg = assert_one_line_error(code, err)
    assert "not a catalog id" in msg and "meta-llama/Llama-2-7b-hf" in msg and "--revision main" in msg


# ------------------------------------------------------------------ 2. model configs
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def model_dir(tmp_path, **changes) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    cfg = {k: v for k, v in {**TINY, **changes}.items() if v is not ...}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_a_config_without_max_position_embeddings_plans_with_a_warning(capsys, tmp_path):
    d = model_dir(tmp_path, max_position_embeddings=...)
    code, out, err = main(capsys, "plan", "--model", d, "--context", "1m", "-H", "rtx-4090", "--json")
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    assert any("no max_position_embeddings" in w and "not checked" in w for w in warnings), warnings
    code, _, err = main(capsys, "plan", "--model", d, "--context", "8k", "-H", "rtx-4090")
    assert code == 0 and "warning:" in err and "is unknown" in " ".join(err.split()), err
    code, out, _ = main(capsys, "inspect", "--model", d)
    assert code == 0 and "unknown (the config gives no max_position_embeddings)" in out
    # with it, the same context is checked (and refused)
    code, _, err = main(capsys, "plan", "--model", model_dir(tmp_path), "--context", "1m", "-H", "rtx-4090")
    assert "exceeds what" in assert_one_line_error(code, err)


@pytest.mark.parametrize("changes, says", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": -4, "original_max_position_embeddings": 4096}},
     "rope_scaling.factor must be a number >= 1"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "8"}}, "rope_scaling.factor must be a number >= 1"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": True}}, "rope_scaling.factor must be a number >= 1"),
    ({"rope_scaling": "yarn"}, 'rope_scaling must be an object like {"rope_type": "yarn"'),
    ({"rope_scaling": ["yarn", 4]}, "rope_scaling must be an object"),
    ({"rope_scaling": {"type": 4, "factor": 4.0}}, "rope_scaling.rope_type must be a string"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -1}},
     "rope_scaling.original_max_position_embeddings must be a token count"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": -4, "rope_theta": 10000.0}},
     "rope_parameters.factor must be a number >= 1"),
    ({"rope_parameters": "yarn"}, "rope_parameters must be an object"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": "yarn"}},
     "rope_parameters.sliding_attention must be an object"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 0.5}}},
     "rope_parameters.full_attention.factor must be a number >= 1"),
])
def test_a_bad_rope_scaling_is_refused(capsys, tmp_path, changes, says):
    d = model_dir(tmp_path, **changes)
    for argv in (["plan", "--model", d, "-H", "rtx-4090"], ["inspect", "--model", d]):
        code, _, err = main(capsys, *argv)
        msg = assert_one_line_error(code, err)
        assert says in msg, msg


def test_good_rope_scalings_still_plan(capsys, tmp_path):
    for changes in ({"rope_scaling": None}, {"rope_scaling": {"rope_type": "default"}},
                    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
                    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "linear", "factor": 8.0}}}):
        code, _, err = main(capsys, "plan", "--model", model_dir(tmp_path, **changes), "-H", "rtx-4090")
        assert code == 0, (changes, err)


# ------------------------------------------------------------------ 3. quantities
@pytest.mark.parametrize("value, says", [
    ("nanGiB", "is not a number: give a finite number"),
    ("NaN GiB", "is not a number: give a finite number"),
    ("infGiB", "is not a finite number"),
    ("-inf GiB", "is not a finite number"),
    ("inf", "is not a finite number"),
    ("1e30GiB", "is larger than any machine (max 1 PiB)"),
    ("1e400GiB", "is larger than any machine (max 1 PiB)"),  # a float overflow, not a crash
    ("2000TiB", "is larger than any machine (max 1 PiB)"),
    ("1e3GiB", "write the number without an exponent (1e3 = 1000)"),
])
def test_a_budget_that_is_no_real_size_says_why(capsys, value, says):
    code, _, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--vram-budget", value)
    msg = assert_one_line_error(code, err)
    assert says in msg and "needs an explicit unit" not in msg, msg


@pytest.mark.parametrize("flag, value, says", [
    ("--context", "nank", "is not a number"),
    ("--context", "infk", "is not a finite number"),
    ("--context", "1e400", "beyond any model's reach"),
    ("--headroom", "nan MiB", "is not a number"),
    ("--ram-budget", "1e20 GB", "is larger than any machine"),
])
def test_other_flags_say_why(capsys, flag, value, says):
    code, _, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", flag, value)
    assert says in assert_one_line_error(code, err)


def test_parsers_refuse_nan_inf_and_absurd_values():
    from vramplan.planner.errors import UnitError
    from vramplan.planner.units import (
        parse_bandwidth,
        parse_flops,
        parse_fraction,
        parse_seconds,
    )

    for fn, value, says in [
        (parse_bandwidth, "nan GB/s", "is not a number"), (parse_bandwidth, "inf GB/s", "not a finite number"),
        (parse_bandwidth, float("nan"), "is not a number"), (parse_bandwidth, float("inf"), "not a finite number"),
        (parse_bandwidth, "1e30 GB/s", "larger than any machine"), (parse_bandwidth, 1e30, "larger than any machine"),
        (parse_flops, "infTFLOPS", "not a finite number"), (parse_flops, float("nan"), "is not a number"),
        (parse_flops, "1e30 TFLOPS", "larger than any machine"),
        (parse_seconds, "nan us", "is not a number"), (parse_seconds, float("inf"), "not a finite number"),
        (parse_fraction, "nan", "is not a number"),
    ]:
        with pytest.raises(UnitError, match=re.escape(says)):
            fn(value)


def test_a_profile_quantity_beyond_any_machine_names_its_key(capsys, tmp_path):
    from vramplan.planner.profiles import shipped_profiles_dir

    text = (shipped_profiles_dir() / "rtx-4090.yaml").read_text()
    bad = tmp_path / "big.yaml"
    bad.write_text(re.sub(r"(\n  memory_bandwidth:).*", r'\1 "1e30 GB/s"', text, count=1))
    code, _, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", str(bad))
    msg = assert_one_line_error(code, err)
    assert "gpus[0].memory_bandwidth: bandwidth '1e30 GB/s' is larger than any machine" in msg, msg


# ------------------------------------------------------------------ 4. profiles
def profile_dict(**changes) -> dict:
    import yaml

    from vramplan.planner.profiles import shipped_profiles_dir

    d = yaml.safe_load((shipped_profiles_dir() / "rtx-4090.yaml").read_text())
    d.update(changes)
    return d


def write_profile(path, **changes):
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(profile_dict(**changes), sort_keys=False))
    return path


def test_more_gpus_than_one_machine_holds_are_refused_with_the_key(capsys, tmp_path):
    from vramplan.planner.hardware import MAX_GPUS_PER_PROFILE

    base = profile_dict()
    gpu = base["gpus"][0]
    many = write_profile(tmp_path / "many.yaml", gpus=[{**gpu, "count": 1000}])
    code, _, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", str(many))
    msg = assert_one_line_error(code, err)
    assert f"gpus[0].count: must be at most {MAX_GPUS_PER_PROFILE} GPUs per profile" in msg and "1000" in msg
    split = write_profile(tmp_path / "split.yaml", gpus=[{**gpu, "count": 40}, {**gpu, "count": 40}])
    code, _, err = main(capsys, "profiles", "show", str(split))
    assert f"gpus: 80 GPUs in all: at most {MAX_GPUS_PER_PROFILE}" in assert_one_line_error(code, err)
    ok = write_profile(tmp_path / "ok.yaml", gpus=[{**gpu, "count": 8}])
    code, out, err = main(capsys, "profiles", "show", str(ok), "--json")
    assert code == 0 and json.loads(out)["profile"]["gpus"][0]["count"] == 8


@pytest.fixture
def two_dirs(tmp_path, monkeypatch):
    a, b = tmp_path / "team-a", tmp_path / "team-b"
    write_profile(a / "node.yaml", name="node", description="node from a")
    write_profile(b / "node.yaml", name="node", description="node from b")
    write_profile(b / "other.yaml", name="other", description="only in b")
    monkeypatch.setenv("VRAMPLAN_PROFILES", f"{a}:{b}")
    return a, b


def test_profiles_list_marks_shadowed_profiles(capsys, two_dirs):
    a, b = two_dirs
    code, out, err = main(capsys, "profiles", "list", "--json")
    assert code == 0, err
    entries = {e["name"]: e for e in json.loads(out)["profiles"]}
    assert entries["node"]["path"] == str(a / "node.yaml")
    assert entries["node"]["shadows"] == [{"path": str(b / "node.yaml"), "origin": "$VRAMPLAN_PROFILES"}]
    assert "shadows" not in entries["other"] and "shadows" not in entries["rtx-4090"]
    code, out, err = main(capsys, "profiles", "list")
    assert code == 0 and "shadowed (unused)" in out
    warning = " ".join(err.split())
    assert f"profile 'node': {a / 'node.yaml'} ($VRAMPLAN_PROFILES) is used; it shadows {b / 'node.yaml'}" in warning
    assert "'other'" not in warning


def test_a_shadowed_name_says_which_file_was_used(capsys, two_dirs):
    a, b = two_dirs
    code, out, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", "node", "--json")
    assert code == 0, err
    assert f"hardware profile 'node': using {a / 'node.yaml'}; it shadows {b / 'node.yaml'}" in " ".join(err.split())
    code, out, err = main(capsys, "profiles", "show", "node")
    assert code == 0 and "node from a" in out and "it shadows" in err
    for argv in (["profiles", "show", "other"], ["profiles", "show", str(b / "node.yaml")]):  # no shadow, a path
        code, _, err = main(capsys, *argv)
        assert code == 0 and "shadows" not in err, err


def test_profile_text_is_shown_literally(capsys, tmp_path):
    path = write_profile(tmp_path / "odd.yaml", name="odd", description="[bold]x[/bold] :smile: [red]",
                         notes=["see [link=http://x]here[/link] :thumbs_up:"])
    code, out, err = main(capsys, "profiles", "show", str(path))
    assert code == 0, err
    assert "[bold]x[/bold] :smile: [red]" in out and "[link=http://x]here[/link] :thumbs_up:" in out
    assert "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in out and "\N{THUMBS UP SIGN}" not in out


def test_profiles_show_of_a_text_file_is_one_literal_line(capsys):
    code, out, err = main(capsys, "profiles", "show", "/etc/passwd")
    msg = assert_one_line_error(code, err)
    assert out == "" and "expected a mapping at the top level" in msg
    assert "root:x:0" in msg and "\N{CROSS MARK}" not in err


def test_an_error_quoting_markup_is_literal(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("\"[bold]x[/bold] :x: :smile:\"\n")
    code, _, err = main(capsys, "profiles", "validate", str(bad))
    assert code == 1 and "[bold]x[/bold]" in err and ":x:" in err and "\N{CROSS MARK}" not in err, err


# ------------------------------------------------------------------ 5. the plan report
PLAN_8B = ("plan", "--model", "llama-3.1-8b", "--context", "32k", "-H", "rtx-4090")


def candidate_rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.search(r"│ (yes|no) +│", ln)]


def test_the_default_plan_report_is_short(capsys):
    code, out, err = main(capsys, *PLAN_8B)
    assert code == 0, err
    # the plan, its memory table and the best alternatives in under 36 lines, plus one line per engine answering the
    # same request (planner.engines: 5 engines, a header and a title) and the fastest engine
    assert len((out + err).splitlines()) < 44, out + err
    assert "plan: bf16 weights + bf16 KV cache, 32/32 layers on the GPU" in out
    assert "memory by device" in out and "constants used" not in out
    rows = candidate_rows(out)
    assert 2 <= len(rows) <= 6 and rows[0].startswith("│ plan │ bf16 ")  # the plan, then the best alternatives
    assert len({r.split("│")[2].strip() for r in rows}) == len(rows)  # one row per weight scheme
    d = json.loads(main(capsys, *PLAN_8B, "--json")[1])
    hint = " ".join(err.split())
    assert f"{len(d['candidates']) - len(rows)} more candidates and the {len(d['constants'])} constants" in hint
    assert "--all" in hint


def test_all_shows_every_candidate_and_the_constants(capsys):
    code, out, err = main(capsys, *PLAN_8B, "--all")
    assert code == 0, err
    d = json.loads(main(capsys, *PLAN_8B, "--json")[1])
    assert len(candidate_rows(out)) == len(d["candidates"]) == len(SCHEMES) * len(KV_SCHEMES)  # every pair
    assert "constants used" in out and all(name in out for name in d["constants"])
    assert "more candidates" not in err


def test_json_keeps_everything(capsys):
    d = json.loads(main(capsys, *PLAN_8B, "--json")[1])
    assert len(d["candidates"]) == len(SCHEMES) * len(KV_SCHEMES) and len(d["constants"]) > 10
    assert d["choice"]["weight_quant"] == "bf16"


def test_nothing_fits_shows_the_nearest_candidates(capsys):
    code, out, err = main(capsys, "plan", "--model", "llama-3.1-405b", "-H", "rtx-4090")
    assert code == 1 and "nothing fits" in out
    rows = candidate_rows(out)
    assert 1 <= len(rows) <= 5 and all("│ no " in r for r in rows) and len((out + err).splitlines()) < 40
