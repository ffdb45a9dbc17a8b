"""Per-architecture builders: config.json (a dict) -> ModelSpec.

Each builder lists the tensors that transformers 5.23 creates for `<Arch>ForCausalLM`, with the
names `named_parameters()` gives them, checked tensor by tensor against transformers on the meta
device (tests/test_architectures.py), plus the per-layer KV layout of the cache transformers builds.

Supported architectures (model_type):
- dense: llama, granite, mistral, ministral, ministral3, qwen2, qwen3, seed_oss, smollm3, gemma2,
  gemma3_text, cohere2, exaone4, olmo2, glm4, starcoder2, phi3
- mixture of experts: mixtral, phimoe, granitemoe, olmoe, qwen2_moe, qwen3_moe, ernie4_5_moe, gpt_oss,
  llama4_text, glm4_moe, and with multi-head latent attention deepseek_v2, deepseek_v3
- multimodal wrappers, text part only: gemma3, llama4, mistral3

Quirks handled: tied embeddings and each class's default for them, biases (qkv-only, all, per flag),
explicit or class-default head_dim (qwen3, gemma, glm4, seed_oss, gpt_oss, llama4; cohere2 ignores it),
q/k norms per head or over all heads (olmo2, olmoe), LayerNorms with bias (starcoder2, phimoe), post-block
norms (olmo2, exaone4, glm4, gemma), fused projections (phi3, glm4), sliding windows per layer (layer_types,
or the class's rule: mistral-style all layers, gemma2/gpt_oss alternating, cohere2/exaone4 every 4th
global, gemma3 every 6th, qwen max_window_layers, smollm3 NoPE layers), llama4's chunked attention (a
window of attention_chunk_size), attention sinks (gpt_oss), fused 3-D experts in both layouts with
per-expert biases (gpt_oss), routers with biases or score-correction terms, shared experts (one gated
shared expert in qwen2_moe; DeepSeek-style in deepseek/glm4_moe/ernie), dense layers among sparse ones
(first_k_dense_replace, decoder_sparse_step, mlp_only_layers, moe_layers / interleave step, ernie's
start/end/interval), and MLA with or without q_lora_rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..errors import ConfigError, UnsupportedArchitectureError
from ..modelspec import ModelSpec
from . import dense, mla, moe, multimodal
from .config import Cfg, check_rope, weight_block_size
from .fp32 import keep_in_fp32

BUILDERS: dict[str, Callable[[Cfg, str], ModelSpec]] = {
    "llama": dense.build_llama,
    "granite": dense.build_granite,
    "mistral": dense.build_mistral,
    "ministral": dense.build_ministral,
    "ministral3": dense.build_ministral3,
    "qwen2": dense.build_qwen2,
    "qwen3": dense.build_qwen3,
    "seed_oss": dense.build_seed_oss,
    "smollm3": dense.build_smollm3,
    "gemma2": dense.build_gemma2,
    "gemma3_text": dense.build_gemma3_text,
    "cohere2": dense.build_cohere2,
    "exaone4": dense.build_exaone4,
    "olmo2": dense.build_olmo2,
    "glm4": dense.build_glm4,
    "starcoder2": dense.build_starcoder2,
    "phi3": dense.build_phi3,
    "mixtral": moe.build_mixtral,
    "phimoe": moe.build_phimoe,
    "granitemoe": moe.build_granitemoe,
    "olmoe": moe.build_olmoe,
    "qwen2_moe": moe.build_qwen2_moe,
    "qwen3_moe": moe.build_qwen3_moe,
    "ernie4_5_moe": moe.build_ernie4_5_moe,
    "gpt_oss": moe.build_gpt_oss,
    "llama4_text": moe.build_llama4_text,
    "glm4_moe": moe.build_glm4_moe,
    "deepseek_v2": mla.build_deepseek_v2,
    "deepseek_v3": mla.build_deepseek_v3,
    "gemma3": multimodal.build_gemma3,
    "llama4": multimodal.build_llama4,
    "mistral3": multimodal.build_mistral3,
}
SUPPORTED_MODEL_TYPES = tuple(BUILDERS)


def spec_from_config(config: dict, *, name: str = "model", source: str = "", where: str | None = None,
                     transformers_version: str | None = None) -> ModelSpec:
    """Build the exact inventory of the model a config.json describes, as `transformers_version` (default: the
    latest verified, fp32.VERIFIED_TRANSFORMERS) holds it once loaded."""
    where = where or name
    c = Cfg(config, where)
    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise ConfigError(f"{where}: config has no model_type")
    builder = BUILDERS.get(mt)
    if builder is None:
        raise UnsupportedArchitectureError(
            f"{where}: unsupported architecture model_type={mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.get("per_layer_config"):  # transformers' heterogeneous configs: per-layer overrides of any field
        raise UnsupportedArchitectureError(f"{where}: per_layer_config (layers unlike the config) is not supported")
    check_rope(config, where)
    weight_block_size(config, where)  # checked here: the engines that size block scales read it
    try:
        spec = builder(c, name)
    except (KeyError, TypeError, ZeroDivisionError) as e:  # a malformed config, never a crash
        raise ConfigError(f"{where}: malformed config ({type(e).__name__}: {e})") from e
    return replace(keep_in_fp32(spec, transformers_version), source=source)
