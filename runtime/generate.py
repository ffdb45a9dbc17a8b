"""The generation loop, gpt-fast style: ``prefill``, ``decode_one_token``, ``decode_n_tokens``
over tensors, batch 1, with the timings a RunReport needs.

Timing rules (seconds, wall clock, CUDA synchronized where a CUDA device is in use):
- prefill_s: from the start of the first prefill chunk to the last chunk's logits
  being ready;
- ttft_s: from the same start to the first generated token available on the host
  (prefill + sampling + the copy to the host);
- token_timestamps_s: one entry per token, when it was available on the host, in seconds
  from the same start (so token_timestamps_s[0] == ttft_s);
- token_times_s: one entry per token after the first, each the wall time of one
  decode step (forward, sampling, copy to host); so len(token_times_s) ==
  len(tokens) - 1;
- decode_tokens_per_s (the headline): the tokens after the first over the wall time from
  the first token to the last, (n - 1) / (token_timestamps_s[-1] - token_timestamps_s[0]);
  it counts everything between tokens (streaming the text too), as a user waits for it;
- decode_tokens_per_s_median: 1 / median(token_times_s), the typical model step;
  _start / _end: tokens per second over the first / last EDGE_FRACTION of the decode
  steps (token_times_s; decode_edge_steps steps each, at least one).
"""

from __future__ import annotations

import functools
import inspect
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from vramplan.planner.quant import KV_SCHEMES, KVScheme
from vramplan.runtime.kvcache import make_cache
from vramplan.runtime.measure import is_oom, synchronize

EDGE_FRACTION = 0.10       # the share of decode steps averaged for the start / end rates
SPECIAL_TOKEN_IDS = 11     # synthetic prompts avoid ids 0..10 (pad/bos/eos live there in most vocabularies)

STOP_MAX_NEW_TOKENS = "max_new_tokens"
STOP_EOS = "eos"
STOP_OOM = "oom"
STOP_STOPPED = "stopped"
STOP_INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM: what was generated and timed until then is kept


@dataclass(kw_only=True)
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    ttft_s: float | None = None
    prefill_s: float | None = None
    prefill_tokens_per_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    token_timestamps_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: float | None = None
    decode_tokens_per_s_median: float | None = None
    decode_tokens_per_s_start: float | None = None
    decode_tokens_per_s_end: float | None = None
    decode_edge_steps: int | None = None  # decode steps in each of the start / end windows
    stopped_reason: str = STOP_MAX_NEW_TOKENS
    error: str | None = None


def synthetic_prompt(n_tokens: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A deterministic [1, n_tokens] prompt of ids in [11, vocab_size) (all ids if the vocab is tiny)."""
    low = SPECIAL_TOKEN_IDS if vocab_size > 2 * SPECIAL_TOKEN_IDS else 0
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size, (1, n_tokens), generator=generator, dtype=torch.long)


def model_device(model: nn.Module) -> torch.device:
    """Where inputs go: the device of the input embeddings."""
    return model.get_input_embeddings().weight.device


def compute_device(model: nn.Module) -> torch.device:
    """Where the logits come out (lm_head's device): sampling, its generator and the timing syncs belong there.
    With offload it can differ from model_device: an untied input embedding stays in RAM."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return weight.device if weight is not None else model_device(model)


@functools.cache
def cache_argument(model_class: type) -> str:
    """The name of the forward's KV-cache argument: ``cache`` since transformers 5.24, where ``past_key_values``
    still works but warns on every run (FutureWarning from transformers/utils/deprecation.py: "deprecated and
    will be removed in version 5.40.0 ... Use `cache` instead"); ``past_key_values`` before it (and in remote code
    written for it)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def forward_logits(model: nn.Module, input_ids: torch.Tensor, start: int, cache, *, cache_position: bool = False
             ) -> torch.Tensor:
    """Run ``input_ids`` (positions start..) through the model; fp32 logits of the last position, [1, vocab].

    Only the last position goes through lm_head. It is picked with an index tensor, not
    ``logits_to_keep=1``: that slice keeps the chunk's batch stride, and a bf16 CPU matmul
    on such an input copies the whole lm_head weight each call (+260 MiB for Qwen2.5-0.5B).
    ``cache_position``: also pass the positions as transformers' cache_position (a StaticCache writes there).
    """
    if hasattr(cache, "static_forward"):  # a compiled decode's static cache (runtime.compiled.StaticDecoder)
        return cache.static_forward(input_ids, start)
    n = input_ids.shape[1]
    positions = torch.arange(start, start + n, device=input_ids.device).unsqueeze(0)
    last = 1 if n == 1 else torch.tensor([n - 1], device=input_ids.device)
    extra = {"cache_position": positions[0]} if cache_position else {}
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=last,
                **{cache_argument(type(model)): cache}, **extra)
    return out.logits[:, -1, :].float()


def prefill(model: nn.Module, input_ids: torch.Tensor, cache, prefill_chunk: int,
            on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
    """Fill ``cache`` with the prompt, ``prefill_chunk`` tokens at a time; the last position's logits.
    ``on_chunk(tokens)`` is called after each chunk with the number of prompt tokens it held."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    n = input_ids.shape[1]
    if n < 1:
        raise ValueError("the prompt is empty")
    logits = None
    for start in range(0, n, prefill_chunk):
        chunk = input_ids[:, start:start + prefill_chunk]
        logits = forward_logits(model, chunk, start, cache)
        if on_chunk is not None:
            on_chunk(chunk.shape[1])
    return logits


def decode_one_token(model: nn.Module, token: torch.Tensor, position: int, cache) -> torch.Tensor:
    """One decode step for ``token`` ([1, 1]) at ``position``; its fp32 logits, [1, vocab]. With a StaticDecoder for
    ``cache``, its compiled step."""
    if hasattr(cache, "static_decode"):
        return cache.static_decode(token, position)
    return forward_logits(model, token, position, cache)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy for temperature 0, else a draw from softmax(logits / temperature); a [1, 1] tensor."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def decode_n_tokens(model: nn.Module, first_token: torch.Tensor, position: int, cache, n: int, *,
                    temperature: float, generator, device, eos_ids: frozenset[int],
                    on_token: Callable[[int], None] | None, stop: Callable[[], bool] | None,
                    tokens: list[int], token_times_s: list[float], token_timestamps_s: list[float],
                    t0: float) -> str:
    """Generate up to ``n`` tokens after ``first_token``; appends to ``tokens`` / ``token_times_s`` /
    ``token_timestamps_s`` (seconds since ``t0``, a perf_counter reading) as it goes (so they survive an
    exception) and returns the stop reason."""
    token = first_token
    for i in range(n):
        start = time.perf_counter()
        logits = decode_one_token(model, token, position + i, cache)
        token = sample(logits, temperature, generator)
        token_id = int(token.item())  # the copy to the host synchronizes
        synchronize(device)
        now = time.perf_counter()
        token_times_s.append(now - start)
        token_timestamps_s.append(now - t0)
        tokens.append(token_id)
        if on_token is not None:
            on_token(token_id)
        if token_id in eos_ids:
            return STOP_EOS
        if stop is not None and stop():
            return STOP_STOPPED
    return STOP_MAX_NEW_TOKENS


def generate(model: nn.Module, input_ids, *, max_new_tokens: int, prefill_chunk: int,
             kv: KVScheme = KV_SCHEMES["bf16"], temperature: float = 0.0,
             eos_token_id: int | Iterable[int] | None = None, seed: int = 0,
             on_token: Callable[[int], None] | None = None, stop: Callable[[], bool] | None = None,
             on_prefill_chunk: Callable[[int], None] | None = None, static=None) -> GenerationResult:
    """Prefill ``input_ids`` ([1, n] tensor or list of ids) in chunks, then decode.
    ``on_prefill_chunk(tokens)`` follows the prefill chunk by chunk (a progress bar).

    An out-of-memory error mid-way does not raise: the result so far comes back with
    stopped_reason "oom" and ``error`` set, so that the caller can re-plan.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = compute_device(model)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.shape[0] != 1:
        raise ValueError(f"batch size 1 only, got input_ids of shape {tuple(input_ids.shape)}")
    input_ids = input_ids.to(model_device(model))
    prompt_tokens = input_ids.shape[1]
    eos_ids = frozenset(_as_id_set(eos_token_id))
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None

    result = GenerationResult(prompt_tokens=prompt_tokens)
    if static is not None:  # compiled decode (runtime.compiled.StaticDecoder): its cache, emptied
        static.reset()
    cache = static if static is not None else make_cache(kv, model.config)
    try:
        with no_grad_context(model, static):
            synchronize(device)
            start = time.perf_counter()
            logits = prefill(model, input_ids, cache, prefill_chunk, on_prefill_chunk)
            synchronize(device)
            result.prefill_s = time.perf_counter() - start
            result.prefill_tokens_per_s = prompt_tokens / result.prefill_s
            token = sample(logits, temperature, generator)
            token_id = int(token.item())
            result.ttft_s = time.perf_counter() - start
            result.token_timestamps_s.append(result.ttft_s)
            result.tokens.append(token_id)
            if on_token is not None:
                on_token(token_id)
            if token_id in eos_ids:
                result.stopped_reason = STOP_EOS
            elif stop is not None and stop():
                result.stopped_reason = STOP_STOPPED
            else:
                result.stopped_reason = decode_n_tokens(
                    model, token, prompt_tokens, cache, max_new_tokens - 1,
                    temperature=temperature, generator=generator, device=device, eos_ids=eos_ids,
                    on_token=on_token, stop=stop, tokens=result.tokens, token_times_s=result.token_times_s,
                    token_timestamps_s=result.token_timestamps_s, t0=start)
    except KeyboardInterrupt:
        result.stopped_reason = STOP_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is turned into a result
        if not is_oom(exc):
            raise
        result.stopped_reason = STOP_OOM
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if result.stopped_reason == STOP_OOM:
        # only now, outside the except block: its exception and frames held the tensors that failed
        del cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _fill_decode_rates(result)
    return result


def warm_up(model: nn.Module, input_ids: torch.Tensor, prefill_chunk: int, kv: KVScheme = KV_SCHEMES["bf16"],
            static=None) -> float:
    """On a CUDA device, the prompt's first chunk and one decode step on a cache thrown away after; its seconds. On
    the CPU the prompt's first CPU_WARM_UP_TOKENS tokens, no decode step; elsewhere nothing (0.0). With a compiled
    decode (``static``, a StaticDecoder), on any device, the first chunk and
    STATIC_WARM_UP_STEPS steps through its own cache, emptied after: the compilation happens here, untimed.

    A fresh process's first prefill on a GPU pays for what CUDA does once: cuBLAS handles, and the kernels it loads
    lazily on their first use (CUDA_MODULE_LOADING=LAZY), chosen per shape. Measured on an H200 (Llama-3.2-1B
    bf16, 512 tokens, five fresh processes): 318-914 ms for the first prefill, 12-22 ms for the next one and 17-30
    ms for one at a new length (bench/results/gpu-nvidia-h200-2/host-variance). The TTFT the planner predicts is a
    warm one, as an engine that serves requests sees it (llama.cpp warms up at load too); the run times it after this
    and reports this as its own number. The first chunk is the one whose shapes the timed prefill starts with.

    On the CPU a first prefill pays for touching the weights: a checkpoint's are pages of its mapped file until then.
    Measured on the 2-core dev VM (bench/results/vs-engines-cpu-dev.md as of 1ade6cf, 128-token prompt, a fresh process
    each): Llama-3.2-1B bf16 from its checkpoint 2.47 s cold where the same prefill warm takes 1.29-1.41 s in one
    process, and the compiled run, which warms up, 1.49 s. A few tokens touch every weight once; what is left cold is
    per shape (0.2 s at most there). llama.cpp warms up at load the same way."""
    device = compute_device(model)  # an offloaded model keeps its input embedding (and the ids) in RAM
    lean = getattr(static, "mode", None) == "lean"  # runtime.lean's decoder step: nothing to compile, warmed as eager
    if device.type != "cuda" and (static is None or lean):
        if device.type != "cpu" or any(p.device.type != "cpu" for p in model.parameters()):
            return 0.0  # (an offloaded model whose lm_head stays in RAM: its layers are streamed, not mapped pages)
        # the CPU: CPU_WARM_UP_TOKENS of the prompt, no decode step (a longer first chunk would cost its whole time)
        prefill_chunk = min(prefill_chunk, CPU_WARM_UP_TOKENS)
        input_ids = input_ids[:, :prefill_chunk]
    cache = make_cache(kv, model.config) if static is None else static
    steps = STATIC_WARM_UP_STEPS if static is not None and not lean else 0 if device.type == "cpu" else 1
    if static is not None and not lean:
        steps = max(1, min(steps, static.max_len - min(prefill_chunk, input_ids.shape[1])))
    with no_grad_context(model, static):
        synchronize(device)
        start = time.perf_counter()
        logits = prefill(model, input_ids[:, :prefill_chunk], cache, prefill_chunk)
        position = min(prefill_chunk, input_ids.shape[1])
        for i in range(steps):
            logits = decode_one_token(model, logits.argmax(dim=-1, keepdim=True), position + i, cache)
        synchronize(device)
        seconds = time.perf_counter() - start
    if static is not None:
        static.reset()
    del cache, logits
    return seconds


# The CPU warm-up's tokens: every weight touched once, in about two decode steps' time (Llama-3.2-1B bf16 here); as
# many as Bf16Rows.FP32_MIN_ROWS, so that its fp32 prefill path is warmed too
CPU_WARM_UP_TOKENS = 8
# A compiled decode's warm-up steps: the first compiles; under CUDA graphs the next ones record and replay the graph.
STATIC_WARM_UP_STEPS = 3


def no_grad_context(model: nn.Module, static=None):
    """``torch.inference_mode()``, or ``torch.no_grad()`` for models holding optimum-quanto weights:
    quanto's generic int4 matmul (fp16, or groups other than 128) fails on inference tensors
    ("Cannot set version_counter for inference tensor"); and for a compiled decode (``static``): its cache is written
    in place by the compiled graph, which inference tensors refuse."""
    if static is not None:
        return torch.no_grad()
    quanto = any(type(m).__module__.startswith("optimum.quanto") for m in model.modules())
    return torch.no_grad() if quanto else torch.inference_mode()


def first_logits(model: nn.Module, input_ids, prefill_chunk: int, kv: KVScheme = KV_SCHEMES["bf16"]) -> torch.Tensor:
    """The fp32 logits of the last prompt position after a (chunked) prefill, [vocab]."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    input_ids = input_ids.to(model_device(model))
    with no_grad_context(model):
        return prefill(model, input_ids, make_cache(kv, model.config), prefill_chunk)[0]


def _as_id_set(eos_token_id) -> Iterable[int]:
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(int(i) for i in eos_token_id)


def _fill_decode_rates(result: GenerationResult) -> None:
    stamps = result.token_timestamps_s
    if len(stamps) >= 2 and stamps[-1] > stamps[0]:
        result.decode_tokens_per_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    times = result.token_times_s
    if not times:
        return
    result.decode_tokens_per_s_median = 1.0 / statistics.median(times)
    edge = result.decode_edge_steps = max(1, math.ceil(EDGE_FRACTION * len(times)))
    result.decode_tokens_per_s_start = edge / sum(times[:edge])
    result.decode_tokens_per_s_end = edge / sum(times[-edge:])
