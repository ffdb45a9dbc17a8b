"""Ollama: a Modelfile (FROM tag, num_ctx, num_gpu) and the tag to pull, by Ollama's own reserves.

Ollama runs GGUF files through ggml like llama.cpp, so the bytes per layer, KV cache and compute
buffers are llama.cpp's (llamacpp_rules.py); what differs is what it keeps free per GPU: its
per-device minimum memory plus OLLAMA_GPU_OVERHEAD, instead of llama.cpp's --fit margin. num_gpu
counts layers as -ngl does (the output layer is the last one). Tags follow ollama.com/library's
naming convention (`<model>:<size>-<variant>-<quant>`), stated as a convention: not every quant
of every model is published. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ..hardware import HardwareProfile
from ..modelspec import ModelSpec
from ..plan import Plan
from ..units import MiB
from . import llamacpp, llamacpp_rules as rules
from .common import EngineConstant, Export, assumption_notes, commented

ENGINE = "ollama"
OLLAMA = "ollama/ollama"
# ml/device.go DeviceInfo.MinimumMemory: "memory that should be set aside on the device for overhead"
# (CUDA and ROCm 457 MiB, Metal 512 MiB).
MINIMUM_MEMORY_BYTES = {"cuda": 457 * MiB, "mps": 512 * MiB}
DEVICE_GO = f"{OLLAMA} ml/device.go @ 02725d3d64510e335bbb0940196ab22385651bc2"
# envconfig/config.go: GpuOverhead = Uint64("OLLAMA_GPU_OVERHEAD", 0): extra VRAM set aside per GPU.
GPU_OVERHEAD_BYTES = 0
ENVCONFIG_GO = f"{OLLAMA} envconfig/config.go @ 4bf0d41c38c7b669bbbd44bf43c08bc4e231432f"
# api/types.go DefaultOptions: Runner.NumBatch 512 (llama.cpp's n_ubatch equivalent, the same as llama.cpp's default).
NUM_BATCH = 512
TYPES_GO = f"{OLLAMA} api/types.go @ b8761ab020a91873a4f27e6008deeace9b2d101f"


# The runner process beside its buffers (Go, llama.cpp, CUDA): unmeasured, as vramplan assumed for llama-server before
# it measured one.
RUNNER_BASE_RAM_ASSUMED = 256 * MiB


def runner_slots(req) -> rules.Slots:
    """Ollama's runner: OLLAMA_NUM_PARALLEL sequences in one KV pool of num_ctx x parallel cells, its graph reserved
    for a logits row per token of a batch (llama.cpp's rule before llama-server reserved one per slot) and a row per
    sequence in its output buffer: unmeasured."""
    return rules.Slots(count=req.batch, unified=True, logit_rows=NUM_BATCH, output_rows=req.batch)


# GGUF file type -> Ollama's quant suffix (the library spells the K-quants with a capital K).
QUANT_TAG = {"F16": "fp16", "BF16": "fp16", "Q8_0": "q8_0", "Q6_K": "q6_K", "Q5_K_M": "q5_K_M", "Q4_K_M": "q4_K_M",
             "IQ4_XS": "q4_K_S", "Q3_K_M": "q3_K_M", "Q2_K": "q2_K"}
# Quants the library publishes for most models of the older families, and for the newer ones (qwen3, gemma3,
# phi4, ...) only these three.
FULL_QUANTS = ("fp16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_K_S", "q3_K_M", "q2_K")
FEW_QUANTS = ("fp16", "q8_0", "q4_K_M")
# Hub id -> (library name, tag stem, published quants); stems as on ollama.com/library. The export names the model
# that was planned: a base (pretrained) checkpoint maps to the library's base ("text") tags, an instruct / chat one to
# its instruct tags, never one to the other. The base tags used here are all listed in an ollama.com/library tag
# listing auto-generated on 2025-08-09 (a public TypeScript `OllamaChatModelId` union: llama3.1:{8b,70b,405b}-text-*,
# llama3.2:{1b,3b}-text-*, llama2:{7b,13b}-text-*, mixtral:8x7b-text-v0.1-*, gemma2:{2b,9b,27b}-text-*). Qwen3, Phi-4,
# DeepSeek-V3/R1 and Gemma 3 "-it" hub ids are themselves the post-trained models those tags hold.
LIBRARY = {
    # base checkpoints -> base ("text") tags
    "meta-llama/Llama-3.1-8B": ("llama3.1", "8b-text", FULL_QUANTS),
    "meta-llama/Llama-3.1-70B": ("llama3.1", "70b-text", FULL_QUANTS),
    "meta-llama/Llama-3.1-405B": ("llama3.1", "405b-text", FULL_QUANTS),
    "meta-llama/Llama-3.2-1B": ("llama3.2", "1b-text", FULL_QUANTS),
    "meta-llama/Llama-3.2-3B": ("llama3.2", "3b-text", FULL_QUANTS),
    "meta-llama/Llama-2-7b-hf": ("llama2", "7b-text", FULL_QUANTS),
    "meta-llama/Llama-2-13b-hf": ("llama2", "13b-text", FULL_QUANTS),
    "mistralai/Mixtral-8x7B-v0.1": ("mixtral", "8x7b-text-v0.1", FULL_QUANTS),
    "google/gemma-2-2b": ("gemma2", "2b-text", FULL_QUANTS),
    "google/gemma-2-9b": ("gemma2", "9b-text", FULL_QUANTS),
    "google/gemma-2-27b": ("gemma2", "27b-text", FULL_QUANTS),
    # instruct / chat checkpoints -> instruct tags
    "meta-llama/Llama-3.1-8B-Instruct": ("llama3.1", "8b-instruct", FULL_QUANTS),
    "meta-llama/Llama-3.1-70B-Instruct": ("llama3.1", "70b-instruct", FULL_QUANTS),
    "meta-llama/Llama-3.1-405B-Instruct": ("llama3.1", "405b-instruct", FULL_QUANTS),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama3.2", "1b-instruct", FULL_QUANTS),
    "meta-llama/Llama-3.2-3B-Instruct": ("llama3.2", "3b-instruct", FULL_QUANTS),
    "meta-llama/Llama-2-7b-chat-hf": ("llama2", "7b-chat", FULL_QUANTS),
    "meta-llama/Llama-2-13b-chat-hf": ("llama2", "13b-chat", FULL_QUANTS),
    "mistralai/Mistral-7B-Instruct-v0.3": ("mistral", "7b-instruct-v0.3", FULL_QUANTS),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": ("mixtral", "8x7b-instruct-v0.1", FULL_QUANTS),
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2.5", "0.5b-instruct", FULL_QUANTS),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2.5", "7b-instruct", FULL_QUANTS),
    "Qwen/Qwen2.5-14B-Instruct": ("qwen2.5", "14b-instruct", FULL_QUANTS),
    "Qwen/Qwen2.5-32B-Instruct": ("qwen2.5", "32b-instruct", FULL_QUANTS),
    "Qwen/Qwen2.5-72B-Instruct": ("qwen2.5", "72b-instruct", FULL_QUANTS),
    "google/gemma-2-2b-it": ("gemma2", "2b-instruct", FULL_QUANTS),
    "google/gemma-2-9b-it": ("gemma2", "9b-instruct", FULL_QUANTS),
    "google/gemma-2-27b-it": ("gemma2", "27b-instruct", FULL_QUANTS),
    "Qwen/Qwen3-0.6B": ("qwen3", "0.6b", FEW_QUANTS),
    "Qwen/Qwen3-4B": ("qwen3", "4b", FEW_QUANTS),
    "Qwen/Qwen3-8B": ("qwen3", "8b", FEW_QUANTS),
    "Qwen/Qwen3-14B": ("qwen3", "14b", FEW_QUANTS),
    "Qwen/Qwen3-32B": ("qwen3", "32b", FEW_QUANTS),
    "Qwen/Qwen3-30B-A3B": ("qwen3", "30b-a3b", FEW_QUANTS),
    "Qwen/Qwen3-235B-A22B": ("qwen3", "235b-a22b", FEW_QUANTS),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": ("qwen3-coder", "30b-a3b", FEW_QUANTS),
    "google/gemma-3-1b-it": ("gemma3", "1b-it", FEW_QUANTS),
    "google/gemma-3-27b-it": ("gemma3", "27b-it", FEW_QUANTS),
    "microsoft/Phi-3-mini-4k-instruct": ("phi3", "3.8b-mini-4k-instruct", FULL_QUANTS),
    "microsoft/phi-4": ("phi4", "14b", FEW_QUANTS),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ("deepseek-r1", "1.5b-qwen-distill", FEW_QUANTS),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": ("deepseek-r1", "7b-qwen-distill", FEW_QUANTS),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": ("deepseek-r1", "32b-qwen-distill", FEW_QUANTS),
    "deepseek-ai/DeepSeek-R1": ("deepseek-r1", "671b", FEW_QUANTS),
    "deepseek-ai/DeepSeek-V3": ("deepseek-v3", "671b", FEW_QUANTS),
}
# Base checkpoints whose library name publishes only the instruct model (no base tag in the listing above: the qwen2.5
# library has no -base / -text tag, mistral's -text tags name no v0.3): exported as their own GGUF, and the note says
# which tag is NOT them.
INSTRUCT_ONLY = {
    "Qwen/Qwen2.5-0.5B": "qwen2.5:0.5b-instruct", "Qwen/Qwen2.5-7B": "qwen2.5:7b-instruct",
    "Qwen/Qwen2.5-14B": "qwen2.5:14b-instruct", "Qwen/Qwen2.5-32B": "qwen2.5:32b-instruct",
    "Qwen/Qwen2.5-72B": "qwen2.5:72b-instruct", "mistralai/Mistral-7B-v0.3": "mistral:7b-instruct-v0.3",
}
# File types convert_hf_to_gguf.py writes itself (--outtype); the others come from llama-quantize.
UNQUANTIZED_FILE_TYPES = ("F16", "BF16")
# Ranked by size, smallest last: "closest" means the published quant of at most the planned size, else the smallest.
QUANT_ORDER = ("fp16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_K_S", "q3_K_M", "q2_K")


def constants(hw: HardwareProfile) -> dict[str, EngineConstant]:
    return {
        "minimum_memory_bytes": EngineConstant(_minimum_memory(hw), f"{DEVICE_GO}: DeviceInfo.MinimumMemory"),
        "gpu_overhead_bytes": EngineConstant(GPU_OVERHEAD_BYTES, f"{ENVCONFIG_GO}: OLLAMA_GPU_OVERHEAD default"),
        "num_batch": EngineConstant(NUM_BATCH, f"{TYPES_GO}: DefaultOptions Runner.NumBatch"),
        "compute_hidden_copies": EngineConstant(rules.COMPUTE_HIDDEN_COPIES, "estimate of ggml's compute "
                                                "buffer (Ollama measures it as the graph size)", assumption=True),
        "compute_ffn_copies": EngineConstant(rules.COMPUTE_FFN_COPIES, "estimate of ggml's compute buffer",
                                             assumption=True),
    }


def _minimum_memory(hw: HardwareProfile) -> int:
    return MINIMUM_MEMORY_BYTES.get(hw.accelerator or "cuda", MINIMUM_MEMORY_BYTES["cuda"])


def ollama_tag(spec: ModelSpec, file_type: str) -> tuple[str | None, str]:
    """The library tag of the planned model closest to a GGUF file type, and what to say about it; None (with how to
    build the GGUF from the planned checkpoint) when the library has no tag for this very model."""
    entry = LIBRARY.get(spec.name)
    if entry is None:
        name = llamacpp.gguf_file_name(spec, file_type)
        f16 = llamacpp.gguf_file_name(spec, "F16")
        other = INSTRUCT_ONLY.get(spec.name)
        why = (f"Ollama's library has no base tag for {spec.name} ({other} is the instruct model, a different one)"
               if other else f"no known Ollama library tag for {spec.name}")
        convert = f"python convert_hf_to_gguf.py <{spec.name} checkpoint dir> --outtype"
        build = (f"{convert} {file_type.lower()} --outfile {name}" if file_type in UNQUANTIZED_FILE_TYPES else
                 f"{convert} f16 --outfile {f16}, then llama-quantize {f16} {name} {file_type}")
        return None, (f"{why}: FROM the GGUF converted from the planned checkpoint (./{name}); build it with "
                      f"llama.cpp: {build}")
    name, stem, published = entry
    wanted = QUANT_TAG[file_type]
    rank = QUANT_ORDER.index(wanted)
    quant = next((q for q in QUANT_ORDER[rank:] if q in published), published[-1])
    said = f"Ollama quant {quant}" + ("" if quant == wanted
                                      else f" (closest published to {file_type}: {wanted} is not)")
    return f"{name}:{stem}-{quant}", said + "; tag by ollama.com/library's naming convention: check it is published"


def export_ollama(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> Export:
    """The Modelfile for a plan: llama.cpp's bytes for the plan's GGUF type, Ollama's reserves for num_gpu."""
    consts = constants(hw)
    if p.request.engine == llamacpp.ENGINE:
        req, notes = replace(p.request, quant=(p.choice.weight_quant,) if p.fits else (),
                             kv_dtype=(p.choice.kv_dtype,) if p.fits else (), gpu_layers=None,
                             expert_placement=None), []
    else:
        req, notes = llamacpp.mapped_request(p)
    margin = _minimum_memory(hw) + GPU_OVERHEAD_BYTES
    q = llamacpp.plan_llamacpp(spec, hw, req)  # the file type and cache llama.cpp's rules pick
    if not q.fits:
        notes.append(f"Ollama: nothing fits: {q.reasons[0]}")
        return Export(engine=ENGINE, fits=False, text=commented(notes, "# no Modelfile"), notes=tuple(notes),
                      constants=consts)
    ft, kv = q.choice.weight_quant, q.choice.kv_dtype
    model = rules.gguf_model(spec, ft)
    fp = llamacpp.footprint(spec, hw, replace(req, quant=(ft,), kv_dtype=(kv,)), model, kv, margin_bytes=margin,
                            slots=runner_slots(req), base_ram_bytes=RUNNER_BASE_RAM_ASSUMED)
    placement, _ = fp.place(expert_offload=False)
    tag, said = ollama_tag(spec, ft)
    notes.append(said)
    if placement is None:
        notes.append("Ollama's reserves leave no placement that fits")
        return Export(engine=ENGINE, fits=False, text=commented(notes, "# no Modelfile"), notes=tuple(notes),
                      constants=consts)
    num_gpu = placement.ngl
    notes.append(f"num_gpu {num_gpu} of {spec.num_layers + 1} layers (the output layer counts as one): GGUF {ft} bytes "
                 f"by planner/gguf.py, kept free per GPU: Ollama's minimum {_minimum_memory(hw) // MiB} MiB + "
                 f"OLLAMA_GPU_OVERHEAD {GPU_OVERHEAD_BYTES} (llama.cpp itself keeps its --fit margin of 1 GiB)")
    if q.choice.expert_layers_on_cpu:
        notes.append(f"llama.cpp would keep the experts of {q.choice.expert_layers_on_cpu} layers in RAM "
                     "(--n-cpu-moe); a Modelfile has no such setting: Ollama offloads whole layers instead")
    env = []
    if kv != "f16":
        env.append(f"OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE={kv}")
    if req.batch > 1:
        env.append(f"OLLAMA_NUM_PARALLEL={req.batch}")
    if env:
        notes.append("server environment (not a Modelfile setting): " + " ".join(env) + " ollama serve")
    notes += assumption_notes(consts)
    pull = f"ollama pull {tag}" if tag else f"(no library tag: build {llamacpp.gguf_file_name(spec, ft)}, see above)"
    body = "\n".join([f"# {pull}", f"FROM {tag or './' + llamacpp.gguf_file_name(spec, ft)}",
                      f"PARAMETER num_ctx {req.context}", f"PARAMETER num_gpu {num_gpu}"])
    return Export(engine=ENGINE, fits=True, text=commented(notes, body), notes=tuple(notes), constants=consts,
                  details={"tag": tag, "gguf_file_type": ft, "kv_cache_type": kv, "num_ctx": req.context,
                           "num_gpu": num_gpu})
