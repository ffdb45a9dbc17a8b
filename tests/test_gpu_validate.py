"""`bench/gpu_validate.sh --cpu-smoke`: every step of the GPU proof (the machine's packages, probe, the GPU tests,
a run, calibration, accuracy, offload vs accelerate in nf4 and bf16, an induced OOM), tiny, on this CPU, through the
same script a GPU device call runs, so the script is known to work before GPU time is spent. It writes its JSON results,
the status and the summary, and an archive into $OUT as a device call would."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_validate_cpu_smoke_runs_every_step_and_writes_its_results(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    env = dict(os.environ, OUT=str(out), VRAMPLAN_CACHE_DIR=str(tmp_path / "cache"),
               VRAMPLAN_CONFIG_DIR=str(tmp_path / "config"))
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_validate.sh"), "--cpu-smoke", "--work", str(work)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    summary = (work / "summary.md").read_text() if (work / "summary.md").exists() else r.stdout[-3000:]
    assert r.returncode == 0, summary
    status = json.loads((out / "status.json").read_text())
    steps = {s["name"]: s for s in status["steps"]}
    assert list(steps) == ["env", "probe", "pytest-gpu", "run-nf4", "decode-profile", "calibrate", "accuracy",
                           "offload-nf4", "oom", "offload-bf16"]
    assert all(s["status"] == "ok" for s in steps.values()), summary
    # the results are data: each step's JSON parses and says what it measured
    assert json.loads((work / "env.json").read_text())["packages"]["torch"]
    calibrated = json.loads((work / "calibrate.json").read_text())
    backends = {e["backend"] for e in calibrated["profile"]["calibration"]["entries"]}
    assert calibrated["runs"] and {"torch", "experts"} <= backends
    accuracy = json.loads((work / "accuracy-smoke.json").read_text())
    assert accuracy["rows"] and all("error_pct" in r for r in accuracy["rows"])
    assert json.loads((work / "decode-profile-smoke.json").read_text())["rows"][0]["top_cpu"]
    for name in ("offload-smoke-nf4.json", "offload-smoke-bf16.json", "oom-smoke.json"):
        assert json.loads((work / name).read_text())
    with tarfile.open(out / "work.tar.gz") as tar:
        assert "work/profile-calibrated.yaml" in tar.getnames()
