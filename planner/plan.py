"""The Plan: plain data that `plan` prints and saves and `run` executes (to_dict / from_dict)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .hardware import HardwareProfile
from .modelspec import ModelSpec
from .request import Request

PLAN_SCHEMA_VERSION = 1


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_ref(spec: ModelSpec) -> dict:
    """What the plan was made for: run refuses a plan made for another model."""
    arch = {k: v for k, v in spec.config.items() if not k.startswith("_") and k not in ("transformers_version",)}
    return {"id": spec.name, "source": spec.source, "model_type": spec.model_type, "num_layers": spec.num_layers,
            "params_total": spec.params_total, "fingerprint": _digest(arch)}


def hardware_fingerprint(hw: HardwareProfile) -> str:
    """Identifies the machine type (GPUs, memory, RAM, cores), not its measured speeds."""
    return _digest({"gpus": [(g.name, g.memory_bytes, g.count) for g in hw.gpus], "ram": hw.host.ram_bytes,
                    "cores": hw.host.cpu_cores, "unified": hw.unified_memory})


def hardware_ref(hw: HardwareProfile) -> dict:
    return {"name": hw.name, "source": hw.source, "gpu": hw.gpu.name if hw.gpu else None,
            "gpu_memory_bytes": hw.gpu.memory_bytes if hw.gpu else 0, "ram_bytes": hw.host.ram_bytes,
            "measured": hw.measured, "calibrated": hw.calibration is not None,
            "fingerprint": hardware_fingerprint(hw)}


@dataclass(frozen=True, kw_only=True)
class Candidate:
    weight_quant: str
    kv_dtype: str
    total_layers: int
    runnable: bool  # fits in VRAM + RAM with some placement
    quality_cost_pct: float
    reason: str = ""
    fits_on_gpu: bool = False
    gpu_layers: int = 0
    offload: str = "none"
    compute_device: str = "cuda"
    embeddings_on_gpu: bool = False
    vram_bytes: int | None = None
    ram_bytes: int | None = None
    ceiling_decode_tokens_per_s: float | None = None
    predicted_decode_tokens_per_s: float | None = None
    predicted_decode_tokens_per_s_full_context: float | None = None
    predicted_ttft_s: float | None = None
    predicted_prefill_tokens_per_s: float | None = None
    max_context_on_gpu: int = 0
    memory: dict | None = field(default=None, compare=False)
    speed_terms: dict | None = field(default=None, compare=False)

    def choice_dict(self) -> dict:
        return {"weight_quant": self.weight_quant, "kv_dtype": self.kv_dtype, "gpu_layers": self.gpu_layers,
                "total_layers": self.total_layers, "offload": self.offload, "compute_device": self.compute_device,
                "embeddings_device": ("cuda" if self.embeddings_on_gpu else "cpu")}

    def predicted_dict(self) -> dict:
        return {"decode_tokens_per_s": self.predicted_decode_tokens_per_s,
                "decode_tokens_per_s_full_context": self.predicted_decode_tokens_per_s_full_context,
                "ttft_s": self.predicted_ttft_s, "prefill_tokens_per_s": self.predicted_prefill_tokens_per_s}

    def to_dict(self) -> dict:
        mem = None
        if self.memory is not None:
            mem = {"gpu": self.memory["gpu"], "cpu": self.memory["cpu"]}
        return {"fits": self.runnable, "fits_on_gpu": self.fits_on_gpu, **self.choice_dict(),
                "quality_cost_pct": self.quality_cost_pct,
                "memory": mem if mem else {"gpu": {"total_bytes": self.vram_bytes}, "cpu": {"total_bytes": self.ram_bytes}},
                "vram_bytes": self.vram_bytes, "ram_bytes": self.ram_bytes,
                "ceiling": {"decode_tokens_per_s": self.ceiling_decode_tokens_per_s},
                "predicted": self.predicted_dict(), "max_context_tokens": self.max_context_on_gpu,
                "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        pred = d.get("predicted") or {}
        return cls(
            weight_quant=d["weight_quant"], kv_dtype=d["kv_dtype"], total_layers=d["total_layers"], runnable=d["fits"],
            quality_cost_pct=d.get("quality_cost_pct", 0.0), reason=d.get("reason", ""),
            fits_on_gpu=d.get("fits_on_gpu", False), gpu_layers=d.get("gpu_layers", 0), offload=d.get("offload", "none"),
            compute_device=d.get("compute_device", "cuda"), embeddings_on_gpu=d.get("embeddings_device") == "cuda",
            vram_bytes=d.get("vram_bytes"), ram_bytes=d.get("ram_bytes"),
            ceiling_decode_tokens_per_s=(d.get("ceiling") or {}).get("decode_tokens_per_s"),
            predicted_decode_tokens_per_s=pred.get("decode_tokens_per_s"),
            predicted_decode_tokens_per_s_full_context=pred.get("decode_tokens_per_s_full_context"),
            predicted_ttft_s=pred.get("ttft_s"), predicted_prefill_tokens_per_s=pred.get("prefill_tokens_per_s"),
            max_context_on_gpu=d.get("max_context_tokens", 0), memory=d.get("memory"),
            speed_terms=d.get("speed_terms"),
        )


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: dict
    hardware: dict
    request: Request
    fits: bool
    choice: Candidate | None
    reasons: list[str]
    candidates: list[Candidate]
    warnings: list[str] = field(default_factory=list)
    alternatives: list[dict] = field(default_factory=list)
    constants: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        c = self.choice
        d = {
            "schema_version": PLAN_SCHEMA_VERSION,
            "fits": self.fits,
            "model": self.model,
            "hardware": self.hardware,
            "request": self.request.to_dict(),
            "choice": c.choice_dict() if c else None,
            "reasons": list(self.reasons),
            "memory": ({"gpu": c.memory["gpu"], "cpu": c.memory["cpu"], "workspace_terms": c.memory["workspace_terms"]}
                       if c and c.memory else None),
            "ceiling": {"decode_tokens_per_s": c.ceiling_decode_tokens_per_s if c else None},
            "predicted": c.predicted_dict() if c else None,
            "speed_terms": c.speed_terms if c else None,
            "max_context_tokens": c.max_context_on_gpu if c else 0,
            "quality_cost_pct": c.quality_cost_pct if c else None,
            "constants": self.constants,
            "warnings": list(self.warnings),
            "alternatives": list(self.alternatives),
            "candidates": [x.to_dict() for x in self.candidates],
        }
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        from .errors import PlanError

        if not isinstance(d, dict) or d.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise PlanError(f"not a vramplan plan (schema_version {PLAN_SCHEMA_VERSION} expected)")
        try:
            choice = None
            if d.get("choice"):
                cd = dict(d["choice"])
                chosen = next((x for x in d.get("candidates", []) if x["weight_quant"] == cd["weight_quant"]
                               and x["kv_dtype"] == cd["kv_dtype"]), {})
                merged = {**chosen, **cd, "fits": True, "predicted": d.get("predicted") or chosen.get("predicted"),
                          "ceiling": d.get("ceiling"), "max_context_tokens": d.get("max_context_tokens", 0),
                          "memory": d.get("memory"), "speed_terms": d.get("speed_terms"),
                          "quality_cost_pct": d.get("quality_cost_pct", 0.0)}
                gpu = (d.get("memory") or {}).get("gpu") or {}
                cpu = (d.get("memory") or {}).get("cpu") or {}
                merged.setdefault("vram_bytes", gpu.get("total_bytes"))
                merged.setdefault("ram_bytes", cpu.get("total_bytes"))
                choice = Candidate.from_dict(merged)
            return cls(model=d["model"], hardware=d["hardware"], request=Request.from_dict(d["request"]),
                       fits=bool(d["fits"]), choice=choice, reasons=list(d.get("reasons", [])),
                       candidates=[Candidate.from_dict(x) for x in d.get("candidates", [])],
                       warnings=list(d.get("warnings", [])), alternatives=list(d.get("alternatives", [])),
                       constants=dict(d.get("constants", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"plan file is incomplete or malformed ({type(e).__name__}: {e})") from None

