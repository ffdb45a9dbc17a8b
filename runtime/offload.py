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

from functools import partial
from typing import Any, Iterator

import torch
from torch import nn

from vramplan.planner.errors import VramplanError
from vramplan.runtime.modeling import decoder_layers
from vramplan.runtime.devices import CPU, move_module, resolve_device, send_to_device
from vramplan.runtime.stream import LayerStream, distinct_bytes, public_scalars
from vramplan.runtime.tensors import count_tensor_bytes, module_leaves

MODES = ("stream", "cpu")


# ---------------------------------------------------------------------------------------
# Public API


def apply_offload(model: nn.Module, *, gpu_layers: int, mode: str, device: str | torch.device,
                  gpu_layers_per_device: tuple[int, ...] | None = None, devices: list | None = None,
                  expert_layers_on_cpu: int = 0) -> "OffloadEngine":
    """Place ``model`` (a CausalLM entirely on the CPU) with ``gpu_layers`` decoder layers on
    ``device`` and the rest offloaded in ``mode`` ("stream" or "cpu"); see the module docstring.

    Several GPUs: ``devices`` (the first is ``device``) and ``gpu_layers_per_device`` (layer counts in device
    order, summing to ``gpu_layers``) split the resident layers, the first ones on the first device; everything
    outside the decoder layers, and streamed layers, stay on the first. ``expert_layers_on_cpu``: the routed experts of
    the first that many MoE layers stay in RAM and compute on the CPU, the rest of those layers on their GPU."""
    if mode not in (*MODES, "none"):
        raise VramplanError(f"unknown offload mode {mode!r}; one of {', '.join(MODES)}, or none")
    device = resolve_device(device)
    devices = [device] + [resolve_device(d) for d in (devices or [device])[1:]]
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
                           expert_layers_on_cpu=expert_layers_on_cpu)
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
        for name, value in public_scalars(layer).items():
            setattr(self, name, value)
        self.index = index
        self.layer = layer
        self._engine = engine

    def forward(self, *args, **kwargs):
        return self._engine._run(self.index, self.layer, args, kwargs)


class OffloadEngine:
    """What ``apply_offload`` placed where, and ``detach()``; stream mode's buffers and slots are its ``stream``
    (runtime/stream.py's LayerStream), whose byte reports (host_bytes, host_buffer_bytes, pinned_bytes, slot_bytes,
    layer_buffer_bytes, h2d_bytes_last_forward) the engine passes on. In cpu mode host_bytes is the offloaded layers'
    tensor bytes and the stream reports are 0."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, layers_path: str, *, mode: str,
                 gpu_layers: int, device: torch.device, layer_devices: list[torch.device] | None = None,
                 expert_layers_on_cpu: int = 0):
        self.model = model
        self.mode = mode
        self.gpu_layers = gpu_layers
        self.device = device
        self.layer_devices: list[torch.device] = layer_devices or [device] * gpu_layers  # of the resident layers
        experts = [(i, m) for i in range(gpu_layers) if (m := _routed_experts(layers[i])) is not None]
        self._experts_in_ram: dict[int, nn.Module] = dict(experts[:expert_layers_on_cpu])
        self.offloaded_layers: tuple[int, ...] = tuple(range(gpu_layers, len(layers)))
        self.input_embedding_on_host = False
        self.attached = False
        self.notes: list[str] = []  # what the engine had to fall back to
        self._cpu_host_bytes = 0
        self._layers = layers
        self._layers_path = layers_path
        self._originals = {i: layers[i] for i in self.offloaded_layers}
        self._resident: list[tuple[nn.Module, bool]] = []  # (module, with its submodules) moved to device
        self._hooks: list[Any] = []
        self._boundary = _Boundary()
        self.stream: LayerStream | None = (LayerStream(layers, self.offloaded_layers, device, self._note)
                                           if mode == "stream" and self.offloaded_layers else None)

    @property
    def host_bytes(self) -> int:
        return self.stream.host_bytes if self.stream is not None else self._cpu_host_bytes

    host_buffer_bytes = property(lambda self: self._stream_report("host_buffer_bytes"))
    pinned_bytes = property(lambda self: self._stream_report("pinned_bytes"))
    slot_bytes = property(lambda self: self._stream_report("slot_bytes"))
    layer_buffer_bytes = property(lambda self: self._stream_report("layer_buffer_bytes"))
    h2d_bytes_last_forward = property(lambda self: self._stream_report("h2d_bytes_last_forward"))

    def _stream_report(self, name: str) -> int:
        return getattr(self.stream, name) if self.stream is not None else 0

    def _direct_cpu_kernels(self) -> None:
        """Layers the CPU computes call torch's CPU kernels directly (runtime.quantize.direct_kernels: the same
        tensors; quanto's without its dispatch, bf16's one-row products by GEMV), as a model run on the CPU alone
        does: the speed model prices the CPU's layers that way."""
        from vramplan.runtime.quantize import direct_kernels

        swapped = sum(direct_kernels(self._layers[i]) for i in self.offloaded_layers)
        if swapped:
            self._note(f"{swapped} layers computed by the CPU run vramplan's direct CPU kernels (the same weights, "
                       "without quanto's per-call overhead)")

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # --- attach / detach ---------------------------------------------------------------

    def attach(self) -> None:
        """Place the model; if a step fails, whatever was done is undone before the error propagates."""
        if self.stream is not None:
            self.stream.check()  # before anything moves
        try:
            self._place_resident()
            if self.stream is not None:
                self.stream.prepare()
            else:
                self._cpu_host_bytes = sum(distinct_bytes(module_leaves(self._layers[i]))
                                           for i in self.offloaded_layers)
                self._direct_cpu_kernels()
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
                move_module(module, CPU, recurse=recurse)
        if self.stream is not None:
            self.stream.close()
        self._boundary.clear()

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
            "layer_devices": [str(d) for d in self.layer_devices], "expert_layers_in_ram": sorted(self._experts_in_ram),
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
            layer, experts = self._layers[i], self._experts_in_ram.get(i)
            if experts is None:
                moved.append((layer, True, self.layer_devices[i]))
            else:
                moved += [(m, r, self.layer_devices[i]) for m, r in _modules_outside(layer, experts, [])]
        self._resident = [(m, r) for m, r, _ in moved]
        for module, recurse, device in moved:
            move_module(module, device, recurse=recurse)

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
        for i, experts in self._experts_in_ram.items():
            self._hooks.append(experts.register_forward_pre_hook(partial(_all_to, CPU), with_kwargs=True))
            self._hooks.append(experts.register_forward_hook(partial(_output_to, self.layer_devices[i])))

    def _inputs_to(self, device: torch.device, first: bool, module: nn.Module, args: tuple, kwargs: dict):
        if first:
            self._boundary.clear()
        return self._boundary.move((args, kwargs), device)

    # --- running -----------------------------------------------------------------------

    def _run(self, index: int, layer: nn.Module, args: tuple, kwargs: dict):
        if self.stream is None:
            return self._run_on_cpu(index, layer, args, kwargs)
        if index == self.offloaded_layers[0] and any(d != self.device for d in self.layer_devices):
            args, kwargs = self._boundary.move((args, kwargs), self.device)  # the hidden state comes from another GPU
        return self.stream.run(index, args, kwargs)

    def _run_on_cpu(self, index: int, layer: nn.Module, args: tuple, kwargs: dict):
        if index == self.offloaded_layers[0]:
            self._boundary.clear()
        args, kwargs = self._boundary.move((args, kwargs), CPU)
        output = layer(*args, **kwargs)
        if index == self.offloaded_layers[-1]:
            output = send_to_device(output, self.device)
        return output


# ---------------------------------------------------------------------------------------
# Devices and moving tensors


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
    return send_to_device(args, device)


def _all_to(device: torch.device, module: nn.Module, args: tuple, kwargs: dict):
    return send_to_device(args, device), send_to_device(kwargs, device)


def _routed_experts(layer: nn.Module) -> nn.Module | None:
    """The module holding a decoder layer's routed experts (``mlp.experts``, ``block_sparse_moe.experts``, ...), or
    None for a dense layer: the submodule named ``experts`` (not ``shared_experts``), fused or a list, quantized or
    not."""
    for name, module in layer.named_modules():
        if name.rpartition(".")[2] == "experts":
            return module
    return None


def _kwargs_to(device: torch.device, module: nn.Module, args: tuple, kwargs: dict):
    """Positions, mask and the like go to ``device``; token ids stay for the embedding's hook."""
    return args, send_to_device(kwargs, device, skip_keys=("input_ids",))
