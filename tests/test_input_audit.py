"""Input the audit found accepted or reported unclearly: ambiguous model names, bad model configs, non-finite or
absurd quantities, oversized and shadowed profiles, file text shown through rich markup, and the length of the
default plan report."""

from __future__ import annotations

import json
import re

import pytest

import cli


def main(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def assert_one_line_error(code: int, err: str, expected: int = 2) -> str:
    assert code == expected, err
    assert "Traceback" not in err and "internal error" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err
    return " ".join(err.split())


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # no cached hub model answers for a catalog name
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and the hub is never asked
    monkeypatch.delenv("VRAMPLAN_PROFILES", raising=False)
    monkeypatch.delenv("VRAMPLAN_DEBUG", raising=False)


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
