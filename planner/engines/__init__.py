"""Plans for the engines people deploy with, each by its own memory rules (shared/DESIGN.md, "Engines").

- `plan_for_engine(spec, hw, req)`: vramplan's plan (planner.search), with the other engines' answers beside it
  (planner.engines.compare), or llama.cpp's (req.engine).
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
from .common import EMIT_ENGINES, Export
from .hf_transformers import export_transformers
from .llamacpp import export_llamacpp, plan_llamacpp
from .ollama import export_ollama
from .vllm import export_vllm

# Exports that need vramplan's own plan (its weight schemes): a GGUF plan has no vLLM or transformers form.
NEEDS_VRAMPLAN_PLAN = ("vllm", "transformers")


def plan_for_engine(spec: ModelSpec, hw: HardwareProfile, req: Request) -> Plan:
    """The plan by `req.engine`'s rules; vramplan's also carries the other engines' answers to the same request
    (`planner.engines.compare`: llama.cpp, Ollama, vLLM) and which is fastest here."""
    if req.engine == "llama.cpp":
        return plan_llamacpp(spec, hw, req)
    from ..search import plan
    from .compare import engine_rows, fastest

    p = plan(spec, hw, req)
    rows = engine_rows(spec, hw, req, p)
    return replace(p, engines=rows, fastest_engine=fastest(p, rows))


def check_emit(engine: str, planning_engine: str) -> None:
    """Refuse an export name it does not know, or one the planning engine cannot feed, before any planning."""
    if engine not in EMIT_ENGINES:
        raise PlanError(f"unknown --emit engine {engine!r}; choose one of: {', '.join(EMIT_ENGINES)}")
    if planning_engine == "llama.cpp" and engine in NEEDS_VRAMPLAN_PLAN:
        raise PlanError(f"--emit {engine} needs vramplan's plan (its weight schemes); a --engine llama.cpp plan "
                        "exports to llama.cpp or ollama")


def emit(engine: str, spec: ModelSpec, hw: HardwareProfile, plan: Plan) -> Export:
    check_emit(engine, plan.request.engine)
    if engine == "vllm":
        return export_vllm(spec, hw, plan)
    if engine == "llama.cpp":
        return export_llamacpp(spec, hw, plan)
    if engine == "ollama":
        return export_ollama(spec, hw, plan)
    return export_transformers(spec, plan)


__all__ = ["EMIT_ENGINES", "Export", "check_emit", "emit", "plan_for_engine"]
