"""Dummy weights: a real architecture built from its config alone, with seeded random weights; and the layer by layer
build they share with a checkpoint's own loader (runtime/layerwise.py).

Speed and memory do not depend on weight values, so benchmarks and `vramplan run --dummy-weights`
measure a model nobody downloaded. The model is built decoder layer by decoder layer and each layer
is quantized (on its target device) right after its values are drawn, its fused MoE experts too
(per expert, runtime/experts.py), so at most one layer is ever held unquantized: Qwen3-30B-A3B
(56.9 GiB in bf16) builds in quanto-int4 at a peak RSS of 16.4 GiB, its 16.0 GiB of quantized
weights + 0.2 GiB (measured on a 2-core, 24 GiB machine: 374 s).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from vramplan.planner.quant import WeightScheme
from vramplan.runtime.modeling import attention_kwargs, decoder_layers, strict_fp32_pattern
from vramplan.runtime.quantize import backend
from vramplan.runtime.tensors import release_freed_heap

DEFAULT_INIT_STD = 0.02  # when a config has no initializer_range


def build_dummy(config, dtype: torch.dtype, scheme: WeightScheme, device: str, device_map: dict | None, seed: int,
                trust_remote_code: bool, on_layer: Callable[[int], None] | None = None,
                random_device: str | None = None) -> nn.Module:
    """The architecture with seeded random weights, quantized like a loaded checkpoint (build_layerwise).

    Each tensor gets ``uniform_`` of the config's init std (faster than ``normal_``); norm weights get the model's own
    ``_init_weights`` (ones, or zeros for Gemma's 1 + w norms), biases zeros.

    ``random_device`` (a CUDA device) draws the values there, a chunk of at most ``RANDOM_CHUNK`` elements at a time,
    and copies them in: the CPU's generator is serial (about 200 M values/s, 40 s for an 8B model), a GPU's draws
    them in milliseconds. Same seed, same device kind: same weights; the CPU and a GPU draw different ones.
    """
    std = float(getattr(config, "initializer_range", None) or DEFAULT_INIT_STD)
    draw = _Draw(random_device, seed)
    done: set[int] = set()
    model = build_layerwise(config, dtype, scheme, device, device_map, trust_remote_code,
                            lambda model, modules: _random_init(model, (m for _, m in modules), std, draw, done),
                            on_layer)
    draw.close()
    assert model is not None  # no check: always built
    return model


# fill(model, modules): writes the values of the parameters (and buffers) of `modules`, (qualified name, module) pairs
Fill = Callable[[nn.Module, Iterable[tuple[str, nn.Module]]], None]


def build_layerwise(config, dtype: torch.dtype, scheme: WeightScheme, device: str, device_map: dict | None,
                    trust_remote_code: bool, fill: Fill, on_layer: Callable[[int], None] | None = None,
                    check: Callable[[nn.Module], bool] | None = None) -> nn.Module | None:
    """The architecture built from its config with its values written by ``fill``, quantized like a loaded
    checkpoint, decoder layer by decoder layer: at most one layer is ever held unquantized.

    Built on the CPU with transformers' ``no_init_weights`` (parameters are allocated but not written, so their pages
    are never touched and no slow default init runs; buffers such as RoPE frequencies are real), then filled decoder
    layer by decoder layer and each layer quantized right away (on its target device), its fused MoE experts too (per
    expert, runtime/experts.py), then the modules outside the layers. An unquantized layer bound for a GPU moves there
    before it is filled. ``check(model)`` on the unfilled skeleton may refuse it (None is returned, nothing written).
    ``on_layer(1)`` follows it decoder layer by decoder layer.
    """
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 **attention_kwargs(config))
    model.tie_weights()  # no_init_weights skips it along with init_weights
    keep_in_fp32(model, dtype)
    if check is not None and not check(model):
        return None
    num_layers = int(config.num_hidden_layers)
    layers_path, layers = decoder_layers(model, num_layers)

    for index, layer in enumerate(layers):
        target = device if device_map is None else device_map[f"{layers_path}.{index}"]
        if not scheme.quantized and target != "cpu":
            # an unquantized GPU layer goes there before its values are written: the model never sits whole in host
            # RAM (measured on an H200: Llama-3.1-8B bf16 peaked at 15.9 GiB of RSS when moved at the end)
            layer.to(target)
        fill(model, layer.named_modules(prefix=f"{layers_path}.{index}"))
        quantize_here = scheme.quantized and not (device_map is not None and target == "cpu")
        if quantize_here:
            backend(scheme).quantize(layer, scheme, dtype, target)
        if quantize_here or target != "cpu":
            release_freed_heap()  # the layer's host copy, before the next layer is touched
        if on_layer is not None:
            on_layer(1)
    in_layers = {id(m) for layer in layers for m in layer.modules()}  # after the swaps
    fill(model, ((name, m) for name, m in model.named_modules() if id(m) not in in_layers))

    if device_map is not None:
        from accelerate import dispatch_model

        return dispatch_model(model, device_map=device_map, main_device="cuda:0")
    return model.to(device) if device != "cpu" else model


def keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """What `from_pretrained` does to a bf16/fp16 load: the tensors the class lists in `_keep_in_fp32_modules_strict`
    held in fp32 (from_config builds them in the load dtype before transformers 5.24; planner/architectures/fp32.py)."""
    pattern = strict_fp32_pattern(model)
    if pattern is None or dtype not in (torch.bfloat16, torch.float16):
        return
    for module_name, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for leaf, t in store.items():
                if t is not None and t.dtype != torch.float32 and pattern.search(f"{module_name}.{leaf}"):
                    if isinstance(t, nn.Parameter):
                        t.data = t.data.float()
                    else:
                        store[leaf] = t.float()


RANDOM_CHUNK = 1 << 24  # elements drawn on a GPU at a time: 32 MiB in bf16, held only while a tensor is filled


class _Draw:
    """Seeded uniform values for the build's tensors, drawn on the CPU or on ``device`` (CUDA) and copied to where a
    tensor lives when that is elsewhere."""

    def __init__(self, device: str | None, seed: int):
        self.device = torch.device(device) if device is not None and str(device).startswith("cuda") else None
        self.generator = torch.Generator(device=self.device or "cpu").manual_seed(seed)

    def uniform_(self, t: torch.Tensor, bound: float) -> None:
        where = self.generator.device
        if t.device.type == where.type and (where.type == "cpu" or t.device.index == where.index):
            t.uniform_(-bound, bound, generator=self.generator)
        elif not t.is_contiguous():  # never in a from_config build; drawn whole where the generator is
            t.copy_(torch.empty(t.shape, dtype=t.dtype, device=where).uniform_(-bound, bound,
                                                                               generator=self.generator))
        else:  # drawn where the generator is, copied to where the tensor lives
            self.fill_in_chunks(t, bound, where)

    def fill_in_chunks(self, t: torch.Tensor, bound: float, device: torch.device) -> None:
        """``t`` (contiguous) filled ``RANDOM_CHUNK`` elements at a time, each drawn on ``device`` and copied in."""
        flat = t.view(-1)
        for start in range(0, flat.numel(), RANDOM_CHUNK):
            n = min(RANDOM_CHUNK, flat.numel() - start)
            flat[start:start + n].copy_(torch.empty(n, dtype=t.dtype, device=device).uniform_(
                -bound, bound, generator=self.generator))

    def close(self) -> None:
        """Hands the chunks' GPU memory back, so that the run's peak VRAM is the model's own."""
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def _random_init(model, modules, std: float, draw: _Draw, done: set[int]) -> None:
    bound = std * 3**0.5  # uniform(-b, b) has standard deviation b / sqrt(3)
    with torch.no_grad():
        for module in modules:
            params = [p for p in module._parameters.values() if p is not None and id(p) not in done]
            if not params:
                continue
            if all(p.ndim <= 1 for p in module.parameters(recurse=False)):
                model._init_weights(module)  # norms: ones, or zeros for (1 + w) norms
            else:
                for p in params:
                    if p.ndim >= 2:
                        draw.uniform_(p.data, bound)
                    else:
                        p.zero_()  # biases
            done.update(id(p) for p in params)
