"""Stream mode of the offload engine: offloaded decoder layers, still packed and quantized, copied to the GPU each
forward into two slots that take turns (see runtime/offload.py's docstring for the whole engine).

- Each offloaded layer's tensors move into one flat host buffer (page-locked in place when CUDA is there): a
  ``_Layout`` says where each distinct leaf tensor lives in it, and the layer's modules hold views of it.
- A slot is a replica of an offloaded layer on the device whose tensors are views into one flat device buffer; layer
  i+1's buffer is copied into the free slot on a side CUDA stream while layer i computes. Events order them.
- A slot takes layer i's per-layer scalar attributes (``layer_idx``, layer type, window) before it runs layer i.

Without CUDA the same code runs on the CPU: no streams, events or pinning, and the slot copies are plain memcpy.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from vramplan.planner.errors import VramplanError
from vramplan.runtime.devices import bnb4_device_form, move_module
from vramplan.runtime.tensors import Leaf, is_wrapper, module_leaves, release_freed_heap

SLOT_COUNT = 2
# Every tensor in a flat layer buffer starts on a multiple of this (the CUDA allocator's alignment): views stay aligned
# for vectorized kernels.
LEAF_ALIGNMENT_BYTES = 256
_SCALAR_TYPES = (bool, int, float, str, type(None))


class LayerStream:
    """The host buffers, slots and copy stream of stream mode, for the offloaded ``layers[i]`` (i in ``offloaded``).

    Reports (bytes): host_bytes (the offloaded layers' tensors, each once, no padding), host_buffer_bytes (the flat
    host buffers: host_bytes + alignment padding), pinned_bytes (host_buffer_bytes when pinned, else 0), slot_bytes
    (the slots' device buffers), layer_buffer_bytes (one layer's buffer: what one slot load copies),
    h2d_bytes_last_forward (copied into slots during the last forward, from its first offloaded layer to its last,
    the prefetch of the next forward's first layer included: achieved link bandwidth = this / the forward's time).
    """

    def __init__(self, layers: nn.ModuleList, offloaded: tuple[int, ...], device: torch.device,
                 note: Callable[[str], None]):
        self.device = device
        self.offloaded = offloaded
        self.host_bytes = 0
        self.host_buffer_bytes = 0
        self.pinned_bytes = 0
        self.slot_bytes = 0
        self.layer_buffer_bytes = 0
        self.h2d_bytes_last_forward = 0
        self._layers = layers
        self._originals = {i: layers[i] for i in offloaded}
        self._next_layer = dict(zip(offloaded, offloaded[1:] + offloaded[:1]))
        self._note = note
        self._host_buffers: dict[int, torch.Tensor] = {}
        self._locked: list[torch.Tensor] = []  # host buffers page-locked with cudaHostRegister
        self._pinned: set[int] = set()  # offloaded layers whose host buffer is pinned (copied asynchronously)
        self._unlock: Callable[[], Any] | None = None
        self._layout: _Layout | None = None
        self._slots: list[_Slot] = []
        self._current_slot: _Slot | None = None
        self._copy_stream = None
        self._attribute_keys: tuple[tuple[str, str], ...] = ()
        self._attribute_values: dict[int, tuple[Any, ...]] = {}

    # --- setup -------------------------------------------------------------------------

    def check(self) -> None:
        """Offloaded layers must share one structure (the slots are replicas), and say their index."""
        first = self.offloaded[0]
        signature = _layout_of(module_leaves(self._layers[first]), _module_types(self._layers[first])).signature
        for index in self.offloaded[1:]:
            layer = self._layers[index]
            if _layout_of(module_leaves(layer), _module_types(layer)).signature != signature:
                raise VramplanError(
                    f"stream mode needs offloaded layers of one structure; layer {index} differs from layer "
                    f"{first} (modules or tensor shapes): use mode='cpu' or more gpu_layers")
        self._collect_layer_attributes()

    def prepare(self) -> None:
        """Pack every offloaded layer into its host buffer (pinned on CUDA) and make the slots."""
        pin = self.device.type == "cuda"
        if pin:  # unlocked when the stream goes away, or at close(); the buffers live at least until then
            self._unlock = weakref.finalize(self, _page_unlock, self._locked)
        for index in self.offloaded:
            self._host_buffers[index] = self._pack_host_layer(index, pin)
        release_freed_heap()  # the layers' former tensors
        self.host_buffer_bytes = sum(b.nbytes for b in self._host_buffers.values())
        self.pinned_bytes = sum(self._host_buffers[i].nbytes for i in self._pinned)
        self.layer_buffer_bytes = self._layout.nbytes
        self._slots = [self._make_slot() for _ in range(min(SLOT_COUNT, len(self.offloaded)))]
        self.slot_bytes = sum(slot.buffer.nbytes for slot in self._slots)
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)

    def close(self) -> None:
        """Drop the slots and unpin the host buffers (the layers keep their tensors in them, pageable)."""
        if self._copy_stream is not None:
            # a prefetch may still be writing a slot: the slots' memory goes back to the allocator only after it
            self._copy_stream.synchronize()
        self._slots, self._current_slot, self._copy_stream = [], None, None
        if self._unlock is not None:
            torch.cuda.synchronize(self.device)  # no copy may still read a buffer being unlocked
            self._unlock()
            self.pinned_bytes = 0

    def _pack_host_layer(self, index: int, pin: bool) -> torch.Tensor:
        """Move layer ``index``'s tensors into one flat host buffer; its modules now hold views of it."""
        layer = self._layers[index]
        bnb4_device_form(layer, self.device)
        leaves = module_leaves(layer)
        layout = _layout_of(leaves, _module_types(layer))
        self._layout = self._layout or layout  # one for all: check() compared them
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        if pin:
            buffer = self._pin(buffer, index)
        _bind(leaves, layout, buffer)
        self.host_bytes += layout.payload_bytes
        return buffer

    def _pin(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Page-lock `buffer` in place; if the driver refuses (a memlock limit, a container), take a buffer from
        torch's pinned allocator instead (rounded up to a power of two); if that fails too, stay pageable, and
        copies of this layer are synchronous. Which one happened is noted."""
        error = _page_lock(buffer)
        if error == 0:
            self._locked.append(buffer)
            self._pinned.add(index)
            return buffer
        try:
            pinned = torch.empty(buffer.nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            _clear_cuda_error()
            self._note(f"cudaHostRegister failed (cudaError {error}) and torch's pinned allocator too: offloaded "
                       "layers stay in pageable memory and their copies are synchronous")
            return buffer
        self._pinned.add(index)
        self._note(f"cudaHostRegister failed (cudaError {error}; is the memlock limit, ulimit -l, too low?): "
                   "offloaded layers use torch's pinned allocator, which rounds each buffer up to a power of two")
        return pinned

    def _make_slot(self) -> "_Slot":
        """A replica of the first offloaded layer on ``device``, its tensors views of one device buffer."""
        module = _clone_layer(self._layers[self.offloaded[0]])
        move_module(module, self.device)
        leaves = module_leaves(module)
        layout = _layout_of(leaves, _module_types(module))
        if layout.signature != self._layout.signature:
            raise VramplanError(
                f"stream mode: on {self.device} this layer's tensors take another layout than in host memory "
                f"(a quantization backend that repacks its weights per device); use mode='cpu'")
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        _bind(leaves, layout, buffer)
        targets = tuple(module.get_submodule(path) for path, _ in self._attribute_keys)
        cuda = self.device.type == "cuda"
        return _Slot(module=module, buffer=buffer, attribute_targets=targets,
                     copied=torch.cuda.Event() if cuda else None, used=torch.cuda.Event() if cuda else None)

    def _collect_layer_attributes(self) -> None:
        """The scalar attributes that differ between offloaded layers (``layer_idx`` at least):
        a slot takes layer i's values before it runs layer i."""
        per_layer = {i: _scalar_attributes(self._originals[i]) for i in self.offloaded}
        first = per_layer[self.offloaded[0]]
        self._attribute_keys = tuple(key for key in first
                                     if any(values.get(key, first[key]) != first[key] for values in per_layer.values()))
        self._attribute_values = {i: tuple(values[key] for key in self._attribute_keys)
                                  for i, values in per_layer.items()}
        holds_index = any(name == "layer_idx" and all(per_layer[i][(path, name)] == i for i in per_layer)
                          for path, name in first)
        if not holds_index:
            raise VramplanError("stream mode: the decoder layers do not say their index (no `layer_idx` "
                                "attribute), so a slot cannot use the right KV cache entry; use mode='cpu'")

    # --- running -----------------------------------------------------------------------

    def run(self, index: int, args: tuple, kwargs: dict):
        """Run offloaded layer ``index`` in the slot holding it (loading it if none does), prefetching the next."""
        if index == self.offloaded[0]:
            self.h2d_bytes_last_forward = 0
        slot = self._slot_holding(index) or self._load(index, self._free_slot())
        self._prefetch(self._next_layer[index], busy=slot)
        if slot.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.copied)
        for target, (_, name), value in zip(slot.attribute_targets, self._attribute_keys,
                                            self._attribute_values[index]):
            setattr(target, name, value)
        output = slot.module(*args, **kwargs)
        if slot.used is not None:
            slot.used.record(torch.cuda.current_stream(self.device))
        self._current_slot = slot
        if not slot.verified:
            self._verify_bindings(slot)
        return output

    def _slot_holding(self, index: int) -> "_Slot | None":
        return next((slot for slot in self._slots if slot.layer == index), None)

    def _free_slot(self, busy: "_Slot | None" = None) -> "_Slot":
        """The slot not in use: not ``busy`` (the one about to run) nor the one that ran last."""
        avoid = busy or self._current_slot
        return next((slot for slot in self._slots if slot is not avoid), self._slots[0])

    def _prefetch(self, index: int, busy: "_Slot") -> None:
        if self._slot_holding(index) is None:
            self._load(index, self._free_slot(busy))

    def _load(self, index: int, slot: "_Slot") -> "_Slot":
        """Copy layer ``index``'s host buffer into ``slot`` (on the side stream, after the slot's last use)."""
        source = self._host_buffers[index]
        if self._copy_stream is None:
            slot.buffer.copy_(source)
        else:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(slot.used)
                # only a pinned source is copied asynchronously; a pageable one would be staged synchronously
                slot.buffer.copy_(source, non_blocking=index in self._pinned)
                slot.buffer.record_stream(self._copy_stream)  # the allocator must not reuse it while this copy runs
                slot.copied.record(self._copy_stream)
        slot.layer = index
        self.h2d_bytes_last_forward += source.nbytes
        return slot

    def _verify_bindings(self, slot: "_Slot") -> None:
        """After a slot's first run: every tensor of it must still be a view of its buffer. A module
        that rebinds its weights in forward would otherwise silently keep the first layer's values."""
        start = slot.buffer.data_ptr()
        stray = [leaf for leaf in module_leaves(slot.module)
                 if leaf.tensor.numel() and not start <= leaf.tensor.data_ptr() < start + slot.buffer.nbytes]
        if stray:
            raise VramplanError(f"stream mode: a module of {type(slot.module).__name__} replaced its tensors "
                                f"during forward ({len(stray)} of them); it cannot be streamed: use mode='cpu'")
        slot.verified = True


# ---------------------------------------------------------------------------------------
# Layouts: one flat byte buffer per layer


@dataclass(frozen=True)
class _Layout:
    """Where each distinct leaf tensor of a layer lives in one flat byte buffer."""

    specs: tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]], ...]  # dtype, size, stride
    offsets: tuple[int, ...]
    leaf_to_tensor: tuple[int, ...]  # leaves sharing a tensor share its view
    module_types: tuple[str, ...]
    nbytes: int
    payload_bytes: int

    @property
    def signature(self) -> tuple:
        return self.specs, self.leaf_to_tensor, self.module_types


def distinct_bytes(leaves: list[Leaf]) -> int:
    return sum({_tensor_key(leaf.tensor): _extent_bytes(leaf.tensor) for leaf in leaves}.values())


def _layout_of(leaves: list[Leaf], module_types: tuple[str, ...]) -> _Layout:
    index_of: dict[tuple, int] = {}
    specs, offsets, leaf_to_tensor = [], [], []
    offset = payload = 0
    for leaf in leaves:
        tensor = leaf.tensor
        key = _tensor_key(tensor)
        if key not in index_of:
            index_of[key] = len(specs)
            specs.append((tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())))
            offsets.append(offset)
            size = _extent_bytes(tensor)
            payload += size
            offset += -(-size // LEAF_ALIGNMENT_BYTES) * LEAF_ALIGNMENT_BYTES
        leaf_to_tensor.append(index_of[key])
    return _Layout(specs=tuple(specs), offsets=tuple(offsets), leaf_to_tensor=tuple(leaf_to_tensor),
                   module_types=module_types, nbytes=max(offset, 1), payload_bytes=payload)


def _bind(leaves: list[Leaf], layout: _Layout, buffer: torch.Tensor) -> None:
    """Copy every leaf into its place in ``buffer`` and point its owner at that view."""
    views = [_view(buffer, offset, *spec) for offset, spec in zip(layout.offsets, layout.specs)]
    for leaf, i in zip(leaves, layout.leaf_to_tensor):
        views[i].copy_(leaf.tensor)
    for leaf, i in zip(leaves, layout.leaf_to_tensor):
        leaf.rebind(views[i])


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, size: tuple, stride: tuple) -> torch.Tensor:
    extent = _extent_elements(size, stride)
    return buffer[offset:offset + extent * dtype.itemsize].view(dtype).as_strided(size, stride)


def _extent_elements(size: tuple, stride: tuple) -> int:
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _extent_bytes(tensor: torch.Tensor) -> int:
    return _extent_elements(tuple(tensor.shape), tuple(tensor.stride())) * tensor.element_size()


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())


def _module_types(layer: nn.Module) -> tuple[str, ...]:
    return tuple(type(m).__name__ for m in layer.modules())


# ---------------------------------------------------------------------------------------
# Slots


@dataclass(eq=False)
class _Slot:
    module: nn.Module
    buffer: torch.Tensor
    attribute_targets: tuple[nn.Module, ...]
    copied: Any  # torch.cuda.Event, or None without CUDA
    used: Any
    layer: int | None = None
    verified: bool = False


def _clone_layer(layer: nn.Module) -> nn.Module:
    """A deep copy of ``layer``, made while its tensors are standalone copies: deep-copying a view
    copies its whole storage (bnb's __deepcopy__ does, for every tensor), here the layer's buffer."""
    leaves = module_leaves(layer)
    originals = [leaf.tensor for leaf in leaves]
    copies = {_tensor_key(t): t.clone() for t in originals}
    for leaf, tensor in zip(leaves, originals):
        leaf.rebind(copies[_tensor_key(tensor)])
    try:
        return _deepcopy_layer(layer)
    finally:
        for leaf, tensor in zip(leaves, originals):
            leaf.rebind(tensor)


def _deepcopy_layer(layer: nn.Module) -> nn.Module:
    """optimum-quanto tensors cannot be deep-copied: they are rebuilt from copies of their inner
    tensors. The model's config stays shared (attention reads ``config._attn_implementation``).
    bnb's Linear4bit ends up with one quant_state, on the module and its weight, as in the original."""
    memo: dict[int, Any] = {}
    for module in layer.modules():
        for value in vars(module).values():
            if isinstance(value, PretrainedConfig):
                memo[id(value)] = value
        for param in module._parameters.values():
            if param is not None and is_wrapper(param):
                memo[id(param)] = nn.Parameter(_clone_wrapper(param), requires_grad=False)
    clone = copy.deepcopy(layer, memo)
    for module in clone.modules():
        weight_state = getattr(getattr(module, "weight", None), "quant_state", None)
        if weight_state is not None and getattr(module, "quant_state", None) is not None:
            module.quant_state = weight_state
    return clone


def _clone_wrapper(tensor: torch.Tensor) -> torch.Tensor:
    if not is_wrapper(tensor):
        return tensor.detach().clone()
    names, context = tensor.__tensor_flatten__()
    inner = {name: _clone_wrapper(getattr(tensor, name)) for name in names}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())


def _scalar_attributes(layer: nn.Module) -> dict[tuple[str, str], Any]:
    return {(path, name): value for path, module in layer.named_modules()
            for name, value in public_scalars(module).items()}


def public_scalars(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and name != "training" and isinstance(value, _SCALAR_TYPES)}


# ---------------------------------------------------------------------------------------
# Page-locking host buffers in place


# cudaHostRegisterPortable: the pinned range is usable from every CUDA context, not only the current one
CUDA_HOST_REGISTER_PORTABLE = 1


def _page_lock(buffer: torch.Tensor) -> int:
    """Pin ``buffer`` in place with cudaHostRegister; the CUDA error code (0 = pinned). Not ``pin_memory=True``
    first: torch's caching host allocator rounds every pinned block up to a power of two (a 0.6 GB layer would
    lock 1 GiB). A failure is cleared from CUDA's sticky last-error slot, so a later, unrelated check does not
    report it."""
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if error != 0:
        _clear_cuda_error()
    return error


def _clear_cuda_error() -> None:
    try:
        torch.cuda.cudart().cudaGetLastError()
    except (RuntimeError, AttributeError):
        pass


def _page_unlock(buffers: list[torch.Tensor]) -> None:
    """Undo _page_lock; ``buffers`` keeps them alive until then (memory must not be freed while registered)."""
    for buffer in buffers:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    buffers.clear()
