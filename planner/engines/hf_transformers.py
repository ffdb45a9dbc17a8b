"""Plain transformers: the from_pretrained snippet closest to a vramplan plan, with comments where it differs.

vramplan's runtime is transformers + bitsandbytes / optimum-quanto plus its own offload engine; plain
transformers has no such engine, so a split plan becomes an accelerate device_map:
- layers mapped to "cpu" are copied to the GPU on every forward (accelerate's hooks, pageable memory, no
  prefetch): neither vramplan's prefetching stream mode nor its CPU-compute mode;
- with bitsandbytes, `llm_int8_enable_fp32_cpu_offload=True` keeps the CPU-mapped layers unquantized in
  the load dtype (2 B/param in bf16), so they take more RAM and move more bytes than the plan's;
- transformers' quanto loader refuses a device_map with CPU entries (runtime/load.py says the same).
The layer and module names come from the model's tensor names. Pure: this writes text, imports nothing.
"""

from __future__ import annotations

from ..choice import OffloadMode
from ..modelspec import ModelSpec, Role
from ..hardware import HardwareProfile
from ..memory import ram_capacity, weight_costs
from ..plan import Plan
from ..request import Request
from ..quant import KV_SCHEMES, SCHEMES
from ..units import format_bytes
from ..quoting import python_fstring, python_str
from .common import EngineAnswer, Export, commented, first_moe_layers, index_range, model_location

ENGINE = "transformers"


def _offloads(c) -> bool:
    """Whether the plan's device_map has CPU entries accelerate offloads."""
    return c.on_gpu and c.offload is not OffloadMode.NONE


def bnb_cpu_ram_bytes(spec: ModelSpec, p: Plan) -> int:
    """Host RAM transformers + accelerate takes for the plan's split: the plan's RAM, with every module mapped to the
    CPU at the load dtype where bitsandbytes quantizes (`llm_int8_enable_fp32_cpu_offload=True` leaves them
    unquantized: the CPU-mapped layers, and the routed experts kept in RAM)."""
    c = p.choice
    s = SCHEMES[c.weight_quant]
    ram = p.memory.cpu.total_bytes
    if s.backend != "bnb" or not c.on_gpu:
        return ram
    quantized, plain = weight_costs(spec, s), weight_costs(spec, SCHEMES[LOAD_SCHEME[s.compute_dtype]])
    offloaded = range(c.gpu_layers, c.total_layers)
    experts = [i for i in first_moe_layers(spec, c.expert_layers_on_cpu) if i < c.gpu_layers]
    return (ram + sum(plain.layers[i] - quantized.layers[i] for i in offloaded)
            + sum(plain.experts[i] - quantized.experts[i] for i in experts))


# The unquantized scheme of each compute dtype: what bitsandbytes leaves a CPU-mapped module in.
LOAD_SCHEME = {"bfloat16": "bf16", "float16": "fp16"}


def _bnb_ram_refusal(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> str | None:
    """Why the plan's split does not fit transformers' RAM (bitsandbytes' unquantized CPU modules), or None."""
    need, capacity = bnb_cpu_ram_bytes(spec, p), ram_capacity(hw, p.request)
    if need <= capacity:
        return None
    return (f"transformers' bitsandbytes offload keeps the CPU-mapped modules unquantized "
            f"({LOAD_SCHEME[SCHEMES[p.choice.weight_quant].compute_dtype]}): RAM needs {format_bytes(need)} of "
            f"{format_bytes(capacity)}")


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


def export_transformers(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> Export:
    if not p.fits:
        notes = ["transformers: vramplan's plan found nothing that fits; no snippet"]
        return Export(engine=ENGINE, fits=False, text=commented(notes, "# no snippet"), notes=tuple(notes))
    c = p.choice
    s = SCHEMES[c.weight_quant]
    notes, fits = [], True
    dtype = "torch.float16" if s.compute_dtype == "float16" else "torch.bfloat16"
    offloads = _offloads(c)
    imports = ["AutoModelForCausalLM"]
    body = []
    if s.quantized:
        name, config = _quantization(c.weight_quant)
        imports.append(name)
        if (offloads or c.expert_layers_on_cpu) and s.backend == "bnb":
            config.append("    llm_int8_enable_fp32_cpu_offload=True,")
            notes.append("transformers' bitsandbytes offload keeps the CPU-mapped modules unquantized in RAM "
                         f"({format_bytes(bnb_cpu_ram_bytes(spec, p))} in all), unlike vramplan's runtime, which "
                         "keeps them quantized")
            if (refusal := _bnb_ram_refusal(spec, hw, p)) is not None:
                fits = False
                notes.append(f"does not fit: {refusal}")
        if offloads and s.backend == "quanto":
            fits = False
            notes.append("transformers' quanto loader refuses a device_map with CPU entries: this snippet raises; "
                         "plain transformers can run this scheme only with every layer on the GPU (or run the plan "
                         "with `vramplan run`)")
        body += ["quantization_config = " + config[0], *config[1:], ")"]
    if c.expert_layers_on_cpu:
        notes.append(f"the experts of {c.expert_layers_on_cpu} layers are mapped to the CPU: accelerate copies them "
                     "to the GPU on every forward, where vramplan's runtime computes them on the CPU")
    if offloads:
        mode = ("streamed to the GPU with prefetch" if c.offload is OffloadMode.STREAM else "computed by the CPU")
        notes.append(f"the {c.offloaded_layers} CPU-mapped layers are copied to the GPU on every forward by accelerate "
                     f"(no prefetch); vramplan's runtime has them {mode}")
    body += _device_map(spec, p)
    args = [f"    {python_str(model_location(spec))},"]
    if s.quantized:
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
    return Export(engine=ENGINE, fits=fits, text=commented(notes, code), notes=tuple(notes),
                  details={"weight_quant": c.weight_quant, "kv_dtype": c.kv_dtype})


def answer(spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> EngineAnswer:
    """Plain transformers (+ accelerate) with vramplan's scheme and split: resident on a GPU, the same eager kernels
    as vramplan's runtime, so its prediction; on the CPU, not priced (vramplan's own CPU kernels are faster); split,
    accelerate's device_map hooks, which vramplan does not model (its stream engine measured 5.06x accelerate's
    decode in bf16 and 16.98x in nf4 on an H200: bench/results/gpu-nvidia-h200*/offload-*)."""
    if not p.fits:
        return EngineAnswer(engine=ENGINE, weight_quant="-", kv_dtype="-", fits=False, how="vramplan plan --emit "
                            "transformers", reason="vramplan's plan found nothing that fits: no device_map to write")
    c = p.choice
    a = EngineAnswer(engine=ENGINE, weight_quant=c.weight_quant, kv_dtype=c.kv_dtype, fits=True,
                     how="vramplan plan --emit transformers")
    split = c.on_gpu and c.gpu_layers < c.total_layers
    if SCHEMES[c.weight_quant].backend == "quanto" and _offloads(c):  # as the export says
        a.fits, a.reason = False, "transformers' quanto loader refuses a device_map with CPU entries"
        return a
    if (refusal := _bnb_ram_refusal(spec, hw, p)) is not None:
        a.fits, a.reason = False, refusal
        return a
    a.with_layers(c, ", accelerate device_map" if split else "")
    if split or c.expert_layers_on_cpu:
        a.max_context_tokens = p.chosen.max_context_tokens or None
        a.speed_from = "not predicted: accelerate's offload is not modeled (5-17x slower than vramplan's stream "\
                       "engine, measured on an H200)"
        return a
    if not c.on_gpu:
        a.max_context_tokens = p.chosen.max_context_tokens or None
        a.speed_from = ("not predicted: on the CPU vramplan calls torch's kernels itself (bf16 by GEMV, quanto's "
                        "int8/int4 without its dispatch, lm_head in int8 rows), plain transformers does not (it "
                        "decoded at 0.69-1.04x of vramplan's speed in the two runs of "
                        "bench/results/vs-engines-cpu-dev*.md, 0.59-0.97x in three runs before them)")
        return a
    speed = p.chosen.speed
    if req.compiled:  # plain generate decodes eagerly: price vramplan's eager decode of the same placement
        from dataclasses import replace

        from ..search import assess

        speed = assess(spec, hw, replace(p.request, compiled=False), c)[1]
    return a.with_speed(speed, p.chosen.max_context_tokens, "vramplan's speed model: the same eager kernels as "
                        "vramplan's runtime", p.predicted.decode_tokens_per_s)
