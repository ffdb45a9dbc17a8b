"""Carry a Plan out: load as planned, generate, measure, and compare with the prediction.

`execute(...) -> RunReport`. The runtime does not re-plan, except after a CUDA
out-of-memory: then it asks the planner again with the GPU budget lowered by what the
OOM showed, says the prediction was wrong and by how much, and retries (bounded),
keeping the text generated so far. An interrupted run (Ctrl-C, SIGTERM) still returns a
report of what it measured, marked interrupted.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from vramplan.planner.choice import ComputeDevice, OffloadMode
from vramplan.planner.errors import PlanError, VramplanError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.lean import decodes_lean
from vramplan.planner.modelspec import ModelSpec, context_limit
from vramplan.planner.plan import Plan, hardware_fingerprint, model_ref
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.planner.search import assess
from vramplan.planner.search import plan as make_plan
from vramplan.planner.sources import ModelSource
from vramplan.planner.units import format_bytes

from .progress import Track, no_track

MAX_OOM_RETRIES = 2
# After an OOM the new GPU budget is what the failed attempt planned to use minus the shortfall
# the OOM revealed, and at least this fraction lower, so each retry makes real progress.
OOM_MIN_BUDGET_CUT = 0.10
DEFAULT_PROMPT_TOKENS = 128  # synthetic prompt length when no prompt is given


@dataclass(kw_only=True)
class Metrics:
    """The four numbers a run is judged by: predicted (from the plan) or measured."""

    decode_tokens_per_s: float | None = None
    ttft_s: float | None = None
    peak_vram_bytes: int | None = None
    peak_ram_bytes: int | None = None

    COMPARED = ("decode_tokens_per_s", "ttft_s", "peak_vram_bytes", "peak_ram_bytes")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Metrics":
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})


@dataclass(kw_only=True)
class Measured(Metrics):
    """What a run measured: the four compared numbers and what explains them.

    decode_tokens_per_s (compared with the prediction) is the tokens after the first over the wall time from the
    first token to the last (runtime/generate.py); beside it the median decode step's rate and the rates over the
    first / last decode_edge_steps steps (generate.EDGE_FRACTION of them). token_timestamps_s: when each token of
    the last attempt was ready, in seconds from the start of its prefill ([0] is its TTFT).
    """

    load_s: float | None = None
    warmup_s: float | None = None  # the untimed warm-up before the prefill (runtime.generate.warm_up)
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s_median: float | None = None
    decode_tokens_per_s_start: float | None = None
    decode_tokens_per_s_end: float | None = None
    decode_edge_steps: int | None = None
    token_timestamps_s: list[float] | None = None
    generated_tokens: int | None = None
    load_average_1m: float | None = None  # the highest 1-minute load average seen around the run
    # of peak_ram_bytes, pages mapped from files (a checkpoint's safetensors through mmap): in RSS, but clean and
    # dropped by the kernel under pressure, unlike the anonymous memory the plan budgets (None: not measured)
    peak_ram_file_bytes: int | None = None
    # the GPU's SM clock while the prompt and tokens were timed (NVML, every CLOCK_SAMPLE_INTERVAL_S): lowest, median
    peak_vram_load_bytes: int | None = None  # peak VRAM up to the timed prefill: loading, quantizing, the warm-up
    gpu_sm_clock_mhz_min: int | None = None
    gpu_sm_clock_mhz_median: int | None = None
    process_cpu_cores: float | None = None  # this process' CPU time / wall time: how many cores it kept busy


RUN_SCHEMA_VERSION = 1  # of a run report's JSON (`run --json`, `run --save`)


@dataclass(kw_only=True)
class RunReport:
    plan: Plan  # the plan the last attempt ran (a re-planned one after an OOM)
    predicted: Metrics = field(default_factory=Metrics)
    measured: Measured = field(default_factory=Measured)
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    device: str = "cpu"
    stopped_reason: str = ""
    interrupted: bool = False
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replans: list[dict] = field(default_factory=list)

    @property
    def error_pct(self) -> dict:
        return {m: _pct(getattr(self.measured, m), getattr(self.predicted, m)) for m in Metrics.COMPARED}

    def to_dict(self) -> dict:
        return {"schema_version": RUN_SCHEMA_VERSION, "predicted": self.predicted.to_dict(),
                "measured": self.measured.to_dict(),
                "error_pct": self.error_pct, "text": self.text, "tokens": list(self.tokens),
                "prompt_tokens": self.prompt_tokens, "device": self.device, "stopped_reason": self.stopped_reason,
                "interrupted": self.interrupted, "errors": list(self.errors), "notes": list(self.notes),
                "replans": list(self.replans), "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "RunReport":
        return cls(plan=Plan.from_dict(d["plan"]), predicted=Metrics.from_dict(d["predicted"]),
                   measured=Measured.from_dict(d["measured"]), text=d["text"], tokens=list(d["tokens"]),
                   prompt_tokens=d["prompt_tokens"], device=d["device"], stopped_reason=d["stopped_reason"],
                   interrupted=d.get("interrupted", False), errors=list(d["errors"]), notes=list(d["notes"]),
                   replans=list(d["replans"]))


def _pct(measured, predicted):
    if measured is None or predicted in (None, 0):
        return None
    return 100.0 * (measured - predicted) / predicted


def check_plan_matches(p: Plan, spec: ModelSpec, hw: HardwareProfile) -> None:
    """A plan made for another model or machine is refused."""
    if p.model.fingerprint != model_ref(spec).fingerprint:
        raise PlanError(f"the plan was made for model {p.model.id!r}, not {spec.name!r} (architecture differs)")
    if p.hardware.fingerprint != hardware_fingerprint(hw):
        raise PlanError(f"the plan was made for hardware {p.hardware.name!r} "
                        f"({p.hardware.gpu or 'no GPU'}), not for {hw.name!r} "
                        f"({hw.gpu.name if hw.gpu else 'no GPU'}), which this run plans for")
    if not p.fits:
        raise PlanError("the plan says nothing fits: there is nothing to run")
    if p.choice.compute_device is ComputeDevice.MPS:
        raise PlanError("the plan runs on an Apple GPU (mps): vramplan's runtime executes on CUDA GPUs or the CPU")


def predicted_for_run(p: Plan, spec: ModelSpec, hw: HardwareProfile, prompt_tokens: int, total_tokens: int) -> Metrics:
    """The plan's prediction for exactly this run: the same choice, at the run's real prompt length and with
    the KV cache this run fills (prompt + generated tokens), which is what its peak memory holds."""
    c = p.choice
    context = max(1, min(total_tokens, p.request.context))
    req = replace(p.request, context=context, prompt_tokens=min(prompt_tokens, context), quant=(c.weight_quant,),
                  kv_dtype=(c.kv_dtype,), compiled=p.decode_compiled)  # priced as the plan decodes (a default too)
    memory, speed = assess(spec, hw, req, c)
    gpu = memory.gpu
    return Metrics(decode_tokens_per_s=speed.decode_tokens_per_s, ttft_s=speed.ttft_s,
                   # what the process will hold at its peak: everything planned except the free headroom (GPU 0,
                   # the one the sampler reads)
                   peak_vram_bytes=(gpu.total_bytes - gpu.headroom_bytes) if gpu else None,
                   peak_ram_bytes=memory.cpu.total_bytes)


class _Contention:
    """Whether other processes shared the CPUs during a run: the load average against this process' own use."""

    def __init__(self) -> None:
        self.wall0 = time.perf_counter()
        self.cpu0 = self._cpu_s()
        self.load = _load_average()

    @staticmethod
    def _cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def finish(self, measured: Measured, notes: list[str]) -> None:
        from .probe.host import busy_note

        wall = time.perf_counter() - self.wall0
        own = (self._cpu_s() - self.cpu0) / wall if wall > 0 else None
        loads = [x for x in (self.load, _load_average()) if x is not None]
        measured.load_average_1m = max(loads) if loads else None
        measured.process_cpu_cores = own
        if measured.load_average_1m is not None and own is not None:
            note = busy_note(measured.load_average_1m - own, os.cpu_count() or 1, "the measured speeds")
            if note:
                notes.append(f"{note} (this process kept {own:.1f} cores busy; the rest of the load is other "
                             "processes')")


def _load_average() -> float | None:
    from .probe.host import load_average

    return load_average()


def execute(p: Plan, spec: ModelSpec, hw: HardwareProfile, source: ModelSource, *, dummy_weights: bool,
            prompt_text: str | None, prompt_tokens: int | None, max_new_tokens: int, temperature: float = 0.0,
            seed: int = 0, allow_pickle: bool = False, trust_remote_code: bool = False,
            on_text: Callable[[str], None] | None = None,
            progress: Callable[[str], None] | None = None, track: Track | None = None) -> RunReport:
    """Run the plan once (plus bounded OOM retries) and report predicted versus measured.

    ``progress`` gets one line per step; ``track`` follows the long ones (a dummy build layer by layer, the
    prefill chunk by chunk with the plan's predicted TTFT)."""
    from .kvcache import available_kv_dtypes
    from .load import load_tokenizer

    say = progress or (lambda s: None)
    check_plan_matches(p, spec, hw)
    if prompt_text is None and prompt_tokens is not None:  # known before anything is imported or loaded
        _check_context(prompt_tokens, max_new_tokens, p.request.context,
                       0 if p.request.allow_context_overflow else context_limit(spec)[0])
    if p.choice.kv_dtype not in available_kv_dtypes():
        raise PlanError(f"the plan's KV-cache dtype {p.choice.kv_dtype} has no backend in this transformers "
                        f"(available: {', '.join(available_kv_dtypes())}): plan again with one of those")
    use_checkpoint = source.path is not None and not dummy_weights
    tokenizer = load_tokenizer(source.path, trust_remote_code) if use_checkpoint else None
    base_ids = _prompt_ids(tokenizer, spec.vocab_size, prompt_text, prompt_tokens, seed)
    n_prompt = int(base_ids.shape[-1])
    _check_context(n_prompt, max_new_tokens, p.request.context,
                   0 if p.request.allow_context_overflow else context_limit(spec)[0])
    report = RunReport(plan=p, prompt_tokens=n_prompt)
    contention = _Contention()
    attempt = _Attempt(report=report, spec=spec, hw=hw, source=source, tokenizer=tokenizer,
                       use_checkpoint=use_checkpoint, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                       seed=seed, temperature=temperature, on_text=on_text, say=say, track=track or no_track)
    for retry in range(MAX_OOM_RETRIES + 1):
        oom = attempt.run(base_ids, max_new_tokens)
        if oom is None or report.interrupted or retry == MAX_OOM_RETRIES or not report.plan.choice.on_gpu:
            if oom:
                report.errors.append(oom)
            break
        from .measure import cuda_free_bytes

        replanned = _replan_after_oom(report, spec, hw, oom, cuda_free_bytes())
        if replanned is None:
            break
        report.plan = replanned
    contention.finish(report.measured, report.notes)
    report.predicted = predicted_for_run(report.plan, spec, hw, n_prompt, n_prompt + max(len(report.tokens), 1))
    m = report.measured
    note = mapped_pages_note(report.predicted.peak_ram_bytes, m.peak_ram_bytes, m.peak_ram_file_bytes)
    if note:
        report.notes.append(note)
    return report


def _check_context(n_prompt: int, max_new_tokens: int, context: int, model_max: int) -> None:
    if n_prompt > context:
        raise VramplanError(f"the prompt is {n_prompt} tokens, more than the plan's context of {context} tokens")
    if n_prompt + max_new_tokens > context:
        raise VramplanError(f"the prompt ({n_prompt} tokens) plus {max_new_tokens} new tokens exceed the plan's "
                            f"context of {context} tokens: plan a longer context or generate fewer tokens")
    if model_max and n_prompt + max_new_tokens > model_max:
        raise VramplanError(f"the prompt ({n_prompt} tokens) plus {max_new_tokens} new tokens exceed the model's "
                            f"maximum context of {model_max} tokens (max_position_embeddings or its rope scaling; "
                            "--allow-context-overflow runs past it)")


@dataclass(kw_only=True)
class _Attempt:
    """Load the report's current plan and generate; what it measures goes into the report."""

    report: RunReport
    spec: ModelSpec
    hw: HardwareProfile
    source: ModelSource
    tokenizer: object
    use_checkpoint: bool
    allow_pickle: bool
    trust_remote_code: bool
    seed: int
    temperature: float
    on_text: Callable[[str], None] | None
    say: Callable[[str], None]
    track: Track

    def run(self, base_ids, max_new_tokens: int) -> str | None:
        """One attempt; returns the out-of-memory message when it ran out of GPU memory, else None."""
        import torch

        from .generate import STOP_INTERRUPTED
        from .measure import PeakMemorySampler, is_oom

        report, c = self.report, self.report.plan.choice
        if c.on_gpu and not torch.cuda.is_available():
            raise VramplanError("the plan runs on a GPU but torch sees no CUDA device here")
        if c.on_gpu and len(c.gpu_layers_per_device) > torch.cuda.device_count():
            raise VramplanError(f"the plan splits layers over {len(c.gpu_layers_per_device)} GPUs; torch sees "
                                f"{torch.cuda.device_count()} here")
        device = "cuda" if c.on_gpu else "cpu"
        report.device = device
        holder: dict = {}
        self._timed_from: float | None = None  # when the timed prefill began: the clocks from then on are the run's
        self._sampler = None
        oom = None
        with PeakMemorySampler(device=device,
                               cuda_context_bytes=(self.hw.overheads.cuda_context_bytes if c.on_gpu
                                                   else None)) as sampler:
            self._sampler = sampler
            try:
                oom = self._load_and_generate(holder, device, base_ids, max_new_tokens)
            except KeyboardInterrupt:
                report.interrupted = True
                report.stopped_reason = STOP_INTERRUPTED
                report.notes.append("interrupted: the numbers are what was measured until then")
            except Exception as e:  # noqa: BLE001 - only out-of-memory is turned into a re-plan
                if not is_oom(e):
                    raise
                oom = f"out of memory while loading: {' '.join(str(e).split())[:300]}"
            finally:
                _release(holder)
        report.measured.peak_ram_bytes = sampler.result.peak_rss_bytes
        report.measured.peak_ram_file_bytes = sampler.result.peak_rss_file_bytes
        report.measured.peak_vram_bytes = sampler.result.peak_vram_bytes
        clocks = sampler.sm_clock_mhz(since=self._timed_from) if self._timed_from is not None else None
        if clocks is not None:
            report.measured.gpu_sm_clock_mhz_min, report.measured.gpu_sm_clock_mhz_median = clocks
        return oom

    def _load_and_generate(self, holder: dict, device: str, base_ids, max_new_tokens: int) -> str | None:
        import torch

        from .generate import (STATIC_WARM_UP_STEPS, STOP_INTERRUPTED, STOP_OOM, compute_device, generate, model_device,
                               warm_up)
        from .measure import is_oom
        from .cpu_paths import recorded_paths
        from .load import load_model

        report, c, spec = self.report, self.report.plan.choice, self.spec
        self.say(f"loading {spec.name} ({c.weight_quant}{'' if self.use_checkpoint else ', dummy weights'}) on "
                 f"{device}")
        t0 = time.perf_counter()
        devices = [device] if device == "cpu" else [f"cuda:{d}" for d in range(len(c.gpu_layers_per_device))]
        if report.plan.decode_compiled:  # every layer on GPU 0 (the planner's rule): the other GPUs stay out of it
            devices = devices[:1]
        offloaded = c.on_gpu and (c.offload is not OffloadMode.NONE or len(devices) > 1 or c.expert_layers_on_cpu > 0)
        # offloaded plans (and those over several GPUs, or with experts in RAM) load on the CPU, then the offload
        # engine places them
        with self.track(f"building {spec.name}" if not self.use_checkpoint else f"loading {spec.name}",
                        spec.num_layers, None) as advance:
            loaded = holder["loaded"] = load_model(
                self.source.path if self.use_checkpoint else self.source.config, scheme=SCHEMES[c.weight_quant],
                dummy_weights=not self.use_checkpoint,
                device="cpu" if offloaded else device, allow_pickle=self.allow_pickle,
                trust_remote_code=self.trust_remote_code, seed=self.seed, tokenizer=self.tokenizer, on_layer=advance,
                random_device=devices[0] if c.on_gpu else None, cpu_alone=not c.on_gpu,
                cpu_paths=None if c.on_gpu else recorded_paths(self.hw.host))
        if offloaded:
            from .offload import apply_offload

            engine = holder["engine"] = apply_offload(
                loaded.model, gpu_layers=c.gpu_layers, mode=c.offload.value, device=devices[0], devices=devices,
                gpu_layers_per_device=c.gpu_layers_per_device, expert_layers_on_cpu=c.expert_layers_on_cpu)
            report.notes.append(f"offload engine ({c.offload}): {engine.summary()}")
        report.measured.load_s = time.perf_counter() - t0
        report.notes.extend(n for n in loaded.notes if n not in report.notes)
        # after an OOM the retry continues from the prompt plus the tokens kept so far
        ids = (torch.cat([base_ids, torch.tensor([report.tokens], dtype=base_ids.dtype)], dim=-1)
               if report.tokens else base_ids)
        static = None
        # --compile, or a scheme that decodes compiled only; else the plan's default, which falls back to eager
        forced = report.plan.request.compiled or getattr(SCHEMES.get(c.weight_quant), "compiled_only", False)
        if report.plan.decode_compiled:  # a static cache for the whole run and the compiled decode step
            from .compiled import StaticDecoder

            try:
                static = StaticDecoder(loaded.model, max_len=int(ids.shape[-1]) + max(
                    max_new_tokens - len(report.tokens), STATIC_WARM_UP_STEPS), device=model_device(loaded.model))
            except Exception as exc:  # noqa: BLE001 - a model transformers has no static cache for
                if forced:
                    raise _compile_failed(exc) from None
                report.notes.append(_eager_fallback(exc))
            if static is not None:
                report.notes.append(f"decode compiled: a static cache of {static.max_len} tokens, torch.compile mode "
                                    f"{static.mode!r}; compiled in the warm-up (not timed: the measured warm-up)"
                                    + (f", inductor's cache in {static.inductor_cache}" if static.inductor_cache
                                       else ""))
        elif decodes_lean(spec, SCHEMES[c.weight_quant], KV_SCHEMES[c.kv_dtype], on_gpu=c.on_gpu, compiled=False,
                          eager=report.plan.request.eager):
            from .lean import LeanDecoder, LeanUnsupported

            try:
                static = LeanDecoder(loaded.model, max_len=int(ids.shape[-1]) + max_new_tokens - len(report.tokens))
                report.notes.append(f"decode by vramplan's own decoder step (runtime.lean): a cache of "
                                    f"{static.max_len} tokens, q/k/v and gate/up one kernel call each (--eager runs "
                                    "transformers' forward)")
            except LeanUnsupported as exc:
                report.notes.append(_lean_fallback(exc))
        lean = getattr(static, "mode", None) == "lean"

        def warm_with(static):
            return warm_up(loaded.model, ids.to(model_device(loaded.model)), report.plan.request.prefill_chunk,
                           KV_SCHEMES[c.kv_dtype], static=static)

        try:
            try:
                warmed = warm_with(static)
            except Exception as exc:  # noqa: BLE001 - the compilation is what runs here, unless out of memory
                if static is None or forced or is_oom(exc):
                    raise
                report.notes.append(_lean_fallback(exc) if lean else _eager_fallback(exc))  # the plan's default
                static, lean = None, False
                warmed = warm_with(None)
        except Exception as exc:  # noqa: BLE001 - out of memory here is the timed run's to meet and re-plan
            if not is_oom(exc):
                if static is not None and not lean:  # the compilation is what runs here
                    raise _compile_failed(exc) from None
                raise
            warmed = 0.0
            report.notes.append("warm-up ran out of memory (the timed run follows)")
        warm = warmed
        if warm:
            report.measured.warmup_s = warm
            what = ("compiling the decode step" if static is not None and not lean else "CUDA first use"
                    if compute_device(loaded.model).type == "cuda" else "the weights' first touch")
            self.say(f"warm-up ({what}, not timed): "
                     f"{warm:.3f} s")
        streamer = _Streamer(self.tokenizer, self.on_text)
        n_ids, new_tokens = int(ids.shape[-1]), max_new_tokens - len(report.tokens)
        self.say(f"prefill {n_ids} tokens in chunks of {report.plan.request.prefill_chunk}, then up to "
                 f"{new_tokens} new tokens" + ("" if self.tokenizer is not None else "; they print as token ids: the "
                                              "model has no tokenizer" + ("" if self.use_checkpoint else
                                              " (dummy weights are random: the tokens mean nothing, only the speed "
                                              "counts)")))
        # the bar's ETA: what the plan predicts for this prefill (the prompt as it is now, after an OOM with the
        # tokens kept); the display closes when the last chunk is done, before the text streams
        ttft_s = predicted_for_run(report.plan, spec, self.hw, n_ids, n_ids + new_tokens).ttft_s
        if self._sampler is not None:
            report.measured.peak_vram_load_bytes = self._sampler.split()
        self._timed_from = time.perf_counter()
        with self.track("prefill", n_ids, ttft_s) as advance:
            result = generate(loaded.model, ids, max_new_tokens=new_tokens,
                              prefill_chunk=report.plan.request.prefill_chunk, kv=KV_SCHEMES[c.kv_dtype],
                              temperature=self.temperature, eos_token_id=_eos(self.tokenizer), seed=self.seed,
                              on_token=streamer.push, on_prefill_chunk=advance, static=static)
        streamer.flush()
        report.tokens.extend(result.tokens)
        report.text += streamer.text
        report.stopped_reason = result.stopped_reason
        if result.stopped_reason == STOP_INTERRUPTED:
            report.interrupted = True
            report.notes.append("interrupted: the numbers are what was measured until then")
        if result.ttft_s is not None:
            m = report.measured
            m.ttft_s, m.prefill_tokens_per_s = result.ttft_s, result.prefill_tokens_per_s
            m.decode_tokens_per_s = result.decode_tokens_per_s
            m.decode_tokens_per_s_median = result.decode_tokens_per_s_median
            m.decode_tokens_per_s_start = result.decode_tokens_per_s_start
            m.decode_tokens_per_s_end = result.decode_tokens_per_s_end
            m.decode_edge_steps = result.decode_edge_steps
            m.token_timestamps_s = list(result.token_timestamps_s)
            m.generated_tokens = len(report.tokens)
        return result.error if result.stopped_reason == STOP_OOM else None


def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _eager_fallback(exc: BaseException) -> str:
    return (f"the compiled decode the plan chose failed here ({_brief(exc)}): decoding eager instead, so the "
            "prediction (priced compiled) is above what eager reaches; --eager plans it eager")


def _lean_fallback(exc: BaseException) -> str:
    return (f"vramplan's own decoder step failed here ({_brief(exc)}): transformers' forward runs it instead, so the "
            "prediction (priced for vramplan's step) is above what it reaches; --eager plans it so")


def _compile_failed(exc: BaseException) -> VramplanError:
    return VramplanError(f"--compile failed here ({_brief(exc)}): run without --compile (the eager decode)")


def _release(holder: dict) -> None:
    """Drop every reference to an attempt's model and hand its memory back before anything else loads.

    The offload engine and its wrappers reference each other, and bitsandbytes' 4-bit weights point
    back at their module (Params4bit.module): plain `del` frees none of it until a collection."""
    from .measure import free_memory

    engine = holder.pop("engine", None)
    if engine is not None:
        engine.detach()
    holder.clear()
    del engine
    free_memory()


def _replan_after_oom(report: RunReport, spec, hw, error: str, free_bytes: int | None = None) -> Plan | None:
    """Lower the GPU budget by what the OOM showed, and to what the device has free now (measured after the failed
    attempt's memory went back: another process may hold what the profile promised), and plan again."""
    current = report.plan
    gpu = current.memory.gpu
    planned = gpu.total_bytes - gpu.headroom_bytes
    seen = report.measured.peak_vram_bytes or planned
    shortfall = max(seen - planned, int(OOM_MIN_BUDGET_CUT * gpu.capacity_bytes))
    budget = max(0, gpu.capacity_bytes - shortfall)
    free_note = ""
    if free_bytes is not None and free_bytes + gpu.cuda_context_bytes < budget:
        budget = free_bytes + gpu.cuda_context_bytes  # this process' CUDA context is planned and already there
        free_note = f" (the device has {free_bytes / 2**30:.2f} GiB free now, measured)"
    wrong_by = (seen - planned) / planned * 100 if planned else None
    msg = (f"CUDA out of memory: the plan predicted {planned / 2**30:.2f} GiB on the GPU, the process reached "
           f"{seen / 2**30:.2f} GiB" + (f" (prediction wrong by {wrong_by:+.1f} %)" if wrong_by is not None else "")
           + f"; re-planning with a GPU budget of {budget / 2**30:.2f} GiB{free_note}")
    report.notes.append(msg)
    new = make_plan(spec, hw, replace(current.request, vram_budget_bytes=budget, gpu_layers=None))
    report.replans.append({"reason": msg, "error": error, "vram_budget_bytes": budget,
                           "choice": new.choice.to_dict() if new.choice else None})
    if not new.fits:
        report.errors.append(f"{error}; and with a GPU budget of {budget / 2**30:.2f} GiB nothing fits")
        return None
    return new


def _prompt_ids(tokenizer, vocab_size: int, prompt_text: str | None, prompt_tokens: int | None, seed: int):
    from .generate import synthetic_prompt

    if prompt_text is not None:
        if tokenizer is None:
            raise VramplanError("this model has no tokenizer (dummy weights or none in the directory): "
                                "give a synthetic prompt length instead of text")
        ids = tokenizer(prompt_text, return_tensors="pt").input_ids
        if ids.shape[-1] == 0:
            raise VramplanError("the prompt is empty after tokenization")
        return ids
    return synthetic_prompt(prompt_tokens or DEFAULT_PROMPT_TOKENS, vocab_size, seed)


def _eos(tokenizer):
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return None  # synthetic runs generate exactly the tokens asked for


class _Streamer:
    """Turns generated ids into text as they come (whole-sequence decode, emitting the new suffix)."""

    def __init__(self, tokenizer, on_text):
        self.tok = tokenizer
        self.on_text = on_text or (lambda s: None)
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> None:
        self.ids.append(int(token_id))
        if self.tok is None:
            piece = f"{token_id} "
            self.text += piece
            self.on_text(piece)
            return
        full = self.tok.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return
        piece = full[len(self.text):]
        self.text = full
        if piece:
            self.on_text(piece)

    def flush(self) -> None:
        if self.tok is not None and self.ids:
            full = self.tok.decode(self.ids, skip_special_tokens=True)
            if len(full) > len(self.text):
                self.on_text(full[len(self.text):])
            self.text = full


def mapped_pages_note(planned: int | None, peak: int | None, mapped: int | None) -> str | None:
    """When the peak RSS is over the plan, say how much of it is pages mapped from files (a checkpoint read through
    mmap, which the kernel drops under pressure) and whether the rest, the memory the plan budgets, is within it."""
    if planned is None or peak is None or not mapped or peak <= planned:
        return None
    anonymous = peak - mapped
    within = "within" if anonymous <= planned else "also over"
    return (f"peak RAM {format_bytes(peak)} counts {format_bytes(mapped)} of pages mapped from files "
            f"(the checkpoint's safetensors, clean and dropped by the kernel under pressure); the rest, "
            f"{format_bytes(anonymous)}, is {within} the plan's {format_bytes(planned)}")
