"""Planning for llama.cpp and writing its command: GGUF file type x KV cache type, -ngl, --n-cpu-moe, -ts.

`plan_llamacpp(spec, hw, req)` returns a normal Plan (the same JSON contract as vramplan's) whose every
byte follows llama.cpp's rules (llamacpp_rules.py) and whose sizes are planner/gguf.py's exact GGUF
bytes. Its speed comes from vramplan's roofline over those bytes, labelled as uncalibrated for
llama.cpp. `export_llamacpp` turns a llama.cpp plan, or a vramplan plan mapped to its closest GGUF
file and cache types, into a `llama-server` command. Pure.
"""

from __future__ import annotations

from dataclasses import field, fields, replace
from functools import lru_cache

from ..memo import ObjectMemo
from ..record import record
from ..choice import Choice, ComputeDevice, OffloadMode, experts_in_ram_text
from ..errors import PlanError
from ..gguf import GGUF_FILE_TYPES, gguf_file_bytes, stored_expert_type
from ..gguf_model import HUB_GGUF_PREFIX
from ..hardware import Calibration, CalibrationEntry, HardwareProfile
from ..capacity import capacity
from ..memory import CPUMemory, GPUMemory, LayerCosts, MemoryBreakdown
from ..modelspec import ModelSpec
from ..engine import Outcome, nothing_fits_reasons, plan_with, request_for
from ..plan import Candidate, Plan
from ..quant import SCHEMES, KVScheme, QualityCost
from ..request import LLAMA_CPP_KV_DTYPES, Request, derived
from ..search import check_context, check_experts, check_request
from ..search import secant_max
from ..speed import EXPERTS_BACKEND, PREFILL_ATTENTION_BACKEND, SpeedEstimate, estimate, speed_constants, ttft_s
from ..units import MiB, format_bytes
from ..work import ReadBytes, experts_touched
from . import llamacpp_rules as rules
from ..quoting import file_stem, shell_quote
from .common import (EngineAnswer, EngineConstant, Export, assumption_notes, commented, first_moe_layers, is_local,
                     shell_command)

ENGINE = "llama.cpp"
SPEED_LABEL = "llama.cpp speed is predicted with vramplan's roofline; uncalibrated for llama.cpp"
# The speed model reads efficiencies by scheme name; llama.cpp's kernels get the defaults of unquantized weights
# under backend "llama.cpp", so a calibration with entries for that backend applies and none other does.
SPEED_SCHEME = replace(SCHEMES["bf16"], backend="llama.cpp", description="GGUF weights run by llama.cpp")
# llama.cpp's kernels are its own: its speed uses only calibration entries measured on llama.cpp
# (bench/llamacpp_serve.py --fit): backend "llama.cpp" per GGUF file type for the weights, "attn-llama.cpp" and
# "prefill-attn-llama.cpp" for its flash-attention kernels. Never those of vramplan's torch runtime; without them, the
# speed model's defaults.
ATTENTION_IMPL = "llama.cpp"
# The calibration's versions name the llama.cpp build ("llama.cpp") and when its entries were fitted (this key): the
# calibration's own measured_at is that of vramplan's runtime.
MEASURED_AT_VERSION = "llama.cpp measured_at"
LLAMA_CPP_BACKENDS = (SPEED_SCHEME.backend, f"attn-{ATTENTION_IMPL}", f"{PREFILL_ATTENTION_BACKEND}-{ATTENTION_IMPL}")
# On a GPU without llama.cpp calibration entries its speed takes the profile's public_fit (engine "llama.cpp"), fitted
# to published llama.cpp CUDA runs (planner/public_gpu, bench/public_gpu.py) per group of file types: the decode
# kernels of one group run at one efficiency (dequantizing fewer bits costs more per byte read: Q2_K decoded slower
# than Q4_0 on the same V100). A group without a fitted entry borrows the nearest fitted one's (FIT_GROUPS runs widest
# to narrowest).
# The IQ1-IQ3 and ternary types decode through codebook lookups (their own kernels): no public record of them was found
# (planner/public_gpu), so their group borrows Q2-Q3's fit and says so.
FIT_GROUPS = {"F16": ("F16", "BF16"), "Q8_0": ("Q8_0",), "Q5-Q6": ("Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0"),
              "Q4": ("Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS", "MXFP4_MOE"),
              "Q2-Q3": ("Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "Q2_K_S"),
              "IQ1-IQ3": ("IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M",
                          "IQ1_S", "TQ2_0", "TQ1_0")}


def fit_group(file_type: str) -> str:
    """The FIT_GROUPS group of a GGUF file type."""
    return next(g for g, types in FIT_GROUPS.items() if file_type in types)


def fitted_entry(hw: HardwareProfile, file_type: str):
    """The profile's public_fit entry for this file type's group, else the nearest fitted group's (None: none)."""
    fit = hw.public_fit
    if fit is None:
        return None
    order = list(FIT_GROUPS)
    mine = order.index(fit_group(file_type))
    fitted = [(abs(order.index(e.quant) - mine), order.index(e.quant), e) for e in fit.entries
              if e.engine == ENGINE and e.quant in FIT_GROUPS]
    return min(fitted, key=lambda x: x[:2])[2] if fitted else None


# llamacpp_rules.QUALITY_STAND_IN: the listed row a file type without one is ranked by.
QUALITY_STAND_IN = rules.QUALITY_STAND_IN


def stand_in(file_type: str, spec: ModelSpec | None = None) -> str:
    """The perplexity row a file type is ranked by: its own, else QUALITY_STAND_IN's. A checkpoint whose experts are
    stored MXFP4 (gpt-oss) keeps them at every file type (planner/gguf.py stored_expert_type): its F16 file is the
    model as published, and MXFP4_MOE changes only the rest, to Q8_0 (Q8_0's row)."""
    if spec is not None and stored_expert_type(spec) is not None and file_type == "MXFP4_MOE":
        return "Q8_0"
    return file_type if file_type in rules.FILE_TYPE_DELTA_PPL else QUALITY_STAND_IN[file_type]


def quality_cost_pct(file_type: str, kv_type: str, spec: ModelSpec | None = None) -> float:
    """llama.cpp's quality cost of a file type and cache type, through its stand-in where the table has no row."""
    return rules.quality_cost_pct(stand_in(file_type, spec), kv_type)


def engine_constants(hw: HardwareProfile, file_types=(), kv_types=(), spec: ModelSpec | None = None) -> dict:
    """rules.constants for these file and cache types, a stand-in's quality row in place of a file type the
    perplexity table lacks, each stand-in named as the assumption it is."""
    listed = tuple(dict.fromkeys(stand_in(t, spec) for t in file_types))
    out = rules.constants(hw.name, hw.overheads.cuda_context_bytes if hw.has_gpu else 0, listed, kv_types,
                          has_gpu=hw.has_gpu)
    for t in file_types:
        if t not in rules.FILE_TYPE_DELTA_PPL:
            why = rules.NO_PERPLEXITY_ROW.get(t, "")
            out[f"quality_stand_in_{t}"] = EngineConstant(stand_in(t, spec), f"{t} has no row in the perplexity "
                                                          "table: the quality cost of this listed type "
                                                          + ("(the experts are stored MXFP4 in the checkpoint: only "
                                                             "the rest changes, to Q8_0)" if stand_in(t, spec) == "Q8_0"
                                                             else "of its size") + (f" ({why})" if why else "")
                                                          + " (planner/engines/llamacpp.py QUALITY_STAND_IN)",
                                                          assumption=True)
    return out


# The conventional name of a community GGUF repository (stated as a convention: it may not exist).
GGUF_REPO_CONVENTION = "bartowski/{name}-GGUF"


@record(kw_only=True)
class LlamaCppChoice(Choice):
    """A Choice in llama.cpp's own names: a GGUF file type and a llama.cpp KV cache type. Choice's placement rules
    apply unchanged; the decoder layers on the GPUs are the LAST gpu_layers ones (llama.cpp's -ngl)."""

    engine: str = ENGINE

    def __post_init__(self) -> None:
        if self.weight_quant not in GGUF_FILE_TYPES:
            raise PlanError(f"choice.weight_quant: unknown GGUF file type {self.weight_quant!r}")
        if self.kv_dtype not in LLAMA_CPP_KV_DTYPES:
            raise PlanError(f"choice.kv_dtype: unknown llama.cpp KV cache type {self.kv_dtype!r}")
        names = {f.name for f in fields(Choice)}
        stand_in = Choice(**{n: getattr(self, n) for n in names} | {"weight_quant": "bf16", "kv_dtype": "bf16"})
        for n in names - {"weight_quant", "kv_dtype"}:
            object.__setattr__(self, n, getattr(stand_in, n))

    def to_dict(self) -> dict:
        return {**super().to_dict(), "engine": self.engine}


@lru_cache(maxsize=None)
def kv_scheme(kv_type: str) -> KVScheme:
    t = rules.KV_GGML_TYPES[kv_type]
    return KVScheme(name=kv_type, description=f"llama.cpp {kv_type} KV cache ({t.block_bytes} B per "
                                              f"{t.block_elements})",
                    bytes_per_element=t.block_bytes / t.block_elements,
                    quality=QualityCost(ppl_increase_pct=rules.KV_QUALITY_PCT_ASSUMED[kv_type],
                                        source="assumption (no published table)"))


@record(kw_only=True)
class Server:
    """The llama-server a plan is for, as far as its memory depends on how it is started: its slots and physical batch
    (rules.Slots), what --fit keeps free per device, the RAM of the processes beside its buffers, and the constants that
    say so. `llama_server(req)` is llama-server as vramplan's export starts it; Ollama starts it its own way."""

    slots: rules.Slots
    margin_bytes: int = rules.FIT_TARGET_MARGIN_BYTES
    base_ram_bytes: int | None = None  # None: llama-server's own (rules.process_base_ram)
    constants: dict = field(default_factory=dict)  # name -> EngineConstant, beside llama.cpp's


def llama_server(req: Request) -> Server:
    return Server(slots=rules.llama_server_slots(req))


def footprint(spec, hw, req, model, kv_type, server: Server | None = None) -> rules.LlamaCppFootprint:
    """Every byte of llama-server (as `server` starts it; as vramplan's export does by default)."""
    server = server or llama_server(req)
    cuda = hw.overheads.cuda_context_bytes if hw.has_gpu else 0
    base = server.base_ram_bytes if server.base_ram_bytes is not None else rules.process_base_ram(hw.has_gpu)
    return rules.LlamaCppFootprint(spec, model, kv_type, req, capacity(hw, req), cuda, server.margin_bytes,
                                   slots=server.slots, base_ram_bytes=base)


def _choice(spec: ModelSpec, hw: HardwareProfile, fp: rules.LlamaCppFootprint,
            p: rules.LlamaCppPlacement) -> LlamaCppChoice:
    L = spec.num_layers
    per_device = list(p.per_device)
    if p.per_device:  # the output slot is no decoder layer
        last = max(i for i, n in enumerate(per_device) if n)
        per_device[last] -= 1
    on_gpu = hw.has_gpu
    in_ram = rules.moe_layers_in_ram(spec, p.cpu_moe) if on_gpu else []
    return LlamaCppChoice(weight_quant=fp.model.file_type, kv_dtype=fp.kv_type,
                          gpu_layers=p.gpu_layers if on_gpu else 0,
                          total_layers=L, offload=OffloadMode.CPU if on_gpu and p.gpu_layers < L else OffloadMode.NONE,
                          compute_device=ComputeDevice(hw.accelerator) if on_gpu else ComputeDevice.CPU,
                          embeddings_on_gpu=False, gpu_layers_per_device=tuple(per_device) if on_gpu else (),
                          moe_layers=len(spec.moe.moe_layers) if spec.moe is not None else 0,
                          expert_layers_on_cpu=len(in_ram), expert_layers_in_ram=tuple(in_ram))


def _breakdown(hw: HardwareProfile, fp: rules.LlamaCppFootprint, p: rules.LlamaCppPlacement) -> MemoryBreakdown:
    """Each GPU's terms (its layers, their KV, its compute buffer, its context and --fit margin), the host's, and the
    compute buffers apart."""
    host = fp.host_bytes(p)
    capacities = list(fp.cap.gpus)
    devices = fp.device_bytes(p) if p.per_device else []
    devices += [rules.DeviceBytes(weights=0, kv=0, compute=0)] * (len(capacities) - len(devices))
    gpus = tuple(GPUMemory(weights_bytes=d.weights, kv_cache_bytes=d.kv, stream_buffers_bytes=0,
                           workspace_bytes=d.compute, cuda_context_bytes=fp.cuda_context_bytes,
                           allocator_reserve_bytes=0, headroom_bytes=fp.margin_bytes, capacity_bytes=cap)
                 for d, cap in zip(devices, capacities))
    cpu = CPUMemory(weights_bytes=host.weights, kv_cache_bytes=host.kv, workspace_bytes=host.compute,
                    runtime_base_bytes=fp.base_ram_bytes, capacity_bytes=fp.ram_for(p))
    return MemoryBreakdown(gpus=gpus, cpu=cpu, workspace_terms={
        "compute_buffers_gpu": sum(d.compute for d in devices), "compute_buffer_host": host.compute - fp.output_buffer,
        "output_buffer_host": fp.output_buffer})


def gguf_layer_costs(fp: rules.LlamaCppFootprint) -> LayerCosts:
    return LayerCosts(weights=fp.model.layers, kv=tuple(fp.kv), embed_bytes=fp.model.token_embd_bytes,
                      head_bytes=fp.model.output_bytes)


def gguf_read_bytes(spec: ModelSpec, model: rules.GGUFModel, batch: int) -> ReadBytes:
    """GGUF bytes a decode step reads per layer: routed experts only for the experts the batch routes to. The same
    object for the same model, file and batch (the last few kept)."""
    return _READ_BYTES.get((spec, model), (batch,), lambda: _gguf_read_bytes(spec, model, batch))


_READ_BYTES = ObjectMemo(64)


def _gguf_read_bytes(spec: ModelSpec, model: rules.GGUFModel, batch: int) -> ReadBytes:
    frac = 1.0
    if spec.moe is not None:
        frac = 1.0 - (1.0 - spec.moe.experts_per_token / spec.moe.num_experts) ** batch
    return ReadBytes(total=[(w - e) + e * frac for w, e in zip(model.layers, model.experts)],
                     experts=[e * frac for e in model.experts])


def max_resident_context(spec, hw, req, model, kv_type, server: Server) -> int:
    """The longest context with every layer (and, on a GPU, the output layer) resident on the GPUs or in RAM."""
    def probe(ctx: int) -> tuple[bool, float]:
        fp = footprint(spec, hw, derived(req, context=ctx, prompt_tokens=None), model, kv_type, server)
        p = (fp.pack(spec.num_layers, 0) if hw.has_gpu
             else rules.LlamaCppPlacement(gpu_layers=0, cpu_moe=0, per_device=()))
        return p is not None and fp.fits_host(p), fp.resident_slack()

    return max(0, secant_max(probe, 1, spec.max_context or req.context))


def speed_hardware(hw: HardwareProfile, spec: ModelSpec, file_type: str, kv_type: str = "f16"
                   ) -> tuple[HardwareProfile, str]:
    """`hw` as llama.cpp's speed sees it (speed_view) and what the prediction rests on (_speed_hardware)."""
    return speed_view(hw, spec, file_type, kv_type), _speed_hardware(hw, spec, file_type, kv_type)[1]


def speed_view(hw: HardwareProfile, spec: ModelSpec, file_type: str, kv_type: str = "f16") -> HardwareProfile:
    """_speed_hardware's profile, one object for every file type and cache that see the same entries (the last few
    kept): most do (a profile calibrated on a few file types, a public fit per file-type group), and the speed model's
    memos know a machine by its object."""
    cal = hw.calibration
    nearest = (_nearest_measured(cal, "gpu", file_type), _nearest_measured(cal, "cpu", file_type)) if cal else ()
    fit = (fitted_entry(hw, file_type) if hw.has_gpu and hw.public_fit is not None and not (nearest and nearest[0])
           else None)
    # the entries by identity (objects of `hw`, which the memo's entry holds): hashing a record is a Python call
    key = (*map(id, nearest), kv_type if cal is not None else None, id(fit))
    return _VIEWS.get((hw, spec), key, lambda: _speed_hardware(hw, spec, file_type, kv_type)[0])


_VIEWS = ObjectMemo(64)


def _nearest_measured(cal: Calibration, device: str, file_type: str) -> CalibrationEntry | None:
    """The calibration's llama.cpp weights entry on `device` nearest to `file_type` (GGUF_FILE_TYPES' order), if any."""
    order = _FILE_TYPE_ORDER
    mine = [e for e in cal.entries if e.device == device and e.backend == SPEED_SCHEME.backend and e.quant in order]
    return min(mine, key=lambda e: (abs(order[e.quant] - order[file_type]), e.quant)) if mine else None


_FILE_TYPE_ORDER = {t: i for i, t in enumerate(GGUF_FILE_TYPES)}


def _speed_hardware(hw: HardwareProfile, spec: ModelSpec, file_type: str, kv_type: str) -> tuple[HardwareProfile, str]:
    """`hw` as llama.cpp's speed sees it: its calibration reduced to the llama.cpp entries, under the keys the speed
    model looks up (SPEED_SCHEME's weights, this model's attention implementation; routed experts at the weights'
    efficiency with no cost per expert: ggml computes them in one op), and what the prediction rests on. A file type
    without an entry of its own borrows the nearest measured one's (GGUF_FILE_TYPES runs largest to smallest); attention
    entries are per cache type (quant "bf16" for f16: flash attention dequantizes a q8_0 / q4_0 cache as it reads it),
    and a cache type without its own borrows f16's."""
    cal = hw.calibration
    entries: list[CalibrationEntry] = []
    said: list[str] = []
    for device in ("gpu", "cpu"):
        weights = _nearest_measured(cal, device, file_type) if cal is not None else None
        if weights is None:
            if device == "gpu" and hw.has_gpu and cal is not None and any(
                    e.backend == SPEED_SCHEME.backend for e in cal.entries):
                said.append("none for the GPU: its defaults there")
            continue
        if weights.quant != file_type:
            said.append(f"{file_type} borrows {weights.quant}'s on the {device.upper()}")
        entries += [replace(weights, quant=SPEED_SCHEME.name),
                    CalibrationEntry(device=device, backend=EXPERTS_BACKEND, quant=SPEED_SCHEME.name,
                                     bandwidth_efficiency=weights.bandwidth_efficiency, compute_efficiency=None)]
        for kind in ("attn", PREFILL_ATTENTION_BACKEND):
            e = cal.lookup(device, f"{kind}-{ATTENTION_IMPL}", cache_entry(kv_type))
            if e is None and kv_type != "f16":
                e = cal.lookup(device, f"{kind}-{ATTENTION_IMPL}", cache_entry("f16"))
                if e is not None:
                    said.append(f"the {kv_type} cache's {kind} borrows f16's on the {device.upper()}")
            if e is not None:
                entries.append(replace(e, backend=f"{kind}-{spec.attention_impl}", quant="bf16"))
    public, said_fit = _public_fit_for_speed(hw, file_type, gpu_calibrated=any(e.device == "gpu" for e in entries))
    if not entries:
        return replace(hw, calibration=None, public_fit=public), (said_fit or SPEED_LABEL)
    versions = cal.versions_dict
    when = versions.get(MEASURED_AT_VERSION, cal.measured_at)
    label = (f"llama.cpp speed is predicted with efficiencies calibrated on llama.cpp ({when}, build "
             f"{versions.get('llama.cpp', 'unknown')[:9]})")
    return (replace(hw, calibration=replace(cal, entries=tuple(entries), measured_at=when), public_fit=public),
            "; ".join([label, *said, *([said_fit] if said_fit else [])]))


def _public_fit_for_speed(hw: HardwareProfile, file_type: str, *, gpu_calibrated: bool):
    """The profile's public_fit reduced to the llama.cpp entry for this file type (the one the speed model then finds
    for SPEED_SCHEME: speed.fitted_entry), and what the GPU's speed rests on; (None, "") where a calibration measured
    llama.cpp on the GPU or nothing was fitted."""
    entry = None if gpu_calibrated or not hw.has_gpu else fitted_entry(hw, file_type)
    if entry is None:
        return None, ""
    group = fit_group(file_type)
    borrowed = f" ({file_type} borrows the {entry.quant} group's)" if entry.quant != group else ""
    said = (f"llama.cpp speed on the GPU is predicted with constants {entry.source} of llama.cpp's CUDA backend on "
            f"{hw.public_fit.gpu_class.upper()} GPUs, GGUF file-type group {entry.quant}{borrowed}")
    return replace(hw.public_fit, entries=(entry,)), said


def cache_entry(kv_type: str) -> str:
    """The quant of the attention entries for a llama.cpp cache type ("bf16", as calibration.fit names it, for f16)."""
    return "bf16" if kv_type == "f16" else kv_type


def forced_cpu_moe(spec: ModelSpec, req: Request) -> int | None:
    """--n-cpu-moe for a forced --expert-placement (it counts decoder layers from the first, dense ones included: the
    experts of MoE layers below it stay in RAM), or None when the search chooses."""
    if req.expert_placement is None:
        return None
    moe = sorted(spec.moe.moe_layers) if spec.moe is not None else []
    return rules.n_cpu_moe(moe[:req.forced_expert_layers(len(moe))])


def candidate(spec, hw, req, model: rules.GGUFModel, kv_type: str, server: Server, contexts: bool = True
              ) -> Candidate:
    fp = footprint(spec, hw, req, model, kv_type, server)
    placement, closest = fp.place(req.gpu_layers, forced_cpu_moe=forced_cpu_moe(spec, req))
    p = placement or closest
    choice, mem = _choice(spec, hw, fp, p), _breakdown(hw, fp, p)
    base = dict(weight_quant=model.file_type, kv_dtype=kv_type,
                quality_cost_pct=quality_cost_pct(model.file_type, kv_type, spec), choice=choice, memory=mem,
                max_context_tokens=max_resident_context(spec, hw, req, model, kv_type, server) if contexts else 0)
    if placement is None:
        return Candidate(**base, fits=False, reason=_overflow_reason(fp, p, req.gpu_layers))
    fast_hw = speed_view(hw, spec, model.file_type, kv_type)
    run_req = derived(req, prefill_chunk=server.slots.n_ubatch)
    speed = estimate(rules.as_run(spec), fast_hw, run_req, SPEED_SCHEME, kv_scheme(kv_type), choice,
                     gguf_layer_costs(fp), gguf_read_bytes(spec, model, req.batch))
    inner = speed  # the prompt's time under op offload when first read: the decode is the same
    speed = SpeedEstimate.pending(inner.decode_tokens_per_s,
                                  lambda: with_op_offload(spec, fast_hw, run_req, kv_type, choice, fp, inner))
    return Candidate(**base, fits=True, speed=speed, reason=_placement_reason(fp, p))


def weights_in_ram_per_ubatch(spec: ModelSpec, choice: LlamaCppChoice, fp: rules.LlamaCppFootprint,
                              tokens: int) -> float:
    """The bytes of weights in RAM one ubatch of `tokens` tokens copies to the GPU under op offload: every layer left on
    the CPU, and the routed experts in RAM of the others, of which only those its tokens reach
    (rules.OP_OFFLOAD_MIN_BATCH)."""
    reached = experts_touched(spec, tokens) / spec.moe.num_experts if spec.moe is not None else 0.0
    first = spec.num_layers - choice.gpu_layers  # layers [0, first) in RAM (-ngl keeps the last ones on the GPU)
    moved = fp.pw[first] - fp.px[first] + fp.px[first] * reached
    return moved + sum(fp.model.experts[i] for i in choice.expert_layers_in_ram if i >= first) * reached


def with_op_offload(spec: ModelSpec, hw: HardwareProfile, req: Request, kv_type: str, choice: LlamaCppChoice,
                    fp: rules.LlamaCppFootprint, speed: SpeedEstimate) -> SpeedEstimate:
    """The prompt's time as llama.cpp takes it with weights in RAM (rules.OP_OFFLOAD_MIN_BATCH): each ubatch (-ub
    tokens of the req.batch prompts together) of at least that many tokens runs on the GPU as if every layer were
    there, plus its weights in RAM over the link at the pageable rate (mmap); a last ubatch below it runs where the
    weights are, as `speed` costs it. Decode (req.batch tokens a step) is left as `speed` has it: below the threshold
    its ops stay on the CPU. Not counted: the KV rows of layers in RAM that their attention reads on the GPU."""
    if not choice.on_gpu or hw.link is None:
        return speed
    ub, total = fp.slots.n_ubatch, req.prompt * req.batch
    rem = total % ub
    tail = rem if rem < rules.OP_OFFLOAD_MIN_BATCH else 0  # tokens of a last ubatch too small to offload
    if total - tail <= 0:
        return speed
    per_ubatch = weights_in_ram_per_ubatch(spec, choice, fp, min(ub, total))
    if not per_ubatch:
        return speed
    L = spec.num_layers
    per_device = list(choice.gpu_layers_per_device) or [0]
    per_device[-1] += L - choice.gpu_layers
    resident = replace(choice, gpu_layers=L, gpu_layers_per_device=tuple(per_device), offload=OffloadMode.NONE,
                       expert_layers_on_cpu=0, expert_layers_in_ram=())
    ubatches = -(-(total - tail) // ub)
    costs, read = gguf_layer_costs(fp), gguf_read_bytes(spec, fp.model, req.batch)
    run, kv = rules.as_run(spec), kv_scheme(kv_type)
    on_gpu_s = ttft_s(run, hw, req, SPEED_SCHEME, kv, resident, costs, read) * (total - tail) / total
    link_s = ubatches * per_ubatch / hw.link.h2d_pageable_bytes_per_s
    tail_s = (ttft_s(run, hw, derived(req, prompt_tokens=-(-tail // req.batch)), SPEED_SCHEME, kv, choice, costs, read)
              if tail else 0.0)
    ttft = on_gpu_s + link_s + tail_s
    terms = {**speed.terms, "op_offload_ubatches": ubatches, "op_offload_bytes_per_ubatch": per_ubatch,
             "op_offload_link_s": link_s, "op_offload_gpu_s": on_gpu_s, "op_offload_cpu_tail_s": tail_s,
             "ttft_s_without_op_offload": speed.ttft_s}
    return replace(speed, ttft_s=ttft, prefill_tokens_per_s=total / ttft, terms=terms)


def op_offload_notes(hw: HardwareProfile, speed: SpeedEstimate) -> list[str]:
    """What the TTFT of a plan with weights in RAM rests on (with_op_offload), in words."""
    t = speed.terms
    if "op_offload_link_s" not in t:
        return []
    return [f"prompt processing with weights in RAM: llama.cpp runs each ubatch of at least "
            f"{rules.OP_OFFLOAD_MIN_BATCH} tokens on the GPU (op offload), copying "
            f"{format_bytes(int(t['op_offload_bytes_per_ubatch']))} of weights from RAM for each of its "
            f"{t['op_offload_ubatches']} ubatches: TTFT {speed.ttft_s:.2f} s = GPU {t['op_offload_gpu_s']:.2f} s "
            f"+ link {t['op_offload_link_s']:.2f} s at {hw.link.h2d_pageable_bytes_per_s / 1e9:g} GB/s (pageable: "
            f"mmapped weights)" + (f" + a last short ubatch on the CPU {t['op_offload_cpu_tail_s']:.2f} s"
                           if t["op_offload_cpu_tail_s"] else "")
            + f", not the {t['ttft_s_without_op_offload']:.2f} s the CPU would take; the KV rows of layers in RAM "
            "crossing the link are not counted"]


def _overflow_reason(fp: rules.LlamaCppFootprint, p: rules.LlamaCppPlacement, forced: int | None) -> str:
    host = fp.host_total(p)
    if host > fp.ram_for(p):
        shared = " (unified memory: what the GPU holds comes out of it)" if fp.cap.unified else ""
        return (f"RAM needs {format_bytes(host)} > {format_bytes(fp.ram_for(p))}{shared} with -ngl {p.ngl} "
                f"({p.gpu_layers} of {fp.L} layers on the GPU)")
    usable = format_bytes(max(fp.usable, default=0))
    if forced is not None:
        return f"{min(forced, fp.L)} layers and the output layer do not fit the GPUs ({usable} usable per device)"
    return f"the GPUs cannot hold even the output layer ({usable} usable per device)"


def _placement_reason(fp: rules.LlamaCppFootprint, p: rules.LlamaCppPlacement) -> str:
    L = fp.L
    if not fp.usable:
        return (f"all {L} layers computed by the CPU (no GPU): RAM {format_bytes(fp.host_total(p))} of "
                f"{format_bytes(fp.ram_for(p))}")
    devices = fp.device_bytes(p) if p.per_device else []
    per_dev = "; ".join(f"GPU {i}: {format_bytes(d.weights + d.kv + d.compute)} of {format_bytes(u)} usable "
                        f"(weights {format_bytes(d.weights)} + KV {format_bytes(d.kv)} + compute "
                        f"{format_bytes(d.compute)})"
                        for i, (d, u) in enumerate(zip(devices, fp.usable)) if p.per_device[i])
    where = (f"all {L} layers and the output layer on the GPU (-ngl {p.ngl})" if p.gpu_layers == L else
             f"layers {L - p.gpu_layers}-{L - 1} and the output layer on the GPU, 0-{L - p.gpu_layers - 1} computed "
             f"by the CPU (-ngl {p.ngl})" if p.gpu_layers else f"every layer computed by the CPU (-ngl {p.ngl})")
    in_ram = rules.moe_layers_in_ram(fp.spec, p.cpu_moe)
    moe = (f", experts of {experts_in_ram_text(len(in_ram), len(fp.spec.moe.moe_layers), in_ram)} in RAM "
           f"(--n-cpu-moe {p.cpu_moe})" if in_ram else "")
    usable = (f"usable = memory - CUDA context {format_bytes(fp.cuda_context_bytes)} - --fit margin "
              f"{format_bytes(fp.margin_bytes)}")
    left = " left beside the GPU's share (unified memory)" if fp.cap.unified else ""
    return (f"{where}{moe}: {per_dev or 'nothing on the GPU'} ({usable}); RAM {format_bytes(fp.host_total(p))} of "
            f"{format_bytes(fp.ram_for(p))}{left}")


class LlamaCppEngine:
    """llama.cpp behind the Engine protocol (planner.engine): GGUF file types x its KV cache types, each placed as
    llama-server's --fit places it (-ngl, --n-cpu-moe, -ts) for llama-server as `server` starts it (as vramplan's
    export does by default), priced with llama.cpp's constants."""

    name = ENGINE
    rules_label = " llama.cpp's rules"

    def __init__(self, server: Server | None = None) -> None:
        self.server = server

    def server_for(self, req: Request) -> Server:
        return self.server or llama_server(req)

    def file_types(self, spec: ModelSpec, req: Request) -> tuple[str, ...]:
        if spec.gguf is not None:
            return gguf_file_types(spec, req)
        if req.quant:
            return req.quant
        if stored_expert_type(spec) is not None:  # gpt-oss: the file as published (experts MXFP4, the rest 16-bit)
            return ("F16", "MXFP4_MOE", *rules.PLANNED_FILE_TYPES)
        return rules.PLANNED_FILE_TYPES

    def caches(self, req: Request) -> tuple[str, ...]:
        return req.kv_dtype or LLAMA_CPP_KV_DTYPES

    def check(self, spec: ModelSpec, hw: HardwareProfile, req: Request) -> tuple[Request, list[str]]:
        if req.offload is OffloadMode.STREAM:
            raise PlanError("llama.cpp computes the layers it does not offload on the CPU: it has no stream mode "
                            "(drop --offload stream)")
        check_request(hw, req)  # the checks every engine shares: a budget beyond the hardware, GPU options without one
        check_experts(spec, req)
        return req, check_context(spec, req)

    def candidates(self, spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True
                   ) -> list[Candidate]:
        server, caches = self.server_for(req), self.caches(req)
        return [candidate(spec, hw, req, model, kv, server, contexts)
                for model in (rules.gguf_model(spec, ft) for ft in self.file_types(spec, req)) for kv in caches]

    def resident_context(self, spec: ModelSpec, hw: HardwareProfile, req: Request, chosen: Candidate) -> int:
        return max_resident_context(spec, hw, req, rules.gguf_model(spec, chosen.weight_quant), chosen.kv_dtype,
                                     self.server_for(req))

    def engine_constants(self, spec: ModelSpec, hw: HardwareProfile, req: Request) -> dict[str, EngineConstant]:
        return {**engine_constants(hw, self.file_types(spec, req), self.caches(req), spec),
                **self.server_for(req).constants}

    def constants(self, spec, hw, req, cands) -> dict:
        return {k: c.for_plan() for k, c in self.engine_constants(spec, hw, req).items()}

    def nothing_fits(self, spec, hw, req, cands) -> Outcome:
        first = cands[0]
        return Outcome(reasons=nothing_fits_reasons(cands, self.rules_label)[:1],
                       warnings=[speed_hardware(hw, spec, first.weight_quant, first.kv_dtype)[1],
                                 *assumption_notes(self.engine_constants(spec, hw, req))])

    def explain(self, spec, hw, req, chosen: Candidate) -> Outcome:
        fast_hw, speed_label = speed_hardware(hw, spec, chosen.weight_quant, chosen.kv_dtype)
        file_bytes = gguf_file_bytes(spec, chosen.weight_quant)
        return Outcome(
            constants=speed_constants(fast_hw, SPEED_SCHEME, "gpu" if chosen.choice.on_gpu else "cpu"),
            warnings=[speed_label, *op_offload_notes(hw, chosen.speed),
                      *assumption_notes(self.engine_constants(spec, hw, req))],
            reasons=[f"GGUF {chosen.weight_quant}: {file_bytes:,} B file ({format_bytes(file_bytes)}; planner/gguf.py, "
                     "llama-quantize's tensor types)"])


LLAMA_CPP = LlamaCppEngine()


def plan_llamacpp(spec: ModelSpec, hw: HardwareProfile, req: Request, server: Server | None = None, *,
                  contexts: bool = True) -> Plan:
    """Decide how llama.cpp runs `spec` on `hw` for `req` (planner.engine's loop): the GGUF file type, the KV cache
    type and -ngl, for llama-server as `server` starts it (as vramplan's export does by default)."""
    return plan_with(LlamaCppEngine(server) if server is not None else LLAMA_CPP, spec, hw, req, contexts=contexts)


# ---------------------------------------------------------------- the command
def gguf_file_name(spec: ModelSpec, file_type: str) -> str:
    """The GGUF file an export suggests writing: a safe file name made from the model's (common.file_stem); the file
    itself where the model was read from one."""
    if spec.gguf is not None:
        return spec.location
    return f"{file_stem(spec.name)}-{file_type}.gguf"


def gguf_file_types(spec: ModelSpec, req: Request) -> tuple[str, ...]:
    """The file type of the GGUF file the model was read from: the only one its plans take (another would be another
    file); a forced other --quant is refused in one line."""
    have = spec.gguf.file_type
    other = [q for q in req.quant if q != have]
    if other:
        raise PlanError(f"{spec.location} is a {have} GGUF file: --quant {','.join(other)} would be another file "
                        "(plan the model it was converted from to choose a file type)")
    return (have,)


def llama_server_command(spec: ModelSpec, p: Plan) -> list[str]:
    c, r = p.choice, p.request
    name = gguf_file_name(spec, c.weight_quant)
    hub = spec.gguf is not None and name.startswith(HUB_GGUF_PREFIX)  # llama-server fetches it: -hf org/repo:TYPE
    argv = ["llama-server", *(("-hf", name.removeprefix(HUB_GGUF_PREFIX)) if hub else ("-m", name)), "-c",
            str(r.context * r.batch)]
    slots = list(c.gpu_layers_per_device)
    if c.on_gpu:
        last = max((i for i, n in enumerate(slots) if n), default=0)
        slots[last] += 1  # the output layer rides with the last decoder layers
    argv += ["-ngl", str(sum(slots) if c.on_gpu else 0)]
    if len(slots) > 1:
        argv += ["-ts", ",".join(str(n) for n in slots)]
    if c.expert_layers_on_cpu:
        argv += ["--n-cpu-moe", str(rules.n_cpu_moe(first_moe_layers(spec, c.expert_layers_on_cpu)))]
    argv += ["-fa", "on"]
    if c.kv_dtype != "f16":
        argv += ["-ctk", c.kv_dtype, "-ctv", c.kv_dtype]
    if r.batch > 1:
        argv += ["-np", str(r.batch)]
    cache = prompt_cache_mib(p)
    if cache < rules.PROMPT_CACHE_DEFAULT_MIB:
        argv += ["--cache-ram", str(cache)]
    return argv


def prompt_cache_mib(p: Plan) -> int:
    """llama-server's prompt cache in RAM (--cache-ram): its default, or what the plan leaves free when that is less."""
    return min(rules.PROMPT_CACHE_DEFAULT_MIB, max(0, p.memory.cpu.free_bytes) // MiB)


def export_from_llamacpp_plan(spec: ModelSpec, hw: HardwareProfile, p: Plan, extra_notes=()) -> Export:
    """The llama-server command for a plan made by llama.cpp's rules."""
    consts = engine_constants(hw, (p.choice.weight_quant,) if p.fits else (), (p.choice.kv_dtype,) if p.fits else (),
                              spec)
    if not p.fits:
        text = commented([*extra_notes, f"llama.cpp: {p.reasons[0]}"], "# no llama-server command: nothing fits")
        return Export(engine=ENGINE, fits=False, text=text, notes=tuple([*extra_notes, *p.reasons]), constants=consts)
    c = p.choice
    name = gguf_file_name(spec, c.weight_quant)
    repo = GGUF_REPO_CONVENTION.format(name=file_stem(spec.name))
    checkpoint = shell_quote(spec.location) if is_local(spec) else f"<the {spec.name} checkpoint directory>"
    if spec.gguf is not None:
        about = [f"GGUF {c.weight_quant}: {name}, {spec.gguf.file_bytes:,} B ({format_bytes(spec.gguf.file_bytes)}"
                 f"{f' in {spec.gguf.splits} parts' if spec.gguf.splits > 1 else ''}; its own tensors' types and "
                 "bytes, read from its header)"]
    else:
        about = [f"GGUF {c.weight_quant}: {name}, {gguf_file_bytes(spec, c.weight_quant):,} B "
                 f"({format_bytes(gguf_file_bytes(spec, c.weight_quant))}; planner/gguf.py: llama-quantize's tensor "
                 "types)",
                 f"where to get it: GGUF repositories are conventionally named like {repo} (a naming convention, not "
                 f"a promise that it exists), or convert: convert_hf_to_gguf.py {checkpoint}, then llama-quantize "
                 f"<f16.gguf> {name} {c.weight_quant}"]
    notes = [*extra_notes, *about,
             p.chosen.reason,
             "-fa on: flash attention (llama.cpp refuses a quantized V cache without it, src/llama-context.cpp); "
             "the plan sized the cache with it"]
    cache = prompt_cache_mib(p)
    notes.append(f"llama-server keeps finished prompts' KV state in RAM up to --cache-ram, default "
                 f"{rules.PROMPT_CACHE_DEFAULT_MIB} MiB: " + (
                     "that fits in what the plan leaves free" if cache == rules.PROMPT_CACHE_DEFAULT_MIB else
                     f"capped at the {cache} MiB the plan leaves free" if cache else
                     "the plan leaves no RAM free: disabled (--cache-ram 0)"))
    if any(rules.window(spec, a) for a in spec.attention):
        slots = rules.llama_server_slots(p.request)
        each = rules.checkpoint_bytes_max(spec, c.kv_dtype, p.request, slots)
        bound = each * rules.CTX_CHECKPOINTS_DEFAULT * slots.count
        notes.append(f"sliding-window layers: llama-server also keeps up to {rules.CTX_CHECKPOINTS_DEFAULT} context "
                     f"checkpoints per slot in RAM (--ctx-checkpoints), each at most {format_bytes(each)} (one "
                     f"sequence's window caches): at most {format_bytes(bound)} for {slots.count} slots, as prompts "
                     "come; not in the plan")
    if c.on_gpu and c.gpu_layers < c.total_layers:
        notes.append(f"llama.cpp decodes the {c.total_layers - c.gpu_layers} layers left in RAM on the CPU; a prompt's "
                     f"ubatches of {rules.OP_OFFLOAD_MIN_BATCH}+ tokens copy their weights to the GPU (op offload)")
    notes += [speed_hardware(hw, spec, c.weight_quant, c.kv_dtype)[1], *op_offload_notes(hw, p.chosen.speed),
              *assumption_notes(consts)]
    argv = llama_server_command(spec, p)
    return Export(engine=ENGINE, fits=True, text=commented(notes, shell_command(argv)), notes=tuple(notes),
                  constants=consts, details={"argv": argv, "gguf_file": name, "gguf_file_type": c.weight_quant,
                                             "gguf_file_bytes": gguf_file_bytes(spec, c.weight_quant),
                                             "kv_cache_type": c.kv_dtype, "ngl": int(argv[argv.index("-ngl") + 1]),
                                             "expert_layers_on_cpu": c.expert_layers_on_cpu})


def llamacpp_plan_of(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> tuple[Plan, list[str]]:
    """llama.cpp's own plan for the request of `p` (p itself when it is llama.cpp's), and how the request was put in
    llama.cpp's words."""
    if p.request.engine == ENGINE:
        return p, []
    req, notes = request_for(ENGINE, p.request, hw)
    return plan_llamacpp(spec, hw, req), notes


def export_llamacpp(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> Export:
    """--emit llama.cpp: llama.cpp's own plan for the request (its row in the engine table) as a llama-server
    command."""
    q, notes = llamacpp_plan_of(spec, hw, p)
    return export_from_llamacpp_plan(spec, hw, q, notes)


SPEED_FROM = "llama.cpp's speed model (its fitted or default constants)"


def row(spec: ModelSpec, hw: HardwareProfile, q: Plan, plan_decode: float | None, notes=()) -> EngineAnswer:
    """A llama.cpp plan as its row of the engine table."""
    return EngineAnswer.of_plan(ENGINE, q, "vramplan plan --engine llama.cpp", SPEED_FROM, plan_decode, notes=notes)
