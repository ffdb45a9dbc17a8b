"""Output for a terminal of any width (issue 40): at 80 and 120 columns the engine table shows whole engine names and
whole commands (one block per engine where the table is wider than the terminal), and no table cell is cut to "…"."""

from __future__ import annotations

import pytest

from cli_helpers import isolate, run_cli
from vramplan import render

ENGINES = ("vramplan", "llama.cpp", "ollama", "vllm", "transformers")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


@pytest.mark.parametrize("width", [80, 120, 200])
@pytest.mark.parametrize("request_", [
    ("--model", "qwen3-32b", "--context", "32k", "-H", "rtx-4090"),
    ("--model", "llama-3.1-70b", "--context", "32k", "-H", "rtx-3090", "--gpus", "2")])
def test_a_terminals_width_keeps_names_and_commands_whole(width, request_, monkeypatch, capsys):
    monkeypatch.setattr(render.out.out, "width", width)
    code, out, err = run_cli(capsys, "plan", *request_)
    assert code == 0, err
    assert "…" not in out or width >= 200  # the wide table cuts a refused row's reason (the JSON has all of it)
    lines = out.splitlines()
    for engine in ENGINES:
        assert any(line.split(":")[0].split()[0] == engine for line in lines if line.strip()), engine
    for command in ("plan --engine llama.cpp", "plan --engine ollama", "plan --emit vllm",
                    "plan --engine transformers"):
        assert any(command in line for line in lines), command
    assert all(len(line) <= width for line in lines if line.startswith(("┃", "│", "┏", "└")))
