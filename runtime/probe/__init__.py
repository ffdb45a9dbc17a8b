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

Modules: `nvml` (the driver's answers), `host` (RAM, cores, cgroups), `measure` (timed
measurements), `datasheets` (typical figures where nothing is measured), `core` (the probe).
Layers: `read_*` functions return plain dataclasses; `parse_*` functions turn raw answers
(NVML's bytes-or-str names, NOT_SUPPORTED errors, cgroup files) into values and are unit
tested with fake answers; `measure_*` functions return a Measurement; `build_profile`
turns all of it into a HardwareProfile. Nothing here imports torch at module level.
"""

from .core import ProbeResult, probe
from .datasheets import (DEFAULT_ALLOCATOR_RESERVE_BYTES, DEFAULT_CUDA_CONTEXT_BYTES, DEFAULT_KERNEL_LAUNCH_S,
                         match_datasheet, typical_link)
from .host import (HostReading, estimate_cpu_bf16_flops, machine_fingerprint, parse_cgroup_cpu_max,
                   parse_cgroup_memory_value, parse_cpuinfo, read_cgroup_cpu, read_cgroup_memory, read_host)
from .measure import Measurement, measure_ram_bandwidth
from .nvml import MigDevice, NvmlGpu, NvmlUnavailable, filter_visible, parse_nvml_gpu, read_nvml

__all__ = [
    "DEFAULT_ALLOCATOR_RESERVE_BYTES", "DEFAULT_CUDA_CONTEXT_BYTES", "DEFAULT_KERNEL_LAUNCH_S", "HostReading",
    "Measurement", "MigDevice", "NvmlGpu", "NvmlUnavailable", "ProbeResult", "estimate_cpu_bf16_flops",
    "filter_visible", "machine_fingerprint", "match_datasheet", "measure_ram_bandwidth", "parse_cgroup_cpu_max",
    "parse_cgroup_memory_value", "parse_cpuinfo", "parse_nvml_gpu", "probe", "read_cgroup_cpu", "read_cgroup_memory",
    "read_host", "read_nvml", "typical_link",
]
