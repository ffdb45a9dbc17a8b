"""Models as people name them: instruct and chat releases of catalog models plan offline with their base's config (and
say so); a hub id asks the hub first and falls back to the variant only where the hub does not answer; names of other
engines' formats and sizes written as contexts get a hint in their one-line error."""

from __future__ import annotations

import json

import pytest

from vramplan.planner.errors import PlanError, UnitError
from vramplan.planner.request import Request
from vramplan.planner.sources import (catalog, catalog_config, catalog_rows, match_variant, resolve_model,
                                     spec_from_config)
from vramplan.planner.units import parse_context

from fake_hub import TINY_LLAMA, FakeHub, cli, hub_env, llama_files, one_line_error


# ------------------------------------------------------------------ variants
def test_every_variant_is_a_real_hub_id_with_a_source_and_no_clash():
    seen = {}
    for e in catalog():
        for v in e.variants:
            org, name = v.id.split("/")
            assert org and name and v.source, v
            for key in {v.id.lower(), name.lower(), *v.aliases}:
                assert key not in seen, (key, seen.get(key), v.id)
                seen[key] = v.id
    bases = {e.id.lower() for e in catalog()} | {a for e in catalog() for a in e.aliases}
    assert not (set(seen) & bases), "a variant name must not shadow a catalog model"


@pytest.mark.parametrize("name, base", [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-70B"),
    ("llama-3.3-70b", "meta-llama/Llama-3.1-70B"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
])
def test_an_instruct_name_plans_offline_with_its_base_config_and_says_so(name, base):
    found = match_variant(name)
    assert found is not None and found[0].id == base
    src = resolve_model(name) if "/" not in name else None
    if src is not None:
        assert src.id == found[1].id and src.kind == "catalog"
        assert base in src.note and "offline" in src.note
        spec = spec_from_config(src.config, name=src.id)
        base_spec = spec_from_config(catalog_config(base), name=base)
        assert spec.weight_bytes("bf16") == base_spec.weight_bytes("bf16")


def test_a_variant_config_override_is_applied_and_named():
    found = match_variant("Qwen2.5-7B-Instruct")
    assert found is not None
    base, v = found
    src = resolve_model("Qwen2.5-7B-Instruct")
    for k, val in v.config.items():
        assert src.config[k] == val
    if v.config:
        assert str(sorted(v.config)) in src.origin


def test_models_lists_the_variants():
    rows = {r["id"]: r for r in catalog_rows()}
    assert "meta-llama/Llama-3.1-8B-Instruct" in rows["meta-llama/Llama-3.1-8B"]["variants"]


def test_the_cli_plans_an_instruct_short_name_offline(tmp_path):
    env = {**hub_env(tmp_path, type("H", (), {"url": "http://127.0.0.1:9"})()), "HF_HUB_OFFLINE": "1"}
    r = cli(env, "plan", "--model", "Llama-3.1-8B-Instruct", "-H", "rtx-4090", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"]["id"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert out["model"]["source"] == "built-in catalog: meta-llama/Llama-3.1-8B's config"


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h


def test_a_hub_instruct_id_reads_the_hubs_config_when_it_answers(hub, tmp_path):
    files, _ = llama_files()
    hub.add("meta-llama/Llama-3.1-8B-Instruct", files)
    r = cli(hub_env(tmp_path, hub), "inspect", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--json")
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["num_layers"] == TINY_LLAMA["num_hidden_layers"], "the hub's own config wins over the catalog's"


def test_a_hub_instruct_id_falls_back_to_its_variant_when_the_hub_is_unreachable(tmp_path):
    env = hub_env(tmp_path, type("H", (), {"url": "http://127.0.0.1:9"})())
    r = cli(env, "inspect", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_layers"] == 32
    assert "could not be reached" in r.stderr and "meta-llama/Llama-3.1-8B" in r.stderr


def test_an_unknown_hub_id_still_fails_when_the_hub_is_unreachable(tmp_path):
    env = hub_env(tmp_path, type("H", (), {"url": "http://127.0.0.1:9"})())
    one_line_error(cli(env, "plan", "--model", "acme/not-a-variant-7B", "-H", "rtx-4090"))


# ------------------------------------------------------------------ hints
@pytest.mark.parametrize("field, value, engine, says", [
    ("quant", "Q4_K_M", "vramplan", "is a GGUF file type: plan it with --engine llama.cpp"),
    ("quant", "q4_k_m", "vramplan", "Q4_K_M is a GGUF file type"),
    ("kv", "q8_0", "vramplan", "llama.cpp's cache type"),
    ("quant", "bnb-nf4", "llama.cpp", "is vramplan's scheme"),
    ("kv", "fp8", "llama.cpp", "is vramplan's cache dtype"),
    ("quant", "nf4", "vramplan", "did you mean"),
    ("quant", "Q4_K_N", "llama.cpp", "did you mean Q4_K_S or Q4_K_M?"),
])
def test_a_name_from_another_engine_or_a_typo_gets_a_hint(field, value, engine, says):
    kwargs = {"quant": {"quant": (value,)}, "kv": {"kv_dtype": (value,)}}[field]
    with pytest.raises(PlanError) as e:
        Request(context=4096, engine=engine, **kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_name_with_nothing_close_gets_the_plain_list():
    with pytest.raises(PlanError) as e:
        Request(context=4096, quant=("zzzzzz",))
    assert "did you mean" not in str(e.value) and "choose one of" in str(e.value)


@pytest.mark.parametrize("text, tokens", [("32kb", 32768), ("32 KiB", 32768), ("1MB", 1048576)])
def test_a_context_written_as_a_size_says_the_token_count(text, tokens):
    with pytest.raises(UnitError) as e:
        parse_context(text)
    assert f"= {tokens} tokens" in str(e.value)


def test_the_cli_hint_is_one_line(tmp_path):
    r = cli(hub_env(tmp_path, type("H", (), {"url": "http://127.0.0.1:9"})()), "plan", "--model", "llama-3.1-8b",
            "-H", "rtx-4090", "-q", "Q4_K_M")
    assert "--engine llama.cpp" in one_line_error(r)
