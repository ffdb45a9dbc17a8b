"""One capacity (planner.capacity): every engine's GPUs and RAM come from `capacity(hw, req)`, budgets applied, and on
unified memory what the GPU holds comes out of the RAM for every engine."""

from __future__ import annotations

from vramplan.planner.capacity import capacity
from vramplan.planner.engines.llamacpp import plan_llamacpp
from vramplan.planner.profiles import resolve_profile
from vramplan.planner.request import Request
from vramplan.planner.sources import model_spec
from vramplan.planner.units import GiB


def test_budgets_apply_per_device_and_to_ram():
    hw = resolve_profile("rtx-4090")[0]
    plain = capacity(hw, Request(context=4096))
    assert plain.gpus == (hw.gpu.memory_bytes,) and plain.ram_bytes == hw.host.ram_bytes and not plain.unified
    budget = capacity(hw, Request(context=4096, vram_budget_bytes=8 * GiB, ram_budget_bytes=16 * GiB))
    assert budget.gpus == (8 * GiB,) and budget.ram_bytes == 16 * GiB and budget.ram_left(5 * GiB) == 16 * GiB
    assert "--vram-budget" in budget.gpu_source and "--ram-budget" in budget.ram_source
    cpu = capacity(resolve_profile("cpu-ddr5-desktop")[0], Request(context=4096))
    assert cpu.gpus == () and cpu.ram_left(0) == cpu.ram_bytes


def test_unified_memory_is_one_pool():
    hw = resolve_profile("apple-m2-ultra-192gb")[0]
    cap = capacity(hw, Request(context=4096))
    assert cap.unified and cap.ram_left(100 * GiB) == hw.host.ram_bytes - 100 * GiB


def test_llama_cpp_on_a_mac_counts_the_gpu_share_out_of_ram():
    """The audit's false fit: DeepSeek-R1 Q3_K_M (297 GiB) was said to fit a 192 GB Mac as 138 GiB "GPU" + 160 GiB
    "RAM". Every llama.cpp candidate that fits now holds both sides within the one pool."""
    hw = resolve_profile("apple-m2-ultra-192gb")[0]
    p = plan_llamacpp(model_spec("deepseek-r1"), hw, Request(context=8192, engine="llama.cpp"))
    for c in p.candidates:
        if c.fits:
            assert c.memory.gpu_total_bytes + c.memory.cpu.total_bytes <= hw.host.ram_bytes, c.weight_quant
    q3 = next(c for c in p.candidates if c.weight_quant == "Q3_K_M" and c.kv_dtype == "f16")
    assert not q3.fits and "unified memory" in q3.reason


def test_vllm_takes_the_ram_budget():
    """vLLM's weight offload sizes its RAM from the same capacity: with a RAM budget too small for the 43 GiB of
    Qwen2.5-32B's bf16 weights it offloads on a 4090, it needs more nodes instead."""
    from vramplan.planner.engines import plan_for_engine

    hw, spec = resolve_profile("rtx-4090")[0], model_spec("qwen2.5-32b")

    def vllm(**kw):
        p = plan_for_engine(spec, hw, Request(context=8192, quant=("bf16",), **kw))
        return next(e for e in p.engines if e.engine == "vllm")

    roomy, tight = vllm(), vllm(ram_budget_bytes=8 * GiB)
    assert roomy.fits and "43.00 GiB/GPU in RAM" in roomy.placement
    assert not tight.fits and "in RAM" not in tight.placement and "needs 4 nodes" in tight.reason
