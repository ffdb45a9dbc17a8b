"""The speed model: time per token from bytes and FLOPs over what the hardware moves and computes.

Per layer and phase: t = max(bytes / (bandwidth x eff_bw), flops / (compute x eff_compute))
+ a fixed per-layer cost. Offloaded layers add the host-link copy (stream mode, overlapped
with compute by prefetch: a max, not a sum) or run on the CPU (cpu mode). Decode reads
the whole KV cache, so tokens/s falls as the context fills. The ceiling is the same
model with every efficiency 1 and no fixed cost: a pure bandwidth roofline.

Efficiencies and fixed costs are per device x backend x quant: calibrated values from
the hardware profile when it has them, else the documented defaults below. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import HardwareProfile
from .memory import LayerCosts, Placement
from .modelspec import Kind, ModelSpec, Role
from .quant import KVScheme, WeightScheme, kv_bytes_per_layer
from .request import Request


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    bandwidth: float  # achieved / peak memory bandwidth during decode
    compute: float  # achieved / peak bf16 FLOP/s during prefill
    per_layer_s: float  # fixed cost per decoder layer per forward (kernel launches, Python)
    per_token_s: float  # fixed cost per forward outside the layers (embedding, lm_head launch, sampling)
    source: str  # "calibrated <date>" or "default"


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
    ("cpu", "bf16"): (0.50, 0.50, 150e-6, 500e-6),
    ("cpu", "fp16"): (0.15, 0.10, 150e-6, 500e-6),
    ("cpu", "bnb-int8"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-nf4"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-nf4-dq"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-fp4"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "bnb-fp4-dq"): (0.03, 0.03, 300e-6, 500e-6),
    ("cpu", "quanto-int8"): (0.30, 0.25, 200e-6, 500e-6),
    ("cpu", "quanto-int4"): (0.20, 0.15, 200e-6, 500e-6),
}
# Attention at decode, per layer: max(KV bytes / (bandwidth x kv_bw_eff), attention FLOPs /
# (compute x attn_compute_eff)). On a GPU reading the cache dominates; transformers' DynamicCache
# appends with torch.cat (a read and a write of the layer's cache per token) before the kernel reads
# it again, so by default the KV path runs at a third of the weights' bandwidth efficiency. On a CPU
# the single-query attention kernel is compute-bound (measured: time per cached token follows
# heads x head_dim x layers, not KV bytes). Calibration fits both per device x attention
# implementation (entries with backend "attn-sdpa" / "attn-eager"); uncalibrated, the compute side
# defaults to the weights' compute efficiency.
KV_PASSES_DEFAULT = 3.0


def kv_efficiency(hw: HardwareProfile, device: str, spec: ModelSpec, kv: KVScheme,
                  weights_eff: Efficiency) -> tuple[float, float, str]:
    """(KV-read bandwidth efficiency, attention compute efficiency, where they come from)."""
    if hw.calibration is not None:
        for impl in (spec.attention_impl, "sdpa"):  # an uncalibrated kernel borrows the calibrated SDPA figure
            e = hw.calibration.lookup(device, f"attn-{impl}", "bf16")
            if e is not None:
                return e.bandwidth_efficiency, e.compute_efficiency, f"calibrated {hw.calibration.measured_at} (attn-{impl})"
    return (weights_eff.bandwidth / KV_PASSES_DEFAULT, weights_eff.compute,
            f"default (KV reads at the weights' efficiency / {KV_PASSES_DEFAULT:g})")


def decode_attention_flops_per_layer(spec: ModelSpec, context: int, batch: int) -> list[float]:
    """FLOPs of one query token's attention per layer: QK^T and AV over the cached tokens (GQA saves none)."""
    per = {a: 4.0 * a.num_heads * a.head_dim * a.cached_tokens(context) * batch for a, _ in spec.attention_groups}
    return [per[a] for a in spec.attention]


# cpu offload mode: hidden states cross the host link twice per forward (to the CPU layers and back);
# each crossing synchronises the GPU stream, costed as this many kernel launches (a default estimate).
CPU_MODE_LINK_CROSSINGS = 2
CPU_MODE_SYNC_LAUNCHES = 10

# Streamed layers: what fraction of the measured pinned host->device bandwidth the copy engine
# sustains for a layer's tensors (many medium-sized copies).
DEFAULT_LINK_EFFICIENCY = 0.85


def efficiency(hw: HardwareProfile, device: str, scheme: WeightScheme) -> Efficiency:
    if hw.calibration is not None:
        e = hw.calibration.lookup(device, scheme.backend, scheme.name)
        if e is not None:
            return Efficiency(bandwidth=e.bandwidth_efficiency, compute=e.compute_efficiency,
                              per_layer_s=e.per_layer_overhead_s, per_token_s=e.per_token_overhead_s,
                              source=f"calibrated {hw.calibration.measured_at}")
    bw, comp, per_layer, per_token = _DEFAULTS[(device, scheme.name)]
    return Efficiency(bandwidth=bw, compute=comp, per_layer_s=per_layer, per_token_s=per_token, source="default")


def _active_fraction(spec: ModelSpec, batch: int) -> float:
    """Fraction of routed-expert bytes a decode step reads: distinct experts hit by `batch` tokens."""
    if spec.moe is None:
        return 1.0
    e, k = spec.moe.num_experts, spec.moe.experts_per_token
    return 1.0 - (1.0 - k / e) ** batch


def _read_bytes_per_layer(spec: ModelSpec, scheme: WeightScheme, batch: int) -> list[float]:
    """Weight bytes one decode step reads per layer (MoE: only the experts the batch routes to)."""
    frac = _active_fraction(spec, batch)

    def read(tensors) -> float:
        return sum(scheme.tensor_bytes(t, scheme.compute_dtype) * (frac if t.kind is Kind.EXPERTS else 1.0)
                   for t in tensors)

    return spec.per_layer(read)


def _flops_per_token(spec: ModelSpec) -> float:
    """Matmul FLOPs per token outside attention: 2 x active weights (embedding lookups are free)."""
    emb = sum(t.numel for t in spec.non_layer_tensors() if t.role is Role.EMBEDDING and not spec.tie_word_embeddings)
    return 2.0 * (spec.params_active - emb)


def _attention_flops(spec: ModelSpec, prompt: int) -> float:
    """QK^T and AV FLOPs for a causal prefill of `prompt` tokens (windows capped)."""
    total = 0.0
    for a in spec.attention:
        width = a.num_heads * a.head_dim
        # sum over positions p of min(p, window): 2 matmuls x 2 FLOPs per MAC
        if a.window is None or prompt <= a.window:
            pairs = prompt * (prompt + 1) / 2
        else:
            w = a.window
            pairs = w * (w + 1) / 2 + (prompt - w) * w
        total += 4.0 * width * pairs
    return total


def decode_bytes_per_token(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, batch: int, context: int,
                           costs: LayerCosts) -> tuple[float, float, float]:
    """One decode step with every layer resident: (active weight + lm_head bytes, KV bytes, attention FLOPs)."""
    read = _read_bytes_per_layer(spec, scheme, batch)
    return (sum(read) + costs.head_bytes, float(sum(kv_bytes_per_layer(spec, kv, context, batch))),
            sum(decode_attention_flops_per_layer(spec, context, batch)))


def prefill_flops(spec: ModelSpec, prompt: int, batch: int = 1) -> float:
    return (_flops_per_token(spec) * prompt + _attention_flops(spec, prompt)) * batch


@dataclass(frozen=True, kw_only=True)
class SpeedEstimate:
    decode_tokens_per_s: float  # at the start of generation (context = the prompt)
    decode_tokens_per_s_full_context: float  # when the cache holds the whole context
    ttft_s: float
    prefill_tokens_per_s: float
    ceiling_decode_tokens_per_s: float  # pure bandwidth roofline at the start
    terms: dict  # seconds per token by where they are spent, and the efficiencies used


def estimate(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
             p: Placement, costs: LayerCosts, read_bytes: list[float] | None = None) -> SpeedEstimate:
    L = spec.num_layers
    n = p.gpu_layers
    B = req.batch
    read = read_bytes if read_bytes is not None else _read_bytes_per_layer(spec, scheme, B)
    on_gpu = p.compute_device == "cuda"
    dev = "gpu" if on_gpu else "cpu"
    eff = efficiency(hw, dev, scheme)
    eff_cpu = efficiency(hw, "cpu", scheme) if (on_gpu and p.offload == "cpu") else eff
    kv_eff, attn_eff, kv_eff_source = kv_efficiency(hw, dev, spec, kv, eff)
    kv_eff_cpu, attn_eff_cpu, _ = (kv_efficiency(hw, "cpu", spec, kv, eff_cpu) if (on_gpu and p.offload == "cpu")
                                   else (kv_eff, attn_eff, kv_eff_source))
    main_flops = hw.gpu.bf16_flops if on_gpu else hw.host.cpu_bf16_flops
    hbm = hw.gpu.memory_bandwidth_bytes_per_s if hw.gpu else 0.0
    ram = hw.host.ram_bandwidth_bytes_per_s
    link = (hw.link.h2d_pinned_bytes_per_s * DEFAULT_LINK_EFFICIENCY) if hw.link else 0.0
    main_bw = hbm if on_gpu else ram

    def decode_time(ctx: int, ideal: bool) -> tuple[float, dict]:
        e_main = 1.0 if ideal else eff.bandwidth
        e_cpu = 1.0 if ideal else eff_cpu.bandwidth
        k_main = 1.0 if ideal else kv_eff
        k_cpu = 1.0 if ideal else kv_eff_cpu
        fixed_layer = 0.0 if ideal else eff.per_layer_s
        kvl = kv_bytes_per_layer(spec, kv, ctx, B)
        afl = decode_attention_flops_per_layer(spec, ctx, B)
        resident = L if (not on_gpu or p.offload == "none") else n

        def attn(i: int, bw: float, k_eff: float, flops: float, a_eff: float) -> float:
            if ideal:  # the ceiling is a pure bandwidth roofline
                return kvl[i] / bw
            return max(kvl[i] / (bw * k_eff), afl[i] / (flops * a_eff))

        t_gpu = (sum(read[:resident]) / (main_bw * e_main) + resident * fixed_layer
                 + sum(attn(i, main_bw, k_main, main_flops, attn_eff) for i in range(resident)))
        t_link = t_cpu = 0.0
        if p.offload == "stream":
            # prefetch overlaps the copy of layer i+1 with the compute of layer i: a max, not a sum;
            # the whole layer (every expert) crosses the link
            t_link = sum(max(costs.weights[i] / link,
                             read[i] / (main_bw * e_main) + attn(i, main_bw, k_main, main_flops, attn_eff) + fixed_layer)
                         for i in range(resident, L))
        elif p.offload == "cpu":
            t_cpu = (sum(read[resident:]) / (ram * e_cpu) + (L - resident) * (0.0 if ideal else eff_cpu.per_layer_s)
                     + sum(attn(i, ram, k_cpu, hw.host.cpu_bf16_flops, attn_eff_cpu) for i in range(resident, L)))
        head = costs.head_bytes / (main_bw * e_main)
        fixed = 0.0 if ideal else eff.per_token_s
        if on_gpu and p.offload == "cpu" and n < L and not ideal:
            # hidden states cross the link twice per forward (tiny), each with a synchronisation
            fixed += CPU_MODE_LINK_CROSSINGS * CPU_MODE_SYNC_LAUNCHES * hw.overheads.kernel_launch_s
        total = t_gpu + t_link + t_cpu + head + fixed
        return total, {"resident_s": t_gpu, "offloaded_s": t_link + t_cpu, "lm_head_s": head, "fixed_s": fixed}

    start_ctx = min(req.prompt, req.context)
    t_start, terms = decode_time(start_ctx, ideal=False)
    t_full, _ = decode_time(req.context, ideal=False)
    t_ceiling, _ = decode_time(start_ctx, ideal=True)

    # Prefill: compute-bound, in chunks; each chunk also reads (or streams) every weight once.
    prompt = req.prompt
    flops = prefill_flops(spec, prompt, B)
    peak = (hw.gpu.bf16_flops if on_gpu else hw.host.cpu_bf16_flops) * eff.compute
    chunks = -(-prompt // req.prefill_chunk)
    if on_gpu and p.offload == "cpu" and n < L:
        frac_cpu = (L - n) / L
        t_compute = flops * (1 - frac_cpu) / peak + flops * frac_cpu / (hw.host.cpu_bf16_flops * eff_cpu.compute)
    else:
        t_compute = flops / peak
    weight_pass = (sum(read[:n]) if on_gpu else sum(read)) / (main_bw * eff.bandwidth)
    stream_pass = (sum(costs.weights[n:]) / link) if (on_gpu and p.offload == "stream" and n < L) else 0.0
    per_chunk_fixed = L * eff.per_layer_s + eff.per_token_s
    t_prefill = max(t_compute, chunks * (weight_pass + stream_pass)) + chunks * per_chunk_fixed
    return SpeedEstimate(
        decode_tokens_per_s=B / t_start,
        decode_tokens_per_s_full_context=B / t_full,
        ttft_s=t_prefill,
        prefill_tokens_per_s=prompt * B / t_prefill,
        ceiling_decode_tokens_per_s=B / t_ceiling,
        terms={**terms, "efficiency_source": eff.source, "kv_efficiency": kv_eff, "attention_compute_efficiency": attn_eff, "kv_efficiency_source": kv_eff_source, "bandwidth_efficiency": eff.bandwidth,
               "compute_efficiency": eff.compute, "per_layer_s": eff.per_layer_s, "per_token_s": eff.per_token_s,
               "link_efficiency": DEFAULT_LINK_EFFICIENCY if p.offload == "stream" else None},
    )
