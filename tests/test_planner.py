"""The planner: toy budgets with exact expected plans, realistic cases whose numbers add up, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vramplan.planner.architectures import spec_from_config
from vramplan.planner.errors import PlanError
from vramplan.planner.profile_yaml import profile_from_dict
from vramplan.planner.memory import layer_costs, workspace_bytes
from vramplan.planner.plan import Plan
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec
from vramplan.planner.units import GiB

ROOT = Path(__file__).resolve().parents[1]

TOY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
# By hand, bf16: a layer = q 64x64 + k 32x64 + v 32x64 + o 64x64 + MLP 3x64x128 + 2 norms x 64
LAYER = (4096 + 2048 + 2048 + 4096 + 3 * 64 * 128 + 128) * 2  # 73,984 B
EMBED = 256 * 64 * 2  # 32,768 B (on the CPU once anything is offloaded)
HEAD = 256 * 64 * 2 + 64 * 2  # lm_head + final norm: 32,896 B (always on the GPU)
KV_LAYER_64 = 64 * 2 * 2 * 16 * 2  # 64 tokens x K,V x 2 KV heads x head_dim 16 x 2 B = 8,192 B
# Workspace with a 1-token prefill chunk: hidden 1x64x2x4 + qkv (4+2+2)x16x2 + MLP 128x2x3
# + logits 256x6 + one layer's K,V at 64 tokens in bf16
WS = 512 + 256 + 768 + 1536 + KV_LAYER_64  # 11,264 B
FULL = 4 * LAYER + 4 * KV_LAYER_64 + EMBED + HEAD + WS  # 405,632 B


def toy_hw(gpu_bytes: int, *, ram_bytes: int = 1 << 30, ram_bw="1 GB/s", link_bw="100 GB/s", cpu="1 TFLOPS",
           gpu: bool = True, calibration=None):
    d = {
        "schema_version": 1, "name": "toy", "description": "toy budget", "source": "test", "measured": False,
        "unified_memory": False,
        "gpus": [{"name": "Toy GPU", "count": 1, "memory": f"{gpu_bytes} B", "memory_bandwidth": "1000 GB/s",
                  "bf16_compute": "100 TFLOPS", "compute_capability": "9.0"}] if gpu else [],
        "host": {"ram": f"{ram_bytes} B", "ram_bandwidth": ram_bw, "cpu_cores": 8, "cpu_bf16_compute": cpu,
                 "eager_dispatch_per_layer": "0 us"},  # toy arithmetic: no host-bound decode
        "link": {"name": "toy link", "h2d_pinned": link_bw, "h2d_pageable": link_bw, "d2h_pinned": link_bw,
                 "d2h_pageable": link_bw} if gpu else None,
        "overheads": {"cuda_context": "0 B", "allocator_reserve": "0 B", "kernel_launch": "0 us"} if gpu else
        {"cuda_context": "0 B", "allocator_reserve": "0 B", "kernel_launch": "0 us"},
        "calibration": calibration, "notes": [],
    }
    return profile_from_dict(d)


def toy_req(**kw):
    base = dict(context=64, prefill_chunk=1, headroom_bytes=0, runtime_base_ram_bytes=0, quant=("bf16",),
                kv_dtype=("bf16",))
    base.update(kw)
    return Request(**base)


@pytest.fixture(scope="module")
def toy():
    return spec_from_config(TOY, name="toy")


def test_toy_hand_counts(toy):
    costs = layer_costs(toy, SCHEMES["bf16"], KV_SCHEMES["bf16"], toy_req())
    assert costs.weights == (LAYER,) * 4 and costs.kv == (KV_LAYER_64,) * 4
    assert costs.embed_bytes == EMBED and costs.head_bytes == HEAD
    assert sum(workspace_bytes(toy, SCHEMES["bf16"], KV_SCHEMES["bf16"], toy_req()).values()) == WS


def test_toy_fits_exactly_at_capacity(toy):
    p = plan(toy, toy_hw(FULL), toy_req())
    assert p.fits and p.choice.offload == "none" and p.choice.gpu_layers == 4
    assert p.to_dict()["memory"]["gpu"]["total_bytes"] == FULL
    assert p.to_dict()["memory"]["gpu"]["free_bytes"] == 0


def test_toy_one_byte_short_offloads_with_exact_layer_counts(toy):
    # stream: n layers + all KV + 2 slots of one layer; cpu: n layers with their own KV
    stream_2 = 2 * LAYER + 4 * KV_LAYER_64 + 2 * LAYER + HEAD + WS
    assert stream_2 <= FULL - 1 < 3 * LAYER + 4 * KV_LAYER_64 + 2 * LAYER + HEAD + WS
    p = plan(toy, toy_hw(FULL - 1, ram_bw="1 GB/s", link_bw="100 GB/s"), toy_req())
    assert (p.choice.offload, p.choice.gpu_layers) == ("stream", 2)  # slow RAM: streaming wins
    assert p.to_dict()["memory"]["gpu"]["total_bytes"] == stream_2
    p = plan(toy, toy_hw(FULL - 1, ram_bw="1000 GB/s", link_bw="0.001 GB/s", cpu="100 TFLOPS"), toy_req())
    assert (p.choice.offload, p.choice.gpu_layers) == ("cpu", 3)  # a crawling link: the CPU computes layer 3
    mem = p.to_dict()["memory"]
    assert mem["gpu"]["total_bytes"] == 3 * LAYER + 3 * KV_LAYER_64 + HEAD + WS
    assert mem["cpu"]["weights_bytes"] == LAYER + EMBED and mem["cpu"]["kv_cache_bytes"] == KV_LAYER_64


def test_toy_forced_choices(toy):
    p = plan(toy, toy_hw(FULL * 10), toy_req(gpu_layers=1, offload="cpu"))
    assert (p.choice.gpu_layers, p.choice.offload) == (1, "cpu")
    p = plan(toy, toy_hw(FULL - 1), toy_req(gpu_layers=99))
    assert not p.fits and "GPU needs" in p.reasons[0]
    p = plan(toy, toy_hw(FULL * 10), toy_req(vram_budget_bytes=FULL))
    assert p.fits and p.choice.offload == "none"
    p = plan(toy, toy_hw(FULL * 10), toy_req(vram_budget_bytes=FULL - 1, offload="cpu"))
    assert (p.choice.offload, p.choice.gpu_layers) == ("cpu", 3)


def test_toy_ram_too_small_says_what_would_fit(toy):
    # GPU of nothing useful, RAM for the model at a short context only
    hw = toy_hw(HEAD + WS, ram_bytes=4 * LAYER + EMBED + 4 * 64 * 128 * 2 + 2 * 1024)
    p = plan(toy, hw, Request(context=4096, prefill_chunk=1, headroom_bytes=0, runtime_base_ram_bytes=0))
    assert not p.fits
    assert p.alternatives and all(a.max_context_tokens < 4096 for a in p.alternatives)
    assert any("what would fit instead" in r for r in p.reasons)


def test_llama_8b_32k_fits_entirely_in_bf16_on_24gib():
    p = plan(model_spec("llama-3.1-8b"), resolve_profile("rtx-4090")[0], Request(context=32768, quant=("bf16",)))
    assert p.fits and p.chosen.fits_on_gpu and p.choice.weight_quant == "bf16"
    gpu = p.to_dict()["memory"]["gpu"]
    assert gpu["weights_bytes"] == 8_030_261_248 * 2
    assert gpu["kv_cache_bytes"] == 32768 * 131072
    assert gpu["total_bytes"] <= gpu["capacity_bytes"] and gpu["capacity_bytes"] >= 24 * GiB - 1 * GiB


def test_llama_70b_on_a_4090_offloads_and_the_numbers_add_up():
    spec = model_spec("llama-3.1-70b")
    p = plan(spec, resolve_profile("rtx-4090")[0], Request(context=32768))
    d = p.to_dict()
    assert d["fits"] and not any(c["fits_on_gpu"] for c in d["candidates"])
    c = d["choice"]
    assert 0 < c["gpu_layers"] < c["total_layers"] == 80 and c["offload"] in ("stream", "cpu")
    for dev in ("gpu", "cpu"):
        m = d["memory"][dev]
        terms = sum(v for k, v in m.items()
                    if k.endswith("_bytes") and k not in ("total_bytes", "capacity_bytes", "free_bytes"))
        assert terms == m["total_bytes"] <= m["capacity_bytes"]
        assert m["free_bytes"] == m["capacity_bytes"] - m["total_bytes"]
    # every weight byte is somewhere: GPU + RAM weights = the whole scheme's weights
    scheme = SCHEMES[c["weight_quant"]]
    assert d["memory"]["gpu"]["weights_bytes"] + d["memory"]["cpu"]["weights_bytes"] == scheme.bytes_of(spec.tensors)
    assert d["predicted"]["decode_tokens_per_s"] <= d["ceiling"]["decode_tokens_per_s"]


def test_forced_bf16_all_layers_on_a_small_gpu_is_refused_with_numbers():
    r = subprocess.run([sys.executable, "cli.py", "plan", "-m", "llama-3.1-8b", "-c", "32k", "-H", "rtx-3060-12gb",
                        "--quant", "bf16", "--gpu-layers", "99"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1
    assert "nothing fits" in r.stdout and "GPU needs 20.57 GiB > capacity 12.00 GiB" in r.stdout


def test_ceiling_reproduces_the_bandwidth_rule():
    """A ~30 GB model on a 1,000 GB/s GPU caps near 33 tokens/s."""
    spec = model_spec("qwen2.5-14b")  # 29.5 GB in bf16
    hw = toy_hw(80 * GiB)
    p = plan(spec, hw, Request(context=16, quant=("bf16",), kv_dtype=("bf16",)))
    weights = SCHEMES["bf16"].bytes_of(spec.tensors) - spec.tensor("model.embed_tokens.weight").bytes("bf16")
    assert p.predicted.ceiling_decode_tokens_per_s == pytest.approx(1000e9 / weights, rel=0.01)
    assert 30 < p.predicted.ceiling_decode_tokens_per_s < 36


def test_prefer_orders_choices():
    spec = model_spec("llama-3.1-8b")
    hw = resolve_profile("rtx-4090")[0]
    q = plan(spec, hw, Request(context=8192, prefer="quality")).chosen
    s = plan(spec, hw, Request(context=8192, prefer="speed")).chosen
    assert q.quality_cost_pct == 0.0
    assert s.speed.decode_tokens_per_s >= q.speed.decode_tokens_per_s
    all_speeds = [c.speed.decode_tokens_per_s for c in plan(spec, hw, Request(context=8192)).candidates if c.fits]
    assert s.speed.decode_tokens_per_s == max(all_speeds)


def test_cpu_only_machine_plans_on_the_cpu():
    p = plan(model_spec("qwen2.5-0.5b"), resolve_profile("cpu-ddr5-desktop")[0], Request(context=2048))
    assert p.fits and p.choice.compute_device == "cpu" and p.choice.gpu_layers == 0
    assert p.to_dict()["memory"]["gpu"] is None


def test_quantized_kv_refused_for_sliding_window_models():
    p = plan(model_spec("gemma-2-9b"), resolve_profile("rtx-4090")[0], Request(context=8192, kv_dtype=("quanto-int4",)))
    assert not p.fits and "sliding-window" in p.candidates[0].reason


def test_plan_round_trips_through_yaml():
    p = plan(model_spec("llama-3.1-70b"), resolve_profile("rtx-4090")[0], Request(context=8192))
    d = p.to_dict()
    back = Plan.from_dict(yaml.safe_load(yaml.safe_dump(d)))
    assert back.to_dict()["choice"] == d["choice"]
    assert back.predicted.decode_tokens_per_s == pytest.approx(p.predicted.decode_tokens_per_s)
    assert back.request == p.request


@pytest.mark.parametrize("kw", [
    dict(context=0), dict(context=-5), dict(context=100, batch=0), dict(context=100, prefer="cheap"),
    dict(context=100, quant=("int3",)), dict(context=100, kv_dtype=("int8",)), dict(context=100, offload="disk"),
    dict(context=100, gpu_layers=-1), dict(context=100, prompt_tokens=200), dict(context=100, prefill_chunk=0),
])
def test_bad_requests(kw):
    with pytest.raises(PlanError):
        Request(**kw)


def test_contradictions_against_the_hardware():
    spec = model_spec("qwen2.5-0.5b")
    cpu = resolve_profile("cpu-ddr5-desktop")[0]
    for kw in (dict(gpu_layers=4), dict(offload="stream"), dict(vram_budget_bytes=GiB)):
        with pytest.raises(PlanError):
            plan(spec, cpu, Request(context=1024, **kw))
    with pytest.raises(PlanError):
        plan(spec, resolve_profile("rtx-4090")[0], Request(context=1024, vram_budget_bytes=100 * GiB))


@pytest.mark.parametrize("args", [
    ["-c", "0"], ["-c", "-4k"], ["-c", "99m"], ["-c", "32k", "--quant", "int3"], ["-c", "32k", "--vram-budget", "24"],
    ["-c", "32k", "--offload", "disk"], ["-c", "32k", "-H", "no-such-profile"],
    ["-c", "1k", "-H", "cpu-ddr5-desktop", "--gpu-layers", "3"],
])
def test_cli_bad_input_is_one_line_exit_2(args):
    r = subprocess.run([sys.executable, "cli.py", "plan", "-m", "llama-3.1-8b", *args], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plan_json_fields_and_no_torch_import(tmp_path):
    code = ("import sys, runpy; sys.argv = ['vramplan', 'plan', '-m', 'llama-3.1-8b', '-c', '32k', '-H', 'rtx-4090', "
            "'--json', '--save', %r]; import cli\ntry:\n    cli.main()\nexcept SystemExit as e:\n    rc = e.code\n"
            "sys.stderr.write('TORCH' if 'torch' in sys.modules else "
            "'NOTORCH')\nsys.exit(rc)") % str(tmp_path / "p.yaml")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stderr.endswith("NOTORCH")
    d = json.loads(r.stdout)
    for key in ("fits", "choice", "memory", "ceiling", "predicted", "max_context_tokens", "candidates"):
        assert key in d
    for key in ("weight_quant", "kv_dtype", "gpu_layers", "total_layers", "offload"):
        assert key in d["choice"]
    for key in ("capacity_bytes", "total_bytes", "weights_bytes", "kv_cache_bytes"):
        assert isinstance(d["memory"]["gpu"][key], int)
    assert isinstance(d["memory"]["cpu"]["total_bytes"], int)
    assert d["ceiling"]["decode_tokens_per_s"] > 0 and d["predicted"]["ttft_s"] > 0
    assert all("weight_quant" in c and "fits" in c and "memory" in c for c in d["candidates"])
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["choice"] == d["choice"]


def test_a_quantized_kv_cache_in_ram_warns_of_allocator_retention():
    """Measured (bench/results/malloc-cpu-dev.md): on a CPU a quanto cache's peak RSS reaches bf16's or more, because
    glibc keeps the dequantized copies it frees; the plan says so wherever such a cache lives in RAM, and only there."""
    spec = model_spec("qwen2.5-0.5b")

    def warned(profile, kv, **kw):
        p = plan(spec, resolve_profile(profile)[0], Request(context=4096, quant=("bf16",), kv_dtype=(kv,), **kw))
        assert p.chosen is not None
        return any("glibc keeps what they free" in w for w in p.warnings)

    assert warned("cpu-ddr5-desktop", "quanto-int4") and warned("cpu-ddr5-desktop", "fp8")
    assert not warned("cpu-ddr5-desktop", "bf16")
    assert not warned("h100-sxm", "quanto-int4")  # on the GPU: the caching allocator, measured there
    assert warned("h100-sxm", "quanto-int4", gpu_layers=4, offload="cpu")


@pytest.mark.parametrize("model, hardware, context, forced", [
    ("deepseek-ai/DeepSeek-V3", "h200", 131072, {}),  # dense and MoE layers, MLA
    ("Qwen/Qwen3-30B-A3B", "rtx-3060-12gb", 8192, {}),  # routed experts of some layers in RAM
    ("google/gemma-3-27b-it", "rtx-4090", 32768, {"gpu_layers": 40, "offload": "cpu"}),  # sliding + full, CPU layers
    ("meta-llama/Llama-3.1-70B", "rtx-4090", 8192, {"gpu_layers": 30, "offload": "stream"}),
])
def test_pricing_each_kind_of_layer_once_changes_no_number(model, hardware, context, forced, monkeypatch):
    """work.DecodeWork.kinds groups layers of equal work so that a decode prices each kind once per device (and
    work.prefill_kinds a prefill); every number of the plan equals the one priced layer by layer (each layer its own
    kind), up to rounding."""
    from vramplan.planner import speed, work

    spec, hw = model_spec(model), resolve_profile(hardware)[0]
    req = Request(context=context, **forced)
    grouped = plan(spec, hw, req).to_dict()  # every estimate made now (they are made when read), before the patches
    kinds = work.decode_work(spec, SCHEMES["bf16"], KV_SCHEMES["bf16"], 1, context,
                              layer_costs(spec, SCHEMES["bf16"], KV_SCHEMES["bf16"], req)).kinds
    assert len(kinds) == spec.num_layers and 1 <= len(set(kinds)) <= 4 < spec.num_layers
    monkeypatch.setattr(work.DecodeWork, "kinds", property(lambda w: list(range(len(w.weights_bytes)))))
    monkeypatch.setattr(work, "_SPEC_MEMO", work.ObjectMemo(256))  # no work grouped before
    grouped_prefill = work.prefill_kinds

    def each_layer(spec, prompt, chunk):  # the prefill's kinds too: one per layer
        kinds, values = grouped_prefill(spec, prompt, chunk)
        return list(range(len(kinds))), [values[k] for k in kinds]

    monkeypatch.setattr(speed, "prefill_kinds", each_layer)
    _assert_close(plan(spec, hw, req).to_dict(), grouped)


def _assert_close(a, b, where="plan"):
    """Equal, floats within rounding: n equal layers priced once and multiplied by n round differently from n sums."""
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-12), where
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_secant_max_finds_the_boundary_bisection_finds():
    """The slack only chooses where to probe: for any monotone ok, with a slack linear, curved, flat or lying, the
    answer is bisect_max's, within twice bisection's probes (plus the two ends)."""
    import math
    import random

    from vramplan.planner.search import bisect_max, secant_max

    rng = random.Random(7)
    slacks = {"linear": lambda x, b: b - x, "curved": lambda x, b: b * b - x * x + 0.5 * (b - x) * b,
              "stepped": lambda x, b: (b - x) // 2048 * 2048 + (1 if x <= b else -1),
              "flat": lambda x, b: 1.0, "lying": lambda x, b: x - b}
    for _ in range(300):
        lo, hi = 1, rng.choice([2, 17, 4096, 131072, 1_000_000])
        b = rng.randint(lo - 1, hi)  # ok(x) is x <= b: b = lo - 1 is "none", b = hi is "all"
        for name, slack in slacks.items():
            probes = []

            def probe(x, slack=slack, b=b):
                probes.append(x)
                assert lo <= x <= hi
                return x <= b, slack(x, b)

            assert secant_max(probe, lo, hi) == bisect_max(lambda x: x <= b, lo, hi) == b, (name, lo, hi, b)
            assert len(probes) <= 2 * math.ceil(math.log2(hi - lo + 1)) + 2, (name, hi, b, len(probes))
            if name == "linear" and hi > 4096:
                assert len(probes) <= 6, (hi, b, probes)
    # a slack with no finite line through it (infinite bytes to spare): bisection's step, not a ValueError
    assert secant_max(lambda x: (x <= 1000, float("inf") if x <= 1000 else -1.0), 1, 131072) == 1000


@pytest.mark.parametrize("model,hardware,context", [("llama-3.1-8b", "rtx-4090", "32k"),
                                                    ("qwen3-30b-a3b", "rtx-4090", "8k"),
                                                    ("llama-3.1-8b", "cpu-epyc-server", "8k")])
def test_longest_context_is_the_one_bisection_finds(monkeypatch, model, hardware, context):
    """Every candidate's and every engine's longest resident context, found by probing where the bytes to spare run
    out, is what plain bisection over the whole range finds."""
    import vramplan
    from vramplan.planner import search
    from vramplan.planner.engines import llamacpp

    def longest(p):
        return ([(c.weight_quant, c.kv_dtype, c.max_context_tokens) for c in p.candidates]
                + [(e.engine, e.weight_quant, e.kv_dtype, e.max_context_tokens) for e in p.engines])

    fast = longest(vramplan.plan(model, hardware=hardware, context=context))
    bisect = lambda probe, lo, hi: search.bisect_max(lambda x: probe(x)[0], lo, hi)  # noqa: E731
    monkeypatch.setattr(search, "secant_max", bisect)
    monkeypatch.setattr(llamacpp, "secant_max", bisect)
    assert fast == longest(vramplan.plan(model, hardware=hardware, context=context))
    assert any(n for *_, n in fast)


@pytest.mark.parametrize("model,hardware,context,forced", [
    ("meta-llama/Llama-3.1-8B", "rtx-4090", 32768, {}),
    ("Qwen/Qwen3-30B-A3B", "rtx-3060-12gb", 8192, {}),
    ("meta-llama/Llama-3.1-70B", "rtx-4090", 8192, {"gpu_layers": 30, "offload": "cpu"}),  # op offload's TTFT
])
def test_pending_estimates_equal_those_made_at_once(model, hardware, context, forced, monkeypatch):
    """speed.estimate prices the decode at the start now and the rest when a field is first read
    (SpeedEstimate.pending), as llama.cpp's candidates do their op-offload prompt time: every candidate's estimate,
    read, equals the one made at once, field for field; a replace or a comparison reads it whole; and a name it lacks
    is still an AttributeError."""
    from dataclasses import fields, replace

    from vramplan.planner import speed
    from vramplan.planner.engines.llamacpp import LLAMA_CPP
    from vramplan.planner.search import VRAMPLAN

    makes = {}
    real = speed.SpeedEstimate.pending.__func__

    def recording(cls, decode, make):
        est = real(cls, decode, make)
        makes[id(est)] = (est, make)
        return est

    monkeypatch.setattr(speed.SpeedEstimate, "pending", classmethod(recording))
    spec, hw = model_spec(model), resolve_profile(hardware)[0]
    for engine in (VRAMPLAN, LLAMA_CPP):
        req = engine.check(spec, hw, Request(context=context, **forced))[0]
        cands = [c for c in engine.candidates(spec, hw, req) if c.speed is not None]
        assert cands and all("_make" in c.speed.__dict__ for c in cands)  # none read yet
        pending = cands[-1].speed
        assert pending.decode_tokens_per_s > 0 and "ttft_s" not in pending.__dict__
        whole = replace(pending, ttft_s=1.0)  # replace reads every field
        assert whole.decode_tokens_per_s_full_context == pending.decode_tokens_per_s_full_context
        assert "_make" not in pending.__dict__
        with pytest.raises(AttributeError):
            pending.no_such_field
        for c in cands:
            est, make = makes[id(c.speed)]
            assert est is c.speed
            at_once = make()
            assert c.speed == at_once and c.speed.decode_tokens_per_s == at_once.decode_tokens_per_s
            assert all(getattr(c.speed, f.name) == getattr(at_once, f.name) for f in fields(at_once))
