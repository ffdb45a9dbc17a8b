"""What the probe's CPU records price (planner.speed's CPU terms): each scheme's decode kernel rate
(HostSpec.cpu_decode_*), a decoder layer's fixed cost (HostSpec.cpu_layer_*) and what vramplan's own decoder step
(runtime.lean) leaves of it. Pure."""

from __future__ import annotations

from .hardware import CPU_DECODE_KERNELS, HardwareProfile
from .lean import LEAN_CPU_PER_LAYER_FACTOR
from .quant import COMPILED_BACKEND, WeightScheme
from .speed_attention import LLAMA_CPP_BACKEND


# A one-row product streams its weights faster than a whole decode step reads them (the step's other ops, its caches'
# misses): the measured kernel rate over the RAM bandwidth is taken at this fraction. Fitted on the 2-core AVX2 EPYC
# VM (no AVX-512, no VNNI; 2026-11-29): `vramplan run` of Qwen2.5-0.5B (dummy weights, a 128-token prompt, 48 new
# tokens) matched at 0.55 / 0.59 / 0.69 / 0.65 of its kernels' rates for bf16 / quanto-int8 / -int4 / -w8a8 (15.2 /
# 14.6 / 7.0 / 2.8 GB/s; RAM 34.1 GB/s): their median. Llama-3.2-1B is held out (bench/results/vs-engines-cpu-epyc-*).
DECODE_KERNEL_STEP_FRACTION = 0.62


def decode_kernel_efficiency(hw: HardwareProfile, device: str, scheme: WeightScheme) -> tuple[float, str] | None:
    """On a CPU whose probe timed the kernel this scheme decodes with (HostSpec.cpu_decode_*: which kernel is fast
    depends on the CPU), the weights' bandwidth efficiency from that rate, and where it comes from; else None."""
    if device != "cpu" or scheme.backend in (COMPILED_BACKEND, LLAMA_CPP_BACKEND):
        return None  # (llama.cpp's kernels are ggml's: torch's rates say nothing of them)
    kernel = _kernel(scheme)
    rate = hw.host.decode_kernel_rate(kernel) if kernel is not None else None
    if not rate:
        return None
    ram = hw.host.ram_bandwidth_bytes_per_s
    eff = min(1.0, DECODE_KERNEL_STEP_FRACTION * rate / ram)
    return eff, (f"profile {hw.name}: host.cpu_decode_{kernel} {rate / 1e9:.1f} GB/s (the probe's timing of "
                 f"{scheme.name}'s kernel) x {DECODE_KERNEL_STEP_FRACTION:g} "
                 f"(planner.speed_cpu.DECODE_KERNEL_STEP_FRACTION) over host.ram_bandwidth {ram / 1e9:.1f} GB/s")


def _kernel(scheme: WeightScheme) -> str | None:
    return next((k for k, name in CPU_DECODE_KERNELS.items() if name == scheme.name), None)


def probe_layer_cost(hw: HardwareProfile, device: str, scheme: WeightScheme) -> tuple[float, str] | None:
    """On a CPU whose full probe timed the fixed cost of this scheme's decoder layer in transformers' eager forward
    (HostSpec.cpu_layer_<kernel>_s), that cost and where it comes from; else None (the speed model's default)."""
    if device != "cpu" or scheme.backend in (COMPILED_BACKEND, LLAMA_CPP_BACKEND):
        return None
    kernel = _kernel(scheme)
    cost = hw.host.layer_cost(kernel) if kernel is not None else None
    if cost is None:
        return None
    return cost, (f"a layer's fixed cost {1e6 * cost:.0f} us: profile {hw.name}: host.cpu_layer_{kernel} (the probe's "
                  "timing on tiny models)")


def lean_factor(hw: HardwareProfile) -> tuple[float, str]:
    """What vramplan's own decoder step leaves of a cpu-w4a8 layer's fixed cost in transformers' forward: the probe's
    two timings' ratio where it recorded both (host.cpu_layer_lean over host.cpu_layer_int4_a8), else
    planner.lean.LEAN_CPU_PER_LAYER_FACTOR; and where it comes from."""
    lean, eager = hw.host.layer_cost("lean"), hw.host.layer_cost("int4_a8")
    if lean is not None and eager and LEAN_FACTOR_RANGE[0] <= lean / eager <= LEAN_FACTOR_RANGE[1]:
        return lean / eager, (f"profile {hw.name}: host.cpu_layer_lean {1e6 * lean:.0f} us over "
                              f"host.cpu_layer_int4_a8 {1e6 * eager:.0f} us")
    return LEAN_CPU_PER_LAYER_FACTOR, "planner.lean.LEAN_CPU_PER_LAYER_FACTOR"


# The ratios of the probe's two timings lean_factor believes; outside them a noisy probe is assumed and the default
# stands (0.62-0.74 measured on the Xeon AMX VM, tiny models and real ones)
LEAN_FACTOR_RANGE = (0.3, 1.2)
