"""The speed model's efficiency records (the weights' Efficiency, which planner.speed finds), and its attention and
routed-expert efficiencies: reading, attending over and updating the KV cache at decode, attention at prefill, and
routed experts computed where they are, with their defaults and the calibration entries that replace them. Pure."""

from __future__ import annotations

from dataclasses import replace

from .record import record
from .hardware import HardwareProfile
from .modelspec import ModelSpec
from .quant import KVScheme, WeightScheme


@record(kw_only=True)
class Efficiency:
    """A scheme's achieved fractions of the peaks, and its fixed cost per layer: the speed model's constants."""

    bandwidth: float  # achieved / peak memory bandwidth during decode
    compute: float  # achieved / peak bf16 FLOP/s during prefill
    per_layer_s: float  # fixed cost per decoder layer per forward (kernel launches, Python)
    per_token_s: float  # fixed cost per forward outside the layers (embedding, lm_head launch, sampling)
    source: str  # "calibrated <date>", "fitted to public measurements (n records)" or "default"
    # eager on a GPU: what the host takes to issue one layer of this scheme (0: not host-bound, or inside per_layer_s)
    dispatch_per_layer_s: float = 0.0
    dispatch_source: str = ""
    kv: float | None = None  # the KV cache read's own efficiency (None: the speed model's rule)


# Attention at decode, per layer: max(KV bytes / (bandwidth x kv_bw_eff), attention FLOPs /
# (compute x attn_compute_eff)). The kernel reads the cache in the compute dtype: a quantized cache
# is dequantized first (see KV update traffic below). On a GPU reading the cache dominates;
# transformers' DynamicCache appends with torch.cat (a read and a write of the layer's cache per
# token) before the kernel reads it again, so by default the KV path runs at a third of the weights'
# bandwidth efficiency. On a CPU the single-query attention kernel is compute-bound (measured: time
# per cached token follows heads x head_dim x layers, not KV bytes). Calibration fits both per
# device x attention implementation (entries with backend "attn-sdpa" / "attn-eager");
# uncalibrated, the compute side defaults to the weights' compute efficiency on a GPU, on a CPU to
# DEFAULT_CPU_DECODE_ATTENTION_EFFICIENCY.
KV_PASSES_DEFAULT = 3.0
# KV update traffic: what a quantized cache moves per cached element per decode step beyond the
# bf16 DynamicCache's torch.cat, is quant.KVScheme.update_extra_bytes_per_element (derived there from
# transformers' cache code). It runs at the calibrated "kv-update" efficiency of that KV dtype
# (backend "kv-update", quant = the KV dtype), else at the weights' bandwidth efficiency, plus a fixed cost per layer
# and step (the entry's per_layer_overhead: the dequantize, cat and quantize ops' dispatch, whatever the context;
# fitted on the 2-core dev VM at 0.17 ms for fp8, 0-0.11 ms for quanto's caches), 0 until calibrated.
KV_UPDATE_BACKEND = "kv-update"
# Attention at prefill (QK^T and AV over the causal pairs, windows capped) is its own kernel with its own efficiency,
# not the weight matmuls': it is costed as its FLOPs / (compute x eff) beside them. Calibration fits it per device x
# attention implementation (entries with backend "prefill-attn-sdpa" / "prefill-attn-eager", compute efficiency),
# jointly with each scheme's matmul efficiency over prompts of several lengths. Uncalibrated defaults: on a CPU 0.40
# of cpu_float_peak, fitted on the 2-core Xeon dev VM with the CPU schemes' matmul efficiencies (_DEFAULTS:
# Qwen2.5-0.5B, prompts 128-2048, 0.395; torch's causal SDPA in bf16 alone reaches 95-185 GFLOP/s there at
# 512-2048 tokens against the fp32 peak's 312-360; it was 0.17 of the bf16 peak, fitted on the AVX512-BF16 EPYC
# VM); on a GPU 0.35, FlashAttention-2's forward on an H100 (about 350 of 989 TFLOPS at head_dim 128,
# FlashAttention-3 paper, Shah et al. 2024, fig. 5).
PREFILL_ATTENTION_BACKEND = "prefill-attn"
DEFAULT_PREFILL_ATTENTION_EFFICIENCY = {"cpu": 0.40, "gpu": 0.35}
# Attention at decode on a CPU, uncalibrated: its FLOPs at this fraction of cpu_float_peak (on a GPU, and before
# runtime.attention, the weights' compute efficiency). vramplan's calibration on the 2-core Xeon dev VM (Qwen2.5-0.5B,
# contexts 128-2048, the four CPU schemes: the attn-sdpa entry) fitted 0.088; SDPA of one packed query over 4096 cached
# tokens alone reaches 62 GFLOP/s of 360 (0.17). It was the weights' 0.50 of the bf16 peak, and torch's enable_gqa path
# that transformers takes reached 5 GFLOP/s.
DEFAULT_CPU_DECODE_ATTENTION_EFFICIENCY = 0.09


# Routed experts (MoE), per layer and step: their bytes at the "experts" efficiency of the scheme on that device, plus
# a fixed cost per routed expert computed (gather its tokens, two matmuls, the gate, scatter-add: kernels and Python,
# like a layer's fixed cost but per expert). Calibration measures both (entries with backend "experts": bandwidth
# efficiency, and per_layer_overhead = the cost per expert call); uncalibrated, the weights' efficiency and these
# defaults: on a GPU EXPERT_CALL_LAUNCHES kernel launches; on a CPU DEFAULT_CPU_EXPERT_CALL_S (eager dispatch of those
# ops, about 50 us measured on the 2-core Xeon dev VM with quanto int4 experts), except for an eager decode where the
# profile has the probe's timing of that call (host.cpu_expert_call: 268 us on the AVX2 EPYC VM, one token). A
# prefill's calls (many tokens each) and a compiled decode's (runtime.experts' unrolled forward, in the graph) keep the
# default: the probe times neither, and with it Qwen3-30B-A3B's CPU TTFT was predicted within 1 % (9.41 / 9.46 s) and a
# 1.9 GB MoE's compiled decode within 11 % (29.7 / 33.2 tok/s quanto-int4) on that VM.
EXPERTS_BACKEND = "experts"
# llama.cpp's schemes' backend (planner.engines.llamacpp.SPEED_SCHEME): ggml computes a layer's routed experts in one
# op (mul_mat_id), so its experts pay their bytes and no cost per expert, uncalibrated as calibrated (the calibrated
# speed view's experts entry has none either).
LLAMA_CPP_BACKEND = "llama.cpp"
EXPERT_CALL_LAUNCHES = 8
DEFAULT_CPU_EXPERT_CALL_S = 40e-6
# int8-wo / int4-wo experts in a compiled GPU decode are read by gathering each routed expert's slices at the index
# tensor (runtime.experts.ExpertMatrices._slice: no host sync, so the step stays one CUDA graph). int8's gather
# fuses into its matmul (coordinate-descent tuning turns a one-row matmul into a reduction inductor fuses with the
# gather and the int8 conversion: runtime.compiled.GPU_COMPILE_OPTIONS): one pass over the bytes, as gpt-fast's Mixtral
# int8 run shows (the same gathers, compiled: 97.92 tok/s on one A100-80GB, meta-pytorch/gpt-fast mixtral-moe/README.md;
# 11.3 GB of routed experts + 1.5 GB of other weights a token; more than 1.7 passes over the experts would need more
# than the A100's 2.04 TB/s). int4's kernel (tinygemm) is an extern call inductor cannot fuse into: the gathered slices
# are written to a buffer and read again, GATHERED_INT4_EXPERT_PASSES over their bytes. By design, not measured (the
# GPU proof's call measures it).
GATHERED_INT4_EXPERT_PASSES = 3


@record(kw_only=True)
class ExpertEfficiency:
    """Routed experts computed by the CPU: achieved bandwidth and the fixed cost of one expert's call."""

    bandwidth: float  # routed experts' bytes, achieved / peak bandwidth
    per_call_s: float  # fixed cost of one routed expert's forward in a decode step
    source: str
    prefill_per_call_s: float | None = None  # in a prefill chunk, where it differs (None: per_call_s)
    # the layer's routed experts computed as one grouped call (transformers' own experts implementation, grouped_mm by
    # default in transformers 5, which bf16 / fp16 weights run): one fixed cost per layer, not one per expert
    grouped: bool = False

    @property
    def prefill_call_s(self) -> float:
        return self.per_call_s if self.prefill_per_call_s is None else self.prefill_per_call_s


def expert_efficiency(hw: HardwareProfile, device: str, scheme: WeightScheme, weights: Efficiency,
                      compiled: bool = False, gathered: bool = False) -> ExpertEfficiency:
    """`gathered`: the routed experts are quantized and gathered in a compiled GPU decode (scheme.gathers_experts, where
    tinygemm takes the model's expert matrices). A scheme that groups its experts (scheme.groups_experts: transformers'
    grouped experts, vLLM's fused MoE) pays one call a layer: `grouped`."""
    e = _expert_efficiency(hw, device, scheme, weights, compiled, gathered)
    if not scheme.groups_experts or scheme.backend == LLAMA_CPP_BACKEND:
        return e
    return replace(e, grouped=True, source=f"{e.source}; one call per layer (grouped experts)")


def _expert_efficiency(hw: HardwareProfile, device: str, scheme: WeightScheme, weights: Efficiency,
                       compiled: bool, gathered: bool) -> ExpertEfficiency:
    e = hw.calibration.lookup(device, EXPERTS_BACKEND, scheme.name) if hw.calibration is not None else None
    if e is not None and e.bandwidth_efficiency is not None:
        return ExpertEfficiency(bandwidth=e.bandwidth_efficiency, per_call_s=e.per_layer_overhead_s,
                                source=f"calibrated {hw.calibration.measured_at}")
    if scheme.backend == LLAMA_CPP_BACKEND:
        return ExpertEfficiency(bandwidth=weights.bandwidth, per_call_s=0.0, prefill_per_call_s=0.0,
                                source="default: llama.cpp computes a layer's routed experts in one op (mul_mat_id), "
                                       "no cost per expert")
    if device == "cpu" and not compiled and hw.host.cpu_expert_call_s is not None:
        return ExpertEfficiency(bandwidth=weights.bandwidth, per_call_s=hw.host.cpu_expert_call_s,
                                prefill_per_call_s=DEFAULT_CPU_EXPERT_CALL_S,
                                source=f"decode calls: profile {hw.name}: host.cpu_expert_call (the probe's timing of "
                                       "an eager call, one token); prefill calls: default")
    call = EXPERT_CALL_LAUNCHES * hw.overheads.kernel_launch_s if device == "gpu" else DEFAULT_CPU_EXPERT_CALL_S
    if device == "gpu" and gathered:
        return ExpertEfficiency(bandwidth=weights.bandwidth / GATHERED_INT4_EXPERT_PASSES, per_call_s=call,
                                source=f"default, each routed expert's bytes read {GATHERED_INT4_EXPERT_PASSES} times "
                                       "(planner.speed_attention.GATHERED_INT4_EXPERT_PASSES: gathered for tinygemm "
                                       "in the graph)")
    return ExpertEfficiency(bandwidth=weights.bandwidth, per_call_s=call, source="default")


@record(kw_only=True)
class KVEfficiency:
    """Reading, attending over and updating the KV cache: achieved fractions of the peaks."""

    read: float  # the attention kernel reading the cache, achieved / peak bandwidth
    attention_compute: float  # the attention kernel's FLOPs, achieved / peak compute
    update: float  # a quantized cache's extra update traffic, achieved / peak bandwidth
    update_per_layer_s: float  # a quantized cache's fixed update cost per layer and step
    prefill_compute: float  # the prefill attention kernel's FLOPs, achieved / peak compute
    source: str


def kv_efficiency(hw: HardwareProfile, device: str, spec: ModelSpec, kv: KVScheme, weights: Efficiency,
                  of: str = "the weights'") -> KVEfficiency:
    """The attention kernel's efficiencies (per device x attention implementation) and the KV dtype's update one;
    `weights` is the efficiency the cache's defaults follow (`of`: whose, in words)."""
    read = weights.bandwidth / KV_PASSES_DEFAULT
    compute = DEFAULT_CPU_DECODE_ATTENTION_EFFICIENCY if device == "cpu" else weights.compute
    source = f"default (KV reads at {of} efficiency / {KV_PASSES_DEFAULT:g}" + (
        f"; attention FLOPs at DEFAULT_CPU_DECODE_ATTENTION_EFFICIENCY {compute:g})" if device == "cpu" else ")")
    if weights.kv is not None:
        read, source = weights.kv, f"{weights.source} (its kv_efficiency)"
    cal = hw.calibration
    if cal is not None:
        for impl in (spec.attention_impl, "sdpa"):  # an uncalibrated kernel borrows the calibrated SDPA figure
            e = cal.lookup(device, f"attn-{impl}", "bf16")
            if e is not None:
                read = e.bandwidth_efficiency if e.bandwidth_efficiency is not None else read
                compute = e.compute_efficiency if e.compute_efficiency is not None else compute
                source = f"calibrated {cal.measured_at} (attn-{impl})"
                break
    update, update_per_layer = weights.bandwidth, 0.0
    e = cal.lookup(device, KV_UPDATE_BACKEND, kv.name) if cal is not None else None
    if e is not None and e.bandwidth_efficiency is not None:
        update, update_per_layer = e.bandwidth_efficiency, e.per_layer_overhead_s
        source += f"; {kv.name} cache update calibrated {cal.measured_at}"
    prefill = DEFAULT_PREFILL_ATTENTION_EFFICIENCY[device]
    for impl in (spec.attention_impl, "sdpa") if cal is not None else ():
        e = cal.lookup(device, f"{PREFILL_ATTENTION_BACKEND}-{impl}", "bf16")
        if e is not None and e.compute_efficiency is not None:
            prefill = e.compute_efficiency
            source += f"; prefill attention calibrated {cal.measured_at} ({PREFILL_ATTENTION_BACKEND}-{impl})"
            break
    return KVEfficiency(read=read, attention_compute=compute, update=update, update_per_layer_s=update_per_layer,
                        prefill_compute=prefill, source=source)
