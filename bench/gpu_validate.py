"""The GPU proof, step by step: probe, calibrate, accuracy, offload vs accelerate, an induced OOM.

Run through bench/gpu_validate.sh (which first installs the wheels carried in .whl/). Each step runs in its own
process with its own time limit; a failed or timed-out step is recorded and the next one runs anyway. Results go
to a work directory inside the repository (default bench/results/gpu-<machine>/, so that a later device call,
which gets a fresh machine and a copy of the repository, finds what an earlier one wrote once it is committed),
and, when $OUT is set, into $OUT as one archive plus status.json and summary.md (a device call brings back at most
8 files).

    bench/gpu_validate.sh --steps env,probe,pytest-gpu,run-int8-wo,run-int4-wo,run-compiled --budget-s 540  # call A
    bench/gpu_validate.sh --steps calibrate,accuracy,offload-nf4 --budget-s 545                  # device call B
    bench/gpu_validate.sh --cpu-smoke                                    # every step, tiny, on this CPU (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout (the GPU machine installs none): in PYTHONPATH
PY = sys.executable
# What a device call may spend: its limit is 10 minutes; keep a margin for the wheel install and the transfers.
DEFAULT_BUDGET_S = 560
MIN_STEP_S = 30  # a step is started with at least this much of the budget left, and cut at what is left


@dataclass(frozen=True)
class Step:
    name: str
    command: str  # a shell command; {work} is the work directory, {profile} the best profile so far
    timeout_s: int
    outputs: tuple[str, ...] = ()  # files (in the work directory) the step writes
    optional: tuple[str, ...] = ()  # files it writes when it can (a PNG needs matplotlib, the `bench` extra)


def gpu_steps() -> list[Step]:
    """The GPU steps in the order of two device calls that fit a session's 15 minutes of device time (each call also
    pays a machine start of a minute or two): call A checks the machine and the CUDA paths, call B measures.

        call A: env,probe,pytest-gpu,run-int8-wo,run-int4-wo,run-compiled     (~6 min: three compiles of an 8B)
        call B: calibrate,accuracy,offload-nf4,oom,offload-bf16 (~7 min)
        not yet run: run-int8 (where bnb-int8's extra VRAM goes), run-compiled (vramplan run --compile), compiled
        (transformers' eager vs compiled decode), run-int8-wo / run-int4-wo (torch's weight-only kernels, compiled)
    pytest-gpu runs every `-m gpu` test: the offload engine's, and tests/test_weight_only.py's CUDA layouts and CUDA
    graph replay of int8-wo / int4-wo.
    """
    model = "llama-3.1-8b"  # 8B, unseen by the calibration (1B and 3B models)
    return [
        Step("env", f"{PY} bench/gpu_env.py > {{work}}/env.json", 60, ("env.json",)),
        Step("probe", f"{PY} cli.py probe --save {{work}}/profile-measured.yaml --json > {{work}}/probe.json", 150,
             ("profile-measured.yaml", "probe.json")),
        Step("pytest-gpu", f"{PY} -m pytest -q -p no:cacheprovider -m gpu tests > {{work}}/pytest-gpu.txt 2>&1", 150,
             ("pytest-gpu.txt",)),
        Step("run-nf4", f"{PY} cli.py run --model {model} --dummy-weights --quant bnb-nf4 --context 4k "
                        "--prompt-tokens 1024 --max-new-tokens 32 --hardware {profile} --json "
                        "> {work}/run-nf4.json", 90, ("run-nf4.json",)),
        # bnb-int8 8B used 1.5 GiB more VRAM than planned on the second H200: the run now reports the peak until
        # timing (loading, quantizing) apart from the whole run's
        Step("run-int8", f"{PY} cli.py run --model {model} --dummy-weights --quant bnb-int8 --context 4k "
                         "--prompt-tokens 1024 --max-new-tokens 16 --hardware {profile} --json "
                         "> {work}/run-int8.json", 90, ("run-int8.json",)),
        # the 8B bf16 resident row (on the first H200 it decoded at 15.7 tok/s, on the second at 44-56)
        Step("run-bf16", f"{PY} cli.py run --model {model} --dummy-weights --quant bf16 --eager --context 4k "
                         "--prompt-tokens 1024 --max-new-tokens 32 --gpu-layers 32 --hardware {profile} --json "
                         "> {work}/run-bf16.json", 90, ("run-bf16.json",)),
        Step("decode-profile", f"{PY} bench/decode_profile.py --model llama-3.2-1b --quants bf16,bnb-nf4 "
                               "--attn sdpa,eager --machine gpu --out {work}", 120,
             ("decode-profile-gpu.json", "decode-profile-gpu.md")),
        Step("calibrate", f"{PY} cli.py calibrate --hardware {{work}}/profile-measured.yaml "
                          "--models llama-3.2-1b,llama-3.2-3b --quants bf16,bnb-nf4,bnb-int8,quanto-int8,quanto-int4 "
                          "--prompts 512,2048 --new-tokens 24 --repeats 1 --kv-dtypes none "
                          "--save-runs {work}/calibration-runs.json --save {work}/profile-calibrated.yaml "
                          "--json > {work}/calibrate.json", 160,
             ("calibration-runs.json", "profile-calibrated.yaml", "calibrate.json")),
        Step("accuracy", f"{PY} bench/accuracy.py --hardware {{profile}} --machine gpu --models {model} "
                         "--quants bf16,bnb-nf4,bnb-int8,quanto-int4 --contexts 4k --prompts 1024 --new-tokens 48 "
                         "--gpu-layers 16 --offload-modes stream,cpu --split-quants bf16,bnb-nf4 --repeats 1 "
                         "--out {work}", 250, ("accuracy-gpu.json", "accuracy-gpu.md"), ("accuracy-gpu.png",)),
        # 544 tokens and 16 new ones: the bf16 comparison took 65 s so on the H200; nf4 builds quantize on the CPU (48 s
        # for our engine's 8B build there) and timed out at 90 s with 1088 / 32
        Step("offload-nf4", f"{PY} bench/offload.py --model {model} --quant bnb-nf4 --gpu-layers 16 --context 544 "
                            "--max-new-tokens 16 --hardware {profile} --machine gpu-nf4 --out {work}", 160,
             ("offload-gpu-nf4.json", "offload-gpu-nf4.md")),
        Step("oom", f"{PY} bench/oom.py --hardware {{profile}} --model {model} --quant bf16 --context 8k "
                    "--ballast-free 10GiB --machine gpu --out {work}", 70, ("oom-gpu.json", "oom-gpu.md")),
        Step("offload-bf16", f"{PY} bench/offload.py --model {model} --quant bf16 --gpu-layers 16 --context 544 "
                             "--max-new-tokens 16 --hardware {profile} --machine gpu-bf16 --out {work}", 90,
             ("offload-gpu-bf16.json", "offload-gpu-bf16.md")),
        # torch's weight-only kernels, decoded compiled (the only way they decode): the runtime issue's int8 / int4 rows
        *(Step(f"run-{q}", f"{PY} cli.py run --model {model} --dummy-weights --quant {q} --context 4k "
                           "--prompt-tokens 1024 --max-new-tokens 64 --hardware {profile} --json "
                           f"> {{work}}/run-{q}.json", 180, (f"run-{q}.json",)) for q in ("int8-wo", "int4-wo")),
        # vramplan's own compiled decode (--compile), the same 8B bf16 row as run-bf16
        Step("run-compiled", f"{PY} cli.py run --model {model} --dummy-weights --quant bf16 --compile --context 4k "
                             "--prompt-tokens 1024 --max-new-tokens 64 --hardware {profile} --json "
                             "> {work}/run-compiled.json", 240, ("run-compiled.json",)),
        # GPU only (a CPU compile of even 0.5B takes two minutes): transformers' own eager vs static cache + compiled
        # (CUDA graphs) decode, HF + bitsandbytes 8B: the public record to re-measure, and the runtime's target
        Step("compiled", f"{PY} bench/compiled_decode.py --model {model} --quants bf16,bnb-nf4 --prompt 512 "
                         "--new-tokens 32 --machine gpu --out {work}", 300,
             ("compiled-decode-gpu.json", "compiled-decode-gpu.md")),
    ]


# The CPU smoke's model: a small Llama written as a config.json into the work directory (dummy weights), so that
# each step's load, quantization and runs take milliseconds, not the seconds of even the catalog's smallest model.
SMOKE_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
                "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
                "eos_token_id": 2}


SMOKE_MODEL_DIR = "smoke-model"


def write_smoke_model(work: Path) -> Path:
    d = work / SMOKE_MODEL_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(SMOKE_CONFIG, indent=2) + "\n")
    return d


def cpu_smoke_steps() -> list[Step]:
    """The same steps and files, small, on a CPU: how CI and a developer know the script works before GPU time."""
    tiny = "{work}/" + SMOKE_MODEL_DIR  # written by write_smoke_model before the steps
    return [
        Step("env", f"{PY} bench/gpu_env.py > {{work}}/env.json", 60, ("env.json",)),
        Step("probe", f"{PY} cli.py probe --save {{work}}/profile-measured.yaml --json > {{work}}/probe.json", 120,
             ("profile-measured.yaml", "probe.json")),
        Step("pytest-gpu", f"{PY} -m pytest -q -p no:cacheprovider -m gpu tests/test_offload.py "
                           "> {work}/pytest-gpu.txt 2>&1", 150, ("pytest-gpu.txt",)),
        Step("run-nf4", f"{PY} cli.py run --model {tiny} --dummy-weights --quant bf16 --eager --context 256 "
                        "--prompt-tokens 32 --max-new-tokens 3 --hardware {profile} --json > {work}/run-nf4.json", 120,
             ("run-nf4.json",)),
        Step("decode-profile", f"{PY} bench/decode_profile.py --model {tiny} --quants bf16 --attn sdpa "
                               "--device cpu --prompt 16 --steps 2 --machine smoke --out {work}", 120,
             ("decode-profile-smoke.json", "decode-profile-smoke.md")),
        Step("calibrate", f"{PY} cli.py calibrate --hardware {{work}}/profile-measured.yaml --models {tiny} "
                          "--quants bf16 --prompts 32,96 --new-tokens 3 --repeats 1 --kv-dtypes none "
                          "--save-runs {work}/calibration-runs.json --save {work}/profile-calibrated.yaml "
                          "--json > {work}/calibrate.json", 300,
             ("calibration-runs.json", "profile-calibrated.yaml", "calibrate.json")),
        Step("accuracy", f"{PY} bench/accuracy.py --hardware {{profile}} --machine smoke --models {tiny} "
                         "--quants bf16 --contexts 256 --prompts 64 --new-tokens 4 --repeats 1 --out {work}", 300,
             ("accuracy-smoke.json", "accuracy-smoke.md"), ("accuracy-smoke.png",)),
        Step("offload-nf4", f"{PY} bench/offload.py --allow-cpu --model {tiny} --quant bnb-nf4 "
                            "--offload-fraction 0.5 --context 24 --max-new-tokens 3 --machine smoke-nf4 --out {work}",
             300, ("offload-smoke-nf4.json", "offload-smoke-nf4.md")),
        Step("oom", f"{PY} bench/oom.py --hardware {{profile}} --machine smoke --out {{work}}", 120,
             ("oom-smoke.json", "oom-smoke.md")),
        Step("offload-bf16", f"{PY} bench/offload.py --allow-cpu --model {tiny} --quant bf16 "
                             "--offload-fraction 0.5 --context 24 --max-new-tokens 3 --machine smoke-bf16 "
                             "--out {work}", 300, ("offload-smoke-bf16.json", "offload-smoke-bf16.md")),
    ]


@dataclass
class Record:
    name: str
    status: str  # "ok", "failed", "timeout", "not run: ..."
    wall_s: float = 0.0
    returncode: int | None = None
    command: str = ""
    outputs: list[str] = field(default_factory=list)
    log_tail: str = ""


def best_profile(work: Path) -> Path | None:
    for name in ("profile-calibrated.yaml", "profile-measured.yaml"):
        if (work / name).is_file():
            return work / name
    return None


def run_step(step: Step, work: Path, remaining_s: float) -> Record:
    profile = best_profile(work)
    command = step.command.format(work=shlex.quote(str(work)), profile=shlex.quote(str(profile)) if profile else "")
    if "{profile}" in step.command and profile is None:
        return Record(step.name, "not run: no hardware profile yet (run the probe step first)", command=command)
    timeout_s = min(step.timeout_s, remaining_s)
    if timeout_s < MIN_STEP_S:
        return Record(step.name, f"not run: {remaining_s:.0f} s left of the budget", command=command)
    log = work / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, shell=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc, status = None, "timeout"
    tail = log.read_text(errors="replace")[-3000:]
    outputs = [o for o in step.outputs if (work / o).is_file()]
    if status == "ok" and len(outputs) < len(step.outputs):
        status = "failed"
        tail += f"\n[gpu_validate] missing outputs: {sorted(set(step.outputs) - set(outputs))}"
    outputs += [o for o in step.optional if (work / o).is_file()]
    return Record(step.name, status, round(time.perf_counter() - t0, 1), rc, command, outputs, tail)


def summary_markdown(records: list[Record], machine: str, mode: str) -> str:
    lines = [f"# GPU validation ({mode}) on {machine}", "", time.strftime("%Y-%m-%d %H:%M"), "",
             "| step | status | seconds | outputs |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r.name} | {r.status} | {r.wall_s} | {', '.join(r.outputs) or '-'} |")
    for r in records:
        if r.status not in ("ok",) and not r.status.startswith("not run"):
            lines += ["", f"## {r.name}: {r.status}", "", "```", r.log_tail[-1500:].strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="the same steps, tiny, on this CPU")
    ap.add_argument("--steps", default=None, help="comma list of steps (default: all)")
    ap.add_argument("--work", default=None, help="work directory (default bench/results/gpu-<machine>)")
    ap.add_argument("--machine", default=None, help="name of the machine in file names (default: the GPU's, or cpu)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"seconds this call may spend; a step whose limit does not fit is not started (default "
                         f"{DEFAULT_BUDGET_S} on a GPU, one device call; no limit for --cpu-smoke)")
    args = ap.parse_args(argv)
    steps = cpu_smoke_steps() if args.cpu_smoke else gpu_steps()
    known = [s.name for s in steps]
    wanted = [s.strip() for s in args.steps.split(",")] if args.steps else known
    unknown = [s for s in wanted if s not in known]
    if unknown:
        print(f"unknown steps {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    machine = args.machine or ("cpu-smoke" if args.cpu_smoke else _gpu_name())
    work = Path(args.work) if args.work else ROOT / "bench" / "results" / f"gpu-{machine}"
    work.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        write_smoke_model(work)
    budget_s = args.budget_s if args.budget_s is not None else (float("inf") if args.cpu_smoke else DEFAULT_BUDGET_S)
    started = time.perf_counter()
    records: list[Record] = []
    summary = ""
    for step in steps:
        if step.name not in wanted:
            continue
        remaining = budget_s - (time.perf_counter() - started)
        print(f"[gpu_validate] {step.name} ({remaining:.0f} s left)", flush=True)
        r = run_step(step, work, remaining)
        print(f"[gpu_validate] {step.name}: {r.status} in {r.wall_s} s", flush=True)
        records.append(r)
        summary = _save(records, machine, "cpu-smoke" if args.cpu_smoke else "gpu", work,
                        "-".join(s.name for s in steps if s.name in wanted))  # a cut call keeps these
    print(summary if records else "no steps run")
    return 0 if all(r.status == "ok" for r in records) else 1


def _save(records: list[Record], machine: str, mode: str, work: Path, call: str) -> str:
    """The status and summary so far, in the work directory and (archived with it) in $OUT."""
    status = {"machine": machine, "mode": mode, "date": time.strftime("%Y-%m-%d"), "steps": [vars(r) for r in records]}
    status_path = work / f"status-{call}.json"
    status_path.write_text(json.dumps(status, indent=2) + "\n")
    summary = summary_markdown(records, machine, mode)
    (work / "summary.md").write_text(summary)
    _export(work, status, summary)
    return summary


def _gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(0).lower()).strip("-")
    except ImportError:
        pass
    return "cpu"


def _export(work: Path, status: dict, summary: str) -> None:
    """Into $OUT (a device call brings back at most 8 files): one archive of the work directory, the status and
    the summary."""
    out = os.environ.get("OUT")
    if not out:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / f"{work.name}.tar.gz", "w:gz") as tar:
        tar.add(work, arcname=work.name)
    (out / "status.json").write_text(json.dumps(status, indent=2) + "\n")
    (out / "summary.md").write_text(summary)


if __name__ == "__main__":
    sys.exit(main())
