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
from .common import Engine, EngineAnswer, FastestEngine
from .llamacpp import GGUF_FOR_SCHEME

# Predictions closer than this ratio are called a tie; the dispatch is named as a reason when it is more than this share
# of vramplan's predicted decode step.
TIE = 1.05
DISPATCH_SHARE = 0.10


def engine_rows(engines: tuple[Engine, ...], spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan
                ) -> tuple[EngineAnswer, ...]:
    """Every engine's answer to the request of vramplan's plan `p`, in `engines`' order."""
    return tuple(_answer(e, spec, hw, req, p) for e in engines)


def _answer(e: Engine, spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> EngineAnswer:
    try:
        return e.answer(spec, hw, req, p)
    except VramplanError as err:  # a model or request that engine's rules refuse: not an error of vramplan's plan
        return EngineAnswer(engine=e.name, weight_quant="-", kv_dtype="-", fits=False, how="-", reason=str(err))


def fastest(p: Plan, rows: tuple[EngineAnswer, ...]) -> FastestEngine | None:
    """Which engine decodes fastest here by prediction; None when nothing fits."""
    entries = [r for r in rows if r.fits and r.decode_tokens_per_s]
    if not entries:
        return None
    best = max(entries, key=lambda r: r.decode_tokens_per_s)
    ratio = best.decode_tokens_per_s / p.predicted.decode_tokens_per_s if p.fits and best.engine != "vramplan" else None
    return FastestEngine(engine=best.engine, decode_tokens_per_s=best.decode_tokens_per_s, why=_why(p, best),
                         decode_vs_plan=ratio)


def _why(p: Plan, best: EngineAnswer) -> str:
    """What the speed models say makes the fastest one fast: where its layers are, and what vramplan's eager decode
    pays that another engine's does not."""
    if best.engine == "vramplan":
        return "no other engine's rules predict a faster decode for this request here"
    if p.fits and best.decode_tokens_per_s < TIE * p.predicted.decode_tokens_per_s:
        return f"a tie: within {100 * (TIE - 1):.0f} % of vramplan's plan, less than the speed models' own error"
    parts = []
    c = p.choice if p.fits else None
    if c is not None and best.gpu_layers is not None and best.gpu_layers > c.gpu_layers:
        parts.append(f"it holds {best.gpu_layers} of {c.total_layers} layers on the GPU where vramplan's plan holds "
                     f"{c.gpu_layers}")
    dispatch = (p.chosen.speed.terms.get("dispatch_per_layer_s") or 0.0) if c is not None else 0.0
    step_s = 1.0 / p.predicted.decode_tokens_per_s if c is not None else 0.0
    if dispatch and c.on_gpu and dispatch * c.gpu_layers > DISPATCH_SHARE * step_s:
        parts.append(f"vramplan's eager decode spends {1e3 * dispatch * c.gpu_layers:.1f} ms a token issuing kernels "
                     f"({1e6 * dispatch:.0f} us per layer: `plan --explain` says from where), which "
                     f"{best.engine}'s decode does not")
    same = (None, c.weight_quant, GGUF_FOR_SCHEME.get(c.weight_quant)) if c is not None else ()
    if c is not None and best.weight_quant not in same:
        parts.append(f"its weights are {best.weight_quant} where vramplan's are {c.weight_quant}")
    return "; ".join(parts) or ("its speed model's constants for this hardware are higher (see each engine's speed "
                                "source)")
