"""What the user asks the planner for: context, batch, preferences and forced choices."""

from __future__ import annotations

from dataclasses import asdict, replace

from .memo import ObjectMemo
from .record import record
from .choice import OFFLOAD_MODES, OffloadMode, StrEnum
from .errors import PlanError
from .gguf import GGUF_FILE_TYPES
from .quant import KV_SCHEMES, SCHEMES
from .units import MAX_CONTEXT_TOKENS, GiB, MiB


class Preference(StrEnum):
    """How `plan` picks among the candidates that fit."""

    QUALITY = "quality"  # the smallest quality cost
    SPEED = "speed"  # the fastest predicted decode
    # the best quality within reach of the fastest (BALANCED_SPEED_FRACTION), among the options that keep the quality
    # floor (BALANCED_MAX_QUALITY_COST_PCT) when any does
    BALANCED = "balanced"


PREFERENCES = tuple(p.value for p in Preference)

# Named defaults, echoed in every plan.
DEFAULT_PREFILL_CHUNK = 2048  # tokens per prefill step; bounds activation memory
DEFAULT_HEADROOM_BYTES = 512 * MiB  # kept free on the GPU for the display, other processes, fragmentation
# "Within reach" for --prefer balanced: the best-quality option whose predicted decode speed is at
# least this fraction of the fastest option's.
BALANCED_SPEED_FRACTION = 0.5
# The quality floor of --prefer balanced, as the most perplexity an option may add over bf16 (the planner's quality
# ranking, Candidate.quality_cost_pct): balanced chooses among the options within it whenever any runs, so it never
# trades quality past it for speed. 8 % keeps every 4-bit weight scheme with a 4-bit KV cache (the costliest,
# bnb-fp4 at 6.0 % + quanto-int4 KV at 1.0 %, planner/quant.py; GGUF IQ4_XS + q4_0 at 4.7 %,
# planner/engines/llamacpp_rules.py) and leaves out GGUF Q3_K_M (10.5 %), Q2_K (56 %) and a 2-bit KV cache (10 %).
BALANCED_MAX_QUALITY_COST_PCT = 8.0
# What a plan must reach to be called usable, not only possible (a product decision, overridable per request): a
# decode at least as fast as a slow reader (1 token a second is about 45 words a minute), and a first token within
# ten minutes of the prompt. A plan that fits below them says so in its verdict and its JSON ("usable").
USABLE_MIN_DECODE_TOK_S = 1.0
USABLE_MAX_TTFT_S = 600.0
# The prompt a plan is timed at by default is the whole context (the worst case, what the context was sized for). Beside
# it a plan also gives the TTFT of a typical prompt: a chat turn with some history, 1024 tokens (an assumption, not a
# measurement; --prompt-tokens times the plan at any other).
TYPICAL_PROMPT_TOKENS = 1024
# RSS of a Python process with torch + transformers imported, before any weight is loaded.
# Measured on the CPU dev machine (torch 2.13, transformers 5.23): ~0.6-0.8 GiB; a CUDA build adds
# its libraries. The calibration may replace it.
RUNTIME_BASE_RAM_BYTES = 1 * GiB
MAX_BATCH = 4096
# The engines a plan can be made for (planner.engine's loop over each one's own search): vramplan's own runtime, plain
# transformers (vramplan's scheme names), llama.cpp and Ollama (GGUF file types and llama.cpp's cache types).
PLANNING_ENGINES = ("vramplan", "llama.cpp", "ollama", "transformers")
GGUF_ENGINES = ("llama.cpp", "ollama")
# What --quant / --kv-dtype name for an engine with its own formats: llama.cpp plans GGUF file types
# (planner.gguf) and its own KV cache types (common/arg.cpp kv_cache_types; the three llama.cpp users pick).
LLAMA_CPP_KV_DTYPES = ("f16", "q8_0", "q4_0")
# Where --expert-placement may put an MoE's routed experts: with their layers on the GPU, or all in RAM computed by the
# CPU (llama.cpp's --cpu-moe); a number N puts those of the first N MoE layers in RAM (llama.cpp's --n-cpu-moe).
EXPERT_PLACEMENTS = ("gpu", "cpu")
# What a compiled decode (--compile: a static KV cache and one torch.compile'd step, runtime/compiled.py) runs:
# unquantized weights with a cache of the same dtype, every layer on one device (bitsandbytes' and quanto's kernels
# break the graph; the offload engine moves weights between steps).
# weights -> the KV cache dtype they compile with (int8-wo / int4-wo: torch's weight-only kernels, compiled only)
COMPILE_SCHEMES = {"bf16": "bf16", "fp16": "fp16", "int8-wo": "bf16", "int4-wo": "bf16"}
# On a machine without a GPU the quanto schemes' layers call torch's CPU kernels themselves
# (runtime.quantize.direct_kernels), which inductor compiles through (tested: the eager tokens): with a bf16 cache,
# dense models (vramplan's quantized experts route tokens in Python). On a GPU quanto's compiled decode is unmeasured.
CPU_COMPILE_SCHEMES = {**COMPILE_SCHEMES, "quanto-int8": "bf16", "quanto-int4": "bf16", "quanto-w8a8": "bf16",
                       "cpu-w4a8": "bf16"}


def compile_schemes(has_gpu: bool) -> dict[str, str]:
    """The weights --compile runs on this machine, each with the KV cache dtype it compiles with."""
    return COMPILE_SCHEMES if has_gpu else CPU_COMPILE_SCHEMES
# Nodes of the profile's machine type a scale-out export (vLLM over Ray) may use; more is a typo.
MAX_NODES = 1024


@record(kw_only=True)
class Request:
    """What the user asks the planner for: context, batch, budgets and forced choices, validated on creation."""

    context: int  # tokens of context per sequence the plan must hold (prompt + generated)
    batch: int = 1
    prompt_tokens: int | None = None  # for the TTFT prediction; default: the whole context is prompt
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prefer: Preference = Preference.BALANCED
    quant: tuple[str, ...] = ()  # forced weight schemes (empty: all)
    kv_dtype: tuple[str, ...] = ()  # forced KV dtypes (empty: all)
    gpu_layers: int | None = None  # forced number of decoder layers on the GPU (>= num layers: all)
    offload: OffloadMode | None = None  # forced offload mode for layers not on the GPU
    # Forced place of an MoE's routed experts: "gpu", "cpu" (all in RAM) or N (the first N MoE layers' in RAM);
    # None: the search chooses. Only the experts of layers on the GPU move: an offloaded layer's go with it.
    expert_placement: str | int | None = None
    vram_budget_bytes: int | None = None  # replaces the GPU's memory as capacity
    ram_budget_bytes: int | None = None  # replaces the host RAM as capacity
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    runtime_base_ram_bytes: int = RUNTIME_BASE_RAM_BYTES
    balanced_speed_fraction: float = BALANCED_SPEED_FRACTION
    balanced_max_quality_cost_pct: float = BALANCED_MAX_QUALITY_COST_PCT
    usable_min_decode_tok_s: float = USABLE_MIN_DECODE_TOK_S
    usable_max_ttft_s: float = USABLE_MAX_TTFT_S
    nodes: int = 1  # machines of the profile's type available to an engine that scales out (vLLM over Ray)
    engine: str = "vramplan"  # whose memory rules the plan follows: one of PLANNING_ENGINES
    allow_context_overflow: bool = False  # plan a context beyond what the model is made for (see context_limit)
    compiled: bool = False  # decode compiled (compile_schemes, every layer on one device), priced without dispatch
    # never compiled. Neither (the default): on a GPU each scheme that compiles is priced both ways, every layer on GPU
    # 0 compiled, and the faster kept (planner.search); on a CPU eager, unless `compiled`
    eager: bool = False

    def __post_init__(self) -> None:
        _int(self, "context", 1, MAX_CONTEXT_TOKENS, "the context")
        _int(self, "batch", 1, MAX_BATCH, "the batch")
        _int(self, "prefill_chunk", 1, MAX_CONTEXT_TOKENS, "the prefill chunk")
        if self.prompt_tokens is not None:
            _int(self, "prompt_tokens", 1, self.context, f"the prompt (at most the context, {self.context} tokens)")
        if self.gpu_layers is not None:
            _int(self, "gpu_layers", 0, None, "the number of GPU layers")
        for name in ("vram_budget_bytes", "ram_budget_bytes"):
            if getattr(self, name) is not None:
                _int(self, name, 0, None, name.replace("_", " "))
        _int(self, "headroom_bytes", 0, None, "the GPU headroom")
        _int(self, "runtime_base_ram_bytes", 0, None, "the runtime's base RAM")
        _int(self, "nodes", 1, MAX_NODES, "the number of nodes")
        if not isinstance(self.compiled, bool):
            raise PlanError(f"compiled must be true or false, got {self.compiled!r}")
        if not isinstance(self.eager, bool):
            raise PlanError(f"eager must be true or false, got {self.eager!r}")
        if self.eager and self.engine not in ("vramplan", "transformers"):
            raise PlanError(f"--eager is vramplan's runtime's decode mode; {self.engine} decodes its own way")
        if self.compiled and self.eager:
            raise PlanError("--compile and --eager contradict each other: give one")
        if self.compiled and self.engine != "vramplan":
            raise PlanError(f"--compile is vramplan's runtime's decode mode; {self.engine} decodes its own way")
        if not isinstance(self.allow_context_overflow, bool):
            raise PlanError(f"allow_context_overflow must be true or false, got {self.allow_context_overflow!r}")
        if self.prefer not in PREFERENCES:
            raise PlanError(f"the preference must be one of {', '.join(PREFERENCES)}, got {self.prefer!r}")
        object.__setattr__(self, "prefer", Preference(self.prefer))
        if self.engine not in PLANNING_ENGINES:
            raise PlanError(f"the engine must be one of {', '.join(PLANNING_ENGINES)}, got {self.engine!r}")
        llama_cpp = self.engine in GGUF_ENGINES
        for name, known, what in (("quant", GGUF_FILE_TYPES if llama_cpp else SCHEMES,
                                   "GGUF file type" if llama_cpp else "weight quantization"),
                                  ("kv_dtype", LLAMA_CPP_KV_DTYPES if llama_cpp else KV_SCHEMES,
                                   "llama.cpp KV cache type" if llama_cpp else "KV-cache dtype")):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) for v in values):
                raise PlanError(f"{name} must be a list of names, got {values!r}")
            if llama_cpp and name == "quant":
                values = [v.upper() for v in values]
            object.__setattr__(self, name, tuple(values))
            for v in values:
                if v not in known:
                    raise PlanError(f"unknown {what} {v!r}{_hint(name, v, llama_cpp)}; choose one of: "
                                    f"{', '.join(known)}")
        if self.offload is not None:
            if self.offload not in OFFLOAD_MODES:
                raise PlanError(f"the offload mode must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")
            object.__setattr__(self, "offload", OffloadMode(self.offload))
        if self.expert_placement is not None:
            object.__setattr__(self, "expert_placement", _expert_placement(self.expert_placement))
        if self.vram_budget_bytes == 0 and self.gpu_layers:
            raise PlanError("a GPU memory budget of 0 contradicts placing layers on the GPU")
        f = self.balanced_speed_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise PlanError("the balanced speed fraction must lie in (0, 1]")
        q = self.balanced_max_quality_cost_pct
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q < float("inf"):
            raise PlanError("the balanced quality floor (most perplexity cost, %) must be a finite number >= 0")
        for name, what in (("usable_min_decode_tok_s", "the least usable decode speed (tok/s)"),
                           ("usable_max_ttft_s", "the longest usable time to first token (s)")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise PlanError(f"{what} must be a finite number >= 0, got {v!r}")

    @property
    def prompt(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.context

    def forced_expert_layers(self, moe_layers: int) -> int:
        """Of `moe_layers` MoE layers (those that may move), how many keep their routed experts in RAM under
        --expert-placement: none for gpu (or no placement forced), all for cpu, else the first N of them."""
        f = self.expert_placement
        return 0 if f in (None, "gpu") else moe_layers if f == "cpu" else min(f, moe_layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["quant"] = list(self.quant)
        d["kv_dtype"] = list(self.kv_dtype)
        d["prefer"] = self.prefer.value
        d["offload"] = self.offload.value if self.offload is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Request":
        d = dict(d)
        d["quant"] = tuple(d.get("quant") or ())
        d["kv_dtype"] = tuple(d.get("kv_dtype") or ())
        return cls(**d)


def _expert_placement(v) -> str | int:
    """"gpu", "cpu" or a whole number of MoE layers (0 is "gpu"), from a name, a digit string or an int."""
    if isinstance(v, str) and v.strip().lower() in EXPERT_PLACEMENTS:
        return v.strip().lower()
    if isinstance(v, str) and v.strip().isascii() and v.strip().isdigit():  # "3", not another script's digits
        v = int(v.strip())
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise PlanError(f"request.expert_placement must be {' or '.join(EXPERT_PLACEMENTS)} or a number of MoE layers "
                        f"(those of the first N in RAM), got {v!r}")
    return v or "gpu"


def _int(req: Request, name: str, minimum: int, maximum: int | None, what: str) -> None:
    v = getattr(req, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(f"{what} must be a whole number, got {v!r}")
    if v < minimum or (maximum is not None and v > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise PlanError(f"{what} must be {bound}, got {v}")


def _hint(field: str, value: str, gguf: bool) -> str:
    """What a name another engine uses, or a close one, would be here: ": Q4_K_M is a GGUF file type: plan it with
    --engine llama.cpp (or ollama)", ": did you mean bnb-nf4?"."""
    import difflib

    weights = field == "quant"
    if not gguf and weights and value.upper() in GGUF_FILE_TYPES:
        return f": {value.upper()} is a GGUF file type: plan it with --engine llama.cpp (or --engine ollama)"
    if not gguf and not weights and value.lower() in LLAMA_CPP_KV_DTYPES:
        return (f": {value.lower()} is llama.cpp's cache type: plan it with --engine llama.cpp; vramplan's runtime "
                "caches in bf16, fp16, fp8 or quanto-int4/int2")
    if gguf and weights and value.lower() in SCHEMES:
        return f": {value.lower()} is vramplan's scheme: plan it without --engine, or name a GGUF type (Q4_K_M, Q8_0)"
    if gguf and not weights and value.lower() in KV_SCHEMES:
        return f": {value.lower()} is vramplan's cache dtype: llama.cpp caches in f16, q8_0 or q4_0"
    known = (GGUF_FILE_TYPES if weights else LLAMA_CPP_KV_DTYPES) if gguf else (SCHEMES if weights else KV_SCHEMES)
    close = [k for k in known if value.lower() in k.lower() and value] or difflib.get_close_matches(
        value, list(known), n=2, cutoff=0.6)
    return f": did you mean {' or '.join(close[:2])}?" if close else ""


def derived(req: Request, **changes) -> Request:
    """replace(req, **changes), one object for the same request and changes (the last few kept): a search derives the
    same few requests (compiled, each probed context, the engine's prefill chunk) again and again, and a Request
    checks itself whenever it is made."""
    return _DERIVED.get((req,), (*changes.items(),), lambda: replace(req, **changes))


_DERIVED = ObjectMemo(256)
