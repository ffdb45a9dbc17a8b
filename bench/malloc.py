"""Benchmark: how glibc's allocator settings change a CPU run's peak RSS and speed.

On a CPU, what a run frees below glibc's mmap threshold stays in the process heap, and glibc raises that
threshold (up to 32 MiB) after the first large free, so a run's many transient tensors (a quantized KV cache's
dequantized copies and re-quantization, quanto's unpacked weights) leave freed memory in RSS: peak RSS
exceeds what the plan counts although nothing holds it. A fixed small threshold returns it to the system, at
the price of page faults on every large allocation. Each configuration runs in a fresh process (the
environment variables are read when the process starts): load a model with dummy weights, prefill a prompt,
decode a few tokens, and report peak RSS beyond the loaded model, TTFT and decode tokens/s.

    python bench/malloc.py --machine cpu-dev

Writes bench/results/malloc-<machine>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

from vramplan.planner.units import MiB  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"

# name -> environment for the run's process
SETTINGS = {
    "glibc default (dynamic threshold)": {},
    "MALLOC_MMAP_THRESHOLD_=1MiB": {"MALLOC_MMAP_THRESHOLD_": str(1 * MiB)},
    "MALLOC_MMAP_THRESHOLD_=4MiB": {"MALLOC_MMAP_THRESHOLD_": str(4 * MiB)},
    "MALLOC_MMAP_THRESHOLD_=32MiB": {"MALLOC_MMAP_THRESHOLD_": str(32 * MiB)},
    "MALLOC_ARENA_MAX=1": {"MALLOC_ARENA_MAX": "1"},
}

CHILD = r"""
import json, sys, time
import psutil, torch
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.planner.sources import load_spec, resolve_model
from vramplan.runtime.generate import decode_one_token, prefill, synthetic_prompt
from vramplan.runtime.kvcache import make_cache
from vramplan.runtime.load import load_model
from vramplan.runtime.measure import PeakMemorySampler

model, quant, kv, prompt, new_tokens, chunk = sys.argv[1:7]
prompt, new_tokens, chunk = int(prompt), int(new_tokens), int(chunk)
source = resolve_model(model)
spec = load_spec(source)
m = load_model(source.config, scheme=SCHEMES[quant], dummy_weights=True, device="cpu", seed=0).model
ids = synthetic_prompt(prompt, spec.vocab_size, 0)
base = psutil.Process().memory_info().rss
with torch.no_grad(), PeakMemorySampler(device="cpu") as sampler:
    cache = make_cache(KV_SCHEMES[kv], m.config)
    t0 = time.perf_counter()
    logits = prefill(m, ids, cache, chunk)
    ttft = time.perf_counter() - t0
    token = logits.argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for i in range(new_tokens):
        token = decode_one_token(m, token, prompt + i, cache).argmax(-1, keepdim=True)
    decode = new_tokens / (time.perf_counter() - t0)
print(json.dumps({"base_rss_bytes": base, "peak_over_base_bytes": sampler.result.peak_rss_bytes - base,
                  "ttft_s": ttft, "decode_tokens_per_s": decode}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--kv-dtypes", default="bf16,quanto-int4")
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma list of the settings to run")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per setting (RSS varies run to run)")
    ap.add_argument("--machine", default="cpu")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    rows = []
    for kv in args.kv_dtypes.split(","):
        for name, env, repeat in [(n, SETTINGS[n], r) for n in args.settings.split(",") for r in range(args.repeats)]:
            clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            proc = subprocess.run([sys.executable, "-c", CHILD, args.model, args.quant, kv, str(args.prompt),
                                   str(args.new_tokens), str(args.prefill_chunk)],
                                  env={**clean, **env}, capture_output=True, text=True)
            row = {"kv_dtype": kv, "setting": name, "env": env, "repeat": repeat}
            if proc.returncode == 0:
                row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
            print(row, flush=True)
            rows.append(row)
    result = {"benchmark": "allocator settings vs peak RSS and speed (CPU)", "date": time.strftime("%Y-%m-%d"),
              "args": vars(args), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"malloc-{args.machine}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"malloc-{args.machine}.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Allocator settings vs peak RSS and speed on {a['machine']}", "",
             f"{result['date']}; {a['model']} {a['quant']} weights (dummy), prompt {a['prompt']} tokens in chunks of "
             f"{a['prefill_chunk']}, then {a['new_tokens']} decode steps; each row a fresh process.", "",
             "| KV cache | allocator setting | run | peak RSS over the loaded model | TTFT s | decode tok/s |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['kv_dtype']} | {r['setting']} | {r['repeat'] + 1} | failed: {r['error']} | | |")
        else:
            lines.append(f"| {r['kv_dtype']} | {r['setting']} | {r['repeat'] + 1} | "
                         f"{r['peak_over_base_bytes'] / 2**20:.0f} MiB | "
                         f"{r['ttft_s']:.2f} | {r['decode_tokens_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
