"""Multi-head latent attention (DeepSeek-V2/V3) with DeepSeek-style mixture of experts."""

from __future__ import annotations


from ..record import record
from ..modelspec import AttentionLayout, ModelSpec, Role
from .common import Inventory, build_decoder
from .config import Cfg
from .moe import deepseek_moe_ffn, moe_info, mtp_note

MLA_CACHE_NOTE = ("MLA: the KV cache holds the compressed latent (kv_lora_rank + qk_rope_head_dim per token and "
                  "layer), as transformers 5.17+, vLLM and SGLang store it; transformers then re-expands the whole "
                  "cached context to full K and V (kv_b_proj) in every layer at every forward: the plan counts that "
                  "up-projection's FLOPs and traffic per token and its temporary K and V (one layer's) in the "
                  "workspace; "
                  "on a CPU, torch's SDPA has no fused kernel for V's head dim unlike K's and materialises the scores "
                  "in fp32 (workspace term sdpa_math_fallback)")


@record(kw_only=True)
class MLA:
    """Low-rank q (or a plain q_proj when q_lora_rank is null, as in V2-Lite) and a compressed joint KV."""

    hidden: int
    heads: int
    q_lora: int | None
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    bias: bool

    def add(self, inv: Inventory, layer: int, prefix: str) -> None:
        p = f"{prefix}.self_attn"
        qk = self.nope + self.rope
        if self.q_lora is None:
            inv.linear(f"{p}.q_proj", self.heads * qk, self.hidden, Role.ATTENTION, layer)
        else:
            inv.linear(f"{p}.q_a_proj", self.q_lora, self.hidden, Role.ATTENTION, layer, self.bias)
            inv.norm(f"{p}.q_a_layernorm", self.q_lora, layer)
            inv.linear(f"{p}.q_b_proj", self.heads * qk, self.q_lora, Role.ATTENTION, layer)
        inv.linear(f"{p}.kv_a_proj_with_mqa", self.kv_lora + self.rope, self.hidden, Role.ATTENTION, layer, self.bias)
        inv.norm(f"{p}.kv_a_layernorm", self.kv_lora, layer)
        inv.linear(f"{p}.kv_b_proj", self.heads * (self.nope + self.v_dim), self.kv_lora, Role.ATTENTION, layer)
        inv.linear(f"{p}.o_proj", self.hidden, self.heads * self.v_dim, Role.ATTENTION, layer, self.bias)

    def layout(self, window: int | None, chunked: bool = False) -> AttentionLayout:
        return AttentionLayout(kind="mla", num_heads=self.heads, num_kv_heads=self.heads,
                               head_dim=self.nope + self.rope, mla_cache_dim=self.kv_lora + self.rope,
                               mla_rope_dim=self.rope, v_head_dim=self.v_dim)


def mla(c: Cfg) -> MLA:
    return MLA(hidden=c.int("hidden_size"), heads=c.int("num_attention_heads"), q_lora=c.int("q_lora_rank", None),
               kv_lora=c.int("kv_lora_rank"), nope=c.int("qk_nope_head_dim"), rope=c.int("qk_rope_head_dim"),
               v_dim=c.int("v_head_dim"), bias=c.bool("attention_bias", False))


def build_deepseek_v2(c: Cfg, name: str) -> ModelSpec:
    # no score-correction buffer (greedy / group-limited routing); MLPs take mlp_bias; shared experts always built
    moe = moe_info(c, "n_routed_experts", "num_experts_per_tok", c.int("moe_intermediate_size"),
                   shared=c.int("n_shared_experts", 2, minimum=0))
    ffn = deepseek_moe_ffn(c, moe, correction_bias=False, mlp_bias=c.bool("mlp_bias", False))
    return build_decoder(c, name, arch="DeepseekV2ForCausalLM", attn=mla(c), ffn=ffn, moe=moe, notes=[MLA_CACHE_NOTE])


def build_deepseek_v3(c: Cfg, name: str) -> ModelSpec:
    moe = moe_info(c, "n_routed_experts", "num_experts_per_tok", c.int("moe_intermediate_size"),
                   shared=c.int("n_shared_experts", 1, minimum=0))  # DeepseekV3Config's default
    ffn = deepseek_moe_ffn(c, moe, correction_bias=True)
    return build_decoder(c, name, arch="DeepseekV3ForCausalLM", attn=mla(c), ffn=ffn, moe=moe,
                         notes=[MLA_CACHE_NOTE, *mtp_note(c)])
