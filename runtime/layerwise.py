"""A safetensors checkpoint loaded decoder layer by decoder layer, each layer quantized as soon as it is read.

transformers' loader (`from_pretrained` with a QuantoConfig) maps the checkpoint and holds it whole in the compute
dtype before quanto quantizes it: Qwen2.5-0.5B in quanto-int8 peaked at 3.17 GiB of RSS on the CPU (1.0 GiB of it the
file's mapped pages) against the 1.73 GiB its plan counts. Here the model is built as the dummy build builds it
(runtime.dummy.build_layerwise: allocated untouched, then written and quantized a layer at a time), its values read
with plain reads (no mapping: the page cache the reads fill is the kernel's, not the process' RSS) straight into each
tensor's memory where the file's dtype is the tensor's, so at most one decoder layer is held unquantized.

The checkpoint must name every parameter as the model does, with the same shapes (transformers' plain layout), or
store fused MoE experts one matrix per expert as transformers' conversion mapping for the model type describes
(renames, experts stacked and gate/up concatenated: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek). A checkpoint that needs
any other conversion (a multimodal wrapper's prefixes, a pre-quantized checkpoint) is left to transformers' loader.
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
from vramplan.planner.sources import read_safetensors_header, weight_files
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
        for t in read_safetensors_header(path):
            dtype = _TORCH_DTYPES.get(t.dtype)
            if dtype is not None:  # another (fp8, ...): left out, so a parameter stored so goes to transformers
                out[t.name] = StoredTensor(path, t.start, t.nbytes, dtype, t.shape)
    return out


@dataclass(frozen=True)
class _Stacked:
    """A fused experts parameter [E, ...] stored one matrix per expert: `parts` per expert, each read into its rows of
    the expert's slice along dim 0 (transformers' MergeModulelist(0), then Concatenate(1) of the parts)."""

    parts: tuple[tuple[StoredTensor, ...], ...]  # [expert][part]


class _Sources:
    """Where each of the model's parameters is stored: under its own name, or (fused MoE experts) one matrix per expert
    as transformers' conversion mapping for the model type says (transformers.conversion_mapping: the checkpoint's
    renames, and converters that stack experts, MergeModulelist(0), and concatenate parts, Concatenate(1)). Other
    conversions are not read here: a parameter that needs one is missing (transformers' loader takes the model)."""

    def __init__(self, stored: dict[str, StoredTensor], model_type: str | None):
        self.stored = stored
        self.renamed: dict[str, StoredTensor] = {}
        self.converters: list[tuple[list[str], str]] = []  # (source patterns with "*", target suffix)
        self.unread_targets: list[str] = []  # names other conversions write: never read as stored
        renames: list[tuple[str, str]] = []
        for c in _conversions(model_type):
            kind, sources, targets, ops = c
            if kind == "rename" and len(sources) == len(targets) == 1 and not ops:
                renames.append((sources[0], targets[0]))
            elif kind == "convert" and len(targets) == 1 and all(src.count("*") == 1 for src in sources) and (
                    ops == [("MergeModulelist", 0), ("Concatenate", 1)] if len(sources) > 1
                    else ops == [("MergeModulelist", 0)]):
                self.converters.append((sources, targets[0]))
            else:
                self.unread_targets.extend(t.replace("*", "") for t in targets if t.replace("*", "") and "*" not in t)
        for name, t in stored.items():
            for old, new in renames:
                name = name.replace(old, new)
            self.renamed[name] = t

    def find(self, name: str, shape: tuple[int, ...]) -> StoredTensor | _Stacked | None:
        if any(name.endswith(target) for target in self.unread_targets):
            return None  # converted by a rule this loader does not apply, even where the name is stored as is
        s = self.stored.get(name) or self.renamed.get(name)
        if s is not None:
            return s if tuple(s.shape) == shape else None
        for sources, target in self.converters:
            if not name.endswith(target) or not shape:
                continue
            prefix = name[: len(name) - len(target)]
            parts = tuple(tuple(self.renamed.get(prefix + src.replace("*", str(e))) for src in sources)
                          for e in range(shape[0]))
            if any(t is None for expert in parts for t in expert):
                continue
            rows = [sum(t.shape[0] for t in expert) for expert in parts]  # type: ignore[union-attr]
            if all(r == shape[1] and all(tuple(t.shape[1:]) == shape[2:] for t in expert)  # type: ignore[union-attr]
                   for r, expert in zip(rows, parts)):
                return _Stacked(parts)  # type: ignore[arg-type]
        return None


def _conversions(model_type: str | None) -> list[tuple[str, list[str], list[str], list[tuple[str, int | None]]]]:
    """transformers' checkpoint conversion mapping for `model_type`, as (kind, sources, targets, operations)."""
    if model_type is None:
        return []
    try:
        from transformers.conversion_mapping import WeightConverter, WeightRenaming, get_checkpoint_conversion_mapping

        mapping = get_checkpoint_conversion_mapping(model_type) or []
    except Exception:  # noqa: BLE001 - another transformers: no conversions read here
        return []
    out = []
    for c in mapping:
        kind = "convert" if isinstance(c, WeightConverter) else "rename" if isinstance(c, WeightRenaming) else "other"
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in (getattr(c, "operations", None) or [])]
        out.append((kind, list(c.source_patterns), list(c.target_patterns), ops))
    return out


class _Reader:
    """Reads stored tensors into tensors, one open file per shard."""

    def __init__(self, sources: _Sources):
        self.sources = sources
        self.files: dict[Path, int] = {}
        self.done: set[int] = set()  # tensors written (tied ones are one tensor under two names)

    def fill(self, model: nn.Module, modules: Iterable[tuple[str, nn.Module]]) -> None:
        with torch.no_grad():
            for name, module in modules:
                for store in (module._parameters, module._buffers):
                    for leaf, t in store.items():
                        full = f"{name}.{leaf}" if name else leaf
                        source = self.sources.find(full, tuple(t.shape)) if t is not None else None
                        if source is None or id(t) in self.done:
                            continue  # a buffer the checkpoint does not hold keeps the constructor's value
                        if isinstance(source, _Stacked):
                            for e, expert in enumerate(source.parts):
                                row = 0
                                for part in expert:
                                    self.read(part, t.data[e, row:row + part.shape[0]])
                                    row += part.shape[0]
                        else:
                            self.read(source, t.data)
                        self.done.add(id(t))

    def read(self, s: StoredTensor, into: torch.Tensor) -> None:
        """`s`'s values into `into`: read in place where it is a contiguous CPU tensor of the stored dtype, else read
        into a CPU tensor of the stored dtype and copied (converted, moved) in."""
        if s.nbytes != into.numel() * s.dtype.itemsize:
            raise CheckpointError(f"{s.path}: a tensor of {tuple(s.shape)} does not fill the {tuple(into.shape)} it "
                                  "is read into")
        direct = into.is_cpu and into.dtype == s.dtype and into.is_contiguous()
        buffer = into if direct else torch.empty(s.shape, dtype=s.dtype)
        view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
        try:
            self._read_into(s, view)
        except OSError as e:
            raise CheckpointError(f"{s.path}: cannot read ({e.strerror or e})") from None
        if not direct:
            into.copy_(buffer.view(into.shape))

    def _read_into(self, s: StoredTensor, view: memoryview) -> None:
        fd = self.files.get(s.path)
        if fd is None:
            fd = self.files[s.path] = os.open(s.path, os.O_RDONLY)
        got = 0
        while got < s.nbytes:
            n = os.preadv(fd, [view[got:]], s.offset + got)
            if n <= 0:
                raise CheckpointError(f"{s.path}: truncated while reading tensor data at byte {s.offset + got}")
            got += n

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


def mismatches(model: nn.Module, sources: "_Sources | dict[str, StoredTensor]") -> list[str]:
    """The model's parameters the checkpoint does not hold with their shape, under their own name or as stacked
    experts (_Sources; tied ones once)."""
    if not isinstance(sources, _Sources):
        sources = _Sources(sources, getattr(getattr(model, "config", None), "model_type", None))
    return [name for name, p in model.named_parameters() if sources.find(name, tuple(p.shape)) is None]


def load_layerwise(model_dir: Path, config, dtype: torch.dtype, scheme: WeightScheme, device: str,
                   trust_remote_code: bool, on_layer: Callable[[int], None] | None = None) -> nn.Module | None:
    """The checkpoint in `model_dir` built layer by layer on `device` (one device, no split), each decoder layer
    quantized by `scheme` as soon as it is read; None, before anything is read, when the checkpoint does not name
    every parameter as the model does (transformers' loader then takes it)."""
    if getattr(config, "quantization_config", None) is not None:
        return None  # stored quantized: transformers' loader reads its format
    sources = _Sources(stored_tensors(model_dir), getattr(config, "model_type", None))
    reader = _Reader(sources)
    try:
        return build_layerwise(config, dtype, scheme, device, None, trust_remote_code, reader.fill, on_layer,
                               check=lambda model: not mismatches(model, sources))
    finally:
        reader.close()
