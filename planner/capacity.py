"""What a machine offers a plan: each GPU's memory and the host's RAM, with the request's budgets applied, and whether
the two are one pool (unified memory: Apple silicon). Every engine takes its capacity from `capacity(hw, req)` and
subtracts only its own reserves (a CUDA context, llama.cpp's --fit margin, vLLM's utilization): no engine reads the
profile's memory or the budgets itself. Pure.

Unified memory: the profile's GPU memory is what the GPU may wire (Metal's recommended working set), and everything the
GPU side holds comes out of the same RAM: `ram_left(gpu_used)` is what the host side may still take.
"""

from __future__ import annotations

from .hardware import HardwareProfile
from .record import record
from .request import Request


@record(kw_only=True)
class Capacity:
    """Bytes each GPU device may hold (device order; empty without a GPU), the host RAM, and whether GPU allocations
    come out of that RAM; with where each figure comes from, for the plan's constants."""

    gpus: tuple[int, ...]
    ram_bytes: int
    unified: bool = False
    gpu_source: str = ""
    ram_source: str = ""

    def ram_left(self, gpu_used: int) -> int:
        """What the host side may hold when the GPUs hold `gpu_used` bytes: all the RAM, or on unified memory what
        the GPU side leaves of it."""
        return self.ram_bytes - (gpu_used if self.unified else 0)


def capacity(hw: HardwareProfile, req: Request) -> Capacity:
    """Each GPU's memory (or the request's per-device budget, where lower) and the RAM (or the request's budget);
    budgets above the hardware are refused by the request checks before any engine plans."""
    vram = req.vram_budget_bytes
    gpus = tuple(d.memory_bytes if vram is None else min(d.memory_bytes, vram) for d in hw.devices) if hw.gpus else ()
    return Capacity(
        gpus=gpus, unified=hw.unified_memory,
        ram_bytes=req.ram_budget_bytes if req.ram_budget_bytes is not None else hw.host.ram_bytes,
        gpu_source="request --vram-budget" if vram is not None else f"profile {hw.name}: gpus[].memory",
        ram_source="request --ram-budget" if req.ram_budget_bytes is not None else f"profile {hw.name}: host.ram")
