"""The KV cache for a run: the runtime half of planner.quant's KV schemes, chosen by their backend.

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

from vramplan.planner.errors import VramplanError
from vramplan.planner.quant import KV_SCHEMES, KVScheme

# The cache backends this module builds (KVScheme.backend).
BACKENDS = ("dynamic", "fp8", "quanto")


def available_backends() -> tuple[str, ...]:
    """The cache backends this transformers can build: transformers 5.17 has no fp8 QuantizedCache backend
    (Fp8QuantizedLayer came later), and quanto's needs optimum-quanto installed."""
    from transformers import cache_utils

    out = ["dynamic"]
    if hasattr(cache_utils, "Fp8QuantizedLayer"):
        out.append("fp8")
    if hasattr(cache_utils, "QuantoQuantizedLayer"):
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            pass
        else:
            out.append("quanto")
    return tuple(out)


def available_kv_dtypes() -> tuple[str, ...]:
    """The KV dtypes (planner.quant.KV_SCHEMES names) whose backend this transformers has."""
    backends = available_backends()
    return tuple(name for name, kv in KV_SCHEMES.items() if kv.backend in backends)


def unpack_pure_torch(packed, bits: int):
    """quanto's `unpack` in plain torch ops, as optimum/quanto/library/unpack.py defines its "default" kernel
    (whose module attribute its decorator leaves as None): value i of each byte is (byte & mask_i) >> (bits * i),
    the values concatenated value index first."""
    import torch

    parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
    return torch.cat(parts).to(torch.uint8)


_PURE_TORCH_UNPACK: dict = {}  # dispatch key -> the torch.library.Library that holds the override alive


def use_pure_torch_quanto_unpack(dispatch_key: str = "CUDA") -> bool:
    """Make quanto's `unpack` (what its int4/int2 KV cache calls on every dequantization) run quanto's own
    pure-torch implementation on `dispatch_key` instead of its C++/CUDA extension, which is compiled with
    nvcc the first time it is used (minutes, inside the measured decode; it fails without nvcc).
    optimum/quanto/library/unpack.py holds the pure-torch version, registered for the "default" key, and
    library/extensions/cuda/__init__.py the extension's, registered for "CUDA". True when the override is
    in place (torch may refuse to override: then the extension is built at first use)."""
    if dispatch_key in _PURE_TORCH_UNPACK:
        return True
    import warnings

    import optimum.quanto  # noqa: F401 - defines the quanto::unpack operator
    import torch

    lib = torch.library.Library("quanto", "IMPL")
    try:
        with warnings.catch_warnings():  # torch says it overrides a registered kernel: that is the point
            warnings.simplefilter("ignore", UserWarning)
            lib.impl("unpack", unpack_pure_torch, dispatch_key)
    except (RuntimeError, TypeError):
        return False
    _PURE_TORCH_UNPACK[dispatch_key] = lib
    return True


def make_cache(kv: KVScheme, config) -> Cache:
    """An empty cache of scheme `kv` for one generation with ``config``'s model (see the module docstring)."""
    if kv.backend == "dynamic":
        return DynamicCache(config=config)
    text_config = config.get_text_config(decoder=True)
    sliding = sorted({t for t in (getattr(text_config, "layer_types", None) or []) if t != "full_attention"})
    if sliding:
        raise VramplanError(
            f"kv cache {kv.name} is not available for {text_config.model_type}: transformers' QuantizedCache "
            f"takes only full-attention models and this one has {', '.join(sliding)} layers; use bf16 or fp16 KV"
        )
    if kv.backend not in available_backends():
        raise VramplanError(f"kv cache {kv.name} is not available: this transformers has no {kv.backend!r} "
                            f"QuantizedCache backend (available KV dtypes: {', '.join(available_kv_dtypes())})")
    try:
        if kv.backend == "fp8":
            return QuantizedCache(backend="fp8", config=config)  # fp8 refuses the group-wise options
        import torch

        if torch.cuda.is_available():
            use_pure_torch_quanto_unpack("CUDA")
        # every option given explicitly: transformers 5.17 breaks on an explicit None
        return QuantizedCache(backend="quanto", config=config, nbits=kv.nbits, q_group_size=kv.group_size,
                              residual_length=kv.residual_tokens)
    except (ValueError, ImportError) as exc:
        raise VramplanError(f"kv cache {kv.name} is not available: {str(exc).splitlines()[0]}") from None
