"""NVML: what the driver says about each GPU, from raw answers to values (fakes in tests)."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping


# ---------------------------------------------------------------- named constants (echoed in notes)

NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NOT_FOUND = 6
NVML_DEVICE_MIG_ENABLE = 1
NVML_CLOCK_SM = 1  # pynvml.NVML_CLOCK_SM
NVML_CLOCK_MEM = 2  # pynvml.NVML_CLOCK_MEM

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


def parse_nvml_gpu(index: int, raw: Mapping[str, Any], system: Mapping[str, Any] | None = None, *,
                   own_pid: int | None = None) -> NvmlGpu:
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
                memory_total_bytes=(as_int(_attr(m_mem, "total"))
                                    if m_mem is not None and not isinstance(m_mem, BaseException) else None),
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
    if (not isinstance(mig, BaseException) and isinstance(mig, (tuple, list)) and mig
            and mig[0] == NVML_DEVICE_MIG_ENABLE):
        devices = []
        count = _call(g("nvmlDeviceGetMaxMigDeviceCount"), handle)
        for i in range(count if isinstance(count, int) else 0):
            h = _call(g("nvmlDeviceGetMigDeviceHandleByIndex"), handle, i)
            if isinstance(h, BaseException):
                continue  # NOT_FOUND: an empty slot
            devices.append({"uuid": _call(g("nvmlDeviceGetUUID"), h), "memory": _call(g("nvmlDeviceGetMemoryInfo"), h)})
        raw["mig_devices"] = devices
    return raw


# The driver's library, as pynvml opens it on every platform but Windows (nvidia-ml-py's _LoadNvmlLibrary).
NVML_LIBRARY = "libnvidia-ml.so.1"


def _import_pynvml() -> Any:
    """pynvml, on a machine whose NVIDIA driver library loads. Where it does not, the answer is pynvml's own (its
    nvmlInit fails with "NVML Shared Library Not Found"), found by opening the same library first: 0.1 ms, where
    importing pynvml costs 8 ms of every `vramplan plan` on a machine without a GPU."""
    if not sys.platform.startswith("win"):
        import ctypes

        try:
            ctypes.CDLL(NVML_LIBRARY)
        except OSError as e:
            raise NvmlUnavailable(f"NVML did not start ({NVML_LIBRARY} does not load: {e}): no NVIDIA driver or GPU "
                                  "here") from None
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
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r} matches {len(hits)} GPUs: ambiguous, list ends "
                             "there")
                break
        if match is None:
            notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r} matches no GPU: CUDA ignores it and the entries after "
                         "it")
            break
        key = (match.index, match.uuid)
        if key in seen:
            notes.append(f"CUDA_VISIBLE_DEVICES lists {token!r} twice; counted once")
            continue
        seen.add(key)
        chosen.append(match)
    return chosen, notes



def _nvml_query(uuid: str | None, query: Callable[[Any, Any], int | None]) -> int | None:
    """query(nvml, handle) on the GPU with this UUID, NVML opened and closed around it; None when NVML or the GPU
    cannot say."""
    if not uuid:
        return None
    try:
        nvml = _import_pynvml()
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        return query(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid))
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def nvml_process_memory(uuid: str | None, pid: int) -> int | None:
    """GPU memory NVML attributes to process `pid` on the GPU with this UUID (None if hidden)."""
    def query(nvml, h):
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
        return None

    return _nvml_query(uuid, query)


def nvml_used_memory(uuid: str | None) -> int | None:
    """GPU memory in use on the GPU with this UUID, by every process."""
    return _nvml_query(uuid, lambda nvml, h: int(nvml.nvmlDeviceGetMemoryInfo(h).used))


