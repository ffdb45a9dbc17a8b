"""Ollama as it is today: llama.cpp's llama-server started with Ollama's launch settings, and the Modelfile for it.

Since v0.30.0 (commit 9db4bdbad, "runner: Remove CGO engines, use llama-server exclusively for GGML models") Ollama runs
every GGUF model in llama.cpp's own llama-server, built from the llama.cpp tag in LLAMA_CPP_VERSION, and lets its --fit
place the layers. The memory estimator of the earlier runner is gone; its reserves (DeviceInfo.MinimumMemory,
OLLAMA_GPU_OVERHEAD) are only logged when a model loads (server/sched.go Scheduler.load). The rules here follow Ollama
OLLAMA_VERSION. An Ollama plan is therefore llama.cpp's plan (llamacpp.plan_llamacpp, by llama.cpp's rules) for
llama-server as Ollama starts it (llm/llama_server.go startLlamaServer):

    -c num_ctx x numParallel -np numParallel   one KV stream of num_ctx cells per slot (-np given: kv_unified off)
    --cache-type-k/-v OLLAMA_KV_CACHE_TYPE      when that variable is set
    --flash-attn auto                          where Ollama deems flash attention supported (OLLAMA_FLASH_ATTENTION
                                               forces on / off)
    -b num_batch -ub num_batch                 num_batch: Ollama's automatic choice (512, 1024 or 2048) unless set
    no -ngl                                    unless num_gpu is set: then -ngl num_gpu, and llama.cpp's --fit aborts
                                               ("n_gpu_layers already set by user", common/fit.cpp)

So the Modelfile sets FROM and num_ctx, and never num_gpu. Tags follow ollama.com/library's naming convention
(`<model>:<size>-<variant>-<quant>`), stated as a convention: not every quant of every model is published. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ..record import record
from ..gguf import gguf_file_bytes
from ..gguf_model import HUB_GGUF_PREFIX
from ..hardware import HardwareProfile
from ..memory import gpu_capacity
from ..modelspec import ModelSpec
from ..plan import Plan
from ..request import Request
from ..units import GiB, MiB, format_bytes
from . import llamacpp, llamacpp_rules as rules
from ..quoting import modelfile_value, one_line, shell_join, shell_quote
from ..engine import Outcome, plan_with, request_for
from ..errors import PlanError
from ..plan import Candidate
from .common import EngineAnswer, EngineConstant, Export, assumption_notes, commented, is_local

ENGINE = "ollama"
OLLAMA = "ollama/ollama"
# The Ollama release whose launch these rules follow, and the llama.cpp it builds (its LLAMA_CPP_VERSION file).
OLLAMA_VERSION = "v0.32.15"
OLLAMA_COMMIT = "b7871fc0d1d82fe109536efa3e0e8e411c766c75"
OLLAMA_LLAMA_CPP_BUILD = "b10488"
# The commit that made llama-server Ollama's only engine for GGUF models (first released in v0.30.0).
LLAMA_SERVER_ONLY_COMMIT = "9db4bdbad6a4981ad761aa2b603e69e8fb83212c"
LLAMA_SERVER_GO = f"{OLLAMA} llm/llama_server.go @ {OLLAMA_COMMIT}"
SCHED_GO = f"{OLLAMA} server/sched.go @ {OLLAMA_COMMIT}"
TYPES_GO = f"{OLLAMA} api/types.go @ {OLLAMA_COMMIT}"
ENVCONFIG_GO = f"{OLLAMA} envconfig/config.go @ {OLLAMA_COMMIT}"
VERSION_FILE = f"{OLLAMA} LLAMA_CPP_VERSION @ {OLLAMA_COMMIT}"

# envconfig.NumParallel: OLLAMA_NUM_PARALLEL, default 1 (Scheduler.load: numParallel = max(NumParallel(), 1)).
NUM_PARALLEL_DEFAULT = 1
# api/types.go DefaultOptions: NumBatch 512. A Modelfile or request without num_batch leaves it automatic
# (server/routes.go usesAutomaticNumBatch): Scheduler.load replaces it with automaticGenerationBatch's choice.
NUM_BATCH_DEFAULT = 512
# server/sched.go automaticGenerationBatch, with flash attention not disabled: generationBatchForContext picks 2048
# above an effective context of 32768 tokens, 1024 above 4096, else 512; a batch above 512 steps down (2048 -> 1024 ->
# 512) while generationBatchFits refuses it: the predicted VRAM over 80 % of the available memory, over 60 % (2048) or
# 75 % (1024) of it (generationBatchHasHeadroom), or the batch's surcharge (2 GiB for 2048, 768 MiB for 1024) beyond
# what the 80 % leaves.
BATCH_MEDIUM, BATCH_LARGE = 1024, 2048
CONTEXT_FOR_MEDIUM, CONTEXT_FOR_LARGE = 4096, 32768
FIT_THRESHOLD_PCT = 80
HEADROOM_PCT = {BATCH_LARGE: 60, BATCH_MEDIUM: 75}
SURCHARGE_BYTES = {BATCH_LARGE: 2 * GiB, BATCH_MEDIUM: 768 * MiB}
# Several GPUs: without OLLAMA_SCHED_SPREAD, Scheduler.load runs the model on the one GPU with the most free memory
# among those whose free memory's 80 % holds the predicted VRAM (selectLlamaServerPlacement, bestSingleGPUFit:
# --split-mode none), else on all of them.
SINGLE_GPU_PCT = 80
# The `ollama serve` process beside llama-server (Go; its HTTP server, model metadata): unmeasured.
OLLAMA_SERVE_RAM_ASSUMED = 128 * MiB
# llama-server's prompt cache: the KV state of finished prompts, kept in RAM up to --cache-ram (default 8192 MiB,
# llama.cpp common.h cache_ram_mib). Ollama passes no --cache-ram (startLlamaServer's flags, LLAMA_SERVER_GO), so it
# may grow to the default as prompts come: counted in the RAM a launch needs, or a busy server runs out of RAM.
PROMPT_CACHE_BYTES = rules.PROMPT_CACHE_DEFAULT_MIB * MiB
LLM_SERVER_GO = f"{OLLAMA} llm/server.go @ {OLLAMA_COMMIT}"
DEVICE_GO = f"{OLLAMA} ml/device.go @ {OLLAMA_COMMIT}"
# llm/server.go:111-116 (NewLlamaServer), before llama-server starts: a num_ctx above the GGUF's context_length (the
# model's training context: max_position_embeddings as convert_hf_to_gguf.py writes it, rope scaling not applied) is
# lowered to it, with the warning "requested context size too large for model". server/sched.go:161-167
# effectiveContext caps the context PredictServerVRAM is given the same way.
NUM_CTX_CAP = f"{LLM_SERVER_GO}:111-116 NewLlamaServer"
# server/sched.go:505-509 (Scheduler.load): "Some architectures are not safe with num_parallel > 1" (ollama/ollama
# issue 4165): these model families (the GGUF's general.architecture) run with numParallel = 1 whatever
# OLLAMA_NUM_PARALLEL says, with the warning "model architecture does not currently support parallel requests".
SINGLE_SLOT_FAMILIES = ("mllama", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen3next", "lfm2", "lfm2moe",
                        "nemotron_h", "nemotron_h_moe", "nemotron_h_omni")
SINGLE_SLOT_RULE = f"{SCHED_GO}:505-509 Scheduler.load"
# transformers model_type -> the general.architecture convert_hf_to_gguf.py writes for it (gguf-py MODEL_ARCH_NAMES:
# Qwen3VL* -> qwen3vl / qwen3vlmoe, Qwen3_5* -> qwen35 / qwen35moe, Qwen3Next -> qwen3next; NemotronH writes
# nemotron_h, or nemotron_h_moe with routed experts: both single-slot). A GGUF read as a model keeps its own name.
OLLAMA_FAMILY = {"mllama": "mllama", "qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe", "qwen3_5": "qwen35",
                 "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next", "lfm2": "lfm2", "lfm2_moe": "lfm2moe",
                 "nemotron_h": "nemotron_h"}
# ml/device.go:571-600 (FlashAttentionSupported, cudaFlashAttentionSupported), applied by llm/llama_server.go:596-621
# (LlamaServerFlashAttention, appendFlashAttentionArgs): a CUDA GPU of compute capability below 6.0, or 7.2 (Jetson
# Xavier), gets --flash-attn off unless OLLAMA_FLASH_ATTENTION is set (CPU, Metal, ROCm and Vulkan keep auto; a CUDA
# driver older than 7 too, never seen today: not modelled). llama.cpp then refuses a quantized V cache ("quantized V
# cache requires flash_attn to be enabled", llama_init_from_model), and Ollama passes OLLAMA_KV_CACHE_TYPE to both
# --cache-type-k and --cache-type-v (llm/llama_server.go:393-396): only f16 starts.
FLASH_ATTENTION_RULE = f"{DEVICE_GO}:571-600 FlashAttentionSupported"
FA_MIN_MAJOR, FA_EXCLUDED_CC = 6, ("7.2",)
# server/sched.go:822-829, 843-856 automaticGenerationBatch with flash attention off on CUDA: 512, or 256 above an
# effective context of 4096 where a CUDA GPU has at most 8 GiB (free memory, else total).
BATCH_CONSTRAINED = 256
CONSTRAINED_GPU_BYTES = 8 * GiB


def constants() -> dict[str, EngineConstant]:
    return {
        "ollama_version": EngineConstant(OLLAMA_VERSION, f"{OLLAMA} tag {OLLAMA_VERSION} ({OLLAMA_COMMIT})"),
        "ollama_llama_cpp_build": EngineConstant(OLLAMA_LLAMA_CPP_BUILD, VERSION_FILE),
        "num_parallel_default": EngineConstant(NUM_PARALLEL_DEFAULT, f"{ENVCONFIG_GO}: NumParallel"),
        "num_batch_default": EngineConstant(NUM_BATCH_DEFAULT, f"{TYPES_GO}: DefaultOptions NumBatch"),
        "auto_batch_fit_threshold_pct": EngineConstant(FIT_THRESHOLD_PCT, f"{SCHED_GO}: generationBatchFits"),
        "single_gpu_pct": EngineConstant(SINGLE_GPU_PCT, f"{SCHED_GO}: bestSingleGPUFit"),
        "ollama_serve_ram_bytes": EngineConstant(OLLAMA_SERVE_RAM_ASSUMED, "the ollama serve process beside "
                                                 "llama-server: unmeasured", assumption=True),
        "single_slot_families": EngineConstant(",".join(SINGLE_SLOT_FAMILIES), SINGLE_SLOT_RULE),
        "flash_attention_min_cc": EngineConstant(f"{FA_MIN_MAJOR}.0 (not {', '.join(FA_EXCLUDED_CC)})",
                                                 FLASH_ATTENTION_RULE),
        "prompt_cache_bytes": EngineConstant(PROMPT_CACHE_BYTES, f"llama-server's --cache-ram default (llama.cpp "
                                             f"common.h cache_ram_mib), which Ollama does not set ({LLAMA_SERVER_GO}: "
                                             "startLlamaServer)"),
    }


# ---------------------------------------------------------------- Ollama's launch settings
def predicted_server_vram(spec: ModelSpec, file_bytes: int, context: int) -> int:
    """llm.PredictServerVRAM: the GGUF file's size plus an f16 KV cache of 2 x block_count x head_count_kv (the least
    of the layers') x embedding_length / head_count (the most) x context x 2 bytes. It decides the batch and the GPUs,
    not the placement."""
    kv_heads = max(1, min((1 if a.kind == "mla" else a.num_kv_heads) for a in spec.attention))  # MLA: GGUF writes 1
    head_dim = spec.hidden_size // max(a.num_heads for a in spec.attention)
    return file_bytes + 2 * spec.num_layers * kv_heads * head_dim * context * 2


def effective_context(spec: ModelSpec, num_ctx: int, num_parallel: int) -> int:
    """effectiveLlamaServerContext: num_ctx capped at the model's training context, times the parallel sequences."""
    train = spec.max_context or num_ctx
    return min(num_ctx, train) * max(num_parallel, 1)


def auto_num_batch(context: int, predicted: int, available: int, no_fa_gpu_bytes: int | None = None) -> int:
    """automaticGenerationBatch (see BATCH_*). Without a GPU the available memory is 0 (the sum over no GPUs), and
    generationBatchFits takes any batch: the context alone decides. `no_fa_gpu_bytes`: flash attention is off on CUDA
    GPUs, the smallest of which has this much free memory: 512, or BATCH_CONSTRAINED above 4096 tokens on a GPU of
    at most 8 GiB."""
    if no_fa_gpu_bytes is not None:
        return (BATCH_CONSTRAINED if context > CONTEXT_FOR_MEDIUM and 0 < no_fa_gpu_bytes <= CONSTRAINED_GPU_BYTES
                else NUM_BATCH_DEFAULT)
    batch = BATCH_LARGE if context > CONTEXT_FOR_LARGE else BATCH_MEDIUM if context > CONTEXT_FOR_MEDIUM else \
        NUM_BATCH_DEFAULT

    def fits(b: int) -> bool:
        if not predicted or not available:
            return True
        threshold = available * FIT_THRESHOLD_PCT // 100
        return (predicted <= threshold and predicted <= available * HEADROOM_PCT[b] // 100
                and SURCHARGE_BYTES[b] <= threshold - predicted)

    while batch > NUM_BATCH_DEFAULT and not fits(batch):
        batch = BATCH_MEDIUM if batch > BATCH_MEDIUM else NUM_BATCH_DEFAULT
    return batch


def ollama_family(spec: ModelSpec) -> str:
    """The model family Ollama keys its rules on (the GGUF's general.architecture)."""
    arch = getattr(spec.gguf, "architecture", None)
    if arch:
        return arch
    return OLLAMA_FAMILY.get(spec.model_type, spec.model_type)


def num_parallel(spec: ModelSpec, requested: int) -> int:
    """Scheduler.load's numParallel: OLLAMA_NUM_PARALLEL (at least 1), 1 for the single-slot families."""
    return 1 if ollama_family(spec) in SINGLE_SLOT_FAMILIES else max(requested, 1)


def flash_attention(hw: HardwareProfile) -> str:
    """--flash-attn as Ollama passes it for these GPUs (OLLAMA_FLASH_ATTENTION unset): "off" where a CUDA GPU's
    compute capability is below 6.0 or is 7.2, else "auto". A GPU of unknown compute capability counts as supported."""
    if hw.accelerator != "cuda":
        return "auto"
    for g in hw.gpus:
        cc = g.compute_capability
        if cc is not None and (g.capability[0] < FA_MIN_MAJOR or cc in FA_EXCLUDED_CC):
            return "off"
    return "auto"


def free_memory(hw: HardwareProfile, req: Request, device: int) -> int:
    """A GPU's free memory as Ollama's discovery reports it before a load: its memory less the CUDA context (the
    profile's), on an otherwise idle machine."""
    return max(0, gpu_capacity(hw, req, device) - hw.overheads.cuda_context_bytes)


@record(kw_only=True)
class OllamaLaunch:
    """How Ollama starts llama-server for one model: what Scheduler.load decides before the start."""

    hardware: HardwareProfile  # the GPUs it runs on (one of several when one holds the predicted VRAM)
    num_ctx: int
    num_parallel: int
    num_batch: int
    predicted_vram_bytes: int
    available_bytes: int  # free memory of the GPUs it runs on
    single_gpu_of: int = 0  # the GPUs there were when it picked one (0: it did not)
    flash_attn: str = "auto"  # --flash-attn: "off" on the CUDA GPUs Ollama deems without flash attention

    @property
    def n_ubatch(self) -> int:
        """llama_context: n_ubatch = min(n_batch, n_ubatch) with n_batch capped at n_ctx (causal attention)."""
        return min(self.num_batch, self.num_ctx * self.num_parallel)

    def server(self, has_gpu: bool) -> llamacpp.Server:
        """llama-server as this launch starts it: -np slots with a stream each and a logits row each (the graph is
        reserved for n_parallel outputs: tools/server/server-context.cpp server_output_limits), -ub num_batch, --fit's
        own margin (Ollama sets LLAMA_ARG_FIT_TARGET only for a multimodal projector), and the ollama serve process
        beside it, and the prompt cache llama-server may grow to (PROMPT_CACHE_BYTES)."""
        n = self.num_parallel
        slots = rules.Slots(count=n, unified=False, logit_rows=n, output_rows=n, n_ubatch=self.n_ubatch)
        return llamacpp.Server(slots=slots, base_ram_bytes=rules.process_base_ram(has_gpu) + OLLAMA_SERVE_RAM_ASSUMED
                               + PROMPT_CACHE_BYTES, constants=constants())

    def argv(self, gguf: str, kv_type: str) -> list[str]:
        """The memory-relevant flags Ollama passes to llama-server (startLlamaServer; --port, --host, logging and
        chat-template flags left out)."""
        out = ["llama-server", "--model", gguf, "-c", str(self.num_ctx * self.num_parallel), "-np",
               str(self.num_parallel)]
        if kv_type != "f16":
            out += ["--cache-type-k", kv_type, "--cache-type-v", kv_type]
        out += ["--flash-attn", self.flash_attn, "-b", str(self.num_batch), "-ub", str(self.num_batch)]
        if self.single_gpu_of:
            out += ["--split-mode", "none", "--main-gpu", "0"]
        return out


def ollama_launch(spec: ModelSpec, hw: HardwareProfile, req: Request, file_type: str) -> OllamaLaunch:
    """Scheduler.load for a Modelfile with num_ctx = req.context and OLLAMA_NUM_PARALLEL = req.batch: the GPUs and the
    automatic num_batch, both from PredictServerVRAM of the GGUF; num_ctx capped at the training context and one slot
    for the single-slot families, as Ollama does before it starts llama-server."""
    slots = num_parallel(spec, req.batch)
    num_ctx = min(req.context, spec.max_context) if spec.max_context else req.context
    context = effective_context(spec, req.context, slots)
    predicted = predicted_server_vram(spec, gguf_file_bytes(spec, file_type), context)
    devices = list(range(len(hw.devices))) if hw.has_gpu else []
    frees = [free_memory(hw, req, d) for d in devices]
    single, used = 0, hw
    if len(devices) > 1:
        holding = [d for d in devices if predicted <= frees[d] * SINGLE_GPU_PCT // 100]
        if holding:
            best = max(holding, key=lambda d: frees[d])
            single, frees = len(devices), [frees[best]]
            used = hw.replace(name=f"{hw.name}-one-gpu", gpus=(replace(hw.devices[best], count=1),))
    available = sum(frees)
    fa = flash_attention(used) if devices else "auto"
    no_fa = min(frees) if fa == "off" else None
    return OllamaLaunch(hardware=used, num_ctx=num_ctx, num_parallel=slots,
                        num_batch=auto_num_batch(context, predicted, available, no_fa),
                        predicted_vram_bytes=predicted, available_bytes=available, single_gpu_of=single, flash_attn=fa)


# OLLAMA_KV_CACHE_TYPE takes these (envconfig/config.go KvCacheType; llama.cpp's cache types), f16 when unset.
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")


class OllamaEngine(llamacpp.LlamaCppEngine):
    """Ollama behind the Engine protocol (planner.engine): llama-server as Ollama launches it (one launch per GGUF file
    type: its automatic num_batch and GPUs), over the quants the library publishes for this model (every planned file
    type where it has no tag: the user builds the GGUF) x the caches OLLAMA_KV_CACHE_TYPE takes, placed by llama.cpp's
    --fit and priced with llama.cpp's constants."""

    name = ENGINE
    rules_label = " Ollama's launch"

    def __init__(self) -> None:
        super().__init__(None)

    def file_types(self, spec: ModelSpec, req: Request) -> tuple[str, ...]:
        if spec.gguf is not None:
            return llamacpp.gguf_file_types(spec, req)
        if req.quant:  # the largest published quant of at most each size asked for
            return tuple(dict.fromkeys(published_file_types(spec, q)[0] for q in req.quant))
        return (tuple(ft for ft in rules.PLANNED_FILE_TYPES if ft in published_file_types(spec, ft))
                or published_file_types(spec, rules.PLANNED_FILE_TYPES[0]))  # a model published in one format

    def caches(self, req: Request) -> tuple[str, ...]:
        return req.kv_dtype or KV_CACHE_TYPES

    def check(self, spec: ModelSpec, hw: HardwareProfile, req: Request) -> tuple[Request, list[str]]:
        forced = [flag for flag, v in (("--gpu-layers", req.gpu_layers), ("--expert-placement", req.expert_placement))
                  if v is not None]
        if forced:
            raise PlanError(f"{', '.join(forced)}: Ollama places layers by llama.cpp's --fit itself (a Modelfile's "
                            "num_gpu is not planned)")
        req, warnings = super().check(spec, hw, req)
        train = spec.max_context
        if train and req.context > train:
            warnings.append(f"num_ctx {req.context} capped at {train}: Ollama lowers a num_ctx above the model's "
                            f"training context (the GGUF's context_length) to it before it starts llama-server ("
                            f"llm/server.go NewLlamaServer: \"requested context size too large for model\"), so "
                            f"this plan is for {train} tokens")
            req = replace(req, context=train)
        family = ollama_family(spec)
        if req.batch > 1 and family in SINGLE_SLOT_FAMILIES:
            warnings.append(f"one slot: Ollama runs the {family} family with num_parallel 1 whatever "
                            f"OLLAMA_NUM_PARALLEL says (server/sched.go Scheduler.load: \"model architecture does not "
                            f"currently support parallel requests\"), so {req.batch} sequences share it in turn")
            req = replace(req, batch=1)
        if hw.has_gpu and flash_attention(hw) == "off":
            ccs = ", ".join(sorted({g.compute_capability for g in hw.gpus if g.compute_capability}))
            quantized = [k for k in req.kv_dtype if k != "f16"]
            if req.kv_dtype and len(quantized) == len(req.kv_dtype):
                raise PlanError(f"--kv-dtype {','.join(quantized)}: Ollama starts llama-server with --flash-attn off "
                                f"on compute capability {ccs} (ml/device.go FlashAttentionSupported), and llama.cpp "
                                "refuses a quantized V cache without flash attention: only f16 runs there")
            warnings.append(f"--flash-attn off: Ollama deems flash attention unsupported on compute capability {ccs} "
                            "(ml/device.go FlashAttentionSupported: CUDA below 6.0, or 7.2), so llama.cpp refuses "
                            "a quantized V cache: only the f16 cache is planned; the compute buffer is still "
                            "estimated as with flash attention (without it llama.cpp also holds the KQ matrix)")
            if quantized:
                req = replace(req, kv_dtype=tuple(k for k in req.kv_dtype if k == "f16"))
        return req, warnings

    def candidates(self, spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True
                   ) -> list[Candidate]:
        out = []
        for ft in self.file_types(spec, req):
            launch = ollama_launch(spec, hw, req, ft)
            server, model, at = launch.server(hw.has_gpu), rules.gguf_model(spec, ft), replace(req, quant=(ft,))
            out += [llamacpp.candidate(spec, launch.hardware, at, model, kv, server, contexts)
                    for kv in self.caches(req) if launch.flash_attn != "off" or kv == "f16"]
        return out

    def resident_context(self, spec: ModelSpec, hw: HardwareProfile, req: Request, chosen: Candidate) -> int:
        ft = chosen.weight_quant
        launch = ollama_launch(spec, hw, req, ft)
        return llamacpp.max_resident_context(spec, launch.hardware, replace(req, quant=(ft,)),
                                             rules.gguf_model(spec, ft), chosen.kv_dtype, launch.server(hw.has_gpu))

    def engine_constants(self, spec: ModelSpec, hw: HardwareProfile, req: Request) -> dict[str, EngineConstant]:
        return {**llamacpp.engine_constants(hw, self.file_types(spec, req), self.caches(req), spec), **constants()}

    def explain(self, spec, hw, req, chosen: Candidate) -> Outcome:
        out = super().explain(spec, hw, req, chosen)
        tag, said = ollama_tag(spec, chosen.weight_quant)
        out.reasons.append(said)
        return out


OLLAMA = OllamaEngine()


def plan_ollama(spec: ModelSpec, hw: HardwareProfile, req: Request, *, contexts: bool = True) -> Plan:
    """Ollama's own plan (planner.engine's loop over OLLAMA): the published quant, the cache type and the launch."""
    return plan_with(OLLAMA, spec, hw, replace(req, engine=ENGINE), contexts=contexts)


# ---------------------------------------------------------------- library tags
# GGUF file type -> Ollama's quant suffix (the library spells the K-quants with a capital K; fp16 is an F16 GGUF).
QUANT_TAG = {"F16": "fp16", "BF16": "fp16", "Q8_0": "q8_0", "Q6_K": "q6_K", "Q5_K_M": "q5_K_M", "Q5_K_S": "q5_K_S",
             "Q5_1": "q5_1", "Q5_0": "q5_0", "Q4_K_M": "q4_K_M", "Q4_K_S": "q4_K_S", "Q4_1": "q4_1", "Q4_0": "q4_0",
             "Q3_K_L": "q3_K_L", "Q3_K_M": "q3_K_M", "Q3_K_S": "q3_K_S", "Q2_K": "q2_K"}
TAG_FILE_TYPE = {"fp16": "F16", **{v: k for k, v in QUANT_TAG.items() if v != "fp16"}}
# Quants the library publishes for the older families (every tag of llama3.1:8b-text, gemma2:9b-text,
# mixtral:8x7b-text-v0.1, llama3.2:1b-text in the listing below), and for the newer ones (qwen3, gemma3, phi4, ...) only
# these three.
FULL_QUANTS = ("fp16", "q8_0", "q6_K", "q5_1", "q5_K_M", "q5_K_S", "q5_0", "q4_1", "q4_K_M", "q4_K_S", "q4_0",
               "q3_K_L", "q3_K_M", "q3_K_S", "q2_K")
FEW_QUANTS = ("fp16", "q8_0", "q4_K_M")
# Models the library holds only as published, in one tag without a quant suffix: gpt-oss's tags are its checkpoint
# as OpenAI ships it, routed experts MXFP4 and the rest BF16 (ollama.com/library/gpt-oss, 2025-08: gpt-oss:20b 14 GB,
# gpt-oss:120b 65 GB): the F16 file convert_hf_to_gguf.py writes from that checkpoint (planner/gguf.py keeps stored
# MXFP4 experts as they are: 13.79 and 65.36 GB).
AS_PUBLISHED = "as-published"
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
    "openai/gpt-oss-20b": ("gpt-oss", "20b", (AS_PUBLISHED,)),
    "openai/gpt-oss-120b": ("gpt-oss", "120b", (AS_PUBLISHED,)),
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
# Ranked by size, largest first (Llama-3-8B's sizes in llama.cpp's perplexity scoreboard: q5_1 5.65 GiB > q5_K_M 5.33
# > q5_K_S = q5_0 5.21 > q4_1 4.78 > q4_K_M 4.58 > q4_K_S 4.37 > q4_0 4.34 > q3_K_L 4.03 > ...): "closest" means the
# largest published quant of at most the planned size, else the smallest.
QUANT_ORDER = ("fp16", "q8_0", "q6_K", "q5_1", "q5_K_M", "q5_K_S", "q5_0", "q4_1", "q4_K_M", "q4_K_S", "q4_0",
               "q3_K_L", "q3_K_M", "q3_K_S", "q2_K")
# The GGUF file types the library does not publish, and its largest quant of at most their size (same scoreboard:
# iq4_NL 4.35 GiB >= q4_0 4.34, iq4_XS 4.14 >= q3_K_L 4.03; the others by planner/gguf.py's Llama-3.1-8B files:
# MXFP4_MOE 7.95 GiB (a dense model's is Q8_0's), IQ3_M 3.52 and IQ3_S 3.43 >= q3_K_S, IQ3_XS 3.28 and IQ3_XXS 3.05 >=
# q2_K; None: smaller than q2_K, the library's smallest quant is the nearest).
LARGEST_AT_MOST = {"IQ4_NL": "q4_0", "IQ4_XS": "q3_K_L", "MXFP4_MOE": "q8_0", "IQ3_M": "q3_K_S", "IQ3_S": "q3_K_S",
                   "IQ3_XS": "q2_K", "IQ3_XXS": "q2_K", "Q2_K_S": None, "IQ2_M": None, "IQ2_S": None, "IQ2_XS": None,
                   "TQ2_0": None, "IQ2_XXS": None, "TQ1_0": None, "IQ1_M": None, "IQ1_S": None}


def published_file_types(spec: ModelSpec, file_type: str) -> tuple[str, ...]:
    """The GGUF file types to try for the planned `file_type`: itself when the library has no tag for this model (the
    user builds the GGUF), else the library's published quants of at most its size, largest first (the smallest when
    none is that small)."""
    entry = LIBRARY.get(spec.name)
    if entry is None:
        return (file_type,)
    published = entry[2]
    if published == (AS_PUBLISHED,):
        return ("F16",)
    wanted = QUANT_TAG.get(file_type) or LARGEST_AT_MOST[file_type]
    at_most = [q for q in QUANT_ORDER[QUANT_ORDER.index(wanted):] if q in published] if wanted else []
    return tuple(TAG_FILE_TYPE[q] for q in (at_most or [published[-1]]))


def ollama_tag(spec: ModelSpec, file_type: str) -> tuple[str | None, str]:
    """The library tag of the planned model for a GGUF file type it publishes, and what to say about it; None (with how
    to build the GGUF from the planned checkpoint) when the library has no tag for this very model."""
    entry = LIBRARY.get(spec.name)
    if spec.gguf is not None:
        return None, f"FROM the GGUF file it was planned from ({spec.location})"
    if entry is None:
        name = llamacpp.gguf_file_name(spec, file_type)
        f16 = llamacpp.gguf_file_name(spec, "F16")
        other = INSTRUCT_ONLY.get(spec.name)
        why = (f"Ollama's library has no base tag for {spec.name} ({other} is the instruct model, a different one)"
               if other else f"no known Ollama library tag for {spec.name}")
        checkpoint = shell_quote(spec.location) if is_local(spec) else f"<{spec.name} checkpoint dir>"
        convert = f"python convert_hf_to_gguf.py {checkpoint} --outtype"
        build = (f"{convert} {file_type.lower()} --outfile {name}" if file_type in UNQUANTIZED_FILE_TYPES else
                 f"{convert} f16 --outfile {f16}, then llama-quantize {f16} {name} {file_type}")
        return None, (f"{why}: FROM the GGUF converted from the planned checkpoint (./{name}); build it with "
                      f"llama.cpp: {build}")
    name, stem, published = entry
    if published == (AS_PUBLISHED,):
        return (f"{name}:{stem}", f"Ollama's {name}:{stem} holds {spec.name} as published (routed experts MXFP4, the "
                "rest BF16: GGUF F16 with the experts as stored); tag as listed on ollama.com/library/gpt-oss")
    quant = QUANT_TAG[file_type]
    return (f"{name}:{stem}-{quant}", f"Ollama quant {quant} (GGUF {file_type}); tag by ollama.com/library's naming "
            "convention: check it is published")


# ---------------------------------------------------------------- the Modelfile
def ollama_plan_of(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> tuple[Plan, list[str]]:
    """Ollama's own plan for the request of `p` (p itself when it is Ollama's), and how the request was put in
    Ollama's words."""
    if p.request.engine == ENGINE:
        return p, []
    req, notes = request_for(ENGINE, p.request, hw)
    return plan_ollama(spec, hw, req), notes


def export_ollama(spec: ModelSpec, hw: HardwareProfile, p: Plan) -> Export:
    """The Modelfile for a plan: llama.cpp's plan for llama-server as Ollama starts it, placed by llama.cpp's --fit."""
    q, notes = ollama_plan_of(spec, hw, p)
    req = q.request
    notes.insert(0, f"Ollama {OLLAMA_VERSION}: llama-server (llama.cpp {OLLAMA_LLAMA_CPP_BUILD}) started with Ollama's "
                    "launch settings and placed by its --fit: llama.cpp's plan for that launch (vramplan's llama.cpp "
                    f"rules follow llama.cpp {rules.MEASURED_COMMIT[:9]})")
    consts = {**constants(), **rules.constants(hw.name, hw.overheads.cuda_context_bytes if hw.has_gpu else 0,
                                               (q.choice.weight_quant,) if q.fits else (),
                                               (q.choice.kv_dtype,) if q.fits else (), has_gpu=hw.has_gpu)}
    if not q.fits:
        notes.append(f"Ollama: nothing fits: {q.reasons[0]}")
        return Export(engine=ENGINE, fits=False, text=commented(notes, "# no Modelfile"), notes=tuple(notes),
                      constants=consts)
    c = q.choice
    ft, kv = c.weight_quant, c.kv_dtype
    launch = ollama_launch(spec, hw, req, ft)
    tag, said = ollama_tag(spec, ft)
    notes.append(said)
    gguf = tag or (spec.location if spec.gguf is not None else "./" + llamacpp.gguf_file_name(spec, ft))
    argv = launch.argv(f"<{gguf} blob>" if tag else gguf, kv)
    if hw.has_gpu:
        notes.append(f"{q.chosen.reason} (by llama.cpp's rules; --fit chooses -ngl" + (
            " and the experts kept in RAM itself: it may also move part of one more layer, and picks which layers' "
            "experts stay" if c.expert_layers_on_cpu else " itself") + ")")
        notes.append("no num_gpu: with num_gpu set Ollama passes -ngl, and llama.cpp's --fit then leaves the placement "
                     "to it (common/fit.cpp: \"n_gpu_layers already set by user\")")
    else:
        notes.append(q.chosen.reason)
    memory = ("flash attention off on CUDA: 512, or 256 beyond 4096 tokens on a GPU of at most 8 GiB"
              if launch.flash_attn == "off" else
              f"predicted VRAM {format_bytes(launch.predicted_vram_bytes)} of {format_bytes(launch.available_bytes)} "
              "free" if hw.has_gpu else "no GPU: the context alone decides")
    notes.append(f"num_batch {launch.num_batch}: Ollama's automatic choice for {launch.num_ctx * launch.num_parallel} "
                 f"tokens of context (server/sched.go automaticGenerationBatch: {memory})")
    if launch.flash_attn == "off":
        notes.append(f"--flash-attn off: Ollama's rule for these GPUs ({FLASH_ATTENTION_RULE}); "
                     "OLLAMA_FLASH_ATTENTION=1 would force it on")
    if launch.single_gpu_of:
        notes.append(f"one GPU of {launch.single_gpu_of}: Ollama runs a model on the GPU with the most free memory "
                     f"when its predicted VRAM is at most {SINGLE_GPU_PCT} % of it (OLLAMA_SCHED_SPREAD=1: all GPUs)")
    notes.append("Ollama will start: " + shell_join(argv))
    env = [f"OLLAMA_KV_CACHE_TYPE={kv}"] if kv != "f16" else []
    if req.batch > 1:
        env.append(f"OLLAMA_NUM_PARALLEL={req.batch}")
    if env:
        notes.append("server environment (not a Modelfile setting): " + " ".join(env) + " ollama serve"
                     + (" (--flash-attn auto turns flash attention on for a quantized V cache: llama.cpp's "
                        "llama_init_from_model)" if kv != "f16" else ""))
    notes.append(f"llama-server keeps finished prompts' KV state in RAM up to its --cache-ram default of "
                 f"{rules.PROMPT_CACHE_DEFAULT_MIB} MiB: Ollama passes no --cache-ram, so the plan counts it in RAM")
    notes += [w for w in q.warnings if not w.startswith("assumption: ")]
    notes += assumption_notes(consts)
    hub_file = spec.gguf is not None and spec.location.startswith(HUB_GGUF_PREFIX)
    pull = (f"ollama pull {tag}" if tag else f"ollama pull {spec.location}" if hub_file else
            "(the GGUF file itself: nothing to pull)" if spec.gguf is not None else
            f"(no library tag: build {llamacpp.gguf_file_name(spec, ft)}, see above)")
    body = "\n".join([f"# {one_line(pull)}", f"FROM {modelfile_value(gguf)}", f"PARAMETER num_ctx {req.context}"])
    return Export(engine=ENGINE, fits=True, text=commented(notes, body), notes=tuple(notes), constants=consts,
                  details={"ollama_version": OLLAMA_VERSION, "tag": tag, "gguf_file_type": ft, "kv_cache_type": kv,
                           "num_ctx": req.context, "num_parallel": launch.num_parallel, "num_batch": launch.num_batch,
                           "llama_server_argv": argv, "fit_ngl": sum(c.gpu_layers_per_device) + 1 if c.on_gpu else 0,
                           "fit_expert_layers_on_cpu": c.expert_layers_on_cpu, "plan": q.to_dict()})


def row(spec: ModelSpec, hw: HardwareProfile, q: Plan, plan_decode: float | None, notes=()) -> EngineAnswer:
    """An Ollama plan as a row of the engine table: its tag and launch beside llama.cpp's placement and speed."""
    a = EngineAnswer.of_plan(ENGINE, q, "vramplan plan --engine ollama", "llama.cpp's speed model at Ollama's launch",
                             plan_decode, notes=notes)
    if q.fits:
        launch = ollama_launch(spec, hw, q.request, q.choice.weight_quant)
        a.tag = ollama_tag(spec, q.choice.weight_quant)[0]
        a.launch = f"num_ctx {launch.num_ctx}, num_batch {launch.num_batch}"
    return a
