"""The offload engine (runtime/offload.py) on tiny saved models.

On the CPU, device="cpu" runs the very same code path (slots, flat buffers, per-layer
attributes, boundary crossings) with streams, events and pinning dropped: the same kernels
run on the same device in the same order, so the offloaded model's logits must be
bit-identical (torch.equal) to the model's without offload, and greedy tokens identical.
Three decoder layers, so that gpu_layers=0 streams three layers through two slots (every
forward reloads them) and gpu_layers=1 streams two.
"""

from __future__ import annotations

import pytest
import torch

from conftest import save_tiny_model, tiny_config
from vramplan.planner.errors import VramplanError
from vramplan.runtime.generate import first_logits, generate, synthetic_prompt
from vramplan.planner.quant import SCHEMES
from vramplan.runtime.load import load_model
from vramplan.runtime.tensors import count_tensor_bytes
from vramplan.runtime.offload import OffloadedLayer, apply_offload

ARCHS = ("llama", "qwen2", "gemma2")  # untied embeddings (llama, qwen2 with q/k/v biases), tied + sliding window
QUANTS = ("bf16", "bnb-nf4", "bnb-int8")
NUM_LAYERS = 3
PROMPT = synthetic_prompt(12, 512, seed=3)
PREFILL_CHUNK = 5
NEW_TOKENS = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on 2 shared cores: OpenMP threads spin-waiting for a busy core make them ~20x
    slower than one thread. Reference and offloaded runs both use this setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload-checkpoints")
    return {arch: save_tiny_model(tiny_config(arch, num_hidden_layers=NUM_LAYERS), root / arch, seed=7)
            for arch in (*ARCHS, "mixtral")}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """reference(arch, quant) -> (model, last logits, greedy tokens) without offload, computed once."""
    cache = {}

    def get(arch: str, quant: str):
        if (arch, quant) not in cache:
            model = load_model(checkpoints[arch], scheme=SCHEMES[quant]).model
            cache[arch, quant] = (model, first_logits(model, PROMPT, PREFILL_CHUNK), _greedy(model))
        return cache[arch, quant]

    return get


def _greedy(model) -> list[int]:
    return generate(model, PROMPT, max_new_tokens=NEW_TOKENS, prefill_chunk=PREFILL_CHUNK).tokens


def _decoder_layers(model):
    return model.model.layers


@pytest.mark.parametrize("gpu_layers", [0, 1])
@pytest.mark.parametrize("mode", ["stream", "cpu"])
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_model_gives_identical_logits_and_tokens(reference, arch, quant, mode, gpu_layers):
    model, ref_logits, ref_tokens = reference(arch, quant)
    originals = list(_decoder_layers(model))
    engine = apply_offload(model, gpu_layers=gpu_layers, mode=mode, device="cpu")
    try:
        assert engine.offloaded_layers == tuple(range(gpu_layers, NUM_LAYERS))
        wrapped = [isinstance(layer, OffloadedLayer) for layer in _decoder_layers(model)]
        assert wrapped == [i >= gpu_layers for i in range(NUM_LAYERS)]
        assert engine.input_embedding_on_host == (arch != "gemma2")  # gemma2 ties lm_head to the embedding
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
        assert _greedy(model) == ref_tokens
    finally:
        engine.detach()
    assert list(_decoder_layers(model)) == originals


def test_streaming_really_reloads_the_slots(reference):
    """Three layers through two slots: every forward copies each offloaded layer once, and the
    bit-for-bit comparisons above can fail: stale slots or a wrong KV-cache index change the logits."""
    model, ref_logits, _ = reference("llama", "bnb-nf4")
    with apply_offload(model, gpu_layers=0, mode="stream", device="cpu") as engine:
        assert len(engine.stream._slots) == 2 and engine.slot_bytes == 2 * engine.layer_buffer_bytes
        assert engine.stream._slots[0].module.self_attn.config is model.config  # shared, not copied
        first_logits(model, PROMPT[:, :1], 1)  # the first forward also loads layer 0 itself
        assert engine.h2d_bytes_last_forward == 4 * engine.layer_buffer_bytes
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
        assert engine.h2d_bytes_last_forward == 3 * engine.layer_buffer_bytes  # layers 1, 2, then 0 for the next
        assert all(slot.verified for slot in engine.stream._slots)

        load = engine.stream._load
        engine.stream._load = lambda index, slot: setattr(slot, "layer", index) or slot  # no copy: stale weights
        assert not torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
        engine.stream._load = load
        for slot in engine.stream._slots:
            slot.layer = None  # they say they hold layers they never received
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)

        key = engine.stream._attribute_keys.index(("self_attn", "layer_idx"))
        engine.stream._attribute_values = {i: values[:key] + (0,) + values[key + 1:]
                                    for i, values in engine.stream._attribute_values.items()}
        try:  # every layer on KV-cache entry 0
            broken = first_logits(model, PROMPT, PREFILL_CHUNK)
        except RuntimeError:  # that entry grows three times per chunk: the mask no longer fits
            broken = None
        assert broken is None or not torch.equal(broken, ref_logits)
    assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("mode", ["stream", "cpu"])
def test_host_bytes_are_the_offloaded_layers_tensor_bytes(checkpoints, quant, mode):
    model = load_model(checkpoints["llama"], scheme=SCHEMES[quant]).model
    if quant == "bnb-nf4" and mode == "stream":
        # On AVX512-BF16 CPUs bnb 4-bit repacks weight and absmax (bf16) on its first forward;
        # stream mode takes that form up front, so count the layers in it. (Not for int8:
        # its first forward moves SCB where count_tensor_bytes does not look.)
        first_logits(model, PROMPT, PREFILL_CHUNK)
    offloaded = torch.nn.ModuleList(_decoder_layers(model)[1:])
    before = count_tensor_bytes(offloaded)["cpu"]
    with apply_offload(model, gpu_layers=1, mode=mode, device="cpu") as engine:
        assert engine.host_bytes == before
        after = count_tensor_bytes(offloaded)["cpu"]
        if mode == "stream":
            # every offloaded tensor now lives in the layers' flat buffers (+ alignment padding)
            assert after == engine.host_buffer_bytes == 2 * engine.layer_buffer_bytes
            assert 0 <= engine.host_buffer_bytes - engine.host_bytes < 256 * 64
            assert engine.slot_bytes == 2 * engine.layer_buffer_bytes
        else:
            assert after == before and engine.host_buffer_bytes == engine.slot_bytes == 0
        assert engine.pinned_bytes == 0  # nothing is pinned without CUDA
        summary = engine.summary()
        assert summary["offloaded_layers"] == [1, 2] and summary["host_bytes"] == before


@pytest.mark.parametrize("mode", ["stream", "cpu"])
def test_detach_restores_the_model(reference, mode):
    model, ref_logits, ref_tokens = reference("qwen2", "bnb-int8")
    originals = list(_decoder_layers(model))
    engine = apply_offload(model, gpu_layers=1, mode=mode, device="cpu")
    with pytest.raises(VramplanError, match="already offloaded"):
        apply_offload(model, gpu_layers=1, mode=mode, device="cpu")
    engine.detach()
    engine.detach()  # idempotent
    assert list(_decoder_layers(model)) == originals
    assert not any(isinstance(m, OffloadedLayer) for m in model.modules())
    assert not model.get_input_embeddings()._forward_pre_hooks and not model.model._forward_pre_hooks
    assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
    assert _greedy(model) == ref_tokens


def test_quanto_layers_stream_and_compute_on_cpu(reference):
    for quant in ("quanto-int8", "quanto-int4"):
        model, ref_logits, _ = reference("llama", quant)
        for mode in ("stream", "cpu"):
            with apply_offload(model, gpu_layers=0, mode=mode, device="cpu"):
                assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits), (quant, mode)


@pytest.mark.parametrize("mode", ["stream", "cpu"])
def test_moe_layers_with_fused_experts_stream(reference, mode):
    """Mixtral keeps its experts as 3-D parameters (not nn.Linear): they stream like any tensor."""
    model, ref_logits, ref_tokens = reference("mixtral", "bf16")
    with apply_offload(model, gpu_layers=0, mode=mode, device="cpu"):
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
        assert _greedy(model) == ref_tokens


def test_all_layers_on_the_device_offloads_nothing(reference):
    model, ref_logits, _ = reference("gemma2", "bf16")
    with apply_offload(model, gpu_layers=NUM_LAYERS, mode="stream", device="cpu") as engine:
        assert engine.offloaded_layers == () and engine.host_bytes == engine.slot_bytes == 0
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)


def test_bad_arguments_are_clear_errors(reference):
    model, _, _ = reference("llama", "bf16")
    for gpu_layers in (-1, NUM_LAYERS + 1, 1.5, True):
        with pytest.raises(VramplanError, match=r"gpu_layers=.* is outside 0\.\.3"):
            apply_offload(model, gpu_layers=gpu_layers, mode="stream", device="cpu")
    with pytest.raises(VramplanError, match="unknown offload mode 'disk'; one of stream, cpu"):
        apply_offload(model, gpu_layers=1, mode="disk", device="cpu")
    with pytest.raises(VramplanError, match="unsupported device"):
        apply_offload(model, gpu_layers=1, mode="cpu", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(VramplanError, match="sees no CUDA GPU"):
            apply_offload(model, gpu_layers=1, mode="stream", device="cuda")
    assert not any(isinstance(m, OffloadedLayer) for m in model.modules())  # nothing was half-applied


def test_model_not_on_the_cpu_and_mixed_layers_are_refused(checkpoints):
    model = load_model(checkpoints["llama"], scheme=SCHEMES["bf16"]).model
    layers = _decoder_layers(model)
    layers[2].mlp.down_proj = torch.nn.Linear(256, 64, bias=True, dtype=torch.bfloat16)  # layer 2 differs
    originals = list(layers)
    with pytest.raises(VramplanError, match="one structure; layer 2 differs from layer 1"):
        apply_offload(model, gpu_layers=1, mode="stream", device="cpu")
    assert list(layers) == originals and not model.model._forward_pre_hooks  # refused before touching anything
    with apply_offload(model, gpu_layers=1, mode="cpu", device="cpu"):  # computing them on the CPU is fine
        first_logits(model, PROMPT, PREFILL_CHUNK)
    layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.empty(256, 64, device="meta"), requires_grad=False)
    with pytest.raises(VramplanError, match="entirely on the CPU; this one has tensors on meta"):
        apply_offload(model, gpu_layers=1, mode="cpu", device="cpu")


# --- on a CUDA GPU ----------------------------------------------------------------------


def _resident_logits(checkpoint, quant):
    model = load_model(checkpoint, scheme=SCHEMES[quant], cpu_alone=False).model  # the engine places it
    engine = apply_offload(model, gpu_layers=NUM_LAYERS, mode="stream", device="cuda")
    logits, tokens = first_logits(model, PROMPT, PREFILL_CHUNK), _greedy(model)
    engine.detach()
    return model, logits, tokens


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_gpu_offload_matches_the_model_on_the_gpu(checkpoints, quant):
    """Stream mode runs the same kernels on the same shapes (slot tensors are 256-byte aligned views,
    as aligned as the allocator's): bit-identical to all layers resident. cpu mode runs two of the
    three layers with CPU kernels, which accumulate in another order: relative logit error < 5 %
    (bf16 rounds at 2**-8 ~ 0.4 % per op; a wrong layer or cache entry gives ~100 %)."""
    model, ref_logits, ref_tokens = _resident_logits(checkpoints["llama"], quant)
    for gpu_layers in (0, 1):
        with apply_offload(model, gpu_layers=gpu_layers, mode="stream", device="cuda") as engine:
            assert engine.pinned_bytes == engine.host_buffer_bytes > 0
            assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
            assert _greedy(model) == ref_tokens
    with apply_offload(model, gpu_layers=1, mode="cpu", device="cuda"):
        logits = first_logits(model, PROMPT, PREFILL_CHUNK)
        assert logits.device.type == "cuda"
        assert float((logits - ref_logits).norm() / ref_logits.norm()) < 0.05
        assert len(_greedy(model)) == NEW_TOKENS


@pytest.mark.gpu
def test_gpu_cpu_mode_gives_gemv_only_to_the_layers_the_cpu_computes(checkpoints):
    """As `vramplan run` loads an offloaded plan (cpu_alone=False): the resident layer and lm_head stay Linears on the
    GPU, the layers the CPU computes get Bf16Rows where it pays, and the logits stay within bf16's rounding of an
    all-GPU run's (the CPU's kernels sum in another order)."""
    from vramplan.runtime.quantize import Bf16Rows

    _, ref_logits, _ = _resident_logits(checkpoints["llama"], "bf16")
    model = load_model(checkpoints["llama"], scheme=SCHEMES["bf16"], cpu_alone=False).model
    assert "Bf16Rows" not in {type(m).__name__ for m in model.modules()}
    layers = list(_decoder_layers(model))
    with apply_offload(model, gpu_layers=1, mode="cpu", device="cuda"):
        kinds = [{type(m).__name__ for m in layer.modules()} for layer in layers]
        assert "Bf16Rows" not in kinds[0] and type(model.lm_head) is torch.nn.Linear
        assert model.lm_head.weight.device.type == "cuda"
        assert all(("Bf16Rows" in k) == Bf16Rows.pays_here() for k in kinds[1:])
        logits = first_logits(model, PROMPT, PREFILL_CHUNK)
        assert float((logits - ref_logits).norm() / ref_logits.norm()) < 0.05


@pytest.mark.gpu
def test_gpu_host_tensors_are_pinned_and_slots_are_reused(checkpoints):
    model = load_model(checkpoints["llama"], scheme=SCHEMES["bnb-nf4"], cpu_alone=False).model
    with apply_offload(model, gpu_layers=0, mode="stream", device="cuda") as engine:
        for index in engine.offloaded_layers:
            layer = engine._originals[index]
            assert engine.stream._host_buffers[index].is_pinned()
            assert layer.mlp.down_proj.weight.data.is_pinned()
            assert layer.mlp.down_proj.weight.quant_state.absmax.is_pinned()
        assert model.lm_head.weight.device.type == "cuda" and model.model.norm.weight.device.type == "cuda"
        assert model.model.embed_tokens.weight.device.type == "cpu"  # untied: the lookup stays on the host
        slot_pointers = [slot.buffer.data_ptr() for slot in engine.stream._slots]
        first_logits(model, PROMPT, PREFILL_CHUNK)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        for _ in range(3):
            first_logits(model, PROMPT, PREFILL_CHUNK)
            assert engine.h2d_bytes_last_forward == 3 * engine.layer_buffer_bytes
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated  # nothing allocated per layer: the two slots are reused
        assert [slot.buffer.data_ptr() for slot in engine.stream._slots] == slot_pointers
        assert all(slot.verified for slot in engine.stream._slots)


@pytest.mark.gpu
def test_gpu_copies_run_on_a_side_stream_while_layers_compute(tmp_path):
    """A profile of one prefill: host-to-device copies run on another stream than the compute
    kernels, and at least one of them overlaps a compute kernel in time."""
    from torch.profiler import ProfilerActivity, profile

    config = tiny_config("llama", num_hidden_layers=6, hidden_size=1024, intermediate_size=4096,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    model = load_model(save_tiny_model(config, tmp_path / "wide"), scheme=SCHEMES["bf16"], cpu_alone=False).model
    ids = synthetic_prompt(512, 512, seed=0)
    with apply_offload(model, gpu_layers=1, mode="stream", device="cuda") as engine:
        first_logits(model, ids, 512)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            first_logits(model, ids, 512)
            torch.cuda.synchronize()
        compute_stream = torch.cuda.current_stream().cuda_stream
        assert engine.stream._copy_stream.cuda_stream != compute_stream
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    copies = [e for e in events if "HtoD" in e.name() or "Memcpy" in e.name()]
    kernels = [e for e in events if "Memcpy" not in e.name() and "Memset" not in e.name()]
    assert copies and kernels
    copy_streams = {e.device_resource_id() for e in copies if e.duration_ns() > 0}
    kernel_streams = {e.device_resource_id() for e in kernels}
    assert copy_streams - kernel_streams, (copy_streams, kernel_streams)
    overlapping = [c for c in copies for k in kernels
                   if c.device_resource_id() != k.device_resource_id()
                   and c.start_ns() < k.end_ns() and k.start_ns() < c.end_ns()]
    assert overlapping


# ---------------------------------------------------------------- several devices, experts in RAM
# On a machine without GPUs "cpu:1" is a device of its own to the engine: the per-device placement, the hooks that
# carry the hidden state and the shared kwargs across, and the final norm/lm_head's way back all run; only the copies
# are no-ops. What real GPUs add (peer copies, per-device caches and streams) is owed to a multi-GPU machine.

@pytest.mark.parametrize("mode,gpu_layers,split", [("none", 3, (1, 2)), ("stream", 2, (1, 1)), ("cpu", 2, (2, 0))])
def test_layers_split_over_devices_give_identical_logits_and_tokens(reference, mode, gpu_layers, split):
    model, ref_logits, ref_tokens = reference("llama", "bf16")
    with apply_offload(model, gpu_layers=gpu_layers, mode=mode, device="cpu", devices=["cpu", "cpu:1"],
                       gpu_layers_per_device=split) as engine:
        expected = ["cpu"] * split[0] + ["cpu:1"] * split[1]
        assert engine.summary()["layer_devices"] == expected
        crossings = [h for h in engine._hooks if getattr(h, "id", None) is not None]
        assert len(crossings) >= 2 + (split[1] > 0) * split[1]  # embedding, base kwargs, each layer on cpu:1
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
        assert _greedy(model) == ref_tokens


def test_split_hooks_really_carry_the_inputs_to_the_other_device(reference, monkeypatch):
    """The layers on the second device get their inputs through the engine's boundary, once per layer and forward."""
    model, ref_logits, _ = reference("llama", "bf16")
    with apply_offload(model, gpu_layers=3, mode="none", device="cpu", devices=["cpu", "cpu:1"],
                       gpu_layers_per_device=(1, 2)) as engine:
        moved = []
        real = engine._boundary.move
        def spy(value, device):  # the boundary recurses: count the calls with a layer's (args, kwargs)
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
                moved.append(device)
            return real(value, device)

        monkeypatch.setattr(engine._boundary, "move", spy)
        first_logits(model, PROMPT[:, :4], 4)
        assert moved == [torch.device("cpu", 1)] * 2  # layers 1 and 2, one forward


def test_bad_device_splits_are_clear_errors(reference):
    model, _, _ = reference("llama", "bf16")
    with pytest.raises(VramplanError, match="must sum to gpu_layers=3"):
        apply_offload(model, gpu_layers=3, mode="none", device="cpu", devices=["cpu", "cpu:1"],
                      gpu_layers_per_device=(1, 1))
    with pytest.raises(VramplanError, match="over at most 1 devices"):
        apply_offload(model, gpu_layers=3, mode="none", device="cpu", gpu_layers_per_device=(1, 2))
    with pytest.raises(VramplanError, match="offload mode none places every layer"):
        apply_offload(model, gpu_layers=2, mode="none", device="cpu")
    assert not any(isinstance(m, OffloadedLayer) for m in model.modules())


def test_experts_kept_in_ram_compute_on_the_cpu(reference):
    """Mixtral with the first two layers' routed experts in RAM: the experts get their own hooks (inputs to the CPU,
    output back to the layer's device), the rest of each layer stays with its device; same logits and tokens."""
    model, ref_logits, ref_tokens = reference("mixtral", "bf16")
    with apply_offload(model, gpu_layers=NUM_LAYERS, mode="none", device="cpu", devices=["cpu", "cpu:1"],
                       gpu_layers_per_device=(1, 2), expert_layers_on_cpu=2) as engine:
        assert engine.summary()["expert_layers_in_ram"] == [0, 1]
        experts = engine._experts_in_ram[1]
        assert experts is _decoder_layers(model)[1].mlp.experts
        assert experts._forward_pre_hooks and experts._forward_hooks
        assert not _decoder_layers(model)[2].mlp.experts._forward_pre_hooks
        resident = {id(m) for m, _ in engine._resident}
        assert id(experts) not in resident and id(_decoder_layers(model)[1].self_attn) in resident
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), ref_logits)
        assert _greedy(model) == ref_tokens
    assert not _decoder_layers(model)[1].mlp.experts._forward_pre_hooks


@pytest.mark.parametrize("double_quant", [False, True])
def test_bnb4_cpu_packed_layer_bound_for_cuda_gets_the_cuda_layout_back(double_quant):
    """A bnb 4-bit layer that a CPU forward repacked (AVX512-BF16) and that then goes to CUDA: the weight and the
    absmax must be the CUDA form again. bitsandbytes 0.50.2 restores absmax only under double quantization; without
    it the engine does (fp32 [N*K/blocksize]). Runs on any CPU: the packing and the inverse are plain torch."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    from vramplan.runtime.stream import bnb4_device_form

    torch.manual_seed(0)
    layer = torch.nn.Sequential(bnb.nn.Linear4bit(256, 128, bias=False, compute_dtype=torch.bfloat16,
                                                  compress_statistics=double_quant, quant_type="nf4"))
    weight = bnb.nn.Params4bit(torch.randn(128, 256, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4",
                               compress_statistics=double_quant)._quantize("cpu")
    layer[0].weight = weight
    layer.eval()
    data, absmax = weight.data.clone(), weight.quant_state.absmax.clone()
    expected = F.dequantize_4bit(weight.data, weight.quant_state)
    weight.data, weight.quant_state = _convert_weight_packed_for_cpu(weight.data, weight.quant_state)
    assert weight.quant_state.absmax.shape != absmax.shape  # the CPU form really differs
    bnb4_device_form(layer, torch.device("cuda"))
    qs = layer[0].weight.quant_state
    assert not getattr(qs, "packing_format_for_cpu", False)
    assert (torch.equal(layer[0].weight.data, data) and qs.absmax.shape == absmax.shape
            and qs.absmax.dtype == absmax.dtype)
    got = F.dequantize_4bit(layer[0].weight.data, qs)
    if double_quant:  # bitsandbytes' own inverse re-quantizes the 8-bit statistics: within a bf16 step
        assert torch.allclose(got.float(), expected.float(), rtol=0, atol=expected.abs().max().item() / 64)
    else:
        assert torch.equal(qs.absmax, absmax) and torch.equal(got, expected)


def test_layers_the_cpu_computes_call_the_direct_kernels(tiny_checkpoints):
    """On a GPU machine the loader leaves quanto's QLinear (the model is not on the CPU alone); cpu-mode offload swaps
    the layers it computes on the CPU for the direct kernels (runtime.quantize.direct_kernels), with the same logits.
    Here the QLinear model is built by quanto's own backend, on the CPU, as a GPU machine's offloaded layers are."""
    import json

    from vramplan.runtime.quantize import backend

    config = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    # loaded for an offload engine to place (cpu_alone=False): none of the CPU path yet
    model = load_model(config, scheme=SCHEMES["bf16"], dummy_weights=True, seed=3, cpu_alone=False).model
    assert {type(m).__name__ for m in model.modules()} >= {"Linear"} and "Bf16Rows" not in {
        type(m).__name__ for m in model.modules()}
    backend(SCHEMES["quanto-int8"]).quantize(model, SCHEMES["quanto-int8"], torch.bfloat16, "cpu")
    before = first_logits(model, PROMPT, PREFILL_CHUNK)
    layers = list(_decoder_layers(model))
    assert len(layers) == 2 and all("QLinear" in {type(m).__name__ for m in layer.modules()} for layer in layers)
    with apply_offload(model, gpu_layers=1, mode="cpu", device="cpu") as engine:
        kinds = [{type(m).__name__ for m in layer.modules()} for layer in layers]
        assert "QLinear" in kinds[0] and "Int8Rows" not in kinds[0]  # resident: left alone
        assert all("Int8Rows" in k and "QLinear" not in k for k in kinds[1:])  # computed by the CPU: direct
        assert any("run vramplan's direct CPU kernels" in n for n in engine.notes)
        assert torch.equal(first_logits(model, PROMPT, PREFILL_CHUNK), before)


def test_bf16_layers_the_cpu_computes_decode_by_gemv(tiny_checkpoints):
    """A bf16 model loaded for the offload engine (cpu_alone=False, as `vramplan run` loads an offloaded plan) keeps
    its Linears (lm_head too); cpu-mode offload gives the layers it computes on the CPU runtime.quantize.Bf16Rows
    (where it pays: a CPU without native bf16), the resident ones keep theirs, and the logits stay within a bf16
    rounding of the model's own."""
    import json

    from vramplan.runtime.quantize import Bf16Rows

    config = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    model = load_model(config, scheme=SCHEMES["bf16"], dummy_weights=True, seed=3, cpu_alone=False).model
    assert "Bf16Rows" not in {type(m).__name__ for m in model.modules()}
    layers = list(_decoder_layers(model))
    step = PROMPT[:, :1]
    with torch.inference_mode():
        before = model(step).logits
    with apply_offload(model, gpu_layers=1, mode="cpu", device="cpu") as engine:
        kinds = [{type(m).__name__ for m in layer.modules()} for layer in layers]
        assert "Linear" in kinds[0] and "Bf16Rows" not in kinds[0]
        assert type(model.lm_head) is torch.nn.Linear
        if Bf16Rows.pays_here():
            assert all("Bf16Rows" in k and "Linear" not in k for k in kinds[1:])
            assert any("run vramplan's direct CPU kernels" in n for n in engine.notes)
        else:
            assert all("Bf16Rows" not in k for k in kinds)
        with torch.inference_mode():
            torch.testing.assert_close(model(step).logits, before, rtol=2 ** -6, atol=1e-3)
