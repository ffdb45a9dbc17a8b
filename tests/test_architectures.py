"""Every architecture's inventory against transformers itself, tensor by tensor.

transformers builds each tiny model on the meta device (`with torch.device("meta")`:
accelerate's init_empty_weights leaves tied embeddings untied in transformers 5), and
the names and shapes of its parameters must equal ModelSpec's exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.architectures import SUPPORTED_MODEL_TYPES, spec_from_config
from planner.errors import ConfigError, UnsupportedArchitectureError
from planner.modelspec import Kind

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REF = Path(__file__).resolve().parents[1] / "planner" / "catalog"

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=512)
# Each case varies the quirks that change the inventory.
TINY = {
    "llama": dict(),
    "llama-tied-bias": dict(model_type="llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "llama-headdim": dict(model_type="llama", head_dim=24),
    "mistral": dict(sliding_window=64),
    "mistral-nowindow": dict(model_type="mistral", sliding_window=None),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2),
    "qwen3": dict(head_dim=24, tie_word_embeddings=True),
    "qwen3-bias": dict(model_type="qwen3", head_dim=16, attention_bias=True),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, mlp_only_layers=[0]),
    "qwen3_moe-step": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32,
                           head_dim=16, decoder_sparse_step=2),
    "gemma2": dict(head_dim=32, sliding_window=16),
    "gemma3_text": dict(head_dim=32, sliding_window=16, num_hidden_layers=7),
    "gemma3_text-untied": dict(model_type="gemma3_text", head_dim=16, sliding_window=16, tie_word_embeddings=False),
    "phi3": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, num_key_value_heads=2, sliding_window=32),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1),
    "deepseek_v3-noqlora": dict(model_type="deepseek_v3", num_key_value_heads=4, n_routed_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1, attention_bias=True),
}


def tiny_config(case: str) -> dict:
    extra = dict(TINY[case])
    mt = extra.pop("model_type", case)
    cfg = transformers.AutoConfig.for_model(mt, **{**BASE, **extra})
    return cfg.to_dict()


def meta_model(config: dict):
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("case", sorted(TINY))
def test_inventory_matches_transformers_tensor_by_tensor(case):
    config = tiny_config(case)
    spec = spec_from_config(config, name=case)
    model = meta_model(config)
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = {t.name: t.shape for t in spec.tensors if t.is_parameter}
    assert ours == theirs
    assert spec.params_total == sum(p.numel() for p in model.parameters())
    # persistent buffers we count (deepseek's router bias) exist in the model too
    buffers = dict(model.named_buffers())
    for t in spec.tensors:
        if t.kind is Kind.BUFFER:
            assert tuple(buffers[t.name].shape) == t.shape
    # and the kinds agree with the modules that hold them (what a quantizer would replace)
    for t in spec.tensors:
        if t.kind is Kind.LINEAR and t.is_parameter:
            module = model.get_submodule(t.name.rsplit(".", 1)[0])
            assert type(module) is torch.nn.Linear, t.name


def test_every_supported_architecture_is_covered():
    covered = {TINY[c].get("model_type", c) for c in TINY}
    assert covered | {"gemma3"} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("case", ["mistral", "gemma2", "gemma3_text", "qwen2-window", "phi3", "llama"])
def test_sliding_windows_match_transformers_cache_layers(case):
    """The layers we cap are the layers transformers' DynamicCache gives a sliding-window layer."""
    config = tiny_config(case)
    spec = spec_from_config(config, name=case)
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    cache = transformers.DynamicCache(config=cfg)
    theirs = [type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers]
    assert [a.window is not None for a in spec.attention] == theirs


def test_kv_cache_shapes_match_a_real_forward():
    """KV bytes per token per layer equal what a real (tiny, CPU) forward pass stores."""
    config = tiny_config("qwen3")
    spec = spec_from_config(config, name="qwen3")
    cfg = transformers.AutoConfig.for_model("qwen3", **{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, 10))
    cache = transformers.DynamicCache(config=cfg)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
    stored = sum(layer.keys.numel() * 2 + layer.values.numel() * 2 for layer in cache.layers)
    assert stored == spec.kv_bytes_per_token(2.0) * 10


# ------------------------------------------------------------ published totals (pure, full-size configs)
PUBLISHED = {
    "meta-llama--Llama-3.1-8B.json": 8_030_261_248,
    "mistralai--Mistral-7B-v0.3.json": 7_248_023_552,
    "Qwen--Qwen2.5-7B.json": 7_615_616_512,
    "mistralai--Mixtral-8x7B-v0.1.json": 46_702_792_704,
    "google--gemma-2-9b.json": 9_241_705_984,
    "Qwen--Qwen3-30B-A3B.json": 30_532_122_624,
    "Qwen--Qwen2.5-0.5B.json": 494_032_768,
}


@pytest.mark.parametrize("file,total", sorted(PUBLISHED.items()))
def test_published_totals(file, total):
    spec = spec_from_config(json.loads((REF / file).read_text()), name=file)
    assert spec.params_total == total


def test_quirks_of_real_configs():
    def load(f):
        return spec_from_config(json.loads((REF / f).read_text()), name=f)

    gemma2 = load("google--gemma-2-9b.json")
    assert [a.window for a in gemma2.attention[:4]] == [4096, None, 4096, None]
    gemma3 = load("google--gemma-3-27b-it.json")
    assert sum(a.window is None for a in gemma3.attention) == 10  # 62 layers, 5 local : 1 global
    assert gemma3.attention[5].window is None and gemma3.attention[0].window == 1024
    ds = load("deepseek-ai--DeepSeek-V3.json")
    assert ds.kv_bytes_per_token(2.0) == 61 * (512 + 64) * 2
    assert len(ds.moe.moe_layers) == 61 - 3
    assert 37.0e9 < ds.params_active < 38.0e9  # published: 37B activated
    qwen05 = load("Qwen--Qwen2.5-0.5B.json")
    assert qwen05.tie_word_embeddings and not any(t.name == "lm_head.weight" for t in qwen05.tensors)
    assert all(a.window is None for a in qwen05.attention)  # use_sliding_window: false
    llama8 = load("meta-llama--Llama-3.1-8B.json")
    assert llama8.kv_bytes_per_token(2.0) == 32 * 2 * 8 * 128 * 2
    assert llama8.kv_cache_elements(1000) * 2 == llama8.kv_bytes_per_token(2.0) * 1000
    assert gemma2.kv_cache_elements(10_000) < gemma2.kv_bytes_per_token(1.0) * 10_000  # windows cap the cache


def test_unknown_architecture_is_refused_with_the_supported_list():
    with pytest.raises(UnsupportedArchitectureError) as e:
        spec_from_config({**BASE, "model_type": "gpt_neox"}, name="x")
    assert "llama" in str(e.value) and "deepseek_v3" in str(e.value)


@pytest.mark.parametrize("bad", [
    {"model_type": "llama"},
    {**BASE, "model_type": "llama", "hidden_size": "64"},
    {**BASE, "model_type": "llama", "num_hidden_layers": -1},
    {**BASE, "model_type": "llama", "num_attention_heads": 3},
    {**BASE, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
    {**BASE, "model_type": "gemma2", "layer_types": ["full_attention"]},
    {**BASE, "model_type": "gemma3"},
    {**BASE},
])
def test_bad_configs_raise_config_errors(bad):
    with pytest.raises(ConfigError):
        spec_from_config(bad, name="bad")
