"""Pre-quantized layouts from real tensors where the package runs on the CPU (issue 38): a tiny llama quantized by
bitsandbytes through transformers and saved, its safetensors header read back tensor by tensor, against
planner/published.py's count of what such a checkpoint stores (and vramplan's own scheme of the same layout, what a
plan of it counts). AWQ, GPTQ and compressed-tensors need packages that do not run here: their layouts are tested from
the published shapes (tests/test_published_formats.py, tests/test_published_sizes.py)."""

from __future__ import annotations

import json
import math

import pytest

from conftest import save_tiny_model, tiny_config
from vramplan.planner.published import owner_of, published, stored_bytes
from vramplan.planner.published_scheme import published_scheme
from vramplan.planner.sources import spec_from_config

pytest.importorskip("bitsandbytes")
torch = pytest.importorskip("torch")
ST_BYTES = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    root = tmp_path_factory.mktemp("bnb-published")
    src = save_tiny_model(tiny_config("llama"), root / "src")
    out = {}
    for name, q in (("nf4-dq", BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.bfloat16)),
                    ("int8", BitsAndBytesConfig(load_in_8bit=True))):
        m = AutoModelForCausalLM.from_pretrained(src, quantization_config=q, device_map="cpu", dtype=torch.bfloat16)
        m.save_pretrained(root / name)
        out[name] = root / name
    return out


def _header_bytes_by_parameter(path) -> dict[str, int]:
    from safetensors import safe_open

    have: dict[str, int] = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in f.keys():
            s = f.get_slice(k)
            have[owner_of(k)] = have.get(owner_of(k), 0) + math.prod(s.get_shape()) * ST_BYTES[s.get_dtype()]
    return have


@pytest.mark.parametrize("name,scheme,per_tensor_slack", [("int8", "bnb-int8", 0), ("nf4-dq", "bnb-nf4-dq", 4)])
def test_a_bitsandbytes_checkpoint_stores_what_published_counts(saved, name, scheme, per_tensor_slack):
    """int8: exact, side tensors included (SCB, weight_format). nf4 with double quantization: within a few bytes per
    tensor, the length of the quant_state JSON's offset written as text (planner/published.py says so)."""
    config = json.loads((saved[name] / "config.json").read_text())
    spec, pub = spec_from_config(config, name=name), published(config, name)
    have = _header_bytes_by_parameter(saved[name])
    assert set(have) == {t.name for t in spec.tensors}  # every stored tensor belongs to a parameter the spec knows
    for t in spec.tensors:
        assert abs(have[t.name] - stored_bytes(pub, t)) <= per_tensor_slack, t.name
    # what a plan of the checkpoint counts: vramplan's own scheme of that layout, without the JSON's bytes
    ps = published_scheme(spec)
    assert ps.name == scheme
    assert ps.bytes_of(spec.tensors, "bfloat16") == pytest.approx(sum(have.values()), rel=0.02)
