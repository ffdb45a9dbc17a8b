"""A pre-quantized checkpoint as a weight scheme: the format it is published in (planner/published.py) behind the
WeightScheme interface every byte count goes through, so that a plan of an AWQ / GPTQ / FP8 / MXFP4 / compressed-tensors
checkpoint counts what is stored, tensor by tensor, and keeps that format (nobody re-quantizes a published checkpoint:
another --quant is refused, in one line). A bitsandbytes checkpoint is vramplan's own scheme of the same layout.

Speed: no engine's constants were fitted on these formats' kernels; a plan prices them with the eager constants of the
vramplan scheme of the same bits (Published.stand_in), over the format's own bytes, and says so. Pure."""

from __future__ import annotations

from dataclasses import replace

from .errors import PlanError
from .formats import WEIGHTS, nearest
from .modelspec import ModelSpec, TensorSpec, dtype_bytes
from .published import Published, is_quantized, published, stored_bytes
from .quant import SCHEMES, WeightScheme
from .record import record


PUBLISHED_BACKEND = "published"


@record(kw_only=True)
class PublishedScheme(WeightScheme):
    """The bytes of a checkpoint as stored (planner.published.stored_bytes); the tensors it leaves unquantized in the
    dtype transformers holds them in."""

    pub: Published | None = None

    def touches(self, t: TensorSpec) -> bool:
        return is_quantized(self.pub, t)

    def tensor_bytes(self, t: TensorSpec, load_dtype: str | None = None) -> int:
        if not self.touches(t):
            return int(t.numel * dtype_bytes(t.held_dtype or self.pub.load_dtype))
        return t.stored_bytes if t.stored_bytes is not None else stored_bytes(self.pub, t)  # the headers' own first


# published() parses the config: once per spec (the spec held with its answer, so its id is not reused meanwhile).
_MEMO: dict[int, tuple[ModelSpec, WeightScheme | None]] = {}
MEMO_SIZE = 8


def published_scheme(spec: ModelSpec) -> WeightScheme | None:
    """The scheme of the format `spec`'s checkpoint is published in, or None for a 16-bit checkpoint."""
    hit = _MEMO.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    pub = published(spec.config, spec.name)
    if pub is None:
        out = None
    elif pub.scheme is not None:  # bitsandbytes: vramplan's own scheme of that layout, loaded as stored
        out = SCHEMES[pub.scheme]
    else:
        out = PublishedScheme(name=pub.name, backend=PUBLISHED_BACKEND, description=pub.description,
                              devices=("cuda", "cpu"), quality=pub.quality, streams_on=(), bits=min(pub.bits, 8),
                              group_size=pub.group_size, compute_dtype=pub.load_dtype, pub=pub)
    if len(_MEMO) >= MEMO_SIZE:
        _MEMO.pop(next(iter(_MEMO)))
    _MEMO[id(spec)] = (spec, out)
    return out


def weight_schemes(spec: ModelSpec, quant: tuple[str, ...]) -> list[WeightScheme]:
    """The weight schemes a plan of `spec` tries: the published format alone (refusing any other --quant), else the
    forced ones, else every scheme."""
    ps = published_scheme(spec)
    if ps is None and spec.gguf is not None and not quant:  # a GGUF file: vramplan's scheme nearest its type
        return [SCHEMES[nearest(spec.gguf.file_type, WEIGHTS, "llama.cpp", "vramplan")]]
    if ps is None:
        return [SCHEMES[q] for q in quant] if quant else list(SCHEMES.values())
    other = [q for q in quant if q != ps.name]
    if other:
        raise PlanError(f"{spec.name} is published pre-quantized ({ps.description}): it is planned as stored, so "
                        f"--quant {','.join(other)} does not apply (plan the 16-bit model to choose a quantization)")
    return [ps]


def scheme_named(spec: ModelSpec, name: str) -> WeightScheme:
    """A plan's weight_quant as a scheme: the published format's, or one of SCHEMES."""
    ps = published_scheme(spec)
    return ps if ps is not None and ps.name == name else SCHEMES[name]


def speed_stand_in(scheme: WeightScheme) -> WeightScheme:
    """The scheme whose constants price a published format's decode (its own bytes are counted apart)."""
    if isinstance(scheme, PublishedScheme):
        return replace(SCHEMES[scheme.pub.stand_in])
    return scheme


def gguf_note(spec: ModelSpec) -> str | None:
    """What vramplan's plan of a model read from a GGUF file is; None for any other model."""
    if spec.gguf is None:
        return None
    name = nearest(spec.gguf.file_type, WEIGHTS, "llama.cpp", "vramplan")
    return (f"planned from a {spec.gguf.file_type} GGUF file: vramplan's runtime loads the model's safetensors "
            f"checkpoint, not the GGUF, so this plan is its scheme nearest {spec.gguf.file_type} ({name}); llama.cpp's "
            "and Ollama's rows plan the file itself")


def loaders_note(spec: ModelSpec) -> str | None:
    """Which engines load the checkpoint as it is, and how, in one line; None for a 16-bit checkpoint."""
    pub = published(spec.config, spec.name)
    if pub is None:
        return None
    how = "; ".join(f"{engine}: {text}" for engine, text in pub.loaders)
    return f"{spec.name} is published pre-quantized ({pub.description}), counted as stored; {how}"


def published_summary(spec: ModelSpec) -> dict:
    """What `inspect` adds for a pre-quantized checkpoint: the format, its bytes as stored and the dtype of the tensors
    it leaves unquantized (the config's torch_dtype may be absent: gpt-oss's is)."""
    ps = published_scheme(spec)
    if ps is None:
        return {}
    return {"checkpoint_dtype": f"{ps.compute_dtype} (the unquantized tensors)",
            "published": {"format": ps.name, "description": ps.description, "stored_bytes": ps.bytes_of(spec.tensors),
                          "quality_cost_pct": ps.quality.ppl_increase_pct, "quality_source": ps.quality.source,
                          "loaders": loaders_note(spec)}}
