"""The planner's bytes per scheme equal what the real libraries allocate, tensor for tensor in total.

The planner side (planner/quant.py) is pure arithmetic; the runtime side loads the same tiny
checkpoint with bitsandbytes / optimum-quanto and counts every resident tensor
(runtime.load.count_tensor_bytes), right after loading.
"""

from __future__ import annotations

import json

import pytest

from vramplan.planner.architectures import spec_from_config
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
    planned = SCHEMES[quant].bytes_of(spec.tensors)
    # transformers keeps a few non-persistent buffers (RoPE inv_freq, original_inv_freq) the plan does not count:
    import torch

    buffers = sum(b.numel() * b.element_size() for n, b in loaded.model.named_buffers()
                  if "rotary_emb" in n and isinstance(b, torch.Tensor))
    assert planned == measured - buffers, (planned, measured, buffers)
