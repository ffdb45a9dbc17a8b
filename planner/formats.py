"""Every engine's formats, one typed record each: `Format(engine, name)`.

A weight format or a KV-cache format of one engine (vramplan's runtime, llama.cpp, Ollama, vLLM, plain transformers)
with its facets in one place: its bits, its quality cost (and the source of that number), the devices it runs on, how
a decode step with it runs there (op by op from Python, or as one graph), whether vramplan's --compile takes it, and
its nearest format in every other engine. A row of the engine table translates only what the user forced (a --quant
or --kv-dtype given in another engine's words) through `nearest`; everything else is each engine's own search.
`tests/test_formats.py` asserts that every format has every facet. Pure.

The facts come from the tables that size and price each engine (planner.quant's schemes, planner.gguf's file types
with llama.cpp's perplexity table, planner.engines.vllm_rules' formats): this module is where they meet, named.
"""

from __future__ import annotations

from functools import cache

from .errors import PlanError
from .gguf import GGUF_FILE_TYPES
from .quant import CPU_KERNEL_BACKEND, KV_SCHEMES, SCHEMES
from .record import record
from .request import COMPILE_SCHEMES, CPU_COMPILE_SCHEMES, LLAMA_CPP_KV_DTYPES

ENGINES = ("vramplan", "llama.cpp", "ollama", "vllm", "transformers")
WEIGHTS, KV = "weights", "kv"
# How a decode step runs: Python issuing each op (vramplan's eager runtime, plain transformers' generate), or one graph
# a C++ loop or a CUDA graph replays (ggml's graph in llama.cpp and Ollama; vLLM's CUDA graphs).
EAGER, GRAPH = "eager", "graph"

# llama.cpp's KV cache types and the quality each costs: llama_rules.KV_QUALITY_PCT_ASSUMED (assumptions, said so).
# vLLM's: --kv-cache-dtype auto (the model's dtype) and fp8 (E4M3 with a per-tensor scale).
VLLM_KV = ("auto", "fp8")
# vLLM's online weight formats of a bf16/fp16 checkpoint (planner.engines.vllm_rules.online_format) with their quality
# cost and its source. MXFP4 rounds its scales to powers of two: quantized from bf16 without calibration, dense
# weights lose far more than a K-quant's (LocalAI's measurement, Qwen3-4B wikitext-2: BF16 13.32, Q4_K_M 13.66,
# MXFP4 17.42: +30.8 %; backend/cpp/llama-cpp/paged/MXFP4_QUALITY.md, 2026-06-21). FP8 E4M3 with one scale per
# tensor: no published perplexity for a weight-only per-tensor cast was found; assumed at 0.5 % (per-channel int8
# RTN is within noise of bf16, planner.quant's quanto-int8; one scale per tensor is coarser).
VLLM_WEIGHTS = {"bf16": (16, 0.0, "reference"), "fp16": (16, 0.0, "reference"),
                "fp8_per_tensor": (8, 0.5, "assumption: FP8 E4M3 weight-only with a per-tensor scale (no published "
                                           "perplexity found; per-channel int8 RTN is within noise of bf16)"),
                "mxfp4": (4, 30.8, "LocalAI MXFP4_QUALITY.md (2026-06-21): Qwen3-4B wikitext-2 PPL 13.32 -> 17.42 "
                                   "quantized from bf16 without calibration")}
# The vramplan scheme whose bytes a vLLM or GGUF weight format is closest to, on a GPU (the CPU's is the same-bits
# scheme that runs there: `nearest`).
_VRAMPLAN_FOR_BITS = {16: "bf16", 8: "bnb-int8", 6: "bnb-int8", 5: "bnb-nf4", 4: "bnb-nf4", 3: "bnb-nf4", 2: "bnb-nf4"}
# ... and off CUDA (planner.quant: quanto is the CPU-capable backend).
_VRAMPLAN_FOR_BITS_CPU = {8: "quanto-int8", 6: "quanto-int8", 5: "quanto-int4", 4: "quanto-int4", 3: "quanto-int4",
                          2: "quanto-int4"}
_VLLM_FOR_BITS = {16: "bf16", 8: "fp8_per_tensor", 6: "fp8_per_tensor", 5: "mxfp4", 4: "mxfp4", 3: "mxfp4",
                  2: "mxfp4"}
_GGUF_FOR_BITS = {16: "BF16", 8: "Q8_0", 6: "Q6_K", 5: "Q5_K_M", 4: "Q4_K_M", 3: "Q3_K_M", 2: "Q2_K"}
_CACHE_FOR_KV = {"bf16": "f16", "fp16": "f16", "fp8": "q8_0", "quanto-int4": "q4_0", "quanto-int2": "q4_0"}


@record(kw_only=True)
class Format:
    """One engine's weight or KV-cache format and its facets."""

    engine: str
    name: str
    kind: str  # WEIGHTS or KV
    bits: float  # nominal bits per weight (per cached element for KV)
    quality_cost_pct: float  # perplexity added over bf16, as the engine's plans rank it
    quality_source: str
    devices: tuple[str, ...]  # accelerators it runs on: "cuda", "mps", "cpu"
    decode: str  # EAGER or GRAPH: how a decode step with it runs
    compiles: bool  # vramplan's --compile takes it (a static cache, one compiled step), on some device
    nearest: dict  # engine -> the name of its nearest format of the same kind

    def __post_init__(self) -> None:
        if self.engine not in ENGINES or self.kind not in (WEIGHTS, KV) or self.decode not in (EAGER, GRAPH):
            raise PlanError(f"format {self.engine}/{self.name}: unknown engine, kind or decode")


def _gguf_bits(file_type: str) -> int:
    from .gguf import GGML_TYPES

    return max(2, min(16, round(GGML_TYPES[GGUF_FILE_TYPES[file_type].default_type].bits_per_weight)))


def _bits_key(table: dict, bits: float):
    return table[min(table, key=lambda b: (abs(b - bits), -b))]


def _vramplan_weights() -> list[Format]:
    out = []
    for s in SCHEMES.values():
        out.append(Format(engine="vramplan", name=s.name, kind=WEIGHTS, bits=s.bits,
                          quality_cost_pct=s.quality.ppl_increase_pct, quality_source=s.quality.source,
                          devices=s.devices, decode=GRAPH if s.compiled_only else EAGER,
                          compiles=s.name in COMPILE_SCHEMES or s.name in CPU_COMPILE_SCHEMES,
                          nearest={"llama.cpp": _bits_key(_GGUF_FOR_BITS, s.bits), "ollama": _bits_key(
                              _GGUF_FOR_BITS, s.bits), "vllm": s.name if s.name in VLLM_WEIGHTS else _bits_key(
                              _VLLM_FOR_BITS, s.bits), "transformers": _bits_key(_VRAMPLAN_FOR_BITS, s.bits)
                              if s.compiled_only or s.backend == CPU_KERNEL_BACKEND else s.name, "vramplan": s.name}))
    return out


def _transformers_weights() -> list[Format]:
    """Plain transformers loads vramplan's schemes through the same libraries (bitsandbytes, optimum-quanto; torchao
    for w8a8), op by op; not the ones vramplan decodes compiled only (its generate() is eager), nor vramplan's own CPU
    kernel (cpu-w4a8: torchao's nearest, 8da4w, stores other bytes)."""
    return [Format(engine="transformers", name=f.name, kind=WEIGHTS, bits=f.bits, quality_cost_pct=f.quality_cost_pct,
                   quality_source=f.quality_source, devices=f.devices, decode=EAGER, compiles=False,
                   nearest={**f.nearest, "vramplan": f.name, "transformers": f.name})
            for f in _vramplan_weights() if f.decode == EAGER and SCHEMES[f.name].backend != CPU_KERNEL_BACKEND]


def _gguf_weights(engine: str) -> list[Format]:
    from .engines import llamacpp_rules as rules

    out = []
    for name in GGUF_FILE_TYPES:
        bits = _gguf_bits(name)
        listed = name if name in rules.FILE_TYPE_DELTA_PPL else rules.QUALITY_STAND_IN.get(name)
        quality = rules.quality_cost_pct(listed, "f16") if listed else None
        source = (rules.PERPLEXITY_README if listed == name else
                  f"{listed}'s row: {name} has none in the perplexity table (an assumption"
                  + (f": {rules.NO_PERPLEXITY_ROW[name]})" if name in rules.NO_PERPLEXITY_ROW else ")") if listed else
                  "no perplexity row: not planned")
        out.append(Format(engine=engine, name=name, kind=WEIGHTS, bits=bits,
                          quality_cost_pct=quality if quality is not None else float("nan"), quality_source=source,
                          devices=("cuda", "mps", "cpu"), decode=GRAPH, compiles=False,
                          nearest={"vramplan": _bits_key(_VRAMPLAN_FOR_BITS, bits), "vllm": _bits_key(
                              _VLLM_FOR_BITS, bits), "transformers": _bits_key(_VRAMPLAN_FOR_BITS, bits),
                              "llama.cpp": name, "ollama": name}))
    return out




def _vllm_weights() -> list[Format]:
    return [Format(engine="vllm", name=name, kind=WEIGHTS, bits=bits, quality_cost_pct=q, quality_source=src,
                   devices=("cuda",), decode=GRAPH, compiles=False,
                   nearest={"vramplan": _bits_key(_VRAMPLAN_FOR_BITS, bits), "transformers": _bits_key(
                       _VRAMPLAN_FOR_BITS, bits), "llama.cpp": _bits_key(_GGUF_FOR_BITS, bits), "ollama": _bits_key(
                       _GGUF_FOR_BITS, bits), "vllm": name})
            for name, (bits, q, src) in VLLM_WEIGHTS.items()]


def _kv_formats() -> list[Format]:
    from .engines import llamacpp_rules as rules

    out = []
    for k in KV_SCHEMES.values():
        bits = 8 * k.bytes_per_element
        near = {"llama.cpp": _CACHE_FOR_KV[k.name], "ollama": _CACHE_FOR_KV[k.name],
                "vllm": "fp8" if k.name == "fp8" else "auto"}
        for engine in ("vramplan", "transformers"):
            out.append(Format(engine=engine, name=k.name, kind=KV, bits=bits,
                              quality_cost_pct=k.quality.ppl_increase_pct, quality_source=k.quality.source,
                              devices=("cuda", "mps", "cpu"), decode=EAGER,
                              compiles=engine == "vramplan" and k.name in COMPILE_SCHEMES.values(),
                              nearest={**near, "vramplan": k.name, "transformers": k.name}))
    for engine in ("llama.cpp", "ollama"):
        for name in LLAMA_CPP_KV_DTYPES:
            t = rules.KV_GGML_TYPES[name]
            out.append(Format(engine=engine, name=name, kind=KV, bits=8 * t.block_bytes / t.block_elements,
                              quality_cost_pct=rules.KV_QUALITY_PCT_ASSUMED[name],
                              quality_source="assumption (no published table)", devices=("cuda", "mps", "cpu"),
                              decode=GRAPH, compiles=False,
                              nearest={"vramplan": {"f16": "bf16", "q8_0": "fp8", "q4_0": "quanto-int4"}[name],
                                       "transformers": {"f16": "bf16", "q8_0": "fp8", "q4_0": "quanto-int4"}[name],
                                       "vllm": "auto" if name == "f16" else "fp8", "llama.cpp": name,
                                       "ollama": name}))
    for name in VLLM_KV:
        out.append(Format(engine="vllm", name=name, kind=KV, bits=16 if name == "auto" else 8,
                          quality_cost_pct=KV_SCHEMES["fp8"].quality.ppl_increase_pct if name == "fp8" else 0.0,
                          quality_source=KV_SCHEMES["fp8"].quality.source if name == "fp8" else "reference",
                          devices=("cuda",), decode=GRAPH, compiles=False,
                          nearest={"vramplan": "fp8" if name == "fp8" else "bf16",
                                   "transformers": "fp8" if name == "fp8" else "bf16",
                                   "llama.cpp": "q8_0" if name == "fp8" else "f16",
                                   "ollama": "q8_0" if name == "fp8" else "f16", "vllm": name}))
    return out


@cache
def formats() -> dict[tuple[str, str, str], Format]:
    """Every format, by (engine, kind, name)."""
    every = [*_vramplan_weights(), *_transformers_weights(), *_gguf_weights("llama.cpp"), *_gguf_weights("ollama"),
             *_vllm_weights(), *_kv_formats()]
    return {(f.engine, f.kind, f.name): f for f in every}


def format_of(engine: str, kind: str, name: str) -> Format:
    """One format by its identity; a name the engine does not have is a PlanError."""
    f = formats().get((engine, kind, name))
    if f is None:
        raise PlanError(f"{engine} has no {kind} format {name!r}")
    return f


def nearest(name: str, kind: str, source: str, target: str, device: str | None = None) -> str:
    """The `target` engine's format nearest `source`'s `name`, that runs on `device` where given (a vramplan scheme
    that does not runs there gives way to one of its bits that does)."""
    if source == target:
        return name
    found = format_of(source, kind, name).nearest[target]
    f = format_of(target, kind, found)
    if kind == WEIGHTS and target in ("vramplan", "transformers") and device in ("cpu", "mps") and f.bits < 16:
        return _bits_key(_VRAMPLAN_FOR_BITS_CPU, f.bits)  # bitsandbytes is the CUDA backend, quanto the CPU's
    if device is None or device in f.devices:
        return found
    same = [g for g in formats().values() if g.engine == target and g.kind == kind and g.bits == f.bits
            and device in g.devices]
    return min(same, key=lambda g: g.quality_cost_pct).name if same else found
