"""Micro-benchmark: one decode step's matrix-vector products, matrix by matrix, on this CPU.

The speed model prices decode weights as bytes / (bandwidth x one efficiency per scheme). This measures how far
that holds per matrix shape: each distinct linear of a model's decoder layer, and its lm_head, as a bf16
[1, in] x [out, in]^T product, with enough copies of the weight that it streams from RAM rather than cache.
A least-squares line over the shapes, time = bytes / bandwidth + a fixed cost per product, says how much of a
layer's time is that fixed cost: what makes models of many small matrices slower per byte than models of few
large ones.

    python bench/gemv.py --models qwen3-0.6b,qwen2.5-0.5b,llama-3.2-1b --machine cpu-dev

Writes bench/results/gemv-<machine>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

from vramplan.planner.units import MiB  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
STREAM_BYTES = 512 * MiB  # weight copies per shape: more than any CPU cache


def shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, in, out) of layer 0's linears and the lm_head."""
    from vramplan.planner.modelspec import Kind
    from vramplan.planner.sources import model_spec

    spec = model_spec(model)
    out = [(t.name.split(".")[-2], t.shape[1], t.shape[0]) for t in spec.layer_tensors(0)
           if t.kind is Kind.LINEAR and len(t.shape) == 2]
    return out + [("lm_head", spec.hidden_size, spec.vocab_size)]


def time_gemv(k: int, n: int, repeats: int) -> float:
    import torch

    copies = max(1, STREAM_BYTES // (k * n * 2))
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, 1, k, dtype=torch.bfloat16)
    best = float("inf")
    with torch.no_grad():
        for w in weights:  # warm-up: first-call dispatch
            torch.nn.functional.linear(x, w)
        for _ in range(repeats):
            t0 = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(x, w)
            best = min(best, (time.perf_counter() - t0) / copies)
    return best


def fit_line(rows: list[dict]) -> dict:
    """time = bytes / bandwidth + fixed, weighted least squares on relative error."""
    xs = [r["bytes"] for r in rows]
    ys = [r["seconds"] for r in rows]
    w = [1.0 / (y * y) for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    fixed = (sy - slope * sx) / sw
    errs = [100 * abs(x * slope + fixed - y) / y for x, y in zip(xs, ys)]
    return {"bandwidth_bytes_per_s": 1.0 / slope, "fixed_s_per_product": fixed, "abs_pct_max": max(errs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-0.6b,qwen2.5-0.5b,llama-3.2-1b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--machine", default="cpu")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    import torch

    rows, timed = [], {}
    for model in args.models.split(","):
        for name, k, n in shapes(model):
            if (k, n) not in timed:
                timed[(k, n)] = time_gemv(k, n, args.repeats)
            s = timed[(k, n)]
            rows.append({"model": model, "matrix": name, "in": k, "out": n, "bytes": k * n * 2, "seconds": s,
                         "gb_per_s": k * n * 2 / s / 1e9})
            print(rows[-1], flush=True)
    layer_rows = [r for r in rows if r["matrix"] != "lm_head"]
    result = {"benchmark": "bf16 matrix-vector products by shape", "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args), "rows": rows,
              "fit_over_layer_matrices": fit_line(layer_rows)}
    per_model = {}
    for model in args.models.split(","):
        rs = [r for r in rows if r["model"] == model]
        layer = [r for r in rs if r["matrix"] != "lm_head"]
        per_model[model] = {"layer_bytes": sum(r["bytes"] for r in layer), "layer_s": sum(r["seconds"] for r in layer),
                            "layer_gb_per_s": sum(r["bytes"] for r in layer) / sum(r["seconds"] for r in layer) / 1e9,
                            "products_per_layer": len(layer)}
    result["per_model"] = per_model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gemv-{args.machine}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"gemv-{args.machine}.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _markdown(r: dict) -> str:
    f = r["fit_over_layer_matrices"]
    lines = [f"# bf16 matrix-vector products by shape on {r['args']['machine']}", "",
             f"{r['date']}; torch {r['torch']}, {r['threads']} threads; best of {r['args']['repeats']}, weights "
             "streamed from RAM.", "", "| model | matrix | in x out | MiB | us | GB/s |", "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['model']} | {x['matrix']} | {x['in']} x {x['out']} | {x['bytes'] / 2**20:.1f} | "
                     f"{x['seconds'] * 1e6:.1f} | {x['gb_per_s']:.1f} |")
    lines += ["", "| model | products per layer | layer MiB | layer us | layer GB/s |", "|---|---|---|---|---|"]
    for m, p in r["per_model"].items():
        lines.append(f"| {m} | {p['products_per_layer']} | {p['layer_bytes'] / 2**20:.1f} | {p['layer_s'] * 1e6:.0f} | "
                     f"{p['layer_gb_per_s']:.1f} |")
    lines += ["", f"Fit over the layer matrices: time = bytes / {f['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s + "
              f"{f['fixed_s_per_product'] * 1e6:.1f} us per product (worst error {f['abs_pct_max']:.0f} %)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
