"""`vramplan calibrate`: a small matrix of real runs, fitted into the profile's calibration.

Each (model, scheme) is loaded once with dummy weights (speed and memory do not depend on
weight values) and run at a few prompt lengths; each run is reduced to the speed model's
features (bytes read per decode step, layers, prefill FLOPs and chunks) and planner.
calibration fits the efficiencies and fixed costs. The process RSS beyond what the plan
counts (weights, KV cache, workspace) is measured too and stored as `runtime_ram`.
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
from dataclasses import dataclass, replace
from typing import Callable

from planner.calibration import Sample, fit
from planner.hardware import HardwareProfile
from planner.memory import layer_costs
from planner.quant import KV_SCHEMES, SCHEMES
from planner.request import Request
from planner.sources import model_spec, resolve_model
from planner.speed import decode_work, prefill_flop


@dataclass(frozen=True, kw_only=True)
class Matrix:
    models: tuple[str, ...]
    quants: tuple[str, ...]
    prompts: tuple[int, ...]
    new_tokens: int
    prefill_chunk: int = 2048
    repeats: int = 2


# Sizes that finish in a few minutes on a 2-core CPU machine, larger on a GPU.
# The accuracy benchmark validates on other models (qwen3-0.6b, gemma-2-2b). Prompts reach 1536
# tokens so that the KV term is measured, not just the weights.
CPU_MATRIX = Matrix(models=("qwen2.5-0.5b", "llama-3.2-1b"), quants=("bf16", "quanto-int8", "quanto-int4"),
                    prompts=(64, 640, 1536), new_tokens=8)
GPU_MATRIX = Matrix(models=("qwen2.5-0.5b", "llama-3.2-3b", "llama-3.1-8b"),
                    quants=("bf16", "bnb-int8", "bnb-nf4", "quanto-int8", "quanto-int4"),
                    prompts=(512, 4096), new_tokens=32)


@dataclass(kw_only=True)
class RunRecord:
    model: str
    quant: str
    prompt: int
    new_tokens: int
    decode_tokens_per_s: float
    ttft_s: float
    peak_rss_bytes: int
    sample: Sample


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "bitsandbytes", "optimum-quanto"):
        try:
            out[dist] = str(version(dist))  # metadata only: importing bitsandbytes prints kernel warnings
        except PackageNotFoundError:
            pass
    return out


def best_of(n: int, run):
    """The fastest of n runs: on a shared machine interference only ever slows a run down."""
    results = [run() for _ in range(n)]
    best = min(results, key=lambda r: 1.0 / r.decode_tokens_per_s_median)
    best.ttft_s = min(r.ttft_s for r in results)
    return best


def run_matrix(hw: HardwareProfile, matrix: Matrix, *, progress: Callable[[str], None] | None = None,
               seed: int = 0) -> list[RunRecord]:
    import torch

    from .generate import generate, synthetic_prompt
    from .load import load_model
    from .measure import PeakMemorySampler

    say = progress or (lambda s: None)
    on_gpu = hw.has_gpu and torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    records = []
    for name in matrix.models:
        spec = model_spec(name)
        source = resolve_model(name)
        for quant in matrix.quants:
            scheme = SCHEMES[quant]
            if ("cuda" if on_gpu else "cpu") not in scheme.devices:
                continue
            say(f"{spec.name} {quant}: loading (dummy weights) on {device}")
            with PeakMemorySampler(device=device) as sampler:
                loaded = load_model(source.config, weight_quant=quant, dummy_weights=True, device=device, seed=seed,
                                    compute_dtype="fp16" if quant == "fp16" else "bf16")
                results = []
                generate(loaded.model, synthetic_prompt(8, spec.vocab_size, seed), max_new_tokens=2,
                         prefill_chunk=matrix.prefill_chunk)  # warm-up: first-call allocations and dispatch
                for prompt in matrix.prompts:
                    ids = synthetic_prompt(prompt, spec.vocab_size, seed)
                    r = best_of(matrix.repeats, lambda: generate(loaded.model, ids, max_new_tokens=matrix.new_tokens,
                                                                 prefill_chunk=matrix.prefill_chunk))
                    results.append((prompt, r))
                    say(f"  prompt {prompt}: TTFT {r.ttft_s:.3f} s, decode {r.decode_tokens_per_s_median:.2f} tok/s")
            peak = sampler.result.peak_rss_bytes
            del loaded
            kv = KV_SCHEMES["bf16"]
            for prompt, r in results:
                ctx = prompt + matrix.new_tokens
                req = Request(context=ctx, prompt_tokens=prompt, prefill_chunk=matrix.prefill_chunk)
                costs = layer_costs(spec, scheme, kv, req)
                mid_ctx = prompt + matrix.new_tokens // 2
                work = decode_work(spec, scheme, kv, 1, mid_ctx, costs)
                weights_read = sum(work.weights_bytes) + work.head_bytes
                kv_read, attn_flops = sum(work.kv_read_bytes), sum(work.attention_flop)
                sample = Sample(
                    device="gpu" if on_gpu else "cpu", backend=scheme.backend, quant=quant,
                    bandwidth_bytes_per_s=hw.gpu.memory_bandwidth_bytes_per_s if on_gpu else hw.host.ram_bandwidth_bytes_per_s,
                    peak_flops=hw.gpu.bf16_flops if on_gpu else hw.host.cpu_bf16_flops,
                    bytes_read_per_token=weights_read, kv_bytes_per_token=kv_read,
                    attention_flops_per_token=attn_flops, attention_impl=spec.attention_impl,
                    num_layers=spec.num_layers, decode_s_per_token=1.0 / r.decode_tokens_per_s_median,
                    prefill_flops=prefill_flop(spec, prompt), prefill_chunks=-(-prompt // matrix.prefill_chunk),
                    prefill_s=r.ttft_s, label=f"{spec.name} {quant} prompt {prompt}")
                records.append(RunRecord(model=spec.name, quant=quant, prompt=prompt, new_tokens=len(r.tokens),
                                         decode_tokens_per_s=r.decode_tokens_per_s_median, ttft_s=r.ttft_s,
                                         peak_rss_bytes=peak, sample=sample))
    return records


def measure_runtime_ram(hw: HardwareProfile, matrix: Matrix, *, progress=None) -> int:
    """Host RSS of a fresh `vramplan run` process beyond what its plan counts (weights, KV, workspace).

    Measured the way users run: one process per model (its largest prompt, bf16), since inside one
    long process the allocator's reuse of earlier runs' memory hides part of each footprint.
    """
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from planner.hardware import save_profile

    extras = []
    with tempfile.TemporaryDirectory() as tmp:
        prof = Path(tmp) / "profile.yaml"
        save_profile(replace(hw, calibration=None), prof)
        for name in matrix.models:
            prompt = max(matrix.prompts)
            cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "cli.py"), "run", "--model", name,
                   "--dummy-weights", "--context", str(prompt + matrix.new_tokens), "--prompt-tokens", str(prompt),
                   "--max-new-tokens", str(matrix.new_tokens), "--quant", "bf16", "--kv-dtype", "bf16",
                   "--prefill-chunk", str(matrix.prefill_chunk), "--hardware", str(prof), "--json"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                continue
            d = json.loads(r.stdout)
            base = d["plan"]["constants"]["runtime_base_ram_bytes"]["value"]
            extra = d["measured"]["peak_ram_bytes"] - (d["predicted"]["peak_ram_bytes"] - base)
            extras.append(extra)
            if progress:
                progress(f"  fresh `vramplan run` of {name}: {extra / 2**20:.0f} MiB beyond the plan's bytes")
    return max(0, int(statistics.median(extras))) if extras else 0


def calibrate(hw: HardwareProfile, matrix: Matrix | None = None, *,
              progress: Callable[[str], None] | None = None) -> tuple[HardwareProfile, list[RunRecord]]:
    """Measure, fit, and return the profile with its calibration section filled."""
    import torch

    m = matrix or (GPU_MATRIX if hw.has_gpu and torch.cuda.is_available() else CPU_MATRIX)
    records = run_matrix(hw, m, progress=progress)
    cal = fit([r.sample for r in records], measured_at=dt.date.today().isoformat(), versions=versions())
    cal = replace(cal, runtime_ram_bytes=measure_runtime_ram(hw, m, progress=progress))
    note = (f"calibrated by vramplan calibrate on {cal.measured_at}: {len(records)} runs of "
            f"{', '.join(m.models)} x {', '.join(m.quants)} x prompts {', '.join(map(str, m.prompts))}")
    return replace(hw, calibration=cal, notes=tuple(n for n in hw.notes if not n.startswith("calibrated by")) + (note,)), records
