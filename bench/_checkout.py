"""`import vramplan` from a checkout that was not installed (the GPU machine runs one as it is copied there).

The repository root is the package `vramplan` (pyproject's package-dir); an installed or editable vramplan finds it
already. Without one, the root is reached through a link named `vramplan` in a temporary directory, added to sys.path
and to PYTHONPATH, so that the commands a benchmark starts (`python cli.py ...`, `-m vramplan.runtime.worker`) find
it too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def use_checkout(root: Path) -> str | None:
    """Make `vramplan` importable here and in child processes; the directory added to the path, or None if it was
    importable already."""
    if importlib.util.find_spec("vramplan") is not None:
        return None
    root = root.resolve()
    parent = Path(tempfile.gettempdir()) / f"vramplan-checkout-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"
    link = parent / "vramplan"
    parent.mkdir(exist_ok=True)
    if not link.exists():
        link.symlink_to(root, target_is_directory=True)
    sys.path.insert(0, str(parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(parent), os.environ.get("PYTHONPATH")) if p)
    return str(parent)
