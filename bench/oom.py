"""Benchmark: an induced out-of-memory is survived. A budget lie: another process takes most of the GPU, the plan
(made from the profile, which promises the whole GPU) says the model fits, the run runs out of memory, re-plans with
what the device has free (measured), and still delivers every token it was asked for.

    python bench/oom.py --hardware h100-sxm --model llama-3.1-8b --quant bf16 --context 8k --ballast-free 10GiB

Writes bench/results/oom-<machine>.json and .md. Without CUDA it writes a result marked skipped (nothing to prove on
a CPU) and exits 0, so that `gpu_validate.sh --cpu-smoke` runs the step end to end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

RESULTS_DIR = ROOT / "bench" / "results"
# The other process: holds `n` bytes on the GPU until killed; says "ready" once they are allocated and touched.
BALLAST_CODE = ("import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); "
                "x.fill_(1); torch.cuda.synchronize(); print('ready', flush=True); time.sleep(3600)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--context", default="8k")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ballast-free", default="10GiB", help="what the other process leaves free on the GPU")
    ap.add_argument("--machine", default="gpu")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    result: dict = {"benchmark": "induced OOM", "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    if not torch.cuda.is_available():
        result["skipped"] = "needs a CUDA GPU: there is no GPU memory to run out of"
    else:
        result.update(_run(args))
    (out_dir / f"oom-{args.machine}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"oom-{args.machine}.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _run(args) -> dict:
    import torch

    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.request import Request
    from vramplan.planner.search import plan
    from vramplan.planner.sources import load_spec, resolve_model
    from vramplan.planner.units import parse_bytes, parse_context
    from vramplan.runtime.execute import execute

    free, total = torch.cuda.mem_get_info()
    leave = parse_bytes(args.ballast_free)
    ballast_bytes = max(0, free - leave)
    ballast = subprocess.Popen([sys.executable, "-c", BALLAST_CODE, str(ballast_bytes)], stdout=subprocess.PIPE,
                               text=True)
    try:
        if ballast.stdout.readline().strip() != "ready":
            return {"error": "the ballast process did not start"}
        source = resolve_model(args.model)
        spec = load_spec(source)
        hw = resolve_profile(args.hardware)[0]
        p = plan(spec, hw, Request(context=parse_context(args.context), prompt_tokens=args.prompt_tokens,
                                   quant=(args.quant,), kv_dtype=("bf16",), eager=True))
        report = execute(p, spec, hw, source, dummy_weights=True, prompt_text=None, prompt_tokens=args.prompt_tokens,
                         max_new_tokens=args.max_new_tokens)
    finally:
        ballast.kill()
        ballast.wait()
    d = report.to_dict()
    return {"device": torch.cuda.get_device_name(0), "device_total_bytes": total, "ballast_bytes": ballast_bytes,
            "first_plan": {"choice": p.choice.to_dict(), "gpu_total_bytes": p.memory.gpu.total_bytes},
            "final_plan": d["plan"]["choice"], "replans": d["replans"], "errors": d["errors"], "notes": d["notes"],
            "generated_tokens": len(report.tokens), "asked_tokens": args.max_new_tokens,
            "survived": len(report.tokens) == args.max_new_tokens and bool(report.replans),
            "predicted": d["predicted"], "measured": d["measured"]}


def _markdown(r: dict) -> str:
    lines = ["# Induced out-of-memory", "", f"{r['date']}; {json.dumps(r['args'])}", ""]
    if "skipped" in r:
        return "\n".join(lines + [f"Skipped: {r['skipped']}.", ""])
    if "error" in r:
        return "\n".join(lines + [f"Error: {r['error']}.", ""])
    lines += [f"Device {r['device']}, {r['device_total_bytes'] / 2**30:.1f} GiB; another process held "
              f"{r['ballast_bytes'] / 2**30:.1f} GiB.",
              f"First plan: {r['first_plan']['choice']} ({r['first_plan']['gpu_total_bytes'] / 2**30:.2f} GiB on the "
              "GPU).",
              f"Final plan: {r['final_plan']}.", "",
              f"Survived: **{r['survived']}** ({r['generated_tokens']} of {r['asked_tokens']} tokens, "
              f"{len(r['replans'])} re-plan(s)).", ""]
    lines += [f"- re-plan: {x['reason']}" for x in r["replans"]]
    lines += [f"- error: {e}" for e in r["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
