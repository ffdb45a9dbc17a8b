"""The speed model: time per token from bytes and FLOPs over what the hardware moves and computes.

Decode, per layer on the device that runs it:
    weights read / (bandwidth x eff_bw)
  + max(KV read / (bandwidth x eff_kv), attention FLOPs / (compute x eff_attn))   the attention kernel
  + KV update traffic / (bandwidth x eff_kv_update)                                quantized caches only
  + a fixed per-layer cost.
Offloaded layers add the host-link copy (stream mode, overlapped with compute by prefetch: a
max, not a sum) or run on the CPU (cpu mode). Decode reads the whole KV cache, so tokens/s
falls as the context fills. Prefill is compute-bound and chunked. The ceiling is a pure
bandwidth roofline: the bytes a step must read (weights and the cache as stored) over the
bandwidth, every efficiency 1, no fixed cost.

Efficiencies and fixed costs are per device x backend x quant: calibrated values from
the hardware profile when it has them, else the documented defaults below. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import HardwareProfile
from .choice import Choice, OffloadMode
from .memory import LayerCosts
from .modelspec import ModelSpec, Role, dtype_bytes
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
# (compute x attn_compute_eff)). The kernel reads the cache in the compute dtype: a quantized cache
# is dequantized first (see KV update traffic below). On a GPU reading the cache dominates;
# transformers' DynamicCache appends with torch.cat (a read and a write of the layer's cache per
# token) before the kernel reads it again, so by default the KV path runs at a third of the weights'
# bandwidth efficiency. On a CPU the single-query attention kernel is compute-bound (measured: time
# per cached token follows heads x head_dim x layers, not KV bytes). Calibration fits both per
# device x attention implementation (entries with backend "attn-sdpa" / "attn-eager");
# uncalibrated, the compute side defaults to the weights' compute efficiency.
KV_PASSES_DEFAULT = 3.0
# KV update traffic: what a quantized cache moves per cached element per decode step beyond the
# bf16 DynamicCache's torch.cat, is quant.KVScheme.update_extra_bytes_per_element (derived there from
# transformers' cache code). It runs at the calibrated "kv-update" efficiency of that KV dtype
# (backend "kv-update", quant = the KV dtype), else at the weights' bandwidth efficiency.
KV_UPDATE_BACKEND = "kv-update"


def decode_attention_flops_per_layer(spec: ModelSpec, context: int, batch: int) -> list[float]:
    """FLOPs of one query token's attention per layer: QK^T and AV over the cached tokens (GQA saves none)."""
    per = {a: 4.0 * a.num_heads * a.head_dim * a.cached_tokens(context) * batch for a, _ in spec.attention_groups}
    return [per[a] for a in spec.attention]


def cached_elements_per_layer(spec: ModelSpec, context: int, batch: int) -> list[int]:
    """Elements (K and V) each layer's cache holds at `context` tokens x `batch` sequences (windows capped)."""
    per = {a: a.cached_tokens(context) * a.kv_elements_per_token * batch for a, _ in spec.attention_groups}
    return [per[a] for a in spec.attention]


# cpu offload mode: hidden states cross the host link twice per forward (to the CPU layers and back);
# each crossing synchronises the GPU stream, costed as this many kernel launches (a default estimate).
CPU_MODE_LINK_CROSSINGS = 2
CPU_MODE_SYNC_LAUNCHES = 10

# Streamed layers: what fraction of the measured pinned host->device bandwidth the copy engine
# sustains for a layer's tensors (many medium-sized copies).
DEFAULT_LINK_EFFICIENCY = 0.85


def efficiency(hw: HardwareProfile, device: str, scheme: WeightScheme) -> Efficiency:
    """The weights' efficiencies and fixed costs on `device` ("gpu" or "cpu"): calibrated, else the defaults
    (field by field: a calibration that did not measure prefill keeps the default compute efficiency)."""
    bw, comp, per_layer, per_token = _DEFAULTS[(device, scheme.name)]
    e = hw.calibration.lookup(device, scheme.backend, scheme.name) if hw.calibration is not None else None
    if e is None or e.bandwidth_efficiency is None:
        return Efficiency(bandwidth=bw, compute=comp, per_layer_s=per_layer, per_token_s=per_token, source="default")
    return Efficiency(bandwidth=e.bandwidth_efficiency,
                      compute=e.compute_efficiency if e.compute_efficiency is not None else comp,
                      per_layer_s=e.per_layer_overhead_s, per_token_s=e.per_token_overhead_s,
                      source=f"calibrated {hw.calibration.measured_at}")


@dataclass(frozen=True, kw_only=True)
class KVEfficiency:
    read: float  # the attention kernel reading the cache, achieved / peak bandwidth
    attention_compute: float  # the attention kernel's FLOPs, achieved / peak compute
    update: float  # a quantized cache's extra update traffic, achieved / peak bandwidth
    source: str


def kv_efficiency(hw: HardwareProfile, device: str, spec: ModelSpec, kv: KVScheme, weights: Efficiency) -> KVEfficiency:
    """The attention kernel's efficiencies (per device x attention implementation) and the KV dtype's update one."""
    read, compute = weights.bandwidth / KV_PASSES_DEFAULT, weights.compute
    source = f"default (KV reads at the weights' efficiency / {KV_PASSES_DEFAULT:g})"
    cal = hw.calibration
    if cal is not None:
        for impl in (spec.attention_impl, "sdpa"):  # an uncalibrated kernel borrows the calibrated SDPA figure
            e = cal.lookup(device, f"attn-{impl}", "bf16")
            if e is not None:
                read = e.bandwidth_efficiency if e.bandwidth_efficiency is not None else read
                compute = e.compute_efficiency if e.compute_efficiency is not None else compute
                source = f"calibrated {cal.measured_at} (attn-{impl})"
                break
    update = weights.bandwidth
    e = cal.lookup(device, KV_UPDATE_BACKEND, kv.name) if cal is not None else None
    if e is not None and e.bandwidth_efficiency is not None:
        update = e.bandwidth_efficiency
        source += f"; {kv.name} cache update calibrated {cal.measured_at}"
    return KVEfficiency(read=read, attention_compute=compute, update=update, source=source)


def _active_fraction(spec: ModelSpec, batch: int) -> float:
    """Fraction of routed-expert bytes a decode step reads: distinct experts hit by `batch` tokens."""
    if spec.moe is None:
        return 1.0
    e, k = spec.moe.num_experts, spec.moe.experts_per_token
    return 1.0 - (1.0 - k / e) ** batch


def read_bytes_per_layer(spec: ModelSpec, scheme: WeightScheme, batch: int) -> list[float]:
    """Weight bytes one decode step reads per layer (MoE: only the experts the batch routes to)."""
    frac = _active_fraction(spec, batch)

    def read(tensors) -> float:
        return sum(scheme.tensor_bytes(t, scheme.compute_dtype) * (frac if t.role is Role.EXPERT else 1.0)
                   for t in tensors)

    return spec.per_layer(read)


def _matmul_flop_per_token(spec: ModelSpec) -> float:
    """Matmul FLOPs per token outside attention: 2 x active weights (embedding lookups are free)."""
    emb = sum(t.numel for t in spec.non_layer_tensors() if t.role is Role.EMBEDDING and not spec.tie_word_embeddings)
    return 2.0 * (spec.params_active - emb)


def _prefill_attention_flop(spec: ModelSpec, prompt: int) -> float:
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


def prefill_flop(spec: ModelSpec, prompt: int, batch: int = 1) -> float:
    """FLOPs of a prefill of `prompt` tokens x `batch` sequences."""
    return (_matmul_flop_per_token(spec) * prompt + _prefill_attention_flop(spec, prompt)) * batch


@dataclass(frozen=True, kw_only=True)
class DecodeWork:
    """What one decode step at one context moves and computes, per layer."""

    weights_bytes: list[float]  # read per layer (MoE: the routed experts only)
    kv_read_bytes: list[float]  # the attention kernel's read of the cache, in the compute dtype
    kv_stored_bytes: list[float]  # the cache as stored (what a bandwidth roofline must read)
    kv_update_bytes: list[float]  # a quantized cache's extra update traffic
    attention_flop: list[float]
    head_bytes: float  # lm_head (or the tied embedding) and the final norm


def decode_work(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, batch: int, context: int,
                costs: LayerCosts, read: list[float] | None = None) -> DecodeWork:
    elements = cached_elements_per_layer(spec, context, batch)
    compute_bytes = dtype_bytes(scheme.compute_dtype)
    stored = kv_bytes_per_layer(spec, kv, context, batch)
    return DecodeWork(
        weights_bytes=read if read is not None else read_bytes_per_layer(spec, scheme, batch),
        kv_read_bytes=[e * compute_bytes for e in elements] if kv.dequantizes_whole_layer else [float(b) for b in stored],
        kv_stored_bytes=[float(b) for b in stored],
        kv_update_bytes=[e * kv.update_extra_bytes_per_element for e in elements],
        attention_flop=decode_attention_flops_per_layer(spec, context, batch),
        head_bytes=float(costs.head_bytes),
    )


@dataclass(frozen=True, kw_only=True)
class DeviceRates:
    """One device as the speed model sees it: peaks and the efficiencies that apply there."""

    bandwidth_bytes_per_s: float
    flop_per_s: float
    weights: Efficiency
    kv: KVEfficiency

    def layer_decode_s(self, w: DecodeWork, i: int) -> float:
        bw = self.bandwidth_bytes_per_s
        attention = max(w.kv_read_bytes[i] / (bw * self.kv.read),
                        w.attention_flop[i] / (self.flop_per_s * self.kv.attention_compute))
        return (w.weights_bytes[i] / (bw * self.weights.bandwidth) + attention
                + w.kv_update_bytes[i] / (bw * self.kv.update) + self.weights.per_layer_s)


def _rates(hw: HardwareProfile, device: str, spec: ModelSpec, scheme: WeightScheme, kv: KVScheme) -> DeviceRates:
    eff = efficiency(hw, device, scheme)
    gpu = device == "gpu"
    return DeviceRates(bandwidth_bytes_per_s=hw.gpu.memory_bandwidth_bytes_per_s if gpu else hw.host.ram_bandwidth_bytes_per_s,
                       flop_per_s=hw.gpu.bf16_flops if gpu else hw.host.cpu_bf16_flops,
                       weights=eff, kv=kv_efficiency(hw, device, spec, kv, eff))


@dataclass(frozen=True, kw_only=True)
class SpeedEstimate:
    decode_tokens_per_s: float  # at the start of generation (context = the prompt)
    decode_tokens_per_s_full_context: float  # when the cache holds the whole context
    ttft_s: float
    prefill_tokens_per_s: float
    ceiling_decode_tokens_per_s: float  # pure bandwidth roofline at the start
    terms: dict  # seconds per token by where they are spent, and the efficiencies used

    @classmethod
    def from_dict(cls, predicted: dict, ceiling: dict, terms: dict) -> "SpeedEstimate":
        return cls(decode_tokens_per_s=float(predicted["decode_tokens_per_s"]),
                   decode_tokens_per_s_full_context=float(predicted["decode_tokens_per_s_full_context"]),
                   ttft_s=float(predicted["ttft_s"]), prefill_tokens_per_s=float(predicted["prefill_tokens_per_s"]),
                   ceiling_decode_tokens_per_s=float(ceiling["decode_tokens_per_s"]), terms=dict(terms or {}))


class _Model:
    """One scheme x KV dtype x placement on one machine: decode and prefill times."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
                 c: Choice, costs: LayerCosts, read: list[float]):
        self.spec, self.hw, self.req, self.scheme, self.kv, self.c, self.costs, self.read = (
            spec, hw, req, scheme, kv, c, costs, read)
        self.main = _rates(hw, "gpu" if c.on_gpu else "cpu", spec, scheme, kv)
        self.cpu = _rates(hw, "cpu", spec, scheme, kv) if c.offload is OffloadMode.CPU else None
        self.link_bytes_per_s = (hw.link.h2d_pinned_bytes_per_s * DEFAULT_LINK_EFFICIENCY) if hw.link else None
        L = spec.num_layers
        self.resident = range(c.gpu_layers if c.offload is not OffloadMode.NONE else L)
        self.offloaded = range(len(self.resident), L)

    def decode_s(self, context: int) -> tuple[float, dict]:
        w = decode_work(self.spec, self.scheme, self.kv, self.req.batch, context, self.costs, self.read)
        main, c = self.main, self.c
        resident_s = sum(main.layer_decode_s(w, i) for i in self.resident)
        offloaded_s = 0.0
        if c.offload is OffloadMode.STREAM:
            # prefetch overlaps the copy of layer i+1 with the compute of layer i: a max, not a sum;
            # the whole layer (every expert) crosses the link
            offloaded_s = sum(max(self.costs.weights[i] / self.link_bytes_per_s, main.layer_decode_s(w, i))
                              for i in self.offloaded)
        elif c.offload is OffloadMode.CPU:
            offloaded_s = sum(self.cpu.layer_decode_s(w, i) for i in self.offloaded)
        head_s = w.head_bytes / (main.bandwidth_bytes_per_s * main.weights.bandwidth)
        fixed_s = main.weights.per_token_s
        if c.offload is OffloadMode.CPU:
            # hidden states cross the link twice per forward (tiny), each with a synchronisation
            fixed_s += CPU_MODE_LINK_CROSSINGS * CPU_MODE_SYNC_LAUNCHES * self.hw.overheads.kernel_launch_s
        terms = {"resident_s": resident_s, "offloaded_s": offloaded_s, "lm_head_s": head_s, "fixed_s": fixed_s,
                 "kv_update_s": sum(w.kv_update_bytes[i] / (self._rates_of(i).bandwidth_bytes_per_s
                                                            * self._rates_of(i).kv.update)
                                    for i in range(self.spec.num_layers))}
        return resident_s + offloaded_s + head_s + fixed_s, terms

    def _rates_of(self, layer: int) -> DeviceRates:
        return self.cpu if (self.cpu is not None and layer in self.offloaded) else self.main

    def ceiling_s(self, context: int) -> float:
        """The bytes a step must read over the bandwidth where they live; streamed layers over the link."""
        w = decode_work(self.spec, self.scheme, self.kv, self.req.batch, context, self.costs, self.read)
        t = w.head_bytes / self.main.bandwidth_bytes_per_s
        for i in range(self.spec.num_layers):
            rates = self._rates_of(i)
            t_layer = (w.weights_bytes[i] + w.kv_stored_bytes[i]) / rates.bandwidth_bytes_per_s
            if self.c.offload is OffloadMode.STREAM and i in self.offloaded:
                t_layer = max(t_layer, self.costs.weights[i] / self.link_bytes_per_s)
            t += t_layer
        return t

    def prefill_s(self) -> float:
        """Compute-bound, in chunks; each chunk also reads (or streams) every resident weight once."""
        c, main, req = self.c, self.main, self.req
        prompt = req.prompt
        flop = prefill_flop(self.spec, prompt, req.batch)
        chunks = -(-prompt // req.prefill_chunk)
        L = self.spec.num_layers
        if self.cpu is not None:
            on_cpu = len(self.offloaded) / L
            compute_s = (flop * (1 - on_cpu) / (main.flop_per_s * main.weights.compute)
                         + flop * on_cpu / (self.cpu.flop_per_s * self.cpu.weights.compute))
        else:
            compute_s = flop / (main.flop_per_s * main.weights.compute)
        weight_pass_s = (sum(self.read[i] for i in self.resident)
                         / (main.bandwidth_bytes_per_s * main.weights.bandwidth))
        stream_pass_s = (sum(self.costs.weights[i] for i in self.offloaded) / self.link_bytes_per_s
                         if c.offload is OffloadMode.STREAM else 0.0)
        per_chunk_fixed_s = L * main.weights.per_layer_s + main.weights.per_token_s
        return max(compute_s, chunks * (weight_pass_s + stream_pass_s)) + chunks * per_chunk_fixed_s


def estimate(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
             c: Choice, costs: LayerCosts, read: list[float] | None = None) -> SpeedEstimate:
    """Decode tokens/s at the start and at the full context, TTFT and the ceiling of one placement."""
    m = _Model(spec, hw, req, scheme, kv, c, costs, read if read is not None else read_bytes_per_layer(spec, scheme, req.batch))
    start = min(req.prompt, req.context)
    t_start, terms = m.decode_s(start)
    t_full, _ = m.decode_s(req.context)
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
               "kv_efficiency_source": main.kv.source, "bandwidth_efficiency": main.weights.bandwidth,
               "compute_efficiency": main.weights.compute, "per_layer_s": main.weights.per_layer_s,
               "per_token_s": main.weights.per_token_s,
               "link_efficiency": DEFAULT_LINK_EFFICIENCY if c.offload is OffloadMode.STREAM else None},
    )
