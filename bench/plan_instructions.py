"""Benchmark: the planner's search counted in instructions, a figure a noisy machine does not move.

bench/plan_speed.py times the search; on a shared 2-core VM those times spread by 30 % from run to run. This counts
what the first `plan_for_engine` call of a fresh process executes (every engine, as `vramplan plan` computes it):
valgrind's callgrind runs the process twice, once building the model's spec and the profile only and once planning
too, and the difference of the instructions it collected is the search's. With `--baseline DIR` it counts another
checkout of vramplan the same way (e.g. `git worktree add /tmp/base <commit>`), for a before/after on one machine.
Needs valgrind. Writes bench/results/plan_instructions-<machine>.json and .md.

    python bench/plan_instructions.py --machine cpu-epyc-avx2 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from plan_speed import CASES  # noqa: E402 - the cases bench/plan_speed.py times
CHILD = r"""
import sys
from vramplan.planner.engines import plan_for_engine
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import model_spec
from vramplan.planner.units import parse_context
model, ctx, hw_name, run = sys.argv[1:5]
spec, hw, req = model_spec(model), resolve_profile(hw_name)[0], Request(context=parse_context(ctx))
if run == "1":
    plan_for_engine(spec, hw, req)
"""


def _env(checkout: Path) -> dict:
    """vramplan imported from `checkout` (a link named vramplan to it, first on the path), bytecode written."""
    link_dir = Path(tempfile.mkdtemp(prefix="vramplan-instr-"))
    (link_dir / "vramplan").symlink_to(checkout.resolve(), target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(link_dir))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _collected(env: dict, case: tuple[str, str, str], run: str) -> int:
    r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", CHILD,
                        *case, run], env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    return int(re.search(r"Collected : (\d+)", r.stderr).group(1))


def instructions(checkout: Path, case: tuple[str, str, str]) -> int:
    """The instructions of the first plan_for_engine call of a process, for `checkout`'s vramplan."""
    env = _env(checkout)
    subprocess.run([sys.executable, "-c", CHILD, *case, "1"], env=env, cwd=tempfile.gettempdir(), check=True,
                   capture_output=True)  # bytecode written first: neither count compiles
    return _collected(env, case, "1") - _collected(env, case, "0")


def _commit(checkout: Path) -> str:
    r = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", required=True, help="name used in the result file names")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout of vramplan to count the same way")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("plan_instructions: needs valgrind (callgrind)")
    rows = []
    for case in CASES:
        row = {"model": case[0], "context": case[1], "hardware": case[2], "instructions": instructions(ROOT, case)}
        if args.baseline is not None:
            row["baseline_instructions"] = instructions(args.baseline, case)
        rows.append(row)
        print(row, flush=True)
    out = {"benchmark": "plan_instructions", "machine": args.machine, "date": time.strftime("%Y-%m-%d"),
           "python": sys.version.split()[0], "commit": _commit(ROOT),
           "baseline_commit": _commit(args.baseline) if args.baseline is not None else None, "cases": rows}
    res = ROOT / "bench" / "results"
    (res / f"plan_instructions-{args.machine}.json").write_text(json.dumps(out, indent=2) + "\n")
    base = args.baseline is not None
    lines = [f"# Planner search in instructions: {args.machine}", "",
             f"{out['date']}, Python {out['python']}, commit {out['commit']}"
             + (f" against {out['baseline_commit']}" if base else "")
             + ". The first `plan_for_engine` call of a fresh process (every engine), counted by valgrind's callgrind: "
             "a figure the machine's load does not move (bench/plan_speed.py times the same call).", "",
             "| model | context | hardware | M instructions |" + (" baseline M | change |" if base else ""),
             "|---|---|---|---|" + ("---|---|" if base else "")]
    for r in rows:
        line = f"| {r['model']} | {r['context']} | {r['hardware']} | {r['instructions'] / 1e6:.0f} |"
        if base:
            b = r["baseline_instructions"]
            line += f" {b / 1e6:.0f} | {100 * (r['instructions'] - b) / b:+.1f} % |"
        lines.append(line)
    (res / f"plan_instructions-{args.machine}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
