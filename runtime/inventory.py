"""Any decoder transformers can build: its exact tensor inventory from the model built on the meta device.

For a model_type without a hand-written builder (planner/architectures) and without known safetensors
headers, `spec_from_transformers` builds `AutoModelForCausalLM.from_config(cfg)` inside
`with torch.device("meta")` (never accelerate's init_empty_weights: in transformers 5 it leaves tied
embeddings untied), lists every parameter and persistent buffer with its shape, takes kinds from the
modules that hold them (exactly nn.Linear -> LINEAR/BIAS, norm modules -> NORM, nn.Embedding ->
EMBEDDING, 3-D expert parameters -> EXPERTS, router modules -> ROUTER) and hands the planner plain data
(planner.generic.spec_from_tensors). torch is imported only when that happens: `load_spec` is what the
CLI calls, and plans a model with a builder or with headers without torch.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import replace

from vramplan.planner.architectures.fp32 import FP32_DTYPE
from vramplan.planner.errors import UnsupportedArchitectureError
from vramplan.planner.generic import (CONTEXT_KEYS, HEAD_KEYS, HIDDEN_KEYS, INTERMEDIATE_KEYS, KV_HEAD_KEYS, LAYER_KEYS,
                             TOP_K_KEYS, classify, is_routed_expert, refuse_unmodelled_state, spec_from_tensors)
from vramplan.planner.modelspec import INVENTORY_META_DEVICE, Kind, ModelSpec, Role, TensorSpec
from vramplan.planner.sources import ModelSource
from vramplan.planner.sources import load_spec as planner_load_spec

# Config attributes read through the config object (attribute_map aliases, defaults, values its __init__ derives).
RESOLVED_KEYS = (*LAYER_KEYS, *HEAD_KEYS, *KV_HEAD_KEYS, *HIDDEN_KEYS, *INTERMEDIATE_KEYS, *CONTEXT_KEYS, *TOP_K_KEYS,
                 "head_dim", "vocab_size", "layer_types", "sliding_window", "use_sliding_window",
                 "attention_chunk_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "multi_query",
                 "new_decoder_architecture")


def runtime_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def load_spec(source: ModelSource) -> ModelSpec:
    """The source's exact inventory (planner.sources.load_spec), with this module's meta-device path for a
    model_type that has neither a builder nor known headers, when torch and transformers are installed, counted
    as the installed transformers holds it (its version read without importing it)."""
    return planner_load_spec(source, generic=spec_from_transformers if runtime_installed() else None,
                             transformers_version=installed_transformers_version())


# transformers states its version on one line of its __init__.py: `__version__ = "5.24.0"`
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


def installed_transformers_version() -> str | None:
    """The installed transformers' version, read from its __init__.py without importing it (importlib.metadata
    alone adds 10 ms to every plan); from the package metadata when that file does not say."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            found = _VERSION_LINE.search(f.read(4096))
    except OSError:
        found = None
    if found:
        return found.group(1)
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def spec_from_transformers(config: dict, name: str, source: str) -> ModelSpec:
    """The tensors of the model transformers builds from `config` (a config.json dict), on the meta device."""
    where = source or name
    refuse_unmodelled_state(config, where)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from vramplan.runtime.modeling import config_from_dict, decoder_layers, strict_fp32_pattern

    cfg = config_from_dict(config, trust_remote_code=False)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the config's own warnings (RoPE factors, ...) are not ours to print
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except ValueError as e:  # a config class with no causal-LM model
        raise UnsupportedArchitectureError(f"{where}: transformers builds no causal LM for model_type "
                                           f"{config.get('model_type')!r} ({str(e).splitlines()[0][:200]})") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    resolved = {**cfg.to_dict(), **{k: v for k in RESOLVED_KEYS if (v := getattr(cfg, k, None)) is not None}}
    stack, _ = decoder_layers(model, int(cfg.num_hidden_layers))
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and inputs is not None and outputs.weight is inputs.weight
    modules = dict(model.named_modules())
    moe = any(is_routed_expert(n) or p.ndim == 3 for n, p in model.named_parameters())
    tensors = [_tensor(n, tuple(p.shape), modules, stack, inputs, outputs, moe) for n, p in model.named_parameters()]
    for n, b in model.named_buffers():
        owner, leaf = n.rsplit(".", 1) if "." in n else ("", n)
        if leaf not in modules[owner]._non_persistent_buffers_set:
            tensors.append(replace(_tensor(n, tuple(b.shape), modules, stack, inputs, outputs, moe), kind=Kind.BUFFER))
    tensors = _kept_in_fp32(tensors, strict_fp32_pattern(model))
    spec = spec_from_tensors(resolved, tensors, name=name, source=source, where=where,
                             inventory=INVENTORY_META_DEVICE, architecture=type(model).__name__, tied=tied)
    return replace(spec, model_type=str(config.get("model_type")), config=config)


def _kept_in_fp32(tensors: list[TensorSpec], pattern: re.Pattern | None) -> list[TensorSpec]:
    """The tensors the class keeps in fp32 under a bf16/fp16 load (runtime.modeling.strict_fp32_pattern), marked so
    (as runtime/dummy.py holds them too)."""
    if pattern is None:
        return tensors
    return [replace(t, held_dtype=FP32_DTYPE) if pattern.search(t.name) else t for t in tensors]


def _tensor(name: str, shape: tuple[int, ...], modules: dict, stack: str, inputs, outputs, moe: bool) -> TensorSpec:
    """Role from the name (embeddings and lm_head by identity), kind from the module holding the tensor."""
    from torch import nn

    owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    module = modules[owner]
    rest = name[len(stack) + 1:] if name.startswith(stack + ".") else None
    layer = int(rest.split(".", 1)[0]) if rest is not None else None
    role, kind = classify(name, shape, layer is not None, moe)
    cls = type(module).__name__
    if module is inputs:
        role, kind = Role.EMBEDDING, Kind.EMBEDDING
    elif module is outputs:
        role = Role.LM_HEAD
    if type(module) is nn.Linear:
        kind = Kind.LINEAR if leaf == "weight" else Kind.BIAS
    elif "Norm" in cls:
        role, kind = Role.NORM, Kind.NORM
    elif isinstance(module, nn.Embedding):
        kind = Kind.EMBEDDING
    elif role is Role.EXPERT or len(shape) == 3:
        role, kind = Role.EXPERT, Kind.EXPERTS if len(shape) == 3 else Kind.EXPERTS_BIAS
    elif role is Role.ROUTER or "Router" in cls:
        role, kind = Role.ROUTER, Kind.ROUTER
    else:
        kind = Kind.OTHER
    return TensorSpec(name=name, shape=shape, role=role, kind=kind, layer=layer)
