"""Hardware profiles read without PyYAML the second time: each profile text's parsed YAML document, kept as JSON.

Importing PyYAML and parsing one profile cost `vramplan plan` 11 ms of its 0.2 s (bench/startup.py). A profile is
read far more often than it changes, so the parsed document is cached by the SHA-256 of the file's text:
    $VRAMPLAN_CACHE_DIR (else ~/.cache/vramplan)/profiles/{digest}.json
What is cached is the document, not the profile: every read checks it with planner.profile_yaml.profile_from_dict,
exactly as a fresh parse is checked, so an error in a profile reads the same whether or not it was cached. A changed
text is a new digest, never a stale entry. Only a document that JSON holds exactly is cached (string keys; strings,
integers, finite floats, booleans and nulls); YAML that is not valid, or not a valid profile, is never cached,
and says so every time.
Any cache that cannot be read or written is passed over: the YAML is parsed, as without a cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from vramplan.planner.errors import VramplanError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.profile_yaml import parse_profile_text, profile_from_dict, read_profile_text

from .files import cache_dir, write_atomic

# Written into every entry; an entry of another format is parsed again and replaced.
FORMAT = 1
# Entries kept: a write past this many removes the least recently written (each quick probe of this machine is a new
# text, so the directory would otherwise grow by one small file per probe).
MAX_ENTRIES = 64


def entry_path(text: str) -> Path:
    return cache_dir() / "profiles" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """planner.profile_yaml.load_profile, with the parsed document cached: the same profile, or the same one-line
    ProfileError."""
    origin = str(Path(path))
    text = read_profile_text(path)
    try:
        entry = entry_path(text)
    except (RuntimeError, OSError):  # no cache directory to be had (no home directory): parse, as without a cache
        entry = None
    doc = _read(entry) if entry is not None else None
    if doc is not None:
        return profile_from_dict(doc, origin=origin)
    doc = parse_profile_text(text, origin)
    profile = profile_from_dict(doc, origin=origin)  # a document that is no profile is refused first, never cached
    if entry is not None and _exact_in_json(doc):
        _write(entry, doc)
    return profile


def _read(entry: Path) -> Any:
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "document" not in data:
        return None
    return data["document"]


def _exact_in_json(doc: Any) -> bool:
    try:
        return _plain(doc)
    except RecursionError:  # YAML's aliases can make a list that holds itself
        return False


def _plain(doc: Any) -> bool:
    if isinstance(doc, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in doc.items())
    if isinstance(doc, list):
        return all(_plain(v) for v in doc)
    if isinstance(doc, float):
        return math.isfinite(doc)
    return doc is None or isinstance(doc, (str, int, bool))


def _write(entry: Path, doc: Any) -> None:
    """Atomically (runtime.files), and quietly: a cache that cannot be written is no reason to fail a plan."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(entry, json.dumps({"format": FORMAT, "document": doc}))
        _prune(entry.parent)
    except (OSError, VramplanError):
        pass


def _prune(directory: Path) -> None:
    entries = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for old in entries[:max(0, len(entries) - MAX_ENTRIES)]:
        old.unlink(missing_ok=True)
