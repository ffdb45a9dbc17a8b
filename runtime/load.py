"""Load a causal LM for a run: from a local safetensors checkpoint or, with dummy weights
(runtime/dummy.py), from a config alone; quantized as its scheme says (runtime/quantize.py);
placed on one device or split between cuda:0 and the CPU; its resident bytes counted
(runtime/tensors.py). Also: the checkpoint checks before loading, the configs, the tokenizer.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from vramplan.planner.errors import (
    CheckpointError,
    ConfigError,
    ModelNotFoundError,
    VramplanError,
)
from vramplan.planner.quant import CPU_KERNEL_BACKEND, TORCH_WO_BACKEND, WeightScheme
from vramplan.planner.sources import read_safetensors_header, weight_files
from vramplan.runtime.cpu_paths import describe as describe_paths
from vramplan.runtime.cpu_paths import resolve as resolve_paths
from vramplan.runtime.devices import resolve_device
from vramplan.runtime.dummy import build_dummy
from vramplan.runtime.experts import quantize_experts
from vramplan.runtime.layerwise import load_layerwise
from vramplan.runtime.measure import is_oom
from vramplan.runtime.modeling import attention_kwargs, config_from_dict, config_from_dir, decoder_layers
from vramplan.runtime.attention import pack_single_queries
from vramplan.runtime.quantize import backend, direct_kernels, quantize_cpu_head, unsupported
from vramplan.runtime.tensors import count_tensor_bytes, release_freed_heap

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,  # a reference mode for tests: everything unquantized held in fp32
}
UNQUANTIZED_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}  # an unquantized scheme's dtype -> compute dtype
# the backends whose checkpoints on one device load a layer at a time (runtime/layerwise.py); transformers' own
# loaders for the rest (bitsandbytes quantizes as it loads; an unquantized model maps the file)
LAYERWISE_BACKENDS = ("quanto", TORCH_WO_BACKEND, CPU_KERNEL_BACKEND)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready to run, with what was asked of the loader and what it measured."""

    model: nn.Module
    tokenizer: Any | None
    config: Any
    scheme: WeightScheme
    compute_dtype: str  # the effective one (for bf16/fp16 weights: the weights' dtype)
    device: str
    load_time_s: float
    num_layers: int
    weights_bytes_by_device: dict[str, int]
    device_map: dict[str, str] | None = None  # set only when the model is split across devices
    notes: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------------------------------
# Loading


def load_model(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    scheme: WeightScheme,
    compute_dtype: str = "bf16",
    dummy_weights: bool = False,
    device: str = "cpu",
    gpu_layers: int | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    seed: int = 0,
    tokenizer: Any | None = None,
    on_layer: Callable[[int], None] | None = None,
    random_device: str | None = None,
    cpu_alone: bool | None = None,
    cpu_paths: Mapping[str, str] | None = None,
) -> LoadedModel:
    """Load ``source`` (a local model directory, or a config dict with ``dummy_weights``) quantized by ``scheme``.

    dtypes: for unquantized schemes the model is held and computed in the scheme's dtype
    (``compute_dtype="fp32"`` upcasts everything, a reference mode for tests). For the
    quantized schemes, everything left unquantized is held in ``compute_dtype`` and bnb
    4-bit dequantizes to it; bnb int8 casts activations to fp16 inside its matmul
    whatever the compute dtype.

    Placement: ``device="cpu"``, or ``"cuda[:0]"`` with ``gpu_layers`` decoder layers on
    the GPU (None: all). See :func:`offload_device_map` for the split.

    ``cpu_alone``: the model runs on the CPU as loaded, so it gets vramplan's CPU path (lm_head as
    planner.quant.cpu_head_scheme says, runtime.quantize.direct_kernels). Default: ``device == "cpu"``; pass False
    for a model loaded on the CPU that an offload engine then places on GPUs (it gives the layers it leaves to the
    CPU their kernels itself).

    ``cpu_paths``: the CPU kernel paths of a model run on the CPU alone (runtime.cpu_paths.recorded_paths: the hardware
    profile's record; None: the CPU's defaults).

    ``on_layer(1)`` follows the build decoder layer by decoder layer (a checkpoint that transformers' loader takes shows
    its own "Loading weights" bar).
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute_dtype {compute_dtype!r}; one of {', '.join(COMPUTE_DTYPES)}")
    device = _normalize_device(device)
    if cpu_alone is None:
        cpu_alone = device == "cpu"
    if scheme.activation_bits < 16 and not (cpu_alone and device == "cpu"):  # before anything is built
        raise VramplanError(f"{scheme.name} runs on the CPU alone (it quantizes activations in a CPU kernel): load "
                            "it with device='cpu' and cpu_alone left on; no offload engine or GPU runs it")
    if device == "cpu" and gpu_layers not in (None, 0):
        raise ValueError(f"gpu_layers={gpu_layers} needs a CUDA device, got device='cpu'")
    if not scheme.quantized and compute_dtype != "fp32":
        compute_dtype = UNQUANTIZED_DTYPES[scheme.compute_dtype]
    dtype = COMPUTE_DTYPES[compute_dtype]

    start = time.perf_counter()
    model_dir: Path | None = None
    if isinstance(source, Mapping):
        if not dummy_weights:
            raise CheckpointError("a config without a checkpoint has no weights: pass dummy_weights to run it with "
                                  "random ones")
        config = config_from_dict(source, trust_remote_code)
    else:
        model_dir = Path(source)
        if not model_dir.is_dir():
            raise ModelNotFoundError(f"{model_dir} is not a directory")
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} has no config.json")
        if not dummy_weights:
            check_checkpoint(model_dir, allow_pickle)
        config = config_from_dir(model_dir, trust_remote_code)

    num_layers = int(config.num_hidden_layers)
    if gpu_layers is not None and not 0 <= gpu_layers <= num_layers:
        raise ValueError(f"gpu_layers={gpu_layers} is outside 0..{num_layers}")
    device_map = _device_map_for(config, device, gpu_layers, num_layers, scheme, trust_remote_code)
    notes = backend(scheme).notes(scheme, offloaded=device_map is not None)
    if dummy_weights:
        model = build_dummy(config, dtype, scheme, device, device_map, seed, trust_remote_code, on_layer,
                            random_device=random_device)
    else:
        model = None
        if device_map is None and scheme.backend in LAYERWISE_BACKENDS:  # read and quantized a layer at a time
            model = load_layerwise(model_dir, config, dtype, scheme, device, trust_remote_code, on_layer)
            if model is not None:
                notes.append("the checkpoint was read and quantized one decoder layer at a time (no layer held "
                             "unquantized but the one being read)")
        if model is None and scheme.backend in (TORCH_WO_BACKEND, CPU_KERNEL_BACKEND):  # the compute dtype, then
            # each layer quantized on its device
            model = _load_checkpoint(model_dir, config, dtype, scheme, "cpu", None, allow_pickle, trust_remote_code)
            for layer in decoder_layers(model, num_layers)[1]:
                backend(scheme).quantize(layer, scheme, dtype, device)
                release_freed_heap()
            model.to(device)
        elif model is None:
            model = _load_checkpoint(model_dir, config, dtype, scheme, device, device_map, allow_pickle,
                                     trust_remote_code)
            _quantize_loaded_experts(model, num_layers, scheme, device, device_map)
    model.eval()
    model.requires_grad_(False)
    # the fp32 reference mode keeps the model as loaded (quanto's own layers, lm_head as it is), except a scheme whose
    # numerics are its own kernel's: quanto-w8a8 gets its kernels and its int8 head in fp32 too
    if cpu_alone and device == "cpu" and (compute_dtype == "bf16" or scheme.activation_bits < 16):
        paths = resolve_paths(cpu_paths)
        head_note = quantize_cpu_head(model, scheme, paths)
        notes += [head_note] if head_note else []
        if direct := direct_kernels(model, scheme.activation_bits, paths):
            kernels = ("bf16",) if scheme.activation_bits == 16 else tuple(paths)
            notes.append(f"{direct} layers run vramplan's direct CPU kernels: the same weights, without quanto's "
                         f"per-call overhead; paths: {describe_paths(cpu_paths, kernels)}")
        if pack_single_queries(model):
            notes.append("decode attention groups the query heads that share a KV head: the same result, without "
                         "torch's slow grouped-query path on the CPU")
    release_freed_heap()
    if tokenizer is None and model_dir is not None:
        tokenizer = load_tokenizer(model_dir, trust_remote_code)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, scheme=scheme, compute_dtype=compute_dtype,
                       device=device, load_time_s=time.perf_counter() - start, num_layers=num_layers,
                       weights_bytes_by_device=count_tensor_bytes(model), device_map=device_map, notes=tuple(notes))


def _normalize_device(device: str) -> str:
    """The device a load places on, as runtime.devices.resolve_device parses it: "cpu" or the first GPU, "cuda:0" (a
    split over several GPUs is the offload engine's, which takes the model from the CPU)."""
    d = resolve_device(device)
    if d.type == "cpu" and not d.index:
        return "cpu"
    if d.type == "cuda" and d.index == 0:
        return "cuda:0"
    raise ValueError(f"unsupported device {device!r}: 'cpu' or 'cuda:0' (one GPU)")


# --- checkpoint checks ----------------------------------------------------------------


def check_checkpoint(model_dir: Path, allow_pickle: bool) -> None:
    """Refuse missing, pickle-only (unless allowed) or truncated/corrupt checkpoints, in one line, reading only
    headers: the index and the shards it names (planner.sources.weight_files), every safetensors header and its
    data offsets against the file's length (planner.sources.read_safetensors_header)."""
    shards = weight_files(model_dir)
    for shard in shards:
        read_safetensors_header(shard)
    if shards:
        return
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles and not allow_pickle:
        raise CheckpointError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); loading them can run "
            "arbitrary code: convert them to safetensors, or pass --allow-pickle if you trust the source"
        )
    if not pickles:
        raise CheckpointError(
            f"{model_dir} has no weights (no *.safetensors): add them, or pass --dummy-weights to run "
            "the architecture with random weights"
        )


# --- placement ------------------------------------------------------------------------


def offload_device_map(layers_path: str, non_layer_modules: list[str], num_layers: int,
                       gpu_layers: int) -> dict[str, str]:
    """Decoder layers 0..gpu_layers-1 on cuda:0, the rest on "cpu" (accelerate streams them in).

    Every module outside the decoder layers (embeddings, rotary embedding, final norm,
    lm_head) goes on cuda:0: they run for every token, accelerate's hooks would copy
    an offloaded one whole on every forward, and tied embeddings/lm_head must share a
    device. The planner must count them as GPU-resident.
    """
    device_map = {name: "cuda:0" for name in non_layer_modules}
    for i in range(num_layers):
        device_map[f"{layers_path}.{i}"] = "cuda:0" if i < gpu_layers else "cpu"
    return device_map


def _device_map_for(config, device, gpu_layers, num_layers, scheme: WeightScheme, trust_remote_code):
    if device == "cpu" or gpu_layers is None or gpu_layers >= num_layers:
        return None
    if scheme.backend == "quanto":
        raise VramplanError(
            f"{scheme.name} with {gpu_layers}/{num_layers} layers on the GPU: transformers' quanto "
            "loader refuses a device_map with CPU entries; put all layers on one device"
        )
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers_path, _ = decoder_layers(skeleton, num_layers)
    parent_path = layers_path.rpartition(".")[0]
    non_layer = [name for name, _ in skeleton.named_children() if name != layers_path.split(".")[0]]
    if parent_path:
        parent = skeleton.get_submodule(parent_path)
        non_layer += [f"{parent_path}.{name}" for name, _ in parent.named_children()
                      if f"{parent_path}.{name}" != layers_path]
    return offload_device_map(layers_path, non_layer, num_layers, gpu_layers)


# --- real checkpoints -----------------------------------------------------------------


def _load_checkpoint(model_dir, config, dtype, scheme: WeightScheme, device, device_map,
                     allow_pickle, trust_remote_code) -> nn.Module:
    from safetensors import SafetensorError

    quantization_config = backend(scheme).transformers_config(scheme, dtype, offload=device_map is not None)
    kwargs: dict[str, Any] = dict(
        **attention_kwargs(config),
        dtype=dtype,
        device_map=device_map if device_map is not None else device,
        trust_remote_code=trust_remote_code,
        use_safetensors=not allow_pickle or any(model_dir.glob("*.safetensors")),
        output_loading_info=True,
    )
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    try:
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except (SafetensorError, OSError, EOFError) as exc:
        raise CheckpointError(f"{model_dir}: cannot read weights ({str(exc).splitlines()[0]})") from None
    except (RuntimeError, NotImplementedError, ImportError) as exc:
        if scheme.backend == "bnb" and not is_oom(exc):  # an OOM is the caller's to re-plan, not "unsupported"
            raise unsupported(scheme, device, exc) from exc
        raise
    missing = sorted(info.get("missing_keys", ()))
    mismatched = info.get("mismatched_keys", ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {shown}")
    if mismatched:
        raise CheckpointError(f"{model_dir}: weights whose shape does not match config.json: {mismatched[0]}")
    return model


def _quantize_loaded_experts(model: nn.Module, num_layers: int, scheme: WeightScheme, device: str,
                             device_map: dict | None) -> None:
    """transformers leaves fused MoE experts unquantized: quantize them per expert (runtime/experts.py), layer by
    layer where each layer's weights are, handing each layer's unquantized experts back before the next. Layers
    a split puts on the CPU stay unquantized, like the rest of those layers under transformers' bnb offload."""
    if not scheme.quantized:
        return
    layers_path, layers = decoder_layers(model, num_layers)
    for index, layer in enumerate(layers):
        if device_map is not None and device_map[f"{layers_path}.{index}"] == "cpu":
            continue
        try:
            if quantize_experts(layer, scheme):
                release_freed_heap()
        except (RuntimeError, NotImplementedError, ImportError) as exc:
            if scheme.backend == "bnb" and not is_oom(exc):
                raise unsupported(scheme, device, exc) from exc
            raise


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    """The directory's tokenizer, or None when it has none (a model runs on token ids without one)."""
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a model runs on token ids without a tokenizer
        logging.getLogger(__name__).warning("tokenizer in %s not loaded: %s", model_dir, exc)
        return None
