"""What the user asks the planner for: context, batch, preferences and forced choices."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import PlanError
from .quant import KV_SCHEMES, SCHEMES
from .units import GiB, MiB

PREFERENCES = ("quality", "speed", "balanced")
OFFLOAD_MODES = ("stream", "cpu")

# Named defaults, echoed in every plan.
DEFAULT_PREFILL_CHUNK = 2048  # tokens per prefill step; bounds activation memory
DEFAULT_HEADROOM_BYTES = 512 * MiB  # kept free on the GPU for the display, other processes, fragmentation
# "Within reach" for --prefer balanced: the best-quality option whose predicted decode speed is at
# least this fraction of the fastest option's.
BALANCED_SPEED_FRACTION = 0.5
# RSS of a Python process with torch + transformers imported, before any weight is loaded.
# Measured on the CPU dev machine (torch 2.13, transformers 5.23): ~0.6-0.8 GiB; a CUDA build adds
# its libraries. The calibration may replace it.
RUNTIME_BASE_RAM_BYTES = 1 * GiB
MAX_BATCH = 4096


@dataclass(frozen=True, kw_only=True)
class Request:
    context: int  # tokens of context per sequence the plan must hold (prompt + generated)
    batch: int = 1
    prompt_tokens: int | None = None  # for the TTFT prediction; default: the whole context is prompt
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prefer: str = "balanced"
    quant: tuple[str, ...] = ()  # forced weight schemes (empty: all)
    kv_dtype: tuple[str, ...] = ()  # forced KV dtypes (empty: all)
    gpu_layers: int | None = None  # forced number of decoder layers on the GPU (>= num layers: all)
    offload: str | None = None  # forced offload mode for layers not on the GPU
    vram_budget_bytes: int | None = None  # replaces the GPU's memory as capacity
    ram_budget_bytes: int | None = None  # replaces the host RAM as capacity
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    runtime_base_ram_bytes: int = RUNTIME_BASE_RAM_BYTES
    balanced_speed_fraction: float = BALANCED_SPEED_FRACTION

    def __post_init__(self) -> None:
        if not isinstance(self.context, int) or self.context < 1:
            raise PlanError(f"context must be at least 1 token, got {self.context!r}")
        if not (1 <= self.batch <= MAX_BATCH):
            raise PlanError(f"batch must be between 1 and {MAX_BATCH}, got {self.batch}")
        if self.prompt_tokens is not None and not (1 <= self.prompt_tokens <= self.context):
            raise PlanError(f"prompt tokens ({self.prompt_tokens}) must be between 1 and the context ({self.context})")
        if self.prefill_chunk < 1:
            raise PlanError(f"prefill chunk must be at least 1 token, got {self.prefill_chunk}")
        if self.prefer not in PREFERENCES:
            raise PlanError(f"--prefer must be one of {', '.join(PREFERENCES)}, got {self.prefer!r}")
        for q in self.quant:
            if q not in SCHEMES:
                raise PlanError(f"unknown quantization {q!r}; choose one of: {', '.join(SCHEMES)}")
        for k in self.kv_dtype:
            if k not in KV_SCHEMES:
                raise PlanError(f"unknown KV-cache dtype {k!r}; choose one of: {', '.join(KV_SCHEMES)}")
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise PlanError(f"--gpu-layers must not be negative, got {self.gpu_layers}")
        if self.offload is not None and self.offload not in OFFLOAD_MODES:
            raise PlanError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")
        for name in ("vram_budget_bytes", "ram_budget_bytes", "headroom_bytes"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise PlanError(f"{name} must not be negative")
        if self.vram_budget_bytes is not None and self.vram_budget_bytes == 0 and self.gpu_layers:
            raise PlanError("--vram-budget 0 contradicts --gpu-layers > 0")
        if not 0 < self.balanced_speed_fraction <= 1:
            raise PlanError("balanced speed fraction must lie in (0, 1]")

    @property
    def prompt(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.context

    def to_dict(self) -> dict:
        d = asdict(self)
        d["quant"] = list(self.quant)
        d["kv_dtype"] = list(self.kv_dtype)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Request":
        d = dict(d)
        d["quant"] = tuple(d.get("quant") or ())
        d["kv_dtype"] = tuple(d.get("kv_dtype") or ())
        return cls(**d)
