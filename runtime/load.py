"""Load a causal LM for a run: from a local safetensors checkpoint or, with dummy
weights, from a config alone; quantized by the libraries made for it
(bitsandbytes through transformers' BitsAndBytesConfig, optimum-quanto); placed on
one device or split between cuda:0 and the CPU; and its resident bytes counted
exactly, tensor by tensor.

What is quantized is what transformers 5.23 quantizes: every ``nn.Linear`` except
``lm_head``. Embeddings, norms, ``lm_head`` and fused MoE expert tensors (Mixtral,
Qwen3-MoE keep their experts as 3-D ``nn.Parameter``s, not ``nn.Linear``) stay in the
compute dtype. The dummy-weights path quantizes the same modules, so a dummy model has
the same layout as a real checkpoint loaded with the same scheme.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import struct
import time
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from planner.errors import (
    CheckpointError,
    ConfigError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    VramplanError,
)

WEIGHT_QUANTS = (
    "bf16", "fp16",
    "bnb-int8", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "bnb-fp4-dq",
    "quanto-int8", "quanto-int4",
)
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,  # a reference mode for tests: everything unquantized held in fp32
}
BNB_4BIT_BLOCKSIZE = 64          # bitsandbytes' default, the one transformers uses
BNB_INT8_OUTLIER_THRESHOLD = 6.0  # transformers' default llm_int8_threshold
DEFAULT_INIT_STD = 0.02           # when a config has no initializer_range

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready to run, with what was asked of the loader and what it measured."""

    model: nn.Module
    tokenizer: Any | None
    config: Any
    weight_quant: str
    compute_dtype: str  # the effective one (for bf16/fp16 weights: the weights' dtype)
    device: str
    load_time_s: float
    num_layers: int
    weights_bytes_by_device: dict[str, int]
    device_map: dict[str, str] | None = None  # set only when the model is split across devices
    notes: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------------------------------
# Counting resident bytes


def count_tensor_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by every parameter and buffer of ``model``, per device ("cpu", "cuda:0").

    Quantized parameters are opened up: bitsandbytes ``Params4bit`` counts its packed data
    plus every tensor of its ``quant_state`` (absmax, code, offset, and the nested state of
    double quantization); ``Int8Params`` counts its int8 data plus ``SCB``; optimum-quanto
    tensors (``WeightQBytesTensor``, ``WeightQBitsTensor``, packed and TinyGemm variants)
    are walked through ``__tensor_flatten__`` down to plain tensors (data, scale, shift).
    Each storage is counted once (tied embeddings, ``CB`` aliasing the int8 data), at its
    full size. ``model.get_memory_footprint()`` misses or misstates all of this.
    """
    by_device: dict[str, int] = defaultdict(int)
    seen: set[tuple[str, int]] = set()
    for module in model.modules():
        tensors = [t for t in chain(module._parameters.values(), module._buffers.values()) if t is not None]
        leaves = chain(chain.from_iterable(_leaf_tensors(t) for t in tensors), _module_side_tensors(module))
        for leaf in leaves:
            device = str(leaf.device)
            if leaf.device.type == "meta":
                by_device[device] += leaf.numel() * leaf.element_size()
                continue
            storage = leaf.untyped_storage()
            key = (device, storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            by_device[device] += storage.nbytes()
    return dict(by_device)


def _leaf_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold the memory of ``tensor`` (duck-typed: no bnb import)."""
    quant_state = getattr(tensor, "quant_state", None)
    if quant_state is not None:  # bitsandbytes Params4bit
        yield tensor.data
        yield from _quant_state_tensors(quant_state)
        return
    scb = getattr(tensor, "SCB", None)
    if scb is not None:  # bitsandbytes Int8Params (CB aliases the data)
        yield tensor.data
        yield scb
        return
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _leaf_tensors(getattr(tensor, name))
        return
    yield tensor.data if isinstance(tensor, nn.Parameter) else tensor


def _module_side_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Tensors a bnb layer keeps outside its parameters: after its first forward,
    ``Linear8bitLt`` moves ``SCB`` (and ``CB``, the int8 data) from the weight to ``module.state``."""
    for name in ("state", "quant_state"):
        holder = module.__dict__.get(name)
        if holder is not None and not isinstance(holder, torch.Tensor) and hasattr(holder, "__dict__"):
            yield from _quant_state_tensors(holder)


def _quant_state_tensors(quant_state: Any) -> Iterator[torch.Tensor]:
    for value in vars(quant_state).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif value is not None and hasattr(value, "absmax") and hasattr(value, "code"):
            yield from _quant_state_tensors(value)  # state2 of double quantization


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


# ---------------------------------------------------------------------------------------
# Loading


def load_model(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    weight_quant: str,
    compute_dtype: str = "bf16",
    dummy_weights: bool = False,
    device: str = "cpu",
    gpu_layers: int | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    seed: int = 0,
    tokenizer: Any | None = None,
) -> LoadedModel:
    """Load ``source`` (a local model directory, or a config dict with ``dummy_weights``).

    dtypes: for ``bf16``/``fp16`` weights the model is held and computed in that dtype
    (``compute_dtype="fp32"`` upcasts everything, a reference mode for tests). For the
    quantized schemes, everything left unquantized is held in ``compute_dtype`` and bnb
    4-bit dequantizes to it; bnb int8 casts activations to fp16 inside its matmul
    whatever the compute dtype.

    Placement: ``device="cpu"``, or ``"cuda[:0]"`` with ``gpu_layers`` decoder layers on
    the GPU (None: all). See :func:`offload_device_map` for the split.
    """
    if weight_quant not in WEIGHT_QUANTS:
        raise ValueError(f"unknown weight_quant {weight_quant!r}; one of {', '.join(WEIGHT_QUANTS)}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute_dtype {compute_dtype!r}; one of {', '.join(COMPUTE_DTYPES)}")
    device = _normalize_device(device)
    if device == "cpu" and gpu_layers not in (None, 0):
        raise ValueError(f"gpu_layers={gpu_layers} needs a CUDA device, got device='cpu'")

    if weight_quant in ("bf16", "fp16") and compute_dtype != "fp32":
        compute_dtype = weight_quant
    dtype = COMPUTE_DTYPES[compute_dtype]

    start = time.perf_counter()
    model_dir: Path | None = None
    if isinstance(source, Mapping):
        if not dummy_weights:
            raise CheckpointError("a config without a checkpoint has no weights: pass dummy_weights to run it with random ones")
        config = _config_from_dict(source, trust_remote_code)
    else:
        model_dir = Path(source)
        if not model_dir.is_dir():
            raise ModelNotFoundError(f"{model_dir} is not a directory")
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} has no config.json")
        if not dummy_weights:
            _check_checkpoint(model_dir, allow_pickle)
        config = _config_from_dir(model_dir, trust_remote_code)

    num_layers = int(config.num_hidden_layers)
    if gpu_layers is not None and not 0 <= gpu_layers <= num_layers:
        raise ValueError(f"gpu_layers={gpu_layers} is outside 0..{num_layers}")
    device_map = _device_map_for(config, device, gpu_layers, num_layers, weight_quant, trust_remote_code)
    notes: list[str] = []
    if weight_quant == "bnb-int8":
        _quiet_bnb_int8_cast_warning()
        notes.append("bnb-int8 casts activations to fp16 inside its matmul")
    if device_map is not None and weight_quant.startswith("bnb-"):
        notes.append("offloaded layers stay unquantized in the compute dtype (transformers' bnb cpu offload)")

    if dummy_weights:
        model = _build_dummy(config, dtype, weight_quant, device, device_map, seed, trust_remote_code)
    else:
        model = _load_checkpoint(model_dir, config, dtype, weight_quant, device, device_map,
                                 allow_pickle, trust_remote_code)
    model.eval()
    model.requires_grad_(False)
    release_freed_heap()
    if tokenizer is None and model_dir is not None:
        tokenizer = load_tokenizer(model_dir, trust_remote_code)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        weight_quant=weight_quant,
        compute_dtype=compute_dtype,
        device=device,
        load_time_s=time.perf_counter() - start,
        num_layers=num_layers,
        weights_bytes_by_device=count_tensor_bytes(model),
        device_map=device_map,
        notes=tuple(notes),
    )


def _normalize_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    if device in ("cuda", "cuda:0"):
        if not torch.cuda.is_available():
            raise VramplanError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA GPU")
        return "cuda:0"
    raise ValueError(f"unsupported device {device!r}: 'cpu' or 'cuda:0' (one GPU)")


# --- configs --------------------------------------------------------------------------


def _config_from_dict(raw: Mapping[str, Any], trust_remote_code: bool):
    values = {k: v for k, v in raw.items() if k not in ("quantization_config", "_name_or_path")}
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError("config has no model_type")
    if not trust_remote_code:
        values.pop("auto_map", None)
    try:
        config = AutoConfig.for_model(model_type, **values)
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"transformers cannot build model_type {model_type!r}: {exc}") from None
    return _text_config(config)


def _config_from_dir(model_dir: Path, trust_remote_code: bool):
    try:
        json.loads((model_dir / "config.json").read_text())
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{model_dir / 'config.json'} is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"{model_dir}: {exc}".splitlines()[0]) from None
    return _text_config(config)


def _text_config(config):
    """The decoder's config: gemma3 and other multimodal configs nest it as text_config."""
    return config.get_text_config(decoder=True)


# --- checkpoint checks ----------------------------------------------------------------


def _check_checkpoint(model_dir: Path, allow_pickle: bool) -> None:
    """Refuse missing, pickle-only (unless allowed) or truncated/corrupt checkpoints, in one line."""
    shards = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is corrupt: {exc}") from None
        missing = sorted(n for n in names if not (model_dir / n).is_file())
        if missing:
            raise CheckpointError(f"{model_dir}: shards listed in the index are missing: {', '.join(missing)}")
    if shards:
        for shard in shards:
            _check_safetensors_file(shard)
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


def _check_safetensors_file(path: Path) -> None:
    """Check the header and that the file is as long as the header says, without reading the data."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            raw_len = handle.read(8)
            if len(raw_len) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", raw_len)
            if 8 + header_len > size:
                raise ValueError(f"header of {header_len} bytes runs past the end of the file")
            header = json.loads(handle.read(header_len))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors file ({exc})") from None
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, header needs {expected})")


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


def _device_map_for(config, device, gpu_layers, num_layers, weight_quant, trust_remote_code):
    if device == "cpu" or gpu_layers is None or gpu_layers >= num_layers:
        return None
    if weight_quant.startswith("quanto-"):
        raise VramplanError(
            f"{weight_quant} with {gpu_layers}/{num_layers} layers on the GPU: transformers' quanto "
            "loader refuses a device_map with CPU entries; put all layers on one device"
        )
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers_path, _ = _decoder_layers(skeleton, num_layers)
    parent_path = layers_path.rpartition(".")[0]
    non_layer = [name for name, _ in skeleton.named_children() if name != layers_path.split(".")[0]]
    if parent_path:
        parent = skeleton.get_submodule(parent_path)
        non_layer += [f"{parent_path}.{name}" for name, _ in parent.named_children()
                      if f"{parent_path}.{name}" != layers_path]
    return offload_device_map(layers_path, non_layer, num_layers, gpu_layers)


def _decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder layers (``model.layers`` for most architectures)."""
    candidates = [(name, mod) for name, mod in model.named_modules()
                  if isinstance(mod, nn.ModuleList) and len(mod) == num_layers]
    if not candidates:
        raise UnsupportedArchitectureError(f"{type(model).__name__}: no list of {num_layers} decoder layers found")
    candidates.sort(key=lambda item: (not item[0].endswith("layers"), item[0].count(".")))
    return candidates[0]


# --- quantization configs -------------------------------------------------------------


def _bnb_4bit_kind(weight_quant: str) -> tuple[str, bool]:
    """("nf4"|"fp4", double_quant) for a bnb 4-bit scheme name."""
    _, quant_type, *rest = weight_quant.split("-")
    return quant_type, rest == ["dq"]


def _quantization_config(weight_quant: str, dtype: torch.dtype, offload: bool):
    from transformers import BitsAndBytesConfig, QuantoConfig

    if weight_quant == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=BNB_INT8_OUTLIER_THRESHOLD,
                                  llm_int8_enable_fp32_cpu_offload=offload)
    if weight_quant.startswith("bnb-"):
        quant_type, double_quant = _bnb_4bit_kind(weight_quant)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                  bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=dtype,
                                  llm_int8_enable_fp32_cpu_offload=offload)
    if weight_quant.startswith("quanto-"):
        return QuantoConfig(weights=weight_quant.removeprefix("quanto-"))
    return None


def _bnb_unsupported(weight_quant: str, device: str, exc: BaseException) -> VramplanError:
    try:
        import bitsandbytes
        version = bitsandbytes.__version__
    except Exception:  # noqa: BLE001 - the reason is what we report
        version = "(not importable)"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return VramplanError(f"{weight_quant} is not supported on {device} with bitsandbytes {version}: {reason}")


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _quiet_bnb_int8_cast_warning() -> None:
    """bnb logs "inputs will be cast ... to float16" on every int8 matmul; it is expected (and noted)."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("MatMul8bitLt: inputs will be cast"))


# --- real checkpoints -----------------------------------------------------------------


def _load_checkpoint(model_dir, config, dtype, weight_quant, device, device_map,
                     allow_pickle, trust_remote_code) -> nn.Module:
    from safetensors import SafetensorError

    quantization_config = _quantization_config(weight_quant, dtype, offload=device_map is not None)
    kwargs: dict[str, Any] = dict(
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
        if weight_quant.startswith("bnb-") and not isinstance(exc, torch.OutOfMemoryError):
            raise _bnb_unsupported(weight_quant, device, exc) from exc
        raise
    missing = sorted(info.get("missing_keys", ()))
    mismatched = info.get("mismatched_keys", ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {shown}")
    if mismatched:
        raise CheckpointError(f"{model_dir}: weights whose shape does not match config.json: {mismatched[0]}")
    return model


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


# --- dummy weights --------------------------------------------------------------------


def _build_dummy(config, dtype, weight_quant, device, device_map, seed, trust_remote_code) -> nn.Module:
    """The architecture with seeded random weights, quantized like a loaded checkpoint.

    Built on the CPU with transformers' ``no_init_weights`` (parameters are allocated but
    not written, so no slow default init; buffers such as RoPE frequencies are real),
    then filled decoder layer by decoder layer with ``uniform_`` of the config's init std
    (faster than ``normal_``) and quantized right away, so that at most one layer is held
    unquantized at a time. Norm weights get the model's own ``_init_weights`` (ones, or
    zeros for Gemma's 1 + w norms), biases zeros.
    """
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # no_init_weights skips it along with init_weights
    std = float(getattr(config, "initializer_range", None) or DEFAULT_INIT_STD)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    num_layers = int(config.num_hidden_layers)
    layers_path, layers = _decoder_layers(model, num_layers)
    done: set[int] = set()

    for index, layer in enumerate(layers):
        _random_init(model, layer.modules(), std, generator, done)
        target = device if device_map is None else device_map[f"{layers_path}.{index}"]
        quantize_here = weight_quant not in ("bf16", "fp16") and not (device_map is not None and target == "cpu")
        if quantize_here:
            _quantize_in_place(layer, weight_quant, dtype, target)
            release_freed_heap()  # the layer's unquantized weights, before the next layer is touched
    in_layers = {id(m) for layer in layers for m in layer.modules()}  # after the swaps
    _random_init(model, (m for m in model.modules() if id(m) not in in_layers), std, generator, done)

    if device_map is not None:
        from accelerate import dispatch_model

        return dispatch_model(model, device_map=device_map, main_device="cuda:0")
    return model.to(device) if device != "cpu" else model


def _random_init(model, modules, std: float, generator: torch.Generator, done: set[int]) -> None:
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
                        p.uniform_(-bound, bound, generator=generator)
                    else:
                        p.zero_()  # biases
            done.update(id(p) for p in params)


def _quantize_in_place(module: nn.Module, weight_quant: str, dtype: torch.dtype, device: str) -> None:
    if weight_quant.startswith("quanto-"):
        from optimum.quanto import freeze, qint4, qint8, quantize

        qtype = {"quanto-int8": qint8, "quanto-int4": qint4}[weight_quant]
        module.to(device)
        quantize(module, weights=qtype)
        freeze(module)
        for sub in module.modules():  # transformers' quanto loader leaves these scalars in fp32
            for name in ("input_scale", "output_scale"):
                buffer = sub._buffers.get(name)
                if buffer is not None:
                    sub._buffers[name] = buffer.float()
        return
    try:
        _replace_linears_with_bnb(module, weight_quant, dtype, device)
    except torch.OutOfMemoryError:
        raise  # the caller re-plans; not a missing feature
    except (RuntimeError, NotImplementedError, ImportError) as exc:
        raise _bnb_unsupported(weight_quant, device, exc) from exc


def _replace_linears_with_bnb(module: nn.Module, weight_quant: str, dtype: torch.dtype, device: str) -> None:
    """Swap every nn.Linear under ``module`` for its bnb layer, quantized on ``device``.

    Same modules, classes and arguments as transformers' bnb loader, so the layout is the
    one a checkpoint loaded with BitsAndBytesConfig gets.
    """
    import bitsandbytes as bnb

    for name, child in list(module.named_children()):
        if not (isinstance(child, nn.Linear) and type(child) is nn.Linear):
            _replace_linears_with_bnb(child, weight_quant, dtype, device)
            continue
        has_bias = child.bias is not None
        if weight_quant == "bnb-int8":
            new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=has_bias,
                                      has_fp16_weights=False, threshold=BNB_INT8_OUTLIER_THRESHOLD,
                                      device="meta")
            weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            quant_type, double_quant = _bnb_4bit_kind(weight_quant)
            new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=has_bias, compute_dtype=dtype,
                                    compress_statistics=double_quant, quant_type=quant_type,
                                    quant_storage=torch.uint8, device="meta")
            weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, blocksize=BNB_4BIT_BLOCKSIZE,
                                       compress_statistics=double_quant, quant_type=quant_type,
                                       quant_storage=torch.uint8, module=new)
        new._parameters["weight"] = weight.to(device)  # .to() quantizes
        if has_bias:
            new._parameters["bias"] = nn.Parameter(child.bias.data.to(device), requires_grad=False)
        new.requires_grad_(False)
        setattr(module, name, new)
