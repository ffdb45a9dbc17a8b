"""Eager against compiled decode, the transformers way: the number a compiled runtime would have to reach.

vramplan's runtime decodes eagerly; on the H200 a decode step is bound by the host (GPU busy 3.9 ms of a 8.4-11.5 ms
Llama-3.2-1B bf16 step, bench/results/gpu-nvidia-h200-2/). Before the runtime gets a compiled path (issue 26), this
measures what transformers itself reaches on the same machine and model (dummy weights, runtime.load), greedy, batch 1:
- eager: `generate` with the dynamic cache;
- compiled: `generate` with a static cache and the forward compiled by torch.compile (mode "reduce-overhead": CUDA
  graphs on a GPU), after warm-up calls that compile it (their time is reported as compile_s).
Decode time per token is (time for 1 + n new tokens - time for 1 new token) / n, each the best of `--repeats` calls,
so prefill and the first token's sampling drop out.

    python bench/compiled_decode.py --model llama-3.1-8b --quants bf16,bnb-nf4 --machine gpu --out DIR
    python bench/compiled_decode.py --model qwen2.5-0.5b --quants bf16 --device cpu --new-tokens 4 --machine smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed


def _timed_generate(model, ids, new_tokens: int, device: str, **kw) -> float:
    import torch

    from vramplan.runtime.measure import synchronize

    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
    synchronize(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def per_token_s(model, ids, new_tokens: int, device: str, repeats: int, **kw) -> float:
    one = min(_timed_generate(model, ids, 1, device, **kw) for _ in range(repeats))
    many = min(_timed_generate(model, ids, 1 + new_tokens, device, **kw) for _ in range(repeats))
    return max(many - one, 1e-9) / new_tokens


def measure(config: dict, quant: str, device: str, prompt: int, new_tokens: int, repeats: int, mode: str) -> dict:
    import torch

    from vramplan.planner.quant import SCHEMES
    from vramplan.runtime.generate import synthetic_prompt
    from vramplan.runtime.load import load_model

    model = load_model(config, scheme=SCHEMES[quant], dummy_weights=True, device=device,
                       random_device=device if device != "cpu" else None).model
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = synthetic_prompt(prompt, vocab, seed=0).to(device)
    row = {"quant": quant, "device": device, "prompt": prompt, "new_tokens": new_tokens, "mode": mode}
    try:
        _timed_generate(model, ids, 2, device)  # warm-up: CUDA's lazy kernel loading
        row["eager_s_per_token"] = per_token_s(model, ids, new_tokens, device, repeats)
        max_len = prompt + new_tokens + 8
        static = {"cache_implementation": "static"}
        model.generation_config.max_length = max_len
        model.forward = torch.compile(model.forward, mode=mode, fullgraph=False, dynamic=False)
        t0 = time.perf_counter()
        for n in (1, 2, 1 + new_tokens):  # compiles the prefill and the decode graphs
            _timed_generate(model, ids, n, device, **static)
        row["compile_s"] = time.perf_counter() - t0
        row["compiled_s_per_token"] = per_token_s(model, ids, new_tokens, device, repeats, **static)
        row["eager_tokens_per_s"] = 1 / row["eager_s_per_token"]
        row["compiled_tokens_per_s"] = 1 / row["compiled_s_per_token"]
        row["speedup"] = row["eager_s_per_token"] / row["compiled_s_per_token"]
    except Exception as e:  # noqa: BLE001 - a failed row is a result; the others still run
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return row


def markdown(out: dict) -> str:
    lines = [f"# Eager vs compiled decode (transformers generate): {out['model']} on {out['machine']}", "",
             f"{out['date']}; {out['versions']}; torch.compile mode {out['mode']}", "",
             "| scheme | prompt | eager tok/s | compiled tok/s | speedup | compile s |", "|---|---|---|---|---|---|"]
    for r in out["rows"]:
        if "error" in r:
            eager = r.get("eager_tokens_per_s", "-")
            lines.append(f"| {r['quant']} | {r['prompt']} | {eager} | error: {r['error']} | | |")
            continue
        lines.append(f"| {r['quant']} | {r['prompt']} | {r['eager_tokens_per_s']:.1f} | "
                     f"{r['compiled_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['compile_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", help="catalog model (dummy weights from its config)")
    ap.add_argument("--quants", default="bf16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mode", default=None, help="torch.compile mode (default: reduce-overhead on a GPU, default on "
                                                 "a CPU)")
    ap.add_argument("--machine", required=True, help="name used in the result file names")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    from vramplan.planner.sources import resolve_model
    from vramplan.runtime.calibrate import versions

    mode = args.mode or ("default" if args.device == "cpu" else "reduce-overhead")
    config = resolve_model(args.model).config
    rows: list[dict] = []
    out = {"benchmark": "compiled_decode", "model": args.model, "machine": args.machine, "mode": mode,
           "date": time.strftime("%Y-%m-%d"), "versions": versions(), "platform": platform.platform(), "rows": rows}
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    for quant in args.quants.split(","):
        print(f"{args.model} {quant}", flush=True)
        rows.append(measure(config, quant, args.device, args.prompt, args.new_tokens, args.repeats, mode))
        (results / f"compiled-decode-{args.machine}.json").write_text(json.dumps(out, indent=2) + "\n")
        (results / f"compiled-decode-{args.machine}.md").write_text(markdown(out))
    print(markdown(out))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
