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

from importlib import import_module

# Each name and the module that defines it. They are imported when first used: importing one module of the package
# (this_machine needs host's fingerprint to find its cached probe) does not import the others (NVML's, the
# measurements, the datasheets), which `vramplan plan` does not need.
_WHERE = {
    "ProbeResult": "core", "probe": "core",
    "DEFAULT_ALLOCATOR_RESERVE_BYTES": "datasheets", "DEFAULT_CUDA_CONTEXT_BYTES": "datasheets",
    "DEFAULT_KERNEL_LAUNCH_S": "datasheets", "match_datasheet": "datasheets", "typical_link": "datasheets",
    "HostReading": "host", "estimate_cpu_flops": "host", "machine_fingerprint": "host",
    "parse_cgroup_cpu_max": "host", "parse_cgroup_memory_value": "host", "parse_cpuinfo": "host",
    "read_cgroup_cpu": "host", "read_cgroup_memory": "host", "read_host": "host",
    "Measurement": "measure", "measure_cpu_matmul": "measure", "measure_ram_bandwidth": "measure",
    "MigDevice": "nvml", "NvmlGpu": "nvml", "NvmlUnavailable": "nvml", "filter_visible": "nvml",
    "parse_nvml_gpu": "nvml", "read_nvml": "nvml",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)
