"""One answer across engines: the request vramplan planned, planned again by each other engine's own rules.

One row per engine, in one shape: the configuration it would run (weights, KV cache), whether it fits, where it puts
the model, its predicted decode and TTFT (and by which speed model), the largest context it holds with that
configuration, how many times vramplan's plan it decodes, and the vramplan command that prints its full command.
- llama.cpp: its plan (planner.engines.llamacpp) at the GGUF file type of vramplan's chosen scheme (Q4_K_M when
  nothing fits) with an f16 cache: one file type and one cache, not its whole search (`--engine llama.cpp` does that);
- Ollama: llama.cpp's plan for llama-server as Ollama launches it (its memory estimate, num_batch, one GPU when the
  model fits one), at the published quant closest to that file type;
- vLLM: the smallest tensor/pipeline-parallel layout that holds the request (planner.engines.vllm), priced as a
  compiled decode (CUDA graphs: the constants fitted on gpt-fast and torchao's published runs, an assumption for vLLM)
  where it runs on one GPU; a multi-GPU layout's speed is not predicted.
Pure: no torch, no files.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import VramplanError
from ..hardware import HardwareProfile
from ..modelspec import ModelSpec, context_limit
from ..plan import Plan
from ..request import Request
from ..speed import compiled_scheme, estimate_compiled, fitted_entry
from ..units import format_bytes
from . import llamacpp, ollama, vllm

# llama.cpp's file type beside a vramplan plan whose scheme has no GGUF equivalent, or that found nothing fitting
OTHER_ENGINE_FILE_TYPE = "Q4_K_M"
# vLLM weight formats -> the compiled decode whose bytes and constants price them (bits, int4 group)
VLLM_COMPILED_BITS = {"bf16": (16, None), "fp16": (16, None), "fp8_per_tensor": (8, None), "checkpoint-fp8": (8, None),
                      "mxfp4": (4, 32), "checkpoint-mxfp4": (4, 32)}
# Predictions closer than this ratio are called a tie; the dispatch is named as a reason when it is more than this share
# of vramplan's predicted decode step.
TIE = 1.05
DISPATCH_SHARE = 0.10
VLLM_SPEED_FROM = ("a compiled decode of the same bits (CUDA graphs; constants fitted on gpt-fast and torchao's "
                   "published runs: an assumption for vLLM, whose own decode is not fitted)")


def engine_rows(spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> list[dict]:
    """vramplan's plan `p` and llama.cpp's, Ollama's and vLLM's answers to its request, one row each."""
    return [_vramplan(spec, hw, req, p),
            _guarded("llama.cpp", lambda: _llamacpp(spec, hw, req, p)),
            _guarded("ollama", lambda: _ollama(spec, hw, p)),
            _guarded("vllm", lambda: _vllm(spec, hw, p))]


def fastest(p: Plan, rows: list[dict]) -> dict | None:
    """Which engine decodes fastest here by prediction; None when nothing fits."""
    entries = [r for r in rows if r["fits"] and r.get("decode_tokens_per_s")]
    if not entries:
        return None
    best = max(entries, key=lambda r: r["decode_tokens_per_s"])
    out = {"engine": best["engine"], "decode_tokens_per_s": best["decode_tokens_per_s"], "why": _why(p, best, rows)}
    if p.fits and best["engine"] != "vramplan":
        out["decode_vs_plan"] = best["decode_tokens_per_s"] / p.predicted.decode_tokens_per_s
    return out


def _why(p: Plan, best: dict, rows: list[dict]) -> str:
    """What the speed models say makes the fastest one fast: where its layers are, and what vramplan's eager decode
    pays that a compiled engine does not."""
    if best["engine"] == "vramplan":
        return "no other engine's rules predict a faster decode for this request here"
    if p.fits and best["decode_tokens_per_s"] < TIE * p.predicted.decode_tokens_per_s:
        return (f"a tie: within {100 * (TIE - 1):.0f} % of vramplan's plan, less than the speed models' own error")
    parts = []
    c = p.choice if p.fits else None
    if c is not None and best.get("gpu_layers") is not None and best["gpu_layers"] > c.gpu_layers:
        parts.append(f"it holds {best['gpu_layers']} of {c.total_layers} layers on the GPU where vramplan's plan holds "
                     f"{c.gpu_layers}")
    dispatch = (p.chosen.speed.terms.get("dispatch_per_layer_s") or 0.0) if c is not None else 0.0
    step_s = 1.0 / p.predicted.decode_tokens_per_s if c is not None else 0.0
    if dispatch and c.on_gpu and dispatch * c.gpu_layers > DISPATCH_SHARE * step_s:
        parts.append(f"vramplan's eager decode spends {1e3 * dispatch * c.gpu_layers:.1f} ms a token issuing kernels "
                     f"({1e6 * dispatch:.0f} us per layer, {p.chosen.speed.terms.get('dispatch_source', '')}), which "
                     f"{best['engine']}'s decode does not")
    if c is not None and best.get("weight_quant") not in (None, c.weight_quant):
        parts.append(f"its weights are {best['weight_quant']} where vramplan's are {c.weight_quant}")
    return "; ".join(parts) or "its speed model's constants for this GPU are higher (see each engine's speed source)"


def _guarded(engine: str, row) -> dict:
    try:
        return row()
    except VramplanError as e:  # a model or request that engine's rules refuse: not an error of vramplan's plan
        return {"engine": engine, "fits": False, "reason": str(e)}


def _row(engine: str, weight_quant: str, kv_dtype: str, fits: bool, how: str) -> dict:
    return {"engine": engine, "weight_quant": weight_quant, "kv_dtype": kv_dtype, "fits": fits, "how": how}


def _layers(row: dict, c) -> dict:
    row.update(gpu_layers=c.gpu_layers, total_layers=c.total_layers, expert_layers_in_ram=c.expert_layers_on_cpu)
    return row


def _layers_placement(c) -> str:
    if not c.on_gpu:
        return "on the CPU"
    where = (f"all {c.total_layers} layers on the GPU" if c.gpu_layers == c.total_layers
             else f"{c.gpu_layers}/{c.total_layers} layers on the GPU")
    return where + (f", experts of {c.expert_layers_on_cpu} layers in RAM" if c.expert_layers_on_cpu else "")


def _with_speed(row: dict, p: Plan, speed, max_context: int | None, speed_from: str) -> dict:
    row.update(decode_tokens_per_s=speed.decode_tokens_per_s, ttft_s=speed.ttft_s, max_context_tokens=max_context,
               speed_from=speed_from)
    if p.fits and p.predicted.decode_tokens_per_s:  # how many times vramplan's plan
        row["decode_vs_plan"] = speed.decode_tokens_per_s / p.predicted.decode_tokens_per_s
    return row


def _vramplan(spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> dict:
    c = p.choice
    flags = f" --quant {c.weight_quant} --kv-dtype {c.kv_dtype}" if p.fits else ""
    row = _row("vramplan", c.weight_quant if p.fits else "-", c.kv_dtype if p.fits else "-", p.fits,
               f"vramplan run --model {spec.name} --hardware {hw.name} --context {req.context}{flags}")
    if not p.fits:
        row["reason"] = p.reasons[0] if p.reasons else "nothing fits"
        return row
    _layers(row, c)["placement"] = _layers_placement(c) + (
        f", {c.offload.value} offload" if c.on_gpu and c.gpu_layers < c.total_layers else "")
    row.update(decode_tokens_per_s=p.predicted.decode_tokens_per_s, ttft_s=p.predicted.ttft_s,
               max_context_tokens=p.chosen.max_context_tokens, speed_from="vramplan's speed model (the profile's "
               "calibration or public fit, else its defaults)")
    return row


def _llamacpp(spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> dict:
    file_type = (llamacpp.GGUF_FOR_SCHEME.get(p.choice.weight_quant, OTHER_ENGINE_FILE_TYPE) if p.fits
                 else OTHER_ENGINE_FILE_TYPE)
    other = llamacpp.plan_llamacpp(spec, hw, replace(req, engine="llama.cpp", quant=(file_type,), kv_dtype=("f16",),
                                                     gpu_layers=None, offload=None, expert_placement=None))
    row = _row("llama.cpp", file_type, "f16", other.fits, f"vramplan plan --engine llama.cpp --quant {file_type}")
    if not other.fits:
        row["reason"] = other.reasons[0] if other.reasons else "nothing fits llama.cpp's rules"
        return row
    _layers(row, other.choice)["placement"] = _layers_placement(other.choice)
    return _with_speed(row, p, other.chosen.speed, other.chosen.max_context_tokens,
                       "llama.cpp's speed model (its fitted or default constants)")


def _ollama(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> dict:
    # the published quant closest to the plan's file type (the llama.cpp row's where vramplan found nothing), not each
    # smaller one in turn as the export does (up to 15 plans: 110 ms for a 405B model that fits nowhere)
    q, launch, _, wanted, _ = ollama.ollama_plan(spec, hw, p, file_type=OTHER_ENGINE_FILE_TYPE, tries=1)
    ft = q.choice.weight_quant if q.fits else (wanted or OTHER_ENGINE_FILE_TYPE)
    tag, _ = ollama.ollama_tag(spec, ft)
    row = _row("ollama", ft, q.choice.kv_dtype if q.fits else "f16", q.fits, "vramplan plan --emit ollama")
    row["tag"] = tag
    if not q.fits:
        row["reason"] = q.reasons[0] if q.reasons else "nothing fits Ollama's launch"
        return row
    _layers(row, q.choice)["placement"] = (_layers_placement(q.choice)
                                           + f" (num_ctx {launch.num_ctx}, num_batch {launch.num_batch})")
    return _with_speed(row, p, q.chosen.speed, q.chosen.max_context_tokens,
                       "llama.cpp's speed model at Ollama's launch")


def _vllm(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> dict:
    a = vllm.vllm_layout(spec, hw, p)
    fmt = a.fmt.name if a.fmt is not None else "-"
    kv = "fp8" if a.kv_cache == "fp8" else "auto (the model's dtype)"
    if a.refused:
        row = _row("vllm", fmt, kv, False, "vramplan plan --emit vllm")
        row["reason"] = a.refused
        return row
    lay, req = a.layout, p.request
    row = _row("vllm", fmt, kv, lay.fits and lay.nodes <= req.nodes, "vramplan plan --emit vllm")
    row["placement"] = (f"TP {lay.tp} x PP {lay.pp}" + (f" over {lay.nodes} nodes" if lay.nodes > 1 else "")
                        + (f", {format_bytes(lay.cpu_offload_bytes)} of weights per GPU in RAM"
                           if lay.cpu_offload_bytes else "")
                        + f", --gpu-memory-utilization {lay.gpu_memory_utilization:.2f}")
    if not row["fits"]:
        row["reason"] = f"needs {lay.nodes} nodes of {hw.name} (--nodes {req.nodes})"
        return row
    max_context = _vllm_max_context(spec, lay, req)
    bits = VLLM_COMPILED_BITS.get(a.fmt.name)
    if lay.tp * lay.pp * lay.nodes > 1 or lay.cpu_offload_bytes or bits is None:
        row.update(decode_tokens_per_s=None, ttft_s=None, max_context_tokens=max_context,
                   speed_from="not predicted: vramplan has no model of vLLM's multi-GPU or offloaded decode"
                   if bits is not None else f"not predicted: no compiled decode of {a.fmt.name}")
        return row
    scheme = compiled_scheme(*bits)
    if fitted_entry(hw, "gpu", scheme) is None:  # the documented defaults would price CUDA graphs below eager decode
        row.update(decode_tokens_per_s=None, ttft_s=None, max_context_tokens=max_context,
                   speed_from=f"not predicted: profile {hw.name} has no compiled-decode constants for {scheme.name} "
                              "(the public compiled runs are on HBM GPUs)")
        return row
    return _with_speed(row, p, estimate_compiled(spec, hw, req, scheme), max_context, VLLM_SPEED_FROM)


def _vllm_max_context(spec: ModelSpec, lay, req: Request) -> int | None:
    """The longest single sequence vLLM's KV pool holds: the pool over the bytes a token takes, for a model whose
    layers all attend to the whole context (a sliding window's blocks do not grow with it: not counted, None)."""
    if any(getattr(a, "window", None) for a in spec.attention) or lay.kv_per_sequence_bytes <= 0:
        return None
    tokens = (lay.kv_pool_bytes - lay.null_block_bytes) * req.context // lay.kv_per_sequence_bytes
    limit, _ = context_limit(spec)
    return int(min(tokens, limit) if limit else tokens)
