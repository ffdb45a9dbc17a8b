"""ggml's block layouts (GGML_TYPES) and llama.cpp's GGUF file types (GGUF_FILE_TYPES): what each ggml type stores per
block, and which default type and mixture each `llama-quantize` file type names. planner/gguf.py (which re-exports
these) says which tensor takes which type. Sources (llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f):
ggml/src/ggml-common.h (block structs and their static_asserts), ggml/include/ggml.h (type ids), include/llama.h
(llama_ftype ids), src/llama-quant.cpp llama_ftype_get_default_type. Pure: stdlib and planner only.
"""

from __future__ import annotations

from .errors import PlanError
from .record import record

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
# ids (4, 5, 31-33, 36-38: blck_size 0). The file types below use all but I8-F64, Q8_1, Q8_K, NVFP4, Q1_0 and Q2_0.
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
    # The types the file types below write beside these, and those none writes: GGUF headers name them all
    # (planner/gguf_file.py reads any file).
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


# Largest to smallest as gguf_tensors sizes Llama-3.1-8B (within 0.02 GiB of the sizes column of
# tools/perplexity/README.md's Llama-3-8B scoreboard, whose q2_K_S row repeats q2_K's 2.96), but MXFP4_MOE, placed by
# its experts' 4.25 bpw (a dense model has none: its MXFP4_MOE file is Q8_0's): planner/engines/llamacpp.py borrows a
# speed entry from the nearest file type in this order. The ids are include/llama.h's llama_ftype.
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
    GGUFFileType(name="MXFP4_MOE", ftype_id=38, default_type="MXFP4",
                 description="routed experts MXFP4 (4.25 bpw), every other tensor and the output Q8_0"),
    GGUFFileType(name="Q3_K_L", ftype_id=13, default_type="Q3_K",
                 description="Q3_K; Q5_K for attn_v, attn_output, ffn_down"),
    GGUFFileType(name="Q3_K_M", ftype_id=12, default_type="Q3_K",
                 description="Q3_K; Q4_K for attn_v, attn_output, ffn_down"),
    GGUFFileType(name="IQ3_M", ftype_id=27, default_type="IQ3_S",
                 description="IQ3_S; Q4_K for attn_v, attn_output and the first eighth of ffn_down, output Q6_K"),
    GGUFFileType(name="IQ3_S", ftype_id=26, default_type="IQ3_S",
                 description="IQ3_S 3.44 bpw; Q4_K attn_v with GQA >= 4, output Q6_K"),
    GGUFFileType(name="Q3_K_S", ftype_id=11, default_type="Q3_K", description="Q3_K; output Q6_K"),
    GGUFFileType(name="IQ3_XS", ftype_id=22, default_type="IQ3_S",
                 description="IQ3_S; IQ3_XXS for attn_q, attn_k and the middle layers' ffn_gate/ffn_up"),
    GGUFFileType(name="IQ3_XXS", ftype_id=23, default_type="IQ3_XXS",
                 description="IQ3_XXS 3.06 bpw; IQ2_S attn_q/attn_k, IQ3_S attn_output, output Q5_K (imatrix)"),
    GGUFFileType(name="Q2_K", ftype_id=10, default_type="Q2_K",
                 description="Q2_K; Q3_K/Q4_K for attn_v, attn_output, ffn_down"),
    GGUFFileType(name="Q2_K_S", ftype_id=21, default_type="Q2_K",
                 description="Q2_K; Q4_K for attn_v (GQA >= 4) and the first eighth of ffn_down (imatrix)"),
    GGUFFileType(name="IQ2_M", ftype_id=29, default_type="IQ2_S",
                 description="IQ2_S 2.56 bpw; IQ3_S attn_output and first ffn_down, output Q5_K (imatrix)"),
    GGUFFileType(name="IQ2_S", ftype_id=28, default_type="IQ2_XS",
                 description="IQ2_XS 2.31 bpw; IQ3_S attn_output and first ffn_down, output Q5_K (imatrix)"),
    GGUFFileType(name="IQ2_XS", ftype_id=20, default_type="IQ2_XS",
                 description="IQ2_XS 2.31 bpw; Q2_K token_embd and first ffn_down, output Q5_K (imatrix)"),
    GGUFFileType(name="TQ2_0", ftype_id=37, default_type="TQ2_0",
                 description="ternary 2.06 bpw (for ternary-trained models); token_embd Q4_K, output Q6_K"),
    GGUFFileType(name="IQ2_XXS", ftype_id=19, default_type="IQ2_XXS",
                 description="IQ2_XXS 2.06 bpw; Q2_K token_embd and first ffn_down, output Q5_K (imatrix)"),
    GGUFFileType(name="TQ1_0", ftype_id=36, default_type="TQ1_0",
                 description="ternary 1.69 bpw (for ternary-trained models); token_embd Q4_K, output Q6_K"),
    GGUFFileType(name="IQ1_M", ftype_id=31, default_type="IQ1_M",
                 description="IQ1_M 1.75 bpw; IQ2_XXS attn_output, Q2_K token_embd, output Q5_K (imatrix)"),
    GGUFFileType(name="IQ1_S", ftype_id=24, default_type="IQ1_S",
                 description="IQ1_S 1.56 bpw; IQ2_XXS attn_output, Q2_K token_embd, output Q5_K (imatrix)"),
]}


def gguf_file_type(name: str) -> GGUFFileType:
    """'q4_k_m' -> the Q4_K_M file type; unknown names raise PlanError listing the choices."""
    try:
        return GGUF_FILE_TYPES[name.strip().upper()]
    except KeyError:
        raise PlanError(f"unknown GGUF file type {name!r}; choose one of: {', '.join(GGUF_FILE_TYPES)}") from None
