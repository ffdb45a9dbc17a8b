"""Quantities at the edges: "32k" tokens, "24GiB", "1008 GB/s", "165 TFLOPS".

Inside the project everything is plain numbers in one unit each: tokens, bytes,
bytes per second, FLOP per second, seconds. These parsers run only at the edges
(CLI flags, YAML files) and refuse anything ambiguous: a bare "24" for memory, "24G"
(GB or GiB?), "24Gb" (bits), negative or non-integral results.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from .errors import UnitError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# Longest context anyone may ask for: 16M tokens. Beyond that is a typo.
MAX_CONTEXT_TOKENS = 1 << 24
# Upper bounds on quantities, far beyond any machine: a value past them is a typo or a unit slip ("1e30GiB"), and
# planning it would only print nonsense.
# Memory: 1 PiB. The largest single machines hold tens of TiB (HPE Superdome Flex: 48 TiB of RAM; a DGX GH200
# NVLink domain: 144 TB of GPU-addressable memory).
MAX_MEMORY_BYTES = 1 << 50
MAX_MEMORY_TEXT = "1 PiB"
# Bandwidth: 100 PB/s. The fastest memory in a machine today moves ~8 TB/s (B200's HBM3e).
MAX_BANDWIDTH_BYTES_PER_S = 1e17
MAX_BANDWIDTH_TEXT = "100000000 GB/s"
# Compute: 1 EFLOP/s. One B200 does ~2.25 PFLOP/s of dense bf16; a profile describes one machine.
MAX_FLOPS = 1e18
MAX_FLOPS_TEXT = "1000000 TFLOPS"
# A refused "1e3" is written out for the user ("1e3 = 1000") up to this exponent; "1e-99999999" is not.
MAX_EXPONENT_SHOWN = 30

# An exponent ("1e30") is read only to say what is wrong: past a bound, that it is; within, to write the number out.
_NUMBER = r"(?P<num>(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?P<exp>[eE][-+]?[0-9]+)?)"

_CONTEXT_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<suffix>[kKmM]?)\s*$")
_CONTEXT_MULT = {"": 1, "k": 1024, "m": 1024**2}

# Prefix letters are case-insensitive except that a "B" must be upper case:
# lowercase b means bits (accelerate's trap) and is refused.
_BYTE_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kKmMgGtTpP]?)(?P<i>i?)B\s*$")
_DEC = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BIN = {"k": KiB, "m": MiB, "g": GiB, "t": TiB, "p": 1 << 50}

_BW_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kKmMgGtT]?)(?P<i>i?)B\s*/\s*s\s*$")
_FLOPS_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kKmMgGtTpP]?)FLOP(?:S|/s)\s*$")
_FLOPS_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}

_TIME_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>s|ms|us|µs|ns|min|m|h|d)\s*$")
# divisors, not 1e-6 multipliers: "5 us" must give exactly 5e-06; durations longer than a second multiply
_TIME_DIV = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_TIME_MUL = {"min": 60.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


_SIGNED_RE = re.compile(r"^\s*[-+]")
# "nan", "inf", "infinity" alone or with a unit ("nanGiB", "inf GB/s", "infk"): float() reads them, a quantity can't be.
_NOT_A_NUMBER_RE = re.compile(r"(?i)^\s*[-+]?(?P<word>nan|inf|infinity)\s*"
                              r"(?:[kmgtpnuµ]?i?(?:b(?:\s*/\s*s)?|flops?|flop/s|s)?)\s*$")
_BITS_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kKmMgGtTpP]?)(?P<i>[iI]?)b(?P<rest>\s*(/\s*s)?)\s*$")


def _diagnose(text: object, what: str, advice: str) -> UnitError:
    """Say what is actually wrong with a quantity the parser refused."""
    s = str(text)
    m = _NOT_A_NUMBER_RE.match(s)
    if m:
        return OutOfRangeError(f"{what} {text!r} is not a number: give a finite number with its unit"
                               if m["word"].lower() == "nan" else f"{what} {text!r} is not a finite number")
    if _SIGNED_RE.match(s):
        return UnitError(f"{what} {text!r} must not be negative" if s.lstrip().startswith("-")
                         else f"{what} {text!r}: write it without a sign")
    m = _BITS_RE.match(s)
    if m:
        fixed = f"{m['num']}{m['prefix'].upper()}{'i' if m['i'] else ''}B{m['rest'].strip()}"
        return UnitError(f"{what} {text!r}: a lowercase 'b' means bits; for bytes write {fixed!r}")
    if not s.strip():
        return UnitError(f"{what} is empty: {advice}")
    return UnitError(f"{what} {text!r} {advice}")


class OutOfRangeError(UnitError):
    """A quantity that parses but is no real value: NaN, infinite, or beyond any machine."""


def _finite(value: float, text: object, what: str) -> float:
    """A float parsed from a number or from a value in the internal unit; NaN or infinity is refused."""
    if math.isnan(value):
        raise OutOfRangeError(f"{what} {text!r} is not a number: give a finite number with its unit")
    if math.isinf(value) and not isinstance(text, str):
        raise OutOfRangeError(f"{what} {text!r} is not a finite number")
    return value


def _at_most(value: float, maximum: float, text: object, what: str, limit: str) -> None:
    """Refuse a value beyond any machine (an overflow to infinity from "1e400GiB" included)."""
    if value > maximum:
        raise OutOfRangeError(f"{what} {text!r} is larger than any machine (max {limit})")


def _no_exponent(m: re.Match, text: object, what: str) -> None:
    """Refuse a number written with an exponent (once it is known to be within bounds): units live in the unit."""
    if m["exp"]:
        small = abs(int(m["exp"][1:])) <= MAX_EXPONENT_SHOWN
        plain = f" ({m['num']} = {format(Decimal(m['num']), 'f')})" if small else ""
        raise UnitError(f"{what} {text!r}: write the number without an exponent{plain}")


def _whole(value: float, text: str, what: str) -> int:
    rounded = round(value)
    if not math.isclose(value, rounded, rel_tol=0, abs_tol=1e-6):
        raise UnitError(f"{what} {text!r} is not a whole number ({value:g})")
    return int(rounded)


# A context written like a size ("32kb", "32 KiB"): the token count it most likely means is the size's number.
_BYTES_AS_TOKENS_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kKmM])[iI]?[bB]\s*$")


def _tokens_of(m: re.Match) -> int:
    return int(float(m["num"]) * _CONTEXT_MULT[m["prefix"].lower()])


def parse_context(text: str | int) -> int:
    """Tokens: 32768, "32k" (= 32768), "128K", "1m" (= 1048576). k and m are binary (1024)."""
    if isinstance(text, bool):
        raise UnitError(f"context {text!r} is not a number of tokens")
    if isinstance(text, int):
        value = text
    else:
        m = _CONTEXT_RE.match(str(text))
        if not m:
            if (b := _BYTES_AS_TOKENS_RE.match(str(text))) is not None:  # "32kb", "32KB": a size, not tokens
                raise UnitError(f"context {text!r} is a number of tokens, not a size: write {b['num']}"
                                f"{b['prefix'].lower()} (= {_tokens_of(b)} tokens)")
            raise _diagnose(text, "context", "is not a token count; write e.g. 4096, 32k (=32768) or 1m (=1048576)")
        tokens = float(m["num"]) * _CONTEXT_MULT[m["suffix"].lower()]
        if tokens > MAX_CONTEXT_TOKENS:  # before rounding: "1e400" is infinite
            raise UnitError(f"context {text!r} is beyond any model's reach (max {MAX_CONTEXT_TOKENS} tokens = 16m)")
        _no_exponent(m, text, "context")
        value = _whole(tokens, str(text), "context")
    if value <= 0:
        raise UnitError(f"context {text!r} must be at least 1 token")
    if value > MAX_CONTEXT_TOKENS:
        raise UnitError(f"context {text!r} is beyond any model's reach (max {MAX_CONTEXT_TOKENS} tokens = 16m)")
    return value


def parse_bytes(text: str | int, *, what: str = "size") -> int:
    """Bytes: "24GiB", "512 MiB" (binary), "24GB" (decimal), "0B". A bare number is refused."""
    if isinstance(text, bool):
        raise UnitError(f"{what} {text!r} needs a unit such as GiB or GB")
    if isinstance(text, int):
        if text < 0:
            raise UnitError(f"{what} {text} must not be negative")
        _at_most(text, MAX_MEMORY_BYTES, text, what, MAX_MEMORY_TEXT)
        return text
    m = _BYTE_RE.match(str(text))
    if not m:
        raise _diagnose(text, what, "needs an explicit unit: e.g. 24GiB (binary), 24GB (decimal), 512MiB")
    prefix = m["prefix"].lower()
    if m["i"]:
        if not prefix:
            raise UnitError(f"{what} {text!r}: 'iB' needs a prefix (KiB, MiB, GiB, TiB, PiB)")
        mult = _BIN[prefix]
    else:
        mult = _DEC[prefix]
    value = float(m["num"]) * mult
    _at_most(value, MAX_MEMORY_BYTES, text, what, MAX_MEMORY_TEXT)
    _no_exponent(m, text, what)
    return _whole(value, str(text), what)


def parse_bandwidth(text: str | int | float, *, what: str = "bandwidth") -> float:
    """Bytes per second: "1008 GB/s", "25 GiB/s"."""
    if isinstance(text, bool):
        raise UnitError(f"{what} {text!r} needs a unit such as GB/s")
    m = None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _BW_RE.match(str(text))
        if not m:
            raise _diagnose(text, what, "needs a unit: e.g. 1008 GB/s or 25 GiB/s")
        prefix = m["prefix"].lower()
        mult = _BIN[prefix] if m["i"] and prefix else _DEC[prefix]
        if m["i"] and not prefix:
            raise UnitError(f"{what} {text!r}: 'iB/s' needs a prefix")
        value = float(m["num"]) * mult
    _finite(value, text, what)
    _at_most(value, MAX_BANDWIDTH_BYTES_PER_S, text, what, MAX_BANDWIDTH_TEXT)
    if m is not None:
        _no_exponent(m, text, what)
    if value <= 0:
        raise UnitError(f"{what} {text!r} must be positive")
    return value


def parse_flops(text: str | int | float, *, what: str = "compute") -> float:
    """FLOP per second: "165 TFLOPS", "989 TFLOP/s"."""
    if isinstance(text, bool):
        raise UnitError(f"{what} {text!r} needs a unit such as TFLOPS")
    m = None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _FLOPS_RE.match(str(text))
        if not m:
            raise _diagnose(text, what, "needs a unit: e.g. 165 TFLOPS or 989 TFLOP/s")
        value = float(m["num"]) * _FLOPS_MULT[m["prefix"].lower()]
    _finite(value, text, what)
    _at_most(value, MAX_FLOPS, text, what, MAX_FLOPS_TEXT)
    if m is not None:
        _no_exponent(m, text, what)
    if value <= 0:
        raise UnitError(f"{what} {text!r} must be positive")
    return value


def parse_seconds(text: str | int | float, *, what: str = "time") -> float:
    """Seconds: "5 us", "1.2 ms", "0.5 s", "10 min" (or "10m"), "2h", "1d"."""
    if isinstance(text, bool):
        raise UnitError(f"{what} {text!r} needs a unit such as ms or us")
    m = None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _TIME_RE.match(str(text))
        if not m:
            raise _diagnose(text, what, "needs a unit: s, ms, us, ns, min, h or d")
        unit = m["unit"]
        value = float(m["num"]) * _TIME_MUL[unit] if unit in _TIME_MUL else float(m["num"]) / _TIME_DIV[unit]
    _finite(value, text, what)
    if math.isinf(value):
        raise UnitError(f"{what} {text!r} is too long to be a time anything waits for")
    if m is not None:
        _no_exponent(m, text, what)
    if value < 0:
        raise UnitError(f"{what} {text!r} must not be negative")
    return value


def parse_fraction(text: str | int | float, *, what: str = "fraction") -> float:
    """A fraction in [0, 1] ("0.85"); percentages ("85%") are converted."""
    if isinstance(text, bool):
        raise UnitError(f"{what} {text!r} is not a fraction")
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise UnitError(f"{what} {text!r} is not a fraction between 0 and 1") from None
    if math.isnan(value):
        raise UnitError(f"{what} {text!r} is not a number: give a fraction between 0 and 1")
    if not (0.0 <= value <= 1.0):
        raise UnitError(f"{what} {text!r} must lie between 0 and 1")
    return value


def format_bytes(n: float | int | None) -> str:
    """Human bytes, binary units: 23622320128 -> '22.00 GiB'."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def format_bandwidth(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / 1e9:.1f} GB/s"


def format_flops(fps: float | None) -> str:
    """TFLOPS to a tenth; a rate under 1 TFLOPS (a CPU's) in GFLOPS, where a tenth of a TFLOPS would hide it."""
    if fps is None:
        return "-"
    return f"{fps / 1e12:.1f} TFLOPS" if fps >= 1e12 else f"{fps / 1e9:.0f} GFLOPS"


def format_count(n: int | float | None) -> str:
    """Parameter counts: 8030261248 -> '8.03B'."""
    if n is None:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def format_tokens(n: int | None) -> str:
    """Context lengths: 32768 -> '32k', 131072 -> '128k', 1000 -> '1000'."""
    if n is None:
        return "-"
    if n >= 1024**2 and n % 1024**2 == 0:
        return f"{n // 1024**2}m"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def format_duration(seconds: float) -> str:
    """A time as a person reads it: seconds under a minute ("14.12 s"), then minutes, hours or days ("2.2 h")."""
    if seconds < 60:
        return f"{seconds:.2f} s"
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    raise AssertionError(seconds)
