"""Pre-quantized checkpoints planned as published (issue 38, step 1): the plan keeps the stored format and counts its
bytes as stored (planner/published.py through planner/published_scheme.py), every engine's row loads it its own way,
and what cannot load it says so in one line. The byte formulas themselves: tests/test_published_formats.py."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli
from vramplan.planner.published_scheme import published_scheme, weight_schemes
from vramplan.planner.errors import PlanError
from vramplan.planner.sources import model_spec

# openai/gpt-oss-120b's model.safetensors files hold 65,248,815,744 bytes of tensors (tests/test_published_formats.py
# has where that number comes from); the experts are MXFP4, the rest bf16.
GPT_OSS_120B_STORED = 65_248_815_744
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


def awq_dir(tmp_path):
    """A local Qwen2.5-7B AWQ checkpoint directory (its config.json; no weights needed to plan)."""
    cfg = json.loads(json.dumps(model_spec("qwen2.5-7b").config))
    cfg.update(quantization_config=AWQ, torch_dtype="float16")
    d = tmp_path / "Qwen2.5-7B-Instruct-AWQ"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def plan_json(capsys, *argv):
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0 and "Traceback" not in err, err
    return json.loads(out)


def test_gpt_oss_120b_fits_one_h100_in_every_engine_as_published(capsys):
    d = plan_json(capsys, "--model", "gpt-oss-120b", "-H", "h100-sxm", "--context", "32k")
    assert d["choice"]["weight_quant"] == "mxfp4" and d["fits"]
    assert d["memory"]["gpus"][0]["weights_bytes"] == GPT_OSS_120B_STORED  # all on the GPU: every stored byte
    assert d["choice"]["expert_layers_in_ram"] == []
    rows = {e["engine"]: e for e in d["engines"]}
    assert {k: (rows[k]["weight_quant"], rows[k]["fits"]) for k in rows} == {
        "vramplan": ("mxfp4", True), "llama.cpp": ("F16", True), "ollama": ("F16", True),
        "vllm": ("checkpoint-mxfp4", True), "transformers": ("mxfp4", True)}
    assert any("vramplan's runtime does not load this format" in w and "quanto-int4's eager constants" in w
               for w in d["warnings"])


def test_inspect_counts_the_checkpoint_as_stored(capsys):
    code, out, err = run_cli(capsys, "inspect", "--model", "gpt-oss-120b", "--json")
    facts = json.loads(out)
    assert facts["published"]["stored_bytes"] == GPT_OSS_120B_STORED and facts["published"]["format"] == "mxfp4"
    assert facts["checkpoint_dtype"].startswith("bfloat16")  # the config has no torch_dtype: not float32


def test_an_awq_checkpoint_is_planned_in_its_own_bytes(capsys, tmp_path):
    d = awq_dir(tmp_path)
    p = plan_json(capsys, "--model", d, "-H", "rtx-4090", "--context", "32k")
    spec = model_spec("qwen2.5-7b")
    assert p["choice"]["weight_quant"] == "awq-int4-g128"
    # qweight in/8 int32 + qzeros (in/128) x (out/8) int32 + scales (in/128) x out fp16 per linear; the rest fp16
    linear = sum(t.numel // 2 + (t.shape[1] // 128) * (t.shape[0] // 8) * 4 + (t.shape[1] // 128) * t.shape[0] * 2
                 for t in spec.tensors if t.kind.name == "LINEAR" and t.layer is not None)
    rest = sum(t.numel * 2 for t in spec.tensors if not (t.kind.name == "LINEAR" and t.layer is not None))
    assert p["memory"]["gpus"][0]["weights_bytes"] == linear + rest
    assert 5.3e9 < linear + rest < 5.7e9  # the published repository is about 5.6 GB, not bf16's 15.2
    rows = {e["engine"]: e for e in p["engines"]}
    assert rows["vllm"]["weight_quant"] == "checkpoint-awq-int4-g128" and rows["vllm"]["fits"]
    assert rows["transformers"]["weight_quant"] == "awq-int4-g128"


def test_another_quant_for_a_published_checkpoint_is_one_line(capsys, tmp_path):
    code, out, err = run_cli(capsys, "plan", "--model", awq_dir(tmp_path), "-H", "rtx-4090", "-q", "bnb-nf4")
    line = assert_one_line_error(code, err)
    assert "published pre-quantized (AWQ 4-bit" in line and "--quant bnb-nf4 does not apply" in line
    with pytest.raises(PlanError, match="planned as stored"):
        weight_schemes(model_spec("gpt-oss-20b"), ("quanto-int4",))


def test_run_refuses_a_format_its_runtime_does_not_load(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "--model", awq_dir(tmp_path), "--dummy-weights", "--prompt-tokens", "4",
                               "-H", "cpu-epyc-server")
    line = assert_one_line_error(code, err)
    assert "vramplan's runtime does not load awq-int4-g128 checkpoints" in line and "vllm: loads it" in line


def test_transformers_snippet_loads_the_checkpoints_own_config(capsys, tmp_path):
    code, out, err = run_cli(capsys, "plan", "--model", awq_dir(tmp_path), "-H", "rtx-4090", "--emit", "transformers")
    assert code == 0, err
    assert "BitsAndBytesConfig" not in out and "quantization_config" not in out.split("from_pretrained(")[1]
    assert "transformers: needs gptqmodel" in out


def test_ollama_and_llamacpp_take_gpt_oss_as_published(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "gpt-oss-20b", "-H", "rtx-4090", "--emit", "ollama")
    assert code == 0, err
    assert "FROM gpt-oss:20b" in out
    d = plan_json(capsys, "--model", "gpt-oss-20b", "-H", "rtx-4090", "--engine", "llama.cpp", "--all")
    f16 = [c for c in d["candidates"] if c["weight_quant"] == "F16"]
    assert f16 and min(c["quality_cost_pct"] for c in f16) == 0.0  # the checkpoint as published, f16 cache


def test_a_bitsandbytes_checkpoint_is_vramplans_own_scheme():
    spec = model_spec("llama-3.1-8b")
    from dataclasses import replace

    bnb = replace(spec, config={**spec.config, "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True}})
    assert published_scheme(bnb).name == "bnb-nf4-dq" and published_scheme(spec) is None


# ---------------------------------------------------------------- the headers are the truth
def _write_awq_checkpoint(d, *, bad_scales: str | None = None):
    """A tiny llama AWQ checkpoint: config.json and a safetensors file whose header holds every stored tensor the AWQ
    GEMM rule names (zeros: only the header is read), `bad_scales` given a scales tensor of another group count."""
    import torch
    from safetensors.torch import save_file

    from conftest import tiny_config_dict
    from vramplan.planner.published import published as read_published, stored_tensors
    from vramplan.planner.sources import spec_from_config

    cfg = {**tiny_config_dict("llama"), "torch_dtype": "float16",
           "quantization_config": {**AWQ, "group_size": 32}}
    spec = spec_from_config(cfg, name="tiny-awq")
    pub = read_published(cfg, "tiny-awq")
    dt = {"I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
    out = {}
    for t in spec.tensors:
        for name, shape, dtype in stored_tensors(pub, t):
            if name == bad_scales:
                shape = (shape[0] * 2, *shape[1:])
            out[name] = torch.zeros(shape, dtype=dt[dtype])
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(out, str(d / "model.safetensors"))
    return spec, pub


def test_the_headers_of_a_published_checkpoint_are_checked_against_its_format(tmp_path):
    from vramplan.cli_inputs import resolve_model

    spec, pub = _write_awq_checkpoint(tmp_path / "ok")
    _, read = resolve_model(str(tmp_path / "ok"), None)
    assert any("hold the awq-int4-g32 layout as counted" in n for n in read.notes), read.notes
    assert published_scheme(read).bytes_of(read.tensors) == published_scheme(spec).bytes_of(spec.tensors)
    bad = "model.layers.0.mlp.down_proj.scales"
    spec, pub = _write_awq_checkpoint(tmp_path / "bad", bad_scales=bad)
    _, read = resolve_model(str(tmp_path / "bad"), None)
    t = next(t for t in read.tensors if t.name == "model.layers.0.mlp.down_proj.weight")
    extra = t.shape[1] // 32 * t.shape[0] * 2  # one more set of fp16 scales
    assert published_scheme(read).bytes_of(read.tensors) == published_scheme(spec).bytes_of(spec.tensors) + extra
    assert any("1 of" in n and "down_proj.weight" in n and "headers' bytes are counted" in n for n in read.notes)
