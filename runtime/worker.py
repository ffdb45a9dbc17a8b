"""One run in a fresh process, as a user's `vramplan run` would be: what calibration and the benchmarks use.

A process that has already loaded and freed models reuses that memory, so it under-counts the
next run's footprint; measuring peak RAM honestly takes a new process per run. `run_fresh(job)`
starts `python -m runtime.worker`, hands it the job as JSON on stdin and reads the RunReport
back as JSON on stdout. A run that fails raises RunFailed with the worker's own one-line
error: never a silent zero.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from vramplan.planner.errors import VramplanError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.profile_yaml import profile_from_dict, profile_to_dict
from vramplan.planner.request import Request

from .execute import RunReport

ROOT = Path(__file__).resolve().parents[1]


class RunFailed(VramplanError):
    """A run in a worker process that produced no report (its error is the message)."""


@dataclass(frozen=True, kw_only=True)
class RunJob:
    model: str  # a catalog name or a model directory
    hardware: dict  # the profile in its YAML/JSON form, carried exactly
    request: dict  # Request.to_dict()
    prompt_tokens: int
    max_new_tokens: int
    dummy_weights: bool = True
    seed: int = 0

    @classmethod
    def of(cls, model: str, hw: HardwareProfile, req: Request, *, prompt_tokens: int, max_new_tokens: int,
           dummy_weights: bool = True, seed: int = 0) -> "RunJob":
        return cls(model=model, hardware=profile_to_dict(hw), request=req.to_dict(), prompt_tokens=prompt_tokens,
                   max_new_tokens=max_new_tokens, dummy_weights=dummy_weights, seed=seed)


def run_fresh(job: RunJob, *, timeout_s: float | None = None) -> RunReport:
    """`job` in a new Python process; its report, or RunFailed saying why there is none."""
    try:
        r = subprocess.run([sys.executable, "-m", "vramplan.runtime.worker"], input=json.dumps(asdict(job)), text=True,
                           capture_output=True, cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{job.model}: the run took longer than {timeout_s:g} s") from None
    if r.returncode != 0 or not r.stdout.strip():
        last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}, no output"])[-1]
        raise RunFailed(f"{job.model}: {last}")
    return RunReport.from_dict(json.loads(r.stdout))


def _run(job: RunJob) -> RunReport:
    from vramplan.planner.search import plan
    from vramplan.planner.sources import resolve_model

    from .execute import execute
    from .inventory import load_spec  # counted as the installed transformers loads it

    source = resolve_model(job.model)
    spec = load_spec(source)
    hw = profile_from_dict(job.hardware, origin="worker job")
    p = plan(spec, hw, Request.from_dict(job.request))
    if not p.fits:
        raise RunFailed(f"{job.model}: nothing fits: {p.reasons[0]}")
    return execute(p, spec, hw, source, dummy_weights=job.dummy_weights, prompt_text=None,
                   prompt_tokens=job.prompt_tokens, max_new_tokens=job.max_new_tokens, seed=job.seed)


def main() -> None:
    try:
        report = _run(RunJob(**json.loads(sys.stdin.read())))
    except VramplanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(json.dumps(report.to_dict()) + "\n")


if __name__ == "__main__":
    main()
