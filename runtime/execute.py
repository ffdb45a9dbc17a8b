"""Carry a Plan out: load as planned, generate, measure, and compare with the prediction.

`execute(...) -> RunReport`. The runtime does not re-plan, except after a CUDA
out-of-memory: then it asks the planner again with the GPU budget lowered by what the
OOM showed, says the prediction was wrong and by how much, and retries (bounded),
keeping the text generated so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from planner.errors import PlanError, VramplanError
from planner.hardware import HardwareProfile
from planner.modelspec import ModelSpec
from planner.choice import OffloadMode
from planner.plan import Plan, hardware_fingerprint, model_ref
from planner.search import plan as make_plan
from planner.sources import ModelSource

MAX_OOM_RETRIES = 2
# After an OOM the new GPU budget is what the failed attempt planned to use minus the shortfall
# the OOM revealed, and at least this fraction lower, so each retry makes real progress.
OOM_MIN_BUDGET_CUT = 0.10
DEFAULT_PROMPT_TOKENS = 128  # synthetic prompt length when no prompt is given
METRICS = ("decode_tokens_per_s", "ttft_s", "peak_vram_bytes", "peak_ram_bytes")


@dataclass(kw_only=True)
class RunReport:
    plan: dict
    predicted: dict
    measured: dict
    error_pct: dict
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    device: str = "cpu"
    stopped_reason: str = ""
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replans: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"predicted": self.predicted, "measured": self.measured, "error_pct": self.error_pct,
                "text": self.text, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens, "device": self.device,
                "stopped_reason": self.stopped_reason, "errors": self.errors, "notes": self.notes,
                "replans": self.replans, "plan": self.plan}


def check_plan_matches(p: Plan, spec: ModelSpec, hw: HardwareProfile) -> None:
    """A plan made for another model or machine is refused."""
    mine = model_ref(spec)["fingerprint"]
    if p.model.get("fingerprint") != mine:
        raise PlanError(f"the plan was made for model {p.model.get('id')!r}, not {spec.name!r} (architecture differs)")
    if p.hardware.get("fingerprint") != hardware_fingerprint(hw):
        raise PlanError(f"the plan was made for hardware {p.hardware.get('name')!r} "
                        f"({p.hardware.get('gpu') or 'no GPU'}), not this machine ({hw.name}: "
                        f"{hw.gpu.name if hw.gpu else 'no GPU'})")
    if not p.fits or p.choice is None:
        raise PlanError("the plan says nothing fits: there is nothing to run")


def _pct(measured, predicted):
    if measured is None or predicted in (None, 0):
        return None
    return 100.0 * (measured - predicted) / predicted


def predicted_for_run(p: Plan, spec: ModelSpec, hw: HardwareProfile, prompt_tokens: int, total_tokens: int) -> dict:
    """The plan's prediction for exactly this run: the same choice, at the run's real prompt length and with
    the KV cache this run fills (prompt + generated tokens), which is what its peak memory holds."""
    c = p.choice
    context = max(1, min(total_tokens, p.request.context))
    req = replace(p.request, context=context, prompt_tokens=min(prompt_tokens, context), quant=(c.weight_quant,),
                  kv_dtype=(c.kv_dtype,), gpu_layers=c.gpu_layers if c.on_gpu else None,
                  offload=c.offload if c.offload is not OffloadMode.NONE else None)
    again = make_plan(spec, hw, req)
    src = again.chosen if again.fits else p.chosen
    gpu = src.memory.gpu
    return {
        "decode_tokens_per_s": src.speed.decode_tokens_per_s,
        "ttft_s": src.speed.ttft_s,
        # what the process will hold at its peak: everything planned except the free headroom
        "peak_vram_bytes": (gpu.total_bytes - gpu.headroom_bytes) if gpu else None,
        "peak_ram_bytes": src.memory.cpu.total_bytes,
    }


def execute(p: Plan, spec: ModelSpec, hw: HardwareProfile, source: ModelSource, *, dummy_weights: bool,
            prompt_text: str | None, prompt_tokens: int | None, max_new_tokens: int, temperature: float = 0.0,
            seed: int = 0, allow_pickle: bool = False, trust_remote_code: bool = False,
            on_text: Callable[[str], None] | None = None,
            progress: Callable[[str], None] | None = None) -> RunReport:
    """Run the plan once (plus bounded OOM retries) and report predicted versus measured."""
    import torch

    from .generate import generate
    from .load import load_model
    from .measure import PeakMemorySampler

    say = progress or (lambda s: None)
    check_plan_matches(p, spec, hw)
    report = RunReport(plan=p.to_dict(), predicted={}, measured={m: None for m in METRICS},
                       error_pct={m: None for m in METRICS})
    current = p
    all_tokens: list[int] = []
    text_parts: list[str] = []
    base_ids = None
    for attempt in range(MAX_OOM_RETRIES + 1):
        c = current.choice
        if c.compute_device == "mps":
            raise VramplanError("the plan runs on an Apple GPU (mps): vramplan's runtime executes on CUDA or the CPU")
        on_gpu = c.on_gpu
        if on_gpu and not torch.cuda.is_available():
            raise VramplanError("the plan runs on a GPU but torch sees no CUDA device here")
        device = "cuda" if on_gpu else "cpu"
        report.device = device
        weight_src = source.path if (source.path is not None and not dummy_weights) else source.config
        ctx_bytes = hw.overheads.cuda_context_bytes if on_gpu else None
        loaded = None
        with PeakMemorySampler(device=device, cuda_context_bytes=ctx_bytes) as sampler:
            t0 = time.perf_counter()
            try:
                say(f"loading {spec.name} ({c.weight_quant}{', dummy weights' if dummy_weights else ''}) on {device}")
                offloaded = on_gpu and c.offload is not OffloadMode.NONE
                # offloaded plans load on the CPU, then the offload engine places them (stream or cpu mode)
                loaded = load_model(weight_src, weight_quant=c.weight_quant,
                                    compute_dtype="fp16" if c.weight_quant == "fp16" else "bf16",
                                    dummy_weights=dummy_weights, device="cpu" if offloaded else device,
                                    allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, seed=seed)
                if offloaded:
                    from .offload import apply_offload

                    engine = apply_offload(loaded.model, gpu_layers=c.gpu_layers, mode=c.offload.value, device=device)
                    report.notes.append(f"offload engine ({c.offload}): {engine.summary()}")
            except torch.cuda.OutOfMemoryError as e:  # pragma: no cover - needs a GPU
                result = None
                oom_error = f"CUDA out of memory while loading: {e}"
            else:
                oom_error = None
                report.measured["load_s"] = time.perf_counter() - t0
                report.notes.extend(loaded.notes)
                if base_ids is None:
                    base_ids = _prompt_ids(loaded, prompt_text, prompt_tokens, seed)
                    report.prompt_tokens = int(base_ids.shape[-1])
                # after an OOM the retry continues from the prompt plus the tokens kept so far
                ids = torch.cat([base_ids, torch.tensor([all_tokens], dtype=base_ids.dtype)], dim=-1) if all_tokens else base_ids
                if report.prompt_tokens + max_new_tokens > current.request.context:
                    report.notes.append(f"prompt {report.prompt_tokens} + {max_new_tokens} new tokens exceed the "
                                        f"planned context {current.request.context}")
                streamer = _Streamer(loaded.tokenizer, on_text)
                say(f"prefill {report.prompt_tokens} tokens in chunks of {current.request.prefill_chunk}, "
                    f"then up to {max_new_tokens} new tokens")
                result = generate(loaded.model, ids, max_new_tokens=max_new_tokens - len(all_tokens),
                                  prefill_chunk=current.request.prefill_chunk, kv_dtype=c.kv_dtype,
                                  temperature=temperature, eos_token_id=_eos(loaded), seed=seed,
                                  on_token=streamer.push)
                streamer.flush()
                all_tokens.extend(result.tokens)
                text_parts.append(streamer.text)
                if result.stopped_reason == "oom":
                    oom_error = result.error
        peaks = sampler.result
        report.measured["peak_ram_bytes"] = peaks.peak_rss_bytes
        report.measured["peak_vram_bytes"] = peaks.peak_vram_bytes
        if result is not None and result.ttft_s is not None:
            report.measured.update(
                ttft_s=result.ttft_s, prefill_tokens_per_s=result.prefill_tokens_per_s,
                decode_tokens_per_s=result.decode_tokens_per_s_median,
                decode_tokens_per_s_start=result.decode_tokens_per_s_start,
                decode_tokens_per_s_end=result.decode_tokens_per_s_end,
                generated_tokens=len(result.tokens))
            report.stopped_reason = result.stopped_reason
        if oom_error is None or attempt == MAX_OOM_RETRIES or not on_gpu:
            if oom_error:
                report.errors.append(oom_error)
            break
        replanned = _replan_after_oom(current, spec, hw, peaks, oom_error, report)
        if replanned is None:
            break
        current = replanned
        loaded = None  # free the failed attempt before the retry loads again
        torch.cuda.empty_cache()
    report.tokens = all_tokens
    report.text = "".join(text_parts)
    report.plan = current.to_dict()
    prompt_len = report.prompt_tokens or p.request.prompt
    report.predicted = predicted_for_run(current, spec, hw, prompt_len, prompt_len + max(len(all_tokens), 1))
    report.error_pct = {m: _pct(report.measured.get(m), report.predicted.get(m)) for m in METRICS}
    return report


def _replan_after_oom(current: Plan, spec, hw, peaks, error: str, report: RunReport) -> Plan | None:
    """Lower the GPU budget by what the OOM showed and plan again."""
    gpu = current.memory.gpu
    planned = gpu.total_bytes - gpu.headroom_bytes
    seen = peaks.peak_vram_bytes or planned
    shortfall = max(seen - planned, int(OOM_MIN_BUDGET_CUT * gpu.capacity_bytes))
    budget = max(0, gpu.capacity_bytes - shortfall)
    wrong_by = (seen - planned) / planned * 100 if planned else None
    msg = (f"CUDA out of memory: the plan predicted {planned / 2**30:.2f} GiB on the GPU, the process reached "
           f"{seen / 2**30:.2f} GiB" + (f" (prediction wrong by {wrong_by:+.1f} %)" if wrong_by is not None else "")
           + f"; re-planning with --vram-budget {budget / 2**30:.2f} GiB")
    report.errors.append(error)
    report.notes.append(msg)
    req = replace(current.request, vram_budget_bytes=budget, gpu_layers=None)
    new = make_plan(spec, hw, req)
    report.replans.append({"reason": msg, "vram_budget_bytes": budget,
                           "choice": new.choice.to_dict() if new.choice else None})
    return new if new.fits else None


def _prompt_ids(loaded, prompt_text, prompt_tokens, seed):
    from .generate import synthetic_prompt

    vocab = loaded.config.vocab_size
    if prompt_text is not None:
        if loaded.tokenizer is None:
            raise VramplanError("this model has no tokenizer (dummy weights or none in the directory): "
                                "use --prompt-tokens N for a synthetic prompt")
        ids = loaded.tokenizer(prompt_text, return_tensors="pt").input_ids
        if ids.shape[-1] == 0:
            raise VramplanError("the prompt is empty after tokenization")
        return ids
    return synthetic_prompt(prompt_tokens or DEFAULT_PROMPT_TOKENS, vocab, seed)


def _eos(loaded):
    tok = loaded.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        return tok.eos_token_id
    return None  # synthetic runs generate exactly --max-new-tokens


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
