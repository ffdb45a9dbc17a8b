"""The public GPU corpus as the benchmark reads it (issue 25): the records, the GPU and the model behind each, the
fixed split, every decode measurement as a Case the planner predicts, and the memory records' checks
(planner/engines/llamacpp_rules.py's buffers, vllm.py's start-up figures). bench/public_gpu.py fits and reports;
tests/test_public_gpu_predictions.py holds both to account."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from vramplan.planner.architectures import spec_from_config
from vramplan.planner.engines.llamacpp import fit_group
from vramplan.planner.hardware import GPUSpec, HardwareProfile, HostSpec, LinkSpec, Overheads
from vramplan.planner.modelspec import ModelSpec
from vramplan.planner.profile_yaml import load_profile
from vramplan.planner.profiles import shipped_profiles_dir
from vramplan.planner.request import Request
from vramplan.planner.sources import catalog_config
from vramplan.planner.speed import compiled_scheme
from vramplan.planner.units import parse_bandwidth, parse_bytes, parse_flops

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "planner" / "public_gpu"
RESULTS = ROOT / "bench" / "results"
CORPUS = "planner/public_gpu/records.jsonl"
FIT_DATE = "2026-11-26"
ENGINES = ("llama.cpp", "transformers", "compiled")
# Targets (issue 25): decode on the held-out third within 15 % (median) and 40 % (worst), per engine.
TARGET_MEDIAN_PCT, TARGET_WORST_PCT = 15.0, 40.0
# What the records do not state and a prediction needs (each an assumption, said in the report):
# optimum-benchmark's text-generation scenario (bitsandbytes' benchmarks): its prompt and generated lengths
OPTIMUM_BENCHMARK_PROMPT, OPTIMUM_BENCHMARK_NEW = 256, 64
# gpt-fast's README runs: a 5-token prompt (stated) and generate.py's default of 200 new tokens
GPT_FAST_PROMPT, GPT_FAST_NEW = 5, 200
# ./main runs of XiongjieDai's LLaMA 2 table: -n 1024 (stated), the prompt not stated (a short one assumed)
XDAI_L2_NEW = 1024


def _load_json(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def records() -> list[dict]:
    return [json.loads(line) for line in (DATA / "records.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]


GPUS = _load_json("gpus.json")
MODELS = _load_json("models.json")
SPLIT = _load_json("split.json")


# ---------------------------------------------------------------- the GPU and the model behind a record
def gpu_key(gpu_text: str) -> str | None:
    return next((k for k, g in GPUS.items() if not k.startswith("_") and gpu_text in g["aliases"]), None)


def base_profile(key: str, count: int = 1) -> HardwareProfile:
    """The record's machine without fitted constants: a shipped profile, or one made from the GPU's datasheet
    figures (host and link: a generic server's, which decode on the GPU does not read)."""
    g = GPUS[key]
    if "profile" in g:
        hw = load_profile(shipped_profiles_dir() / f"{g['profile']}.yaml")
        if hw.calibration is not None:
            hw = replace(hw, calibration=None)  # the public fit is what is tested, not this machine's calibration
    else:
        hw = HardwareProfile(
            schema_version=1, name=key, description=g["name"], source=g["source"], measured=False,
            gpus=(GPUSpec(name=g["name"], memory_bytes=parse_bytes(g["memory"]),
                          memory_bandwidth_bytes_per_s=parse_bandwidth(g["memory_bandwidth"]),
                          bf16_flops=parse_flops(g["bf16_compute"])),),
            host=HostSpec(ram_bytes=parse_bytes("512 GiB"), ram_bandwidth_bytes_per_s=parse_bandwidth("100 GB/s"),
                          cpu_cores=32, cpu_bf16_flops=parse_flops("5 TFLOPS")),
            link=LinkSpec(name="PCIe 4.0 x16", h2d_pinned_bytes_per_s=25e9, h2d_pageable_bytes_per_s=12e9,
                          d2h_pinned_bytes_per_s=25e9, d2h_pageable_bytes_per_s=12e9),
            overheads=Overheads(cuda_context_bytes=parse_bytes("500 MiB"),
                                allocator_reserve_bytes=parse_bytes("512 MiB"), kernel_launch_s=5e-6))
    hw = replace(hw, public_fit=None, host=replace(hw.host, eager_dispatch_per_layer_s=None))
    if count > 1:
        hw = replace(hw, gpus=(replace(hw.gpus[0], count=count),))
    return hw


def model_spec(name: str) -> ModelSpec:
    m = MODELS[name]
    if "same_as" in m:
        return model_spec(m["same_as"])
    if "catalog" in m:
        return spec_from_config(catalog_config(m["catalog"]), name=m["catalog"])
    config = {**catalog_config(m["derive"]), **m["set"]}
    config = {k: v for k, v in config.items() if v is not None}
    return spec_from_config(config, name=name)


# ---------------------------------------------------------------- decode cases
@dataclass
class Case:
    """One decode measurement: what ran, where, and the planner's prediction of it."""

    record: str
    engine: str  # one of ENGINES
    metric: str  # the measured key ("tokens_per_s", "tg512_tokens_per_s", ...)
    measured: float  # tokens/s
    gpu: str  # gpus.json key
    gpu_count: int
    gpu_class: str
    host_class: str
    quant: str  # the engine's scheme (a vramplan scheme, a compiled format, a GGUF file type)
    fit_quant: str  # the fitted entry it uses (the GGUF file type's group for llama.cpp)
    model: str
    context: int
    prompt: int
    batch: int = 1
    group_size: int | None = None  # compiled int4
    attention_impl: str | None = None
    offload: str | None = None
    gpu_layers: int | None = None
    split: str = "fit"  # "fit" or "held-out"
    source: str = ""
    anomaly: bool = False  # flagged in the record before the fit
    notes: list[str] = field(default_factory=list)
    basis: dict = field(default_factory=dict)
    predicted: float | None = None

    @property
    def point(self) -> str:
        return self.record if self.metric == "tokens_per_s" else f"{self.record}@{self.metric.split('_')[0]}"


def _source_name(r: dict) -> str:
    s = r["source"]
    return s.get("repo") or s.get("path") or s.get("url", "")


def _split(engine: str, gpu: str, source: str) -> str:
    rule = SPLIT["held_out"][engine]
    held = gpu in rule.get("gpus", ()) or source in rule.get("sources", ())
    return "held-out" if held else "fit"


COMPILED_QUANTS = {"Base": (16, None), "bf16": (16, None), "8-bit": (8, None), "int8wo": (8, None),
                   "4-bit (G=32)": (4, 32), "int4wo-64": (4, 64), "autoquant-int4hqq": (4, 64)}
EAGER_QUANTS = {"bf16": "bf16", "fp16": "fp16", "bnb-nf4": "bnb-nf4", "bnb-nf4 (double quant)": "bnb-nf4-dq",
                "bnb-int8": "bnb-int8"}


def _int(v) -> int | None:
    """An ngl like 99, "999 (33/33 layers)" or None."""
    if v is None:
        return None
    return int(str(v).split()[0])


def decode_cases() -> tuple[list[Case], list[dict]]:
    """Every decode measurement the planner can predict, and every other record with why it is not one."""
    cases, left_out = [], []

    def skip(r, why):
        left_out.append({"record": r["id"], "kind": r["kind"], "why": why})

    for r in records():
        speeds = {k: v for k, v in r["measured"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                  and (k == "tokens_per_s" or k.startswith("tg") or k in ("eval_tokens_per_s",))
                  and k.endswith("tokens_per_s")}
        test = r.get("test") or ""
        if r["kind"] == "llamabench" and not (test.startswith("tg") or r.get("ubatch") == 1 or "eval" in test):
            skip(r, "prompt processing (prefill): not a decode record; prefill is not fitted here")
            continue
        if r["kind"] in ("llamacpp_buffers", "vllm_startup") and not speeds:
            if any(k.endswith("tokens_per_s") for k in r["measured"]):
                skip(r, "a prompt-eval (prefill) figure beside its buffers: prefill is not fitted here")
            continue  # memory records (tests/test_public_gpu_predictions.py)
        if not speeds:
            skip(r, "no decode tokens/s measured (OOM, or a prefill figure only)")
            continue
        key = gpu_key(r["gpu"])
        engine = ("llama.cpp" if r["engine"] == "llama.cpp" else
                  "compiled" if r.get("mode") == "compiled" else
                  "transformers" if r["engine"] == "transformers" else None)
        why = _unpredictable(r, engine, key)
        if why:
            skip(r, why)
            continue
        g = GPUS[key]
        count = r.get("gpu_count") or 1
        source = _source_name(r)
        common = dict(record=r["id"], engine=engine, gpu=key, gpu_count=count, gpu_class=g["gpu_class"],
                      host_class=g["host_class"], model=r["model"], split=_split(engine, key, source), source=source,
                      anomaly=bool(r.get("anomaly_known_before_fit")))
        for metric, value in speeds.items():
            cases.append(_case(r, metric, value, common))
    return cases, left_out


def _unpredictable(r: dict, engine: str | None, key: str | None) -> str:
    """Why a speed record is not predicted ("" when it is)."""
    if engine is None:
        return f"engine {r['engine']} ({r.get('mode')}): not one the planner models"
    if (r.get("backend") or "").startswith(("Vulkan", "ROCm")) and engine == "llama.cpp":
        return f"llama.cpp's {r['backend']} backend: the plan and the fit model its CUDA backend"
    if "mining card" in (r.get("notes") or ""):
        return "a mining card (CMP 170HX) with throttled arithmetic and a patched driver: not bandwidth-bound"
    if engine == "llama.cpp" and (r.get("ngl") is not None and _int(r["ngl"]) < 99):
        return f"partial offload (-ngl {r['ngl']}) on a Tegra X2 (unified memory): not a full-offload decode"
    if "nkvo1" in r["id"]:
        return "-nkvo 1 (the KV cache in RAM): llama.cpp's plan keeps it with the layers"
    if key is None:
        return f"GPU {r['gpu']!r}: no datasheet entry (planner/public_gpu/gpus.json)"
    if r["model"] not in MODELS:
        return f"model {r['model']!r}: no catalog model or config with its shapes"
    if engine == "compiled" and (r.get("tp") or 1) > 1:
        return "tensor parallel: not a path of vramplan's own engine (vLLM plans TP for memory, not speed)"
    if engine == "compiled" and r["quant"] not in COMPILED_QUANTS:
        return f"{r['quant']}: dynamic int8 activation quantization has no weight format in the speed model"
    if engine == "transformers" and r["kind"] != "own_measurement" and r["quant"] not in EAGER_QUANTS:
        return f"{r['quant']}: no vramplan scheme (GPTQ kernels)"
    return ""


def _case(r: dict, metric: str, value: float, common: dict) -> Case:
    engine = common["engine"]
    spec_layers = model_spec(r["model"]).num_layers
    notes: list[str] = []
    test = r.get("test") or ""
    if engine == "llama.cpp":
        quant = r["file_type"]
        if metric.startswith("tg") and metric != "tokens_per_s":
            n = int(metric[2:].split("_")[0])
            depth, new = 0, n
        elif test.startswith("tg"):
            depth, new = 0, int(test[2:].split()[0])
        elif r.get("ubatch") == 1:  # ppN@dD with -ub 1: N decode-like steps from depth D
            n = int(test[2:].split("@")[0].split()[0])
            depth = int(test.split("@d")[1].split()[0]) if "@d" in test else 0
            new = n
        elif "main tg" in test or "llama-cli tg" in test:  # ./main -p '<8 tokens>' -n 256
            depth, new = 8, int(test.split("n=")[1].split(")")[0])
        else:  # XiongjieDai's ./main -n 1024, prompt unstated
            depth, new = 0, XDAI_L2_NEW
            notes.append("prompt not stated: decode from an empty context assumed")
        mid = depth + new // 2
        return Case(**common, metric=metric, measured=value, quant=quant, fit_quant=fit_group(quant),
                    context=max(depth + new, 256), prompt=max(1, mid), notes=notes)
    if engine == "compiled":
        bits, group = COMPILED_QUANTS[r["quant"]]
        scheme = compiled_scheme(bits, group)
        if r["engine"] == "gpt-fast":
            prompt, new = GPT_FAST_PROMPT, GPT_FAST_NEW
            notes.append("200 new tokens assumed (generate.py's default)")
        else:
            prompt, new = GPT_FAST_PROMPT, 200  # torchao's benchmark_results.txt: max_new_tokens 200
        if r["quant"] == "autoquant-int4hqq":
            notes.append("autoquant's int4 HQQ layers planned as int4 weight-only, group 64")
        return Case(**common, metric=metric, measured=value, quant=scheme.name, fit_quant=scheme.name,
                    group_size=group, context=prompt + new, prompt=prompt + new // 2, notes=notes)
    # transformers' eager forward
    quant = EAGER_QUANTS.get(r["quant"], r["quant"])
    if r["kind"] == "own_measurement":
        prompt, new = r["prompt_tokens"], r["new_tokens"]
    elif "optimum" in common["source"]:  # huggingface/optimum's GPTQ benchmark: prompt 512, 512 new tokens (stated)
        prompt, new = 512, 512
    else:
        prompt, new = OPTIMUM_BENCHMARK_PROMPT, OPTIMUM_BENCHMARK_NEW
        notes.append(f"prompt {prompt} and {new} new tokens assumed (optimum-benchmark's lengths are not stated)")
    batch = r.get("batch") or 1
    measured = value
    if batch > 1:  # the record's tokens/s counts every sequence
        notes.append(f"batch {batch}: tokens/s of all sequences")
    return Case(**common, metric=metric, measured=measured, quant=quant, fit_quant=quant, context=prompt + new,
                prompt=prompt + new // 2, batch=batch, attention_impl=r.get("attention_impl"),
                offload=r.get("offload"), gpu_layers=r.get("gpu_layers") if r.get("offload") else spec_layers,
                notes=notes)


# ---------------------------------------------------------------- memory records
MEMORY_TOLERANCE = 0.03  # issue 25: within 3 % wherever a record is complete
# Why a complete memory record's quantity misses, where the cause is a rule this benchmark does not own (llama.cpp's and
# vLLM's rules are planner/engines/llamacpp_rules.py and vllm.py): the test marks each an expected failure with it.
KNOWN_MISSES = {
    "compute_buffer_fa_off": (
        "llamacpp_rules.compute_buffer_bytes estimates the graph with flash attention on (COMPUTE_*_COPIES + an f16 KQ "
        "mask); these builds ran without it, and their f32 KQ scores (n_ctx x n_ubatch x heads) shape the buffer: "
        "70.5 MiB at n_ctx 512, 164 MiB at 2048, against the estimate's 97-99 MiB"),
    "gptneox": ("Pythia is model_type gpt_neox: planner/architectures has no builder for it and planner/gguf no "
                "gptneox tensor rules"),
    "no_config": "no catalog model or config with this model's shapes",
    "mxfp4": ("gpt-oss ships MXFP4 expert weights; vllm.py's weight formats (bf16, fp16, fp8, bitsandbytes) have none, "
              "so its weights are counted in bf16"),
    "vllm_activation": (
        "vllm.py's profile-run activation estimate (PROFILE_*_COPIES_ASSUMED: 1.4-2.3 GiB here) is below the 4.8-5.6 "
        "GiB these vLLM logs measured (block size 128, prefix caching, the 'latest' image): the KV pool comes out "
        "5-7 % high"),
    "cudagraph": ("vllm.py assumes 1 GiB of CUDA graphs per GPU (CUDAGRAPH_BYTES_ASSUMED); the logs measured 0.1-1.03 "
                  "GiB, and llm-d's table even negative figures"),
}


MEMORY_QUANTITIES = ("model_buffer_mib", "cpu_buffer_mib", "cpu_mapped_buffer_mib", "kv_buffer_mib",
                     "compute_buffer_mib", "weights_gib", "weights_gib_per_gpu", "kv_cache_gib", "kv_cache_gib_per_gpu",
                     "kv_tokens", "max_concurrency", "cuda_graph_gib", "cuda_graph_gib_per_gpu")


def memory_checks() -> list[dict]:
    """Every quantity of every complete llama.cpp and vLLM memory record: measured, predicted, and the known miss
    (a KNOWN_MISSES key) where one applies."""
    out = []
    for r in records():
        if r["kind"] not in ("llamacpp_buffers", "vllm_startup") or not r["complete"]:
            continue
        if r["model"] not in MODELS:
            why = "gptneox" if "gptneox" in (r["model"] or "") else "no_config"
            out += [{"record": r["id"], "quantity": q, "measured": v, "predicted": None, "miss": why}
                    for q, v in r["measured"].items() if q in MEMORY_QUANTITIES and isinstance(v, (int, float))]
            continue
        out += _llamacpp_memory(r) if r["kind"] == "llamacpp_buffers" else _vllm_memory(r)
    for c in out:
        c["ok"] = (c["predicted"] is not None and (
            c["predicted"] == c["measured"] if isinstance(c["measured"], bool)
            else abs(c["predicted"] - c["measured"]) <= MEMORY_TOLERANCE * abs(c["measured"])))
        if c["ok"]:
            c["miss"] = None  # a known gap that happens to land within the tolerance here
    return out


def _llamacpp_memory(r: dict) -> list[dict]:
    """llama.cpp's buffers for the record's launch (main / llama-cli / llama-perplexity: one sequence, -ngl all):
    the GPU's model buffer (every layer and the output layer), the host's (token_embd), the KV and compute buffers."""
    from vramplan.planner.engines import llamacpp_rules as rules
    from vramplan.planner.units import MiB

    spec = model_spec(r["model"])
    model = rules.gguf_model(spec, r["file_type"])
    slots = rules.Slots(count=1, unified=True, logit_rows=1, output_rows=1)
    req = Request(context=r["n_ctx"], engine="llama.cpp", quant=(r["file_type"],), kv_dtype=(r["kv_type"],))
    m = r["measured"]
    fa_off = not r.get("flash_attn")
    rows = [("model_buffer_mib", (sum(model.layers) + model.output_bytes) / MiB, None),
            ("cpu_buffer_mib", model.token_embd_bytes / MiB, None),
            ("kv_buffer_mib", sum(rules.kv_bytes_per_layer(spec, r["kv_type"], req, slots)) / MiB, None),
            ("compute_buffer_mib", rules.compute_buffer_bytes(spec, req, with_logits=True, slots=slots) / MiB,
             "compute_buffer_fa_off" if fa_off else None)]
    return [{"record": r["id"], "quantity": q, "measured": m[q], "predicted": round(v, 2), "miss": miss}
            for q, v, miss in rows if q in m]


def _before_033(version: str | None) -> bool:
    """Whether a record's vLLM version (as the record states it: "0.10.1.1", "0.26.1rc1.dev608+g..", "vllm") is older
    than 0.33; an unstated one counts as older (every record predates 0.33)."""
    import re

    m = re.match(r"\D*(\d+)\.(\d+)", version or "")
    return m is None or (int(m.group(1)), int(m.group(2))) < (0, 33)


def _vllm_memory(r: dict) -> list[dict]:
    """vLLM's start-up figures from planner/engines/vllm.py's rules at the record's gpu_memory_utilization, TP and
    max_model_len: weights, the KV pool, its tokens and the concurrency it gives, the CUDA graphs, and whether it
    starts at all."""
    from vramplan.planner.engines import vllm as V
    from vramplan.planner.units import GiB

    spec = model_spec(r["model"])
    key = gpu_key(r["gpu"])
    hw = base_profile(key, r.get("gpu_count") or 1)
    seen = GPUS[key].get("memory_seen_by_cuda")
    if seen:  # the total the record states (what vLLM's worker sees), not nvidia-smi's: VLLMModel takes its CUDA
        # shortfall off a profile's NVML total, so the stated total is given back with it
        hw = replace(hw, gpus=(replace(hw.gpus[0], memory_bytes=int(float(seen.split()[0]) * GiB)
                                       + V.CUDA_HIDDEN_BYTES_ASSUMED),))
    q = (r["quant"] or "").lower()
    fmt = V.weight_format("bnb-int8") if "fp8" in q else V.weight_format("bf16")
    tp = r.get("tp") or 1
    m = V.VLLMModel(spec, hw, Request(context=r["max_model_len"]), fmt, "auto")
    launched = r["gpu_memory_utilization"]
    m.utilization = lambda distributed: launched  # as launched, not as vramplan would choose it
    lay = m.layout(tp, 1, 1)
    # vLLM 0.33 (the rules' version) takes its CUDA-graph estimate out of the KV pool; the records' older vLLM did
    # not (they log the graphs after the pool is sized): given back for them
    pool = lay.kv_pool_bytes + (lay.cudagraph_bytes if _before_033(r.get("engine_version")) else 0)
    block = r["measured"].get("block_size") or m.attention_backend()[1]
    per_token = sum(kv.page_bytes / kv.block_size for kv in m.layer_kv(tp))
    tokens = int(max(0, pool) // (per_token * block) * block)
    mxfp4 = spec.model_type == "gpt_oss"
    meas = r["measured"]
    rows = [("weights_gib", lay.weights_bytes / GiB, "mxfp4" if mxfp4 else None),
            ("weights_gib_per_gpu", lay.weights_bytes / GiB, "mxfp4" if mxfp4 else None),
            ("kv_cache_gib", pool / GiB, "mxfp4" if mxfp4 else
             "vllm_activation" if "activation_peak_gib" in meas else None),
            ("kv_cache_gib_per_gpu", pool / GiB, "mxfp4" if mxfp4 else None),
            ("kv_tokens", tokens, "mxfp4" if mxfp4 else None),
            ("max_concurrency", tokens / r["max_model_len"], "mxfp4" if mxfp4 else None),
            ("cuda_graph_gib", V.CUDAGRAPH_BYTES_ASSUMED / GiB, "cudagraph"),
            ("cuda_graph_gib_per_gpu", V.CUDAGRAPH_BYTES_ASSUMED / GiB, "cudagraph")]
    out = [{"record": r["id"], "quantity": q, "measured": meas[q], "predicted": round(v, 4), "miss": miss}
           for q, v, miss in rows if isinstance(meas.get(q), (int, float))]
    failed = bool(meas.get("startup_failed") or meas.get("oom"))
    out.append({"record": r["id"], "quantity": "starts", "measured": not failed, "predicted": lay.fits,
                "miss": "mxfp4" if mxfp4 and lay.fits == failed else None})
    return out


