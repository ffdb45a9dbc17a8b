"""Print the README's quick-start commands, one a line: the fenced bash block under '## Quick start'.

.ci/run runs them as they are written; tests/test_structure.py checks their shape (two commands: install with
constraints.txt and plan, then the test command). No dependencies: this runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_commands(text: str) -> list[str]:
    section = re.search(r"^## Quick start.*?$(.*?)^## ", text, re.S | re.M)
    if section is None:
        raise SystemExit("README.md has no '## Quick start' section")
    block = re.search(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
    if block is None:
        raise SystemExit("README.md's quick start has no ```bash block")
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{c}\n" for c in quickstart_commands(README.read_text(encoding="utf-8"))))
