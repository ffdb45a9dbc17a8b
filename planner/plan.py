"""The Plan: plain data that `plan` prints and saves and `run` executes (to_dict / from_dict)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import field
from typing import TYPE_CHECKING

from .record import record
from .choice import Choice, OffloadMode
from .constant import Constant
from .errors import PlanError
from .hardware import HardwareProfile
from .memory import MemoryBreakdown
from .modelspec import INVENTORY_HAND_WRITTEN, ModelSpec
from .request import Request
from .speed import SpeedEstimate
from .units import format_duration

if TYPE_CHECKING:
    from .engines.common import EngineAnswer, FastestEngine

PLAN_SCHEMA_VERSION = 1


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@record(kw_only=True)
class ModelRef:
    """What the plan was made for: run refuses a plan made for another model (the fingerprint of its architecture)."""

    id: str
    fingerprint: str
    source: str = ""
    inventory: str = INVENTORY_HAND_WRITTEN
    model_type: str = ""
    num_layers: int = 0
    params_total: int = 0

    def to_dict(self) -> dict:
        return {"id": self.id, "source": self.source, "inventory": self.inventory, "model_type": self.model_type,
                "num_layers": self.num_layers, "params_total": self.params_total, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelRef":
        return cls(id=str(d["id"]), fingerprint=str(d["fingerprint"]), source=str(d.get("source") or ""),
                   inventory=str(d.get("inventory") or INVENTORY_HAND_WRITTEN),
                   model_type=str(d.get("model_type") or ""), num_layers=int(d.get("num_layers") or 0),
                   params_total=int(d.get("params_total") or 0))


def model_ref(spec: ModelSpec) -> ModelRef:
    arch = {k: v for k, v in spec.config.items() if not k.startswith("_") and k not in ("transformers_version",)}
    return ModelRef(id=spec.name, source=spec.source, inventory=spec.inventory, model_type=spec.model_type,
                    num_layers=spec.num_layers, params_total=spec.params_total, fingerprint=_digest(arch))


def hardware_fingerprint(hw: HardwareProfile) -> str:
    """Identifies the machine type (GPUs, memory, RAM, cores), not its measured speeds."""
    return _digest({"gpus": [(g.name, g.memory_bytes, g.count) for g in hw.gpus], "ram": hw.host.ram_bytes,
                    "cores": hw.host.cpu_cores, "unified": hw.unified_memory})


@record
class GpuRef:
    """One kind of GPU in the plan's hardware: name, memory and how many."""

    name: str
    memory_bytes: int
    count: int = 1

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_bytes": self.memory_bytes, "count": self.count}


@record(kw_only=True)
class HardwareRef:
    """The machine the plan was made for: run refuses a plan made for another (the fingerprint of its GPUs, RAM and
    cores, not of its measured speeds)."""

    name: str
    fingerprint: str
    source: str = ""
    gpus: tuple[GpuRef, ...] = ()
    ram_bytes: int = 0
    measured: bool = False
    calibrated: bool = False

    @property
    def gpu(self) -> str | None:
        """The first GPU's name (None without one)."""
        return self.gpus[0].name if self.gpus else None

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "gpu": self.gpu,
                "gpu_memory_bytes": self.gpus[0].memory_bytes if self.gpus else 0, "ram_bytes": self.ram_bytes,
                "gpus": [g.to_dict() for g in self.gpus], "measured": self.measured, "calibrated": self.calibrated,
                "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareRef":
        gpus = tuple(GpuRef(str(g["name"]), int(g["memory_bytes"]), int(g.get("count", 1)))
                     for g in d.get("gpus") or ())
        if not gpus and d.get("gpu"):  # a plan saved before the list of GPUs
            gpus = (GpuRef(str(d["gpu"]), int(d.get("gpu_memory_bytes") or 0)),)
        return cls(name=str(d["name"]), fingerprint=str(d["fingerprint"]), source=str(d.get("source") or ""),
                   gpus=gpus, ram_bytes=int(d.get("ram_bytes") or 0), measured=bool(d.get("measured")),
                   calibrated=bool(d.get("calibrated")))


def hardware_ref(hw: HardwareProfile) -> HardwareRef:
    return HardwareRef(name=hw.name, source=hw.source, ram_bytes=hw.host.ram_bytes,
                       gpus=tuple(GpuRef(g.name, g.memory_bytes, g.count) for g in hw.gpus), measured=hw.measured,
                       calibrated=hw.calibration is not None, fingerprint=hardware_fingerprint(hw))


@record
class Alternative:
    """When nothing fits: the longest context one weight scheme x KV dtype could hold."""

    weight_quant: str
    kv_dtype: str
    max_context_tokens: int

    def to_dict(self) -> dict:
        return {"weight_quant": self.weight_quant, "kv_dtype": self.kv_dtype,
                "max_context_tokens": self.max_context_tokens}

    @classmethod
    def from_dict(cls, d: dict) -> "Alternative":
        return cls(str(d["weight_quant"]), str(d["kv_dtype"]), int(d["max_context_tokens"]))


@record(kw_only=True)
class Candidate:
    """One weight scheme x KV dtype: whether it runs, the best placement found, its bytes and speed.

    `choice`, `memory` and `speed` are None when the scheme was ruled out before any placement
    was sized (a device it cannot run on, a cache the model refuses); a candidate that does not
    fit keeps the placement that came closest and its breakdown, so the reason has numbers."""

    weight_quant: str
    kv_dtype: str
    quality_cost_pct: float
    fits: bool  # runs with some placement within every device's capacity
    reason: str = ""
    choice: Choice | None = None
    memory: MemoryBreakdown | None = None
    speed: SpeedEstimate | None = None  # only when it fits
    max_context_tokens: int = 0  # the largest context with every layer on the GPU (in RAM without a GPU)
    compiled: bool = False  # its decode is compiled (a static cache, one captured step): priced, and run, so

    @property
    def fits_on_gpu(self) -> bool:
        c = self.choice
        return self.fits and c is not None and c.on_gpu and c.offload is OffloadMode.NONE

    @property
    def vram_bytes(self) -> int | None:
        """Every GPU's total together (one number for the table; `memory.gpus` has each)."""
        return self.memory.gpu_total_bytes if self.memory is not None and self.memory.gpus else None

    @property
    def ram_bytes(self) -> int | None:
        return self.memory.cpu.total_bytes if self.memory is not None else None

    def to_dict(self) -> dict:
        placement = self.choice.to_dict() if self.choice is not None else {
            "weight_quant": self.weight_quant, "kv_dtype": self.kv_dtype, "gpu_layers": 0, "total_layers": None,
            "offload": OffloadMode.NONE.value, "compute_device": None, "embeddings_device": None}
        mem = self.memory.to_dict() if self.memory is not None else {"gpu": None, "gpus": [], "cpu": None}
        return {"fits": self.fits, "fits_on_gpu": self.fits_on_gpu, **placement,
                "quality_cost_pct": self.quality_cost_pct,
                "memory": {"gpu": mem["gpu"], "gpus": mem["gpus"], "cpu": mem["cpu"]},
                "vram_bytes": self.vram_bytes, "ram_bytes": self.ram_bytes,
                "ceiling": _ceiling_dict(self.speed), "predicted": _predicted_dict(self.speed),
                "max_context_tokens": self.max_context_tokens, "decode_compiled": self.compiled,
                "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        mem = d.get("memory") or {}
        pred = d.get("predicted") or {}
        return cls(weight_quant=d["weight_quant"], kv_dtype=d["kv_dtype"],
                   quality_cost_pct=float(d["quality_cost_pct"]), fits=bool(d["fits"]),
                   reason=str(d.get("reason") or ""),
                   choice=Choice.from_dict(d) if d.get("compute_device") is not None else None,
                   memory=MemoryBreakdown.from_dict(mem) if mem.get("cpu") else None,
                   speed=(SpeedEstimate.from_dict(pred, d.get("ceiling") or {}, {})
                          if pred.get("decode_tokens_per_s") is not None else None),
                   max_context_tokens=int(d.get("max_context_tokens") or 0),
                   compiled=d.get("decode_compiled") is True)


def _ceiling_dict(s: SpeedEstimate | None) -> dict:
    return {"decode_tokens_per_s": s.ceiling_decode_tokens_per_s if s is not None else None}


def _typical(d) -> tuple[int, float] | None:
    if d is None:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("prompt_tokens"), int) or not isinstance(d.get("ttft_s"), float):
        raise PlanError("typical_prompt_ttft must hold prompt_tokens (an integer) and ttft_s (a number)")
    return d["prompt_tokens"], d["ttft_s"]


def _predicted_dict(s: SpeedEstimate | None) -> dict:
    keys = ("decode_tokens_per_s", "decode_tokens_per_s_full_context", "ttft_s", "prefill_tokens_per_s")
    return {k: (getattr(s, k) if s is not None else None) for k in keys}


@record(kw_only=True)
class Plan:
    """What `plan` decided: the chosen candidate (None when nothing fits), why, and every other candidate."""

    model: ModelRef
    hardware: HardwareRef
    request: Request
    chosen: Candidate | None
    reasons: list[str]
    candidates: list[Candidate]
    warnings: list[str] = field(default_factory=list)
    alternatives: list[Alternative] = field(default_factory=list)
    constants: dict[str, Constant] = field(default_factory=dict)
    # the same request by other engines' own rules (planner.engines.compare): one row each, and the fastest engine
    # here by prediction (vramplan's own plan included)
    engines: tuple[EngineAnswer, ...] = ()
    fastest_engine: FastestEngine | None = None
    # the chosen plan's TTFT for a typical prompt (request.TYPICAL_PROMPT_TOKENS) where the request times the whole
    # context by default: (prompt tokens, seconds)
    typical_prompt_ttft: tuple[int, float] | None = None
    # `plan --concurrency`: each engine's sequences of the context at once (planner.concurrency), when asked for
    concurrency: tuple = ()

    def __post_init__(self) -> None:
        c = self.chosen
        if c is not None and not (c.fits and c.choice is not None and c.memory is not None):
            raise PlanError("a plan's chosen candidate must fit, with a placement and a memory breakdown")

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def choice(self) -> Choice | None:
        return self.chosen.choice if self.chosen is not None else None

    @property
    def memory(self) -> MemoryBreakdown | None:
        return self.chosen.memory if self.chosen is not None else None

    @property
    def predicted(self) -> SpeedEstimate | None:
        return self.chosen.speed if self.chosen is not None else None

    @property
    def decode_compiled(self) -> bool:
        """The run decodes compiled: forced (--compile), or the chosen candidate's, priced so (a GPU's default)."""
        return self.request.compiled or (self.chosen is not None and self.chosen.compiled)

    @property
    def unusable(self) -> list[str]:
        """Why a plan that fits is not usable by the request's thresholds (Request.usable_*): [] when it is, or when
        nothing is predicted to judge by."""
        s, r = self.predicted, self.request
        if s is None:
            return []
        out = []
        if s.decode_tokens_per_s < r.usable_min_decode_tok_s:
            out.append(f"decode {s.decode_tokens_per_s:.2f} tok/s is under {r.usable_min_decode_tok_s:g} tok/s")
        if s.ttft_s > r.usable_max_ttft_s:
            out.append(f"the first token comes after {format_duration(s.ttft_s)}, over "
                       f"{format_duration(r.usable_max_ttft_s)}")
        return out

    def to_dict(self) -> dict:
        c = self.chosen
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "fits": self.fits,
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "request": self.request.to_dict(),
            "choice": self.choice.to_dict() if c else None,
            "reasons": list(self.reasons),
            "memory": self.memory.to_dict() if c else None,
            "ceiling": _ceiling_dict(self.predicted),
            "predicted": _predicted_dict(self.predicted) if c else None,
            "speed_terms": dict(self.predicted.terms) if self.predicted is not None else None,
            "max_context_tokens": c.max_context_tokens if c else 0,
            "quality_cost_pct": c.quality_cost_pct if c else None,
            "usable": (not self.unusable) if c else False,
            "decode_compiled": self.decode_compiled,
            "unusable_because": self.unusable,
            "typical_prompt_ttft": (dict(zip(("prompt_tokens", "ttft_s"), self.typical_prompt_ttft))
                                    if self.typical_prompt_ttft else None),
            "reason": c.reason if c else None,
            # the long list before the short ones: a file cut short inside it lacks the keys after it
            "candidates": [x.to_dict() for x in self.candidates],
            # optional (plans saved before it lack it), so before the keys a complete file must end with
            "engines": [e.to_dict() for e in self.engines],
            "fastest_engine": self.fastest_engine.to_dict() if self.fastest_engine is not None else None,
            "constants": {k: c.to_dict() for k, c in self.constants.items()},
            "warnings": list(self.warnings),
            "alternatives": [a.to_dict() for a in self.alternatives],
            **({"concurrency": [c.to_dict() for c in self.concurrency]} if self.concurrency else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A saved plan back; anything malformed (a hand edit, another tool's file) is a PlanError."""
        from .engines.common import EngineAnswer, FastestEngine  # here: the engines import this module
        if not isinstance(d, dict) or d.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise PlanError(f"not a vramplan plan (schema_version {PLAN_SCHEMA_VERSION} expected)")
        engine = (d.get("request") or {}).get("engine", "vramplan") if isinstance(d.get("request"), dict) else None
        if engine not in (None, "vramplan"):
            raise PlanError(f"this plan follows {engine}'s rules (request.engine): run it with {engine} (`vramplan "
                            f"plan ... --engine {engine} --emit {engine}` prints the command), not with vramplan run")
        _check_complete(d)
        try:
            chosen = None
            if d.get("fits"):
                choice = Choice.from_dict(d["choice"])
                chosen = Candidate(weight_quant=choice.weight_quant, kv_dtype=choice.kv_dtype,
                                   quality_cost_pct=float(d.get("quality_cost_pct") or 0.0), fits=True,
                                   reason=str(d.get("reason") or ""), choice=choice,
                                   memory=MemoryBreakdown.from_dict(d["memory"]),
                                   speed=(SpeedEstimate.from_dict(d["predicted"], d["ceiling"], d["speed_terms"])
                                          if (d.get("predicted") or {}).get("decode_tokens_per_s") is not None
                                          else None),
                                   max_context_tokens=int(d.get("max_context_tokens") or 0),
                   compiled=d.get("decode_compiled") is True)
            return cls(model=ModelRef.from_dict(d["model"]), hardware=HardwareRef.from_dict(d["hardware"]),
                       request=Request.from_dict(d["request"]),
                       chosen=chosen, reasons=[str(r) for r in d.get("reasons", [])],
                       candidates=[Candidate.from_dict(x) for x in d.get("candidates", [])],
                       warnings=[str(w) for w in d.get("warnings", [])],
                       alternatives=[Alternative.from_dict(a) for a in d.get("alternatives", [])],
                       constants={k: Constant.from_dict(c) for k, c in d.get("constants", {}).items()},
                       engines=tuple(EngineAnswer.from_dict(e) for e in d.get("engines", [])),
                       fastest_engine=FastestEngine.from_dict(d["fastest_engine"]) if d.get("fastest_engine") else None,
                       typical_prompt_ttft=_typical(d.get("typical_prompt_ttft")))
        except PlanError as e:
            raise PlanError(f"plan file: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise PlanError(f"plan file is incomplete or malformed ({type(e).__name__}: {e})") from None


# Every key a saved plan holds (to_dict writes them all) and the types each may take: a file cut short, or edited,
# lacks some, and is refused naming the first one missing rather than run with defaults.
_NULL = type(None)
_PLAN_KEYS: dict[str, tuple[type, ...]] = {
    "schema_version": (int,), "fits": (bool,), "model": (dict,), "hardware": (dict,), "request": (dict,),
    "choice": (dict, _NULL), "reasons": (list,), "memory": (dict, _NULL), "ceiling": (dict,),
    "predicted": (dict, _NULL), "speed_terms": (dict, _NULL), "max_context_tokens": (int,),
    "quality_cost_pct": (int, float, _NULL), "reason": (str, _NULL), "candidates": (list,), "constants": (dict,),
    "warnings": (list,), "alternatives": (list,)}
_FITTING_KEYS = ("choice", "memory", "predicted", "speed_terms")  # not null in a plan that fits
_MODEL_KEYS: dict[str, tuple[type, ...]] = {"id": (str,), "fingerprint": (str,)}  # what run checks
_HARDWARE_KEYS: dict[str, tuple[type, ...]] = {"name": (str,), "fingerprint": (str,)}
_REQUEST_KEYS: dict[str, tuple[type, ...]] = {"context": (int,)}  # the others have defaults
_CANDIDATE_KEYS: dict[str, tuple[type, ...]] = {
    "fits": (bool,), "fits_on_gpu": (bool,), "weight_quant": (str,), "kv_dtype": (str,), "gpu_layers": (int,),
    "total_layers": (int, _NULL), "offload": (str,), "compute_device": (str, _NULL),
    "embeddings_device": (str, _NULL), "quality_cost_pct": (int, float), "memory": (dict,),
    "vram_bytes": (int, _NULL), "ram_bytes": (int, _NULL), "ceiling": (dict,), "predicted": (dict,),
    "max_context_tokens": (int,), "reason": (str,)}


def _check_complete(d: dict) -> None:
    """PlanError naming the first key a plan lacks or holds with the wrong type (a truncated or hand-cut file)."""
    _check_keys(d, _PLAN_KEYS, "")
    if d["fits"]:
        for key in _FITTING_KEYS:
            if d[key] is None:
                raise PlanError(f"plan file is incomplete: {key} is empty in a plan that fits")
    _check_keys(d["model"], _MODEL_KEYS, "model")
    _check_keys(d["hardware"], _HARDWARE_KEYS, "hardware")
    _check_keys(d["request"], _REQUEST_KEYS, "request")
    for i, c in enumerate(d["candidates"]):
        if not isinstance(c, dict):
            raise PlanError(f"plan file is malformed: candidates[{i}] must be a mapping, got {type(c).__name__}")
        _check_keys(c, _CANDIDATE_KEYS, f"candidates[{i}]")


def _check_keys(d: dict, keys: dict[str, tuple[type, ...]], section: str) -> None:
    """`section` names where `d` sits ("" at the top) in the message (not as "request.x": the CLI reads that as a
    flag's name)."""
    where = f" in {section}" if section else ""
    for key, types in keys.items():
        if key not in d:
            raise PlanError(f"plan file is incomplete: it has no {key}{where} (cut short?)")
        v = d[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            names = " or ".join("null" if t is _NULL else t.__name__ for t in types)
            raise PlanError(f"plan file is malformed: {key}{where} must be {names}, got {type(v).__name__}")


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """A plan saved by `vramplan plan --save` (YAML or JSON); anything unreadable or malformed is a PlanError."""
    import yaml

    from .textfiles import read_text
    from .yaml_strict import safe_load_strict

    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: cannot read the plan ({getattr(e, 'strerror', None) or e})") from None
    try:
        doc = safe_load_strict(text)
    except yaml.YAMLError:
        raise PlanError(f"{path}: not valid YAML or JSON") from None
    except RecursionError:
        raise PlanError(f"{path}: nested too deeply to be a plan") from None
    try:
        p = Plan.from_dict(doc)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    if not p.fits:
        raise PlanError(f"{path}: this plan says nothing fits: there is nothing to run")
    return p
