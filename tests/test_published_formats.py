"""planner/published.py: what a pre-quantized checkpoint stores, counted from its config's quantization_config.

Exact per-tensor bytes on hand-worked shapes, totals against published checkpoint sizes where an exact figure is
cited, skip lists with the matching rules of the library that reads them, owner_of over every stored name, and
one-line ConfigErrors for malformed configs. Pure and fast: configs are built here from the catalog."""

from __future__ import annotations

import pytest

from vramplan.planner.errors import ConfigError
from vramplan.planner.modelspec import Kind, Role, TensorSpec
from vramplan.planner.published import (
    QUALITY_AWQ, QUALITY_GPTQ, QUALITY_GPTQ_ACT_ORDER, QUALITY_MXFP4, awq_zeros_width, bnb_quant_state_json,
    is_quantized, owner_of, published, stored_bytes, stored_tensors, total_stored_bytes,
)
from vramplan.planner.quant import SCHEMES
from vramplan.planner.sources import catalog_config, model_spec

WHERE = "test config.json"


def with_quant(model: str, q: dict | None, **extra) -> dict:
    config = {**catalog_config(model), **extra}
    if q is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = q
    return config


def linear(name: str, out_f: int, in_f: int, layer: int | None = 0) -> TensorSpec:
    return TensorSpec(name=name, shape=(out_f, in_f), role=Role.ATTENTION, kind=Kind.LINEAR, layer=layer)


AWQ_GEMM = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
            "zero_point": True}  # Qwen/Qwen2.5-7B-Instruct-AWQ's quantization_config
GPTQ_4 = {"bits": 4, "group_size": 128, "desc_act": False, "quant_method": "gptq", "sym": True}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
                "dynamic": False, "actorder": None}}}}


def test_no_quantization_config_is_none():
    assert published(with_quant("Qwen/Qwen2.5-7B", None), WHERE) is None


# ------------------------------------------------------------------ hand-worked per-tensor layouts

def test_awq_gemm_layout_and_bytes():
    pub = published(with_quant("Qwen/Qwen2.5-7B", AWQ_GEMM, torch_dtype="float16"), WHERE)
    assert (pub.name, pub.method, pub.bits, pub.group_size, pub.load_dtype) == ("awq-int4-g128", "awq", 4, 128,
                                                                                  "float16")
    assert pub.description == "AWQ 4-bit, group 128, zero points (GEMM layout)"
    q = linear("model.layers.0.self_attn.q_proj.weight", 3584, 3584)
    assert stored_tensors(pub, q) == (
        ("model.layers.0.self_attn.q_proj.qweight", (3584, 448), "I32"),  # [in, out / 8]
        ("model.layers.0.self_attn.q_proj.qzeros", (28, 448), "I32"),  # [in / 128, out / 8]
        ("model.layers.0.self_attn.q_proj.scales", (28, 3584), "F16"))  # [in / 128, out]
    assert stored_bytes(pub, q) == 3584 * 448 * 4 + 28 * 448 * 4 + 28 * 3584 * 2 == 6_673_408


def test_awq_gemv_pads_the_zeros_width():
    pub = published(with_quant("Qwen/Qwen2.5-7B", {**AWQ_GEMM, "version": "gemv", "group_size": 64}), WHERE)
    # 18944 / 64 = 296 groups -> ceil(296 / 8) = 37 int32 columns, padded to a multiple of 2 for group 64
    assert awq_zeros_width(18944, 64) == 38 and awq_zeros_width(4096, 128) == 4 and awq_zeros_width(4096, 32) == 16
    down = linear("model.layers.0.mlp.down_proj.weight", 3584, 18944)
    assert stored_tensors(pub, down) == (
        ("model.layers.0.mlp.down_proj.qweight", (3584, 2368), "I32"),  # [out, in / 8]
        ("model.layers.0.mlp.down_proj.qzeros", (3584, 38), "I32"),
        ("model.layers.0.mlp.down_proj.scales", (3584, 304), "F16"))  # [out, 8 x zeros width]


def test_gptq_layout_stores_g_idx_whatever_desc_act():
    for desc_act, quality in ((False, QUALITY_GPTQ), (True, QUALITY_GPTQ_ACT_ORDER)):
        pub = published(with_quant("meta-llama/Llama-2-7b-hf", {**GPTQ_4, "desc_act": desc_act}), WHERE)
        assert pub.name == "gptq-int4-g128" and pub.quality == quality and pub.load_dtype == "float16"
        q = linear("model.layers.0.self_attn.q_proj.weight", 4096, 4096)
        assert stored_tensors(pub, q) == (
            ("model.layers.0.self_attn.q_proj.qweight", (512, 4096), "I32"),  # [in x 4 / 32, out]
            ("model.layers.0.self_attn.q_proj.qzeros", (32, 512), "I32"),  # [in / 128, out x 4 / 32]
            ("model.layers.0.self_attn.q_proj.scales", (32, 4096), "F16"),
            ("model.layers.0.self_attn.q_proj.g_idx", (4096,), "I32"))
        assert stored_bytes(pub, q) == 8_388_608 + 65_536 + 262_144 + 16_384


def test_gptq_3_and_8_bits_and_one_group():
    pub3 = published(with_quant("meta-llama/Llama-2-7b-hf", {**GPTQ_4, "bits": 3}), WHERE)
    q = linear("model.layers.0.self_attn.q_proj.weight", 4096, 4096)
    assert [s for _, s, _ in stored_tensors(pub3, q)] == [(384, 4096), (32, 384), (32, 4096), (4096,)]
    pub8 = published(with_quant("meta-llama/Llama-2-7b-hf", {**GPTQ_4, "bits": 8, "group_size": -1}), WHERE)
    assert pub8.name == "gptq-int8-gall" and pub8.group_size is None and pub8.stand_in == "quanto-int8"
    assert [s for _, s, _ in stored_tensors(pub8, q)] == [(1024, 4096), (1, 1024), (1, 4096), (4096,)]


def test_llama2_7b_gptq_total_hand_worked():
    """TheBloke/Llama-2-7B-GPTQ's main branch (4-bit, g128, no act-order) is listed at 3.90 GB; no exact byte count was
    found to cite, so the hand-worked total is asserted: 32 layers x (n / 2 packed + scales + qzeros + g_idx) + fp16
    embeddings, lm_head and norms. (AutoGPTQ of that time also wrote zero fp16 biases, 2,718,464 B, which the model's
    own tensor list does not have.)"""
    spec = model_spec("Llama-2-7b-hf")
    pub = published(with_quant("meta-llama/Llama-2-7b-hf", GPTQ_4), WHERE)
    per_layer_linear = 4 * 4096 * 4096 + 3 * 4096 * 11008
    scales = (4 * 32 * 4096 + 2 * 32 * 11008 + 86 * 4096) * 2
    g_idx = (6 * 4096 + 11008) * 4
    expected = 32 * (per_layer_linear // 2 + scales + scales // 4 + g_idx) + 2 * 32000 * 4096 * 2 + 65 * 4096 * 2
    assert total_stored_bytes(pub, spec.tensors) == expected == 3_893_862_400


def test_gptq_lm_head_true_quantizes_the_head():
    pub = published(with_quant("meta-llama/Llama-2-7b-hf", {**GPTQ_4, "lm_head": True}), WHERE)
    head = TensorSpec(name="lm_head.weight", shape=(32000, 4096), role=Role.LM_HEAD, kind=Kind.LINEAR)
    assert is_quantized(pub, head)
    assert not is_quantized(published(with_quant("meta-llama/Llama-2-7b-hf", GPTQ_4), WHERE), head)


def test_fp8_block_deepseek_v3_and_its_experts():
    pub = published(catalog_config("deepseek-ai/DeepSeek-V3"), WHERE)
    assert (pub.name, pub.block, pub.stand_in, pub.load_dtype) == ("fp8-block128x128", (128, 128), "quanto-int8",
                                                                    "bfloat16")
    assert "assumption" in pub.quality.source
    spec = model_spec("DeepSeek-V3")
    kv_a = spec.tensor("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")  # [576, 7168]
    assert stored_tensors(pub, kv_a) == (
        ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), "F8_E4M3"),
        ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv", (5, 56), "F32"))  # ceil(576/128) = 5
    assert stored_bytes(pub, kv_a) == 576 * 7168 + 5 * 56 * 4
    experts = spec.tensor("model.layers.3.mlp.experts.gate_up_proj")  # [256, 4096, 7168]
    assert stored_tensors(pub, experts) == (
        ("model.layers.3.mlp.experts.gate_up_proj", (256, 4096, 7168), "F8_E4M3"),
        ("model.layers.3.mlp.experts.gate_up_proj_weight_scale_inv", (256, 32, 56), "F32"))
    router = spec.tensor("model.layers.3.mlp.gate.weight")
    assert not is_quantized(pub, router) and stored_bytes(pub, router) == 256 * 7168 * 2


def test_fp8_per_tensor_static_and_fbgemm():
    q = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}  # AutoFP8's config
    pub = published(with_quant("meta-llama/Llama-3.1-8B", q), WHERE)
    t = linear("model.layers.0.mlp.down_proj.weight", 4096, 14336)
    assert pub.name == "fp8-tensor" and pub.skip == ("lm_head",)
    assert stored_tensors(pub, t) == (("model.layers.0.mlp.down_proj.weight", (4096, 14336), "F8_E4M3"),
                                      ("model.layers.0.mlp.down_proj.weight_scale", (), "F32"),
                                      ("model.layers.0.mlp.down_proj.input_scale", (), "F32"))
    assert stored_bytes(pub, t) == 4096 * 14336 + 8
    fb = published(with_quant("meta-llama/Llama-3.1-8B", {"quant_method": "fbgemm_fp8",
                                                          "modules_to_not_convert": ["lm_head"]}), WHERE)
    assert stored_bytes(fb, t) == 4096 * 14336 + 4096 * 4  # + fp32 weight_scale [out, 1]


def test_bnb_prequantized_equals_the_scheme_plus_its_quant_state_json():
    t = linear("model.layers.0.self_attn.q_proj.weight", 3584, 3584)
    for dq in (False, True):
        q = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
             "bnb_4bit_use_double_quant": dq, "bnb_4bit_compute_dtype": "bfloat16"}
        pub = published(with_quant("Qwen/Qwen2.5-7B", q), WHERE)
        scheme = SCHEMES[pub.scheme]
        assert pub.scheme == ("bnb-nf4-dq" if dq else "bnb-nf4") and pub.quality == scheme.quality
        state = bnb_quant_state_json(pub, 3584, 3584)
        assert state.startswith('{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [3584, 3584]')
        # quant.py counts the double-quantization offset as a 4-byte fp32 tensor; the checkpoint writes it in the JSON
        assert stored_bytes(pub, t) == scheme.tensor_bytes(t) - (4 if dq else 0) + len(state)
        names = [n for n, _, _ in stored_tensors(pub, t)]
        assert names[0] == t.name and names[-1] == t.name + ".quant_state.bitsandbytes__nf4"
    pub8 = published(with_quant("Qwen/Qwen2.5-7B", {"quant_method": "bitsandbytes", "load_in_8bit": True,
                                                     "llm_int8_skip_modules": ["lm_head"]}), WHERE)
    assert pub8.scheme == "bnb-int8" and stored_bytes(pub8, t) == SCHEMES["bnb-int8"].tensor_bytes(t) + 1
    assert pub8.skip == ("lm_head",)


def test_bnb_default_quant_type_is_fp4_and_experts_stay_unquantized():
    pub = published(with_quant("Qwen/Qwen3-30B-A3B", {"quant_method": "bitsandbytes", "load_in_4bit": True}), WHERE)
    assert pub.scheme == "bnb-fp4"
    experts = model_spec("Qwen3-30B-A3B").tensor("model.layers.0.mlp.experts.gate_up_proj")
    assert not is_quantized(pub, experts) and stored_bytes(pub, experts) == experts.numel * 2


def test_compressed_tensors_w4a16_pack_quantized():
    pub = published(with_quant("Qwen/Qwen2.5-7B", CT_W4A16), WHERE)
    assert (pub.name, pub.stand_in, pub.scale_dtype) == ("ct-w4a16-g128", "quanto-int4", "BF16")
    t = linear("model.layers.0.mlp.down_proj.weight", 3584, 18944)
    assert stored_tensors(pub, t) == (
        ("model.layers.0.mlp.down_proj.weight_packed", (3584, 2368), "I32"),
        ("model.layers.0.mlp.down_proj.weight_shape", (2,), "I64"),
        ("model.layers.0.mlp.down_proj.weight_scale", (3584, 148), "BF16"))
    asym = {**CT_W4A16, "config_groups": {"group_0": {**CT_W4A16["config_groups"]["group_0"], "weights": {
        **CT_W4A16["config_groups"]["group_0"]["weights"], "symmetric": False, "actorder": "group"}}}}
    pub = published(with_quant("Qwen/Qwen2.5-7B", asym), WHERE)
    assert stored_tensors(pub, t)[3:] == (("model.layers.0.mlp.down_proj.weight_zero_point", (448, 148), "I32"),
                                          ("model.layers.0.mlp.down_proj.weight_g_idx", (18944,), "I32"))


def test_compressed_tensors_fp8_int8_and_nvfp4():
    t = linear("model.layers.0.self_attn.o_proj.weight", 3584, 3584)

    def ct(fmt: str, weights: dict, acts: dict | None) -> dict:
        return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}

    fp8 = published(with_quant("Qwen/Qwen2.5-7B", ct("float-quantized", {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})), WHERE)
    assert fp8.name == "ct-fp8" and stored_bytes(fp8, t) == 3584 * 3584 + 3584 * 2  # bf16 scale [out, 1]
    w8a8 = published(with_quant("Qwen/Qwen2.5-7B", ct("int-quantized", {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True})), WHERE)
    assert w8a8.name == "ct-w8a8-int8" and w8a8.quality == SCHEMES["quanto-w8a8"].quality
    assert stored_tensors(w8a8, t)[0] == ("model.layers.0.self_attn.o_proj.weight", (3584, 3584), "I8")
    nvfp4 = published(with_quant("Qwen/Qwen2.5-7B", ct("nvfp4-pack-quantized", {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True},
        {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"})), WHERE)
    assert nvfp4.name == "ct-nvfp4" and stored_tensors(nvfp4, t) == (
        ("model.layers.0.self_attn.o_proj.weight_packed", (3584, 1792), "U8"),
        ("model.layers.0.self_attn.o_proj.weight_scale", (3584, 224), "F8_E4M3"),
        ("model.layers.0.self_attn.o_proj.weight_global_scale", (1,), "F32"),
        ("model.layers.0.self_attn.o_proj.input_global_scale", (1,), "F32"))


# ------------------------------------------------------------------ mxfp4 and published totals

@pytest.mark.parametrize("model, total", [
    # openai/gpt-oss-20b model.safetensors.index.json: {"metadata": {"total_size": 13761264768}, ...}, quoted in a
    # model-directory dump next to the config the catalog copied (stored code index, find_string id 31112482743).
    ("openai/gpt-oss-20b", 13_761_264_768),
    # openai/gpt-oss-120b: an inventory of the 15 weight files, `weights["tensor_bytes"] == 65248815744` (file sizes
    # 65,248,893,184 with their headers), in a deployment test (stored code index, find_string id 59724567210).
    ("openai/gpt-oss-120b", 65_248_815_744),
])
def test_gpt_oss_total_equals_the_published_checkpoint(model, total):
    spec = model_spec(model.split("/")[1])
    pub = published(catalog_config(model), WHERE)
    assert (pub.name, pub.load_dtype, pub.quality, pub.stand_in) == ("mxfp4", "bfloat16", QUALITY_MXFP4, "quanto-int4")
    assert total_stored_bytes(pub, spec.tensors) == total


def test_gpt_oss_stores_only_the_experts_in_mxfp4():
    spec = model_spec("gpt-oss-120b")
    pub = published(catalog_config("openai/gpt-oss-120b"), WHERE)
    assert pub.skip == ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
    quantized = {t.name for t in spec.tensors if is_quantized(pub, t)}
    assert quantized == {f"model.layers.{i}.mlp.experts.{p}" for i in range(36) for p in ("gate_up_proj", "down_proj")}
    gate_up = spec.tensor("model.layers.0.mlp.experts.gate_up_proj")  # [E, in 2880, out 5760], transposed
    assert stored_tensors(pub, gate_up) == (
        ("model.layers.0.mlp.experts.gate_up_proj_blocks", (128, 5760, 90, 16), "U8"),
        ("model.layers.0.mlp.experts.gate_up_proj_scales", (128, 5760, 90), "U8"))
    # 4.25 bits per expert weight, as the model card says
    assert stored_bytes(pub, gate_up) * 8 / gate_up.numel == 4.25


# ------------------------------------------------------------------ skip lists

def test_transformers_skip_rules_on_awq_configs():
    spec = model_spec("Qwen2.5-7B")
    pub = published(with_quant("Qwen/Qwen2.5-7B", AWQ_GEMM), WHERE)  # modules_to_not_convert: null
    quantized = [t for t in spec.tensors if is_quantized(pub, t)]
    assert len(quantized) == 28 * 7 and all(t.kind is Kind.LINEAR and t.layer is not None for t in quantized)
    skip = published(with_quant("Qwen/Qwen2.5-7B", {**AWQ_GEMM, "modules_to_not_convert": [
        "model.layers.1", "mlp.gate", "visual", "layers.*.self_attn.o_proj"]}), WHERE)
    check = {  # from the start to a module boundary, as a regex, or as a suffix
        "model.layers.1.mlp.up_proj.weight": False, "model.layers.11.mlp.up_proj.weight": True,
        "model.layers.2.mlp.gate_proj.weight": True, "model.layers.2.self_attn.o_proj.weight": True,
        "model.layers.2.self_attn.q_proj.weight": True}
    assert {n: is_quantized(skip, spec.tensor(n)) for n in check} == check
    moe = published(with_quant("Qwen/Qwen2.5-7B", {**AWQ_GEMM, "modules_to_not_convert": ["gate"]}), WHERE)
    assert not is_quantized(moe, linear("model.layers.0.mlp.gate.weight", 64, 2048))  # suffix "gate"
    assert is_quantized(moe, linear("model.layers.0.mlp.gate_proj.weight", 64, 2048))


def test_compressed_tensors_ignore_rules():
    q = {**CT_W4A16, "ignore": ["lm_head", "re:.*mlp.down_proj$", "model.layers.0.self_attn.q_proj"]}
    pub = published(with_quant("Qwen/Qwen2.5-7B", q), WHERE)
    spec = model_spec("Qwen2.5-7B")
    check = {"model.layers.3.mlp.down_proj.weight": False, "model.layers.0.self_attn.q_proj.weight": False,
             "model.layers.10.self_attn.q_proj.weight": True, "model.layers.3.mlp.up_proj.weight": True}
    assert {n: is_quantized(pub, spec.tensor(n)) for n in check} == check
    only_attn = {**CT_W4A16, "config_groups": {"g": {**CT_W4A16["config_groups"]["group_0"],
                                                     "targets": ["re:.*self_attn.*"]}}}
    pub = published(with_quant("Qwen/Qwen2.5-7B", only_attn), WHERE)
    assert is_quantized(pub, spec.tensor("model.layers.3.self_attn.k_proj.weight"))
    assert not is_quantized(pub, spec.tensor("model.layers.3.mlp.up_proj.weight"))


# ------------------------------------------------------------------ owner_of

FORMATS = [AWQ_GEMM, {**AWQ_GEMM, "version": "gemv"}, GPTQ_4, CT_W4A16,
           {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
           {"quant_method": "fp8", "activation_scheme": "static"}, {"quant_method": "fbgemm_fp8"},
           {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_use_double_quant": True},
           {"quant_method": "bitsandbytes", "load_in_8bit": True}]


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q["quant_method"] + "-" + str(len(q)))
def test_owner_of_round_trips_every_stored_name(q):
    for model in ("Qwen/Qwen2.5-7B", "Qwen/Qwen3-30B-A3B"):
        pub = published(with_quant(model, q), WHERE)
        for t in model_spec(model.split("/")[1]).tensors:
            for name, _, _ in stored_tensors(pub, t):
                assert owner_of(name) == t.name, (name, t.name)
            assert stored_bytes(pub, t) > 0


def test_owner_of_mxfp4_and_plain_names():
    spec = model_spec("gpt-oss-20b")
    pub = published(catalog_config("openai/gpt-oss-20b"), WHERE)
    for t in spec.tensors:
        assert all(owner_of(n) == t.name for n, _, _ in stored_tensors(pub, t))
    assert owner_of("model.layers.0.mlp.experts.gate_up_proj_bias") == "model.layers.0.mlp.experts.gate_up_proj_bias"
    q_proj = "model.layers.0.self_attn.q_proj"
    assert owner_of(q_proj + ".weight.nested_quant_map") == owner_of(q_proj + ".qzeros") == q_proj + ".weight"
    assert owner_of("lm_head.weight") == "lm_head.weight"


# ------------------------------------------------------------------ quality, loaders, errors

def test_quality_and_loaders_are_cited():
    awq = published(with_quant("Qwen/Qwen2.5-7B", AWQ_GEMM), WHERE)
    assert awq.quality == QUALITY_AWQ and "arXiv:2306.00978" in awq.quality.source and "5.60" in awq.quality.source
    assert awq.load_dtype == "bfloat16"  # Qwen2.5-7B's own config says torch_dtype bfloat16
    assert published(with_quant("meta-llama/Llama-2-7b-hf", AWQ_GEMM, torch_dtype=None), WHERE).load_dtype == "float16"
    engines = {e for e, _ in awq.loaders}
    assert {"vllm", "transformers", "llama.cpp"} <= engines
    for q in FORMATS:
        pub = published(with_quant("Qwen/Qwen2.5-7B", q), WHERE)
        assert pub.quality.source and pub.stand_in in SCHEMES and pub.loaders


@pytest.mark.parametrize("q, message", [
    ([1, 2], "must be an object"),
    ({"bits": 4}, "no quant_method; known: awq, gptq"),
    ({"quant_method": "exl2"}, "unknown quant_method 'exl2'; known: awq, gptq, fp8, fbgemm_fp8, mxfp4"),
    ({"quant_method": "hqq", "nbits": 4}, "not counted yet"),
    ({**AWQ_GEMM, "bits": 3}, "bits must be one of 4"),
    ({**AWQ_GEMM, "version": "marlin"}, "AWQ version 'marlin' is not counted"),
    ({**GPTQ_4, "bits": 5}, "bits must be one of 2, 3, 4, 8"),
    ({**GPTQ_4, "group_size": 0}, "group_size must be positive or -1"),
    ({**GPTQ_4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not counted"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme must be dynamic or static"),
    ({"quant_method": "bitsandbytes"}, "exactly one of load_in_4bit and load_in_8bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "nf4 or fp4"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "must be a list of module names"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.(*"]}, "is not a valid pattern"),
    ({**CT_W4A16, "format": "marlin-24"}, 'format "marlin-24" is not counted'),
    ({**CT_W4A16, "config_groups": {}}, "config_groups must be an object"),
    ({**CT_W4A16, "config_groups": {"a": CT_W4A16["config_groups"]["group_0"], "b": {
        **CT_W4A16["config_groups"]["group_0"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "mixed precision"),
])
def test_malformed_configs_are_one_line_config_errors(q, message):
    with pytest.raises(ConfigError) as e:
        published(with_quant("Qwen/Qwen2.5-7B", q), WHERE)
    text = str(e.value)
    assert message in text and text.startswith(WHERE) and "\n" not in text
