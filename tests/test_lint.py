"""The repository passes `ruff check` with the settings in pyproject.toml ([tool.ruff]: E, F and W at 120 columns).

Skipped where ruff is not installed (it comes with the `test` extra, pinned in constraints.txt)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# ruff checks the whole tree in well under a second; the limit only keeps a broken install from hanging the suite.
RUFF_TIMEOUT_S = 120


def test_ruff_check_passes():
    pytest.importorskip("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                       timeout=RUFF_TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
