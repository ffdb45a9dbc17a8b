"""Fused MoE experts quantized per expert, and a forward that reads only the experts a token is routed to.

transformers 5 holds a MoE layer's routed experts as two 3-D parameters, ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I] (gpt_oss and llama4 transposed: [E, H, 2I], [E, I, H]; gpt_oss adds a bias per
expert), which neither bitsandbytes nor optimum-quanto quantizes. ``quantize_experts(module, scheme, device)``
replaces every such module under ``module`` by a `QuantizedExperts` (llama4's by a `QuantizedRowExperts`):
each expert's [out, in] matrix is quantized on its own with the library's own quantizer, in the layout its
own Linear layers use, and the E results are stacked on a leading expert axis, so that expert e's bytes are
one contiguous slice of every buffer; tables that do not depend on the values (bnb's code tables) are held
once per projection. planner/quant.py counts exactly these bytes (WeightScheme._experts_bytes).

Kernels, per scheme (all run on the device the weights are on):
- quanto int8: quanto's kernels: on the CPU torch's ``_weight_int8pack_mm`` (bf16 activations; in_features a
  multiple of 16, see INT8PACK_IN_MULTIPLE); on CUDA quanto's ``qbytes_mm``, which dequantizes to bf16 and
  multiplies, its own choice for weight-only int8. quanto-w8a8 (CPU only): the same bytes, its input quantized per
  token and multiplied int8 by int8 (``int8_dynamic_mm``).
- quanto int4: torch's tinygemm kernels, ``_weight_int4pack_mm_for_cpu`` and, on CUDA (sm80+),
  ``_weight_int4pack_mm``. Their packing is device-specific: moving the module to another device type
  repacks the experts, as quanto's own tensors do (never streamed: planner's ``streams_on`` is empty).
- bnb 4-bit: ``bitsandbytes.matmul_4bit``: on CUDA bnb's fused 4-bit kernels; on the CPU it dequantizes
  each routed expert's matrix to the compute dtype, then multiplies. (bnb's fused AVX512-BF16 CPU kernel
  needs the weight re-laid out, absmax in bf16 and double quantization undone, a layout the plan does not
  count; experts keep the layout the plan counts.)
- bnb int8: ``bitsandbytes.matmul`` with the LLM.int8() state of its Linear8bitLt: int8 activations,
  columns above the outlier threshold in fp16.
- int8-wo / int4-wo (torch's weight-only kernels, decoded compiled): runtime.weight_only's layouts and products per
  expert. In a compiled CUDA step each routed expert's slices are gathered at the index tensor (``_slice``), so
  that no host read of an index breaks the CUDA graph.
- cpu-w4a8 (CPU only): runtime.cpu_kernel's layout per expert, its int4 x int8 kernel (the input quantized per group
  of 128); a compiled step reads each expert's slices at the index on the host and calls the kernel as a custom op.
The matmuls of quanto's schemes run in bf16 (the scheme's compute dtype: their scales are bf16); activations
are cast to it and the result back.

Routers stay in the compute dtype, as transformers leaves them: they are not plain ``nn.Linear`` (Mixtral's
``gate`` holds a bare weight; llama4's and phimoe's routers subclass ``nn.Linear`` and bnb's loader skips
them by exact type), they are E x H (0.1-0.2 % of an MoE layer) and top-k picks experts from small logit
differences. Shared experts are plain ``nn.Linear`` MLPs: the backends quantize them like any dense MLP.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from vramplan.planner.quant import (BNB_NESTED_BLOCKSIZE, CPU_KERNEL_BACKEND, INT8PACK_IN_MULTIPLE,
                                   TINYGEMM_OUT_MULTIPLE, TORCH_WO_BACKEND, WeightScheme, experts_int4_group,
                                   tinygemm_packs, w4a8_packs)

from . import cpu_kernel
from .weight_only import int4_groups, int4_mm, int8_rows, int8_rows_mm

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def is_fused_experts(module: nn.Module) -> bool:
    """transformers 5's routed experts: 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    return all(isinstance(p, nn.Parameter) and p.ndim == 3
               for p in (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)))


def quantize_experts(module: nn.Module, scheme: WeightScheme, device: str | torch.device | None = None) -> int:
    """Replace every fused experts module below ``module`` by its per-expert quantized form, built on ``device``
    (None: where its weights are); returns how many were replaced. Unquantized schemes leave them alone."""
    if not scheme.quantized:
        return 0
    replaced = 0
    for name, child in list(module.named_children()):
        if is_fused_experts(child):
            cls = QuantizedRowExperts if type(child).__name__ == "Llama4TextExperts" else QuantizedExperts
            setattr(module, name, cls(child, scheme, child.gate_up_proj.device if device is None else device))
            replaced += 1
        else:
            replaced += quantize_experts(child, scheme, device)
    return replaced


# ---------------------------------------------------------------------------------------
# One projection of all experts


class ExpertMatrices(nn.Module, abc.ABC):
    """One fused projection (gate_up or down) of E experts, each expert's [out, in] matrix quantized on its own.

    Every buffer has the expert axis first, so expert e's bytes are the e-th contiguous slice of each.
    ``matmul(x, e)`` computes ``x @ W_e.T`` for ``x`` [m, in] on this module's device, in ``x``'s dtype.
    """

    # buffers with the expert axis first; the others (code tables) are shared by all experts
    EXPERT_BUFFERS: tuple[str, ...] = ()

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.num_experts = num_experts
        self.out_features = out_features
        self.in_features = in_features

    @property
    def expert_nbytes(self) -> int:
        """Bytes a matmul with one expert reads: its slice of every per-expert buffer."""
        return sum(self._buffers[name][0].nbytes for name in self.EXPERT_BUFFERS if name in self._buffers)

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``x @ W_expert.T`` with the layout's own kernel; a layout that GATHERS also takes the expert as an index
        tensor (int64 [1], on this module's device)."""

    @abc.abstractmethod
    def dequantize(self, expert: int) -> torch.Tensor:
        """Expert ``expert``'s [out, in] matrix as the kernel sees it, in fp32."""

    # whether `matmul` takes an index tensor, reading each per-expert buffer's slice by index_select (_slice), so
    # that a CUDA graph holds the step (a host read of the index is a sync no graph captures)
    GATHERS = False

    def _slice(self, name: str, expert: int | torch.Tensor) -> torch.Tensor:
        """Buffer `name`'s slice of one expert: a view at an index, or gathered at an index tensor."""
        buffer = self._buffers[name]
        return buffer.index_select(0, expert)[0] if isinstance(expert, torch.Tensor) else buffer[expert]

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, out_features={self.out_features}, in_features={self.in_features}"


class PlainMatrices(ExpertMatrices):
    """Experts a scheme's kernels cannot hold (quanto int4 with out % 16 or in % 32; int4-wo where tinygemm_packs does
    not; cpu-w4a8 with in % 128), in the compute dtype."""

    EXPERT_BUFFERS = ("weight",)

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        super().__init__(*source.dims)
        weight = torch.empty(*source.dims, dtype=source.dtype, device=device)
        for e in range(source.experts):
            weight[e] = source.matrix(e, device)
        self.register_buffer("weight", weight)

    GATHERS = True

    def matmul(self, x, expert):
        return nn.functional.linear(x, self._slice("weight", expert).to(x.dtype))

    def dequantize(self, expert):
        return self.weight[expert].float()


def quanto_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] quantized as quanto's qint8 does (absmax per row): int8 [out, in] and one scale per row [out, 1] in
    w's dtype."""
    from optimum.quanto import AbsmaxOptimizer, qint8, quantize_weight

    q = quantize_weight(w, qtype=qint8, axis=0, scale=AbsmaxOptimizer()(w, qtype=qint8, axis=0), optimized=False)
    return q._data, q._scale


def int8_dynamic_mm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, in] times the int8 rows `data` [out, in] (one scale per row, [out] or [out, 1]) with x quantized to int8
    on the fly, one absmax scale per row of x (per token): symmetric, to -127..127, the scheme of torchao's int8dq
    (whose scales' dtype and eps differ: the same scheme, not bit-identical tensors). torch._int_mm multiplies int8 by
    int8 into exact int32 sums (oneDNN; VNNI where the CPU has it), given the [in, out] view of the row-major rows as
    they are; both scales apply to the sums in fp32. Returns fp32 [M, out]. A row of zeros stays zeros.

    Written in few ops, as eager runs them one by one (about 10 a matmul): the absmax in x's own dtype (exact), fp32
    only where the multiply promotes to it, the int32 sums scaled by one promoting multiply. x is multiplied by
    127 / absmax rather than divided by absmax / 127: with the division, inductor's compiled decode rounded some value
    the other way than eager (its tokens parted on the tests' model; with inductor's emulate_precision_casts they did
    not), and with the multiply the two agree (tests/test_w8a8.py)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(torch.finfo(torch.float32).tiny)
    q = x.mul(127 / amax).round_().to(torch.int8)  # a multiply, which inductor computes as eager does
    return torch._int_mm(q, data.t()).mul((amax / 127).mul(scale.reshape(1, -1)))


class QuantoInt8Matrices(ExpertMatrices):
    """quanto qint8 per expert: int8 [E, out, in] + one bf16 scale per output row [E, out, 1]."""

    EXPERT_BUFFERS = ("data", "scale")

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        super().__init__(*source.dims)
        experts, out_f, in_f = source.dims
        data = torch.empty(experts, out_f, in_f, dtype=torch.int8, device=device)
        scale = torch.empty(experts, out_f, 1, dtype=_scheme_dtype(scheme), device=device)
        for e in range(experts):
            data[e], scale[e] = quanto_int8_rows(source.matrix(e, device, scale.dtype))
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)

    def matmul(self, x, expert):
        from optimum.quanto.library.qbytes_mm import qbytes_mm

        a = x.to(self.scale.dtype)
        if a.device.type == "cpu" and self.in_features % INT8PACK_IN_MULTIPLE == 0:
            out = torch._weight_int8pack_mm(a.contiguous(), self.data[expert], self.scale[expert].view(-1))
        else:  # what quanto does on CUDA, and on the CPU where the int8 kernel cannot run: dequantize, matmul
            out = qbytes_mm(a, self.data[expert], self.scale[expert])
        return out.to(x.dtype)

    def dequantize(self, expert):
        return self.data[expert].float() * self.scale[expert].float()


class QuantoW8A8Matrices(QuantoInt8Matrices):
    """quanto-w8a8's experts: quanto-int8's bytes, multiplied with their input quantized per token (int8_dynamic_mm),
    on the CPU, the only device the scheme runs on."""

    def matmul(self, x, expert):
        return int8_dynamic_mm(x, self.data[expert], self.scale[expert]).to(x.dtype)


class QuantoInt4Matrices(ExpertMatrices):
    """quanto qint4 per expert in torch's tinygemm layout: packed 4-bit data (CPU: uint8 [E, out, in / 2]; CUDA:
    int32 tiles of the same bytes) + bf16 scale and shift per group of ``group_size`` along each row,
    [E, in / group, out, 2]. Quantized by quanto's MaxOptimizer and quantize_affine, packed by its TinyGemm
    tensor, as its Linear layers with groups of 128 are."""

    EXPERT_BUFFERS = ("data", "scale_shift")

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        from optimum.quanto import MaxOptimizer, qint4
        from optimum.quanto.tensor.weights.tinygemm import TinyGemmWeightQBitsTensor

        super().__init__(*source.dims)
        experts, out_f, in_f = source.dims
        self.group_size = experts_int4_group(out_f, in_f)
        dtype = _scheme_dtype(scheme)
        scale_shift = torch.empty(experts, in_f // self.group_size, out_f, 2, dtype=dtype, device=device)
        data = None
        optimizer = MaxOptimizer()
        for e in range(experts):
            w = source.matrix(e, device, dtype)
            scale, shift = optimizer(w, qtype=qint4, axis=0, group_size=self.group_size)
            # quanto's quantize_weight without its generic 4-bit packing round trip (what it does for groups of 128)
            values = torch.ops.quanto.quantize_affine(w, bits=4, axis=0, group_size=self.group_size, scale=scale,
                                                      shift=shift)
            packed = TinyGemmWeightQBitsTensor(qint4, 0, self.group_size, w.size(), w.stride(), values, (scale, shift))
            if data is None:
                data = torch.empty(experts, *packed._data._data.shape, dtype=packed._data._data.dtype, device=device)
            data[e], scale_shift[e] = packed._data._data, packed._scale_shift
        self.register_buffer("data", data)
        self.register_buffer("scale_shift", scale_shift)

    def matmul(self, x, expert):
        kernel = torch._weight_int4pack_mm_for_cpu if self.data.device.type == "cpu" else torch._weight_int4pack_mm
        out = kernel(x.to(self.scale_shift.dtype).contiguous(), self.data[expert], self.group_size,
                     self.scale_shift[expert])
        return out.to(x.dtype)

    def dequantize(self, expert):
        identity = torch.eye(self.in_features, dtype=self.scale_shift.dtype, device=self.data.device)
        return self.matmul(identity, expert).t().float()

    def _apply(self, fn, recurse=True):
        """Moving to another device type repacks every expert for that device's kernel (quanto's
        TinyGemmPackedTensor unpacks on the source device and packs on the target)."""
        source = self.data.device
        target = fn(torch.empty(0, dtype=torch.uint8, device=source)).device
        if target.type != source.type and "meta" not in (target.type, source.type):
            self._buffers["data"] = self._repacked(target)
        return super()._apply(fn, recurse)

    def _repacked(self, device: torch.device) -> torch.Tensor:
        from optimum.quanto.tensor.weights.tinygemm.packed import TinyGemmPackedTensor

        shape, stride = (self.out_features, self.in_features), (self.in_features, 1)
        out = None
        for e in range(self.num_experts):
            packed = TinyGemmPackedTensor(self.data[e], shape, stride).to(device)._data
            if out is None:
                out = torch.empty(self.num_experts, *packed.shape, dtype=packed.dtype, device=device)
            out[e] = packed
        return out


class TorchInt8Matrices(ExpertMatrices):
    """int8-wo's experts: int8 [E, out, in] + one scale per row in the compute dtype [E, out], each expert quantized
    as runtime.weight_only quantizes a linear (int8_rows) and multiplied by its product (int8_rows_mm: on a GPU the
    rows converted in the matmul, which inductor fuses; on the CPU torch._weight_int8pack_mm)."""

    EXPERT_BUFFERS = ("data", "scale")
    GATHERS = True

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        super().__init__(*source.dims)
        data = torch.empty(*source.dims, dtype=torch.int8, device=device)
        scale = torch.empty(*source.dims[:2], dtype=_scheme_dtype(scheme), device=device)
        for e in range(source.experts):
            int8_rows(source.matrix(e, device), data[e], scale[e])
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)

    def matmul(self, x, expert):
        return int8_rows_mm(x, self._slice("data", expert), self._slice("scale", expert)).to(x.dtype)

    def dequantize(self, expert):
        return self.data[expert].float() * self.scale[expert].float()[:, None]


class TorchInt4Matrices(ExpertMatrices):
    """int4-wo's experts in tinygemm's layout for their device (runtime.weight_only.int4_groups: packed codes
    [E, ...] + bf16 scale and zero per group [E, in / group, out, 2]), the scheme's group size, multiplied by
    tinygemm's kernel there (int4_mm). Quantized on the device they run on; a move to another device type is refused
    (the two layouts differ, and neither scheme streams)."""

    EXPERT_BUFFERS = ("packed", "scale_zeros")
    GATHERS = True

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        super().__init__(*source.dims)
        self.group_size = scheme.group_size
        packed = scale_zeros = None
        for e in range(source.experts):
            p, sz = int4_groups(source.matrix(e, device), self.group_size, device)
            if packed is None:
                packed = torch.empty(source.experts, *p.shape, dtype=p.dtype, device=device)
                scale_zeros = torch.empty(source.experts, *sz.shape, dtype=sz.dtype, device=device)
            packed[e], scale_zeros[e] = p, sz
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)

    def matmul(self, x, expert):
        a = x.to(torch.bfloat16).contiguous()
        return int4_mm(a, self._slice("packed", expert), self.group_size, self._slice("scale_zeros", expert)
                       ).to(x.dtype)

    def dequantize(self, expert):
        identity = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self.matmul(identity, expert).t().float()

    def _apply(self, fn, recurse=True):
        source = self.packed.device
        target = fn(torch.empty(0, dtype=torch.uint8, device=source)).device
        if target.type != source.type and "meta" not in (target.type, source.type):
            raise RuntimeError(f"int4-wo experts are packed for {source.type}'s kernel: quantize them on "
                               f"{target.type} instead of moving them")
        return super()._apply(fn, recurse)


class W4A8Matrices(ExpertMatrices):
    """cpu-w4a8's experts: each expert's matrix in runtime.cpu_kernel's layout (codes [E, out, in / 2], a bf16 scale
    and zero per group [E, out, in / group, 2]), multiplied by its kernel, the input quantized per group."""

    EXPERT_BUFFERS = ("codes", "scale_zeros")

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        super().__init__(*source.dims)
        self.group_size = scheme.group_size
        experts, out_features, in_features = source.dims
        codes = torch.empty(experts, out_features, in_features // 2, dtype=torch.uint8)
        scale_zeros = torch.empty(experts, out_features, in_features // self.group_size, 2, dtype=torch.bfloat16)
        for e in range(experts):
            codes[e], scale_zeros[e] = cpu_kernel.quantize_matrix(source.matrix(e, "cpu"), self.group_size)
        self.register_buffer("codes", codes)
        self.register_buffer("scale_zeros", scale_zeros)

    def matmul(self, x, expert):
        return cpu_kernel.product(x, self._slice("codes", expert), self._slice("scale_zeros", expert),
                                  self.group_size).to(x.dtype)

    def dequantize(self, expert):
        return cpu_kernel.dequantize(self._slice("codes", expert), self._slice("scale_zeros", expert), self.group_size)


class Bnb4bitMatrices(ExpertMatrices):
    """bitsandbytes 4-bit (nf4/fp4, blocks of 64) per expert, as ``bnb.functional.quantize_4bit`` lays out one
    matrix: packed uint8 [E, ceil(n / 2)] + fp32 absmax [E, blocks] and the 16-entry fp32 code; with double
    quantization uint8 absmax [E, blocks] + fp32 nested absmax [E, ceil(blocks / 256)] + fp32 offset [E] and the
    256-entry fp32 nested code."""

    EXPERT_BUFFERS = ("packed", "absmax", "nested_absmax", "offset")

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        from bitsandbytes.functional import quantize_4bit

        super().__init__(*source.dims)
        experts, out_f, in_f = source.dims
        self.blocksize = scheme.group_size
        self.quant_type = scheme.variant
        self.double_quant = scheme.double_quant
        n = out_f * in_f
        blocks = -(-n // self.blocksize)
        self.register_buffer("packed", torch.empty(experts, -(-n // 2), dtype=torch.uint8, device=device))
        absmax_dtype = torch.uint8 if self.double_quant else torch.float32
        self.register_buffer("absmax", torch.empty(experts, blocks, dtype=absmax_dtype, device=device))
        if self.double_quant:
            nested = -(-blocks // BNB_NESTED_BLOCKSIZE)
            self.register_buffer("nested_absmax", torch.empty(experts, nested, dtype=torch.float32, device=device))
            self.register_buffer("offset", torch.empty(experts, dtype=torch.float32, device=device))
        for e in range(experts):
            packed, state = quantize_4bit(source.matrix(e, device, _scheme_dtype(scheme)), blocksize=self.blocksize,
                                          compress_statistics=self.double_quant, quant_type=self.quant_type,
                                          quant_storage=torch.uint8)
            self.packed[e] = packed.view(-1)
            self.absmax[e] = state.absmax
            if self.double_quant:
                self.nested_absmax[e] = state.state2.absmax
                self.offset[e] = state.offset
            if e == 0:  # value-independent tables, once per projection
                self.register_buffer("code", state.code.clone())
                if self.double_quant:
                    self.register_buffer("nested_code", state.state2.code.clone())

    def quant_state(self, expert: int, dtype: torch.dtype):
        """bnb's QuantState of one expert: views of the stacked buffers, nothing copied."""
        from bitsandbytes.functional import QuantState

        nested = None
        if self.double_quant:
            nested = QuantState(absmax=self.nested_absmax[expert], code=self.nested_code,
                                blocksize=BNB_NESTED_BLOCKSIZE, dtype=torch.float32)
        return QuantState(absmax=self.absmax[expert], shape=torch.Size((self.out_features, self.in_features)),
                          code=self.code, blocksize=self.blocksize, quant_type=self.quant_type, dtype=dtype,
                          offset=self.offset[expert] if self.double_quant else None, state2=nested)

    def matmul(self, x, expert):
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, self.packed[expert].view(-1, 1).t(), quant_state=self.quant_state(expert, x.dtype))

    def dequantize(self, expert):
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(self.packed[expert].view(-1, 1), self.quant_state(expert, torch.float32)).float()


class BnbInt8Matrices(ExpertMatrices):
    """bitsandbytes LLM.int8() per expert, as Int8Params quantizes one matrix: int8 [E, out, in] + fp32 SCB
    (absmax per output row) [E, out]."""

    EXPERT_BUFFERS = ("data", "scb")

    def __init__(self, source: "_Source", scheme: WeightScheme, device):
        from bitsandbytes.functional import int8_vectorwise_quant

        super().__init__(*source.dims)
        experts, out_f, in_f = source.dims
        self.threshold = scheme.outlier_threshold
        data = torch.empty(experts, out_f, in_f, dtype=torch.int8, device=device)
        scb = torch.empty(experts, out_f, dtype=torch.float32, device=device)
        for e in range(experts):
            data[e], scb[e], _ = int8_vectorwise_quant(source.matrix(e, device, torch.float16))
        self.register_buffer("data", data)
        self.register_buffer("scb", scb)

    def matmul(self, x, expert):
        import bitsandbytes as bnb
        from bitsandbytes.autograd._functions import MatmulLtState

        state = MatmulLtState()  # what Linear8bitLt.init_8bit_state leaves for inference
        state.CB, state.SCB = self.data[expert], self.scb[expert]
        state.threshold, state.has_fp16_weights, state.is_training = self.threshold, False, False
        return bnb.matmul(x, self.data[expert], state=state)

    def dequantize(self, expert):
        return self.data[expert].float() * self.scb[expert].float()[:, None] / 127


def _matrices_class(scheme: WeightScheme, out_features: int, in_features: int, device) -> type[ExpertMatrices]:
    if scheme.backend == TORCH_WO_BACKEND:
        if scheme.bits == 8:
            return TorchInt8Matrices
        # (the CPU's packing takes rows in sixteens, CUDA's in eights: the plan counts CUDA's)
        packs = tinygemm_packs(out_features, in_features, scheme.group_size) and (
            torch.device(device).type == "cuda" or out_features % TINYGEMM_OUT_MULTIPLE == 0)
        return TorchInt4Matrices if packs else PlainMatrices
    if scheme.backend == "bnb":
        return BnbInt8Matrices if scheme.bits == 8 else Bnb4bitMatrices
    if scheme.backend == CPU_KERNEL_BACKEND:
        return W4A8Matrices if w4a8_packs(out_features, in_features) else PlainMatrices
    if scheme.backend == "quanto":
        if scheme.bits == 8:
            return QuantoW8A8Matrices if scheme.activation_bits == 8 else QuantoInt8Matrices
        return QuantoInt4Matrices if experts_int4_group(out_features, in_features) else PlainMatrices
    raise ValueError(f"{scheme.name}: no per-expert quantization for backend {scheme.backend!r}")


def _scheme_dtype(scheme: WeightScheme) -> torch.dtype:
    return COMPUTE_DTYPES[scheme.compute_dtype]


class _Source:
    """A fused 3-D parameter read one expert's [out, in] matrix at a time, whichever way it is stored."""

    def __init__(self, fused: torch.Tensor, transposed: bool):
        self.fused = fused
        self.transposed = transposed
        experts, a, b = fused.shape
        self.dims = (experts, b, a) if transposed else (experts, a, b)
        self.dtype = fused.dtype

    @property
    def experts(self) -> int:
        return self.dims[0]

    def matrix(self, expert: int, device, dtype: torch.dtype | None = None) -> torch.Tensor:
        w = self.fused[expert].detach()
        w = w.t() if self.transposed else w
        return w.to(device=device, dtype=dtype or self.dtype).contiguous()


# ---------------------------------------------------------------------------------------
# The experts module


class QuantizedExperts(nn.Module):
    """The routed experts of one MoE layer, quantized per expert; a drop-in for transformers' experts module.

    Interface (what a placement may rely on):
    - ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``: transformers'
      experts contract. All three on the device the weights are on; the result is there too, in
      ``hidden_states``' dtype. Only the experts some token is routed to are read, each once per call: a
      token's output is the sum over its k experts of weight x expert(hidden). Indices >= E (expert-parallel
      sentinels) are skipped.
    - The module owns its tensors outright (buffers of ``gate_up``, ``down``, the biases; no parameters, no
      references to other devices): ``.to(device)`` moves it as a whole (quanto int4 repacks on a device type
      change) and ``runtime.tensors.module_leaves`` / ``count_tensor_bytes`` see every byte.
    - ``expert_nbytes``: the bytes one expert's forward reads (both projections and biases).
    The math between the projections (activation, gpt_oss's clamped GLU, an optional post-expert norm) is the
    model's own: ``gating`` is transformers' experts module with its weights removed, kept for ``act_fn`` and
    ``_apply_gate``. Its forward is never called.
    """

    def __init__(self, experts: nn.Module, scheme: WeightScheme, device):
        super().__init__()
        transposed = _is_transposed(experts)
        gate_up = _Source(experts.gate_up_proj, transposed)
        down = _Source(experts.down_proj, transposed)
        self.num_experts = gate_up.experts
        self.scheme = scheme.name
        self.gate_up = _matrices_class(scheme, *gate_up.dims[1:], device)(gate_up, scheme, device)
        self.down = _matrices_class(scheme, *down.dims[1:], device)(down, scheme, device)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            bias = getattr(experts, name, None)
            self.register_buffer(name.removesuffix("_proj_bias") + "_bias",
                                 None if bias is None else bias.detach().to(device).clone())
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            experts._parameters.pop(name, None)
        self.gating = experts.to(device)  # no weights left; a post-expert norm would keep its own

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert's forward reads: its slices of both projections and of the biases."""
        biases = sum(b[0].nbytes for b in (self.gate_up_bias, self.down_bias) if b is not None)
        return self.gate_up.expert_nbytes + self.down.expert_nbytes + biases

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.unrolled_forward(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # routed (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        weights = top_k_weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts[:self.num_experts]):
            if count:
                rows = order[start:start + count]
                tokens = rows // k
                y = self.expert_forward(expert, hidden_states[tokens]) * weights[rows, None]
                out.index_add_(0, tokens, y.to(out.dtype))
            start += count
        return out

    gather_override: bool | None = None  # forces `gathers` (the tests run CUDA's way on the CPU)

    @property
    def gathers(self) -> bool:
        """Whether the compiled step reads each routed expert by gathering its slices at the index tensor (on a CUDA
        device, where both projections' layouts can: no host sync, so the step stays one CUDA graph) rather than at
        the index read on the host (the CPU's way: a view, no copy)."""
        if self.gather_override is not None:
            return self.gather_override
        on_cuda = next(self.gate_up.buffers()).device.type == "cuda"
        return self.gate_up.GATHERS and self.down.GATHERS and on_cuda

    def unrolled_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
        """`forward` as one compiled graph captures it (runtime.compiled: a decode step of T tokens): each token's k
        experts in turn, unrolled (T x k is fixed by the shapes), with no branch on the routing. Each expert's slices
        are read at an index the graph carries: an unbacked integer (dynamo's capture_scalar_outputs), or, where the
        module `gathers`, the index tensor itself (index_select: the slices copied, then multiplied). Every index is
        below E (no expert-parallel sentinels on one device)."""
        tokens, gathers = [], self.gathers
        for t in range(hidden_states.shape[0]):
            x, acc = hidden_states[t:t + 1], None
            for j in range(top_k_index.shape[1]):
                if gathers:
                    expert = top_k_index[t, j:j + 1]
                else:
                    expert = top_k_index[t, j].item()
                    torch._check(expert >= 0)
                    torch._check(expert < self.num_experts)
                y = self.expert_forward(expert, x) * top_k_weights[t, j]
                acc = y if acc is None else acc + y
            tokens.append(acc.to(hidden_states.dtype))
        return torch.cat(tokens)

    def expert_forward(self, expert: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One expert (an index, or an int64 [1] index tensor where both projections' layouts GATHER) on its tokens'
        hidden states [m, H] -> [m, H]."""
        h = self.gate_up.matmul(x, expert)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[expert]
        h = self._gate(h)
        h = self.down.matmul(h, expert)
        if self.down_bias is not None:
            h = h + self.down_bias[expert]
        norm = getattr(self.gating, "post_expert_norm", None) if getattr(self.gating, "has_post_expert_norm", False) \
            else None
        return h if norm is None else norm(h)

    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        apply_gate = getattr(self.gating, "_apply_gate", None)
        if apply_gate is not None:
            return apply_gate(h)  # transformers' default (act(gate) * up) or the model's own (gpt_oss)
        gate, up = h.chunk(2, dim=-1)
        return self.gating.act_fn(gate) * up

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, scheme={self.scheme}"


class QuantizedRowExperts(QuantizedExperts):
    """llama4's experts contract: ``forward(routed_in [E * T, H]) -> [E * T, H]``, row e * T + t holding token t's
    hidden state already scaled by its router score for expert e (zero where e is not among its top k:
    sigmoid(-inf)). A routed-out row is all zeros and, with no biases, so is its output (act(0) * 0 = 0): only
    the nonzero rows are computed, so each token reads only its own experts' bytes."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = hidden_states.view(self.num_experts, -1, hidden_states.shape[-1])
        out = torch.zeros_like(rows)
        routed = rows.ne(0).any(dim=-1)  # [E, T]
        for expert, count in enumerate(routed.sum(dim=-1).tolist()):
            if count:
                tokens = routed[expert].nonzero().squeeze(-1)
                out[expert, tokens] = self.expert_forward(expert, rows[expert, tokens]).to(out.dtype)
        return out.view(-1, hidden_states.shape[-1])


def _is_transposed(experts: nn.Module) -> bool:
    """[E, in, out] storage: transformers' flag where its experts class has one, else the shapes (llama4's
    gate_up [E, H, 2I] and down [E, I, H] share H across the middle and last axes)."""
    flag = getattr(experts, "is_transposed", None)
    if flag is not None:
        return bool(flag)
    return experts.gate_up_proj.shape[1] == experts.down_proj.shape[2]


def random_experts(hidden: int, width: int, experts: int, top_k: int, generator: torch.Generator,
                   implementation: str = "eager") -> nn.Module:
    """A standalone bf16 routed-experts module of transformers' Qwen3-MoE, weights drawn from N(0, 0.02): what
    calibration and the probe time the experts' kernels on. `implementation`: transformers' experts implementation
    ("eager": a loop over the routed experts; "grouped_mm": one grouped call, what a model's bf16 experts run)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                                  num_experts_per_tok=top_k)
    config._experts_implementation = implementation  # standalone: the model's dispatch never set it
    module = Qwen3MoeExperts(config).to(torch.bfloat16)
    for p in module.parameters():
        p.data.normal_(0, 0.02, generator=generator)
    return module
