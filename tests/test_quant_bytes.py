"""The planner's bytes per scheme equal what the real libraries allocate, tensor for tensor in total.

The planner side (planner/quant.py) is pure arithmetic; the runtime side loads the same tiny
checkpoint with bitsandbytes / optimum-quanto and counts every resident tensor
(runtime.load.count_tensor_bytes), right after loading.
"""

from __future__ import annotations

import json

import pytest

from vramplan.planner.architectures import spec_from_config
from vramplan.planner.memory import weight_costs
from vramplan.planner.quant import SCHEMES

pytest.importorskip("torch")


@pytest.mark.parametrize("quant", ["bf16", "bnb-int8", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "quanto-int8",
                                   "quanto-int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_planned_bytes_equal_loaded_bytes(load_tiny, tiny_checkpoints, arch, quant):
    config = json.loads((tiny_checkpoints[arch] / "config.json").read_text())
    spec = spec_from_config(config, name=arch)
    loaded = load_tiny(arch, quant)
    measured = sum(loaded.weights_bytes_by_device.values())
    # loaded on the CPU alone: lm_head as the scheme stores it there (quant.cpu_head_scheme)
    planned = weight_costs(spec, SCHEMES[quant], cpu_only=True).total_bytes
    # transformers keeps a few non-persistent buffers (RoPE inv_freq, original_inv_freq) the plan does not count:
    import torch

    buffers = sum(b.numel() * b.element_size() for n, b in loaded.model.named_buffers()
                  if "rotary_emb" in n and isinstance(b, torch.Tensor))
    assert planned == measured - buffers, (planned, measured, buffers)


@pytest.mark.parametrize("quant", ["quanto-int8", "quanto-int4"])
def test_a_tied_head_on_the_cpu_is_an_int8_copy_counted_exactly(tmp_path, quant):
    """On the CPU alone the quanto schemes store lm_head in int8 rows (quant.cpu_head_scheme); a tied embedding keeps
    its bf16 tensor for the lookup, so the head is a second copy: the plan counts both, and the logits stay those of the
    bf16 head within int8's rounding."""
    import torch

    from conftest import save_tiny_model, tiny_config
    from vramplan.runtime.generate import first_logits
    from vramplan.runtime.load import load_model

    config = tiny_config("qwen2", tie_word_embeddings=True)
    path = save_tiny_model(config, tmp_path / "tied")
    spec = spec_from_config(json.loads((path / "config.json").read_text()), name="tied")
    loaded = load_model(path, scheme=SCHEMES[quant])
    model = loaded.model
    assert type(model.lm_head).__name__ == "Int8Rows" and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert any("lm_head) is kept in int8 rows" in n and "tied embedding" in n for n in loaded.notes), loaded.notes
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary_emb" in n)
    costs = weight_costs(spec, SCHEMES[quant], cpu_only=True)
    assert costs.total_bytes == sum(loaded.weights_bytes_by_device.values()) - buffers
    vocab, hidden = spec.vocab_size, config.hidden_size
    assert costs.head_bytes - weight_costs(spec, SCHEMES[quant]).head_bytes == vocab * hidden + 2 * vocab
    assert costs.head_read_bytes == vocab * hidden + 2 * vocab + 2 * hidden  # the int8 head and the final norm

    ids = torch.arange(3, 19).unsqueeze(0)
    quantized = first_logits(model, ids, 64)
    row = torch.round(model.model.embed_tokens.weight[5].float() / model.lm_head.scale[5].float())
    assert (model.lm_head.data[5].float() - row).abs().max() <= 1  # absmax rows (quanto rounds in bf16)
    model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    model.lm_head.weight = model.model.embed_tokens.weight  # the bf16 head, tied again
    reference = first_logits(model, ids, 64)
    assert torch.nn.functional.cosine_similarity(quantized.flatten(), reference.flatten(), dim=0).item() > 0.999


def test_a_head_the_int8_kernel_cannot_take_stays_as_loaded():
    """torch's CPU int8 matmul needs in_features a multiple of 16: such a head stays in bf16, in the plan too."""
    from vramplan.planner.quant import cpu_head_scheme

    assert cpu_head_scheme(SCHEMES["quanto-int8"], 4096).name == "quanto-int8"
    assert cpu_head_scheme(SCHEMES["quanto-int4"], 4104) is None
    assert cpu_head_scheme(SCHEMES["bnb-int8"], 4096) is None and cpu_head_scheme(SCHEMES["bf16"], 4096) is None
    spec = spec_from_config({**json.loads(json.dumps(_TIED_ODD)), "model_type": "qwen2"}, name="odd")
    assert weight_costs(spec, SCHEMES["quanto-int8"], cpu_only=True) == weight_costs(spec, SCHEMES["quanto-int8"])


_TIED_ODD = dict(hidden_size=72, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=36, vocab_size=512, max_position_embeddings=512,
                 tie_word_embeddings=True)


def test_the_direct_int8_kernel_gives_quantos_numbers_on_quantos_tensors():
    """runtime.quantize.Int8Rows.from_quanto: the QLinear's own tensors (shared), the same kernel, the same output;
    a width the kernel cannot take on several rows goes through the dequantized matmul instead."""
    import torch
    from optimum.quanto import qint8
    from optimum.quanto.nn import QLinear

    from vramplan.runtime.quantize import Int8Rows

    torch.manual_seed(0)
    for in_features, rows in ((64, 1), (64, 7), (40, 1)):
        linear = torch.nn.Linear(in_features, 48, bias=True).to(torch.bfloat16)
        q = QLinear.from_module(linear, weights=qint8)
        q.freeze()
        direct = Int8Rows.from_quanto(q)
        assert direct.data.data_ptr() == q.weight._data.data_ptr() and direct.output_scale is q.output_scale
        x = torch.randn(1, rows, in_features, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(direct(x), q(x)), (in_features, rows)
    x = torch.randn(5, 40, dtype=torch.bfloat16)  # 40 % 16: quanto would hand several rows to the kernel, which crashes
    reference = x.float() @ (direct.data.float() * direct.scale.float()[:, None]).t() + direct.bias.float()
    assert torch.allclose(direct(x).float(), reference, atol=0.05, rtol=0.02)


def test_bf16_rows_give_linears_bits_on_linears_parameters():
    """runtime.quantize.Bf16Rows: the Linear's own Parameters (shared), one row by GEMV with the bias added before the
    rounding: F.linear's outputs to within their last bf16 bit (fp32 sums in another order); several rows go through
    F.linear itself."""
    import torch

    from vramplan.runtime.quantize import Bf16Rows

    torch.manual_seed(0)
    for in_features, out_features, bias in ((64, 48, True), (896, 4864, False), (72, 512, True)):
        linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
        rows = Bf16Rows.of(linear)
        assert rows.weight is linear.weight and rows.bias is linear.bias and isinstance(rows, torch.nn.Linear)
        for shape in ((1, 1, in_features), (in_features,), (1, 5, in_features)):
            x = torch.randn(shape, dtype=torch.bfloat16)
            with torch.inference_mode():
                ours, theirs = rows(x), linear(x)
            if x.numel() > in_features:
                assert torch.equal(ours, theirs)
            else:  # one bf16 rounding step apart at most, and only where the fp32 sums straddle it
                torch.testing.assert_close(ours, theirs, rtol=2 ** -7, atol=1e-5, msg=str((in_features, bias, shape)))
                assert (ours != theirs).float().mean() < 0.01


def test_bf16_rows_call_gemv_for_one_row_and_linear_for_several_or_off_the_cpu():
    """What Bf16Rows dispatches: mv / addmv for one row on the CPU; F.linear for several rows, and for an input on
    another device (here: meta), as a GPU's would be."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vramplan.runtime.quantize import Bf16Rows

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def ops(module, x) -> set[str]:
        with torch.inference_mode(), Ops() as mode:
            module(x)
        return mode.seen

    for bias in (False, True):
        rows = Bf16Rows.of(torch.nn.Linear(64, 48, bias=bias).to(torch.bfloat16).eval())
        assert not rows.training
        one = ops(rows, torch.randn(1, 1, 64, dtype=torch.bfloat16))
        assert one & {"mv", "addmv"} and not one & {"linear", "mm", "addmm"}, one
        several = ops(rows, torch.randn(1, 5, 64, dtype=torch.bfloat16))
        assert several & {"linear", "mm", "addmm"} and not several & {"mv", "addmv"}, several
        meta = Bf16Rows.of(torch.nn.Linear(64, 48, bias=bias, device="meta", dtype=torch.bfloat16))
        elsewhere = ops(meta, torch.randn(1, 1, 64, dtype=torch.bfloat16, device="meta"))
        assert not elsewhere & {"mv", "addmv"}, elsewhere


def test_loaded_for_an_offload_engine_a_model_gets_no_cpu_path(load_tiny, tiny_checkpoints):
    """load_model(cpu_alone=False), as run loads an offloaded plan: quanto stays QLinear and lm_head a Linear (the
    plan counts the scheme's head on a GPU machine), bf16 keeps its Linears; the engine decides per layer."""
    from vramplan.runtime.load import load_model

    for quant, kept in (("quanto-int8", "QLinear"), ("bf16", "Linear")):
        loaded = load_model(tiny_checkpoints["llama"], scheme=SCHEMES[quant], cpu_alone=False)
        kinds = {type(m).__name__ for m in loaded.model.modules()}
        assert kept in kinds and not kinds & {"Int8Rows", "Int4Groups", "Bf16Rows"}, (quant, kinds)
        assert type(loaded.model.lm_head).__name__ == "Linear"
        assert not any("direct CPU kernels" in n or "kept in int8 rows" in n for n in loaded.notes)


def test_a_cpu_run_of_quanto_uses_the_direct_kernels(load_tiny):
    loaded = load_tiny("llama", "quanto-int8")
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert "Int8Rows" in kinds and "QLinear" not in kinds
    assert any("run vramplan's direct CPU kernels" in n for n in loaded.notes)
    int4 = load_tiny("llama", "quanto-int4").model
    kinds = {n.rsplit(".", 1)[-1]: type(m).__name__ for n, m in int4.named_modules()}
    # down_proj (in 256) is in tinygemm's groups of 128; the in-64 layers keep quanto's per-row 4-bit layout
    assert kinds["down_proj"] == "Int4Groups" and kinds["q_proj"] == "QLinear" and kinds["lm_head"] == "Int8Rows"


def test_the_direct_int4_kernel_gives_quantos_numbers_on_quantos_tensors():
    import torch
    from optimum.quanto import qint4
    from optimum.quanto.nn import QLinear

    from vramplan.runtime.quantize import Int4Groups

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, bias=True).to(torch.bfloat16)
    q = QLinear.from_module(linear, weights=qint4)
    q.freeze()
    direct = Int4Groups(q)
    assert direct.group_size == 128 and direct.data.data_ptr() == q.weight._data._data.data_ptr()
    for rows in (1, 5):
        x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(direct(x), q(x)), rows
    assert torch.allclose(direct.dequantize(), q.weight.dequantize().float(), atol=1e-2)


def test_a_cpu_bf16_run_decodes_by_gemv_with_transformers_tokens(load_tiny, tiny_checkpoints):
    """A bf16 model run on the CPU alone swaps each plain Linear for Bf16Rows (shared Parameters, a tied head still
    tied) and decodes the same greedy tokens, with logits within a bf16 rounding, as transformers' own load."""
    import torch
    from transformers import AutoModelForCausalLM

    from vramplan.runtime.generate import generate, synthetic_prompt

    from vramplan.runtime.quantize import Bf16Rows

    for arch in ("llama", "qwen2"):
        loaded = load_tiny(arch, "bf16")
        model = loaded.model
        linears = [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)]
        if not Bf16Rows.pays_here():  # a CPU with native bf16: F.linear stays
            assert set(linears) == {"Linear"}
            continue
        assert linears and set(linears) == {"Bf16Rows"}, (arch, set(linears))
        assert any("bf16 by mv (this CPU's default)" in n for n in loaded.notes)
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight is model.get_input_embeddings().weight
        reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.bfloat16).eval()
        ids = synthetic_prompt(12, model.config.vocab_size, seed=3)
        with torch.inference_mode():
            ours = generate(model, ids, max_new_tokens=6, prefill_chunk=64)
            theirs = reference.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
            step = torch.tensor([[int(ids[0, -1])]])
            torch.testing.assert_close(model(step).logits, reference(step).logits, rtol=2 ** -6, atol=1e-3)
        assert list(ours.tokens) == theirs[0, ids.shape[1]:].tolist(), arch
