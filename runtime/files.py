"""Writing results to disk without ever leaving a truncated file: plans, run reports, profiles, caches.

Every write goes to a temporary file in the target's directory, is flushed to disk, and then
renamed over the target (atomic on POSIX): a full disk or an interrupted write leaves the old
file (or none) and no temporary behind. Errors are one-line VramplanErrors naming the path.
No torch: the planner-only install saves plans through here too.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from planner.errors import VramplanError
from planner.hardware import HardwareProfile
from planner.profile_yaml import dumps_profile


class WriteError(VramplanError):
    """A result that could not be written (read-only directory, a directory in the way, a full disk)."""


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Fail now, before minutes of work, if `path` cannot be written: say why in one line."""
    p = Path(path).expanduser()
    if not str(path).strip():
        raise WriteError("the output path is empty")
    if p.is_dir():
        raise WriteError(f"{p}: is a directory, not a file")
    parent = p.parent
    if not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WriteError(f"{p}: cannot create its directory ({e.strerror or e})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WriteError(f"{p}: directory {parent} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise WriteError(f"{p}: file is not writable")
    return p


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename; returns the path."""
    p = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        _remove(tmp)
        raise WriteError(f"{p}: cannot write ({e.strerror or e})") from None
    except BaseException:
        _remove(tmp)
        raise
    return p


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def save_json(path: str | os.PathLike[str], data: Any) -> Path:
    return write_atomic(path, json.dumps(data, indent=2) + "\n")


def save_yaml(path: str | os.PathLike[str], data: Any) -> Path:
    return write_atomic(path, yaml.safe_dump(data, sort_keys=False))


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> Path:
    """A hardware profile as YAML (the strict schema's text form)."""
    return write_atomic(path, dumps_profile(profile))
