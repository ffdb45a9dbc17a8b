"""The runtime half of the quantization registry: for each scheme backend of planner.quant, how to quantize.

The planner's WeightScheme carries every layout field (bits, block size, 4-bit variant, double
quantization, int8 outlier threshold); a backend here turns them into the library's own objects:
the transformers quantization config used when loading a checkpoint, and the in-place quantization
of a module (dummy weights, offloaded layers). Both produce the same modules, classes and layouts,
so a dummy model is laid out like a checkpoint loaded with the same scheme. What is quantized is
what transformers quantizes, every plain ``nn.Linear`` except ``lm_head`` (not its subclasses: llama4's and
phimoe's routers), plus the fused MoE experts, which vramplan quantizes itself, per expert
(runtime/experts.py; the loader calls it for checkpoints, whose experts transformers leaves unquantized).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.nn import functional as F

from vramplan.planner.errors import VramplanError
from vramplan.planner.quant import CPU_KERNEL_BACKEND, TORCH_WO_BACKEND, WeightScheme, cpu_head_scheme
from vramplan.runtime.cpu_paths import FbgemmInt8Dynamic, default_path, native_bf16, resolve
from vramplan.runtime.experts import int8_dynamic_mm, quanto_int8_rows, quantize_experts
from vramplan.runtime.measure import is_oom
from vramplan.runtime.weight_only import Int8WeightOnly, quantize_linears


class Backend:
    """One library. `transformers_config` is what from_pretrained takes; `quantize` swaps a module's layers."""

    name = ""

    def transformers_config(self, scheme: WeightScheme, dtype: torch.dtype, offload: bool):
        return None

    def quantize(self, module: nn.Module, scheme: WeightScheme, dtype: torch.dtype, device: str) -> None:
        module.to(device)

    def notes(self, scheme: WeightScheme, offloaded: bool) -> list[str]:
        return []


class Unquantized(Backend):
    name = "torch"


class BitsAndBytes(Backend):
    name = "bnb"

    def transformers_config(self, scheme, dtype, offload):
        from transformers import BitsAndBytesConfig

        if scheme.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=scheme.outlier_threshold,
                                      llm_int8_enable_fp32_cpu_offload=offload)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scheme.variant,
                                  bnb_4bit_use_double_quant=scheme.double_quant, bnb_4bit_compute_dtype=dtype,
                                  llm_int8_enable_fp32_cpu_offload=offload)

    def quantize(self, module, scheme, dtype, device):
        try:
            _replace_linears_with_bnb(module, scheme, dtype, device)
            quantize_experts(module, scheme, device)
        except (RuntimeError, NotImplementedError, ImportError) as exc:
            if is_oom(exc):
                raise  # the caller re-plans; not a missing feature
            raise unsupported(scheme, device, exc) from exc

    def notes(self, scheme, offloaded):
        out = []
        if scheme.bits == 8:
            _quiet_bnb_int8_cast_warning()
            out.append("bnb-int8 casts activations to fp16 inside its matmul")
        if offloaded:
            out.append("offloaded layers stay unquantized in the compute dtype (transformers' bnb cpu offload)")
        return out


class TorchWeightOnly(Backend):
    """int8-wo / int4-wo: torch's weight-only kernels (runtime.weight_only). A checkpoint loads in the compute dtype
    on the CPU and each decoder layer is quantized on its device (runtime.load), as dummy layers are here."""

    name = TORCH_WO_BACKEND

    def quantize(self, module, scheme, dtype, device):
        try:
            quantize_experts(module, scheme, device)
            quantize_linears(module, scheme, device)
        except (RuntimeError, NotImplementedError) as exc:
            if is_oom(exc):
                raise  # the caller re-plans; not a missing feature
            raise unsupported(scheme, device, exc) from exc
        module.to(device)

    def notes(self, scheme, offloaded):
        return [f"{scheme.name}: every linear of the decoder layers and every routed expert quantized at load for "
                "torch's weight-only kernels (lm_head stays in the load dtype); it decodes compiled"]


class CpuKernel(Backend):
    """cpu-w4a8: vramplan's own CPU kernel (runtime.cpu_kernel), every plain nn.Linear of the decoder layers it takes
    and an MoE's routed experts (runtime.experts.W4A8Matrices) quantized at load; lm_head as
    planner.quant.cpu_head_scheme says (runtime.load)."""

    name = CPU_KERNEL_BACKEND

    def quantize(self, module, scheme, dtype, device):
        from vramplan.runtime import cpu_kernel

        if torch.device(device).type != "cpu":
            raise VramplanError(f"{scheme.name} runs on the CPU alone (its kernel is vramplan's AVX2 code), not on "
                                f"{device}")
        if reason := cpu_kernel.unavailable():
            raise VramplanError(f"{scheme.name} cannot run here: {reason}")
        quantize_experts(module, scheme, "cpu")
        cpu_kernel.quantize_linears(module, scheme.group_size)
        module.to(device)

    def notes(self, scheme, offloaded):
        return [f"{scheme.name}: every linear of the decoder layers and every routed expert quantized at load to 4 "
                f"bits in groups of {scheme.group_size}, multiplied by vramplan's AVX2 kernel with its inputs in int8 "
                "(runtime.cpu_kernel)"]


class Quanto(Backend):
    name = "quanto"

    def transformers_config(self, scheme, dtype, offload):
        from transformers import QuantoConfig

        # transformers' quanto loader takes every nn.Linear subclass too, and a router turned into a QLinear
        # loses its top-k forward: skip them by name, as well as lm_head (an explicit list drops the defaults)
        return QuantoConfig(weights=_quanto_weights(scheme), modules_to_not_convert=["lm_head", *ROUTER_MODULE_NAMES])

    def quantize(self, module, scheme, dtype, device):
        from optimum.quanto import freeze, qtypes, quantize

        module.to(device)
        quantize_experts(module, scheme, device)
        subclasses = [name for name, m in module.named_modules()
                      if isinstance(m, nn.Linear) and type(m) is not nn.Linear]
        quantize(module, weights=qtypes[_quanto_weights(scheme, prefix="q")], exclude=subclasses or None)
        freeze(module)
        for sub in module.modules():  # transformers' quanto loader leaves these scalars in fp32
            for name in ("input_scale", "output_scale"):
                buffer = sub._buffers.get(name)
                if buffer is not None:
                    sub._buffers[name] = buffer.float()


class Int8Rows(Int8WeightOnly):
    """An int8 weight-only linear for the CPU: int8 [out, in] + one scale per row in the compute dtype, multiplied by
    torch's _weight_int8pack_mm, the kernel quanto's qint8 runs there, called directly (quanto's own path adds an
    autograd Function and a custom op per call: 7.5 of 60 ms of a Qwen2.5-0.5B decode step, 168 calls).

    `from_linear`: lm_head quantized as quanto's qint8 does (absmax per row), a block of rows at a time, so no
    full-size temporary is held (quant.cpu_head_bytes counts it). `from_quanto`: a frozen quanto qint8 QLinear's own
    tensors, shared, not copied, with its fp32 input/output scale scalars kept (quant counts them)."""

    ROWS_PER_BLOCK = 8192

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Rows":  # type: ignore[override]  (quanto's, on the CPU)
        weight = linear.weight.detach()
        data = torch.empty(weight.shape, dtype=torch.int8)
        scale = torch.empty(weight.shape[0], dtype=weight.dtype)
        for start in range(0, weight.shape[0], cls.ROWS_PER_BLOCK):
            rows = slice(start, start + cls.ROWS_PER_BLOCK)
            data[rows], block_scale = quanto_int8_rows(weight[rows])
            scale[rows] = block_scale.view(-1)
        return cls(data, scale, linear.bias)

    @classmethod
    def from_quanto(cls, qlinear: nn.Module) -> "Int8Rows":
        weight = qlinear.weight
        return _with_scalars(cls(weight._data, weight._scale.view(-1), qlinear.bias), qlinear)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


class Int8Dynamic(Int8Rows):
    """quanto-w8a8 on the CPU: Int8Rows' tensors (a frozen quanto qint8 QLinear's, shared, or lm_head quantized as
    quanto does), with each input row quantized to int8 by its absmax and multiplied int8 by int8 into int32
    (runtime.experts.int8_dynamic_mm: torch._int_mm, VNNI where the CPU has it). Where bf16 is converted in software
    (no AVX512-BF16), _weight_int8pack_mm widens every weight to bf16 and multiplies at about 12.5 GB/s of int8 rows
    streamed from RAM; _int_mm reads them at about 20 (2-core Xeon VM, 160 4864 x 896 matrices, 700 MB: 55 against
    32-39 ms with the quantization). The scheme is torchao's int8dq, not weight-only int8: it has its own quality
    cost (planner.quant: quanto-w8a8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int8_dynamic_mm(x.reshape(-1, self.in_features), self.data, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows x int8 tokens"


class Int4Groups(nn.Module):
    """quanto's qint4 QLinear in torch's tinygemm layout (groups of 128 along each row) on the CPU without quanto's
    dispatch: its own packed data and scale/shift, shared, not copied, with its fp32 input/output scale scalars, and
    the kernel quanto calls there, torch's _weight_int4pack_mm_for_cpu."""

    def __init__(self, qlinear: nn.Module):
        super().__init__()
        weight = qlinear.weight
        self.out_features, self.in_features = qlinear.out_features, qlinear.in_features
        self.group_size = weight._group_size
        self.register_buffer("data", weight._data._data)
        self.register_buffer("scale_shift", weight._scale_shift)
        _with_scalars(self, qlinear)
        self.bias = qlinear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, self.in_features).to(self.scale_shift.dtype).contiguous()
        out = torch._weight_int4pack_mm_for_cpu(a, self.data, self.group_size, self.scale_shift)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The [out, in] matrix the kernel multiplies by, in fp32 (the kernel applied to the identity)."""
        identity = torch.eye(self.in_features, dtype=self.scale_shift.dtype)
        return torch._weight_int4pack_mm_for_cpu(identity, self.data, self.group_size, self.scale_shift).t().float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


class Bf16Rows(nn.Linear):
    """A bf16 nn.Linear on the CPU whose one-row products (a decode step at batch 1) call torch.mv, the same weight and
    bias Parameters, shared, not copied. torch 2.13's bf16 F.linear of one row goes through its GEMM path, which
    converts bf16 at about half the rate of mv's GEMV on a CPU without native bf16 (2-core Xeon, AVX-512 without BF16:
    8192 x 2048 in 1230 us against 719; a Qwen2.5-0.5B decode 11.8 -> 13.1 tok/s, bench/results/vs-engines-cpu-dev.md as
    of 3293d8f). Both sum in fp32, in another order: an output equals F.linear's or differs in its last bf16 bit (896 x
    4864: 0.5 elements a row on average, at most 2). Several rows (a prefill) multiply in fp32, the weight widened a
    block of rows at a time (_fp32_blocks): bf16 F.linear converts in software at about 61 GFLOP/s there, this runs at
    200-235 at 128 rows and 270-290 at 512 (4864 x 896: 225 at 128), and beats F.linear from 8 rows up. Fewer than
    FP32_MIN_ROWS keep F.linear. A subclass, so what looks for a Linear (transformers' output embeddings, tied weights)
    still finds one."""

    # from this many rows the fp32 blocks beat bf16 F.linear on the 2-core Xeon dev VM: 8 rows 49-87 GFLOP/s against
    # 38-39 (4864 x 896, 896 x 4864, 8192 x 2048); 4 rows 15-50 against 27-30, 2 rows 9-34 against 35-50
    FP32_MIN_ROWS = 8
    # Where bf16 is native (AVX512-BF16, AMX: runtime.cpu_paths.native_bf16) a prefill keeps bf16 F.linear: on the
    # 2-core Xeon AMX VM it ran 860-1040 GFLOP/s at 128 rows of Qwen2.5-0.5B's and Llama-3.2-1B's shapes, the fp32
    # blocks 210-260, and a 128-token bf16 prefill of Qwen2.5-0.5B took 0.83 s by them (2026-11-29)
    FP32_PREFILL = None  # (native_bf16's answer, read at the first prefill)

    @classmethod
    def of(cls, linear: nn.Linear) -> "Bf16Rows":
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias
        return module.train(linear.training)

    @staticmethod
    def pays_here() -> bool:
        """Whether bf16 rows run by GEMV here: the path runtime.cpu_paths picks without a profile's record."""
        return default_path("bf16") == "mv"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu:  # moved to a GPU
            return super().forward(x)
        if x.numel() != self.in_features:  # several rows: a prefill
            if Bf16Rows.FP32_PREFILL is None:
                Bf16Rows.FP32_PREFILL = not native_bf16()
            if x.numel() < self.FP32_MIN_ROWS * self.in_features or torch.compiler.is_compiling() \
                    or not Bf16Rows.FP32_PREFILL:
                return super().forward(x)
            return _fp32_blocks(self.weight, x, self.bias)
        row = x.reshape(-1)
        if torch.compiler.is_compiling():  # inductor would decompose mv into loops of its own: keep torch's
            out = _gemv_op(self.weight, row, self.bias)
        else:
            out = _gemv(self.weight, row, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def _gemv(weight: torch.Tensor, row: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """weight @ row (+ bias), by torch's GEMV; addmv adds the bias before the one rounding to bf16, as F.linear's
    addmm does."""
    return torch.mv(weight, row) if bias is None else torch.addmv(bias, weight, row)


# the fp32 rows of weight widened at a time: one core's L2 (2 MiB on the dev VM's Xeon); 2 MiB blocks ran 1.1-1.6x
# faster than 256 KiB ones there, and widening the whole weight at once re-reads it from RAM (8192 x 2048: 127 GFLOP/s
# at 128 rows against 227)
FP32_BLOCK_BYTES = 2 << 20


def _fp32_blocks(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) in fp32, rounded once to x's dtype as F.linear's fp32 accumulation is: the bf16 weight
    widened FP32_BLOCK_BYTES of fp32 rows at a time, each block's product written into its columns of the output."""
    in_features = weight.shape[1]
    flat = x.reshape(-1, in_features).float()
    out = torch.empty(flat.shape[0], weight.shape[0], dtype=x.dtype)
    step = max(16, FP32_BLOCK_BYTES // (4 * in_features))
    for start in range(0, weight.shape[0], step):
        stop = start + step
        out[:, start:stop] = F.linear(flat, weight[start:stop].float(),
                                      None if bias is None else bias[start:stop].float())
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("vramplan::bf16_gemv", mutates_args=())
def _gemv_op(weight: torch.Tensor, row: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """_gemv as a custom op, which torch.compile calls as it is: inductor decomposes aten's mv into generated loops,
    7 % slower on Llama-3.2-1B's compiled decode here (6.85 against 7.35 tok/s; Qwen2.5-0.5B 13.9 against 14.1)."""
    return _gemv(weight, row, bias)


@_gemv_op.register_fake
def _(weight: torch.Tensor, row: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return row.new_empty(weight.shape[0])


def _with_scalars(module: nn.Module, qlinear: nn.Module) -> nn.Module:
    """`module` holding the QLinear's fp32 input/output scale scalars too (the plan counts their 8 bytes)."""
    for name in ("input_scale", "output_scale"):
        if qlinear._buffers.get(name) is not None:
            module.register_buffer(name, qlinear._buffers[name])
    return module


def direct_kernels(model: nn.Module, activation_bits: int = 16, paths: Mapping[str, str] | None = None) -> int:
    """Every layer on the CPU (a model run there alone, or the layers an offload computes there) whose kernel
    vramplan can call itself is replaced by a module over the same tensors (same bytes, same kernel or, for bf16, the
    same sums by GEMV): a frozen quanto QLinear in qint8 by Int8Rows, in qint4 with tinygemm's layout by Int4Groups,
    and a plain bf16 nn.Linear by Bf16Rows where `paths` (runtime.cpu_paths.resolve: the profile's record, else the
    CPU's default) runs bf16 rows by "mv"; returns how many. Other layouts (quanto's generic 4-bit packing, fp16,
    bitsandbytes) stay as they are. With `activation_bits` 8 (the scheme's: quanto-w8a8) every qint8 QLinear on the
    CPU becomes an Int8Dynamic (path "int_mm") or an FbgemmInt8Dynamic ("fbgemm"), whatever its scale's dtype. Each
    is swapped in as it is made, so a repacked layout (fbgemm's) never coexists with all of its sources."""
    paths = resolve(paths)
    swaps: list[tuple[str, Callable[[], nn.Module]]] = []
    quanto = "optimum.quanto" in sys.modules  # no QLinear exists before quanto is imported (it takes 1-2 s)
    if quanto:
        from optimum.quanto import qint8
        from optimum.quanto.nn import QLinear
        from optimum.quanto.tensor.weights.tinygemm import TinyGemmWeightQBitsTensor
    gemv = paths["bf16"] == "mv"
    fbgemm = paths["int8_dynamic"] == "fbgemm"
    for name, m in model.named_modules():
        if type(m) is nn.Linear:
            if gemv and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu":
                swaps.append((name, functools.partial(Bf16Rows.of, m)))
            continue
        if not quanto or type(m) is not QLinear or m.activation_qtype is not None:
            continue
        if type(m.weight) is TinyGemmWeightQBitsTensor and m.weight._data._data.device.type == "cpu":
            swaps.append((name, functools.partial(Int4Groups, m)))
        elif getattr(m.weight, "qtype", None) is qint8 and m.weight._data.dtype == torch.int8 \
                and m.weight._data.device.type == "cpu":
            if activation_bits == 8:
                swaps.append((name, functools.partial(_dynamic, m, fbgemm)))
            elif m.weight._scale.dtype == torch.bfloat16:
                swaps.append((name, functools.partial(Int8Rows.from_quanto, m)))
    del m
    count = len(swaps)
    swaps.reverse()
    while swaps:  # each source let go of (its partial dropped) once its replacement is in
        name, make = swaps.pop()
        model.set_submodule(name, make())
        del make
    return count


def _dynamic(qlinear: nn.Module, fbgemm: bool) -> nn.Module:
    rows = Int8Dynamic.from_quanto(qlinear)
    return FbgemmInt8Dynamic.from_rows(rows) if fbgemm else rows


def quantize_cpu_head(model: nn.Module, scheme: WeightScheme, paths: Mapping[str, str] | None = None) -> str | None:
    """On a model that runs on the CPU alone, store lm_head as planner.quant.cpu_head_scheme says (int8 rows for the
    quanto schemes; quanto-w8a8's by the int8 x int8 path of `paths`, runtime.cpu_paths.resolve), as the plan counts
    it; a tied embedding keeps its own tensor for the lookup. Returns a note for the run's report, or None when the head
    stays as it is."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_scheme = cpu_head_scheme(scheme, head.in_features) if type(head) is nn.Linear else None
    if head_scheme is None:
        return None
    name = next(n for n, m in model.named_modules() if m is head)
    tied = head.weight is getattr(model.get_input_embeddings(), "weight", None)
    rows = Int8Dynamic if head_scheme.activation_bits == 8 else Int8Rows
    module = rows.from_linear(head)
    del head
    if rows is Int8Dynamic and resolve(paths)["int8_dynamic"] == "fbgemm":
        model.set_submodule(name, module)  # the bf16 head goes (unless tied) before its packed copy is made
        module = FbgemmInt8Dynamic.from_rows(module)  # if it fails, the int8 rows stay, by _int_mm
    model.set_submodule(name, module)
    per_token = ", its input quantized per token" if rows is Int8Dynamic else ""
    return (f"the output layer (lm_head) is kept in int8 rows on the CPU, as {head_scheme.name} stores its weights"
            f"{per_token}: it is read whole for every token, so this halves that read"
            + ("; the tied embedding keeps its own copy for the lookup" if tied else ""))


# Module names of the routers that subclass nn.Linear (transformers 5.23: llama4's feed_forward.router, phimoe's
# mlp.router); transformers' module patterns match them as suffixes.
ROUTER_MODULE_NAMES = ("router",)

BACKENDS: dict[str, Backend] = {b.name: b for b in (Unquantized(), BitsAndBytes(), Quanto(), TorchWeightOnly(),
                                                    CpuKernel())}


def backend(scheme: WeightScheme) -> Backend:
    try:
        return BACKENDS[scheme.backend]
    except KeyError:
        raise VramplanError(f"{scheme.name}: no runtime for backend {scheme.backend!r}") from None


def _quanto_weights(scheme: WeightScheme, prefix: str = "") -> str:
    """quanto's name for the weight type: int8 / int4 (qint8 / qint4 in optimum.quanto.qtypes)."""
    return f"{prefix}int{scheme.bits}"


def unsupported(scheme: WeightScheme, device: str, exc: BaseException) -> VramplanError:
    try:
        import bitsandbytes

        version = bitsandbytes.__version__
    except Exception:  # noqa: BLE001 - the reason is what we report
        version = "(not importable)"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return VramplanError(f"{scheme.name} is not supported on {device} with bitsandbytes {version}: {reason}")


def _replace_linears_with_bnb(module: nn.Module, scheme: WeightScheme, dtype: torch.dtype, device: str) -> None:
    """Swap every nn.Linear under ``module`` for its bnb layer, quantized on ``device``.

    Same modules, classes and arguments as transformers' bnb loader, so the layout is the
    one a checkpoint loaded with BitsAndBytesConfig gets.
    """
    import bitsandbytes as bnb

    for name, child in list(module.named_children()):
        if not (isinstance(child, nn.Linear) and type(child) is nn.Linear):
            _replace_linears_with_bnb(child, scheme, dtype, device)
            continue
        has_bias = child.bias is not None
        if scheme.bits == 8:
            new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=has_bias,
                                      has_fp16_weights=False, threshold=scheme.outlier_threshold, device="meta")
            weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=has_bias, compute_dtype=dtype,
                                    compress_statistics=scheme.double_quant, quant_type=scheme.variant,
                                    quant_storage=torch.uint8, device="meta")
            weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, blocksize=scheme.group_size,
                                       compress_statistics=scheme.double_quant, quant_type=scheme.variant,
                                       quant_storage=torch.uint8, module=new)
        new._parameters["weight"] = weight.to(device)  # .to() quantizes
        if has_bias:
            new._parameters["bias"] = nn.Parameter(child.bias.data.to(device), requires_grad=False)
        new.requires_grad_(False)
        setattr(module, name, new)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _quiet_bnb_int8_cast_warning() -> None:
    """bnb logs "inputs will be cast ... to float16" on every int8 matmul; it is expected (and noted)."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("MatMul8bitLt: inputs will be cast"))
