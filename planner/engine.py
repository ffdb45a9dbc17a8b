"""One planner over every engine: the Engine protocol and the one loop (`plan_with`) every engine's plan goes through.

An engine is a planner behind one interface (shared/DESIGN.md, turn 4): what it checks of a request, the candidates
its own search finds (its formats x KV caches, each with the placement it makes, the bytes per device its rules count
against `planner.capacity`, and its price), the constants it used, and what it says about the outcome. The loop is
the same for all: checks, candidates, the preference with its quality floor (planner.preference), reasons, warnings.
vramplan's runtime (planner.search.VRAMPLAN), llama.cpp (planner.engines.llamacpp.LLAMA_CPP) and Ollama
(planner.engines.ollama.OLLAMA) implement it; `vramplan plan --engine X` and the row of engine X under every plan are
the same call. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from .constant import Constant
from .hardware import HardwareProfile
from .modelspec import ModelSpec
from .plan import Alternative, Candidate, Plan, hardware_ref, model_ref
from .preference import choose_by_preference
from .errors import VramplanError
from .request import TYPICAL_PROMPT_TOKENS, Request


@dataclass(kw_only=True)
class Outcome:
    """What an engine says about a search's outcome: reasons and warnings to add, nothing-fits alternatives, and the
    constants the chosen candidate's price used."""

    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    alternatives: list[Alternative] = field(default_factory=list)
    constants: dict[str, Constant] = field(default_factory=dict)


class Engine(Protocol):
    """A planner: the engine's own search, by its own rules."""

    name: str

    def check(self, spec: ModelSpec, hw: HardwareProfile, req: Request) -> tuple[Request, list[str]]:
        """Refuse (PlanError) what this engine cannot plan; the request as it plans it, and the warnings to show."""

    def candidates(self, spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True
                   ) -> list[Candidate]:
        """Every format x KV cache it can run here (the request's forced ones only), each placed and priced; with
        `contexts`, each with the longest context it holds resident."""

    def resident_context(self, spec: ModelSpec, hw: HardwareProfile, req: Request, chosen: Candidate) -> int:
        """The longest context the chosen candidate holds resident (what `contexts=False` left out)."""

    def constants(self, spec: ModelSpec, hw: HardwareProfile, req: Request, cands: list[Candidate]
                  ) -> dict[str, Constant]:
        """Every constant its search used, named and sourced."""

    def nothing_fits(self, spec: ModelSpec, hw: HardwareProfile, req: Request, cands: list[Candidate]) -> Outcome:
        """Why nothing fits (the first reason first), and what would fit instead."""

    def explain(self, spec: ModelSpec, hw: HardwareProfile, req: Request, chosen: Candidate) -> Outcome:
        """What to say about the chosen candidate beyond the preference's reasons."""


def plan_with(engine: Engine, spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True) -> Plan:
    """The one loop: the engine's checks, its candidates, the preference with its quality floor, and what the engine
    says about the outcome. Without `contexts` (a row of the engine table, which shows the chosen one alone) only the
    chosen candidate gets its longest resident context."""
    req, warnings = engine.check(spec, hw, req)
    cands = engine.candidates(spec, hw, req, contexts=contexts)
    consts = engine.constants(spec, hw, req, cands)
    common = dict(model=model_ref(spec), hardware=hardware_ref(hw), request=req, candidates=cands, constants=consts)
    if not any(c.fits for c in cands):
        out = engine.nothing_fits(spec, hw, req, cands)
        return Plan(**common, chosen=None, reasons=out.reasons, warnings=[*warnings, *out.warnings],
                    alternatives=out.alternatives)
    chosen, reasons = choose_by_preference(cands, req)
    if not contexts:
        chosen = replace(chosen, max_context_tokens=engine.resident_context(spec, hw, req, chosen))
        cands = [chosen if c.weight_quant == chosen.weight_quant and c.kv_dtype == chosen.kv_dtype else c
                 for c in cands]
        common["candidates"] = cands
    out = engine.explain(spec, hw, req, chosen)
    consts.update(out.constants)
    p = Plan(**common, chosen=chosen, reasons=[*reasons, *out.reasons], warnings=[*warnings, *out.warnings],
             typical_prompt_ttft=typical_prompt_ttft(engine, spec, hw, req, chosen) if contexts else None)
    return replace(p, warnings=[*p.warnings, *verdict_warnings(p)])


def typical_prompt_ttft(engine: Engine, spec: ModelSpec, hw: HardwareProfile, req: Request, chosen: Candidate
                        ) -> tuple[int, float] | None:
    """The chosen format's TTFT for a typical prompt (TYPICAL_PROMPT_TOKENS) by the engine's own search, where the
    request times the whole context by default and the context is longer; None otherwise."""
    if req.prompt_tokens is not None or req.context <= TYPICAL_PROMPT_TOKENS or chosen.speed is None:
        return None
    short = replace(req, prompt_tokens=TYPICAL_PROMPT_TOKENS)
    try:  # only the chosen format and cache (a published checkpoint's stored format is not a --quant: all of them)
        short = replace(short, quant=(chosen.weight_quant,), kv_dtype=(chosen.kv_dtype,))
    except VramplanError:
        pass
    c = chosen.choice
    if req.engine in TAKES_PLACEMENT and c is not None:  # and the chosen placement: the fastest one for a short prompt
        try:                                             # may be another
            offload = getattr(c, "offload", None)
            short = replace(short, gpu_layers=c.gpu_layers, expert_placement=getattr(c, "expert_layers_on_cpu", 0) or
                            None, offload=offload.value if req.engine == "vramplan" and offload is not None
                            and offload.value != "none" else short.offload)
        except VramplanError:
            pass
    try:
        same = [c for c in engine.candidates(spec, hw, short, contexts=False)
                if c.fits and c.speed is not None and c.choice == chosen.choice
                and (c.weight_quant, c.kv_dtype, c.compiled) == (chosen.weight_quant, chosen.kv_dtype, chosen.compiled)]
    except VramplanError:
        return None
    return (TYPICAL_PROMPT_TOKENS, same[0].speed.ttft_s) if same else None


def verdict_warnings(p: Plan) -> list[str]:
    """What a person must know of a plan that fits: that it is too slow to use (Plan.unusable), and a quality past
    the floor (as --prefer speed or a forced format may choose)."""
    out = []
    if p.unusable:
        out.append(f"this plan fits but is not usable as it stands: {'; '.join(p.unusable)} (the thresholds: "
                   "--min-tok-s / --max-ttft; a shorter context or prompt, or a smaller format, changes it)")
    c, floor = p.chosen, p.request.balanced_max_quality_cost_pct
    if c.quality_cost_pct > floor:
        out.append(f"{c.weight_quant} + {c.kv_dtype} adds ~{c.quality_cost_pct:.1f} % perplexity over bf16, past the "
                   f"{floor:g} % quality floor: its output may be much worse than the model's"
                   + (" (--prefer speed ranks speed first; --prefer balanced keeps the floor)"
                      if getattr(p.request.prefer, "value", p.request.prefer) == "speed" else ""))
    return out


def nothing_fits_reasons(cands: list[Candidate], rules: str = "") -> list[str]:
    """The first candidate asked for (the best quality) and why it does not fit, then the smallest one's reason."""
    first = cands[0]
    reasons = [f"nothing fits{rules}: {first.weight_quant} + {first.kv_dtype} KV: {first.reason}"]
    sized = [c for c in cands if c.memory is not None]  # those that got as far as a memory breakdown
    smallest = min(sized, key=lambda c: (c.vram_bytes or 0) + c.ram_bytes, default=None)
    if smallest is not None and smallest is not first:
        reasons.append(f"smallest option, {smallest.weight_quant} + {smallest.kv_dtype} KV: {smallest.reason}")
    return reasons


# The placements each engine's request can force: vramplan's runtime and plain transformers (an accelerate device_map)
# take --gpu-layers and --expert-placement, llama.cpp takes them as -ngl and --n-cpu-moe; Ollama places by llama.cpp's
# --fit itself (num_gpu is not planned), vLLM by its own layout search.
TAKES_PLACEMENT = ("vramplan", "transformers", "llama.cpp")


def request_for(target: str, req: Request, hw: HardwareProfile) -> tuple[Request, list[str]]:
    """`req` in engine `target`'s words, and what the translation says: a forced --quant / --kv-dtype becomes the
    target's nearest format (planner.formats, for this machine's device), a forced placement stays where the target
    can take it; nothing else is forced. Unforced, every engine searches its own formats."""
    from .formats import KV, WEIGHTS, nearest

    if target == req.engine:
        return req, []
    device = hw.accelerator or "cpu"
    quant = tuple(dict.fromkeys(nearest(q, WEIGHTS, req.engine, target, device) for q in req.quant))
    kv = tuple(dict.fromkeys(nearest(k, KV, req.engine, target) for k in req.kv_dtype))
    notes = [f"{flag} {','.join(given)} as {target}'s {','.join(mine)}" for flag, given, mine in
             (("--quant", req.quant, quant), ("--kv-dtype", req.kv_dtype, kv)) if given and given != mine]
    keep = target in TAKES_PLACEMENT
    dropped = [flag for flag, v in (("--gpu-layers", req.gpu_layers), ("--expert-placement", req.expert_placement),
                                    ("--offload", req.offload)) if v is not None and not keep]
    if dropped:
        notes.append(f"{', '.join(dropped)}: {target} places layers its own way")
    offload = req.offload if target == "vramplan" else None
    return replace(req, engine=target, quant=quant, kv_dtype=kv, offload=offload, compiled=False,
                   eager=req.eager and target in ("vramplan", "transformers"),
                   gpu_layers=req.gpu_layers if keep else None,
                   expert_placement=req.expert_placement if keep else None), notes
