"""Where --model comes from: local directories (safetensors headers), the HF cache, the catalog."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from fake_hub import safetensors_bytes
from vramplan.planner.architectures import spec_from_config
from vramplan.planner.errors import CheckpointError, ModelNotFoundError, VramplanError
from vramplan.planner.sources import (
    catalog, find_in_catalog, model_spec, read_safetensors_header, resolve_model,
)

ROOT = Path(__file__).resolve().parents[1]
REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "hf-configs"

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 256, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def cli(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]):
    """A real safetensors file (zeros), written by hand: header JSON + data."""
    path.write_bytes(safetensors_bytes(tensors)[0])


def tiny_dir(tmp_path: Path, dtype="BF16") -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    spec = spec_from_config(TINY_LLAMA, name="t")
    write_safetensors(d / "model.safetensors", {t.name: (dtype, t.shape) for t in spec.tensors})
    return d


def test_catalog_holds_every_reference_config():
    ids = {e.id for e in catalog()}
    for f in REF.glob("*.json"):
        org, name = f.stem.split("--", 1)
        name = name.split(".resaved")[0]
        assert f"{org}/{name}" in ids


@pytest.mark.parametrize("name,expected", [
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),
    ("META-LLAMA/LLAMA-3.1-8B", "meta-llama/Llama-3.1-8B"),
    ("mixtral", "mistralai/Mixtral-8x7B-v0.1"),
    ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B"),
])
def test_catalog_lookup(name, expected):
    assert find_in_catalog(name).id == expected


def test_ambiguous_and_unknown_names():
    with pytest.raises(ModelNotFoundError, match="ambiguous.*Llama-3.1-70B"):
        find_in_catalog("llama-3.1")
    with pytest.raises(ModelNotFoundError, match="close names: .*llama-3.2-1b"):
        find_in_catalog("llama-3.2-1c")


def test_local_directory_reads_safetensors_headers(tmp_path):
    d = tiny_dir(tmp_path, dtype="F32")
    spec = model_spec(str(d))
    assert spec.dtype == "float32"  # the checkpoint, not the config's bfloat16, decides
    assert spec.checkpoint_bytes == spec.params_total * 4
    assert all(t.dtype == "float32" for t in spec.tensors)
    assert resolve_model(str(d)).kind == "directory"


def test_sharded_checkpoint_with_index(tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    spec = spec_from_config(TINY_LLAMA, name="t")
    half = len(spec.tensors) // 2
    shards = {"model-00001-of-00002.safetensors": spec.tensors[:half],
              "model-00002-of-00002.safetensors": spec.tensors[half:]}
    for f, ts in shards.items():
        write_safetensors(d / f, {t.name: ("BF16", t.shape) for t in ts})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {t.name: f for f, ts in shards.items() for t in ts}}))
    assert model_spec(str(d)).checkpoint_bytes == spec.params_total * 2


def test_shape_mismatch_between_config_and_checkpoint(tmp_path):
    d = tiny_dir(tmp_path)
    cfg = dict(TINY_LLAMA, intermediate_size=128)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        model_spec(str(d))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "huge-length", "short"])
def test_unreadable_safetensors_header(tmp_path, damage):
    d = tiny_dir(tmp_path)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        f.write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}" + raw[28:])
    elif damage == "huge-length":
        f.write_bytes(struct.pack("<Q", 10**15) + raw[8:])
    else:
        f.write_bytes(b"abc")
    with pytest.raises(CheckpointError):
        read_safetensors_header(f)
    r = cli("inspect", "--model", str(d))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_hf_cache_lookup_offline(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    src = resolve_model("acme/tiny-llama")
    assert src.kind == "hf-cache" and src.path == snap
    assert model_spec("acme/tiny-llama").num_layers == 2


@pytest.mark.parametrize("content,match", [
    ('{"model_type": "llama", "hidden_size": 64', "not valid JSON"),
    ('{"model_type": "llama"}', "missing required field"),
    ('{"model_type": "acme_lm", "hidden_size": 64}', "unsupported architecture"),
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"hidden_size": 64}', "no model_type"),
])
def test_bad_config_files_one_line_exit_2(tmp_path, content, match):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(content)
    with pytest.raises(VramplanError, match=match):
        model_spec(str(d))
    r = cli("inspect", "--model", str(d))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and match.split()[0] in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_unknown_model_and_missing_dir_exit_2():
    for name in ["no-such-model-anywhere", "./no/such/dir"]:
        r = cli("inspect", "--model", name)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_inspect_json_has_the_promised_fields():
    r = cli("inspect", "--model", "meta-llama/Llama-3.1-8B", "--json")
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["params_total"] == 8_030_261_248
    assert facts["params_active"] == 8_030_261_248
    assert facts["num_layers"] == 32
    assert facts["kv_bytes_per_token"] == 131_072
    assert facts["weight_bytes"]["bf16"] == 8_030_261_248 * 2


def test_models_json_lists_the_catalog():
    r = cli("models", "--json")
    d = json.loads(r.stdout)
    rows = d["models"]
    assert d["schema_version"] == 1 and len(rows) == len(catalog())
    moe = next(r for r in rows if r["id"] == "Qwen/Qwen3-30B-A3B")
    assert moe["params_active"] < moe["params_total"]


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "intermediate_size", "head_dim", "tie_word_embeddings", "sliding_window",
                     "layer_types", "num_local_experts", "num_experts_per_tok", "torch_dtype"]),
    st.one_of(st.integers(-4, 300), st.text(max_size=6), st.booleans(), st.none(),
              st.sampled_from(["llama", "mixtral", "gemma2", "qwen3", "deepseek_v3", "phi3"]),
              st.lists(st.sampled_from(["full_attention", "sliding_attention", "x"]), max_size=4)),
))
def test_any_config_builds_or_raises_our_error(cfg):
    try:
        spec = spec_from_config(cfg, name="fuzz")
    except VramplanError:
        return
    assert spec.params_total > 0 and spec.num_layers == len(spec.attention)
