"""Every architecture's inventory against transformers itself, tensor by tensor.

transformers builds each tiny model on the meta device (`with torch.device("meta")`:
accelerate's init_empty_weights leaves tied embeddings untied in transformers 5), and
the names and shapes of its parameters must equal ModelSpec's exactly.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from vramplan.planner.architectures import SUPPORTED_MODEL_TYPES, spec_from_config
from vramplan.planner.errors import ConfigError, UnsupportedArchitectureError
from vramplan.planner.modelspec import Kind, Role

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REF = Path(__file__).resolve().parents[1] / "planner" / "catalog"

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=512, pad_token_id=None, bos_token_id=None, eos_token_id=None)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
# Each case varies the quirks that change the inventory.
TINY = {
    "llama": dict(),
    "llama-tied-bias": dict(model_type="llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "llama-headdim": dict(model_type="llama", head_dim=24),
    "granite": dict(),
    "granite-tied-bias": dict(model_type="granite", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral": dict(sliding_window=64),
    "mistral-nowindow": dict(model_type="mistral", sliding_window=None),
    "ministral": dict(head_dim=16, sliding_window=32),
    "ministral3": dict(sliding_window=32),  # head_dim defaults to 128
    "ministral3-tied": dict(model_type="ministral3", head_dim=16, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2),
    "qwen3": dict(head_dim=24, tie_word_embeddings=True),
    "qwen3-bias": dict(model_type="qwen3", head_dim=16, attention_bias=True),
    "seed_oss": dict(head_dim=16),
    "seed_oss-outbias": dict(model_type="seed_oss", attention_bias=False, attention_out_bias=True, mlp_bias=True),
    "smollm3": dict(),
    "smollm3-window": dict(model_type="smollm3", use_sliding_window=True, sliding_window=16, no_rope_layer_interval=2,
                           attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "gemma2": dict(head_dim=32, sliding_window=16),
    "gemma3_text": dict(head_dim=32, sliding_window=16, num_hidden_layers=7),
    "gemma3_text-untied": dict(model_type="gemma3_text", head_dim=16, sliding_window=16, tie_word_embeddings=False),
    "cohere2": dict(sliding_window=16, head_dim=24),
    "cohere2-untied-bias": dict(model_type="cohere2", sliding_window=16, sliding_window_pattern=2,
                                tie_word_embeddings=False, attention_bias=True),
    "exaone4": dict(head_dim=16, sliding_window=16),
    "exaone4-tied": dict(model_type="exaone4", sliding_window=16, tie_word_embeddings=True,
                         layer_types=["full_attention", "sliding_attention"] * 2),
    "olmo2": dict(),
    "olmo2-tied-bias": dict(model_type="olmo2", head_dim=24, attention_bias=True, tie_word_embeddings=True),
    "glm4": dict(head_dim=16),
    "glm4-defaults": dict(model_type="glm4", attention_bias=False),  # head_dim defaults to 128
    "starcoder2": dict(sliding_window=32),
    "starcoder2-nobias": dict(model_type="starcoder2", use_bias=False, tie_word_embeddings=False),
    "phi3": dict(num_key_value_heads=2, sliding_window=32),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "phimoe-bias": dict(model_type="phimoe", num_local_experts=4, num_experts_per_tok=1, attention_bias=True,
                        lm_head_bias=True, sliding_window=32),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, attention_bias=True),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "olmoe-headdim": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, head_dim=24, attention_bias=True),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=48, **EXPERTS),
    "qwen2_moe-sparse": dict(model_type="qwen2_moe", num_experts=4, shared_expert_intermediate_size=48,
                             decoder_sparse_step=2, mlp_only_layers=[3], qkv_bias=False, use_sliding_window=True,
                             sliding_window=16, max_window_layers=3, **EXPERTS),
    "qwen3_moe": dict(num_experts=4, head_dim=16, mlp_only_layers=[0], **EXPERTS),
    "qwen3_moe-step": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32,
                           head_dim=16, decoder_sparse_step=2, use_sliding_window=True, sliding_window=16,
                           max_window_layers=2),  # Qwen3MoeConfig ignores max_window_layers
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2),
    "ernie4_5_moe-bias": dict(model_type="ernie4_5_moe", moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                              moe_num_shared_experts=0, use_bias=True, tie_word_embeddings=False,
                              moe_layer_interval=2, moe_layer_start_index=0, moe_layer_end_index=2),
    "ernie4_5_moe-tied-bias": dict(model_type="ernie4_5_moe", moe_num_experts=4, moe_k=1, moe_intermediate_size=32,
                                   moe_num_shared_experts=1, use_bias=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16),
    "gpt_oss-nobias-tied": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=1, attention_bias=False,
                                tie_word_embeddings=True, sliding_window=8),  # head_dim defaults to 64
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=96,
                        head_dim=16, attention_chunk_size=32, interleave_moe_layer_step=2),
    "llama4_text-allmoe": dict(model_type="llama4_text", num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=32, intermediate_size_mlp=96, attention_chunk_size=16,
                               attention_bias=True, tie_word_embeddings=True, no_rope_layers=[1, 0, 1, 1]),
    "llama4_text-layers": dict(model_type="llama4_text", num_local_experts=4, num_experts_per_tok=1,
                               intermediate_size=32, intermediate_size_mlp=96, head_dim=16, moe_layers=[0, 3]),
    "glm4_moe": dict(n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1, head_dim=16, **EXPERTS),
    "glm4_moe-qknorm-bias": dict(model_type="glm4_moe", n_routed_experts=4, first_k_dense_replace=0,
                                 n_shared_experts=2, head_dim=16, use_qk_norm=True, attention_bias=True,
                                 num_nextn_predict_layers=1, **EXPERTS),
    "deepseek_v2": dict(n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1, **EXPERTS, **MLA),
    "deepseek_v2-lite": dict(model_type="deepseek_v2", n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=2,
                             attention_bias=True, mlp_bias=True, **EXPERTS, **{**MLA, "q_lora_rank": None}),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                        **EXPERTS, **MLA),
    "deepseek_v3-noqlora": dict(model_type="deepseek_v3", n_routed_experts=4, n_shared_experts=1,
                                first_k_dense_replace=2, n_group=2, topk_group=1, attention_bias=True,
                                **EXPERTS, **{**MLA, "q_lora_rank": None}),
}


def tiny_config(case: str) -> dict:
    """The config.json transformers writes for a TINY case (a fresh copy each call)."""
    return json.loads(_tiny_config_json(case))


@functools.cache
def _tiny_config_json(case: str) -> str:
    extra = dict(TINY[case])
    mt = extra.pop("model_type", case)
    return json.dumps(transformers.AutoConfig.for_model(mt, **{**BASE, **extra}).to_dict())


def meta_model(config: dict):
    cfg = transformers.AutoConfig.for_model(config["model_type"],
                                            **{k: v for k, v in config.items() if k != "model_type"})
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
    # persistent buffers we count (deepseek's router bias) exist in the model too, and are saved
    buffers = dict(model.named_buffers())
    for t in spec.tensors:
        if t.kind is Kind.BUFFER:
            owner, leaf = t.name.rsplit(".", 1)
            assert tuple(buffers[t.name].shape) == t.shape
            assert leaf not in model.get_submodule(owner)._non_persistent_buffers_set
    # and the kinds agree with the modules that hold them: exactly the nn.Linear ones are what bnb replaces
    for t in spec.tensors:
        if t.is_parameter:
            module = model.get_submodule(t.name.rsplit(".", 1)[0])
            assert (type(module) is torch.nn.Linear) == (t.kind in (Kind.LINEAR, Kind.BIAS)), t.name
            assert ("Norm" in type(module).__name__) == (t.kind is Kind.NORM), t.name
            assert (t.kind in (Kind.EXPERTS, Kind.EXPERTS_BIAS)) == (t.role is Role.EXPERT), t.name


def test_every_supported_architecture_is_covered():
    covered = {TINY[c].get("model_type", c) for c in TINY} | {w.split("-")[0] for w in WRAPPED}
    assert covered == set(SUPPORTED_MODEL_TYPES)


EXPERT_COUNTS = {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"}
MOE_CASES = [c for c in sorted(TINY) if EXPERT_COUNTS & set(TINY[c])]


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_facts_match_the_model(case):
    """Sparse layers, expert count and per-expert width are those of the modules transformers builds."""
    config = tiny_config(case)
    spec = spec_from_config(config, name=case)
    model = meta_model(config)
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    assert list(spec.moe.moe_layers) == sorted({int(n.split(".")[2]) for n in experts})
    down = next(p for n, p in experts.items() if n.endswith("down_proj"))
    assert spec.moe.num_experts == down.shape[0]
    assert down.numel() == spec.moe.num_experts * spec.hidden_size * spec.moe.expert_intermediate_size
    assert spec.moe.experts_per_token == model.config.num_experts_per_tok
    assert 0 < spec.params_active < spec.params_total
    # the orientation the planner sizes per-expert quantization by is transformers' own (llama4's class has no flag)
    for t in spec.tensors:
        if t.kind is Kind.EXPERTS:
            module = model.get_submodule(t.name.rsplit(".", 1)[0])
            assert t.transposed == getattr(module, "is_transposed", type(module).__name__ == "Llama4TextExperts")
            out_f, in_f = t.matrix_shape
            assert (in_f if t.name.endswith("gate_up_proj") else out_f) == spec.hidden_size, t.name


# ------------------------------------------------------------ multimodal wrappers: the text model inside
TINY_VISION = {
    "mistral3": dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, head_dim=16, image_size=64, patch_size=16),
    "llama4": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                   patch_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32),
    "gemma3": dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, image_size=64, patch_size=16),
}
# wrapper case -> the TINY text case inside, and whether that text model ties by default
WRAPPED = {"mistral3": ("mistral", False), "mistral3-ministral3": ("ministral3-tied", False),
           "llama4": ("llama4_text", False), "gemma3": ("gemma3_text", True)}
TIE_SETTINGS = [None, True, False]


def wrapper_config(case: str, top_tie, text_tie) -> dict:
    wrapper = case.split("-")[0]
    text = tiny_config(WRAPPED[case][0])
    text.pop("tie_word_embeddings")
    if text_tie is not None:
        text["tie_word_embeddings"] = text_tie
    config = dict(model_type=wrapper, text_config=text, vision_config=TINY_VISION[wrapper], torch_dtype="bfloat16")
    if top_tie is not None:
        config["tie_word_embeddings"] = top_tie
    return config


def wrapper_text_parameters(config: dict) -> dict:
    """The wrapper's language-model parameters under their `<Arch>ForCausalLM` names."""
    cfg = transformers.AutoConfig.for_model(config["model_type"],
                                            **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    out = {}
    for n, p in model.named_parameters():
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
            if n.startswith(old):
                out[new + n[len(old):]] = tuple(p.shape)
    return out


@pytest.mark.parametrize("top_tie", TIE_SETTINGS)
@pytest.mark.parametrize("text_tie", TIE_SETTINGS)
@pytest.mark.parametrize("case", sorted(WRAPPED))
def test_wrapper_text_part_matches_transformers(case, text_tie, top_tie):
    """gemma3/mistral3 tie by their own flag (default true), llama4 by its text model's.

    When the wrapper would tie but text_config says untied, transformers builds the model tied from the
    config alone, yet keeps the checkpoint's own lm_head on load (test below): we count it.
    """
    config = wrapper_config(case, top_tie, text_tie)
    spec = spec_from_config(config, name=case)
    ours = {t.name: t.shape for t in spec.tensors if t.is_parameter}
    theirs = wrapper_text_parameters(config)
    wrapper_ties = case.startswith(("gemma3", "mistral3")) and top_tie is not False
    text_ties = WRAPPED[case][1] if text_tie is None else text_tie
    if case.startswith("llama4"):
        assert ours == theirs and spec.tie_word_embeddings == text_ties
    elif wrapper_ties and not text_ties:
        assert "lm_head.weight" not in theirs and not spec.tie_word_embeddings
        assert {k: v for k, v in ours.items() if k != "lm_head.weight"} == theirs
    else:
        assert ours == theirs and spec.tie_word_embeddings == (wrapper_ties and text_ties)
    assert spec.dtype == "bfloat16" and spec.config is config
    assert any("vision tower" in n for n in spec.notes)


def test_mistral3_keeps_the_checkpoints_own_lm_head(tmp_path):
    """Mistral-Small configs carry no top-level tie_word_embeddings (Mistral3Config defaults it to true) and an
    untied text_config; transformers 5.23 loads such a checkpoint untied, so its lm_head counts."""
    config = wrapper_config("mistral3", top_tie=False, text_tie=False)
    cfg = transformers.AutoConfig.for_model("mistral3", **{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert loaded.config.tie_word_embeddings  # the wrapper says tie ...
    assert loaded.lm_head.weight.data_ptr() != loaded.model.language_model.embed_tokens.weight.data_ptr()  # ... yet not
    spec = spec_from_config(saved, name="mistral3")
    assert not spec.tie_word_embeddings
    text_params = sum(p.numel() for n, p in loaded.named_parameters() if "vision" not in n and "projector" not in n)
    assert spec.params_total == text_params


def test_wrapper_with_an_unknown_text_model_is_unsupported():
    config = wrapper_config("mistral3", None, None)
    config["text_config"] = {**config["text_config"], "model_type": "qwen3_next"}
    with pytest.raises(UnsupportedArchitectureError, match="qwen3_next"):
        spec_from_config(config, name="x")


# ------------------------------------------------------------ KV layouts
WINDOWED = ["llama", "mistral", "mistral-nowindow", "ministral", "ministral3", "phi3", "starcoder2", "phimoe-bias",
            "gemma2", "gemma3_text", "cohere2", "cohere2-untied-bias", "exaone4", "exaone4-tied", "gpt_oss",
            "gpt_oss-nobias-tied", "qwen2-window", "qwen2_moe-sparse", "qwen3_moe-step", "smollm3-window",
            "llama4_text", "llama4_text-allmoe"]


@pytest.mark.parametrize("case", WINDOWED)
def test_windows_match_transformers_cache_layers(case):
    """Each layer's window is the one transformers' DynamicCache gives it (chunked layers included)."""
    config = tiny_config(case)
    spec = spec_from_config(config, name=case)
    cfg = transformers.AutoConfig.for_model(config["model_type"],
                                            **{k: v for k, v in config.items() if k != "model_type"})
    cache = transformers.DynamicCache(config=cfg)
    theirs = [layer.sliding_window if type(layer).__name__ == "DynamicSlidingWindowLayer" else None
              for layer in cache.layers]
    assert [a.window for a in spec.attention] == theirs
    assert any(theirs) == (case not in ("llama", "mistral-nowindow"))


@pytest.mark.parametrize("case", [c for c in WINDOWED if "layer_types" not in TINY[c]])
def test_window_rule_is_the_config_class_rule(case):
    """Without layer_types (configs saved before transformers wrote them), each architecture's rule gives the
    layer types its config class derives."""
    config = tiny_config(case)
    without = {**{k: v for k, v in config.items() if k != "layer_types"}, **TINY[case]}  # (cohere2 pops its pattern)
    without["model_type"] = config["model_type"]
    assert [a.window for a in spec_from_config(without, name=case).attention] == \
        [a.window for a in spec_from_config(config, name=case).attention]


def test_llama4_chunked_layers_keep_one_chunk():
    spec = spec_from_config(tiny_config("llama4_text"), name="llama4")
    assert [a.window for a in spec.attention] == [32, 32, 32, None]  # every 4th layer is NoPE, full attention
    assert [a.chunked for a in spec.attention] == [True, True, True, False]  # chunks, not sliding windows
    assert spec.kv_cache_elements(1000) == (3 * 32 + 1000) * 2 * 2 * 16


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v2-lite", "deepseek_v3", "deepseek_v3-noqlora"])
def test_mla_cache_is_the_compressed_latent(case):
    config = tiny_config(case)
    spec = spec_from_config(config, name=case)
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert all(a.kind == "mla" and a.mla_cache_dim == latent and a.window is None for a in spec.attention)
    assert spec.kv_bytes_per_token(2.0) == config["num_hidden_layers"] * latent * 2


def test_kv_cache_shapes_match_a_real_forward():
    """KV bytes per token per layer equal what a real (tiny, CPU) forward pass stores."""
    config = tiny_config("qwen3")
    spec = spec_from_config(config, name="qwen3")
    cfg = transformers.AutoConfig.for_model("qwen3", **{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, 10))
    cache = transformers.DynamicCache(config=cfg)
    from vramplan.runtime.generate import cache_argument

    with torch.inference_mode():
        model(ids, **{cache_argument(type(model)): cache}, use_cache=True)
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


@pytest.mark.parametrize("model_type,field,value", [
    ("llama", "vocab_size", 10**30),
    ("llama", "intermediate_size", 10**15),
    ("llama", "hidden_size", 10**7),
    ("llama", "num_hidden_layers", 10**5),
    ("llama", "num_attention_heads", 10**6),
    ("llama", "head_dim", 10**5),
    ("llama", "max_position_embeddings", 0),
    ("llama", "max_position_embeddings", 10**12),
    ("llama", "vocab_size", 1e30),
    ("mistral", "sliding_window", 10**12),
    ("mixtral", "num_local_experts", 10**7),
    ("qwen3_moe", "moe_intermediate_size", 10**12),
    ("llama4_text", "attention_chunk_size", 0),
    ("exaone4", "sliding_window_pattern", "LLLG"),  # transformers cannot derive layer_types from it either
    ("deepseek_v3", "kv_lora_rank", 10**9),
])
def test_absurd_sizes_are_config_errors_naming_the_field(model_type, field, value):
    case = next(c for c in sorted(TINY) if TINY[c].get("model_type", c) == model_type)
    config = {k: v for k, v in tiny_config(case).items() if k != "layer_types"}
    config[field] = value
    with pytest.raises(ConfigError, match=repr(field)):
        spec_from_config(config, name="bad")


def test_every_size_a_builder_reads_has_a_bound(monkeypatch):
    """Adding a builder that reads an unbounded size field fails here: bound it in FIELD_MAXIMUM."""
    from vramplan.planner.architectures import config as config_module

    read: set[str] = set()
    original = config_module.Cfg.int

    def recording(self, key, *args, **kwargs):
        read.add(key)
        return original(self, key, *args, **kwargs)

    monkeypatch.setattr(config_module.Cfg, "int", recording)
    for case in TINY:
        spec_from_config(tiny_config(case), name=case)
    not_sizes = {"_sliding_window_pattern", "moe_layer_end_index"}  # a pattern alias; -1 means "the last layer"
    assert read - not_sizes <= set(config_module.FIELD_MAXIMUM)
    assert "vocab_size" in read and "attention_chunk_size" in read


# ------------------------------------------------------------ property: any mutation is a spec or a ConfigError
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vramplan.planner.architectures.config import FIELD_MAXIMUM  # noqa: E402
from vramplan.planner.modelspec import ModelSpec  # noqa: E402

DELETE = object()
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-2, 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.lists(st.one_of(st.integers(-2, 8),
                       st.sampled_from(["full_attention", "sliding_attention", "chunked_attention"])),
             max_size=6),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.just(DELETE),
)
MUTABLE_KEYS = sorted(set(FIELD_MAXIMUM) | {"model_type", "layer_types", "tie_word_embeddings", "torch_dtype", "dtype",
                                              "attention_bias", "mlp_only_layers", "moe_layers", "no_rope_layers",
                                              "use_sliding_window", "text_config", "per_layer_config"})
POOL = sorted(TINY) + sorted(WRAPPED)


def pool_config(case: str) -> dict:
    if case in WRAPPED:
        return wrapper_config(case, None, None)
    return tiny_config(case)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(POOL), nested=st.booleans(),
       mutations=st.lists(st.tuples(st.sampled_from(MUTABLE_KEYS), JSON_VALUES), min_size=1, max_size=4))
def test_mutated_configs_give_a_spec_or_a_config_error(case, nested, mutations):
    config = pool_config(case)
    target = config["text_config"] if nested and "text_config" in config else config
    for key, value in mutations:
        if value is DELETE:
            target.pop(key, None)
        else:
            target[key] = value
    try:
        spec = spec_from_config(config, name=case)
    except (ConfigError, UnsupportedArchitectureError):
        return
    assert isinstance(spec, ModelSpec) and spec.params_total > 0 and len(spec.attention) == spec.num_layers
