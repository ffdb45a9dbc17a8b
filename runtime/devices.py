"""Devices and moving things to them: the one device parser and the one recursive mover every part of the runtime
uses (accelerate's ``send_to_device`` is the model), and moving a module with every side tensor of its
quantization backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vramplan.planner.errors import VramplanError
from vramplan.runtime.tensors import module_leaves

CPU = torch.device("cpu")


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a torch.device (``cuda`` is the current GPU); one line otherwise, or
    when no GPU is there."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise VramplanError(f"unsupported device {device!r}: {exc}") from None
    if device.type == "cpu":
        # cpu:N (N > 0) is the CPU too, but a device of its own to the engine: the multi-GPU hooks and boundaries run
        # on a machine without GPUs (tests)
        return CPU if not device.index else device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise VramplanError(f"device {str(device)!r} asked for, but torch {torch.__version__} sees no CUDA GPU")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    raise VramplanError(f"unsupported device {str(device)!r}: 'cpu' or 'cuda[:N]'")


def send_to_device(value: Any, device: torch.device, *, skip_keys: tuple[str, ...] = ()) -> Any:
    """``value`` with every tensor in it on ``device``: tensors, (named) tuples, lists and dicts, recursively (the
    shape of accelerate's ``send_to_device``); a dict's ``skip_keys`` and anything else stay as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        moved = (send_to_device(v, device, skip_keys=skip_keys) for v in value)
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    if isinstance(value, list):
        return [send_to_device(v, device, skip_keys=skip_keys) for v in value]
    if isinstance(value, dict):
        return {k: v if k in skip_keys else send_to_device(v, device, skip_keys=skip_keys) for k, v in value.items()}
    return value


def move_module(module: nn.Module, device: torch.device, *, recurse: bool = True) -> None:
    """``module.to(device)``, then every leaf re-pointed at its copy on ``device``: nn.Module.to
    swaps a parameter's ``.data`` but not bnb's side tensors (Int8Params.SCB, its CB alias)."""
    if device.type != "cpu":
        bnb4_device_form(module, device)
    if recurse:
        module.to(device)  # optimum-quanto tensors re-wrap themselves for the device
    for leaf in module_leaves(module, recurse=recurse):
        leaf.rebind(leaf.tensor.to(device))


def bnb4_device_form(layer: nn.Module, device: torch.device) -> None:
    """Put bnb 4-bit weights in the layout their forward uses on ``device``, up front.

    On a CPU with AVX512-BF16, Linear4bit repacks its weight and absmax on its first forward
    and rebinds them; a slot must not do that under the engine (its tensors are views of its
    buffer), so layers that slots run on the CPU are repacked here, the same way. A layer
    repacked by an earlier CPU forward and bound for CUDA is unpacked (as Params4bit.cuda() does).
    """
    for module in layer.modules():
        weight = getattr(module, "weight", None)
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            continue
        from bitsandbytes.functional import _convert_weight_packed_for_cpu, _convert_weight_packed_for_cpu_inverse

        packed = getattr(quant_state, "packing_format_for_cpu", False)
        if device.type == "cpu" and not packed and getattr(module, "support_avx512bf16_for_cpu", False) \
                and not module.training:
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu(weight.data, quant_state)
        elif device.type != "cpu" and packed:
            nested = getattr(quant_state, "original_nested", False)
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, quant_state)
            if not nested:
                # bitsandbytes 0.50.2's inverse restores absmax only for double quantization; otherwise it stays
                # the CPU form, bf16 [K / blocksize, N], where CUDA kernels want fp32 [N * K / blocksize]
                # (functional.py _convert_weight_packed_for_cpu / _inverse)
                qs = weight.quant_state
                qs.absmax = qs.absmax.T.reshape(-1).to(torch.float32).contiguous()
