"""Fitting the speed model's efficiencies and fixed costs to measured runs. Pure.

The decode model is linear in its unknowns once the attention term's bound is known. For one
device x backend x quant:

    t_token = weight_bytes / bandwidth / eff_bw + attention / eff_attn + layers * per_layer_s + per_token_s

where `attention` is the attention's roofline time, max(KV bytes / bandwidth, attention FLOPs /
peak compute), taken per run from whichever bound is the larger on that device. A
non-negative least-squares fit over runs of different sizes (models, contexts) gives eff_bw,
eff_attn, per_layer_s and per_token_s. eff_attn belongs to the attention kernel, not to the
weight quantization: it is stored once per device x attention implementation (the median over
the quantizations' fits) as an entry with backend "attn-sdpa" or "attn-eager", as its
bandwidth efficiency when reading the cache bounds it (GPUs) or its compute efficiency when
FLOPs do (CPUs). Prefill then gives the compute efficiency:

    eff_compute = flops / (peak_flops * (t_prefill - chunks * (layers * per_layer_s + per_token_s)))

(median over runs). Residuals are reported as percentage errors of the fitted model on the
runs it was fitted to; the accuracy benchmark measures it on runs it has not seen.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from .hardware import Calibration, CalibrationEntry
from .speed import KV_PASSES_DEFAULT

# Distinct layer counts the runs need before a per-token constant is fitted beside the per-layer cost.
MIN_DEPTHS_FOR_PER_TOKEN = 3
# Bounds that keep a noisy fit physical.
MIN_EFFICIENCY = 0.005
MAX_EFFICIENCY = 1.5


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One measured run, reduced to the speed model's features."""

    device: str  # "gpu" or "cpu"
    backend: str
    quant: str
    bandwidth_bytes_per_s: float  # peak bandwidth of where the layers ran
    peak_flops: float
    bytes_read_per_token: float  # weights + lm_head one decode step reads
    kv_bytes_per_token: float  # KV cache one decode step reads (at the measured context)
    attention_flops_per_token: float  # QK^T + AV FLOPs of one decode step
    attention_impl: str  # "sdpa" or "eager"
    num_layers: int
    decode_s_per_token: float  # measured (median)
    prefill_flops: float
    prefill_chunks: int
    prefill_s: float  # measured (TTFT)
    label: str = ""


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: list[list[float]], y: list[float], weights: list[float]) -> list[float]:
    """Weighted least squares with every coefficient >= 0: the best over all active sets (k <= 4)."""
    k = len(rows[0])
    best, best_err = [0.0] * k, float("inf")
    for size in range(1, k + 1):
        for active in itertools.combinations(range(k), size):
            ata = [[sum(w * r[i] * r[j] for r, w in zip(rows, weights)) for j in active] for i in active]
            aty = [sum(w * r[i] * v for r, v, w in zip(rows, y, weights)) for i in active]
            sol = _solve(ata, aty)
            if sol is None or any(s < 0 for s in sol):
                continue
            coef = [0.0] * k
            for i, s in zip(active, sol):
                coef[i] = s
            err = sum(w * (sum(c * x for c, x in zip(coef, r)) - v) ** 2 for r, v, w in zip(rows, y, weights))
            if err < best_err:
                best, best_err = coef, err
    return best


# What bounds single-query attention at decode, per device. Measured on the CPU dev machine
# (bench/results/accuracy-cpu-dev.md): the time per cached token followed heads x head_dim x layers
# (Llama-3.2-1B 30.6 us vs Qwen3-0.6B 53 us per token: ratio 1.74, FLOP ratio 1.75, KV-byte ratio
# 3.5), so the CPU kernel is compute-bound; on GPUs decode attention reads the cache at bandwidth.
ATTENTION_BOUND = {"cpu": "compute", "gpu": "bandwidth"}


def _compute_bound(s: Sample) -> bool:
    return ATTENTION_BOUND[s.device] == "compute"


def _attention_roofline(s: Sample) -> float:
    if _compute_bound(s):
        return s.attention_flops_per_token / s.peak_flops
    return s.kv_bytes_per_token / s.bandwidth_bytes_per_s


def _eff(inverse: float) -> float:
    return min(MAX_EFFICIENCY, max(MIN_EFFICIENCY, 1.0 / inverse)) if inverse > 0 else MAX_EFFICIENCY


def fit_entry(samples: list[Sample]) -> tuple[CalibrationEntry, float, dict]:
    """Fit one device x backend x quant; returns the entry, the KV efficiency and residuals (percent)."""
    s0 = samples[0]
    # A per-token constant is told apart from the per-layer cost only by runs of several depths; with
    # fewer the two are collinear and the fit swings between them, so the fixed cost stays per layer
    # (eager dispatch: what it physically is).
    fit_per_token = len({s.num_layers for s in samples}) >= MIN_DEPTHS_FOR_PER_TOKEN
    rows = [[s.bytes_read_per_token / s.bandwidth_bytes_per_s, _attention_roofline(s), float(s.num_layers)]
            + ([1.0] if fit_per_token else []) for s in samples]
    y = [s.decode_s_per_token for s in samples]
    # relative errors matter, not absolute seconds: weight each run by 1/t^2
    coef = nnls(rows, y, [1.0 / (t * t) for t in y])
    inv_eff, inv_kv, per_layer = coef[:3]
    per_token = coef[3] if fit_per_token else 0.0
    eff_bw, eff_kv = _eff(inv_eff), _eff(inv_kv)
    effs = []
    for s in samples:
        fixed = s.prefill_chunks * (s.num_layers * per_layer + per_token)
        compute_s = s.prefill_s - fixed
        if compute_s > 0 and s.prefill_flops > 0:
            effs.append(s.prefill_flops / (s.peak_flops * compute_s))
    eff_c = min(MAX_EFFICIENCY, max(MIN_EFFICIENCY, statistics.median(effs))) if effs else MIN_EFFICIENCY
    entry = CalibrationEntry(device=s0.device, backend=s0.backend, quant=s0.quant, bandwidth_efficiency=round(eff_bw, 5),
                             compute_efficiency=round(eff_c, 5), per_layer_overhead_s=round(per_layer, 9),
                             per_token_overhead_s=round(per_token, 9))
    errs = []
    for s in samples:
        pred = (s.bytes_read_per_token / (s.bandwidth_bytes_per_s * eff_bw) + _attention_roofline(s) / eff_kv
                + s.num_layers * per_layer + per_token)
        errs.append(100.0 * abs(pred - s.decode_s_per_token) / s.decode_s_per_token)
    return entry, eff_kv, {"decode_abs_pct_median": statistics.median(errs), "decode_abs_pct_max": max(errs),
                           "runs": len(samples)}


def fit(samples: list[Sample], *, measured_at: str, versions: dict[str, str]) -> Calibration:
    groups: dict[tuple[str, str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.device, s.backend, s.quant), []).append(s)
    entries, residuals = [], {}
    kv_effs: dict[tuple[str, str], list[float]] = {}
    bound: dict[tuple[str, str], list[bool]] = {}
    bw_effs: dict[str, list[float]] = {}
    for key, group in sorted(groups.items()):
        entry, eff_kv, res = fit_entry(group)
        entries.append(entry)
        bw_effs.setdefault(key[0], []).append(entry.bandwidth_efficiency)
        for impl in {s.attention_impl for s in group}:
            kv_effs.setdefault((key[0], impl), []).append(eff_kv)
            bound.setdefault((key[0], impl), []).extend(_compute_bound(s) for s in group)
        tag = "/".join(key)
        residuals[f"{tag}: decode_abs_pct_median"] = round(res["decode_abs_pct_median"], 3)
        residuals[f"{tag}: decode_abs_pct_max"] = round(res["decode_abs_pct_max"], 3)
    for (device, impl), effs in sorted(kv_effs.items()):
        # the KV cache is read in the compute dtype whatever the weights are: one figure per kernel.
        # The fitted efficiency is the compute one where FLOPs bound the runs, else the bandwidth one;
        # the other side keeps the documented default (weights' bandwidth efficiency / 3).
        eff = round(statistics.median(effs), 5)
        compute_bound = sum(bound[(device, impl)]) * 2 > len(bound[(device, impl)])
        default_bw = round(statistics.median(bw_effs[device]) / KV_PASSES_DEFAULT, 5)
        entries.append(CalibrationEntry(device=device, backend=f"attn-{impl}", quant="bf16",
                                        bandwidth_efficiency=default_bw if compute_bound else eff,
                                        compute_efficiency=eff if compute_bound else MAX_EFFICIENCY))
    return Calibration(measured_at=measured_at, versions=versions, entries=tuple(entries), residuals=residuals)
