"""transformers' SDPA attention, with one query against a grouped cache on the CPU packed instead of enable_gqa.

transformers 5's ``sdpa_attention_forward`` passes ``enable_gqa=True`` to torch's SDPA when there is no mask, which is
every decode step of a DynamicCache at batch 1. torch 2.13's CPU kernel runs that case about 12x slower than the same
product with the query's heads packed as rows of their key/value head (transformers' own ``pack_gqa``, which it uses
when a mask is present): Qwen2.5-0.5B's shapes (14 query heads over 2 KV heads, head_dim 64), 4096 cached tokens, 24
layers in bf16 on the 2-core Xeon dev VM: 69 ms against 5.7 ms a token; a Qwen2.5-0.5B decode at 2048 tokens of
context 125 -> 85 ms a token (transformers' own forward). Both are the same SDPA of the same tensors.

``PACKED_SDPA`` is registered with transformers' attention and mask interfaces (the mask as SDPA's), and a model that
vramplan runs on the CPU alone is switched to it (runtime.load). Everything else, every GPU call, a compiled graph, a
mask, a position bias, softcapping or sinks, goes to transformers' own function unchanged.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

PACKED_SDPA = "vramplan_sdpa"
# what takes transformers' own function: these change the product (or transformers refuses them for SDPA)
_DEFER_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")


def packed_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] != 1 or attention_mask is not None or groups <= 1 or dropout or not query.is_cpu
            or torch.compiler.is_compiling() or kwargs.get("output_attentions")
            or any(kwargs.get(k) is not None for k in _DEFER_KWARGS)
            or query.shape[1] != key.shape[1] * groups):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)  # (batch, kv heads, the group's queries, dim)
    out = F.scaled_dot_product_attention(packed, key, value, scale=scaling)
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


_registered = False


def register() -> str:
    """Register PACKED_SDPA with transformers (once per process); returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
        if PACKED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
        _registered = True
    return PACKED_SDPA


def pack_single_queries(model: torch.nn.Module) -> bool:
    """Switch a model that uses transformers' SDPA to PACKED_SDPA; False where it uses another implementation (eager,
    for softcapping models) or cannot switch."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(register())
    except (ValueError, ImportError):
        return False
    return model.config._attn_implementation == PACKED_SDPA


def use_attention(model: torch.nn.Module, impl: str, device: str) -> None:
    """Set the model's attention implementation as the planner names it ("sdpa", "eager"): SDPA on the CPU is
    PACKED_SDPA, as load_model leaves a model that runs on the CPU alone."""
    if attention_name(model) != impl:
        model.set_attn_implementation(impl)
    if impl == "sdpa" and device == "cpu":
        pack_single_queries(model)


def attention_name(model: torch.nn.Module) -> str:
    """The model's attention implementation as the planner names it: PACKED_SDPA is SDPA."""
    name = getattr(model.config, "_attn_implementation", None) or "eager"
    return "sdpa" if name == PACKED_SDPA else name
