"""Where one decode step's time goes: torch.profiler over a few steps, per attention implementation and scheme.

On an H200 (2026-11-26) bf16 with SDPA decoded at 45-58 ms per token for Llama-3.2-1B, 3B and Llama-3.1-8B alike,
while the same 1B model with eager attention took 12 ms and bnb-nf4 with SDPA 13 ms: a fixed cost per token the
per-layer speed model cannot follow. This benchmark is the first thing to run on the next GPU: for each (scheme,
attention) it times the first prefill (cold), a second one at the same length and one at a new length, then
`steps` decode steps after a warm-up, profiles three of them, and writes the wall time per step, the CPU and GPU busy
time per step, and the ops that take the most (self) time, as JSON and Markdown.

The second H200 session (2026-11-26) profiled it: the 45-58 ms did not come back (1B bf16 SDPA: 8.4-11.5 ms per step
in five fresh processes), SDPA ran FlashAttention (not cuDNN) whichever backend order was set, and a step is bound
by the host: 3.9 ms of GPU work under 12-21 ms of CPU time (about 4200 ops). See
bench/results/gpu-nvidia-h200-2/README.md.

    python bench/decode_profile.py --model llama-3.2-1b --quants bf16,bnb-nf4 --attn sdpa,eager --machine gpu
    python bench/decode_profile.py --model qwen2.5-0.5b --quants bf16 --attn sdpa,eager --device cpu --machine smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed
TOP_OPS = 12


def profile_one(config: dict, quant: str, attn: str, device: str, prompt: int, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vramplan.planner.quant import KV_SCHEMES, SCHEMES
    from vramplan.runtime.attention import use_attention
    from vramplan.runtime.generate import decode_one_token, prefill, synthetic_prompt
    from vramplan.runtime.kvcache import make_cache
    from vramplan.runtime.load import load_model
    from vramplan.runtime.measure import synchronize

    model = load_model(config, scheme=SCHEMES[quant], dummy_weights=True, device=device,
                       random_device=device if device != "cpu" else None).model
    use_attention(model, attn, device)  # SDPA on the CPU packed, as the runtime runs it
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = synthetic_prompt(prompt, vocab, seed=0).to(device)
    times: list[float] = []
    prefill_ms: dict[str, float] = {}
    with torch.no_grad():
        for label, n in (("first", prompt), ("again", prompt), ("new_length", prompt + 37)):
            synchronize(device)
            t0 = time.perf_counter()
            cache = make_cache(KV_SCHEMES["bf16"], model.config)
            logits = prefill(model, synthetic_prompt(n, vocab, seed=1).to(device), cache, 2048)
            synchronize(device)
            prefill_ms[label] = 1e3 * (time.perf_counter() - t0)
            del cache, logits
        cache = make_cache(KV_SCHEMES["bf16"], model.config)
        token = prefill(model, ids, cache, 2048).argmax(dim=-1, keepdim=True)
        position = prompt
        for _ in range(3):  # warm-up steps
            token = decode_one_token(model, token, position, cache).argmax(dim=-1, keepdim=True)
            position += 1
        synchronize(device)
        for _ in range(steps):
            t0 = time.perf_counter()
            token = decode_one_token(model, token, position, cache).argmax(dim=-1, keepdim=True)
            int(token.item())
            synchronize(device)
            times.append(time.perf_counter() - t0)
            position += 1
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                token = decode_one_token(model, token, position, cache).argmax(dim=-1, keepdim=True)
                int(token.item())
                position += 1
            synchronize(device)
    averages = prof.key_averages()
    gpu = device != "cpu"

    def gpu_self(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    def row(e) -> dict:
        return {"op": e.key, "calls_per_step": e.count / 3, "self_cpu_us_per_step": e.self_cpu_time_total / 3,
                "self_gpu_us_per_step": gpu_self(e) / 3 if gpu else None}

    by_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    by_gpu = sorted(averages, key=gpu_self, reverse=True)[:TOP_OPS] if gpu else []
    result = {"quant": quant, "attn": attn, "device": device, "prompt": prompt, "steps": steps,
              "prefill_ms": prefill_ms,
              "dtype": str(model.get_input_embeddings().weight.dtype),
              "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
              "cpu_busy_ms_per_step": sum(e.self_cpu_time_total for e in averages) / 3 / 1e3,
              "gpu_busy_ms_per_step": sum(gpu_self(e) for e in averages) / 3 / 1e3 if gpu else None,
              "ops_per_step": sum(e.count for e in averages) / 3,
              "top_cpu": [row(e) for e in by_cpu], "top_gpu": [row(e) for e in by_gpu]}
    del model, cache
    if gpu:
        torch.cuda.empty_cache()
    return result


def markdown(out: dict) -> str:
    lines = [f"# Decode step profile: {out['model']} on {out['machine']}", "", f"{out['date']}; {out['versions']}", "",
             "| scheme | attention | step ms (median) | CPU busy ms | GPU busy ms | ops per step "
             "| prefill ms: first / again / new length |",
             "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['quant']} | {r['attn']} | error: {r['error']} | | | | |")
            continue
        gpu = "-" if r["gpu_busy_ms_per_step"] is None else f"{r['gpu_busy_ms_per_step']:.2f}"
        pf = " / ".join(f"{r['prefill_ms'][k]:.1f}" for k in ("first", "again", "new_length"))
        lines.append(f"| {r['quant']} | {r['attn']} | {r['step_ms_median']:.2f} | {r['cpu_busy_ms_per_step']:.2f} | "
                     f"{gpu} | {r['ops_per_step']:.0f} | {pf} |")
    for r in out["rows"]:
        if "error" in r:
            continue
        for kind in ("top_cpu", "top_gpu"):
            if not r[kind]:
                continue
            lines += ["", f"## {r['quant']}, {r['attn']}: top ops by self {kind[4:].upper()} time per step", "",
                      "| op | calls | self CPU us | self GPU us |", "|---|---|---|---|"]
            for o in r[kind]:
                g = "-" if o["self_gpu_us_per_step"] is None else f"{o['self_gpu_us_per_step']:.0f}"
                lines.append(f"| `{o['op']}` | {o['calls_per_step']:.0f} | {o['self_cpu_us_per_step']:.0f} | {g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", help="catalog model (dummy weights from its config)")
    ap.add_argument("--quants", default="bf16,bnb-nf4")
    ap.add_argument("--attn", default="sdpa,eager", help="attention implementations (comma list)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--machine", required=True, help="name used in the result file names")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    from vramplan.planner.sources import resolve_model
    from vramplan.runtime.calibrate import versions

    config = resolve_model(args.model).config
    rows = []
    out = {"benchmark": "decode_profile", "model": args.model, "machine": args.machine,
           "date": time.strftime("%Y-%m-%d"), "versions": versions(), "platform": platform.platform(), "rows": rows}
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    for quant in args.quants.split(","):
        for attn in args.attn.split(","):
            print(f"{args.model} {quant} {attn}", flush=True)
            try:
                rows.append(profile_one(config, quant, attn, args.device, args.prompt, args.steps))
            except Exception as e:  # noqa: BLE001 - a failed row is a result; the others still run
                rows.append({"quant": quant, "attn": attn, "error": f"{type(e).__name__}: {e}"[:300]})
            (results / f"decode-profile-{args.machine}.json").write_text(json.dumps(out, indent=2) + "\n")
            (results / f"decode-profile-{args.machine}.md").write_text(markdown(out))
    print(markdown(out))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
