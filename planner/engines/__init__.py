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


def _vramplan_plan(spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True) -> Plan:
    from ..engine import plan_with
    from ..search import VRAMPLAN

    return plan_with(VRAMPLAN, spec, hw, req, contexts=contexts)


# Every engine behind the interface, vramplan's first: the order of `vramplan plan`'s table of engines.
ENGINES: tuple[Engine, ...] = (
    Engine(own.ENGINE, _vramplan_plan, own.row, None),
    Engine(llamacpp.ENGINE, llamacpp.plan_llamacpp, llamacpp.row, llamacpp.export_llamacpp),
    Engine(ollama.ENGINE, ollama.plan_ollama, ollama.row, ollama.export_ollama),
    Engine(vllm.ENGINE, None, None, vllm.export_vllm, answer=vllm.answer),
    Engine(hf_transformers.ENGINE, hf_transformers.transformers_plan, hf_transformers.row,
           hf_transformers.export_transformers),
)
BY_NAME = {e.name: e for e in ENGINES}


def plan_for_engine(spec: ModelSpec, hw: HardwareProfile, req: Request) -> Plan:
    """The plan by `req.engine`'s own search, with every engine's own answer to the same request beside it (one row
    each, the planning engine's from this very plan) and which is fastest here."""
    from .compare import engine_rows, fastest

    main = BY_NAME[req.engine]
    p = main.plan(spec, hw, req)
    rows = engine_rows(ENGINES, spec, hw, req, p)
    return replace(p, engines=rows, fastest_engine=fastest(p, rows))


def check_emit(engine: str, planning_engine: str) -> None:
    """Refuse an export name it does not know, before any planning."""
    if engine not in EMIT_ENGINES:
        raise PlanError(f"unknown --emit engine {engine!r}; choose one of: {', '.join(EMIT_ENGINES)}")


def emit(engine: str, spec: ModelSpec, hw: HardwareProfile, plan: Plan) -> Export:
    check_emit(engine, plan.request.engine)
    return BY_NAME[engine].export(spec, hw, plan)


__all__ = ["ENGINES", "EMIT_ENGINES", "Engine", "EngineAnswer", "Export", "check_emit", "emit", "plan_for_engine"]
