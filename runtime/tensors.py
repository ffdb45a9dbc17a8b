"""The plain tensors that hold a module's memory, whatever library wrapped them: walking, counting, freeing.

bitsandbytes' Params4bit keeps packed data plus a quant_state (absmax, code, and for double
quantization a nested state), Int8Params its int8 data plus SCB (which its first forward moves
into the module's MatmulLtState), optimum-quanto's tensor subclasses their inner tensors
(data, scale, shift) behind __tensor_flatten__. `module_leaves` opens all of them up, in a fixed
order, each with a way to point its owner at another tensor (the offload engine rebinds them into
flat buffers); `count_tensor_bytes` counts what they hold, per device, each storage once.
`model.get_memory_footprint()` misses or misstates all of this.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class Leaf:
    """A plain tensor holding part of a module's memory, and how to point its owner at another one."""

    tensor: torch.Tensor
    rebind: Callable[[torch.Tensor], None]


def module_leaves(module: nn.Module, *, recurse: bool = True) -> list[Leaf]:
    """Every plain tensor of ``module``, in a fixed order, opened up like ``count_tensor_bytes``:
    bnb Params4bit (packed data + quant_state tensors), Int8Params (int8 data + SCB, also when its
    first forward moved them into the module's ``state``), optimum-quanto inner tensors."""
    leaves: list[Leaf] = []
    for owner in (module.modules() if recurse else (module,)):
        for param in owner._parameters.values():
            if param is not None:
                leaves.extend(_param_leaves(owner, param))
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                leaves.extend(_tensor_leaves(buffer, partial(owner._buffers.__setitem__, name)))
    return leaves


def _param_leaves(owner: nn.Module, param: torch.Tensor) -> Iterator[Leaf]:
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None:  # bitsandbytes Params4bit
        yield Leaf(param.data, partial(setattr, param, "data"))
        yield from _quant_state_leaves(quant_state)
    elif hasattr(param, "SCB") and hasattr(param, "CB"):  # bitsandbytes Int8Params
        yield from _int8_leaves(owner, param)
    elif is_wrapper(param):  # optimum-quanto
        yield from _tensor_leaves(param, None)
    else:
        yield Leaf(param.data, partial(setattr, param, "data"))


def _tensor_leaves(tensor: torch.Tensor, rebind: Callable | None) -> Iterator[Leaf]:
    if not is_wrapper(tensor):
        yield Leaf(tensor, rebind)
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        yield from _tensor_leaves(getattr(tensor, name), partial(setattr, tensor, name))


def _quant_state_leaves(quant_state: Any) -> Iterator[Leaf]:
    for name, value in list(vars(quant_state).items()):
        if isinstance(value, torch.Tensor):
            yield Leaf(value, partial(setattr, quant_state, name))
        elif value is not None and hasattr(value, "absmax") and hasattr(value, "code"):
            yield from _quant_state_leaves(value)  # state2 of double quantization


def _int8_leaves(owner: nn.Module, weight: torch.Tensor) -> Iterator[Leaf]:
    """Int8Params: CB *is* the int8 data (an alias); the first forward moves CB/SCB into the
    module's MatmulLtState. Rebinding points every alias at the new tensor."""
    state = getattr(owner, "state", None)

    def rebind_data(tensor: torch.Tensor) -> None:
        weight.data = tensor
        if weight.CB is not None:
            weight.CB = tensor
        if getattr(state, "CB", None) is not None:
            state.CB = tensor

    def rebind_scb(tensor: torch.Tensor) -> None:
        if weight.SCB is not None:
            weight.SCB = tensor
        if getattr(state, "SCB", None) is not None:
            state.SCB = tensor

    yield Leaf(weight.data, rebind_data)
    scb = weight.SCB if weight.SCB is not None else getattr(state, "SCB", None)
    if scb is not None:
        yield Leaf(scb, rebind_scb)


def is_wrapper(tensor: torch.Tensor) -> bool:
    return (hasattr(type(tensor), "__tensor_flatten__")
            and type(tensor) not in (torch.Tensor, nn.Parameter))


def count_tensor_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by every parameter and buffer of ``model`` (opened up by `module_leaves`), per device ("cpu",
    "cuda:0"), each storage once (tied embeddings, bnb's CB aliasing the int8 data), at its full size. Tensors on
    the meta device (accelerate's offloaded parameters) count their nominal size. A module that holds its weights
    outside torch tensors (fbgemm's packed rows, runtime.cpu_paths) adds its `packed_nbytes` on the CPU."""
    by_device: dict[str, int] = defaultdict(int)
    for module in model.modules():
        by_device["cpu"] += getattr(module, "packed_nbytes", 0)
    seen: set[tuple[str, int]] = set()
    for leaf in module_leaves(model):
        t = leaf.tensor
        device = str(t.device)
        if t.device.type == "meta":
            by_device[device] += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        key = (device, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        by_device[device] += storage.nbytes()
    return {d: n for d, n in by_device.items() if n or d != "cpu"}


def release_freed_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Quantizing frees each layer's unquantized weights, but glibc keeps the freed chunks
    in its heap, so without this the RSS after loading (and any peak measured later)
    still holds them: 2.3 GiB instead of 0.85 GiB for Qwen2.5-0.5B in quanto-int4.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None
