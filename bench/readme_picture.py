"""The README's picture of the default output: `vramplan plan --model llama-3.1-8b --context 32k -H rtx-4090` as a
100-column terminal shows it, recorded by rich and written as SVG to docs/plan-output.svg.
Run: python bench/readme_picture.py (after a change to what `plan` prints)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

from vramplan import cli, render  # noqa: E402

COMMAND = ["plan", "--model", "llama-3.1-8b", "--context", "32k", "-H", "rtx-4090"]
WIDTH = 100
OUT = ROOT / "docs" / "plan-output.svg"


def main() -> None:
    console = render._Console(record=True, width=WIDTH, force_terminal=True, color_system="truecolor",
                              file=io.StringIO(), emoji=False)
    render.out.out = render.out.err = console  # results and notes in one stream, in the order a terminal shows them
    try:
        cli.main(COMMAND)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(console.export_svg(title="vramplan " + " ".join(COMMAND)), encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
