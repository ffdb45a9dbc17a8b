"""Benchmark: how long a full planner search takes, in-process (target: < 100 ms for 405B at 128k).

Writes bench/results/plan_speed.json and .md. Run: python bench/plan_speed.py
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

from vramplan.planner.profiles import resolve_profile  # noqa: E402
from vramplan.planner.request import Request  # noqa: E402
from vramplan.planner.engines import plan_for_engine  # noqa: E402
from vramplan.planner.gguf import forget_tensors  # noqa: E402
from vramplan.planner.search import plan  # noqa: E402
from vramplan.planner.sources import model_spec  # noqa: E402

CASES = [
    ("meta-llama/Llama-3.1-405B", "128k", "h200"),
    ("meta-llama/Llama-3.1-405B", "128k", "rtx-4090"),
    ("meta-llama/Llama-3.1-70B", "32k", "rtx-4090"),
    ("deepseek-ai/DeepSeek-V3", "128k", "h200"),
    ("meta-llama/Llama-3.1-8B", "32k", "rtx-4090"),
    ("Qwen/Qwen3-30B-A3B", "32k", "rtx-3060-12gb"),
]
REPEATS = 15
TARGET_MS = 100.0


def main() -> None:
    from vramplan.planner.units import parse_context

    rows = []
    for model, ctx, hw_name in CASES:
        t0 = time.perf_counter()
        spec = model_spec(model)
        spec_ms = (time.perf_counter() - t0) * 1000
        hw = resolve_profile(hw_name)[0]
        req = Request(context=parse_context(ctx))
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            p = plan(spec, hw, req)
            times.append((time.perf_counter() - t) * 1000)
        engines = []
        for _ in range(REPEATS):  # what `vramplan plan` does: the search, then every other engine's answer
            forget_tensors()  # one plan per process: no file's tensors are known yet
            t = time.perf_counter()
            plan_for_engine(spec, hw, req)
            engines.append((time.perf_counter() - t) * 1000)
        rows.append({"all_engines_ms_median": round(statistics.median(engines), 2),
                     "all_engines_under_target": statistics.median(engines) < TARGET_MS,
                     "model": model, "context": ctx, "hardware": hw_name, "fits": p.fits,
                     "choice": p.choice.to_dict() if p.choice else None, "candidates": len(p.candidates),
                     "spec_build_ms": round(spec_ms, 2), "search_ms_median": round(statistics.median(times), 2),
                     "search_ms_max": round(max(times), 2), "under_target": statistics.median(times) < TARGET_MS})
    out = {"benchmark": "planner full search", "target_ms": TARGET_MS, "repeats": REPEATS,
           "python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "plan_speed.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = ["# Planner search time (in-process)", "", f"{out['date']}, Python {out['python']}, {out['machine']}; "
             f"median of {REPEATS} runs; target < {TARGET_MS:.0f} ms.", "",
             "| model | context | hardware | fits | search ms (median) | max | with every engine ms | spec build ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['context']} | {r['hardware']} | {r['fits']} | {r['search_ms_median']} | "
                     f"{r['search_ms_max']} | {r['all_engines_ms_median']} | {r['spec_build_ms']} |")
    (res / "plan_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
