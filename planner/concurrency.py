"""How many sequences of the request's context each engine runs at once, and their aggregate decode (`plan
--concurrency`). Pure.

Each planning engine keeps the format and KV cache it chose for one sequence and its own rules decide the rest: the
request's batch is raised (doubled, then bisected) while that engine's plan of the batch still fits with at least as
many layers on the GPUs as its one-sequence plan. More sequences that only fit by moving layers off the GPU are not
counted: they would decode each token slower. The batch is what each engine plans it as: vramplan's runtime decodes
`batch` sequences together; llama.cpp's llama-server runs -np slots of the context each; Ollama OLLAMA_NUM_PARALLEL;
plain transformers a batched generate. vLLM's answer is its own count: the sequences of max_model_len its KV pool
holds at the most --gpu-memory-utilization the GPU allows (its log's "Maximum concurrency").
"""

from __future__ import annotations

from dataclasses import replace

from .errors import VramplanError
from .hardware import HardwareProfile
from .modelspec import ModelSpec
from .plan import Plan
from .record import record
from .request import MAX_BATCH, Request


@record(kw_only=True)
class Concurrency:
    """One engine's answer: sequences of the context at once (0: none), their aggregate decode (None where not
    predicted), with which format, and how it was found."""

    engine: str
    weight_quant: str
    kv_dtype: str
    sequences: int
    aggregate_decode_tokens_per_s: float | None
    how: str

    def to_dict(self) -> dict:
        return {"engine": self.engine, "weight_quant": self.weight_quant, "kv_dtype": self.kv_dtype,
                "sequences": self.sequences, "aggregate_decode_tokens_per_s": self.aggregate_decode_tokens_per_s,
                "how": self.how}


def _gpu_layers(p: Plan) -> int:
    c = p.choice
    return getattr(c, "gpu_layers", 0) if c is not None else 0


def _moved_off(p: Plan, one: Plan) -> str:
    """How `p` holds less on the GPUs than `one` ('' where it does not): fewer layers, more layers' routed experts in
    RAM, or layers offloaded where `one` had none."""
    c, o = p.choice, one.choice
    if _gpu_layers(p) < _gpu_layers(one):
        return f"fits only with {_gpu_layers(p)} layers on the GPU, not {_gpu_layers(one)}"
    experts, base = (getattr(x, "expert_layers_on_cpu", 0) or 0 for x in (c, o))
    if experts > base:
        return f"fits only with the routed experts of {experts} layers in RAM, not {base}"
    offload, was = (getattr(getattr(x, "offload", None), "value", "none") for x in (c, o))
    if offload != "none" and was == "none":
        return f"fits only with layers offloaded ({offload})"
    return ""


def most_sequences(plan_fn, spec: ModelSpec, hw: HardwareProfile, req: Request, one: Plan,
                   limit: int = MAX_BATCH) -> tuple[int, Plan | None, str]:
    """The largest batch `plan_fn` fits with `one`'s format and cache and at least its GPU layers, its plan, and why
    one more does not fit (a doubling, then a bisection: what fits shrinks as the batch grows)."""
    c = one.chosen
    why: dict[int, str] = {}

    forced = replace(req, kv_dtype=(c.kv_dtype,))
    try:  # the chosen format too, where it is one the engine takes (a published checkpoint's stored format is not a
        # --quant, and the only format there is)
        plan_fn(spec, hw, with_quant := replace(forced, quant=(c.weight_quant,)), contexts=False)
        forced = with_quant
    except VramplanError:
        pass

    def at(n: int) -> Plan | None:
        try:
            p = plan_fn(spec, hw, replace(forced, batch=n), contexts=False)
        except VramplanError as e:
            why[n] = str(e)
            return None
        if not p.fits:
            why[n] = p.reasons[0] if p.reasons else "does not fit"
            return None
        if (p.chosen.weight_quant, p.chosen.kv_dtype) != (c.weight_quant, c.kv_dtype):
            why[n] = f"fits only as {p.chosen.weight_quant} + {p.chosen.kv_dtype}"
            return None
        if moved := _moved_off(p, one):
            why[n] = moved
            return None
        return p

    best, best_plan = 1, one
    n = 2
    while n <= limit and (p := at(n)) is not None:
        best, best_plan, n = n, p, n * 2
    lo, hi = best, min(n, limit + 1)  # best fits; hi does not (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (p := at(mid)) is not None:
            lo, best_plan = mid, p
        else:
            hi = mid
    if lo >= limit:
        return lo, best_plan, f"the request's limit of {limit} sequences"
    return lo, best_plan, why.get(lo + 1, why.get(hi, ""))


def concurrency(engines, spec: ModelSpec, hw: HardwareProfile, req: Request, p: Plan) -> tuple[Concurrency, ...]:
    """Every engine's answer, in the order of `engines` (planner.engines.ENGINES); the plan's own engine from `p`."""
    from .engines import vllm

    out = []
    for e in engines:
        if e.plan is None:  # vLLM: its pool's own count
            out.append(_vllm(vllm, spec, hw, req))
            continue
        try:
            one = p if e.name == req.engine else e.plan(spec, hw, _in_words(e.name, req, hw), contexts=False)
        except VramplanError as err:
            out.append(Concurrency(engine=e.name, weight_quant="-", kv_dtype="-", sequences=0,
                                   aggregate_decode_tokens_per_s=None, how=str(err)))
            continue
        if not one.fits:
            out.append(Concurrency(engine=e.name, weight_quant="-", kv_dtype="-", sequences=0,
                                   aggregate_decode_tokens_per_s=None, how="one sequence does not fit"))
            continue
        mine = one.request
        n, best, why = most_sequences(e.plan, spec, hw, mine, one)
        speed = best.predicted if best is not None else None
        out.append(Concurrency(engine=e.name, weight_quant=one.chosen.weight_quant, kv_dtype=one.chosen.kv_dtype,
                               sequences=n, aggregate_decode_tokens_per_s=speed.decode_tokens_per_s if speed else None,
                               how=f"{n + 1} do not fit: {why}" if why else f"{n} fit"))
    return tuple(out)


def _in_words(engine: str, req: Request, hw: HardwareProfile) -> Request:
    from .engine import request_for

    return request_for(engine, req, hw)[0]


def _vllm(vllm, spec: ModelSpec, hw: HardwareProfile, req: Request) -> Concurrency:
    a = vllm.vllm_best(spec, hw, req)  # vLLM puts the request in its own words (vllm_formats)
    if a.refused or a.layout is None or not a.fits:
        return Concurrency(engine=vllm.ENGINE, weight_quant="-", kv_dtype="-", sequences=0,
                           aggregate_decode_tokens_per_s=None, how=a.refused or "one sequence does not fit")
    lay = a.layout
    most = a.model.layout(lay.tp, lay.pp, lay.nodes, lay.cpu_offload_bytes, lay.cpu_offload_params)
    return Concurrency(engine=vllm.ENGINE, weight_quant=a.fmt.name, kv_dtype=a.kv_cache, sequences=most.max_concurrency,
                       aggregate_decode_tokens_per_s=None,
                       how=f"its KV pool at --gpu-memory-utilization {most.gpu_memory_utilization:.2f} (the most this "
                           f"GPU allows) holds {most.max_concurrency} sequences of {req.context} tokens; aggregate "
                           "decode not predicted for vLLM")
