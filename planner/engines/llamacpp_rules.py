"""llama.cpp's memory rules, as llama.cpp applies them: GGUF tensor bytes, where each tensor and KV row lives,
its compute buffers and the margin `--fit` keeps free per device. Named constants, each with its source.

Placement (src/llama-model.cpp, load_tensors): with `-ngl N` the last N of the n_layer + 1 "layer slots"
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
from dataclasses import dataclass

from ..gguf import GGML_TYPES, GGUFTensor, gguf_tensors
from ..modelspec import ModelSpec
from ..request import LLAMA_CPP_KV_DTYPES, Request
from ..units import MiB
from .common import EngineConstant

LLAMA_CPP = "ggml-org/llama.cpp"
COMMON_H = f"{LLAMA_CPP} common/common.h @ 001d906a6d86e2490e394361e7cc6f478b100088"
ARG_CPP = f"{LLAMA_CPP} common/arg.cpp @ 145b6280d6aa1890e22457143dad0badb3fd6820"
MODEL_CPP = f"{LLAMA_CPP} src/llama-model.cpp @ a5410f046c01d01330c8a42f13b64a211fedf2c3"
KV_CACHE_CPP = f"{LLAMA_CPP} src/llama-kv-cache.cpp @ 3514e9f6e795d3b3cd88d6614f6c07e7ce6f916f"
CONTEXT_CPP = f"{LLAMA_CPP} src/llama-context.cpp @ 4c7103b96d720ea6057eec6ac11a49727f9ecd43"
PERPLEXITY_README = ("ggerganov/llama.cpp examples/perplexity/README.md @ 0a21ad6e3f457f81ad6af43b95856bf7064a9ef9, "
                     "'LLaMA 3 8b Scoreboard' (wikitext-2, CUDA)")

# --fit keeps this much free on every device: common_params::fit_params_target = 1024*1024*1024 per device
# (`-fitt MiB` changes it).
FIT_TARGET_MARGIN_BYTES = 1024 * MiB
# Physical batch of a prompt-processing step: common_params::n_ubatch = 512 (`-ub`); the compute buffers are
# reserved for a graph of this many tokens.
N_UBATCH = 512
# The GGUF file types a llama.cpp plan chooses among, best quality first.
PLANNED_FILE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")
# -ctk / -ctv types (common/arg.cpp kv_cache_types holds these and more) -> ggml type whose block layout sizes a row.
KV_GGML_TYPES = {name: GGML_TYPES[name.upper()] for name in LLAMA_CPP_KV_DTYPES}

# Perplexity increase of each file type over F16 on Llama-3-8B (PERPLEXITY_README): delta PPL over the F16
# PPL 6.231634 (= q8_0's 6.234284 - 0.002650). IQ4_XS's row is the one quantized with an importance matrix
# (the table has no IQ4_XS without one).
LLAMA3_8B_F16_PPL = 6.231634
FILE_TYPE_DELTA_PPL = {"BF16": 0.0, "F16": 0.0, "Q8_0": 0.002650, "Q6_K": 0.021748, "Q5_K_M": 0.056974,
                       "Q4_K_M": 0.175482, "IQ4_XS": 0.228071, "Q3_K_M": 0.656864, "Q2_K": 3.519934}
# KV cache quantization's perplexity cost: no measured table was found in llama.cpp's docs: ASSUMED values,
# said so in every plan that uses them.
KV_QUALITY_PCT_ASSUMED = {"f16": 0.0, "q8_0": 0.1, "q4_0": 1.0}

# Compute buffers: ggml-alloc sizes them from a worst-case graph at load (llama.cpp logs "compute buffer size").
# Not derivable exactly without building the graph: ESTIMATED here, with flash attention on, as
#   logits  n_vocab x n_ubatch x 4 B               (f32, only on the device holding the output layer)
#   scratch n_ubatch x (4 hidden + 3 x FFN width) x 4 B + the f16 KQ mask n_ubatch x KV cells x 2 B
COMPUTE_HIDDEN_COPIES_ASSUMED = 4
COMPUTE_FFN_COPIES_ASSUMED = 3
# RSS of llama-server before any model tensor (binary, backends, tokenizer): ASSUMED.
PROCESS_BASE_RAM_ASSUMED = 256 * MiB


def constants(hw_name: str, cuda_context_bytes: int, file_types=(), kv_types=()) -> dict[str, EngineConstant]:
    """The llama.cpp constants a plan or an export of these file and cache types used, by name (numbers only: a
    plan's table shows them)."""
    compute = "estimate of the compute buffer ggml-alloc reserves at load (llama.cpp measures it)"
    out = {
        "fit_target_margin_bytes": EngineConstant(FIT_TARGET_MARGIN_BYTES, f"{COMMON_H}: fit_params_target "
                                                  "(1024*1024*1024 per device; -fitt in common/arg.cpp)"),
        "n_ubatch": EngineConstant(N_UBATCH, f"{COMMON_H}: n_ubatch"),
        "cuda_context_bytes": EngineConstant(cuda_context_bytes, f"profile {hw_name}: overheads.cuda_context "
                                             "(llama.cpp's --fit measures free memory after it)"),
        "llama3_8b_f16_ppl": EngineConstant(LLAMA3_8B_F16_PPL, PERPLEXITY_README),
        "compute_hidden_copies": EngineConstant(COMPUTE_HIDDEN_COPIES_ASSUMED, compute, assumption=True),
        "compute_ffn_copies": EngineConstant(COMPUTE_FFN_COPIES_ASSUMED, compute, assumption=True),
        "process_base_ram_bytes": EngineConstant(PROCESS_BASE_RAM_ASSUMED, "llama-server's RSS before model "
                                                 "tensors", assumption=True),
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


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file's bytes as llama.cpp places them: per decoder layer, routed experts apart, and outside."""

    file_type: str
    layers: tuple[int, ...]  # data bytes of each decoder layer's tensors
    experts: tuple[int, ...]  # of which routed experts (*_exps)
    token_embd_bytes: int  # always in host memory (dev_input)
    output_bytes: int  # the output layer slot: output.weight (a GPU copy of token_embd when tied) + output_norm + generated

    @property
    def total_bytes(self) -> int:
        """What the loaded model occupies; a tied token_embd is counted once in host memory and once as output."""
        return sum(self.layers) + self.token_embd_bytes + self.output_bytes


def gguf_model(spec: ModelSpec, file_type: str) -> GGUFModel:
    layers = [0] * spec.num_layers
    experts = [0] * spec.num_layers
    token_embd = output = 0
    tied = True
    for t in gguf_tensors(spec, file_type):
        if t.layer is not None:
            layers[t.layer] += t.nbytes
            experts[t.layer] += t.nbytes if is_expert_tensor(t) else 0
        elif t.name == "token_embd.weight":
            token_embd = t.nbytes
        else:
            tied = tied and t.name != "output.weight"
            output += t.nbytes  # output.weight, output_norm, rope_freqs / rope factors
    if tied:  # llama-model.cpp loads token_embd again (TENSOR_DUPLICATED) as the output projection
        output += token_embd
    return GGUFModel(file_type=file_type, layers=tuple(layers), experts=tuple(experts), token_embd_bytes=token_embd,
                     output_bytes=output)


def kv_cells(req: Request) -> int:
    """KV cells llama-server allocates: -c is the context of all -np slots together."""
    return req.context * req.batch


def kv_bytes_per_layer(spec: ModelSpec, kv_type: str, req: Request) -> list[int]:
    """K and V rows of each layer (src/llama-kv-cache.cpp: a type_k tensor n_embd_k_gqa x kv_size and a type_v one;
    sliding-window layers keep window x slots + n_ubatch cells, llama_kv_cache_iswa; MLA caches one latent row)."""
    t = KV_GGML_TYPES[kv_type]
    cells = kv_cells(req)

    def row(elements: int) -> int:
        return math.ceil(elements / t.block_elements) * t.block_bytes

    out = []
    for a in spec.attention:
        n = cells if a.window is None else min(cells, a.window * req.batch + N_UBATCH)
        out.append(n * row(a.kv_elements_per_token) if a.kind == "mla"
                   else 2 * n * row(a.num_kv_heads * a.head_dim))
    return out


def compute_buffer_bytes(spec: ModelSpec, req: Request, *, with_logits: bool) -> int:
    """ESTIMATED compute buffer of one backend (see COMPUTE_*_ASSUMED)."""
    tokens = min(N_UBATCH, kv_cells(req))
    scratch = tokens * (COMPUTE_HIDDEN_COPIES_ASSUMED * spec.hidden_size + COMPUTE_FFN_COPIES_ASSUMED * spec.mlp_width) * 4
    mask = tokens * kv_cells(req) * 2
    return scratch + mask + (spec.vocab_size * tokens * 4 if with_logits else 0)


@dataclass(frozen=True)
class Placement:
    """-ngl and --n-cpu-moe: the last `gpu_layers` decoder layers (and the output layer, when any is) on the GPUs,
    split over devices as `per_device`; the experts of the first `cpu_moe` layers in host memory."""

    gpu_layers: int
    cpu_moe: int
    per_device: tuple[int, ...]  # GPU slots (decoder layers, plus the output layer on its device) per device

    @property
    def ngl(self) -> int:
        """The -ngl value: decoder layers plus the output slot (0: nothing on a GPU)."""
        return sum(self.per_device)


@dataclass(frozen=True)
class DeviceBytes:
    weights: int
    kv: int
    compute: int


class LlamaCppFootprint:
    """Every byte of one GGUF file type x KV cache type x request, per device, by llama.cpp's rules."""

    def __init__(self, spec: ModelSpec, model: GGUFModel, kv_type: str, req: Request, device_capacities: list[int],
                 cuda_context_bytes: int, ram_capacity: int, margin_bytes: int = FIT_TARGET_MARGIN_BYTES):
        """`margin_bytes`: what the engine keeps free per device (llama.cpp's --fit margin; Ollama has its own)."""
        self.spec, self.model, self.req, self.kv_type = spec, model, req, kv_type
        self.kv = kv_bytes_per_layer(spec, kv_type, req)
        self.L = spec.num_layers
        self.margin_bytes = margin_bytes
        self.usable = [c - cuda_context_bytes - margin_bytes for c in device_capacities]
        self.cuda_context_bytes = cuda_context_bytes
        self.ram_capacity = ram_capacity
        self.scratch = compute_buffer_bytes(spec, req, with_logits=False)
        self.with_logits = compute_buffer_bytes(spec, req, with_logits=True)

    def _gpu_layer_cost(self, i: int, cpu_moe: int) -> int:
        experts_on_cpu = self.model.experts[i] if i < cpu_moe else 0
        return self.model.layers[i] - experts_on_cpu + self.kv[i]

    def pack(self, gpu_layers: int, cpu_moe: int) -> Placement | None:
        """The devices' share of the last `gpu_layers` layers and the output layer, filled in device order
        (as -ts splits them), or None when they do not fit."""
        if not self.usable:
            return None
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
        return Placement(gpu_layers=gpu_layers, cpu_moe=cpu_moe, per_device=tuple(counts))

    def device_bytes(self, p: Placement) -> list[DeviceBytes]:
        out, i = [], self.L - p.gpu_layers
        slots = [*range(i, self.L), None]  # None: the output slot
        for n in p.per_device:
            mine, slots = slots[:n], slots[n:]
            layers = [j for j in mine if j is not None]
            has_output = None in mine
            weights = sum(self.model.layers[j] - (self.model.experts[j] if j < p.cpu_moe else 0) for j in layers)
            compute = (self.with_logits if has_output else self.scratch) if mine else 0
            out.append(DeviceBytes(weights=weights + (self.model.output_bytes if has_output else 0),
                                   kv=sum(self.kv[j] for j in layers), compute=compute))
        return out

    def host_bytes(self, p: Placement) -> DeviceBytes:
        cpu_layers = range(self.L - p.gpu_layers)
        gpu_layers = range(self.L - p.gpu_layers, self.L)
        experts_here = sum(self.model.experts[j] for j in gpu_layers if j < p.cpu_moe)
        weights = (self.model.token_embd_bytes + sum(self.model.layers[j] for j in cpu_layers) + experts_here
                   + (0 if p.ngl else self.model.output_bytes))
        computes_here = bool(cpu_layers) or experts_here > 0
        compute = (self.scratch if p.ngl else self.with_logits) if computes_here else 0
        return DeviceBytes(weights=weights, kv=sum(self.kv[j] for j in cpu_layers), compute=compute)

    def host_total(self, p: Placement) -> int:
        h = self.host_bytes(p)
        return h.weights + h.kv + h.compute + PROCESS_BASE_RAM_ASSUMED

    def fits_host(self, p: Placement) -> bool:
        return self.host_total(p) <= self.ram_capacity

    def place(self, forced_gpu_layers: int | None = None, *, expert_offload: bool = True
              ) -> tuple[Placement | None, Placement]:
        """The placement llama.cpp users pick (every layer on the GPUs; for an MoE, the fewest layers' experts in
        RAM first, then fewer layers on the GPUs), and the one that came closest when none fits. Without
        `expert_offload` (an engine with no --n-cpu-moe) only whole layers move."""
        L = self.L
        moe = self._moe_layers() if expert_offload else 0
        cpu_only = Placement(gpu_layers=0, cpu_moe=0, per_device=())
        if not self.usable:
            return (cpu_only if self.fits_host(cpu_only) else None), cpu_only
        tries: list[tuple[int, int]] = []
        counts = [min(forced_gpu_layers, L)] if forced_gpu_layers is not None else list(range(L, -1, -1))
        for n in counts:
            tries.extend((n, m) for m in (range(0, moe + 1) if n == L and moe else [moe if n < L else 0]))
        closest = cpu_only
        for n, m in tries:
            p = self.pack(n, m)
            if p is None and n == 0:
                p = cpu_only  # not even the output layer fits: -ngl 0
            if p is None:
                continue
            if self.fits_host(p):
                return p, p
            closest = p
            break  # fewer GPU layers only put more in RAM
        return None, closest

    def _moe_layers(self) -> int:
        """--n-cpu-moe counts layers from the first; experts of the first k layers cover every MoE layer up to k."""
        with_experts = [i for i, e in enumerate(self.model.experts) if e]
        return (with_experts[-1] + 1) if with_experts else 0

