"""Which runs take vramplan's own CPU decoder step (runtime.lean) instead of transformers' forward: the rule the speed
model prices and the runtime follows, one function for both.

transformers' eager forward is about 180 torch ops a decoder layer (its modules, the mask, a DynamicCache that
concatenates the whole cache every step): a fixed 326-422 us a layer on the 2-core Xeon AMX VM (bench/lean_cpu.py).
runtime.lean runs the same modules' weights through about 30 ops a layer: one kernel call for q, k and v together and
one for gate and up (their rows concatenated, exact), a preallocated cache written in place, and SDPA over its filled
part: 227-261 us there. planner.speed prices its layers' fixed cost with planner.speed_cpu.lean_factor (the probe's
two timings, else LEAN_CPU_PER_LAYER_FACTOR).
"""

from __future__ import annotations

from .modelspec import ModelSpec
from .quant import KVScheme, WeightScheme

# The architectures whose decoder layer runtime.lean writes out (transformers 5's Llama layer: RMSNorm, q/k/v/o
# projections, rotary embedding from the model's own rotary module, SDPA, a gated MLP; Qwen3's per-head q/k norms).
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The schemes it runs: vramplan's own kernel, whose q/k/v and gate/up rows it concatenates into one call each.
LEAN_SCHEMES = ("cpu-w4a8",)
# What runtime.lean leaves of a layer's fixed cost (calibrated, which `vramplan calibrate` measures in transformers'
# forward, or default): a decode step with the kernel calls and lm_head replaced by empty tensors, lean's over
# transformers', median of 22 steps after a 128-token prompt (bench/lean_cpu.py, cpu-w4a8, 2-core Xeon VM with AMX,
# 2026-11-29; bench/results/lean-cpu-cpu-xeon-amx.md): Qwen2.5-0.5B 227 / 353 us a layer, Llama-3.2-1B 261 / 422 in
# the committed run (0.64, 0.62), 239 / 326 and 235 / 344 in one before it (0.73, 0.68); their mean.
LEAN_CPU_PER_LAYER_FACTOR = 0.67


def lean_refusal(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme) -> str | None:
    """Why a run of `spec` in `scheme` with cache `kv`, every layer on the CPU and eager, does not take runtime.lean's
    decoder step (it then runs transformers' forward), or None when it does."""
    if scheme.name not in LEAN_SCHEMES:
        return f"vramplan's own decoder step runs {', '.join(LEAN_SCHEMES)} only"
    if spec.model_type not in LEAN_MODEL_TYPES:
        return f"vramplan's own decoder step runs {', '.join(LEAN_MODEL_TYPES)} models, not {spec.model_type}"
    if spec.moe is not None:
        return "vramplan's own decoder step runs dense models (an MoE's experts route in transformers' forward)"
    if any(a.kind != "mha" or a.window is not None for a in spec.attention):
        return "vramplan's own decoder step runs full attention in every layer (no sliding window)"
    if kv.backend != "dynamic":
        return f"vramplan's own decoder step keeps an unquantized cache, not {kv.name}"
    return None


def decodes_lean(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, *, on_gpu: bool, compiled: bool,
                 eager: bool) -> bool:
    """Whether vramplan's runtime decodes this plan with runtime.lean: every layer on the CPU, neither --compile nor
    --eager (which runs transformers' forward, to compare), and no refusal."""
    return not on_gpu and not compiled and not eager and lean_refusal(spec, scheme, kv) is None
