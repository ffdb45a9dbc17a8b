"""Fit a calibration again from saved runs, with no GPU: and check it against accuracy rows measured elsewhere.

`vramplan calibrate` measures, then fits. A device session is short; this fits the runs it saved (`--save-runs`, one
file or several from different sessions of the same machine, the fastest run of each point kept:
runtime.calibrate.fastest_per_point) into a profile, and re-predicts the rows of accuracy benchmarks (bench/accuracy.py
JSON: models the calibration did not see) with it, beside their measured numbers and the prediction they were run
with. Nothing is measured here.

    R=bench/results; python bench/refit.py --hardware $R/gpu-nvidia-h200-2/profile-measured.yaml \\
        --runs $R/gpu-nvidia-h200/calibration-runs.json,$R/gpu-nvidia-h200-2/calibration-runs.json \\
        --check $R/gpu-nvidia-h200-2/accuracy-gpu.json --save /tmp/h200-refit.yaml --out $R/gpu-nvidia-h200-2/refit
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed
METRICS = ("decode_tokens_per_s", "ttft_s", "peak_vram_bytes")


def refit(hw, run_files: list[str]):
    from vramplan.planner.calibration import fit
    from vramplan.runtime.calibrate import fastest_per_point, load_runs, versions

    every = load_runs(tuple(run_files))
    records = fastest_per_point(every)
    fitted = fit([r.sample for r in records], measured_at=dt.date.today().isoformat(), versions=versions())
    note = (f"calibration refitted by bench/refit.py on {fitted.calibration.measured_at} from {len(records)} points "
            f"({len(every)} runs, the fastest of each point kept) saved in {', '.join(run_files)}")
    notes = tuple(n for n in hw.notes if not n.startswith(("calibrated by", "calibration refitted"))) + (note,)
    # runtime RAM is measured by calibrate's fresh runs, not saved with the runs: the profile's own stands
    cal = replace(fitted.calibration, runtime_ram_bytes=hw.calibration.runtime_ram_bytes if hw.calibration else None)
    return replace(hw, calibration=cal, notes=notes), fitted.warnings, len(every), len(records)


def repredict(hw, row: dict) -> dict:
    from vramplan.cli import build_request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import resolve_model
    from vramplan.runtime.execute import predicted_for_run
    from vramplan.runtime.inventory import load_spec

    spec = load_spec(resolve_model(row["model"]))
    req = build_request(row["context"], None, row["prompt_tokens"], None, row["quant"], row["kv_dtype"],
                        row["gpu_layers"], row["offload"], row["vram_budget"], None, None, None)
    p = plan(spec, hw, req)
    m = predicted_for_run(p, spec, hw, row["prompt_tokens"], row["prompt_tokens"] + row["new_tokens"])
    return {k: getattr(m, k) for k in METRICS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", required=True, help="the measured profile the runs were made on")
    ap.add_argument("--runs", required=True, help="comma list of calibration run files (calibrate --save-runs)")
    ap.add_argument("--check", default="", help="comma list of accuracy JSON files to re-predict")
    ap.add_argument("--save", default=None, help="write the refitted profile (YAML) here")
    ap.add_argument("--out", default=None, help="directory for refit.json / refit.md")
    args = ap.parse_args(argv)

    from vramplan.planner.profile_yaml import dumps_profile
    from vramplan.planner.profiles import resolve_profile

    hw, warnings, n_runs, n_points = refit(resolve_profile(args.hardware)[0], args.runs.split(","))
    rows = []
    for path in filter(None, args.check.split(",")):
        for row in json.loads(Path(path).read_text())["rows"]:
            if not row.get("measured") or row["measured"].get("decode_tokens_per_s") is None:
                continue
            new = repredict(hw, row)
            rows.append({"file": path, "model": row["model"], "quant": row["quant"], "gpu_layers": row["gpu_layers"],
                         "offload": row["offload"], "measured": {k: row["measured"].get(k) for k in METRICS},
                         "predicted_then": {k: row["predicted"].get(k) for k in METRICS}, "predicted_refit": new,
                         "error_pct_refit": {k: 100 * (row["measured"][k] - new[k]) / new[k]
                                             for k in METRICS if row["measured"].get(k) and new.get(k)}})
    out = {"benchmark": "refit", "date": dt.date.today().isoformat(), "hardware": args.hardware, "runs": args.runs,
           "runs_read": n_runs, "points_fitted": n_points, "warnings": warnings, "rows": rows}
    lines = [f"# Calibration refitted from saved runs ({out['date']})", "",
             f"{n_runs} runs from `{args.runs}`, {n_points} points (the fastest run of each kept), on "
             f"`{args.hardware}`.",
             "", "| model | scheme | split | decode tok/s measured | predicted then | refit | error | "
             "TTFT s measured | refit | peak VRAM error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        split = "all on the GPU" if r["gpu_layers"] is None else f"{r['gpu_layers']} on the GPU, {r['offload']}"
        e = r["error_pct_refit"]
        lines.append(f"| {r['model']} | {r['quant']} | {split} | {r['measured']['decode_tokens_per_s']:.1f} | "
                     f"{r['predicted_then']['decode_tokens_per_s']:.1f} | "
                     f"{r['predicted_refit']['decode_tokens_per_s']:.1f} | {e.get('decode_tokens_per_s', 0):+.1f} % | "
                     f"{r['measured']['ttft_s']:.3f} | {r['predicted_refit']['ttft_s']:.3f} | "
                     f"{e.get('peak_vram_bytes', 0):+.1f} % |")
    lines += [""] + [f"- warning: {w}" for w in warnings]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.save:
        Path(args.save).write_text(dumps_profile(hw))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "refit.json").write_text(json.dumps(out, indent=2) + "\n")
        (Path(args.out) / "refit.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
