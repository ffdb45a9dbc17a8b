"""`vramplan calibrate`: a small matrix of real runs, fitted into the profile's calibration.

Each (model, scheme) is loaded once with dummy weights (speed and memory do not depend on
weight values) and run at a few prompt lengths; the first model also runs its two longest
prompts with each quantized KV cache this transformers offers. Each run is reduced to the speed model's
features (bytes read per decode step, layers, prefill FLOPs and chunks, KV update traffic) and
planner.calibration fits the efficiencies and fixed costs. The process RSS beyond what the plan
counts (weights, KV cache, workspace) is measured in fresh processes and stored as
`runtime_ram`. A run that fails is reported, never stored as a zero.
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from vramplan.planner.calibration import ExpertSample, Sample, fit, fit_experts
from vramplan.planner.errors import VramplanError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.memory import layer_costs, weight_costs
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.planner.request import Request
from vramplan.planner.sources import resolve_model
from vramplan.planner.speed import cpu_float_peak, cpu_matmul_peak
from vramplan.planner.work import decode_work, prefill_attention_flop, prefill_flop
from vramplan.runtime.inventory import load_spec  # counted as the installed transformers loads it

from .progress import Advance, Track, no_track

MIN_NEW_TOKENS = 2  # decode needs at least two tokens to time one step


@dataclass(frozen=True, kw_only=True)
class Matrix:
    models: tuple[str, ...]
    quants: tuple[str, ...]
    prompts: tuple[int, ...]
    new_tokens: int
    prefill_chunk: int = 2048
    repeats: int = 2
    kv_dtypes: tuple[str, ...] = ()  # quantized caches, run on the first model at the two longest prompts
    experts: bool = True  # time routed MoE experts per scheme (measure_experts)
    eager: bool = True  # also run the first model's first scheme with eager attention (its own kernel efficiencies)
    skip: tuple[tuple[str, str], ...] = ()  # (model, scheme) pairs left out: they do not fit this machine


# Sizes that finish in a few minutes on a 2-core CPU machine, larger on a GPU.
# The accuracy benchmark validates on other models (qwen3-0.6b, gemma-2-2b). Prompts reach 4096
# tokens so that the KV term and prefill attention (half of a 4096-token prefill's time) are measured, not just the
# weights: fitted on prompts of at most 2048, a 4000-token prompt's TTFT came out 29 % short (attention's
# efficiency falls as the cache outgrows the CPU's caches).
CPU_MATRIX = Matrix(models=("qwen2.5-0.5b", "llama-3.2-1b"),
                    quants=("bf16", "quanto-int8", "quanto-int4", "quanto-w8a8"), prompts=(64, 1024, 4096),
                    new_tokens=8, kv_dtypes=("fp8", "quanto-int4", "quanto-int2"))
GPU_MATRIX = Matrix(models=("qwen2.5-0.5b", "llama-3.2-3b", "llama-3.1-8b"),
                    quants=("bf16", "bnb-int8", "bnb-nf4", "quanto-int8", "quanto-int4"),
                    prompts=(512, 4096), new_tokens=32, kv_dtypes=("fp8", "quanto-int4"))


def matrix_for(hw: HardwareProfile, *, models: tuple[str, ...] = (), quants: tuple[str, ...] = (),
               prompts: tuple[int, ...] = (), new_tokens: int | None = None, repeats: int | None = None,
               kv_dtypes: tuple[str, ...] | None = None, on_gpu: bool | None = None) -> Matrix:
    """The default matrix for this machine, with what the user chose instead; bad choices are refused."""
    from vramplan.planner.sources import find_in_catalog

    if on_gpu is None:
        on_gpu = _on_gpu(hw)
    m = GPU_MATRIX if on_gpu else CPU_MATRIX
    for q in quants:
        if q not in SCHEMES:
            raise VramplanError(f"unknown quantization {q!r}; choose from {', '.join(SCHEMES)}")
    for name in models:  # a directory with config.json (its dummy weights), else a catalog name
        resolve_model(name) if Path(name).expanduser().is_dir() else find_in_catalog(name)  # else: close matches
    if new_tokens is not None and new_tokens < MIN_NEW_TOKENS:
        raise VramplanError(f"calibration needs at least {MIN_NEW_TOKENS} new tokens per run, got {new_tokens}")
    if repeats is not None and repeats < 1:
        raise VramplanError(f"calibration needs at least one run per point, got {repeats}")
    for k in kv_dtypes or ():
        if k not in KV_SCHEMES or not KV_SCHEMES[k].quantized:
            raise VramplanError(f"{k!r} is not a quantized KV cache; choose from "
                                f"{', '.join(n for n, s in KV_SCHEMES.items() if s.quantized)}")
    return replace(m, models=models or m.models, quants=quants or m.quants, prompts=prompts or m.prompts,
                   new_tokens=new_tokens if new_tokens is not None else m.new_tokens,
                   repeats=repeats if repeats is not None else m.repeats,
                   kv_dtypes=kv_dtypes if kv_dtypes is not None else m.kv_dtypes)


def _on_gpu(hw: HardwareProfile) -> bool:
    """Whether calibration runs on the GPU: a profile with one, and a torch that reaches it (torch is imported only
    then, so that a refusal on a CPU machine costs no import)."""
    if not hw.has_gpu:
        return False
    import torch

    return torch.cuda.is_available()


class DoesNotFitError(VramplanError):
    """A calibration point that this machine cannot hold: refused before anything is loaded, like `run`'s "nothing
    fits" (exit 1)."""

    exit_code = 1


def point_request(spec, quant: str, prompt: int, matrix: Matrix, on_gpu: bool) -> Request:
    """What a calibration run of `spec` in `quant` at `prompt` holds: the whole model on the one device it is loaded on
    (run_matrix loads every layer there), a bf16 cache of prompt + new tokens. Only memory is asked, so a prompt
    beyond the model's context is planned as it runs (with dummy weights)."""
    return Request(context=prompt + matrix.new_tokens, prompt_tokens=prompt, quant=(quant,), kv_dtype=("bf16",),
                   prefill_chunk=matrix.prefill_chunk, gpu_layers=spec.num_layers if on_gpu else None,
                   allow_context_overflow=True, eager=True)  # calibration measures the eager decode's constants


def check_fits(hw: HardwareProfile, matrix: Matrix, *, named: tuple[str, ...] = (),
               on_gpu: bool | None = None) -> tuple[Matrix, list[str]]:
    """Plan every point (model x scheme x prompt) against `hw` before anything is loaded. A point of a model the user
    named (`named`) that does not fit is refused (DoesNotFitError, what it needs vs has); a point of the default
    matrix drops its (model, scheme) pair with a warning. Returns the matrix to run and the warnings."""
    from vramplan.planner.search import plan

    if on_gpu is None:
        on_gpu = _on_gpu(hw)
    device = "cuda" if on_gpu else "cpu"
    skip, warnings, refused = list(matrix.skip), [], []
    # a scheme the planner never offers on this profile (a CPU scheme on a GPU profile calibrated on its CPU) is not
    # calibrated for it either
    skip += [(name, q) for name in matrix.models for q in matrix.quants
             if (hw.accelerator or "cpu") not in SCHEMES[q].devices and (name, q) not in skip]
    for name in matrix.models:
        spec = load_spec(resolve_model(name))
        for quant in matrix.quants:
            if device not in SCHEMES[quant].devices or (name, quant) in skip:
                continue  # run_matrix skips these too
            for prompt in sorted(matrix.prompts):
                p = plan(spec, hw, point_request(spec, quant, prompt, matrix, on_gpu))
                if p.fits:
                    continue
                why = next((c.reason for c in p.candidates if c.reason), None) or "; ".join(p.reasons)
                what = f"{spec.name} {quant} at a {prompt}-token prompt does not fit {hw.name}: {why}"
                if name in named:
                    refused.append(what)
                else:
                    warnings.append(f"left out of the calibration: {what}")
                    skip.append((name, quant))
                break  # longer prompts need more
    if refused:
        more = f" (and {len(refused) - 1} more point(s) of the models named)" if len(refused) > 1 else ""
        raise DoesNotFitError(f"calibrate: {refused[0]}{more}; nothing was loaded")
    runnable = [(m, q) for m in matrix.models for q in matrix.quants
                if device in SCHEMES[q].devices and (m, q) not in skip]
    if not runnable:
        raise DoesNotFitError("calibrate: no point of the matrix fits this machine: " + "; ".join(warnings))
    return replace(matrix, skip=tuple(skip)), warnings


@dataclass(kw_only=True)
class RunRecord:
    model: str
    quant: str
    kv_dtype: str
    prompt: int
    new_tokens: int
    # the median decode step's rate (GenerationResult.decode_tokens_per_s_median), not `run`'s headline (tokens over
    # wall time, first token to last): the fit models one step, and a median ignores the steps another process slowed
    # on a shared machine; calibration runs stream no text, so the two differ only by such steps
    decode_tokens_per_s: float
    ttft_s: float
    peak_rss_bytes: int
    sample: Sample

    def to_dict(self) -> dict:
        return {"model": self.model, "quant": self.quant, "kv_dtype": self.kv_dtype, "prompt": self.prompt,
                "new_tokens": self.new_tokens, "ttft_s": self.ttft_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "peak_rss_bytes": self.peak_rss_bytes, "sample": asdict(self.sample)}

    @classmethod
    def from_dict(cls, d: dict) -> "RunRecord":
        sample = d["sample"]
        if "prefill_attention_flops" not in sample:  # saved before prefill attention was its own term: count it now
            sample = {**sample, "prefill_attention_flops": prefill_attention_flop(load_spec(resolve_model(d["model"])),
                                                                                  d["prompt"])}
        return cls(**{**d, "sample": Sample(**sample)})


def load_runs(paths: tuple[str, ...]) -> list[RunRecord]:
    """Runs saved by an earlier `calibrate --save-runs` (on the same machine), to fit together with new ones."""
    import json

    import yaml

    from vramplan.planner.textfiles import read_text
    from vramplan.planner.yaml_strict import safe_load_strict

    from .files import suffix_format

    records = []
    for path in paths:
        try:
            text = read_text(path)
        except (OSError, UnicodeDecodeError) as e:
            raise VramplanError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        try:  # saved as YAML for a .yaml / .yml path, else as JSON (runtime.files)
            doc = safe_load_strict(text) if suffix_format(path, "json") == "yaml" else json.loads(text)
            records += [RunRecord.from_dict(r) for r in doc["runs"]]
        except (yaml.YAMLError, ValueError, KeyError, TypeError) as e:
            raise VramplanError(f"{path}: not a file of calibration runs ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:200]})") from None
        except RecursionError:
            raise VramplanError(f"{path}: not a file of calibration runs (nested too deeply)") from None
        except MemoryError:
            raise VramplanError(f"{path}: not a file of calibration runs (too large to parse: {len(text)} "
                                "characters)") from None
    return records


@dataclass(kw_only=True)
class CalibrationResult:
    profile: HardwareProfile  # the input profile with its calibration section filled
    records: list[RunRecord]
    warnings: list[str] = field(default_factory=list)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "bitsandbytes", "optimum-quanto"):
        try:
            out[dist] = str(version(dist))  # metadata only: importing bitsandbytes prints kernel warnings
        except PackageNotFoundError:
            pass
    return out


def fastest_per_point(records: list[RunRecord]) -> list[RunRecord]:
    """One run per point (model, scheme, KV cache, prompt, new tokens, device, attention): where earlier runs
    (--add-runs) and new ones repeat a point, the fastest decode is kept, with the fastest TTFT beside it, as
    `best_of` keeps among a call's repeats. On the H200 the same code's Llama-3.2-1B bf16 decode measured 18-22 tok/s
    in one session and 103-107 in the next (eager GPU decode is bound by a host that others share); fitting both
    would average the interference in."""
    best: dict[tuple, RunRecord] = {}
    for r in records:
        key = (r.model, r.quant, r.kv_dtype, r.prompt, r.new_tokens, r.sample.device, r.sample.attention_impl)
        kept = best.get(key)
        if kept is None:
            best[key] = r
            continue
        fast, slow = (r, kept) if r.decode_tokens_per_s > kept.decode_tokens_per_s else (kept, r)
        if slow.ttft_s < fast.ttft_s:
            fast = replace(fast, ttft_s=slow.ttft_s, sample=replace(fast.sample, prefill_s=slow.sample.prefill_s))
        best[key] = fast
    return list(best.values())


def best_of(n: int, run):
    """The fastest of n runs: on a shared machine interference only ever slows a run down."""
    results = [run() for _ in range(n)]
    best = min(results, key=lambda r: 1.0 / r.decode_tokens_per_s_median)
    best.ttft_s = min(r.ttft_s for r in results)
    return best


def _sample(hw: HardwareProfile, spec, quant: str, kv_dtype: str, prompt: int, matrix: Matrix, on_gpu: bool,
            result, attention_impl: str) -> Sample:
    scheme, kv = SCHEMES[quant], KV_SCHEMES[kv_dtype]
    req = Request(context=prompt + matrix.new_tokens, prompt_tokens=prompt, prefill_chunk=matrix.prefill_chunk,
                  eager=True)
    # a run on the CPU stores lm_head as the scheme does there (quant.cpu_head_scheme), as the loader does
    costs = layer_costs(spec, scheme, kv, req, weight_costs(spec, scheme, cpu_only=not on_gpu))
    work = decode_work(spec, scheme, kv, 1, prompt + matrix.new_tokens // 2, costs)
    return Sample(
        device="gpu" if on_gpu else "cpu", backend=scheme.backend, quant=quant,
        bandwidth_bytes_per_s=hw.gpu.memory_bandwidth_bytes_per_s if on_gpu else hw.host.ram_bandwidth_bytes_per_s,
        peak_flops=hw.gpu.bf16_flops if on_gpu else cpu_float_peak(hw.host)[0],
        matmul_peak_flops=None if on_gpu else cpu_matmul_peak(hw.host, scheme)[0],
        bytes_read_per_token=sum(work.weights_bytes) + work.head_bytes,
        kv_bytes_per_token=sum(work.per_layer("kv_read")),
        attention_flops_per_token=sum(work.per_layer("attention_flop")), attention_impl=attention_impl,
        num_layers=spec.num_layers, decode_s_per_token=1.0 / result.decode_tokens_per_s_median,
        prefill_flops=prefill_flop(spec, prompt), prefill_attention_flops=prefill_attention_flop(spec, prompt),
        prefill_chunks=-(-prompt // matrix.prefill_chunk),
        prefill_s=result.ttft_s, kv_dtype=kv_dtype, kv_update_bytes_per_token=sum(work.per_layer("kv_update")),
        label=f"{spec.name} {quant} {kv_dtype} KV prompt {prompt}")


def _matrix_runs(matrix: Matrix, device: str) -> list[tuple]:
    """(source, spec, scheme, [(prompt, KV dtype, attention implementation)]) for each model and scheme that runs on
    `device`, in the order they run."""
    from .kvcache import available_kv_dtypes

    kv_runs = [k for k in matrix.kv_dtypes if k in available_kv_dtypes()]
    out = []
    first_pair = next(((m, q) for m in matrix.models for q in matrix.quants
                       if device in SCHEMES[q].devices and (m, q) not in matrix.skip), None)
    for name in matrix.models:
        source = resolve_model(name)
        spec = load_spec(source)
        for quant in matrix.quants:
            if device not in SCHEMES[quant].devices or (name, quant) in matrix.skip:
                continue
            native = spec.attention_impl
            first = (name, quant) == first_pair  # the extra runs (KV caches, eager) go to the first pair that runs
            runs = [(p, "bf16", native) for p in matrix.prompts]
            if first and not spec.sliding_window_layers:
                # two cache sizes: the update's traffic grows with the cache, its fixed cost per layer does not
                runs += [(p, k, native) for p in sorted(set(matrix.prompts))[-2:] for k in kv_runs]
            if first and matrix.eager and native != "eager":
                # the eager kernel too (what gemma2's softcapping forces), on the same weights and prompts
                runs += [(p, "bf16", "eager") for p in matrix.prompts]
            out.append((source, spec, quant, runs))
    return out


def run_matrix(hw: HardwareProfile, matrix: Matrix, *, progress: Callable[[str], None] | None = None,
               seed: int = 0, track: Track | None = None) -> tuple[list[RunRecord], list[str]]:
    """Every run of the matrix that works, and one warning per (model, scheme) that did not. ``track`` follows the
    timed runs (a (model, scheme) that fails counts all of its runs as done)."""
    from .measure import free_memory

    say = progress or (lambda s: None)
    on_gpu = _on_gpu(hw)
    device = "cuda" if on_gpu else "cpu"
    records, warnings = [], []
    planned = _matrix_runs(matrix, device)
    with (track or no_track)("calibration runs", sum(len(runs) for *_, runs in planned), None) as advance:
        for source, spec, quant, runs in planned:
            say(f"{spec.name} {quant}: loading (dummy weights) on {device}")
            done = [0]

            def advance_one(n: int) -> None:
                done[0] += n
                advance(n)

            try:
                results, peak_rss = _run_model(source.config, spec, quant, runs, matrix, device, seed, say, advance_one)
            except (VramplanError, RuntimeError, ValueError) as e:
                warnings.append(f"{spec.name} {quant}: not calibrated ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:200]})")
                advance(len(runs) - done[0])  # its runs will not happen: the bar counts them done
                continue
            finally:
                free_memory()  # the model is gone with _run_model's frame; collect its cycles
            for prompt, kv_dtype, impl, r in results:
                # a directory's runs name its path, so that --add-runs finds the model again
                records.append(RunRecord(model=str(source.path.resolve()) if source.kind == "directory" else spec.name,
                                         quant=quant, kv_dtype=kv_dtype, prompt=prompt,
                                         new_tokens=len(r.tokens), decode_tokens_per_s=r.decode_tokens_per_s_median,
                                         ttft_s=r.ttft_s, peak_rss_bytes=peak_rss,
                                         sample=_sample(hw, spec, quant, kv_dtype, prompt, matrix, on_gpu, r, impl)))
    return records, warnings


def _run_model(config: dict, spec, quant: str, runs: list[tuple[int, str, str]], matrix: Matrix, device: str,
               seed: int, say: Callable[[str], None], advance: Advance | None = None) -> tuple[list, int]:
    """Load one model in one scheme and time its runs (prompt, KV dtype, attention implementation);
    ([(prompt, kv dtype, implementation, result)], peak RSS)."""
    from .attention import use_attention
    from .generate import generate, synthetic_prompt
    from .load import load_model
    from .measure import PeakMemorySampler

    results = []
    with PeakMemorySampler(device=device) as sampler:
        model = load_model(config, scheme=SCHEMES[quant], dummy_weights=True, device=device, seed=seed,
                           random_device=device if device != "cpu" else None).model
        # warm-up: first-call allocations, dispatch and kernel loading, at the shortest timed prompt's shapes (an
        # 8-token warm-up left the first timed prefill cold on an H200: Llama-3.2-1B bf16 at 512 tokens took 0.46 s
        # once, then 0.05 s at 2048)
        generate(model, synthetic_prompt(min((p for p, _, _ in runs), default=8), spec.vocab_size, seed + 1),
                 max_new_tokens=2, prefill_chunk=matrix.prefill_chunk)
        for prompt, kv_dtype, impl in runs:
            use_attention(model, impl, device)
            ids = synthetic_prompt(prompt, spec.vocab_size, seed)
            r = best_of(matrix.repeats, lambda: generate(model, ids, max_new_tokens=matrix.new_tokens,
                                                         prefill_chunk=matrix.prefill_chunk,
                                                         kv=KV_SCHEMES[kv_dtype]))
            if r.decode_tokens_per_s_median is None or r.ttft_s is None:
                raise VramplanError(f"the run stopped early ({r.stopped_reason}: {r.error or '-'})")
            results.append((prompt, kv_dtype, impl, r))
            say(f"  prompt {prompt}, {kv_dtype} KV, {impl} attention: TTFT {r.ttft_s:.3f} s, "
                f"decode {r.decode_tokens_per_s_median:.2f} tok/s (median step)")
            if advance is not None:
                advance(1)
    return results, sampler.result.peak_rss_bytes


def measure_runtime_ram(hw: HardwareProfile, matrix: Matrix, *,
                        progress: Callable[[str], None] | None = None) -> tuple[int | None, int | None, list[str]]:
    """What a fresh run process holds beyond what its plan counts, from one such run per model of the matrix (bf16,
    longest prompt): host RSS beyond weights, KV and workspace (the runtime's base RAM), and on a GPU the peak VRAM
    beyond weights, KV, workspace and the CUDA context (the caching allocator's reserve); each the median over the
    models, or None (with the reasons) when no such run worked or, for VRAM, ran on a GPU."""
    from .worker import RunFailed, RunJob, run_fresh

    bare = replace(hw, calibration=None)  # plan with the default base RAM, which the difference then replaces
    extras, vram_extras, warnings = [], [], []
    for name in matrix.models:
        if (name, "bf16") in matrix.skip:
            continue  # bf16 does not fit here (check_fits said so)
        prompt = max(matrix.prompts)
        req = Request(context=prompt + matrix.new_tokens, prompt_tokens=prompt, quant=("bf16",), kv_dtype=("bf16",),
                      prefill_chunk=matrix.prefill_chunk, eager=True)
        try:
            report = run_fresh(RunJob.of(name, bare, req, prompt_tokens=prompt, max_new_tokens=matrix.new_tokens))
        except RunFailed as e:
            warnings.append(f"runtime RAM not measured with {name}: {e}")
            continue
        base = report.plan.constants["runtime_base_ram_bytes"].value
        extra = report.measured.peak_ram_bytes - (report.predicted.peak_ram_bytes - base)
        extras.append(extra)
        vram = allocator_excess(report.measured.peak_vram_bytes, report.predicted.peak_vram_bytes,
                                bare.overheads.allocator_reserve_bytes)
        if vram is not None:
            vram_extras.append(vram)
        if progress:
            progress(f"  fresh run of {name}: {extra / 2**20:.0f} MiB of RAM beyond the plan's bytes"
                     + (f", {vram / 2**20:.0f} MiB of VRAM beyond them and the CUDA context" if vram is not None
                        else ""))
    ram = max(0, int(statistics.median(extras))) if extras else None
    return ram, (max(0, int(statistics.median(vram_extras))) if vram_extras else None), warnings


def allocator_excess(measured_vram: int | None, predicted_vram: int | None, reserve_planned: int) -> int | None:
    """A run's peak VRAM beyond its plan's counted bytes (weights, KV, workspace, CUDA context): the prediction less
    the allocator reserve it was planned with. On an H200, Llama-3.1-8B bnb-nf4 peaked at 7,298,088,960 B against
    7,672,829,440 predicted with the default 512 MiB reserve: 162,130,432 B (155 MiB) of the reserve was used."""
    if measured_vram is None or predicted_vram is None:
        return None
    return measured_vram - (predicted_vram - reserve_planned)


# The experts micro-benchmark: one MoE layer's routed experts (transformers' fused Qwen3-MoE experts, quantized per
# expert as runs do), one token routed to k of them, at two expert sizes: a small one and Qwen3-30B-A3B's
# (hidden 2048, expert intermediate 768). Varying the size and k separates bytes from the per-expert cost.
EXPERT_SHAPES = ((512, 256), (2048, 768))
EXPERT_COUNT = 32
EXPERT_TOP_K = (2, 8)
EXPERT_REPEATS = 21


def measure_experts(hw: HardwareProfile, quants: tuple[str, ...], device: str, *,
                    progress: Callable[[str], None] | None = None) -> tuple[list[ExpertSample], list[str]]:
    """Time routed experts for each scheme on `device` ("cpu" or "cuda"): vramplan's quantized experts (a call per
    expert), bf16 / fp16 by transformers' grouped call (one a layer); the samples and a warning per scheme that could
    not be measured."""
    import time

    import torch

    from .experts import QuantizedExperts, random_experts

    say = progress or (lambda _: None)
    samples, warnings = [], []
    on_gpu = device != "cpu"
    bandwidth = hw.gpu.memory_bandwidth_bytes_per_s if on_gpu else hw.host.ram_bandwidth_bytes_per_s
    generator = torch.Generator().manual_seed(0)

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    for quant in quants:
        scheme = SCHEMES[quant]
        say(f"experts: {quant} on {device}")
        try:
            for hidden, inter in EXPERT_SHAPES:
                # unquantized experts run transformers' grouped call in a model (planner.speed: one call a layer)
                experts = random_experts(hidden, inter, EXPERT_COUNT, max(EXPERT_TOP_K), generator,
                                         "eager" if scheme.quantized else "grouped_mm")
                if scheme.quantized:
                    module = QuantizedExperts(experts, scheme, device)
                    per_expert = module.expert_nbytes
                else:
                    module = experts.to(device=device, dtype=getattr(torch, scheme.compute_dtype))
                    per_expert = (3 * hidden * inter) * scheme.bits // 8
                x = torch.randn(1, hidden, generator=generator).to(device=device, dtype=torch.bfloat16)
                for k in EXPERT_TOP_K:
                    times = []
                    for _ in range(EXPERT_REPEATS):
                        index = torch.randperm(EXPERT_COUNT, generator=generator)[:k][None].to(device)
                        weights = torch.full((1, k), 1.0 / k, dtype=torch.bfloat16, device=device)
                        sync()
                        t0 = time.perf_counter()
                        with torch.inference_mode():
                            module(x, index, weights)
                        sync()
                        times.append(time.perf_counter() - t0)
                    samples.append(ExpertSample(device="gpu" if on_gpu else "cpu", quant=quant,
                                                bandwidth_bytes_per_s=bandwidth, bytes_read=float(per_expert * k),
                                                calls=k if scheme.quantized else 1,
                                                seconds=statistics.median(times[1:]),
                                                label=f"{quant} experts {hidden}x{inter} top-{k}"))
                del module, experts
        except Exception as e:  # a scheme this machine cannot run is reported, the others go on
            warnings.append(f"experts {quant} on {device}: not measured ({type(e).__name__}: {e})")
            samples = [x for x in samples if x.quant != quant]
    return samples, warnings


def calibrate(hw: HardwareProfile, matrix: Matrix, *, progress: Callable[[str], None] | None = None,
              earlier: list[RunRecord] = (), track: Track | None = None) -> CalibrationResult:
    """Measure, fit (with `earlier` runs of this machine, from a previous call), and return the profile with its
    calibration section filled, with every warning."""
    records, warnings = run_matrix(hw, matrix, progress=progress, track=track)
    if not records:
        raise VramplanError("every calibration run failed, nothing to fit: " + "; ".join(warnings))
    records = fastest_per_point(list(earlier) + records)
    fitted = fit([r.sample for r in records], measured_at=dt.date.today().isoformat(), versions=versions())
    warnings.extend(fitted.warnings)
    runtime_ram, reserve, ram_warnings = measure_runtime_ram(hw, matrix, progress=progress)
    warnings.extend(ram_warnings)
    cal = replace(fitted.calibration, runtime_ram_bytes=runtime_ram)
    notes = tuple(n for n in hw.notes if not n.startswith("calibrated by"))
    if reserve is not None:  # measured: it replaces the default (and the probe's note that it is one)
        hw = replace(hw, overheads=replace(hw.overheads, allocator_reserve_bytes=reserve))
        notes = tuple(n for n in notes if not n.startswith("allocator reserve")) + (
            f"allocator reserve {reserve / 2**20:.2f} MiB measured by vramplan calibrate: the median over fresh runs "
            "of the peak VRAM beyond the plan's weights, KV cache, workspace and CUDA context",)
    if matrix.experts:
        cal = _with_experts(cal, hw, matrix, progress, warnings)
    note = (f"calibrated by vramplan calibrate on {cal.measured_at}: {len(records)} runs of "
            f"{', '.join(matrix.models)} x {', '.join(matrix.quants)} x prompts {', '.join(map(str, matrix.prompts))}"
            + (f"; KV caches {', '.join(sorted({r.kv_dtype for r in records} - {'bf16'}))}"
               if any(r.kv_dtype != "bf16" for r in records) else ""))
    notes = notes + (note,)
    return CalibrationResult(profile=replace(hw, calibration=cal, notes=notes), records=records, warnings=warnings)


def _with_experts(cal, hw: HardwareProfile, matrix: Matrix, progress, warnings: list[str]):
    """The calibration with an "experts" entry per scheme of the matrix, measured here."""
    device = "cuda" if _on_gpu(hw) else "cpu"
    try:
        samples, w = measure_experts(hw, matrix.quants, device, progress=progress)
    except ImportError as e:  # a transformers without fused Qwen3-MoE experts: the rest of the calibration stands
        samples, w = [], [f"routed experts not measured: {e}"]
    warnings.extend(w)
    entries, residuals = list(cal.entries), dict(cal.residuals)
    for quant in dict.fromkeys(x.quant for x in samples):
        entry, res, w = fit_experts([x for x in samples if x.quant == quant])
        entries = [e for e in entries if e.key != entry.key] + [entry]
        residuals.update(res)
        warnings.extend(w)
    return replace(cal, entries=tuple(entries), residuals=residuals)
