"""Which CPU kernel path a decode runs, chosen per machine from the probe's record (planner.hardware.CPU_DECODE_PATHS:
HostSpec.cpu_decode_<kernel>_path, which `vramplan probe` sets to the path it timed fastest), and the fbgemm path of
quanto-w8a8.

- bf16, one row: "mv" (runtime.quantize.Bf16Rows: torch's GEMV) or "linear" (F.linear's GEMM). Without a record: mv
  where the CPU converts bf16 in software (no AVX512-BF16, no AMX), else linear.
- int8 x int8 (quanto-w8a8): "int_mm" (runtime.quantize.Int8Dynamic: torch._int_mm, oneDNN, fast with VNNI) or
  "fbgemm" (FbgemmInt8Dynamic: fbgemm's dynamic int8 linear, PyTorch's x86 dynamic quantization kernel, which
  multiplies with AVX2's vpmaddubsw where there is no VNNI). On the 2-core AVX2 EPYC VM (no VNNI) a Qwen2.5-0.5B
  decode step took 103 ms by fbgemm against 326 by _int_mm, its 128-token prefill 1.1 s against 32.5 (2026-11-29).
  Without a record: fbgemm where torch has it (x86) and the CPU has no VNNI, else int_mm.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Iterable, Mapping

import torch
from torch import nn

from vramplan.planner.hardware import CPU_DECODE_PATHS, HostSpec
from vramplan.planner.quant import fbgemm_linear_bytes


def fbgemm_available() -> bool:
    """This torch has fbgemm's kernels and the quantized tensors they pack from (deprecated in torch 2.13)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch, "_make_per_channel_quantized_tensor")
            and hasattr(torch.ops.quantized, "linear_dynamic"))


def native_bf16() -> bool:
    """Whether oneDNN has native bf16 dot products here (AVX512-BF16, AMX)."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def default_path(kernel: str) -> str:
    """The path a kernel takes where the profile records none: by the CPU's instruction set."""
    if kernel == "bf16":  # F.linear where oneDNN has native bf16 dot products (AVX512-BF16, AMX), its GEMV unmeasured
        return "linear" if native_bf16() else "mv"
    if kernel == "int8_dynamic":  # _int_mm where the CPU has int8 dot products (VNNI: 8-bit activations, fast)
        vnni = getattr(torch.cpu, "_is_vnni_supported", lambda: False)()
        return "fbgemm" if fbgemm_available() and not vnni else "int_mm"
    raise ValueError(f"unknown CPU decode kernel {kernel!r}")


def recorded_paths(host: HostSpec | None) -> dict[str, str]:
    """kernel -> the path the profile records for it (the probe's fastest), for the kernels it records a path this
    torch can run (not fbgemm on a build without it)."""
    out = {}
    for kernel in CPU_DECODE_PATHS:
        path = getattr(host, f"cpu_decode_{kernel}_path", None) if host is not None else None
        if path is not None and not (path == "fbgemm" and not fbgemm_available()):
            out[kernel] = path
    return out


def resolve(paths: Mapping[str, str] | None) -> dict[str, str]:
    """kernel -> the path the runtime runs it by: `paths` (recorded_paths), else default_path."""
    given = dict(paths or {})
    return {k: given.get(k) or default_path(k) for k in CPU_DECODE_PATHS}


def describe(paths: Mapping[str, str] | None, kernels: Iterable[str] = CPU_DECODE_PATHS) -> str:
    """"bf16 by mv (the profile), ..." for a run's notes: each kernel's path and whether the profile chose it."""
    given, chosen = dict(paths or {}), resolve(paths)
    chooser = {True: "the profile", False: "this CPU's default"}
    return ", ".join(f"{k} by {chosen[k]} ({chooser[k in given]})" for k in kernels)


# fbgemm's packed weights are a TorchScript object, which torch.compile does not trace: the compiled decode calls them
# through a custom op that takes the module's key in this table.
_PACKED: dict[int, object] = {}
_OUT_FEATURES: dict[int, int] = {}
_KEYS = itertools.count()


class FbgemmInt8Dynamic(nn.Module):
    """quanto-w8a8's matmul by fbgemm: the int8 rows (one scale per row) packed once into fbgemm's layout
    (torch.ops.quantized.linear_prepack, per-channel scales, zero points 0), each input quantized on the fly and
    multiplied int8 by int8 into int32 (torch.ops.quantized.linear_dynamic).

    fbgemm quantizes a whole input to uint8 with one scale (per tensor). Each row (token) is first divided by its
    absmax, so that the one scale is every token's own (quanto-w8a8's per-token absmax), and the outputs multiplied
    back. Activations take 7 bits (reduce_range, PyTorch's default for fbgemm: AVX2's vpmaddubsw saturates its 16-bit
    pair sums with 8; measured here, 16 % error on an adversarial input with 8 bits, 0.02 % with 7): half the
    resolution of _int_mm's symmetric int8 (planner.quant: quanto-w8a8's quality note).

    The packed weights hold the input dimension padded to fbgemm's block (planner.quant.FBGEMM_K_BLOCK) and 12 bytes a
    row (a column offset, a scale and a zero point: planner.quant.fbgemm_linear_bytes); the int8 rows they are packed
    from are released."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = data.shape
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors: fbgemm_available() checks they exist
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_channel_quantized_tensor(
                data, scale.reshape(-1).double(), torch.zeros(self.out_features, dtype=torch.long), 0)
        self.key = next(_KEYS)
        previous = torch.backends.quantized.engine
        try:  # fbgemm's layout (the one counted), whatever engine the process chose
            torch.backends.quantized.engine = "fbgemm"
            _PACKED[self.key] = torch.ops.quantized.linear_prepack(weight, None)
        finally:
            torch.backends.quantized.engine = previous
        # what the packed rows hold, which no tensor of the module shows (runtime.tensors.count_tensor_bytes adds it)
        self.packed_nbytes = fbgemm_linear_bytes(self.out_features, self.in_features)
        _OUT_FEATURES[self.key] = self.out_features
        self.bias = bias

    @classmethod
    def from_rows(cls, rows: nn.Module) -> "FbgemmInt8Dynamic":
        """From an Int8Rows / Int8Dynamic (its data and scale), keeping its fp32 scale scalars."""
        module = cls(rows.data, rows.scale, rows.bias)
        for name in ("input_scale", "output_scale"):
            if rows._buffers.get(name) is not None:
                module.register_buffer(name, rows._buffers[name])
        return module

    def __deepcopy__(self, memo: dict) -> "FbgemmInt8Dynamic":
        """A copy with packed rows of its own (under its own key: a copy sharing the key would drop them when it
        goes)."""
        import copy

        data, scale = self.unpacked()
        new = type(self)(data, scale, copy.deepcopy(self.bias, memo))
        for name in ("input_scale", "output_scale"):
            if self._buffers.get(name) is not None:
                new.register_buffer(name, self._buffers[name].clone())
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError("FbgemmInt8Dynamic holds fbgemm's packed rows outside its tensors: it cannot be pickled (copy "
                        "it with copy.deepcopy, or save the model before its CPU kernels are swapped in)")

    def __del__(self) -> None:
        _PACKED.pop(getattr(self, "key", None), None)
        _OUT_FEATURES.pop(getattr(self, "key", None), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # the custom op only where inductor traces (its dispatch costs about 55 us a call in eager)
        out = _fbgemm_linear(flat, self.key) if torch.compiler.is_compiling() else _per_token(flat, _PACKED[self.key])
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 rows and their scales, as packed (fbgemm's unpack)."""
        weight, _ = torch.ops.quantized.linear_unpack(_PACKED[self.key])
        return weight.int_repr(), weight.q_per_channel_scales().float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows x 7-bit tokens (fbgemm)"


def _per_token(x: torch.Tensor, packed: object) -> torch.Tensor:
    """x [M, in] (any float dtype) times the packed rows, each row of x scaled to absmax 1 first and back after (one
    row needs no scaling: fbgemm's one scale is already its own); fp32 [M, out]."""
    flat = x.float()
    if flat.shape[0] == 1:
        return torch.ops.quantized.linear_dynamic(flat, packed, True)
    amax = flat.abs().amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
    return torch.ops.quantized.linear_dynamic(flat / amax, packed, True) * amax


@torch.library.custom_op("vramplan::fbgemm_int8_dynamic", mutates_args=())
def _fbgemm_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    """_per_token by the packed rows of `key`, as an op inductor calls as it is."""
    return _per_token(x, _PACKED[key])


@_fbgemm_linear.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _OUT_FEATURES[key], dtype=torch.float32)
