"""Compiled decode: a static KV cache and one decode step compiled by torch.compile, gpt-fast style.

Eager decode issues every op of every layer from Python: on the H200 a Llama-3.2-1B bf16 step took 8.4-11.5 ms of
which the GPU was busy 3.9 (bench/results/gpu-nvidia-h200-2). Here the step is one compiled graph over a transformers
StaticCache (fixed shapes: the cache holds `max_len` tokens from the start), replayed as a CUDA graph on a GPU (mode
"reduce-overhead" with coordinate-descent tuning: GPU_COMPILE_OPTIONS); on a CPU inductor compiles it ("default"). The
prefill stays eager, through the same cache. The first decode steps compile (tens of seconds; `vramplan run` does them
in its untimed warm-up and reports their time); inductor's on-disk cache (inductor_cache) makes a later run's compile
shorter.

What compiles: unquantized weights (bf16, fp16) with a KV cache of the model's dtype, every layer on one device; on an
NVIDIA GPU also int8-wo / int4-wo (runtime.weight_only), which decode compiled only; on a machine without a GPU also
quanto's int8 / int4 / w8a8 layers, whose modules call torch's CPU kernels themselves
(runtime.quantize.direct_kernels: _weight_int8pack_mm, _weight_int4pack_mm_for_cpu, _int_mm are ops inductor calls as
they are, and it fuses w8a8's per-token quantization into the ops around it). bitsandbytes' kernels break the graph,
quanto's compiled decode on a GPU is unmeasured, and the offload engine moves weights between steps
(planner.request.compile_schemes says so to the planner).

MoE: transformers' own experts (bf16) route through its experts implementation (grouped_mm by default in 5.x), which
compiles; vramplan's quantized experts (runtime.experts.QuantizedExperts) take their unrolled forward inside the
graph, each routed expert read at an index the graph carries: dynamo's capture_scalar_outputs, set here for such a
model; on CUDA int8-wo's and int4-wo's experts are gathered at the index tensor instead (no host sync: one CUDA
graph).
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from .experts import QuantizedExperts
from .files import CacheDirError, cache_dir
from .generate import cache_argument, forward_logits

INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
# torch.compile's options for a GPU decode step: mode "reduce-overhead" (CUDA graphs: "triton.cudagraphs") plus
# coordinate-descent tuning, as gpt-fast's generate.py (meta-pytorch/gpt-fast 05f7c16) sets it for its published runs
# (torch.compile takes a mode or options, not both)
GPU_COMPILE_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}


def inductor_cache() -> str | None:
    """Where inductor keeps what it compiled, reused by the next run: $TORCHINDUCTOR_CACHE_DIR, else vramplan's
    cache's inductor/ (kept across reboots, where torch's default lives under /tmp), set for this process."""
    if not os.environ.get(INDUCTOR_CACHE_VAR):
        try:
            os.environ[INDUCTOR_CACHE_VAR] = str(cache_dir() / "inductor")
        except CacheDirError:
            return None
    return os.environ[INDUCTOR_CACHE_VAR]


class StaticDecoder:
    """A model's static cache of `max_len` tokens and its compiled decode step."""

    def __init__(self, model: nn.Module, max_len: int, device: torch.device):
        from transformers import StaticCache

        self.model, self.device, self.max_len = model, torch.device(device), max_len
        self.inductor_cache = inductor_cache()
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self._arg = cache_argument(type(model))
        if any(isinstance(m, QuantizedExperts) for m in model.modules()):
            torch._dynamo.config.capture_scalar_outputs = True  # each routed expert's index, read inside the graph
        # on a GPU: reduce-overhead's CUDA graphs, and coordinate-descent tuning, with which inductor turns a one-row
        # matmul into a fused reduction (torch/_inductor/decomposition.py `mm`), so that int8 rows converted in it (and
        # experts gathered into it) are read once, as int8: gpt-fast's generate.py sets the same (GPU_COMPILE_OPTIONS)
        self.mode = "reduce-overhead" if self.device.type == "cuda" else "default"
        options = dict(options=GPU_COMPILE_OPTIONS) if self.device.type == "cuda" else dict(mode=self.mode)
        # dynamo keeps its compiled graphs on the step's code object, at most recompile_limit (8) of them: each decoder
        # steps through a copy of its own, so that the models one process compiles (a re-plan, the tests) do not add up
        step = types.FunctionType(StaticDecoder._eager_step.__code__.replace(), globals(), "_eager_step")
        self._step = torch.compile(types.MethodType(step, self), fullgraph=True, dynamic=False, **options)

    def _eager_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=token, position_ids=position.view(1, 1), cache_position=position, use_cache=True,
                         **{self._arg: self.cache})
        return out.logits[:, -1, :].float()

    def static_forward(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        """An eager forward of `input_ids` at positions start.. through the static cache (the prefill's chunks):
        fp32 logits of the last position, [1, vocab]."""
        n = input_ids.shape[1]
        if start + n > self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} tokens; positions {start}..{start + n - 1} "
                             "do not fit")
        return forward_logits(self.model, input_ids, start, self.cache, cache_position=True)

    def static_decode(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """One compiled decode step for `token` ([1, 1]) at `position`: its fp32 logits, [1, vocab]. The position is a
        tensor input, so every step replays the same graph."""
        if position >= self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} tokens; position {position} does not fit")
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed: its buffers may go
        pos = torch.tensor([position], device=token.device)
        return self._step(token, pos).clone()

    def reset(self) -> None:
        """An empty cache (its tensors kept: the compiled graph reads them in place)."""
        self.cache.reset()
