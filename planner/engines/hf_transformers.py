"""Plain transformers: the from_pretrained snippet closest to a vramplan plan, with comments where it differs.

vramplan's runtime is transformers + bitsandbytes / optimum-quanto plus its own offload engine; plain
transformers has no such engine, so a split plan becomes an accelerate device_map:
- layers mapped to "cpu" are copied to the GPU on every forward (accelerate's hooks, pageable memory, no
  prefetch): neither vramplan's prefetching stream mode nor its CPU-compute mode;
- with bitsandbytes, `llm_int8_enable_fp32_cpu_offload=True` keeps the CPU-mapped layers unquantized in
  the load dtype (2 B/param in bf16), so they take more RAM and move more bytes than the plan's;
- transformers' quanto loader refuses a device_map with CPU entries (runtime/load.py says the same);
- an MoE's fused routed experts stay in the load dtype under bitsandbytes and quanto (their loaders swap nn.Linear
  layers only) and run transformers' grouped experts: counted and priced so (as_transformers_loads).
The layer and module names come from the model's tensor names. Pure: this writes text, imports nothing.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..choice import Choice, OffloadMode
from ..engine import Outcome, nothing_fits_reasons, plan_with, request_for
from ..plan import Candidate
from ..modelspec import ModelSpec, Role
from ..hardware import HardwareProfile
from ..memory import ram_capacity, weight_costs
from ..plan import Plan
from ..request import Request
from ..published_scheme import (PUBLISHED_BACKEND, loaders_note, published_scheme, scheme_named, speed_stand_in,
                                weight_schemes)
from ..quant import CPU_KERNEL_BACKEND, KV_SCHEMES, SCHEMES
from ..units import format_bytes
from ..quoting import python_fstring, python_str
from .common import EngineAnswer, Export, commented, first_moe_layers, index_range, model_location

ENGINE = "transformers"


def _offloads(c) -> bool:
    """Whether the plan's device_map has CPU entries accelerate offloads."""
    return c.on_gpu and c.offload is not OffloadMode.NONE


def bnb_cpu_ram_bytes(spec: ModelSpec, c: Choice, ram: int) -> int:
    """Host RAM transformers + accelerate takes for a split (`ram`: what the placement puts in RAM as vramplan counts
    it), with every module mapped to the CPU at the load dtype where bitsandbytes quantizes
    (`llm_int8_enable_fp32_cpu_offload=True` leaves them unquantized: the CPU-mapped layers, and the routed experts
    kept in RAM)."""
    s = scheme_named(spec, c.weight_quant)
    if s.backend != "bnb" or not c.on_gpu:
        return ram
    quantized, plain = weight_costs(spec, s), weight_costs(spec, SCHEMES[LOAD_SCHEME[s.compute_dtype]])
    offloaded = range(c.gpu_layers, c.total_layers)
    experts = [i for i in first_moe_layers(spec, c.expert_layers_on_cpu) if i < c.gpu_layers]
    return (ram + sum(plain.layers[i] - quantized.layers[i] for i in offloaded)
            + sum(plain.experts[i] - quantized.experts[i] for i in experts))


# The unquantized scheme of each compute dtype: what bitsandbytes leaves a CPU-mapped module in.
LOAD_SCHEME = {"bfloat16": "bf16", "float16": "fp16"}


def _split_refusal(spec: ModelSpec, c: Choice, mem, capacity: int) -> str | None:
    """Why transformers cannot run a split placement that vramplan's counting fits: quanto refuses a device_map with
    CPU entries; bitsandbytes keeps CPU-mapped modules unquantized (their RAM over `capacity`)."""
    s = scheme_named(spec, c.weight_quant)
    if s.backend == "quanto":
        return "transformers' quanto loader refuses a device_map with CPU entries"
    need = bnb_cpu_ram_bytes(spec, c, mem.cpu.total_bytes)
    if need <= capacity:
        return None
    return (f"transformers' bitsandbytes offload keeps the CPU-mapped modules unquantized "
            f"({LOAD_SCHEME[s.compute_dtype]}): RAM needs {format_bytes(need)} of {format_bytes(capacity)}")


# ---------------------------------------------------------------- its own search
# Accelerate's offload and the CPU are not priced (module docstring): these say so in the row and the plan.
SPLIT_UNPRICED = ("not predicted: accelerate's offload is not modeled (5-17x slower than vramplan's stream engine, "
                  "measured on an H200)")
CPU_UNPRICED = ("not predicted: on the CPU vramplan calls torch's kernels itself (bf16 by GEMV, quanto's int8/int4 "
                "without its dispatch, lm_head in int8 rows), plain transformers does not (it decoded at 0.69-1.04x of "
                "vramplan's speed in the two runs of bench/results/vs-engines-cpu-dev*.md, 0.59-0.97x in three runs "
                "before them)")
RESIDENT_PRICED = "vramplan's speed model: the same eager kernels as vramplan's runtime"


def transformers_candidates(spec: ModelSpec, hw: HardwareProfile, req: Request, contexts: bool = True
                            ) -> list[Candidate]:
    """Every scheme x KV dtype plain transformers loads (vramplan's weight-only schemes: w8a8 is vramplan's own CPU
    kernel), each with the placement it makes: every layer on the GPU (priced as vramplan's eager decode: the same
    kernels), else an accelerate device_map, the routed experts or the last layers mapped to the CPU and copied to
    the GPU on every forward (KV on the GPU, as for vramplan's stream mode; not priced), within its own refusals; on a
    machine without a GPU, on the CPU (not priced)."""
    from ..memory import Placement
    from ..search import (choice_of, device_refusal, experts_in_ram, footprint, kv_refusal, max_resident_context,
                          overflow_reason, placement_at, bisect_max)
    from ..speed import estimate
    from ..work import read_bytes_per_layer

    schemes = weight_schemes(spec, req.quant) if req.quant or published_scheme(spec) else [
        s for s in SCHEMES.values() if s.activation_bits == 16 and not s.compiled_only]  # generate() is eager
    kvs = [KV_SCHEMES[k] for k in req.kv_dtype] if req.kv_dtype else list(KV_SCHEMES.values())
    L, cap = spec.num_layers, ram_capacity(hw, req)

    def in_turn(fp, forced_e: int):
        """Every layer on the GPU, else the experts of the fewest layers in RAM, else the most GPU layers: each made
        only when the one before does not run."""
        yield placement_at(fp, L, OffloadMode.NONE, forced_e, best_effort=True)
        if not forced_e:
            yield experts_in_ram(fp, L, OffloadMode.NONE)
        n = bisect_max(lambda m: placement_at(fp, m, OffloadMode.STREAM) is not None, 0, L - 1)
        yield placement_at(fp, n, OffloadMode.STREAM) if n >= 0 else None

    out = []
    for s in map(as_transformers_loads, schemes):
        weights, read = weight_costs(spec, s, not hw.has_gpu), read_bytes_per_layer(spec, s, req.batch)
        for k in kvs:
            base = dict(weight_quant=s.name, kv_dtype=k.name,
                        quality_cost_pct=s.quality.ppl_increase_pct + k.quality.ppl_increase_pct)
            compiled_only = (f"{s.name} is vramplan's compiled decode of torch's weight-only kernels: plain "
                             "transformers' generate() runs eager") if s.compiled_only else None
            own_kernel = (f"{s.name} is vramplan's own CPU kernel: plain transformers has none (torchao's nearest, "
                          "8da4w, stores other bytes)") if s.backend == CPU_KERNEL_BACKEND else None
            if why := device_refusal(s, hw) or kv_refusal(spec, k) or compiled_only or own_kernel:
                out.append(Candidate(**base, fits=False, reason=why))
                continue
            fp = footprint(spec, hw, req, s, k, weights)
            forced_e = req.forced_expert_layers(fp.moe_layers) if req.expert_placement is not None else 0
            if not hw.has_gpu:
                tries = [Placement(())]
            elif req.gpu_layers is not None and req.gpu_layers < L:
                tries = [placement_at(fp, req.gpu_layers, OffloadMode.STREAM, forced_e, best_effort=True)]
            else:
                tries = (p for p in in_turn(fp, forced_e) if p is not None)
            best = _best_of(spec, hw, req, s, k, fp, tries, base, cap, read, choice_of, overflow_reason, estimate)
            if contexts and best.memory is not None:
                best = replace(best, max_context_tokens=max_resident_context(spec, hw, req, s, k, weights))
            out.append(best)
    return out


# transformers 5's bitsandbytes and optimum-quanto loaders replace nn.Linear layers only (replace_with_bnb_linear,
# replace_with_quanto_layers): an MoE's fused 3-D experts stay in the load dtype and run transformers' grouped experts
# (grouped_mm), where vramplan's runtime quantizes them per expert (runtime.experts). One object per scheme: the speed
# model's memos know a scheme by its identity.
def as_transformers_loads(s):
    """The scheme as plain transformers stores and runs it: routed experts unquantized and grouped where its loader
    quantizes (bitsandbytes, optimum-quanto); the scheme itself otherwise."""
    return _experts_as_loaded(s) if s.backend in ("bnb", "quanto") else s


@functools.cache
def _experts_as_loaded(s):
    return replace(s, quantizes_experts=False, groups_experts=True)


def _best_of(spec, hw, req, s, k, fp, tries, base, cap, read, make_choice, overflow, estimate) -> Candidate:
    """The first placement of `tries` transformers runs (priced when every layer is on the GPU), or why none does."""
    reason, first = "", None
    for p in tries:
        if first is None:
            first = p
        c = make_choice(spec, s, k, hw, p)
        mem = fp.breakdown(c)
        if mem.over is not None:
            reason = reason or overflow(mem, c)
            continue
        split = c.on_gpu and (c.offload is not OffloadMode.NONE or c.expert_layers_on_cpu)
        if split and (refused := _split_refusal(spec, c, mem, cap)):
            reason = refused
            continue
        if c.on_gpu and not split:
            speed = estimate(spec, hw, req, speed_stand_in(s), k, c, fp.costs, read)
            return Candidate(**base, fits=True, choice=c, memory=mem, speed=speed,
                             reason=f"every layer on the GPU: {RESIDENT_PRICED}")
        how = SPLIT_UNPRICED if split else CPU_UNPRICED
        where = (f"an accelerate device_map: {c.offloaded_layers} layers" if c.offload is not OffloadMode.NONE else
                 f"the experts of {c.expert_layers_on_cpu} layers") + " mapped to the CPU" if split else "on the CPU"
        return Candidate(**base, fits=True, choice=c, memory=mem, reason=f"{where}; {how}")
    c = make_choice(spec, s, k, hw, first) if first is not None else None
    return Candidate(**base, fits=False, choice=c, memory=fp.breakdown(c) if c else None,
                     reason=reason or "no placement")


def transformers_plan(spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True) -> Plan:
    """Plain transformers' own plan for the request (its row in the engine table, what --emit transformers writes)."""
    return plan_with(TRANSFORMERS, spec, hw, req, contexts=contexts)


class TransformersEngine:
    """Plain transformers + accelerate behind the Engine protocol (planner.engine)."""

    name = ENGINE

    def check(self, spec: ModelSpec, hw: HardwareProfile, req: Request) -> tuple[Request, list[str]]:
        from ..search import VRAMPLAN

        return VRAMPLAN.check(spec, hw, replace(req, offload=None, compiled=False, eager=True))

    def candidates(self, spec, hw, req, *, contexts: bool = True) -> list[Candidate]:
        return transformers_candidates(spec, hw, req, contexts)

    def resident_context(self, spec, hw, req, chosen: Candidate) -> int:
        from ..search import VRAMPLAN

        return VRAMPLAN.resident_context(spec, hw, req, chosen)

    def constants(self, spec, hw, req, cands) -> dict:
        from ..search import VRAMPLAN

        return VRAMPLAN.constants(spec, hw, req, cands)

    def nothing_fits(self, spec, hw, req, cands) -> Outcome:
        return Outcome(reasons=nothing_fits_reasons(cands, " transformers' loading"))

    def explain(self, spec, hw, req, chosen: Candidate) -> Outcome:
        return Outcome()


TRANSFORMERS = TransformersEngine()


def _module_names(spec: ModelSpec) -> tuple[str, str | None]:
    """(decoder layers path, input embedding module) from the tensor names."""
    first = next(t.name for t in spec.tensors if t.layer == 0)
    embed = next((t.name.removesuffix(".weight") for t in spec.non_layer_tensors() if t.role is Role.EMBEDDING), None)
    return first.split(".0.", 1)[0], embed


def _quantization(scheme: str) -> tuple[str, list[str]]:
    """(import name, config lines) for a vramplan scheme."""
    s = SCHEMES[scheme]
    if s.backend == "bnb" and s.bits == 8:
        return "BitsAndBytesConfig", ["BitsAndBytesConfig(", "    load_in_8bit=True,",
                                      f"    llm_int8_threshold={s.outlier_threshold},"]
    if s.backend == "bnb":
        return "BitsAndBytesConfig", ["BitsAndBytesConfig(", "    load_in_4bit=True,",
                                      f'    bnb_4bit_quant_type="{s.variant}",',
                                      f"    bnb_4bit_use_double_quant={s.double_quant},",
                                      "    bnb_4bit_compute_dtype=torch.bfloat16,"]
    if s.activation_bits == 8:  # vramplan's own kernel: transformers runs the same scheme through torchao
        return "TorchAoConfig", ["TorchAoConfig(", "    Int8DynamicActivationInt8WeightConfig(),"]
    return "QuantoConfig", ["QuantoConfig(", f'    weights="int{s.bits}",']


def _device_map(spec: ModelSpec, p: Plan) -> list[str]:
    c = p.choice
    if not c.on_gpu:
        return ['device_map = "cpu"']
    layers, embed = _module_names(spec)
    per = list(c.gpu_layers_per_device) or [c.gpu_layers]
    experts = _experts_module(spec) if c.expert_layers_on_cpu else None
    if len(per) == 1 and c.offload is OffloadMode.NONE and not experts:
        return ['device_map = {"": 0}']
    lines = ['device_map = {"": 0}  # later, longer entries override earlier ones']
    start = 0
    for device, n in enumerate(per):
        if device and n:
            lines.append(f"device_map |= {{{python_fstring(layers + '.', 'i')}: {device} for i in range({start}, "
                         f"{start + n})}}")
        start += n
    if c.offload is not OffloadMode.NONE:
        lines.append(f'device_map |= {{{python_fstring(layers + ".", "i")}: "cpu" for i in range({start}, '
                     f'{c.total_layers})}}')
        if embed and not c.embeddings_on_gpu:
            lines.append(f'device_map[{python_str(embed)}] = "cpu"')
    if experts:
        resident = [i for i in first_moe_layers(spec, c.expert_layers_on_cpu) if i < c.gpu_layers]
        key = python_fstring(layers + ".", "i", "." + experts)
        lines.append(f'device_map |= {{{key}: "cpu" for i in {index_range(resident)}}}  # routed experts in RAM')
    return lines


def _experts_module(spec: ModelSpec) -> str | None:
    """The routed experts' module inside a decoder layer ("mlp.experts"), from a layer's expert tensor name."""
    t = next((t for t in spec.tensors if t.role is Role.EXPERT and t.layer is not None), None)
    if t is None:
        return None
    inside = t.name.split(f".{t.layer}.", 1)[1]
    return inside.rpartition(".")[0] if ".experts" in inside else None


def _cache_lines(kv: str) -> list[str]:
    k = KV_SCHEMES[kv]
    if k.backend == "dynamic":
        return []
    call = ('QuantizedCache(backend="fp8", config=model.config)' if k.backend == "fp8" else
            f'QuantizedCache(backend="quanto", config=model.config, nbits={k.nbits}, q_group_size={k.group_size}, '
            f"residual_length={k.residual_tokens})")
    return ["", f"# the plan's {kv} KV cache: generate(..., cache=cache) "
                "(past_key_values=cache before transformers 5.24)",
            "from transformers.cache_utils import QuantizedCache", f"cache = {call}"]


def transformers_plan_of(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> tuple[Plan, list[str]]:
    """Plain transformers' own plan for the request of `p`, and how the request was put in its words."""
    req, notes = request_for(ENGINE, p.request, hw)
    return transformers_plan(spec, hw, req), notes


def export_transformers(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> Export:
    """--emit transformers: plain transformers' own plan for the request (its row) as a from_pretrained snippet."""
    q, notes = transformers_plan_of(spec, hw, p)
    if not q.fits:
        notes.append(f"transformers: {q.reasons[0]}; no snippet")
        return Export(engine=ENGINE, fits=False, text=commented(notes, "# no snippet"), notes=tuple(notes))
    c = q.choice
    s = scheme_named(spec, c.weight_quant)
    dtype = "torch.float16" if s.compute_dtype == "float16" else "torch.bfloat16"
    stored = s.backend == PUBLISHED_BACKEND or (s.quantized and published_scheme(spec) is s)
    if stored:  # the checkpoint's own quantization_config loads it: no second one
        notes.append(loaders_note(spec))
    offloads = _offloads(c)
    imports = ["AutoModelForCausalLM"]
    body = []
    notes.append(f"{c.weight_quant} + {c.kv_dtype} KV: {q.chosen.reason}")
    if s.quantized and not stored:
        name, config = _quantization(c.weight_quant)
        imports.append(name)
        if (offloads or c.expert_layers_on_cpu) and s.backend == "bnb":
            config.append("    llm_int8_enable_fp32_cpu_offload=True,")
            notes.append("transformers' bitsandbytes offload keeps the CPU-mapped modules unquantized in RAM "
                         f"({format_bytes(bnb_cpu_ram_bytes(spec, c, q.memory.cpu.total_bytes))} in all), unlike "
                         "vramplan's runtime, which keeps them quantized")
        body += ["quantization_config = " + config[0], *config[1:], ")"]
    if c.expert_layers_on_cpu:
        notes.append(f"the experts of {c.expert_layers_on_cpu} layers are mapped to the CPU: accelerate copies them "
                     "to the GPU on every forward, where vramplan's runtime computes them on the CPU")
    if offloads:
        notes.append(f"the {c.offloaded_layers} CPU-mapped layers are copied to the GPU on every forward by accelerate "
                     "(no prefetch), where vramplan's runtime streams them with prefetch or computes them on the CPU")
    body += _device_map(spec, q)
    args = [f"    {python_str(model_location(spec))},"]
    if s.quantized and not stored:
        args.append("    quantization_config=quantization_config,")
    args += ["    device_map=device_map,", f"    dtype={dtype},"]
    body += ["model = AutoModelForCausalLM.from_pretrained(", *args, ")", *_cache_lines(c.kv_dtype)]
    extra = []
    if s.activation_bits == 8:
        extra = ["from torchao.quantization import Int8DynamicActivationInt8WeightConfig"]
        notes.append(f"{c.weight_quant} is vramplan's own CPU kernel (int8 rows x int8 tokens); transformers runs the "
                     "same scheme through torchao (pip install torchao): int8 per row and per token, but not "
                     "bit-identical tensors (its scales' dtype and rounding differ), and a speed vramplan has not "
                     "measured")
    code = "\n".join(["import torch", f"from transformers import {', '.join(imports)}", *extra, "", *body])
    return Export(engine=ENGINE, fits=True, text=commented(notes, code), notes=tuple(notes),
                  details={"weight_quant": c.weight_quant, "kv_dtype": c.kv_dtype})


def row(spec: ModelSpec, hw: HardwareProfile, q: Plan, plan_decode: float | None, notes=()) -> EngineAnswer:
    """Plain transformers' plan as its row: every layer on a GPU at vramplan's eager prediction (the same kernels);
    accelerate's device_map hooks and the CPU not priced (vramplan's stream engine measured 5.06x accelerate's decode
    in bf16 and 16.98x in nf4 on an H200: bench/results/gpu-nvidia-h200*/offload-*)."""
    c = q.choice
    split = q.fits and c.on_gpu and c.gpu_layers < c.total_layers
    priced = q.fits and q.predicted is not None
    return EngineAnswer.of_plan(ENGINE, q, "vramplan plan --engine transformers",
                                RESIDENT_PRICED if priced or not q.fits else q.chosen.reason.split("; ", 1)[-1],
                                plan_decode, extra=", accelerate device_map" if split else "", notes=notes)
