"""The host: RAM, cores, clocks and cgroup limits (psutil, /proc, cgroups), and its identity."""

from __future__ import annotations

import math
import os
import platform
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramplan.planner.hardware import SCHEMA_VERSION
from vramplan.planner.units import format_flops
from .nvml import NvmlUnavailable, read_nvml

# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX rounded to pages).
CGROUP_UNLIMITED_THRESHOLD = 1 << 60

# Estimated bf16 matmul FLOP per cycle per core that a CPU *achieves* (not peak), by the best
# instruction set it has. avx512_bf16 is calibrated on an AMD EPYC (Zen 4) VM: 2 cores at
# 2.6 GHz measured 150-420 GFLOPS (noisy VM) with torch 2.13, median ~200 (~40/cycle/core).
# amx_bf16: what torch reaches, not the tiles' 1024/cycle peak: on a 2-core AMX Xeon VM (issue 40) the full probe
# measured 0.28 TFLOPS and a plain torch.mm 0.57 at about 2.1 GHz, 67-137/cycle/core (384 had said 1.6 TFLOPS); the
# quick probe samples a matmul there when torch is installed (runtime.probe.core._quick_bf16_sample).
CPU_BF16_FLOP_PER_CYCLE: tuple[tuple[str, float, str], ...] = (
    ("amx_bf16", 67.0, "Intel AMX bf16 tiles, as torch's kernels reach them"),
    ("avx512_bf16", 40.0, "AVX-512 BF16 (vdpbf16ps)"),
    ("avx512f", 16.0, "AVX-512 via fp32 conversion"),
    ("avx2", 10.0, "AVX2/FMA via fp32 conversion"),
    ("sve", 24.0, "ARM SVE"),
    ("bf16", 16.0, "ARM NEON BF16 (bfmmla)"),
    ("asimd", 8.0, "ARM NEON"),
)
CPU_BF16_FLOP_PER_CYCLE_FALLBACK = 4.0
# fp32 and int8 matmuls (the kernels a CPU prefill runs where bf16 is converted in software, and quanto-w8a8's): FLOP
# (int8: ops) per cycle per core, by the vector width and two FMA / dot-product units. Checked on the 2-core Xeon dev VM
# (AVX-512 with VNNI, 2.30 GHz by psutil): torch fp32 312 GFLOP/s measured (64 here gives 294), torch._int_mm 1216
# GOP/s (256 gives 1178); the other rows follow from their widths, unmeasured. No row: not estimated (the planner
# then prices those matmuls against the bf16 figure).
CPU_FP32_FLOP_PER_CYCLE: tuple[tuple[str, float, str], ...] = (
    ("avx512f", 64.0, "AVX-512 FMA (2 units)"),
    ("fma", 32.0, "AVX2 FMA (2 units)"),
    ("asimd", 16.0, "ARM NEON FMA"),
)
# where these are, bf16 matmuls are native and vramplan's CPU path keeps them (no fp32 estimate: the planner would take
# it for the faster)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPU_INT8_OPS_PER_CYCLE: tuple[tuple[str, float, str], ...] = (
    ("avx512_vnni", 256.0, "AVX-512 VNNI (vpdpbusd, 2 units)"),
)
DEFAULT_CPU_GHZ = 2.5
# An x86 CPU without int8 dot-product instructions multiplies int8 by int8 (quanto-w8a8's kernel) by fbgemm's AVX2
# path (runtime.cpu_paths: vpmaddubsw), not by torch._int_mm, which is far slower there: on the 2-core AVX2 EPYC VM
# (2026-11-29) one row by 64 MiB of int8 weights streamed 13.5 GB/s by fbgemm (median of 4 probes: 13.5 / 13.1 / 13.5 /
# 15.1) and 2.1 by _int_mm, with RAM copying at 34.1 (the full probe's). The quick probe (no torch) estimates that
# kernel's rate at this share of the RAM bandwidth there, and records the fbgemm path; `vramplan probe` times both.
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
NO_INT8_DOT_DYNAMIC_RAM_SHARE = 13.5 / 34.1
# cpu-w4a8's kernel (runtime.cpu_kernel: AVX2 vpmaddubsw, built with the machine's C compiler) streamed one row by 68
# MiB of its int4 weights at 12.4 GB/s on the same VM (the full probe, 2026-11-29; bench/cpu_int4_kernel.py's runs
# 11.5-12.3), the full probe's RAM copy at 30.1-34.1 there: the quick probe estimates it at this share of the RAM
# bandwidth on an x86 CPU with AVX2 and FMA where a C compiler is found (the kernel is built at its first use).
W4A8_RAM_SHARE = 12.4 / 32.0
W4A8_FLAGS = frozenset({"avx2", "fma"})


def c_compiler() -> str | None:
    """The C compiler cpu-w4a8's kernel is built with: $CC, else cc, else gcc; None when there is none."""
    import shutil

    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

@dataclass(frozen=True)
class HostReading:
    hostname: str
    system: str  # "Linux", "Darwin", "Windows"
    machine: str  # "x86_64", "arm64"
    cpu_model: str | None
    cpu_flags: tuple[str, ...]  # the flags relevant to matmul speed only
    logical_cores: int
    physical_cores: int | None
    affinity_cores: int | None  # CPUs this process may run on
    cgroup_cpu_limit: float | None  # CPUs worth of quota, None = no limit
    cpu_max_mhz: float | None
    cpu_mhz_source: str
    ram_total_bytes: int
    ram_available_bytes: int | None
    cgroup_memory_limit_bytes: int | None
    cgroup_memory_usage_bytes: int | None
    cgroup_memory_source: str | None

    @property
    def effective_ram_bytes(self) -> int:
        """RAM this process can have: the smaller of physical RAM and the cgroup limit."""
        if self.cgroup_memory_limit_bytes is not None:
            return min(self.ram_total_bytes, self.cgroup_memory_limit_bytes)
        return self.ram_total_bytes

    @property
    def effective_cores(self) -> int:
        """Cores a matmul can use: physical cores, capped by affinity and the cgroup quota."""
        n = self.physical_cores or self.logical_cores
        if self.affinity_cores:
            n = min(n, self.affinity_cores)
        if self.cgroup_cpu_limit:
            n = min(n, max(1, math.floor(self.cgroup_cpu_limit)))
        return max(1, n)


# ---------------------------------------------------------------- host: psutil, /proc, cgroups


def parse_cgroup_memory_value(text: str) -> int | None:
    """A cgroup memory limit file's content -> bytes, or None for "no limit"."""
    t = text.strip()
    if not t or t == "max" or t == "-1":
        return None
    try:
        v = int(t)
    except ValueError:
        return None
    if v <= 0 or v >= CGROUP_UNLIMITED_THRESHOLD:
        return None
    return v


def parse_cgroup_cpu_max(text: str) -> float | None:
    """cgroup v2 cpu.max ("max 100000" or "200000 100000") -> CPUs, None = no limit."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_proc_self_cgroup(text: str) -> tuple[str | None, dict[str, str]]:
    """/proc/self/cgroup -> (v2 path, {v1 controller: path})."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        else:
            for c in controllers.split(","):
                if c:
                    v1[c] = path
    return v2, v1


def _ancestors(base: Path, rel: str | None) -> list[Path]:
    """base/rel, then its parents up to base (a parent's limit applies to its children too)."""
    dirs = [base]
    if rel and rel.strip("/"):
        parts = [p for p in rel.strip("/").split("/") if p]
        for i in range(1, len(parts) + 1):
            dirs.append(base.joinpath(*parts[:i]))
    return list(reversed(dirs))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def read_cgroup_memory(root: Path = Path("/sys/fs/cgroup"),
                       proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int | None, int | None, str | None]:
    """(limit bytes, usage bytes, file) of the tightest cgroup memory limit, v2 or v1; Nones if none."""
    v2, v1 = parse_proc_self_cgroup(_read(proc_self_cgroup) or "")
    candidates: list[tuple[Path, str]] = []  # (limit file, usage file name)
    for d in _ancestors(root, v2):
        candidates.append((d / "memory.max", "memory.current"))
    for d in _ancestors(root / "memory", v1.get("memory")):
        candidates.append((d / "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best: tuple[int, Path, str] | None = None
    for f, usage_name in candidates:
        text = _read(f)
        if text is None:
            continue
        limit = parse_cgroup_memory_value(text)
        if limit is not None and (best is None or limit < best[0]):
            best = (limit, f, usage_name)
    if best is None:
        return None, None, None
    limit, f, usage_name = best
    usage_text = _read(f.parent / usage_name)
    usage = None
    if usage_text is not None:
        try:
            usage = int(usage_text.strip())
        except ValueError:
            usage = None
    return limit, usage, str(f)


def read_cgroup_cpu(root: Path = Path("/sys/fs/cgroup"),
                    proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota, in CPUs (v2 cpu.max or v1 cfs quota/period), None if none."""
    v2, v1 = parse_proc_self_cgroup(_read(proc_self_cgroup) or "")
    limits: list[float] = []
    for d in _ancestors(root, v2):
        text = _read(d / "cpu.max")
        if text is not None and (v := parse_cgroup_cpu_max(text)) is not None:
            limits.append(v)
    for base in (root / "cpu", root / "cpu,cpuacct"):
        for d in _ancestors(base, v1.get("cpu")):
            q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            if q is not None and p is not None and (v := parse_cgroup_cpu_max(f"{q.strip()} {p.strip()}")) is not None:
                limits.append(v)
    return min(limits) if limits else None


_RELEVANT_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni",
                   "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm"}


def parse_cpuinfo(text: str) -> tuple[str | None, tuple[str, ...], float | None]:
    """/proc/cpuinfo -> (model name, relevant flags, MHz of the first CPU)."""
    model = mhz = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        value = value.strip()
        if model is None and key in ("model name", "cpu model", "hardware"):
            model = value or None
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key == "cpu mhz" and mhz is None:
            try:
                mhz = float(value)
            except ValueError:
                pass
    return model, tuple(sorted(flags & _RELEVANT_FLAGS)), mhz


def _darwin_sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def read_host(
    *,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_self_cgroup: Path = Path("/proc/self/cgroup"),
    cpuinfo: Path = Path("/proc/cpuinfo"),
) -> HostReading:
    """RAM, cores, clock and cgroup limits of this host (psutil, with os fallbacks)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        psutil = None  # type: ignore[assignment]

    system, machine = platform.system(), platform.machine()
    logical = os.cpu_count() or 1
    physical = None
    ram_total = ram_avail = None
    freq_max = freq_cur = None
    if psutil is not None:
        logical = psutil.cpu_count(logical=True) or logical
        physical = psutil.cpu_count(logical=False)
        vm = psutil.virtual_memory()
        ram_total, ram_avail = int(vm.total), int(vm.available)
        try:
            f = psutil.cpu_freq()
        except Exception:
            f = None
        if f is not None:
            freq_max, freq_cur = (f.max or None), (f.current or None)
    if ram_total is None:
        ram_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        affinity = len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        affinity = None

    model, flags, cpuinfo_mhz = parse_cpuinfo(_read(cpuinfo) or "")
    if system == "Darwin":
        model = model or _darwin_sysctl("machdep.cpu.brand_string")
    if freq_max:
        mhz, mhz_source = float(freq_max), "max clock (psutil)"
    elif freq_cur:
        mhz, mhz_source = float(freq_cur), "current clock (psutil; max unknown)"
    elif cpuinfo_mhz:
        mhz, mhz_source = cpuinfo_mhz, "/proc/cpuinfo cpu MHz"
    else:
        mhz, mhz_source = None, f"unknown (assumed {DEFAULT_CPU_GHZ} GHz)"

    limit, usage, source = (None, None, None)
    cpu_limit = None
    if system == "Linux":
        limit, usage, source = read_cgroup_memory(cgroup_root, proc_self_cgroup)
        cpu_limit = read_cgroup_cpu(cgroup_root, proc_self_cgroup)
    if limit is not None and usage is not None and ram_avail is not None:
        ram_avail = min(ram_avail, max(0, limit - usage))

    return HostReading(
        hostname=socket.gethostname(),
        system=system,
        machine=machine,
        cpu_model=model,
        cpu_flags=flags,
        logical_cores=int(logical),
        physical_cores=int(physical) if physical else None,
        affinity_cores=affinity,
        cgroup_cpu_limit=cpu_limit,
        cpu_max_mhz=mhz,
        cpu_mhz_source=mhz_source,
        ram_total_bytes=int(ram_total),
        ram_available_bytes=ram_avail,
        cgroup_memory_limit_bytes=limit,
        cgroup_memory_usage_bytes=usage,
        cgroup_memory_source=source,
    )


_PER_CYCLE = {"bf16": (CPU_BF16_FLOP_PER_CYCLE, CPU_BF16_FLOP_PER_CYCLE_FALLBACK),
              "fp32": (CPU_FP32_FLOP_PER_CYCLE, None), "int8": (CPU_INT8_OPS_PER_CYCLE, None)}


def estimate_cpu_flops(host: HostReading, kind: str) -> tuple[float | None, str]:
    """(FLOP/s, how it was estimated) for a `kind` matmul (bf16, fp32 or int8) on all usable cores, from the CPU's
    flags and clock; (None, why) where no flag gives a rate (bf16 has a fallback rate, fp32 and int8 none)."""
    table, fallback = _PER_CYCLE[kind]
    flags = set(host.cpu_flags)
    if kind == "fp32" and flags & NATIVE_BF16_FLAGS:
        return None, ("CPU fp32 compute not estimated: bf16 is native here (AVX512-BF16 / AMX), and the CPU kernels "
                      "compute in it (runtime.quantize.Bf16Rows.pays_here)")
    per_cycle, isa = fallback, "no known vector extension"
    for flag, rate, label in table:
        if flag in flags:
            per_cycle, isa = rate, label
            break
    if kind == "bf16" and not flags and host.system == "Darwin" and host.machine == "arm64":
        per_cycle, isa = 16.0, "Apple silicon NEON BF16 (assumed)"
    what = "ops" if kind == "int8" else "FLOP"
    if per_cycle is None:
        return None, f"CPU {kind} compute not estimated: no known vector extension for it"
    ghz = (host.cpu_max_mhz / 1000) if host.cpu_max_mhz else DEFAULT_CPU_GHZ
    cores = host.effective_cores
    flops = cores * ghz * 1e9 * per_cycle
    how = (
        f"CPU {kind} compute {format_flops(flops)} is estimated, not measured: {cores} cores x {ghz:.2f} GHz "
        f"({host.cpu_mhz_source}) x {per_cycle:g} {what}/cycle/core achieved with {isa}"
    )
    return flops, how


# A machine is busy when the 1-minute load average of *other* processes exceeds this many runnable
# threads per usable core: measurements taken then (RAM bandwidth above all) come out low.
BUSY_LOAD_PER_CORE = 0.5
BUSY_NOTE_PREFIX = "measured while the machine was busy"


def load_average() -> float | None:
    """The 1-minute load average (runnable threads), or None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(load: float | None, cores: int, what: str) -> str | None:
    """A note saying `what` was measured under load, when the load says so; None on an idle machine."""
    if load is None or load <= BUSY_LOAD_PER_CORE * cores:
        return None
    return (f"{BUSY_NOTE_PREFIX} (load average {load:.2f} on {cores} cores): {what} may be low; "
            "measure again when it is idle")


def machine_fingerprint() -> dict[str, Any]:
    """What identifies this machine's hardware, for the quick-probe cache key (fast, no torch)."""
    try:
        gpus = [
            {"name": g.name, "uuid": g.uuid, "memory": g.memory_total_bytes, "mig": g.mig_enabled}
            for g in read_nvml()
        ]
    except NvmlUnavailable:
        gpus = []
    if hasattr(os, "sysconf"):  # POSIX: the kernel's total, the figure psutil reads too; psutil's import costs 7 ms
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:  # pragma: no cover - Windows
        import psutil

        ram = int(psutil.virtual_memory().total)
    limit = read_cgroup_memory()[0] if platform.system() == "Linux" else None
    return {
        "gpus": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "ram_total": ram,
        "cgroup_memory_limit": limit,
        "cpu_count": os.cpu_count(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "schema_version": SCHEMA_VERSION,
    }


