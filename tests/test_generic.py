"""The generic paths for a model_type without a hand-written builder, checked against reality.

- safetensors headers (planner/generic.py): a tiny model saved with save_pretrained, counted from its headers
  alone, must give the builder's parameters, bytes under every scheme and KV cache;
- transformers on the meta device (runtime/inventory.py): the same, tensor by tensor (names, shapes, roles,
  kinds, layers), for every architecture the builders know;
- model types with no builder: parameters against the real model, KV cache against the cache a real forward
  fills, and a plan end to end through the CLI;
- recurrent / state-space models are refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan.planner.errors import ConfigError, UnsupportedArchitectureError
from vramplan.planner.generic import attention_layouts, classify, kv_width, refuse_unmodelled_state
from vramplan.planner.modelspec import (INVENTORY_HAND_WRITTEN, INVENTORY_HEADERS, INVENTORY_META_DEVICE, Kind, Role,
                               TensorSpec)
from vramplan.planner.quant import SCHEMES
from vramplan.planner.sources import load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[1]
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None or
                                 importlib.util.find_spec("transformers") is None, reason="needs the runtime extra")


def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def facts(spec, context: int = 100_000) -> dict:
    """What the planner counts from a spec: parameters, bytes under every scheme, the KV cache, the experts."""
    moe = spec.moe
    return dict(params=spec.params_total, active=spec.params_active, roles=spec.params_by_role(),
                schemes={n: s.bytes_of(spec.tensors) for n, s in SCHEMES.items()},
                kv_per_token=spec.kv_bytes_per_token(2.0), kv_elements=spec.kv_cache_elements(context),
                checkpoint=spec.checkpoint_bytes, dtype=spec.dtype, tied=spec.tie_word_embeddings,
                mlp_width=spec.mlp_width, largest_linear=spec.largest_layer_linear_numel,
                moe=None if moe is None else (moe.num_experts, moe.experts_per_token, moe.moe_layers,
                                              moe.expert_intermediate_size))


# ------------------------------------------------------------------ pure: names, layouts, refusals
@pytest.mark.parametrize("name,shape,in_layer,moe,expected", [
    ("model.layers.0.self_attn.q_proj.weight", (64, 64), True, False, (Role.ATTENTION, Kind.LINEAR)),
    ("model.layers.0.self_attn.q_norm.weight", (16,), True, False, (Role.NORM, Kind.NORM)),
    ("model.layers.0.self_attn.sinks", (4,), True, False, (Role.ATTENTION, Kind.OTHER)),
    ("transformer.h.0.attn.c_attn.bias", (192,), True, False, (Role.ATTENTION, Kind.BIAS)),
    ("transformer.h.0.attn.bias", (1, 1, 64, 64), True, False, (Role.ATTENTION, Kind.BUFFER)),
    ("model.layers.0.mlp.down_proj.weight", (64, 96), True, False, (Role.MLP, Kind.LINEAR)),
    ("model.layers.0.mlp.experts.3.w1.weight", (32, 64), True, True, (Role.EXPERT, Kind.EXPERTS)),
    ("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 64), True, True, (Role.EXPERT, Kind.EXPERTS_BIAS)),
    ("model.layers.0.block_sparse_moe.input_linear.weight", (4, 192, 64), True, True, (Role.EXPERT, Kind.EXPERTS)),
    ("model.layers.0.mlp.gate.weight", (4, 64), True, True, (Role.ROUTER, Kind.ROUTER)),
    ("model.layers.0.mlp.gate.weight", (4, 64), True, False, (Role.MLP, Kind.LINEAR)),
    ("model.layers.0.mlp.gate.e_score_correction_bias", (4,), True, True, (Role.ROUTER, Kind.BUFFER)),
    ("model.layers.0.mlp.moe_statics.e_score_correction_bias", (1, 4), True, True, (Role.ROUTER, Kind.ROUTER)),
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64), True, True, (Role.ROUTER, Kind.LINEAR)),
    ("model.layers.0.mlp.shared_experts.up_proj.weight", (64, 64), True, True, (Role.MLP, Kind.LINEAR)),
    ("model.embed_tokens.weight", (128, 64), False, False, (Role.EMBEDDING, Kind.EMBEDDING)),
    ("transformer.wpe.weight", (256, 64), False, False, (Role.EMBEDDING, Kind.EMBEDDING)),
    ("embed_out.weight", (128, 64), False, False, (Role.LM_HEAD, Kind.LINEAR)),
    ("lm_head.bias", (128,), False, False, (Role.LM_HEAD, Kind.BIAS)),
    ("transformer.ln_f.weight", (64,), False, False, (Role.NORM, Kind.NORM)),
    ("vision_tower.patch_embed.proj.weight", (64, 48), False, False, (Role.EMBEDDING, Kind.EMBEDDING)),
    ("multi_modal_projector.linear_1.weight", (64, 64), False, False, (Role.EMBEDDING, Kind.OTHER)),
])
def test_roles_and_kinds_from_names(name, shape, in_layer, moe, expected):
    assert classify(name, shape, in_layer, moe) == expected


def _attn(name, shape, layer=0):
    return TensorSpec(name=name, shape=shape, role=Role.ATTENTION, kind=Kind.LINEAR, layer=layer)


def test_kv_width_from_projections():
    p = "model.layers.0.self_attn"
    assert kv_width([_attn(f"{p}.k_proj.weight", (32, 64)), _attn(f"{p}.v_proj.weight", (32, 64))], 64, 64) == 64
    assert kv_width([_attn("h.0.attention.query_key_value.weight", (192, 64))], 64, 64) == 128  # fused: minus Q
    assert kv_width([_attn("h.0.attn.c_attn.weight", (64, 96))], 64, 64) == 32  # gpt2's Conv1D is [in, out]
    assert kv_width([_attn(f"{p}.o_proj.weight", (64, 64))], 64, 64) is None


def test_kv_layout_from_the_config():
    base = dict(model_type="x", hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    assert [a.kv_elements_per_token for a in attention_layouts({**base, "num_key_value_heads": 2}, "x")] == [64] * 4
    assert attention_layouts({**base, "multi_query": True}, "x")[0].num_kv_heads == 1
    falcon = {**base, "model_type": "falcon", "num_kv_heads": 1, "new_decoder_architecture": True}
    assert attention_layouts(falcon, "x")[0].num_kv_heads == 4  # falcon caches K/V broadcast to every head
    windows = {**base, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert [a.window for a in attention_layouts(windows, "x")] == [16, None, 16, None]
    assert {a.window for a in attention_layouts({**base, "sliding_window": 16}, "x")} == {16}  # transformers' rule
    assert {a.window for a in attention_layouts({**base, "sliding_window": 16, "use_sliding_window": False}, "x")} \
        == {None}
    mla = attention_layouts({**base, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4}, "x")[0]
    assert mla.kind == "mla" and mla.kv_elements_per_token == 20
    with pytest.raises(ConfigError, match="none of"):
        attention_layouts({"model_type": "x", "hidden_size": 64}, "x")


@pytest.mark.parametrize("config", [
    *({"model_type": mt} for mt in ("mamba", "mamba2", "falcon_h1", "qwen3_next", "lfm2", "jamba", "zamba", "rwkv",
                                    "recurrent_gemma")),
    {"model_type": "acme", "layer_types": ["full_attention", "linear_attention"]},
    {"model_type": "acme", "layers_block_type": ["attention", "mamba"]},
    {"model_type": "acme", "ssm_state_size": 16},
])
def test_recurrent_and_state_space_models_are_refused(config):
    with pytest.raises(UnsupportedArchitectureError, match="recurrent / state-space state"):
        refuse_unmodelled_state(config, "m")


def test_attention_only_layer_types_pass():
    refuse_unmodelled_state({"model_type": "acme", "layer_types": ["full_attention", "sliding_attention",
                                                                    "chunked_attention"]}, "m")


@pytest.mark.parametrize("mt", ["mamba", "qwen3_next"])
def test_recurrent_model_dir_is_one_line_exit_2(tmp_path, mt):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": mt, "hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(UnsupportedArchitectureError, match=mt):
        load_spec(resolve_model(str(tmp_path)))
    r = cli("inspect", "--model", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "does not model that state" in r.stderr


def test_the_hand_written_path_says_so():
    r = cli("inspect", "--model", "qwen3-8b", "--json")
    assert json.loads(r.stdout)["inventory"] == INVENTORY_HAND_WRITTEN
    r = cli("plan", "--model", "qwen3-8b", "-H", "rtx-4090", "--json")
    assert json.loads(r.stdout)["model"]["inventory"] == INVENTORY_HAND_WRITTEN


# ------------------------------------------------------------------ against the builders
def _save(config: dict, path: Path) -> Path:
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                                     if k != "model_type"})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    return path


def _tiny_cases():
    if importlib.util.find_spec("torch") is None:
        return []
    from test_architectures import TINY

    return sorted(TINY)


@needs_torch
@pytest.mark.parametrize("case", _tiny_cases())
def test_meta_device_inventory_equals_the_builder(case):
    from vramplan.planner.architectures import spec_from_config
    from vramplan.runtime.inventory import spec_from_transformers
    from test_architectures import tiny_config

    import transformers

    config = tiny_config(case)
    ours = spec_from_config(config, name=case, transformers_version=transformers.__version__)  # fp32 routers
    generic = spec_from_transformers(config, case, "")
    assert generic.inventory == INVENTORY_META_DEVICE
    row = lambda t: (t.name, t.shape, t.role, t.kind, t.layer)  # noqa: E731
    assert sorted(map(row, generic.tensors)) == sorted(map(row, ours.tensors))
    assert generic.attention == ours.attention
    assert facts(generic) == facts(ours)


HEADER_CASES = ["llama", "llama-tied-bias", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3_text", "deepseek_v3",
                "gpt_oss", "mixtral", "granitemoe", "ernie4_5_moe", "phi3"]


@needs_torch
@pytest.mark.parametrize("case", HEADER_CASES)
def test_header_inventory_equals_the_builder(case, tmp_path):
    """save_pretrained writes experts per expert (mixtral as w1/w2/w3, granitemoe fused under other names): the
    header path must still count what the builder counts, under every quantization scheme."""
    from vramplan.planner.generic import spec_from_headers
    from vramplan.planner.sources import apply_headers, normalized_headers, source_headers
    from test_architectures import tiny_config

    source = resolve_model(str(_save(tiny_config(case), tmp_path / case)))
    headers = source_headers(source)
    builder = load_spec(source)
    generic = apply_headers(spec_from_headers(source.config, normalized_headers(headers), name=case, source="",
                                              where=case), headers, case)
    assert builder.inventory == INVENTORY_HAND_WRITTEN and generic.inventory == INVENTORY_HEADERS
    assert facts(generic) == facts(builder)
    assert generic.checkpoint_bytes == sum(h.nbytes for h in headers)


# ------------------------------------------------------------------ model types without a builder
NO_BUILDER = {  # plain decoders transformers 5.23 builds; tiny sizes
    "stablelm": {},
    "gpt_neox": {},
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64, num_key_value_heads=None),
    "nemotron": {},
}
NO_BUILDER_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def _no_builder_model(mt: str):
    import torch
    import transformers

    values = {k: v for k, v in {**NO_BUILDER_BASE, **NO_BUILDER[mt]}.items() if v is not None}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(mt, **values))


def _cached_elements(model, tokens: int) -> int:
    """K and V elements the cache of a real forward over `tokens` tokens holds."""
    import torch

    with torch.no_grad():
        cache = model(torch.arange(1, tokens + 1)[None], use_cache=True).past_key_values
    return sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))


@needs_torch
@pytest.mark.parametrize("mt", sorted(NO_BUILDER))
def test_models_without_a_builder_match_the_real_model(mt, tmp_path):
    from vramplan.planner.architectures import BUILDERS
    from vramplan.runtime.inventory import spec_from_transformers

    assert mt not in BUILDERS
    model = _no_builder_model(mt)
    real_params = sum(p.numel() for p in model.parameters())
    real_kv = _cached_elements(model, 12)
    model.to(dtype=__import__("torch").bfloat16).save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    from_headers, from_meta = load_spec(source), spec_from_transformers(source.config, mt, "")
    assert from_headers.inventory == INVENTORY_HEADERS
    for spec in (from_headers, from_meta):
        assert spec.params_total == real_params
        assert spec.kv_cache_elements(12) == real_kv
    assert from_headers.params_by_role() == from_meta.params_by_role()
    assert from_headers.checkpoint_bytes == 2 * real_params


@needs_torch
def test_models_without_a_builder_plan_end_to_end(tmp_path):
    """stablelm from its checkpoint (headers; no torch in the CLI process) and gpt_neox from its config alone
    (transformers on the meta device), each planned through the CLI."""
    from vramplan.runtime.inventory import spec_from_transformers

    stablelm = tmp_path / "stablelm"
    _no_builder_model("stablelm").save_pretrained(stablelm)
    neox = tmp_path / "gpt_neox-config"
    neox.mkdir()
    neox_config = _no_builder_model("gpt_neox").config.to_dict()
    (neox / "config.json").write_text(json.dumps(neox_config))
    for path, mt, inventory, params in (
            (stablelm, "stablelm", INVENTORY_HEADERS, load_spec(resolve_model(str(stablelm))).params_total),
            (neox, "gpt_neox", INVENTORY_META_DEVICE, spec_from_transformers(neox_config, "x", "").params_total)):
        r = cli("plan", "--model", str(path), "--context", "256", "-H", "rtx-4090", "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert d["model"]["inventory"] == inventory and d["model"]["model_type"] == mt and d["choice"]
        assert d["model"]["params_total"] == params
    r = cli("plan", "--model", str(stablelm), "--context", "256", "-H", "rtx-4090")
    assert r.returncode == 0 and "no hand-written builder" in r.stderr and "generic path" in r.stderr
    r = cli("inspect", "--model", str(stablelm))
    assert r.returncode == 0 and "safetensors headers" in r.stdout


@needs_torch
def test_an_unknown_model_type_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "acme_lm", "hidden_size": 64}))
    r = cli("inspect", "--model", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unsupported architecture" in r.stderr and "acme_lm" in r.stderr
