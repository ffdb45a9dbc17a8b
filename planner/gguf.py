"""llama.cpp GGUF sizing, tensor by tensor: which ggml type `llama-quantize` gives each tensor, and its bytes.

`gguf_tensors(spec, "Q4_K_M")` lists the tensors of the GGUF file that convert_hf_to_gguf.py
followed by `llama-quantize <f16.gguf> <out.gguf> Q4_K_M` writes for the model a ModelSpec
describes: GGUF name, transformers name, ggml type, shape (ggml order: ne[0] is the row length),
exact data bytes and decoder layer. `gguf_file_bytes` adds GGUF's per-tensor alignment padding,
the exact header and tensor-info bytes, and an estimate of the key/value metadata (the tokenizer
is not derivable from config.json: see `metadata_bytes_estimate`). Pure: stdlib and planner only.

Tied embeddings follow the spec: a tied model has no output.weight and its token_embd takes the
output rules. Some published files of tied models (Qwen's own Qwen2.5-0.5B/3B GGUFs) carry a
separate output.weight all the same; plan those with tie_word_embeddings false.

Sources followed (llama.cpp commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f, 2026-10-01, the
tree vendored by the llama-cpp-python 0.3.36 sdist on PyPI):
- src/llama-quant.cpp: tensor_get_category, tensor_allows_quantization, tensor_type_fallback,
  llama_tensor_get_type_impl (the per-ftype mixture rules, `use_more_bits`, the attn_v / ffn_down
  counters, n_gqa / n_expert conditions, the LLM_TYPE_70B bump), llama_tensor_get_type,
  llama_ftype_get_default_type, init_quantize_state_counters (n_ffn_down = n_layer_all,
  has_tied_embeddings), GGUF_DEFAULT_ALIGNMENT padding after every tensor.
- src/llama-model-loader.h: weight_name_comparer (tensors are visited by layer, then by name;
  the counters depend on that order).
- src/models/llama.cpp, src/models/qwen2.cpp: which models are LLM_TYPE_70B.
- ggml/src/ggml-common.h (block structs and their static_asserts), ggml/include/ggml.h (type ids),
  include/llama.h (llama_ftype ids).
- ggml/src/gguf.cpp: gguf_write_out (header, key/value and tensor-info encoding, alignment).
- convert_hf_to_gguf.py with conversion/base.py (prepare_tensors: 1-D tensors, norms, biases and
  ffn_gate_inp stay F32), conversion/llama.py (rope_freqs for llama3 RoPE), conversion/qwen.py
  (transformers-5 fused experts split into ffn_gate_exps + ffn_up_exps), conversion/deepseek.py
  (kv_b_proj split into attn_k_b / attn_v_b, MTP layers skipped), conversion/gemma.py (gemma3
  token_embd trimmed to the tokenizer's vocabulary), conversion/phi.py (rope_factors_long/short),
  gguf-py/gguf/constants.py and tensor_mapping.py (GGUF tensor names).

Left out, since no supported model_type converts to them or no listed file type reaches them:
the falcon / glm5-next / bailingmoe3 special cases, the IQ1-IQ3, TQ, Q2_K_S and MXFP4 mixtures,
--pure, --tensor-type / --output-tensor-type overrides, and convert's optional q/k/v and
gate/up fusion (off by default).
"""

from __future__ import annotations

import math

from .record import record
from .errors import PlanError, UnsupportedArchitectureError
from .modelspec import ModelSpec, TensorSpec

# ------------------------------------------------------------------ ggml block layouts
QK_K = 256  # super-block size of the k-quants and IQ4_XS (ggml-common.h)
GGML_HALF_BYTES = 2  # ggml_half: every block scale is an fp16


@record(kw_only=True)
class GGMLType:
    """A ggml tensor type: `block_elements` values stored in `block_bytes` bytes (ggml type traits)."""

    name: str
    type_id: int  # enum ggml_type
    block_elements: int
    block_bytes: int

    def __post_init__(self) -> None:
        if self.block_elements <= 0 or self.block_bytes <= 0:
            raise ValueError(f"ggml type {self.name}: bad block layout {self.block_elements}/{self.block_bytes}")

    @property
    def quantized(self) -> bool:
        """ggml_is_quantized: block types (F32/F16/BF16 store one value per element)."""
        return self.block_elements > 1

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elements

    def row_bytes(self, row_elements: int) -> int:
        """ggml_row_size: bytes of one row; the row must hold whole blocks."""
        if row_elements % self.block_elements:
            raise ValueError(f"{self.name}: a row of {row_elements} is not a whole number of "
                             f"{self.block_elements}-element blocks")
        return row_elements // self.block_elements * self.block_bytes


# ggml's type traits (ggml/src/ggml.c type_traits @ 0c1e57098bba43ac29e6e3b677cdceebdd22334f): blck_size is the block's
# elements (QK4_0 = 32, QK_K = 256, ...) and type_size = sizeof(block_*), whose bytes the structs in
# ggml/src/ggml-common.h add up to (their static_asserts quoted): every type of ggml.h's enum ggml_type but the removed
# ids (4, 5, 31-33, 36-38: blck_size 0). The file types below use only the first fifteen.
GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in [
    GGMLType(name="F32", type_id=0, block_elements=1, block_bytes=4),
    GGMLType(name="F16", type_id=1, block_elements=1, block_bytes=2),
    GGMLType(name="BF16", type_id=30, block_elements=1, block_bytes=2),
    # sizeof(ggml_half) + QK4_0/2
    GGMLType(name="Q4_0", type_id=2, block_elements=32, block_bytes=GGML_HALF_BYTES + 32 // 2),
    # 2*sizeof(ggml_half) + QK4_1/2
    GGMLType(name="Q4_1", type_id=3, block_elements=32, block_bytes=2 * GGML_HALF_BYTES + 32 // 2),
    # sizeof(ggml_half) + sizeof(uint32_t) + QK5_0/2
    GGMLType(name="Q5_0", type_id=6, block_elements=32, block_bytes=GGML_HALF_BYTES + 4 + 32 // 2),
    # 2*sizeof(ggml_half) + sizeof(uint32_t) + QK5_1/2
    GGMLType(name="Q5_1", type_id=7, block_elements=32, block_bytes=2 * GGML_HALF_BYTES + 4 + 32 // 2),
    # sizeof(ggml_half) + QK8_0
    GGMLType(name="Q8_0", type_id=8, block_elements=32, block_bytes=GGML_HALF_BYTES + 32),
    # 2*sizeof(ggml_half) + QK_K/16 + QK_K/4
    GGMLType(name="Q2_K", type_id=10, block_elements=QK_K, block_bytes=2 * GGML_HALF_BYTES + QK_K // 16 + QK_K // 4),
    # sizeof(ggml_half) + QK_K/4 + QK_K/8 + 12
    GGMLType(name="Q3_K", type_id=11, block_elements=QK_K, block_bytes=GGML_HALF_BYTES + QK_K // 4 + QK_K // 8 + 12),
    # 2*sizeof(ggml_half) + K_SCALE_SIZE (12) + QK_K/2
    GGMLType(name="Q4_K", type_id=12, block_elements=QK_K, block_bytes=2 * GGML_HALF_BYTES + 12 + QK_K // 2),
    # 2*sizeof(ggml_half) + K_SCALE_SIZE (12) + QK_K/2 + QK_K/8
    GGMLType(name="Q5_K", type_id=13, block_elements=QK_K,
             block_bytes=2 * GGML_HALF_BYTES + 12 + QK_K // 2 + QK_K // 8),
    # sizeof(ggml_half) + QK_K/16 + 3*QK_K/4
    GGMLType(name="Q6_K", type_id=14, block_elements=QK_K, block_bytes=GGML_HALF_BYTES + QK_K // 16 + 3 * QK_K // 4),
    # sizeof(ggml_half) + QK4_NL/2
    GGMLType(name="IQ4_NL", type_id=20, block_elements=32, block_bytes=GGML_HALF_BYTES + 32 // 2),
    # sizeof(ggml_half) + sizeof(uint16_t) + QK_K/64 + QK_K/2
    GGMLType(name="IQ4_XS", type_id=23, block_elements=QK_K,
             block_bytes=GGML_HALF_BYTES + 2 + QK_K // 64 + QK_K // 2),
    # The types no file type above writes: GGUF headers name them all (planner/gguf_file.py reads any file).
    # Plain integers and f64: one value per element (type_size sizeof(int8_t) ... sizeof(double)).
    GGMLType(name="I8", type_id=24, block_elements=1, block_bytes=1),
    GGMLType(name="I16", type_id=25, block_elements=1, block_bytes=2),
    GGMLType(name="I32", type_id=26, block_elements=1, block_bytes=4),
    GGMLType(name="I64", type_id=27, block_elements=1, block_bytes=8),
    GGMLType(name="F64", type_id=28, block_elements=1, block_bytes=8),
    # 2*sizeof(ggml_half) + QK8_1: the d and s halves, then the quants (ggml-common.h, block_q8_1)
    GGMLType(name="Q8_1", type_id=9, block_elements=32, block_bytes=2 * GGML_HALF_BYTES + 32),
    # sizeof(float) + QK_K + QK_K/16*sizeof(int16_t): an fp32 delta, the quants, the sums of 16
    GGMLType(name="Q8_K", type_id=15, block_elements=QK_K, block_bytes=4 + QK_K + QK_K // 16 * 2),
    # sizeof(ggml_half) + QK_K/8*sizeof(uint16_t)
    GGMLType(name="IQ2_XXS", type_id=16, block_elements=QK_K, block_bytes=GGML_HALF_BYTES + QK_K // 8 * 2),
    # sizeof(ggml_half) + QK_K/8*sizeof(uint16_t) + QK_K/32
    GGMLType(name="IQ2_XS", type_id=17, block_elements=QK_K,
             block_bytes=GGML_HALF_BYTES + QK_K // 8 * 2 + QK_K // 32),
    # sizeof(ggml_half) + QK_K/4 + QK_K/16
    GGMLType(name="IQ2_S", type_id=22, block_elements=QK_K, block_bytes=GGML_HALF_BYTES + QK_K // 4 + QK_K // 16),
    # sizeof(ggml_half) + 3*(QK_K/8)
    GGMLType(name="IQ3_XXS", type_id=18, block_elements=QK_K, block_bytes=GGML_HALF_BYTES + 3 * (QK_K // 8)),
    # sizeof(ggml_half) + 13*(QK_K/32) + IQ3S_N_SCALE (QK_K/64)
    GGMLType(name="IQ3_S", type_id=21, block_elements=QK_K,
             block_bytes=GGML_HALF_BYTES + 13 * (QK_K // 32) + QK_K // 64),
    # sizeof(ggml_half) + QK_K/8 + QK_K/16
    GGMLType(name="IQ1_S", type_id=19, block_elements=QK_K, block_bytes=GGML_HALF_BYTES + QK_K // 8 + QK_K // 16),
    # QK_K/8 + QK_K/16 + QK_K/32 (no ggml_half: the scale lives in the scales' spare bits)
    GGMLType(name="IQ1_M", type_id=29, block_elements=QK_K, block_bytes=QK_K // 8 + QK_K // 16 + QK_K // 32),
    # sizeof(ggml_half) + QK_K/64 + (QK_K - 4*QK_K/64)/5: five ternary values per byte
    GGMLType(name="TQ1_0", type_id=34, block_elements=QK_K,
             block_bytes=GGML_HALF_BYTES + QK_K // 64 + (QK_K - 4 * QK_K // 64) // 5),
    # sizeof(ggml_half) + QK_K/4
    GGMLType(name="TQ2_0", type_id=35, block_elements=QK_K, block_bytes=GGML_HALF_BYTES + QK_K // 4),
    # sizeof(uint8_t) + QK_MXFP4/2 (QK_MXFP4 = 32): an E8M0 exponent, then 4-bit values
    GGMLType(name="MXFP4", type_id=39, block_elements=32, block_bytes=1 + 32 // 2),
    # sizeof(uint8_t)*(QK_NVFP4/QK_NVFP4_SUB) + QK_NVFP4/2 (QK_NVFP4 = 64, QK_NVFP4_SUB = 16): four UE4M3 scales
    GGMLType(name="NVFP4", type_id=40, block_elements=64, block_bytes=64 // 16 + 64 // 2),
    # sizeof(ggml_half) + QK1_0/8 (QK1_0 = 128)
    GGMLType(name="Q1_0", type_id=41, block_elements=128, block_bytes=GGML_HALF_BYTES + 128 // 8),
    # sizeof(ggml_half) + QK2_0/4 (QK2_0 = 64)
    GGMLType(name="Q2_0", type_id=42, block_elements=64, block_bytes=GGML_HALF_BYTES + 64 // 4),
]}


# ------------------------------------------------------------------ file types (llama_ftype)
@record(kw_only=True)
class GGUFFileType:
    """A `llama-quantize` target: its llama_ftype id and the ggml type most tensors get."""

    name: str  # as llama-quantize spells it on the command line
    ftype_id: int  # general.file_type
    default_type: str  # llama_ftype_get_default_type
    description: str

    def __post_init__(self) -> None:
        if self.default_type not in GGML_TYPES:
            raise ValueError(f"file type {self.name}: unknown default type {self.default_type}")


GGUF_FILE_TYPES: dict[str, GGUFFileType] = {f.name: f for f in [
    GGUFFileType(name="F16", ftype_id=1, default_type="F16", description="float16 (norms, biases, router F32)"),
    GGUFFileType(name="BF16", ftype_id=32, default_type="BF16", description="bfloat16 (norms, biases, router F32)"),
    GGUFFileType(name="Q8_0", ftype_id=7, default_type="Q8_0", description="8.5 bpw everywhere"),
    GGUFFileType(name="Q6_K", ftype_id=18, default_type="Q6_K", description="6.56 bpw everywhere"),
    GGUFFileType(name="Q5_K_M", ftype_id=17, default_type="Q5_K",
                 description="Q5_K; Q6_K for half of attn_v and ffn_down, output Q6_K"),
    GGUFFileType(name="Q5_K_S", ftype_id=16, default_type="Q5_K", description="Q5_K; output Q6_K"),
    GGUFFileType(name="Q5_1", ftype_id=9, default_type="Q5_1", description="legacy 6 bpw; output Q6_K"),
    GGUFFileType(name="Q5_0", ftype_id=8, default_type="Q5_0", description="legacy 5.5 bpw; output Q6_K"),
    GGUFFileType(name="Q4_K_M", ftype_id=15, default_type="Q4_K",
                 description="Q4_K; Q6_K for half of attn_v and ffn_down, output Q6_K"),
    GGUFFileType(name="Q4_K_S", ftype_id=14, default_type="Q4_K",
                 description="Q4_K; Q5_K for the first attn_v and ffn_down, output Q6_K"),
    GGUFFileType(name="Q4_1", ftype_id=3, default_type="Q4_1", description="legacy 5 bpw; output Q6_K"),
    GGUFFileType(name="Q4_0", ftype_id=2, default_type="Q4_0", description="legacy 4.5 bpw; output Q6_K"),
    GGUFFileType(name="IQ4_NL", ftype_id=25, default_type="IQ4_NL", description="non-linear 4.5 bpw; output Q6_K"),
    GGUFFileType(name="IQ4_XS", ftype_id=30, default_type="IQ4_XS", description="non-linear 4.25 bpw; output Q6_K"),
    GGUFFileType(name="Q3_K_L", ftype_id=13, default_type="Q3_K",
                 description="Q3_K; Q5_K for attn_v, attn_output, ffn_down"),
    GGUFFileType(name="Q3_K_M", ftype_id=12, default_type="Q3_K",
                 description="Q3_K; Q4_K for attn_v, attn_output, ffn_down"),
    GGUFFileType(name="Q3_K_S", ftype_id=11, default_type="Q3_K", description="Q3_K; output Q6_K"),
    GGUFFileType(name="Q2_K", ftype_id=10, default_type="Q2_K",
                 description="Q2_K; Q3_K/Q4_K for attn_v, attn_output, ffn_down"),
]}


def gguf_file_type(name: str) -> GGUFFileType:
    """'q4_k_m' -> the Q4_K_M file type; unknown names raise PlanError listing the choices."""
    try:
        return GGUF_FILE_TYPES[name.strip().upper()]
    except KeyError:
        raise PlanError(f"unknown GGUF file type {name!r}; choose one of: {', '.join(GGUF_FILE_TYPES)}") from None


# ------------------------------------------------------------------ HF -> GGUF tensor inventory
# general.architecture that convert_hf_to_gguf.py writes for each transformers model_type.
GGUF_ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama",
    "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "deepseek_v3": "deepseek2",
}

# Per-layer module (after "model.layers.N.") -> GGUF name (after "blk.N."), gguf-py tensor_mapping.py.
LAYER_MODULE_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",  # phi3 keeps q, k and v fused
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # phi3 keeps gate and up fused in one [2I, H] ffn_up
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# Gemma 2/3 have a norm after attention and one before the MLP: the first is not ffn_norm there.
GEMMA_LAYER_MODULE_NAMES = {**LAYER_MODULE_NAMES, "post_attention_layernorm": "post_attention_norm"}
NON_LAYER_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
# The tokenizer shipped with every Gemma 3 model has this many tokens; convert trims token_embd's
# padding rows beyond it (config vocab_size 262208).
GEMMA3_TOKENIZER_VOCAB = 262144


@record(kw_only=True)
class _Source:
    """A tensor as convert_hf_to_gguf.py writes it, before llama-quantize."""

    name: str
    hf_name: str | None  # None for tensors convert generates (rope_freqs, rope factors)
    shape: tuple[int, ...]  # ggml order
    layer: int | None
    f32: bool  # convert stores it as F32 whatever --outtype is


def _forced_f32(gguf_name: str, ndim: int) -> bool:
    """conversion/base.py prepare_tensors: 1-D tensors, norms, biases and routers stay F32."""
    return ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight") \
        or ".ffn_gate_inp." in gguf_name


def _source(name: str, hf_name: str | None, torch_shape: tuple[int, ...], layer: int | None) -> _Source:
    return _Source(name=name, hf_name=hf_name, shape=tuple(reversed(torch_shape)), layer=layer,
                   f32=_forced_f32(name, len(torch_shape)))


def _layer_sources(spec: ModelSpec, t: TensorSpec) -> list[_Source]:
    prefix = f"model.layers.{t.layer}."
    if not t.name.startswith(prefix):
        raise UnsupportedArchitectureError(f"{spec.name}: tensor {t.name} has no GGUF name (layer {t.layer})")
    rest = t.name[len(prefix):]
    blk = f"blk.{t.layer}."
    if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: convert splits it into gate and up
        e, two_i, h = t.shape
        half = (e, two_i // 2, h)
        return [_source(blk + "ffn_gate_exps.weight", t.name, half, t.layer),
                _source(blk + "ffn_up_exps.weight", t.name, half, t.layer)]
    if rest == "mlp.experts.down_proj":
        return [_source(blk + "ffn_down_exps.weight", t.name, t.shape, t.layer)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [_source(blk + "exp_probs_b.bias", t.name, t.shape, t.layer)]
    if rest == "self_attn.kv_b_proj.weight":
        return _split_kv_b(spec, t, blk)
    module, _, suffix = rest.rpartition(".")
    table = GEMMA_LAYER_MODULE_NAMES if spec.model_type in ("gemma2", "gemma3_text") else LAYER_MODULE_NAMES
    if module not in table or suffix not in ("weight", "bias"):
        raise UnsupportedArchitectureError(f"{spec.name} ({spec.model_type}): tensor {t.name} has no known GGUF name")
    return [_source(f"{blk}{table[module]}.{suffix}", t.name, t.shape, t.layer)]


def _split_kv_b(spec: ModelSpec, t: TensorSpec, blk: str) -> list[_Source]:
    """conversion/deepseek.py: kv_b_proj [H*(nope+v), r] -> attn_k_b [H, r, nope] (transposed) + attn_v_b [H, v, r]."""
    nope = int(spec.config["qk_nope_head_dim"])
    v_dim = int(spec.config["v_head_dim"])
    rank = t.shape[1]
    heads = t.shape[0] // (nope + v_dim)
    if heads * (nope + v_dim) != t.shape[0]:
        raise UnsupportedArchitectureError(f"{spec.name}: {t.name} rows {t.shape[0]} are not heads x (nope + v)")
    return [_source(blk + "attn_k_b.weight", t.name, (heads, rank, nope), t.layer),
            _source(blk + "attn_v_b.weight", t.name, (heads, v_dim, rank), t.layer)]


def _non_layer_source(spec: ModelSpec, t: TensorSpec) -> _Source:
    name = NON_LAYER_NAMES.get(t.name)
    if name is None:
        raise UnsupportedArchitectureError(f"{spec.name} ({spec.model_type}): tensor {t.name} has no known GGUF name")
    shape = t.shape
    if name == "token_embd.weight" and spec.model_type == "gemma3_text":
        shape = (min(shape[0], GEMMA3_TOKENIZER_VOCAB), shape[1])
    return _source(name, t.name, shape, None)


def _rope_parameters(config: dict) -> dict:
    """RoPE settings: transformers 5 `rope_parameters` (maybe per attention type) or the older `rope_scaling`."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return {}
    full = params.get("full_attention")
    return full if isinstance(full, dict) else params


def _generated_sources(spec: ModelSpec) -> list[_Source]:
    """Tensors convert_hf_to_gguf.py adds that the checkpoint lacks (RoPE frequency factors)."""
    rope = _rope_parameters(spec.config)
    rope_type = str(rope.get("rope_type", rope.get("type", ""))).lower()
    heads = spec.attention[0].num_heads
    if spec.model_type in ("llama", "mistral", "mixtral") and rope_type == "llama3":
        head_dim = spec.config.get("head_dim") or spec.hidden_size // heads
        return [_source("rope_freqs.weight", None, (head_dim // 2,), None)]
    if spec.model_type == "phi3" and rope.get("long_factor"):
        partial = float(spec.config.get("partial_rotary_factor", 1.0))
        rope_dims = int(partial * spec.hidden_size) // heads
        return [_source(f"rope_factors_{kind}.weight", None, (rope_dims // 2,), None) for kind in ("long", "short")]
    return []


def _sources(spec: ModelSpec) -> list[_Source]:
    if spec.model_type not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{spec.name}: no GGUF mapping for model_type {spec.model_type!r}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    out = _generated_sources(spec)
    for t in spec.tensors:
        out.extend(_layer_sources(spec, t) if t.layer is not None else [_non_layer_source(spec, t)])
    return out


def _load_order(s: _Source) -> tuple[int, str]:
    """llama_model_loader::weight_name_comparer: by block number (-1 outside blocks), then by name."""
    return (-1 if s.layer is None else s.layer, s.name)


# ------------------------------------------------------------------ llama-quantize type selection
# tensor_get_category: the first matching substring decides (order as in llama-quant.cpp).
CATEGORY_PATTERNS = (
    ("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
    ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
    ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"),
)
ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")  # category_is_attn_v
# tensor_allows_quantization: name fragments never quantized (architecture-independent ones).
NEVER_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "time_mix_first.weight",
    "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
    "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
NEVER_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")  # LLM_TENSOR_POS_EMBD, TOKEN_TYPES
# tensor_type_fallback: the type a row length that is no whole number of blocks falls back to.
FALLBACK_TYPES = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1",
                  "Q6_K": "Q8_0"}
# The rule sets that move attn_output to Q5_K in 8-expert models (llama_tensor_get_type_impl).
EIGHT_EXPERT_ATTN_OUTPUT_Q5_K = ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS")


def tensor_category(name: str) -> str:
    """tensor_get_category: 'output', 'token_embd', 'attn_v', 'ffn_down', ... or 'other'."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for fragment, category in CATEGORY_PATTERNS:
        if fragment in name:
            return category
    return "other"


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one larger than 1 (at least 1)."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization for the default parameters (quantize_output_tensor, not only_copy)."""
    if ggml_n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    return not any(f in name for f in NEVER_QUANTIZED) and name not in NEVER_QUANTIZED_NAMES


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The Q4_K_M / Q5_K_M rule: the first and last eighth and every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def fallback_type(type_name: str, row_elements: int) -> str:
    """tensor_type_fallback: a type whose block does not divide the row length is demoted."""
    t = GGML_TYPES[type_name]
    if row_elements % t.block_elements == 0:
        return type_name
    demoted = FALLBACK_TYPES.get(type_name, type_name if t.block_elements <= 32 else None)
    if demoted is None:
        raise PlanError(f"no tensor type fallback is defined for type {type_name}")
    return demoted if row_elements % GGML_TYPES[demoted].block_elements == 0 else "F16"


@record(kw_only=True)
class _ModelFacts:
    """The hparams llama_tensor_get_type_impl reads."""

    arch: str
    n_layer: int  # n_layer_all: GGUF block_count
    n_expert: int  # 0 for dense models
    n_gqa: int  # n_head / n_head_kv of layer 0 as the GGUF stores them
    is_70b: bool  # model.type == LLM_TYPE_70B


def _model_facts(spec: ModelSpec) -> _ModelFacts:
    arch = GGUF_ARCHITECTURES[spec.model_type]
    a = spec.attention[0]
    n_head_kv = 1 if a.kind == "mla" else a.num_kv_heads  # conversion/deepseek.py writes MLA as MQA
    n_expert = spec.moe.num_experts if spec.moe else 0
    # src/models/llama.cpp (8-expert models are typed 8x7B / 8x22B) and src/models/qwen2.cpp
    is_70b = spec.num_layers == 80 and (
        (arch == "llama" and n_expert != 8 and a.num_heads != n_head_kv) or arch == "qwen2")
    return _ModelFacts(arch=arch, n_layer=spec.num_layers, n_expert=n_expert, n_gqa=a.num_heads // n_head_kv,
                       is_70b=is_70b)


class _QuantizeState:
    """quantize_state_impl: the counters llama-quantize advances tensor by tensor."""

    def __init__(self, facts: _ModelFacts, names: list[str], imatrix: bool) -> None:
        self.facts = facts
        self.has_imatrix = imatrix
        self.n_attention_wv = sum(1 for n in names if tensor_category(n) in ATTN_V_LIKE)
        self.has_tied_embeddings = "output.weight" not in names
        self.n_ffn_down = facts.n_layer
        self.i_attention_wv = 0
        self.i_ffn_down = 0

    def layer_info(self, counter: int, name: str) -> tuple[int, int]:
        """With experts the layer comes from the name; otherwise from the running counter."""
        if self.facts.n_expert > 1:
            return int(name.split(".")[1]), self.n_ffn_down
        return counter, self.n_ffn_down


def _output_type(new_type: str, row: int) -> str:
    if row % GGML_TYPES[new_type].block_elements:
        return "Q8_0"
    return new_type if new_type == "Q8_0" else "Q6_K"


def _attn_v_type(qs: _QuantizeState, ftype: str, new_type: str) -> str:
    f = qs.facts
    i, n = qs.i_attention_wv, qs.n_attention_wv
    if ftype == "Q2_K":
        new_type = "Q4_K" if f.n_gqa >= 4 else "Q3_K"
    elif ftype == "Q3_K_M":
        new_type = "Q5_K" if i < 2 else "Q4_K"
    elif ftype == "Q3_K_L":
        new_type = "Q5_K"
    elif ftype in ("IQ4_NL", "IQ4_XS") and f.n_gqa >= 4:
        new_type = "Q5_K"
    elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
        new_type = "Q6_K"
    elif ftype == "Q4_K_S" and i < 4:
        new_type = "Q5_K"
    if f.is_70b and new_type in ("Q3_K", "Q4_K"):
        new_type = "Q5_K"
    if f.n_expert == 8:
        new_type = "Q8_0"
    qs.i_attention_wv += 1
    return new_type


def _ffn_down_type(qs: _QuantizeState, ftype: str, new_type: str, name: str) -> str:
    i, n = qs.layer_info(qs.i_ffn_down, name)
    if ftype == "Q2_K":
        new_type = "Q3_K"
    elif ftype == "Q3_K_M":
        new_type = "Q5_K" if i < n // 16 else "Q4_K"
    elif ftype == "Q3_K_L":
        new_type = "Q5_K"
    elif ftype == "Q4_K_M":
        if use_more_bits(i, n):
            new_type = "Q6_K"
    elif i < n // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not qs.has_imatrix:
        new_type = "Q5_K"
    elif ftype == "Q5_K_M" and use_more_bits(i, n):
        new_type = "Q6_K"
    elif ftype == "Q4_K_S" and i < n // 8:
        new_type = "Q5_K"
    elif ftype in ("Q4_0", "Q5_0") and qs.has_imatrix and i < n // 8:
        new_type = "Q4_1" if ftype == "Q4_0" else "Q5_1"
    qs.i_ffn_down += 1
    return new_type


def _attn_output_type(qs: _QuantizeState, ftype: str, new_type: str) -> str:
    if qs.facts.n_expert == 8:
        return "Q5_K" if ftype in EIGHT_EXPERT_ATTN_OUTPUT_Q5_K else new_type
    return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, new_type)


def _mixture_type(qs: _QuantizeState, ftype: str, new_type: str, name: str, row: int) -> str:
    """llama_tensor_get_type_impl for the file types in GGUF_FILE_TYPES."""
    category = tensor_category(name)
    if category == "output" or (qs.has_tied_embeddings and category == "token_embd"):
        return _output_type(new_type, row)
    if category in ATTN_V_LIKE:
        return _attn_v_type(qs, ftype, new_type)
    if category == "attn_k":
        return "Q8_0" if qs.facts.n_expert == 8 else new_type
    if category == "ffn_down":
        return _ffn_down_type(qs, ftype, new_type, name)
    if category == "attn_output":
        return _attn_output_type(qs, ftype, new_type)
    return new_type


def _select_types(spec: ModelSpec, sources: list[_Source], file_type: GGUFFileType, imatrix: bool) -> list[str]:
    """llama_tensor_get_type for every tensor, visited in the loader's order (the counters depend on it)."""
    qs = _QuantizeState(_model_facts(spec), [s.name for s in sources], imatrix)
    default = GGML_TYPES[file_type.default_type]
    out = []
    for s in sources:
        source_type = "F32" if s.f32 else default.name
        if not allows_quantization(s.name, s.shape):
            out.append(source_type)
            continue
        new_type = default.name
        if default.quantized:
            new_type = _mixture_type(qs, file_type.name, new_type, s.name, s.shape[0])
            new_type = fallback_type(new_type, s.shape[0])
        out.append(new_type)
    return out


# ------------------------------------------------------------------ public API
@record(kw_only=True)
class GGUFTensor:
    """One tensor of the GGUF file."""

    name: str  # GGUF name, e.g. "blk.0.attn_v.weight"
    hf_name: str | None  # transformers parameter it comes from; None when convert generates it
    ggml_type: str
    shape: tuple[int, ...]  # ggml order (ne): shape[0] is the row length, reversed from PyTorch
    nbytes: int  # ggml_nbytes: exact data bytes, without the file's alignment padding
    layer: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def gguf_tensors(spec: ModelSpec, file_type: str, *, imatrix: bool = False) -> tuple[GGUFTensor, ...]:
    """Every tensor of the file `llama-quantize ... <file_type>` writes, in the file's order.

    `imatrix`: quantized with an importance matrix (changes IQ4_XS/IQ4_NL ffn_down and Q4_0/Q5_0
    ffn_down in the first eighth of the layers; the other file types do not depend on it).
    """
    key = (id(spec), file_type, imatrix)
    hit = _TENSORS_MEMO.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    ft = gguf_file_type(file_type)
    sources = sorted(_sources(spec), key=_load_order)
    types = _select_types(spec, sources, ft, imatrix)
    tensors = tuple(
        GGUFTensor(name=s.name, hf_name=s.hf_name, ggml_type=ty, shape=s.shape, layer=s.layer,
                   nbytes=math.prod(s.shape[1:]) * GGML_TYPES[ty].row_bytes(s.shape[0]))
        for s, ty in zip(sources, types)
    )
    if len(_TENSORS_MEMO) >= TENSORS_MEMO_SIZE:
        _TENSORS_MEMO.pop(next(iter(_TENSORS_MEMO)))
    _TENSORS_MEMO[key] = (spec, tensors)  # the spec held with it: its id cannot be reused while the entry lives
    return tensors


# One plan asks for the same file's tensors several times (llama.cpp's plan, Ollama's launch and plan, the file
# size): 7-20 ms each for a 405B model. The last few answers are kept, keyed by the spec object they were made for.
TENSORS_MEMO_SIZE = 8
_TENSORS_MEMO: dict[tuple[int, str, bool], tuple[ModelSpec, tuple[GGUFTensor, ...]]] = {}


def forget_tensors() -> None:
    """Empty the memo of gguf_tensors (what a fresh process starts with: bench/plan_speed.py times that)."""
    _TENSORS_MEMO.clear()


def gguf_layer_bytes(spec: ModelSpec, file_type: str, *, imatrix: bool = False) -> list[int]:
    """Data bytes of each decoder layer's tensors (ggml_nbytes, what a backend buffer holds)."""
    out = [0] * spec.num_layers
    for t in gguf_tensors(spec, file_type, imatrix=imatrix):
        if t.layer is not None:
            out[t.layer] += t.nbytes
    return out


@record(kw_only=True)
class GGUFNonLayerBytes:
    """Data bytes outside the decoder layers."""

    token_embd_bytes: int
    output_bytes: int  # 0 when the output projection is tied to token_embd
    output_norm_bytes: int
    other_bytes: int  # tensors convert generates (rope_freqs, rope factors)

    @property
    def total_bytes(self) -> int:
        return self.token_embd_bytes + self.output_bytes + self.output_norm_bytes + self.other_bytes


def gguf_non_layer_bytes(spec: ModelSpec, file_type: str, *, imatrix: bool = False) -> GGUFNonLayerBytes:
    by_name = {t.name: t.nbytes for t in gguf_tensors(spec, file_type, imatrix=imatrix) if t.layer is None}
    named = ("token_embd.weight", "output.weight", "output_norm.weight")
    return GGUFNonLayerBytes(
        token_embd_bytes=by_name.get("token_embd.weight", 0),
        output_bytes=by_name.get("output.weight", 0),
        output_norm_bytes=by_name.get("output_norm.weight", 0),
        other_bytes=sum(v for k, v in by_name.items() if k not in named),
    )


# ------------------------------------------------------------------ the file: header, metadata, padding
GGUF_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT (general.alignment unset)
GGUF_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version u32, n_tensors i64, n_kv i64
# Tokenizer metadata (tokenizer.ggml.tokens / token_type / merges / scores, a gguf string being a
# u64 length + bytes) cannot be derived from config.json. Bytes per vocabulary entry, measured on
# the vocab-only GGUFs llama.cpp ships in models/ (tokenizer.* bytes / token count):
TOKENIZER_BYTES_PER_TOKEN = {
    # ggml-vocab-llama-bpe.gguf (Llama 3): 7,817,598 B / 128,256 tokens, 280,147 merges
    "llama3-bpe": 60.95,
    # ggml-vocab-qwen2.gguf: 5,928,217 B / 151,936 tokens, 151,387 merges (deepseek-llm: 38.77)
    "bpe": 39.02,
    # ggml-vocab-llama-spm.gguf (Llama 2, Mistral): 723,363 B / 32,000 tokens, scores, no merges (phi-3: 22.62)
    "spm": 22.61,
}
SPM_MAX_VOCAB = 32768  # sentencepiece vocabularies of the supported families are at most this large
# general.* and <arch>.* hyperparameter keys (~30-40 keys, ~2 KiB) plus a chat template (~1-5 KiB
# in instruct models): an estimate, not derivable from config.json.
MODEL_METADATA_BYTES = 8 * 1024


def tokenizer_family(spec: ModelSpec) -> str:
    """Which TOKENIZER_BYTES_PER_TOKEN row a model's tokenizer is closest to."""
    if spec.model_type in ("gemma2", "gemma3_text") or spec.vocab_size <= SPM_MAX_VOCAB:
        return "spm"
    if spec.model_type == "llama":
        return "llama3-bpe"
    return "bpe"


def metadata_bytes_estimate(spec: ModelSpec) -> int:
    """Key/value metadata: vocab_size x bytes per token of the tokenizer family + MODEL_METADATA_BYTES."""
    per_token = TOKENIZER_BYTES_PER_TOKEN[tokenizer_family(spec)]
    return math.ceil(spec.vocab_size * per_token) + MODEL_METADATA_BYTES


def tensor_info_bytes(tensors: tuple[GGUFTensor, ...]) -> int:
    """gguf_write_out: per tensor a string name (u64 + bytes), n_dims u32, ne i64 each, type i32, offset u64."""
    return sum(8 + len(t.name.encode()) + 4 + 8 * ggml_n_dims(t.shape) + 4 + 8 for t in tensors)


def _pad(n: int, alignment: int = GGUF_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


@record(kw_only=True)
class GGUFFileSize:
    """A GGUF file's bytes: exact tensor data and tensor infos, estimated key/value metadata."""

    tensor_data_bytes: int  # sum of ggml_nbytes
    padding_bytes: int  # zeros after each tensor up to GGUF_ALIGNMENT
    header_bytes: int  # header + tensor infos + the metadata estimate, padded to GGUF_ALIGNMENT
    metadata_estimate_bytes: int  # the estimated part of header_bytes

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.tensor_data_bytes + self.padding_bytes


def gguf_file_size(spec: ModelSpec, file_type: str, *, imatrix: bool = False) -> GGUFFileSize:
    tensors = gguf_tensors(spec, file_type, imatrix=imatrix)
    data = sum(t.nbytes for t in tensors)
    padded = sum(_pad(t.nbytes) for t in tensors)
    metadata = metadata_bytes_estimate(spec)
    header = _pad(GGUF_HEADER_BYTES + metadata + tensor_info_bytes(tensors))
    return GGUFFileSize(tensor_data_bytes=data, padding_bytes=padded - data, header_bytes=header,
                        metadata_estimate_bytes=metadata)


def gguf_file_bytes(spec: ModelSpec, file_type: str, *, imatrix: bool = False) -> int:
    """Size of the single-file GGUF `llama-quantize` writes (metadata estimated: see metadata_bytes_estimate)."""
    return gguf_file_size(spec, file_type, imatrix=imatrix).file_bytes
