"""What a plan chooses: a weight scheme, a KV dtype and a placement of the decoder layers.

`Choice` is plain data (the `choice` object of a plan's JSON); the enums name the few
values its fields take. Pure: no torch.
"""

from __future__ import annotations

from enum import Enum

from .record import record
from .errors import PlanError
from .published import is_published_name
from .quant import KV_SCHEMES, SCHEMES


class StrEnum(str, Enum):
    """An enum whose members are their string values everywhere: comparisons, f-strings, JSON."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class OffloadMode(StrEnum):
    """Where the decoder layers that are not resident on the GPU run."""

    NONE = "none"  # every layer resident where it computes (all on the GPU, or a machine without one)
    STREAM = "stream"  # weights stay in pinned RAM and are copied into GPU slots each forward
    CPU = "cpu"  # the CPU computes them, with their KV cache in RAM


class ComputeDevice(StrEnum):
    """The device that runs the resident layers."""

    CUDA = "cuda"
    MPS = "mps"  # Apple silicon's GPU (planned; vramplan's runtime does not execute on it)
    CPU = "cpu"  # a machine without a GPU


OFFLOAD_MODES = tuple(m.value for m in OffloadMode if m is not OffloadMode.NONE)


@record(kw_only=True)
class Choice:
    """One way to run a model: schemes and where each decoder layer lives."""

    weight_quant: str
    kv_dtype: str
    gpu_layers: int  # decoder layers resident on the GPU (0 on a machine without one)
    total_layers: int
    offload: OffloadMode  # how the other total_layers - gpu_layers run
    compute_device: ComputeDevice
    embeddings_on_gpu: bool  # the input embedding (lm_head and the final norm always live with the resident layers)
    # The resident layers split over the GPUs, in device order (the first ones on GPU 0); () means all on GPU 0.
    gpu_layers_per_device: tuple[int, ...] = ()
    moe_layers: int = 0  # decoder layers with routed experts (0: a dense model)
    # Of those, how many keep their routed experts in RAM, computed by the CPU (the first ones, like llama.cpp's
    # --n-cpu-moe); attention, shared experts and the KV cache of those layers stay where the layer is.
    expert_layers_on_cpu: int = 0
    # Those layers' indices among all decoder layers (an MoE's first layers may be dense: DeepSeek-V3's MoE layers start
    # at layer 3), so the words can name the layers llama.cpp's --n-cpu-moe counts; () when not known (an older plan).
    expert_layers_in_ram: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.weight_quant not in SCHEMES and not is_published_name(self.weight_quant):
            raise PlanError(f"choice.weight_quant: unknown scheme {self.weight_quant!r}; one of {', '.join(SCHEMES)}")
        if self.kv_dtype not in KV_SCHEMES:
            raise PlanError(f"choice.kv_dtype: unknown KV dtype {self.kv_dtype!r}; one of {', '.join(KV_SCHEMES)}")
        object.__setattr__(self, "offload", _enum(OffloadMode, self.offload, "offload"))
        object.__setattr__(self, "compute_device", _enum(ComputeDevice, self.compute_device, "compute_device"))
        for name in ("gpu_layers", "total_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"choice.{name} must be a non-negative integer, got {v!r}")
        if self.gpu_layers > self.total_layers:
            raise PlanError(f"choice.gpu_layers {self.gpu_layers} exceeds total_layers {self.total_layers}")
        full = self.gpu_layers == self.total_layers
        if self.compute_device is ComputeDevice.CPU and (self.gpu_layers or self.offload is not OffloadMode.NONE):
            raise PlanError("choice: a CPU-only placement has no GPU layers and no offload")
        if self.on_gpu and full != (self.offload is OffloadMode.NONE):
            raise PlanError(f"choice: offload {self.offload.value!r} with {self.gpu_layers} of {self.total_layers} "
                            "layers on the GPU (offload is 'none' exactly when every layer is on the GPU)")
        per = tuple(self.gpu_layers_per_device) or ((self.gpu_layers,) if self.on_gpu else ())
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in per) or sum(per) != self.gpu_layers:
            raise PlanError(f"choice.gpu_layers_per_device {list(per)} must be non-negative counts summing to "
                            f"gpu_layers {self.gpu_layers}")
        object.__setattr__(self, "gpu_layers_per_device", per)
        for name in ("moe_layers", "expert_layers_on_cpu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"choice.{name} must be a non-negative integer, got {v!r}")
        if self.expert_layers_on_cpu > self.moe_layers:
            raise PlanError(f"choice: {self.expert_layers_on_cpu} layers' experts in RAM, of {self.moe_layers} MoE "
                            "layers")
        where = tuple(self.expert_layers_in_ram)
        if where and (len(where) != self.expert_layers_on_cpu or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.total_layers for i in where)):
            raise PlanError(f"choice.expert_layers_in_ram {list(where)} must be {self.expert_layers_on_cpu} layer "
                            f"indices below {self.total_layers}")
        object.__setattr__(self, "expert_layers_in_ram", where)

    @property
    def on_gpu(self) -> bool:
        return self.compute_device is not ComputeDevice.CPU

    @property
    def offloaded_layers(self) -> int:
        return self.total_layers - self.gpu_layers if self.on_gpu else 0

    @property
    def embeddings_device(self) -> str:
        return self.compute_device.value if self.embeddings_on_gpu else ComputeDevice.CPU.value

    @property
    def expert_placement(self) -> str | int | None:
        """Where routed experts live: "gpu" (with their layers), "cpu" (all in RAM), or how many MoE layers keep
        theirs in RAM; None for a dense model. (Experts of a layer that is itself offloaded go with the layer.)"""
        if not self.moe_layers:
            return None
        if self.expert_layers_on_cpu == 0:
            return "gpu"
        return "cpu" if self.expert_layers_on_cpu == self.moe_layers else self.expert_layers_on_cpu

    def to_dict(self) -> dict:
        return {"weight_quant": self.weight_quant, "kv_dtype": self.kv_dtype, "gpu_layers": self.gpu_layers,
                "total_layers": self.total_layers, "offload": self.offload.value,
                "compute_device": self.compute_device.value, "embeddings_device": self.embeddings_device,
                "gpu_layers_per_device": list(self.gpu_layers_per_device), "moe_layers": self.moe_layers,
                "expert_placement": self.expert_placement, "expert_layers_in_ram": list(self.expert_layers_in_ram)}

    @classmethod
    def from_dict(cls, d: dict) -> "Choice":
        placement = d.get("expert_placement")
        moe_layers = int(d.get("moe_layers") or 0)
        on_cpu = moe_layers if placement == "cpu" else (placement if isinstance(placement, int) else 0)
        return cls(weight_quant=d["weight_quant"], kv_dtype=d["kv_dtype"], gpu_layers=d["gpu_layers"],
                   total_layers=d["total_layers"], offload=d["offload"], compute_device=d["compute_device"],
                   embeddings_on_gpu=d.get("embeddings_device") not in (None, ComputeDevice.CPU.value),
                   gpu_layers_per_device=tuple(d.get("gpu_layers_per_device") or ()), moe_layers=moe_layers,
                   expert_layers_on_cpu=on_cpu, expert_layers_in_ram=tuple(d.get("expert_layers_in_ram") or ()))


def layer_span(indices) -> str:
    """Decoder layer indices in words: "layers 3-44", "layer 5", "layers 1, 3, 5-7"."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    return f"layer{'s' if len(indices) > 1 else ''} {text}"


def experts_in_ram_text(on_cpu: int, moe_layers: int, where=()) -> str:
    """Which routed experts are in RAM, in the words every output uses (a Choice's expert_layers_on_cpu, moe_layers and
    expert_layers_in_ram): "the first 42 of 58 MoE layers (layers 3-44)", "all 48 MoE layers"."""
    text = f"all {moe_layers} MoE layers" if on_cpu == moe_layers else f"the first {on_cpu} of {moe_layers} MoE layers"
    if where and (on_cpu < moe_layers or min(where)):
        text += f" ({layer_span(where)})"
    return text


def _enum(cls, value, what: str):
    try:
        return cls(value)
    except ValueError:
        raise PlanError(f"choice.{what} must be one of {', '.join(m.value for m in cls)}, got {value!r}") from None
