"""The KV cache for a run, chosen by its dtype name.

- "bf16" / "fp16": transformers' ``DynamicCache``, built from the config so that
  sliding-window layers keep only their window. It stores keys and values in the dtype
  the attention produces, i.e. the model's compute dtype. Asking for "fp16" KV with a
  bf16 model (or the reverse) therefore stores bf16: both are 2 bytes per element, so
  every byte count the planner made holds, and casting on every step would cost time
  and, bf16 -> fp16, overflow the keys of models with large activations (fp16 max 65504).
- "fp8": ``QuantizedCache(backend="fp8")``: float8_e4m3fn with one fp32 scale per layer
  and tensor, calibrated on the first update (the first prefill chunk) and frozen;
  later values beyond that amplitude saturate at +-448 x scale.
- "quanto-int4" / "quanto-int2": ``QuantizedCache(backend="quanto")``, KIVI-style:
  int4/int2 in groups of 64 values (q_group_size) with a scale and shift per group in
  the compute dtype; up to ``residual_length`` (128) of the newest tokens are kept
  unquantized. Every update (every decode step) dequantizes the layer's whole cache to
  attend over it, and requantizes all of it when the residual fills: a transient of one
  layer's full K and V in the compute dtype, and a per-token cost that grows with the
  context. The fp8 layer also dequantizes the whole layer on every update.

transformers' QuantizedCache takes only full-attention models; for a model with
sliding-window layers (Gemma 2/3, Mistral with sliding_window set) it is refused here
with a VramplanError.
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicCache, QuantizedCache

from planner.errors import VramplanError

KV_DTYPES = ("bf16", "fp16", "fp8", "quanto-int4", "quanto-int2")
QUANTO_KV_GROUP_SIZE = 64
QUANTO_KV_RESIDUAL_LENGTH = 128
_QUANTO_KV_NBITS = {"quanto-int4": 4, "quanto-int2": 2}


def available_kv_dtypes() -> tuple[str, ...]:
    """The KV dtypes this transformers can build: each quantized one needs its QuantizedCache backend
    (transformers 5.17 has no fp8 backend; quanto's needs optimum-quanto)."""
    import inspect

    from transformers import cache_utils

    source = inspect.getsource(QuantizedCache.__init__)
    out = ["bf16", "fp16"]
    if hasattr(cache_utils, "Fp8QuantizedLayer") and '"fp8"' in source:
        out.append("fp8")
    if hasattr(cache_utils, "QuantoQuantizedLayer"):
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            pass
        else:
            out += ["quanto-int4", "quanto-int2"]
    return tuple(out)


def make_cache(kv_dtype: str, config) -> Cache:
    """An empty cache for one generation with ``config``'s model (see the module docstring)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; one of {', '.join(KV_DTYPES)}")
    if kv_dtype in ("bf16", "fp16"):
        return DynamicCache(config=config)
    text_config = config.get_text_config(decoder=True)
    sliding = sorted({t for t in (getattr(text_config, "layer_types", None) or []) if t != "full_attention"})
    if sliding:
        raise VramplanError(
            f"kv cache {kv_dtype} is not available for {text_config.model_type}: transformers' QuantizedCache "
            f"takes only full-attention models and this one has {', '.join(sliding)} layers; use bf16 or fp16 KV"
        )
    try:
        if kv_dtype == "fp8":
            return QuantizedCache(backend="fp8", config=config)
        return QuantizedCache(
            backend="quanto",
            config=config,
            nbits=_QUANTO_KV_NBITS[kv_dtype],
            q_group_size=QUANTO_KV_GROUP_SIZE,
            residual_length=QUANTO_KV_RESIDUAL_LENGTH,
        )
    except (ValueError, ImportError) as exc:
        raise VramplanError(f"kv cache {kv_dtype} is not available: {str(exc).splitlines()[0]}") from None
