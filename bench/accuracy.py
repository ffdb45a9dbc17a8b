"""Accuracy benchmark: plan, then run, and compare predicted with measured.

A matrix of models x quantizations x KV dtypes x contexts (x offloaded splits on a GPU) is
planned and run, each row in a fresh process (runtime.worker) so that peak RAM is the row's own. Writes
bench/results/accuracy-<machine>.json and .md (predicted, measured and error per row; median and worst error) and a
PNG: predicted vs measured decode tokens/s on log axes with y = x, and the same for peak memory.

    python bench/accuracy.py --hardware bench/results/profile-cpu-dev.yaml --machine cpu-dev
    python bench/accuracy.py --hardware h100-measured --machine h100 --models llama-3.1-8b,qwen2.5-14b \
        --quants bf16,bnb-int8,bnb-nf4 --contexts 4k,32k --vram-budget 24GiB --offload-modes stream,cpu
    python bench/accuracy.py --hardware bench/results/profile-cpu-dev-calibrated.yaml --machine cpu-dev-kv \
        --models qwen3-0.6b --quants bf16 --kv-dtypes bf16,fp8,quanto-int4,quanto-int2 --contexts 8k --prompts 6000
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
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

# Not the calibration's matrix (qwen2.5-0.5b and llama-3.2-1b at prompts 64 and 384).
CPU_DEFAULT = dict(models="qwen3-0.6b,gemma-2-2b", quants="bf16,quanto-int8,quanto-int4", contexts="2k",
                   prompts="256,1024", new_tokens=12)
TARGETS_CPU = {"decode_median_pct": 15.0, "decode_worst_pct": 25.0, "ram_pct": 5.0}
TARGETS_GPU = {"decode_pct": 10.0, "ttft_pct": 15.0, "vram_pct": 3.0, "vram_abs_bytes": 128 * 2**20}


def run_row(model, quant, kv_dtype, context, prompt, new_tokens, hw, vram_budget, offload, gpu_layers=None) -> dict:
    from vramplan.planner.request import Request
    from vramplan.planner.units import parse_bytes, parse_context
    from vramplan.runtime.worker import RunFailed, RunJob, run_fresh

    req = Request(context=parse_context(context), prompt_tokens=prompt, quant=(quant,), kv_dtype=(kv_dtype,),
                  vram_budget_bytes=parse_bytes(vram_budget) if vram_budget else None, offload=offload,
                  gpu_layers=gpu_layers)
    t0 = time.time()
    row = {"model": model, "quant": quant, "kv_dtype": kv_dtype, "context": context, "prompt_tokens": prompt,
           "new_tokens": new_tokens, "vram_budget": vram_budget, "offload": offload, "gpu_layers": gpu_layers}
    try:
        report = run_fresh(RunJob.of(model, hw, req, prompt_tokens=prompt, max_new_tokens=new_tokens))
    except RunFailed as e:
        row.update(error=str(e), wall_s=round(time.time() - t0, 1))
        return row
    d = report.to_dict()
    row.update(predicted=d["predicted"], measured=d["measured"], error_pct=d["error_pct"], choice=d["plan"]["choice"],
               errors=d["errors"], notes=d["notes"], wall_s=round(time.time() - t0, 1))
    return row


def best_row(rows: list[dict]) -> dict:
    """The run with the fastest decode, with the smallest TTFT of all runs and the wall time summed."""
    ok = [r for r in rows if "measured" in r]
    if not ok:
        return rows[0]
    best = max(ok, key=lambda r: r["measured"]["decode_tokens_per_s"] or 0)
    m, p = best["measured"], best["predicted"]
    m["ttft_s"] = min(r["measured"]["ttft_s"] for r in ok)
    best["error_pct"]["ttft_s"] = 100.0 * (m["ttft_s"] - p["ttft_s"]) / p["ttft_s"] if p.get("ttft_s") else None
    best["runs"] = len(rows)
    best["wall_s"] = round(sum(r["wall_s"] for r in rows), 1)
    return best


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error_pct" in r]

    def stats(metric):
        vals = [abs(r["error_pct"][metric]) for r in ok if r["error_pct"].get(metric) is not None]
        return {"median_abs_pct": round(statistics.median(vals), 2), "worst_abs_pct": round(max(vals), 2),
                "n": len(vals)} if vals else None

    return {m: stats(m) for m in ("decode_tokens_per_s", "ttft_s", "peak_ram_bytes", "peak_vram_bytes")}


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """The predicted-vs-measured PNG, when matplotlib (the `bench` extra) is installed; False, and a line saying so,
    when it is not: the JSON and Markdown are written before this and stand on their own."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): {path.name} not drawn", flush=True)
        return False

    ok = [r for r in rows if "error_pct" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    panels = [("decode_tokens_per_s", "decode tokens/s", 1.0), ("peak_ram_bytes", "peak RAM (GiB)", 2**30)]
    if any(r["measured"].get("peak_vram_bytes") for r in ok):
        panels[1] = ("peak_vram_bytes", "peak VRAM (GiB)", 2**30)
    kv_varies = len({r.get("kv_dtype", "bf16") for r in ok}) > 1
    for ax, (metric, label, scale) in zip(axes, panels):
        # one series per weight scheme, or per scheme + KV cache where the caches differ (a KV matrix)
        pts = [(r["predicted"][metric] / scale, r["measured"][metric] / scale,
                f"{r['quant']} + {r.get('kv_dtype', 'bf16')} KV" if kv_varies else r["quant"]) for r in ok
               if r["predicted"].get(metric) and r["measured"].get(metric)]
        for q in sorted({p[2] for p in pts}):
            xs = [p[0] for p in pts if p[2] == q]
            ys = [p[1] for p in pts if p[2] == q]
            ax.scatter(xs, ys, label=q, s=36)
        if pts:
            lo = min(min(p[0], p[1]) for p in pts) * 0.7
            hi = max(max(p[0], p[1]) for p in pts) * 1.4
            ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            if hi / lo >= 10:  # a log scale only over a decade or more: below it, it has no labelled tick
                ax.set_xscale("log")
                ax.set_yscale("log")
                from matplotlib.ticker import NullFormatter, ScalarFormatter

                for axis in (ax.xaxis, ax.yaxis):
                    axis.set_major_formatter(ScalarFormatter())
                    axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"predicted {label}")
        ax.set_ylabel(f"measured {label}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(out: dict) -> str:
    lines = [f"# Accuracy: predicted vs measured on {out['machine']}", "",
             f"{out['date']}; hardware profile `{out['hardware']}`; {out['versions']}", "",
             "| model | quant | KV | context | prompt | split | decode tok/s pred | meas | err | TTFT s pred | meas "
             "| err | peak RAM pred | meas | err | peak VRAM err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, kind):
        if v is None:
            return "-"
        return {"pct": f"{v:+.1f}%", "gib": f"{v / 2**30:.2f} GiB", "num": f"{v:.3g}"}[kind]

    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['quant']} | {r.get('kv_dtype', 'bf16')} | {r['context']} | "
                         f"{r['prompt_tokens']} | - | error: {r['error']} |" + " |" * 9)
            continue
        p, m, e, c = r["predicted"], r["measured"], r["error_pct"], r["choice"]
        split = "cpu" if c["compute_device"] == "cpu" else f"{c['gpu_layers']}/{c['total_layers']} {c['offload']}"
        lines.append(
            f"| {r['model']} | {r['quant']} | {r.get('kv_dtype', 'bf16')} | {r['context']} | {r['prompt_tokens']} | "
            f"{split} | {f(p['decode_tokens_per_s'], 'num')} | {f(m['decode_tokens_per_s'], 'num')} | "
            f"{f(e['decode_tokens_per_s'], 'pct')} | "
            f"{f(p['ttft_s'], 'num')} | {f(m['ttft_s'], 'num')} | {f(e['ttft_s'], 'pct')} | "
            f"{f(p['peak_ram_bytes'], 'gib')} | {f(m['peak_ram_bytes'], 'gib')} | {f(e['peak_ram_bytes'], 'pct')} | "
            f"{f(e['peak_vram_bytes'], 'pct')} |")
    lines += ["", "## Summary (absolute % error)", "", "| metric | median | worst | rows |", "|---|---|---|---|"]
    for metric, s in out["summary"].items():
        if s:
            lines.append(f"| {metric} | {s['median_abs_pct']} | {s['worst_abs_pct']} | {s['n']} |")
    lines += ["", f"Targets: {out['targets']}", ""]
    return "\n".join(lines)


def replot(machine: str, results: Path) -> None:
    """Redraw the PNG from a saved JSON (no runs)."""
    out = json.loads((results / f"accuracy-{machine}.json").read_text())
    plot(out["rows"], results / f"accuracy-{machine}.png", f"vramplan predicted vs measured - {machine}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", required=True, help="the (calibrated) profile to plan with")
    ap.add_argument("--machine", required=True, help="name used in the result file names")
    ap.add_argument("--models", default=CPU_DEFAULT["models"])
    ap.add_argument("--quants", default=CPU_DEFAULT["quants"])
    ap.add_argument("--contexts", default=CPU_DEFAULT["contexts"])
    ap.add_argument("--prompts", default=CPU_DEFAULT["prompts"], help="prompt lengths (or 'context' for the whole)")
    ap.add_argument("--new-tokens", type=int, default=CPU_DEFAULT["new_tokens"])
    ap.add_argument("--kv-dtypes", default="bf16", help="KV-cache dtypes (comma list)")
    ap.add_argument("--vram-budget", default=None, help="also run offloaded rows under this GPU budget")
    ap.add_argument("--offload-modes", default="stream,cpu", help="offload modes of the budget rows")
    ap.add_argument("--split-quants", default=None,
                    help="weight schemes that also get the offloaded rows (comma list; default: all of --quants)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per row; the fastest is kept (on a shared machine interference only slows a run)")
    ap.add_argument("--gpu-layers", type=int, default=None,
                    help="the split of the offloaded rows (instead of, or with, --vram-budget)")
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON, Markdown and PNG")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the saved JSON")
    args = ap.parse_args()
    results = Path(args.out)
    if args.replot:
        replot(args.machine, results)
        return

    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.units import parse_context

    hw = resolve_profile(args.hardware)[0]
    from vramplan.runtime.calibrate import versions

    rows: list[dict] = []
    offloaded = args.vram_budget or args.gpu_layers is not None
    split_quants = set(args.split_quants.split(",")) if args.split_quants else None
    meta = {"benchmark": "accuracy", "machine": args.machine, "hardware": args.hardware,
            "date": time.strftime("%Y-%m-%d"), "versions": versions(), "platform": platform.platform()}
    # every scheme's resident rows first, then the offloaded ones: a run cut by its time limit (a GPU call's budget)
    # has measured each scheme once before it spends minutes on the slower offloaded builds
    splits = [(None, None)] + ([(args.vram_budget, m) for m in args.offload_modes.split(",")] if offloaded else [])
    order = [(budget, offload, model, quant, kv_dtype, context, prompt) for budget, offload in splits
             for model in args.models.split(",") for quant in args.quants.split(",")
             if offload is None or split_quants is None or quant in split_quants
             for kv_dtype in args.kv_dtypes.split(",") for context in args.contexts.split(",")
             for prompt in args.prompts.split(",")]
    for budget, offload, model, quant, kv_dtype, context, prompt in order:
        n = parse_context(context) - args.new_tokens if prompt == "context" else int(prompt)
        print(f"{model} {quant} {kv_dtype} KV ctx {context} prompt {n} budget {budget} {offload}",
              flush=True)
        row = best_row([run_row(model, quant, kv_dtype, context, n, args.new_tokens, hw, budget,
                                offload, args.gpu_layers if offload else None)
                        for _ in range(args.repeats)])
        print("   ", {k: row.get(k) for k in ("error_pct", "error", "wall_s")}, flush=True)
        rows.append(row)
        out = write(results, meta, rows)  # after every row: a cut run keeps what it measured
    if not rows:
        return
    plot(rows, results / f"accuracy-{args.machine}.png", f"vramplan predicted vs measured - {args.machine}")
    print(markdown(out))


def write(results: Path, meta: dict, rows: list[dict]) -> dict:
    gpu = any((r.get("choice") or {}).get("compute_device") == "cuda" for r in rows)
    out = {**meta, "targets": TARGETS_GPU if gpu else TARGETS_CPU, "rows": rows, "summary": summarize(rows)}
    results.mkdir(parents=True, exist_ok=True)
    (results / f"accuracy-{meta['machine']}.json").write_text(json.dumps(out, indent=2) + "\n")
    (results / f"accuracy-{meta['machine']}.md").write_text(markdown(out))
    return out


if __name__ == "__main__":
    main()
