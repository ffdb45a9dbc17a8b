"""MLA (deepseek_v2/v3) as transformers runs it, and the router tensors transformers keeps in fp32.

- transformers (5.17-5.24) caches MLA's compressed latent and re-expands the whole cached context to full K and V
  with kv_b_proj in every layer at every forward (`expand_kv`): the speed model counts that up-projection per decode
  token and per prefill chunk, the memory model its temporary K and V; on a CPU, torch's SDPA falls back to its math
  path for V's head dim unlike K's and materialises fp32 scores (a CPU-only workspace term).
- which router tensors a loaded model holds in fp32 depends on the transformers version
  (planner/architectures/fp32.py): the planner follows the version it is given, the runtime passes the installed one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cli_helpers import isolate, run_cli as main
from vramplan.planner.architectures import spec_from_config
from vramplan.planner.architectures.fp32 import VERIFIED_TRANSFORMERS
from vramplan.planner.engines.llamacpp_rules import as_run
from vramplan.planner.memory import SDPA_MATH_KV_FP32_COPIES, SDPA_MATH_SCORE_FP32_COPIES, layer_costs, workspace_bytes
from vramplan.planner.profile_yaml import profile_from_dict
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.speed import _DEFAULTS, DEFAULT_CPU_DECODE_ATTENTION_EFFICIENCY, estimate
from vramplan.planner.work import decode_work, prefill_expand_flop_per_layer

# A small DeepSeek-V3: 4 heads, q_lora 24, kv_lora 32, qk_nope 16, qk_rope 8, v 12; layer 0 dense, 1-2 MoE (8 experts).
DS3 = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
       "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "q_lora_rank": 24, "kv_lora_rank": 32,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}
HEADS, LORA, NOPE, ROPE, V = 4, 32, 16, 8, 12
EXPERTS, HIDDEN, MOE_LAYERS = 8, 64, 2
BF16 = 2


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch)


def cpu_hw(*, flops="1 TFLOPS", ram_bw="10 GB/s", gpu: bool = False):
    return profile_from_dict({
        "schema_version": 1, "name": "toy", "description": "toy", "source": "test", "measured": False,
        "unified_memory": False,
        "gpus": [{"name": "Toy GPU", "count": 1, "memory": "80 GiB", "memory_bandwidth": "1000 GB/s",
                  "bf16_compute": "100 TFLOPS", "compute_capability": "9.0"}] if gpu else [],
        "host": {"ram": "64 GiB", "ram_bandwidth": ram_bw, "cpu_cores": 8, "cpu_bf16_compute": flops},
        "link": {"name": "toy link", "h2d_pinned": "20 GB/s", "h2d_pageable": "20 GB/s", "d2h_pinned": "20 GB/s",
                 "d2h_pageable": "20 GB/s"} if gpu else None,
        "overheads": {"cuda_context": "0 B", "allocator_reserve": "0 B", "kernel_launch": "0 us"},
        "calibration": None, "notes": []})


def req(context: int, **kw) -> Request:
    return Request(**{**dict(context=context, prompt_tokens=context, prefill_chunk=512, headroom_bytes=0,
                             runtime_base_ram_bytes=0, quant=("bf16",), kv_dtype=("bf16",)), **kw})


# --- the expansion: speed -----------------------------------------------------------------


def test_decode_expansion_work_is_the_up_projection_of_the_whole_context():
    """Per layer and decode token: kv_b_proj over every cached token (2 x ctx x kv_lora x heads x (nope + v)
    FLOPs), and the elements it moves: the latent read, kv_b_proj's output written, k_nope read back, the key
    written; the attention kernel then reads the expanded K and V, not the latent."""
    spec = spec_from_config(DS3, name="ds3")
    scheme, kv = SCHEMES["bf16"], KV_SCHEMES["bf16"]
    for ctx in (512, 3000):
        w = decode_work(spec, scheme, kv, 1, ctx, layer_costs(spec, scheme, kv, req(ctx)))
        assert w.per_layer("expand_flop") == [2.0 * ctx * LORA * HEADS * (NOPE + V)] * 3
        moved = LORA + ROPE + HEADS * ((NOPE + V) + NOPE + (NOPE + ROPE))
        assert w.per_layer("expand_bytes") == [float(ctx * moved * BF16)] * 3
        assert w.per_layer("kv_read") == [float(ctx * HEADS * (NOPE + ROPE + V) * BF16)] * 3
        assert w.per_layer("attention_flop") == [2.0 * HEADS * (NOPE + ROPE + V) * ctx] * 3
        assert w.per_layer("kv_stored") == [float(ctx * (LORA + ROPE) * BF16)] * 3  # the cache itself stays compressed


def test_planned_decode_cost_grows_with_the_context_as_the_expansion_implies():
    """On a compute-bound CPU (1 GFLOP/s at 0.5 efficiency, 100 GB/s) the expansion is compute-bound: one more
    cached token costs every layer 2 x kv_lora x heads x (nope + v) FLOPs more, on top of the attention kernel."""
    spec = spec_from_config(DS3, name="ds3")
    hw = cpu_hw(flops="0.001 TFLOPS", ram_bw="100 GB/s")
    scheme, kv = SCHEMES["bf16"], KV_SCHEMES["bf16"]
    eff_compute = _DEFAULTS[("cpu", "bf16")][1]

    def decode_s(ctx: int) -> tuple[float, float]:
        r = req(ctx)
        e = estimate(spec, hw, r, scheme, kv, _cpu_choice(spec, hw, r), layer_costs(spec, scheme, kv, r))
        return 1.0 / e.decode_tokens_per_s, e.terms["mla_expand_s"]

    (t512, x512), (t3000, x3000) = decode_s(512), decode_s(3000)
    per_token_flop = 3 * 2.0 * LORA * HEADS * (NOPE + V)
    assert x512 == pytest.approx(512 * per_token_flop / (1e9 * eff_compute))
    assert x3000 == pytest.approx(3000 * per_token_flop / (1e9 * eff_compute))
    attention_per_token = (3 * 2.0 * HEADS * (NOPE + ROPE + V)  # compute-bound here too
                           / (1e9 * DEFAULT_CPU_DECODE_ATTENTION_EFFICIENCY))
    assert t3000 - t512 == pytest.approx((3000 - 512) * (per_token_flop / (1e9 * eff_compute) + attention_per_token))


def test_prefill_expands_once_per_chunk_over_the_context_so_far():
    """A 1200-token prompt in 512-token chunks expands 512, 1024 and 1200 cached tokens in every layer: matmul
    FLOPs at the weights' compute efficiency (compute-bound here), beside the same model without the expansion."""
    spec = spec_from_config(DS3, name="ds3")
    flat = replace(spec, attention=tuple(replace(a, mla_rope_dim=None) for a in spec.attention))  # no expansion
    assert [a.expands_cache for a in spec.attention + flat.attention] == [True] * 3 + [False] * 3
    per_layer = 2.0 * LORA * HEADS * (NOPE + V) * (512 + 1024 + 1200)
    assert list(prefill_expand_flop_per_layer(spec, 1200, 512)) == [per_layer] * 3
    hw = cpu_hw(flops="0.001 TFLOPS", ram_bw="1000 GB/s")
    scheme, kv = SCHEMES["bf16"], KV_SCHEMES["bf16"]

    def ttft(s) -> float:
        r = req(1200)
        return estimate(s, hw, r, scheme, kv, _cpu_choice(s, hw, r), layer_costs(s, scheme, kv, r)).ttft_s

    assert ttft(spec) - ttft(flat) == pytest.approx(3 * per_layer / (1e9 * _DEFAULTS[("cpu", "bf16")][1]), rel=1e-9)


def test_llama_cpp_and_other_attention_have_no_expansion():
    spec = spec_from_config(DS3, name="ds3")
    scheme, kv = SCHEMES["bf16"], KV_SCHEMES["bf16"]
    for s in (as_run(spec), spec_from_config({**DS3, "model_type": "llama", "num_key_value_heads": 2,
                                              "head_dim": 16}, name="llama")):
        w = decode_work(s, scheme, kv, 1, 1000, layer_costs(s, scheme, kv, req(1000)))
        assert not any(w.per_layer("expand_flop")) and not any(w.per_layer("expand_bytes"))
        assert "mla_expanded_kv" not in workspace_bytes(s, scheme, kv, req(1000))


def _cpu_choice(spec, hw, r):
    return plan(spec, hw, r).chosen.choice


# --- the expansion: memory ----------------------------------------------------------------


def test_workspace_counts_one_layers_expanded_k_and_v_and_the_cpu_math_scores():
    """mla_expanded_kv: kv_b_proj's output (heads x (nope + v)) and the key (heads x (nope + rope)) at the whole
    context, bf16, one layer at a time. sdpa_math_fallback: fp32 scores of the largest chunk x the keys so far,
    its boolean mask, and fp32 copies of the expanded K and V."""
    spec = spec_from_config(DS3, name="ds3")
    ctx, chunk = 3000, 512
    terms = workspace_bytes(spec, SCHEMES["bf16"], KV_SCHEMES["bf16"], req(ctx, prefill_chunk=chunk))
    assert terms["mla_expanded_kv"] == ctx * HEADS * ((NOPE + V) + (NOPE + ROPE)) * BF16  # 1,248,000 B
    scores = 440 * 3000  # the largest chunk's: the last one, 440 queries x 3000 keys (the one before: 512 x 2560)
    fp32_scores_and_kv = HEADS * (scores * SDPA_MATH_SCORE_FP32_COPIES
                                  + ctx * (NOPE + ROPE + V) * SDPA_MATH_KV_FP32_COPIES)
    assert terms["sdpa_math_fallback"] == int(fp32_scores_and_kv * 4 + scores * 1)  # + the chunk's boolean mask


def test_cpu_math_scores_stay_off_the_gpu():
    spec = spec_from_config(DS3, name="ds3")
    r = req(3000)
    terms = workspace_bytes(spec, SCHEMES["bf16"], KV_SCHEMES["bf16"], r)
    gpu_plan = plan(spec, cpu_hw(gpu=True), r)
    assert gpu_plan.chosen.choice.gpu_layers == 3
    assert gpu_plan.memory.gpu.workspace_bytes == sum(terms.values()) - terms["sdpa_math_fallback"]
    cpu_plan = plan(spec, cpu_hw(), r)
    assert cpu_plan.memory.cpu.workspace_bytes == sum(terms.values())


# --- fp32 routers, by transformers version -------------------------------------------------------


def _router_bytes(spec) -> dict[str, int]:
    bf16 = SCHEMES["bf16"]
    return {t.name.rsplit(".", 1)[-1]: bf16.tensor_bytes(t) for t in spec.tensors
            if t.name.startswith("model.layers.1.mlp.gate.")}


@pytest.mark.parametrize("version, weight_bytes", [("5.17.0", BF16), ("5.23.0", BF16), ("5.24.0", 4), (None, 4)])
def test_deepseek_v3_router_dtypes_follow_the_transformers_version(version, weight_bytes):
    spec = spec_from_config(DS3, name="ds3", transformers_version=version)
    assert _router_bytes(spec) == {"weight": EXPERTS * HIDDEN * weight_bytes, "e_score_correction_bias": EXPERTS * 4}
    note = next(n for n in spec.notes if n.startswith("router tensors"))
    assert f"transformers {version or VERIFIED_TRANSFORMERS[-1]}" in note
    assert f"checked against transformers {', '.join(VERIFIED_TRANSFORMERS)}" in note
    older = spec_from_config(DS3, name="ds3", transformers_version="5.23.0")
    delta = SCHEMES["bf16"].bytes_of(spec.tensors) - SCHEMES["bf16"].bytes_of(older.tensors)
    assert delta == (weight_bytes - BF16) * EXPERTS * HIDDEN * MOE_LAYERS


TINY_FAMILIES = {  # tiny configs of the families with fp32 router tensors (transformers writes the rest)
    "deepseek_v2": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, num_experts_per_tok=2,
                        moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                        num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    "glm4_moe": dict(n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1, head_dim=16,
                     num_experts_per_tok=2, moe_intermediate_size=32),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1),
}


def _tiny_config(model_type: str) -> dict:
    from transformers import AutoConfig

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                vocab_size=128, max_position_embeddings=512, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return AutoConfig.for_model(model_type, **{**base, **TINY_FAMILIES[model_type]}).to_dict()


def _fp32_and_bytes(model) -> tuple[set[str], int]:
    import torch

    tensors = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if "rotary_emb" not in n]
    return {n for n, t in tensors if t.dtype == torch.float32}, sum(t.numel() * t.element_size() for _, t in tensors)


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_planned_fp32_tensors_are_the_ones_the_installed_transformers_holds(model_type):
    """A bf16 dummy build (runtime/dummy.py, which applies the class's _keep_in_fp32_modules_strict like
    from_pretrained) holds exactly the tensors the rule marks, for the installed version, and the planned bytes."""
    import transformers

    from vramplan.runtime.load import load_model

    config = _tiny_config(model_type)
    spec = spec_from_config(config, name=model_type, transformers_version=transformers.__version__)
    fp32, held_bytes = _fp32_and_bytes(load_model(config, scheme=SCHEMES["bf16"], dummy_weights=True).model)
    assert fp32 == {t.name for t in spec.tensors if t.held_dtype == "float32"}
    assert SCHEMES["bf16"].bytes_of(spec.tensors) == held_bytes


def test_a_loaded_checkpoint_holds_what_the_dummy_build_holds(tmp_path):
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from vramplan.runtime.load import load_model

    config = _tiny_config("deepseek_v3")
    values = dict(config)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values),
                                     dtype=torch.bfloat16).save_pretrained(tmp_path / "ds3")
    spec = spec_from_config(config, name="ds3", transformers_version=transformers.__version__)
    fp32, held_bytes = _fp32_and_bytes(load_model(tmp_path / "ds3", scheme=SCHEMES["bf16"]).model)
    assert fp32 == {t.name for t in spec.tensors if t.held_dtype == "float32"}
    assert SCHEMES["bf16"].bytes_of(spec.tensors) == held_bytes


def test_inspect_names_the_transformers_version_and_the_expansion(tmp_path, capsys):
    import json

    import transformers

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(DS3))
    code, out, err = main(capsys, "inspect", "--model", str(tmp_path / "m"), "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any(f"as transformers {transformers.__version__} loads them" in n for n in notes), notes
    mla = next(n for n in notes if n.startswith("MLA:"))
    assert "re-expands the whole cached context" in mla and "decompressed" not in mla


# --- against a real prefill -------------------------------------------------------------------

PREFILL_RSS = """
import json, resource, sys
import torch
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.runtime.generate import prefill, synthetic_prompt
from vramplan.runtime.kvcache import make_cache
from vramplan.runtime.load import load_model

config, tokens, chunk = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = load_model(config, scheme=SCHEMES["bf16"], dummy_weights=True).model
ids = synthetic_prompt(tokens, config["vocab_size"], seed=0)
cache = make_cache(KV_SCHEMES["bf16"], model.config)
with torch.no_grad():
    prefill(model, ids[:, :64], make_cache(KV_SCHEMES["bf16"], model.config), chunk)  # first touches, off the peak
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    prefill(model, ids, make_cache(KV_SCHEMES["bf16"], model.config), chunk)
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024))
"""


def test_a_long_mla_prefill_stays_within_the_planned_workspace():
    """A tiny deepseek_v3 (2 heads, qk 48 / v 32: torch's CPU SDPA math path) prefilling 4096 tokens in 2048-token
    chunks: the process's peak RSS grows by less than the plan's CPU workspace + KV cache at that context (156-198
    MiB measured over runs, 214 MiB planned; before the MLA terms the plan had 9 MiB)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_moe_experts import moe_config

    config = moe_config("deepseek_v3", max_position_embeddings=8192)
    tokens, chunk = 4096, 2048
    r = subprocess.run([sys.executable, "-c", PREFILL_RSS, json.dumps(config), str(tokens), str(chunk)],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    grown = json.loads(r.stdout.strip().splitlines()[-1])
    spec = spec_from_config(config, name="ds3")
    r_plan = req(tokens, prefill_chunk=chunk)
    planned = plan(spec, cpu_hw(), r_plan).memory.cpu
    print(f"peak RSS grew {grown / 2**20:.1f} MiB; planned workspace {planned.workspace_bytes / 2**20:.1f} MiB + KV "
          f"{planned.kv_cache_bytes / 2**20:.1f} MiB")
    assert grown <= planned.workspace_bytes + planned.kv_cache_bytes


def test_the_installed_transformers_version_is_read_without_importing_it():
    import subprocess
    import sys
    from pathlib import Path

    import transformers

    from vramplan.runtime.inventory import installed_transformers_version

    root = Path(__file__).resolve().parents[1]
    assert installed_transformers_version() == transformers.__version__
    code = ("import sys; from runtime.inventory import installed_transformers_version as v; v(); "
            "print('transformers' in sys.modules, 'importlib.metadata' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr
