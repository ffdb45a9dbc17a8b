"""Dense decoder families: one self-attention and one dense MLP per layer, differing only by flags.

Each builder states what its transformers 5 class does differently from Llama: biases, head_dim
defaults, q/k norms, where the per-layer norms sit, the MLP's layout, the sliding-window rule.
"""

from __future__ import annotations

from ..modelspec import ModelSpec
from .common import (FULL, SLIDING, all_sliding, build_decoder, dense_ffn, mha, rope_layers,
                     sliding_unless_every)
from .config import Cfg

SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")  # olmo2, exaone4: no input_layernorm


def build_llama(c: Cfg, name: str) -> ModelSpec:
    return build_decoder(c, name, arch="LlamaForCausalLM", attn=mha(c, bias=c.bool("attention_bias", False)),
                         ffn=dense_ffn(c, bias=c.bool("mlp_bias", False)))


def build_granite(c: Cfg, name: str) -> ModelSpec:
    # Llama's tensors; the embedding/residual/logit multipliers are scalars, not parameters
    return build_decoder(c, name, arch="GraniteForCausalLM", attn=mha(c, bias=c.bool("attention_bias", False)),
                         ffn=dense_ffn(c, bias=c.bool("mlp_bias", False)))


def build_mistral(c: Cfg, name: str) -> ModelSpec:
    return build_decoder(c, name, arch="MistralForCausalLM", attn=mha(c), ffn=dense_ffn(c), window_rule=all_sliding)


def build_ministral(c: Cfg, name: str) -> ModelSpec:
    # MinistralConfig defaults layer_types to all sliding when sliding_window is set. Its attention reads
    # getattr(config, "head_dim", ...) and fails on head_dim null; the RoPE uses hidden/heads then, as we do.
    return build_decoder(c, name, arch="MinistralForCausalLM", attn=mha(c), ffn=dense_ffn(c), window_rule=all_sliding)


def build_ministral3(c: Cfg, name: str) -> ModelSpec:
    # Ministral3Config: head_dim defaults to 128; sliding_window (default null) applies to every layer
    return build_decoder(c, name, arch="Ministral3ForCausalLM", attn=mha(c, head_dim_default=128), ffn=dense_ffn(c),
                         window_rule=all_sliding)


def qwen_window_rule(c: Cfg):
    """Qwen2/Qwen3: with use_sliding_window, layers from max_window_layers on slide."""
    if not c.bool("use_sliding_window", False):
        return None
    first = c.int("max_window_layers", c.int("num_hidden_layers"), minimum=0)
    return lambda i: SLIDING if i >= first else FULL


def build_qwen2(c: Cfg, name: str) -> ModelSpec:
    return build_decoder(c, name, arch="Qwen2ForCausalLM", attn=mha(c, bias=True, o_bias=False), ffn=dense_ffn(c),
                         window_rule=qwen_window_rule(c))


def build_qwen3(c: Cfg, name: str) -> ModelSpec:
    attn = mha(c, head_dim_default=128, bias=c.bool("attention_bias", False), qk_norm="head")
    return build_decoder(c, name, arch="Qwen3ForCausalLM", attn=attn, ffn=dense_ffn(c), window_rule=qwen_window_rule(c))


def build_seed_oss(c: Cfg, name: str) -> ModelSpec:
    # SeedOssConfig: head_dim defaults to 128, q/k/v biases on by default, o_proj's bias is its own flag
    attn = mha(c, head_dim_default=128, bias=c.bool("attention_bias", True), o_bias=c.bool("attention_out_bias", False))
    return build_decoder(c, name, arch="SeedOssForCausalLM", attn=attn,
                         ffn=dense_ffn(c, bias=c.bool("mlp_bias", False)))


def build_smollm3(c: Cfg, name: str) -> ModelSpec:
    # SmolLM3Config: with use_sliding_window, the NoPE layers are the sliding ones
    n = c.int("num_hidden_layers")
    rule = None
    if c.bool("use_sliding_window", False):
        uses_rope = rope_layers(c, n)
        rule = lambda i: FULL if uses_rope[i] else SLIDING  # noqa: E731
    return build_decoder(c, name, arch="SmolLM3ForCausalLM", attn=mha(c, bias=c.bool("attention_bias", False)),
                         ffn=dense_ffn(c, bias=c.bool("mlp_bias", False)), tie_default=True, window_rule=rule)


def build_gemma2(c: Cfg, name: str) -> ModelSpec:
    attn = mha(c, head_dim_default=256, bias=c.bool("attention_bias", False))
    return build_decoder(c, name, arch="Gemma2ForCausalLM", attn=attn, ffn=dense_ffn(c), norms=SANDWICH_NORMS,
                         tie_default=True, window_rule=sliding_unless_every(2))


def build_gemma3_text(c: Cfg, name: str) -> ModelSpec:
    pattern = c.int("_sliding_window_pattern", None) or c.int("sliding_window_pattern", 6)
    attn = mha(c, head_dim_default=256, bias=c.bool("attention_bias", False), qk_norm="head")
    return build_decoder(c, name, arch="Gemma3ForCausalLM", attn=attn, ffn=dense_ffn(c), norms=SANDWICH_NORMS,
                         tie_default=True, window_rule=sliding_unless_every(pattern))


def build_cohere2(c: Cfg, name: str) -> ModelSpec:
    # Attention and MLP run in parallel after one input_layernorm (a LayerNorm without bias); logit_scale is a
    # scalar. Cohere2Config sets head_dim = hidden/heads, but a head_dim in the file overrides it.
    attn = mha(c, bias=c.bool("attention_bias", False))
    rule = sliding_unless_every(c.int("sliding_window_pattern", 4))
    return build_decoder(c, name, arch="Cohere2ForCausalLM", attn=attn, ffn=dense_ffn(c), norms=("input_layernorm",),
                         tie_default=True, window_rule=rule)


def build_exaone4(c: Cfg, name: str) -> ModelSpec:
    # Exaone4Config derives layer_types from an integer sliding_window_pattern (every 4th layer global); real
    # checkpoints ship layer_types with the pattern spelt "LLLG", from which transformers cannot derive them.
    rule = None
    if c.has("sliding_window"):
        rule = lambda i: sliding_unless_every(c.int("sliding_window_pattern", 4))(i)  # noqa: E731
    return build_decoder(c, name, arch="Exaone4ForCausalLM", attn=mha(c, qk_norm="head"), ffn=dense_ffn(c),
                         norms=POST_NORMS, window_rule=rule)


def build_olmo2(c: Cfg, name: str) -> ModelSpec:
    # q_norm/k_norm normalise all heads together ([heads*head_dim], [kv_heads*head_dim]); norms after each block only
    attn = mha(c, bias=c.bool("attention_bias", False), qk_norm="all_heads")
    return build_decoder(c, name, arch="Olmo2ForCausalLM", attn=attn, ffn=dense_ffn(c), norms=POST_NORMS)


def build_glm4(c: Cfg, name: str) -> ModelSpec:
    # Glm4Config: head_dim defaults to 128 and q/k/v biases to on (o_proj never has one); a fused gate_up MLP;
    # two extra norms after the attention and the MLP.
    attn = mha(c, head_dim_default=128, bias=c.bool("attention_bias", True), o_bias=False)
    norms = ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")
    return build_decoder(c, name, arch="Glm4ForCausalLM", attn=attn, ffn=dense_ffn(c, style="fused"), norms=norms)


def build_starcoder2(c: Cfg, name: str) -> ModelSpec:
    # every Linear has a bias under use_bias (default on); LayerNorms with bias; a c_fc/c_proj MLP; tied by default
    bias = c.bool("use_bias", True)
    return build_decoder(c, name, arch="Starcoder2ForCausalLM", attn=mha(c, bias=bias),
                         ffn=dense_ffn(c, style="fc", bias=bias), norm_bias=True, tie_default=True,
                         window_rule=all_sliding)


def build_phi3(c: Cfg, name: str) -> ModelSpec:
    return build_decoder(c, name, arch="Phi3ForCausalLM", attn=mha(c, fused_qkv=True), ffn=dense_ffn(c, style="fused"),
                         window_rule=all_sliding)
