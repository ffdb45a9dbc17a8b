"""Quantization schemes, planner half: exact bytes for any tensor, what each touches.

Each weight scheme knows which tensors it quantizes (transformers 5 + bitsandbytes /
optimum-quanto replace the plain `nn.Linear` modules inside the decoder layers; vramplan
quantizes the fused 3-D routed experts itself, per expert; embeddings, norms, lm_head,
routers and expert biases stay in the load dtype), the bytes of every tensor it stores
(scales and absmax included), the temporary it needs at matmul time, where it runs, and a
documented quality cost. The runtime half (how to load it) lives in runtime/quantize.py and,
for the experts, runtime/experts.py. Pure.

Layouts (measured with bitsandbytes 0.50.2 / optimum-quanto 0.2.7 on transformers 5.23;
shared/DESIGN.md and tests/test_runtime_core.py check them on real modules):
- bnb int8 (LLM.int8): int8 [out, in] + fp32 SCB [out].
- bnb 4-bit, blocksize 64: packed uint8 (n/2) + fp32 absmax per 64 elements + a 16-entry fp32
  code table (64 B); with double quantization: uint8 absmax per 64 + fp32 nested absmax per
  256 blocks + fp32 offset + a 256-entry fp32 nested code table (1 KiB).
  (On the CPU, bnb re-lays 4-bit weights out at the first forward: bf16 scales, double
  quantization undone, ~0.531 B/param. The plan counts the layout as loaded.)
- quanto qint8: int8 [out, in] + one scale per output row in the compute dtype + 8 B of fp32 scalars.
  quanto-w8a8 stores the same bytes; only its matmul differs (activations quantized per token, on the CPU).
- quanto qint4: packed uint8 (n/2) + scale and shift per group of 128 along each row in the
  compute dtype + 8 B of fp32 scalars (quanto's groups: 128, 96, 64 or 32 dividing in > 128; else
  one per row, or per column for a single-row weight: `quanto_linear_int4_group`).

Fused routed experts (Kind.EXPERTS, [E, out, in] or transposed [E, in, out]), as runtime/experts.py
stores them: each expert's [out, in] matrix quantized on its own in the scheme's layout, the E
results stacked so that expert e's bytes are one contiguous slice of every buffer; tables that do
not depend on the values are stored once per fused tensor:
- bnb int8: E x (int8 [out, in] + fp32 SCB [out]).
- bnb 4-bit: E x (packed ceil(n/2) + fp32 absmax per 64), + the 16-entry fp32 code (64 B); with
  double quantization E x (packed + uint8 absmax per 64 + fp32 nested absmax per 256 blocks + fp32
  offset), + the code and the 256-entry fp32 nested code (64 + 1024 B).
- quanto int8: E x (int8 [out, in] + bf16 scale [out]); no module scalars.
- quanto int4: E x (tinygemm-packed n/2 + bf16 scale and shift per group along each row), the group
  the largest of 128/64/32 dividing `in` (`experts_int4_group`); matrices the tinygemm kernels cannot
  hold (out not a multiple of 16, in not of 32) stay in the compute dtype.
- int8-wo: E x (int8 [out, in] + bf16 scale [out]).
- int4-wo: E x (tinygemm-packed n/2 + bf16 scale and zero per group of 64 along each row); matrices
  tinygemm cannot take (`tinygemm_packs`) stay in the compute dtype.
"""

from __future__ import annotations

import functools
import math

from .record import record
from .modelspec import Kind, ModelSpec, TensorSpec, dtype_bytes


@record(kw_only=True)
class QualityCost:
    """Typical perplexity increase over bf16, in percent, and where the number comes from."""

    ppl_increase_pct: float
    source: str


@record(kw_only=True)
class WeightScheme:
    """A weight quantization scheme: its bytes per parameter by role, its backend and what it costs in quality."""

    name: str
    backend: str  # "torch", "bnb", "quanto"
    description: str
    devices: tuple[str, ...]  # where the runtime can execute it: "cuda", "cpu", "mps"
    quality: QualityCost
    # Accelerators whose layout of this scheme is byte-identical to the one packed in RAM, so that stream
    # offload can refill a GPU slot by copying bytes. optimum-quanto packs int4 differently for the CPU
    # kernel (_weight_int4pack_mm_for_cpu) and for CUDA's tinygemm (tensor/weights/tinygemm: repacked on .to()).
    streams_on: tuple[str, ...] = ("cuda",)
    # layout
    bits: int = 16  # 16 = unquantized
    group_size: int | None = None  # elements per scale (4-bit schemes)
    double_quant: bool = False
    scale_bytes: float = 0.0  # bytes of each scale / absmax
    row_scales: bool = False  # one scale per output row (int8 schemes)
    row_scale_bytes: float = 0.0
    fixed_bytes_per_tensor: int = 0  # code tables etc.
    compute_dtype: str = "bfloat16"
    variant: str | None = None  # the library's name for the 4-bit data type: bnb "nf4" or "fp4"
    outlier_threshold: float | None = None  # bnb LLM.int8(): activations above it take the fp16 path
    # The scheme lm_head takes on a machine without a GPU, where the CPU reads all of it every token (None: it stays
    # in the load dtype, as transformers leaves it): see cpu_head_scheme.
    cpu_head: str | None = None
    # 8: every matmul quantizes its input to int8 on the fly, one absmax scale per token (row), and multiplies int8 by
    # int8 into int32 (runtime.quantize.Int8Dynamic: torch._int_mm); 16: the activations stay in the compute dtype
    # (weight-only). Same weight bytes either way.
    activation_bits: int = 16
    # Decodes as one compiled graph only (runtime.compiled, runtime.weight_only): torch's weight-only kernels, whose
    # eager path on a GPU dequantizes every weight each call.
    compiled_only: bool = False
    min_capability: tuple[int, int] | None = None  # the least CUDA compute capability its kernels run on
    # A compiled decode that gathers each routed expert's slices into a buffer for a kernel inductor cannot fuse the
    # gather into (vramplan's int4-wo: tinygemm): priced at planner.speed_attention.GATHERED_INT4_EXPERT_PASSES
    gathers_experts: bool = False
    # A layer's routed experts run as one grouped call, not a call per expert: transformers' own experts implementation
    # (grouped_mm, its default in transformers 5), which bf16 / fp16 weights run, and vLLM's fused MoE kernels in every
    # format (planner.speed_attention.expert_efficiency: one fixed cost a layer)
    groups_experts: bool = False
    # False where the engine leaves an MoE's fused routed experts as loaded: plain transformers with bitsandbytes or
    # optimum-quanto swaps only nn.Linear layers (planner.engines.hf_transformers.as_transformers_loads)
    quantizes_experts: bool = True

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def touches(self, t: TensorSpec) -> bool:
        """True when the runtime stores this tensor quantized: the library's nn.Linear layers, vramplan's
        per-expert quantization of fused experts."""
        if not self.quantized:
            return False
        if t.kind is Kind.EXPERTS:
            if not self.quantizes_experts:
                return False
            if self.backend == CPU_KERNEL_BACKEND:
                return w4a8_packs(*t.matrix_shape)
            if self.backend == TORCH_WO_BACKEND:
                return self.bits == 8 or tinygemm_packs(*t.matrix_shape, self.group_size)
            return not (self.backend == "quanto" and self.bits == 4 and experts_int4_group(*t.matrix_shape) is None)
        if t.kind is not Kind.LINEAR or t.layer is None:
            return False
        if self.backend == CPU_KERNEL_BACKEND:
            return w4a8_packs(*t.matrix_shape)
        return not (self.backend == TORCH_WO_BACKEND and self.bits == 4
                    and not tinygemm_packs(*t.matrix_shape, self.group_size))

    def tensor_bytes(self, t: TensorSpec, load_dtype: str | None = None) -> int:
        """Exact bytes this scheme stores for one tensor."""
        load = load_dtype or self.compute_dtype
        if not self.touches(t):
            return int(t.numel * dtype_bytes(t.held_dtype or load))
        if t.kind is Kind.EXPERTS:
            return self._experts_bytes(t)
        n = t.numel
        out_features = t.shape[0]
        if self.bits == 8 and self.activation_bits == 8:
            return fbgemm_linear_bytes(out_features, t.shape[-1]) + self.fixed_bytes_per_tensor  # + quanto's scalars
        if self.bits == 8:
            return n + int(out_features * self.row_scale_bytes) + self.fixed_bytes_per_tensor
        if self.bits == 4:
            blocks = math.ceil(n / self.group_size)
            packed = math.ceil(n / 2)
            if self.backend == "bnb" and self.double_quant:
                nested = math.ceil(blocks / BNB_NESTED_BLOCKSIZE)
                return packed + blocks * 1 + nested * 4 + 4 + self.fixed_bytes_per_tensor
            if self.backend == "quanto":
                return _quanto_int4_linear_bytes(out_features, t.shape[-1], int(self.scale_bytes)) + \
                    self.fixed_bytes_per_tensor
            return packed + int(blocks * self.scale_bytes) + self.fixed_bytes_per_tensor
        raise AssertionError(self.bits)

    def _experts_bytes(self, t: TensorSpec) -> int:
        """A fused experts tensor quantized per expert (runtime/experts.py): E x one expert's matrix, plus the
        value-independent tables once per tensor (bnb's code tables)."""
        experts = t.shape[0]
        out_features, in_features = t.matrix_shape
        n = out_features * in_features
        if self.bits == 8:  # bnb: fp32 SCB per row; quanto, int8-wo: bf16 scale per row
            return experts * (n + int(out_features * self.row_scale_bytes))
        if self.backend in (TORCH_WO_BACKEND, CPU_KERNEL_BACKEND):  # packed codes, bf16 scale and zero per group
            return experts * (n // 2 + out_features * (in_features // self.group_size) * int(self.scale_bytes))
        if self.backend == "bnb":
            blocks = math.ceil(n / self.group_size)
            if self.double_quant:
                per_expert = math.ceil(n / 2) + blocks + math.ceil(blocks / BNB_NESTED_BLOCKSIZE) * 4 + 4
            else:
                per_expert = math.ceil(n / 2) + int(blocks * self.scale_bytes)
            return experts * per_expert + self.fixed_bytes_per_tensor
        group = experts_int4_group(out_features, in_features)  # quanto int4, tinygemm layout
        return experts * (n // 2 + out_features * (in_features // group) * int(self.scale_bytes))

    def bytes_of(self, tensors, load_dtype: str | None = None) -> int:
        return sum(self.tensor_bytes(t, load_dtype) for t in tensors)

    def matmul_temp_bytes(self, spec: ModelSpec) -> int:
        """Temporary a matmul needs: 4-bit and int8 kernels dequantize the weight to the compute dtype first
        (for routed experts, one expert's matrix at a time)."""
        if not self.quantized:
            return 0
        largest = max(spec.largest_layer_linear_numel, spec.largest_expert_matrix_numel)
        return int(largest * dtype_bytes(self.compute_dtype))


# bitsandbytes' double quantization: the absmax of 256 blocks share one fp32 nested absmax.
BNB_NESTED_BLOCKSIZE = 256
# Group sizes of torch's tinygemm int4 kernels (_weight_int4pack_mm and _for_cpu), largest first, and what
# their packing needs of a matrix: out (N) a multiple of 16 (the CPU packing; CUDA's needs 8), in (K) of 32.
TINYGEMM_GROUP_SIZES = (128, 64, 32)
TINYGEMM_OUT_MULTIPLE = 16


def quanto_linear_int4_group(in_features: int) -> int | None:
    """The group size optimum-quanto 0.2.7's QLinear picks for int4 (nn/qmodule.py): above 128 input features the
    largest of 128, 96, 64, 32 dividing them; else none (one scale and shift per row)."""
    if in_features <= 128:
        return None
    return next((g for g in (128, 96, 64, 32) if in_features % g == 0), None)


def _quanto_int4_linear_bytes(out_features: int, in_features: int, scale_shift_bytes: int) -> int:
    """Packed data + scale and shift of one quanto int4 QLinear weight. Grouped, the weight is [out x in / g, g]
    rows with a scale and shift each; ungrouped, one per row, or per column when there is a single row (quanto
    quantizes along no axis then); 4-bit values pack in pairs along the first axis."""
    group = quanto_linear_int4_group(in_features)
    if group is not None:
        rows = out_features * in_features // group
        return math.ceil(rows / 2) * group + rows * scale_shift_bytes
    scales = in_features if out_features == 1 else out_features
    return math.ceil(out_features / 2) * in_features + scales * scale_shift_bytes


def experts_tinygemm_pack(spec: ModelSpec, group_size: int | None) -> bool:
    """Whether tinygemm's int4 layout takes every routed-experts matrix of an MoE (int4-wo quantizes them then)."""
    if spec.moe is None:
        return False
    layer = spec.layer_tensors(next(iter(spec.moe.moe_layers)))
    return all(tinygemm_packs(*t.matrix_shape, group_size) for t in layer if t.kind is Kind.EXPERTS)


def experts_int4_group(out_features: int, in_features: int) -> int | None:
    """Group size of a quanto-int4 expert matrix: the largest tinygemm group dividing `in_features` (128 as
    quanto's own Linear layers use where it divides), or None when the tinygemm kernels cannot hold the matrix."""
    if out_features % TINYGEMM_OUT_MULTIPLE:
        return None
    return next((g for g in TINYGEMM_GROUP_SIZES if in_features % g == 0), None)


def _bnb4(name, quant_type, dq, ppl, src) -> WeightScheme:
    return WeightScheme(
        name=name, backend="bnb", bits=4, group_size=64, double_quant=dq, scale_bytes=4.0,
        # a 16-entry fp32 code table (64 B) per Linear; double quantization adds a 256-entry nested one
        fixed_bytes_per_tensor=64 + (1024 if dq else 0),
        devices=("cuda", "cpu"), variant=quant_type,
        description=f"bitsandbytes {quant_type.upper()} 4-bit, blocksize 64" + (", double quantization" if dq else ""),
        quality=QualityCost(ppl_increase_pct=ppl, source=src),
    )


# transformers' default llm_int8_threshold (BitsAndBytesConfig), as in the LLM.int8() paper.
BNB_INT8_OUTLIER_THRESHOLD = 6.0

_QLORA = ("QLoRA (Dettmers et al. 2023, arXiv:2305.14314) Table 2: mean Pile-CC perplexity over LLaMA/OPT/BLOOM/"
          "Pythia: NF4+DQ 27.41, FP4 (E3M0) 29.48, FP4 (E2M1) 31.07, Int4 34.34; NF4 matches 16-bit in fine-tuning "
          "benchmarks. The % over bf16 is a typical 7B-13B figure, not a per-model measurement.")

_INT8DQ = ("torchao's int8 dynamic activation + int8 weight (int8dq: symmetric absmax int8 per weight row and per "
           "activation token, the scheme quanto-w8a8 runs), torchao/quantization/README.md (pytorch/ao 03d01ad), "
           "lm_eval WikiText perplexity: Llama-3-8B bf16 7.441, int8dq 7.581 (+1.9 %), int8 weight-only 7.447; "
           "Llama-2-7B 12.212, 12.262 (+0.4 %), 12.204. The larger of the two. On x86 vramplan runs it by fbgemm, "
           "whose activations take 7 bits (runtime.cpu_paths): a coarser step than int8dq's, not measured in "
           "perplexity")

# torch's own weight-only kernels, gpt-fast's path (runtime.weight_only): int8 rows with a bf16 scale each, and int4 in
# tinygemm's layout (_weight_int4pack_mm on CUDA) with a bf16 scale and zero per group of 64: the decoder layers'
# linears and routed experts (expert by expert, runtime.experts); lm_head stays in the load dtype. Quality:
# torchao/quantization/README.md (pytorch/ao fd6e4b1), lm_eval WikiText word perplexity of torchao's int8wo /
# int4wo-64, which quantize the same way.
TORCH_WO_BACKEND = "torch-wo"
TINYGEMM_INNER_K_TILES = 8  # _convert_weight_to_int4pack's innerKTiles: in_features a multiple of 8 x 16
_TORCHAO_WO = ("torchao/quantization/README.md (pytorch/ao fd6e4b1), lm_eval WikiText perplexity, A100: Llama-2-7B "
               "bf16 12.212, int8wo 12.204, int4wo-64 12.843 (+5.2 %); Llama-3-8B 7.441, 7.447 (+0.1 %), 8.316 "
               "(+11.8 %); H100: Llama-3.1-8B 7.54, 7.56 (+0.3 %), 8.44 (+11.9 %)")


def tinygemm_packs(out_features: int, in_features: int, group_size: int | None) -> bool:
    """Whether tinygemm's int4 layout takes a [out, in] matrix: rows in tiles of 8, the input dimension in tiles of
    TINYGEMM_INNER_K_TILES x 16 and in whole groups (aten _convert_weight_to_int4pack; gpt-fast's
    _check_linear_int4_k). A linear it does not take stays in the load dtype."""
    return (group_size is not None and out_features % 8 == 0 and in_features % (TINYGEMM_INNER_K_TILES * 16) == 0
            and in_features % group_size == 0)


# vramplan's own CPU kernel (runtime.cpu_kernel): 4-bit weights in groups of CPU_W4A8_GROUP along each row, a bf16 scale
# and zero per group (gpt-fast's group_quantize: tinygemm's values), times the activations quantized to int8 per group
# of the same size. A linear whose input width is not a whole number of groups stays in the load dtype.
CPU_KERNEL_BACKEND = "vramplan-cpu"
CPU_W4A8_GROUP = 128
_W4A8 = ("int4 weights, round to nearest in groups of 128 with a scale and zero: AWQ (Lin et al. 2023, "
         "arXiv:2306.00978) Table 4, Llama-2-7B WikiText-2 perplexity FP16 5.47, INT4 g128 RTN 5.73 (+4.8 %); plus "
         "int8 activations: torchao's int8dq (per-token absmax) over its int8 weight-only, Llama-3-8B 7.581 against "
         "7.447 (+1.8 %; torchao/quantization/README.md, pytorch/ao 03d01ad), a coarser activation step than the "
         "kernel's per group of 128. The sum of the two, an estimate not measured on the combination")


def w4a8_packs(out_features: int, in_features: int) -> bool:
    """Whether cpu-w4a8's kernel takes a [out, in] matrix: whole groups along the input."""
    return out_features > 0 and in_features % CPU_W4A8_GROUP == 0


SCHEMES: dict[str, WeightScheme] = {s.name: s for s in [
    WeightScheme(name="bf16", backend="torch", bits=16, devices=("cuda", "cpu", "mps"), groups_experts=True,
                 description="bfloat16, unquantized",
                 quality=QualityCost(ppl_increase_pct=0.0, source="reference")),
    WeightScheme(name="fp16", backend="torch", bits=16, devices=("cuda", "mps", "cpu"), compute_dtype="float16",
                 groups_experts=True,
                 description="float16, unquantized",
                 quality=QualityCost(ppl_increase_pct=0.0,
                                     source="reference (overflow risk for some bf16-trained models)")),
    WeightScheme(name="bnb-int8", backend="bnb", bits=8, row_scales=True, row_scale_bytes=4.0, devices=("cuda", "cpu"),
                 outlier_threshold=BNB_INT8_OUTLIER_THRESHOLD,
                 description="bitsandbytes LLM.int8(): int8 weights + fp32 row scale (SCB), outlier decomposition",
                 quality=QualityCost(ppl_increase_pct=0.1, source="LLM.int8() (Dettmers et al. 2022, arXiv:2208.07339) "
                                     "§4: no perplexity degradation measured from 125M to 175B parameters")),
    _bnb4("bnb-nf4", "nf4", False, 3.0, _QLORA),
    _bnb4("bnb-nf4-dq", "nf4", True, 3.0, _QLORA),
    _bnb4("bnb-fp4", "fp4", False, 6.0, _QLORA),
    _bnb4("bnb-fp4-dq", "fp4", True, 6.0, _QLORA),
    WeightScheme(name="quanto-int8", backend="quanto", bits=8, row_scales=True, row_scale_bytes=2.0,
                 fixed_bytes_per_tensor=8, devices=("cuda", "cpu", "mps"), cpu_head="quanto-int8",
                 description="optimum-quanto qint8 weights, one scale per output row",
                 quality=QualityCost(ppl_increase_pct=0.2, source="per-channel int8 weight-only RTN: within noise of "
                                     "fp16 (SmoothQuant, Xiao et al. 2022, arXiv:2211.10438, W8A16 rows)")),
    WeightScheme(name="quanto-w8a8", backend="quanto", bits=8, row_scales=True, row_scale_bytes=2.0,
                 fixed_bytes_per_tensor=8, devices=("cpu",), streams_on=(), cpu_head="quanto-w8a8", activation_bits=8,
                 description="optimum-quanto qint8 weights x int8 activations (absmax per token, at each matmul), "
                             "torchao's int8dq recipe: on x86 fbgemm's int8 kernel (7-bit activations), elsewhere "
                             "torch's _int_mm",
                 quality=QualityCost(ppl_increase_pct=1.9, source=_INT8DQ)),
    WeightScheme(name="quanto-int4", backend="quanto", bits=4, group_size=128, scale_bytes=4.0,
                 fixed_bytes_per_tensor=8, devices=("cuda", "cpu", "mps"), streams_on=(), cpu_head="quanto-int8",
                 description="optimum-quanto qint4 weights, group 128, scale + shift per group",
                 quality=QualityCost(ppl_increase_pct=4.8, source="AWQ (Lin et al. 2023, arXiv:2306.00978) Table 4: "
                                     "Llama-2-7B WikiText-2 perplexity FP16 5.47, INT4 g128 round-to-nearest 5.73")),
    WeightScheme(name="int8-wo", backend=TORCH_WO_BACKEND, bits=8, row_scales=True, row_scale_bytes=2.0,
                 devices=("cuda",), streams_on=(), compiled_only=True,
                 description="int8 weight-only, a bf16 scale per row (torchao int8wo, gpt-fast int8), decoded "
                             "compiled: torch's kernels in one CUDA graph",
                 quality=QualityCost(ppl_increase_pct=0.3, source=_TORCHAO_WO + ": the largest int8wo cost")),
    WeightScheme(name="int4-wo", backend=TORCH_WO_BACKEND, bits=4, group_size=64, scale_bytes=4.0,
                 devices=("cuda",), streams_on=(), compiled_only=True,
                 min_capability=(8, 0),  # tinygemm (aten/src/ATen/native/cuda/int4mm.cu) is built for sm80 and up
                 description="int4 weight-only, group 64 with a bf16 scale and zero (torchao int4wo-64, gpt-fast "
                             "int4, tinygemm), decoded compiled: torch's kernels in one CUDA graph",
                 quality=QualityCost(ppl_increase_pct=5.2, source=_TORCHAO_WO + ": Llama-2-7B's, the model "
                                     "quanto-int4's figure comes from; Llama-3 loses about twice as much")),
    WeightScheme(name="cpu-w4a8", backend=CPU_KERNEL_BACKEND, bits=4, group_size=CPU_W4A8_GROUP, scale_bytes=4.0,
                 devices=("cpu",), streams_on=(), cpu_head="quanto-w8a8", activation_bits=8,
                 description="int4 weights, group 128 with a bf16 scale and zero, x int8 activations per group: "
                             "vramplan's AVX2 CPU kernel (llama.cpp's Q4_0 x Q8_0 product), built with the machine's "
                             "C compiler",
                 quality=QualityCost(ppl_increase_pct=6.6, source=_W4A8)),
]}


# torch 2.13's CPU int8 weight-only matmul (_weight_int8pack_mm, which quanto's qint8 runs there) crashes (SIGSEGV) for
# more than one row when in_features is not a multiple of 16; quanto calls it from 4. The runtime's int8 experts and
# layers use it from 16 and dequantize otherwise; a head it cannot take stays as loaded.
INT8PACK_IN_MULTIPLE = 16


def cpu_head_scheme(scheme: WeightScheme, in_features: int) -> WeightScheme | None:
    """Whose quantization lm_head [vocab, hidden] takes when the model runs on the CPU alone, or None (it stays in the
    load dtype); its bytes: cpu_head_bytes.

    The quanto schemes quantize it as quanto's qint8 does (absmax per row) into int8 rows for torch's CPU int8 kernel:
    on the CPU lm_head is the largest single read of a decode step (Qwen2.5-0.5B: 272 MB in bf16, 17 of 66 ms a token on
    the 2-core dev VM), and int8 halves it (66.0 -> 57.8 ms with quanto-int8 layers, 45.8 -> 37.2 with quanto-int4,
    measured by hand; bench/results/vs-engines-cpu-dev.md as of 3293d8f has the runs). 8 bits under 4-bit layers too, as
    llama.cpp keeps output.weight at 6-8 bits in its 4-bit types. A tied embedding stays as it is for the lookup, so the
    int8 head is a second copy (+0.5 B per element of it)."""
    if scheme.cpu_head is None or in_features % INT8PACK_IN_MULTIPLE:
        return None
    return SCHEMES[scheme.cpu_head]


def cpu_head_bytes(t: TensorSpec, head: WeightScheme) -> int:
    """lm_head [out, in] as runtime.quantize.Int8Rows.from_linear stores it: int8 [out, in] + one bf16 scale per row;
    under quanto-w8a8, packed for fbgemm (fbgemm_linear_bytes)."""
    out_features, in_features = t.matrix_shape
    if head.activation_bits == 8:
        return fbgemm_linear_bytes(out_features, in_features)
    return out_features * in_features + 2 * out_features


# fbgemm's packed int8 matrix, as torch.ops.quantized.linear_prepack builds it on x86 (runtime.cpu_paths'
# FbgemmInt8Dynamic, quanto-w8a8's default path there): the input dimension padded to a multiple of FBGEMM_K_BLOCK,
# and FBGEMM_ROW_BYTES a row (an int32 column offset, an fp32 scale, an int32 zero point). Measured by the RSS a
# prepack added on the AVX2 EPYC VM (torch 2.13): 140 bytes a row over int8 at in_features 896 (padded to 1024),
# 268 at 4864 (5120), 139 at 897. Where the runtime takes torch._int_mm's path instead (a profile's record, or a
# CPU without fbgemm), it holds the int8 rows and a bf16 scale a row: fewer bytes than counted.
FBGEMM_K_BLOCK = 512
FBGEMM_ROW_BYTES = 12


def fbgemm_linear_bytes(out_features: int, in_features: int) -> int:
    return out_features * (math.ceil(in_features / FBGEMM_K_BLOCK) * FBGEMM_K_BLOCK + FBGEMM_ROW_BYTES)


@record(kw_only=True)
class KVScheme:
    """A KV-cache dtype as transformers 5 stores it."""

    name: str
    description: str
    bytes_per_element: float
    backend: str = "dynamic"  # how transformers stores it: "dynamic" (DynamicCache) or a QuantizedCache backend
    nbits: int | None = None  # quanto: bits per value
    group_size: int | None = None  # quanto: values per scale + shift (q_group_size)
    per_layer_fixed_bytes: int = 0  # per-tensor scales
    residual_tokens: int = 0  # tokens kept in the compute dtype before quantizing (QuantizedCache residual_length)
    dequantizes_whole_layer: bool = False  # attention reads a full-precision copy of the layer's cache each step
    full_attention_only: bool = False  # transformers' QuantizedCache refuses sliding-window layers
    # Bytes moved per cached element per decode step by the cache's update beyond what the bf16
    # DynamicCache's torch.cat moves (read 2 + write 2): the speed model's KV update traffic.
    update_extra_bytes_per_element: float = 0.0
    quality: QualityCost

    @property
    def quantized(self) -> bool:
        return self.bytes_per_element < 2


# Per cached element and decode step, from transformers 5.23 cache_utils (bytes read + written):
# - Fp8QuantizedLayer.update: torch.cat of the fp8 cache (1 + 1) instead of bf16's (2 + 2), then
#   _dequantize: .float() (1 + 4), * scale (4 + 4), .to(bf16) (4 + 2): 21 - 4 = 17 extra.
# - QuantizedLayer.update with quanto: dequantize() every step: unpack (the packed bytes + 1),
#   .to(bf16) (1 + 2), - shift (2 + 2), * scale (2 + 2), ungrouping copy (2 + 2) = 16 + the packed
#   bytes; then the same torch.cat as bf16. Re-quantizing once per 128-token residual adds ~0.05.
# Calibration replaces the efficiency these bytes move at; the byte counts are the model.
FP8_KV_UPDATE_EXTRA_BYTES = 17.0
# QuantizedCache(backend="quanto") as vramplan builds it: q_group_size values share one bf16 scale and one bf16
# shift (4 bytes), and the newest residual_length tokens stay in bf16 until they are flushed.
QUANTO_KV_GROUP = 64
QUANTO_KV_SCALE_SHIFT_BYTES = 4
QUANTO_KV_RESIDUAL = 128
QUANTO_KV_UPDATE_EXTRA_BYTES = 16.0

KV_SCHEMES: dict[str, KVScheme] = {k.name: k for k in [
    KVScheme(name="bf16", description="bfloat16 (DynamicCache)", bytes_per_element=2.0,
             quality=QualityCost(ppl_increase_pct=0.0, source="reference")),
    KVScheme(name="fp16", description="float16 (DynamicCache)", bytes_per_element=2.0,
             quality=QualityCost(ppl_increase_pct=0.0, source="reference")),
    KVScheme(name="fp8", description="float8 e4m3, per-tensor fp32 scale (QuantizedCache backend fp8)",
             bytes_per_element=1.0, backend="fp8", per_layer_fixed_bytes=2 * 4, dequantizes_whole_layer=True,
             full_attention_only=True, update_extra_bytes_per_element=FP8_KV_UPDATE_EXTRA_BYTES,
             quality=QualityCost(ppl_increase_pct=0.3, source="FP8 e4m3 KV with per-tensor scale: vLLM docs report "
                                 "negligible accuracy loss; typical <0.5 % perplexity")),
    KVScheme(name="quanto-int4", description="int4 per-channel, group 64, 128 residual tokens (QuantizedCache quanto)",
             bytes_per_element=0.5 + QUANTO_KV_SCALE_SHIFT_BYTES / QUANTO_KV_GROUP, backend="quanto", nbits=4,
             group_size=QUANTO_KV_GROUP, residual_tokens=QUANTO_KV_RESIDUAL, dequantizes_whole_layer=True,
             full_attention_only=True, update_extra_bytes_per_element=QUANTO_KV_UPDATE_EXTRA_BYTES + 0.5,
             quality=QualityCost(ppl_increase_pct=1.0, source="KIVI (Liu et al. 2024, arXiv:2402.02750) and the "
                                 "transformers KV-quantization blog (2024): int4 close to fp16")),
    KVScheme(name="quanto-int2", description="int2 per-channel, group 64, 128 residual tokens (QuantizedCache quanto)",
             bytes_per_element=0.25 + QUANTO_KV_SCALE_SHIFT_BYTES / QUANTO_KV_GROUP, backend="quanto", nbits=2,
             group_size=QUANTO_KV_GROUP, residual_tokens=QUANTO_KV_RESIDUAL, dequantizes_whole_layer=True,
             full_attention_only=True, update_extra_bytes_per_element=QUANTO_KV_UPDATE_EXTRA_BYTES + 0.25,
             quality=QualityCost(ppl_increase_pct=10.0, source="transformers KV-quantization blog (2024): int2 "
                                 "degrades perplexity noticeably; rough figure")),
]}


def layer_kv_bytes(a, kv: KVScheme, context: int, batch: int) -> float:
    """KV-cache bytes of one layer with attention layout `a` for `context` tokens x `batch` sequences."""
    tokens = a.cached_tokens(context)
    per_tok = a.kv_elements_per_token
    if kv.residual_tokens:
        resid = min(tokens, kv.residual_tokens)
        b = batch * (resid * per_tok * 2.0 + (tokens - resid) * per_tok * kv.bytes_per_element)
    else:
        b = batch * tokens * per_tok * kv.bytes_per_element
    return b + kv.per_layer_fixed_bytes


def kv_bytes(spec: ModelSpec, kv: KVScheme, context: int, batch: int, layers=None) -> int:
    """Exact KV-cache bytes of `layers` (default: all) for `context` tokens x `batch` sequences."""
    if layers is None:
        total = sum(n * layer_kv_bytes(a, kv, context, batch) for a, n in spec.attention_groups)
    else:
        total = sum(layer_kv_bytes(spec.attention[i], kv, context, batch) for i in layers)
    return int(math.ceil(total))


def kv_bytes_per_layer(spec: ModelSpec, kv: KVScheme, context: int, batch: int) -> list[int]:
    return spec.per_attention_layout(lambda a: int(math.ceil(layer_kv_bytes(a, kv, context, batch))))


# The backend of a compiled decode's weight formats (planner.speed fits and prices them as their own engine).
COMPILED_BACKEND = "compiled"
# A torch.compile'd decode (static KV cache, CUDA graphs: gpt-fast, torchao's generate.py) reads the same bytes without
# the eager dispatch; its weight formats are torchao's weight-only ones (int8 with a bf16 scale per row; int4 packed
# with a bf16 scale and zero per group, tinygemm). the search prices bf16 / fp16 compiled on a CUDA GPU with
# compiled_scheme(16) (planner.search.speed_scheme); bench/public_gpu.py predicts the published compiled runs with all
# three, and the profiles keep their fitted constants (engine "compiled").
_TORCHAO = QualityCost(ppl_increase_pct=0.0, source="not planned: speed only")


@functools.cache
def compiled_scheme(bits: int, group_size: int | None = None, gathers_experts: bool = False,
                    groups_experts: bool | None = None) -> WeightScheme:
    """A compiled decode's weights: bf16 (16), int8 weight-only (8) or int4 weight-only with `group_size` (4; with
    `gathers_experts`, vramplan's runtime, which gathers an MoE's routed experts for tinygemm). `groups_experts`: a
    layer's experts in one grouped call (None: bf16's, transformers' grouped experts; vLLM's fused MoE passes True).
    One object per arguments (the speed model's memos know a scheme by its identity)."""
    grouped = bits == 16 if groups_experts is None else groups_experts
    if bits == 16:
        return WeightScheme(name="bf16", backend=COMPILED_BACKEND, description="bf16, compiled decode",
                            devices=("cuda",), quality=_TORCHAO, groups_experts=grouped)
    if bits == 8:
        return WeightScheme(name="int8-wo", backend=COMPILED_BACKEND, bits=8, row_scales=True, row_scale_bytes=2.0,
                            description="int8 weight-only, bf16 scale per row, compiled decode", devices=("cuda",),
                            quality=_TORCHAO, groups_experts=grouped)
    if bits == 4 and group_size:
        return WeightScheme(name="int4-wo", backend=COMPILED_BACKEND, bits=4, group_size=group_size, scale_bytes=4.0,
                            description=f"int4 weight-only, group {group_size} (bf16 scale + zero), compiled decode",
                            devices=("cuda",), quality=_TORCHAO, gathers_experts=gathers_experts,
                            groups_experts=grouped)
    raise ValueError(f"no compiled weight format of {bits} bits (group {group_size})")
