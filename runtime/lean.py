"""vramplan's own decoder step on the CPU: the model's weights, as loaded and quantized, run without transformers'
forward (planner.lean says which runs, and why it pays).

A decode step of transformers 5's Llama-style forward is about 180 torch ops a layer (its modules' Python, the causal
mask, a DynamicCache that concatenates the whole cache every step); on a small CPU that is a fixed 1-1.75 ms a layer.
LeanDecoder runs the same computation, op for op where it can, in about 30:
- q, k and v are one kernel call, gate and up another: a W4A8Linear's rows are concatenated into one matrix (each
  output row is its own dot product, so the product is exactly the three calls'), and the modules keep views of it, so
  no byte is added and transformers' forward still works on the same model;
- RMSNorm and the rotary embedding are transformers' arithmetic (cos and sin from the model's own rotary module once a
  step: every rope type it knows), each op in the same dtype;
- the cache is preallocated for the run ([kv heads, max_len, head_dim] a layer, in the compute dtype, as the planner
  counts it) and written in place; a decode step's attention is SDPA over its filled part with the query heads packed
  by their key/value head (runtime.attention's arrangement), a prefill's is causal SDPA.
It serves generate() as a compiled decode's StaticDecoder does (static_forward, static_decode, reset, max_len).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vramplan.planner.lean import LEAN_MODEL_TYPES
from vramplan.runtime.cpu_kernel import W4A8Linear, product
from vramplan.runtime.tensors import release_freed_heap


class LeanUnsupported(ValueError):
    """The model's structure is not the one LeanDecoder writes out (the message says what differs)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm, op for op: in fp32, the weight applied in the input's dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q / k, [T, heads, D]: x cos + rotate_half(x) sin, where
    rotate_half(x) sin = roll(x, D/2) x sin with its first half negated (the same products, so the same values)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin_signed


class Rows:
    """Linears of one input called as one: W4A8Linears' rows concatenated into one matrix whose views the modules keep
    (one kernel call, exact); any other modules called in turn. Returns the outputs, [T, out] each."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.fused = all(type(m) is W4A8Linear for m in modules) and len({(m.in_features, m.group_size)
                                                                          for m in modules}) == 1
        if not self.fused:
            return
        first = modules[0]
        self.group, self.sizes = first.group_size, [m.out_features for m in modules]
        biases = [m.bias for m in modules]
        self.codes = torch.cat([m.codes for m in modules])
        self.scale_zeros = torch.cat([m.scale_zeros for m in modules])
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b if b is not None else torch.zeros(n, dtype=first.scale_zeros.dtype)
                                   for b, n in zip(biases, self.sizes)])
        start = 0
        for m, n in zip(modules, self.sizes):  # the modules keep views: the concatenated matrix is the only copy
            m.codes, m.scale_zeros = self.codes[start:start + n], self.scale_zeros[start:start + n]
            if m.bias is not None:
                m.bias = self.bias[start:start + n]
            start += n

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not self.fused:
            return [m(x) for m in self.modules]
        out = product(x, self.codes, self.scale_zeros, self.group)
        if self.bias is not None:
            out += self.bias
        if out.dtype is not x.dtype:
            out = out.to(x.dtype)
        return list(out.split(self.sizes, dim=-1))


class _Layer:
    """One decoder layer's weights, as LeanDecoder reads them."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.norm2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        self.qkv = Rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = (q_norm.weight, q_norm.variance_epsilon) if q_norm is not None else None
        self.k_norm = (k_norm.weight, k_norm.variance_epsilon) if k_norm is not None else None
        self.scaling = attn.scaling
        self.gate_up = Rows([mlp.gate_proj, mlp.up_proj])
        self.act, self.down = mlp.act_fn, mlp.down_proj


def structure_refusal(model: nn.Module) -> str | None:
    """Why LeanDecoder cannot run `model` (its type, a module it does not know, a sliding window, a device), or None."""
    config = model.config
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"{config.model_type} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or getattr(model, "lm_head", None) is None:
        return f"{type(model).__name__} is not a decoder with embed_tokens, layers, norm, rotary_emb and lm_head"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or (getattr(config, "sliding_window", None)
                                             and getattr(config, "use_sliding_window", True)
                                             and config.model_type == "mistral"):
        return "a sliding window"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "scaling", "head_dim")) \
                or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"{type(layer).__name__} is not a Llama-style layer"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "a layer is not on the CPU"
    return None


class LeanDecoder:
    """A model's decoder step without transformers' forward, over a cache of `max_len` tokens it preallocates."""

    def __init__(self, model: nn.Module, max_len: int):
        why = structure_refusal(model)
        if why:
            raise LeanUnsupported(f"vramplan's own decoder step cannot run this model: {why}")
        config = model.config
        self.model, self.max_len = model, max_len
        inner = model.model
        self.embed, self.rotary, self.head = inner.embed_tokens, inner.rotary_emb, model.lm_head
        self.final_norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.layers = [_Layer(layer) for layer in inner.layers]
        attn = inner.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        dtype = self.embed.weight.dtype
        shape = (len(self.layers), self.kv_heads, max_len, self.head_dim)
        self.keys, self.values = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.mode = "lean"
        release_freed_heap()  # the q/k/v and gate/up matrices the concatenated ones replaced

    def reset(self) -> None:
        """An empty cache (its tensors kept; what a step reads is only the filled part)."""

    def static_decode(self, token: torch.Tensor, position: int) -> torch.Tensor:
        return self.static_forward(token, position)

    def static_forward(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        """`input_ids` ([1, T]) at positions start..start+T-1, the cache before them filled: fp32 logits of the last
        position, [1, vocab]."""
        n = input_ids.shape[1]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens; positions {start}..{end - 1} do not fit")
        h = self.embed(input_ids[0])  # [T, hidden]
        positions = torch.arange(start, end).unsqueeze(0)
        cos, sin = self.rotary(h, positions)  # [1, T, D] in h's dtype
        cos = cos[0].unsqueeze(1)
        half = self.head_dim // 2
        sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).unsqueeze(1)
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        groups = H // KV
        mask = None
        if n > 1 and start:
            mask = torch.arange(end).unsqueeze(0) <= positions[0].unsqueeze(1)  # [T, start + T]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, *layer.norm1)
            q, k, v = layer.qkv(x)
            q, k, v = q.view(n, H, D), k.view(n, KV, D), v.view(n, KV, D)
            if layer.q_norm is not None:
                q, k = rms_norm(q, *layer.q_norm), rms_norm(k, *layer.k_norm)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            keys, values = self.keys[i], self.values[i]
            keys[:, start:end] = k.transpose(0, 1)
            values[:, start:end] = v.transpose(0, 1)
            keys, values = keys[:, :end].unsqueeze(0), values[:, :end].unsqueeze(0)
            if n == 1:  # one query a head: packed by key/value head, no mask
                out = F.scaled_dot_product_attention(q.view(1, KV, groups, D), keys, values, scale=layer.scaling)
            else:
                if groups > 1:
                    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
                out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                                     is_causal=mask is None, scale=layer.scaling)
                out = out[0].transpose(0, 1)
            h = h + layer.o_proj(out.reshape(n, H * D))
            gate, up = layer.gate_up(rms_norm(h, *layer.norm2))
            h = h + layer.down(layer.act(gate) * up)
        return self.head(rms_norm(h[-1:], *self.final_norm)).float()
