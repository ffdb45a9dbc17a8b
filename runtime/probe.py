"""The prober: read this machine (NVML, psutil, cgroups) and measure it (torch).

Two modes:
- quick (`probe(quick=True)`): reads only, in well under 2 s, and never imports torch.
  GPU peaks come from a shipped profile whose GPU matches (datasheet figures), else
  from NVML (memory clock x bus width; CUDA cores x SM clock); the link is the typical
  figure for its PCIe generation and width; RAM bandwidth is a short multi-threaded copy;
  CPU bf16 compute is estimated from cores x clock x the instruction set. Notes say which.
- full (`probe(quick=False)`): also measures, with torch, every number the planner uses:
  GPU memory bandwidth, host<->device bandwidth (pinned and pageable, both directions),
  GPU and CPU bf16 matmul throughput, RAM bandwidth, the CUDA context's memory cost and
  kernel launch latency. Each measurement is short, repeated, and reported as a median.

Layers: `read_*` functions return plain dataclasses; `parse_*` functions turn raw answers
(NVML's bytes-or-str names, NOT_SUPPORTED errors, cgroup files) into values and are unit
tested with fake answers; `measure_*` functions return a Measurement; `build_profile`
turns all of it into a HardwareProfile. Nothing here imports torch at module level.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from planner.hardware import (
    SCHEMA_VERSION,
    GPUSpec,
    HardwareProfile,
    HostSpec,
    LinkSpec,
    Overheads,
)
from planner.units import GiB, MiB, format_bandwidth, format_bytes, format_flops, parse_bandwidth, parse_flops, parse_seconds

Progress = Callable[[str], None]

# ---------------------------------------------------------------- named constants (echoed in notes)

NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NOT_FOUND = 6
NVML_DEVICE_MIG_ENABLE = 1
NVML_CLOCK_SM = 1  # pynvml.NVML_CLOCK_SM
NVML_CLOCK_MEM = 2  # pynvml.NVML_CLOCK_MEM

# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX rounded to pages).
CGROUP_UNLIMITED_THRESHOLD = 1 << 60

# Host <-> GPU copies that a PCIe link of each generation typically achieves at x16,
# (pinned, pageable) in bytes/s; scaled by width/16. Typical, not measured.
PCIE_TYPICAL_X16: dict[int, tuple[float, float]] = {
    1: (3.0e9, 2.0e9),
    2: (6.0e9, 4.0e9),
    3: (12.0e9, 8.0e9),
    4: (25.0e9, 12.0e9),
    5: (50.0e9, 20.0e9),
    6: (100.0e9, 25.0e9),
}
DEFAULT_CUDA_CONTEXT_BYTES = 500 * MiB  # typical CUDA 12 context with torch + cuBLAS, lazy loading on
DEFAULT_ALLOCATOR_RESERVE_BYTES = 512 * MiB  # caching-allocator slack kept free (not measurable by a probe)
DEFAULT_KERNEL_LAUNCH_S = parse_seconds("5 us")  # typical CUDA launch latency from Python/torch

# Quick RAM bandwidth: copy this many bytes, counted read + written, median of repeats.
QUICK_RAM_COPY_BYTES = 128 * MiB
QUICK_RAM_REPEATS = 5
QUICK_RAM_MAX_THREADS = 16
FULL_RAM_COPY_BYTES = 512 * MiB
FULL_REPEATS = 7

# Estimated bf16 matmul FLOP per cycle per core that a CPU *achieves* (not peak), by the best
# instruction set it has. avx512_bf16 is calibrated on an AMD EPYC (Zen 4) VM: 2 cores at
# 2.6 GHz measured 150-420 GFLOPS (noisy VM) with torch 2.13, median ~200 (~40/cycle/core).
CPU_BF16_FLOP_PER_CYCLE: tuple[tuple[str, float, str], ...] = (
    ("amx_bf16", 384.0, "Intel AMX bf16 tiles"),
    ("avx512_bf16", 40.0, "AVX-512 BF16 (vdpbf16ps)"),
    ("avx512f", 16.0, "AVX-512 via fp32 conversion"),
    ("avx2", 10.0, "AVX2/FMA via fp32 conversion"),
    ("sve", 24.0, "ARM SVE"),
    ("bf16", 16.0, "ARM NEON BF16 (bfmmla)"),
    ("asimd", 8.0, "ARM NEON"),
)
CPU_BF16_FLOP_PER_CYCLE_FALLBACK = 4.0
DEFAULT_CPU_GHZ = 2.5

# An NVIDIA GPU that matches no datasheet: dense bf16 tensor FLOP per CUDA core per SM clock,
# by compute capability major. Fitted on datasheets: A100 312 TFLOPS = 6912 cores x 1.41 GHz x 32;
# L4 121 = 7424 x 2.04 x 8; RTX 4090 165 = 16384 x 2.52 x 4 (GeForce runs bf16, which
# accumulates in fp32, at half the rate of the professional parts).
GPU_BF16_FLOP_PER_CORE_CLOCK = {8: 8.0, 9: 32.0, 10: 32.0, 12: 8.0}
GPU_BF16_FLOP_PER_CORE_CLOCK_DATACENTER_80 = 32.0  # A100 / A30 (cc 8.0)
GPU_BF16_FLOP_PER_CORE_CLOCK_GEFORCE = 4.0
GPU_FLOPS_PER_BYTE_GUESS = 100.0  # last resort: bf16 FLOP/s ~ 100 x memory bandwidth

# Apple silicon: the share of unified RAM the GPU may wire by default (macOS
# recommendedMaxWorkingSetSize is ~2/3 of RAM up to 36 GiB, ~3/4 above).
APPLE_GPU_SHARE_SMALL = 2 / 3
APPLE_GPU_SHARE_LARGE = 0.75
APPLE_GPU_SHARE_THRESHOLD_BYTES = 36 * GiB
# chip -> (memory bandwidth bytes/s, GPU fp16/bf16 FLOP/s of the top GPU bin, approximate)
APPLE_CHIPS: dict[str, tuple[float, float]] = {
    "M1": (68.25e9, 2.6e12),
    "M1 Pro": (200e9, 5.2e12),
    "M1 Max": (400e9, 10.4e12),
    "M1 Ultra": (800e9, 20.8e12),
    "M2": (100e9, 3.6e12),
    "M2 Pro": (200e9, 6.8e12),
    "M2 Max": (400e9, 13.6e12),
    "M2 Ultra": (800e9, 27.2e12),
    "M3": (100e9, 4.1e12),
    "M3 Pro": (150e9, 7.4e12),
    "M3 Max": (400e9, 16.4e12),
    "M3 Ultra": (819e9, 28.4e12),
    "M4": (120e9, 4.3e12),
    "M4 Pro": (273e9, 9.2e12),
    "M4 Max": (546e9, 18.4e12),
}
UNIFIED_NVIDIA_GPUS = ("GB10",)  # DGX Spark: GPU and CPU share LPDDR5X


# ---------------------------------------------------------------- plain data


@dataclass(frozen=True)
class MigDevice:
    uuid: str | None
    memory_total_bytes: int | None


@dataclass(frozen=True)
class NvmlGpu:
    """One physical GPU as NVML reports it. None = could not be read (see `unreadable`)."""

    index: int  # NVML index (PCI bus order, as nvidia-smi)
    name: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_used_bytes: int | None = None
    other_processes: int | None = None  # processes other than us with memory on this GPU
    other_processes_memory_bytes: int | None = None  # None when NVML hides per-process usage
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    memory_clock_max_mhz: int | None = None
    memory_bus_width_bits: int | None = None
    sm_clock_max_mhz: int | None = None
    cuda_cores: int | None = None
    compute_capability: str | None = None
    mig_enabled: bool | None = None
    mig_devices: tuple[MigDevice, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    unreadable: tuple[str, ...] = ()  # "pcie_gen_max: not supported", ...

    @property
    def nvml_peak_bandwidth_bytes_per_s(self) -> float | None:
        """Theoretical memory bandwidth: max memory clock x 2 (double data rate) x bus width.

        NVML reports the memory clock such that this holds for HBM, GDDR6, GDDR6X and GDDR7
        alike (RTX 4090: 10501 MHz x 2 x 384 bit / 8 = 1008 GB/s; A100: 1215 x 2 x 5120 / 8).
        """
        if not self.memory_clock_max_mhz or not self.memory_bus_width_bits:
            return None
        return self.memory_clock_max_mhz * 1e6 * 2 * self.memory_bus_width_bits / 8


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no pynvml, no driver, no GPU): the reason is the message."""


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


@dataclass(frozen=True)
class Measurement:
    name: str
    value: float  # the median
    unit: str  # "B/s", "FLOP/s", "s", "B"
    samples: tuple[float, ...]
    method: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ProbeResult:
    profile: HardwareProfile
    readings: dict[str, Any]  # everything read and measured, JSON-serialisable
    notes: tuple[str, ...]
    quick: bool
    elapsed_s: float


# ---------------------------------------------------------------- NVML: raw answers -> values


def _text(raw: Any) -> str:
    if isinstance(raw, (bytes, bytearray)):
        return bytes(raw).decode("utf-8", "replace").strip("\x00").strip()
    return str(raw).strip()


def _nvml_problem(raw: Any) -> str | None:
    """Why a raw answer is not a value: None when it is one."""
    if isinstance(raw, BaseException):
        if getattr(raw, "value", None) == NVML_ERROR_NOT_SUPPORTED:
            return "not supported"
        return f"error ({raw})"
    return None


def _attr(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def format_cuda_driver_version(v: int) -> str:
    """NVML's 12040 -> "12.4"."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def parse_nvml_gpu(index: int, raw: Mapping[str, Any], system: Mapping[str, Any] | None = None, *, own_pid: int | None = None) -> NvmlGpu:
    """Turn one GPU's raw NVML answers (values or the exceptions raised) into an NvmlGpu.

    `raw` keys: name, uuid, pci, memory, compute_processes, graphics_processes,
    pcie_gen_current, pcie_gen_max, pcie_width_current, pcie_width_max, memory_clock_max,
    sm_clock_max, memory_bus_width, cuda_cores, compute_capability, mig_mode, mig_devices.
    `system` keys: driver_version, cuda_driver_version. A missing key was not asked.
    """
    unreadable: list[str] = []
    own_pid = os.getpid() if own_pid is None else own_pid

    def get(key: str, src: Mapping[str, Any] = raw) -> Any:
        if key not in src:
            return None
        value = src[key]
        problem = _nvml_problem(value)
        if problem:
            unreadable.append(f"{key}: {problem}")
            return None
        return value

    def as_int(v: Any) -> int | None:
        if v is None or isinstance(v, bool):
            return None
        try:
            i = int(v)
        except (TypeError, ValueError):
            return None
        return i if i >= 0 else None

    name_raw = get("name")
    name = _text(name_raw) if name_raw is not None else f"GPU {index}"
    uuid_raw = get("uuid")
    pci = get("pci")
    bus = _attr(pci, "busId") if pci is not None else None
    mem = get("memory")
    total = as_int(_attr(mem, "total")) if mem is not None else None
    free = as_int(_attr(mem, "free")) if mem is not None else None
    used = as_int(_attr(mem, "used")) if mem is not None else None

    others: dict[int, int | None] = {}
    procs_known = False
    for key in ("compute_processes", "graphics_processes"):
        procs = get(key)
        if procs is None:
            continue
        procs_known = True
        for p in procs:
            pid = as_int(_attr(p, "pid"))
            if pid is None or pid == own_pid:
                continue
            usage = as_int(_attr(p, "usedGpuMemory"))
            # The same process can be listed as compute and graphics: count it once.
            others[pid] = max(others.get(pid) or 0, usage) if usage is not None else others.get(pid)
    other_mem: int | None
    if not procs_known:
        other_mem = None
    elif any(v is None for v in others.values()):
        other_mem = None  # NVML hides per-process usage (containers, no permission)
    else:
        other_mem = sum(v for v in others.values() if v is not None)

    cc_raw = get("compute_capability")
    cc = None
    if cc_raw is not None:
        try:
            cc = f"{int(cc_raw[0])}.{int(cc_raw[1])}"
        except (TypeError, ValueError, IndexError):
            unreadable.append(f"compute_capability: unexpected answer {cc_raw!r}")

    mig_raw = get("mig_mode")
    mig_enabled = None
    if mig_raw is not None:
        current = mig_raw[0] if isinstance(mig_raw, (tuple, list)) else mig_raw
        mig_enabled = as_int(current) == NVML_DEVICE_MIG_ENABLE
    mig_devices: list[MigDevice] = []
    for m in get("mig_devices") or ():
        m_uuid = _attr(m, "uuid")
        m_mem = _attr(m, "memory")
        mig_devices.append(
            MigDevice(
                uuid=_text(m_uuid) if m_uuid is not None and not isinstance(m_uuid, BaseException) else None,
                memory_total_bytes=as_int(_attr(m_mem, "total")) if m_mem is not None and not isinstance(m_mem, BaseException) else None,
            )
        )

    system = system or {}
    drv = get("driver_version", system)
    cuda_v = get("cuda_driver_version", system)
    cuda_ver = None
    if cuda_v is not None:
        cuda_ver = format_cuda_driver_version(int(cuda_v)) if isinstance(cuda_v, int) else _text(cuda_v)

    return NvmlGpu(
        index=index,
        name=name,
        uuid=_text(uuid_raw) if uuid_raw is not None else None,
        pci_bus_id=_text(bus) if bus is not None else None,
        memory_total_bytes=total,
        memory_free_bytes=free,
        memory_used_bytes=used,
        other_processes=len(others) if procs_known else None,
        other_processes_memory_bytes=other_mem,
        pcie_gen_current=as_int(get("pcie_gen_current")),
        pcie_gen_max=as_int(get("pcie_gen_max")),
        pcie_width_current=as_int(get("pcie_width_current")),
        pcie_width_max=as_int(get("pcie_width_max")),
        memory_clock_max_mhz=as_int(get("memory_clock_max")),
        memory_bus_width_bits=as_int(get("memory_bus_width")),
        sm_clock_max_mhz=as_int(get("sm_clock_max")),
        cuda_cores=as_int(get("cuda_cores")),
        compute_capability=cc,
        mig_enabled=mig_enabled,
        mig_devices=tuple(mig_devices),
        driver_version=_text(drv) if drv is not None else None,
        cuda_driver_version=cuda_ver,
        unreadable=tuple(unreadable),
    )


def _call(fn: Callable[..., Any] | None, *args: Any) -> Any:
    """The answer of one NVML call, or the exception it raised (kept as a value)."""
    if fn is None:
        return NotImplementedError("not in this pynvml")
    try:
        return fn(*args)
    except Exception as e:  # NVMLError and friends: parsed later
        return e


def collect_nvml_raw(nvml: Any, handle: Any) -> dict[str, Any]:
    """Ask NVML everything about one GPU; answers or exceptions, unparsed."""
    g = lambda name: getattr(nvml, name, None)  # noqa: E731 - older pynvml lacks some calls
    clock_mem = getattr(nvml, "NVML_CLOCK_MEM", NVML_CLOCK_MEM)
    clock_sm = getattr(nvml, "NVML_CLOCK_SM", NVML_CLOCK_SM)
    raw: dict[str, Any] = {
        "name": _call(g("nvmlDeviceGetName"), handle),
        "uuid": _call(g("nvmlDeviceGetUUID"), handle),
        "pci": _call(g("nvmlDeviceGetPciInfo"), handle),
        "memory": _call(g("nvmlDeviceGetMemoryInfo"), handle),
        "compute_processes": _call(g("nvmlDeviceGetComputeRunningProcesses"), handle),
        "graphics_processes": _call(g("nvmlDeviceGetGraphicsRunningProcesses"), handle),
        "pcie_gen_current": _call(g("nvmlDeviceGetCurrPcieLinkGeneration"), handle),
        "pcie_gen_max": _call(g("nvmlDeviceGetMaxPcieLinkGeneration"), handle),
        "pcie_width_current": _call(g("nvmlDeviceGetCurrPcieLinkWidth"), handle),
        "pcie_width_max": _call(g("nvmlDeviceGetMaxPcieLinkWidth"), handle),
        "memory_clock_max": _call(g("nvmlDeviceGetMaxClockInfo"), handle, clock_mem),
        "sm_clock_max": _call(g("nvmlDeviceGetMaxClockInfo"), handle, clock_sm),
        "memory_bus_width": _call(g("nvmlDeviceGetMemoryBusWidth"), handle),
        "cuda_cores": _call(g("nvmlDeviceGetNumGpuCores"), handle),
        "compute_capability": _call(g("nvmlDeviceGetCudaComputeCapability"), handle),
        "mig_mode": _call(g("nvmlDeviceGetMigMode"), handle),
    }
    mig = raw["mig_mode"]
    if not isinstance(mig, BaseException) and isinstance(mig, (tuple, list)) and mig and mig[0] == NVML_DEVICE_MIG_ENABLE:
        devices = []
        count = _call(g("nvmlDeviceGetMaxMigDeviceCount"), handle)
        for i in range(count if isinstance(count, int) else 0):
            h = _call(g("nvmlDeviceGetMigDeviceHandleByIndex"), handle, i)
            if isinstance(h, BaseException):
                continue  # NOT_FOUND: an empty slot
            devices.append({"uuid": _call(g("nvmlDeviceGetUUID"), h), "memory": _call(g("nvmlDeviceGetMemoryInfo"), h)})
        raw["mig_devices"] = devices
    return raw


def _import_pynvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py (pynvml) is not installed") from None
    return pynvml


def read_nvml(nvml: Any = None, *, own_pid: int | None = None) -> list[NvmlGpu]:
    """Every GPU NVML enumerates (all of them: filter with `filter_visible`)."""
    nvml = nvml or _import_pynvml()
    try:
        nvml.nvmlInit()
    except Exception as e:
        raise NvmlUnavailable(f"NVML did not start ({e}): no NVIDIA driver or GPU here") from None
    try:
        system = {
            "driver_version": _call(getattr(nvml, "nvmlSystemGetDriverVersion", None)),
            "cuda_driver_version": _call(getattr(nvml, "nvmlSystemGetCudaDriverVersion", None)),
        }
        count = nvml.nvmlDeviceGetCount()
        gpus = []
        for i in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(parse_nvml_gpu(i, collect_nvml_raw(nvml, handle), system, own_pid=own_pid))
        return gpus
    except NvmlUnavailable:
        raise
    except Exception as e:
        raise NvmlUnavailable(f"NVML failed while enumerating GPUs: {e}") from None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def filter_visible(gpus: list[NvmlGpu], cuda_visible_devices: str | None) -> tuple[list[NvmlGpu], list[str]]:
    """The GPUs CUDA will see under CUDA_VISIBLE_DEVICES, in its order, plus notes.

    As CUDA does: unset means all; empty means none; entries are indices or (prefixes of)
    "GPU-..." / "MIG-..." UUIDs; the list ends at the first entry that matches nothing.
    A MIG UUID yields that instance, with the instance's memory.
    """
    notes: list[str] = []
    if cuda_visible_devices is None:
        return list(gpus), notes
    spec = cuda_visible_devices.strip()
    if not spec:
        notes.append("CUDA_VISIBLE_DEVICES is empty: no GPU is visible to CUDA")
        return [], notes
    chosen: list[NvmlGpu] = []
    seen: set[tuple[int, str | None]] = set()
    by_index = {g.index: g for g in gpus}
    for token in (t.strip() for t in spec.split(",")):
        match: NvmlGpu | None = None
        if re.fullmatch(r"\d+", token):
            match = by_index.get(int(token))
        elif token.upper().startswith("MIG-"):
            for g in gpus:
                for m in g.mig_devices:
                    if m.uuid and m.uuid.lower().startswith(token.lower()):
                        match = dataclasses.replace(
                            g,
                            name=f"{g.name} MIG",
                            uuid=m.uuid,
                            memory_total_bytes=m.memory_total_bytes,
                            memory_free_bytes=None,
                            memory_used_bytes=None,
                        )
                        break
                if match:
                    break
        elif token:
            wanted = token.lower() if token.lower().startswith("gpu-") else f"gpu-{token.lower()}"
            hits = [g for g in gpus if g.uuid and g.uuid.lower().startswith(wanted)]
            if len(hits) == 1:
                match = hits[0]
            elif len(hits) > 1:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r} matches {len(hits)} GPUs: ambiguous, list ends there")
                break
        if match is None:
            notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r} matches no GPU: CUDA ignores it and the entries after it")
            break
        key = (match.index, match.uuid)
        if key in seen:
            notes.append(f"CUDA_VISIBLE_DEVICES lists {token!r} twice; counted once")
            continue
        seen.add(key)
        chosen.append(match)
    return chosen, notes


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


def read_cgroup_memory(root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int | None, int | None, str | None]:
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


def read_cgroup_cpu(root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
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


_RELEVANT_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "asimd", "sve", "sve2", "bf16", "i8mm"}


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


def estimate_cpu_bf16_flops(host: HostReading) -> tuple[float, str]:
    """(FLOP/s, how it was estimated) for a bf16 matmul on all usable cores."""
    flags = set(host.cpu_flags)
    per_cycle, isa = CPU_BF16_FLOP_PER_CYCLE_FALLBACK, "no known vector extension"
    for flag, rate, label in CPU_BF16_FLOP_PER_CYCLE:
        if flag in flags:
            per_cycle, isa = rate, label
            break
    if not flags and host.system == "Darwin" and host.machine == "arm64":
        per_cycle, isa = 16.0, "Apple silicon NEON BF16 (assumed)"
    ghz = (host.cpu_max_mhz / 1000) if host.cpu_max_mhz else DEFAULT_CPU_GHZ
    cores = host.effective_cores
    flops = cores * ghz * 1e9 * per_cycle
    how = (
        f"CPU bf16 compute {format_flops(flops)} is estimated, not measured: {cores} cores x {ghz:.2f} GHz "
        f"({host.cpu_mhz_source}) x {per_cycle:g} FLOP/cycle/core achieved with {isa}"
    )
    return flops, how


def machine_fingerprint() -> dict[str, Any]:
    """What identifies this machine's hardware, for the quick-probe cache key (fast, no torch)."""
    try:
        gpus = [
            {"name": g.name, "uuid": g.uuid, "memory": g.memory_total_bytes, "mig": g.mig_enabled}
            for g in read_nvml()
        ]
    except NvmlUnavailable:
        gpus = []
    try:
        import psutil

        ram = int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
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


# ---------------------------------------------------------------- measurements


def _median_measurement(name: str, unit: str, work: float, times: list[float], method: str) -> Measurement:
    samples = tuple(work / t for t in times if t > 0)
    if not samples:
        raise RuntimeError(f"{name}: timer resolution too coarse")
    return Measurement(name, statistics.median(samples), unit, samples, method)


def measure_ram_bandwidth_quick(nbytes: int = QUICK_RAM_COPY_BYTES, repeats: int = QUICK_RAM_REPEATS, threads: int | None = None) -> Measurement:
    """RAM copy bandwidth without torch: numpy copies in threads (numpy releases the GIL),
    else a single-threaded bytearray copy. Bytes read + written are counted."""
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    if np is None:
        src = bytearray(b"\x5a") * nbytes  # touched, so no shared zero page flatters the result
        dst = bytearray(nbytes)
        view = memoryview(dst)
        view[:] = src  # fault the pages in
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            view[:] = src
            times.append(time.perf_counter() - t0)
        return _median_measurement("ram_bandwidth", "B/s", 2 * nbytes, times, f"bytearray copy of {format_bytes(nbytes)}, 1 thread, read+write counted")

    from concurrent.futures import ThreadPoolExecutor

    n_threads = max(1, min(threads or (os.cpu_count() or 1), QUICK_RAM_MAX_THREADS))
    src = np.empty(nbytes, dtype=np.uint8)
    src.fill(0x5A)
    dst = np.empty_like(src)
    bounds = [(i * nbytes // n_threads, (i + 1) * nbytes // n_threads) for i in range(n_threads)]

    def copy(b: tuple[int, int]) -> None:
        np.copyto(dst[b[0] : b[1]], src[b[0] : b[1]])

    with ThreadPoolExecutor(n_threads) as pool:
        list(pool.map(copy, bounds))  # fault the pages in
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(copy, bounds))
            times.append(time.perf_counter() - t0)
    return _median_measurement(
        "ram_bandwidth", "B/s", 2 * nbytes, times, f"numpy copy of {format_bytes(nbytes)} in {n_threads} threads, read+write counted"
    )


def measure_ram_bandwidth_torch(torch: Any, nbytes: int = FULL_RAM_COPY_BYTES, repeats: int = FULL_REPEATS) -> Measurement:
    src = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return _median_measurement(
        "ram_bandwidth", "B/s", 2 * nbytes, times, f"torch copy of {format_bytes(nbytes)} on {torch.get_num_threads()} threads, read+write counted"
    )


def _matmul_size(rate_guess: float, target_s: float, lo: int = 512, hi: int = 8192) -> int:
    n = int(round((rate_guess * target_s / 2) ** (1 / 3) / 256)) * 256
    return max(lo, min(hi, n))


def measure_cpu_matmul_bf16(torch: Any, repeats: int = 5) -> Measurement:
    """bf16 matmul FLOP/s on all torch threads. The size steps up with the machine's speed
    (2048 below 1 TFLOPS, 4096 below 20, else 8192) so that one product takes tens of ms."""
    a = torch.randn(1024, 1024).to(torch.bfloat16)
    a @ a
    t0 = time.perf_counter()
    a @ a
    guess = 2 * 1024**3 / max(time.perf_counter() - t0, 1e-6)
    n = 2048 if guess < 1e12 else 4096 if guess < 20e12 else 8192
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return _median_measurement("cpu_bf16_matmul", "FLOP/s", 2 * n**3, times, f"torch bf16 {n}x{n} @ {n}x{n} on {torch.get_num_threads()} threads")


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elif device == "mps":
        torch.mps.synchronize()


def _timed(torch: Any, device: str, fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()
    _sync(torch, device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    return times


def measure_gpu_memory_bandwidth(torch: Any, device: str, nbytes: int) -> Measurement:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a.fill_(1)
    b = torch.empty_like(a)
    times = _timed(torch, device, lambda: b.copy_(a), FULL_REPEATS * 2)
    del a, b
    return _median_measurement("gpu_memory_bandwidth", "B/s", 2 * nbytes, times, f"device-to-device copy of {format_bytes(nbytes)}, read+write counted")


def measure_host_link(torch: Any, device: str, nbytes: int) -> dict[str, Measurement]:
    """h2d / d2h bandwidth from pinned and from pageable host memory."""
    out: dict[str, Measurement] = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.full((nbytes,), 1, dtype=torch.uint8)
    pinned = None
    if device.startswith("cuda"):
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(1)
    for kind, host in (("pinned", pinned), ("pageable", pageable)):
        if host is None:
            continue
        t = _timed(torch, device, lambda: dev.copy_(host, non_blocking=kind == "pinned"), FULL_REPEATS)
        out[f"h2d_{kind}"] = _median_measurement(f"h2d_{kind}", "B/s", nbytes, t, f"host->device copy of {format_bytes(nbytes)} from {kind} memory")
        t = _timed(torch, device, lambda: host.copy_(dev, non_blocking=kind == "pinned"), FULL_REPEATS)
        out[f"d2h_{kind}"] = _median_measurement(f"d2h_{kind}", "B/s", nbytes, t, f"device->host copy of {format_bytes(nbytes)} to {kind} memory")
    return out


def measure_gpu_matmul_bf16(torch: Any, device: str, repeats: int = 10) -> Measurement:
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    t = _timed(torch, device, lambda: a @ a, 3)
    guess = 2 * 2048**3 / max(statistics.median(t), 1e-6)
    n = _matmul_size(guess, 0.02, lo=2048, hi=16384)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = _timed(torch, device, lambda: a @ b, repeats)
    return _median_measurement("gpu_bf16_matmul", "FLOP/s", 2 * n**3, times, f"torch bf16 {n}x{n} @ {n}x{n}")


def measure_kernel_launch(torch: Any, device: str, launches: int = 2000, repeats: int = 5) -> Measurement:
    """Seconds per launch of a trivial kernel, back to back (launch-bound, not compute-bound)."""
    x = torch.zeros(1, device=device)

    def burst() -> None:
        for _ in range(launches):
            x.add_(1)

    times = _timed(torch, device, burst, repeats)
    samples = tuple(t / launches for t in times)
    return Measurement("kernel_launch", statistics.median(samples), "s", samples, f"{launches} back-to-back x.add_(1) on a 1-element tensor")


def nvml_process_memory(uuid: str | None, pid: int) -> int | None:
    """GPU memory NVML attributes to process `pid` on the GPU with this UUID (None if hidden)."""
    if not uuid:
        return None
    try:
        nvml = _import_pynvml()
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        h = nvml.nvmlDeviceGetHandleByUUID(uuid)
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
        return None
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def nvml_used_memory(uuid: str | None) -> int | None:
    if not uuid:
        return None
    try:
        nvml = _import_pynvml()
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(uuid)).used)
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


# ---------------------------------------------------------------- datasheets and typical figures


def _norm_gpu_name(name: str) -> str:
    s = name.lower()
    for word in ("nvidia", "geforce"):
        s = s.replace(word, " ")
    return re.sub(r"[^a-z0-9]+", "", s)


def match_datasheet(name: str, memory_bytes: int | None) -> tuple[GPUSpec, str] | None:
    """The GPUSpec of a shipped profile whose GPU has this name (and about this memory)."""
    from planner.profiles import shipped_profiles_dir
    from planner.hardware import load_profile
    from planner.errors import ProfileError

    want = _norm_gpu_name(name)
    directory = shipped_profiles_dir()
    for f in sorted(directory.glob("*.yaml")):
        try:
            prof = load_profile(f)
        except ProfileError:
            continue
        for g in prof.gpus:
            if _norm_gpu_name(g.name) != want:
                continue
            if memory_bytes is not None and abs(g.memory_bytes - memory_bytes) > 0.1 * g.memory_bytes:
                continue
            return g, prof.name
    return None


def typical_link(gen: int | None, width: int | None) -> tuple[LinkSpec, str] | None:
    if not gen or not width or gen not in PCIE_TYPICAL_X16:
        return None
    pinned, pageable = PCIE_TYPICAL_X16[gen]
    scale = width / 16
    name = f"PCIe {gen}.0 x{width}"
    link = LinkSpec(
        name=name,
        h2d_pinned_bytes_per_s=pinned * scale,
        h2d_pageable_bytes_per_s=min(pageable, pinned * scale),
        d2h_pinned_bytes_per_s=pinned * scale,
        d2h_pageable_bytes_per_s=min(pageable, pinned * scale),
    )
    note = (
        f"link bandwidths are typical figures for {name} ({format_bandwidth(link.h2d_pinned_bytes_per_s)} pinned, "
        f"{format_bandwidth(link.h2d_pageable_bytes_per_s)} pageable), not measured; run `vramplan probe` (full) to measure"
    )
    return link, note


def estimate_gpu_bf16_flops(g: NvmlGpu) -> tuple[float, str] | None:
    """Dense bf16 FLOP/s from NVML's CUDA-core count x max SM clock, for a GPU no datasheet matches."""
    if not g.cuda_cores or not g.sm_clock_max_mhz or not g.compute_capability:
        return None
    major = int(g.compute_capability.split(".")[0])
    if major < 8:
        return None  # no bf16 tensor cores before Ampere
    if g.compute_capability == "8.0":
        per = GPU_BF16_FLOP_PER_CORE_CLOCK_DATACENTER_80
    else:
        per = GPU_BF16_FLOP_PER_CORE_CLOCK.get(major, 8.0)
        if "geforce" in g.name.lower() and per == 8.0:
            per = GPU_BF16_FLOP_PER_CORE_CLOCK_GEFORCE
    flops = g.cuda_cores * g.sm_clock_max_mhz * 1e6 * per
    how = (
        f"{g.name}: bf16 compute {format_flops(flops)} estimated from NVML: {g.cuda_cores} CUDA cores x "
        f"{g.sm_clock_max_mhz} MHz x {per:g} FLOP/core/clock (compute capability {g.compute_capability}); no datasheet match"
    )
    return flops, how


def _apple_chip(model: str | None) -> str | None:
    if not model:
        return None
    m = re.search(r"\b(M\d)(?:\s+(Pro|Max|Ultra))?\b", model)
    if not m:
        return None
    chip = m.group(1) + (f" {m.group(2)}" if m.group(2) else "")
    return chip if chip in APPLE_CHIPS else None


def apple_gpu_share(ram_bytes: int) -> float:
    return APPLE_GPU_SHARE_LARGE if ram_bytes > APPLE_GPU_SHARE_THRESHOLD_BYTES else APPLE_GPU_SHARE_SMALL


# ---------------------------------------------------------------- versions


def _vramplan_version() -> str:
    try:
        from importlib.metadata import version

        return version("vramplan")
    except Exception:  # PackageNotFoundError when run from a checkout
        return "dev"


def _tidy(x: float, mult: float, unit: str, parse: Callable[[str], float], digits: int = 4) -> float:
    """x rounded to `digits` significant digits *as the YAML will spell it* ("22.63 GB/s"), so
    that the profile file shows the short form and reloads to the identical float."""
    text = f"{x / mult:.{digits}g}"
    if "e" in text:
        text = f"{x / mult:.0f}"
    return parse(f"{text} {unit}")


def _bw(x: float) -> float:
    return _tidy(x, 1e9, "GB/s", parse_bandwidth)


def _fl(x: float) -> float:
    return _tidy(x, 1e12, "TFLOPS", parse_flops)


def _sec(x: float) -> float:
    return _tidy(x, 1e-6, "us", parse_seconds, digits=3)


def _round_bytes(n: float, quantum: int = MiB) -> int:
    return int(max(0, round(n / quantum)) * quantum)


# ---------------------------------------------------------------- the probe


@dataclass
class _GpuGroup:
    gpus: list[NvmlGpu]
    bandwidth: float | None = None
    flops: float | None = None
    cc: str | None = None
    memory: int | None = None


def probe(quick: bool = False, progress: Progress | None = None) -> ProbeResult:
    """Read (and unless quick, measure) this machine; return its HardwareProfile and readings."""
    t_start = time.perf_counter()
    say = progress or (lambda _msg: None)
    notes: list[str] = []
    timings: dict[str, float] = {}
    readings: dict[str, Any] = {"mode": "quick" if quick else "full"}
    measurements: dict[str, Measurement] = {}

    def timed(label: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            timings[label] = round(time.perf_counter() - t0, 4)

    # -- read ---------------------------------------------------------------
    say("reading GPUs (NVML)")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        all_gpus = timed("nvml", read_nvml)
        readings["nvml"] = {"gpus": [dataclasses.asdict(g) for g in all_gpus]}
    except NvmlUnavailable as e:
        all_gpus = []
        readings["nvml"] = {"error": str(e)}
        notes.append(f"NVML unavailable: {e}")
    visible, cvd_notes = filter_visible(all_gpus, cvd)
    notes.extend(cvd_notes)
    readings["cuda_visible_devices"] = cvd
    readings["visible_gpu_indices"] = [g.index for g in visible]
    if cvd and len(visible) > 1 and len({g.name for g in visible}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        notes.append("mixed GPUs and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers devices fastest-first, NVML by PCI bus")

    say("reading host (psutil, cgroups)")
    host = timed("host", read_host)
    readings["host"] = dataclasses.asdict(host)
    if host.cgroup_memory_limit_bytes is not None and host.cgroup_memory_limit_bytes < host.ram_total_bytes:
        notes.append(
            f"RAM is the container's cgroup limit {format_bytes(host.cgroup_memory_limit_bytes)} "
            f"({host.cgroup_memory_source}), not the host's {format_bytes(host.ram_total_bytes)}"
        )
    if host.effective_cores < (host.physical_cores or host.logical_cores):
        notes.append(f"cores limited to {host.effective_cores} by CPU affinity or cgroup quota")

    driver = next((g.driver_version for g in all_gpus if g.driver_version), None)
    cuda_driver = next((g.cuda_driver_version for g in all_gpus if g.cuda_driver_version), None)
    for g in visible:
        if g.unreadable:
            notes.append(f"GPU {g.index} ({g.name}): NVML could not read " + "; ".join(g.unreadable))
        if g.mig_enabled:
            notes.append(
                f"GPU {g.index} ({g.name}) has MIG enabled: a CUDA process gets one MIG instance, "
                "so the instance's memory is used, and bandwidth/compute are a fraction of the figures"
            )
        if g.other_processes_memory_bytes:
            notes.append(
                f"GPU {g.index}: {format_bytes(g.other_processes_memory_bytes)} in use by {g.other_processes} other "
                "process(es) right now (not subtracted from the profile)"
            )
        elif g.other_processes_memory_bytes is None and g.memory_used_bytes and g.memory_used_bytes > 1 * GiB:
            notes.append(f"GPU {g.index}: {format_bytes(g.memory_used_bytes)} in use right now (by whom: hidden from NVML)")

    # -- torch (full mode only) ------------------------------------------------
    torch = None
    if not quick:
        say("importing torch")
        try:
            torch = timed("import_torch", lambda: __import__("torch"))
            readings["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads()}
        except ImportError:
            notes.append("torch is not installed: measurements that need it were replaced by estimates")
            readings["torch"] = {"error": "not installed"}
    if torch is not None and not all_gpus and torch.cuda.is_available():
        visible = _gpus_from_torch(torch)  # torch already applied CUDA_VISIBLE_DEVICES
        readings["visible_gpu_indices"] = [g.index for g in visible]
        notes.append("GPUs read through torch because NVML is unavailable: no PCIe link, clock or process readings")

    # -- host measurements ------------------------------------------------------
    say("measuring RAM bandwidth")
    try:
        if torch is not None:
            measurements["ram_bandwidth"] = timed("ram_bandwidth", lambda: measure_ram_bandwidth_torch(torch))
        else:
            measurements["ram_bandwidth"] = timed("ram_bandwidth", lambda: measure_ram_bandwidth_quick(threads=host.effective_cores))
    except Exception as e:  # MemoryError in a tight container
        notes.append(f"RAM bandwidth not measured ({type(e).__name__}: {e})")
    ram_bw = measurements["ram_bandwidth"].value if "ram_bandwidth" in measurements else None
    if ram_bw is not None:
        notes.append(f"RAM bandwidth {format_bandwidth(ram_bw)} measured: {measurements['ram_bandwidth'].method}")
    else:
        ram_bw = 10e9
        notes.append("RAM bandwidth unknown: assumed 10 GB/s")

    cpu_flops = None
    if torch is not None:
        say("measuring CPU bf16 matmul")
        try:
            measurements["cpu_bf16_matmul"] = timed("cpu_bf16_matmul", lambda: measure_cpu_matmul_bf16(torch))
            cpu_flops = measurements["cpu_bf16_matmul"].value
            notes.append(f"CPU bf16 compute {format_flops(cpu_flops)} measured: {measurements['cpu_bf16_matmul'].method}")
        except Exception as e:
            notes.append(f"CPU bf16 matmul not measured ({type(e).__name__}: {e})")
    if cpu_flops is None:
        cpu_flops, how = estimate_cpu_bf16_flops(host)
        notes.append(how)

    host_spec = HostSpec(
        ram_bytes=host.effective_ram_bytes,
        ram_bandwidth_bytes_per_s=_bw(ram_bw),
        cpu_cores=host.effective_cores,
        cpu_bf16_flops=_fl(cpu_flops),
    )

    # -- GPUs -----------------------------------------------------------------
    unified = False
    gpus: list[GPUSpec] = []
    link: LinkSpec | None = None
    overheads = Overheads.zero()
    gpu_measured = False

    apple = host.system == "Darwin" and host.machine == "arm64"
    if apple:
        unified = True
        chip = _apple_chip(host.cpu_model)
        share = apple_gpu_share(host.effective_ram_bytes)
        mem = _round_bytes(host.effective_ram_bytes * share)
        bw, fl = APPLE_CHIPS.get(chip or "", (host_spec.ram_bandwidth_bytes_per_s, 2e12))
        notes.append(
            f"Apple silicon ({chip or host.cpu_model or 'unknown chip'}): unified memory; GPU memory = {share:.0%} of RAM "
            f"(macOS default GPU working-set limit); bandwidth and GPU compute are "
            + ("approximate chip figures" if chip else "guesses (chip not recognised)")
        )
        if torch is not None and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            say("measuring the integrated GPU (MPS)")
            try:
                m_bw = measure_gpu_memory_bandwidth(torch, "mps", 256 * MiB)
                m_fl = measure_gpu_matmul_bf16(torch, "mps")
                measurements.update(gpu0_memory_bandwidth=m_bw, gpu0_bf16_matmul=m_fl)
                bw, fl = m_bw.value, m_fl.value
                gpu_measured = True
                notes.append("integrated GPU bandwidth and bf16 compute measured with torch MPS")
            except Exception as e:
                notes.append(f"MPS measurement failed ({type(e).__name__}: {e}); chip figures used")
        gpus.append(
            GPUSpec(name=f"Apple {chip} GPU" if chip else "Apple GPU", memory_bytes=mem, memory_bandwidth_bytes_per_s=_bw(bw), bf16_flops=_fl(fl))
        )
        overheads = Overheads(cuda_context_bytes=0, allocator_reserve_bytes=DEFAULT_ALLOCATOR_RESERVE_BYTES, kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S)

    elif visible:
        groups: dict[tuple[str, int | None], _GpuGroup] = {}
        for g in visible:
            mem = g.memory_total_bytes
            if g.mig_enabled and g.mig_devices and g.mig_devices[0].memory_total_bytes:
                mem = g.mig_devices[0].memory_total_bytes
            groups.setdefault((g.name, mem), _GpuGroup([], memory=mem)).gpus.append(g)
        cuda_ok = torch is not None and torch.cuda.is_available()
        if torch is not None and not cuda_ok:
            notes.append(f"torch {torch.__version__} has no usable CUDA: GPU figures are datasheet/NVML values, not measured")
        ctx_measured: list[int] = []
        launch_measured: list[float] = []
        link_measured: dict[str, float] = {}
        for (name, mem), grp in groups.items():
            first = grp.gpus[0]
            grp.cc = first.compute_capability
            if any(_norm_gpu_name(u) in _norm_gpu_name(name) for u in UNIFIED_NVIDIA_GPUS):
                unified = True
                if grp.memory is None:
                    grp.memory = host.effective_ram_bytes
                    notes.append(f"{name}: unified memory; GPU memory = all of RAM ({format_bytes(grp.memory)}), shared with the CPU")
            if cuda_ok:
                torch_index = _torch_index_for(torch, first, visible.index(first))
                dev = f"cuda:{torch_index}"
                say(f"measuring {name} ({dev})")
                try:
                    res = _measure_cuda_device(torch, dev, first, say)
                    readings.setdefault("torch_devices", {})[dev] = {
                        k: res[k] for k in ("name", "cc", "sm_count", "total_memory", "free_memory", "context_bytes")
                    }
                    for k, m in res["measurements"].items():
                        measurements[f"gpu{torch_index}_{k}"] = m
                    grp.bandwidth = res["measurements"]["memory_bandwidth"].value
                    grp.flops = res["measurements"]["bf16_matmul"].value
                    grp.cc = grp.cc or res["cc"]
                    grp.memory = grp.memory or res["total_memory"]
                    if res.get("context_bytes") is not None:
                        ctx_measured.append(res["context_bytes"])
                    launch_measured.append(res["measurements"]["kernel_launch"].value)
                    for k in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"):
                        if k in res["measurements"]:
                            link_measured.setdefault(k, res["measurements"][k].value)
                    notes.extend(res["notes"])
                    gpu_measured = True
                except Exception as e:
                    notes.append(f"{name}: measurement failed ({type(e).__name__}: {e}); using datasheet/NVML figures")
            if grp.bandwidth is None or grp.flops is None:
                _fill_from_datasheet_or_nvml(grp, name, notes)
            if grp.memory is None:
                raise RuntimeError(f"{name}: GPU memory size unreadable (NVML and torch both failed)")
            gpus.append(
                GPUSpec(
                    name=name,
                    memory_bytes=int(grp.memory),
                    memory_bandwidth_bytes_per_s=_bw(grp.bandwidth or 0.0),
                    bf16_flops=_fl(grp.flops or 0.0),
                    count=len(grp.gpus),
                    compute_capability=grp.cc,
                )
            )
        if not unified:
            link = _build_link(visible[0], link_measured, notes)
        ctx = max(ctx_measured) if ctx_measured else DEFAULT_CUDA_CONTEXT_BYTES
        launch = statistics.median(launch_measured) if launch_measured else DEFAULT_KERNEL_LAUNCH_S
        if not ctx_measured:
            notes.append(f"CUDA context {format_bytes(ctx)} is a typical figure, not measured")
        if not launch_measured:
            notes.append(f"kernel launch latency {launch * 1e6:g} us is a typical figure, not measured")
        notes.append(f"allocator reserve {format_bytes(DEFAULT_ALLOCATOR_RESERVE_BYTES)} is vramplan's default, not measured")
        overheads = Overheads(
            cuda_context_bytes=_round_bytes(ctx),
            allocator_reserve_bytes=DEFAULT_ALLOCATOR_RESERVE_BYTES,
            kernel_launch_s=_sec(launch),
        )
    else:
        notes.append("no GPU visible: CPU-only profile (no link, zero GPU overheads)")

    # -- assemble -------------------------------------------------------------
    measured = (not quick) and torch is not None and (not gpus or gpu_measured)
    today = _dt.date.today().isoformat()
    versions = f"vramplan {_vramplan_version()}"
    if torch is not None:
        versions += f", torch {torch.__version__}"
    versions += f", driver {driver}" if driver else ", no NVIDIA driver"
    if cuda_driver:
        versions += f", CUDA {cuda_driver}"
    if quick:
        source = f"quick probe by vramplan on {today} ({versions}): read, not measured, except RAM bandwidth; see notes"
    else:
        source = f"measured by vramplan probe on {today} ({versions})"
    gpu_desc = ", ".join(f"{g.count}x {g.name} {format_bytes(g.memory_bytes)}" for g in gpus) or "no GPU"
    description = (
        f"{host.hostname}: {gpu_desc}; {host.cpu_model or host.machine}, {host.effective_cores} cores, "
        f"{format_bytes(host.effective_ram_bytes)} RAM"
    )
    profile = HardwareProfile(
        schema_version=SCHEMA_VERSION,
        name="this-machine",
        description=description,
        source=source,
        gpus=tuple(gpus),
        host=host_spec,
        link=link,
        overheads=overheads,
        unified_memory=unified,
        measured=measured,
        notes=tuple(notes),
    )
    elapsed = time.perf_counter() - t_start
    readings["measurements"] = {k: m.as_dict() for k, m in measurements.items()}
    readings["timings_s"] = timings
    readings["elapsed_s"] = round(elapsed, 3)
    return ProbeResult(profile=profile, readings=readings, notes=tuple(notes), quick=quick, elapsed_s=elapsed)


def _fill_from_datasheet_or_nvml(grp: _GpuGroup, name: str, notes: list[str]) -> None:
    first = grp.gpus[0]
    sheet = match_datasheet(name, grp.memory)
    if sheet is not None:
        spec, prof_name = sheet
        grp.bandwidth = grp.bandwidth or spec.memory_bandwidth_bytes_per_s
        grp.flops = grp.flops or spec.bf16_flops
        grp.cc = grp.cc or spec.compute_capability
        notes.append(
            f"{name}: memory bandwidth {format_bandwidth(grp.bandwidth)} and bf16 compute {format_flops(grp.flops)} "
            f"are datasheet figures from the shipped profile {prof_name!r}, not measured"
        )
        return
    if grp.bandwidth is None:
        bw = first.nvml_peak_bandwidth_bytes_per_s
        if bw is not None:
            grp.bandwidth = bw
            notes.append(
                f"{name}: memory bandwidth {format_bandwidth(bw)} derived from NVML: {first.memory_clock_max_mhz} MHz x 2 x "
                f"{first.memory_bus_width_bits} bit (theoretical peak, no datasheet match)"
            )
        else:
            grp.bandwidth = 300e9
            notes.append(f"{name}: memory bandwidth unknown (no datasheet match, NVML clock/bus width unreadable): assumed 300 GB/s")
    if grp.flops is None:
        est = estimate_gpu_bf16_flops(first)
        if est is not None:
            grp.flops, how = est
            notes.append(how)
        else:
            grp.flops = grp.bandwidth * GPU_FLOPS_PER_BYTE_GUESS
            notes.append(
                f"{name}: bf16 compute unknown: guessed {format_flops(grp.flops)} = {GPU_FLOPS_PER_BYTE_GUESS:g} FLOP per byte "
                "of memory bandwidth; run `vramplan probe` (full) to measure"
            )


def _build_link(first: NvmlGpu, measured: dict[str, float], notes: list[str]) -> LinkSpec:
    gen, width = first.pcie_gen_max, first.pcie_width_max
    typical = typical_link(gen, width)
    name = f"PCIe {gen}.0 x{width}" if gen and width else "host link (PCIe generation unreadable)"
    if gen and width and first.pcie_gen_current and first.pcie_width_current and first.pcie_width_current < width:
        notes.append(f"GPU {first.index}: link runs at x{first.pcie_width_current} now (max x{width})")
    if len(measured) == 4:
        return LinkSpec(
            name=name,
            h2d_pinned_bytes_per_s=_bw(measured["h2d_pinned"]),
            h2d_pageable_bytes_per_s=_bw(measured["h2d_pageable"]),
            d2h_pinned_bytes_per_s=_bw(measured["d2h_pinned"]),
            d2h_pageable_bytes_per_s=_bw(measured["d2h_pageable"]),
        )
    if typical is not None:
        link, note = typical
        notes.append(note)
        return link
    fallback = typical_link(4, 16)
    assert fallback is not None
    notes.append(f"PCIe generation/width unreadable: assumed PCIe 4.0 x16 typical figures ({format_bandwidth(fallback[0].h2d_pinned_bytes_per_s)} pinned)")
    return dataclasses.replace(fallback[0], name=name)


def _gpus_from_torch(torch: Any) -> list[NvmlGpu]:
    """What torch knows about its CUDA devices, in NvmlGpu form (when NVML is missing)."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = getattr(props, "uuid", None)
        gpus.append(
            NvmlGpu(
                index=i,
                name=props.name,
                uuid=f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith(("GPU-", "MIG-")) else (str(uuid) if uuid else None),
                memory_total_bytes=int(props.total_memory),
                compute_capability=f"{props.major}.{props.minor}",
            )
        )
    return gpus


def _torch_index_for(torch: Any, gpu: NvmlGpu, position: int) -> int:
    """torch's index of an NVML GPU: by UUID when torch exposes it, else its visible position."""
    if gpu.uuid:
        want = gpu.uuid.lower().removeprefix("gpu-")
        for i in range(torch.cuda.device_count()):
            uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
            if uuid is not None and str(uuid).lower().removeprefix("gpu-") == want:
                return i
    return position


def _measure_cuda_device(torch: Any, dev: str, nvml_gpu: NvmlGpu, say: Progress) -> dict[str, Any]:
    """Everything measured on one CUDA device; the context cost is taken last (after cuBLAS loads)."""
    notes: list[str] = []
    idx = int(dev.split(":")[1])
    pid = os.getpid()
    fresh = not torch.cuda.is_initialized()
    used_before = nvml_used_memory(nvml_gpu.uuid) if fresh else None
    props = torch.cuda.get_device_properties(idx)
    free, total = torch.cuda.mem_get_info(idx)
    m: dict[str, Measurement] = {}
    nbytes = int(min(1 * GiB, free // 4)) // MiB * MiB
    say(f"{dev}: memory bandwidth")
    m["memory_bandwidth"] = measure_gpu_memory_bandwidth(torch, dev, nbytes)
    say(f"{dev}: host link")
    m.update(measure_host_link(torch, dev, min(256 * MiB, nbytes)))
    say(f"{dev}: bf16 matmul")
    m["bf16_matmul"] = measure_gpu_matmul_bf16(torch, dev)
    say(f"{dev}: kernel launch latency")
    m["kernel_launch"] = measure_kernel_launch(torch, dev)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(idx)
    context = None
    own = nvml_process_memory(nvml_gpu.uuid, pid)
    if own is not None:
        context = own - reserved
        notes.append(
            f"{dev}: CUDA context + libraries {format_bytes(context)} measured (NVML memory of this process minus torch's reserved pool)"
        )
    elif used_before is not None:
        used_after = nvml_used_memory(nvml_gpu.uuid)
        if used_after is not None:
            context = used_after - used_before - reserved
            notes.append(f"{dev}: CUDA context {format_bytes(context)} measured as the device's used memory before/after")
    if context is None or context <= 0:
        context = None
        notes.append(f"{dev}: CUDA context cost could not be measured (process memory hidden from NVML)")
    m_ctx = Measurement("cuda_context", float(context), "B", (float(context),), "NVML") if context else None
    if m_ctx:
        m["cuda_context"] = m_ctx
    return {
        "measurements": m,
        "name": props.name,
        "free_memory": int(free),
        "cc": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "total_memory": int(total),
        "context_bytes": context,
        "notes": notes,
    }
