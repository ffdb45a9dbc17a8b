"""Hardware profiles on disk: strict YAML <-> planner.hardware's dataclasses.

On disk a profile is YAML with units in the strings ("24564 MiB", "1008 GB/s",
"165.2 TFLOPS", "5 us"). Loading is strict: unknown keys, duplicate keys, wrong types,
missing keys and unitless quantities are refused with the file, the key path and what
was expected; writing gives the shortest exact spelling of every quantity, so a profile
round-trips to equal values. Reads only (writing a file is the runtime's: runtime.files).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import shlex
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, Mapping

from .record import record
from .errors import ProfileError, UnitError
from .hardware import (CPU_DECODE_KERNELS, CPU_DECODE_PATHS, CPU_LAYER_COSTS, SCHEMA_VERSION, Calibration,
                       CalibrationEntry, FittedEntry, GPUSpec, HardwareProfile, HostSpec, LinkSpec, Overheads,
                       PublicFit, _FieldError)
from .textfiles import read_text
from .units import GiB, KiB, MiB, TiB, OutOfRangeError, parse_bandwidth, parse_bytes, parse_flops, parse_seconds
from .yaml_strict import safe_load_strict


# ---------------------------------------------------------------- YAML <-> dataclasses
#
# One table per section: YAML key -> (dataclass field, kind, required). Kinds parse a
# YAML value into the internal unit and format it back exactly.


@record
class _Kind:
    """How one kind of YAML value parses into the internal unit and formats back."""

    expected: str  # for messages: 'a size like "24 GiB"'
    parse: Callable[[Any], Any]
    format: Callable[[Any], Any]


class _Bad(Exception):
    """A value that does not fit its kind (turned into a ProfileError with the key path); its text, when it has
    one, says what is wrong instead of what was expected."""


# How much of a bad value an error message quotes: enough to recognise it, never a whole file.
SHOW_MAX_CHARS = 60


def _show(v: Any) -> str:
    if isinstance(v, str):
        text = json.dumps(v, ensure_ascii=False)
        return text if len(text) <= SHOW_MAX_CHARS else f"a string of {len(v)} characters ({text[:SHOW_MAX_CHARS]}...)"
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    if v is None:
        return "null"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**SHOW_MAX_CHARS:
        return f"an integer of {len(str(abs(v)))} digits"
    return repr(v)


def _unit_parser(parse: Callable[[str], Any]) -> Callable[[Any], Any]:
    def run(v: Any) -> Any:
        if not isinstance(v, str):  # a bare number is refused: the unit lives in the string
            raise _Bad()
        try:
            return parse(v)
        except OutOfRangeError as e:  # the right form, but NaN, infinite or beyond any machine: say that
            raise _Bad(str(e)) from None
        except UnitError:
            raise _Bad() from None

    return run


def _shortest(x: float) -> list[str]:
    """Decimal renderings of x, shortest first, without exponents."""
    texts = []
    for digits in range(1, 18):
        t = f"{x:.{digits}g}"
        if "e" not in t and "n" not in t and t not in texts:
            texts.append(t)
    return texts


def _exact(value: float, candidates: list[tuple[float, str]], parse: Callable[[str], float]) -> str:
    """The first unit (in order of preference) with the shortest number that parses back to exactly `value`."""
    for mult, unit in candidates:
        for text in _shortest(value / mult):
            s = f"{text} {unit}"
            try:
                if parse(s) == value:
                    return s
            except UnitError:
                break
    # Exact decimal expansion of the float in the base unit: always parses back bit for bit.
    return f"{format(Decimal(value), 'f')} {candidates[-1][1]}"


def format_bytes_exact(n: int) -> str:
    """Bytes as the shortest exact string: 24564 MiB, 141 GB, 0 B."""
    if n == 0:
        return "0 B"
    for mult, unit in ((TiB, "TiB"), (GiB, "GiB"), (10**12, "TB"), (10**9, "GB"), (MiB, "MiB"), (10**6, "MB"),
                       (KiB, "KiB"), (10**3, "kB")):
        if n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def format_bandwidth_exact(bps: float) -> str:
    return _exact(bps, [(1e9, "GB/s"), (1e6, "MB/s"), (1.0, "B/s")], parse_bandwidth)


def format_flops_exact(fps: float) -> str:
    cands = [(1e12, "TFLOPS"), (1e9, "GFLOPS"), (1.0, "FLOPS")]
    return _exact(fps, cands, parse_flops)


def format_seconds_exact(s: float) -> str:
    if s == 0:
        return "0 us"
    if s < 1e-3:
        cands = [(1e-6, "us"), (1e-9, "ns"), (1.0, "s")]
    elif s < 1.0:
        cands = [(1e-3, "ms"), (1e-6, "us"), (1.0, "s")]
    else:
        cands = [(1e-3, "ms"), (1.0, "s")][::-1]
    return _exact(s, cands, parse_seconds)


def _parse_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad()
    return v


def _finite_float(v: Any) -> float | None:
    """A YAML number as a finite float; None for what is no number, not finite, or an integer too large for a
    float (math.isfinite raises OverflowError on it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        x = float(v)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _parse_number(v: Any) -> float:
    x = _finite_float(v)
    if x is None:
        raise _Bad()
    return x


def _parse_str(v: Any) -> str:
    if not isinstance(v, str):
        raise _Bad()
    return v


def _parse_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad()
    return v


def _parse_opt_str(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):  # compute_capability: 8.9 unquoted
        raise _Bad()
    return _parse_str(v)


def _ident(v: Any) -> Any:
    return v


SIZE = _Kind('a size like "24 GiB" or "512 MiB"', _unit_parser(lambda s: parse_bytes(s)), format_bytes_exact)
BANDWIDTH = _Kind('a bandwidth like "1008 GB/s"', _unit_parser(lambda s: parse_bandwidth(s)), format_bandwidth_exact)
COMPUTE = _Kind('a compute rate like "165.2 TFLOPS"', _unit_parser(lambda s: parse_flops(s)), format_flops_exact)
TIME = _Kind('a time like "5 us" or "1.2 ms"', _unit_parser(lambda s: parse_seconds(s)), format_seconds_exact)
INT = _Kind("an integer", _parse_int, _ident)
NUMBER = _Kind("a number", _parse_number, _ident)
STR = _Kind("a string", _parse_str, _ident)
BOOL = _Kind("true or false", _parse_bool, _ident)
OPT_SIZE = _Kind('a size like "700 MiB" (or null)', lambda v: None if v is None else SIZE.parse(v),
                 lambda v: None if v is None else SIZE.format(v))
OPT_NUMBER = _Kind("a number (or null)", lambda v: None if v is None else _parse_number(v), _ident)
OPT_TIME = _Kind('a time like "750 us" (or null)', lambda v: None if v is None else TIME.parse(v),
                 lambda v: None if v is None else TIME.format(v))
OPT_BANDWIDTH = _Kind('a bandwidth like "9.2 GB/s" (or null)', lambda v: None if v is None else BANDWIDTH.parse(v),
                      lambda v: None if v is None else BANDWIDTH.format(v))
OPT_COMPUTE = _Kind('a compute rate like "1.2 TFLOPS" (or null)', lambda v: None if v is None else COMPUTE.parse(v),
                    lambda v: None if v is None else COMPUTE.format(v))
OPT_STR = _Kind("a string (or null)", _parse_opt_str, _ident)
CC = _Kind('a quoted compute capability like "8.9" (or null)', _parse_opt_str, _ident)

# yaml key -> (field, kind, default) ; default _REQUIRED means the key must be present.
_REQUIRED = object()

_GPU_KEYS: dict[str, tuple[str, _Kind, Any]] = {
    "name": ("name", STR, _REQUIRED),
    "count": ("count", INT, 1),
    "memory": ("memory_bytes", SIZE, _REQUIRED),
    "memory_bandwidth": ("memory_bandwidth_bytes_per_s", BANDWIDTH, _REQUIRED),
    "bf16_compute": ("bf16_flops", COMPUTE, _REQUIRED),
    "compute_capability": ("compute_capability", CC, None),
}
_HOST_KEYS = {
    "ram": ("ram_bytes", SIZE, _REQUIRED),
    "ram_bandwidth": ("ram_bandwidth_bytes_per_s", BANDWIDTH, _REQUIRED),
    "cpu_cores": ("cpu_cores", INT, _REQUIRED),
    "cpu_bf16_compute": ("cpu_bf16_flops", COMPUTE, _REQUIRED),
    "cpu_fp32_compute": ("cpu_fp32_flops", OPT_COMPUTE, None),
    "cpu_int8_compute": ("cpu_int8_ops", OPT_COMPUTE, None),
    "eager_dispatch_per_layer": ("eager_dispatch_per_layer_s", OPT_TIME, None),
    "cpu_expert_call": ("cpu_expert_call_s", OPT_TIME, None),
    **{f"cpu_decode_{k}": (f"cpu_decode_{k}_bytes_per_s", OPT_BANDWIDTH, None) for k in CPU_DECODE_KERNELS},
    **{f"cpu_decode_{k}_path": (f"cpu_decode_{k}_path", OPT_STR, None) for k in CPU_DECODE_PATHS},
    **{f"cpu_layer_{k}": (f"cpu_layer_{k}_s", OPT_TIME, None) for k in CPU_LAYER_COSTS},
}
_LINK_KEYS = {
    "name": ("name", STR, _REQUIRED),
    "h2d_pinned": ("h2d_pinned_bytes_per_s", BANDWIDTH, _REQUIRED),
    "h2d_pageable": ("h2d_pageable_bytes_per_s", BANDWIDTH, _REQUIRED),
    "d2h_pinned": ("d2h_pinned_bytes_per_s", BANDWIDTH, _REQUIRED),
    "d2h_pageable": ("d2h_pageable_bytes_per_s", BANDWIDTH, _REQUIRED),
}
_OVERHEAD_KEYS = {
    "cuda_context": ("cuda_context_bytes", SIZE, _REQUIRED),
    "allocator_reserve": ("allocator_reserve_bytes", SIZE, _REQUIRED),
    "kernel_launch": ("kernel_launch_s", TIME, _REQUIRED),
}
_ENTRY_KEYS = {
    "device": ("device", STR, _REQUIRED),
    "backend": ("backend", STR, _REQUIRED),
    "quant": ("quant", STR, _REQUIRED),
    "bandwidth_efficiency": ("bandwidth_efficiency", OPT_NUMBER, None),
    "compute_efficiency": ("compute_efficiency", OPT_NUMBER, None),
    "per_layer_overhead": ("per_layer_overhead_s", TIME, 0.0),
    "per_token_overhead": ("per_token_overhead_s", TIME, 0.0),
}
_FITTED_ENTRY_KEYS = {  # records is handled by hand
    "engine": ("engine", STR, _REQUIRED),
    "quant": ("quant", STR, _REQUIRED),
    "bandwidth_efficiency": ("bandwidth_efficiency", NUMBER, _REQUIRED),
    "kv_efficiency": ("kv_efficiency", OPT_NUMBER, None),
    "per_layer": ("per_layer_s", TIME, 0.0),
    "per_token": ("per_token_s", TIME, 0.0),
    "dispatch_factor": ("dispatch_factor", OPT_NUMBER, None),
    "records": ("records", None, ()),
}
_PUBLIC_FIT_KEYS = {  # host_records/entries are handled by hand
    "fitted_at": ("fitted_at", STR, _REQUIRED),
    "corpus": ("corpus", STR, _REQUIRED),
    "gpu_class": ("gpu_class", STR, _REQUIRED),
    "host_class": ("host_class", STR, _REQUIRED),
    "host_records": ("host_records", None, ()),
    "entries": ("entries", None, []),
}
_CALIBRATION_KEYS = {  # versions/entries/residuals are handled by hand
    "measured_at": ("measured_at", STR, _REQUIRED),
    "versions": ("versions", None, {}),
    "entries": ("entries", None, []),
    "residuals": ("residuals", None, {}),
    "runtime_ram": ("runtime_ram_bytes", OPT_SIZE, None),
}
_PROFILE_KEYS = {
    "schema_version": ("schema_version", INT, _REQUIRED),
    "name": ("name", STR, _REQUIRED),
    "description": ("description", STR, _REQUIRED),
    "source": ("source", STR, _REQUIRED),
    "measured": ("measured", BOOL, False),
    "unified_memory": ("unified_memory", BOOL, False),
    "gpus": ("gpus", None, _REQUIRED),
    "host": ("host", None, _REQUIRED),
    "link": ("link", None, None),
    "overheads": ("overheads", None, _REQUIRED),
    "calibration": ("calibration", None, None),
    "public_fit": ("public_fit", None, None),
    "notes": ("notes", None, ()),
}


_FAILED = object()  # a value or section whose error a collecting reader has recorded


class _Reader:
    """Walks a loaded YAML document with a key path, raising ProfileError with file and path; with `collect`, it
    records each error and reads on (every key of a mapping, every section), so one pass finds them all."""

    def __init__(self, origin: str, collect: bool = False) -> None:
        self.origin = origin
        self.collect = collect
        self.errors: list[ProfileError] = []

    def fail(self, path: str, message: str) -> ProfileError:
        where = f"{self.origin}: {path}: " if path else f"{self.origin}: "
        return ProfileError(where + message)

    def note(self, e: ProfileError) -> None:
        """Raise `e`, or record it and read on."""
        if not self.collect:
            raise e
        self.errors.append(e)

    def attempt(self, fn, *args) -> Any:
        """fn(*args); a collecting reader records its error and gets _FAILED."""
        try:
            return fn(*args)
        except ProfileError as e:
            if not self.collect:
                raise
            self.errors.append(e)
            return _FAILED

    def mapping(self, value: Any, path: str, keys: Mapping[str, tuple[str, Any, Any]]) -> dict[str, Any]:
        what = path or "the top level"
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected a mapping at {what}, got {_show(value)}")
        for k in value:
            if not isinstance(k, str) or k not in keys:
                close = difflib.get_close_matches(str(k), list(keys), n=1)
                hint = f'; did you mean "{close[0]}"?' if close else ""
                self.note(self.fail(path, f'unknown key "{k}" (expected one of: {", ".join(keys)}){hint}'))
        for k, (_f, kind, default) in keys.items():
            if default is _REQUIRED and k not in value:
                exp = f" ({kind.expected})" if isinstance(kind, _Kind) else ""
                self.note(self.fail(path, f'missing required key "{k}"{exp}'))
        return {k: v for k, v in value.items() if isinstance(k, str) and k in keys}

    def scalars(self, value: Any, path: str, keys: Mapping[str, tuple[str, Any, Any]]) -> dict[str, Any]:
        """Parse a mapping whose values are all scalar kinds into dataclass kwargs."""
        return self.values(self.mapping(value, path, keys), path, keys)

    def values(self, d: dict[str, Any], path: str, keys: Mapping[str, tuple[str, Any, Any]]) -> dict[str, Any]:
        """The scalar kinds of a mapping `mapping` has checked, as dataclass kwargs (its other keys: the caller's)."""
        kwargs: dict[str, Any] = {}
        for k, (field, kind, default) in keys.items():
            if kind is None:
                continue
            if k not in d:
                kwargs[field] = _FAILED if default is _REQUIRED else default
                continue
            kwargs[field] = self.attempt(self.value, d[k], _join(path, k), kind)
        return kwargs

    def value(self, v: Any, path: str, kind: _Kind) -> Any:
        try:
            return kind.parse(v)
        except _Bad as e:
            raise self.fail(path, str(e) or f"expected {kind.expected}, got {_show(v)}") from None

    def build(self, cls: type, kwargs: dict[str, Any], path: str, keys: Mapping[str, tuple[str, Any, Any]]) -> Any:
        if any(v is _FAILED or (isinstance(v, tuple) and _FAILED in v) for v in kwargs.values()):
            return _FAILED  # its errors are recorded already
        try:
            return cls(**kwargs)
        except _FieldError as e:
            yaml_key = next((k for k, (f, _kind, _d) in keys.items() if f == e.field), e.field)
            self.note(self.fail(_join(path, yaml_key), e.detail))
            return _FAILED


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _parse_profile(d: Any, r: _Reader) -> HardwareProfile:
    if not isinstance(d, Mapping):
        raise r.fail("", f"expected a mapping at the top level, got {_show(d)}")
    # The schema version first: a future file's other keys would only confuse.
    if "schema_version" not in d:
        raise r.fail("", f'missing required key "schema_version" (this vramplan reads {SCHEMA_VERSION})')
    sv = d["schema_version"]
    if isinstance(sv, bool) or not isinstance(sv, int):
        raise r.fail("schema_version", f"expected an integer, got {_show(sv)}")
    if sv != SCHEMA_VERSION:
        newer = " (written by a newer vramplan: upgrade)" if sv > SCHEMA_VERSION else ""
        raise r.fail("schema_version",
                     f"unsupported schema version {_show(sv)}: this vramplan reads version {SCHEMA_VERSION}{newer}")

    top = r.mapping(d, "", _PROFILE_KEYS)
    kwargs = r.values(top, "", _PROFILE_KEYS)
    kwargs["gpus"] = r.attempt(_parse_gpus, top["gpus"], r) if "gpus" in top else _FAILED
    kwargs["host"] = r.attempt(lambda: r.build(HostSpec, r.scalars(top["host"], "host", _HOST_KEYS), "host",
                                               _HOST_KEYS)) if "host" in top else _FAILED
    link_raw = top.get("link")
    kwargs["link"] = None if link_raw is None else r.attempt(
        lambda: r.build(LinkSpec, r.scalars(link_raw, "link", _LINK_KEYS), "link", _LINK_KEYS))
    kwargs["overheads"] = r.attempt(lambda: r.build(
        Overheads, r.scalars(top["overheads"], "overheads", _OVERHEAD_KEYS), "overheads", _OVERHEAD_KEYS
    )) if "overheads" in top else _FAILED
    cal_raw = top.get("calibration")
    kwargs["calibration"] = None if cal_raw is None else r.attempt(_parse_calibration, cal_raw, r)
    fit_raw = top.get("public_fit")
    kwargs["public_fit"] = None if fit_raw is None else r.attempt(_parse_public_fit, fit_raw, r)
    kwargs["notes"] = r.attempt(_parse_notes, top.get("notes", []), r)
    out = r.build(HardwareProfile, kwargs, "", _PROFILE_KEYS)
    if out is _FAILED:  # a collecting reader's errors, the first one raised
        raise r.errors[0]
    return out


def _parse_gpus(gpus_raw: Any, r: _Reader) -> tuple[GPUSpec, ...]:
    if gpus_raw is None:
        gpus_raw = []
    if not isinstance(gpus_raw, list):
        raise r.fail("gpus", f"expected a list of GPUs (or [] for none), got {_show(gpus_raw)}")
    gpus = []
    for i, g in enumerate(gpus_raw):
        p = _join("gpus", i)
        gpus.append(r.attempt(lambda g=g, p=p: r.build(GPUSpec, r.scalars(g, p, _GPU_KEYS), p, _GPU_KEYS)))
    return tuple(gpus)


def _parse_notes(notes_raw: Any, r: _Reader) -> tuple[str, ...]:
    if notes_raw is None:
        notes_raw = []
    if not isinstance(notes_raw, list):
        raise r.fail("notes", f"expected a list of strings, got {_show(notes_raw)}")
    for i, n in enumerate(notes_raw):
        if not isinstance(n, str):
            raise r.fail(_join("notes", i), f"expected a string, got {_show(n)}")
    return tuple(notes_raw)


def _parse_calibration(raw: Any, r: _Reader) -> Calibration:
    path = "calibration"
    d = r.mapping(raw, path, _CALIBRATION_KEYS)
    kwargs = r.values(d, path, _CALIBRATION_KEYS)
    versions = d.get("versions", {}) or {}
    if not isinstance(versions, Mapping):
        raise r.fail(_join(path, "versions"), f'expected a mapping like {{torch: "2.5.1"}}, got {_show(versions)}')
    for k, v in versions.items():
        if not isinstance(v, str):
            raise r.fail(_join(_join(path, "versions"), str(k)), f"expected a quoted version string, got {_show(v)}")
    residuals = d.get("residuals", {}) or {}
    if not isinstance(residuals, Mapping):
        raise r.fail(_join(path, "residuals"), f"expected a mapping of name: number, got {_show(residuals)}")
    for k, v in residuals.items():
        if _finite_float(v) is None:
            raise r.fail(_join(_join(path, "residuals"), str(k)), f"expected a number, got {_show(v)}")
    entries_raw = d.get("entries", []) or []
    if not isinstance(entries_raw, list):
        raise r.fail(_join(path, "entries"), f"expected a list, got {_show(entries_raw)}")
    entries = []
    for i, e in enumerate(entries_raw):
        p = _join(_join(path, "entries"), i)
        entries.append(r.build(CalibrationEntry, r.scalars(e, p, _ENTRY_KEYS), p, _ENTRY_KEYS))
    kwargs.update(versions=dict(versions), residuals=dict(residuals), entries=tuple(entries))
    return r.build(Calibration, kwargs, path, _CALIBRATION_KEYS)


def _id_list(raw: Any, path: str, r: _Reader) -> tuple[str, ...]:
    raw = [] if raw is None else raw
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise r.fail(path, f"expected a list of record ids, got {_show(raw)}")
    return tuple(raw)


def _parse_public_fit(raw: Any, r: _Reader) -> PublicFit:
    path = "public_fit"
    d = r.mapping(raw, path, _PUBLIC_FIT_KEYS)
    kwargs = r.values(d, path, _PUBLIC_FIT_KEYS)
    kwargs["host_records"] = _id_list(d.get("host_records"), _join(path, "host_records"), r)
    entries_raw = d.get("entries", []) or []
    if not isinstance(entries_raw, list):
        raise r.fail(_join(path, "entries"), f"expected a list, got {_show(entries_raw)}")
    entries = []
    for i, e in enumerate(entries_raw):
        p = _join(_join(path, "entries"), i)
        ekw = r.scalars(e, p, _FITTED_ENTRY_KEYS)
        ekw["records"] = _id_list(e.get("records"), _join(p, "records"), r)
        entries.append(r.build(FittedEntry, ekw, p, _FITTED_ENTRY_KEYS))
    kwargs["entries"] = tuple(entries)
    return r.build(PublicFit, kwargs, path, _PUBLIC_FIT_KEYS)


def public_fit_to_dict(f: PublicFit | None) -> dict[str, Any] | None:
    if f is None:
        return None
    return {"fitted_at": f.fitted_at, "corpus": f.corpus, "gpu_class": f.gpu_class, "host_class": f.host_class,
            "host_records": list(f.host_records),
            "entries": [{**_section_to_dict(e, _FITTED_ENTRY_KEYS), "records": list(e.records)} for e in f.entries]}


def profile_from_dict(d: Any, *, origin: str = "<dict>") -> HardwareProfile:
    """Strictly build a HardwareProfile from a loaded YAML/JSON document; an invalid one's first error, saying how many
    more there are."""
    try:
        return _parse_profile(d, _Reader(origin))
    except ProfileError as e:
        more = len(_document_errors(d, origin)) - 1
        if more <= 0:
            raise
        where = "" if origin.startswith("<") else " " + shlex.quote(origin)
        raise ProfileError(f"{e} (and {more} more error{'s' if more > 1 else ''}: `vramplan profiles validate"
                           f"{where}` lists every one)") from None


def _document_errors(d: Any, origin: str) -> list[str]:
    r = _Reader(origin, collect=True)
    try:
        _parse_profile(d, r)
    except ProfileError as e:
        if not any(e is x for x in r.errors):
            r.errors.append(e)
    return [str(e) for e in r.errors]


def profile_errors(path: str | os.PathLike[str]) -> list[str]:
    """Every error of a profile file, in one pass (`profiles validate`): [] for a valid one. A file that cannot be read
    or is not YAML has one."""
    origin = str(Path(path))
    try:
        doc = parse_profile_text(read_profile_text(path), origin)
    except ProfileError as e:
        return [str(e)]
    return _document_errors(doc, origin)


def _section_to_dict(obj: Any, keys: Mapping[str, tuple[str, Any, Any]]) -> dict[str, Any]:
    return {k: kind.format(getattr(obj, field)) for k, (field, kind, _d) in keys.items() if kind is not None}


def profile_to_dict(p: HardwareProfile) -> dict[str, Any]:
    """The YAML/JSON form: plain types, units in strings, every key present, fixed order."""
    cal = None
    if p.calibration is not None:
        c = p.calibration
        cal = {
            "measured_at": c.measured_at,
            "versions": dict(c.versions),
            "entries": [_section_to_dict(e, _ENTRY_KEYS) for e in c.entries],
            "residuals": dict(c.residuals),
            "runtime_ram": OPT_SIZE.format(c.runtime_ram_bytes),
        }
    return {
        "schema_version": p.schema_version,
        "name": p.name,
        "description": p.description,
        "source": p.source,
        "measured": p.measured,
        "unified_memory": p.unified_memory,
        "gpus": [_section_to_dict(g, _GPU_KEYS) for g in p.gpus],
        "host": _section_to_dict(p.host, _HOST_KEYS),
        "link": None if p.link is None else _section_to_dict(p.link, _LINK_KEYS),
        "overheads": _section_to_dict(p.overheads, _OVERHEAD_KEYS),
        "calibration": cal,
        "public_fit": public_fit_to_dict(p.public_fit),
        "notes": list(p.notes),
    }


def parse_profile_text(text: str, origin: str = "<string>") -> Any:
    """The YAML document of a profile's text, parsed strictly (not yet checked as a profile: profile_from_dict)."""
    import yaml

    try:
        doc = safe_load_strict(text)
    except RecursionError:
        raise ProfileError(f"{origin}: nested too deeply to be a hardware profile") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ProfileError(f"{origin}: not valid YAML{where}: {problem}") from None
    if doc is None:
        raise ProfileError(f"{origin}: empty file (expected a hardware profile mapping)")
    return doc


def loads_profile(text: str, origin: str = "<string>") -> HardwareProfile:
    """Parse YAML text (strictly) into a HardwareProfile."""
    return profile_from_dict(parse_profile_text(text, origin), origin=origin)


def dumps_profile(p: HardwareProfile) -> str:
    header = (
        f"# vramplan hardware profile (schema {SCHEMA_VERSION}). Units live in the strings:\n"
        '# sizes "24 GiB" (binary) or "24 GB" (decimal), bandwidths "GB/s", compute "TFLOPS", times "us".\n'
    )
    import yaml

    body = yaml.safe_dump(profile_to_dict(p), sort_keys=False, allow_unicode=True, default_flow_style=False, width=100)
    return header + body


def read_profile_text(path: str | os.PathLike[str]) -> str:
    """A profile file's text; a file that is missing, a directory or unreadable is a one-line ProfileError."""
    path = Path(path)
    try:
        return read_text(path)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ProfileError(f"{path}: is a directory, not a profile file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    return loads_profile(read_profile_text(path), str(Path(path)))
