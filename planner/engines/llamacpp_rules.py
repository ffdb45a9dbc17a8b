"""llama.cpp's memory rules, as llama.cpp applies them: GGUF tensor bytes, where each tensor and KV row lives,
its compute buffers and the margin `--fit` keeps free per device. Named constants, each with its source.

LlamaCppPlacement (src/llama-model.cpp, load_tensors): with `-ngl N` the last N of the n_layer + 1 "layer slots"
(the decoder layers, then the output layer) go to the GPUs, i_gpu_start = max(n_layer + 1 - N, 0); the
input layer (token_embd) always stays in host memory (dev_input = CPU). Layers that stay on the CPU are
computed by the CPU; nothing is streamed. `--n-cpu-moe N` keeps the routed-expert tensors (`*_exps`) of
the first N layers in host memory (common/arg.cpp). Each layer's K and V rows live on its layer's device
(src/llama-kv-cache.cpp: `buft = ggml_backend_dev_buffer_type(model.dev_layer(il))` with offload_kqv on).
With several GPUs, `-ts` splits the GPU slots in proportion (llama_model load_tensors: cumulative splits).
Pure: no torch.
"""

from __future__ import annotations

import math
from itertools import accumulate
from dataclasses import replace

from ..memo import ObjectMemo
from ..capacity import Capacity
from ..record import record
from ..gguf import GGML_TYPES, GGUFTensor, gguf_sums
from ..modelspec import ModelSpec
from ..request import LLAMA_CPP_KV_DTYPES, Request
from ..units import MiB
from .common import EngineConstant


def n_cpu_moe(layers_in_ram) -> int:
    """llama.cpp's --n-cpu-moe for the decoder layers (indices) whose routed experts stay in RAM: it counts decoder
    layers from the first, dense ones included, so it is one past the last of them (0: none)."""
    return max(layers_in_ram, default=-1) + 1


def moe_layers_in_ram(spec: ModelSpec, cpu_moe: int) -> list[int]:
    """The MoE layers (indices) whose routed experts --n-cpu-moe `cpu_moe` keeps in RAM: those below it."""
    return [i for i in sorted(spec.moe.moe_layers) if i < cpu_moe] if spec.moe is not None else []

LLAMA_CPP = "ggml-org/llama.cpp"
# The llama.cpp whose llama-server ran vramplan's exported commands (bench/llamacpp_serve.py) and whose
# llama-quantize wrote tests/data/gguf_golden.json.
MEASURED_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
COMMON_H = f"{LLAMA_CPP} common/common.h @ 001d906a6d86e2490e394361e7cc6f478b100088"
ARG_CPP = f"{LLAMA_CPP} common/arg.cpp @ 145b6280d6aa1890e22457143dad0badb3fd6820"
MODEL_CPP = f"{LLAMA_CPP} src/llama-model.cpp @ a5410f046c01d01330c8a42f13b64a211fedf2c3"
KV_CACHE_CPP = f"{LLAMA_CPP} src/llama-kv-cache.cpp @ 3514e9f6e795d3b3cd88d6614f6c07e7ce6f916f"
CONTEXT_CPP = f"{LLAMA_CPP} src/llama-context.cpp @ 4c7103b96d720ea6057eec6ac11a49727f9ecd43"
SERVER_CPP = f"{LLAMA_CPP} tools/server/server.cpp @ {MEASURED_COMMIT}"
COMMON_H_MEASURED = f"{LLAMA_CPP} common/common.h @ {MEASURED_COMMIT}"
# Read in the tree llama-cpp-python 0.3.36's sdist vendors, which is MEASURED_COMMIT (its vendor/llama.cpp submodule).
ISWA_CPP = f"{LLAMA_CPP} src/llama-kv-cache-iswa.cpp @ {MEASURED_COMMIT}"
CONTEXT_CPP_MEASURED = f"{LLAMA_CPP} src/llama-context.cpp @ {MEASURED_COMMIT}"
FIT_CPP = f"{LLAMA_CPP} common/fit.cpp @ {MEASURED_COMMIT}"
CUDA_CU = f"{LLAMA_CPP} ggml/src/ggml-cuda/ggml-cuda.cu @ {MEASURED_COMMIT}"
BACKEND_CPP = f"{LLAMA_CPP} ggml/src/ggml-backend.cpp @ {MEASURED_COMMIT}"
LOADER_CPP = f"{LLAMA_CPP} src/llama-model-loader.cpp @ {MEASURED_COMMIT}"
PERPLEXITY_README = ("ggerganov/llama.cpp examples/perplexity/README.md @ 0a21ad6e3f457f81ad6af43b95856bf7064a9ef9, "
                     "'LLaMA 3 8b Scoreboard' (wikitext-2, CUDA)")

# --fit keeps this much free on every device: common_params::fit_params_target = 1024*1024*1024 per device
# (`-fitt MiB` changes it).
FIT_TARGET_MARGIN_BYTES = 1024 * MiB
# Physical batch of a prompt-processing step: common_params::n_ubatch = 512 (`-ub`); the compute buffers are
# reserved for a graph of this many tokens.
N_UBATCH = 512
# The GGUF file types a llama.cpp plan chooses among, best quality first (by FILE_TYPE_DELTA_PPL): every one with a
# perplexity row but the legacy Q4_0/Q4_1/Q5_0/Q5_1 and the _S/_L K-quant siblings a listed type of its size beats,
# and IQ4_NL (IQ4_XS is as good and smaller). TQ1_0, TQ2_0 and MXFP4_MOE have no row (NO_PERPLEXITY_ROW): not planned.
PLANNED_FILE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "Q3_K_M", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS",
                      "IQ2_M", "Q2_K_S", "IQ2_S", "Q2_K", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
# -ctk / -ctv types (common/arg.cpp kv_cache_types holds these and more) -> ggml type whose block layout sizes a row.
KV_GGML_TYPES = {name: GGML_TYPES[name.upper()] for name in LLAMA_CPP_KV_DTYPES}

# Perplexity increase of each file type over F16 on Llama-3-8B (PERPLEXITY_README): delta PPL over the F16
# PPL 6.231634 (= q8_0's 6.234284 - 0.002650); the rows quantized without an importance matrix ("imatrix None") where
# the table has one. The IQ rows and Q2_K_S are in it only with one (FILE_TYPE_PPL_IMATRIX): those rows are with it,
# as llama-quantize makes those files (planner/gguf.py: IQ1-IQ2, IQ3_XXS, IQ3_XS and Q2_K_S require one). The same
# table, unchanged, is in tools/perplexity/README.md of the tree vramplan's llama.cpp rules follow (MEASURED_COMMIT).
LLAMA3_8B_F16_PPL = 6.231634
FILE_TYPE_DELTA_PPL = {"BF16": 0.0, "F16": 0.0, "Q8_0": 0.002650, "Q6_K": 0.021748, "Q5_K_M": 0.056974,
                       "Q5_K_S": 0.104964, "Q5_1": 0.106223, "Q5_0": 0.131591, "Q4_K_M": 0.175482,
                       "Q4_K_S": 0.268895, "Q4_1": 0.451103, "Q4_0": 0.468514, "IQ4_NL": 0.223959,
                       "IQ4_XS": 0.228071, "Q3_K_L": 0.556242, "Q3_K_M": 0.656864, "IQ3_M": 0.666694,
                       "IQ3_S": 0.733867, "IQ3_XS": 0.931409, "IQ3_XXS": 1.226803, "Q3_K_S": 1.632152,
                       "IQ2_M": 2.369166, "Q2_K_S": 3.092145, "IQ2_S": 3.419148, "Q2_K": 3.519934,
                       "IQ2_XS": 4.529791, "IQ2_XXS": 7.860148, "IQ1_M": 19.262089, "IQ1_S": 54.462959}
# The rows of FILE_TYPE_DELTA_PPL measured with an importance matrix, and which (the table's "imatrix" column: "WT 10m",
# 10 million wikitext tokens; q2_K_S and iq1_S have rows for 1k-10m tokens, the 10m ones are taken as for the others).
FILE_TYPE_PPL_IMATRIX = {t: "WT 10m" for t in ("IQ4_NL", "IQ4_XS", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "IQ2_M",
                                               "Q2_K_S", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")}
# The file types planner/gguf.py sizes that have no perplexity row, and why: no public number for them on Llama-3-8B
# (or any model whose weights are not already in their format) was found. Not planned; asked for by name, they need a
# stand-in or an unknown cost.
NO_PERPLEXITY_ROW = {
    "TQ1_0": "ternary (1.69 bpw): made for ternary-trained models (BitNet b1.58, TriLM); its perplexity was published "
             "for those only, not for ternarizing a model trained in 16 bits",
    "TQ2_0": "ternary (2.06 bpw): made for ternary-trained models (BitNet b1.58, TriLM); its perplexity was published "
             "for those only, not for ternarizing a model trained in 16 bits",
    "MXFP4_MOE": "MXFP4 routed experts, Q8_0 elsewhere: on a dense model (Llama-3-8B) its file is Q8_0's, tensor for "
                 "tensor, so the scoreboard's q8_0 row measures nothing of MXFP4; no perplexity of MXFP4 experts "
                 "quantized from 16 bits was found (for gpt-oss, whose checkpoint stores its experts MXFP4, the "
                 "experts are unchanged and the rest is Q8_0)",
}
# A file type the perplexity table lacks, asked for by name (--quant Q4_0), borrows the row of the listed type of its
# size (an assumption, said so). The ternary types (NO_PERPLEXITY_ROW) store the same ternary values in two packings:
# both borrow the table's lowest row (IQ1_S), as a bound, not a measurement; MXFP4_MOE (4.25 bpw experts, Q8_0
# elsewhere) the 4-bit row of the listed types, except where the checkpoint stores its experts MXFP4
# (planner/engines/llamacpp.py stand_in).
QUALITY_STAND_IN = {"Q4_0": "Q4_K_M", "Q4_1": "Q4_K_M", "Q4_K_S": "Q4_K_M", "IQ4_NL": "IQ4_XS", "Q5_0": "Q5_K_M",
                    "Q5_1": "Q5_K_M", "Q5_K_S": "Q5_K_M", "Q3_K_L": "Q3_K_M", "Q3_K_S": "Q3_K_M",
                    "TQ1_0": "IQ1_S", "TQ2_0": "IQ1_S", "MXFP4_MOE": "Q4_K_M"}
# KV cache quantization's perplexity cost: no measured table was found in llama.cpp's docs: ASSUMED values,
# said so in every plan that uses them.
KV_QUALITY_PCT_ASSUMED = {"f16": 0.0, "q8_0": 0.1, "q4_0": 1.0}

# Prompt processing with layers in RAM (op offload): ggml's scheduler runs an op whose weight is in a host buffer on a
# GPU backend that asks for it (BACKEND_CPP ggml_backend_sched_backend_id_from_cur: sched->op_offload, on by default,
# and ggml_backend_offload_op), copying the weight over the link for each ubatch (ggml_backend_sched_compute_splits:
# only the experts a MUL_MAT_ID uses). CUDA asks for every op whose batch is at least
# GGML_OP_OFFLOAD_MIN_BATCH tokens, 32 unless that variable says otherwise (CUDA_CU ggml_backend_cuda_device_offload_op,
# get_op_batch_size). With mmap (the default load mode) the weights in RAM stay in the mapped file, pageable memory
# (LOADER_CPP: "avoid using a host buffer when using mmap"): they cross at the link's pageable rate.
OP_OFFLOAD_MIN_BATCH = 32
# llama-server without -np: "auto", 4 slots sharing one unified KV pool (tools/server/server.cpp).
SERVER_AUTO_SLOTS = 4
# llama-server keeps the KV state of finished prompts in host RAM, up to --cache-ram MiB (common.h cache_ram_mib;
# tools/server/server-task.cpp server_prompt_cache): beside every buffer, growing as it serves.
PROMPT_CACHE_DEFAULT_MIB = 8192
# Models with sliding-window layers also keep up to --ctx-checkpoints copies of those layers' cache per slot
# (common.h n_ctx_checkpoints), in host RAM: not planned (their size depends on the prompts served).
CTX_CHECKPOINTS_DEFAULT = 32
# n_ctx and every cache stream are padded to 256 cells (src/llama-context.cpp, src/llama-kv-cache-iswa.cpp).
KV_PAD = 256
# The architectures whose sliding windows llama.cpp keeps (src/models/*.cpp set a swa_type; HF model_type names). Any
# other's window is dropped and its layers cache the whole context: phi3 says so ("Phi SWA is currently disabled",
# src/models/phi3.cpp), and the llama, qwen2 and starcoder2 graphs have no window.
SWA_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "cohere2", "gpt_oss",
                             "exaone4", "olmo3", "llama4"})
# Compute buffers: ggml-alloc sizes them from a worst-case graph at load (llama.cpp logs "compute buffer size").
# Not derivable exactly without building the graph: ESTIMATED here, with flash attention on, as
#   scratch n_ubatch x (4 hidden + 3 x FFN width) x 4 B + the f16 KQ mask n_ubatch x cells of a stream x 2 B per cache
#   logits  n_vocab x slots x 4 B (f32, on the device holding the output layer: one row per slot is reserved)
# Measured against a CPU build (bench/results/llamacpp-serve-cpu-dev.md, 13 runs of 5 models): 2-11 % over. CUDA's
# are unmeasured.
COMPUTE_HIDDEN_COPIES = 4
COMPUTE_FFN_COPIES = 3
COMPUTE_SOURCE = ("estimate of the compute buffer ggml-alloc reserves at load; measured 2-11 % over on 5 models with a "
                  "CPU build (bench/results/llamacpp-serve-cpu-dev.md)")
# RSS of llama-server beside its buffers (binary, libraries, tokenizer, slots, heap). A CPU build: MEASURED, peak RSS
# after a first request less every buffer llama.cpp reports: at most 51 MiB over the 13 runs of
# bench/results/llamacpp-serve-cpu-dev.md (Gemma-2's, with a 13 MiB context checkpoint), rounded up. Its prompt cache
# comes on top, bounded by --cache-ram (PROMPT_CACHE_DEFAULT_MIB). A CUDA build also maps the CUDA runtime and
# cuBLAS: ASSUMED, unmeasured.
PROCESS_BASE_RAM_CPU_BUILD = 64 * MiB
PROCESS_BASE_RAM_GPU_ASSUMED = 256 * MiB


def process_base_ram(has_gpu: bool) -> int:
    return PROCESS_BASE_RAM_GPU_ASSUMED if has_gpu else PROCESS_BASE_RAM_CPU_BUILD


def constants(hw_name: str, cuda_context_bytes: int, file_types=(), kv_types=(), *, has_gpu: bool = True
              ) -> dict[str, EngineConstant]:
    """The llama.cpp constants a plan or an export of these file and cache types used, by name (numbers only: a
    plan's table shows them)."""
    base = (EngineConstant(PROCESS_BASE_RAM_GPU_ASSUMED, "llama-server's RSS beside its buffers, CUDA build",
                           assumption=True) if has_gpu else
            EngineConstant(PROCESS_BASE_RAM_CPU_BUILD, "llama-server's RSS beside its buffers, CPU build: measured "
                           "(bench/results/llamacpp-serve-cpu-dev.md)"))
    out = {
        "fit_target_margin_bytes": EngineConstant(FIT_TARGET_MARGIN_BYTES, f"{COMMON_H}: fit_params_target "
                                                  "(1024*1024*1024 per device; -fitt in common/arg.cpp)"),
        "n_ubatch": EngineConstant(N_UBATCH, f"{COMMON_H}: n_ubatch"),
        "cuda_context_bytes": EngineConstant(cuda_context_bytes, f"profile {hw_name}: overheads.cuda_context "
                                             "(llama.cpp's --fit measures free memory after it)"),
        "llama3_8b_f16_ppl": EngineConstant(LLAMA3_8B_F16_PPL, PERPLEXITY_README),
        "server_auto_slots": EngineConstant(SERVER_AUTO_SLOTS, f"{SERVER_CPP}: n_parallel auto"),
        "op_offload_min_batch": EngineConstant(OP_OFFLOAD_MIN_BATCH, f"{CUDA_CU}: GGML_OP_OFFLOAD_MIN_BATCH default "
                                               "(prompt processing of layers in RAM runs on the GPU from this batch)"),
        "prompt_cache_default_mib": EngineConstant(PROMPT_CACHE_DEFAULT_MIB, f"{COMMON_H_MEASURED}: cache_ram_mib"),
        "compute_hidden_copies": EngineConstant(COMPUTE_HIDDEN_COPIES, COMPUTE_SOURCE, assumption=has_gpu),
        "compute_ffn_copies": EngineConstant(COMPUTE_FFN_COPIES, COMPUTE_SOURCE, assumption=has_gpu),
        "process_base_ram_bytes": base,
    }
    out.update({f"delta_ppl_{k}": EngineConstant(FILE_TYPE_DELTA_PPL[k], PERPLEXITY_README) for k in file_types})
    out.update({f"kv_quality_pct_{k}": EngineConstant(KV_QUALITY_PCT_ASSUMED[k], "no published perplexity table for "
                                                      "llama.cpp's quantized KV cache was found", assumption=True)
                for k in kv_types if KV_QUALITY_PCT_ASSUMED[k]})
    return out


def quality_cost_pct(file_type: str, kv_type: str) -> float:
    return 100.0 * FILE_TYPE_DELTA_PPL[file_type] / LLAMA3_8B_F16_PPL + KV_QUALITY_PCT_ASSUMED[kv_type]


def is_expert_tensor(t: GGUFTensor) -> bool:
    """The routed-expert tensors --n-cpu-moe / --cpu-moe keep in host memory (llm_ffn_exps_cpu_override: *_exps)."""
    return "_exps." in t.name


@record
class GGUFModel:
    """A GGUF file's bytes as llama.cpp places them: per decoder layer, routed experts apart, and outside."""

    file_type: str
    layers: tuple[int, ...]  # data bytes of each decoder layer's tensors
    experts: tuple[int, ...]  # of which routed experts (*_exps)
    token_embd_bytes: int  # always in host memory (dev_input)
    # the output layer slot: output.weight (a GPU copy of token_embd when tied) + output_norm + generated
    output_bytes: int
    tied_copy_bytes: int = 0  # of which the copy of a tied token_embd: none while the output layer stays in RAM

    @property
    def total_bytes(self) -> int:
        """What the loaded model occupies with the output layer on a GPU; a tied token_embd is counted once in host
        memory and once as output."""
        return sum(self.layers) + self.token_embd_bytes + self.output_bytes

    @property
    def host_output_bytes(self) -> int:
        """The output slot's bytes when it stays in RAM: a tied output is the mmapped token_embd itself (llama.cpp's
        TENSOR_DUPLICATED tensor in the same host buffer; measured: bench/results/llamacpp-serve-cpu-dev.md)."""
        return self.output_bytes - self.tied_copy_bytes


def gguf_model(spec: ModelSpec, file_type: str) -> GGUFModel:
    """The file's bytes as the llama.cpp planner places them; the same object for the same spec and file type (the
    last few kept: the searches of llama.cpp and Ollama ask for each file type several times)."""
    return _GGUF_MODELS.get((spec,), (file_type,), lambda: _gguf_model(spec, file_type))


_GGUF_MODELS = ObjectMemo(64)


def _gguf_model(spec: ModelSpec, file_type: str) -> GGUFModel:
    sums = gguf_sums(spec, file_type)  # per layer, and of it the routed experts' (is_expert_tensor)
    token_embd = output = 0
    tied = True
    for name, nbytes in sums.outside:
        if name == "token_embd.weight":
            token_embd = nbytes
        else:
            tied = tied and name != "output.weight"
            output += nbytes  # output.weight, output_norm, rope_freqs / rope factors
    copy = token_embd if tied else 0  # llama-model.cpp loads token_embd again (TENSOR_DUPLICATED) as the output
    return GGUFModel(file_type=file_type, layers=sums.layers, experts=sums.experts, token_embd_bytes=token_embd,
                     output_bytes=output + copy, tied_copy_bytes=copy)


@record
class Slots:
    """How the server holds sequences: `count` slots (n_seq_max), one KV pool all share (`unified`) or one KV stream
    per slot, how many rows of logits its compute graph is reserved for, and the physical batch (-ub) its graph and
    its sliding-window caches are sized for."""

    count: int
    unified: bool
    logit_rows: int  # in the compute graph, on the device with the output layer
    output_rows: int  # in the host output buffer the logits are copied to
    n_ubatch: int = N_UBATCH  # -ub (llama_context caps it at -b and at n_ctx)


def llama_server_slots(req: Request) -> Slots:
    """llama-server's slots for what the export writes (tools/server/server.cpp): no -np (a batch of 1) is "auto", 4
    slots sharing one unified pool of -c cells; -np N, N slots with a stream of -c/N cells each (common.h
    kv_unified = false). The graph is reserved for one logits row per slot (server-context.cpp server_output_limits:
    n_outputs_max = n_parallel)."""
    if req.batch > 1:
        return Slots(count=req.batch, unified=False, logit_rows=req.batch, output_rows=req.batch)
    return Slots(count=SERVER_AUTO_SLOTS, unified=True, logit_rows=SERVER_AUTO_SLOTS, output_rows=SERVER_AUTO_SLOTS)


def _pad(n: int) -> int:
    return -(-n // KV_PAD) * KV_PAD


def kv_streams(req: Request, slots: Slots) -> tuple[int, int]:
    """(cells per stream, streams): -c is the context of all slots together, padded to 256
    (src/llama-context.cpp); without a unified pool each slot's stream holds -c / slots cells, padded too."""
    n_ctx = _pad(req.context * req.batch)
    return (n_ctx, 1) if slots.unified else (_pad(n_ctx // slots.count), slots.count)


def window(spec: ModelSpec, layer) -> int | None:
    """A layer's sliding window as llama.cpp keeps it (None: the whole context; see SWA_MODEL_TYPES)."""
    return layer.window if spec.model_type in SWA_MODEL_TYPES else None


def as_run(spec: ModelSpec) -> ModelSpec:
    """The model as llama.cpp runs it: without the sliding windows it drops (its speed attends the whole context),
    and without transformers' MLA expansion (`without_mla_expansion`). The same object for the same spec (the last
    few kept): the speed model's memos know a model by its object."""
    return _AS_RUN.get((spec,), (), lambda: _as_run(spec))


_AS_RUN = ObjectMemo(8)


def _as_run(spec: ModelSpec) -> ModelSpec:
    spec = without_mla_expansion(spec)
    if spec.model_type in SWA_MODEL_TYPES or not any(a.window for a in spec.attention):
        return spec
    return replace(spec, attention=tuple(replace(a, window=None) for a in spec.attention))


def without_mla_expansion(spec: ModelSpec) -> ModelSpec:
    """MLA layers costed as before vramplan modelled transformers' `expand_kv` (AttentionLayout.expands_cache):
    llama.cpp's deepseek2 graph never up-projects the cached context per token, and its fitted attention
    efficiencies were fitted on this costing."""
    if not any(a.expands_cache for a in spec.attention):
        return spec
    return replace(spec, attention=tuple(replace(a, mla_rope_dim=None, v_head_dim=None) if a.expands_cache else a
                                         for a in spec.attention))


def layer_cells(window: int | None, req: Request, slots: Slots) -> tuple[int, int]:
    """(cells per stream, streams) of one layer's cache: a sliding-window layer keeps min(stream, window x slots sharing
    the stream + n_ubatch) cells, padded to 256, in each of the streams (ISWA_CPP: size_swa =
    GGML_PAD(min(size_base, n_swa * (unified ? n_seq_max : 1) + n_ubatch), 256), without --swa-full; size_base is
    llama_context's n_ctx_seq, one stream's cells, and llama_kv_cache allocates kv_size x n_stream cells)."""
    cells, streams = kv_streams(req, slots)
    if window is None:
        return cells, streams
    return _pad(min(cells, window * (slots.count if slots.unified else 1) + slots.n_ubatch)), streams


def kv_bytes_per_layer(spec: ModelSpec, kv_type: str, req: Request, slots: Slots | None = None) -> list[int]:
    """K and V rows of each layer (src/llama-kv-cache.cpp: a type_k tensor n_embd_k_gqa x kv_size per stream and a
    type_v one; MLA caches one latent row) for llama-server's slots unless `slots` says otherwise."""
    t = KV_GGML_TYPES[kv_type]
    slots = slots or llama_server_slots(req)

    def row(elements: int) -> int:
        return math.ceil(elements / t.block_elements) * t.block_bytes

    def layer(a) -> int:
        cells, streams = layer_cells(window(spec, a), req, slots)
        n = cells * streams
        return n * row(a.kv_elements_per_token) if a.kind == "mla" else 2 * n * row(a.num_kv_heads * a.head_dim)

    return spec.per_attention_layout(layer)  # most models' layers share one layout: each distinct one counted once


def checkpoint_bytes_max(spec: ModelSpec, kv_type: str, req: Request, slots: Slots) -> int:
    """The most one context checkpoint holds: one sequence's cells of the sliding-window layers, at most window +
    n_ubatch of them and at most a stream, K and V rows (tools/server/server-context.cpp create_checkpoint writes the
    slot's sequence with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the window caches only)."""
    t = KV_GGML_TYPES[kv_type]
    total = 0
    for a in spec.attention:
        w = window(spec, a)
        if w is None:
            continue
        cells = min(kv_streams(req, slots)[0], w + slots.n_ubatch)
        elements = a.kv_elements_per_token if a.kind == "mla" else 2 * a.num_kv_heads * a.head_dim
        total += cells * math.ceil(elements / t.block_elements) * t.block_bytes
    return total


def compute_buffer_bytes(spec: ModelSpec, req: Request, *, with_logits: bool, slots: Slots | None = None) -> int:
    """ESTIMATED compute buffer of one backend: the scratch of one ubatch (see COMPUTE_*_COPIES), the f16 KQ mask of
    each cache (n_kv of a stream x n_ubatch; src/llama-graph.cpp build_attn_inp_kq_mask) and, on the device with the
    output layer, the f32 logits rows the graph is reserved for."""
    slots = slots or llama_server_slots(req)
    cells, streams = kv_streams(req, slots)
    tokens = min(slots.n_ubatch, cells * streams)
    scratch = tokens * (COMPUTE_HIDDEN_COPIES * spec.hidden_size + COMPUTE_FFN_COPIES * spec.mlp_width) * 4
    windows = {window(spec, a) for a, _ in spec.attention_groups}
    caches = {w: layer_cells(w, req, slots)[0] for w in windows}  # a mask per cache
    mask = tokens * sum(caches.values()) * 2
    return scratch + mask + (spec.vocab_size * slots.logit_rows * 4 if with_logits else 0)


def output_buffer_bytes(spec: ModelSpec, slots: Slots) -> int:
    """The host buffer the logits are copied to: n_vocab x max(outputs, slots) f32 (llama-context.cpp
    output_reserve)."""
    return spec.vocab_size * slots.output_rows * 4


@record
class LlamaCppPlacement:
    """-ngl and --n-cpu-moe: the last `gpu_layers` decoder layers (and the output layer, when any is) on the GPUs,
    split over devices as `per_device`; the experts of the first `cpu_moe` layers in host memory."""

    gpu_layers: int
    cpu_moe: int
    per_device: tuple[int, ...]  # GPU slots (decoder layers, plus the output layer on its device) per device

    @property
    def ngl(self) -> int:
        """The -ngl value: decoder layers plus the output slot (0: nothing on a GPU)."""
        return sum(self.per_device)


@record
class DeviceBytes:
    """What llama.cpp puts on one device: weights, KV cache and compute buffer bytes."""

    weights: int
    kv: int
    compute: int


class LlamaCppFootprint:
    """Every byte of one GGUF file type x KV cache type x request, per device, by llama.cpp's rules."""

    def __init__(self, spec: ModelSpec, model: GGUFModel, kv_type: str, req: Request, cap: Capacity,
                 cuda_context_bytes: int, margin_bytes: int = FIT_TARGET_MARGIN_BYTES,
                 slots: Slots | None = None, base_ram_bytes: int = PROCESS_BASE_RAM_GPU_ASSUMED):
        """`cap`: the machine's capacity (planner.capacity: budgets applied; on unified memory the GPU's share comes
        out of the RAM); `margin_bytes`: what the engine keeps free per device (llama.cpp's --fit margin; Ollama has
        its own); `slots`: the server's sequences (llama-server's by default); `base_ram_bytes`: the process beside
        its buffers."""
        self.spec, self.model, self.req, self.kv_type = spec, model, req, kv_type
        slots = slots or llama_server_slots(req)
        self.slots = slots
        self.base_ram_bytes = base_ram_bytes
        self.output_buffer = output_buffer_bytes(spec, slots)
        self.kv = kv_bytes_per_layer(spec, kv_type, req, slots)
        self.L = spec.num_layers
        self.margin_bytes = margin_bytes
        self.usable = [c - cuda_context_bytes - margin_bytes for c in cap.gpus]
        self.cuda_context_bytes = cuda_context_bytes
        self.cap = cap
        self.ram_capacity = cap.ram_bytes  # what RAM holds with nothing on a GPU (ram_for: beside a placement's GPUs)
        self.scratch = compute_buffer_bytes(spec, req, with_logits=False, slots=slots)
        self.with_logits = compute_buffer_bytes(spec, req, with_logits=True, slots=slots)
        # prefix sums of the layers' weights, KV and routed experts: sum over layers [a, b) is p[b] - p[a]
        self.pw, self.pkv, self.px = (list(accumulate(v, initial=0)) for v in (model.layers, self.kv, model.experts))

    def _gpu_layer_cost(self, i: int, cpu_moe: int) -> int:
        in_ram = self.model.experts[i] if i < cpu_moe else 0
        return self.model.layers[i] - in_ram + self.kv[i]

    def pack(self, gpu_layers: int, cpu_moe: int) -> LlamaCppPlacement | None:
        """The devices' share of the last `gpu_layers` layers and the output layer, filled in device order
        (as -ts splits them), or None when they do not fit."""
        if not self.usable:
            return None
        if len(self.usable) == 1 and self.with_logits >= self.scratch:
            # one device: every step adds bytes (the output slot's compute buffer replaces the scratch one, no
            # smaller), so the whole sum decides; by prefix sums, what the bisections ask dozens of times
            return self._pack_one(gpu_layers, cpu_moe)
        return self._pack_in_order(gpu_layers, cpu_moe)

    def _pack_in_order(self, gpu_layers: int, cpu_moe: int) -> LlamaCppPlacement | None:
        """pack, slot by slot into the devices in order."""
        counts = [0] * len(self.usable)
        used = [0] * len(self.usable)
        d = 0
        costs = [self._gpu_layer_cost(i, cpu_moe) for i in range(self.L - gpu_layers, self.L)]
        costs.append(self.model.output_bytes)  # the output slot
        for k, cost in enumerate(costs):
            last = k == len(costs) - 1
            while d < len(self.usable):
                extra = (self.with_logits if last else self.scratch) - (self.scratch if counts[d] else 0)
                if used[d] + cost + extra <= self.usable[d]:
                    break
                d += 1
            if d == len(self.usable):
                return None
            used[d] += cost + (self.with_logits if last else self.scratch) - (self.scratch if counts[d] else 0)
            counts[d] += 1
        return LlamaCppPlacement(gpu_layers=gpu_layers, cpu_moe=cpu_moe, per_device=tuple(counts))

    def _in_ram(self, a: int, b: int, cpu_moe: int) -> int:
        """Bytes of routed experts in RAM among layers [a, b) with --n-cpu-moe `cpu_moe` (layers below it)."""
        return self.px[min(b, cpu_moe)] - self.px[min(a, cpu_moe)] if cpu_moe > a else 0

    def _pack_one(self, gpu_layers: int, cpu_moe: int) -> LlamaCppPlacement | None:
        first, L = self.L - gpu_layers, self.L
        need = (self.pw[L] - self.pw[first] + self.pkv[L] - self.pkv[first] - self._in_ram(first, L, cpu_moe)
                + self.model.output_bytes + self.with_logits)
        if need > self.usable[0]:
            return None
        return LlamaCppPlacement(gpu_layers=gpu_layers, cpu_moe=cpu_moe, per_device=(gpu_layers + 1,))

    def device_bytes(self, p: LlamaCppPlacement) -> list[DeviceBytes]:
        """Each device's share: its slots in order (the last gpu_layers layers, then the output slot)."""
        out, a, left = [], self.L - p.gpu_layers, p.gpu_layers + 1  # left: slots, the output one last
        for n in p.per_device:
            has_output = n == left and n > 0
            b = a + n - (1 if has_output else 0)  # its layers [a, b)
            weights = self.pw[b] - self.pw[a] - self._in_ram(a, b, p.cpu_moe)
            compute = (self.with_logits if has_output else self.scratch) if n else 0
            out.append(DeviceBytes(weights=weights + (self.model.output_bytes if has_output else 0),
                                   kv=self.pkv[b] - self.pkv[a], compute=compute))
            a, left = b, left - n
        return out

    def host_bytes(self, p: LlamaCppPlacement) -> DeviceBytes:
        first = self.L - p.gpu_layers  # layers [0, first) on the CPU
        experts_here = self._in_ram(first, self.L, p.cpu_moe)
        weights = (self.model.token_embd_bytes + self.pw[first] + experts_here
                   + (0 if p.ngl else self.model.host_output_bytes))
        computes_here = first > 0 or experts_here > 0
        compute = (self.scratch if p.ngl else self.with_logits) if computes_here else 0
        return DeviceBytes(weights=weights, kv=self.pkv[first], compute=compute + self.output_buffer)

    def host_total(self, p: LlamaCppPlacement) -> int:
        h = self.host_bytes(p)
        return h.weights + h.kv + h.compute + self.base_ram_bytes

    def gpu_total(self, p: LlamaCppPlacement) -> int:
        """Every byte a placement puts on the GPUs: their layers, KV and compute buffers, and a context each used."""
        devices = self.device_bytes(p) if p.per_device else []
        return sum(d.weights + d.kv + d.compute + self.cuda_context_bytes for d in devices)

    def ram_for(self, p: LlamaCppPlacement) -> int:
        """The RAM the host side of `p` may take: all of it, or on unified memory what the GPU side leaves, the
        margin --fit keeps free on each device it uses counted with the GPU side (it is the same pool)."""
        if not self.cap.unified:
            return self.cap.ram_bytes
        return self.cap.ram_left(self.gpu_total(p) + self.margin_bytes * len(p.per_device or ()))

    def fits_host(self, p: LlamaCppPlacement) -> bool:
        return self.host_total(p) <= self.ram_for(p)

    def resident_slack(self) -> int:
        """Bytes to spare with every layer resident: on the GPUs taken together (their usable bytes less every
        layer, the output layer and one compute buffer), or in RAM without a GPU. What a search over the context
        steers by; whether it fits is pack's and fits_host's."""
        if not self.usable:
            return self.ram_capacity - self.host_total(LlamaCppPlacement(gpu_layers=0, cpu_moe=0, per_device=()))
        need = self.pw[self.L] + self.pkv[self.L] + self.model.output_bytes + self.with_logits
        slack = sum(self.usable) - need
        if self.cap.unified:  # the host side shares the pool: the RAM left beside every layer on the GPU
            everything = LlamaCppPlacement(gpu_layers=self.L, cpu_moe=0, per_device=(self.L + 1,))
            slack = min(slack, self.ram_for(everything) - self.host_total(everything))
        return slack

    def place(self, forced_gpu_layers: int | None = None, *, expert_offload: bool = True,
              forced_cpu_moe: int | None = None) -> tuple[LlamaCppPlacement | None, LlamaCppPlacement]:
        """The placement llama.cpp users pick (every layer on the GPUs; for an MoE, the fewest layers' experts in
        RAM first, then fewer layers on the GPUs), and the one that came closest when none fits. Without
        `expert_offload` (an engine with no --n-cpu-moe) only whole layers move; `forced_cpu_moe` fixes
        --n-cpu-moe at every layer count."""
        moe = self._moe_layers() if expert_offload else 0
        cpu_only = LlamaCppPlacement(gpu_layers=0, cpu_moe=0, per_device=())
        if not self.usable:
            return (cpu_only if self.fits_host(cpu_only) else None), cpu_only
        first = self._first_packed(forced_gpu_layers, forced_cpu_moe, moe)
        if first is None:
            return None, cpu_only
        p = first if first.ngl or first.gpu_layers else cpu_only  # not even the output layer fits: -ngl 0
        return (p, p) if self.fits_host(p) else (None, p)  # fewer GPU layers only put more in RAM

    def _first_packed(self, forced_gpu_layers: int | None, forced_cpu_moe: int | None,
                      moe: int) -> LlamaCppPlacement | None:
        """The first placement of llama.cpp users' order that the GPUs hold: every layer with the fewest layers'
        experts in RAM (an MoE), then the most layers with every MoE layer's experts in RAM, down to none; a forced
        -ngl or --n-cpu-moe fixes its count. What packs is monotone in each count (fewer layers, more experts in
        RAM: less on the GPUs), so each count is found by bisection, not by trying every one."""
        L = self.L
        if forced_gpu_layers is not None:
            n = min(forced_gpu_layers, L)
            m = forced_cpu_moe if forced_cpu_moe is not None else (moe if n < L else 0)
            if n == L and moe and forced_cpu_moe is None:
                return self._fewest_experts(n, moe)
            return self.pack(n, m) or (LlamaCppPlacement(gpu_layers=0, cpu_moe=m, per_device=()) if n == 0 else None)
        if forced_cpu_moe is None and moe and (p := self._fewest_experts(L, moe)) is not None:
            return p
        m_all = forced_cpu_moe if forced_cpu_moe is not None else 0
        if (p := self.pack(L, m_all)) is not None:
            return p
        m = forced_cpu_moe if forced_cpu_moe is not None else moe
        lo, hi = 0, L - 1  # the most layers below L that pack with m
        if self.pack(lo, m) is None:
            return LlamaCppPlacement(gpu_layers=0, cpu_moe=m, per_device=())
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.pack(mid, m) is not None else (lo, mid - 1)
        return self.pack(lo, m)

    def _fewest_experts(self, n: int, moe: int) -> LlamaCppPlacement | None:
        """n layers on the GPUs with the fewest layers' experts in RAM (--n-cpu-moe) that pack, or None."""
        if self.pack(n, moe) is None:
            return None
        lo, hi = 0, moe
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.pack(n, mid) is not None else (mid + 1, hi)
        return self.pack(n, lo)

    def _moe_layers(self) -> int:
        """--n-cpu-moe counts layers from the first; experts of the first k layers cover every MoE layer up to k."""
        return n_cpu_moe(i for i, e in enumerate(self.model.experts) if e)

