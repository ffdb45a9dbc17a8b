"""Forced choices and what the exports say: --expert-placement and --gpu-layers on an MoE, --prefer balanced's
quality floor, the Ollama tag of the model that was planned, the words beside --n-cpu-moe, --nodes and --emit."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli as main
from conftest import run_profile


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch)


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = main(capsys, "plan", *argv, "--json")
    assert "Traceback" not in err, err
    return code, json.loads(out)


# ---------------------------------------------------------------- 1. expert placement
QWEN_MOE = ("--model", "qwen3-30b-a3b", "--context", "32k", "--hardware", "rtx-3060-12gb")
MIXTRAL = ("--model", "mixtral-8x7b-v0.1", "--context", "32k", "--hardware", "rtx-4090")


# quanto-int4 fixed: the search's own pick on the RTX 4090 profile (its public fit) streams bnb-nf4-dq layers instead
@pytest.mark.parametrize("case", [QWEN_MOE, (*MIXTRAL, "--quant", "quanto-int4")], ids=["qwen3-30b-a3b", "mixtral"])
def test_gpu_layers_all_keeps_the_experts_in_ram_placement(capsys, case):
    """The search puts every layer on the GPU with some layers' experts in RAM; asking for every layer on the GPU
    (--gpu-layers L) must find that same placement, not "nothing fits"."""
    code, auto = plan_json(capsys, *case)
    c = auto["choice"]
    assert code == 0 and c["gpu_layers"] == c["total_layers"] and c["offload"] == "none"
    assert isinstance(c["expert_placement"], int) and 0 < c["expert_placement"] < c["moe_layers"]
    code, forced = plan_json(capsys, *case, "--gpu-layers", str(c["total_layers"]))
    assert code == 0, forced["reasons"]
    f = forced["choice"]
    for key in ("weight_quant", "kv_dtype", "gpu_layers", "offload", "expert_placement", "expert_layers_in_ram"):
        assert f[key] == c[key], key


def test_expert_placement_forced_cpu_gpu_and_n(capsys):
    code, cpu = plan_json(capsys, *MIXTRAL, "--expert-placement", "cpu")
    c = cpu["choice"]
    assert code == 0 and c["expert_placement"] == "cpu" and c["gpu_layers"] == 32 and c["offload"] == "none"
    assert c["expert_layers_in_ram"] == list(range(32))
    assert "routed experts of all 32 MoE layers in RAM" in cpu["reason"]

    code, gpu = plan_json(capsys, *MIXTRAL, "--expert-placement", "gpu")
    g = gpu["choice"]
    # every expert stays with its layer: the model does not fit whole, so whole layers are offloaded instead
    assert code == 0 and g["expert_placement"] == "gpu" and g["expert_layers_in_ram"] == []
    assert g["gpu_layers"] < 32 and g["offload"] != "none"
    runs_here = [x for x in gpu["candidates"] if "does not run on" not in (x["reason"] or "")]
    assert runs_here and all(x.get("expert_placement") in ("gpu", None) for x in runs_here)

    code, n = plan_json(capsys, *MIXTRAL, "--expert-placement", "20")
    e = n["choice"]
    assert code == 0 and e["expert_placement"] == 20 and e["gpu_layers"] == 32
    assert "routed experts of the first 20 of 32 MoE layers (layers 0-19) in RAM" in n["reason"]
    # the search alone picks 8 layers' experts (for quanto-int4: its own pick on the RTX 4090 profile streams
    # bnb-nf4-dq layers): forcing 20 is honoured, not replaced by the search's choice
    assert plan_json(capsys, *MIXTRAL, "--quant", "quanto-int4")[1]["choice"]["expert_placement"] == 8


def test_expert_placement_with_gpu_layers_moves_only_resident_layers_experts(capsys):
    code, d = plan_json(capsys, *MIXTRAL, "--expert-placement", "cpu", "--gpu-layers", "20", "--offload", "cpu")
    c = d["choice"]
    assert code == 0 and c["gpu_layers"] == 20 and c["offload"] == "cpu"
    assert c["expert_layers_in_ram"] == list(range(20))  # the offloaded layers' experts go with their layers


def test_expert_placement_llama_cpp(capsys):
    code, d = plan_json(capsys, *MIXTRAL, "--engine", "llama.cpp", "--expert-placement", "5")
    c = d["choice"]
    assert code == 0 and c["expert_placement"] == 5 and c["gpu_layers"] == 32
    assert "experts of the first 5 of 32 MoE layers (layers 0-4) in RAM (--n-cpu-moe 5)" in d["reason"]
    code, d = plan_json(capsys, *MIXTRAL, "--engine", "llama.cpp", "--expert-placement", "gpu")
    assert code == 0 and d["choice"]["expert_placement"] == "gpu"


@pytest.mark.parametrize("argv, says", [
    (("--model", "llama-3.1-8b", "--hardware", "rtx-4090", "--expert-placement", "cpu"), "dense model"),
    (("--model", "llama-3.1-8b", "--hardware", "rtx-4090", "--expert-placement", "cpu", "--engine", "llama.cpp"),
     "dense model"),
    ((*MIXTRAL, "--expert-placement", "33"), "has 32 MoE layers"),
    ((*MIXTRAL, "--expert-placement", "some"), "--expert-placement must be gpu or cpu or a number"),
    ((*MIXTRAL, "--expert-placement", "-1"), "--expert-placement must be"),
    (("--model", "mixtral-8x7b-v0.1", "--hardware", "cpu-epyc-server", "--expert-placement", "cpu"), "no GPU"),
])
def test_expert_placement_refusals(capsys, argv, says):
    code, _, err = main(capsys, "plan", *argv)
    assert_one_line_error(code, err)
    assert says in err


def test_run_takes_expert_placement(capsys, tmp_path):
    """`run` plans with it (refused before anything loads where it cannot apply: this machine's CPU-only profile) and
    refuses it beside --plan."""
    code, _, err = main(capsys, "run", "--model", "llama-3.2-1b", "--dummy-weights", "--hardware", run_profile(),
                        "--expert-placement", "2", "--kv-dtype", "bf16", "--prompt", "hi")
    assert_one_line_error(code, err)
    assert "an expert placement was given, but hardware 'cpu-ddr5-desktop-here' has no GPU" in err
    code, _, err = main(capsys, "run", "--model", "llama-3.2-1b", "--plan", str(tmp_path / "p.yaml"),
                        "--expert-placement", "cpu", "--prompt", "hi")
    assert_one_line_error(code, err)
    assert "drop --expert-placement" in err


# ---------------------------------------------------------------- 4. the words beside --n-cpu-moe
def test_deepseek_v3_llama_cpp_words_and_flag_agree(capsys):
    """DeepSeek-V3's first 3 layers are dense and --n-cpu-moe counts layers from 0: the words name the MoE layers
    and the layer range that the flag covers."""
    argv = ("plan", "--model", "deepseek-v3", "--context", "8k", "--hardware", "h200", "--engine", "llama.cpp",
            "--quant", "Q5_K_M")
    code, out, _ = main(capsys, *argv, "--emit", "llama.cpp")
    assert code == 0
    flag = int(out.split("--n-cpu-moe ")[-1].split()[0])
    assert flag == 45
    words = "experts of the first 42 of 58 MoE layers (layers 3-44) in RAM (--n-cpu-moe 45)"
    assert words in out
    code, out, _ = main(capsys, *argv)  # the human plan: its summary line and its reason
    assert code == 0
    assert "routed experts of the first 42 of 58 MoE layers (layers 3-44) in RAM (--n-cpu-moe 45)" in out
    assert words in " ".join(out.split())
    # and whatever the search picks: the flag is one past the last MoE layer the words name
    code, out, _ = main(capsys, *argv[:-2], "--emit", "llama.cpp")
    flag = int(out.split("--n-cpu-moe ")[-1].split()[0])
    said = out.split("MoE layers (layers 3-")[1].split(")")[0]
    assert code == 0 and flag == int(said) + 1


# ---------------------------------------------------------------- 2. balanced's quality floor
LLAMA_70B_4090 = ("--model", "llama-3.1-70b", "--context", "32k", "--hardware", "rtx-4090", "--engine", "llama.cpp")


def test_balanced_keeps_the_quality_floor_and_says_why(capsys):
    """Only IQ1-IQ2 and Q2_K options are within 50 % of the fastest: balanced must not take them (IQ1_S +875 %
    perplexity on the Llama-3-8B scoreboard), and the reasons say the floor outranked speed."""
    from vramplan.planner.request import BALANCED_MAX_QUALITY_COST_PCT

    code, d = plan_json(capsys, *LLAMA_70B_4090)
    assert code == 0
    fastest = max((c for c in d["candidates"] if c["fits"]), key=lambda c: c["predicted"]["decode_tokens_per_s"])
    assert fastest["weight_quant"] == "IQ1_S"  # the case: the fastest option is the lossiest
    assert fastest["quality_cost_pct"] > BALANCED_MAX_QUALITY_COST_PCT
    assert d["choice"]["weight_quant"] not in ("IQ1_S", "IQ1_M", "IQ2_XXS", "Q2_K", "Q3_K_M")
    assert d["quality_cost_pct"] <= BALANCED_MAX_QUALITY_COST_PCT
    said = [r for r in d["reasons"] if "outranks speed" in r]
    assert len(said) == 1 and "the quality floor (at most 8 % perplexity over bf16" in said[0]
    assert "the fastest IQ1_S + q4_0 KV" in said[0]
    assert "within reach of the fastest option that keeps the quality floor" in d["reasons"][0]
    # --prefer speed still takes the fastest, floor or not
    code, d = plan_json(capsys, *LLAMA_70B_4090, "--prefer", "speed")
    assert code == 0 and d["choice"]["weight_quant"] == "IQ1_S"


def test_balanced_without_an_option_above_the_floor_chooses_among_all(capsys):
    code, d = plan_json(capsys, *LLAMA_70B_4090, "--quant", "Q2_K")
    assert code == 0 and d["choice"]["weight_quant"] == "Q2_K"
    assert any("no option that runs keeps the quality floor" in r for r in d["reasons"])


def test_balanced_floor_is_a_request_field_echoed_in_the_plan():
    from vramplan.planner.errors import PlanError
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import BALANCED_MAX_QUALITY_COST_PCT, Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import model_spec

    with pytest.raises(PlanError, match="quality floor"):
        Request(context=4096, balanced_max_quality_cost_pct=-1)
    p = plan(model_spec("llama-3.1-8b"), resolve_profile("rtx-4090")[0], Request(context=4096))
    assert p.constants["balanced_max_quality_cost_pct"].value == BALANCED_MAX_QUALITY_COST_PCT


# ---------------------------------------------------------------- 3. the Ollama tag of the model that was planned
def _ollama(capsys, model: str) -> str:
    code, out, _ = main(capsys, "plan", "--model", model, "--hardware", "rtx-4090", "--emit", "ollama")
    assert code == 0
    return out


@pytest.mark.parametrize("model, tag", [
    ("llama-3.1-8b", "llama3.1:8b-text-"),
    ("llama-2-7b-hf", "llama2:7b-text-"),
    ("mixtral-8x7b-v0.1", "mixtral:8x7b-text-v0.1-"),
    ("gemma-2-9b", "gemma2:9b-text-"),
])
def test_ollama_base_checkpoints_get_base_tags(capsys, model, tag):
    out = _ollama(capsys, model)
    line = next(ln for ln in out.splitlines() if ln.startswith("FROM "))
    assert line.startswith(f"FROM {tag}") and "instruct" not in line and "chat" not in line


def test_ollama_base_checkpoint_without_a_base_tag_gets_its_own_gguf(capsys):
    out = _ollama(capsys, "qwen2.5-7b")
    line = next(ln for ln in out.splitlines() if ln.startswith("FROM "))
    assert line.startswith("FROM ./Qwen2.5-7B-") and line.endswith(".gguf")
    assert "qwen2.5:7b-instruct is the instruct model, a different one" in out
    assert "python convert_hf_to_gguf.py <Qwen/Qwen2.5-7B checkpoint dir>" in out
    assert "ollama pull" not in out


def test_ollama_instruct_checkpoints_get_instruct_tags():
    from dataclasses import replace

    from vramplan.planner.engines.ollama import LIBRARY, ollama_tag
    from vramplan.planner.sources import model_spec

    spec = model_spec("llama-3.1-8b")
    for name, tag in [("meta-llama/Llama-3.1-8B-Instruct", "llama3.1:8b-instruct-q4_K_M"),
                      ("meta-llama/Llama-2-7b-chat-hf", "llama2:7b-chat-q4_K_M"),
                      ("mistralai/Mistral-7B-Instruct-v0.3", "mistral:7b-instruct-v0.3-q4_K_M"),
                      ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5:7b-instruct-q4_K_M"),
                      ("google/gemma-2-9b-it", "gemma2:9b-instruct-q4_K_M")]:
        assert ollama_tag(replace(spec, name=name), "Q4_K_M")[0] == tag
    # the whole table: an instruct id never gets a base tag, a base id of a family with base tags never an instruct one
    instruct_marks = ("Instruct", "-it", "chat")
    for name, (_, stem, _) in LIBRARY.items():
        if any(m in name for m in instruct_marks):
            assert "text" not in stem, name
        elif name.startswith(("meta-llama/", "mistralai/", "google/gemma-2-")):
            assert "text" in stem, name


# ---------------------------------------------------------------- 5. --nodes and a repeated --emit
PLAN_8B = ("plan", "--model", "llama-3.1-8b", "--hardware", "rtx-4090")


@pytest.mark.parametrize("extra, says", [
    (("--nodes", "2"), "--nodes only applies to the vLLM export"),
    (("--nodes", "2", "--emit", "ollama"), "--nodes only applies to the vLLM export"),
    (("--emit", "vllm", "--emit", "ollama"), "--emit was given 2 times (vllm, ollama)"),
    (("--emit", "ollama", "--emit", "ollama", "--json"), "--emit was given 2 times"),
])
def test_nodes_without_vllm_and_a_repeated_emit_are_refused(capsys, extra, says):
    code, out, err = main(capsys, *PLAN_8B, *extra)
    assert_one_line_error(code, err)
    assert out == "" and says in err


def test_nodes_with_emit_vllm_and_one_emit_still_work(capsys):
    code, out, _ = main(capsys, *PLAN_8B, "--nodes", "2", "--emit", "vllm", "--json")
    assert code == 0 and json.loads(out)["emit"]["engine"] == "vllm"
    code, out, _ = main(capsys, *PLAN_8B, "--emit", "ollama")
    assert code == 0 and "FROM llama3.1:8b-text-" in out


@pytest.mark.parametrize("engine", ["vramplan", "llama.cpp"])
def test_every_engine_refuses_a_gpu_budget_beyond_the_card(capsys, engine):
    """Capacity comes from one function and the request checks run for every engine: llama.cpp once planned
    `--vram-budget 200GiB` on a 24 GiB card against 200 GiB."""
    code, _, err = main(capsys, "plan", "--model", "llama-3.1-8b", "-H", "rtx-4090", "--engine", engine,
                        "--vram-budget", "200GiB")
    assert_one_line_error(code, err)
    assert "exceeds the GPU's" in err


def test_a_gpu_budget_below_the_card_is_each_engines_capacity(capsys):
    for engine in ("vramplan", "llama.cpp"):
        code, d = plan_json(capsys, "--model", "llama-3.1-8b", "-H", "rtx-4090", "--engine", engine,
                            "--vram-budget", "6GiB", "--context", "8k")
        assert d["memory"]["gpu"]["capacity_bytes"] == 6 * 2**30, engine
