"""The engines people deploy with, behind one interface (common.Engine), each by its own rules (shared/DESIGN.md,
"Engines"): `answer` (the same request planned its way: an EngineAnswer) and `export` (the plan written for it).

- `ENGINES`: vramplan (its plan, planner.search), llama.cpp, Ollama, vLLM and plain transformers;
- `plan_for_engine(spec, hw, req)`: vramplan's plan with every engine's answer beside it (planner.engines.compare),
  or llama.cpp's own (req.engine);
- `emit(engine, spec, hw, plan)`: the plan written for vLLM, llama.cpp, Ollama or plain transformers.
One module per engine holds that engine's named, cited constants; none borrows vramplan's runtime rules.
Pure: no torch, no files.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import PlanError
from ..hardware import HardwareProfile
from ..modelspec import ModelSpec
from ..plan import Plan
from ..request import Request
from . import hf_transformers, llamacpp, ollama, vllm
from . import vramplan as own
from .common import EMIT_ENGINES, Engine, EngineAnswer, Export

# Every engine behind the interface, vramplan's first: the order of `vramplan plan`'s table of engines.
ENGINES: tuple[Engine, ...] = (
    Engine(own.ENGINE, own.answer, None),
    Engine(llamacpp.ENGINE, llamacpp.answer, llamacpp.export_llamacpp),
    Engine(ollama.ENGINE, ollama.answer, ollama.export_ollama),
    Engine(vllm.ENGINE, vllm.answer, vllm.export_vllm, needs_vramplan_plan=True),
    Engine(hf_transformers.ENGINE, hf_transformers.answer, hf_transformers.export_transformers,
           needs_vramplan_plan=True),
)
BY_NAME = {e.name: e for e in ENGINES}


def plan_for_engine(spec: ModelSpec, hw: HardwareProfile, req: Request) -> Plan:
    """The plan by `req.engine`'s rules; vramplan's also carries every engine's answer to the same request
    (`planner.engines.compare`) and which is fastest here."""
    if req.engine == llamacpp.ENGINE:
        return llamacpp.plan_llamacpp(spec, hw, req)
    from ..search import plan
    from .compare import engine_rows, fastest

    p = plan(spec, hw, req)
    rows = engine_rows(ENGINES, spec, hw, req, p)
    return replace(p, engines=rows, fastest_engine=fastest(p, rows))


def check_emit(engine: str, planning_engine: str) -> None:
    """Refuse an export name it does not know, or one the planning engine cannot feed, before any planning."""
    if engine not in EMIT_ENGINES:
        raise PlanError(f"unknown --emit engine {engine!r}; choose one of: {', '.join(EMIT_ENGINES)}")
    if planning_engine == llamacpp.ENGINE and BY_NAME[engine].needs_vramplan_plan:
        raise PlanError(f"--emit {engine} needs vramplan's plan (its weight schemes); a --engine llama.cpp plan "
                        "exports to llama.cpp or ollama")


def emit(engine: str, spec: ModelSpec, hw: HardwareProfile, plan: Plan) -> Export:
    check_emit(engine, plan.request.engine)
    return BY_NAME[engine].export(spec, hw, plan)


__all__ = ["ENGINES", "EMIT_ENGINES", "Engine", "EngineAnswer", "Export", "check_emit", "emit", "plan_for_engine"]
