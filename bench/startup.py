"""Benchmark: `vramplan plan` as a whole process, and where its start-up goes (target: <= 0.2 s median).

Times whole processes (bytecode caching on, as on a user's machine: PYTHONDONTWRITEBYTECODE is removed), beside
`python -c pass` (the interpreter and its site packages) and `import cli`, and lists the slowest imports of one plan
by `python -X importtime` (cumulative microseconds). Writes bench/results/startup-<machine>.json and .md.

Run: python bench/startup.py --machine cpu-dev
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.2
# `python -m vramplan` is the console script's own entry (vramplan.__main__:console), as the `vramplan` command runs.
PLAN = ["-m", "vramplan", "plan", "--model", "llama-3.1-8b", "--context", "32k", "-H", "rtx-4090"]
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "import cli": ["-c", "import vramplan.cli"],
    "vramplan plan (table)": PLAN,
    "vramplan plan --json": [*PLAN, "--json"],
    "vramplan models --json": ["-m", "vramplan", "models", "--json"],
}
TOP_IMPORTS = 15
# Where one plan's time goes, in one process: the wall time of each phase, and two costs that cut across the imports
# (class bodies turned into dataclasses, regular expressions compiled). Instrumented by wrapping, not by a profiler,
# so the numbers are wall times of an otherwise plain run.
PHASES = r"""
import dataclasses, gc, json, re, sys, time
gc.disable()  # as the console script does (vramplan/__main__.py)
t0 = time.perf_counter()
cost = {"dataclass_s": 0.0, "dataclasses": 0, "regex_s": 0.0}
_process, _compile = dataclasses._process_class, re._compile
def process(*a, **k):
    t = time.perf_counter(); r = _process(*a, **k); cost["dataclass_s"] += time.perf_counter() - t
    cost["dataclasses"] += 1; return r
def compile_(*a, **k):
    t = time.perf_counter(); r = _compile(*a, **k); cost["regex_s"] += time.perf_counter() - t; return r
dataclasses._process_class, re._compile = process, compile_
import contextlib, io
from vramplan import cli
t1 = time.perf_counter()
from vramplan import render
from vramplan.planner import engines, search
from vramplan.planner.engines import compare
t2 = time.perf_counter()
phases = {}
def timed(mod, name):
    f, key = getattr(mod, name), f"{mod.__name__}.{name}"
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); phases[key] = phases.get(key, 0) + time.perf_counter() - t; return r
    setattr(mod, name, g)
for mod, name in ((cli, "resolve_model"), (cli, "resolve_hardware"), (search, "plan"), (compare, "engine_rows"),
                  (render, "plan")):
    timed(mod, name)
sys.argv = ["vramplan", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()):
    try:
        cli.main()
    except SystemExit:
        pass
t3 = time.perf_counter()
print(json.dumps({"import cli": t1 - t0, "import the engines": t2 - t1, "the command": t3 - t2,
                  **{f"  {k}": v for k, v in phases.items()}, **cost}))
"""


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["VRAMPLAN_CACHE_DIR"] = env.get("VRAMPLAN_CACHE_DIR", str(ROOT / ".bench-cache"))
    return env


def time_process(args: list[str], repeats: int, python: Path | None = None) -> dict:
    env, python = _env(), str(python or sys.executable)
    cwd = ROOT if python == sys.executable else Path("/")  # an installed copy must not see this checkout
    subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, check=True)  # writes the bytecode
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True)
        times.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4)}


def slowest_imports() -> list[dict]:
    r = subprocess.run([sys.executable, "-X", "importtime", *PLAN], cwd=ROOT, env=_env(), capture_output=True,
                       text=True)
    rows = []
    for line in r.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cumulative_us, name = line.removeprefix("import time:").split("|")
        depth = (len(name) - len(name.lstrip()) - 1) // 2  # importtime indents children by two spaces
        rows.append({"module": name.strip(), "depth": depth, "self_us": int(self_us.strip()),
                     "cumulative_us": int(cumulative_us.strip())})
    top = [r for r in rows if r["depth"] <= 1]
    return sorted(top, key=lambda r: -r["cumulative_us"])[:TOP_IMPORTS]


def phases(repeats: int) -> dict:
    """Median of each phase over `repeats` processes (seconds; "dataclasses" is a count)."""
    runs = []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", PHASES, *PLAN[2:]], cwd=ROOT, env=_env(), capture_output=True,
                           text=True, check=True)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {k: round(statistics.median(run[k] for run in runs), 4) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="cpu-dev", help="name used in the result file names")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--installed", type=Path, default=None,
                    help="also time a venv where vramplan is installed from a wheel, as `pip install vramplan` does "
                         "(no editable finder in its start-up): python -m venv V && V/bin/pip install .")
    args = ap.parse_args()
    rows = {name: time_process(argv, args.repeats) for name, argv in COMMANDS.items()}
    if args.installed is not None:
        venv = args.installed.resolve()
        rows["python -c pass (installed venv)"] = time_process(["-c", "pass"], args.repeats, venv / "bin" / "python")
        rows["vramplan plan (installed venv)"] = time_process(PLAN[2:], args.repeats, venv / "bin" / "vramplan")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out = {"benchmark": "start-up", "machine": args.machine, "date": time.strftime("%Y-%m-%d"),
           "python": platform.python_version(), "repeats": args.repeats, "target_s": TARGET_S,
           "load_average_1m": load, "commands": rows, "phases_of_plan": phases(args.repeats),
           "slowest_imports_of_plan": slowest_imports()}
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"startup-{args.machine}.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Start-up on {args.machine}", "",
             f"{out['date']}, Python {out['python']}, load average {load}; median of {args.repeats} processes; "
             f"target for `vramplan plan`: <= {TARGET_S} s.", "",
             "| command | median s | min s | max s |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['median_s']} | {r['min_s']} | {r['max_s']} |" for name, r in rows.items()]
    ph = out["phases_of_plan"]
    lines += ["", "Where one plan's time goes (one process, wall ms; the interpreter itself is `python -c pass` above; "
              "the command includes its lazy imports; dataclass and regex costs are spread over the imports):", "",
              "| phase | ms |", "|---|---|"]
    lines += [f"| {k.strip() if not k.startswith(' ') else '&nbsp;&nbsp;' + k.strip()} | "
              f"{v if k == 'dataclasses' else round(1000 * v, 1)} |" for k, v in ph.items()]
    lines += ["", "Slowest imports of one `vramplan plan` (top level and their children, cumulative):", "",
              "| module | cumulative ms | self ms |", "|---|---|---|"]
    lines += [f"| {'  ' * r['depth']}{r['module']} | {r['cumulative_us'] / 1000:.1f} | {r['self_us'] / 1000:.1f} |"
              for r in out["slowest_imports_of_plan"]]
    (res / f"startup-{args.machine}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
