"""vramplan's llama.cpp plans against a real llama-server: the exported command run, its memory and speed measured.

For each case below (a real architecture with random weights, or a small MoE of our own), this script
1. saves the model with transformers (random init, bf16) and converts it with llama.cpp's
   convert_hf_to_gguf.py --outtype f16, writing a byte-fallback SentencePiece vocabulary of the model's
   vocab size (the tokenizer's content does not change any size; the prompts are token ids),
2. quantizes it with `llama-quantize` to the case's file type,
3. plans it with `plan_llamacpp` on the given hardware profile and writes the command with
   `llama_server_command` (vramplan's `plan --emit llama.cpp`), then runs exactly that command
   (only -m points at the file, plus --host/--port/--threads/-lv),
4. reads llama.cpp's own buffer sizes from its log (model per buffer type, KV, compute, output), the
   server's RSS after load and its peak (VmHWM) after a prompt, and the /completion timings,
5. with --fit, fits llama.cpp's efficiencies (weights per GGUF file type, its attention kernels) to the FIT_CASES runs
   with planner.calibration.fit and writes them into --profile: llama.cpp plans on that profile then use them,
6. writes predicted (from the rules and profile as they are now) next to measured, per term, as JSON and Markdown.

It needs a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/) and llama-server + llama-quantize built from
that tree (CPU build); both are given by path, nothing is built here. llama-cpp-python's sdist vendors one:

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON && cmake --build build -j
    python bench/llamacpp_serve.py --llama-cpp llama_cpp_python-*/vendor/llama.cpp --bin build/bin --fit \
        --commit <the tree's commit> --name cpu-dev
    python bench/llamacpp_serve.py --from-json --name cpu-dev   # re-predict the stored runs, no llama.cpp needed
"""

from __future__ import annotations

import argparse
import shlex
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, replace
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

from gguf_golden import CONVERT_TEMPLATE, convert, llama_cpp_commit, quantize  # noqa: E402

from vramplan.planner.architectures import spec_from_config  # noqa: E402
from vramplan.planner.engines import llamacpp_rules as rules  # noqa: E402
from vramplan.planner.gguf import gguf_file_bytes  # noqa: E402
from vramplan.planner.engines.llamacpp import LLAMA_CPP_BACKENDS, llama_server_command, plan_llamacpp  # noqa: E402
from vramplan.planner.engines.llamacpp_fit import ServerRun, fit_llamacpp  # noqa: E402
from vramplan.planner.profile_yaml import dumps_profile  # noqa: E402
from vramplan.planner.profile_yaml import load_profile  # noqa: E402
from vramplan.planner.request import Request  # noqa: E402
from vramplan.planner.units import MiB  # noqa: E402
from vramplan.runtime.llamacpp_run import free_port, proc_memory, wait_healthy  # noqa: E402

REFERENCE = ROOT.parent / "shared" / "reference" / "hf-configs"
# A small MoE of our own (no catalog MoE converts and runs in minutes on 2 cores): Qwen3-MoE rules.
SMALL_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024,
                 intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1,
                 mlp_only_layers=[], vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=32768)
# name -> (config: reference file or dict, file type, KV type, context, batch, prompt tokens)
CASES: dict[str, tuple] = {
    "qwen3-0.6b-q4km-f16": ("Qwen--Qwen3-0.6B.json", "Q4_K_M", "f16", 4096, 1, 1024),
    "qwen3-0.6b-q8-f16": ("Qwen--Qwen3-0.6B.json", "Q8_0", "f16", 4096, 1, 1024),
    "qwen3-0.6b-q8-q8kv": ("Qwen--Qwen3-0.6B.json", "Q8_0", "q8_0", 8192, 1, 1024),
    "llama-3.2-1b-q4km-np4": ("meta-llama--Llama-3.2-1B.json", "Q4_K_M", "f16", 2048, 4, 512),
    "llama-3.2-1b-q4km-q8kv": ("meta-llama--Llama-3.2-1B.json", "Q4_K_M", "q8_0", 4096, 1, 1024),
    "llama-3.2-1b-q4km-q4kv": ("meta-llama--Llama-3.2-1B.json", "Q4_K_M", "q4_0", 4096, 1, 1024),
    "gemma-2-2b-q4km-swa": ("google--gemma-2-2b.json", "Q4_K_M", "f16", 8192, 1, 1024),
    "gemma-2-2b-q4km-np3": ("google--gemma-2-2b.json", "Q4_K_M", "f16", 3000, 3, 1024),  # a stream per slot, padded
    "qwen2.5-0.5b-q6k-f16": ("Qwen--Qwen2.5-0.5B.json", "Q6_K", "f16", 4096, 1, 1024),
    "qwen2.5-0.5b-q6k-q4kv": ("Qwen--Qwen2.5-0.5B.json", "Q6_K", "q4_0", 16384, 1, 1024),
    # held out: prompts twice the fitted ones' (prefill attention grows with their square)
    "qwen2.5-0.5b-q6k-f16-2k": ("Qwen--Qwen2.5-0.5B.json", "Q6_K", "f16", 4096, 1, 2048),
    "qwen2.5-0.5b-q6k-q4kv-2k": ("Qwen--Qwen2.5-0.5B.json", "Q6_K", "q4_0", 4096, 1, 2048),
    "small-moe-q4km": (SMALL_MOE, "Q4_K_M", "f16", 4096, 1, 1024),
}
N_PREDICT = 32
# Each case also runs this short prompt first: decode and prefill at two sizes.
SHORT_PROMPT = 256
# --fit fits llama.cpp's efficiencies to these (dense models): weights and attention on the f16-cache runs, then the
# attention on each quantized cache type given those; the other cases are held out.
FIT_CASES = ("qwen3-0.6b-q4km-f16", "llama-3.2-1b-q4km-np4", "gemma-2-2b-q4km-swa", "qwen3-0.6b-q8-f16",
             "qwen2.5-0.5b-q6k-f16", "qwen3-0.6b-q8-q8kv", "qwen2.5-0.5b-q6k-q4kv")

# convert_hf_to_gguf.py with every model class's set_vocab writing a byte-fallback SPM vocabulary of exactly
# vocab_size tokens (llama.cpp sizes token_embd by the vocabulary, so the count must match).
CONVERT_WITH_BYTE_VOCAB = CONVERT_TEMPLATE.replace("SET_VOCAB", """
def set_vocab(self):
    n = self.hparams["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\\u2581t{i}" for i in range(n - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (n - len(types))
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens[:n])
    w.add_token_scores([0.0] * n)
    w.add_token_types(types[:n])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
""")

# llama.cpp's log lines (at -lv 4) this reads: "load_tensors:   CPU_Mapped model buffer size =   370.96 MiB",
# "llama_kv_cache:        CPU KV buffer size =   448.00 MiB", "sched_reserve:        CPU compute buffer size = ...",
# "llama_context:        CPU  output buffer size =     2.32 MiB". A gemma-2 model has two KV caches (iswa).
BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")
# llama-server's prompt cache (finished prompts' KV state, in RAM up to --cache-ram) and, for models with sliding-window
# layers, its context checkpoints: "- cache state: 1 prompts, 41.956 MiB (limits: ...)",
# "created context checkpoint 1 of 32 (pos_min = 0, pos_max = 251, n_tokens = 252, size = 12.800 MiB)".
CACHE_LINE = re.compile(r"cache state: \d+ prompts, ([\d.]+) MiB")
CHECKPOINT_LINE = re.compile(r"created context checkpoint .* size = ([\d.]+) MiB")


def load_config(source) -> dict:
    return dict(source) if isinstance(source, dict) else json.loads((REFERENCE / source).read_text())


def save_model(config: dict, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    skip = {"architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "model_type"}
    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k not in skip})
    cfg.architectures = config.get("architectures")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out_dir)


def make_gguf(llama_cpp: Path, bin_dir: Path, config: dict, file_type: str, work: Path, key: str) -> Path:
    out = work / f"{key}-{file_type}.gguf"
    if out.exists():
        return out
    model_dir, f16 = work / key, work / f"{key}-f16.gguf"
    if not f16.exists():
        save_model(config, model_dir)
        convert(llama_cpp, model_dir, f16, CONVERT_WITH_BYTE_VOCAB)
    quantize(bin_dir / "llama-quantize", f16, out, file_type)
    return out


def serve(argv: list[str], gguf: Path, prompts: list[int], vocab: int, threads: int, repeats: int) -> dict:
    """Run the exported llama-server command on `gguf`, send prompts of random token ids (each a fresh sequence, then
    N_PREDICT tokens; `repeats` of each length), return what was measured."""
    port = free_port()
    cmd = [*argv, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads), "-lv", "4"]
    cmd[cmd.index("-m") + 1] = str(gguf)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    out: dict = {"command": cmd}
    try:
        t0 = time.monotonic()
        wait_healthy(proc, port, log, timeout_s=300)
        out["load_s"] = time.monotonic() - t0
        out["rss_loaded"] = proc_memory(proc.pid)
        rng = random.Random(0)
        out["runs"] = []
        for n in prompts:
            timings, rss = [], None
            for _ in range(repeats):  # a new prompt each time: nothing to reuse from the prompt cache
                body = {"prompt": [rng.randrange(300, vocab) for _ in range(n)], "n_predict": N_PREDICT,
                        "ignore_eos": True, "cache_prompt": False}
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
                timings.append(json.load(urllib.request.urlopen(req, timeout=1800))["timings"])
                rss = rss or proc_memory(proc.pid)  # after the first: before the prompt cache holds anything
            # the fastest of the repeats: on a shared machine interference only ever slows a run down
            best = dict(min(timings, key=lambda t: t["predicted_ms"] / t["predicted_n"]))
            best["prompt_ms"] = min(t["prompt_ms"] for t in timings)
            out["runs"].append({"prompt_tokens": n, "timings": best, "repeats": timings, "rss": rss})
        out["rss_after"] = proc_memory(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    buffers: dict[str, float] = {}
    for line in log:
        m = BUFFER_LINE.search(line)
        if m:
            key = f"{m.group(1)} {m.group(2)}"
            buffers[key] = buffers.get(key, 0.0) + float(m.group(3))
    out["buffers_mib"] = buffers
    out["prompt_cache_mib"] = [float(m.group(1)) for m in map(CACHE_LINE.search, log) if m]
    out["checkpoints_mib"] = [float(m.group(1)) for m in map(CHECKPOINT_LINE.search, log) if m]
    out["log_tail"] = [line.rstrip() for line in log if "memory breakdown" in line or "|   - " in line][-4:]
    return out


def predicted(spec, hw, req: Request, file_type: str, kv_type: str) -> tuple[dict, list[str]]:
    plan = plan_llamacpp(spec, hw, req)
    if not plan.fits:
        raise RuntimeError(f"{spec.name}: the plan does not fit: {plan.reasons}")
    cpu = plan.chosen.memory.cpu
    speed = plan.chosen.speed
    slots = rules.llama_server_slots(req)
    return {
        "gguf_file_bytes": gguf_file_bytes(spec, file_type),
        "host_weights_bytes": cpu.weights_bytes,
        "kv_bytes": sum(rules.kv_bytes_per_layer(spec, kv_type, req)),
        "compute_bytes": rules.compute_buffer_bytes(spec, req, with_logits=True),
        "output_bytes": rules.output_buffer_bytes(spec, slots),
        "process_base_bytes": cpu.runtime_base_bytes,
        "ram_total_bytes": cpu.weights_bytes + cpu.kv_cache_bytes + cpu.workspace_bytes + cpu.runtime_base_bytes,
        "ceiling_decode_tokens_per_s": speed.ceiling_decode_tokens_per_s,
    }, llama_server_command(spec, plan)


def case_spec_request(r: dict):
    spec = spec_from_config(r["config"], name=r["model"])
    req = Request(context=r["context"], batch=r["batch"], prompt_tokens=r["prompt_tokens"], engine="llama.cpp",
                  quant=(r["file_type"],), kv_dtype=(r["kv_type"],))
    return spec, req


def run_case(name: str, args, hw, work: Path) -> dict:
    source, file_type, kv_type, context, batch, prompt = CASES[name]
    config = load_config(source)
    key = config.get("_name_or_path") or (source.removesuffix(".json") if isinstance(source, str) else name)
    r = {"model": key, "config": config, "file_type": file_type, "kv_type": kv_type, "context": context,
         "batch": batch, "prompt_tokens": prompt, "n_predict": N_PREDICT}
    spec, req = case_spec_request(r)
    _, argv = predicted(spec, hw, req, file_type, kv_type)
    gguf = make_gguf(args.llama_cpp, args.bin, config, file_type, work, key.replace("/", "--"))
    measured = serve([str(args.bin / "llama-server"), *argv[1:]], gguf, [SHORT_PROMPT, prompt], config["vocab_size"],
                     args.threads, args.repeats)
    measured["gguf_file_bytes"] = gguf.stat().st_size
    return {**r, "exported_command": argv, "measured": measured}


def _decode_s(run: dict) -> float:
    t = run["timings"]
    return t["predicted_ms"] / 1000 / t["predicted_n"]


def server_runs(results: dict, names) -> list[ServerRun]:
    """The measured requests of these cases, as the fit takes them."""
    runs = []
    for name in names:
        r = results["cases"][name]
        spec, _ = case_spec_request(r)
        runs += [ServerRun(spec=spec, file_type=r["file_type"], kv_type=r["kv_type"], prompt=run["prompt_tokens"],
                           new_tokens=r["n_predict"], decode_s_per_token=_decode_s(run),
                           prefill_s=run["timings"]["prompt_ms"] / 1000) for run in r["measured"]["runs"]]
    return runs


def without_llamacpp_calibration(hw):
    cal = hw.calibration
    if cal is None:
        return hw
    return replace(hw, calibration=replace(cal, entries=tuple(e for e in cal.entries
                                                              if e.backend not in LLAMA_CPP_BACKENDS)))


def predict_all(results: dict, hw) -> None:
    """Every prediction from the rules and `hw` as they are now: memory per case; decode and TTFT per run, for the one
    sequence each run is (calibrated with `hw`'s llama.cpp entries, and without them)."""
    bare = without_llamacpp_calibration(hw)
    for r in results["cases"].values():
        spec, req = case_spec_request(r)
        r["predicted"], _ = predicted(spec, hw, req, r["file_type"], r["kv_type"])
        for run in r["measured"]["runs"]:
            one = replace(req, batch=1, prompt_tokens=run["prompt_tokens"])
            for key, h in (("predicted", hw), ("predicted_uncalibrated", bare)):
                speed = plan_llamacpp(spec, h, one).chosen.speed
                run[key] = {"decode_tokens_per_s": speed.decode_tokens_per_s, "ttft_s": speed.ttft_s}


def _mib(b) -> str:
    return f"{b / MiB:,.1f}"


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.0f} %"


def speed_lines(results: dict) -> list[str]:
    fitted = set(results.get("fit", {}).get("cases", ()))
    lines = ["", "## Speed: one sequence, all layers on the CPU", "",
             "Predicted by vramplan's speed model over the GGUF bytes: `uncal.` with its defaults (no llama.cpp "
             "entries in the profile), `cal.` with the efficiencies `--fit` fitted to the runs marked *fit* (the "
             "others are held out: another architecture, file type or cache type). Decode is the mean over "
             f"{N_PREDICT} tokens after the prompt; TTFT is llama-server's prompt time.", "",
             "| case | runs | prompt | decode tok/s uncal. / cal. / meas (cal. error) | TTFT s uncal. / cal. / meas "
             "(cal. error) |", "|---|---|---|---|---|"]
    for name, r in results["cases"].items():
        for run in r["measured"]["runs"]:
            t, p, u = run["timings"], run["predicted"], run["predicted_uncalibrated"]
            dec, ttft = 1 / _decode_s(run), t["prompt_ms"] / 1000
            lines.append(f"| {name} | {'fit' if name in fitted else 'held out'} | {run['prompt_tokens']} | "
                         f"{u['decode_tokens_per_s']:.1f} / {p['decode_tokens_per_s']:.1f} / {dec:.1f} "
                         f"({_err(p['decode_tokens_per_s'], dec)}) | {u['ttft_s']:.2f} / {p['ttft_s']:.2f} / "
                         f"{ttft:.2f} ({_err(p['ttft_s'], ttft)}) |")
    fit_info = results.get("fit")
    if fit_info:
        lines += ["", "Fitted entries (written into the profile):", ""]
        lines += [f"- {e['device']} {e['backend']} {e['quant']}: bandwidth {e['bandwidth_efficiency']}, compute "
                  f"{e['compute_efficiency']}, per layer {e['per_layer_overhead_s'] * 1e6:.1f} us"
                  for e in fit_info["entries"]]
        lines += [f"- warning: {w}" for w in fit_info["warnings"]]
    return lines


def measured_terms(m: dict) -> dict:
    """llama.cpp's buffers by kind (MiB), and the RSS that is not stale page cache: llama.cpp maps the file and copies
    the tensors its CPU kernels repack (CPU_REPACK) into RAM of their own, leaving their mapped pages unused
    (clean, reclaimable page cache that RSS still counts)."""
    buf = m["buffers_mib"]

    def kind(k: str) -> float:
        return sum(v for name, v in buf.items() if name.endswith(f" {k}"))

    repack = buf.get("CPU_REPACK model", 0.0)
    first = m["runs"][0]["rss"]["VmHWM"] / MiB  # before any prompt cache: the first prompt's own state is not cached
    return {"kv": kind("KV"), "compute": kind("compute"), "output": kind("output"), "repack": repack,
            "rss_first": first, "working_set": first - repack, "rss_peak": m["rss_after"]["VmHWM"] / MiB,
            "prompt_cache": max(m["prompt_cache_mib"], default=0.0), "checkpoints": sum(m["checkpoints_mib"])}


def markdown(results: dict) -> str:
    lines = [f"# llama.cpp ({results['llama_cpp_commit'][:9]}, CPU build) running vramplan's exported commands",
             "", f"Machine: {results['machine']}; profile `{results['profile']}`; {results['threads']} threads. "
             f"Each case: prompts of random token ids, each then {N_PREDICT} tokens; the fastest of "
             f"{results.get('repeats', 1)} requests per prompt length.", "",
             "Memory in MiB. RAM pred is vramplan's llama.cpp plan: the GGUF tensors once, KV, compute + output "
             "buffers, the process. The working set is the server's peak RSS after its first request less the "
             "CPU_REPACK copies' stale mapped pages (llama.cpp repacks Q4_K/Q4_0/IQ4_NL tensors for its CPU kernels "
             "into RAM of their own; the file pages they came from stay in RSS as reclaimable page cache). After "
             "the second prompt RSS also holds llama-server's prompt cache (the first prompt's KV state, bounded by "
             "--cache-ram) and, for sliding-window models, context checkpoints: their logged sizes are shown.", "",
             "| case | command | GGUF file pred / meas | KV pred / meas | compute pred / meas | output pred / meas "
             "| repacked | RAM pred | working set | RSS peak (prompt cache, checkpoints) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["cases"].items():
        p, m = r["predicted"], r["measured"]
        mt = measured_terms(m)
        lines.append(
            f"| {name} | `{shlex.join(r['exported_command'][1:])}` | {_mib(p['gguf_file_bytes'])} / "
            f"{_mib(m['gguf_file_bytes'])} | {_mib(p['kv_bytes'])} / {mt['kv']:,.1f} | {_mib(p['compute_bytes'])} / "
            f"{mt['compute']:,.1f} | {_mib(p['output_bytes'])} / {mt['output']:,.1f} | {mt['repack']:,.1f} | "
            f"{_mib(p['ram_total_bytes'])} | {mt['working_set']:,.1f} | {mt['rss_peak']:,.1f} "
            f"({mt['prompt_cache']:,.1f}, {mt['checkpoints']:,.1f}) |")
    return "\n".join(lines + speed_lines(results)) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree")
    ap.add_argument("--bin", type=Path, help="folder with llama-server and llama-quantize")
    ap.add_argument("--profile", default=str(ROOT / "bench" / "results" / "profile-cpu-dev-calibrated.yaml"))
    ap.add_argument("--name", default="cpu-dev", help="results go to bench/results/llamacpp-serve-NAME.{json,md}")
    ap.add_argument("--machine", default="2-core AMD EPYC VM (AVX-512), 23.5 GiB RAM, no GPU")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work", type=Path, default=None, help="keep the models and GGUF files here (default: temp)")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--commit", default=None, help="llama.cpp commit, when the tree is no git checkout")
    ap.add_argument("--fit", action="store_true", help="fit llama.cpp's efficiencies to the FIT_CASES runs and "
                    "write them into --profile")
    ap.add_argument("--repeats", type=int, default=2, help="requests per prompt length; the fastest is kept")
    ap.add_argument("--keep", action="store_true", help="measure only --cases, keeping the other cases' "
                    "measurements in bench/results/llamacpp-serve-NAME.json")
    ap.add_argument("--from-json", action="store_true", help="reuse the measurements of bench/results/"
                    "llamacpp-serve-NAME.json (no llama.cpp needed)")
    args = ap.parse_args()
    hw = load_profile(args.profile)
    out = ROOT / "bench" / "results" / f"llamacpp-serve-{args.name}"
    if args.from_json:
        results = json.loads(out.with_suffix(".json").read_text())
    else:
        if args.llama_cpp is None or args.bin is None:
            ap.error("--llama-cpp and --bin are needed to measure (or --from-json)")
        results = {"generated_by": "bench/llamacpp_serve.py", "llama_cpp_commit": args.commit or
                   llama_cpp_commit(args.llama_cpp), "machine": args.machine, "profile": Path(args.profile).name,
                   "threads": args.threads, "repeats": args.repeats, "cases": {}}
        if args.keep and out.with_suffix(".json").exists():  # measure only --cases, keep the others' measurements
            before = json.loads(out.with_suffix(".json").read_text())
            results["cases"] = before["cases"]
            if "fit" in before:
                results["fit"] = before["fit"]
        with tempfile.TemporaryDirectory() as tmp:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            for name in args.cases:
                print(f"{name} ...", flush=True)
                results["cases"][name] = run_case(name, args, hw, work)
        results["cases"] = {name: results["cases"][name] for name in CASES if name in results["cases"]}
    if args.fit:
        hw, warnings = fit_llamacpp(hw, server_runs(results, FIT_CASES), commit=results["llama_cpp_commit"],
                                    measured_at=date.today().isoformat())
        results["fit"] = {"cases": list(FIT_CASES), "warnings": warnings,
                          "entries": [asdict(e) for e in hw.calibration.entries if e.backend in LLAMA_CPP_BACKENDS]}
        Path(args.profile).write_text(dumps_profile(hw))
        print(f"wrote llama.cpp's entries into {args.profile}" + "".join(f"\nwarning: {w}" for w in warnings))
    predict_all(results, hw)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
