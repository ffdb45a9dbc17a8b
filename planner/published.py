"""Pre-quantized checkpoints as published: what config.json's `quantization_config` says is STORED, tensor by tensor.

A model downloaded already quantized (AWQ, GPTQ, FP8, MXFP4, bitsandbytes, compressed-tensors) is not re-quantized by
anyone: its bytes are the checkpoint's, in its own layout. `published(config, where)` reads the quantization_config
into a `Published` record; `is_quantized`, `stored_tensors` and `stored_bytes` then give, for any TensorSpec of the
model, whether it is stored quantized, the tensors the safetensors files hold for it (the packed weight and every side
tensor: zero points, scales, group indices, block scales, code tables) and their exact bytes. `owner_of` maps a stored
tensor name back to the parameter it belongs to. Pure: stdlib and planner modules only.

Layouts, each from the code that writes the checkpoint (file and function named where it is used below):
- AWQ GEMM  (AutoAWQ awq/modules/linear/gemm.py WQLinear_GEMM.__init__): qweight I32 [in, out/8], qzeros I32
  [in/g, out/8], scales F16 [in/g, out].
- AWQ GEMV  (AutoAWQ awq/modules/linear/gemv.py WQLinear_GEMV.__init__): qweight I32 [out, in/8], qzeros I32 [out, w],
  scales F16 [out, 8w], w = calculate_zeros_width(in, g) (the group count over 8, padded for g = 64 / 32).
- GPTQ      (AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py QuantLinear.__init__): qweight I32
  [in x bits / 32, out], qzeros I32 [ceil(in/g), out x bits / 32], scales F16 [ceil(in/g), out], g_idx I32 [in] --
  g_idx is registered whether or not desc_act is set.
- fp8       (transformers 5.24 integrations/finegrained_fp8.py FP8Linear.__init__): F8_E4M3 [out, in] + weight_scale_inv
  F32 [ceil(out/bo), ceil(in/bi)] (U8 with scale_fmt ue8m0); without weight_block_size the per-tensor checkpoints
  (AutoFP8, as vLLM's Fp8LinearMethod reads them) hold weight_scale F32 [] and, for a static activation scheme,
  input_scale F32 [].
- fbgemm_fp8 (transformers integrations/fbgemm_fp8.py FbgemmFp8Linear.__init__): F8_E4M3 [out, in] + weight_scale F32
  [out, 1] (input_scale_ub is a non-persistent buffer, not saved).
- mxfp4     (transformers integrations/mxfp4.py, Mxfp4ReverseDeserialize / _convert_moe_packed_tensors): the routed
  experts' <name>_blocks U8 [E, out, in/32, 16] and <name>_scales U8 [E, out, in/32]; nothing else is converted
  (replace_with_mxfp4_linear converts GptOssMLP experts only).
- bitsandbytes (bitsandbytes 0.50.2 nn/modules.py Linear4bit._save_to_state_dict + functional.py QuantState.as_dict
  (packed=True); Linear8bitLt._save_to_state_dict): 4-bit: weight U8 [ceil(n/2), 1], weight.absmax F32 [n/64]
  (U8 with double quantization, plus weight.nested_absmax F32 [ceil(blocks/256)] and weight.nested_quant_map F32
  [256]), weight.quant_map F32 [16], weight.quant_state.bitsandbytes__<type> U8 [len(JSON)]; 8-bit: weight I8
  [out, in], SCB F32 [out], weight_format U8 [].
- compressed-tensors (compressed_tensors/compressors/quantized_compressors/pack_quantized.py
  PackedQuantizationCompressor.compression_param_info / compress_weight, nvfp4_quantized.py, quantization/lifecycle/
  initialize.py _initialize_scale_zero_point): pack-quantized: weight_packed I32 [out, ceil(in / (32 // bits))],
  weight_shape I64 [2], weight_scale [out, ceil(in/g)] / [out, 1] / [1] in the weight's dtype, weight_zero_point I32
  [ceil(out / (32 // bits)), groups] when asymmetric, weight_g_idx I32 [in] with actorder "group"; int-/float-quantized:
  the weight in I8 / F8_E4M3 + weight_scale (+ weight_zero_point of the scale's shape when asymmetric);
  nvfp4-pack-quantized: weight_packed U8 [out, in/2], weight_scale F8_E4M3 [out, in/16], weight_global_scale F32 [1].
  Static input activations add input_scale [1] (NVFP4: input_global_scale F32 [1]).

Fused routed experts (Kind.EXPERTS, transformers 5's [E, out, in] / transposed [E, in, out]) are counted per expert in
the method's layout, the E results stacked, under the fused name with "_<side tensor>" appended; a checkpoint written
per expert (experts.<e>.gate_proj ...) holds the same bytes when the fused gate/up split falls on group boundaries, as
it does in every published MoE. bitsandbytes leaves fused experts in the load dtype (transformers 5 replaces nn.Linear
only).

Not counted (published() raises ConfigError): HQQ (transformers' HqqHfQuantizer is serializable, but HQQLinear's saved
meta -- scale, zero, shape and a dozen scalars encoded as tensors -- is hqq's own and could not be checked here), AWQ
gemv_fast / marlin layouts, GPTQ marlin checkpoints, compressed-tensors sparse / marlin-24 formats, mixed-precision
compressed-tensors configs.
"""

from __future__ import annotations

import json
import math
import re

from .errors import ConfigError
from .modelspec import Kind, TensorSpec, canonical_dtype, dtype_bytes
from .quant import SCHEMES, QualityCost
from .record import record

# ------------------------------------------------------------------ quality, each with its source

_AWQ_TABLE4 = ("AWQ (Lin et al. 2023, arXiv:2306.00978) Table 4: Llama-2-7B INT4 g128 WikiText-2 perplexity FP16 5.47, "
               "RTN 5.73, GPTQ 5.69, GPTQ-R (act-order) 5.63, AWQ 5.60")
QUALITY_AWQ = QualityCost(ppl_increase_pct=2.4, source=_AWQ_TABLE4 + ": AWQ +2.4 %")
QUALITY_GPTQ = QualityCost(ppl_increase_pct=4.0, source=_AWQ_TABLE4 + ": GPTQ +4.0 %")
QUALITY_GPTQ_ACT_ORDER = QualityCost(ppl_increase_pct=2.9, source=_AWQ_TABLE4 + ": GPTQ-R +2.9 %")
QUALITY_INT4_RTN = SCHEMES["quanto-int4"].quality  # the same table's round-to-nearest row, for other 4-bit ints
_INT8 = SCHEMES["quanto-int8"].quality
QUALITY_INT8 = QualityCost(ppl_increase_pct=_INT8.ppl_increase_pct,
                           source="the 8-bit weight-only class (planner/quant.py quanto-int8): " + _INT8.source)
QUALITY_FP8 = QualityCost(ppl_increase_pct=_INT8.ppl_increase_pct,
                          source="assumption: FP8 e4m3 weights put in the 8-bit weight-only class (planner/quant.py "
                                 "quanto-int8: " + _INT8.source + "); vLLM's FP8 docs say only 'minimal impact on "
                                 "accuracy', no perplexity table was found")
QUALITY_MXFP4 = QualityCost(ppl_increase_pct=0.0,
                            source="post-trained with MXFP4 experts (openai gpt-oss model card: 'The models are post-"
                                   "trained with quantization of the mixture-of-experts (MoE) weights to MXFP4 format, "
                                   "where the weights are quantized to 4.25 bits per parameter'): the checkpoint is "
                                   "the model")
QUALITY_NVFP4 = QualityCost(ppl_increase_pct=QUALITY_INT4_RTN.ppl_increase_pct,
                            source="assumption: no published NVFP4 perplexity table was found; put in the 4-bit "
                                   "round-to-nearest class (" + QUALITY_INT4_RTN.source + ")")

# ------------------------------------------------------------------ loaders, per method

_LOADERS: dict[str, tuple[tuple[str, str], ...]] = {
    "awq": (("vllm", "loads it as it is (AWQ kernels; AWQ-Marlin on compute capability >= 8.0)"),
            ("transformers", "needs gptqmodel (transformers 5.24 integrations/awq.py builds the layers from it)"),
            ("llama.cpp", "only through a GGUF conversion of the unquantized model")),
    "gptq": (("vllm", "loads it as it is (GPTQ-Marlin kernels on compute capability >= 8.0, else the GPTQ kernels)"),
             ("transformers", "needs gptqmodel and optimum (transformers 5.24 quantizers/quantizer_gptq.py)"),
             ("llama.cpp", "only through a GGUF conversion of the unquantized model")),
    "fp8": (("vllm", "loads it as it is (W8A8 on compute capability >= 8.9, weight-only FP8 Marlin below)"),
            ("transformers", "loads it as it is (FineGrainedFP8: triton / DeepGEMM kernels)"),
            ("llama.cpp", "only through a GGUF conversion (dequantized first)")),
    "fbgemm_fp8": (("vllm", "loads it as it is"),
                   ("transformers", "needs fbgemm-gpu (transformers quantizers/quantizer_fbgemm_fp8.py)"),
                   ("llama.cpp", "only through a GGUF conversion (dequantized first)")),
    "mxfp4": (("vllm", "loads it as it is"),
              ("transformers", "keeps MXFP4 with the `kernels` package and triton on compute capability >= 7.5, "
                               "else dequantizes the experts to bf16 (quantizers/quantizer_mxfp4.py)"),
              ("llama.cpp", "through a GGUF conversion, which keeps the experts in MXFP4")),
    "bitsandbytes": (("transformers", "loads it as it is (bitsandbytes)"),
                     ("vllm", "loads it with quantization='bitsandbytes'"),
                     ("llama.cpp", "only through a GGUF conversion of the unquantized model")),
    "compressed-tensors": (("vllm", "loads it as it is"),
                           ("transformers", "needs compressed-tensors"),
                           ("llama.cpp", "only through a GGUF conversion (dequantized first)")),
}

KNOWN_METHODS = ("awq", "gptq", "fp8", "fbgemm_fp8", "mxfp4", "bitsandbytes", "compressed-tensors")
NOT_COUNTED = {"hqq": "HQQ's saved layout (W_q plus hqq's own meta tensors) is not counted yet"}

# Safetensors header names of the dtypes stored here.
_ST = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3",
       "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
       "bool": "BOOL"}
_ST_BYTES = {st: int(dtype_bytes(name)) for name, st in _ST.items()}

# bitsandbytes: transformers' BitsAndBytesConfig has no blocksize; Params4bit quantizes with 64; the nested
# (double-quantization) blocks are 256; code tables: 16 fp32 values, 256 for the nested one.
BNB_BLOCKSIZE = 64
BNB_NESTED_BLOCKSIZE = 256
# QuantState.as_dict writes the nested offset (a float32 mean, `self.offset.item()`) into the JSON as Python's repr of
# it: its length depends on the value (up to 20 characters for 0.0xxxxxxxxxxxxxxxx); counted at this width.
BNB_NESTED_OFFSET_JSON_CHARS = 20
# NVFP4: 16 values per fp8 scale (compressed-tensors' nvfp4 preset, group_size 16).
NVFP4_GROUP = 16
MXFP4_GROUP = 32  # the OCP MX block: 32 values share one E8M0 scale byte; 16 bytes hold their 32 nibbles


# The names published() gives its formats (a plan's weight_quant may be one: planner.choice accepts them).
PUBLISHED_NAME_RE = re.compile(r"(awq-int4-g(\d+|all)(-gemv)?|gptq-int\d-g(\d+|all)|fp8-tensor|fp8-block\d+x\d+|"
                               r"fbgemm-fp8|mxfp4|ct-nvfp4|ct-fp8|ct-w\d+a\d+(-g\d+|-int8)?\S*)")


def is_published_name(name: str) -> bool:
    return bool(PUBLISHED_NAME_RE.fullmatch(name))


@record(kw_only=True)
class Published:
    """A pre-quantized checkpoint's format, read from config.json's quantization_config."""

    method: str  # quant_method as the config writes it
    name: str  # vramplan's name of the format, e.g. "awq-int4-g128"
    description: str  # one line a user reads
    bits: int
    group_size: int | None
    quality: QualityCost
    load_dtype: str  # dtype of the tensors left unquantized (canonical)
    skip: tuple[str, ...]  # module patterns left unquantized, as the config gives them
    scheme: str | None  # the SCHEMES name a bitsandbytes checkpoint equals; else None
    stand_in: str  # the SCHEMES name whose speed stands in for this format's
    loaders: tuple[tuple[str, str], ...]  # (engine, how it loads the checkpoint)
    # layout details (what stored_tensors needs beyond the above)
    layout: str  # awq-gemm, awq-gemv, gptq, fp8-block, fp8-tensor, fbgemm-fp8, mxfp4, bnb-4bit, bnb-8bit, ct-pack,
    # ct-int, ct-float, ct-nvfp4
    block: tuple[int, int] | None = None  # (rows, columns) one scale covers: fp8 weight_block_size, ct block strategy
    strategy: str | None = None  # compressed-tensors weights strategy: group, channel, tensor, block, tensor_group
    symmetric: bool = True  # compressed-tensors: False stores zero points
    act_order: bool = False  # compressed-tensors actorder "group": weight_g_idx is stored
    input_scales: tuple[tuple[str, str], ...] = ()  # per-module activation scalars stored: (suffix, safetensors dtype)
    scale_dtype: str = "F32"  # safetensors dtype of the weight scales
    bnb_quant_type: str | None = None
    double_quant: bool = False
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors config_groups targets
    quantize_lm_head: bool = False  # GPTQ "lm_head": true (GPTQModel quantizes the head too)

    def __post_init__(self) -> None:
        if self.bits <= 0 or (self.group_size is not None and self.group_size <= 0):
            raise ValueError(f"{self.name}: bad bits {self.bits} or group size {self.group_size}")


# ------------------------------------------------------------------ reading the config

def published(config: dict, where: str) -> Published | None:
    """The checkpoint's format from config.json (`where` names it in messages); None when it has no
    quantization_config. A malformed or unknown one is a ConfigError with a one-line message."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError(f"{where}: quantization_config has no quant_method; known: {', '.join(KNOWN_METHODS)}")
    method = method.lower()
    if method in NOT_COUNTED:
        raise ConfigError(f"{where}: quant_method {method!r}: {NOT_COUNTED[method]}; counted: "
                          f"{', '.join(KNOWN_METHODS)}")
    reader = _READERS.get(method)
    if reader is None:
        raise ConfigError(f"{where}: unknown quant_method {method!r}; known: {', '.join(KNOWN_METHODS)}")
    return reader(q, config, f"{where}: quantization_config ({method})")


def _load_dtype(config: dict, default: str, where: str) -> str:
    raw = config.get("torch_dtype", config.get("dtype"))
    if raw is None:
        text = config.get("text_config")
        raw = text.get("torch_dtype", text.get("dtype")) if isinstance(text, dict) else None
    if raw is None or raw == "auto":
        return default
    try:
        return canonical_dtype(raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _int(q: dict, key: str, where: str, default=None, allowed: tuple[int, ...] | None = None) -> int:
    v = q.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or (allowed is not None and v not in allowed):
        want = f"one of {', '.join(map(str, allowed))}" if allowed else "an integer"
        raise ConfigError(f"{where}: {key} must be {want}, got {json.dumps(v)}")
    return v


def _group(q: dict, where: str, key: str = "group_size", default: int = 128) -> int | None:
    g = _int(q, key, where, default)
    if g == -1:
        return None  # one group over the whole input dimension
    if g <= 0:
        raise ConfigError(f"{where}: {key} must be positive or -1, got {g}")
    return g


def _patterns(q: dict, keys: tuple[str, ...], where: str) -> tuple[str, ...]:
    for key in keys:
        v = q.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
            raise ConfigError(f"{where}: {key} must be a list of module names, got {json.dumps(v)[:60]}")
        for p in v:
            try:
                re.compile(p.removeprefix("re:"))
            except re.error as e:
                raise ConfigError(f"{where}: {key} entry {p!r} is not a valid pattern ({e})") from None
        return tuple(v)
    return ()


def _stand_in(bits: int) -> str:
    return "quanto-int4" if bits <= 4 else "quanto-int8"


def _awq(q: dict, config: dict, where: str) -> Published:
    bits = _int(q, "bits", where, 4, allowed=(4,))  # WQLinear_GEMM / _GEMV: "Only 4-bit are supported for now."
    g = _group(q, where)
    version = str(q.get("version", q.get("format", "gemm"))).lower()
    if version not in ("gemm", "gemv"):
        raise ConfigError(f"{where}: AWQ version {version!r} is not counted; counted: gemm, gemv")
    if version == "gemv" and g is not None and g < 128 and g not in (64, 32):
        raise ConfigError(f"{where}: AWQ gemv packs group sizes >= 128, 64 or 32 only, got {g}")
    zero = q.get("zero_point", True)
    gtext = f"group {g}" if g else "one group per row"
    return Published(
        method="awq", name=f"awq-int4-g{g or 'all'}" + ("-gemv" if version == "gemv" else ""),
        description=f"AWQ 4-bit, {gtext}, {'zero points' if zero else 'no zero points'} ({version.upper()} layout)",
        bits=bits, group_size=g, quality=QUALITY_AWQ, load_dtype=_load_dtype(config, "float16", where),
        skip=_patterns(q, ("modules_to_not_convert",), where), scheme=None, stand_in=_stand_in(bits),
        loaders=_LOADERS["awq"], layout=f"awq-{version}", scale_dtype="F16")


def _gptq(q: dict, config: dict, where: str) -> Published:
    bits = _int(q, "bits", where, 4, allowed=(2, 3, 4, 8))  # qlinear_cuda_old: "Only 2,3,4,8 bits are supported."
    g = _group(q, where)
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{where}: GPTQ checkpoint_format {fmt!r} is not counted; counted: gptq, gptq_v2")
    act_order = bool(q.get("desc_act", False))
    quality = (QUALITY_INT8 if bits == 8 else QUALITY_GPTQ_ACT_ORDER if act_order and bits == 4
               else QUALITY_GPTQ if bits == 4 else QUALITY_INT4_RTN)
    if bits < 4:
        quality = QualityCost(ppl_increase_pct=QUALITY_INT4_RTN.ppl_increase_pct,
                              source=f"{bits}-bit GPTQ: no cited figure; at least the 4-bit round-to-nearest cost ("
                                     f"{QUALITY_INT4_RTN.source})")
    return Published(
        method="gptq", name=f"gptq-int{bits}-g{g or 'all'}",
        description=f"GPTQ {bits}-bit, {f'group {g}' if g else 'one group per row'}, zero points"
                    + (", act-order (desc_act)" if act_order else ""),
        bits=bits, group_size=g, quality=quality, load_dtype=_load_dtype(config, "float16", where),
        skip=_patterns(q, ("modules_to_not_convert",), where), scheme=None, stand_in=_stand_in(bits),
        loaders=_LOADERS["gptq"], layout="gptq", scale_dtype="F16", quantize_lm_head=bool(q.get("lm_head", False)))


def _fp8(q: dict, config: dict, where: str) -> Published:
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in block)):
        raise ConfigError(f"{where}: weight_block_size must be two positive integers, got {json.dumps(block)}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"{where}: activation_scheme must be dynamic or static, got {json.dumps(scheme)}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}: fmt {json.dumps(fmt)} is not counted; counted: e4m3")
    skip = _patterns(q, ("modules_to_not_convert", "ignored_layers"), where)
    common = dict(method="fp8", bits=8, group_size=None, quality=QUALITY_FP8,
                  load_dtype=_load_dtype(config, "bfloat16", where), skip=skip, scheme=None, stand_in="quanto-int8",
                  loaders=_LOADERS["fp8"])
    if block is None:
        return Published(name="fp8-tensor", description=f"FP8 e4m3, one fp32 scale per tensor, {scheme} activations",
                         layout="fp8-tensor", input_scales=(("input_scale", "F32"),) if scheme == "static" else (),
                         **common)
    bo, bi = block
    ue8m0 = q.get("scale_fmt") == "ue8m0"
    return Published(name=f"fp8-block{bo}x{bi}",
                     description=f"FP8 e4m3, one {'ue8m0' if ue8m0 else 'fp32'} scale per {bo}x{bi} block, "
                                 f"{scheme} activations",
                     layout="fp8-block", block=(bo, bi), scale_dtype="U8" if ue8m0 else "F32",
                     input_scales=(("activation_scale", "F32"),) if scheme == "static" else (), **common)


def _fbgemm(q: dict, config: dict, where: str) -> Published:
    return Published(method="fbgemm_fp8", name="fbgemm-fp8", bits=8, group_size=None,
                     description="FP8 e4m3 (fbgemm), one fp32 scale per output row, dynamic activations",
                     quality=QUALITY_FP8, load_dtype=_load_dtype(config, "bfloat16", where),
                     skip=_patterns(q, ("modules_to_not_convert",), where), scheme=None, stand_in="quanto-int8",
                     loaders=_LOADERS["fbgemm_fp8"], layout="fbgemm-fp8")


def _mxfp4(q: dict, config: dict, where: str) -> Published:
    return Published(method="mxfp4", name="mxfp4", bits=4, group_size=MXFP4_GROUP,
                     description="MXFP4 routed experts (e2m1 values, one e8m0 scale per 32), the rest unquantized",
                     quality=QUALITY_MXFP4, load_dtype=_load_dtype(config, "bfloat16", where),
                     skip=_patterns(q, ("modules_to_not_convert",), where), scheme=None, stand_in="quanto-int4",
                     loaders=_LOADERS["mxfp4"], layout="mxfp4")


def _bnb(q: dict, config: dict, where: str) -> Published:
    four, eight = bool(q.get("load_in_4bit")), bool(q.get("load_in_8bit"))
    if four == eight:
        raise ConfigError(f"{where}: exactly one of load_in_4bit and load_in_8bit must be true")
    skip = _patterns(q, ("llm_int8_skip_modules",), where)
    common = dict(method="bitsandbytes", group_size=None, load_dtype=_load_dtype(config, "bfloat16", where),
                  skip=skip, loaders=_LOADERS["bitsandbytes"])
    if eight:
        s = SCHEMES["bnb-int8"]
        return Published(name="bnb-int8", description=s.description, bits=8, quality=s.quality, scheme=s.name,
                         stand_in="quanto-int8", layout="bnb-8bit", **common)
    qt = q.get("bnb_4bit_quant_type", "fp4")  # transformers' BitsAndBytesConfig default is fp4
    if qt not in ("nf4", "fp4"):
        raise ConfigError(f"{where}: bnb_4bit_quant_type must be nf4 or fp4, got {json.dumps(qt)}")
    dq = bool(q.get("bnb_4bit_use_double_quant", False))
    s = SCHEMES[f"bnb-{qt}" + ("-dq" if dq else "")]
    return Published(name=s.name, description=s.description, bits=4, quality=s.quality, scheme=s.name,
                     stand_in="quanto-int4", layout="bnb-4bit", bnb_quant_type=qt, double_quant=dq,
                     **{**common, "group_size": BNB_BLOCKSIZE})


_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "nvfp4-pack-quantized")


def _ct(q: dict, config: dict, where: str) -> Published:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise ConfigError(f"{where}: config_groups must be an object of quantization groups")
    first = next(iter(groups.values()))
    if any((g.get("weights"), g.get("input_activations"), g.get("format")) !=
           (first.get("weights"), first.get("input_activations"), first.get("format")) for g in groups.values()):
        raise ConfigError(f"{where}: groups with different schemes (mixed precision) are not counted yet")
    w = first.get("weights")
    if not isinstance(w, dict):
        raise ConfigError(f"{where}: config_groups weights must be an object (weight-quantized checkpoints only)")
    fmt = first.get("format") or q.get("format")
    if fmt not in _CT_FORMATS:
        raise ConfigError(f"{where}: format {json.dumps(fmt)} is not counted; counted: {', '.join(_CT_FORMATS)}")
    bits = _int(w, "num_bits", where)
    kind = w.get("type", "int")
    strategy = w.get("strategy", "tensor")
    if kind not in ("int", "float") or strategy not in ("group", "channel", "tensor", "block", "tensor_group"):
        raise ConfigError(f"{where}: weights type {json.dumps(kind)} / strategy {json.dumps(strategy)} not counted")
    g = _int(w, "group_size", where) if strategy in ("group", "tensor_group") else None
    block = None
    if strategy == "block":
        b = w.get("block_structure")
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
            raise ConfigError(f"{where}: block_structure must be two positive integers, got {json.dumps(b)}")
        block = (b[0], b[1])
    load = _load_dtype(config, "bfloat16", where)
    targets = first.get("targets", ["Linear"])
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{where}: targets must be a list of names, got {json.dumps(targets)[:60]}")
    acts = first.get("input_activations")
    inputs: tuple[tuple[str, str], ...] = ()
    if isinstance(acts, dict) and acts.get("dynamic") is False:  # static: a stored scale (lifecycle/initialize.py)
        inputs = (("input_scale", _ST[load]),)
        if not acts.get("symmetric", True):
            inputs += (("input_zero_point", "I8" if acts.get("type", "int") == "int" else "F8_E4M3"),)
    a_bits = acts.get("num_bits", 16) if isinstance(acts, dict) else 16
    sym = bool(w.get("symmetric", True))
    common = dict(method="compressed-tensors", bits=bits, group_size=g, load_dtype=load,
                  skip=_patterns(q, ("ignore",), where), scheme=None, stand_in=_stand_in(bits),
                  loaders=_LOADERS["compressed-tensors"], strategy=strategy, symmetric=sym,
                  act_order=w.get("actorder") == "group", block=block, targets=tuple(targets), scale_dtype=_ST[load])
    if fmt == "nvfp4-pack-quantized":
        if (bits, kind, g) != (4, "float", NVFP4_GROUP):
            raise ConfigError(f"{where}: nvfp4-pack-quantized needs 4-bit float weights in groups of 16")
        if isinstance(acts, dict) and acts.get("num_bits") == 4:
            inputs = (("input_global_scale", "F32"),)
        return Published(name="ct-nvfp4", description="NVFP4 (compressed-tensors): e2m1 values, an fp8 scale per 16, "
                         "an fp32 global scale", quality=QUALITY_NVFP4, layout="ct-nvfp4", input_scales=inputs,
                         **{**common, "scale_dtype": "F8_E4M3"})
    gtext = f"-g{g}" if g else ""
    if kind == "float":
        if bits != 8:
            raise ConfigError(f"{where}: float weights of {bits} bits are counted only as nvfp4-pack-quantized")
        return Published(name="ct-fp8", description=f"FP8 e4m3 (compressed-tensors), {strategy} scales",
                         quality=QUALITY_FP8, layout="ct-float", input_scales=inputs, **common)
    if fmt == "pack-quantized":
        if bits > 8:
            raise ConfigError(f"{where}: pack-quantized packs at most 8 bits, got {bits}")
        quality = QUALITY_INT8 if bits == 8 else QUALITY_INT4_RTN
        if bits == 4:  # llm-compressor's W4A16 recipes run GPTQ
            quality = QualityCost(ppl_increase_pct=QUALITY_GPTQ.ppl_increase_pct,
                                  source="assumed GPTQ-made (llm-compressor's W4A16 recipes): " + QUALITY_GPTQ.source)
        return Published(name=f"ct-w{bits}a{a_bits}{gtext}",
                         description=f"int{bits} weights packed in int32 (compressed-tensors), {strategy} scales"
                                     + ("" if sym else ", zero points"),
                         quality=quality, layout="ct-pack", input_scales=inputs, **common)
    if bits != 8:
        raise ConfigError(f"{where}: {fmt} stores int8 weights, got {bits} bits")
    return Published(name=f"ct-w8a{a_bits}-int8", description=f"int8 weights (compressed-tensors), {strategy} scales"
                     + (f", int{a_bits} activations" if a_bits < 16 else ""),
                     quality=SCHEMES["quanto-w8a8"].quality if a_bits == 8 else QUALITY_INT8, layout="ct-int",
                     input_scales=inputs, **common)


_READERS = {"awq": _awq, "gptq": _gptq, "fp8": _fp8, "fbgemm_fp8": _fbgemm, "mxfp4": _mxfp4, "bitsandbytes": _bnb,
            "compressed-tensors": _ct}


# ------------------------------------------------------------------ which tensors are stored quantized

def transformers_skips(module: str, patterns) -> bool:
    """transformers 5.24 quantizers/quantizers_utils.py should_convert_module, negated: a pattern matches the module
    name from its start up to a module boundary (as a regex: "layers.*.self_attn"), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in patterns)


def ct_matches(module: str, target: str) -> bool:
    """compressed-tensors utils/match.py is_match for a Linear module: "re:<regex>" matched from the start of the name,
    else the exact name or the class name "Linear"."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target in (module, "Linear")


def _module_of(t: TensorSpec) -> str:
    """The module holding the parameter: "model.layers.0.self_attn.q_proj" for its .weight, the experts module for a
    fused experts tensor."""
    return t.name.rsplit(".", 1)[0] if "." in t.name else t.name


def is_quantized(pub: Published, t: TensorSpec) -> bool:
    """Whether the checkpoint stores this tensor in the quantized format. Only weight matrices are: the Linear layers
    inside the decoder layers and (every method but bitsandbytes) the fused routed experts; mxfp4 converts the experts
    only. Embeddings, norms, biases, routers, 1-D tensors and lm_head (layer None) stay in the load dtype -- except a
    GPTQ lm_head the config says is quantized. Then the config's skip list, with the matching rules of the library
    that reads it."""
    if t.kind is Kind.EXPERTS:
        if pub.layout == "bnb-4bit" or pub.layout == "bnb-8bit":
            return False
    elif pub.layout == "mxfp4" or t.kind is not Kind.LINEAR or len(t.shape) != 2:
        return False
    elif t.layer is None and not (pub.quantize_lm_head and t.name == "lm_head.weight"):
        return False
    module = _module_of(t)
    if pub.method == "compressed-tensors":
        if any(ct_matches(module, p) for p in pub.skip):
            return False
        return any(ct_matches(module, p) for p in pub.targets)
    return not transformers_skips(module, pub.skip)


# ------------------------------------------------------------------ what is stored

StoredTensor = tuple[str, tuple[int, ...], str]


def stored_tensors(pub: Published, t: TensorSpec) -> tuple[StoredTensor, ...]:
    """The tensors the checkpoint holds for this parameter: (name, shape, safetensors dtype)."""
    if not is_quantized(pub, t):
        return ((t.name, t.shape, _ST[canonical_dtype(t.dtype)] if t.dtype else _ST[pub.load_dtype]),)
    out_f, in_f = t.matrix_shape
    # Side tensors: "<module>.<suffix>" beside an nn.Linear weight, "<param>_<suffix>" beside a fused experts tensor.
    fused = t.kind is Kind.EXPERTS
    lead = (t.shape[0],) if fused else ()
    base = t.name + "_" if fused else _module_of(t) + "."
    rows = _LAYOUTS[pub.layout](pub, out_f, in_f)
    return tuple((t.name if suffix is None else base + suffix, lead + shape, dtype) for suffix, shape, dtype in rows)


def stored_bytes(pub: Published, t: TensorSpec) -> int:
    """Exact bytes on disk of this parameter with its side tensors (qzeros, scales, g_idx, block scales, ...)."""
    return sum(math.prod(shape) * _ST_BYTES[dtype] for _, shape, dtype in stored_tensors(pub, t))


def total_stored_bytes(pub: Published, tensors) -> int:
    return sum(stored_bytes(pub, t) for t in tensors)


# Each layout: (out, in) of one matrix -> rows of (suffix or None for the weight's own name, shape, dtype).
Row = tuple[str | None, tuple[int, ...], str]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _awq_gemm(pub: Published, out_f: int, in_f: int) -> list[Row]:
    g = pub.group_size or in_f
    pack = 32 // pub.bits
    return [("qweight", (in_f, _cdiv(out_f, pack)), "I32"), ("qzeros", (_cdiv(in_f, g), _cdiv(out_f, pack)), "I32"),
            ("scales", (_cdiv(in_f, g), out_f), "F16")]


def awq_zeros_width(in_features: int, group_size: int, pack_num: int = 8) -> int:
    """AutoAWQ awq/modules/linear/gemv.py calculate_zeros_width: the groups of a row over 8, padded to a multiple of 2
    for group 64 and of 4 for group 32."""
    multiplier = 1 if group_size >= 128 else {64: 2, 32: 4}[group_size]
    base = _cdiv(in_features // group_size, pack_num)
    return _cdiv(base, multiplier) * multiplier


def _awq_gemv(pub: Published, out_f: int, in_f: int) -> list[Row]:
    g = pub.group_size or in_f
    pack = 32 // pub.bits
    width = awq_zeros_width(in_f, g, pack)
    return [("qweight", (out_f, _cdiv(in_f, pack)), "I32"), ("qzeros", (out_f, width), "I32"),
            ("scales", (out_f, width * pack), "F16")]


def _gptq(pub: Published, out_f: int, in_f: int) -> list[Row]:
    g = pub.group_size or in_f
    return [("qweight", (_cdiv(in_f * pub.bits, 32), out_f), "I32"),
            ("qzeros", (_cdiv(in_f, g), _cdiv(out_f * pub.bits, 32)), "I32"),
            ("scales", (_cdiv(in_f, g), out_f), "F16"), ("g_idx", (in_f,), "I32")]


def _input_rows(pub: Published, shape: tuple[int, ...]) -> list[Row]:
    return [(suffix, shape, dtype) for suffix, dtype in pub.input_scales]


def _fp8_block(pub: Published, out_f: int, in_f: int) -> list[Row]:
    bo, bi = pub.block
    return [(None, (out_f, in_f), "F8_E4M3"), ("weight_scale_inv", (_cdiv(out_f, bo), _cdiv(in_f, bi)),
                                                pub.scale_dtype)] + _input_rows(pub, ())


def _fp8_tensor(pub: Published, out_f: int, in_f: int) -> list[Row]:
    return [(None, (out_f, in_f), "F8_E4M3"), ("weight_scale", (), "F32")] + _input_rows(pub, ())


def _fbgemm(pub: Published, out_f: int, in_f: int) -> list[Row]:
    return [(None, (out_f, in_f), "F8_E4M3"), ("weight_scale", (out_f, 1), "F32")]


def _mxfp4(pub: Published, out_f: int, in_f: int) -> list[Row]:
    groups = _cdiv(in_f, MXFP4_GROUP)
    return [("blocks", (out_f, groups, MXFP4_GROUP // 2), "U8"), ("scales", (out_f, groups), "U8")]


def bnb_quant_state_json(pub: Published, out_f: int, in_f: int) -> str:
    """The JSON bitsandbytes packs into weight.quant_state.bitsandbytes__<type> (functional.py QuantState.as_dict with
    packed=True: the non-tensor entries in their order; utils.py pack_dict_to_tensor: json.dumps, UTF-8, one uint8 per
    byte). dtype is the dtype the weight was quantized from, written as str(torch dtype).strip("torch.")."""
    d: dict = {"quant_type": pub.bnb_quant_type, "blocksize": BNB_BLOCKSIZE, "dtype": pub.load_dtype,
               "shape": [out_f, in_f]}
    if pub.double_quant:
        d.update({"nested_blocksize": BNB_NESTED_BLOCKSIZE, "nested_dtype": "float32",
                  "nested_offset": 0.0})
    text = json.dumps(d)
    if pub.double_quant:  # the offset's repr at its counted width in place of "0.0"
        text = text[:-len("0.0}")] + "0" * BNB_NESTED_OFFSET_JSON_CHARS + "}"
    return text


def _bnb4(pub: Published, out_f: int, in_f: int) -> list[Row]:
    n = out_f * in_f
    blocks = _cdiv(n, BNB_BLOCKSIZE)
    rows: list[Row] = [(None, (_cdiv(n, 2), 1), "U8")]
    if pub.double_quant:
        rows += [("weight.absmax", (blocks,), "U8"), ("weight.quant_map", (16,), "F32"),
                 ("weight.nested_absmax", (_cdiv(blocks, BNB_NESTED_BLOCKSIZE),), "F32"),
                 ("weight.nested_quant_map", (256,), "F32")]
    else:
        rows += [("weight.absmax", (blocks,), "F32"), ("weight.quant_map", (16,), "F32")]
    state = bnb_quant_state_json(pub, out_f, in_f)
    return rows + [(f"weight.quant_state.bitsandbytes__{pub.bnb_quant_type}", (len(state.encode()),), "U8")]


def _bnb8(pub: Published, out_f: int, in_f: int) -> list[Row]:
    return [(None, (out_f, in_f), "I8"), ("SCB", (out_f,), "F32"), ("weight_format", (), "U8")]


def _ct_scale_shape(pub: Published, out_f: int, in_f: int) -> tuple[int, ...]:
    """compressed-tensors lifecycle/initialize.py _initialize_scale_zero_point: group (out, ceil(in/g)), channel
    (out, 1), tensor (1,); block (ceil(out/bo), ceil(in/bi))."""
    if pub.strategy in ("group", "tensor_group"):
        return (out_f, max(_cdiv(in_f, pub.group_size), 1))
    if pub.strategy == "channel":
        return (out_f, 1)
    if pub.strategy == "block":
        return (_cdiv(out_f, pub.block[0]), _cdiv(in_f, pub.block[1]))
    return (1,)


def _ct_tail(pub: Published, in_f: int) -> list[Row]:
    return ([("weight_g_idx", (in_f,), "I32")] if pub.act_order else []) + _input_rows(pub, (1,))


def _ct_pack(pub: Published, out_f: int, in_f: int) -> list[Row]:
    pack = 32 // pub.bits
    scale = _ct_scale_shape(pub, out_f, in_f)
    rows: list[Row] = [("weight_packed", (out_f, _cdiv(in_f, pack)), "I32"), ("weight_shape", (2,), "I64"),
                       ("weight_scale", scale, pub.scale_dtype)]
    if not pub.symmetric and pub.strategy in ("group", "channel"):  # packed along the output dimension
        rows.append(("weight_zero_point", (_cdiv(out_f, pack), scale[1]), "I32"))
    return rows + _ct_tail(pub, in_f)


def _ct_plain(pub: Published, out_f: int, in_f: int) -> list[Row]:
    dtype = "I8" if pub.layout == "ct-int" else "F8_E4M3"
    scale = _ct_scale_shape(pub, out_f, in_f)
    rows: list[Row] = [(None, (out_f, in_f), dtype), ("weight_scale", scale, pub.scale_dtype)]
    if not pub.symmetric:
        rows.append(("weight_zero_point", scale, dtype))
    return rows + _ct_tail(pub, in_f)


def _ct_nvfp4(pub: Published, out_f: int, in_f: int) -> list[Row]:
    return [("weight_packed", (out_f, _cdiv(in_f, 2)), "U8"),
            ("weight_scale", (out_f, _cdiv(in_f, NVFP4_GROUP)), "F8_E4M3"),
            ("weight_global_scale", (1,), "F32")] + _input_rows(pub, (1,))


_LAYOUTS = {"awq-gemm": _awq_gemm, "awq-gemv": _awq_gemv, "gptq": _gptq, "fp8-block": _fp8_block,
            "fp8-tensor": _fp8_tensor, "fbgemm-fp8": _fbgemm, "mxfp4": _mxfp4, "bnb-4bit": _bnb4, "bnb-8bit": _bnb8,
            "ct-pack": _ct_pack, "ct-int": _ct_plain, "ct-float": _ct_plain, "ct-nvfp4": _ct_nvfp4}


# ------------------------------------------------------------------ stored names back to parameters

# Side tensors named after their module: "<module>.<suffix>" belongs to "<module>.weight".
_MODULE_SUFFIXES = frozenset({
    "qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "input_scale", "activation_scale",
    "SCB", "weight_format", "weight_packed", "weight_shape", "weight_zero_point", "weight_global_scale",
    "input_global_scale", "weight_g_idx", "input_zero_point"})
# bitsandbytes 4-bit: "<module>.weight.<suffix>".
_WEIGHT_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4",
                    "quant_state.bitsandbytes__fp4")
# Fused experts: "<experts>.<param>_<suffix>" belongs to "<experts>.<param>" (longest first: scale_inv before scale).
_FUSED_SUFFIXES = tuple(sorted({"blocks", "scales", *_MODULE_SUFFIXES} - {"weight_format"}, key=len, reverse=True))


def owner_of(header_name: str) -> str:
    """The parameter a stored tensor belongs to: "...q_proj.qweight" -> "...q_proj.weight",
    "...q_proj.weight.absmax" -> "...q_proj.weight", "...experts.gate_up_proj_blocks" -> "...experts.gate_up_proj";
    any other name is its own owner."""
    for suffix in _WEIGHT_SUFFIXES:
        if header_name.endswith(".weight." + suffix):
            return header_name[:-len(suffix) - 1]
    module, _, last = header_name.rpartition(".")
    if module and last in _MODULE_SUFFIXES:
        return f"{module}.weight"
    for suffix in _FUSED_SUFFIXES:
        if last.endswith("_" + suffix) and len(last) > len(suffix) + 1:
            return f"{module}.{last[:-len(suffix) - 1]}" if module else last[:-len(suffix) - 1]
    return header_name
