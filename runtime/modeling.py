"""What the runtime reads off a transformers model and its config, shared by the loader (runtime/load.py), the dummy
build (runtime/dummy.py), the offload engine and the meta-device inventory: the decoder's config (a multimodal config
nests it), the attention implementation to ask for, and the ModuleList of decoder layers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from torch import nn
from transformers import AutoConfig

from vramplan.planner.errors import ConfigError, UnsupportedArchitectureError


def config_from_dict(raw: Mapping[str, Any], trust_remote_code: bool):
    values = {k: v for k, v in raw.items() if k not in ("quantization_config", "_name_or_path")}
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError("config has no model_type")
    if not trust_remote_code:
        values.pop("auto_map", None)
    try:
        config = AutoConfig.for_model(model_type, **values)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedArchitectureError(f"unsupported architecture: transformers cannot build model_type "
                                           f"{model_type!r} ({first[:200]})") from None
    return text_config(config)


def config_from_dir(model_dir: Path, trust_remote_code: bool):
    try:
        json.loads((model_dir / "config.json").read_text())
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{model_dir / 'config.json'} is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"{model_dir}: {exc}".splitlines()[0]) from None
    return text_config(config)


def text_config(config):
    """The decoder's config: gemma3 and other multimodal configs nest it as text_config."""
    return config.get_text_config(decoder=True)


def attention_kwargs(config) -> dict:
    """The attention implementation to ask for. Logit softcapping (Gemma 2) needs eager attention: transformers 5.23
    picks it by default, but 5.17 picks SDPA, which ignores the softcap (its logits differ by ~0.02)."""
    text = config.get_text_config(decoder=True)
    return {"attn_implementation": "eager"} if getattr(text, "attn_logit_softcapping", None) is not None else {}


def decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder layers (``model.layers`` for most architectures)."""
    candidates = [(name, mod) for name, mod in model.named_modules()
                  if isinstance(mod, nn.ModuleList) and len(mod) == num_layers]
    if not candidates:
        raise UnsupportedArchitectureError(f"{type(model).__name__}: no list of {num_layers} decoder layers found")
    candidates.sort(key=lambda item: (not item[0].endswith("layers"), item[0].count(".")))
    return candidates[0]


def strict_fp32_pattern(model: nn.Module) -> re.Pattern | None:
    """What a model class keeps in fp32 under a bf16/fp16 load (`_keep_in_fp32_modules_strict`), as a pattern that
    matches a tensor's name the way transformers matches it (anywhere in the name); None when the class keeps none."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None)
    return re.compile("|".join(re.escape(k) for k in sorted(keep))) if keep else None
