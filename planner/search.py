"""The search: every weight scheme x KV dtype, the most layers that fit, the better offload mode.

`plan(spec, hw, req) -> Plan` is a pure function over plain data. For each candidate it
finds the most decoder layers that fit the GPU at the target context and batch, whether
the whole model fits, the largest context that fits entirely on the GPU, and (when
layers are offloaded) whether streaming their weights or computing them on the CPU is
faster; then it picks one candidate by the request's preference and says why.
"""

from __future__ import annotations

from dataclasses import replace

from .errors import PlanError
from .hardware import HardwareProfile
from .memory import (FitTotals, LayerCosts, Placement, gpu_capacity, layer_costs, memory_breakdown, place,
                     ram_capacity, workspace_bytes)
from .modelspec import ModelSpec
from .plan import Candidate, Plan, hardware_ref, model_ref
from .quant import KV_SCHEMES, SCHEMES, KVScheme, WeightScheme, kv_bytes
from .request import RUNTIME_BASE_RAM_BYTES, Request
from .speed import _read_bytes_per_layer, estimate
from .units import format_bytes

_GIB = 1024**3


def _g(n: float) -> str:
    return f"{n / _GIB:.2f} GiB"


def _device_ok(scheme: WeightScheme, hw: HardwareProfile) -> str | None:
    device = "cuda" if hw.has_gpu and not hw.unified_memory else ("mps" if hw.unified_memory else "cpu")
    if device not in scheme.devices:
        return f"{scheme.name} does not run on {device}"
    return None


def _evaluate(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
              read: list[float] | None = None, quick: bool = False) -> Candidate:
    """One scheme x KV dtype: the best placement that fits (quick: only whether one fits).
    `read` (weight bytes a decode step reads per layer) is shared across KV dtypes; computed when absent."""
    base = dict(weight_quant=scheme.name, kv_dtype=kv.name, total_layers=spec.num_layers,
                quality_cost_pct=scheme.quality.ppl_increase_pct + kv.quality.ppl_increase_pct)
    why_not = _device_ok(scheme, hw)
    if why_not is None and kv.full_attention_only and spec.sliding_window_layers:
        why_not = f"KV dtype {kv.name}: transformers' QuantizedCache refuses models with sliding-window layers"
    if why_not:
        return Candidate(**base, runnable=False, reason=why_not)
    costs = layer_costs(spec, scheme, kv, req)
    ws = workspace_bytes(spec, scheme, kv, req)
    has_gpu = hw.has_gpu
    L = spec.num_layers
    fit = FitTotals(spec, hw, req, costs, sum(ws.values()))
    gpu_cap = gpu_capacity(hw, req)

    def ram_cap(n: int, mode: str) -> int:
        return ram_capacity(hw, req, fit.gpu_total(n, mode) if has_gpu else 0)

    def over(n: int, mode: str) -> str | None:
        if has_gpu and fit.gpu_total(n, mode) > gpu_cap:
            return "gpu"
        if fit.cpu_total(n, mode) > ram_cap(n, mode):
            return "cpu"
        return None

    fitting: list[tuple[int, str]] = []
    failure: tuple[int, str] | None = None
    if not has_gpu:
        if over(0, "none") is None:
            fitting.append((0, "none"))
        else:
            failure = (0, "none")
    else:
        modes = [req.offload] if req.offload else ["stream", "cpu"]
        if req.gpu_layers is not None:
            n = min(req.gpu_layers, L)
            for mode in modes:
                if over(n, mode) is None:
                    fitting.append((n, mode))
                elif failure is None:
                    failure = (n, mode)
        elif over(L, "none") is None:
            fitting.append((L, "none"))
        else:
            failure = (L, "none")
            for mode in modes:
                for n in range(L - 1, -1, -1):
                    o = over(n, mode)
                    if o == "gpu":
                        continue
                    if o is None:
                        fitting.append((n, mode))
                    else:
                        failure = (n, mode)  # the GPU has room; RAM ran out
                    break  # fewer GPU layers only put more in RAM
    if quick:
        return Candidate(**base, runnable=bool(fitting))
    if read is None:
        read = _read_bytes_per_layer(spec, scheme, req.batch)
    weights_total = fit.pw[L] + costs.embed_bytes + costs.head_bytes
    max_ctx = (_max_context_on_gpu if has_gpu else _max_context_on_cpu)(spec, hw, req, scheme, kv, weights_total)
    if not fitting:
        n, mode = failure
        p = place(spec, n, mode, has_gpu)
        mem = memory_breakdown(spec, hw, req, scheme, kv, p, costs, ws)
        where = "gpu" if (mem["gpu"] is not None and mem["gpu"]["free_bytes"] < 0) else "cpu"
        return Candidate(**base, runnable=False, gpu_layers=p.gpu_layers, offload=p.offload,
                         compute_device=p.compute_device,
                         vram_bytes=mem["gpu"]["total_bytes"] if mem["gpu"] else None,
                         ram_bytes=mem["cpu"]["total_bytes"], max_context_on_gpu=max_ctx,
                         reason=_overflow_reason(mem, where, p, spec), memory=mem)
    scored = []
    for n, mode in fitting:
        p = place(spec, n, mode, has_gpu)
        mem = memory_breakdown(spec, hw, req, scheme, kv, p, costs, ws)
        s = estimate(spec, hw, req, scheme, kv, p, costs, read)
        scored.append((s.decode_tokens_per_s, p, mem, s))
    scored.sort(key=lambda x: -x[0])
    _, p, mem, s = scored[0]
    reason = _placement_reason(spec, p, mem, costs, scored)
    return Candidate(**base, runnable=True, fits_on_gpu=(has_gpu and p.offload == "none"), gpu_layers=p.gpu_layers,
                     offload=p.offload, compute_device=p.compute_device, embeddings_on_gpu=p.embeddings_on_gpu,
                     vram_bytes=mem["gpu"]["total_bytes"] if mem["gpu"] else None, ram_bytes=mem["cpu"]["total_bytes"],
                     ceiling_decode_tokens_per_s=s.ceiling_decode_tokens_per_s,
                     predicted_decode_tokens_per_s=s.decode_tokens_per_s,
                     predicted_decode_tokens_per_s_full_context=s.decode_tokens_per_s_full_context,
                     predicted_ttft_s=s.ttft_s, predicted_prefill_tokens_per_s=s.prefill_tokens_per_s,
                     max_context_on_gpu=max_ctx, reason=reason, memory=mem, speed_terms=s.terms)


def _overflow_reason(mem: dict, over: str, p: Placement, spec: ModelSpec) -> str:
    d = mem[over]
    terms = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {_g(v)}" for k, v in d.items()
                      if k.endswith("_bytes") and k not in ("total_bytes", "capacity_bytes", "free_bytes") and v)
    where = "GPU" if over == "gpu" else "RAM"
    layers = (f"with {p.gpu_layers} of {spec.num_layers} layers on the GPU ({p.offload} offload)"
              if p.compute_device == "cuda" else "on the CPU")
    return f"{where} needs {_g(d['total_bytes'])} > capacity {_g(d['capacity_bytes'])} {layers}: {terms}"


def _placement_reason(spec: ModelSpec, p: Placement, mem: dict, costs: LayerCosts, scored) -> str:
    L = spec.num_layers
    if p.compute_device == "cpu":
        return f"all {L} layers on the CPU (no GPU): RAM {_g(mem['cpu']['total_bytes'])} of {_g(mem['cpu']['capacity_bytes'])}"
    g = mem["gpu"]
    if p.offload == "none":
        return f"all {L} layers on the GPU: {_g(g['total_bytes'])} of {_g(g['capacity_bytes'])}"
    parts = (f"weights {_g(g['weights_bytes'])} + KV {_g(g['kv_cache_bytes'])} + workspace {_g(g['workspace_bytes'])}"
             + (f" + stream buffers {_g(g['stream_buffers_bytes'])}" if g["stream_buffers_bytes"] else "")
             + f" + context/allocator/headroom {_g(g['cuda_context_bytes'] + g['allocator_reserve_bytes'] + g['headroom_bytes'])}")
    nxt = costs.weights[p.gpu_layers] + (costs.kv[p.gpu_layers] if p.offload == "cpu" else 0)
    text = (f"layers 0-{p.gpu_layers - 1} on the GPU, {p.gpu_layers}-{L - 1} offloaded ({p.offload}): "
            if p.gpu_layers else f"no layer fits on the GPU; all {L} offloaded ({p.offload}): ")
    text += f"GPU budget {_g(g['capacity_bytes'])} holds {parts}; one more layer needs {_g(nxt)}, {_g(g['free_bytes'])} free"
    if len(scored) > 1:
        other = scored[1]
        text += (f"; {p.offload} mode predicted {scored[0][0]:.2f} tok/s beats {other[1].offload} mode "
                 f"{other[0]:.2f} tok/s ({other[1].gpu_layers} GPU layers)")
    return text


def _fits_whole_gpu(spec, hw, req, scheme, kv, ctx: int, weights_total: int) -> bool:
    r = replace(req, context=ctx, prompt_tokens=None)
    kvb = kv_bytes(spec, kv, ctx, req.batch)
    ws = sum(workspace_bytes(spec, scheme, kv, r).values())
    need = weights_total + kvb + ws + hw.overheads.cuda_context_bytes + hw.overheads.allocator_reserve_bytes + req.headroom_bytes
    return need <= gpu_capacity(hw, req)


def _max_context_on_gpu(spec, hw, req, scheme, kv, weights_total: int) -> int:
    """Largest context (up to the model's maximum) with every layer on the GPU; 0 if none."""
    hi = spec.max_context or req.context
    if _fits_whole_gpu(spec, hw, req, scheme, kv, hi, weights_total):
        return hi
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits_whole_gpu(spec, hw, req, scheme, kv, mid, weights_total):
            lo = mid
        else:
            hi = mid
    return lo


def _max_context_on_cpu(spec, hw, req, scheme, kv, weights_total: int) -> int:
    """CPU-only machines: the largest context that fits in RAM."""
    cap = ram_capacity(hw, req) - req.runtime_base_ram_bytes - weights_total

    def fits(ctx):
        r = replace(req, context=ctx, prompt_tokens=None)
        return kv_bytes(spec, kv, ctx, req.batch) + sum(workspace_bytes(spec, scheme, kv, r).values()) <= cap

    hi = spec.max_context or req.context
    if fits(hi):
        return hi
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _choose(cands: list[Candidate], req: Request) -> tuple[Candidate, list[str]]:
    runnable = [c for c in cands if c.runnable]
    fastest = max(runnable, key=lambda c: c.predicted_decode_tokens_per_s)
    reasons = []
    if req.prefer == "speed":
        choice = fastest
        reasons.append(f"--prefer speed: the fastest predicted decode ({choice.predicted_decode_tokens_per_s:.2f} tok/s)")
    elif req.prefer == "quality":
        choice = min(runnable, key=lambda c: (c.quality_cost_pct, -c.predicted_decode_tokens_per_s))
        reasons.append(f"--prefer quality: the smallest quality cost that runs (~{choice.quality_cost_pct:.1f} % "
                       "perplexity over bf16)")
    else:
        floor = req.balanced_speed_fraction * fastest.predicted_decode_tokens_per_s
        within = [c for c in runnable if c.predicted_decode_tokens_per_s >= floor]
        choice = min(within, key=lambda c: (c.quality_cost_pct, -c.predicted_decode_tokens_per_s))
        reasons.append(
            f"--prefer balanced: the best quality whose predicted decode speed is within reach of the fastest option, "
            f"i.e. at least {req.balanced_speed_fraction:.0%} of {fastest.predicted_decode_tokens_per_s:.2f} tok/s "
            f"({fastest.weight_quant} + {fastest.kv_dtype} KV); {len(within)} of {len(runnable)} options qualify")
    reasons.append(f"{choice.weight_quant} weights + {choice.kv_dtype} KV cache: {choice.reason}")
    return choice, reasons


def _alternatives(spec, hw, req) -> list[dict]:
    """When nothing fits: the longest context each scheme could hold (smallest KV dtype), best first."""
    out = []
    for scheme in SCHEMES.values():
        if _device_ok(scheme, hw):
            continue
        for kv_name in ("bf16", "quanto-int4"):
            kv = KV_SCHEMES[kv_name]
            if kv.full_attention_only and spec.sliding_window_layers:
                continue
            def runs(ctx: int) -> bool:
                return _evaluate(spec, hw, replace(req, context=ctx, prompt_tokens=None), scheme, kv,
                                 quick=True).runnable

            if not runs(1):
                continue
            lo, hi = 1, req.context
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if runs(mid) else (lo, mid)
            out.append({"weight_quant": scheme.name, "kv_dtype": kv_name, "max_context_tokens": lo})
    out.sort(key=lambda a: -a["max_context_tokens"])
    return out


def _constants(hw: HardwareProfile, req: Request) -> dict:
    """Every constant the plan used, with its value and where it comes from."""
    from . import memory as m, speed as sp

    o = hw.overheads
    out = {
        "gpu_capacity_bytes": {"value": gpu_capacity(hw, req), "from": "request --vram-budget" if req.vram_budget_bytes is not None else f"profile {hw.name}: gpus[0].memory"},
        "ram_capacity_bytes": {"value": ram_capacity(hw, req), "from": "request --ram-budget" if req.ram_budget_bytes is not None else f"profile {hw.name}: host.ram"},
        "cuda_context_bytes": {"value": o.cuda_context_bytes, "from": f"profile {hw.name}: overheads.cuda_context"},
        "allocator_reserve_bytes": {"value": o.allocator_reserve_bytes, "from": f"profile {hw.name}: overheads.allocator_reserve"},
        "kernel_launch_s": {"value": o.kernel_launch_s, "from": f"profile {hw.name}: overheads.kernel_launch"},
        "headroom_bytes": {"value": req.headroom_bytes, "from": "request --headroom"},
        "prefill_chunk_tokens": {"value": req.prefill_chunk, "from": "request --prefill-chunk"},
        "runtime_base_ram_bytes": {"value": req.runtime_base_ram_bytes, "from": (
            f"profile {hw.name}: calibration.runtime_ram" if hw.calibration is not None
            and hw.calibration.runtime_ram_bytes == req.runtime_base_ram_bytes else "planner.request.RUNTIME_BASE_RAM_BYTES")},
        "balanced_speed_fraction": {"value": req.balanced_speed_fraction, "from": "planner.request.BALANCED_SPEED_FRACTION"},
        "activation_hidden_copies": {"value": m.ACTIVATION_HIDDEN_COPIES, "from": "planner.memory"},
        "activation_mlp_copies": {"value": m.ACTIVATION_MLP_COPIES, "from": "planner.memory"},
        "logits_bytes_per_element": {"value": m.LOGITS_BYTES_PER_ELEMENT, "from": "planner.memory"},
        "link_efficiency": {"value": sp.DEFAULT_LINK_EFFICIENCY, "from": "planner.speed.DEFAULT_LINK_EFFICIENCY"},
        "ram_bandwidth_bytes_per_s": {"value": hw.host.ram_bandwidth_bytes_per_s, "from": f"profile {hw.name}: host.ram_bandwidth"},
        "cpu_bf16_flops": {"value": hw.host.cpu_bf16_flops, "from": f"profile {hw.name}: host.cpu_bf16_compute"},
    }
    if hw.gpu is not None:
        out["gpu_memory_bandwidth_bytes_per_s"] = {"value": hw.gpu.memory_bandwidth_bytes_per_s, "from": f"profile {hw.name}: gpus[0].memory_bandwidth"}
        out["gpu_bf16_flops"] = {"value": hw.gpu.bf16_flops, "from": f"profile {hw.name}: gpus[0].bf16_compute"}
    if hw.link is not None:
        out["link_h2d_pinned_bytes_per_s"] = {"value": hw.link.h2d_pinned_bytes_per_s, "from": f"profile {hw.name}: link.h2d_pinned"}
    return out


def plan(spec: ModelSpec, hw: HardwareProfile, req: Request) -> Plan:
    """Decide how to run `spec` on `hw` for `req`; pure and fast (< 100 ms for a 405B model)."""
    if req.gpu_layers is not None and not hw.has_gpu and req.gpu_layers > 0:
        raise PlanError(f"--gpu-layers {req.gpu_layers}: hardware {hw.name!r} has no GPU")
    if req.offload is not None and not hw.has_gpu:
        raise PlanError(f"--offload {req.offload}: hardware {hw.name!r} has no GPU to offload from")
    if req.vram_budget_bytes is not None and not hw.has_gpu:
        raise PlanError(f"--vram-budget: hardware {hw.name!r} has no GPU")
    if req.vram_budget_bytes is not None and hw.gpu is not None and req.vram_budget_bytes > hw.gpu.memory_bytes:
        raise PlanError(f"--vram-budget {format_bytes(req.vram_budget_bytes)} exceeds the GPU's "
                        f"{format_bytes(hw.gpu.memory_bytes)}")
    cal = hw.calibration
    if cal is not None and cal.runtime_ram_bytes is not None and req.runtime_base_ram_bytes == RUNTIME_BASE_RAM_BYTES:
        req = replace(req, runtime_base_ram_bytes=cal.runtime_ram_bytes)  # measured beats the default
    schemes = [SCHEMES[q] for q in req.quant] if req.quant else list(SCHEMES.values())
    kvs = [KV_SCHEMES[k] for k in req.kv_dtype] if req.kv_dtype else list(KV_SCHEMES.values())
    warnings: list[str] = []
    if req.context > spec.max_context > 0:
        warnings.append(f"context {req.context} exceeds the model's max_position_embeddings {spec.max_context}")
    if hw.gpu is not None and hw.gpu.count > 1:
        warnings.append(f"{hw.gpu.count} GPUs in the profile: plans use one GPU (multi-GPU split is not implemented)")
    reads: dict[str, list[float]] = {}
    cands = []
    for s in schemes:
        read = reads.setdefault(s.name, _read_bytes_per_layer(spec, s, req.batch))
        for k in kvs:
            cands.append(_evaluate(spec, hw, req, s, k, read))
    runnable = [c for c in cands if c.runnable]
    if not runnable:
        forced = req.gpu_layers is not None or req.quant or req.kv_dtype or req.offload
        alts = [] if forced else _alternatives(spec, hw, req)
        first = cands[0]  # the best-quality option asked for
        reasons = [f"nothing fits: {first.weight_quant} + {first.kv_dtype} KV: {first.reason}"]
        sized = [c for c in cands if c.ram_bytes is not None]  # those that got as far as a memory breakdown
        smallest = min(sized, key=lambda c: (c.vram_bytes or 0) + c.ram_bytes, default=None)
        if smallest is not None and smallest is not first:
            reasons.append(f"smallest option, {smallest.weight_quant} + {smallest.kv_dtype} KV: {smallest.reason}")
        if alts:
            a = alts[0]
            reasons.append(f"what would fit instead: {a['weight_quant']} weights + {a['kv_dtype']} KV up to "
                           f"{a['max_context_tokens']} tokens of context")
        return Plan(model=model_ref(spec), hardware=hardware_ref(hw), request=req, fits=False, choice=None,
                    reasons=reasons, candidates=cands, warnings=warnings, alternatives=alts,
                    constants=_constants(hw, req))
    choice, reasons = _choose(cands, req)
    if choice.offload != "none":
        warnings.append(f"{choice.total_layers - choice.gpu_layers} of {choice.total_layers} layers are offloaded "
                        f"({choice.offload}): decode is limited by the "
                        f"{'host link' if choice.offload == 'stream' else 'CPU'}")
    if spec.moe is not None and SCHEMES[choice.weight_quant].quantized:
        warnings.append("transformers 5 stores MoE experts as fused 3D tensors that bitsandbytes and quanto do not "
                        "quantize: the experts stay in bf16 and are counted so")
    if choice.weight_quant.startswith("bnb") and choice.compute_device == "cpu":
        warnings.append("bitsandbytes runs on the CPU only slowly; quanto schemes are the CPU-capable backend")
    return Plan(model=model_ref(spec), hardware=hardware_ref(hw), request=req, fits=True, choice=choice,
                reasons=reasons, candidates=cands, warnings=warnings, alternatives=[], constants=_constants(hw, req))
