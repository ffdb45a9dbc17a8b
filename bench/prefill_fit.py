"""The CPU prefill constants of planner.speed: each scheme's matmul efficiency and one attention efficiency, fitted
on one model's TTFTs and checked on another's.

The runs are `vramplan calibrate --save-runs` files (a model in each CPU scheme at several prompt lengths; SDPA runs
are used). Every TTFT is modelled as the speed model prices a CPU prefill:

    TTFT = chunks x (layers x per_layer_s + per_token_s)            the scheme's fixed costs (planner.speed._DEFAULTS)
         + matmul FLOPs / (matmul peak x eff[scheme])                the peak: planner.speed.cpu_matmul_peak
         + attention FLOPs / (float peak x eff_attention)            the peak: planner.speed.cpu_float_peak

and the efficiencies are one weighted least-squares fit over the --fit runs (relative errors). The --held-out runs
(another model, not seen by the fit) are then predicted with the fitted efficiencies and with the shipped defaults,
and their errors reported. Writes bench/results/prefill-fit-<machine>.json and .md.

    vramplan calibrate --models qwen2.5-0.5b --quants bf16,quanto-int8,quanto-int4,quanto-w8a8 \\
        --prompts 128,512,2048 --repeats 1 --kv-dtypes none --save-runs fit.json
    vramplan calibrate --models llama-3.2-1b ... --save-runs held-out.json
    python bench/prefill_fit.py --fit fit.json --held-out held-out.json --machine cpu-dev
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

RESULTS = ROOT / "bench" / "results"


def load_runs(path: Path) -> list[dict]:
    d = json.loads(path.read_text())
    runs = d["runs"] if isinstance(d, dict) else d
    return [r["sample"] for r in runs if r["sample"]["attention_impl"] == "sdpa" and r["sample"]["device"] == "cpu"]


def fixed_s(s: dict) -> float:
    from vramplan.planner.speed import _DEFAULTS

    _, _, per_layer, per_token = _DEFAULTS[("cpu", s["quant"])]
    return s["prefill_chunks"] * (s["num_layers"] * per_layer + per_token)


def features(s: dict) -> tuple[float, float]:
    """(matmul seconds at efficiency 1, attention seconds at efficiency 1)."""
    attention = s["prefill_attention_flops"]
    matmul_peak = s.get("matmul_peak_flops") or s["peak_flops"]
    return (s["prefill_flops"] - attention) / matmul_peak, attention / s["peak_flops"]


def fit(samples: list[dict]) -> tuple[dict[str, float], float]:
    """({scheme: matmul efficiency}, attention efficiency)."""
    from vramplan.planner.calibration import bounded_nnls

    quants = sorted({s["quant"] for s in samples})
    rows, y, weights = [], [], []
    for s in samples:
        matmul, attention = features(s)
        rows.append([matmul if q == s["quant"] else 0.0 for q in quants] + [attention])
        y.append(s["prefill_s"] - fixed_s(s))
        weights.append(1.0 / s["prefill_s"] ** 2)
    coef, _ = bounded_nnls(rows, y, weights, {})
    return {q: 1.0 / c for q, c in zip(quants, coef)}, 1.0 / coef[-1]


def predict(s: dict, eff: dict[str, float], attention_eff: float) -> float:
    matmul, attention = features(s)
    return fixed_s(s) + matmul / eff[s["quant"]] + attention / attention_eff


def shipped() -> tuple[dict[str, float], float]:
    from vramplan.planner.speed import _DEFAULTS, DEFAULT_PREFILL_ATTENTION_EFFICIENCY

    return ({q: v[1] for (d, q), v in _DEFAULTS.items() if d == "cpu"}, DEFAULT_PREFILL_ATTENTION_EFFICIENCY["cpu"])


def rows_of(samples: list[dict], fitted: tuple, defaults: tuple) -> list[dict]:
    out = []
    for s in samples:
        p_fit, p_def = predict(s, *fitted), predict(s, *defaults)
        out.append({"run": s["label"], "quant": s["quant"], "prompt_chunks": s["prefill_chunks"],
                    "measured_ttft_s": s["prefill_s"], "fitted_ttft_s": p_fit, "default_ttft_s": p_def,
                    "fitted_err_pct": 100 * (p_fit / s["prefill_s"] - 1),
                    "default_err_pct": 100 * (p_def / s["prefill_s"] - 1),
                    "matmul_peak_flops": s.get("matmul_peak_flops") or s["peak_flops"],
                    "float_peak_flops": s["peak_flops"]})
    return out


def markdown(out: dict) -> str:
    f = out["fitted"]
    lines = [f"# CPU prefill constants on {out['machine']}", "", f"{out['date']}; {out['platform']}", "",
             f"Fitted on {out['fit_runs']}; held out: {out['held_out_runs']}.", "",
             "| | " + " | ".join(f["matmul"]) + " | attention |", "|---|" + "---|" * (len(f["matmul"]) + 1),
             "| fitted | " + " | ".join(f"{v:.3f}" for v in f["matmul"].values()) + f" | {f['attention']:.3f} |",
             "| shipped default | " + " | ".join(f"{out['shipped']['matmul'].get(q, float('nan')):.2f}"
                                                 for q in f["matmul"]) + f" | {out['shipped']['attention']:.2f} |",
             "", "Efficiencies: achieved over the peak each kernel computes against (matmuls: planner.speed."
             "cpu_matmul_peak; attention: cpu_float_peak).", ""]
    for part in ("fit", "held_out"):
        lines += [f"## {'Fitted runs' if part == 'fit' else 'Held-out runs'}", "",
                  "| run | TTFT s | fitted s | err | default s | err |", "|---|---|---|---|---|---|"]
        for r in out[part]:
            lines.append(f"| {r['run']} | {r['measured_ttft_s']:.3f} | {r['fitted_ttft_s']:.3f} | "
                         f"{r['fitted_err_pct']:+.0f} % | {r['default_ttft_s']:.3f} | {r['default_err_pct']:+.0f} % |")
        errs = [abs(r["default_err_pct"]) for r in out[part]]
        if errs:
            lines += ["", f"With the shipped defaults: median |error| {statistics.median(errs):.0f} %, "
                          f"max {max(errs):.0f} %.", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", type=Path, required=True, help="runs to fit (vramplan calibrate --save-runs)")
    ap.add_argument("--held-out", type=Path, help="runs of another model, predicted and not fitted")
    ap.add_argument("--machine", required=True)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    fit_samples = load_runs(args.fit)
    held = load_runs(args.held_out) if args.held_out else []
    eff, attention = fit(fit_samples)
    defaults = shipped()
    out = {"benchmark": "prefill_fit", "machine": args.machine, "date": time.strftime("%Y-%m-%d"),
           "platform": platform.platform(), "fit_runs": args.fit.name,
           "held_out_runs": args.held_out.name if args.held_out else None,
           "fitted": {"matmul": eff, "attention": attention},
           "shipped": {"matmul": {q: defaults[0][q] for q in eff}, "attention": defaults[1]},
           "fit": rows_of(fit_samples, (eff, attention), defaults),
           "held_out": rows_of(held, (eff, attention), defaults)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"prefill-fit-{args.machine}"
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
