"""vramplan's vLLM rules against vLLM 0.33.0 itself, where it is installed (skipped otherwise: vLLM is no dependency).

vLLM imports without a GPU, but its platform detection finds none: a stand-in CUDA platform answers the few questions
these pure functions ask (the GPU's memory, name and compute capability). Compared: the accepted-value tables, the
`vllm serve` parser on the commands the export writes, the batch defaults, the longest --max-model-len, and the KV
cache groups and bytes per request (vllm/v1/core/kv_cache_planning.py) on real models' layer specs.

Run it with vLLM 0.33.0 installed beside vramplan's dependencies, e.g. in a throwaway venv:
    python -m venv --system-site-packages /tmp/vllmvenv
    /tmp/vllmvenv/bin/pip install --no-deps vllm==0.33.0   (then the pure-Python packages its imports ask for)
    /tmp/vllmvenv/bin/python -m pytest tests/test_vllm_reference.py
"""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest

from vramplan.planner.engines import vllm_rules as rules

vllm = pytest.importorskip("vllm")
if vllm.__version__ != rules.VLLM_VERSION:
    pytest.skip(f"vLLM {vllm.__version__} installed; the rules follow {rules.VLLM_VERSION}", allow_module_level=True)

import torch  # noqa: E402  (vLLM needs it; only where vLLM is installed)
import vllm.platforms as platforms  # noqa: E402
from vllm.platforms.interface import Platform, PlatformEnum  # noqa: E402

from vramplan.planner.engines.vllm import VLLMModel, weight_format  # noqa: E402
from vramplan.planner.profiles import resolve_profile  # noqa: E402
from vramplan.planner.request import Request  # noqa: E402
from vramplan.planner.sources import model_spec  # noqa: E402
from vramplan.planner.architectures import spec_from_config  # noqa: E402
from test_vllm_rules import FLAG_CASES, SCOUT, export  # noqa: E402


class StandInCuda(Platform):
    """A CUDA platform without a GPU: what get_batch_defaults and the configs ask, from a vramplan GPUSpec."""

    _enum = PlatformEnum.CUDA
    device_name = device_type = "cuda"
    dispatch_key = "CUDA"
    gpu = None

    @classmethod
    def get_device_total_memory(cls, device_id=0):
        return cls.gpu.memory_bytes

    @classmethod
    def get_device_name(cls, device_id=0):
        return cls.gpu.name

    @classmethod
    def is_device_capability(cls, capability, device_id=0):
        return tuple(int(x) for x in cls.gpu.compute_capability.split(".")) == tuple(capability)

    @classmethod
    def support_hybrid_kv_cache(cls):
        return True


platforms._current_platform = StandInCuda()
StandInCuda.gpu = resolve_profile("h100-sxm")[0].gpu

RTX4090 = resolve_profile("rtx-4090")[0]
H100 = resolve_profile("h100-sxm")[0]


# ---------------------------------------------------------------- tables and the parser
def test_tables_are_vllms():
    from vllm.config.cache import CacheConfig, CacheDType
    from vllm.config.model import ModelDType
    from vllm.config.parallel import DistributedExecutorBackend
    from vllm.config.quantization import _ONLINE_SHORTHANDS
    from vllm.model_executor.layers import quantization as q

    assert rules.QUANTIZATION_METHODS == get_args(q.QuantizationMethods)
    assert rules.DEPRECATED_QUANTIZATION_METHODS == tuple(q.DEPRECATED_QUANTIZATION_METHODS)
    assert rules.ONLINE_QUANTIZATION == tuple(_ONLINE_SHORTHANDS)
    assert rules.KV_CACHE_DTYPES == get_args(CacheDType) and rules.MODEL_DTYPES == get_args(ModelDType)
    assert rules.DISTRIBUTED_EXECUTOR_BACKENDS == get_args(DistributedExecutorBackend)
    assert rules.DEFAULT_GPU_MEMORY_UTILIZATION == CacheConfig().gpu_memory_utilization
    assert rules.BLOCK_SIZE == CacheConfig.DEFAULT_BLOCK_SIZE
    # vocab_parallel_embedding imports CUDA kernels at import time: read its constant instead
    vocab = Path(vllm.__file__).parent / "model_executor/layers/vocab_parallel_embedding.py"
    assert f"DEFAULT_VOCAB_PADDING_SIZE = {rules.VOCAB_PADDING}\n" in vocab.read_text()


def test_cuda_graph_estimate_is_on_by_default(monkeypatch):
    import vllm.envs as envs

    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    assert envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is True


@pytest.mark.parametrize("model, hw, req, quant, kv, choice", FLAG_CASES, ids=lambda x: getattr(x, "name", None))
def test_vllm_serve_parses_the_export(model, hw, req, quant, kv, choice):
    from vllm.config.cache import CacheConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = export(model, hw, req, quant, kv, **choice).details["argv"]
    argv = argv[argv.index("serve") + 1:]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    assert args.model_tag == argv[0] and args.max_model_len == req.context
    assert args.quantization is None or args.quantization in QUANTIZATION_METHODS
    CacheConfig(cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization)


# ---------------------------------------------------------------- batch defaults and the longest max_model_len
@pytest.mark.parametrize("name", ["rtx-4090", "a100-80gb-sxm", "h100-sxm", "h200", "l40s"])
def test_batch_defaults_are_get_batch_defaults(name):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    gpu = resolve_profile(name)[0].gpu
    for g in (gpu, replace(gpu, memory_bytes=180 * 2**30)):
        StandInCuda.gpu = g
        tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
        assert (tokens[UsageContext.OPENAI_API_SERVER], seqs[UsageContext.OPENAI_API_SERVER]) == \
            rules.BATCH_DEFAULTS[rules.batch_tier(g)]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v3", "gemma-3-27b", "microsoft/Phi-3-mini-4k-instruct",
                                  "qwen2.5-7b", "mistralai/Mistral-7B-v0.3"])
def test_derived_max_model_len_is_vllms(name):
    from transformers import AutoConfig
    from vllm.config.model import _get_and_verify_max_len

    spec = model_spec(name)
    cfg = {k: v for k, v in spec.config.items() if k != "quantization_config"}
    hf = AutoConfig.for_model(**cfg)
    arch = types.SimpleNamespace(derived_max_model_len_and_key=(spec.max_context, "max_position_embeddings"))
    derived = _get_and_verify_max_len(hf, arch, None, None, False, None)
    assert rules.derived_max_model_len(spec)[0] == derived


# ---------------------------------------------------------------- the KV cache
def _vllm_specs(spec, tp: int, kv_dtype, block: int):
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)

    out = {}
    for i, a in enumerate(spec.attention):
        name = f"model.layers.{i}.self_attn.attn"
        heads = dict(num_kv_heads=max(1, a.num_kv_heads // tp), head_size=a.head_dim, dtype=kv_dtype)
        if a.kind == "mla":
            out[name] = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=a.mla_cache_dim, dtype=kv_dtype)
        elif a.chunked:
            out[name] = ChunkedLocalAttentionSpec(block_size=block, attention_chunk_size=a.window, **heads)
        elif a.window is not None:
            out[name] = SlidingWindowSpec(block_size=block, sliding_window=a.window, **heads)
        else:
            out[name] = FullAttentionSpec(block_size=block, **heads)
    return out


def _vllm_config(max_model_len: int, batched: int, pp: int):
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig

    sched = SchedulerConfig.default_factory(max_model_len=max_model_len, max_num_batched_tokens=batched,
                                            async_scheduling=True)
    vc = VllmConfig(scheduler_config=sched, cache_config=CacheConfig(), parallel_config=ParallelConfig())
    vc.parallel_config.pipeline_parallel_size = pp  # set after: its validator counts this machine's GPUs
    vc.cache_config.kv_cache_layout = "LBNHC"
    vc.model_config = types.SimpleNamespace(max_model_len=max_model_len, original_max_model_len=max_model_len,
                                            supports_kv_cache_grouping=False)
    return vc


KV_CASES = [("gemma-2-9b", RTX4090, 8192, 1, 1, "auto"), ("gemma-3-27b", H100, 32768, 1, 1, "auto"),
            ("gemma-3-27b", H100, 32768, 2, 2, "fp8"), ("gemma-2-9b", RTX4090, 4096, 1, 3, "auto"),
            ("llama-3.1-8b", RTX4090, 32768, 1, 2, "auto"), ("microsoft/Phi-3-mini-4k-instruct", RTX4090, 4096, 1, 1,
                                                             "auto"),
            ("gpt-oss-20b", H100, 65536, 1, 1, "auto"), ("deepseek-v3", H100, 32768, 8, 2, "auto"),
            ("deepseek-v3", H100, 32768, 8, 2, "fp8"), ("llama-4-scout-text", H100, 131072, 2, 1, "auto")]


@pytest.mark.parametrize("name, hw, ctx, tp, pp, kv", KV_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_kv_bytes_per_request_are_vllms(name, hw, ctx, tp, pp, kv, monkeypatch):
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    spec = spec_from_config(SCOUT, name=name) if name == "llama-4-scout-text" else model_spec(name)
    m = VLLMModel(spec, hw, Request(context=ctx), weight_format("bf16"), kv)
    vc = _vllm_config(ctx, m.tokens, pp)
    assert vc.max_in_flight_tokens == rules.max_in_flight_tokens(pp, m.tokens)
    specs = _vllm_specs(spec, tp, torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16, m.attention_backend()[1])
    groups = planning.get_global_kv_cache_groups(vc, [specs])
    ours = rules.kv_groups(m.layer_kv(tp))
    assert sorted(len(g.layer_names) for g in groups) == sorted(len(g.layers) for g in ours)
    builder = get_kv_cache_config_builder(vc)
    start = 0
    for n in rules.pp_partitions(spec.num_layers, pp):
        stage = range(start, start + n)
        start += n
        worker = {k: v for i, (k, v) in enumerate(specs.items()) if i in stage}
        projected = planning._project_kv_cache_groups_to_worker(groups, worker)
        theirs = (planning._max_memory_usage_bytes_from_groups(builder, vc, projected),
                  planning._pool_bytes_per_block_from_builder(builder, vc, projected))
        assert rules.kv_request_bytes(ours, stage, ctx, vc.max_in_flight_tokens) == theirs


# ---------------------------------------------------------------- the attention backend and the MoE padding
def _needs_vllm_cuda_ops(module: str):
    """A vLLM module that loads its CUDA extension on import: skipped where torch is a CPU build (no libcuda, no
    libtorch_cuda), as on the project's CI."""
    import importlib

    try:
        return importlib.import_module(module)
    except (ImportError, AttributeError) as e:  # AttributeError: vLLM's custom ops never registered
        pytest.skip(f"{module} needs vLLM's CUDA extension: {str(e).splitlines()[0][:120]}")


@pytest.mark.parametrize("cc, mla, kv, nope", [((9, 0), True, "auto", 128), ((9, 0), True, "fp8", 128),
                                               ((10, 0), True, "auto", 128), ((8, 0), True, "fp8", 128),
                                               ((12, 0), True, "auto", 128), ((8, 9), False, "auto", None),
                                               ((9, 0), False, "fp8", None)])
def test_attention_backend_is_vllms_first_valid_one(cc, mla, kv, nope):
    """The first backend of vLLM's priority list that takes this capability and cache dtype, and its preferred block
    (what update_block_size_for_backend sets from DEFAULT_BLOCK_SIZE)."""
    cuda = _needs_vllm_cuda_ops("vllm.platforms.cuda")
    _get_backend_priorities = cuda._get_backend_priorities
    from vllm.platforms.interface import DeviceCapability

    cap = DeviceCapability(*cc)
    for backend in _get_backend_priorities(mla, cap, kv_cache_dtype=None if kv == "auto" else kv):
        try:
            cls = backend.get_class()
        except Exception:  # a backend whose kernels this machine lacks is not vLLM's pick on a GPU either: next
            continue
        dense = "SPARSE" not in backend.name
        if dense and cls.supports_compute_capability(cap) and kv in cls.supported_kv_cache_dtypes:
            break
    gpu = replace(H100.gpu, compute_capability=f"{cc[0]}.{cc[1]}")
    assert rules.attention_backend(gpu, mla, kv, nope) == (backend.name, cls.get_preferred_block_size(16))


@pytest.mark.parametrize("backend, cc", [("TRITON", "9.0"), ("MARLIN", "8.0"),
                                         ("FLASHINFER_TRTLLM_MXFP4_BF16", "10.0")])
def test_mxfp4_padding_is_vllms(backend, cc):
    oracle = _needs_vllm_cuda_ops("vllm.model_executor.layers.fused_moe.oracle.mxfp4")

    gpu = replace(H100.gpu, compute_capability=cc)
    name, inter_multiple, hidden_multiple = rules.mxfp4_moe_backend(gpu)
    assert name == backend
    for inter in (2880, 1440, 720, 360):
        assert oracle.mxfp4_round_up_hidden_size_and_intermediate_size(oracle.Mxfp4MoeBackend[name], 2880, inter) == \
            (rules.round_up(2880, hidden_multiple), rules.round_up(inter, inter_multiple))
