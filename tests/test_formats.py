"""A format has an identity (planner.formats): every engine's weight and KV-cache formats, each one record with every
facet, and a nearest format in every other engine that exists there."""

from __future__ import annotations

import math

import pytest

from vramplan.planner.errors import PlanError
from vramplan.planner.formats import ENGINES, EAGER, GRAPH, KV, WEIGHTS, format_of, formats, nearest
from vramplan.planner.gguf import GGUF_FILE_TYPES
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.planner.request import LLAMA_CPP_KV_DTYPES

ALL = list(formats().values())


@pytest.mark.parametrize("f", ALL, ids=lambda f: f"{f.engine}/{f.kind}/{f.name}")
def test_every_format_has_every_facet(f):
    assert f.engine in ENGINES and f.kind in (WEIGHTS, KV) and f.name
    assert 0 < f.bits <= 32
    assert math.isfinite(f.quality_cost_pct) and f.quality_cost_pct >= 0 and f.quality_source
    assert f.devices and set(f.devices) <= {"cuda", "mps", "cpu"}
    assert f.decode in (EAGER, GRAPH) and isinstance(f.compiles, bool)
    assert set(f.nearest) == set(ENGINES), f"{f.name}: nearest in every engine"
    for engine, name in f.nearest.items():
        assert format_of(engine, f.kind, name).name == name  # it exists there, of the same kind
    assert f.nearest[f.engine] == f.name


def test_every_engine_has_its_formats():
    have = {(f.engine, f.kind) for f in ALL}
    assert have == {(e, k) for e in ENGINES for k in (WEIGHTS, KV)}
    assert {f.name for f in ALL if f.engine == "vramplan" and f.kind == WEIGHTS} == set(SCHEMES)
    assert {f.name for f in ALL if f.engine == "vramplan" and f.kind == KV} == set(KV_SCHEMES)
    assert {f.name for f in ALL if f.engine == "llama.cpp" and f.kind == WEIGHTS} == set(GGUF_FILE_TYPES)
    assert {f.name for f in ALL if f.engine == "llama.cpp" and f.kind == KV} == set(LLAMA_CPP_KV_DTYPES)


@pytest.mark.parametrize("name, source, target, device, expected", [
    ("bnb-nf4", "vramplan", "llama.cpp", None, "Q4_K_M"),
    ("bf16", "vramplan", "llama.cpp", None, "BF16"),
    ("quanto-int8", "vramplan", "vllm", None, "fp8_per_tensor"),
    ("Q4_K_M", "llama.cpp", "vramplan", "cuda", "bnb-nf4"),
    ("Q4_K_M", "llama.cpp", "vramplan", "cpu", "quanto-int4"),  # bitsandbytes is the CUDA backend
    ("Q8_0", "llama.cpp", "vramplan", "cpu", "quanto-int8"),
    ("Q2_K", "llama.cpp", "vllm", None, "mxfp4"),
])
def test_nearest_weights(name, source, target, device, expected):
    assert nearest(name, WEIGHTS, source, target, device) == expected


def test_nearest_caches_and_the_same_engine():
    assert nearest("fp8", KV, "vramplan", "llama.cpp") == "q8_0"
    assert nearest("quanto-int2", KV, "vramplan", "ollama") == "q4_0"  # llama.cpp's smallest of the three planned
    assert nearest("q4_0", KV, "llama.cpp", "vllm") == "fp8"
    assert nearest("Q6_K", WEIGHTS, "llama.cpp", "llama.cpp") == "Q6_K"


def test_an_unknown_format_is_a_plan_error():
    with pytest.raises(PlanError, match="vllm has no weights format 'nf4'"):
        format_of("vllm", WEIGHTS, "nf4")
