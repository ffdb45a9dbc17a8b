"""Hardware profiles: what a machine has and how fast it is, as plain frozen data.

A HardwareProfile is the planner's whole view of a machine: GPUs (memory, memory
bandwidth, dense bf16 compute), the host (RAM, RAM bandwidth, cores, CPU bf16
compute), the host<->GPU link, fixed overheads and, once `vramplan calibrate` has
run, measured efficiencies. Internal units: bytes, bytes/s, FLOP/s, seconds.

Its YAML form (strict reading, exact writing) lives in planner/profile_yaml.py.
This module is pure: no torch, no hardware access, no files.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import re
from typing import Any, Callable, Mapping

from .errors import ProfileError
from .record import record

SCHEMA_VERSION = 1

# Efficiencies are achieved / peak: physically at most 1. A fit that wants more says that the
# profile's peak is wrong (measured under load, or a datasheet figure below what boost clocks give);
# `vramplan calibrate` then stores 1 and warns instead of writing an impossible number.
MAX_EFFICIENCY = 1.0

DEVICES = ("gpu", "cpu")

# GPUs one profile may hold, over all its GPU entries. A profile is one machine: the largest nodes hold 8 (DGX/HGX
# H100, B200) to 16-20 (dense PCIe servers); several machines are --nodes. 64 leaves room for any real node, while
# refusing a typo like 1000, which would plan and print a column per device.
MAX_GPUS_PER_PROFILE = 64
# A host's cores, at most: the largest machines today have 1,536 (8 sockets x 192); a larger count is a typo.
MAX_CPU_CORES = 16384

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CC_RE = re.compile(r"^[0-9]+\.[0-9]+$")


# ---------------------------------------------------------------- validation helpers
_GPUS_WHY = " GPUs per profile (one machine; several are --nodes)"


class _FieldError(ProfileError):
    """A bad value in one dataclass field; the loader maps `field` to the YAML key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


def _check_int(obj: Any, field: str, *, minimum: int, maximum: int | None = None, why: str = "") -> None:
    v = getattr(obj, field)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _FieldError(field, f"expected an integer, got {v!r}")
    if v < minimum:
        raise _FieldError(field, f"must be at least {minimum}, got {_shown(v)}")
    if maximum is not None and v > maximum:
        raise _FieldError(field, f"must be at most {maximum}{why}, got {_shown(v)}")


def _shown(v: int) -> str:
    """An integer as a message shows it: in full, or by its length when it is absurdly long."""
    digits = len(str(abs(v))) if abs(v) < 10 ** 4000 else None
    return str(v) if digits is not None and digits <= 20 else f"an integer of {digits or 'over 4000'} digits"


def _check_float(obj: Any, field: str, *, positive: bool = True, maximum: float | None = None) -> None:
    v = getattr(obj, field)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _FieldError(field, f"expected a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise _FieldError(field, f"must be finite, got {v}")
    if positive and v <= 0:
        raise _FieldError(field, f"must be positive, got {v:g}")
    if not positive and v < 0:
        raise _FieldError(field, f"must not be negative, got {v:g}")
    if maximum is not None and v > maximum:
        raise _FieldError(field, f"must be at most {maximum:g}, got {v:g}")
    object.__setattr__(obj, field, v)  # normalise ints to float: equality survives a round trip


def _check_str(obj: Any, field: str, *, allow_empty: bool = False) -> None:
    v = getattr(obj, field)
    if not isinstance(v, str):
        raise _FieldError(field, f"expected a string, got {v!r}")
    if not allow_empty and not v.strip():
        raise _FieldError(field, "must not be empty")


def _check_bool(obj: Any, field: str) -> None:
    v = getattr(obj, field)
    if not isinstance(v, bool):
        raise _FieldError(field, f"expected true or false, got {v!r}")


# ---------------------------------------------------------------- the schema


@record(kw_only=True)
class GPUSpec:
    """One kind of GPU in the machine (count of them), with datasheet or measured peaks."""

    name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    bf16_flops: float  # dense bf16 tensor FLOP/s (fp32 accumulate), not the sparsity figure
    count: int = 1
    compute_capability: str | None = None  # "8.9"

    def __post_init__(self) -> None:
        _check_str(self, "name")
        _check_int(self, "memory_bytes", minimum=1)
        _check_float(self, "memory_bandwidth_bytes_per_s")
        _check_float(self, "bf16_flops")
        _check_int(self, "count", minimum=1, maximum=MAX_GPUS_PER_PROFILE, why=_GPUS_WHY)
        cc = self.compute_capability
        if cc is not None and (not isinstance(cc, str) or not _CC_RE.match(cc)):
            raise _FieldError("compute_capability", f'expected "major.minor" like "8.9", got {cc!r}')

    @property
    def total_memory_bytes(self) -> int:
        return self.memory_bytes * self.count

    @property
    def capability(self) -> tuple[int, int] | None:
        """The compute capability as (major, minor), None where unknown."""
        cc = self.compute_capability
        return None if cc is None else tuple(int(x) for x in cc.split("."))  # type: ignore[return-value]


# The kernel each CPU scheme decodes with, by the name of its HostSpec rate (runtime.quantize: Bf16Rows, Int8Rows,
# Int4Groups, Int8Dynamic; runtime.probe.measure.measure_cpu_decode_kernels times them).
CPU_DECODE_KERNELS = {"bf16": "bf16", "int8": "quanto-int8", "int4": "quanto-int4", "int8_dynamic": "quanto-w8a8",
                      "int4_a8": "cpu-w4a8"}
# The kernels the runtime runs by more than one path, and those paths (runtime.cpu_paths): the probe times each and
# records the fastest (HostSpec.cpu_decode_<kernel>_path), whose rate is the kernel's.
CPU_DECODE_PATHS = {"bf16": ("mv", "linear"), "int8_dynamic": ("int_mm", "fbgemm")}
# The decoder layers whose fixed cost the full probe times (HostSpec.cpu_layer_<name>_s): each CPU_DECODE_KERNELS
# scheme in transformers' eager forward, and "lean", cpu-w4a8 in vramplan's own decoder step (runtime.lean)
CPU_LAYER_COSTS = (*CPU_DECODE_KERNELS, "lean")


@record(kw_only=True)
class HostSpec:
    """The CPU side: RAM, its bandwidth, cores and what a bf16 matmul achieves on them (and, where measured, an fp32
    and an int8 one), and how fast one core dispatches an eager decoder layer to the GPU."""

    ram_bytes: int
    ram_bandwidth_bytes_per_s: float
    cpu_cores: int
    cpu_bf16_flops: float  # what a bf16 matmul achieves on all cores
    # What an fp32 matmul and an int8 one (torch._int_mm: int8 x int8 into int32, a multiply-add counted as 2 ops)
    # achieve on all cores; None: not measured. A CPU prefill's matmuls run against the one of these their kernel
    # computes in (planner.speed.cpu_matmul_peak): where bf16 is converted in software, fp32 is the faster.
    cpu_fp32_flops: float | None = None
    cpu_int8_ops: float | None = None
    # What the host takes to issue one bf16 decoder layer of transformers' eager forward to the GPU (Python, ATen
    # dispatch, kernel launches) at batch 1: eager decode on a fast GPU waits on it (planner.speed). None: unknown,
    # the speed model's default (planner.speed.DEFAULT_EAGER_DISPATCH_PER_LAYER_S).
    eager_dispatch_per_layer_s: float | None = None
    # Bytes of weights per second each CPU decode kernel streams from RAM at one row (CPU_DECODE_KERNELS; the probe
    # times them): which kernel is fast depends on the CPU (planner.speed prices each scheme's). None: not measured.
    cpu_decode_bf16_bytes_per_s: float | None = None
    cpu_decode_int8_bytes_per_s: float | None = None
    cpu_decode_int4_bytes_per_s: float | None = None
    cpu_decode_int8_dynamic_bytes_per_s: float | None = None
    # vramplan's own kernel (cpu-w4a8: runtime.cpu_kernel), timed where it builds; None: it does not build here, or
    # the probe is older than the kernel, and the planner refuses the scheme
    cpu_decode_int4_a8_bytes_per_s: float | None = None
    # The path the runtime runs each of CPU_DECODE_PATHS' kernels by (the probe's fastest). None: runtime.cpu_paths'
    # default for the CPU's instruction set.
    cpu_decode_bf16_path: str | None = None
    cpu_decode_int8_dynamic_path: str | None = None
    # The fixed cost of one routed expert's eager forward for one token on the CPU (runtime.experts.QuantizedExperts:
    # gather, two matmuls, the gate, scatter-add), timed by the probe at shapes whose bytes take no time. None: the
    # speed model's default (planner.speed.DEFAULT_CPU_EXPERT_CALL_S). It moves with the machine: about 50 us on the
    # Xeon dev VM, 268 us on the AVX2 EPYC VM.
    cpu_expert_call_s: float | None = None
    # The fixed cost of one decoder layer of a decode step on the CPU, beyond its weights' bytes, per CPU_LAYER_COSTS:
    # timed by the full probe on tiny models (runtime.probe.measure.measure_cpu_layer_costs). None: the speed model's
    # default (fitted on one machine). It moves with the machine: cpu-w4a8's 291 us on the Xeon AMX VM, 710 by default.
    cpu_layer_bf16_s: float | None = None
    cpu_layer_int8_s: float | None = None
    cpu_layer_int4_s: float | None = None
    cpu_layer_int8_dynamic_s: float | None = None
    cpu_layer_int4_a8_s: float | None = None
    cpu_layer_lean_s: float | None = None

    def decode_kernel_rate(self, kernel: str) -> float | None:
        return getattr(self, f"cpu_decode_{kernel}_bytes_per_s")

    def layer_cost(self, name: str) -> float | None:
        """The probe's fixed cost of a layer (CPU_LAYER_COSTS' `name`), or None."""
        return getattr(self, f"cpu_layer_{name}_s")

    def __post_init__(self) -> None:
        _check_int(self, "ram_bytes", minimum=1)
        _check_float(self, "ram_bandwidth_bytes_per_s")
        _check_int(self, "cpu_cores", minimum=1, maximum=MAX_CPU_CORES, why=" (cores of one host)")
        _check_float(self, "cpu_bf16_flops")
        for name in ("cpu_fp32_flops", "cpu_int8_ops", *(f"cpu_decode_{k}_bytes_per_s" for k in CPU_DECODE_KERNELS)):
            if getattr(self, name) is not None:
                _check_float(self, name)
        if self.eager_dispatch_per_layer_s is not None:
            _check_float(self, "eager_dispatch_per_layer_s", positive=False, maximum=1.0)
        for name in ("cpu_expert_call_s", *(f"cpu_layer_{k}_s" for k in CPU_LAYER_COSTS)):
            if getattr(self, name) is not None:
                _check_float(self, name, maximum=1.0)
        for kernel, paths in CPU_DECODE_PATHS.items():
            path = getattr(self, f"cpu_decode_{kernel}_path")
            if path is not None and path not in paths:
                raise _FieldError(f"cpu_decode_{kernel}_path", f"must be one of {', '.join(paths)}, got {path!r}")


@record(kw_only=True)
class LinkSpec:
    """The host <-> GPU link, per direction and host-memory kind."""

    name: str  # "PCIe 4.0 x16"
    h2d_pinned_bytes_per_s: float
    h2d_pageable_bytes_per_s: float
    d2h_pinned_bytes_per_s: float
    d2h_pageable_bytes_per_s: float

    def __post_init__(self) -> None:
        _check_str(self, "name")
        for f in ("h2d_pinned_bytes_per_s", "h2d_pageable_bytes_per_s",
                  "d2h_pinned_bytes_per_s", "d2h_pageable_bytes_per_s"):
            _check_float(self, f)


@record(kw_only=True)
class Overheads:
    """Fixed costs that are no tensor's: the CUDA context, allocator slack, launch latency."""

    cuda_context_bytes: int  # memory the CUDA context takes on the GPU
    allocator_reserve_bytes: int  # caching-allocator slack/fragmentation kept free
    kernel_launch_s: float  # per-kernel launch latency

    def __post_init__(self) -> None:
        _check_int(self, "cuda_context_bytes", minimum=0)
        _check_int(self, "allocator_reserve_bytes", minimum=0)
        _check_float(self, "kernel_launch_s", positive=False, maximum=1.0)

    @classmethod
    def zero(cls) -> "Overheads":
        return cls(cuda_context_bytes=0, allocator_reserve_bytes=0, kernel_launch_s=0.0)


# The backends a calibration entry may name: what the speed model looks up (the weight schemes' backends, vramplan's
# compiled decode, routed experts, the KV-cache update, llama.cpp's kernels), and attention per implementation (the
# kernel transformers runs, ModelSpec.attention_impl, or llama.cpp's); tests/test_structure.py checks them against
# what the speed model and the fits use. Another name is a typo that would never be looked up.
CALIBRATION_BACKENDS = ("torch", "bnb", "quanto", "torch-wo", "vramplan-cpu", "compiled", "experts", "kv-update",
                        "llama.cpp")
ATTENTION_PREFIXES = ("attn-", "prefill-attn-")
ATTENTION_IMPLS = ("sdpa", "eager", "llama.cpp")


def _known_backend(backend: str) -> bool:
    return backend in CALIBRATION_BACKENDS or any(
        backend.startswith(p) and backend[len(p):] in ATTENTION_IMPLS for p in ATTENTION_PREFIXES)


@record(kw_only=True)
class CalibrationEntry:
    """Measured efficiencies for one device x backend x quantization scheme."""

    device: str  # "gpu" or "cpu"
    backend: str  # "torch", "bnb", "quanto"
    quant: str  # "bf16", "bnb-nf4", "quanto-int8"
    bandwidth_efficiency: float | None  # achieved / peak, in (0, 1]; None when the runs did not measure it
    compute_efficiency: float | None  # achieved / peak, in (0, 1]; None when the runs did not measure it
    per_layer_overhead_s: float = 0.0
    per_token_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise _FieldError("device", f'expected "gpu" or "cpu", got {self.device!r}')
        _check_str(self, "backend")
        if not _known_backend(self.backend):
            attention = " / ".join(p + "IMPL" for p in ATTENTION_PREFIXES)
            raise _FieldError("backend", f"unknown calibration backend {self.backend!r}: one of "
                              f"{', '.join(CALIBRATION_BACKENDS)}, or {attention} with IMPL one of "
                              f"{', '.join(ATTENTION_IMPLS)}")
        _check_str(self, "quant")
        if self.bandwidth_efficiency is None and self.compute_efficiency is None:
            raise _FieldError("bandwidth_efficiency", "an entry needs a bandwidth or a compute efficiency (or both)")
        for name in ("bandwidth_efficiency", "compute_efficiency"):
            if getattr(self, name) is not None:
                _check_float(self, name, maximum=MAX_EFFICIENCY)
        _check_float(self, "per_layer_overhead_s", positive=False, maximum=1.0)
        _check_float(self, "per_token_overhead_s", positive=False, maximum=60.0)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.device, self.backend, self.quant)


def _pairs(value: Any, field: str, kind: Callable[[Any], bool], what: str) -> tuple[tuple[str, Any], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((k, v) for k, v in items)
    except (TypeError, ValueError):
        raise _FieldError(field, f"expected a mapping of {what}, got {value!r}") from None
    seen = set()
    for k, v in pairs:
        if not isinstance(k, str) or not kind(v):
            raise _FieldError(field, f"expected a mapping of {what}, got {k!r}: {v!r}")
        if k in seen:
            raise _FieldError(field, f"duplicate key {k!r}")
        seen.add(k)
    return pairs


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _unique_entries(entries, cls: type, describe: Callable[[Any], str]) -> tuple:
    """`entries` as a tuple of `cls`, no key twice (`describe` names a repeated entry)."""
    out, seen = tuple(entries), set()
    for i, e in enumerate(out):
        if not isinstance(e, cls):
            raise _FieldError("entries", f"entry {i} is not a {cls.__name__}: {e!r}")
        if e.key in seen:
            raise _FieldError("entries", f"two entries for {describe(e)}")
        seen.add(e.key)
    return out


def _public_source(n: int, detail: str = "") -> str:
    return f"fitted to public measurements ({n} record{'s' if n != 1 else ''}{detail})"


@record(kw_only=True)
class Calibration:
    """What `vramplan calibrate` measured. Mappings are stored as tuples of pairs (hashable)."""

    measured_at: str  # ISO date or datetime
    versions: tuple[tuple[str, str], ...] = ()  # accepts a dict too: {"torch": "2.13.0"}
    entries: tuple[CalibrationEntry, ...] = ()
    residuals: tuple[tuple[str, float], ...] = ()  # {"decode_tokens_per_s_median_abs_pct": 4.2}
    # RSS of the runtime process beyond what the plan counts (interpreter, torch, allocator), measured
    runtime_ram_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_str(self, "measured_at")
        if self.runtime_ram_bytes is not None:
            _check_int(self, "runtime_ram_bytes", minimum=0)
        try:
            _dt.datetime.fromisoformat(self.measured_at)
        except ValueError:
            raise _FieldError("measured_at",
                              f'expected an ISO date like "2025-01-31", got {self.measured_at!r}') from None
        object.__setattr__(self, "versions",
                           _pairs(self.versions, "versions", lambda v: isinstance(v, str), "name: version string"))
        residuals = _pairs(self.residuals, "residuals", _is_number, "name: number")
        object.__setattr__(self, "residuals", tuple((k, float(v)) for k, v in residuals))
        object.__setattr__(self, "entries", _unique_entries(
            self.entries, CalibrationEntry, lambda e: f"device={e.device} backend={e.backend} quant={e.quant}"))

    @property
    def versions_dict(self) -> dict[str, str]:
        return dict(self.versions)

    @property
    def residuals_dict(self) -> dict[str, float]:
        return dict(self.residuals)

    def lookup(self, device: str, backend: str, quant: str) -> CalibrationEntry | None:
        for e in self.entries:
            if e.key == (device, backend, quant):
                return e
        return None


# Engines whose GPU speed constants are fitted to public measurements (planner/public_gpu, bench/public_gpu.py):
# transformers' eager forward (vramplan's runtime), a torch.compile'd decode with CUDA graphs (gpt-fast, torchao), and
# llama.cpp's CUDA backend.
FITTED_ENGINES = ("transformers", "compiled", "llama.cpp")
# GPU classes the fit tells apart: HBM (datacenter: V100, A100, H100, H200, MI250X) and GDDR (GeForce, RTX workstation,
# T4, L4, L40S, A10G); host classes: the desktop or workstation CPU of a consumer card, the server CPU of a datacenter
# one (eager dispatch runs on one core: its clock decides).
GPU_CLASSES = ("hbm", "gddr")
HOST_CLASSES = ("desktop", "server")


@record(kw_only=True)
class FittedEntry:
    """The GPU speed constants of one engine x scheme on one GPU class, fitted to public measurements."""

    engine: str  # one of FITTED_ENGINES
    quant: str  # the engine's scheme: a vramplan scheme, a compiled weight format, a GGUF file-type group
    bandwidth_efficiency: float  # weights read per token, achieved / peak
    kv_efficiency: float | None = None  # the KV cache read, achieved / peak; None: the speed model's rule
    per_layer_s: float = 0.0  # GPU-side fixed cost per decoder layer and token
    per_token_s: float = 0.0  # fixed cost per token outside the layers
    # eager only: the host's dispatch of one layer of this scheme, in units of host.eager_dispatch_per_layer (bf16: 1)
    dispatch_factor: float | None = None
    records: tuple[str, ...] = ()  # the public records it was fitted to

    def __post_init__(self) -> None:
        if self.engine not in FITTED_ENGINES:
            raise _FieldError("engine", f"expected one of {', '.join(FITTED_ENGINES)}, got {self.engine!r}")
        _check_str(self, "quant")
        _check_float(self, "bandwidth_efficiency", maximum=MAX_EFFICIENCY)
        if self.kv_efficiency is not None:
            _check_float(self, "kv_efficiency", maximum=MAX_EFFICIENCY)
        _check_float(self, "per_layer_s", positive=False, maximum=1.0)
        _check_float(self, "per_token_s", positive=False, maximum=60.0)
        if self.dispatch_factor is not None:
            _check_float(self, "dispatch_factor", positive=False, maximum=100.0)
        records = tuple(self.records)
        if not all(isinstance(r, str) and r for r in records):
            raise _FieldError("records", f"expected a list of record ids, got {list(records)!r}")
        object.__setattr__(self, "records", records)

    @property
    def key(self) -> tuple[str, str]:
        return (self.engine, self.quant)

    @property
    def source(self) -> str:
        return _public_source(len(self.records))


@record(kw_only=True)
class PublicFit:
    """The GPU speed constants of this profile's GPU and host class, fitted to the public corpus: what the speed model
    uses where `vramplan calibrate` measured nothing (a calibration overrides them entry by entry)."""

    fitted_at: str  # ISO date
    corpus: str  # where the records are
    gpu_class: str  # one of GPU_CLASSES
    host_class: str  # one of HOST_CLASSES
    host_records: tuple[str, ...] = ()  # the records host.eager_dispatch_per_layer was fitted to
    entries: tuple[FittedEntry, ...] = ()

    def __post_init__(self) -> None:
        _check_str(self, "fitted_at")
        try:
            _dt.date.fromisoformat(self.fitted_at)
        except ValueError:
            raise _FieldError("fitted_at", f'expected an ISO date like "2026-11-26", got {self.fitted_at!r}') from None
        _check_str(self, "corpus")
        if self.gpu_class not in GPU_CLASSES:
            raise _FieldError("gpu_class", f"expected one of {', '.join(GPU_CLASSES)}, got {self.gpu_class!r}")
        if self.host_class not in HOST_CLASSES:
            raise _FieldError("host_class", f"expected one of {', '.join(HOST_CLASSES)}, got {self.host_class!r}")
        object.__setattr__(self, "host_records", tuple(self.host_records))
        object.__setattr__(self, "entries", _unique_entries(self.entries, FittedEntry,
                                                            lambda e: f"engine={e.engine} quant={e.quant}"))

    def lookup(self, engine: str, quant: str) -> FittedEntry | None:
        for e in self.entries:
            if e.key == (engine, quant):
                return e
        return None

    @property
    def host_source(self) -> str:
        return _public_source(len(self.host_records), f", {self.host_class} hosts")


@record(kw_only=True)
class HardwareProfile:
    """One machine type: everything the planner knows about the hardware."""

    schema_version: int
    name: str  # short id, e.g. "rtx-4090"
    description: str
    source: str  # datasheet URL(s), or "measured by vramplan probe on <date> (...)"
    gpus: tuple[GPUSpec, ...]  # empty for CPU-only machines
    host: HostSpec
    link: LinkSpec | None  # None for CPU-only and unified-memory machines
    overheads: Overheads
    unified_memory: bool = False  # Apple silicon, GB10: GPU and CPU share RAM
    measured: bool = False  # True when produced by the probe's measurements
    calibration: Calibration | None = None
    public_fit: PublicFit | None = None  # GPU speed constants fitted to public measurements
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.schema_version, bool) or self.schema_version != SCHEMA_VERSION:
            raise _FieldError(
                "schema_version",
                f"this vramplan reads schema version {SCHEMA_VERSION}, got {self.schema_version!r}",
            )
        _check_str(self, "name")
        if not _NAME_RE.match(self.name):
            raise _FieldError("name",
                              f"expected letters, digits, '.', '_' or '-' (like \"rtx-4090\"), got {self.name!r}")
        _check_str(self, "description", allow_empty=True)
        _check_str(self, "source")
        gpus = tuple(self.gpus)
        for i, g in enumerate(gpus):
            if not isinstance(g, GPUSpec):
                raise _FieldError("gpus", f"gpus[{i}] is not a GPUSpec: {g!r}")
        object.__setattr__(self, "gpus", gpus)
        if sum(g.count for g in gpus) > MAX_GPUS_PER_PROFILE:
            raise _FieldError("gpus", f"{sum(g.count for g in gpus)} GPUs in all: at most {MAX_GPUS_PER_PROFILE}"
                              f"{_GPUS_WHY}")
        if not isinstance(self.host, HostSpec):
            raise _FieldError("host", f"expected a HostSpec, got {self.host!r}")
        if self.link is not None and not isinstance(self.link, LinkSpec):
            raise _FieldError("link", f"expected a LinkSpec or None, got {self.link!r}")
        if not isinstance(self.overheads, Overheads):
            raise _FieldError("overheads", f"expected Overheads, got {self.overheads!r}")
        _check_bool(self, "unified_memory")
        _check_bool(self, "measured")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise _FieldError("calibration", f"expected a Calibration or None, got {self.calibration!r}")
        if self.public_fit is not None and not isinstance(self.public_fit, PublicFit):
            raise _FieldError("public_fit", f"expected a PublicFit or None, got {self.public_fit!r}")
        notes = tuple(self.notes)
        if not all(isinstance(n, str) for n in notes):
            raise _FieldError("notes", f"expected a list of strings, got {list(notes)!r}")
        object.__setattr__(self, "notes", notes)
        # Cross-field rules.
        if self.unified_memory and not gpus:
            raise _FieldError("unified_memory", "true needs a GPU entry (the integrated GPU)")
        if self.unified_memory and self.link is not None:
            raise _FieldError("link", "must be null when unified_memory is true (GPU and CPU share RAM)")
        if not gpus and self.link is not None:
            raise _FieldError("link", "must be null on a machine without GPUs")
        reserved = self.overheads.cuda_context_bytes + self.overheads.allocator_reserve_bytes
        for i, g in enumerate(gpus):
            if reserved >= g.memory_bytes:
                raise _FieldError("overheads", f"the CUDA context and allocator reserve ({reserved:,} B) leave "
                                  f"nothing of gpus[{i}]'s {g.memory_bytes:,} B")
        if self.public_fit is not None and not gpus:
            raise _FieldError("public_fit", "must be null on a machine without GPUs (its constants are the GPU's)")
        if gpus and not self.unified_memory and self.link is None:
            raise _FieldError("link", "a machine with a discrete GPU needs its host link (e.g. PCIe 4.0 x16)")

    # -- derived -------------------------------------------------------------
    @property
    def gpu(self) -> GPUSpec | None:
        """The first (planning) GPU, or None on a CPU-only machine."""
        return self.gpus[0] if self.gpus else None

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def accelerator(self) -> str | None:
        """The GPU's programming interface: "mps" for Apple silicon, "cuda" for NVIDIA, None without a GPU."""
        if not self.gpus:
            return None
        return "mps" if self.unified_memory and self.gpus[0].name.lower().startswith("apple") else "cuda"

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)

    @property
    def devices(self) -> tuple[GPUSpec, ...]:
        """One entry per GPU device, in device order (a GPUSpec of count n is n devices)."""
        return tuple(g for g in self.gpus for _ in range(g.count))

    @property
    def gpu_memory_bytes(self) -> int:
        """Memory of one device of the first GPU kind (0 without GPU)."""
        return self.gpus[0].memory_bytes if self.gpus else 0

    @property
    def total_gpu_memory_bytes(self) -> int:
        return sum(g.total_memory_bytes for g in self.gpus)

    @property
    def gpu_memory_bandwidth_bytes_per_s(self) -> float:
        return self.gpus[0].memory_bandwidth_bytes_per_s if self.gpus else 0.0

    @property
    def gpu_bf16_flops(self) -> float:
        return self.gpus[0].bf16_flops if self.gpus else 0.0

    @property
    def gpu_usable_bytes(self) -> int:
        """One device's memory less the CUDA context and the allocator reserve (no user headroom)."""
        if not self.gpus:
            return 0
        return max(0, self.gpu_memory_bytes - self.overheads.cuda_context_bytes
                   - self.overheads.allocator_reserve_bytes)

    @property
    def cpu_only(self) -> bool:
        return not self.gpus

    def replace(self, **changes: Any) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)
