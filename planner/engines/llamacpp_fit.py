"""Fitting llama.cpp's speed entries to measured llama-server runs (`vramplan calibrate --engine llama.cpp`).

Runs are reduced to the speed model's features as llama.cpp's plans cost them (planner/engines/llamacpp.py: GGUF
bytes, f16 attention, prompts in n_ubatch steps), fitted by planner.calibration.fit as vramplan's own runtime is, and
the attention on each quantized cache found by bisection given those. Apart from llamacpp.py so that planning, which
every `vramplan plan` does, does not load the fitter. Pure.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from ..record import record
from ..calibration import MIN_EFFICIENCY, Sample, fit
from ..hardware import MAX_EFFICIENCY, Calibration, CalibrationEntry, HardwareProfile
from ..modelspec import ModelSpec
from ..request import Request
from ..speed import PREFILL_ATTENTION_BACKEND, cpu_float_peak, cpu_matmul_peak
from ..work import decode_work, prefill_attention_flop, prefill_flop
from . import llamacpp_rules as rules
from .llamacpp import (ATTENTION_IMPL, ENGINE, LLAMA_CPP_BACKENDS, MEASURED_AT_VERSION, SPEED_SCHEME, footprint,
                       gguf_layer_costs, gguf_read_bytes, kv_scheme, plan_llamacpp)


@record(kw_only=True)
class ServerRun:
    """One measured llama-server request: a prompt of one sequence, then `new_tokens` tokens, all layers on the CPU."""

    spec: ModelSpec
    file_type: str
    kv_type: str
    prompt: int
    new_tokens: int
    decode_s_per_token: float
    prefill_s: float


def _predicted(hw: HardwareProfile, run: ServerRun) -> tuple[float, float]:
    """(decode s per token, TTFT) llama.cpp's plan predicts for `run` on `hw`."""
    req = Request(context=run.prompt + run.new_tokens, prompt_tokens=run.prompt, engine=ENGINE,
                  quant=(run.file_type,), kv_dtype=(run.kv_type,))
    speed = plan_llamacpp(run.spec, hw, req).chosen.speed
    return 1.0 / speed.decode_tokens_per_s, speed.ttft_s


def fit_cache_attention(hw: HardwareProfile, runs: list[ServerRun], *, bisections: int = 40
                        ) -> tuple[tuple[CalibrationEntry, ...], list[str]]:
    """llama.cpp's attention on quantized caches: per cache type, the decode and prefill attention efficiencies that
    make `hw`'s fitted model (weights entries for the runs' file types) meet each run, the median over the runs. Each is
    found by bisection on the planner's own prediction, which falls as the efficiency rises; a run the model cannot
    meet within the bounds (faster than at efficiency 1, slower than at the least) is said in a warning."""
    found: dict[tuple[str, str], list[float]] = {}
    warnings: list[str] = []
    for run in runs:
        for kind, which in (("attn", 0), (PREFILL_ATTENTION_BACKEND, 1)):
            measured = (run.decode_s_per_token, run.prefill_s)[which]
            lo, hi = MIN_EFFICIENCY, MAX_EFFICIENCY
            for _ in range(bisections):
                mid = (lo * hi) ** 0.5
                entry = CalibrationEntry(device="cpu", backend=f"{kind}-{ATTENTION_IMPL}", quant=run.kv_type,
                                         bandwidth_efficiency=None, compute_efficiency=mid)
                trial = with_entries(hw, (entry,))
                if _predicted(trial, run)[which] > measured:
                    lo = mid
                else:
                    hi = mid
            eff = (lo * hi) ** 0.5
            if eff > 0.99 * MAX_EFFICIENCY or eff < 1.01 * MIN_EFFICIENCY:
                warnings.append(f"{run.spec.name} {run.file_type} {run.kv_type} cache, prompt {run.prompt}: its "
                                f"{kind} time is out of the model's reach (efficiency held at {eff:.3g})")
            found.setdefault((kind, run.kv_type), []).append(eff)
    entries = tuple(CalibrationEntry(device="cpu", backend=f"{kind}-{ATTENTION_IMPL}", quant=kv,
                                     bandwidth_efficiency=None, compute_efficiency=round(statistics.median(effs), 5))
                    for (kind, kv), effs in sorted(found.items()))
    return entries, warnings


def with_entries(hw: HardwareProfile, entries: tuple[CalibrationEntry, ...]) -> HardwareProfile:
    """`hw` with these calibration entries in place of any of the same keys."""
    keys = {e.key for e in entries}
    cal = hw.calibration
    kept = tuple(e for e in cal.entries if e.key not in keys)
    return replace(hw, calibration=replace(cal, entries=kept + tuple(entries)))


def calibration_sample(hw: HardwareProfile, run: ServerRun, label: str = "") -> Sample:
    """One llama-server run reduced to the speed model's features, as llama.cpp's plans cost it: GGUF bytes, f16
    attention, prompts in n_ubatch steps."""
    spec, model = rules.without_mla_expansion(run.spec), rules.gguf_model(run.spec, run.file_type)
    req = Request(context=run.prompt + run.new_tokens, prompt_tokens=run.prompt, engine=ENGINE,
                  prefill_chunk=rules.N_UBATCH)
    fp = footprint(spec, hw, req, model, run.kv_type)
    work = decode_work(spec, SPEED_SCHEME, kv_scheme(run.kv_type), 1, run.prompt + run.new_tokens // 2,
                       gguf_layer_costs(fp), gguf_read_bytes(spec, model, 1))
    return Sample(device="cpu", backend=SPEED_SCHEME.backend, quant=run.file_type,
                  bandwidth_bytes_per_s=hw.host.ram_bandwidth_bytes_per_s, peak_flops=cpu_float_peak(hw.host)[0],
                  matmul_peak_flops=cpu_matmul_peak(hw.host, SPEED_SCHEME)[0],
                  bytes_read_per_token=sum(work.weights_bytes) + work.head_bytes,
                  kv_bytes_per_token=sum(work.per_layer("kv_read")),
                  attention_flops_per_token=sum(work.per_layer("attention_flop")),
                  attention_impl=ATTENTION_IMPL, num_layers=spec.num_layers,
                  decode_s_per_token=run.decode_s_per_token, prefill_flops=prefill_flop(spec, run.prompt),
                  prefill_attention_flops=prefill_attention_flop(spec, run.prompt),
                  prefill_chunks=-(-run.prompt // rules.N_UBATCH), prefill_s=run.prefill_s,
                  kv_dtype="fp16" if run.kv_type == "f16" else run.kv_type, label=label)


def fit_llamacpp(hw: HardwareProfile, runs: list[ServerRun], *, commit: str, measured_at: str
                 ) -> tuple[HardwareProfile, list[str]]:
    """llama.cpp's efficiencies fitted to measured llama-server runs, in `hw`'s calibration in place of any llama.cpp
    entries it had: the weights per file type and the attention on the f16 cache by planner.calibration.fit (as
    `vramplan calibrate` fits vramplan's runtime), then the attention on each quantized cache given those."""
    if hw.has_gpu:
        raise ValueError(f"{hw.name} has a GPU: llama.cpp's efficiencies are fitted to CPU runs on a CPU profile")
    samples = [calibration_sample(hw, r, f"{r.spec.name} {r.file_type} prompt {r.prompt}")
               for r in runs if r.kv_type == "f16"]
    fitted = fit(samples, measured_at=measured_at, versions={"llama.cpp": commit})
    hw = with_llamacpp_calibration(hw, fitted.calibration, commit)
    entries, warnings = fit_cache_attention(hw, [r for r in runs if r.kv_type != "f16"])
    return with_entries(hw, entries), [*fitted.warnings, *warnings]


def _fitted_here(residual: str) -> bool:
    """A residual of a llama.cpp entry ("cpu/llama.cpp/Q4_K_M: decode_abs_pct_median")."""
    parts = residual.split(":")[0].split("/")
    return len(parts) > 1 and parts[1] in LLAMA_CPP_BACKENDS


def with_llamacpp_calibration(hw: HardwareProfile, fitted: Calibration, commit: str) -> HardwareProfile:
    """`hw` with llama.cpp's fitted entries in place of any it had, the rest of its calibration kept."""
    old = hw.calibration
    kept = tuple(e for e in (old.entries if old is not None else ()) if e.backend not in LLAMA_CPP_BACKENDS)
    residuals = {k: v for k, v in (old.residuals_dict if old is not None else {}).items() if not _fitted_here(k)}
    residuals.update(fitted.residuals_dict)
    versions = {**(old.versions_dict if old is not None else {}), "llama.cpp": commit,
                MEASURED_AT_VERSION: fitted.measured_at}
    cal = Calibration(measured_at=old.measured_at if old is not None else fitted.measured_at, versions=versions,
                      entries=kept + fitted.entries, residuals=residuals,
                      runtime_ram_bytes=old.runtime_ram_bytes if old is not None else None)
    return replace(hw, calibration=cal)
