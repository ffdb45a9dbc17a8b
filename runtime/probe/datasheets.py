"""Datasheet and typical figures used where the probe cannot measure: GPUs, PCIe links, Apple chips."""

from __future__ import annotations

import re

from vramplan.planner.hardware import GPUSpec, LinkSpec
from vramplan.planner.units import GiB, MiB, format_bandwidth, format_flops, parse_seconds
from .nvml import NvmlGpu

# Host <-> GPU copies that a PCIe link of each generation typically achieves at x16,
# (pinned, pageable) in bytes/s; scaled by width/16. Typical, not measured.
PCIE_TYPICAL_X16: dict[int, tuple[float, float]] = {
    1: (3.0e9, 2.0e9),
    2: (6.0e9, 4.0e9),
    3: (12.0e9, 8.0e9),
    4: (25.0e9, 12.0e9),
    5: (50.0e9, 20.0e9),
    6: (100.0e9, 25.0e9),
}
DEFAULT_CUDA_CONTEXT_BYTES = 500 * MiB  # typical CUDA 12 context with torch + cuBLAS, lazy loading on
DEFAULT_ALLOCATOR_RESERVE_BYTES = 512 * MiB  # caching-allocator slack kept free (not measurable by a probe)
DEFAULT_KERNEL_LAUNCH_S = parse_seconds("5 us")  # typical CUDA launch latency from Python/torch


# An NVIDIA GPU that matches no datasheet: dense bf16 tensor FLOP per CUDA core per SM clock,
# by compute capability major. Fitted on datasheets: A100 312 TFLOPS = 6912 cores x 1.41 GHz x 32;
# L4 121 = 7424 x 2.04 x 8; RTX 4090 165 = 16384 x 2.52 x 4 (GeForce runs bf16, which
# accumulates in fp32, at half the rate of the professional parts).
GPU_BF16_FLOP_PER_CORE_CLOCK = {8: 8.0, 9: 32.0, 10: 32.0, 12: 8.0}
GPU_BF16_FLOP_PER_CORE_CLOCK_DATACENTER_80 = 32.0  # A100 / A30 (cc 8.0)
GPU_BF16_FLOP_PER_CORE_CLOCK_GEFORCE = 4.0
GPU_FLOPS_PER_BYTE_GUESS = 100.0  # last resort: bf16 FLOP/s ~ 100 x memory bandwidth

# Apple silicon: the share of unified RAM the GPU may wire by default (macOS
# recommendedMaxWorkingSetSize is ~2/3 of RAM up to 36 GiB, ~3/4 above).
APPLE_GPU_SHARE_SMALL = 2 / 3
APPLE_GPU_SHARE_LARGE = 0.75
APPLE_GPU_SHARE_THRESHOLD_BYTES = 36 * GiB
# chip -> (memory bandwidth bytes/s, GPU fp16/bf16 FLOP/s of the top GPU bin, approximate)
APPLE_CHIPS: dict[str, tuple[float, float]] = {
    "M1": (68.25e9, 2.6e12),
    "M1 Pro": (200e9, 5.2e12),
    "M1 Max": (400e9, 10.4e12),
    "M1 Ultra": (800e9, 20.8e12),
    "M2": (100e9, 3.6e12),
    "M2 Pro": (200e9, 6.8e12),
    "M2 Max": (400e9, 13.6e12),
    "M2 Ultra": (800e9, 27.2e12),
    "M3": (100e9, 4.1e12),
    "M3 Pro": (150e9, 7.4e12),
    "M3 Max": (400e9, 16.4e12),
    "M3 Ultra": (819e9, 28.4e12),
    "M4": (120e9, 4.3e12),
    "M4 Pro": (273e9, 9.2e12),
    "M4 Max": (546e9, 18.4e12),
}
UNIFIED_NVIDIA_GPUS = ("GB10",)  # DGX Spark: GPU and CPU share LPDDR5X


# ---------------------------------------------------------------- datasheets and typical figures


def norm_gpu_name(name: str) -> str:
    s = name.lower()
    for word in ("nvidia", "geforce"):
        s = s.replace(word, " ")
    return re.sub(r"[^a-z0-9]+", "", s)


def match_datasheet(name: str, memory_bytes: int | None) -> tuple[GPUSpec, str] | None:
    """The GPUSpec of a shipped profile whose GPU has this name (and about this memory)."""
    from vramplan.planner.profiles import shipped_profiles_dir
    from vramplan.planner.profile_yaml import load_profile
    from vramplan.planner.errors import ProfileError

    want = norm_gpu_name(name)
    directory = shipped_profiles_dir()
    for f in sorted(directory.glob("*.yaml")):
        try:
            prof = load_profile(f)
        except ProfileError:
            continue
        for g in prof.gpus:
            if norm_gpu_name(g.name) != want:
                continue
            if memory_bytes is not None and abs(g.memory_bytes - memory_bytes) > 0.1 * g.memory_bytes:
                continue
            return g, prof.name
    return None


def typical_link(gen: int | None, width: int | None) -> tuple[LinkSpec, str] | None:
    if not gen or not width or gen not in PCIE_TYPICAL_X16:
        return None
    pinned, pageable = PCIE_TYPICAL_X16[gen]
    scale = width / 16
    name = f"PCIe {gen}.0 x{width}"
    link = LinkSpec(
        name=name,
        h2d_pinned_bytes_per_s=pinned * scale,
        h2d_pageable_bytes_per_s=min(pageable, pinned * scale),
        d2h_pinned_bytes_per_s=pinned * scale,
        d2h_pageable_bytes_per_s=min(pageable, pinned * scale),
    )
    note = (
        f"link bandwidths are typical figures for {name} ({format_bandwidth(link.h2d_pinned_bytes_per_s)} pinned, "
        f"{format_bandwidth(link.h2d_pageable_bytes_per_s)} pageable), not measured; run `vramplan probe` (full) to "
        "measure"
    )
    return link, note


def estimate_gpu_bf16_flops(g: NvmlGpu) -> tuple[float, str] | None:
    """Dense bf16 FLOP/s from NVML's CUDA-core count x max SM clock, for a GPU no datasheet matches."""
    if not g.cuda_cores or not g.sm_clock_max_mhz or not g.compute_capability:
        return None
    major = int(g.compute_capability.split(".")[0])
    if major < 8:
        return None  # no bf16 tensor cores before Ampere
    if g.compute_capability == "8.0":
        per = GPU_BF16_FLOP_PER_CORE_CLOCK_DATACENTER_80
    else:
        per = GPU_BF16_FLOP_PER_CORE_CLOCK.get(major, 8.0)
        if "geforce" in g.name.lower() and per == 8.0:
            per = GPU_BF16_FLOP_PER_CORE_CLOCK_GEFORCE
    flops = g.cuda_cores * g.sm_clock_max_mhz * 1e6 * per
    how = (
        f"{g.name}: bf16 compute {format_flops(flops)} estimated from NVML: {g.cuda_cores} CUDA cores x "
        f"{g.sm_clock_max_mhz} MHz x {per:g} FLOP/core/clock (compute capability {g.compute_capability}); no datasheet "
        "match"
    )
    return flops, how


def _apple_chip(model: str | None) -> str | None:
    if not model:
        return None
    m = re.search(r"\b(M\d)(?:\s+(Pro|Max|Ultra))?\b", model)
    if not m:
        return None
    chip = m.group(1) + (f" {m.group(2)}" if m.group(2) else "")
    return chip if chip in APPLE_CHIPS else None


def apple_gpu_share(ram_bytes: int) -> float:
    return APPLE_GPU_SHARE_LARGE if ram_bytes > APPLE_GPU_SHARE_THRESHOLD_BYTES else APPLE_GPU_SHARE_SMALL


