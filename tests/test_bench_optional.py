"""Benchmarks write their JSON and Markdown whether or not matplotlib (the `bench` extra) is installed; the PNG is
added when it is. The GPU machine may have no matplotlib: the proof must not die at its plot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _accuracy():
    spec = importlib.util.spec_from_file_location("bench_accuracy", ROOT / "bench" / "accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = [{"quant": q, "predicted": {"decode_tokens_per_s": p, "peak_ram_bytes": 2**30},
         "measured": {"decode_tokens_per_s": m, "peak_ram_bytes": 1.1 * 2**30},
         "error_pct": {"decode_tokens_per_s": 100 * (p / m - 1)}}
        for q, p, m in (("bf16", 10.0, 11.0), ("quanto-int8", 15.0, 14.0))]


def test_without_matplotlib_the_plot_is_skipped_with_a_line(monkeypatch, tmp_path, capsys):
    accuracy = _accuracy()
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    png = tmp_path / "accuracy-x.png"
    assert accuracy.plot(ROWS, png, "t") is False
    assert not png.exists()
    assert "matplotlib is not installed" in capsys.readouterr().out
    # the Markdown does not need it
    md = accuracy.markdown({"machine": "x", "date": "d", "hardware": "h", "versions": "v", "targets": "t",
                            "rows": [], "summary": accuracy.summarize(ROWS)})
    assert "# Accuracy" in md


def test_with_matplotlib_the_png_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "accuracy-x.png"
    assert _accuracy().plot(ROWS, png, "t") is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
