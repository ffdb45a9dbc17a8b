"""Tensors transformers holds in fp32 whatever the load dtype, by transformers version.

A model class lists them in `_keep_in_fp32_modules_strict`: `from_pretrained` upcasts them to fp32 when the
load dtype is bf16 or fp16 (modeling_utils `_get_dtype_plan`). Since 5.24 the routers of the DeepSeek family
also create them in fp32 (`torch.zeros(..., dtype=torch.float32)`), so `from_config` holds them in fp32 too;
vramplan's dummy-weights build applies the same list (runtime/dummy.py), so both load paths hold what a
checkpoint load holds. The planner imports no transformers: the caller passes the installed version
(runtime/inventory.py reads it from transformers' __init__.py, without importing it); without one, the latest
verified version's rule applies (planning for a machine that is not this one).

Verified (VERIFIED_TRANSFORMERS): 5.17 and 5.18 by reading their modeling files (the wheels); 5.23 by the byte
tests of tests/test_moe_experts.py, which passed with deepseek_v3's router weight in bf16; 5.24 by those tests
and by tests/test_mla.py, which compares every tensor's dtype with the rule. deepseek_v2's and glm4_moe's
router weights are taken to have moved to fp32 with deepseek_v3's (5.24; 5.19-5.22 were not read).
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..modelspec import ModelSpec

# The transformers versions whose fp32 tensors this table was checked against (see the module docstring).
VERIFIED_TRANSFORMERS = ("5.17", "5.18", "5.23", "5.24")
OLDEST_VERIFIED = (5, 17)
FP32_DTYPE = "float32"

# model_type -> (tensor-name suffix, first version that holds it in fp32). Read from each class's
# `_keep_in_fp32_modules_strict` and its router's constructor (models/<type>/modeling_<type>.py).
KEEP_IN_FP32: dict[str, tuple[tuple[str, tuple[int, int]], ...]] = {
    # 5.17-5.23: no list; 5.24: ["gate.weight"]
    "deepseek_v2": (("gate.weight", (5, 24)),),
    # 5.17-5.23: ["e_score_correction_bias"] (from_pretrained only); 5.24: + "gate.weight", both made in fp32
    "deepseek_v3": (("gate.e_score_correction_bias", OLDEST_VERIFIED), ("gate.weight", (5, 24))),
    # 5.17: ["e_score_correction_bias"], made in fp32; 5.24: + "gate.weight"
    "glm4_moe": (("gate.e_score_correction_bias", OLDEST_VERIFIED), ("gate.weight", (5, 24))),
    # 5.17: ["gate.weight", "moe_statics"]; 5.24: ["gate.weight", "e_score_correction_bias"]: the same tensors
    # (checkpoints name the bias mlp.moe_statics.*, the loaded model mlp.gate.moe_statics.*)
    "ernie4_5_moe": (("gate.weight", OLDEST_VERIFIED), ("moe_statics.e_score_correction_bias", OLDEST_VERIFIED)),
}


def parse_version(version: str | None) -> tuple[int, int]:
    """(major, minor) of a transformers version string ("5.24.0", "5.25.0.dev0"); None or unreadable: the latest
    verified version."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m is None:
        return tuple(int(x) for x in VERIFIED_TRANSFORMERS[-1].split("."))  # type: ignore[return-value]
    return int(m.group(1)), int(m.group(2))


def keep_in_fp32(spec: ModelSpec, transformers_version: str | None) -> ModelSpec:
    """The spec with `held_dtype` float32 on the tensors the given transformers version holds in fp32, and a note
    saying which version the rule followed."""
    rule = KEEP_IN_FP32.get(spec.model_type)
    if not rule:
        return spec
    version = parse_version(transformers_version)
    suffixes = tuple(s for s, since in rule if version >= since)
    tensors = tuple(replace(t, held_dtype=FP32_DTYPE) if t.layer is not None and t.name.endswith(suffixes) else t
                    for t in spec.tensors)
    shown = transformers_version or f"{VERIFIED_TRANSFORMERS[-1]} (none given: the latest verified)"
    note = (f"router tensors kept in fp32 as transformers {shown} loads them ({', '.join(suffixes)}; "
            f"rule checked against transformers {', '.join(VERIFIED_TRANSFORMERS)})")
    if not suffixes:
        note = (f"transformers {shown} keeps no router tensor in fp32 for {spec.model_type} "
                f"(rule checked against transformers {', '.join(VERIFIED_TRANSFORMERS)})")
    return replace(spec, tensors=tensors, notes=spec.notes + (note,))
