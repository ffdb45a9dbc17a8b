"""runtime/layerwise.py: a safetensors checkpoint read and quantized a decoder layer at a time gives the model
transformers' loader gives (tensor for tensor, token for token), from bf16, fp32 and sharded files; a checkpoint it
cannot read name for name goes to transformers' loader."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_ARCHS, save_tiny_model, tiny_config
from vramplan.planner.quant import SCHEMES

torch = pytest.importorskip("torch")

from vramplan.runtime import load as load_module  # noqa: E402
from vramplan.runtime.layerwise import load_layerwise, mismatches, stored_tensors  # noqa: E402
from vramplan.runtime.load import load_model  # noqa: E402

LAYERWISE_NOTE = "read and quantized one decoder layer at a time"


def _load(path, quant, *, layerwise: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not layerwise:
            m.setattr(load_module, "LAYERWISE_BACKENDS", ())
        loaded = load_model(path, scheme=SCHEMES[quant])
    assert any(LAYERWISE_NOTE in n for n in loaded.notes) is layerwise
    return loaded


def _state(model) -> dict:
    """Every tensor the model holds (quanto's inner data and scales included), by name, as plain CPU tensors."""
    out = {}
    for name, t in model.state_dict().items():
        out[name] = t.dequantize() if hasattr(t, "dequantize") and type(t) is not torch.Tensor else t
    return out


def _tokens(model, n: int = 6) -> list[int]:
    ids = torch.tensor([[5, 17, 33, 2, 9, 41, 100]])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=-1)
    return out


@pytest.mark.parametrize("quant", ["quanto-int8", "quanto-int4"])
def test_layerwise_load_equals_transformers_loader(tiny_checkpoints, monkeypatch, quant):
    path = tiny_checkpoints["qwen2"]
    ours = _load(path, quant, layerwise=True, monkeypatch=monkeypatch)
    theirs = _load(path, quant, layerwise=False, monkeypatch=monkeypatch)
    a, b = _state(ours.model), _state(theirs.model)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert ours.weights_bytes_by_device == theirs.weights_bytes_by_device
    assert _tokens(ours.model) == _tokens(theirs.model)


def test_fp32_and_sharded_checkpoints_read_as_the_bf16_one(tiny_checkpoints, tmp_path, monkeypatch):
    """Stored in fp32 (converted at the read) and in shards of at most 100 kB (an index), the same model."""
    config = tiny_config("llama")
    fp32 = save_tiny_model(config, tmp_path / "fp32", dtype="float32")
    bf16 = save_tiny_model(config, tmp_path / "bf16", dtype="bfloat16")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(bf16).save_pretrained(tmp_path / "shards", max_shard_size="100kB")
    assert json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {s.dtype for s in stored_tensors(fp32).values()} == {torch.float32}
    states = [_state(_load(p, "quanto-int8", layerwise=True, monkeypatch=monkeypatch).model)
              for p in (bf16, fp32, tmp_path / "shards")]
    for other in states[1:]:
        assert other.keys() == states[0].keys()
        assert all(torch.equal(other[k], states[0][k]) for k in other)


def test_unquantized_layers_and_norms_hold_the_files_values(tiny_checkpoints, monkeypatch):
    """What is not quantized (norms, the embedding) is the stored tensor, bit for bit."""
    from safetensors.torch import load_file

    path = tiny_checkpoints["llama"]
    stored = load_file(path / "model.safetensors")
    model = _load(path, "quanto-int4", layerwise=True, monkeypatch=monkeypatch).model
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert torch.equal(model.model.layers[1].input_layernorm.weight, stored["model.layers.1.input_layernorm.weight"])
    assert torch.equal(model.model.norm.weight, stored["model.norm.weight"])


def test_a_checkpoint_named_otherwise_goes_to_transformers(tmp_path, monkeypatch):
    """A parameter stored under another name or shape: load_layerwise refuses it before reading anything, and
    load_model's transformers path reports it, as it did before."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tiny_config("llama"), tmp_path / "renamed")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.renamed"] = tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = tiny_config("llama")
    assert load_layerwise(path, config, torch.bfloat16, SCHEMES["quanto-int8"], "cpu", False) is None
    from vramplan.planner.errors import CheckpointError

    with pytest.raises(CheckpointError, match="missing"):
        load_model(path, scheme=SCHEMES["quanto-int8"])


def test_mismatches_names_what_differs(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    stored = stored_tensors(tiny_checkpoints["llama"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert mismatches(model, stored) == []
    with torch.device("meta"):
        wider = AutoModelForCausalLM.from_config(tiny_config("llama", intermediate_size=512))
    assert set(mismatches(wider, stored)) == {f"model.layers.{i}.mlp.{p}.weight" for i in range(2)
                                              for p in ("gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_every_tiny_architecture_loads_to_the_same_tokens(tiny_checkpoints, monkeypatch, arch):
    """Each architecture the suite builds, read a layer at a time (mixtral's experts stored one matrix per expert
    under block_sparse_moe, stacked as transformers' conversion mapping says): the same greedy tokens as
    transformers' loader."""
    ours = _load(tiny_checkpoints[arch], "quanto-int8", layerwise=True, monkeypatch=monkeypatch)
    theirs = _load(tiny_checkpoints[arch], "quanto-int8", layerwise=False, monkeypatch=monkeypatch)
    assert _tokens(ours.model, 4) == _tokens(theirs.model, 4)


@pytest.mark.parametrize("arch, overrides", [
    ("mixtral", {}),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1,
                       mlp_only_layers=[]))])
def test_moe_experts_stored_per_expert_are_stacked_as_transformers_stacks_them(tmp_path, arch, overrides):
    """Every tensor of the model equals transformers' load (bf16: nothing quantized, so the stacked experts are
    compared element for element), the gate/up halves in their order."""
    from transformers import AutoConfig

    from conftest import TINY_COMMON

    values = {**TINY_COMMON, **(dict(num_local_experts=4, num_experts_per_tok=2) if arch == "mixtral" else {}),
              **overrides}
    config = AutoConfig.for_model(arch, **values)
    path = save_tiny_model(config, tmp_path / arch)
    stored = stored_tensors(path)
    assert any(".experts.0." in n for n in stored) and not any(n.endswith("gate_up_proj") for n in stored)
    ours = load_layerwise(path, config, torch.bfloat16, SCHEMES["bf16"], "cpu", False)
    assert ours is not None
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and any(k.endswith("experts.gate_up_proj") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_dtype_the_loader_does_not_convert_goes_to_transformers(tmp_path):
    """A parameter stored in fp8 (a dtype this loader leaves out): load_layerwise refuses before reading anything."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tiny_config("llama"), tmp_path / "fp8")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].to(
        torch.float8_e4m3fn)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.1.mlp.down_proj.weight" not in stored_tensors(path)
    assert load_layerwise(path, tiny_config("llama"), torch.bfloat16, SCHEMES["quanto-int8"], "cpu", False) is None


def test_an_expert_part_of_another_shape_is_not_stacked(tmp_path):
    """Every part of a stacked expert must have the fused tensor's trailing shape: an up_proj of half the width sends
    the checkpoint to transformers' loader, never into a slice it would fill in part."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from conftest import TINY_COMMON

    config = AutoConfig.for_model("qwen3_moe", **{**TINY_COMMON, "num_experts": 2, "num_experts_per_tok": 1,
                                                  "moe_intermediate_size": 64, "mlp_only_layers": []})
    path = save_tiny_model(config, tmp_path / "moe")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    tensors[name] = tensors[name][:, :32].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert load_layerwise(path, config, torch.bfloat16, SCHEMES["bf16"], "cpu", False) is None
