"""Plans for the engines people deploy with, each by its own memory rules (shared/DESIGN.md, "Engines").

- `plan_for_engine(spec, hw, req)`: vramplan's plan (planner.search) or llama.cpp's (req.engine).
- `emit(engine, spec, hw, plan)`: the plan written for vLLM, llama.cpp, Ollama or plain transformers.
One module per engine holds that engine's named, cited constants; none borrows vramplan's runtime rules.
Pure: no torch, no files.
"""

from __future__ import annotations

from ..errors import PlanError, VramplanError
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
# llama.cpp's file type beside a vramplan plan whose scheme has no GGUF equivalent, or that found nothing fitting
OTHER_ENGINE_FILE_TYPE = "Q4_K_M"


def plan_for_engine(spec: ModelSpec, hw: HardwareProfile, req: Request) -> Plan:
    """The plan by `req.engine`'s rules; vramplan's also carries llama.cpp's answer at the same bits
    (`other_engines`)."""
    if req.engine == "llama.cpp":
        return plan_llamacpp(spec, hw, req)
    from ..search import plan

    p = plan(spec, hw, req)
    p.engines.extend(other_engines(spec, hw, req, p))
    return p


def other_engines(spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> list[dict]:
    """llama.cpp's plan for the same request at the GGUF file type of vramplan's chosen scheme (Q4_K_M when nothing
    fits) with an f16 cache: whether it fits, its placement and predicted speed, and how it compares. One file type
    and one cache, not llama.cpp's whole search: 5-25 ms (`vramplan plan --engine llama.cpp` searches them all)."""
    from dataclasses import replace

    from .llamacpp import GGUF_FOR_SCHEME

    file_type = GGUF_FOR_SCHEME.get(p.choice.weight_quant, OTHER_ENGINE_FILE_TYPE) if p.fits else OTHER_ENGINE_FILE_TYPE
    try:
        other = plan_llamacpp(spec, hw, replace(req, engine="llama.cpp", quant=(file_type,), kv_dtype=("f16",),
                                                gpu_layers=None, offload=None, expert_placement=None))
    except VramplanError as e:  # a model or request llama.cpp's rules refuse: not an error of the vramplan plan
        return [{"engine": "llama.cpp", "weight_quant": file_type, "kv_dtype": "f16", "fits": False,
                 "reason": str(e)}]
    row: dict = {"engine": "llama.cpp", "weight_quant": file_type, "kv_dtype": "f16", "fits": other.fits,
                 "how": f"vramplan plan --engine llama.cpp --quant {file_type}"}
    if not other.fits:
        row["reason"] = other.reasons[0] if other.reasons else "nothing fits llama.cpp's rules"
        return [row]
    c, speed = other.choice, other.chosen.speed
    row.update(gpu_layers=c.gpu_layers, total_layers=c.total_layers, expert_layers_in_ram=c.expert_layers_on_cpu,
               decode_tokens_per_s=speed.decode_tokens_per_s, ttft_s=speed.ttft_s,
               max_context_tokens=other.chosen.max_context_tokens)
    if p.fits and p.predicted.decode_tokens_per_s:
        row["decode_vs_plan"] = speed.decode_tokens_per_s / p.predicted.decode_tokens_per_s
    return [row]


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


__all__ = ["EMIT_ENGINES", "Export", "check_emit", "emit", "other_engines", "plan_for_engine"]
