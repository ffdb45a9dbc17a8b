"""vramplan's own CPU decoder step (runtime.lean) against transformers' forward, cpu-w4a8, per model.

Each model runs in a fresh process: dummy weights loaded as `vramplan run` loads them (runtime.load, the CPU path), a
`--prompt`-token prefill, then `--steps` greedy decode steps a mode, the median step kept: transformers' forward (a
DynamicCache, as --eager runs it) and runtime.lean. Then both again with the kernel calls and lm_head replaced by
empty tensors of their shapes: what is left is each path's fixed cost, whose ratio per layer is what
planner.lean.LEAN_CPU_PER_LAYER_FACTOR holds. Writes bench/results/lean-cpu-<machine>.json and .md. Run nothing else
meanwhile: the VM has 2 cores.

    python bench/lean_cpu.py --models qwen2.5-0.5b,llama-3.2-1b --machine cpu-epyc-avx2
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


def one(model_name: str, prompt: int, steps: int) -> dict:
    """One process's measurement (run by the parent with --one)."""
    import torch

    from vramplan.planner.quant import KV_SCHEMES, SCHEMES
    from vramplan.planner.sources import resolve_model
    from vramplan.runtime import cpu_kernel, lean
    from vramplan.runtime.generate import decode_one_token, prefill, synthetic_prompt
    from vramplan.runtime.kvcache import make_cache
    from vramplan.runtime.load import load_model

    config = resolve_model(model_name).config
    model = load_model(config, scheme=SCHEMES["cpu-w4a8"], dummy_weights=True, device="cpu").model
    ids = synthetic_prompt(prompt, model.config.vocab_size, seed=1)
    decoder = lean.LeanDecoder(model, max_len=prompt + steps + 1)

    def median_step(cache) -> float:
        times, token = [], torch.tensor([[11]])
        with torch.inference_mode():
            prefill(model, ids, cache, 2048)
            for i in range(steps):
                t0 = time.perf_counter()
                token = decode_one_token(model, token, prompt + i, cache).argmax(dim=-1, keepdim=True)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[2:])

    out = {"model": model_name, "layers": model.config.num_hidden_layers, "prompt": prompt, "steps": steps}
    out["transformers_ms"] = 1e3 * median_step(make_cache(KV_SCHEMES["bf16"], model.config))
    out["lean_ms"] = 1e3 * median_step(decoder)
    empty = lambda x, codes, sz, group: torch.empty(x.shape[0], codes.shape[0], dtype=x.dtype)  # noqa: E731
    cpu_kernel.product = lean.product = empty
    class NoHead(torch.nn.Module):
        def forward(self, x):
            return torch.zeros(*x.shape[:-1], 8, dtype=x.dtype)

    model.lm_head = decoder.head = NoHead()
    out["transformers_fixed_ms"] = 1e3 * median_step(make_cache(KV_SCHEMES["bf16"], model.config))
    out["lean_fixed_ms"] = 1e3 * median_step(decoder)
    n = out["layers"]
    out["transformers_fixed_per_layer_us"] = 1e3 * out["transformers_fixed_ms"] / n
    out["lean_fixed_per_layer_us"] = 1e3 * out["lean_fixed_ms"] / n
    out["factor"] = out["lean_fixed_ms"] / out["transformers_fixed_ms"]
    return out


def markdown(result: dict) -> str:
    lines = [f"# vramplan's own CPU decoder step against transformers' forward: {result['machine']}", "",
             f"{result['date']}; cpu-w4a8, dummy weights; {result['versions']}", "",
             "| model | layers | step ms: transformers / lean | speed-up | fixed cost a layer, us: transformers / lean "
             "| factor |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['layers']} | {r['transformers_ms']:.1f} / {r['lean_ms']:.1f} | "
                     f"{r['transformers_ms'] / r['lean_ms']:.2f}x | {r['transformers_fixed_per_layer_us']:.0f} / "
                     f"{r['lean_fixed_per_layer_us']:.0f} | {r['factor']:.2f} |")
    lines += ["", "The fixed cost is the step with the kernel calls and lm_head replaced by empty tensors; the factor "
              "is lean's over transformers' (planner.lean.LEAN_CPU_PER_LAYER_FACTOR)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,llama-3.2-1b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--machine", required=True, help="name used in the result file names")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.prompt, args.steps)))
        return 0
    import torch
    import transformers

    rows = []
    for name in args.models.split(","):
        done = subprocess.run([sys.executable, __file__, "--one", name, "--prompt", str(args.prompt), "--steps",
                               str(args.steps), "--machine", args.machine], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    result = {"machine": args.machine, "date": time.strftime("%Y-%m-%d"), "rows": rows,
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"lean-cpu-{args.machine}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"lean-cpu-{args.machine}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
