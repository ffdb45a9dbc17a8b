"""Bad input gets one line and exit 2 (1 when nothing fits), never a traceback, a hang or "internal error"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan import cli
from cli_helpers import assert_one_line_error, isolate, run_cli as main
from conftest import run_profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch)


@pytest.mark.parametrize("argv", [
    ["plan"],  # no --model
    ["plan", "--model", "llama-3.1-8b", "--bogus"],
    ["nosuchcmd"],
    ["profiles", "validate", "--bogus"],
    ["plan", "--model", "llama-3.1-8b", "--batch", "x"],
    ["plan", "--model", "llama-3.1-8b", "--emit", "x"],
])
def test_usage_errors_are_one_line_exit_2(capsys, argv):
    code, _, err = main(capsys, *argv)
    assert_one_line_error(code, err)
    assert "--help" in err


def test_no_subcommand_shows_help_exit_2(capsys):
    code, out, err = main(capsys, "profiles")
    assert code == 2 and "Usage" in out + err and "internal error" not in err and (out + err).count("Usage") == 1


@pytest.mark.parametrize("argv, says", [
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--json", "--yaml"], "--json or --yaml, not both"),
    (["plan", "--model", "llama-3.1-8b", "-H", ""], "name is empty"),
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--quant", ""], "--quant is empty"),
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--quant", " , "], "--quant is empty"),
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--save", ""], "path is empty"),
    (["plan", "--model", "llama-3.1-8b", "-H", "cpu-ddr5-desktop", "--ram-budget", "1TiB"], "exceeds the host's"),
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--vram-budget", "-1GiB"], "must not be negative"),
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--vram-budget", "NaN GiB"], "is not a number"),
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--vram-budget", "24gib"], "lowercase 'b' means bits"),
    (["plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--context", "-5k"], "must not be negative"),
    (["plan", "--model", "llama-3.1-8b", "-H", "/etc/passwd"], "expected a mapping at the top level"),
    (["plan", "--model", "llama-3.1-8b", "-H", "~vramplan-no-such-user/p.yaml"],
     "cannot expand '~vramplan-no-such-user'"),  # Path.expanduser's RuntimeError (issue 36)
    (["plan", "--model", "llama-3.1-8b", "-H", "apple-m2-max-96gb", "--offload", "stream"], "unified memory"),
    (["profiles", "show", "rtx-4090", "--json", "--yaml"], "not both"),
])
def test_bad_input_says_what_is_wrong(capsys, argv, says):
    code, _, err = main(capsys, *argv)
    assert_one_line_error(code, err)
    assert says in " ".join(err.split()), err


def test_a_profile_file_is_never_echoed(capsys):
    code, _, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", "/etc/passwd")
    assert_one_line_error(code, err)
    assert len(err) < 400


def test_profile_search_path_that_does_not_exist(capsys, monkeypatch):
    monkeypatch.setenv("VRAMPLAN_PROFILES", "/nonexistent/vramplan")
    code, _, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090")
    assert_one_line_error(code, err)
    assert "VRAMPLAN_PROFILES lists /nonexistent/vramplan, which is not a directory" in err


def test_probe_save_onto_a_directory_or_under_a_file(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    for target in (tmp_path, tmp_path / "file" / "p.yaml"):
        code, _, err = main(capsys, "probe", "--quick", "--save", str(target))
        assert_one_line_error(code, err)
    assert not list(tmp_path.glob(".*.tmp"))


def test_profile_validation_refuses_duplicates_and_impossible_overheads(capsys, tmp_path):
    good = (ROOT / "profiles" / "rtx-4090.yaml").read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text(good + "name: again\n")
    ctx = tmp_path / "ctx.yaml"
    ctx.write_text(good.replace("cuda_context:", "cuda_context: 100 GiB\n  old_cuda_context:", 1))
    lines = [ln for ln in ctx.read_text().splitlines() if "old_cuda_context" not in ln]
    ctx.write_text("\n".join(lines) + "\n")
    code, _, err = main(capsys, "profiles", "validate", str(dup), str(ctx))
    assert code == 1
    assert "duplicate key 'name'" in err and "leave nothing of gpus[0]" in err


def test_bad_configs_are_one_line(capsys, tmp_path):
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text('{"model_type": "llama", "vocab_size": ' + "9" * 100001 + "}")
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 200000 + "]" * 200000)
    absurd = tmp_path / "absurd"
    absurd.mkdir()
    (absurd / "config.json").write_text((ROOT / "planner/catalog/meta-llama--Llama-3.1-8B.json").read_text()
                                        .replace('"vocab_size": 128256',
                                                 '"vocab_size": 1000000000000000000000000000000'))
    for d in (huge, deep, absurd):
        code, _, err = main(capsys, "inspect", "--model", str(d))
        assert_one_line_error(code, err)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_weights_does_not_hang(tmp_path):
    (tmp_path / "config.json").write_text((ROOT / "planner/catalog/Qwen--Qwen2.5-0.5B.json").read_text())
    os.mkfifo(tmp_path / "model.safetensors")
    r = subprocess.run([sys.executable, "cli.py", "plan", "--model", str(tmp_path), "-H", "rtx-4090"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a regular file" in r.stderr


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True, reason="root reads any directory")
def test_an_unreadable_model_directory(capsys, tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    (d / "config.json").write_text("{}")
    d.chmod(0)
    try:
        code, _, err = main(capsys, "inspect", "--model", str(d))
    finally:
        d.chmod(0o755)
    assert_one_line_error(code, err)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(context=st.text(max_size=12), budget=st.one_of(st.none(), st.text(max_size=12)))
def test_any_context_or_budget_text_is_a_plan_or_a_one_line_error(capsys, context, budget):
    argv = ["plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090", "--json", "--context", context]
    if budget is not None:
        argv += ["--vram-budget", budget]
    code, out, err = main(capsys, *argv)
    assert code in (0, 1, 2), err
    assert "Traceback" not in err and "internal error" not in err
    if code == 2:
        assert_one_line_error(code, err)
    else:
        assert out.lstrip().startswith("{")


def test_the_planner_only_install(tmp_path):
    """Without torch (and without click: typer >= 0.29 bundles its own) plan works and run says what is missing."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['click'] = None\n"
            "import cli\n"
            "try:\n"
            "    cli.main(sys.argv[1:])\n"
            "finally:\n"
            "    print('torch imported:', sys.modules.get('torch') is not None, file=sys.stderr)\n")
    env = dict(os.environ, VRAMPLAN_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--json"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "torch imported: False" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", code, "run", "--model", "qwen2.5-0.5b", "--dummy-weights",
                        "-H", run_profile(), "--prompt-tokens", "4"], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and "needs the runtime extra" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", code, "plan"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and "Missing option" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_error_table_finds_every_class_it_names():
    """One table maps exception types to what the user sees; each of its rows resolves on the installed typer (a
    typer that renamed its click classes would otherwise turn usage errors into internal errors)."""
    rows = cli.error_table()
    assert all(types for types, _, _ in rows), [formatter for types, formatter, _ in rows if not types]
    import typer

    assert typer.Exit in rows[4][0] and typer.Abort in rows[5][0]


def test_the_console_script_is_cli_main_with_its_exit_codes(tmp_path):
    """`vramplan` (pyproject's console script, vramplan.__main__:console, also `python -m vramplan`) keeps cli.main's
    output and exit codes: 0 with a plan, 2 and one line for bad input, 1 when nothing fits."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"vramplan": "vramplan.__main__:console"}
    env = dict(os.environ, VRAMPLAN_CACHE_DIR=str(tmp_path), VRAMPLAN_CONFIG_DIR=str(tmp_path / "c"),
               VRAMPLAN_PROFILES="")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "vramplan", *args], cwd=tmp_path, capture_output=True,
                              text=True, env=env, timeout=120)

    ok = run("plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090", "--json")
    assert ok.returncode == 0 and '"fits": true' in ok.stdout, ok.stderr
    bad = run("plan", "--model", "qwen2.5-0.5b", "-H", "rtx-4090", "--context", "lots")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    none = run("plan", "--model", "llama-3.1-405b", "-H", "rtx-3060-12gb", "--ram-budget", "8GiB")
    assert none.returncode == 1, none.stderr
