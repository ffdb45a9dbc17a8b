"""This machine's hardware profile for plans made without --hardware: a quick probe, cached.

The quick probe (NVML and psutil, a short RAM copy; no torch) takes about a second, so its
result is cached per machine in `cache_dir()`:
  $VRAMPLAN_CACHE_DIR, else $XDG_CACHE_HOME/vramplan, else ~/.cache/vramplan,
as `this-machine-<hostname>-<hash of the hardware identity>.yaml`. A changed machine (other GPUs,
RAM, cgroup limit, CUDA_VISIBLE_DEVICES, CPU count) gets a fresh probe; `vramplan probe` and
`vramplan probe --quick` refresh the cache. A probe taken while other processes kept the CPUs
busy says so in its notes (the RAM bandwidth it measured is then low), and `plan` warns about it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

from planner.errors import ProfileError
from planner.hardware import HardwareProfile
from planner.profile_yaml import load_profile

from .files import WriteError, save_profile
from .probe.host import BUSY_NOTE_PREFIX, machine_fingerprint


def cache_dir() -> Path:
    if os.environ.get("VRAMPLAN_CACHE_DIR"):
        return Path(os.environ["VRAMPLAN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vramplan"


def cache_path() -> Path:
    """Where this machine's quick-probe profile is cached: hostname + hash of the hardware identity."""
    digest = hashlib.sha256(json.dumps(machine_fingerprint(), sort_keys=True).encode()).hexdigest()[:16]
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"
    return cache_dir() / f"this-machine-{host}-{digest}.yaml"


def cached_profile() -> HardwareProfile | None:
    """The cached profile of this machine, or None when there is none (or it no longer loads)."""
    path = cache_path()
    if not path.is_file():
        return None
    try:
        return load_profile(path)
    except ProfileError:
        return None  # from another vramplan version: probe again


def store(profile: HardwareProfile) -> Path | None:
    """Make `profile` this machine's cached one (named "this-machine"); None when the cache cannot be written."""
    try:
        return save_profile(profile.replace(name="this-machine"), cache_path())
    except WriteError:
        return None  # a read-only home is no reason to fail a plan


def this_machine_profile(refresh: bool = False) -> HardwareProfile:
    """This machine's profile: the cached quick probe, or a new one (cached) when there is none or `refresh`."""
    if not refresh:
        cached = cached_profile()
        if cached is not None:
            return cached
    from .probe import probe

    profile = probe(quick=True).profile
    store(profile)
    return profile


def busy_note(profile: HardwareProfile) -> str | None:
    """The note a probe leaves when other processes kept the CPUs busy while it measured, if any."""
    return next((n for n in profile.notes if n.startswith(BUSY_NOTE_PREFIX)), None)
