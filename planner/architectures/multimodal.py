"""Multimodal configs (gemma3, llama4, mistral3): plan the text model inside their text_config.

The vision tower and the multimodal projector are not counted. Tensor names are those of the text
model's own `<Arch>ForCausalLM`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..errors import UnsupportedArchitectureError
from ..modelspec import ModelSpec
from .common import with_notes
from .config import Cfg
from .dense import build_gemma3_text, build_ministral, build_ministral3, build_mistral
from .moe import build_llama4_text

Builder = Callable[[Cfg, str], ModelSpec]


def text_part(c: Cfg, name: str, *, builders: dict[str, Builder], default_type: str, wrapper_ties: bool | None,
              wrapper_class: str) -> ModelSpec:
    """The text model's spec; the wrapper's dtype fills in when text_config has none.

    wrapper_ties: the wrapper class's default for its own tie_word_embeddings, when that flag (not the
    text_config's) decides tying in transformers 5.23 (gemma3, mistral3); None when the text model decides
    (llama4). A wrapper that says untied wins. One that says tied while text_config says untied is built
    tied by from_config, but from_pretrained keeps the checkpoint's own lm_head.weight when it differs from
    the embeddings (PreTrainedModel.tie_weights), which is what an untied text_config means: count it.
    """
    text = dict(c.sub("text_config"))
    text.setdefault("model_type", default_type)
    builder = builders.get(text["model_type"]) if isinstance(text["model_type"], str) else None
    if builder is None:
        raise UnsupportedArchitectureError(f"{c.where}: {c.d['model_type']} with text_config model_type "
                                           f"{text['model_type']!r}; supported: {', '.join(builders)}")
    if not (text.get("dtype") or text.get("torch_dtype")):
        text["torch_dtype"] = c.d.get("dtype") or c.d.get("torch_dtype")
    if wrapper_ties is not None and not c.bool("tie_word_embeddings", wrapper_ties):
        text["tie_word_embeddings"] = False
    spec = builder(Cfg(text, c.where + ":text_config"), name)
    return with_notes(replace(spec, config=c.d),
                      f"{c.d['model_type']}: text part only ({spec.architecture} inside {wrapper_class}); "
                      "the vision tower and projector are not counted")


def build_gemma3(c: Cfg, name: str) -> ModelSpec:
    return text_part(c, name, builders={"gemma3_text": build_gemma3_text}, default_type="gemma3_text",
                     wrapper_ties=True, wrapper_class="Gemma3ForConditionalGeneration")


def build_llama4(c: Cfg, name: str) -> ModelSpec:
    # Llama4ForConditionalGeneration holds a Llama4ForCausalLM whose own (text) config decides tying
    return text_part(c, name, builders={"llama4_text": build_llama4_text}, default_type="llama4_text",
                     wrapper_ties=None, wrapper_class="Llama4ForConditionalGeneration")


def build_mistral3(c: Cfg, name: str) -> ModelSpec:
    # Mistral-Small-3.1/3.2 ship a "mistral" text_config, Ministral 3 a "ministral3" one
    builders = {"mistral": build_mistral, "ministral": build_ministral, "ministral3": build_ministral3}
    return text_part(c, name, builders=builders, default_type="mistral", wrapper_ties=True,
                     wrapper_class="Mistral3ForConditionalGeneration")
