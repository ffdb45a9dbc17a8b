"""vramplan's own engine behind the Engine interface: its plan (planner.search) as an EngineAnswer. Pure."""

from __future__ import annotations

from ..hardware import HardwareProfile
from ..modelspec import ModelSpec
from ..plan import Plan
from ..quoting import shell_join
from .common import EngineAnswer

ENGINE = "vramplan"
SPEED_FROM = "vramplan's speed model (the profile's calibration or public fit, else its defaults)"


def row(spec: ModelSpec, hw: HardwareProfile, p: Plan, plan_decode: float | None, notes=()) -> EngineAnswer:
    """The plan in the shape of every engine's answer, with the `vramplan run` that runs it."""
    req, c = p.request, p.choice
    argv = ["vramplan", "run", "--model", spec.location or spec.name, "--hardware", hw.name, "--context",
            str(req.context)]
    if p.fits:
        argv += ["--quant", c.weight_quant, "--kv-dtype", c.kv_dtype]
    if req.compiled:
        argv.append("--compile")
    elif req.eager:
        argv.append("--eager")
    extra = f", {c.offload.value}" if p.fits and c.on_gpu and c.gpu_layers < c.total_layers else ""
    return EngineAnswer.of_plan(ENGINE, p, shell_join(argv), SPEED_FROM, plan_decode, extra=extra, notes=notes)
