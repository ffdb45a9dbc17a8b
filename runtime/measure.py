"""Measuring a run: peak host and GPU memory over a window, and synchronized wall time.

Every reading tolerates a machine without a GPU, without NVML, or where NVML cannot see
this process (containers with their own PID namespace): the value is then None.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import dataclass

import psutil
import torch

DEFAULT_SAMPLE_INTERVAL_S = 0.005
CLOCK_SAMPLE_INTERVAL_S = 0.05  # the GPU's SM clock is read every this many seconds (one NVML call)


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device``'s current stream; a no-op for the CPU or None.

    The current stream, not the whole device: the offload engine's side stream may be prefetching the
    next forward's first layer, and that copy is not part of the step being timed."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# What out-of-memory looks like when it is not a torch.OutOfMemoryError: cuBLAS failing to allocate its
# workspace, a raw CUDA error string, the CPU allocator.
OOM_MESSAGES = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation")


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` means a device or host ran out of memory (the run re-plans), not a bug or a missing feature."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, MemoryError):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in message for m in OOM_MESSAGES)


def free_memory() -> None:
    """Hand back what dropped objects held: collect reference cycles (bnb's 4-bit weights point back at their
    module, the offload engine and its wrappers at each other), then empty torch's CUDA cache."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_free_bytes(device: int | None = None) -> int | None:
    """What the CUDA device has free now (cudaMemGetInfo: what every process left), or None without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.mem_get_info(device)[0])


class Timer:
    """Wall time of a block, with CUDA synchronized on entry and exit when a CUDA device is given.

    >>> with Timer("cuda:0") as t: ...
    >>> t.elapsed_s
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.start_s: float | None = None
        self.elapsed_s: float | None = None

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self.start_s = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.elapsed_s = time.perf_counter() - self.start_s


@dataclass(frozen=True, kw_only=True)
class MemoryPeaks:
    """Peaks over one sampled window, in bytes; None where the source is unavailable.

    peak_rss_bytes: the largest process RSS seen by the sampler, raised to
        ru_maxrss at the end when ru_maxrss grew during the window (then the lifetime
        peak was reached inside the window, so it is this window's exact peak, even one
        shorter than the sampling interval).
    lifetime_max_rss_bytes: ru_maxrss at the end of the window (the process' lifetime
        peak, which may predate the window).
    peak_vram_bytes: max(peak_torch_reserved_bytes + cuda_context_bytes,
        peak_nvml_process_bytes), with a missing term left out; None without CUDA.
        NVML's per-process figure includes the CUDA context and non-torch allocations;
        torch's reserved figure does not, hence the context estimate (from the probe).
    """

    peak_rss_bytes: int
    start_rss_bytes: int
    lifetime_max_rss_bytes: int
    peak_torch_reserved_bytes: int | None
    peak_nvml_process_bytes: int | None
    cuda_context_bytes: int | None
    peak_vram_bytes: int | None
    # of the highest RSS sampled, the pages mapped from files or shared (RssFile + RssShmem): a checkpoint's
    # safetensors read through mmap are counted in RSS, yet clean and dropped by the kernel under pressure, unlike the
    # anonymous memory a plan budgets (psutil's `shared`, from /proc/self/statm). None where it is missing (not Linux).
    peak_rss_file_bytes: int | None = None

    @property
    def rss_delta_bytes(self) -> int:
        return self.peak_rss_bytes - self.start_rss_bytes


def rss_split(process: psutil.Process) -> tuple[int, int | None]:
    """This process's RSS and its file-backed / shared part (RssFile + RssShmem: psutil's `shared`, from
    /proc/self/statm), in bytes; the part None where psutil does not report it (not Linux)."""
    info = process.memory_info()
    return info.rss, getattr(info, "shared", None)


def _ru_maxrss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # Linux reports KiB


class _NvmlProcessMemory:
    """Used GPU memory of this process on one device through NVML, or None."""

    def __init__(self, device: torch.device):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
            uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
            if uuid is not None:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            else:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # noqa: BLE001 - no NVML is a normal condition
            self.handle = None

    def read(self) -> int | None:
        if self.handle is None:
            return None
        try:
            processes = self._pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:  # noqa: BLE001
            return None
        used = [p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory is not None]
        return sum(used) if used else None

    def sm_clock_mhz(self) -> int | None:
        """The device's SM clock now (MHz), or None."""
        if self.handle is None:
            return None
        try:
            return int(self._pynvml.nvmlDeviceGetClockInfo(self.handle, self._pynvml.NVML_CLOCK_SM))
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        if self.handle is not None:
            try:
                self._pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass


class PeakMemorySampler:
    """Context manager sampling RSS (and NVML process memory on CUDA) every ``interval_s``.

    >>> with PeakMemorySampler(device="cuda:0", cuda_context_bytes=500 << 20) as sampler:
    ...     run()
    >>> sampler.result.peak_vram_bytes
    """

    def __init__(self, *, device: torch.device | str | None = None,
                 interval_s: float = DEFAULT_SAMPLE_INTERVAL_S, cuda_context_bytes: int | None = None):
        device = torch.device(device) if device is not None else None
        self.cuda_device = (device if device is not None and device.type == "cuda" and torch.cuda.is_available()
                            else None)
        self.interval_s = interval_s
        self.cuda_context_bytes = cuda_context_bytes
        self.result: MemoryPeaks | None = None
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: _NvmlProcessMemory | None = None
        self._peak_rss = 0
        self._peak_rss_file: int | None = None  # the file-backed part at that peak
        self._peak_nvml: int | None = None
        self._split_reserved: int | None = None  # torch's peak before a split()
        self.sm_clocks: list[tuple[float, int]] = []  # (perf_counter, MHz) on CUDA where NVML reads the clock

    def _sample(self) -> None:
        rss, mapped = rss_split(self._process)
        if rss >= self._peak_rss:
            self._peak_rss, self._peak_rss_file = rss, mapped
        if self._nvml is not None:
            used = self._nvml.read()
            if used is not None:
                self._peak_nvml = used if self._peak_nvml is None else max(self._peak_nvml, used)
            now = time.perf_counter()
            if not self.sm_clocks or now - self.sm_clocks[-1][0] >= CLOCK_SAMPLE_INTERVAL_S:
                mhz = self._nvml.sm_clock_mhz()
                if mhz is not None:
                    self.sm_clocks.append((now, mhz))

    def sm_clock_mhz(self, since: float) -> tuple[int, int] | None:
        """The lowest and the median SM clock (MHz) sampled from perf_counter() ``since`` on, or None. A GPU's clock
        falls when it idles (345 MHz on an idle H200, 1980 under load); eager decode, bound by the host, leaves it
        idle between kernels: a run's clock says whether the GPU ran at its speed."""
        clocks = sorted(mhz for t, mhz in self.sm_clocks if t >= since)
        return (clocks[0], clocks[len(clocks) // 2]) if clocks else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakMemorySampler":
        if self.cuda_device is not None:
            synchronize(self.cuda_device)
            torch.cuda.reset_peak_memory_stats(self.cuda_device)
            self._nvml = _NvmlProcessMemory(self.cuda_device)
        self._start_maxrss = _ru_maxrss_bytes()
        self._start_rss, self._peak_rss_file = rss_split(self._process)
        self._peak_rss = self._start_rss
        self._sample()
        self._thread = threading.Thread(target=self._run, name="vramplan-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def split(self) -> int | None:
        """Peak VRAM so far (torch's reserved pool + the CUDA context, or NVML's figure for this process if higher),
        then torch's peak starts again from here: what loading took apart from what running takes. The window's
        result still covers both (its torch term is the larger of the two). None without CUDA."""
        if self.cuda_device is None:
            return None
        synchronize(self.cuda_device)
        reserved = torch.cuda.max_memory_reserved(self.cuda_device)
        self._split_reserved = max(self._split_reserved or 0, reserved)
        torch.cuda.reset_peak_memory_stats(self.cuda_device)
        terms = [reserved + (self.cuda_context_bytes or 0)] + ([self._peak_nvml] if self._peak_nvml else [])
        return max(terms)

    def __exit__(self, *exc) -> None:
        torch_reserved = None
        if self.cuda_device is not None:
            synchronize(self.cuda_device)
            torch_reserved = max(torch.cuda.max_memory_reserved(self.cuda_device), self._split_reserved or 0)
        self._stop.set()
        self._thread.join()
        self._sample()
        end_maxrss = _ru_maxrss_bytes()
        peak_rss = self._peak_rss
        if end_maxrss > self._start_maxrss:
            peak_rss = max(peak_rss, end_maxrss)
        if self._nvml is not None:
            self._nvml.close()
        vram_terms = []
        if torch_reserved is not None:
            vram_terms.append(torch_reserved + (self.cuda_context_bytes or 0))
        if self._peak_nvml is not None:
            vram_terms.append(self._peak_nvml)
        self.result = MemoryPeaks(
            peak_rss_bytes=peak_rss,
            start_rss_bytes=self._start_rss,
            lifetime_max_rss_bytes=end_maxrss,
            peak_torch_reserved_bytes=torch_reserved,
            peak_nvml_process_bytes=self._peak_nvml,
            cuda_context_bytes=self.cuda_context_bytes,
            peak_vram_bytes=max(vram_terms) if vram_terms else None,
            peak_rss_file_bytes=self._peak_rss_file,
        )
