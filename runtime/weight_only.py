"""torch's own weight-only kernels for the int8-wo and int4-wo schemes (planner.quant), gpt-fast's path: a decoder
layer's plain nn.Linear layers quantized at load, tensor by tensor on the device they run on, and decoded as one
compiled graph (runtime.compiled; on a GPU a CUDA graph replay).

- Int8WeightOnly: int8 [out, in], one scale per row (absmax / 127, in the compute dtype). On a GPU the product is
  F.linear(x, w.to(x.dtype)) * scale, which inductor fuses into one kernel reading the int8 bytes (gpt-fast's
  WeightOnlyInt8Linear); on the CPU torch._weight_int8pack_mm.
- Int4WeightOnly: 4-bit codes in groups of `group_size` along each row, with a bf16 scale and zero per group
  (value = (code - 8) x scale + zero: gpt-fast's group_quantize_tensor), packed in tinygemm's layout: on a GPU
  _convert_weight_to_int4pack (int32 [out/8, in/128, 32, 4]) for _weight_int4pack_mm, on the CPU
  _convert_weight_to_int4pack_for_cpu (uint8 [out, in/2]) for _weight_int4pack_mm_for_cpu. Both hold out x in / 2
  bytes of codes and in / group_size x out x 4 bytes of scales and zeros, as planner.quant counts them.

A linear tinygemm does not take (planner.quant.tinygemm_packs) stays as it is, as the planner counts it; so does
lm_head. An MoE's routed experts are quantized the same way, expert by expert (runtime.experts: TorchInt8Matrices,
TorchInt4Matrices, by int8_rows / int4_groups and their products int8_rows_mm / int4_mm).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from vramplan.planner.quant import (INT8PACK_IN_MULTIPLE, TINYGEMM_INNER_K_TILES, TINYGEMM_OUT_MULTIPLE, WeightScheme,
                                   tinygemm_packs)

# Rows quantized at a time: the float32 working copy of one block, not of a whole matrix (a 405B model's MLP
# projection is 53248 x 16384). A multiple of the row tiles of both int4 layouts (CUDA's 8, the CPU's up to 64), so
# that blocks packed apart concatenate into the whole matrix's layout.
ROWS_PER_BLOCK = 4096
assert ROWS_PER_BLOCK % 64 == 0


class Int8WeightOnly(nn.Module):
    """int8 rows with one scale each (see the module docstring); runtime.quantize.Int8Rows, quanto's qint8 layers run
    by the same CPU kernel, is one of them."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = data.shape
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, device: torch.device | str) -> "Int8WeightOnly":
        weight = linear.weight.detach()
        data = torch.empty(weight.shape, dtype=torch.int8, device=device)
        scale = torch.empty(weight.shape[0], dtype=weight.dtype, device=device)
        int8_rows(weight, data, scale)
        bias = linear.bias.detach().to(device) if linear.bias is not None else None
        return cls(data, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int8_rows_mm(x.reshape(-1, self.in_features), self.data, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The [out, in] matrix the kernel multiplies by, in fp32."""
        return self.data.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only rows"


class Int4WeightOnly(nn.Module):
    """4-bit groups in tinygemm's layout (see the module docstring)."""

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int, out_features: int,
                 in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features, self.group_size = out_features, in_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, device: torch.device | str) -> "Int4WeightOnly":
        weight = linear.weight.detach()
        packed, scale_zeros = int4_groups(weight, group_size, device)
        bias = linear.bias.detach().to(device) if linear.bias is not None else None
        return cls(packed, scale_zeros, group_size, *weight.shape, bias)

    def _product(self, a: torch.Tensor) -> torch.Tensor:
        """bf16 rows [m, in] by the matrix: [m, out]."""
        return int4_mm(a, self.packed, self.group_size, self.scale_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The [out, in] matrix the kernel multiplies by, in fp32 (the kernel applied to the identity)."""
        identity = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self._product(identity).t().float()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 weight-only groups of "
                f"{self.group_size}")


def int8_rows(weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """weight [out, in] quantized into `data` (int8, same shape) and `scale` ([out], its dtype) on their device: one
    absmax / 127 scale per row, ROWS_PER_BLOCK rows at a time in fp32."""
    for start in range(0, weight.shape[0], ROWS_PER_BLOCK):
        rows = weight[start:start + ROWS_PER_BLOCK].to(data.device, torch.float32)
        s = (rows.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        data[start:start + ROWS_PER_BLOCK] = (rows / s[:, None]).round().clamp(-128, 127).to(torch.int8)
        scale[start:start + ROWS_PER_BLOCK] = s.to(scale.dtype)


def int8_rows_mm(a: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """a [m, in] times the int8 rows `data` [out, in] with their scales [out]: [m, out] in the scales' dtype. On a GPU
    F.linear of the rows converted to a's dtype, scaled after, which inductor fuses into one kernel reading the int8
    bytes; on the CPU torch._weight_int8pack_mm."""
    if data.device.type != "cpu":
        return F.linear(a.to(scale.dtype), data.to(scale.dtype)) * scale
    a = a.to(scale.dtype)
    if a.shape[0] == 1 or data.shape[1] % INT8PACK_IN_MULTIPLE == 0:
        return torch._weight_int8pack_mm(a.contiguous(), data, scale)
    # the kernel crashes on several rows of such a width: dequantize, as quanto's fallback does
    return a @ (data.to(a.dtype) * scale[:, None]).t()


def int4_groups(weight: torch.Tensor, group_size: int, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] in tinygemm's layout for `device`: the packed codes and the bf16 scales and zeros
    [in / group_size, out, 2], quantized in row blocks of whole row tiles (ROWS_PER_BLOCK) in fp32."""
    on_gpu = torch.device(device).type == "cuda"
    packs, scales = [], []
    for start in range(0, weight.shape[0], ROWS_PER_BLOCK):
        codes, scale_zeros = group_quantize(weight[start:start + ROWS_PER_BLOCK].to(device, torch.float32), group_size)
        packs.append(pack_int4(codes, on_gpu))
        scales.append(scale_zeros)
    return torch.cat(packs), torch.cat(scales, dim=1)


def int4_mm(a: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zeros: torch.Tensor) -> torch.Tensor:
    """bf16 rows a [m, in] by a matrix packed by int4_groups on a's device: [m, out], tinygemm's kernel there."""
    if packed.device.type == "cpu":
        return torch._weight_int4pack_mm_for_cpu(a, packed, group_size, scale_zeros)
    return torch._weight_int4pack_mm(a, packed, group_size, scale_zeros)


def group_quantize(rows: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [n, k] -> int32 codes 0..15 [n, k] and bf16 scale and zero [k / group_size, n, 2]: per group,
    scale = (max - min) / 15 and zero = min + 8 x scale, so that value = (code - 8) x scale + zero."""
    n, k = rows.shape
    groups = rows.reshape(-1, group_size)
    low, high = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    # the kernel rebuilds values from the bf16 scale and zero: the codes are rounded against those (gpt-fast's
    # group_quantize_tensor_from_qparams)
    scale = ((high - low).clamp(min=1e-6) / 15).to(torch.bfloat16)
    zero = (low + scale.float() * 8).to(torch.bfloat16)
    start = zero.float() - 8 * scale.float()
    codes = groups.sub(start).div(scale.float()).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    scale_zeros = torch.cat([scale.reshape(n, -1, 1), zero.reshape(n, -1, 1)], dim=2).transpose(0, 1)
    return codes, scale_zeros.contiguous()


def pack_int4(codes: torch.Tensor, on_gpu: bool) -> torch.Tensor:
    """int32 codes [n, k] in tinygemm's layout for the device: CUDA's from uint8 pairs (the even column in the high
    nibble), the CPU's from the codes themselves."""
    if on_gpu:
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch._convert_weight_to_int4pack(pairs.contiguous(), TINYGEMM_INNER_K_TILES)
    return torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), TINYGEMM_INNER_K_TILES)


def replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> int:
    """Every plain nn.Linear of `module` but lm_head replaced by `make(linear)` where that gives a module (None: the
    linear stays, as the plan counts it); returns how many. The rest of `module` is left where it is."""
    swaps = [(name, new) for name, m in module.named_modules()
             if type(m) is nn.Linear and not name.endswith("lm_head") and (new := make(m)) is not None]
    for name, new in swaps:
        module.set_submodule(name, new)
    return len(swaps)


def quantize_linears(module: nn.Module, scheme: WeightScheme, device: torch.device | str) -> int:
    """Every plain nn.Linear of `module` (a decoder layer, or a model's decoder layers) that the scheme quantizes,
    replaced by its weight-only module on `device`; returns how many."""
    def make(m: nn.Linear) -> nn.Module | None:
        if scheme.bits == 8:
            return Int8WeightOnly.from_linear(m, device)
        if tinygemm_packs(m.out_features, m.in_features, scheme.group_size) and (
                torch.device(device).type == "cuda" or m.out_features % TINYGEMM_OUT_MULTIPLE == 0):
            # (the CPU's packing takes rows in sixteens, CUDA's in eights: the plan counts CUDA's)
            return Int4WeightOnly.from_linear(m, scheme.group_size, device)
        return None

    return replace_linears(module, make)
