"""The speed model: time per token from bytes and FLOPs over what the hardware moves and computes.

Decode, per layer on the device that runs it:
    weights read / (bandwidth x eff_bw)
  + max(KV read / (bandwidth x eff_kv), attention FLOPs / (compute x eff_attn))   the attention kernel
  + KV update traffic / (bandwidth x eff_kv_update) + a fixed update cost           quantized caches only
  + a fixed per-layer cost.
Offloaded layers add the host-link copy (stream mode, overlapped with compute by prefetch: a max, not a sum) or
run on the CPU (cpu mode). Decode reads the whole KV cache, so tokens/s falls as the context fills. Prefill is chunked:
its matmuls compute-bound (FLOPs / (compute x eff_compute)), its attention kernels at their own efficiency (FLOPs /
(compute x eff_prefill_attn)), which long prompts make the larger part. The ceiling is a pure bandwidth roofline: the
bytes a step must read (weights and the cache as stored) over the bandwidth, every efficiency 1, no fixed cost.

Efficiencies and fixed costs are per device x backend x quant: calibrated values from the hardware profile when it has
them, else its GPU constants fitted to public measurements (profile.public_fit: planner/public_gpu,
bench/public_gpu.py), else the documented defaults below.

Eager decode on a GPU (transformers' forward, vramplan's runtime) is also bound by the host: one CPU core issues every
op of every layer (Python, ATen dispatch, kernel launches) while the GPU runs the ones before, so a token takes the
longer of the two, max(GPU time, layers x the host's dispatch per layer x the scheme's dispatch factor). The dispatch
per layer is the host's (host.eager_dispatch_per_layer); the public data shows it deciding eager decode on every GPU
faster than an RTX 4090 (an H100 decodes Llama-3.1-8B in bf16 at 41 tok/s, the 4090 at 47). A torch.compile'd decode
with CUDA graphs (engine "compiled") and llama.cpp have no such term. Pure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import fields, replace
from typing import Callable

from .lean import decodes_lean
from .memo import ObjectMemo
from .record import record
from .hardware import HardwareProfile, HostSpec
from .choice import Choice, ComputeDevice, OffloadMode
from .constant import constants
from .memory import LayerCosts, layer_costs
from .modelspec import ModelSpec, dtype_bytes
from .quant import (COMPILED_BACKEND, KV_SCHEMES, SCHEMES, KVScheme, WeightScheme,  # noqa: F401
                    compiled_scheme, experts_tinygemm_pack)
from .request import Request
from .speed_cpu import decode_kernel_efficiency, lean_factor, probe_layer_cost
from .speed_attention import (DEFAULT_CPU_DECODE_ATTENTION_EFFICIENCY, DEFAULT_CPU_EXPERT_CALL_S,  # noqa: F401
                              DEFAULT_PREFILL_ATTENTION_EFFICIENCY, EXPERT_CALL_LAUNCHES, EXPERTS_BACKEND,
                              GATHERED_INT4_EXPERT_PASSES, LLAMA_CPP_BACKEND,
                              KV_PASSES_DEFAULT, KV_UPDATE_BACKEND, PREFILL_ATTENTION_BACKEND, ExpertEfficiency,
                              KVEfficiency, Efficiency, expert_efficiency, kv_efficiency)
from .work import (DecodeWork, ReadBytes, decode_work, experts_touched, head_flop, prefill_kinds,
                   read_bytes_per_layer)


# Documented defaults, used until `vramplan calibrate` replaces them. They are deliberately
# round numbers from published behaviour, not fits:
# - HF transformers eager decode at batch 1 reaches roughly half of the HBM roofline on large
#   GPUs for bf16 (llama.cpp: 50-80 % on consumer GPUs, 38-50 % on A100/H100; HF is lower);
# - bnb 4-bit dequantizes each weight before the matmul: Llama-2-13B on an A100 ran 19.2 tok/s
#   in nf4 vs 27.1 in fp16 (batch 1) although it reads 3.6x fewer bytes -> ~0.1 of the roofline;
# - bnb int8's outlier decomposition is slower still at batch 1;
# - on the CPU, bf16 matmuls stream weights at about half the RAM bandwidth; quanto's packed
#   int8/int4 CPU kernels do less well per byte; bitsandbytes' CPU path is slow.
# A Python/launch cost per layer dominates small models: ~40 us per layer per forward on a GPU
# (about 8-10 kernels x 5 us), ~150 us on the CPU (eager dispatch).
_DEFAULTS: dict[tuple[str, str], tuple[float, float, float, float]] = {
    # (device, quant): (bandwidth eff, compute eff, per-layer s, per-token s)
    ("gpu", "bf16"): (0.55, 0.45, 40e-6, 200e-6),
    ("gpu", "fp16"): (0.55, 0.45, 40e-6, 200e-6),
    ("gpu", "bnb-int8"): (0.08, 0.15, 150e-6, 200e-6),
    ("gpu", "bnb-nf4"): (0.12, 0.30, 80e-6, 200e-6),
    ("gpu", "bnb-nf4-dq"): (0.11, 0.30, 90e-6, 200e-6),
    ("gpu", "bnb-fp4"): (0.12, 0.30, 80e-6, 200e-6),
    ("gpu", "bnb-fp4-dq"): (0.11, 0.30, 90e-6, 200e-6),
    ("gpu", "quanto-int8"): (0.25, 0.30, 80e-6, 200e-6),
    ("gpu", "quanto-int4"): (0.20, 0.25, 80e-6, 200e-6),
    # The eager CPU schemes, each fitted the same way to one profile of Qwen2.5-0.5B's decode step on the 2-core dev VM
    # (bench/decode_profile.py, 128-token prompt, 2026-11-26: bench/results/decode-profile-cpu-dev-fit.md; RAM 28.75
    # GB/s by the probe then): the bandwidth efficiency from the matmuls' time over the weights they read; the per-layer
    # cost from the rest of the step, less attention and the 0.5 ms per token, over 24 layers. bf16 (by GEMV,
    # runtime.quantize.Bf16Rows): 56.9 ms over 988 MB -> 0.60; 17.0 ms -> 0.71 ms a layer (was 0.50, 150 us). Against
    # bench/results/vs-engines-cpu-dev.md as of 3293d8f (a later run, the probe at 27.7 GB/s): Qwen2.5-0.5B bf16 /
    # int8 / int4 +1 / +1 / -2 %; held out, Llama-3.2-1B -17 / -12 / -6 %.
    # The CPU compute efficiencies (prefill matmuls) are against planner.speed.cpu_matmul_peak: the faster of the bf16
    # and fp32 matmul, quanto-w8a8's the int8 one. One least-squares fit, on Qwen2.5-0.5B's TTFT at 128 / 512 / 2048
    # tokens in each scheme on the 2-core dev VM (the per-layer costs here, and one prefill attention efficiency, 0.395:
    # DEFAULT_PREFILL_ATTENTION_EFFICIENCY; fp32 peak 360 GFLOP/s, int8 1182 GOP/s by the probe; 2026-11-26,
    # bench/results/prefill-fit-cpu-dev.md): bf16 0.574, int8 0.355, int4 0.384, w8a8 0.406, every TTFT within 17 %
    # (18 % with these rounded values).
    # They were 0.50 and 1.0 (held at the cap) against the bf16 matmul's 62 GFLOP/s, which this CPU converts in
    # software: the quanto TTFTs over-predicted by 75-100 %, w8a8's 5-8x.
    ("cpu", "bf16"): (0.60, 0.57, 710e-6, 500e-6),
    ("cpu", "fp16"): (0.15, 0.10, 150e-6, 500e-6),
    ("cpu", "bnb-int8"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-nf4"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-nf4-dq"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-fp4"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-fp4-dq"): (0.03, 0.03, 300e-6, 500e-6),
    # quanto: vramplan calls torch's int8 / int4 kernels itself and keeps lm_head in int8 rows
    # (runtime.quantize.Int8Rows / Int4Groups, quant.cpu_head_scheme). Fitted as bf16 above: int8 37.6 ms over 494 MB ->
    # 0.46, 15.4 ms -> 0.64 ms a layer; int4 (and its int8 head) 23.7 ms over 326 MB -> 0.48, 10.7 ms -> 0.45 ms a layer
    # (were 0.40 / 0.39 with 150 us, bf16's cost of then, fitted to a vs_engines run). Prefill: above.
    ("cpu", "quanto-int8"): (0.46, 0.36, 640e-6, 500e-6),
    ("cpu", "quanto-int4"): (0.48, 0.38, 450e-6, 500e-6),
    # quanto-w8a8 (runtime.quantize.Int8Dynamic), fitted against quanto-int8 in one run of the same profile
    # (bench/results/decode-profile-cpu-dev-w8a8.md, 128-token prompt): its matmuls took 22.5 ms where int8's took
    # 36.4 -> 0.46 x 36.4 / 22.5 = 0.74; the rest of its step 7.5 ms more (the per-token quantization's ops) ->
    # 0.64 + 7.5 / 24 = 0.95 ms a layer.
    ("cpu", "quanto-w8a8"): (0.74, 0.41, 950e-6, 500e-6),
    # cpu-w4a8 (runtime.cpu_kernel): planned only where the probe timed its kernel, whose rate sets its bandwidth
    # (speed_cpu.decode_kernel_efficiency; 0.50 is never used); a layer's fixed cost is bf16's (one call a matmul, as
    # Bf16Rows makes), unless the probe timed its own (speed_cpu.probe_layer_cost). Prefill against the int8 matmul's
    # peak (cpu_matmul_peak: fbgemm's where the probe records that path): 0.53, fitted to Qwen2.5-0.5B's TTFT at a
    # 128-token prompt on the 2-core AVX2 EPYC VM (0.41, w8a8's, predicted 1.63 s for 1.25 measured;
    # bench/results/vs-engines-cpu-epyc-avx2-w4a8-noprefetch.md); Llama-3.2-1B held out.
    ("cpu", "cpu-w4a8"): (0.50, 0.53, 710e-6, 500e-6),
}
# MLA as transformers runs it (AttentionLayout.expands_cache: deepseek_v2/v3's `expand_kv`, modeling_deepseek_v3.py in
# transformers 5.17-5.24): every forward of every layer up-projects the layer's WHOLE cached context with kv_b_proj
# and copies k_nope and the shared k_rot into a new key tensor, before the attention kernel reads K and V. Per decode
# token that is context x expand_flop_per_token FLOPs (a matmul: at the weights' compute efficiency) and context x
# expand_traffic_elements_per_token elements moved in the compute dtype (at the weights' bandwidth efficiency),
# whichever takes longer; prefill expands once per chunk over the context so far. Measured on the 2-core dev VM
# (hidden 256, 8 heads, kv_lora_rank 256, bf16): at a 3000-token context matmuls, almost all kv_b_proj's, are 62 %
# of a decode step's time (torch profiler; the copies of the expansion and of SDPA's math path most of the rest).


# Each time the hidden state changes device (GPU to GPU in a multi-GPU pipeline, GPU to CPU and back around cpu-mode
# layers or routed experts in RAM) it crosses the link (its bytes over the host link) and synchronises, costed as
# this many kernel launches (a default estimate, the profile's kernel_launch each).
CROSSING_SYNC_LAUNCHES = 10

# Streamed layers: what fraction of the measured pinned host->device bandwidth the copy engine
# sustains for a layer's tensors (many medium-sized copies).
DEFAULT_LINK_EFFICIENCY = 0.85


# Eager dispatch on a GPU (see the module docstring). A host whose profile does not say how fast it dispatches gets the
# public fit's server-class figure (the slower class: an H100 SXM's host in the bitsandbytes 0.45 benchmarks,
# optimum-benchmark with transformers 4.46: 0.76 ms per Llama layer in bf16), and each scheme the fit's dispatch factor:
# bitsandbytes' Python wrappers and its int8 outlier decomposition issue more work per layer than bf16's matmuls.
# bench/public_gpu.py fits them; a profile's public_fit and host.eager_dispatch_per_layer carry the fitted values.
DEFAULT_EAGER_DISPATCH_PER_LAYER_S = 760e-6
DEFAULT_DISPATCH_FACTOR = {"bf16": 1.0, "fp16": 1.0, "bnb-nf4": 1.37, "bnb-nf4-dq": 1.6, "bnb-fp4": 1.37,
                           "bnb-fp4-dq": 1.6, "bnb-int8": 2.1, "quanto-int8": 1.5, "quanto-int4": 1.5}
# Which fitted engine a scheme runs on: its backend names llama.cpp (LLAMA_CPP_BACKEND) or a compiled decode, else
# transformers' eager.
EAGER_ENGINE = "transformers"


def fitted_engine(scheme: WeightScheme) -> str:
    return scheme.backend if scheme.backend in (COMPILED_BACKEND, LLAMA_CPP_BACKEND) else EAGER_ENGINE


# A compiled decode on a CPU (runtime.compiled: inductor, no CUDA graphs) runs the same matmul kernels as eager and
# fuses what lies between them, so it keeps the scheme's efficiencies and leaves this fraction of each layer's fixed
# cost (calibrated or default): 1 - (eager - compiled step time) / 24 layers / the default per-layer cost, the mean of
# two runs 40 min apart (bench/compiled_cpu.py, Qwen2.5-0.5B, 128-token prompt, median of 40 steps each;
# bench/results/compiled-cpu-cpu-dev-1.md and compiled-cpu-cpu-dev.md, ms saved a layer): quanto-int8 0.33 and 0.24 of
# 0.64; quanto-int4 0.27 and 0.14 of 0.45; quanto-w8a8 0.56 and 0.68 of 0.95 (its per-token quantization, about 8 small
# ops a matmul in eager, fuses into the ops around it). The two runs differ by up to 0.12 ms a layer: this VM's spread.
# bf16 has no entry: its step is its GEMVs' (0.14 ms a layer in both runs; +1 / -7 % for Qwen2.5-0.5B / Llama-3.2-1B in
# bench/results/vs-engines-cpu-dev.md as of 2554959; -0 / -1 % and +15 / -1 % in its two runs since).
COMPILED_CPU_PER_LAYER_FACTOR: dict[str, float] = {"quanto-int8": 0.56, "quanto-int4": 0.54, "quanto-w8a8": 0.35}


# llama.cpp's file types until calibrated (`vramplan calibrate --engine llama.cpp`): on a GPU bf16's; on the CPU the
# values bf16 had before vramplan's GEMV path, which has no counterpart in llama.cpp (ggml has no per-op dispatch).
# Against bench/results/vs-engines-cpu-dev.md as of 3293d8f (2-core VM, not fitted to it): Qwen2.5-0.5B BF16 / Q8_0 /
# Q4_0 -19 / -18 / -13 %, Llama-3.2-1B -24 / -17 / -6 %; against bench/results/vs-engines-cpu-epyc-avx2.md (the AVX2
# EPYC VM, its probe's RAM bandwidth): +9 / +14 / +16 %, +2 / -6 / +7 %. The probe's timings of torch's kernels
# (speed_cpu.decode_kernel_efficiency) never apply: they priced these at half that speed there.
_LLAMA_CPP_DEFAULTS: dict[str, tuple[float, float, float, float]] = {
    "gpu": _DEFAULTS[("gpu", "bf16")], "cpu": (0.50, 0.50, 150e-6, 500e-6)}


def _default(device: str, scheme: WeightScheme) -> tuple[float, float, float, float]:
    """The documented defaults; a compiled scheme takes the unquantized weights' on that device, a llama.cpp file
    type _LLAMA_CPP_DEFAULTS."""
    if scheme.backend == LLAMA_CPP_BACKEND:
        return _LLAMA_CPP_DEFAULTS[device]
    key = (device, scheme.name)
    if scheme.backend == COMPILED_BACKEND and key not in _DEFAULTS:
        return _DEFAULTS[(device, "bf16")]
    return _DEFAULTS[key]


def host_dispatch_per_layer(hw: HardwareProfile) -> tuple[float, str]:
    """The host's eager dispatch of one bf16 layer, and where the figure comes from."""
    if hw.host.eager_dispatch_per_layer_s is not None:
        fit = hw.public_fit
        return hw.host.eager_dispatch_per_layer_s, (f"profile {hw.name}: host.eager_dispatch_per_layer, "
                                                    + (fit.host_source if fit is not None else "as given"))
    return DEFAULT_EAGER_DISPATCH_PER_LAYER_S, "default: planner.speed.DEFAULT_EAGER_DISPATCH_PER_LAYER_S"


def _dispatch(hw: HardwareProfile, device: str, scheme: WeightScheme, factor: float | None) -> tuple[float, str]:
    """Eager dispatch per layer of this scheme on a GPU (0 elsewhere, compiled or llama.cpp)."""
    if device != "gpu" or fitted_engine(scheme) != EAGER_ENGINE:
        return 0.0, ""
    per_layer, where = host_dispatch_per_layer(hw)
    if factor is None:
        factor = DEFAULT_DISPATCH_FACTOR.get(scheme.name, 1.0)
        return per_layer * factor, f"{where} x {factor:g} (planner.speed.DEFAULT_DISPATCH_FACTOR[{scheme.name}])"
    return per_layer * factor, f"{where} x {factor:g} (profile {hw.name}: public_fit {scheme.name} dispatch_factor)"


def fitted_entry(hw: HardwareProfile, device: str, scheme: WeightScheme):
    """The profile's public_fit entry for this scheme on a GPU (None: none). llama.cpp's speed view of a profile
    (engines.llamacpp.speed_hardware) holds the one entry of the plan's file type, under its file-type group."""
    if device != "gpu" or hw.public_fit is None:
        return None
    engine = fitted_engine(scheme)
    e = hw.public_fit.lookup(engine, scheme.name)
    if e is None and engine == LLAMA_CPP_BACKEND:
        mine = [x for x in hw.public_fit.entries if x.engine == engine]
        e = mine[0] if len(mine) == 1 else None
    return e


def efficiency(hw: HardwareProfile, device: str, scheme: WeightScheme, compiled: bool = False,
               lean: bool = False) -> Efficiency:
    """The weights' efficiencies and fixed costs on `device` ("gpu" or "cpu"): calibrated, else fitted to public
    measurements (the profile's public_fit, GPU only), else the defaults (field by field: a calibration that did not
    measure prefill keeps the default compute efficiency). A calibration's per-layer cost was measured with the
    host's dispatch in it: no dispatch term is added to it. `compiled` on a CPU (a compiled decode of this scheme,
    runtime.compiled): the per-layer cost times what compiling measured to leave of it
    (COMPILED_CPU_PER_LAYER_FACTOR); on a GPU a compiled decode is its own scheme (compiled_scheme). `lean` on a CPU
    (runtime.lean's decoder step, planner.lean.decodes_lean): the same, by planner.speed_cpu.lean_factor."""
    eff = _efficiency(hw, device, scheme)
    factor = COMPILED_CPU_PER_LAYER_FACTOR.get(scheme.name) if compiled and device == "cpu" else None
    if factor is not None:
        return replace(eff, per_layer_s=eff.per_layer_s * factor,
                       source=f"{eff.source}; compiled: x {factor:g} a layer's fixed cost "
                              f"(planner.speed.COMPILED_CPU_PER_LAYER_FACTOR[{scheme.name}])")
    if lean and device == "cpu":
        factor, where = lean_factor(hw)
        return replace(eff, per_layer_s=eff.per_layer_s * factor,
                       source=f"{eff.source}; vramplan's own decoder step: x {factor:.3g} a layer's fixed cost "
                              f"({where})")
    return eff


def _efficiency(hw: HardwareProfile, device: str, scheme: WeightScheme) -> Efficiency:
    bw, comp, per_layer, per_token = _default(device, scheme)
    if scheme.backend == COMPILED_BACKEND and device == "cpu" and scheme.name in SCHEMES:
        # a CPU has no dispatch term to drop, and a compiled bf16 decode measured +1 % / -7 % of eager there
        # (bench/results/vs-engines-cpu-dev.md as of 2554959): the weights' own calibration stands for it
        scheme = SCHEMES[scheme.name]
    e, stand_in = _calibrated_entry(hw, device, scheme)
    if e is None:
        fitted = fitted_entry(hw, device, scheme)
        if fitted is None and scheme.backend == COMPILED_BACKEND and device == "gpu" and hw.public_fit is not None:
            eager = hw.public_fit.lookup(EAGER_ENGINE, scheme.name)
            if eager is not None:  # no compiled runs for this GPU class: the same kernels' bytes, without the dispatch
                return Efficiency(bandwidth=eager.bandwidth_efficiency, compute=comp, per_layer_s=eager.per_layer_s,
                                  per_token_s=eager.per_token_s, kv=eager.kv_efficiency,
                                  source=f"{eager.source}: profile {hw.name} public_fit {eager.engine} {eager.quant} "
                                         "without its eager dispatch (no compiled runs fitted for this GPU class)")
        if fitted is not None:
            d, d_source = _dispatch(hw, device, scheme, fitted.dispatch_factor)
            return Efficiency(bandwidth=fitted.bandwidth_efficiency, compute=comp, per_layer_s=fitted.per_layer_s,
                              per_token_s=fitted.per_token_s, kv=fitted.kv_efficiency,
                              source=f"{fitted.source}: profile {hw.name} public_fit {fitted.engine} {fitted.quant}",
                              dispatch_per_layer_s=d, dispatch_source=d_source)
        d, d_source = _dispatch(hw, device, scheme, None)
        measured = decode_kernel_efficiency(hw, device, scheme)
        probed = probe_layer_cost(hw, device, scheme)  # the probe's timing of a layer's fixed cost, where recorded
        per_layer, layer_source = probed if probed is not None else (per_layer, None)
        if measured is not None:
            return Efficiency(bandwidth=measured[0], compute=comp, per_layer_s=per_layer, per_token_s=per_token,
                              source=measured[1] + (f"; {layer_source}" if layer_source else ""))
        return Efficiency(bandwidth=bw, compute=comp, per_layer_s=per_layer, per_token_s=per_token,
                          source="default" + (f" ({layer_source})" if layer_source else ""),
                          dispatch_per_layer_s=d, dispatch_source=d_source)
    return Efficiency(bandwidth=e.bandwidth_efficiency,
                      compute=e.compute_efficiency if e.compute_efficiency is not None else comp,
                      per_layer_s=e.per_layer_overhead_s, per_token_s=e.per_token_overhead_s,
                      source=f"calibrated {hw.calibration.measured_at}"
                             + (f" ({stand_in}'s entry: same backend and bits)" if stand_in else ""))


def _calibrated_entry(hw: HardwareProfile, device: str, scheme: WeightScheme):
    """The scheme's calibration entry, else the entry of a calibrated scheme with the same backend and bits (fp16 runs
    bf16's kernels on the same bytes, bnb-fp4 nf4's): a calibrated machine's measured dispatch costs are closer than the
    defaults, which an H200 showed to be 5x off (bf16 calibrated at 15.7 tok/s for Llama-3.1-8B, fp16 predicted at 121
    by default). (entry, the stand-in scheme's name or None)."""
    cal = hw.calibration
    if cal is None:
        return None, None
    e = cal.lookup(device, scheme.backend, scheme.name)
    if e is not None and e.bandwidth_efficiency is not None:
        return e, None
    for other in SCHEMES.values():
        if other.name != scheme.name and other.backend == scheme.backend and other.bits == scheme.bits \
                and other.activation_bits == scheme.activation_bits:
            e = cal.lookup(device, other.backend, other.name)
            if e is not None and e.bandwidth_efficiency is not None:
                return e, other.name
    return None, None


def speed_constants(hw: HardwareProfile, scheme: WeightScheme, device: str = "gpu", compiled: bool = False,
                    lean: bool = False) -> dict:
    """The speed constants a prediction of `scheme` on `device` uses, by name, as Constant records (the value and where
    it comes from; for constants fitted to public measurements, the records they were fitted to:
    planner/public_gpu/records.jsonl)."""
    eff = efficiency(hw, device, scheme, compiled, lean)
    fitted = fitted_entry(hw, device, scheme) if eff.source.startswith("fitted") else None
    where = eff.source + (f"; records {', '.join(fitted.records)}" if fitted is not None else "")
    prefix = f"{device}_{fitted_engine(scheme)}_{fitted.quant if fitted is not None else scheme.name}"
    out = {f"{prefix}_bandwidth_efficiency": {"value": eff.bandwidth, "from": where},
           f"{prefix}_per_layer_s": {"value": eff.per_layer_s, "from": where},
           f"{prefix}_per_token_s": {"value": eff.per_token_s, "from": where}}
    if eff.kv is not None:
        out[f"{prefix}_kv_efficiency"] = {"value": eff.kv, "from": where}
    if eff.dispatch_per_layer_s:
        out[f"{prefix}_eager_dispatch_per_layer_s"] = {"value": eff.dispatch_per_layer_s, "from": eff.dispatch_source
                                                       + (f"; host records {', '.join(hw.public_fit.host_records)}"
                                                          if hw.public_fit is not None and fitted is not None else "")}
    return constants(out)


@record(kw_only=True)
class DeviceRates:
    """One device as the speed model sees it: peaks and the efficiencies that apply there."""

    bandwidth_bytes_per_s: float
    flop_per_s: float  # the peak attention's kernels compute against: a GPU's bf16, a CPU's cpu_float_peak
    matmul_flop_per_s: float  # the peak the weights' matmuls compute against (cpu_matmul_peak on a CPU)
    weights: Efficiency
    kv: KVEfficiency
    experts: ExpertEfficiency

    def weights_s(self, nbytes: float) -> float:
        return nbytes / (self.bandwidth_bytes_per_s * self.weights.bandwidth)

    def experts_s(self, nbytes: float, calls: float) -> float:
        """Routed experts computed here: their bytes, and a fixed cost per expert (per layer, grouped)."""
        if self.experts.grouped:
            calls = min(calls, 1.0)
        return nbytes / (self.bandwidth_bytes_per_s * self.experts.bandwidth) + calls * self.experts.per_call_s

    def layer_decode_s(self, w: DecodeWork, i: int, *, without_experts: bool = False) -> float:
        """One layer's decode step here; its routed experts too unless they are computed elsewhere."""
        bw = self.bandwidth_bytes_per_s
        a = w.layout(i)
        attention = max(a.kv_read / (bw * self.kv.read),
                        a.attention_flop / (self.flop_per_s * self.kv.attention_compute))
        experts = 0.0 if without_experts else self.experts_s(w.expert_bytes[i], w.expert_calls(i))
        return (self.weights_s(w.weights_bytes[i] - w.expert_bytes[i]) + experts + attention
                + self.kv_update_s(w, i) + self.expand_s(w, i) + self.weights.per_layer_s)

    def expand_s(self, w: DecodeWork, i: int) -> float:
        """An MLA layer's expansion of its cached context: kv_b_proj's FLOPs or the bytes it moves, the longer."""
        a = w.layout(i)
        if not a.expand_flop:
            return 0.0
        return max(a.expand_flop / (self.matmul_flop_per_s * self.weights.compute),
                   a.expand_bytes / (self.bandwidth_bytes_per_s * self.weights.bandwidth))

    def kv_update_s(self, w: DecodeWork, i: int) -> float:
        """A quantized cache's extra work in layer i: its update traffic, and its fixed cost per layer."""
        update = w.layout(i).kv_update
        if not update:
            return 0.0
        return update / (self.bandwidth_bytes_per_s * self.kv.update) + self.kv.update_per_layer_s

    def prefill_s(self, flop: float, attention_flop: float, chunk_bytes: float, chunks: int) -> float:
        """A prefill's share on this device: its matmuls compute-bound, unless re-reading their weights each chunk
        takes longer, then its attention kernels at theirs."""
        return (max(flop / (self.matmul_flop_per_s * self.weights.compute), chunks * self.weights_s(chunk_bytes))
                + attention_flop / (self.flop_per_s * self.kv.prefill_compute))


def cpu_float_peak(host: HostSpec) -> tuple[float, str]:
    """The peak a CPU's floating-point kernels compute against (its bf16 matmuls, torch's weight-only int8 / int4
    kernels, the attention kernels), and the profile field it comes from: the faster of the bf16 and the fp32 matmul.
    Where bf16 is native (AVX512-BF16, AMX) that is bf16's (and the quick probe estimates no fp32 figure there); where
    it is converted in software fp32 is faster, and the kernels compute in it: on the 2-core Xeon dev VM (AVX-512, no
    BF16) torch's bf16 matmul reaches 62 GFLOP/s, its fp32 one 312-360, and at 128 rows of 4864 x 896 vramplan's bf16
    prefill (runtime.quantize.Bf16Rows, in fp32) 225, _weight_int8pack_mm 147; SDPA's causal prefill attention in
    bf16 95-185. A profile without the fp32 figure (datasheets, older probes) keeps bf16's."""
    if host.cpu_fp32_flops is not None and host.cpu_fp32_flops > host.cpu_bf16_flops:
        return host.cpu_fp32_flops, "host.cpu_fp32_compute"
    return host.cpu_bf16_flops, "host.cpu_bf16_compute"


def cpu_matmul_peak(host: HostSpec, scheme: WeightScheme) -> tuple[float, str]:
    """The peak a CPU's weight matmuls of `scheme` compute against, and the profile field it comes from: the int8
    matmul's where the scheme quantizes its activations to 8 bits (quanto-w8a8: torch._int_mm) and the profile has
    it; the bf16 matmul's for fp16 and bitsandbytes (kernels of their own, their default efficiencies set against the
    bf16 figure and not measured since); the fp32 matmul's for quanto's int8 / int4 kernels where the profile has it;
    else cpu_float_peak (vramplan's bf16 rows, quanto's kernels, llama.cpp's, whose efficiencies were fitted against
    it)."""
    if scheme.activation_bits == 8 and host.cpu_int8_ops is not None:
        return host.cpu_int8_ops, "host.cpu_int8_compute"
    if scheme.backend == "bnb" or scheme.name == "fp16":
        return host.cpu_bf16_flops, "host.cpu_bf16_compute"
    if scheme.backend == "quanto" and scheme.activation_bits >= 16 and host.cpu_fp32_flops is not None:
        # torch's int8 / int4 weight-only CPU kernels multiply in fp32 (AVX-512 FMA), never by oneDNN's native bf16:
        # on the 2-core Xeon AMX VM _weight_int8pack_mm ran 133-158 GFLOP/s at 128 rows (fp32 matmul 382, bf16 1252)
        return host.cpu_fp32_flops, "host.cpu_fp32_compute"
    return cpu_float_peak(host)


def unquantized_sibling(scheme: WeightScheme) -> WeightScheme:
    """The unquantized scheme of the same engine and compute dtype (a compiled decode's bf16 for a compiled one): whose
    efficiency a GPU's cache reads and updates take, uncalibrated (_rates). They run the same kernels whatever the
    weights' format (attention over a bf16 / fp16 cache, transformers' cache appends), not the quantized weight kernel
    (quanto-int4's fitted 0.2 on a GPU read the cache at a third of that). On the H200 (bench/results/
    gpu-nvidia-h200-2/calibrate.json) calibration found every scheme's decode attention at least as fast as bf16's:
    held at 1 for quanto-int4, quanto-int8, bnb-nf4 and bnb-int8 alike. A CPU keeps the weight-only sibling's (its
    predictions were checked against runs made so: bench/results/vs-engines-*)."""
    if not scheme.quantized or scheme.backend == LLAMA_CPP_BACKEND:
        return weight_only_sibling(scheme)  # (llama.cpp's cache has its own figures: planner.engines.llamacpp)
    if scheme.backend == COMPILED_BACKEND:
        return compiled_scheme(16)
    return SCHEMES["fp16" if scheme.compute_dtype == "float16" else "bf16"]


def weight_only_sibling(scheme: WeightScheme) -> WeightScheme:
    """The scheme with the same backend and bits whose matmuls keep the activations in the compute dtype (the scheme
    itself when it does)."""
    if scheme.activation_bits >= 16:
        return scheme
    return next((s for s in SCHEMES.values() if s.backend == scheme.backend and s.bits == scheme.bits
                 and s.activation_bits >= 16), scheme)


def _rates(hw: HardwareProfile, device: str | int, spec: ModelSpec, scheme: WeightScheme, kv: KVScheme,
           compiled: bool = False, lean: bool = False) -> DeviceRates:
    """The rates of GPU `device` (an index) or of "cpu" (`lean`: runtime.lean's decoder step, efficiency's)."""
    gpu = device != "cpu"
    kind = "gpu" if gpu else "cpu"
    eff = efficiency(hw, kind, scheme, compiled, lean)
    # attention and the cache update are not the weights' matmuls: a scheme that quantizes activations for its matmuls
    # (quanto-w8a8) reads and updates its cache as its weight-only sibling does; on a GPU a quantized scheme without a
    # cache figure of its own reads its cache as an unquantized one's (unquantized_sibling)
    sibling = unquantized_sibling(scheme) if gpu and eff.kv is None else weight_only_sibling(scheme)
    kv_weights = eff if sibling is scheme else efficiency(hw, kind, sibling, compiled, lean)
    whose = "the weights'" if sibling is scheme else f"{sibling.name}'s"
    g = hw.devices[device] if gpu else None
    return DeviceRates(bandwidth_bytes_per_s=(g.memory_bandwidth_bytes_per_s if gpu
                                              else hw.host.ram_bandwidth_bytes_per_s),
                       flop_per_s=g.bf16_flops if gpu else cpu_float_peak(hw.host)[0],
                       matmul_flop_per_s=g.bf16_flops if gpu else cpu_matmul_peak(hw.host, scheme)[0],
                       weights=eff, kv=kv_efficiency(hw, kind, spec, kv, kv_weights, of=whose),
                       experts=expert_efficiency(hw, kind, scheme, eff, compiled, gathered=scheme.gathers_experts
                                                 and experts_tinygemm_pack(spec, scheme.group_size)))


# The rates of the last few (hardware, device, model, scheme, cache): a search prices many placements of each.
_RATES_MEMO = ObjectMemo(256)


def _rates_of(hw: HardwareProfile, device: str | int, spec: ModelSpec, scheme: WeightScheme, kv: KVScheme,
              compiled: bool, lean: bool = False) -> DeviceRates:
    """_rates, made once for the same objects."""
    return _RATES_MEMO.get((hw, spec, scheme, kv), (device, compiled, lean),
                           lambda: _rates(hw, device, spec, scheme, kv, compiled, lean))


def _all_rates(hw: HardwareProfile, spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, compiled: bool,
               on_gpu: bool, lean: bool = False) -> dict[str | int, DeviceRates]:
    """The CPU's rates and, for a placement on the GPUs, each GPU's (eager: a compiled GPU decode is its own scheme),
    one dict for the same objects (not to be changed)."""
    def make():
        rates = {CPU_DEVICE: _rates_of(hw, CPU_DEVICE, spec, scheme, kv, compiled, lean)}
        for d in range(len(hw.devices) if on_gpu else 0):
            rates[d] = _rates_of(hw, d, spec, scheme, kv, False)
        return rates
    return _RATES_MEMO.get((hw, spec, scheme, kv), ("all", compiled, on_gpu, lean), make)


@record(kw_only=True)
class SpeedEstimate:
    """A placement's predicted decode and time to first token, with the terms they are made of."""

    decode_tokens_per_s: float  # at the start of generation (context = the prompt)
    decode_tokens_per_s_full_context: float  # when the cache holds the whole context
    ttft_s: float
    prefill_tokens_per_s: float
    ceiling_decode_tokens_per_s: float  # pure bandwidth roofline at the start
    terms: dict  # seconds per token by where they are spent, and the efficiencies used

    @classmethod
    def pending(cls, decode_tokens_per_s: float, make: Callable[[], "SpeedEstimate"]) -> "SpeedEstimate":
        """An estimate whose decode at the start is known now and whose other fields are `make()`'s, computed when one
        is first read (compared, printed, written): a search ranks every placement by its decode and shows a few.
        `make()` gives the same decode."""
        est = object.__new__(cls)
        object.__setattr__(est, "decode_tokens_per_s", decode_tokens_per_s)
        object.__setattr__(est, "_make", make)
        return est

    def __getattr__(self, name: str):
        """A pending estimate's other fields, made on first read (only attributes not set come here)."""
        make = self.__dict__.get("_make")
        if make is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        full = make()
        for f in fields(self):
            object.__setattr__(self, f.name, getattr(full, f.name))
        object.__delattr__(self, "_make")
        return getattr(self, name)

    @classmethod
    def from_dict(cls, predicted: dict, ceiling: dict, terms: dict) -> "SpeedEstimate":
        return cls(decode_tokens_per_s=float(predicted["decode_tokens_per_s"]),
                   decode_tokens_per_s_full_context=float(predicted["decode_tokens_per_s_full_context"]),
                   ttft_s=float(predicted["ttft_s"]), prefill_tokens_per_s=float(predicted["prefill_tokens_per_s"]),
                   ceiling_decode_tokens_per_s=float(ceiling["decode_tokens_per_s"]), terms=dict(terms or {}))


# Where a layer's work runs: a GPU index, or the CPU.
CPU_DEVICE = "cpu"
# How a layer runs where it is: resident on its device; streamed to GPU 0 over the link; computed by the CPU beside a
# GPU; resident with its routed experts in RAM, computed by the CPU.
_RESIDENT, _STREAMED, _ON_CPU, _EXPERTS_IN_RAM = "resident", "streamed", "on the CPU", "experts in RAM"


class _Layout:
    """Where a placement puts each layer, as the speed model prices it: per layer its device and its place (device, how
    it runs there, the bytes it streams in), the crossings of the hidden state's path, and what the pricing groups by
    place and kind of layer. One object per distinct placement of a model (_layout): the search prices the same
    placement under many schemes and caches (every layer on the GPU, most often), and its groups are found once."""

    def __init__(self, spec: ModelSpec, c: Choice, weights: tuple[int, ...]):
        L = spec.num_layers
        self.device = _layer_devices(c, L)
        self.streamed = {i for i in range(c.gpu_layers, L)} if c.offload is OffloadMode.STREAM else set()
        moe = sorted(spec.moe.moe_layers) if spec.moe is not None else []
        self.expert_layers_in_ram = set(moe[:c.expert_layers_on_cpu]) if c.on_gpu else set()
        # the hidden state's path: each layer's device, then lm_head on GPU 0 (the CPU without a GPU)
        path = [*self.device, 0 if c.on_gpu else CPU_DEVICE]
        self.crossings = (sum(1 for a, b in zip(path, path[1:]) if a != b) + 2 * len(self.expert_layers_in_ram))
        # Each layer's place: (device, how it runs there, the bytes it streams in). The layers of one place and one
        # kind of work take equal time, so each such group is priced once and counted (a model has few).
        streamed, in_ram, on_gpu = self.streamed, self.expert_layers_in_ram, c.on_gpu
        seen: dict[tuple, int] = {}
        if streamed or in_ram:
            self.place_of = [seen.setdefault(
                (dev, _STREAMED, weights[i]) if i in streamed
                else (dev, _ON_CPU, 0) if dev == CPU_DEVICE and on_gpu
                else (dev, _EXPERTS_IN_RAM, 0) if i in in_ram else (dev, _RESIDENT, 0), len(seen))
                for i, dev in enumerate(self.device)]  # per layer, its place's number
        else:  # each device's layers in one place
            number = {dev: seen.setdefault((dev, _ON_CPU if dev == CPU_DEVICE and on_gpu else _RESIDENT, 0), len(seen))
                      for dev in dict.fromkeys(self.device)}
            self.place_of = [number[dev] for dev in self.device]
        self.place_list = list(seen)
        self._groups = ObjectMemo(16)
        self._counted = ObjectMemo(16)

    def grouped(self, w: DecodeWork) -> list[tuple[tuple, int, int]]:
        """(place, first layer, layers) for each place and kind of work at `w`, in the order they first occur."""
        first, kinds = w.first_of_kind, w.kinds  # one object for equal kinds (work._kinds)

        def make():
            k, places = len(first), self.place_list
            counts = Counter([p * k + kind for p, kind in zip(self.place_of, kinds)])
            return [(places[pk // k], first[pk % k], n) for pk, n in counts.items()]
        return self._groups.get((kinds, first), (), make)

    def counted(self, kinds: list[int], weights: tuple[int, ...], experts) -> list[tuple]:
        """_counted over (place, prefill kind, weight bytes, expert bytes) of the layers."""
        return self._counted.get((kinds, weights, experts), (),
                                 lambda: _counted(self.place_of, kinds, weights, experts or [0] * len(self.device)))


def _layer_devices(c: Choice, L: int) -> list:
    if not c.on_gpu:
        return [CPU_DEVICE] * L
    devices = [d for d, k in enumerate(c.gpu_layers_per_device) for _ in range(k)]
    rest = 0 if c.offload is OffloadMode.STREAM else CPU_DEVICE
    return devices + [rest] * (L - len(devices))


_LAYOUTS = ObjectMemo(64)


def _layout(spec: ModelSpec, c: Choice, costs: LayerCosts) -> _Layout:
    """The _Layout of placement `c`, one object per distinct placement of the model (the last few kept)."""
    streamed = c.offload is OffloadMode.STREAM
    # (the offload mode by its value: an enum's hash is a Python call)
    key = (c.on_gpu, c.gpu_layers, c.gpu_layers_per_device, c.offload.value, c.expert_layers_on_cpu,
           tuple(costs.weights[c.gpu_layers:]) if streamed else None)
    return _LAYOUTS.get((spec,), key, lambda: _Layout(spec, c, costs.weights))


class _Model:
    """One scheme x KV dtype x placement on one machine: decode and prefill times, layer by layer on the device that
    runs each (resident layers on their GPU, streamed ones on GPU 0 behind the link, offloaded ones on the CPU,
    routed experts in RAM on the CPU), plus a crossing each time the hidden state changes device."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
                 c: Choice, costs: LayerCosts, read: ReadBytes):
        self.spec, self.hw, self.req, self.scheme, self.kv, self.c, self.costs, self.read = (
            spec, hw, req, scheme, kv, c, costs, read)
        self.rates = _all_rates(hw, spec, scheme, kv, req.compiled, c.on_gpu,
                                decodes_lean(spec, scheme, kv, on_gpu=c.on_gpu, compiled=req.compiled, eager=req.eager))
        self.main = self.rates[0] if c.on_gpu else self.rates[CPU_DEVICE]  # where lm_head and the fixed costs are
        self.link_bytes_per_s = (hw.link.h2d_pinned_bytes_per_s * DEFAULT_LINK_EFFICIENCY) if hw.link else None
        self.layout = _layout(spec, c, costs)
        self.hidden_bytes = spec.hidden_size * dtype_bytes(scheme.compute_dtype) * req.batch  # one token's state
        self.crossing_s = self._crossing_s(1)
        self._works: dict[int, DecodeWork] = {}

    def _crossing_s(self, tokens: int) -> float:
        """One change of device for `tokens` positions' hidden states: their bytes over the link, and a sync."""
        if not self.c.on_gpu:
            return 0.0
        move = tokens * self.hidden_bytes / self.link_bytes_per_s if self.link_bytes_per_s else 0.0
        return move + CROSSING_SYNC_LAUNCHES * self.hw.overheads.kernel_launch_s

    def _work(self, context: int) -> DecodeWork:
        if context not in self._works:
            self._works[context] = decode_work(self.spec, self.scheme, self.kv, self.req.batch, context, self.costs,
                                               self.read)
        return self._works[context]

    def host_dispatch_s(self) -> float:
        """Eager on a GPU: what the host takes to issue one forward of the layers the GPUs run (resident and streamed;
        layers the CPU computes are its own work, inside their per-layer cost)."""
        if not self.c.on_gpu:
            return 0.0
        gpu_layers = len(self.layout.device) - self.layout.device.count(CPU_DEVICE)
        return gpu_layers * self.main.weights.dispatch_per_layer_s

    def decode_s(self, context: int, with_terms: bool = True) -> tuple[float, dict]:
        """One decode step's time at `context`, and its terms (empty unless `with_terms`)."""
        w = self._work(context)
        resident_s = streamed_s = cpu_layers_s = experts_s = 0.0
        cpu = self.rates[CPU_DEVICE]
        for (dev, how, link_bytes), i, n in self.layout.grouped(w):
            if how is _STREAMED:
                # prefetch overlaps the copy of layer i+1 with the compute of layer i: a max, not a sum;
                # the whole layer (every expert) crosses the link
                streamed_s += n * max(link_bytes / self.link_bytes_per_s, self.rates[dev].layer_decode_s(w, i))
            elif how is _ON_CPU:
                cpu_layers_s += n * self.rates[dev].layer_decode_s(w, i)
            elif how is _EXPERTS_IN_RAM:
                resident_s += n * self.rates[dev].layer_decode_s(w, i, without_experts=True)
                experts_s += n * cpu.experts_s(w.expert_bytes[i], w.expert_calls(i))
            else:
                resident_s += n * self.rates[dev].layer_decode_s(w, i)
        head_s = self.main.weights_s(w.head_bytes)
        fixed_s = self.main.weights.per_token_s + self.layout.crossings * self.crossing_s
        # the GPUs' share runs behind the host's dispatch of it: the longer of the two
        gpu_s = resident_s + streamed_s + head_s + fixed_s
        host_s = self.host_dispatch_s()
        total = max(gpu_s, host_s) + cpu_layers_s + experts_s
        if not with_terms:
            return total, {}
        terms = {"resident_s": resident_s, "offloaded_s": streamed_s + cpu_layers_s, "experts_on_cpu_s": experts_s,
                 "lm_head_s": head_s, "fixed_s": fixed_s, "crossings": self.layout.crossings,
                 "kv_update_s": self._per_kind_sum(w, DeviceRates.kv_update_s),
                 "mla_expand_s": self._per_kind_sum(w, DeviceRates.expand_s),
                 "host_dispatch_s": host_s, "decode_bound": "host dispatch" if host_s > gpu_s else "device"}
        return total, terms

    def _per_kind_sum(self, w: DecodeWork, term) -> float:
        """`term(rates, w, i)` summed over the layers, priced once per device and kind of layer."""
        return sum(n * term(self.rates[dev], w, i) for (dev, _, _), i, n in self.layout.grouped(w))

    def ceiling_s(self, context: int) -> float:
        """The bytes a step must read over the bandwidth where they live; streamed layers over the link."""
        w = self._work(context)
        cpu_bw = self.rates[CPU_DEVICE].bandwidth_bytes_per_s
        t = w.head_bytes / self.main.bandwidth_bytes_per_s
        for (dev, how, link_bytes), i, n in self.layout.grouped(w):
            bw = self.rates[dev].bandwidth_bytes_per_s
            if how is _EXPERTS_IN_RAM:
                t_layer = ((w.weights_bytes[i] - w.expert_bytes[i] + w.layout(i).kv_stored) / bw
                           + w.expert_bytes[i] / cpu_bw)
            else:
                t_layer = (w.weights_bytes[i] + w.layout(i).kv_stored) / bw
            if how is _STREAMED:
                t_layer = max(t_layer, link_bytes / self.link_bytes_per_s)
            t += n * t_layer
        return t

    def prefill_s(self) -> float:
        """Per device, compute-bound unless re-reading its weights each chunk takes longer (a chunk of many tokens
        touches every expert); the devices take turns. Streamed layers also cross the link once per chunk."""
        req = self.req
        prompt = req.prompt
        chunks = -(-prompt // req.prefill_chunk)
        kinds, work = prefill_kinds(self.spec, prompt, req.prefill_chunk)
        segments: dict = {}  # device -> [matmul FLOPs, weight bytes per chunk, link bytes per chunk, attention FLOPs]
        calls: Counter = Counter()  # device computing a layer's routed experts -> MoE layers it computes them for
        for place, kind, weights, expert_bytes, n in self.layout.counted(kinds, self.costs.weights, self.costs.experts):
            (dev, how, _), (matmul, expand, attention, share) = self.layout.place_list[place], work[kind]
            seg = segments.setdefault(dev, [0.0, 0.0, 0.0, 0.0])
            seg[3] += n * attention * req.batch  # attention stays with the layer
            seg[0] += n * expand * req.batch  # so does MLA's expansion, a matmul
            if how is _EXPERTS_IN_RAM:
                cpu = segments.setdefault(CPU_DEVICE, [0.0, 0.0, 0.0, 0.0])
                cpu[0] += n * matmul * prompt * req.batch * share
                cpu[1] += n * expert_bytes
                seg[0] += n * matmul * prompt * req.batch * (1 - share)
                seg[1] += n * (weights - expert_bytes)
            else:
                seg[0] += n * matmul * prompt * req.batch
                seg[2 if how is _STREAMED else 1] += n * weights
            if expert_bytes:
                calls[CPU_DEVICE if how is _EXPERTS_IN_RAM else dev] += n
        head = segments.setdefault(0 if self.c.on_gpu else CPU_DEVICE, [0.0, 0.0, 0.0, 0.0])
        head[0] += head_flop(self.spec) * req.batch
        # each chunk computes every expert its tokens reach once per MoE layer: a fixed cost per expert call (one per
        # layer where the experts are grouped)
        touched = experts_touched(self.spec, min(req.prefill_chunk, prompt) * req.batch)
        calls_s = sum(n * chunks * (1.0 if self.rates[dev].experts.grouped else touched)
                      * self.rates[dev].experts.prefill_call_s for dev, n in calls.items())
        total = calls_s
        for dev, (f, chunk_bytes, link_bytes, attention_f) in segments.items():
            t = self.rates[dev].prefill_s(f, attention_f, chunk_bytes, chunks)
            if link_bytes:
                t = max(t, chunks * link_bytes / self.link_bytes_per_s)
            total += t
        main = self.main.weights
        per_chunk_fixed_s = (self.spec.num_layers * main.per_layer_s + main.per_token_s
                             + self.layout.crossings * self._crossing_s(min(req.prefill_chunk, prompt)))
        # each chunk is one eager forward the host dispatches: never faster than that
        return max(total + chunks * per_chunk_fixed_s, chunks * self.host_dispatch_s())


def _counted(*per_layer):
    """Equal tuples of the layers' values (one value from each list), each once with how many layers have it, in the
    order they first occur: what prices each kind of layer once."""
    return [(*values, n) for values, n in Counter(zip(*per_layer)).items()]


def estimate(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
             c: Choice, costs: LayerCosts, read: ReadBytes | None = None) -> SpeedEstimate:
    """Decode tokens/s at the start and at the full context, TTFT and the ceiling of one placement: the decode at the
    start now, the rest when first read (SpeedEstimate.pending)."""
    m = _Model(spec, hw, req, scheme, kv, c, costs,
               read if read is not None else read_bytes_per_layer(spec, scheme, req.batch))
    start = min(req.prompt, req.context)
    return SpeedEstimate.pending(req.batch / m.decode_s(start, with_terms=False)[0],
                                 lambda: _estimate(m, spec, hw, req, scheme, c, start))


def _estimate(m: _Model, spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, c: Choice,
              start: int) -> SpeedEstimate:
    t_start, terms = m.decode_s(start)
    t_full, _ = m.decode_s(req.context, with_terms=False)
    ttft = m.prefill_s()
    main = m.main
    return SpeedEstimate(
        decode_tokens_per_s=req.batch / t_start,
        decode_tokens_per_s_full_context=req.batch / t_full,
        ttft_s=ttft,
        prefill_tokens_per_s=req.prompt * req.batch / ttft,
        ceiling_decode_tokens_per_s=req.batch / m.ceiling_s(start),
        terms={**terms, "efficiency_source": main.weights.source, "kv_efficiency": main.kv.read,
               "attention_compute_efficiency": main.kv.attention_compute, "kv_update_efficiency": main.kv.update,
               "kv_update_per_layer_s": main.kv.update_per_layer_s,
               "prefill_attention_efficiency": main.kv.prefill_compute,
               "kv_efficiency_source": main.kv.source, "bandwidth_efficiency": main.weights.bandwidth,
               "compute_efficiency": main.weights.compute, "matmul_peak_flops": main.matmul_flop_per_s,
               "matmul_peak_from": ("gpu bf16_compute" if c.on_gpu else cpu_matmul_peak(hw.host, scheme)[1]),
               "per_layer_s": main.weights.per_layer_s,
               "per_token_s": main.weights.per_token_s, "experts_bandwidth_efficiency": main.experts.bandwidth,
               "per_expert_call_s": main.experts.per_call_s,
               "prefill_per_expert_call_s": main.experts.prefill_call_s,
               "experts_efficiency_source": main.experts.source,
               "dispatch_per_layer_s": main.weights.dispatch_per_layer_s,
               "dispatch_source": main.weights.dispatch_source,
               "link_efficiency": DEFAULT_LINK_EFFICIENCY if c.offload is OffloadMode.STREAM else None},
    )


def ttft_s(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme, c: Choice,
           costs: LayerCosts, read: ReadBytes) -> float:
    """estimate(...).ttft_s alone, without pricing the decode."""
    return _Model(spec, hw, req, scheme, kv, c, costs, read).prefill_s()


def estimate_compiled(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme) -> SpeedEstimate:
    """A compiled decode (`compiled_scheme`) with every layer on GPU 0 and a bf16 cache: the setting of the public
    compiled runs. The choice names bf16 as a stand-in: the scheme's own bytes and constants are what count."""
    kv = KV_SCHEMES["bf16"]
    L = spec.num_layers
    c = Choice(weight_quant="bf16", kv_dtype="bf16", gpu_layers=L, total_layers=L, offload=OffloadMode.NONE,
               compute_device=ComputeDevice.CUDA, embeddings_on_gpu=True, gpu_layers_per_device=(L,))
    return estimate(spec, hw, req, scheme, kv, c, layer_costs(spec, scheme, kv, req))
