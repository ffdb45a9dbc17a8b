"""Fitting the speed model's efficiencies and fixed costs to measured runs. Pure.

The decode model is linear in its unknowns once the attention term's bound is known. For one
device x backend x quant, on runs with a bf16 KV cache:

    t_token = weight_bytes / bandwidth / eff_bw + attention / eff_attn + layers * per_layer_s + per_token_s

where `attention` is the attention's roofline time, max(KV bytes / bandwidth, attention FLOPs /
peak compute), taken per run from whichever bound is the larger on that device. A
non-negative least-squares fit over runs of different sizes (models, contexts) gives eff_bw,
eff_attn, per_layer_s and per_token_s, with every efficiency bounded by physics (at most 1):
a fit that wants more says the profile's peak is too low, and is refitted with that
efficiency held at 1 and a warning. eff_attn belongs to the attention kernel, not to the
weight quantization: it is stored once per device x attention implementation (the median over
the quantizations' fits) as an entry with backend "attn-sdpa" or "attn-eager", as its
bandwidth efficiency when reading the cache bounds it (GPUs) or its compute efficiency when
FLOPs do (CPUs); the other side is left unmeasured (null). Prefill then gives the compute
efficiency:

    eff_compute = flops / (peak * (t_prefill - chunks * (layers * per_layer_s + per_token_s)))

less the attention kernels' share, attention_flops / (peak_flops * eff_prefill_attn), where `peak` is what the
scheme's matmuls compute against (peak_flops, or on a CPU planner.speed.cpu_matmul_peak's int8 one):
one least-squares fit per device over every scheme's runs, an unknown matmul efficiency per scheme and one attention
efficiency per attention implementation (the same kernel on bf16 activations whatever the weights
are), stored as an entry with backend "prefill-attn-<impl>". Prompts of several lengths tell the two
apart (attention grows with the prompt squared); where the runs' attention share is too small to
measure, the speed model's default is used and no entry is stored. Runs with a quantized KV
cache measure its update: what they take beyond the same run with a bf16 cache (measured, else
the fitted model) is its traffic over bandwidth x eff_update plus a fixed cost per layer (told
apart by runs of two cache sizes), stored per device x KV dtype (backend "kv-update"). Residuals are percentage
errors of the fitted model on the runs it was fitted to; a large one is a warning. The accuracy benchmark measures
the model on runs it has not seen.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

from .record import record
from .hardware import MAX_EFFICIENCY, Calibration, CalibrationEntry
from .speed import DEFAULT_PREFILL_ATTENTION_EFFICIENCY, EXPERTS_BACKEND, KV_UPDATE_BACKEND, PREFILL_ATTENTION_BACKEND

# Distinct layer counts the runs need before a per-token constant is fitted beside the per-layer cost.
MIN_DEPTHS_FOR_PER_TOKEN = 3
# Below this an efficiency is noise, not a measurement.
MIN_EFFICIENCY = 0.005
# A fit whose median decode error on its own runs exceeds this is reported as a warning: the model
# does not describe those runs (a busy machine, a kernel the model does not know).
RESIDUAL_WARN_PCT = 10.0
# The prefill attention efficiency is fitted only from runs whose attention is at least this share of their prefill
# FLOPs (two or more runs of different shares): below it, attention is within the noise of the matmuls' time.
MIN_PREFILL_ATTENTION_SHARE = 0.03


@record(kw_only=True)
class Sample:
    """One measured run, reduced to the speed model's features."""

    device: str  # "gpu" or "cpu"
    backend: str
    quant: str
    bandwidth_bytes_per_s: float  # peak bandwidth of where the layers ran
    peak_flops: float  # a GPU's bf16 peak, a CPU's planner.speed.cpu_float_peak (bf16's in runs stored before it)
    bytes_read_per_token: float  # weights + lm_head one decode step reads
    kv_bytes_per_token: float  # KV cache one decode step reads (at the measured context, compute dtype)
    attention_flops_per_token: float  # QK^T + AV FLOPs of one decode step
    attention_impl: str  # "sdpa" or "eager"
    num_layers: int
    decode_s_per_token: float  # measured (median)
    prefill_flops: float  # every prefill FLOP: matmuls, lm_head and attention
    prefill_chunks: int
    prefill_s: float  # measured (TTFT)
    kv_dtype: str = "bf16"
    kv_update_bytes_per_token: float = 0.0  # a quantized cache's extra update traffic per decode step
    prefill_attention_flops: float = 0.0  # of prefill_flops, the attention kernels' (0 in runs stored before them)
    # the peak the prefill's weight matmuls compute against (planner.speed.cpu_matmul_peak on a CPU); None: peak_flops
    # (runs stored before it, and GPUs)
    matmul_peak_flops: float | None = None
    label: str = ""


@record(kw_only=True)
class ExpertSample:
    """One timed forward of a routed-experts module (one token routed to k experts): `calls` is k for vramplan's
    quantized experts (a call each), 1 for bf16 / fp16 (transformers' grouped call)."""

    device: str
    quant: str
    bandwidth_bytes_per_s: float  # peak bandwidth of the device
    bytes_read: float  # the routed experts' bytes
    calls: int  # experts computed
    seconds: float  # measured (median)
    label: str = ""


def fit_experts(samples: list[ExpertSample]) -> tuple[CalibrationEntry, dict, list[str]]:
    """One device x scheme: t = bytes / (bandwidth x eff) + calls x per-call cost, from shapes and k that vary both.
    Returns the "experts" entry (per_layer_overhead = the cost per call: per expert, or per grouped layer), residuals
    and warnings."""
    s0 = samples[0]
    tag = f"{s0.device}/{EXPERTS_BACKEND}/{s0.quant}"
    rows = [[s.bytes_read / s.bandwidth_bytes_per_s, float(s.calls)] for s in samples]
    y = [s.seconds for s in samples]
    coef, held = bounded_nnls(rows, y, [1.0 / (t * t) for t in y], {0: 1 / MAX_EFFICIENCY})
    warnings = []
    if 0 in held:
        warnings.append(f"{tag}: the experts read their bytes faster than the profile's peak bandwidth allows: held "
                        f"the efficiency at {MAX_EFFICIENCY:g}")
    eff, per_call = _eff(coef[0]), coef[1]
    errs = [100.0 * abs(r[0] * coef[0] + r[1] * per_call - t) / t for r, t in zip(rows, y)]
    residuals = {f"{tag}: abs_pct_median": round(statistics.median(errs), 3),
                 f"{tag}: abs_pct_max": round(max(errs), 3)}
    entry = CalibrationEntry(device=s0.device, backend=EXPERTS_BACKEND, quant=s0.quant,
                             bandwidth_efficiency=round(eff, 5), compute_efficiency=None,
                             per_layer_overhead_s=round(per_call, 9))
    return entry, residuals, warnings


@record
class FitResult:
    calibration: Calibration
    warnings: tuple[str, ...]


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
    """Weighted least squares with every coefficient >= 0: the best over all 2^k - 1 active sets (k is small: at most
    a scheme per column and an attention implementation or two in the prefill fit)."""
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


def bounded_nnls(rows: list[list[float]], y: list[float], weights: list[float],
                 min_inverse: dict[int, float]) -> tuple[list[float], list[int]]:
    """NNLS with coefficients i in `min_inverse` at least that value (an inverse efficiency >= 1/MAX_EFFICIENCY):
    a coefficient that falls below is held at its bound and the rest refitted. Returns (coefficients, held)."""
    held: dict[int, float] = {}
    while True:
        free = [i for i in range(len(rows[0])) if i not in held]
        y_free = [v - sum(r[i] * c for i, c in held.items()) for r, v in zip(rows, y)]
        sol = nnls([[r[i] for i in free] for r in rows], y_free, weights) if free else []
        coef = dict(held)
        coef.update(zip(free, sol))
        low = [i for i in free if i in min_inverse and coef[i] < min_inverse[i]]
        if not low:
            return [coef[i] for i in range(len(rows[0]))], sorted(held)
        i = min(low, key=lambda j: coef[j] / min_inverse[j])
        held[i] = min_inverse[i]


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


@record
class _Fitted:
    entry: CalibrationEntry
    eff_kv: dict[str, float]  # per attention implementation
    residuals: dict
    warnings: tuple[str, ...]

    def decode_s(self, s: Sample) -> float:
        """The fitted model's time per token for a run with a bf16 cache."""
        e = self.entry
        return (s.bytes_read_per_token / (s.bandwidth_bytes_per_s * e.bandwidth_efficiency)
                + _attention_roofline(s) / self.eff_kv[s.attention_impl] + s.num_layers * e.per_layer_overhead_s
                + e.per_token_overhead_s)


def fit_entry(samples: list[Sample]) -> _Fitted:
    """Fit one device x backend x quant (bf16-KV runs): the entry, the attention efficiency, residuals, warnings."""
    s0 = samples[0]
    tag = f"{s0.device}/{s0.backend}/{s0.quant}"
    # A per-token constant is told apart from the per-layer cost only by runs of several depths; with
    # fewer the two are collinear and the fit swings between them, so the fixed cost stays per layer
    # (eager dispatch: what it physically is).
    fit_per_token = len({s.num_layers for s in samples}) >= MIN_DEPTHS_FOR_PER_TOKEN
    # one attention column per implementation: the same weights' runs with SDPA and with eager attention share
    # everything but the attention kernel
    impls = sorted({s.attention_impl for s in samples})
    rows = [[s.bytes_read_per_token / s.bandwidth_bytes_per_s]
            + [_attention_roofline(s) if s.attention_impl == i else 0.0 for i in impls] + [float(s.num_layers)]
            + ([1.0] if fit_per_token else []) for s in samples]
    y = [s.decode_s_per_token for s in samples]
    # relative errors matter, not absolute seconds: weight each run by 1/t^2; efficiencies at most 1
    coef, held = bounded_nnls(rows, y, [1.0 / (t * t) for t in y],
                              {j: 1 / MAX_EFFICIENCY for j in range(len(impls) + 1)})
    warnings = []
    peak = "bandwidth" if 0 in held else None
    if 0 in held:
        warnings.append(f"{tag}: the runs read weights faster than the profile's peak bandwidth allows "
                        f"({s0.bandwidth_bytes_per_s / 1e9:.1f} GB/s): held the efficiency at {MAX_EFFICIENCY:g}; the "
                        "profile's bandwidth is too low (measured under load?): probe again on an idle machine")
    for j, impl in enumerate(impls, start=1):
        if j in held:
            what = "compute" if _compute_bound(s0) else "bandwidth"
            warnings.append(f"{tag}: decode attention ({impl}) ran faster than the profile's peak {what} allows: held "
                            f"its efficiency at {MAX_EFFICIENCY:g}; check the profile's peak {what}")
    inv_eff, per_layer = coef[0], coef[len(impls) + 1]
    per_token = coef[len(impls) + 2] if fit_per_token else 0.0
    eff_bw, eff_kv = _eff(inv_eff), {i: _eff(c) for i, c in zip(impls, coef[1:len(impls) + 1])}
    entry = CalibrationEntry(device=s0.device, backend=s0.backend, quant=s0.quant,
                             bandwidth_efficiency=round(eff_bw, 5),
                             compute_efficiency=None,  # from prefill: _fit_prefill, over every scheme of the device
                             per_layer_overhead_s=round(per_layer, 9), per_token_overhead_s=round(per_token, 9))
    fitted = _Fitted(entry, eff_kv, {}, ())
    errs = [100.0 * abs(fitted.decode_s(s) - s.decode_s_per_token) / s.decode_s_per_token for s in samples]
    residuals = {"decode_abs_pct_median": statistics.median(errs), "decode_abs_pct_max": max(errs),
                 "runs": len(samples)}
    if residuals["decode_abs_pct_median"] > RESIDUAL_WARN_PCT:
        warnings.append(f"{tag}: the fit misses its own runs by {residuals['decode_abs_pct_median']:.1f} % (median; "
                        f"more than {RESIDUAL_WARN_PCT:g} %): the speed model does not describe them"
                        + (" (and the bandwidth bound was hit)" if peak else ""))
    return _Fitted(entry, eff_kv, residuals, tuple(warnings))


def _prefill_compute_s(s: Sample, entry: CalibrationEntry) -> float:
    """A run's measured prefill less its fixed costs (per chunk: every layer's and the per-forward one)."""
    return s.prefill_s - s.prefill_chunks * (s.num_layers * entry.per_layer_overhead_s + entry.per_token_overhead_s)


def _attention_share(s: Sample) -> float:
    return s.prefill_attention_flops / s.prefill_flops if s.prefill_flops > 0 else 0.0


def _fit_prefill(device: str, groups: dict[tuple[str, str, str], tuple[list[Sample], CalibrationEntry]]
                 ) -> tuple[dict, dict[str, float], dict, list[str]]:
    """One device: t_compute = matmul FLOPs / (peak x eff_c[scheme]) + attention FLOPs / (peak x eff_a[impl]), fitted
    over every scheme's runs at once. Returns ({group: eff_c}, {impl: eff_a fitted}, residuals, warnings)."""
    runs = [(key, s, t) for key, (samples, entry) in groups.items() for s in samples
            if s.prefill_flops > 0 and (t := _prefill_compute_s(s, entry)) > 0]
    if not runs:
        return {}, {}, {}, []
    keys = sorted({key for key, _, _ in runs})
    impls = sorted({s.attention_impl for _, s, _ in runs})
    # an implementation's attention is measurable when its runs reach a visible share in two or more runs of different
    # shares (prompt lengths, or models of different shapes); one that is not shares SDPA's column when that one is
    # measured (as the speed model borrows SDPA's figure), else it is priced at the default and not stored
    fitted = [i for i in impls if len({round(_attention_share(s), 4) for _, s, _ in runs if s.attention_impl == i
                                       and _attention_share(s) >= MIN_PREFILL_ATTENTION_SHARE}) >= 2]
    column_of = {i: i if i in fitted else "sdpa" if "sdpa" in fitted else None for i in impls}
    columns = [("matmul", k) for k in keys] + [("attention", i) for i in fitted]
    rows, y, weights = [], [], []
    for key, s, t in runs:
        attention = s.prefill_attention_flops / s.peak_flops
        matmul = (s.prefill_flops - s.prefill_attention_flops) / (s.matmul_peak_flops or s.peak_flops)
        impl = column_of[s.attention_impl]
        rows.append([matmul if c == ("matmul", key) else attention if c == ("attention", impl) else 0.0
                     for c in columns])
        unmeasured = attention / DEFAULT_PREFILL_ATTENTION_EFFICIENCY[device] if impl is None else 0.0
        y.append(t - unmeasured)
        weights.append(1.0 / (s.prefill_s * s.prefill_s))  # relative errors of the TTFT
    coef, held = bounded_nnls(rows, y, weights, {j: 1 / MAX_EFFICIENCY for j in range(len(columns))})
    warnings = []
    for j in held:
        what, name = columns[j]
        tag = "/".join(name) if what == "matmul" else f"{device}/{PREFILL_ATTENTION_BACKEND}-{name}"
        warnings.append(f"{tag}: prefill {'matmuls' if what == 'matmul' else 'attention'} ran faster than the "
                        f"profile's peak compute allows: held at {MAX_EFFICIENCY:g}; the profile's compute figure is "
                        "too low")
    inverse = dict(zip(columns, coef))
    eff_c = {k: _eff(inverse[("matmul", k)]) for k in keys}
    eff_a = {i: _eff(inverse[("attention", i)]) for i in fitted}
    errs: dict = {}
    for (key, s, _), row, v in zip(runs, rows, y):
        errs.setdefault(key, []).append(100.0 * abs(sum(r * c for r, c in zip(row, coef)) - v) / s.prefill_s)
    residuals = {}
    for k, e in sorted(errs.items()):
        residuals["/".join(k) + ": prefill_abs_pct_median"] = round(statistics.median(e), 3)
        residuals["/".join(k) + ": prefill_abs_pct_max"] = round(max(e), 3)
    return eff_c, eff_a, residuals, warnings


def _same_run(s: Sample) -> tuple:
    """What identifies a run's model, scheme, attention kernel and context apart from its KV dtype."""
    return (s.device, s.backend, s.quant, s.attention_impl, s.bytes_read_per_token, s.num_layers,
            s.attention_flops_per_token)


def _fit_kv_update(samples: list[Sample], fitted: _Fitted, bf16: dict[tuple, float]
                   ) -> tuple[CalibrationEntry | None, list[str]]:
    """One device x KV dtype: what its runs take beyond the same run with a bf16 cache (measured where the matrix has
    it, else the fitted model) is its update traffic over bandwidth x eff, plus a fixed cost per layer. Runs of
    different cache sizes per layer tell the two apart; with one size the fixed cost stays 0."""
    s0 = samples[0]
    tag = f"{s0.device}/{KV_UPDATE_BACKEND}/{s0.kv_dtype}"
    runs = []
    for s in samples:
        extra_s = s.decode_s_per_token - bf16.get(_same_run(s), fitted.decode_s(s))
        if s.kv_update_bytes_per_token > 0 and extra_s > 0:
            runs.append((s, extra_s))
    if not runs:
        return None, [f"{tag}: the {s0.kv_dtype} runs were no slower than the same runs with a bf16 cache: its update "
                      "cost is not measurable at these contexts"]
    fixed = len({round(s.kv_update_bytes_per_token / s.num_layers) for s, _ in runs}) >= 2
    rows = [[s.kv_update_bytes_per_token / s.bandwidth_bytes_per_s] + ([float(s.num_layers)] if fixed else [])
            for s, _ in runs]
    y = [e for _, e in runs]
    coef, held = bounded_nnls(rows, y, [1.0 / (e * e) for e in y], {0: 1 / MAX_EFFICIENCY})
    warnings = []
    if 0 in held:
        warnings.append(f"{tag}: the cache update moved its bytes faster than the profile's peak bandwidth: held at "
                        f"{MAX_EFFICIENCY:g}")
    return CalibrationEntry(device=s0.device, backend=KV_UPDATE_BACKEND, quant=s0.kv_dtype,
                            bandwidth_efficiency=round(_eff(coef[0]), 5), compute_efficiency=None,
                            per_layer_overhead_s=round(coef[1], 9) if fixed else 0.0), warnings


def fit(samples: list[Sample], *, measured_at: str, versions: dict[str, str]) -> FitResult:
    if not samples:
        raise ValueError("no runs to fit: every calibration run failed")
    groups: dict[tuple[str, str, str], list[Sample]] = {}
    kv_groups: dict[tuple[str, str, str, str], list[Sample]] = {}
    for s in samples:
        if s.kv_dtype in ("bf16", "fp16"):
            groups.setdefault((s.device, s.backend, s.quant), []).append(s)
        else:
            kv_groups.setdefault((s.device, s.backend, s.quant, s.kv_dtype), []).append(s)
    entries, residuals, warnings = [], {}, []
    old = sum(1 for s in samples if s.device == "cpu" and s.matmul_peak_flops is None)
    if old:
        warnings.append(f"{old} CPU runs were saved before the CPU fp32 kernels and their peaks (no "
                        "matmul_peak_flops): they are fitted against the bf16 peak they were saved with, beside runs "
                        "priced against planner.speed.cpu_matmul_peak; measure them again")
    fitted: dict[tuple[str, str, str], _Fitted] = {}
    kv_effs: dict[tuple[str, str], list[float]] = {}
    bound: dict[tuple[str, str], list[bool]] = {}
    for key, group in sorted(groups.items()):
        fitted[key] = fit_entry(group)
    compute_eff: dict[tuple[str, str, str], float] = {}
    prefill_attention: list[CalibrationEntry] = []
    for device in sorted({key[0] for key in fitted}):
        eff_c, eff_a, res, w = _fit_prefill(device,
                                            {k: (groups[k], f.entry) for k, f in fitted.items() if k[0] == device})
        compute_eff.update(eff_c)
        residuals.update(res)
        warnings.extend(w)
        prefill_attention.extend(CalibrationEntry(device=device, backend=f"{PREFILL_ATTENTION_BACKEND}-{impl}",
                                                  quant="bf16", bandwidth_efficiency=None,
                                                  compute_efficiency=round(e, 5))
                                 for impl, e in sorted(eff_a.items()))
    for key, group in sorted(groups.items()):
        f = fitted[key]
        entries.append(replace(f.entry, compute_efficiency=round(compute_eff[key], 5)) if key in compute_eff
                       else f.entry)
        warnings.extend(f.warnings)
        for impl in {s.attention_impl for s in group}:
            kv_effs.setdefault((key[0], impl), []).append(f.eff_kv[impl])
            bound.setdefault((key[0], impl), []).extend(_compute_bound(s) for s in group)
        tag = "/".join(key)
        residuals[f"{tag}: decode_abs_pct_median"] = round(f.residuals["decode_abs_pct_median"], 3)
        residuals[f"{tag}: decode_abs_pct_max"] = round(f.residuals["decode_abs_pct_max"], 3)
    for (device, impl), effs in sorted(kv_effs.items()):
        # the KV cache is read in the compute dtype whatever the weights are: one figure per kernel, on the
        # side (compute or bandwidth) that bounded the runs; the other side was not measured
        eff = round(statistics.median(effs), 5)
        compute_bound = sum(bound[(device, impl)]) * 2 > len(bound[(device, impl)])
        entries.append(CalibrationEntry(device=device, backend=f"attn-{impl}", quant="bf16",
                                        bandwidth_efficiency=None if compute_bound else eff,
                                        compute_efficiency=eff if compute_bound else None))
    entries.extend(prefill_attention)
    kv_entries: dict[tuple[str, str], list[CalibrationEntry]] = {}
    bf16 = {_same_run(s): s.decode_s_per_token for group in groups.values() for s in group}
    for (device, backend, quant, kv_dtype), group in sorted(kv_groups.items()):
        base = fitted.get((device, backend, quant))
        if base is None:
            warnings.append(f"{kv_dtype} KV runs of {backend}/{quant} on the {device} have no bf16-cache runs "
                            "to compare with: not fitted")
            continue
        entry, w = _fit_kv_update(group, base, bf16)
        warnings.extend(w)
        if entry is not None:
            kv_entries.setdefault((device, kv_dtype), []).append(entry)
    for (device, kv_dtype), es in sorted(kv_entries.items()):
        entries.append(CalibrationEntry(
            device=device, backend=KV_UPDATE_BACKEND, quant=kv_dtype, compute_efficiency=None,
            bandwidth_efficiency=round(statistics.median(e.bandwidth_efficiency for e in es), 5),
            per_layer_overhead_s=round(statistics.median(e.per_layer_overhead_s for e in es), 9)))
    cal = Calibration(measured_at=measured_at, versions=versions, entries=tuple(entries), residuals=residuals)
    return FitResult(calibration=cal, warnings=tuple(warnings))
