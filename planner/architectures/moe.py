"""Mixture-of-experts families with ordinary (GQA) attention.

In transformers 5.23 every one of them fuses its routed experts into two 3-D parameters per layer
(`Inventory.fused_experts`); what differs is where the router sits and what it holds, shared experts,
which layers are sparse, and the attention flags.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..modelspec import Kind, ModelSpec, MoEInfo, Role
from .common import (CHUNKED, FFN, FULL, SLIDING, Inventory, all_sliding, build_decoder, dense_ffn, mha, rope_layers,
                     sliding_unless_every)
from .config import Cfg


def moe_info(c: Cfg, experts_key: str, k_key: str, inter: int, shared: int = 0) -> MoEInfo:
    return MoEInfo(num_experts=c.int(experts_key), experts_per_token=c.int(k_key), num_shared_experts=shared,
                   expert_intermediate_size=inter)


def routed_ffn(c: Cfg, moe: MoEInfo, *, sparse_and_dense: tuple[Callable[[int], bool], FFN] | None = None,
               prefix: str = "mlp", router: str = "gate",
               extra: Callable[[Inventory, int, str], None] | None = None) -> FFN:
    """Router + fused experts in every layer, or in the layers sparse_and_dense[0] picks with the dense MLP
    sparse_and_dense[1] in the others; `extra` adds what else a sparse layer holds (shared experts, ...)."""
    hidden = c.int("hidden_size")

    def add(inv: Inventory, i: int, p: str) -> bool:
        if sparse_and_dense is not None and not sparse_and_dense[0](i):
            return sparse_and_dense[1](inv, i, p)
        m = f"{p}.{prefix}"
        inv.router(f"{m}.{router}", moe.num_experts, hidden, i)
        inv.fused_experts(f"{m}.experts", moe.num_experts, hidden, moe.expert_intermediate_size, i)
        if extra is not None:
            extra(inv, i, m)
        return True
    return add


def build_mixtral(c: Cfg, name: str) -> ModelSpec:
    moe = moe_info(c, "num_local_experts", "num_experts_per_tok", c.int("intermediate_size"))
    return build_decoder(c, name, arch="MixtralForCausalLM", attn=mha(c), ffn=routed_ffn(c, moe),
                         window_rule=all_sliding, moe=moe)


def build_phimoe(c: Cfg, name: str) -> ModelSpec:
    # LayerNorms with bias, an optional lm_head bias; the router (an nn.Linear subclass) is mlp.router
    moe = moe_info(c, "num_local_experts", "num_experts_per_tok", c.int("intermediate_size"))
    return build_decoder(c, name, arch="PhimoeForCausalLM", attn=mha(c, bias=c.bool("attention_bias", False)),
                         ffn=routed_ffn(c, moe, router="router"), norm_bias=True,
                         head_bias=c.bool("lm_head_bias", False), window_rule=all_sliding, moe=moe)


def build_granitemoe(c: Cfg, name: str) -> ModelSpec:
    moe = moe_info(c, "num_local_experts", "num_experts_per_tok", c.int("intermediate_size"))
    return build_decoder(c, name, arch="GraniteMoeForCausalLM", attn=mha(c, bias=c.bool("attention_bias", False)),
                         ffn=routed_ffn(c, moe, prefix="block_sparse_moe", router="router"), moe=moe)


def build_olmoe(c: Cfg, name: str) -> ModelSpec:
    # q_norm spans hidden_size and k_norm (hidden_size / heads) * kv_heads, whatever head_dim says
    attn = mha(c, bias=c.bool("attention_bias", False))
    attn = replace(attn, qk_norm=(attn.hidden, attn.hidden // attn.heads * attn.kv_heads))
    moe = moe_info(c, "num_experts", "num_experts_per_tok", c.int("intermediate_size"))
    return build_decoder(c, name, arch="OlmoeForCausalLM", attn=attn, ffn=routed_ffn(c, moe), moe=moe)


def _qwen_sparse_layers(c: Cfg) -> Callable[[int], bool]:
    step = c.int("decoder_sparse_step", 1)
    dense_only = c.layer_indices("mlp_only_layers", c.int("num_hidden_layers"))
    return lambda i: i not in dense_only and (i + 1) % step == 0


def build_qwen3_moe(c: Cfg, name: str) -> ModelSpec:
    moe = moe_info(c, "num_experts", "num_experts_per_tok", c.int("moe_intermediate_size"))
    attn = mha(c, bias=c.bool("attention_bias", False), qk_norm="head")
    ffn = routed_ffn(c, moe, sparse_and_dense=(_qwen_sparse_layers(c), dense_ffn(c)))
    # unlike Qwen2/Qwen3, Qwen3MoeConfig has no max_window_layers: use_sliding_window makes every layer slide
    rule = all_sliding if c.bool("use_sliding_window", False) else None
    return build_decoder(c, name, arch="Qwen3MoeForCausalLM", attn=attn, ffn=ffn, window_rule=rule, moe=moe)


def build_qwen2_moe(c: Cfg, name: str) -> ModelSpec:
    # one shared expert (its own width) behind a sigmoid gate, an nn.Linear [1, H] that quantizers replace
    hidden = c.int("hidden_size")
    shared_inter = c.int("shared_expert_intermediate_size")
    moe = moe_info(c, "num_experts", "num_experts_per_tok", c.int("moe_intermediate_size"), shared=1)

    def shared(inv: Inventory, i: int, m: str) -> None:
        inv.gated_mlp(f"{m}.shared_expert", hidden, shared_inter, i)
        inv.linear(f"{m}.shared_expert_gate", 1, hidden, Role.ROUTER, i)

    rule = None
    if c.bool("use_sliding_window", False):  # Qwen2MoeConfig: even layers below max_window_layers slide
        below = c.int("max_window_layers", 28, minimum=0)
        rule = lambda i: SLIDING if (i + 1) % 2 and i < below else FULL  # noqa: E731
    ffn = routed_ffn(c, moe, sparse_and_dense=(_qwen_sparse_layers(c), dense_ffn(c)), extra=shared)
    return build_decoder(c, name, arch="Qwen2MoeForCausalLM", attn=mha(c, bias=c.bool("qkv_bias", True), o_bias=False),
                         ffn=ffn, window_rule=rule, moe=moe)


def build_ernie4_5_moe(c: Cfg, name: str) -> ModelSpec:
    # use_bias puts a bias on every Linear but the experts (lm_head too); the router keeps its score-correction
    # bias as a [1, E] parameter of gate.moe_statics; tied by default
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    bias = c.bool("use_bias", False)
    n_shared = c.int("moe_num_shared_experts", 0, minimum=0)
    moe_inter = c.int("moe_intermediate_size")
    moe = moe_info(c, "moe_num_experts", "moe_k", moe_inter, shared=n_shared)
    interval = c.int("moe_layer_interval", 1)
    start = c.int("moe_layer_start_index", 1, minimum=0)
    end = c.int("moe_layer_end_index", -1, minimum=-1)
    end = n - 1 if end == -1 else end

    def extra(inv: Inventory, i: int, m: str) -> None:
        inv.add(f"{m}.gate.moe_statics.e_score_correction_bias", (1, moe.num_experts), Role.ROUTER, Kind.ROUTER, i)
        if n_shared:
            inv.gated_mlp(f"{m}.shared_experts", hidden, moe_inter * n_shared, i, bias)

    is_sparse = lambda i: (i + 1) % interval == 0 and start <= i <= end  # noqa: E731
    ffn = routed_ffn(c, moe, sparse_and_dense=(is_sparse, dense_ffn(c, bias=bias)), extra=extra)
    return build_decoder(c, name, arch="Ernie4_5_MoeForCausalLM", attn=mha(c, bias=bias), ffn=ffn, tie_default=True,
                         head_bias=bias, moe=moe)


def build_gpt_oss(c: Cfg, name: str) -> ModelSpec:
    # head_dim defaults to 64; biases on every attention Linear by default; one learned sink per head;
    # the router has a bias; experts are transposed [E, H, 2I] / [E, I, H] with a bias per expert;
    # GptOssConfig alternates sliding and full layers, starting with a sliding one
    hidden = c.int("hidden_size")
    moe = moe_info(c, "num_local_experts", "num_experts_per_tok", c.int("intermediate_size"))

    def ffn(inv: Inventory, i: int, p: str) -> bool:
        inv.router(f"{p}.mlp.router", moe.num_experts, hidden, i, bias=True)
        inv.fused_experts(f"{p}.mlp.experts", moe.num_experts, hidden, moe.expert_intermediate_size, i,
                          transposed=True, bias=True)
        return True

    notes = []  # a checkpoint storing the experts MXFP4 is counted as stored by planner/published_scheme.py
    attn = mha(c, head_dim_default=64, bias=c.bool("attention_bias", True), sinks=True)
    return build_decoder(c, name, arch="GptOssForCausalLM", attn=attn, ffn=ffn, window_rule=sliding_unless_every(2),
                         moe=moe, notes=notes)


def build_llama4_text(c: Cfg, name: str) -> ModelSpec:
    # head_dim defaults to 128; the q/k L2 norm has no weight. MoE layers (moe_layers, else every
    # interleave_moe_layer_step-th) hold a router (an nn.Linear subclass), transposed fused experts and one
    # shared expert of the experts' width; the other layers a dense MLP of intermediate_size_mlp.
    # Layers that use RoPE attend in chunks of attention_chunk_size (layer type chunked_attention).
    n = c.int("num_hidden_layers")
    hidden = c.int("hidden_size")
    inter = c.int("intermediate_size")
    dense_inter = c.int("intermediate_size_mlp")
    moe = moe_info(c, "num_local_experts", "num_experts_per_tok", inter, shared=1)
    if c.has("moe_layers"):
        sparse = c.layer_indices("moe_layers", n)
    else:
        step = c.int("interleave_moe_layer_step", 1)
        sparse = set(range(step - 1, n, step))

    def ffn(inv: Inventory, i: int, p: str) -> bool:
        m = f"{p}.feed_forward"
        if i not in sparse:
            inv.gated_mlp(m, hidden, dense_inter, i)
            return False
        inv.fused_experts(f"{m}.experts", moe.num_experts, hidden, inter, i, transposed=True)
        inv.router(f"{m}.router", moe.num_experts, hidden, i)
        inv.gated_mlp(f"{m}.shared_expert", hidden, inter, i)
        return True

    uses_rope = rope_layers(c, n)
    attn = mha(c, head_dim_default=128, bias=c.bool("attention_bias", False))
    return build_decoder(c, name, arch="Llama4ForCausalLM", attn=attn, ffn=ffn, moe=moe, intermediate=dense_inter,
                         window_rule=lambda i: CHUNKED if uses_rope[i] else FULL)


def deepseek_moe_ffn(c: Cfg, moe: MoEInfo, *, correction_bias: bool, mlp_bias: bool = False) -> FFN:
    """DeepSeek-style MoE (deepseek_v2/v3, glm4_moe): dense MLPs in the first `first_k_dense_replace` layers,
    then a router (with a persistent score-correction buffer in v3 and glm4_moe), fused experts and the shared
    experts as one MLP of n_shared_experts x moe_intermediate_size."""
    hidden = c.int("hidden_size")
    first_dense = c.int("first_k_dense_replace", 0, minimum=0)
    shared_inter = moe.num_shared_experts * moe.expert_intermediate_size

    def extra(inv: Inventory, i: int, m: str) -> None:
        if correction_bias:
            inv.add(f"{m}.gate.e_score_correction_bias", (moe.num_experts,), Role.ROUTER, Kind.BUFFER, i)
        if shared_inter:  # n_shared_experts 0 would build zero-sized Linears: no bytes, no tensors here
            inv.gated_mlp(f"{m}.shared_experts", hidden, shared_inter, i, mlp_bias)

    return routed_ffn(c, moe, sparse_and_dense=(lambda i: i >= first_dense, dense_ffn(c, bias=mlp_bias)), extra=extra)


def mtp_note(c: Cfg) -> list[str]:
    if c.int("num_nextn_predict_layers", 0, minimum=0):
        return ["the multi-token-prediction layer in the checkpoint is not loaded by transformers and is not counted"]
    return []


def build_glm4_moe(c: Cfg, name: str) -> ModelSpec:
    # q/k/v biases under attention_bias (o_proj never); q/k norms under use_qk_norm
    moe = moe_info(c, "n_routed_experts", "num_experts_per_tok", c.int("moe_intermediate_size"),
                   shared=c.int("n_shared_experts", 1, minimum=0))
    qk_norm = "head" if c.bool("use_qk_norm", False) else None
    attn = mha(c, bias=c.bool("attention_bias", False), o_bias=False, qk_norm=qk_norm)
    ffn = deepseek_moe_ffn(c, moe, correction_bias=True)
    return build_decoder(c, name, arch="Glm4MoeForCausalLM", attn=attn, ffn=ffn, moe=moe, notes=mtp_note(c))

