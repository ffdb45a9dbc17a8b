"""Several GPUs: the joint split of layers over GPUs (then the CPU), per-device breakdowns within each capacity,
uneven cards, the JSON contract (`gpu_layers_per_device`, `memory.gpus`) and the pipeline's speed at batch 1."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from vramplan.cli import app
from vramplan.planner.choice import OffloadMode
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.search import assess, plan
from vramplan.planner.sources import model_spec

ROOT = Path(__file__).resolve().parents[1]


def _profile(*names_counts: tuple[str, int]):
    """One machine with the GPUs of the named shipped profiles (host and link of the first)."""
    first = resolve_profile(names_counts[0][0])[0]
    gpus = tuple(replace(resolve_profile(name)[0].gpus[0], count=count) for name, count in names_counts)
    return replace(first, name="_".join(f"{c}x{n}" for n, c in names_counts), gpus=gpus)


def _within_capacity(p):
    for g in p.chosen.memory.gpus:
        assert g.total_bytes <= g.capacity_bytes and g.free_bytes >= 0


def test_70b_nf4_at_16k_fits_entirely_on_two_4090s():
    spec = model_spec("meta-llama/Llama-3.1-70B")
    two = plan(spec, _profile(("rtx-4090", 2)), Request(context=16384, quant=("bnb-nf4-dq",)))
    c = two.chosen.choice
    assert two.fits and c.gpu_layers == 80 and c.offload is OffloadMode.NONE
    assert len(c.gpu_layers_per_device) == 2 and all(k > 0 for k in c.gpu_layers_per_device)
    _within_capacity(two)
    # GPU 0 holds the embedding and the head as well, so it carries fewer layers
    assert c.gpu_layers_per_device[0] < c.gpu_layers_per_device[1]
    assert any("several GPUs" in w for w in two.warnings)
    one = plan(spec, _profile(("rtx-4090", 1)), Request(context=16384, quant=("bnb-nf4-dq",)))
    assert one.chosen.choice.gpu_layers < 80  # one card offloads


def test_uneven_cards_get_an_uneven_split_by_their_memory():
    spec = model_spec("meta-llama/Llama-3.1-8B")
    p = plan(spec, _profile(("rtx-3060-12gb", 1), ("rtx-4090", 1)), Request(context=8192, quant=("bf16",)))
    c = p.chosen.choice
    assert c.gpu_layers == 32 and c.offload is OffloadMode.NONE
    small, big = c.gpu_layers_per_device
    assert small > 0 and big > 0 and small != big
    _within_capacity(p)
    g0, g1 = p.chosen.memory.gpus
    assert g0.capacity_bytes < g1.capacity_bytes
    # GPU 0 filled first: its free memory is less than one more layer
    layer = (g1.weights_bytes - 0) / big
    assert g0.free_bytes < layer


def test_a_model_that_fits_one_gpu_stays_on_it_and_a_split_is_never_faster():
    spec = model_spec("meta-llama/Llama-3.1-8B")
    req = Request(context=8192, quant=("bf16",))
    two = plan(spec, _profile(("rtx-4090", 2)), req)
    one = plan(spec, _profile(("rtx-4090", 1)), req)
    assert two.chosen.choice.gpu_layers_per_device == (32, 0)
    assert two.chosen.speed.decode_tokens_per_s == pytest.approx(one.chosen.speed.decode_tokens_per_s)
    # the same model forced over both cards: the hop between them costs, nothing runs in parallel at batch 1
    hw = _profile(("rtx-4090", 2))
    split = replace(two.chosen.choice, gpu_layers_per_device=(16, 16))
    _, speed = assess(spec, hw, req, split)
    assert speed.decode_tokens_per_s < one.chosen.speed.decode_tokens_per_s


def test_per_device_budgets_and_bytes_add_up():
    """Every GPU's breakdown sums its terms; the layers' bytes split in proportion to the layer counts."""
    spec = model_spec("meta-llama/Llama-3.1-70B")
    p = plan(spec, _profile(("rtx-4090", 2)), Request(context=16384, quant=("bnb-nf4-dq",), vram_budget_bytes=22 << 30))
    assert p.fits
    for g in p.chosen.memory.gpus:
        assert g.capacity_bytes == 22 << 30 and g.total_bytes <= 22 << 30
        d = g.to_dict()
        terms = sum(v for k, v in d.items() if k not in ("total_bytes", "capacity_bytes", "free_bytes"))
        assert terms == d["total_bytes"]
    full = plan(spec, _profile(("rtx-4090", 2)), Request(context=16384, quant=("bnb-nf4-dq",)))
    assert full.chosen.choice.offload is OffloadMode.NONE
    k0, k1 = full.chosen.choice.gpu_layers_per_device
    g0, g1 = full.chosen.memory.gpus
    assert g1.kv_cache_bytes * k0 == g0.kv_cache_bytes * k1  # every layer of a dense model caches alike
    assert g1.stream_buffers_bytes == 0 and g1.cuda_context_bytes == g0.cuda_context_bytes  # a context per GPU


def test_json_contract_has_per_device_lists(tmp_path):
    doc = yaml.safe_load((ROOT / "profiles" / "rtx-4090.yaml").read_text())
    doc["name"] = "two-4090s"
    doc["gpus"][0]["count"] = 2
    path = tmp_path / "two-4090s.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(app, ["plan", "--model", "meta-llama/Llama-3.1-70B", "-H", str(path), "--context", "16k",
                                 "--quant", "bnb-nf4-dq", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["choice"]["gpu_layers"] == 80 and sum(out["choice"]["gpu_layers_per_device"]) == 80
    gpus = out["memory"]["gpus"]
    assert len(gpus) == 2 and out["memory"]["gpu"] == gpus[0]
    chosen = next(c for c in out["candidates"] if c["fits"])
    assert chosen["vram_bytes"] == sum(g["total_bytes"] for g in chosen["memory"]["gpus"])
    assert out["constants"]["gpu1_capacity_bytes"]["value"] == gpus[1]["capacity_bytes"]
    text = CliRunner().invoke(app, ["plan", "--model", "meta-llama/Llama-3.1-70B", "-H", str(path), "--context",
                                    "16k", "--quant", "bnb-nf4-dq"])
    assert text.exit_code == 0 and "GPU0" in text.stdout and "GPU1" in text.stdout
