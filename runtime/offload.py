"""The offload engine: run a causal LM whose last decoder layers do not fit on the GPU.

``apply_offload(model, gpu_layers=..., mode=..., device=...)`` takes a transformers CausalLM
loaded entirely on the CPU, already quantized as planned, and places it:

- on ``device``: the first ``gpu_layers`` decoder layers and everything outside the decoder
  layers (final norm, lm_head, rotary embedding), plus the input embedding when it is tied
  to lm_head. An untied input embedding stays on the CPU (a lookup reads a few rows; the
  plan counts it in RAM): token ids go to it and its output comes to ``device``.
- the other decoder layers, "offloaded", run in one of two modes:
  - "stream": each offloaded layer's tensors, still packed and quantized, are moved into
    one flat host buffer per layer (page-locked in place when CUDA is there). Two "slots",
    replicas of an offloaded layer on ``device`` whose tensors are views into one flat device
    buffer, take turns: while one slot runs layer i, layer i+1's buffer is copied into the other on a
    side CUDA stream, one copy per layer. Events order them: compute waits for the copy
    into its slot; a copy into a slot waits for the compute that last read it. The last
    offloaded layer prefetches the first for the next forward. The KV cache of streamed
    layers is on ``device``: before a slot runs layer i it takes that layer's index
    (``self_attn.layer_idx``) and every other per-layer attribute (layer type, window).
  - "cpu": offloaded layers compute on the CPU with their KV cache in RAM. Hidden states
    and the kwargs a decoder layer receives (position embeddings, mask, positions) cross
    to the CPU once per forward, at the first offloaded layer; the output of the last one
    comes back to ``device``.

Without CUDA the same code runs with ``device="cpu"``: streams, events and pinning drop
out, the slot copies are plain memcpy, and the logits are bit-identical to the model's
without offload, which is what the tests check.

``OffloadEngine.detach()`` puts the original layers back and the model on the CPU.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from planner.errors import VramplanError
from runtime.load import decoder_layers
from runtime.tensors import Leaf, count_tensor_bytes, is_wrapper, module_leaves, release_freed_heap

MODES = ("stream", "cpu")
SLOT_COUNT = 2
# Offset alignment of each tensor inside a layer's flat buffer: kernels want >= 16 bytes for
# vectorized loads; 256 matches what cudaMalloc guarantees, so a view is aligned like its original.
LEAF_ALIGNMENT_BYTES = 256
CPU = torch.device("cpu")
_SCALAR_TYPES = (bool, int, float, str, type(None))


# ---------------------------------------------------------------------------------------
# Public API


def apply_offload(model: nn.Module, *, gpu_layers: int, mode: str, device: str | torch.device,
                  gpu_layers_per_device: tuple[int, ...] | None = None, devices: list | None = None,
                  experts_on_cpu: int = 0) -> "OffloadEngine":
    """Place ``model`` (a CausalLM entirely on the CPU) with ``gpu_layers`` decoder layers on
    ``device`` and the rest offloaded in ``mode`` ("stream" or "cpu"); see the module docstring.

    Several GPUs: ``devices`` (the first is ``device``) and ``gpu_layers_per_device`` (layer counts in device
    order, summing to ``gpu_layers``) split the resident layers, the first ones on the first device; everything
    outside the decoder layers, and streamed layers, stay on the first. ``experts_on_cpu``: the routed experts of
    the first that many MoE layers stay in RAM and compute on the CPU, the rest of those layers on their GPU."""
    if mode not in (*MODES, "none"):
        raise VramplanError(f"unknown offload mode {mode!r}; one of {', '.join(MODES)}, or none")
    device = _resolve_device(device)
    devices = [device] + [_resolve_device(d) for d in (devices or [device])[1:]]
    split = tuple(gpu_layers_per_device) if gpu_layers_per_device else (gpu_layers,)
    if len(split) > len(devices) or sum(split) != gpu_layers:
        raise VramplanError(f"gpu_layers_per_device {list(split)} must sum to gpu_layers={gpu_layers} over at most "
                            f"{len(devices)} devices")
    if any(isinstance(m, OffloadedLayer) for m in model.modules()):
        raise VramplanError("this model is already offloaded: detach() its engine first")
    layers_path, layers = decoder_layers(model, int(model.config.get_text_config(decoder=True).num_hidden_layers))
    if isinstance(gpu_layers, bool) or not isinstance(gpu_layers, int) or not 0 <= gpu_layers <= len(layers):
        raise VramplanError(f"gpu_layers={gpu_layers!r} is outside 0..{len(layers)} (the model's decoder layers)")
    if mode == "none" and gpu_layers != len(layers):
        raise VramplanError(f"offload mode none places every layer: gpu_layers={gpu_layers} of {len(layers)}")
    elsewhere = sorted(set(count_tensor_bytes(model)) - {"cpu"})
    if elsewhere:
        raise VramplanError(f"apply_offload takes a model loaded entirely on the CPU; this one has tensors on "
                            f"{', '.join(elsewhere)}")
    engine = OffloadEngine(model, layers, layers_path, mode=mode, gpu_layers=gpu_layers, device=device,
                           layer_devices=[devices[d] for d, k in enumerate(split) for _ in range(k)],
                           experts_on_cpu=experts_on_cpu)
    engine.attach()
    return engine


class OffloadedLayer(nn.Module):
    """Stands in the decoder ModuleList for an offloaded layer and hands each call to the engine.

    The original layer stays registered as ``.layer`` (its host tensors are still part of the
    model for counting and ``model.modules()``), and its public scalar attributes are copied
    here, for model code that reads them off the layer (``decoder_layer.attention_type``).
    """

    def __init__(self, engine: "OffloadEngine", index: int, layer: nn.Module):
        super().__init__()
        for name, value in _public_scalars(layer).items():
            setattr(self, name, value)
        self.index = index
        self.layer = layer
        self._engine = engine

    def forward(self, *args, **kwargs):
        return self._engine._run(self.index, self.layer, args, kwargs)


class OffloadEngine:
    """What ``apply_offload`` placed where, the stream-mode machinery, and ``detach()``.

    Reports (bytes):
      host_bytes: the offloaded layers' tensors held in host memory (each tensor once, no padding);
      host_buffer_bytes: the flat host buffers of stream mode (host_bytes + alignment padding);
      pinned_bytes: host_buffer_bytes when they are pinned (CUDA), else 0;
      slot_bytes: the device buffers of the slots (both);
      layer_buffer_bytes: one layer's buffer, what one slot load copies;
      h2d_bytes_last_forward: bytes copied into slots during the last forward (stream),
        from its first offloaded layer to its last, including the prefetch of the next
        forward's first layer; so achieved link bandwidth = this / the forward's time.
    """

    def __init__(self, model: nn.Module, layers: nn.ModuleList, layers_path: str, *, mode: str,
                 gpu_layers: int, device: torch.device, layer_devices: list[torch.device] | None = None,
                 experts_on_cpu: int = 0):
        self.model = model
        self.mode = mode
        self.gpu_layers = gpu_layers
        self.device = device
        self.layer_devices: list[torch.device] = layer_devices or [device] * gpu_layers  # of the resident layers
        experts = [(i, m) for i in range(gpu_layers) if (m := _routed_experts(layers[i])) is not None]
        self._experts_on_cpu: dict[int, nn.Module] = dict(experts[:experts_on_cpu])
        self.offloaded_layers: tuple[int, ...] = tuple(range(gpu_layers, len(layers)))
        self.input_embedding_on_host = False
        self.host_bytes = 0
        self.host_buffer_bytes = 0
        self.pinned_bytes = 0
        self.slot_bytes = 0
        self.layer_buffer_bytes = 0
        self.h2d_bytes_last_forward = 0
        self.attached = False
        self._layers = layers
        self._layers_path = layers_path
        self._originals = {i: layers[i] for i in self.offloaded_layers}
        self._next_layer = dict(zip(self.offloaded_layers, self.offloaded_layers[1:] + self.offloaded_layers[:1]))
        self._resident: list[tuple[nn.Module, bool]] = []  # (module, with its submodules) moved to device
        self._hooks: list[Any] = []
        self._boundary = _Boundary()
        # stream mode
        self._host_buffers: dict[int, torch.Tensor] = {}
        self._locked: list[torch.Tensor] = []  # host buffers page-locked with cudaHostRegister
        self._pinned: set[int] = set()  # offloaded layers whose host buffer is pinned (copied asynchronously)
        self.notes: list[str] = []  # what the engine had to fall back to
        self._unlock: Callable[[], Any] | None = None
        self._layout: _Layout | None = None
        self._slots: list[_Slot] = []
        self._current_slot: _Slot | None = None
        self._copy_stream = None
        self._attribute_keys: tuple[tuple[str, str], ...] = ()
        self._attribute_values: dict[int, tuple[Any, ...]] = {}

    # --- attach / detach ---------------------------------------------------------------

    def attach(self) -> None:
        """Place the model; if a step fails, whatever was done is undone before the error propagates."""
        if self.mode == "stream" and self.offloaded_layers:
            self._check_streamable()  # before anything moves
        try:
            self._place_resident()
            if self.mode == "stream":
                self._prepare_stream()
            else:
                self.host_bytes = sum(_distinct_bytes(module_leaves(self._layers[i])) for i in self.offloaded_layers)
            self._install_wrappers()
            self._install_hooks()
        except BaseException:
            self._restore()
            raise
        self.attached = True

    def detach(self) -> None:
        """Put the original layers back, remove the hooks and bring the model back to the CPU.
        Streamed layers keep their tensors in their host buffers, no longer pinned; the values are the same."""
        if self.attached:
            self._restore()
            self.attached = False

    def _restore(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for index, layer in self._originals.items():
            self._layers[index] = layer
        if self.device.type != "cpu" or any(d.type != "cpu" for d in self.layer_devices):
            for module, recurse in self._resident:
                _move(module, CPU, recurse=recurse)
        if self._copy_stream is not None:
            # a prefetch may still be writing a slot: the slots' memory goes back to the allocator only after it
            self._copy_stream.synchronize()
        self._slots, self._current_slot, self._copy_stream = [], None, None
        if self._unlock is not None:
            torch.cuda.synchronize(self.device)  # no copy may still read a buffer being unlocked
            self._unlock()
            self.pinned_bytes = 0
        self._boundary.clear()

    remove = detach

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "device": str(self.device), "gpu_layers": self.gpu_layers,
            "offloaded_layers": list(self.offloaded_layers), "input_embedding_on_host": self.input_embedding_on_host,
            "host_bytes": self.host_bytes, "host_buffer_bytes": self.host_buffer_bytes,
            "pinned_bytes": self.pinned_bytes, "slot_bytes": self.slot_bytes,
            "layer_buffer_bytes": self.layer_buffer_bytes, "h2d_bytes_last_forward": self.h2d_bytes_last_forward,
            "layer_devices": [str(d) for d in self.layer_devices], "experts_on_cpu": sorted(self._experts_on_cpu),
            "notes": list(self.notes),
        }

    # --- placement ---------------------------------------------------------------------

    def _place_resident(self) -> None:
        """Everything but the offloaded layers (and an untied input embedding) goes to ``device``; resident layers to
        their own device, without the routed experts kept in RAM."""
        embedding = self.model.get_input_embeddings()
        self.input_embedding_on_host = not _embeddings_tied(self.model)
        keep_on_host = [embedding] if self.input_embedding_on_host else []
        moved = [(m, r, self.device) for m, r in _modules_outside(self.model, self._layers, keep_on_host)]
        for i in range(self.gpu_layers):
            layer, experts = self._layers[i], self._experts_on_cpu.get(i)
            if experts is None:
                moved.append((layer, True, self.layer_devices[i]))
            else:
                moved += [(m, r, self.layer_devices[i]) for m, r in _modules_outside(layer, experts, [])]
        self._resident = [(m, r) for m, r, _ in moved]
        for module, recurse, device in moved:
            _move(module, device, recurse=recurse)

    def _install_wrappers(self) -> None:
        for index in self.offloaded_layers:
            self._layers[index] = OffloadedLayer(self, index, self._originals[index])

    def _install_hooks(self) -> None:
        """Token ids go to the input embedding's device, its output and every other tensor the
        decoder stack receives (positions, mask) to ``device``."""
        embedding = self.model.get_input_embeddings()
        base = self.model.get_submodule(self._layers_path.rpartition(".")[0])
        self._hooks = [
            embedding.register_forward_pre_hook(_ids_to_weight_device),
            embedding.register_forward_hook(partial(_output_to, self.device)),
            base.register_forward_pre_hook(partial(_kwargs_to, self.device), with_kwargs=True),
        ]
        # several GPUs: a resident layer on another device gets its inputs there (the decoder stack's kwargs are
        # shared by every layer: one copy per device and forward); the final norm and lm_head get theirs back
        elsewhere = [i for i in range(self.gpu_layers) if self.layer_devices[i] != self.device]
        for i in elsewhere:
            self._hooks.append(self._layers[i].register_forward_pre_hook(
                partial(self._inputs_to, self.layer_devices[i], i == elsewhere[0]), with_kwargs=True))
        if any(d != self.device for d in self.layer_devices):
            for module in (getattr(base, "norm", None), self.model.get_output_embeddings()):
                if module is not None:
                    self._hooks.append(module.register_forward_pre_hook(partial(_args_to, self.device)))
        # routed experts in RAM: their inputs go to the CPU, their output back to their layer's device
        for i, experts in self._experts_on_cpu.items():
            self._hooks.append(experts.register_forward_pre_hook(partial(_all_to, CPU), with_kwargs=True))
            self._hooks.append(experts.register_forward_hook(partial(_output_to, self.layer_devices[i])))

    def _inputs_to(self, device: torch.device, first: bool, module: nn.Module, args: tuple, kwargs: dict):
        if first:
            self._boundary.clear()
        return self._boundary.move((args, kwargs), device)

    # --- stream mode: setup ------------------------------------------------------------

    def _prepare_stream(self) -> None:
        if not self.offloaded_layers:
            return
        pin = self.device.type == "cuda"
        if pin:  # unlocked when the engine goes away, or at detach(); the buffers live at least until then
            self._unlock = weakref.finalize(self, _page_unlock, self._locked)
        for index in self.offloaded_layers:
            self._host_buffers[index] = self._pack_host_layer(index, pin)
        release_freed_heap()  # the layers' former tensors
        self.host_buffer_bytes = sum(b.nbytes for b in self._host_buffers.values())
        self.pinned_bytes = sum(self._host_buffers[i].nbytes for i in self._pinned)
        self.layer_buffer_bytes = self._layout.nbytes
        self._slots = [self._make_slot() for _ in range(min(SLOT_COUNT, len(self.offloaded_layers)))]
        self.slot_bytes = sum(slot.buffer.nbytes for slot in self._slots)
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)

    def _pack_host_layer(self, index: int, pin: bool) -> torch.Tensor:
        """Move layer ``index``'s tensors into one flat host buffer; its modules now hold views of it."""
        layer = self._layers[index]
        _bnb4_device_form(layer, self.device)
        leaves = module_leaves(layer)
        layout = _layout_of(leaves, _module_types(layer))
        self._layout = self._layout or layout  # one for all: _check_streamable compared them
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        if pin:
            buffer = self._pin(buffer, index)
        _bind(leaves, layout, buffer)
        self.host_bytes += layout.payload_bytes
        return buffer

    def _pin(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Page-lock `buffer` in place; if the driver refuses (a memlock limit, a container), take a buffer from
        torch's pinned allocator instead (rounded up to a power of two); if that fails too, stay pageable, and
        copies of this layer are synchronous. Which one happened is in `notes`."""
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

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _make_slot(self) -> "_Slot":
        """A replica of the first offloaded layer on ``device``, its tensors views of one device buffer."""
        module = _clone_layer(self._layers[self.offloaded_layers[0]])
        _move(module, self.device)
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

    def _check_streamable(self) -> None:
        """Offloaded layers must share one structure (the slots are replicas), and say their index."""
        first = self.offloaded_layers[0]
        signature = _layout_of(module_leaves(self._layers[first]), _module_types(self._layers[first])).signature
        for index in self.offloaded_layers[1:]:
            layer = self._layers[index]
            if _layout_of(module_leaves(layer), _module_types(layer)).signature != signature:
                raise VramplanError(
                    f"stream mode needs offloaded layers of one structure; layer {index} differs from layer "
                    f"{first} (modules or tensor shapes): use mode='cpu' or more gpu_layers")
        self._collect_layer_attributes()

    def _collect_layer_attributes(self) -> None:
        """The scalar attributes that differ between offloaded layers (``layer_idx`` at least):
        a slot takes layer i's values before it runs layer i."""
        per_layer = {i: _scalar_attributes(self._originals[i]) for i in self.offloaded_layers}
        first = per_layer[self.offloaded_layers[0]]
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

    def _run(self, index: int, layer: nn.Module, args: tuple, kwargs: dict):
        if self.mode == "stream":
            return self._run_streamed(index, args, kwargs)
        return self._run_on_cpu(index, layer, args, kwargs)

    def _run_streamed(self, index: int, args: tuple, kwargs: dict):
        if index == self.offloaded_layers[0]:
            self.h2d_bytes_last_forward = 0
            if any(d != self.device for d in self.layer_devices):  # the hidden state comes from another GPU
                args, kwargs = self._boundary.move((args, kwargs), self.device)
        slot = self._slot_holding(index) or self._load(index, self._free_slot())
        self._prefetch(self._next_offloaded(index), busy=slot)
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

    def _run_on_cpu(self, index: int, layer: nn.Module, args: tuple, kwargs: dict):
        if index == self.offloaded_layers[0]:
            self._boundary.clear()
        args, kwargs = self._boundary.move((args, kwargs), CPU)
        output = layer(*args, **kwargs)
        if index == self.offloaded_layers[-1]:
            output = _to(output, self.device)
        return output

    def _slot_holding(self, index: int) -> "_Slot | None":
        return next((slot for slot in self._slots if slot.layer == index), None)

    def _free_slot(self, busy: "_Slot | None" = None) -> "_Slot":
        """The slot not in use: not ``busy`` (the one about to run) nor the one that ran last."""
        avoid = busy or self._current_slot
        return next((slot for slot in self._slots if slot is not avoid), self._slots[0])

    def _next_offloaded(self, index: int) -> int:
        """The layer after ``index``; after the last, the first one (the next forward's)."""
        return self._next_layer[index]

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


def _distinct_bytes(leaves: list[Leaf]) -> int:
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
            for name, value in _public_scalars(module).items()}


def _public_scalars(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and name != "training" and isinstance(value, _SCALAR_TYPES)}


# ---------------------------------------------------------------------------------------
# Moving modules and tensors


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


def _resolve_device(device: str | torch.device) -> torch.device:
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


def _move(module: nn.Module, device: torch.device, *, recurse: bool = True) -> None:
    """``module.to(device)``, then every leaf re-pointed at its copy on ``device``: nn.Module.to
    swaps a parameter's ``.data`` but not bnb's side tensors (Int8Params.SCB, its CB alias)."""
    if device.type != "cpu":
        _bnb4_device_form(module, device)
    if recurse:
        module.to(device)  # optimum-quanto tensors re-wrap themselves for the device
    for leaf in module_leaves(module, recurse=recurse):
        leaf.rebind(leaf.tensor.to(device))


def _bnb4_device_form(layer: nn.Module, device: torch.device) -> None:
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


def _modules_outside(root: nn.Module, layers: nn.ModuleList,
                     keep: list[nn.Module]) -> Iterator[tuple[nn.Module, bool]]:
    """The largest submodules of ``root`` that hold no decoder layer and nothing in ``keep``, as
    (module, True); their ancestors as (ancestor, False): only their own tensors move."""
    blocked = {id(layers), *map(id, keep)}
    if id(root) in blocked:
        return
    if not any(id(m) in blocked for m in root.modules()):
        yield root, True
        return
    yield root, False
    for child in root.children():
        yield from _modules_outside(child, layers, keep)


def _embeddings_tied(model: nn.Module) -> bool:
    output = model.get_output_embeddings()
    weight = getattr(output, "weight", None)
    return weight is not None and weight is model.get_input_embeddings().weight


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return type(value)(*(_to(v, device) for v in value)) if hasattr(value, "_fields") \
            else tuple(_to(v, device) for v in value)
    return value


class _Boundary:
    """Moves what an offloaded layer receives across the link once per forward: a source tensor
    (position embeddings, mask, positions) is copied the first time, then the copy is reused."""

    def __init__(self):
        self._copies: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def clear(self) -> None:
        self._copies.clear()

    def move(self, value: Any, device: torch.device) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device == device:
                return value
            key = (id(value), device)
            hit = self._copies.get(key)
            if hit is None or hit[0] is not value:
                hit = self._copies[key] = (value, value.to(device))
            return hit[1]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self.move(v, device) for v in value)
        if isinstance(value, list):
            return [self.move(v, device) for v in value]
        if isinstance(value, dict):
            return {k: self.move(v, device) for k, v in value.items()}
        return value


def _ids_to_weight_device(module: nn.Module, args: tuple):
    if not args:
        return None
    return (args[0].to(module.weight.device), *args[1:])


def _output_to(device: torch.device, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.to(device)


def _args_to(device: torch.device, module: nn.Module, args: tuple):
    return _to(args, device)


def _all_to(device: torch.device, module: nn.Module, args: tuple, kwargs: dict):
    return _to(args, device), {k: _to(v, device) for k, v in kwargs.items()}


def _routed_experts(layer: nn.Module) -> nn.Module | None:
    """The module holding a decoder layer's routed experts (``mlp.experts``, ``block_sparse_moe.experts``, ...), or
    None for a dense layer: the submodule named ``experts`` (not ``shared_experts``), fused or a list, quantized or not."""
    for name, module in layer.named_modules():
        if name.rpartition(".")[2] == "experts":
            return module
    return None


def _kwargs_to(device: torch.device, module: nn.Module, args: tuple, kwargs: dict):
    """Positions, mask and the like go to ``device``; token ids stay for the embedding's hook."""
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) and k != "input_ids" else v for k, v in kwargs.items()}
    return args, moved
