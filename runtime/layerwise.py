"""A safetensors checkpoint loaded decoder layer by decoder layer, each layer quantized as soon as it is read.

transformers' loader (`from_pretrained` with a QuantoConfig) maps the checkpoint and holds it whole in the compute
dtype before quanto quantizes it: Qwen2.5-0.5B in quanto-int8 peaked at 3.17 GiB of RSS on the CPU (1.0 GiB of it the
file's mapped pages) against the 1.73 GiB its plan counts. Here the model is built as the dummy build builds it
(runtime.dummy.build_layerwise: allocated untouched, then written and quantized a layer at a time), its values read
with plain reads (no mapping: the page cache the reads fill is the kernel's, not the process' RSS) straight into each
tensor's memory where the file's dtype is the tensor's, so at most one decoder layer is held unquantized.

The checkpoint must name every parameter as the model does, with the same shapes (transformers' plain layout); a
checkpoint that needs transformers' renames or conversions (fused experts stored per expert, a multimodal wrapper's
prefixes, a pre-quantized checkpoint) is left to transformers' loader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from vramplan.planner.errors import CheckpointError
from vramplan.planner.quant import WeightScheme
from vramplan.planner.sources import parse_safetensors_header, safetensors_header_length, weight_files
from vramplan.runtime.dummy import build_layerwise

# safetensors dtype names (planner.modelspec.canonical_dtype's) -> torch
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                 "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
                 "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a safetensors file."""

    path: Path
    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def stored_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint's safetensors files (the index's shards), by name, from their headers; those of
    a dtype this loader does not convert (fp8, ...) left out."""
    out: dict[str, StoredTensor] = {}
    for path in weight_files(model_dir):
        size = path.stat().st_size
        with path.open("rb") as f:
            n = safetensors_header_length(f.read(8), size, str(path))
            raw = f.read(n)
        for t in parse_safetensors_header(raw, size - 8 - n, str(path)):
            dtype = _TORCH_DTYPES.get(t.dtype)
            if dtype is not None:  # another (fp8, ...): left out, so a parameter stored so goes to transformers
                out[t.name] = StoredTensor(path, 8 + n + t.start, t.nbytes, dtype, t.shape)
    return out


class _Reader:
    """Reads stored tensors into tensors, one open file per shard."""

    def __init__(self, stored: dict[str, StoredTensor]):
        self.stored = stored
        self.files: dict[Path, int] = {}
        self.done: set[int] = set()  # tensors written (tied ones are one tensor under two names)

    def fill(self, model: nn.Module, modules: Iterable[tuple[str, nn.Module]]) -> None:
        with torch.no_grad():
            for name, module in modules:
                for store in (module._parameters, module._buffers):
                    for leaf, t in store.items():
                        full = f"{name}.{leaf}" if name else leaf
                        if t is None or id(t) in self.done or full not in self.stored:
                            continue  # a buffer the checkpoint does not hold keeps the constructor's value
                        self.read(self.stored[full], t.data)
                        self.done.add(id(t))

    def read(self, s: StoredTensor, into: torch.Tensor) -> None:
        """`s`'s values into `into`: read in place where it is a contiguous CPU tensor of the stored dtype, else read
        into a CPU tensor of the stored dtype and copied (converted, moved) in."""
        direct = into.is_cpu and into.dtype == s.dtype and into.is_contiguous()
        buffer = into if direct else torch.empty(s.shape, dtype=s.dtype)
        view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
        fd = self.files.get(s.path)
        if fd is None:
            fd = self.files[s.path] = os.open(s.path, os.O_RDONLY)
        got = 0
        while got < s.nbytes:
            n = os.preadv(fd, [view[got:]], s.offset + got)
            if n <= 0:
                raise CheckpointError(f"{s.path}: truncated while reading tensor data at byte {s.offset + got}")
            got += n
        if not direct:
            into.copy_(buffer.view(into.shape))

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


def mismatches(model: nn.Module, stored: dict[str, StoredTensor]) -> list[str]:
    """The model's parameters the checkpoint does not hold under their own name and shape (tied ones once)."""
    out = []
    for name, p in model.named_parameters():
        s = stored.get(name)
        if s is None or tuple(s.shape) != tuple(p.shape):
            out.append(name)
    return out


def load_layerwise(model_dir: Path, config, dtype: torch.dtype, scheme: WeightScheme, device: str,
                   trust_remote_code: bool, on_layer: Callable[[int], None] | None = None) -> nn.Module | None:
    """The checkpoint in `model_dir` built layer by layer on `device` (one device, no split), each decoder layer
    quantized by `scheme` as soon as it is read; None, before anything is read, when the checkpoint does not name
    every parameter as the model does (transformers' loader then takes it)."""
    if getattr(config, "quantization_config", None) is not None:
        return None  # stored quantized: transformers' loader reads its format
    stored = stored_tensors(model_dir)
    reader = _Reader(stored)
    try:
        return build_layerwise(config, dtype, scheme, device, None, trust_remote_code, reader.fill, on_layer,
                               check=lambda model: not mismatches(model, stored))
    finally:
        reader.close()
