"""Hardware profiles read without PyYAML the second time: each profile text's parsed YAML document, kept as JSON.

Importing PyYAML and parsing one profile cost `vramplan plan` 11 ms of its 0.2 s (bench/startup.py). A profile is
read far more often than it changes, so the parsed document is cached by the SHA-256 of the file's text:
    $VRAMPLAN_CACHE_DIR (else ~/.cache/vramplan)/profile-documents/vramplan-profile-{sha256}.json
holding {"format", "sha256", "document"}. An entry is used only when all of these hold, else it is passed over (the
YAML is parsed, and the entry replaced):
- its directory and the entry itself belong to this user and no one else may write them (a cache directory shared
  with others, or one a project's files live in, cannot plant a profile: a GPU with 1000 GiB);
- the entry is a regular file, opened without following a symlink or waiting on a FIFO;
- it is JSON of this format, and the SHA-256 it holds is the text's (an entry copied to another name is refused);
- its document passes planner.profile_yaml.profile_from_dict, the check a fresh parse gets (an entry that fails it
  was not written by this code: the YAML file is parsed, and only its own faults are reported).
A changed text is a new digest, never a stale entry. Only a document that JSON holds exactly is cached (string keys;
strings, integers, finite floats, booleans and nulls); YAML that is not valid, or not a valid profile, is never
cached, and says so every time. Pruning removes only entries this code wrote: the name's pattern, and content of this
format whose digest is the name's; any other file in the directory is left alone.
Any cache that cannot be read or written is passed over: the YAML is parsed, as without a cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from vramplan.planner.errors import ProfileError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.profile_yaml import parse_profile_text, profile_from_dict, read_profile_text

from .files import CacheDirError, cache_dir

# Written into every entry; an entry of another format is parsed again and replaced.
FORMAT = 2
# The entries' directory under cache_dir(), made private (PRIVATE_DIR_MODE); a directory of another name than the
# first format's `profiles/`, which was made with the umask's mode (group-writable under a umask of 002).
ENTRY_DIR = "profile-documents"
ENTRY_PREFIX = "vramplan-profile-"
ENTRY_SUFFIX = ".json"
ENTRY_NAME = re.compile(re.escape(ENTRY_PREFIX) + r"([0-9a-f]{64})" + re.escape(ENTRY_SUFFIX))
PRIVATE_DIR_MODE = 0o700
# Permission bits an entry or its directory must not have: with them another user could plant an entry.
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
# An entry is opened without following a symlink at its name and without waiting for a FIFO's writer.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
# Entries kept: a write past this many removes the least recently written (each quick probe of this machine is a new
# text, so the directory would otherwise grow by one small file per probe).
MAX_ENTRIES = 64


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def entry_path(text: str) -> Path:
    """Where the parsed document of a profile's text is cached (CacheDirError when there is no cache directory)."""
    return _entry_for(text_digest(text))


def _entry_for(digest: str) -> Path:
    return cache_dir() / ENTRY_DIR / f"{ENTRY_PREFIX}{digest}{ENTRY_SUFFIX}"


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """planner.profile_yaml.load_profile, with the parsed document cached: the same profile, or the same one-line
    ProfileError."""
    origin = str(Path(path))
    text = read_profile_text(path)
    digest = text_digest(text)
    entry = _usable_entry(digest)
    if entry is not None:
        profile = _cached_profile(entry, digest, origin)
        if profile is not None:
            return profile
    doc = parse_profile_text(text, origin)
    profile = profile_from_dict(doc, origin=origin)  # a document that is no profile is refused first, never cached
    if entry is not None and _exact_in_json(doc):
        _write(entry, doc, digest)
    return profile


def _usable_entry(digest: str) -> Path | None:
    """The entry for the text of `digest` when its directory may be used (a missing one is made private by the first
    write), else None."""
    if not hasattr(os, "geteuid"):  # no owners to check (Windows): no cache
        return None
    try:
        entry = _entry_for(digest)
        st = os.lstat(entry.parent)
    except FileNotFoundError:
        return entry
    except (CacheDirError, OSError):
        return None
    return entry if stat.S_ISDIR(st.st_mode) and private(st) else None


def private(st: os.stat_result) -> bool:
    """Owned by this user, and no one else may write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & OTHERS_WRITE


def _cached_profile(entry: Path, digest: str, origin: str) -> HardwareProfile | None:
    doc = _read(entry, digest)
    if doc is None:
        return None
    try:
        return profile_from_dict(doc, origin=origin)
    except ProfileError:  # not a document this code cached (a fresh parse was checked before it was written)
        return None


def _read(entry: Path, digest: str) -> Any:
    """The document an entry holds for the text of `digest`; None when the entry is missing, not this user's private
    regular file, not JSON of this format, or for another text."""
    text = _read_private(entry)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("sha256") != digest:
        return None
    return data.get("document")


def _read_private(entry: Path) -> str | None:
    """An entry's text when it is a regular file of this user's that no one else may write, else None. Checked before
    opening (opening a device can have effects) and on the open file (what was checked may have been swapped); the
    open neither follows a symlink nor waits for a FIFO's writer."""
    try:
        if not stat.S_ISREG(os.lstat(entry).st_mode):
            return None
        fd = os.open(entry, READ_FLAGS)
        with open(fd, encoding="utf-8") as f:
            st = os.fstat(fd)
            return f.read() if stat.S_ISREG(st.st_mode) and private(st) else None
    except (OSError, UnicodeDecodeError):
        return None


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


def _write(entry: Path, doc: Any, digest: str) -> None:
    """Atomically (a private temporary file renamed over the entry), and quietly: a cache that cannot be written is no
    reason to fail a plan. Not synced to disk: an entry cut short by a crash is no JSON, and is parsed again."""
    tmp = None
    try:
        entry.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent)  # mode 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps({"format": FORMAT, "sha256": digest, "document": doc}))
        os.replace(tmp, entry)
        tmp = None
        _prune(entry.parent)
    except OSError:
        pass
    finally:
        if tmp is not None:
            _remove(Path(tmp))


def _prune(directory: Path) -> None:
    """Beyond MAX_ENTRIES of this code's entries, remove the least recently written; nothing else is touched."""
    named = [p for p in directory.iterdir() if ENTRY_NAME.fullmatch(p.name)]
    if len(named) <= MAX_ENTRIES:
        return
    ours = sorted((mtime, p) for p in named if (mtime := _entry_mtime(p)) is not None)
    for _mtime, old in ours[:max(0, len(ours) - MAX_ENTRIES)]:
        _remove(old)


def _entry_mtime(path: Path) -> int | None:
    """When an entry this code wrote was written; None for anything else of such a name (a user's file, a link)."""
    match = ENTRY_NAME.fullmatch(path.name)
    if match is None or _read(path, match.group(1)) is None:
        return None
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return None


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
