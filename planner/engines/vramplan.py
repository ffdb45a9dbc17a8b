"""vramplan's own engine behind the Engine interface: its plan (planner.search) as an EngineAnswer. Pure."""

from __future__ import annotations

from ..hardware import HardwareProfile
from ..modelspec import ModelSpec
from ..plan import Plan
from ..request import Request
from .common import EngineAnswer

ENGINE = "vramplan"


def answer(spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> EngineAnswer:
    """The plan itself, in the shape of every engine's answer, with the `vramplan run` that runs it."""
    c = p.choice
    flags = (f" --quant {c.weight_quant} --kv-dtype {c.kv_dtype}" if p.fits else "") + (
        " --compile" if req.compiled else "")
    a = EngineAnswer(engine=ENGINE, weight_quant=c.weight_quant if p.fits else "-",
                     kv_dtype=c.kv_dtype if p.fits else "-", fits=p.fits,
                     how=f"vramplan run --model {spec.name} --hardware {hw.name} --context {req.context}{flags}")
    if not p.fits:
        a.reason = p.reasons[0] if p.reasons else "nothing fits"
        return a
    a.with_layers(c, f", {c.offload.value}" if c.on_gpu and c.gpu_layers < c.total_layers else "")
    a.decode_tokens_per_s, a.ttft_s = p.predicted.decode_tokens_per_s, p.predicted.ttft_s
    a.max_context_tokens = p.chosen.max_context_tokens
    a.speed_from = "vramplan's speed model (the profile's calibration or public fit, else its defaults)"
    return a
