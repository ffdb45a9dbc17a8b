"""Units at the edges: what parses, what is refused, and that nothing else can happen."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from vramplan.planner.errors import UnitError, VramplanError
from vramplan.planner.units import (
    GiB, MiB, format_bytes, format_tokens, parse_bandwidth, parse_bytes, parse_context, parse_flops, parse_fraction,
    parse_seconds,
)


@pytest.mark.parametrize("text,tokens", [
    ("32k", 32768), ("128k", 131072), ("1m", 1048576), ("1M", 1048576), ("4096", 4096), (4096, 4096),
    ("32K", 32768), (" 2k ", 2048), ("1.5k", 1536), ("16m", 16 * 1024**2),
])
def test_context(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["0", "-1", "-2k", "", "k", "32kb", "1.0001k", "32 tokens", "17m", "1e3", True, 0, -5,
                                  "1g", "nan"])
def test_context_refused(text):
    with pytest.raises(UnitError):
        parse_context(text)


@pytest.mark.parametrize("text,n", [
    ("24GiB", 24 * GiB), ("24 GiB", 24 * GiB), ("512MiB", 512 * MiB), ("24GB", 24 * 10**9), ("1.5 GiB", 3 * GiB // 2),
    ("0B", 0), ("100B", 100), ("2 TB", 2 * 10**12), (1024, 1024),
])
def test_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["24", "24G", "24Gb", "24 gb", "-1GiB", "GiB", "24 GiBs", "1.3B", "iB", "24 Gib",
                                  "24gib", -1, True, "1e9B"])
def test_bytes_refused(text):
    with pytest.raises(UnitError):
        parse_bytes(text)


def test_bandwidth_flops_seconds_fraction():
    assert parse_bandwidth("1008 GB/s") == 1008e9
    assert parse_bandwidth("25 GiB/s") == 25 * GiB
    assert parse_flops("165.2 TFLOPS") == pytest.approx(165.2e12)
    assert parse_flops("989 TFLOP/s") == pytest.approx(989e12)
    assert parse_seconds("5 us") == pytest.approx(5e-6)
    assert parse_seconds("1.5 ms") == pytest.approx(1.5e-3)
    assert (parse_seconds("10 min"), parse_seconds("10m"), parse_seconds("2h"), parse_seconds("1d")) == (
        600.0, 600.0, 7200.0, 86400.0)  # durations past a second, as --max-ttft takes them
    assert parse_fraction("0.25") == 0.25 and parse_fraction("85%") == pytest.approx(0.85)
    for bad, fn in [("1008 Gb/s", parse_bandwidth), ("0 GB/s", parse_bandwidth), ("fast", parse_flops),
                    ("5", parse_seconds), ("1.5", parse_fraction), ("-3%", parse_fraction)]:
        with pytest.raises(UnitError):
            fn(bad)


def test_formatting():
    assert format_bytes(24 * GiB) == "24.00 GiB"
    assert format_bytes(512) == "512 B"
    assert format_tokens(32768) == "32k" and format_tokens(1048576) == "1m" and format_tokens(1000) == "1000"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=12), st.integers(min_value=-10**12, max_value=10**12), st.booleans()))
def test_any_input_parses_or_raises_our_error(value):
    for fn in (parse_context, parse_bytes, parse_bandwidth, parse_flops, parse_seconds, parse_fraction):
        try:
            out = fn(value)
        except VramplanError:
            continue
        assert isinstance(out, (int, float)) and out >= 0


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=16 * 1024), st.sampled_from(["k", "K", "", "m"]))
def test_context_round_numbers(n, suffix):
    mult = {"k": 1024, "K": 1024, "": 1, "m": 1024**2}[suffix]
    if n * mult > 16 * 1024**2:
        with pytest.raises(UnitError):
            parse_context(f"{n}{suffix}")
    else:
        assert parse_context(f"{n}{suffix}") == n * mult
