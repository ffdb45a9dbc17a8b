"""Shell completion: the script Typer writes, and what it completes (commands, catalog names, profile names), through
the same entry point a shell calls."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def complete(words: str, tmp_path) -> list[str]:
    """What bash completion offers for the last of `words` (vramplan's own completion protocol, as the installed
    script calls it)."""
    env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
           "_VRAMPLAN_COMPLETE": "complete_bash", "HOME": str(tmp_path)}
    env.pop("VRAMPLAN_PROFILES", None)
    out = subprocess.run([sys.executable, "-c", "from vramplan.cli import main; main()"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_completion_script_is_shown(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from vramplan.cli import main; main()", "--show-completion", "bash"],
                         env={**os.environ, "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "_VRAMPLAN_COMPLETE=complete_bash" in out.stdout


@pytest.mark.parametrize("words, expected, unexpected", [
    ("vramplan pl", {"plan"}, {"models"}),
    ("vramplan plan --model qwen3-3", {"qwen3-30b-a3b", "qwen3-32b"}, {"llama-3.1-8b"}),
    ("vramplan plan -H rtx-40", {"rtx-4090", "rtx-4060-laptop-8gb"}, {"h100-sxm"}),
])
def test_completion_offers_commands_models_and_profiles(words, expected, unexpected, tmp_path):
    got = set(complete(words, tmp_path))
    assert expected <= got and not (unexpected & got)
