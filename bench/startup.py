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
PLAN = ["cli.py", "plan", "--model", "llama-3.1-8b", "--context", "32k", "-H", "rtx-4090"]
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "import cli": ["-c", "import cli"],
    "vramplan plan (table)": PLAN,
    "vramplan plan --json": [*PLAN, "--json"],
    "vramplan models --json": ["cli.py", "models", "--json"],
}
TOP_IMPORTS = 15


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["VRAMPLAN_CACHE_DIR"] = env.get("VRAMPLAN_CACHE_DIR", str(ROOT / ".bench-cache"))
    return env


def time_process(args: list[str], repeats: int) -> dict:
    env = _env()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True)  # writes the bytecode
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="cpu-dev", help="name used in the result file names")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()
    rows = {name: time_process(argv, args.repeats) for name, argv in COMMANDS.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out = {"benchmark": "start-up", "machine": args.machine, "date": time.strftime("%Y-%m-%d"),
           "python": platform.python_version(), "repeats": args.repeats, "target_s": TARGET_S,
           "load_average_1m": load, "commands": rows, "slowest_imports_of_plan": slowest_imports()}
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"startup-{args.machine}.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Start-up on {args.machine}", "",
             f"{out['date']}, Python {out['python']}, load average {load}; median of {args.repeats} processes; "
             f"target for `vramplan plan`: <= {TARGET_S} s.", "",
             "| command | median s | min s | max s |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['median_s']} | {r['min_s']} | {r['max_s']} |" for name, r in rows.items()]
    lines += ["", "Slowest imports of one `vramplan plan` (top level and their children, cumulative):", "",
              "| module | cumulative ms | self ms |", "|---|---|---|"]
    lines += [f"| {'  ' * r['depth']}{r['module']} | {r['cumulative_us'] / 1000:.1f} | {r['self_us'] / 1000:.1f} |"
              for r in out["slowest_imports_of_plan"]]
    (res / f"startup-{args.machine}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
