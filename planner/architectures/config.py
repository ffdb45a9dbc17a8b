"""Typed, checked access to a config.json dict, with plausible bounds on every size field.

A builder never reads a size from the raw dict: `Cfg.int` checks the type, the minimum and the
field's maximum, and every problem is a ConfigError that names the field.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ConfigError
from ..modelspec import canonical_dtype

# Bounds on size fields: the largest value a public model uses, times a wide margin. Beyond them a
# config is corrupt (a unit slip, a typo, a fuzzed file), not big, and planning it would only print
# nonsense (10**30 parameters).
MAX_LAYERS = 4096  # public models: at most ~130 decoder layers (Llama-3.1-405B has 126)
MAX_HIDDEN = 1 << 18  # 262,144; public models: at most 16,384 (Llama-3.1-405B)
MAX_INTERMEDIATE = 1 << 21  # 2,097,152; public models: at most ~74k (dense MLPs of the largest models)
MAX_VOCAB = 1 << 24  # 16.8M; public models: at most ~262k (Gemma 3)
MAX_HEADS = 1 << 12  # 4,096; public models: at most 128 query heads (DeepSeek-V3, Llama-3.1-405B)
MAX_HEAD_DIM = 1 << 12  # 4,096; public models: at most 256 (Gemma)
MAX_EXPERTS = 1 << 16  # public models: at most 512 routed experts per layer
MAX_TOKENS = 1 << 30  # ~1.07B; public models: at most ~10M positions (Llama 4 Scout)

FIELD_MAXIMUM: dict[str, int] = {
    "num_hidden_layers": MAX_LAYERS,
    "first_k_dense_replace": MAX_LAYERS,
    "decoder_sparse_step": MAX_LAYERS,
    "interleave_moe_layer_step": MAX_LAYERS,
    "moe_layer_interval": MAX_LAYERS,
    "moe_layer_start_index": MAX_LAYERS,
    "max_window_layers": MAX_LAYERS,
    "sliding_window_pattern": MAX_LAYERS,
    "no_rope_layer_interval": MAX_LAYERS,
    "hidden_size": MAX_HIDDEN,
    "q_lora_rank": MAX_HIDDEN,
    "kv_lora_rank": MAX_HIDDEN,
    "intermediate_size": MAX_INTERMEDIATE,
    "intermediate_size_mlp": MAX_INTERMEDIATE,
    "moe_intermediate_size": MAX_INTERMEDIATE,
    "shared_expert_intermediate_size": MAX_INTERMEDIATE,
    "vocab_size": MAX_VOCAB,
    "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "qk_nope_head_dim": MAX_HEAD_DIM,
    "qk_rope_head_dim": MAX_HEAD_DIM,
    "v_head_dim": MAX_HEAD_DIM,
    "num_experts": MAX_EXPERTS,
    "num_local_experts": MAX_EXPERTS,
    "n_routed_experts": MAX_EXPERTS,
    "moe_num_experts": MAX_EXPERTS,
    "num_experts_per_tok": MAX_EXPERTS,
    "moe_k": MAX_EXPERTS,
    "n_shared_experts": MAX_EXPERTS,
    "moe_num_shared_experts": MAX_EXPERTS,
    "num_nextn_predict_layers": MAX_LAYERS,
    "max_position_embeddings": MAX_TOKENS,
    "sliding_window": MAX_TOKENS,
    "attention_chunk_size": MAX_TOKENS,
}


class Cfg:
    """Typed, checked access to a config dict; every problem is a ConfigError naming the field."""

    def __init__(self, d: dict, where: str):
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: config is not a JSON object")
        self.d = d
        self.where = where

    # transformers' attribute_map: the same field under another name, depending on who saved the config
    ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",),
               "n_routed_experts": ("num_local_experts", "num_experts"), "moe_num_experts": ("num_experts",),
               "moe_k": ("num_experts_per_tok",), "num_nextn_predict_layers": ("num_mtp_layers",)}

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def _get(self, key: str):
        v = self.d.get(key)
        for alt in self.ALIASES.get(key, ()) if v is None else ():
            v = self.d.get(alt)
            if v is not None:
                break
        return v

    def int(self, key: str, default: Any = ..., *, minimum: int = 1) -> int:
        v = self._get(key)
        if v is None:
            if default is ...:
                raise ConfigError(f"{self.where}: missing required field {key!r}")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise ConfigError(f"{self.where}: field {key!r} must be an integer, got {v!r}")
        if v < minimum:
            raise ConfigError(f"{self.where}: field {key!r} must be >= {minimum}, got {v}")
        maximum = FIELD_MAXIMUM.get(key)
        if maximum is not None and v > maximum:
            raise ConfigError(f"{self.where}: field {key!r}={v} is beyond any real model (max {maximum}); corrupt "
                              "config?")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: field {key!r} must be true or false, got {v!r}")
        return v

    def int_list(self, key: str) -> list[int]:
        v = self.d.get(key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ConfigError(f"{self.where}: field {key!r} must be a list of integers, got {v!r}")
        return v

    def layer_indices(self, key: str, n_layers: int) -> set[int]:
        """A list of decoder-layer indices (mlp_only_layers, moe_layers), each in 0 .. n_layers - 1; empty when
        absent. An index no layer has would silently change nothing: a ConfigError names it."""
        indices = self.int_list(key)
        bad = [i for i in indices if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(f"{self.where}: field {key!r} lists layer {json_text(bad[0])}, but the model has "
                              f"{n_layers} layers (0 to {n_layers - 1})")
        return set(indices)

    def str_list(self, key: str, length: int) -> list[str] | None:
        """A list of `length` strings (layer_types), or None when absent."""
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) != length or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"{self.where}: field {key!r} must list one string per layer ({length})")
        return v

    def sub(self, key: str) -> dict:
        """A nested config object (text_config)."""
        v = self.d.get(key)
        if not isinstance(v, dict):
            raise ConfigError(f"{self.where}: config has no {key} object")
        return v

    def dtype(self) -> str:
        v = self.d.get("dtype") or self.d.get("torch_dtype") or "float32"
        if not isinstance(v, str):
            raise ConfigError(f"{self.where}: field 'torch_dtype' must be a string, got {v!r}")
        return canonical_dtype(v)


# transformers 5.24 (modeling_rope_utils.py, _validate_*_rope_parameters): "`rope_parameters`'s factor field must be a
# float or int >= 1". transformers only warns; a factor below it (-4) is a corrupt config, not a scaling.
MIN_ROPE_FACTOR = 1.0
ROPE_KEYS = ("rope_scaling", "rope_parameters")  # transformers 4 / transformers 5 spelling
_ROPE_ENTRY_KEYS = ("rope_type", "type", "factor", "rope_theta")


def check_rope(config: dict, where: str) -> None:
    """Refuse a rope_scaling / rope_parameters that is not what transformers reads: an object (or null) holding
    rope_type (a string), factor (a number >= MIN_ROPE_FACTOR) and original_max_position_embeddings (a token count);
    transformers 5 may key such objects by attention type ({"full_attention": {...}, "sliding_attention": {...}})."""
    for scope, c in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(c, dict):
            continue
        for key in ROPE_KEYS:
            r = c.get(key)
            if r is None:
                continue
            path = scope + key
            if not isinstance(r, dict):
                raise ConfigError(f"{where}: {path} must be an object like {{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                  f"\"original_max_position_embeddings\": 32768}} (or null), got {json_text(r)}")
            if any(k in r for k in _ROPE_ENTRY_KEYS) or not r:
                _check_rope_entry(r, path, where)
                continue
            for kind, entry in r.items():
                if not isinstance(entry, dict):
                    raise ConfigError(f"{where}: {path}.{kind} must be an object with rope_type and its parameters, "
                                      f"got {json_text(entry)}")
                _check_rope_entry(entry, f"{path}.{kind}", where)


def _check_rope_entry(e: dict, path: str, where: str) -> None:
    kind = e.get("rope_type", e.get("type"))
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(f"{where}: {path}.rope_type must be a string such as \"yarn\" or \"linear\", got "
                          f"{json_text(kind)}")
    factor = e.get("factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not factor >= MIN_ROPE_FACTOR or factor == float("inf")):
        raise ConfigError(f"{where}: {path}.factor must be a number >= {MIN_ROPE_FACTOR:g} (how many times the "
                          f"original context it stretches to), got {json_text(factor)}")
    original = e.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int)
                                 or not 1 <= original <= MAX_TOKENS):
        raise ConfigError(f"{where}: {path}.original_max_position_embeddings must be a token count between 1 and "
                          f"{MAX_TOKENS}, got {json_text(original)}")


def weight_block_size(config: dict, where: str) -> tuple[int, int] | None:
    """quantization_config.weight_block_size: (rows, columns) of the block one scale covers in a block-quantized
    checkpoint (fp8 DeepSeek-V3: [128, 128]); None when absent. Anything but two positive integers is a ConfigError,
    as transformers 5.24 refuses it too (utils/quantization_config.py FineGrainedFP8Config.post_init: "weight_block_size
    must be a tuple of two positive integers")."""
    q = config.get("quantization_config")
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size must be two positive integers (the rows and "
                          f"columns one scale covers, e.g. [128, 128]), got {json_text(block)}")
    return block[0], block[1]


# How much of a bad value a message quotes.
SHOW_MAX_CHARS = 60


def json_text(v: Any) -> str:
    """A config value as JSON, cut to SHOW_MAX_CHARS."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= SHOW_MAX_CHARS else text[:SHOW_MAX_CHARS] + "..."
