"""The engines side by side in one run: vramplan's torch runtime, plain transformers `generate`, and llama.cpp.

The same random-weight model (a catalog architecture saved once with transformers, bf16) is run at each bit width by
each engine, each in a fresh process, one after the other:
- vramplan: `vramplan run` of the saved checkpoint with the scheme forced (bf16, quanto-int8 and quanto-w8a8,
  quanto-int4 and cpu-w4a8), all on this machine's CPU, eager and (vramplan-compiled) with --compile; its report gives
  predicted and measured decode, TTFT and peak RAM; with --recommended also `vramplan run` with the scheme the plan
  chooses;
- transformers: `AutoModelForCausalLM.from_pretrained` (quanto through `QuantoConfig` for 8 and 4 bits) and
  `generate(do_sample=False)` with a streamer stamping each token; peak RSS of that process;
- llama.cpp: the checkpoint converted with llama.cpp's convert_hf_to_gguf.py (BF16) and quantized with llama-quantize
  (Q8_0, Q4_0), then `vramplan run --engine llama.cpp` on the file: llama-server started with the command vramplan's
  llama.cpp plan writes; its own timings and its peak RSS.

Every engine gets the same prompt length (random token ids) and the same number of new tokens, and the host's threads.
Decode is the tokens after the first over the time from the first to the last, for every engine. Writes
bench/results/vs-engines-<machine>.json and .md: decode tok/s, TTFT and peak RAM per model, bit width and engine, and
each engine's decode against the fastest at that width.

    python bench/vs_engines.py --llama-cpp /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --bin /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin --machine cpu-dev
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

# bits -> (vramplan / transformers scheme, GGUF file type)
WIDTHS = {16: ("bf16", "BF16"), 8: ("quanto-int8", "Q8_0"), 4: ("quanto-int4", "Q4_0")}
# vramplan's schemes at each width: 8 bits also as quanto-w8a8 (the same bytes, activations in int8 too, as llama.cpp's
# CPU kernels quantize them for Q8_0 and Q4_0)
VRAMPLAN_SCHEMES = {16: ("bf16",), 8: ("quanto-int8", "quanto-w8a8"), 4: ("quanto-int4", "cpu-w4a8")}
MODELS = ("qwen2.5-0.5b", "llama-3.2-1b")

# Plain transformers in a fresh process: the model loaded as a user would, then one greedy generate whose streamer
# stamps each new token (the first stamp after the prompt is TTFT).
TRANSFORMERS_RUN = r'''
import json, resource, sys, time, torch
from transformers import AutoModelForCausalLM, QuantoConfig
from transformers.generation.streamers import BaseStreamer
path, bits, prompt, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
kw = {} if bits == 16 else {"quantization_config": QuantoConfig(weights="int8" if bits == 8 else "int4")}
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()
ids = torch.randint(300, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
class Stamps(BaseStreamer):
    def __init__(self): self.t = []
    def put(self, value): self.t.append(time.perf_counter())
    def end(self): pass
with torch.no_grad():
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up, as llama-server's is
    s = Stamps(); t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=s)
t = s.t[1:]  # the first put() is the prompt itself
print(json.dumps({"ttft_s": t[0] - t0, "decode_tokens_per_s": (len(t) - 1) / (t[-1] - t[0]),
                  "peak_ram_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
'''


def run_cli(model_dir: Path, args: list[str], hw_name: str | None, prompt: int, new: int) -> dict:
    """`vramplan run` of the checkpoint as a user runs it (`args`: the scheme, or llama.cpp and its GGUF file); its
    JSON report reduced to the compared numbers."""
    cmd = [sys.executable, str(ROOT / "cli.py"), "run", "--model", str(model_dir), *args,
           "--context", str(prompt + new + 16), "--prompt-tokens", str(prompt), "--max-new-tokens", str(new),
           "--json"] + (["--hardware", hw_name] if hw_name else [])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    d = json.loads(r.stdout)
    m, p = d["measured"], d["predicted"]
    return {"scheme": ((d.get("plan") or {}).get("choice") or {}).get("weight_quant"),
            "decode_tokens_per_s": m["decode_tokens_per_s"],
            "ttft_s": m["ttft_s"], "peak_ram_bytes": m["peak_ram_bytes"],
            "predicted": {"decode_tokens_per_s": p["decode_tokens_per_s"], "ttft_s": p["ttft_s"],
                          "peak_ram_bytes": p["peak_ram_bytes"]}}


def run_transformers(model_dir: Path, bits: int, prompt: int, new: int) -> dict:
    r = subprocess.run([sys.executable, "-c", TRANSFORMERS_RUN, str(model_dir), str(bits), str(prompt), str(new)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def markdown(out: dict) -> str:
    lines = [f"# Engines side by side on {out['machine']}", "", f"{out['date']}; {out['platform']}; {out['versions']}",
             f"prompt {out['prompt_tokens']} tokens, {out['new_tokens']} new tokens, {out['threads']} threads; "
             "each run a fresh process, one after the other", "",
             "| model | bits | engine | decode tok/s | x fastest | TTFT s | peak RAM GiB | planned RAM GiB | "
             "predicted decode |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in out["rows"]:
        r = row["result"]
        if "error" in r:
            lines.append(f"| {row['model']} | {row['bits']} | {row['engine']} | error: {r['error']} | | | | | |")
            continue
        pred = (r.get("predicted") or {}).get("decode_tokens_per_s")
        ram = (r.get("predicted") or {}).get("peak_ram_bytes")
        lines.append(f"| {row['model']} | {row['bits']} | {row['engine']} ({row['scheme']}) | "
                     f"{r['decode_tokens_per_s']:.1f} | {row.get('vs_fastest', 0):.2f} | {r['ttft_s']:.3f} | "
                     f"{r['peak_ram_bytes'] / 2**30:.2f} | {'-' if ram is None else f'{ram / 2**30:.2f}'} | "
                     f"{'-' if pred is None else f'{pred:.1f}'} |")
    lines += ["", "x fastest: against the fastest row at that width; the recommended plan's row against the fastest "
              "row of that model at any width. planned RAM: what the run's plan counts in RAM (llama.cpp's plan for its"
              " rows); peak RAM: the process' peak RSS, mapped file pages included. llama.cpp's CPU backend repacks"
              " Q4_0 / Q4_K / IQ4_NL matrices into a buffer of its own, and the file pages it copied them from stay"
              " mapped: clean page cache the kernel reclaims under pressure, which its plan leaves out as"
              " bench/results/llamacpp-serve-cpu-dev.md measures it (its Q4_0 rows' peak is over its plan by about"
              " the repacked bytes)."]
    return "\n".join(lines) + "\n"


def against_fastest(rows: list[dict], pool: list[dict]) -> None:
    """Each row's decode over the fastest of `pool` (its "vs_fastest"), where both measured."""
    best = max((g["result"].get("decode_tokens_per_s") or 0 for g in pool), default=0)
    for r in rows:
        if best and "error" not in r["result"]:
            r["vs_fastest"] = r["result"]["decode_tokens_per_s"] / best


def save(out: dict, where: Path, machine: str) -> None:
    """The results so far, as JSON and Markdown (after every group, so a run cut short keeps what it measured)."""
    (where / f"vs-engines-{machine}.json").write_text(json.dumps(out, indent=2) + "\n")
    (where / f"vs-engines-{machine}.md").write_text(markdown(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--bin", type=Path, help="directory with llama-server and llama-quantize")
    ap.add_argument("--engines", default="vramplan,vramplan-compiled,transformers,llama.cpp",
                    help="comma list of vramplan, vramplan-compiled, transformers, llama.cpp")
    ap.add_argument("--recommended", action="store_true",
                    help="also `vramplan run` each model with the plan vramplan recommends (no --quant), and compare "
                         "it with the fastest row of that model at any width")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--bits", default="16,8,4")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hardware", default=None, help="profile for the plans (default: this machine's)")
    ap.add_argument("--machine", required=True)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--work", type=Path, default=None, help="where checkpoints and GGUFs go (default: a temp dir)")
    args = ap.parse_args(argv)
    engines = args.engines.split(",")
    if "llama.cpp" in engines and not (args.llama_cpp and args.bin):
        ap.error("llama.cpp needs --llama-cpp and --bin (or leave it out of --engines)")

    import llamacpp_serve as ls
    from vramplan.planner.sources import resolve_model
    from vramplan.runtime.calibrate import versions

    work = args.work or Path(tempfile.mkdtemp(prefix="vs-engines-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    out = {"benchmark": "vs_engines", "machine": args.machine, "date": time.strftime("%Y-%m-%d"),
           "platform": platform.platform(),
           "versions": {**versions(), "llama.cpp": ls.llama_cpp_commit(args.llama_cpp) if args.llama_cpp else None},
           "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "threads": os.cpu_count(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        source = resolve_model(name)
        config = dict(source.config)
        key = name.replace("/", "--")
        model_dir = work / key
        if not (model_dir / "config.json").exists():
            ls.save_model(config, model_dir)
        for bits in (int(b) for b in args.bits.split(",")):
            scheme, file_type = WIDTHS[bits]
            group = []
            for engine in engines:
                print(f"{name} {bits}-bit {engine}", flush=True)
                if engine in ("vramplan", "vramplan-compiled"):  # `vramplan run` (--compile) of each scheme
                    for s in VRAMPLAN_SCHEMES[bits]:
                        r = run_cli(model_dir, ["--quant", s] + (["--compile"] if engine != "vramplan" else []),
                                    args.hardware, args.prompt, args.new_tokens)
                        print("   ", s, {k: v for k, v in r.items() if k != "command"}, flush=True)
                        group.append({"model": name, "bits": bits, "engine": engine, "scheme": s, "result": r})
                    rows.extend(group[-len(VRAMPLAN_SCHEMES[bits]):])
                    continue
                if engine == "transformers":
                    r = run_transformers(model_dir, bits, args.prompt, args.new_tokens)
                else:  # the GGUF made once per file type, then `vramplan run --engine llama.cpp` on it
                    gguf = ls.make_gguf(args.llama_cpp, args.bin, config, file_type, work, key)
                    r = run_cli(model_dir, ["--engine", "llama.cpp", "--gguf", str(gguf), "--llama-server",
                                            str(args.bin / "llama-server")], args.hardware, args.prompt,
                                args.new_tokens)
                row = {"model": name, "bits": bits, "engine": engine,
                       "scheme": file_type if engine == "llama.cpp" else scheme, "result": r}
                print("   ", {k: v for k, v in r.items() if k != "command"}, flush=True)
                rows.append(row)
                group.append(row)
            against_fastest(group, group)
            save(out, args.out, args.machine)
        if args.recommended:  # `vramplan run` as a user runs it: the plan's own scheme, against the model's fastest row
            print(f"{name} recommended plan", flush=True)
            r = run_cli(model_dir, [], args.hardware, args.prompt, args.new_tokens)
            print("   ", r, flush=True)
            row = {"model": name, "bits": "plan", "engine": "vramplan (recommended plan)", "scheme": r.get("scheme"),
                   "result": r}
            against_fastest([row], [g for g in rows if g["model"] == name])
            rows.append(row)
            save(out, args.out, args.machine)
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
