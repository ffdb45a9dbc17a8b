"""Finding hardware profiles by name or path, and this machine's cached quick probe.

Search order for a name (first hit wins, case-insensitive NAME.yaml / NAME.yml):
  1. the directories in $VRAMPLAN_PROFILES (os.pathsep-separated, ':' on POSIX)
  2. the user's profile directory: $VRAMPLAN_CONFIG_DIR/profiles if that variable is set,
     else $XDG_CONFIG_HOME/vramplan/profiles, else ~/.config/vramplan/profiles
  3. the shipped profiles/ package directory

File I/O only; no torch. `this_machine_profile` imports runtime.probe lazily, whose
quick path reads NVML and psutil and never imports torch.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import NamedTuple

from .errors import ProfileError
from .hardware import HardwareProfile, load_profile, save_profile

PROFILE_SUFFIXES = (".yaml", ".yml")


class ProfileEntry(NamedTuple):
    name: str
    path: Path
    origin: str  # "$VRAMPLAN_PROFILES", "user", "shipped"
    profile: HardwareProfile | ProfileError  # the loaded profile, or why it does not load


def shipped_profiles_dir() -> Path:
    import profiles  # the package that holds the shipped YAML files

    return Path(profiles.__file__).resolve().parent


def user_profiles_dir() -> Path:
    if os.environ.get("VRAMPLAN_CONFIG_DIR"):
        return Path(os.environ["VRAMPLAN_CONFIG_DIR"]).expanduser() / "profiles"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "vramplan" / "profiles"


def search_dirs() -> list[tuple[Path, str]]:
    """The profile directories in lookup order, each with a label saying where it came from."""
    dirs: list[tuple[Path, str]] = []
    for part in os.environ.get("VRAMPLAN_PROFILES", "").split(os.pathsep):
        if part.strip():
            dirs.append((Path(part.strip()).expanduser(), "$VRAMPLAN_PROFILES"))
    dirs.append((user_profiles_dir(), "user"))
    dirs.append((shipped_profiles_dir(), "shipped"))
    return dirs


def _profile_files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.suffix.lower() in PROFILE_SUFFIXES and p.is_file())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.lower().endswith(PROFILE_SUFFIXES)


def resolve_profile(name_or_path: str | os.PathLike[str]) -> tuple[HardwareProfile, Path]:
    """A profile from an existing path, else by name from the search directories."""
    text = os.fspath(name_or_path)
    candidate = Path(text).expanduser()
    if candidate.is_file():
        return load_profile(candidate), candidate
    if candidate.is_dir():
        raise ProfileError(f"{text}: is a directory, not a hardware profile file")
    if _looks_like_path(text):
        raise ProfileError(f"{text}: no such profile file")
    wanted = text.strip().lower()
    dirs = search_dirs()
    for directory, _origin in dirs:
        for f in _profile_files(directory):
            if f.stem.lower() == wanted:
                return load_profile(f), f
    known = sorted({f.stem for d, _o in dirs for f in _profile_files(d)})
    close = difflib.get_close_matches(wanted, [k.lower() for k in known], n=4, cutoff=0.5)
    by_lower = {k.lower(): k for k in known}
    close_names = [by_lower[c] for c in close]
    hint = f"; did you mean: {', '.join(close_names)}?" if close_names else ""
    where = "; ".join(f"{d} ({o})" for d, o in dirs)
    raise ProfileError(
        f'unknown hardware profile "{text}"{hint} Looked in: {where}. '
        "See `vramplan profiles list`, or pass a YAML path."
    )


def list_profiles() -> list[ProfileEntry]:
    """Every profile visible by name, sorted by name; earlier directories shadow later ones."""
    seen: dict[str, ProfileEntry] = {}
    for directory, origin in search_dirs():
        for f in _profile_files(directory):
            key = f.stem.lower()
            if key in seen:
                continue
            try:
                prof: HardwareProfile | ProfileError = load_profile(f)
            except ProfileError as e:
                prof = e
            seen[key] = ProfileEntry(f.stem, f, origin, prof)
    return sorted(seen.values(), key=lambda e: e.name.lower())


# ---------------------------------------------------------------- this machine (cached quick probe)


def cache_dir() -> Path:
    if os.environ.get("VRAMPLAN_CACHE_DIR"):
        return Path(os.environ["VRAMPLAN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vramplan"


def this_machine_cache_path() -> Path:
    """Where this machine's quick-probe profile is cached: hostname + hash of the hardware identity."""
    from runtime.probe import machine_fingerprint  # lazy; no torch on this path

    fingerprint = machine_fingerprint()
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"
    return cache_dir() / f"this-machine-{host}-{digest}.yaml"


def this_machine_profile(refresh: bool = False) -> HardwareProfile:
    """This machine's profile from the quick probe, cached per machine so `plan` stays fast.

    The cache key is the hostname plus a hash of what identifies the hardware (GPU names,
    UUIDs and memory, CUDA_VISIBLE_DEVICES, RAM total, cgroup limit, CPU count): a changed
    machine gets a fresh probe. `refresh=True` re-probes and rewrites the cache.
    """
    path = this_machine_cache_path()
    if not refresh and path.is_file():
        try:
            return load_profile(path)
        except ProfileError:
            pass  # stale or from another vramplan version: probe again
    from runtime.probe import probe

    profile = probe(quick=True).profile
    try:
        save_profile(profile, path)
    except OSError:
        pass  # a read-only home is no reason to fail a plan
    return profile
