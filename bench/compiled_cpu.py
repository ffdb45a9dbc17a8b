"""vramplan's own decode on a CPU, eager against compiled (runtime.compiled.StaticDecoder), per scheme.

Each (scheme, mode) runs in a fresh process: the model (dummy weights, runtime.load, the CPU path: direct kernels and
the CPU head) prefills `--prompt` tokens, then decodes `--steps` tokens greedily, one step at a time; the first
`--warm` steps (which compile) are dropped and the median step time is kept. What compiling leaves of a step's fixed
cost per layer is what planner.speed.COMPILED_CPU_PER_LAYER_FACTOR holds (the matmul kernels are the same in both
modes). The tokens of the two modes agree until the first near-tie of the random weights' logits, where the sums'
order (fused or not) can pick the other token: the table gives how many agree. Writes
bench/results/compiled-cpu-<machine>.json and .md. Run nothing else meanwhile: the VM has 2 cores.

    python bench/compiled_cpu.py --model qwen2.5-0.5b --quants bf16,quanto-int8,quanto-int4,quanto-w8a8 \\
        --machine cpu-dev
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed


def one(model_name: str, quant: str, mode: str, prompt: int, steps: int, warm: int) -> dict:
    """One process's measurement (run by the parent with --one)."""
    import torch

    from vramplan.planner.quant import KV_SCHEMES, SCHEMES
    from vramplan.planner.sources import resolve_model
    from vramplan.runtime.generate import decode_one_token, prefill, synthetic_prompt
    from vramplan.runtime.kvcache import make_cache
    from vramplan.runtime.load import load_model

    loaded = load_model(dict(resolve_model(model_name).config), scheme=SCHEMES[quant], dummy_weights=True,
                        device="cpu")
    model = loaded.model
    ids = synthetic_prompt(prompt, int(model.config.get_text_config(decoder=True).vocab_size), seed=0)
    times, tokens = [], []
    with torch.no_grad():
        if mode == "compiled":
            from vramplan.runtime.compiled import StaticDecoder

            static = StaticDecoder(model, prompt + steps + 1, torch.device("cpu"))
            token = static.static_forward(ids, 0).argmax(dim=-1, keepdim=True)

            def step(tok, pos):
                return static.static_decode(tok, pos)
        else:
            cache = make_cache(KV_SCHEMES["bf16"], model.config)
            token = prefill(model, ids, cache, 2048).argmax(dim=-1, keepdim=True)

            def step(tok, pos):
                return decode_one_token(model, tok, pos, cache)
        for i in range(steps):
            t0 = time.perf_counter()
            token = step(token, prompt + i).argmax(dim=-1, keepdim=True)
            tokens.append(int(token))
            times.append(time.perf_counter() - t0)
    kept = times[warm:]
    return {"model": model_name, "quant": quant, "mode": mode, "layers": int(loaded.num_layers),
            "step_ms_median": 1e3 * statistics.median(kept), "step_ms_min": 1e3 * min(kept),
            "compile_and_warm_s": sum(times[:warm]), "tokens": tokens}


def markdown(out: dict) -> str:
    lines = [f"# vramplan's CPU decode, eager and compiled: {out['model']} on {out['machine']}", "",
             f"{out['date']}; {out['platform']}; {out['versions']}",
             f"prompt {out['prompt']} tokens; median of {out['steps'] - out['warm']} decode steps after {out['warm']}",
             "", "| scheme | eager ms/step | compiled ms/step | eager tok/s | compiled tok/s | saved per layer ms "
             "| tokens equal for |", "|---|---|---|---|---|---|---|"]
    for q, r in out["schemes"].items():
        lines.append(f"| {q} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {1e3 / r['eager_ms']:.1f} | "
                     f"{1e3 / r['compiled_ms']:.1f} | {r['saved_per_layer_ms']:.3f} | "
                     f"{r['equal_tokens']} of {out['steps']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--quants", default="bf16,quanto-int8,quanto-int4,quanto-w8a8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--one", nargs=2, metavar=("QUANT", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.model, *args.one, args.prompt, args.steps, args.warm)))
        return 0
    from vramplan.runtime.calibrate import versions

    runs = []
    for quant in args.quants.split(","):
        for mode in ("eager", "compiled"):
            r = subprocess.run([sys.executable, __file__, "--model", args.model, "--prompt", str(args.prompt),
                                "--steps", str(args.steps), "--warm", str(args.warm), "--machine", args.machine,
                                "--one", quant, mode], capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise SystemExit(f"{quant} {mode}: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(quant, mode, f"{runs[-1]['step_ms_median']:.2f} ms", flush=True)
    schemes = {}
    for quant in args.quants.split(","):
        e, c = (next(r for r in runs if r["quant"] == quant and r["mode"] == m) for m in ("eager", "compiled"))
        schemes[quant] = {"eager_ms": e["step_ms_median"], "compiled_ms": c["step_ms_median"],
                          "saved_per_layer_ms": (e["step_ms_median"] - c["step_ms_median"]) / e["layers"],
                          "equal_tokens": next((i for i, (a, b) in enumerate(zip(e["tokens"], c["tokens"])) if a != b),
                                               len(e["tokens"]))}
    out = {"benchmark": "compiled_cpu", "model": args.model, "machine": args.machine,
           "date": time.strftime("%Y-%m-%d"), "platform": platform.platform(), "versions": versions(),
           "prompt": args.prompt, "steps": args.steps, "warm": args.warm, "schemes": schemes, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"compiled-cpu-{args.machine}.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.out / f"compiled-cpu-{args.machine}.md").write_text(markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
