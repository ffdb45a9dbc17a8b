"""Benchmark: our offload engine (stream mode) against accelerate's device_map offload.

Same model (catalog config, dummy weights: speed does not depend on weight values), same
split (the first --gpu-layers decoder layers on the GPU, the rest offloaded), same
quantization where the baseline allows it. Measures decode tokens/s and TTFT for both,
the bytes each moves over the host link per token, and the link roofline for ours:
streamed bytes per token / pinned host-to-device bandwidth (measured here, and the
--hardware profile's figure beside it).

The baseline is what a transformers user gets: ``from_pretrained(..., device_map=...)`` /
``dispatch_model`` with the layers past the split mapped to "cpu" (runtime.load builds
exactly that). accelerate then copies every offloaded weight to the GPU synchronously,
from pageable memory, on every forward. For bitsandbytes it needs
``llm_int8_enable_fp32_cpu_offload=True``, which keeps the offloaded layers unquantized
in the compute dtype: it moves bf16 weights where we move packed 4-bit/8-bit ones.
transformers' quanto loader refuses a device_map with CPU entries: no baseline for quanto.

Targets on a GPU: >= 3x accelerate's decode tokens/s for bnb-nf4, >= 1.5x for bf16, and
>= 85 % of the link roofline.

Without a GPU the script refuses unless --allow-cpu; then it runs a small sanity
comparison on the CPU (our engine with device="cpu" against the same model without
offload: identical tokens, and what the engine's bookkeeping reports), labelled
"CPU sanity run, not the GPU benchmark".

    python bench/offload.py --model llama-3.1-8b --quant bnb-nf4 --gpu-layers 8 \\
        --context 1024 --max-new-tokens 64 --hardware h100-pcie
    python bench/offload.py --allow-cpu --model qwen2.5-0.5b --quant bf16 --offload-fraction 0.5 \\
        --context 32 --max-new-tokens 3

Writes bench/results/offload-<machine>.json and .md (<machine>: --machine, else the
--hardware name, else the GPU's name; "cpu-sanity" for the CPU run).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
__import__("_checkout").use_checkout(ROOT)  # vramplan from this checkout when not installed

import torch  # noqa: E402

from vramplan.planner.profiles import resolve_profile  # noqa: E402
from vramplan.planner.quant import SCHEMES  # noqa: E402
from vramplan.planner.sources import resolve_model  # noqa: E402
from vramplan.runtime.generate import generate, synthetic_prompt  # noqa: E402
from vramplan.runtime.load import load_model  # noqa: E402
from vramplan.runtime.measure import free_memory  # noqa: E402
from vramplan.runtime.offload import apply_offload  # noqa: E402

CPU_SANITY_LABEL = "CPU sanity run, not the GPU benchmark"
TARGET_SPEEDUP = {"bnb-nf4": 3.0, "bf16": 1.5}
TARGET_ROOFLINE_FRACTION = 0.85
BANDWIDTH_PROBE_BYTES = 256 * 2**20
BANDWIDTH_PROBE_REPEATS = 10
WARMUP_NEW_TOKENS = 2
RESULTS_DIR = ROOT / "bench" / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="catalog name or a directory with config.json (dummy weights "
                                                  "from its config)")
    p.add_argument("--quant", default="bnb-nf4", help="weight scheme: bf16, bnb-nf4, bnb-int8, ...")
    split = p.add_mutually_exclusive_group(required=True)
    split.add_argument("--gpu-layers", type=int, help="decoder layers kept on the GPU")
    split.add_argument("--offload-fraction", type=float, help="fraction of decoder layers offloaded, in [0, 1]")
    p.add_argument("--context", type=int, default=1024, help="prompt + generated tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--hardware", help="hardware profile name or path (its pinned h2d bandwidth is reported)")
    p.add_argument("--machine", help="name in the results file names")
    p.add_argument("--out", default=str(RESULTS_DIR), help="directory for the JSON and Markdown")
    p.add_argument("--allow-cpu", action="store_true", help="without a GPU: run the CPU sanity comparison")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.offload_fraction is not None and not 0 <= args.offload_fraction <= 1:
        p.error("--offload-fraction must be in [0, 1]")
    if args.max_new_tokens < 1 or args.context <= args.max_new_tokens:
        p.error("--context must exceed --max-new-tokens >= 1")
    return args


# --- pieces -----------------------------------------------------------------------------


def model_config(name: str) -> dict:
    """A catalog model's config, or a directory's config.json (the CPU smoke runs a tiny one)."""
    return resolve_model(name).config


def split_layers(config: dict, gpu_layers: int | None, offload_fraction: float | None) -> tuple[int, int]:
    num_layers = int(config.get("text_config", config)["num_hidden_layers"])
    if gpu_layers is None:
        gpu_layers = round(num_layers * (1 - offload_fraction))
    if not 0 <= gpu_layers <= num_layers:
        raise SystemExit(f"--gpu-layers {gpu_layers} is outside 0..{num_layers}")
    return gpu_layers, num_layers


def measure_pinned_h2d_bytes_per_s(device: str) -> float:
    """Pinned host -> device copy bandwidth, best of a few 256 MiB copies timed with CUDA events."""
    host = torch.empty(BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    best = float("inf")
    for _ in range(BANDWIDTH_PROBE_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return BANDWIDTH_PROBE_BYTES / best


def profile_h2d_bytes_per_s(hardware: str | None) -> float | None:
    if not hardware:
        return None
    return resolve_profile(hardware)[0].link.h2d_pinned_bytes_per_s


def timed_generation(model, prompt, args) -> dict:
    """Warm up, then one measured generation; its decode rate, TTFT and tokens."""
    generate(model, prompt[:, :8], max_new_tokens=WARMUP_NEW_TOKENS, prefill_chunk=args.prefill_chunk)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result = generate(model, prompt, max_new_tokens=args.max_new_tokens, prefill_chunk=args.prefill_chunk)
    if result.error:
        raise SystemExit(f"generation failed: {result.error}")
    return {
        "decode_tokens_per_s": result.decode_tokens_per_s_median,
        "ttft_s": result.ttft_s,
        "generated_tokens": len(result.tokens),
        "tokens": result.tokens,
        "peak_vram_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
    }


def run_ours(config, args, gpu_layers, prompt, device: str) -> dict:
    row = _measure_ours(config, args, gpu_layers, prompt, device)
    free_memory()  # the model went with _measure_ours' frame; collect its reference cycles
    return row


def _measure_ours(config, args, gpu_layers, prompt, device: str) -> dict:
    loaded = load_model(config, scheme=SCHEMES[args.quant], dummy_weights=True, device="cpu", random_device=device,
                        cpu_alone=False)
    engine = apply_offload(loaded.model, gpu_layers=gpu_layers, mode="stream", device=device)
    row = {"engine": "vramplan stream", **timed_generation(loaded.model, prompt, args)}
    row["link_bytes_per_token"] = engine.h2d_bytes_last_forward  # the last forward was a decode step
    row["engine_summary"] = engine.summary()
    engine.detach()
    return row


def run_accelerate(config, args, gpu_layers, prompt) -> dict:
    """accelerate's dispatch_model offload, as runtime.load builds it for a split load."""
    if args.quant.startswith("quanto-"):
        return {"engine": "accelerate device_map", "skipped": "transformers' quanto loader refuses CPU entries "
                                                             "in a device_map"}
    row = _measure_accelerate(config, args, gpu_layers, prompt)
    free_memory()
    return row


def _measure_accelerate(config, args, gpu_layers, prompt) -> dict:
    loaded = load_model(config, scheme=SCHEMES[args.quant], dummy_weights=True, device="cuda:0",
                        gpu_layers=gpu_layers, random_device="cuda:0")
    row = {"engine": "accelerate device_map", **timed_generation(loaded.model, prompt, args)}
    # every offloaded weight is copied to the GPU on every forward. accelerate's dispatch_model leaves the
    # offloaded parameters on the meta device and keeps their values in a CPU weights map: count both.
    by_device = loaded.weights_bytes_by_device
    row["link_bytes_per_token"] = by_device.get("cpu", 0) + by_device.get("meta", 0)
    row["notes"] = list(loaded.notes)
    return row


def add_link_figures(row: dict, h2d_bytes_per_s: float) -> None:
    rate, per_token = row.get("decode_tokens_per_s"), row.get("link_bytes_per_token")
    if not rate or not per_token:
        return
    row["achieved_link_bytes_per_s"] = rate * per_token
    row["link_roofline_tokens_per_s"] = h2d_bytes_per_s / per_token
    row["fraction_of_link_roofline"] = rate / row["link_roofline_tokens_per_s"]


# --- the two runs -----------------------------------------------------------------------


def gpu_benchmark(args, config, gpu_layers, num_layers) -> dict:
    device = "cuda:0"
    prompt = synthetic_prompt(args.context - args.max_new_tokens, int(config.get("vocab_size", 32000)))
    measured_h2d = measure_pinned_h2d_bytes_per_s(device)
    ours = run_ours(config, args, gpu_layers, prompt, device)
    baseline = run_accelerate(config, args, gpu_layers, prompt)
    for row in (ours, baseline):
        add_link_figures(row, measured_h2d)
    out = {"label": "GPU benchmark", "device": torch.cuda.get_device_name(0),
           "measured_pinned_h2d_bytes_per_s": measured_h2d,
           "profile_pinned_h2d_bytes_per_s": profile_h2d_bytes_per_s(args.hardware), "rows": [ours, baseline]}
    if baseline.get("decode_tokens_per_s"):
        out["decode_speedup_vs_accelerate"] = ours["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
        out["ttft_speedup_vs_accelerate"] = baseline["ttft_s"] / ours["ttft_s"]
    out["targets"] = {
        "speedup": TARGET_SPEEDUP.get(args.quant),
        "speedup_met": (out["decode_speedup_vs_accelerate"] >= TARGET_SPEEDUP[args.quant]
                        if args.quant in TARGET_SPEEDUP and "decode_speedup_vs_accelerate" in out else None),
        "fraction_of_link_roofline": TARGET_ROOFLINE_FRACTION,
        "roofline_met": (ours["fraction_of_link_roofline"] >= TARGET_ROOFLINE_FRACTION
                         if "fraction_of_link_roofline" in ours else None),
    }
    if args.quant.startswith("bnb-"):
        offloaded = num_layers - gpu_layers
        out["notes"] = [f"accelerate's baseline needs llm_int8_enable_fp32_cpu_offload=True: its {offloaded} "
                        f"offloaded layers stay unquantized ({ours['engine_summary']['host_bytes']} bytes packed "
                        f"for us vs {baseline.get('link_bytes_per_token')} bytes in the compute dtype for it)"]
    return out


def cpu_sanity_run(args, config, gpu_layers, num_layers) -> dict:
    """Our engine with device="cpu" against the same model without offload, tokens compared."""
    prompt = synthetic_prompt(args.context - args.max_new_tokens, int(config.get("vocab_size", 32000)))
    loaded = load_model(config, scheme=SCHEMES[args.quant], dummy_weights=True, device="cpu")
    plain = {"engine": "no offload (same model, CPU)", **timed_generation(loaded.model, prompt, args)}
    rows = [plain]
    for mode in ("stream", "cpu"):
        with apply_offload(loaded.model, gpu_layers=gpu_layers, mode=mode, device="cpu") as engine:
            row = {"engine": f"vramplan {mode} (device=cpu)", **timed_generation(loaded.model, prompt, args)}
            row["link_bytes_per_token"] = engine.h2d_bytes_last_forward if mode == "stream" else None
            row["engine_summary"] = engine.summary()
            row["tokens_identical_to_no_offload"] = row["tokens"] == plain["tokens"]
        rows.append(row)
    notes = ["no GPU: the 'link' is a memcpy between host buffers and the rates are CPU compute, not a "
             "prediction of GPU performance; accelerate has no CPU-to-CPU offload to compare with",
             "the check that matters: tokens identical with and without offload, in both modes"]
    profile_h2d = profile_h2d_bytes_per_s(args.hardware)
    streamed = rows[1]["link_bytes_per_token"]
    if profile_h2d and streamed:
        notes.append(f"on {args.hardware} ({profile_h2d / 1e9:.0f} GB/s pinned h2d) streaming "
                     f"{streamed / 1e6:.1f} MB/token caps decode at {profile_h2d / streamed:.1f} tokens/s "
                     "(link roofline of this split)")
    return {"label": CPU_SANITY_LABEL, "device": platform.processor() or platform.machine(),
            "profile_pinned_h2d_bytes_per_s": profile_h2d, "rows": rows,
            "notes": notes}


# --- output -----------------------------------------------------------------------------


def machine_name(args, cuda: bool) -> str:
    if args.machine:
        name = args.machine
    elif not cuda:
        name = "cpu-sanity"
    elif args.hardware:
        name = Path(args.hardware).stem
    else:
        name = torch.cuda.get_device_name(0)
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def write_results(result: dict, machine: str, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"offload-{machine}.json", out / f"offload-{machine}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(render_markdown(result))
    return json_path, md_path


def _fmt(value, scale=1.0, digits=2, unit="") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


def render_markdown(result: dict) -> str:
    run = result["run"]
    lines = [f"# Offload engine vs accelerate: {result['label']}", "",
             f"{run['date']}; {result['device']}; model {run['model']} ({run['quant']}, dummy weights), "
             f"{run['gpu_layers']}/{run['num_layers']} decoder layers on the device; prompt {run['prompt_tokens']} "
             f"tokens (prefill chunk {run['prefill_chunk']}), {run['max_new_tokens']} new tokens; "
             f"torch {run['torch']}, {run['torch_threads']} CPU threads.", ""]
    measured, profiled = result.get("measured_pinned_h2d_bytes_per_s"), result.get("profile_pinned_h2d_bytes_per_s")
    if measured:
        lines.append(f"Pinned host-to-device bandwidth, measured: {measured / 1e9:.1f} GB/s.")
    if profiled:
        lines.append(f"Profile {run['hardware']}: {profiled / 1e9:.1f} GB/s pinned h2d.")
    lines += ["", "| engine | decode tok/s | TTFT s | link MB/token | achieved link GB/s | % of link roofline | "
                  "peak VRAM GiB | tokens as without offload |",
              "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        if row.get("skipped"):
            lines.append(f"| {row['engine']} | skipped: {row['skipped']} | | | | | | |")
            continue
        same = row.get("tokens_identical_to_no_offload")
        lines.append(
            f"| {row['engine']} | {_fmt(row.get('decode_tokens_per_s'))} | {_fmt(row.get('ttft_s'), digits=3)} | "
            f"{_fmt(row.get('link_bytes_per_token'), 1e-6)} | {_fmt(row.get('achieved_link_bytes_per_s'), 1e-9)} | "
            f"{_fmt(row.get('fraction_of_link_roofline'), 100, 1)} | {_fmt(row.get('peak_vram_bytes'), 2**-30)} | "
            f"{'-' if same is None else same} |")
    if "decode_speedup_vs_accelerate" in result:
        targets = result["targets"]
        lines += ["", f"Decode speedup vs accelerate: {result['decode_speedup_vs_accelerate']:.2f}x "
                      f"(target {targets['speedup']}x: {targets['speedup_met']}); TTFT speedup "
                      f"{result['ttft_speedup_vs_accelerate']:.2f}x; fraction of the link roofline target "
                      f"{targets['fraction_of_link_roofline']:.0%}: {targets['roofline_met']}."]
    if result.get("notes"):
        lines += [""] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("This benchmark needs a CUDA GPU (it compares host-link streaming with accelerate's offload), "
              "and torch sees none here. Run it on a GPU machine, or pass --allow-cpu for a small "
              f"{CPU_SANITY_LABEL!r}.", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    config = model_config(args.model)
    gpu_layers, num_layers = split_layers(config, args.gpu_layers, args.offload_fraction)
    start = time.perf_counter()
    result = (gpu_benchmark if cuda else cpu_sanity_run)(args, config, gpu_layers, num_layers)
    result["run"] = {"model": resolve_model(args.model).id, "quant": args.quant, "gpu_layers": gpu_layers,
                     "num_layers": num_layers, "prompt_tokens": args.context - args.max_new_tokens,
                     "max_new_tokens": args.max_new_tokens, "prefill_chunk": args.prefill_chunk,
                     "hardware": args.hardware, "torch_threads": torch.get_num_threads(),
                     "torch": torch.__version__, "python": platform.python_version(),
                     "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.perf_counter() - start, 1)}
    json_path, md_path = write_results(result, machine_name(args, cuda), Path(args.out))
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
