"""This machine's hardware profile for plans made without --hardware: a quick probe, cached.

The quick probe (NVML and psutil, a short RAM copy; no torch) takes about a second, so its
result is cached per machine in `cache_dir()`:
  $VRAMPLAN_CACHE_DIR, else $XDG_CACHE_HOME/vramplan, else ~/.cache/vramplan,
as `this-machine-<hostname>-<hash of the hardware identity>.yaml`. A changed machine (other GPUs,
RAM, cgroup limit, CUDA_VISIBLE_DEVICES, CPU count) gets a fresh probe; `vramplan probe` and
`vramplan probe --quick` refresh the cache. A probe taken while other processes kept the CPUs
busy says so in its notes (the RAM bandwidth it measured is then low), and `plan` warns about it.

A cached probe is measured again (quietly, about a second) when it is older than
PROBE_CACHE_MAX_AGE_S ($VRAMPLAN_PROBE_MAX_AGE_DAYS overrides), or when it was taken while the
machine was busy (once it is BUSY_PROBE_RETRY_S old), or when it is dated in the future (beyond
CLOCK_SKEW_ALLOWANCE_S: it would never grow old); `this_machine()` says which, and when the cache
could not be written (also when no cache directory can be named: runtime.files.CacheDirError).
`differences(profile, here)` says how a profile's hardware differs from this machine's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from vramplan.planner.errors import ProfileError, VramplanError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.units import format_bytes

from .files import CacheDirError, WriteError, cache_dir, save_profile
from .probe.host import BUSY_NOTE_PREFIX, machine_fingerprint
from .yaml_cache import OTHERS_WRITE, load_profile, private

SECONDS_PER_DAY = 86400
# How long a cached quick probe stands before it is measured again: the hardware identity in the file name catches a
# changed machine, not a changed BIOS setting, memory clock or driver, and a probe costs about a second.
PROBE_CACHE_MAX_AGE_S = 7 * SECONDS_PER_DAY
PROBE_MAX_AGE_ENV = "VRAMPLAN_PROBE_MAX_AGE_DAYS"
# A probe taken while the machine was busy is taken again once it is this old: on a machine that stays busy (a shared
# CI runner, the 2-core dev VM) probing on every plan would cost each one a second and add to the load it measures.
BUSY_PROBE_RETRY_S = 15 * 60
# How far a cached probe's time may lie in the future and still count as now (a network file system's server and this
# machine disagree by seconds); one dated further ahead was written under a wrong clock, and is measured again: its
# age would otherwise stay negative until the clock caught up, and it would never expire.
CLOCK_SKEW_ALLOWANCE_S = 5 * 60
# How far a profile's GPU memory and host RAM may differ from this machine's and still be this machine: the RAM the
# kernel and firmware reserve changes by a percent or two between kernels and boots; another machine type differs by
# far more (and a cgroup limit that moved is a different machine for planning).
SAME_MACHINE_MEMORY_TOLERANCE = 0.05
# What every probe since it took the CPU's fp32 and int8 matmul figures (host.cpu_fp32_compute, cpu_int8_compute) says
# of the fp32 one, measured, estimated or neither (runtime.probe.core): a cached probe without such a note is older
CPU_FP32_NOTE_PREFIX = "CPU fp32 "


def cache_path() -> Path:
    """Where this machine's quick-probe profile is cached: hostname + hash of the hardware identity (CacheDirError when
    there is no cache directory)."""
    digest = hashlib.sha256(json.dumps(machine_fingerprint(), sort_keys=True).encode()).hexdigest()[:16]
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"
    return cache_dir() / f"this-machine-{host}-{digest}.yaml"


def cached_profile() -> tuple[HardwareProfile, Path] | None:
    """The cached profile of this machine and its file; None when there is no cache directory, no file, one that is not
    this user's private regular file (a shared cache directory: anyone could plant one), or it no longer loads."""
    try:
        path = cache_path()
    except CacheDirError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or not private(st):  # another user's, or one anyone may write: probe again
        return None
    try:
        return load_profile(path), path
    except ProfileError:
        return None  # from another vramplan version: probe again


def store(profile: HardwareProfile) -> Path | None:
    """Make `profile` this machine's cached one (named "this-machine"); None when the cache cannot be written."""
    return store_or_why(profile)[0]


def store_or_why(profile: HardwareProfile) -> tuple[Path | None, str | None]:
    """(the cache file, None), or (None, why it could not be written): a read-only home is no reason to fail a plan.
    The file is left writable by this user alone (`cached_profile` reads no other), whatever the umask."""
    try:
        path = save_profile(profile.replace(name="this-machine"), cache_path())
    except (WriteError, CacheDirError) as e:
        return None, str(e)
    try:
        path.chmod(path.stat().st_mode & ~OTHERS_WRITE & 0o7777)
    except OSError as e:
        return None, f"{path}: cannot make it private ({e.strerror or e})"
    return path, None


def env_number(name: str, default: float, *, unit: str, allow_zero: bool, allow_infinite: bool = False) -> float:
    """$name as a number (of `unit`), or `default` when it is unset or empty; one line (VramplanError) when it is no
    number, negative, zero where zero is not allowed, or infinite where that is not allowed."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or (math.isinf(value) and not allow_infinite) or not (value >= 0 if allow_zero else value > 0):
        raise VramplanError(f"${name}={text!r}: expected a number of {unit} {'>=' if allow_zero else '>'} 0")
    return value


def probe_max_age_s() -> float:
    """PROBE_CACHE_MAX_AGE_S, or $VRAMPLAN_PROBE_MAX_AGE_DAYS (a number of days, 0: always probe)."""
    days = env_number(PROBE_MAX_AGE_ENV, PROBE_CACHE_MAX_AGE_S / SECONDS_PER_DAY, unit="days", allow_zero=True,
                      allow_infinite=True)  # inf: never measured again
    return days * SECONDS_PER_DAY


@dataclass(frozen=True, kw_only=True)
class ThisMachine:
    """This machine's quick-probe profile and how it was come by."""

    profile: HardwareProfile
    cache_file: Path | None  # where it is cached; None when the cache could not be written
    probed_now: bool  # measured by this call (no usable cache, a stale or busy one, or asked to)
    why_probed: str | None = None  # why a cached probe was not used ("... days old", "taken while busy")
    why_not_cached: str | None = None  # the write error, when cache_file is None


def this_machine(refresh: bool = False) -> ThisMachine:
    """The cached quick probe when it is young and was taken on an idle machine; else a new one, cached if possible."""
    why = None
    found = None if refresh else cached_profile()
    if found is not None:
        cached, path = found
        why = stale_reason(cached, path)
        if why is None:
            return ThisMachine(profile=cached, cache_file=path, probed_now=False)
    from .probe import probe

    profile = probe(quick=True).profile
    saved, unsaved = store_or_why(profile)
    return ThisMachine(profile=profile, cache_file=saved, probed_now=True, why_probed=why, why_not_cached=unsaved)


def stale_reason(cached: HardwareProfile, path: Path) -> str | None:
    """Why a cached probe should be measured again (too old, or taken under load), or None."""
    try:
        age_s = time.time() - path.stat().st_mtime
    except OSError:
        return "the cached one vanished"
    if age_s < -CLOCK_SKEW_ALLOWANCE_S:
        return f"the cached one is dated {_duration(-age_s)} in the future (a clock was wrong)"
    limit_s = probe_max_age_s()
    if age_s > limit_s:
        return (f"the cached one was {age_s / SECONDS_PER_DAY:.1f} days old (limit {limit_s / SECONDS_PER_DAY:g} "
                f"days, ${PROBE_MAX_AGE_ENV})")
    if not any(n.startswith(CPU_FP32_NOTE_PREFIX) for n in cached.notes):
        return "the cached one predates the CPU's fp32 and int8 matmul figures, which the CPU prefill is priced with"
    if busy_note(cached) is not None and age_s > BUSY_PROBE_RETRY_S:
        return (f"the cached one was taken while the machine was busy, {age_s / 60:.0f} min ago (retried after "
                f"{BUSY_PROBE_RETRY_S / 60:g} min)")
    return None


def _duration(seconds: float) -> str:
    """Seconds in words: minutes below a day, else days."""
    if seconds < SECONDS_PER_DAY:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / SECONDS_PER_DAY:.1f} days"


def this_machine_inventory() -> HardwareProfile:
    """What this machine has (its GPUs, its RAM), for a check before a run: the cached quick probe, of any age, or a
    quick probe without its timed CPU sample, not cached (on a CPU with AVX512-BF16 or AMX the sample imports torch)."""
    found = cached_profile()
    if found is not None:
        return found[0]
    from .probe import probe

    return probe(quick=True, sample_cpu=False).profile


def this_machine_profile(refresh: bool = False) -> HardwareProfile:
    """This machine's profile: the cached quick probe, or a new one (cached) when there is none, it is stale, or
    `refresh`."""
    return this_machine(refresh).profile


def busy_note(profile: HardwareProfile) -> str | None:
    """The note a probe leaves when other processes kept the CPUs busy while it measured, if any."""
    return next((n for n in profile.notes if n.startswith(BUSY_NOTE_PREFIX)), None)


def differences(profile: HardwareProfile, here: HardwareProfile) -> list[str]:
    """How `profile`'s hardware differs from `here` (this machine's probe): GPUs (name, count, memory), host RAM and
    cores; empty when it describes this machine."""
    from .probe.datasheets import norm_gpu_name

    def gpus(p: HardwareProfile) -> str:
        return ", ".join(f"{g.count}x {g.name} {format_bytes(g.memory_bytes)}" for g in p.gpus) or "no GPU"

    def close(a: int, b: int) -> bool:
        return abs(a - b) <= SAME_MACHINE_MEMORY_TOLERANCE * max(a, b)

    found = []
    theirs = sorted(profile.gpus, key=lambda g: norm_gpu_name(g.name))
    ours = sorted(here.gpus, key=lambda g: norm_gpu_name(g.name))
    if len(theirs) != len(ours) or any(
            norm_gpu_name(a.name) != norm_gpu_name(b.name) or a.count != b.count
            or not close(a.memory_bytes, b.memory_bytes) for a, b in zip(theirs, ours)):
        found.append(f"GPUs {gpus(profile)} (this machine: {gpus(here)})")
    if not close(profile.host.ram_bytes, here.host.ram_bytes):
        found.append(f"RAM {format_bytes(profile.host.ram_bytes)} (this machine: {format_bytes(here.host.ram_bytes)})")
    if profile.host.cpu_cores != here.host.cpu_cores:
        found.append(f"{profile.host.cpu_cores} CPU cores (this machine: {here.host.cpu_cores})")
    return found


def beyond_this_machine(profile: HardwareProfile, here: HardwareProfile) -> list[str]:
    """What `profile` has that this machine (`here`, its probe) does not: a GPU it lacks (by name), more of one, more
    memory on one, or more RAM (each beyond SAME_MACHINE_MEMORY_TOLERANCE); empty when the profile is within this
    machine. Less is allowed (a CPU-only profile on a GPU machine, a smaller RAM): a run then plans with less than is
    here, never with more."""
    from .probe.datasheets import norm_gpu_name

    def gpus(p: HardwareProfile) -> str:
        return ", ".join(f"{g.count}x {g.name} {format_bytes(g.memory_bytes)}" for g in p.gpus) or "no GPU"

    def over(a: int, b: int) -> bool:
        return a > b * (1 + SAME_MACHINE_MEMORY_TOLERANCE)

    ours = {norm_gpu_name(g.name): g for g in here.gpus}
    found = [f"{g.count}x {g.name} {format_bytes(g.memory_bytes)} (this machine: {gpus(here)})" for g in profile.gpus
             if (mine := ours.get(norm_gpu_name(g.name))) is None or g.count > mine.count
             or over(g.memory_bytes, mine.memory_bytes)]
    if over(profile.host.ram_bytes, here.host.ram_bytes):
        found.append(f"RAM {format_bytes(profile.host.ram_bytes)} (this machine: {format_bytes(here.host.ram_bytes)})")
    return found
