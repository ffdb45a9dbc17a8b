"""The probe itself: read, measure, and assemble a HardwareProfile."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from vramplan.planner.hardware import (CPU_DECODE_KERNELS, SCHEMA_VERSION, GPUSpec, HardwareProfile, HostSpec, LinkSpec,
                                       Overheads)
from vramplan.planner.units import (GiB, MiB, format_bandwidth, format_bytes, format_flops, parse_bandwidth,
                                    parse_flops, parse_seconds)
from .datasheets import (APPLE_CHIPS, DEFAULT_ALLOCATOR_RESERVE_BYTES, DEFAULT_CUDA_CONTEXT_BYTES,
                         DEFAULT_KERNEL_LAUNCH_S, GPU_FLOPS_PER_BYTE_GUESS, UNIFIED_NVIDIA_GPUS, _apple_chip,
                         norm_gpu_name, apple_gpu_share, estimate_gpu_bf16_flops, match_datasheet, typical_link)
from .host import (INT8_DOT_FLAGS, NATIVE_BF16_FLAGS, NO_INT8_DOT_DYNAMIC_RAM_SHARE, W4A8_FLAGS, W4A8_RAM_SHARE,
                   busy_note, c_compiler, estimate_cpu_flops, load_average, read_host)
from .measure import (Measurement, measure_cpu_decode_kernels, measure_cpu_expert_call, measure_cpu_layer_costs,
                      measure_cpu_matmul, measure_gpu_matmul_bf16, measure_gpu_memory_bandwidth, measure_host_link,
                      measure_kernel_launch, measure_ram_bandwidth)
from .measure import FULL_RAM_COPY_BYTES, FULL_REPEATS, QUICK_RAM_COPY_BYTES, QUICK_RAM_REPEATS
from .nvml import NvmlGpu, NvmlUnavailable, filter_visible, nvml_process_memory, nvml_used_memory, read_nvml

Progress = Callable[[str], None]

@dataclass(frozen=True)
class ProbeResult:
    profile: HardwareProfile
    readings: dict[str, Any]  # everything read and measured, JSON-serialisable
    notes: tuple[str, ...]
    quick: bool
    elapsed_s: float


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


def _quick_bf16_sample(host, measurements: dict, notes: list, say) -> float | None:
    """On a CPU with AVX512-BF16 or AMX the flags do not decide the bf16 rate torch reaches (on a 2-core AMX Xeon VM
    the flags said 1.6 TFLOPS, the full probe measured 0.28 and a plain matmul 0.57): the quick probe samples one
    product (CPU_MATMUL_TARGET_S, about 50 ms, plus torch's import) where torch is installed. None without torch."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    say("sampling a CPU bf16 matmul (native bf16: the flags do not decide its rate)")
    try:
        torch = __import__("torch")
        m = measure_cpu_matmul(torch, "bf16", repeats=3)
    except Exception as e:
        notes.append(f"CPU bf16 matmul not sampled ({type(e).__name__}: {e})")
        return None
    measurements["cpu_bf16_matmul"] = m
    flags = "/".join(sorted(NATIVE_BF16_FLAGS & set(host.cpu_flags)))
    notes.append(f"CPU bf16 compute {format_flops(m.value)} sampled by the quick probe ({flags}: the flags do not "
                 f"decide what torch reaches): {m.method}")
    return m.value


def probe(quick: bool = False, progress: Progress | None = None, sample_cpu: bool = True) -> ProbeResult:
    """Read (and unless quick, measure) this machine; return its HardwareProfile and readings. `sample_cpu` False: a
    quick probe without its timed bf16 sample (no torch imported), for a check of what the machine has."""
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
    if (cvd and len(visible) > 1 and len({g.name for g in visible}) > 1
            and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"):
        notes.append("mixed GPUs and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers devices fastest-first, NVML by "
                     "PCI bus")

    say("reading host (psutil, cgroups)")
    load_before = load_average()  # before our own measurements add to it
    host = timed("host", read_host)
    readings["host"] = dataclasses.asdict(host)
    readings["load_average_1m"] = load_before
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
            notes.append(f"GPU {g.index}: {format_bytes(g.memory_used_bytes)} in use right now (by whom: hidden from "
                         "NVML)")

    # -- torch (full mode only) ------------------------------------------------
    torch = None
    if not quick:
        say("importing torch")
        try:
            torch = timed("import_torch", lambda: __import__("torch"))
            readings["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                                 "threads": torch.get_num_threads()}
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
        size, repeats = (QUICK_RAM_COPY_BYTES, QUICK_RAM_REPEATS) if quick else (FULL_RAM_COPY_BYTES, FULL_REPEATS)
        measurements["ram_bandwidth"] = timed("ram_bandwidth", lambda: measure_ram_bandwidth(
            size, repeats, threads=host.effective_cores))
    except Exception as e:  # MemoryError in a tight container
        notes.append(f"RAM bandwidth not measured ({type(e).__name__}: {e})")
    ram_bw = measurements["ram_bandwidth"].value if "ram_bandwidth" in measurements else None
    if ram_bw is not None:
        notes.append(f"RAM bandwidth {format_bandwidth(ram_bw)} measured: {measurements['ram_bandwidth'].method}")
        busy = busy_note(load_before, host.effective_cores, "the RAM bandwidth and CPU compute measured")
        if busy:
            notes.append(busy)
    else:
        ram_bw = 10e9
        notes.append("RAM bandwidth unknown: assumed 10 GB/s")

    cpu_rates: dict[str, float | None] = {}
    for kind in ("bf16", "fp32", "int8"):
        rate = None
        if torch is not None:
            say(f"measuring CPU {kind} matmul")
            name = f"cpu_{kind}_matmul"
            try:
                measurements[name] = timed(name, lambda: measure_cpu_matmul(torch, kind))
                rate = measurements[name].value
                notes.append(f"CPU {kind} compute {format_flops(rate)} measured: {measurements[name].method}")
            except Exception as e:
                notes.append(f"CPU {kind} matmul not measured ({type(e).__name__}: {e})")
        if rate is None and quick and sample_cpu and kind == "bf16" and NATIVE_BF16_FLAGS & set(host.cpu_flags):
            rate = _quick_bf16_sample(host, measurements, notes, say)
        if rate is None:
            rate, how = estimate_cpu_flops(host, kind)
            notes.append(how)
        cpu_rates[kind] = rate

    decode: dict[str, float] = {}
    paths: dict[str, str] = {}
    if torch is None and "avx2" in host.cpu_flags and not INT8_DOT_FLAGS & set(host.cpu_flags):
        decode["int8_dynamic"] = NO_INT8_DOT_DYNAMIC_RAM_SHARE * ram_bw
        paths["int8_dynamic"] = "fbgemm"
        notes.append(f"CPU int8 x int8 decode (quanto-w8a8's kernel) estimated at "
                     f"{format_bandwidth(decode['int8_dynamic'])} by fbgemm's path: no int8 dot-product instructions "
                     f"(VNNI) in the CPU's flags, where fbgemm streams about {NO_INT8_DOT_DYNAMIC_RAM_SHARE:.3f} of "
                     "the RAM bandwidth (runtime.probe.host.NO_INT8_DOT_DYNAMIC_RAM_SHARE); `vramplan probe` times it")
    if torch is None and W4A8_FLAGS <= set(host.cpu_flags) and c_compiler() is not None:  # (x86 flags: an x86 CPU)
        decode["int4_a8"] = W4A8_RAM_SHARE * ram_bw
        notes.append(f"CPU int4 x int8 decode (cpu-w4a8's kernel) estimated at {format_bandwidth(decode['int4_a8'])}: "
                     f"AVX2 and a C compiler ({c_compiler()}) to build it, where it streams about "
                     f"{W4A8_RAM_SHARE:.3f} of the RAM bandwidth (runtime.probe.host.W4A8_RAM_SHARE); `vramplan probe` "
                     "builds and times it")
    if torch is not None:  # the full probe (the quick one imports no torch): which decode kernel is fast, timed
        say("timing the CPU decode kernels (which is fast depends on the CPU)")
        try:
            kernels, paths = measure_cpu_decode_kernels(torch)
        except Exception as e:  # noqa: BLE001 - a kernel this torch lacks: the scheme keeps its default
            notes.append(f"CPU decode kernels not timed ({type(e).__name__}: {e})")
            kernels, paths = {}, {}
        for name, m in kernels.items():
            measurements[m.name] = m
            if name in CPU_DECODE_KERNELS:
                decode[name] = m.value
        if paths.get("int8_dynamic") == "fbgemm" and cpu_rates.get("int8") is not None:
            try:  # quanto-w8a8's prefill runs by its decode's path: its int8 matmul rate is that path's
                m = measure_cpu_matmul(torch, "int8", path="fbgemm")
                measurements["cpu_int8_matmul"] = m
                cpu_rates["int8"] = m.value
                notes.append(f"CPU int8 compute {format_flops(m.value)} by fbgemm, the int8 x int8 path the runtime "
                             f"takes here: {m.method}")
            except Exception as e:  # noqa: BLE001 - the _int_mm rate stays
                notes.append(f"CPU int8 matmul by fbgemm not measured ({type(e).__name__}: {e})")
        from vramplan.runtime.cpu_kernel import unavailable as w4a8_unavailable

        if "int4_a8" not in kernels and (why := w4a8_unavailable()):
            notes.append(f"cpu-w4a8 not available: {why}; the planner refuses it here")
        if kernels:
            notes.append("CPU decode kernels timed (weights streamed at one row): " + ", ".join(
                f"{name} {format_bandwidth(m.value)}" for name, m in kernels.items() if name not in paths)
                + "; the runtime runs " + ", ".join(f"{k} by {p}" for k, p in paths.items())
                + ", the faster (runtime.cpu_paths)")

    expert_call = None
    if torch is not None:  # the full probe: what an MoE's routed expert costs a call here, beyond its bytes
        say("timing a routed expert's call (MoE)")
        try:
            measurements["cpu_expert_call"] = m = measure_cpu_expert_call(torch)
            expert_call = float(f"{m.value:.3g}")
            notes.append(f"CPU routed-expert call {1e6 * m.value:.0f} us measured (eager decode, one token): "
                         f"{m.method}")
        except Exception as e:  # noqa: BLE001 - the speed model's default stays
            notes.append(f"CPU routed-expert call not timed ({type(e).__name__}: {e})")

    layer_costs: dict[str, float] = {}
    if torch is not None:  # the full probe: a decoder layer's fixed cost, per CPU scheme, on this machine
        say("timing a decoder layer's fixed cost per CPU scheme (tiny models)")
        try:
            layers, skipped = timed("cpu_layer_costs", lambda: measure_cpu_layer_costs(torch, paths))
            measurements.update({m.name: m for m in layers.values()})
            layer_costs = {name: float(f"{m.value:.3g}") for name, m in layers.items() if m.value > 0}
            if layer_costs:
                notes.append("CPU decoder layer's fixed cost measured (tiny models, a decode step): " + ", ".join(
                    f"{name} {1e6 * v:.0f} us" for name, v in layer_costs.items()))
            notes.extend(f"CPU decoder layer's fixed cost of {name} not timed ({why}): the speed model's default"
                         for name, why in skipped.items())
        except Exception as e:  # noqa: BLE001 - the speed model's defaults stay
            notes.append(f"CPU decoder layer's fixed cost not timed ({type(e).__name__}: {e})")

    host_spec = HostSpec(
        ram_bytes=host.effective_ram_bytes,
        ram_bandwidth_bytes_per_s=_bw(ram_bw),
        cpu_cores=host.effective_cores,
        cpu_bf16_flops=_fl(cpu_rates["bf16"]),
        cpu_fp32_flops=None if cpu_rates["fp32"] is None else _fl(cpu_rates["fp32"]),
        cpu_int8_ops=None if cpu_rates["int8"] is None else _fl(cpu_rates["int8"]),
        **{f"cpu_decode_{name}_bytes_per_s": _bw(rate) for name, rate in decode.items()},
        **{f"cpu_decode_{name}_path": path for name, path in paths.items()},
        cpu_expert_call_s=expert_call,
        **{f"cpu_layer_{name}_s": v for name, v in layer_costs.items()},
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
            f"Apple silicon ({chip or host.cpu_model or 'unknown chip'}): unified memory; GPU memory = {share:.0%} of "
            f"RAM (macOS default GPU working-set limit); bandwidth and GPU compute are "
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
            GPUSpec(name=f"Apple {chip} GPU" if chip else "Apple GPU", memory_bytes=mem,
                    memory_bandwidth_bytes_per_s=_bw(bw), bf16_flops=_fl(fl))
        )
        overheads = Overheads(cuda_context_bytes=0, allocator_reserve_bytes=DEFAULT_ALLOCATOR_RESERVE_BYTES,
                              kernel_launch_s=DEFAULT_KERNEL_LAUNCH_S)

    elif visible:
        groups: dict[tuple[str, int | None], _GpuGroup] = {}
        for g in visible:
            mem = g.memory_total_bytes
            if g.mig_enabled and g.mig_devices and g.mig_devices[0].memory_total_bytes:
                mem = g.mig_devices[0].memory_total_bytes
            groups.setdefault((g.name, mem), _GpuGroup([], memory=mem)).gpus.append(g)
        # NVML's used memory before this process touches CUDA: the fallback measure of the CUDA context's
        # cost. Read first: get_device_properties (and every later call) creates the context.
        used_before = ({g.uuid: nvml_used_memory(g.uuid) for g in visible}
                       if torch is not None and not torch.cuda.is_initialized() else {})
        cuda_ok = torch is not None and torch.cuda.is_available()
        if torch is not None and not cuda_ok:
            notes.append(f"torch {torch.__version__} has no usable CUDA: GPU figures are datasheet/NVML values, not "
                         "measured")
        ctx_measured: list[int] = []
        launch_measured: list[float] = []
        link_measured: dict[str, float] = {}
        for (name, mem), grp in groups.items():
            first = grp.gpus[0]
            grp.cc = first.compute_capability
            if any(norm_gpu_name(u) in norm_gpu_name(name) for u in UNIFIED_NVIDIA_GPUS):
                unified = True
                if grp.memory is None:
                    grp.memory = host.effective_ram_bytes
                    notes.append(f"{name}: unified memory; GPU memory = all of RAM ({format_bytes(grp.memory)}), "
                                 "shared with the CPU")
            if cuda_ok:
                torch_index = _torch_index_for(torch, first, visible.index(first))
                dev = f"cuda:{torch_index}"
                say(f"measuring {name} ({dev})")
                try:
                    res = _measure_cuda_device(torch, dev, first, say, used_before.get(first.uuid))
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
        notes.append(f"allocator reserve {format_bytes(DEFAULT_ALLOCATOR_RESERVE_BYTES)} is vramplan's default, not "
                     "measured")
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
                f"{name}: memory bandwidth {format_bandwidth(bw)} derived from NVML: {first.memory_clock_max_mhz} MHz "
                f"x 2 x {first.memory_bus_width_bits} bit (theoretical peak, no datasheet match)"
            )
        else:
            grp.bandwidth = 300e9
            notes.append(f"{name}: memory bandwidth unknown (no datasheet match, NVML clock/bus width unreadable): "
                         "assumed 300 GB/s")
    if grp.flops is None:
        est = estimate_gpu_bf16_flops(first)
        if est is not None:
            grp.flops, how = est
            notes.append(how)
        else:
            grp.flops = grp.bandwidth * GPU_FLOPS_PER_BYTE_GUESS
            notes.append(
                f"{name}: bf16 compute unknown: guessed {format_flops(grp.flops)} = {GPU_FLOPS_PER_BYTE_GUESS:g} FLOP "
                "per byte of memory bandwidth; run `vramplan probe` (full) to measure"
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
    notes.append("PCIe generation/width unreadable: assumed PCIe 4.0 x16 typical figures "
                 f"({format_bandwidth(fallback[0].h2d_pinned_bytes_per_s)} pinned)")
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
                uuid=(f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith(("GPU-", "MIG-"))
                      else (str(uuid) if uuid else None)),
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


def _measure_cuda_device(torch: Any, dev: str, nvml_gpu: NvmlGpu, say: Progress,
                         used_before: int | None) -> dict[str, Any]:
    """Everything measured on one CUDA device; the context cost is taken last (after cuBLAS loads).
    `used_before`: NVML's used memory of the device before this process created a CUDA context (or None)."""
    notes: list[str] = []
    idx = int(dev.split(":")[1])
    pid = os.getpid()
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
            f"{dev}: CUDA context + libraries {format_bytes(context)} measured (NVML memory of this process minus "
            "torch's reserved pool)"
        )
    elif used_before is not None:
        used_after = nvml_used_memory(nvml_gpu.uuid)
        if used_after is not None:
            context = used_after - used_before - reserved
            notes.append(f"{dev}: CUDA context {format_bytes(context)} measured as the device's used memory "
                         "before/after")
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
