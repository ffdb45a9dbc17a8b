"""What every engine shares: the Engine interface, its two records (Export, EngineAnswer), named engine constants, and
a few formatting helpers.

An Engine answers a request by its own rules (`answer`: an EngineAnswer, one row of `vramplan plan`'s table of
engines) and writes a plan for itself (`export`: what `vramplan plan --emit ENGINE` prints: the text to paste, a
command, a Modelfile or a Python snippet, whose leading comment lines say where the engine's plan differs from
vramplan's, plus the engine constants it used and engine-specific plain data). Pure.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from ..record import record
from ..choice import Choice
from ..modelspec import ModelSpec
from ..constant import Constant
from ..quoting import one_line, shell_quote
from ..units import GiB, format_bytes

# The engines `--emit` writes for.
EMIT_ENGINES = ("vllm", "llama.cpp", "ollama", "transformers")


@record
class EngineConstant(Constant):
    """One of an engine's own rules: a plan's Constant (its value and where it comes from: file + commit, or a doc
    URL), and whether it is an `assumption`, a value no source gives; the export says so."""

    assumption: bool = False

    def to_dict(self) -> dict:
        return {"value": self.value, "from": self.source, "assumption": self.assumption}

    def for_plan(self) -> Constant:
        """As a plan lists it: an assumption says so in where it comes from."""
        return Constant(self.value, self.source + (" (assumption)" if self.assumption else ""))


@record(kw_only=True)
class Export:
    """A plan written for another engine."""

    engine: str
    fits: bool  # the emitted configuration fits the hardware it names
    text: str  # what to paste: comment lines (the notes) then the command / Modelfile / snippet
    notes: tuple[str, ...] = ()  # where the engine's plan differs from vramplan's, and every assumption used
    constants: dict = field(default_factory=dict)  # name -> EngineConstant
    details: dict = field(default_factory=dict)  # engine-specific plain data (layout, memory per device)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "fits": self.fits, "text": self.text, "notes": list(self.notes),
                "constants": {k: c.to_dict() for k, c in self.constants.items()}, "details": dict(self.details)}


def assumption_notes(constants: dict) -> list[str]:
    """One note per constant that no source gives."""
    return [f"assumption: {name} = {_show(c.value)} ({c.source})" for name, c in constants.items() if c.assumption]


def _show(v) -> str:
    return format_bytes(v) if isinstance(v, int) and v >= 1 << 20 else f"{v:g}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------- generated text: quoted values only
# What an export writes is code (a shell script, a Python snippet, a Modelfile), and a model's name or path is the
# user's text: a directory may be called `x\ntouch PWNED #`. It reaches that code only through planner.quoting
# (one_line, shell_quote, modelfile_value, file_stem) and repr().

def commented(notes, body: str, prefix: str = "# ") -> str:
    """The notes as comment lines above the body: each note is one line (`one_line`), so no text in it can end the
    comment and run; the whole text stays pasteable."""
    lines = [f"{prefix}{one_line(n)}" for n in notes]
    return "\n".join([*lines, body]) + "\n"


def is_local(spec: ModelSpec) -> bool:
    """Whether the model is a local directory (its location an absolute path), not a hub id."""
    return os.path.isabs(spec.location)


def model_location(spec: ModelSpec) -> str:
    """What an engine's command loads: the local directory's absolute path, or the hub id."""
    return spec.location or spec.name


def shell_command(argv: list[str]) -> str:
    """A command line, one option per continuation line after the program and its positional arguments; every word
    quoted (`shell_quote`)."""
    head, opts = [], []
    for a in argv:
        (opts if (opts or a.startswith("-")) else head).append(a)
    groups, cur = [], []
    for a in opts:
        if a.startswith("-") and cur:
            groups.append(cur)
            cur = []
        cur.append(a)
    if cur:
        groups.append(cur)
    parts = [" ".join(shell_quote(x) for x in head)] + ["  " + " ".join(shell_quote(x) for x in g) for g in groups]
    return " \\\n".join(parts)


def gib(n: int, decimals: int = 2) -> str:
    return f"{n / GiB:.{decimals}f} GiB"


def floor_to(x: float, step: float) -> float:
    """x rounded down to a multiple of step (a float like 0.01), without binary noise."""
    digits = max(0, -int(math.floor(math.log10(step))))
    return round(math.floor(x / step + 1e-9) * step, digits)


def first_moe_layers(spec: ModelSpec, count: int) -> list[int]:
    """The indices of the first `count` decoder layers with routed experts (a Choice's expert_layers_on_cpu)."""
    return sorted(spec.moe.moe_layers)[:count] if spec.moe is not None else []


def index_range(indices: list[int]) -> str:
    """Python for a list of layer indices: `range(a, b)` when they are consecutive."""
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return f"range({indices[0]}, {indices[-1] + 1})" if indices[0] else f"range({indices[-1] + 1})"
    return repr(indices)


@dataclass(kw_only=True)
class EngineAnswer:
    """One engine's answer to a request, by its own rules: the configuration it runs (weights, KV cache), whether it
    fits (else `reason`), where it puts the model, its predicted decode and TTFT (None where not predicted) and which
    speed model gives them, the longest context it holds on the GPU, how many times vramplan's plan it decodes, and the
    vramplan command that prints its full command."""

    engine: str
    weight_quant: str
    kv_dtype: str
    fits: bool
    how: str
    reason: str | None = None
    placement: str | None = None
    gpu_layers: int | None = None
    total_layers: int | None = None
    expert_layers_on_cpu: int | None = None  # MoE layers whose routed experts are in RAM (a count)
    decode_tokens_per_s: float | None = None
    ttft_s: float | None = None
    max_context_tokens: int | None = None
    speed_from: str | None = None
    decode_vs_plan: float | None = None
    tag: str | None = None  # Ollama's library tag
    launch: str | None = None  # Ollama's launch settings
    quality_cost_pct: float | None = None  # perplexity its formats add over bf16, as its plans rank it
    notes: tuple[str, ...] = ()  # how the request was put in this engine's words (planner.engine.request_for)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None or k in ("decode_tokens_per_s", "ttft_s")}
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineAnswer":
        """An answer back from a saved plan; keys this version does not know are left out."""
        known = {f.name for f in fields(cls)}
        out = cls(**{k: v for k, v in d.items() if k in known})
        out.notes = tuple(str(n) for n in out.notes or ())
        return out

    @classmethod
    def of_plan(cls, engine: str, p, how: str, speed_from: str, plan_decode: float | None, *, extra: str = "",
                notes=()) -> "EngineAnswer":
        """An engine's row from its own plan (planner.engine's loop): its chosen format, cache, placement and
        prediction, or why nothing fits."""
        if not p.fits:
            first = p.candidates[0] if p.candidates else None
            return cls(engine=engine, weight_quant=first.weight_quant if first else "-",
                       kv_dtype=first.kv_dtype if first else "-", fits=False, how=how,
                       reason=p.reasons[0] if p.reasons else "nothing fits", notes=tuple(notes))
        c = p.chosen
        a = cls(engine=engine, weight_quant=c.weight_quant, kv_dtype=c.kv_dtype, fits=True, how=how,
                quality_cost_pct=c.quality_cost_pct, notes=tuple(notes))
        a.with_layers(c.choice, extra)
        if c.speed is None:  # an engine that does not predict this placement's speed
            a.max_context_tokens, a.speed_from = c.max_context_tokens or None, speed_from
            return a
        return a.with_speed(c.speed, c.max_context_tokens, speed_from, plan_decode)

    def with_layers(self, c: Choice, extra: str = "") -> "EngineAnswer":
        """Its placement from a Choice: the layers on the GPU (or the CPU), the experts in RAM."""
        self.gpu_layers, self.total_layers, self.expert_layers_on_cpu = (c.gpu_layers, c.total_layers,
                                                                         c.expert_layers_on_cpu)
        if not c.on_gpu:
            where = "on the CPU"
        else:
            where = (f"all {c.total_layers} layers on the GPU" if c.gpu_layers == c.total_layers
                     else f"{c.gpu_layers}/{c.total_layers} layers on the GPU")
            where += f", experts of {c.expert_layers_on_cpu} in RAM" if c.expert_layers_on_cpu else ""
        self.placement = where + extra
        return self

    def with_speed(self, speed, max_context: int | None, speed_from: str, plan_decode: float | None
                   ) -> "EngineAnswer":
        """Its predicted speed (a SpeedEstimate) and context, and the ratio to vramplan's plan (`plan_decode`)."""
        self.decode_tokens_per_s, self.ttft_s = speed.decode_tokens_per_s, speed.ttft_s
        self.max_context_tokens, self.speed_from = max_context, speed_from
        if plan_decode:
            self.decode_vs_plan = speed.decode_tokens_per_s / plan_decode
        return self


@record(kw_only=True)
class FastestEngine:
    """Which engine decodes fastest here by prediction, its decode, why, and how many times vramplan's plan (None when
    it is vramplan's own plan, or vramplan's plan does not fit)."""

    engine: str
    decode_tokens_per_s: float
    why: str
    decode_vs_plan: float | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "FastestEngine":
        return cls(engine=str(d["engine"]), decode_tokens_per_s=float(d["decode_tokens_per_s"]), why=str(d["why"]),
                   decode_vs_plan=d.get("decode_vs_plan"))


@record
class Engine:
    """One engine behind the interface: its name; its own plan of a request (`plan(spec, hw, req) -> Plan`, the
    planner.engine loop over its search; None for vLLM, whose layouts are no Plan); its row of the engine table from
    that plan (`row(spec, hw, plan, plan_decode, notes) -> EngineAnswer`), or from a request where it has no Plan
    (`answer(spec, hw, req, plan_decode)`); and its export of a plan's request (`export(spec, hw, plan) -> Export`:
    the engine's own answer to that request, written as its command)."""

    name: str
    plan: Callable | None
    row: Callable | None
    export: Callable | None
    answer: Callable | None = None
