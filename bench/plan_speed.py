"""Benchmark: how long the planner's search takes (target: < 100 ms for 405B at 128k on an H200, every engine).

Each timing is the first search of a fresh process, as `vramplan plan` runs it: the modules imported and the model's
spec built beforehand (both timed apart), no memo warm from an earlier search. Per case, REPEATS processes time
vramplan's own search, and REPEATS more the whole of what `vramplan plan` computes (plan_for_engine: vramplan's plan,
then every other engine's own answer). Then one process repeats the whole in place, for the warm figure.

Writes bench/results/plan_speed.json and .md. Run: python bench/plan_speed.py
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    ("meta-llama/Llama-3.1-405B", "128k", "h200"),
    ("meta-llama/Llama-3.1-405B", "128k", "rtx-4090"),
    ("meta-llama/Llama-3.1-70B", "32k", "rtx-4090"),
    ("deepseek-ai/DeepSeek-V3", "128k", "h200"),
    ("meta-llama/Llama-3.1-8B", "32k", "rtx-4090"),
    ("Qwen/Qwen3-30B-A3B", "32k", "rtx-3060-12gb"),
]
REPEATS = 15
WARM_REPEATS = 15
TARGET_MS = 100.0

# One fresh process: import, build the spec, then time the first call (and, with "warm", more calls in place).
CHILD = r"""
import json, sys, time
sys.path.insert(0, {bench!r})
__import__("_checkout").use_checkout(__import__("pathlib").Path({root!r}))
from vramplan.planner.engines import plan_for_engine
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.search import plan
from vramplan.planner.sources import model_spec
from vramplan.planner.units import parse_context

model, ctx, hw_name, what, warm = sys.argv[1:6]
t = time.perf_counter()
spec = model_spec(model)
spec_ms = (time.perf_counter() - t) * 1000
hw = resolve_profile(hw_name)[0]
req = Request(context=parse_context(ctx))
run = plan if what == "search" else plan_for_engine
times = []
for _ in range(1 + int(warm)):
    t = time.perf_counter()
    p = run(spec, hw, req)
    times.append((time.perf_counter() - t) * 1000)
print(json.dumps({{"ms": times, "spec_ms": spec_ms, "fits": p.fits, "candidates": len(p.candidates),
                  "choice": p.choice.to_dict() if p.choice else None}}))
"""


def _child(model: str, ctx: str, hw: str, what: str, warm: int = 0) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # bytecode cached, as installed
    code = CHILD.format(bench=str(ROOT / "bench"), root=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, model, ctx, hw, what, str(warm)], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    _child(*CASES[0], "search")  # bytecode written before anything is timed
    rows = []
    for model, ctx, hw in CASES:
        search = [_child(model, ctx, hw, "search") for _ in range(REPEATS)]
        whole = [_child(model, ctx, hw, "all") for _ in range(REPEATS)]
        warm = _child(model, ctx, hw, "all", WARM_REPEATS)["ms"][1:]
        s_ms = [r["ms"][0] for r in search]
        a_ms = [r["ms"][0] for r in whole]
        rows.append({"model": model, "context": ctx, "hardware": hw, "fits": search[0]["fits"],
                     "choice": search[0]["choice"], "candidates": search[0]["candidates"],
                     "spec_build_ms": round(statistics.median(r["spec_ms"] for r in search), 2),
                     "search_ms_median": round(statistics.median(s_ms), 2), "search_ms_min": round(min(s_ms), 2),
                     "all_engines_ms_median": round(statistics.median(a_ms), 2),
                     "all_engines_ms_min": round(min(a_ms), 2),
                     "all_engines_warm_ms_median": round(statistics.median(warm), 2),
                     "all_engines_under_target": statistics.median(a_ms) < TARGET_MS})
    out = {"benchmark": "planner search, first call of a fresh process", "target_ms": TARGET_MS,
           "repeats": REPEATS, "python": platform.python_version(), "machine": platform.machine(),
           "processor": platform.processor(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
           "load_average": os.getloadavg()[0], "rows": rows}
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "plan_speed.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = ["# Planner search time", "", f"{out['date']}, Python {out['python']}, {out['machine']}, {out['cpus']} "
             f"CPUs, load average {out['load_average']:.2f}. Each figure is the first search of a fresh process (the "
             f"modules imported and the spec built first), median (and least) of {REPEATS} processes; \"warm\" is the "
             f"same call repeated in one process. Target: every engine < {TARGET_MS:.0f} ms for 405B at 128k on an "
             "H200.", "",
             "| model | context | hardware | fits | vramplan's search ms | every engine ms | every engine, warm ms | "
             "spec build ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['context']} | {r['hardware']} | {r['fits']} | {r['search_ms_median']} "
                     f"({r['search_ms_min']}) | {r['all_engines_ms_median']} ({r['all_engines_ms_min']}) | "
                     f"{r['all_engines_warm_ms_median']} | {r['spec_build_ms']} |")
    (res / "plan_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
