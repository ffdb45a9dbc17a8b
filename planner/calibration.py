"""Fitting the speed model's efficiencies and fixed costs to measured runs. Pure.

The decode model is linear in its unknowns. For one device x backend x quant:

    t_token = bytes_read / bandwidth * (1 / eff_bw) + layers * per_layer_s + per_token_s

so a non-negative least-squares fit over runs of different sizes (models, contexts) gives
eff_bw, per_layer_s and per_token_s. Prefill then gives the compute efficiency:

    eff_compute = flops / (peak_flops * (t_prefill - chunks * (layers * per_layer_s + per_token_s)))

(median over runs). Residuals are reported as percentage errors of the fitted model on the
runs it was fitted to; the accuracy benchmark measures it on runs it has not seen.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from .hardware import Calibration, CalibrationEntry

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
    bytes_read_per_token: float  # weights + KV + lm_head one decode step reads (at the measured context)
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
    """Weighted least squares with every coefficient >= 0: the best over all active sets (k <= 3)."""
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


def fit_entry(samples: list[Sample]) -> tuple[CalibrationEntry, dict]:
    """Fit one device x backend x quant; returns the entry and its residuals (percent)."""
    s0 = samples[0]
    rows = [[s.bytes_read_per_token / s.bandwidth_bytes_per_s, float(s.num_layers), 1.0] for s in samples]
    y = [s.decode_s_per_token for s in samples]
    # relative errors matter, not absolute seconds: weight each run by 1/t^2
    inv_eff, per_layer, per_token = nnls(rows, y, [1.0 / (t * t) for t in y])
    eff_bw = min(MAX_EFFICIENCY, max(MIN_EFFICIENCY, 1.0 / inv_eff)) if inv_eff > 0 else MAX_EFFICIENCY
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
        pred = s.bytes_read_per_token / (s.bandwidth_bytes_per_s * eff_bw) + s.num_layers * per_layer + per_token
        errs.append(100.0 * abs(pred - s.decode_s_per_token) / s.decode_s_per_token)
    return entry, {"decode_abs_pct_median": statistics.median(errs), "decode_abs_pct_max": max(errs), "runs": len(samples)}


def fit(samples: list[Sample], *, measured_at: str, versions: dict[str, str]) -> Calibration:
    groups: dict[tuple[str, str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.device, s.backend, s.quant), []).append(s)
    entries, residuals = [], {}
    for key, group in sorted(groups.items()):
        entry, res = fit_entry(group)
        entries.append(entry)
        tag = "/".join(key)
        residuals[f"{tag}: decode_abs_pct_median"] = round(res["decode_abs_pct_median"], 3)
        residuals[f"{tag}: decode_abs_pct_max"] = round(res["decode_abs_pct_max"], 3)
    return Calibration(measured_at=measured_at, versions=versions, entries=tuple(entries), residuals=residuals)
