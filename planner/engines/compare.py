"""One answer across engines: the request vramplan planned, answered by every engine behind the Engine interface
(planner.engines.ENGINES: vramplan, llama.cpp, Ollama, vLLM, plain transformers), one EngineAnswer each, and which
engine decodes fastest here by prediction, and why. Each engine's `answer` says how it plans (its module's docstring).
Pure: no torch, no files.
"""

from __future__ import annotations

from ..errors import VramplanError
from ..hardware import HardwareProfile
from ..modelspec import ModelSpec
from ..plan import Plan
from ..request import Request
from ..engine import request_for
from .common import Engine, EngineAnswer, FastestEngine

# Predictions closer than this ratio are called a tie; the dispatch is named as a reason when it is more than this share
# of vramplan's predicted decode step.
TIE = 1.05
DISPATCH_SHARE = 0.10


def engine_rows(engines: tuple[Engine, ...], spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan
                ) -> tuple[EngineAnswer, ...]:
    """Every engine's own answer to the request of plan `p`, in `engines`' order; the planning engine's row is `p`
    itself."""
    decode = p.predicted.decode_tokens_per_s if p.fits and p.predicted is not None else None
    return tuple(_answer(e, lambda e=e: e.row(spec, hw, p, decode) if e.name == req.engine
                         else engine_row(e, spec, hw, req, decode)) for e in engines)


def engine_row(e: Engine, spec: ModelSpec, hw: HardwareProfile, req: Request, plan_decode: float | None
               ) -> EngineAnswer:
    """Engine e's row for a request: its own plan of the request in its words (planner.engine.request_for), the same
    call as `vramplan plan --engine e` (vLLM: its own layout search, what --emit vllm writes)."""
    if e.plan is None:
        return e.answer(spec, hw, req, plan_decode)
    mine, notes = request_for(e.name, req, hw)
    return e.row(spec, hw, e.plan(spec, hw, mine, contexts=False), plan_decode, notes)


def _answer(e: Engine, make) -> EngineAnswer:
    try:
        return make()
    except VramplanError as err:  # a model or request that engine's rules refuse: not an error of the plan
        return EngineAnswer(engine=e.name, weight_quant="-", kv_dtype="-", fits=False, how="-", reason=str(err))


def fastest(p: Plan, rows: tuple[EngineAnswer, ...]) -> FastestEngine | None:
    """Which engine decodes fastest here by prediction; None when nothing fits."""
    entries = [r for r in rows if r.fits and r.decode_tokens_per_s]
    if not entries:
        return None
    best = max(entries, key=lambda r: r.decode_tokens_per_s)
    mine = p.predicted.decode_tokens_per_s if p.fits and p.predicted is not None else None
    ratio = best.decode_tokens_per_s / mine if mine and best.engine != p.request.engine else None
    return FastestEngine(engine=best.engine, decode_tokens_per_s=best.decode_tokens_per_s, why=_why(p, best),
                         decode_vs_plan=ratio)


def _why(p: Plan, best: EngineAnswer) -> str:
    """What the speed models say makes the fastest one fast (where its layers are, what the planning engine's eager
    decode pays that the other's does not, other weights), and what it gives up in quality."""
    mine = p.request.engine
    if best.engine == mine:
        return "no other engine's rules predict a faster decode for this request here"
    if p.fits and p.predicted is not None and best.decode_tokens_per_s < TIE * p.predicted.decode_tokens_per_s:
        return f"a tie: within {100 * (TIE - 1):.0f} % of this plan, less than the speed models' own error"
    parts = []
    c = p.choice if p.fits else None
    if c is not None and best.gpu_layers is not None and best.gpu_layers > c.gpu_layers:
        parts.append(f"it holds {best.gpu_layers} of {c.total_layers} layers on the GPU where this plan holds "
                     f"{c.gpu_layers}")
    dispatch = (p.chosen.speed.terms.get("dispatch_per_layer_s") or 0.0) if c is not None and p.predicted else 0.0
    if dispatch and c.on_gpu and dispatch * c.gpu_layers > DISPATCH_SHARE / p.predicted.decode_tokens_per_s:
        parts.append(f"{mine}'s eager decode spends {1e3 * dispatch * c.gpu_layers:.1f} ms a token issuing kernels "
                     f"({1e6 * dispatch:.0f} us per layer: `plan --explain` says from where), which "
                     f"{best.engine}'s decode does not")
    if c is not None and best.weight_quant != c.weight_quant:
        parts.append(f"its weights are {best.weight_quant} + {best.kv_dtype} KV where this plan's are "
                     f"{c.weight_quant} + {c.kv_dtype}")
    if c is not None and best.quality_cost_pct is not None and best.quality_cost_pct > p.chosen.quality_cost_pct + 0.05:
        parts.append(f"it gives up quality: ~{best.quality_cost_pct:.1f} % perplexity over bf16 where this plan's "
                     f"costs ~{p.chosen.quality_cost_pct:.1f} %")
    why = "; ".join(parts) or ("its speed model's constants for this hardware are higher (see each engine's speed "
                               "source)")
    return why + RUNNABLE.get(best.engine, "")


# How a person runs the fastest engine's answer, where it is not this plan's engine: llama.cpp through vramplan's own
# `run --engine llama.cpp` (llama-server on the model's GGUF file, timed against llama.cpp's plan), the others from
# the command their export writes.
RUNNABLE = {"llama.cpp": "; to run it here: `vramplan run --engine llama.cpp --model MODEL.gguf` (with a llama-server "
                         "build: --llama-server or $VRAMPLAN_LLAMA_SERVER)",
            "ollama": "; `vramplan plan --emit ollama` writes its Modelfile",
            "vllm": "; `vramplan plan --emit vllm` writes its command"}
