"""--prefer: which of the candidates that fit a plan chooses, and why; one rule for every engine (planner.engine's loop
calls it for vramplan's schemes, llama.cpp's GGUF file types, Ollama's published quants, ...). Pure."""

from __future__ import annotations

from .plan import Candidate
from .request import Request


def choose_by_preference(cands: list[Candidate], req: Request) -> tuple[Candidate, list[str]]:
    """The candidate the request's preference picks among those that fit, and why. An engine whose speed is not
    predicted for some placements (vLLM across GPUs, plain transformers with accelerate's offload) chooses among the
    priced ones where any runs, else the best quality that runs (the fewest bytes among equals)."""
    runnable = [c for c in cands if c.fits]
    priced = [c for c in runnable if c.speed is not None]
    if not priced:
        return _unpriced(runnable, req)
    runnable = priced
    fastest = max(runnable, key=lambda c: c.speed.decode_tokens_per_s)
    top = fastest.speed.decode_tokens_per_s
    reasons = []
    if req.prefer == "speed":
        choice = fastest
        reasons.append(f"--prefer speed: the fastest predicted decode ({top:.2f} tok/s)")
    elif req.prefer == "quality":
        choice = min(runnable, key=lambda c: (c.quality_cost_pct, -c.speed.decode_tokens_per_s))
        reasons.append(f"--prefer quality: the smallest quality cost that runs (~{choice.quality_cost_pct:.1f} % "
                       "perplexity over bf16)")
    else:
        choice, why = _balanced(runnable, req)
        reasons.extend(why)
    reasons.append(f"{choice.weight_quant} weights + {choice.kv_dtype} KV cache: {choice.reason}")
    return choice, reasons


def _balanced(runnable: list[Candidate], req: Request) -> tuple[Candidate, list[str]]:
    """--prefer balanced: among the options that keep the quality floor (all of them when none does), the best quality
    whose predicted decode speed is within reach of the fastest of them; and why."""
    cap = req.balanced_max_quality_cost_pct
    kept = [c for c in runnable if c.quality_cost_pct <= cap]
    pool = kept or runnable
    fastest = max(pool, key=lambda c: c.speed.decode_tokens_per_s)
    top = fastest.speed.decode_tokens_per_s
    within = [c for c in pool if c.speed.decode_tokens_per_s >= req.balanced_speed_fraction * top]
    choice = min(within, key=lambda c: (c.quality_cost_pct, -c.speed.decode_tokens_per_s))
    reasons = [f"--prefer balanced: the best quality whose predicted decode speed is within reach of the fastest option"
               f"{' that keeps the quality floor' if kept else ''}, i.e. at least {req.balanced_speed_fraction:.0%} of "
               f"{top:.2f} tok/s ({fastest.weight_quant} + {fastest.kv_dtype} KV); {len(within)} of {len(runnable)} "
               "options qualify"]
    if fastest is not choice and top > choice.speed.decode_tokens_per_s:
        reasons.append(f"it trades {top / choice.speed.decode_tokens_per_s:.2f}x the decode speed for quality: "
                       f"{fastest.weight_quant} + {fastest.kv_dtype} KV decodes at {top:.2f} tok/s for "
                       f"~{fastest.quality_cost_pct:.1f} % perplexity over bf16, within the floor (--prefer speed "
                       f"takes it); this plan {choice.speed.decode_tokens_per_s:.2f} tok/s for "
                       f"~{choice.quality_cost_pct:.1f} %")
    dropped = [c for c in runnable if c.quality_cost_pct > cap]
    floor = f"the quality floor (at most {cap:g} % perplexity over bf16, planner.request.BALANCED_MAX_QUALITY_COST_PCT)"
    if not kept:
        reasons.append(f"no option that runs keeps {floor}: balanced chose among all of them")
    elif dropped:
        quick = max(dropped, key=lambda c: c.speed.decode_tokens_per_s)
        if quick.speed.decode_tokens_per_s > top:
            reasons.append(f"{floor} outranks speed: it leaves out {len(dropped)} "
                           f"option{'s' if len(dropped) > 1 else ''}"
                           f", the fastest {quick.weight_quant} + {quick.kv_dtype} KV at "
                           f"{quick.speed.decode_tokens_per_s:.2f} tok/s (~{quick.quality_cost_pct:.1f} % perplexity)")
    return choice, reasons


def _unpriced(runnable: list[Candidate], req: Request) -> tuple[Candidate, list[str]]:
    """Where no speed is predicted: --prefer quality takes the best quality; otherwise, among the options that keep the
    quality floor (all when none does), the one with the largest share of its layers on the GPU (what a decode waits
    on least), then the best quality, then the fewest bytes."""
    def share(c: Candidate) -> float:
        ch = c.choice
        return 1.0 if ch is None or not ch.on_gpu else (ch.gpu_layers - 0.5 * (ch.expert_layers_on_cpu > 0)
                                                          ) / ch.total_layers

    def size(c: Candidate) -> int:
        return (c.vram_bytes or 0) + (c.ram_bytes or 0)

    if req.prefer == "quality":
        choice = min(runnable, key=lambda c: (c.quality_cost_pct, -share(c), size(c)))
        why = "--prefer quality: the smallest quality cost that runs"
    else:
        kept = [c for c in runnable if c.quality_cost_pct <= req.balanced_max_quality_cost_pct] or runnable
        choice = min(kept, key=lambda c: (-share(c), c.quality_cost_pct, size(c)))
        why = ("the most of the model on the GPU among the options that keep the quality floor, then the best "
               "quality")
    return choice, [f"no speed is predicted for what runs here: {why} (~{choice.quality_cost_pct:.1f} % perplexity "
                    "over bf16)", f"{choice.weight_quant} weights + {choice.kv_dtype} KV cache: {choice.reason}"]
