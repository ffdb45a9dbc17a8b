"""The search: every weight scheme x KV dtype, the most layers that fit, the better offload mode.

`plan(spec, hw, req) -> Plan` is a pure function over plain data. For each candidate it
finds the most decoder layers that fit the GPU at the target context and batch, whether
the whole model fits, the largest context that fits with every layer resident, and (when
layers are offloaded) whether streaming their weights or computing them on the CPU is
faster; then it picks one candidate by the request's preference and says why. Every
verdict comes from `memory.Footprint`, the same formula whose breakdown the plan prints.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from .choice import Choice, ComputeDevice, OffloadMode, experts_in_ram_text
from .errors import PlanError
from .hardware import HardwareProfile
from .memory import (Footprint, LayerCosts, MemoryBreakdown, Placement, WeightCosts, embeddings_on_gpu, gpu_capacity,
                     layer_costs, ram_capacity, weight_costs, workspace_bytes)
from .modelspec import ModelSpec, context_limit
from .constant import Constant, constants
from .engine import Outcome, nothing_fits_reasons, plan_with
from .plan import Alternative, Candidate, Plan
from .preference import choose_by_preference  # noqa: F401 - the --prefer rule, one for every engine
from .published_scheme import (PUBLISHED_BACKEND, gguf_note, loaders_note, scheme_named, speed_stand_in,
                               weight_schemes)
from .quant import CPU_KERNEL_BACKEND, KV_SCHEMES, SCHEMES, TORCH_WO_BACKEND, KVScheme, WeightScheme
from .request import COMPILE_SCHEMES, RUNTIME_BASE_RAM_BYTES, Request, compile_schemes, derived
from .lean import LEAN_SCHEMES, decodes_lean, lean_refusal
from .speed import SpeedEstimate, compiled_scheme, estimate, speed_constants
from .work import read_bytes_per_layer
from .units import format_bytes

# When nothing fits, alternatives are searched with these KV dtypes: full precision and the smallest
# cache that keeps most quality.
ALTERNATIVE_KV_DTYPES = ("bf16", "quanto-int4")


def device_refusal(scheme: WeightScheme, hw: HardwareProfile) -> str | None:
    device = hw.accelerator or "cpu"
    if device not in scheme.devices:
        return f"{scheme.name} does not run on {device}"
    if scheme.backend == CPU_KERNEL_BACKEND and hw.host.cpu_decode_int4_a8_bytes_per_s is None:
        return (f"{scheme.name} runs vramplan's AVX2 kernel, built with the machine's C compiler, and profile "
                f"{hw.name} has no probe record of it (host.cpu_decode_int4_a8: `vramplan probe` times it where it "
                "builds)")
    need = scheme.min_capability
    if need is not None and device == "cuda" and (have := hw.devices[0].capability) is not None and have < need:
        return (f"{scheme.name} needs compute capability {need[0]}.{need[1]} or newer (its kernel's); "
                f"{hw.devices[0].name} has {have[0]}.{have[1]}")
    return None


def kv_refusal(spec: ModelSpec, kv: KVScheme) -> str | None:
    if kv.full_attention_only and spec.sliding_window_layers:
        return f"KV dtype {kv.name}: transformers' QuantizedCache refuses models with sliding-window layers"
    return None


def offload_modes(hw: HardwareProfile, scheme: WeightScheme) -> tuple[OffloadMode, ...]:
    """What offloaded layers can do here: stream over the host link (none on unified memory, and only for a
    scheme whose packed bytes are the device's layout), or run on the CPU."""
    stream = hw.link is not None and hw.accelerator in scheme.streams_on
    return (OffloadMode.STREAM, OffloadMode.CPU) if stream else (OffloadMode.CPU,)


def choice_of(spec: ModelSpec, scheme: WeightScheme, kv: KVScheme, hw: HardwareProfile, p: Placement) -> Choice:
    """The Choice a placement makes, with the scheme names."""
    L = spec.num_layers
    moe = sorted(spec.moe.moe_layers) if spec.moe is not None else []
    if not hw.has_gpu:
        return Choice(weight_quant=scheme.name, kv_dtype=kv.name, gpu_layers=0, total_layers=L,
                      offload=OffloadMode.NONE, compute_device=ComputeDevice.CPU, embeddings_on_gpu=False,
                      moe_layers=len(moe))
    n = p.n
    return Choice(weight_quant=scheme.name, kv_dtype=kv.name, gpu_layers=n, total_layers=L,
                  offload=OffloadMode.NONE if n == L else p.mode, compute_device=ComputeDevice(hw.accelerator),
                  embeddings_on_gpu=embeddings_on_gpu(n, L, spec.tie_word_embeddings), gpu_layers_per_device=p.split,
                  moe_layers=len(moe), expert_layers_on_cpu=p.expert_layers_on_cpu,
                  expert_layers_in_ram=tuple(moe[:p.expert_layers_on_cpu]))


def check_experts(spec: ModelSpec, req: Request) -> None:
    """Refuse an expert placement the model cannot take: a dense model, or more MoE layers than it has."""
    f = req.expert_placement
    if f is None:
        return
    moe = len(spec.moe.moe_layers) if spec.moe is not None else 0
    if not moe:
        raise PlanError(f"request.expert_placement {f}: {spec.name} is a dense model (no routed experts to place)")
    if isinstance(f, int) and f > moe:
        raise PlanError(f"request.expert_placement {f}: {spec.name} has {moe} MoE layers")


def footprint(spec, hw, req, scheme, kv, weights: WeightCosts) -> Footprint:
    return Footprint(spec, hw, req, layer_costs(spec, scheme, kv, req, weights),
                     workspace_bytes(spec, scheme, kv, req, int8_path=hw.host.cpu_decode_int8_dynamic_path))


def placement_at(fp: Footprint, n: int, mode: OffloadMode, e: int = 0, *,
                 best_effort: bool = False) -> Placement | None:
    """n layers on the GPUs in `mode` with the experts of the first e MoE layers in RAM, split over the GPUs (None when
    they do not fit; with `best_effort`, the split that shows how far over it is)."""
    n = min(n, fp.L)
    split = fp.split_for(n, OffloadMode.NONE if n == fp.L else mode, e, best_effort=best_effort)
    return None if split is None else Placement(split, OffloadMode.NONE if n == fp.L else mode, e)


def _forced_experts(fp: Footprint, req: Request, n: int) -> int:
    """How many MoE layers keep their routed experts in RAM with n layers on the GPUs under --expert-placement (0 when
    not forced): only those of resident layers move, an offloaded layer's experts go with it."""
    return req.forced_expert_layers(fp.moe_layers_before(n))


def _placements(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme,
                fp: Footprint) -> tuple[list[Placement], Placement]:
    """The placements that fit (for each offload mode, the most GPU layers; for an MoE, the fewest layers' experts in
    RAM that let every layer stay on the GPUs, or the forced --gpu-layers stay there), and the one that came closest.
    A forced --expert-placement fixes the experts in RAM at every layer count."""
    L = spec.num_layers
    if not hw.has_gpu:
        p = Placement(())
        return ([p] if fp.over(p) is None else []), p
    possible = offload_modes(hw, scheme)
    modes = [m for m in ([OffloadMode(req.offload)] if req.offload else possible) if m in possible]
    forced_experts = req.expert_placement is not None

    def at(n: int, mode: OffloadMode, best_effort: bool = False) -> Placement | None:
        return placement_at(fp, n, mode, _forced_experts(fp, req, min(n, L)), best_effort=best_effort)

    if req.gpu_layers is not None:
        n = min(req.gpu_layers, L)
        tried = list(dict.fromkeys(at(n, m, True) for m in modes)) or [at(L, OffloadMode.NONE, True)]  # n = L: one
        fitting = [p for p in tried if fp.over(p) is None]
        if not fitting and not forced_experts and fp.moe_layers:
            # the layers asked for stay on the GPUs: the fewest of their layers' experts in RAM that make room
            fitting = [p for m in ([OffloadMode.NONE] if n == L else modes)
                       if (p := experts_in_ram(fp, n, m)) is not None]
        return fitting, tried[0]
    full = at(L, OffloadMode.NONE)
    if full is not None and fp.over(full) is None:
        return [full], full
    fitting: list[Placement] = []
    closest = at(L, OffloadMode.NONE, True)
    for mode in modes:
        # the most layers the GPUs have room for (fewer always have room); fewer GPU layers only put more in RAM
        n = bisect_max(lambda k: at(k, mode) is not None, 0, L - 1)
        p = at(n, mode) if n >= 0 else None
        if p is not None:
            if fp.over(p) is None:
                fitting.append(p)
            else:
                closest = p  # the GPUs have room; RAM ran out
    experts = experts_in_ram(fp, L, OffloadMode.NONE) if not (req.offload or forced_experts) else None
    if experts is not None:
        fitting.append(experts)
    return fitting, closest


def experts_in_ram(fp: Footprint, n: int, mode: OffloadMode) -> Placement | None:
    """For an MoE: n layers on the GPUs with the routed experts of the fewest (first) of them in RAM, computed by the
    CPU (llama.cpp's --n-cpu-moe); None when even all their experts in RAM leave too little room."""
    most = fp.moe_layers_before(n)
    if not most:
        return None

    def fits(e: int) -> Placement | None:
        p = placement_at(fp, n, mode, e)
        return p if p is not None and fp.over(p) is None else None

    if fits(most) is None:
        return None
    lo, hi = 0, most  # fits(hi); find the smallest e that fits (e = 0, no expert in RAM, is the caller's own try)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) is not None else (mid, hi)
    return fits(hi)


def _runs(spec, hw, req, scheme, kv, weights: WeightCosts) -> bool:
    """Whether some placement of this scheme x KV dtype fits (no speed estimate)."""
    return bool(_placements(spec, hw, req, scheme, footprint(spec, hw, req, scheme, kv, weights))[0])


def _evaluate(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme,
              weights: WeightCosts, read: list[float], contexts: bool = True) -> Candidate:
    """One scheme x KV dtype: the fastest placement that fits, or why none does.
    `weights` and `read` (weight bytes a decode step reads per layer) are shared across KV dtypes."""
    base = dict(weight_quant=scheme.name, kv_dtype=kv.name,
                quality_cost_pct=scheme.quality.ppl_increase_pct + kv.quality.ppl_increase_pct)
    if scheme.compiled_only and not req.compiled and not device_refusal(scheme, hw):
        if req.eager:
            return Candidate(**base, fits=False, reason=f"{scheme.name} decodes compiled only (torch's weight-only "
                                                        "kernels in one graph): --eager leaves it out")
        req = derived(req, compiled=True)
    why_not = device_refusal(scheme, hw) or kv_refusal(spec, kv) or _compile_ok(spec, hw, req, scheme, kv)
    if why_not:
        return Candidate(**base, fits=False, reason=why_not)
    fp = footprint(spec, hw, req, scheme, kv, weights)
    if req.offload and OffloadMode(req.offload) not in offload_modes(hw, scheme):
        return Candidate(**base, fits=False, reason=f"{scheme.name} cannot be streamed to {hw.accelerator}: its layout "
                                                    "there differs from the one packed in RAM (use cpu offload)")
    fitting, closest = _placements(spec, hw, req, scheme, fp)
    max_ctx = max_resident_context(spec, hw, req, scheme, kv, weights) if contexts else 0
    if not fitting:
        c = choice_of(spec, scheme, kv, hw, closest)
        mem = fp.breakdown(c)
        return Candidate(**base, fits=False, choice=c, memory=mem, max_context_tokens=max_ctx,
                         reason=overflow_reason(mem, c))
    choices = [choice_of(spec, scheme, kv, hw, p) for p in fitting]
    if req.compiled:
        choices = [c for c in choices if _on_one_device(c)]
        if not choices:
            c = choice_of(spec, scheme, kv, hw, fitting[0])
            return Candidate(**base, fits=False, choice=c, memory=fp.breakdown(c), max_context_tokens=max_ctx,
                             reason=f"--compile needs every layer on one device; {scheme.name} fits only split "
                                    f"({_label(c)})")
    priced = speed_scheme(req, scheme)
    scored = sorted(((estimate(spec, hw, req, priced, kv, c, fp.costs, read), c) for c in choices),
                    key=lambda sc: -sc[0].decode_tokens_per_s)
    speed, c = scored[0]
    compiled = req.compiled
    if compiles_by_default(spec, hw, req, scheme, kv) and (one := [x for x in choices if _on_one_device(x)]):
        # a GPU's default: every layer on GPU 0 priced compiled too, and the faster of the two kept
        creq = derived(req, compiled=True)
        cpriced = speed_scheme(creq, scheme)
        fast = max(((estimate(spec, hw, creq, cpriced, kv, x, fp.costs, read), x) for x in one),
                   key=lambda sc: sc[0].decode_tokens_per_s)
        if fast[0].decode_tokens_per_s > speed.decode_tokens_per_s:
            (speed, c), compiled = fast, True
            scored = [fast, *(sc for sc in scored if sc[1] is not fast[1])]
    mem = fp.breakdown(c)
    return Candidate(**base, fits=True, choice=c, memory=mem, speed=speed, max_context_tokens=max_ctx,
                     reason=_placement_reason(c, mem, fp.costs, scored), compiled=compiled)


def compiles_by_default(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme,
                        kv: KVScheme) -> bool:
    """Whether the search prices this scheme x cache compiled as well as eager: on a CUDA GPU (CUDA graphs; no
    compiled decode is measured on Apple's), for vramplan's runtime,
    where neither --compile nor --eager decides and --compile would take it (compile_schemes)."""
    return (hw.accelerator == "cuda" and req.engine == "vramplan" and not req.compiled and not req.eager
            and _compile_ok(spec, hw, derived(req, compiled=True), scheme, kv) is None)


def _compile_ok(spec: ModelSpec, hw: HardwareProfile, req: Request, scheme: WeightScheme, kv: KVScheme) -> str | None:
    if not req.compiled:
        return None
    runs = compile_schemes(hw.has_gpu)
    if scheme.compiled_only and runs.get(scheme.name) not in (None, kv.name):
        return f"{scheme.name} decodes compiled, with a {runs[scheme.name]} cache only"
    if runs.get(scheme.name) != kv.name:
        return (f"--compile runs {', '.join(f'{w} weights with a {k} cache' for w, k in runs.items())} here "
                "(a static cache torch.compile captures; bitsandbytes' kernels break the graph"
                + ("; quanto's compiled decode is unmeasured on a GPU)" if hw.has_gpu else ")"))
    if scheme.quantized and spec.moe is not None and spec.model_type in ROW_EXPERT_MODEL_TYPES:
        return (f"--compile: {spec.model_type}'s routed experts run in vramplan's row-wise experts module, which "
                "routes tokens in Python (a graph break): "
                + (f"{scheme.name} decodes compiled only; another scheme" if scheme.compiled_only else "run it eager"))
    if scheme.activation_bits == 8 and scheme.bits == 8 and not hw.has_gpu \
            and hw.host.cpu_decode_int8_dynamic_path == "fbgemm":
        return (f"--compile: {scheme.name} runs by fbgemm on this CPU (the profile's "
                "host.cpu_decode_int8_dynamic_path), whose packed weights a compiled graph reaches through a custom "
                "op at every matmul: eager decodes faster (Qwen2.5-0.5B on the AVX2 EPYC VM: 14.4 against 11.5 "
                "tok/s compiled, 2026-11-29); run it eager")
    return None


# Models whose quantized routed experts are runtime.experts.QuantizedRowExperts (llama4's per-row layout), which has
# no unrolled forward for a compiled graph; other MoE models' QuantizedExperts take theirs.
ROW_EXPERT_MODEL_TYPES = ("llama4", "llama4_text")


def _on_one_device(c: Choice) -> bool:
    """Every layer on the CPU, or every layer on GPU 0 (a profile's other GPUs left empty) with its experts."""
    return (not c.on_gpu or (c.gpu_layers == c.total_layers and c.gpu_layers_per_device[:1] == (c.gpu_layers,)
                             and not c.expert_layers_on_cpu))


def speed_scheme(req: Request, scheme: WeightScheme) -> WeightScheme:
    """The scheme whose constants price the decode: with --compile, a compiled decode of the same bytes (its fitted
    constants, no eager dispatch); else the scheme itself. (On a CPU the quanto schemes price as themselves:
    speed.efficiency scales their per-layer cost by COMPILED_CPU_PER_LAYER_FACTOR.)"""
    if req.compiled and scheme.name in COMPILE_SCHEMES:  # (int4-wo's routed experts are gathered for tinygemm)
        return compiled_scheme(min(scheme.bits, 16), scheme.group_size,
                               scheme.backend == TORCH_WO_BACKEND and scheme.bits == 4)
    return speed_stand_in(scheme)


def overflow_reason(mem: MemoryBreakdown, c: Choice) -> str:
    where = mem.over or "cpu"
    d = mem.device(where)
    terms = ", ".join(f"{t.removesuffix('_bytes').replace('_', ' ')} {format_bytes(getattr(d, t))}"
                      for t in d.TERMS if getattr(d, t))
    device = "RAM" if where == "cpu" else ("GPU" if len(mem.gpus) == 1 else f"GPU {where[3:] or 0}")
    layers = (f"with {c.gpu_layers} of {c.total_layers} layers on the GPU{'s' if len(mem.gpus) > 1 else ''} "
              f"({c.offload.value} offload)" if c.on_gpu else "on the CPU")
    return f"{device} needs {format_bytes(d.total_bytes)} > capacity {format_bytes(d.capacity_bytes)} {layers}: {terms}"


def _gpu_parts(g) -> str:
    fixed = g.cuda_context_bytes + g.allocator_reserve_bytes + g.headroom_bytes
    return (f"weights {format_bytes(g.weights_bytes)} + KV {format_bytes(g.kv_cache_bytes)} + workspace "
            f"{format_bytes(g.workspace_bytes)}"
            + (f" + stream buffers {format_bytes(g.stream_buffers_bytes)}" if g.stream_buffers_bytes else "")
            + f" + context/allocator/headroom {format_bytes(fixed)}")


def _split_text(c: Choice, mem: MemoryBreakdown) -> str:
    """Where the resident layers are: "the GPU", or layer ranges per GPU with each one's bytes."""
    if len(mem.gpus) == 1:
        return "the GPU"
    parts, start = [], 0
    for d, (k, g) in enumerate(zip(c.gpu_layers_per_device, mem.gpus)):
        if k:
            parts.append(f"GPU {d}: layers {start}-{start + k - 1}, {format_bytes(g.total_bytes)} of "
                         f"{format_bytes(g.capacity_bytes)}")
        start += k
    return f"{len(mem.gpus)} GPUs ({'; '.join(parts)}; a pipeline across the GPUs: at batch 1 they take turns, " \
           "so several GPUs hold more, they do not decode faster)"


def _placement_reason(c: Choice, mem: MemoryBreakdown, costs: LayerCosts, scored) -> str:
    L = c.total_layers
    cpu = mem.cpu
    if not c.on_gpu:
        return (f"all {L} layers on the CPU (no GPU): RAM {format_bytes(cpu.total_bytes)} of "
                f"{format_bytes(cpu.capacity_bytes)} (weights {format_bytes(cpu.weights_bytes)} + KV "
                f"{format_bytes(cpu.kv_cache_bytes)} + workspace {format_bytes(cpu.workspace_bytes)} + runtime "
                f"{format_bytes(cpu.runtime_base_bytes)})")
    g = mem.gpu
    where = _split_text(c, mem)
    experts = experts_in_ram_text(c.expert_layers_on_cpu, c.moe_layers, c.expert_layers_in_ram)
    if c.offload is OffloadMode.NONE and c.expert_layers_on_cpu:
        text = (f"all {L} layers on {where}, with the routed experts of {experts} in RAM, computed by the CPU "
                f"({format_bytes(cpu.weights_bytes)} in RAM; a token reads only its top-k experts): "
                f"GPU holds {_gpu_parts(g)}, {format_bytes(g.free_bytes)} free")
    elif c.offload is OffloadMode.NONE:
        text = f"all {L} layers on {where}: {format_bytes(g.total_bytes)} of {format_bytes(g.capacity_bytes)}" \
            if len(mem.gpus) == 1 else f"all {L} layers on {where}"
    else:
        n = c.gpu_layers
        nxt = costs.weights[n] + (costs.kv[n] if c.offload is OffloadMode.CPU else 0)
        text = (f"layers 0-{n - 1} on {where}, {n}-{L - 1} offloaded ({c.offload.value}): " if n
                else f"no layer fits on the GPU; all {L} offloaded ({c.offload.value}): ")
        if c.expert_layers_on_cpu:
            text += f"the routed experts of {experts} in RAM, computed by the CPU; "
        text += (f"GPU 0 budget {format_bytes(g.capacity_bytes)} holds {_gpu_parts(g)}; one more layer needs "
                 f"{format_bytes(nxt)}; RAM {format_bytes(cpu.total_bytes)} of {format_bytes(cpu.capacity_bytes)}")
    if len(scored) > 1:
        (best, _), (other_speed, other) = scored[0], scored[1]
        text += (f"; predicted {best.decode_tokens_per_s:.2f} tok/s beats {_label(other)} at "
                 f"{other_speed.decode_tokens_per_s:.2f} tok/s")
    return text


def _label(c: Choice) -> str:
    experts = f"experts of {c.expert_layers_on_cpu} layers in RAM" if c.expert_layers_on_cpu else ""
    if c.offload is OffloadMode.NONE:
        return experts or "every layer on the GPU"
    return f"{c.offload.value} offload ({c.gpu_layers} GPU layers{', ' + experts if experts else ''})"


def bisect_max(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest x in [lo, hi] with ok(x), for ok true up to some point and false after; lo - 1 if none."""
    if ok(hi):
        return hi
    if not ok(lo):
        return lo - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def secant_max(probe: Callable[[int], tuple[bool, float]], lo: int, hi: int) -> int:
    """`bisect_max` for an ok(x) that comes with a slack: probe(x) = (ok(x), slack(x)), the slack falling as x grows
    and crossing 0 near where ok turns false (bytes to spare). Each probe goes where the straight line between the
    bracket's two slacks crosses 0 (regula falsi), or to the middle when the last probe did not halve the bracket.
    The answer is ok's own boundary, as bisect_max finds it; the slack only chooses where to look. A slack linear in x
    takes about four probes where bisecting 1..128k takes 19."""
    ok_hi, s_hi = probe(hi)
    if ok_hi:
        return hi
    ok_lo, s_lo = probe(lo)
    if not ok_lo:
        return lo - 1
    halved = True
    while hi - lo > 1:
        width = hi - lo
        if halved and s_lo > s_hi and math.isfinite(s_lo - s_hi):
            x = lo + int(width * s_lo / (s_lo - s_hi))
        else:
            x = (lo + hi) // 2
        x = min(max(x, lo + 1), hi - 1)
        ok, s = probe(x)
        lo, s_lo, hi, s_hi = (x, s, hi, s_hi) if ok else (lo, s_lo, x, s)
        halved = 2 * (hi - lo) <= width
    return lo


def max_resident_context(spec, hw, req, scheme, kv, weights: WeightCosts) -> int:
    """Largest context (up to the model's maximum) with every layer resident: all on the GPU, or in RAM
    on a machine without one; 0 if none."""
    n = spec.num_layers if hw.has_gpu else 0

    def probe(ctx: int) -> tuple[bool, float]:
        fp = footprint(spec, hw, derived(req, context=ctx, prompt_tokens=None), scheme, kv, weights)
        p = placement_at(fp, n, OffloadMode.NONE)
        mem = fp.breakdown_of(p or placement_at(fp, n, OffloadMode.NONE, best_effort=True))
        return p is not None and mem.over is None, min(d.capacity_bytes - d.total_bytes for d in (*mem.gpus, mem.cpu))

    return max(0, secant_max(probe, 1, spec.max_context or req.context))


def _alternatives(spec, hw, req) -> list[Alternative]:
    """When nothing fits: the longest context each scheme could hold, best first."""
    out = []
    for scheme in SCHEMES.values():
        if device_refusal(scheme, hw) or scheme.compiled_only:  # those fit on one device or not at all: no shorter
            continue                                            # context frees their split

        weights = weight_costs(spec, scheme, not hw.has_gpu)
        for kv_name in ALTERNATIVE_KV_DTYPES:
            kv = KV_SCHEMES[kv_name]
            if kv_refusal(spec, kv):
                continue
            best = bisect_max(lambda ctx: _runs(spec, hw, derived(req, context=ctx, prompt_tokens=None), scheme, kv,
                                                weights), 1, req.context)
            if best >= 1:
                out.append(Alternative(scheme.name, kv_name, best))
    out.sort(key=lambda a: -a.max_context_tokens)
    return out


def _constants(hw: HardwareProfile, req: Request) -> dict[str, Constant]:
    """Every constant the plan used, with its value and where it comes from."""
    from . import memory as m, speed as sp

    o = hw.overheads
    out = {
        "gpu_capacity_bytes": {"value": gpu_capacity(hw, req), "from": "request --vram-budget"
                               if req.vram_budget_bytes is not None else f"profile {hw.name}: gpus[0].memory"},
        "ram_capacity_bytes": {"value": ram_capacity(hw, req), "from": "request --ram-budget"
                               if req.ram_budget_bytes is not None else f"profile {hw.name}: host.ram"},
        "cuda_context_bytes": {"value": o.cuda_context_bytes, "from": f"profile {hw.name}: overheads.cuda_context"},
        "allocator_reserve_bytes": {"value": o.allocator_reserve_bytes, "from": f"profile {hw.name}: "
                                                                                "overheads.allocator_reserve"},
        "kernel_launch_s": {"value": o.kernel_launch_s, "from": f"profile {hw.name}: overheads.kernel_launch"},
        "headroom_bytes": {"value": req.headroom_bytes, "from": "request --headroom"},
        "prefill_chunk_tokens": {"value": req.prefill_chunk, "from": "request --prefill-chunk"},
        "runtime_base_ram_bytes": {"value": req.runtime_base_ram_bytes, "from": (
            f"profile {hw.name}: calibration.runtime_ram" if hw.calibration is not None
            and hw.calibration.runtime_ram_bytes == req.runtime_base_ram_bytes
            else "planner.request.RUNTIME_BASE_RAM_BYTES")},
        "balanced_speed_fraction": {"value": req.balanced_speed_fraction,
                                    "from": "planner.request.BALANCED_SPEED_FRACTION"},
        "balanced_max_quality_cost_pct": {"value": req.balanced_max_quality_cost_pct,
                                          "from": "planner.request.BALANCED_MAX_QUALITY_COST_PCT"},
        "activation_hidden_copies": {"value": m.ACTIVATION_HIDDEN_COPIES, "from": "planner.memory"},
        "activation_mlp_copies": {"value": m.ACTIVATION_MLP_COPIES, "from": "planner.memory"},
        "logits_bytes_per_element": {"value": m.LOGITS_BYTES_PER_ELEMENT, "from": "planner.memory"},
        "sdpa_math_score_fp32_copies": {"value": m.SDPA_MATH_SCORE_FP32_COPIES, "from": "planner.memory (CPU, V head "
                                        "dim != Q/K's: MLA)"},
        "sdpa_math_kv_fp32_copies": {"value": m.SDPA_MATH_KV_FP32_COPIES, "from": "planner.memory (CPU, V head dim != "
                                     "Q/K's: MLA)"},
        "link_efficiency": {"value": sp.DEFAULT_LINK_EFFICIENCY, "from": "planner.speed.DEFAULT_LINK_EFFICIENCY"},
        "ram_bandwidth_bytes_per_s": {"value": hw.host.ram_bandwidth_bytes_per_s, "from": f"profile {hw.name}: "
                                                                                          "host.ram_bandwidth"},
        "cpu_bf16_flops": {"value": hw.host.cpu_bf16_flops, "from": f"profile {hw.name}: host.cpu_bf16_compute"},
    }
    for key, field, value in (("cpu_fp32_flops", "cpu_fp32_compute", hw.host.cpu_fp32_flops),
                              ("cpu_int8_ops", "cpu_int8_compute", hw.host.cpu_int8_ops)):
        if value is not None:  # a CPU prefill's matmuls compute against these (planner.speed.cpu_matmul_peak)
            out[key] = {"value": value, "from": f"profile {hw.name}: host.{field}"}
    entry = 0
    for g in hw.gpus:  # the other devices, where a profile has several
        for _ in range(g.count):
            if entry:
                where = f"profile {hw.name}: gpus[{hw.gpus.index(g)}]"
                out[f"gpu{entry}_capacity_bytes"] = {"value": gpu_capacity(hw, req, entry), "from": f"{where}.memory"}
                out[f"gpu{entry}_memory_bandwidth_bytes_per_s"] = {"value": g.memory_bandwidth_bytes_per_s,
                                                                   "from": f"{where}.memory_bandwidth"}
            entry += 1
    measured_call = hw.host.cpu_expert_call_s is not None
    used_for = "; a prefill's and a compiled decode's calls" if measured_call else ""
    out["cpu_expert_call_s"] = {"value": sp.DEFAULT_CPU_EXPERT_CALL_S,
                                "from": f"planner.speed.DEFAULT_CPU_EXPERT_CALL_S (MoE, until calibrated: "
                                        f"calibration.experts{used_for})"}
    if measured_call:
        out["cpu_eager_decode_expert_call_s"] = {
            "value": hw.host.cpu_expert_call_s,
            "from": f"profile {hw.name}: host.cpu_expert_call (the probe's timing; MoE, until calibrated: "
                    "calibration.experts)"}
    if hw.gpu is not None:
        out["expert_call_launches"] = {"value": sp.EXPERT_CALL_LAUNCHES, "from": "planner.speed.EXPERT_CALL_LAUNCHES "
                                       "(MoE, until calibrated: calibration.experts)"}
        out["gathered_int4_expert_passes"] = {"value": sp.GATHERED_INT4_EXPERT_PASSES,
                                              "from": "planner.speed.GATHERED_INT4_EXPERT_PASSES (compiled MoE, "
                                                      "int4-wo: by design, unmeasured)"}
        out["crossing_sync_launches"] = {"value": sp.CROSSING_SYNC_LAUNCHES,
                                         "from": "planner.speed.CROSSING_SYNC_LAUNCHES"}
    if hw.gpu is not None:
        out["gpu_memory_bandwidth_bytes_per_s"] = {"value": hw.gpu.memory_bandwidth_bytes_per_s,
                                                   "from": f"profile {hw.name}: gpus[0].memory_bandwidth"}
        out["gpu_bf16_flops"] = {"value": hw.gpu.bf16_flops, "from": f"profile {hw.name}: gpus[0].bf16_compute"}
    if hw.link is not None:
        out["link_h2d_pinned_bytes_per_s"] = {"value": hw.link.h2d_pinned_bytes_per_s, "from": f"profile {hw.name}: "
                                                                                               "link.h2d_pinned"}
    return constants(out)


def check_request(hw: HardwareProfile, req: Request) -> None:
    """Refuse requests this hardware cannot honour, before any search."""
    if not hw.has_gpu:
        for given, what in ((req.gpu_layers, "a number of GPU layers"), (req.offload, "an offload mode"),
                            (req.expert_placement, "an expert placement"),
                            (req.vram_budget_bytes, "a GPU memory budget")):
            if given is not None and not (what.startswith("a number") and given == 0):
                raise PlanError(f"{what} was given, but hardware {hw.name!r} has no GPU")
    device_refusals = [why for q in req.quant if q in SCHEMES and (why := device_refusal(SCHEMES[q], hw))]
    if req.quant and len(device_refusals) == len(req.quant):  # no scheme asked for runs here: bad input, not a fit
        raise PlanError(f"request.quant {','.join(req.quant)}: {'; '.join(device_refusals)} (hardware {hw.name!r})")
    if req.offload == OffloadMode.STREAM and hw.link is None and hw.has_gpu:
        raise PlanError(f"stream offload needs a host-GPU link; hardware {hw.name!r} has unified memory "
                        "(offloaded layers can only run on the CPU)")
    largest = max((g.memory_bytes for g in hw.gpus), default=0)
    if req.vram_budget_bytes is not None and hw.gpus and req.vram_budget_bytes > largest * BUDGET_SLACK:
        raise PlanError(f"the GPU memory budget {format_bytes(req.vram_budget_bytes)} exceeds the GPU's "
                        f"{format_bytes(largest)}")
    if req.ram_budget_bytes is not None and req.ram_budget_bytes > hw.host.ram_bytes * BUDGET_SLACK:
        raise PlanError(f"the RAM budget {format_bytes(req.ram_budget_bytes)} exceeds the host's "
                        f"{format_bytes(hw.host.ram_bytes)} (profile {hw.name!r})")


# A budget at most this much over the hardware is what it has, as a person writes it (24GiB for a 4090's 23.99 GiB):
# planned at capacity (planner/capacity.py takes the smaller of the two), with a note (budget_notes).
BUDGET_SLACK = 1.01


def budget_notes(hw: HardwareProfile, req: Request) -> list[str]:
    """What check_request let through as the hardware's own size: a budget over it by at most BUDGET_SLACK."""
    out = []
    largest = max((g.memory_bytes for g in hw.gpus), default=0)
    if req.vram_budget_bytes is not None and hw.gpus and req.vram_budget_bytes > largest:
        out.append(f"the GPU memory budget {format_bytes(req.vram_budget_bytes)} is the GPU's own "
                   f"{format_bytes(largest)} as written: planned at that")
    if req.ram_budget_bytes is not None and req.ram_budget_bytes > hw.host.ram_bytes:
        out.append(f"the RAM budget {format_bytes(req.ram_budget_bytes)} is the host's own "
                   f"{format_bytes(hw.host.ram_bytes)} as written: planned at that")
    return out


def check_context(spec: ModelSpec, req: Request) -> list[str]:
    """Refuse a context beyond what the model is made for (PlanError) unless the request allows it; the warnings to
    show (the overflow allowed, or a rope scaling that makes the context valid)."""
    limit, why = context_limit(spec)
    if not limit:
        return [(f"{spec.name}'s config gives no max_position_embeddings: the longest context the model is made "
                 f"for is unknown, so context {req.context} was not checked against it")]
    if req.context <= spec.max_context:
        return []
    if req.context <= limit:
        return [f"context {req.context} is beyond max_position_embeddings {spec.max_context}, within the {why}"]
    if not req.allow_context_overflow:
        raise PlanError(f"context {req.context} exceeds what {spec.name} is made for ({why}): quality past it is "
                        f"not what the model was trained for; plan at most {limit} tokens, or set "
                        "request.allow_context_overflow to plan it anyway")
    return [f"context {req.context} exceeds {spec.name}'s {why}: planned as asked (the overflow is allowed); "
            "expect the quality to degrade past it"]


def _measured_runtime(hw: HardwareProfile, req: Request) -> Request:
    cal = hw.calibration
    if cal is not None and cal.runtime_ram_bytes is not None and req.runtime_base_ram_bytes == RUNTIME_BASE_RAM_BYTES:
        return replace(req, runtime_base_ram_bytes=cal.runtime_ram_bytes)  # measured beats the default
    return req


def assess(spec: ModelSpec, hw: HardwareProfile, req: Request, c: Choice) -> tuple[MemoryBreakdown, SpeedEstimate]:
    """The bytes and the speed of one given choice under `req` (a run's own prompt and context), without a search:
    the same placement, so a run is compared with the plan it runs."""
    req = _measured_runtime(hw, req)
    scheme, kv = scheme_named(spec, c.weight_quant), KV_SCHEMES[c.kv_dtype]
    fp = footprint(spec, hw, req, scheme, kv, weight_costs(spec, scheme, not hw.has_gpu))
    return fp.breakdown(c), estimate(spec, hw, req, speed_scheme(req, scheme), kv, c, fp.costs,
                                     read_bytes_per_layer(spec, scheme, req.batch))


class VramplanEngine:
    """vramplan's own runtime behind the Engine protocol (planner.engine): its weight schemes x KV dtypes, each with
    the fastest placement that fits (stream or cpu offload, experts in RAM), priced by planner.speed."""

    name = "vramplan"

    def check(self, spec: ModelSpec, hw: HardwareProfile, req: Request) -> tuple[Request, list[str]]:
        check_request(hw, req)
        check_experts(spec, req)
        return _measured_runtime(hw, req), [*budget_notes(hw, req), *check_context(spec, req)]

    def candidates(self, spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True
                   ) -> list[Candidate]:
        schemes = weight_schemes(spec, req.quant)
        kvs = [KV_SCHEMES[k] for k in req.kv_dtype] if req.kv_dtype else list(KV_SCHEMES.values())
        cands = []
        for s in schemes:
            weights, read = weight_costs(spec, s, not hw.has_gpu), read_bytes_per_layer(spec, s, req.batch)
            cands.extend(_evaluate(spec, hw, req, s, k, weights, read, contexts) for k in kvs)
        return cands

    def resident_context(self, spec: ModelSpec, hw: HardwareProfile, req: Request, chosen: Candidate) -> int:
        s = scheme_named(spec, chosen.weight_quant)
        return max_resident_context(spec, hw, req, s, KV_SCHEMES[chosen.kv_dtype], weight_costs(spec, s,
                                                                                                   not hw.has_gpu))

    def constants(self, spec: ModelSpec, hw: HardwareProfile, req: Request, cands: list[Candidate]
                  ) -> dict[str, Constant]:
        return _constants(hw, req)

    def nothing_fits(self, spec: ModelSpec, hw: HardwareProfile, req: Request, cands: list[Candidate]) -> Outcome:
        forced = (req.gpu_layers is not None or req.quant or req.kv_dtype or req.offload
                  or req.expert_placement is not None)
        alts = [] if forced else _alternatives(spec, hw, req)
        reasons = nothing_fits_reasons(cands)
        if alts:
            a = alts[0]
            reasons.append(f"what would fit instead: {a.weight_quant} weights + {a.kv_dtype} KV up to "
                           f"{a.max_context_tokens} tokens of context")
        return Outcome(reasons=reasons, alternatives=alts)

    def explain(self, spec: ModelSpec, hw: HardwareProfile, req: Request, chosen: Candidate) -> Outcome:
        c = chosen.choice
        compiled = req.compiled or chosen.compiled
        priced = speed_scheme(replace(req, compiled=compiled), scheme_named(spec, c.weight_quant))
        kv = KV_SCHEMES[c.kv_dtype]
        lean = decodes_lean(spec, priced, kv, on_gpu=c.on_gpu, compiled=compiled, eager=req.eager)
        out = Outcome(constants=speed_constants(hw, priced, "gpu" if c.on_gpu else "cpu", compiled, lean))
        if lean:
            out.reasons.append("decode by vramplan's own decoder step (runtime.lean: transformers' forward without its "
                               "per-op overhead, q/k/v and gate/up one kernel call each; --eager runs transformers' "
                               f"forward), priced with the share of each layer's fixed cost it leaves: "
                               f"{chosen.speed.terms.get('efficiency_source')}")
        elif priced.name in LEAN_SCHEMES and not c.on_gpu and not compiled:
            why = "--eager asks for it" if req.eager else lean_refusal(spec, priced, kv)
            out.reasons.append(f"decode by transformers' forward, not vramplan's own decoder step: {why}")
        if compiled:
            how = ("--compile" if req.compiled else "the default on a GPU where it is predicted faster than eager; "
                   "--eager decodes eager")
            out.reasons.append("decode compiled: a static cache and torch.compile, CUDA graphs on a GPU "
                               f"({how}), priced without the eager dispatch (on a CPU: with the share of each layer's "
                               "fixed cost that compiling measured to leave); "
                               f"efficiencies: {chosen.speed.terms.get('efficiency_source')}")
        if c.offload is not OffloadMode.NONE:
            out.warnings.append(f"{c.offloaded_layers} of {c.total_layers} layers are offloaded ({c.offload.value}): "
                                f"decode is limited by the {'host link' if c.offload is OffloadMode.STREAM else 'CPU'}")
        if len([k for k in c.gpu_layers_per_device if k]) > 1:
            out.warnings.append("the layers are split over several GPUs: a pipeline, so at batch 1 the GPUs take "
                                "turns; they hold a bigger model, they do not decode faster than one GPU would")
        if KV_SCHEMES[c.kv_dtype].dequantizes_whole_layer and (c.compute_device is ComputeDevice.CPU
                                                               or c.offload is OffloadMode.CPU):
            out.warnings.append(f"a {c.kv_dtype} KV cache in RAM: each step dequantizes a layer's cache into fresh "
                                "tensors, and glibc keeps what they free in its heap, so peak RSS can exceed this "
                                "plan by more than the cache saves (measured: a quanto-int4 cache peaked at or above "
                                "bf16's; bench/results/malloc-cpu-dev.md); leave headroom, or use bf16 KV where it "
                                "fits")
        if said := gguf_note(spec):
            out.warnings.append(said)
        if (said := loaders_note(spec)) and scheme_named(spec, c.weight_quant).backend == PUBLISHED_BACKEND:
            out.warnings.append(f"{said}; vramplan's runtime does not load this format (`vramplan run` refuses it): "
                                f"the speed above is {speed_stand_in(scheme_named(spec, c.weight_quant)).name}'s "
                                "eager constants over these bytes, a stand-in")
        if scheme_named(spec, c.weight_quant).backend == "bnb" and c.compute_device is ComputeDevice.CPU:
            out.warnings.append("bitsandbytes runs on the CPU only slowly; quanto schemes are the CPU-capable backend")
        return out


VRAMPLAN = VramplanEngine()


def plan(spec: ModelSpec, hw: HardwareProfile, req: Request) -> Plan:
    """Decide how vramplan's runtime runs `spec` on `hw` for `req` (planner.engine's loop over VRAMPLAN); pure and
    fast (< 100 ms for a 405B model)."""
    return plan_with(VRAMPLAN, spec, hw, req)
