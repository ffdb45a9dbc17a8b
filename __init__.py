"""vramplan: will this LLM run on my machine, how, and how fast?

One package: `vramplan.planner` (pure planning), `vramplan.runtime` (hardware, models, runs), `vramplan.profiles` (the
shipped hardware profiles), `vramplan.cli` (the `vramplan` command). For notebooks and scripts:

    import vramplan
    p = vramplan.plan("llama-3.1-8b", hardware="rtx-4090", context="32k")
    p.fits, p.chosen.weight_quant, p.chosen.speed.decode_tokens_per_s, p.fastest_engine.engine, p.engines[1].ttft_s

Nothing is imported here until it is used: `import vramplan.cli` (every command) pays for none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .planner.hardware import HardwareProfile
    from .planner.modelspec import ModelSpec
    from .planner.plan import Plan

__all__ = ["plan", "model", "hardware"]


def model(name: str, *, revision: str | None = None) -> ModelSpec:
    """A model's exact inventory, as `--model` takes it: a directory with config.json, a Hugging Face id in the local
    cache, a catalog name (`vramplan models`) or any hub id (config.json and safetensors headers, never weights)."""
    from .runtime.hub import resolve
    from .runtime.inventory import load_spec

    _check_text(name, "vramplan.model: the model", "a name or a path")
    if revision is not None:
        _check_text(revision, "vramplan.model: revision", "a branch, tag or commit")
    return load_spec(resolve(name, revision=revision))


def hardware(name: str | None = None) -> HardwareProfile:
    """A hardware profile by name or YAML path (`vramplan profiles list`); None: this machine's cached quick probe."""
    if name is None:
        from .runtime.this_machine import this_machine_profile

        return this_machine_profile()
    from .planner.profiles import resolve_profile
    from .runtime.yaml_cache import load_profile

    _check_text(name, "vramplan.hardware: the profile", "a name, a YAML path or None")
    return resolve_profile(name, load_profile)[0]


def plan(model: str | ModelSpec, hardware: str | HardwareProfile | None = None, context: str | int = "4k",
         **options: Any) -> Plan:
    """The plan `vramplan plan` makes, as the typed Plan (`.to_dict()` is its JSON).

    `model`: a name as `vramplan.model()` takes it, or a ModelSpec. `hardware`: a profile name or path, a
    HardwareProfile, or None for this machine. `context`: tokens ("32k" or 32768). `options`: the Request's fields
    (vramplan.planner.request.Request), e.g. quant=("bnb-nf4",), kv_dtype=("q8",), prefer="speed", gpu_layers=20,
    engine="llama.cpp", compiled=True; a budget as bytes (vram_budget_bytes=...) or as text (vram_budget="20GiB").
    Bad input raises a vramplan.planner.errors.VramplanError subclass with the message the command line prints."""
    from .planner.engines import plan_for_engine
    from .planner.errors import ConfigError
    from .planner.request import Request
    from .planner.units import parse_bytes, parse_context

    from .planner.hardware import HardwareProfile
    from .planner.modelspec import ModelSpec

    if not isinstance(model, (str, ModelSpec)):
        raise ConfigError(f"vramplan.plan: model must be a name or a ModelSpec, got {type(model).__name__}")
    if hardware is not None and not isinstance(hardware, (str, HardwareProfile)):
        raise ConfigError(f"vramplan.plan: hardware must be a profile name, a HardwareProfile or None, got "
                          f"{type(hardware).__name__}")
    if isinstance(context, bool) or not isinstance(context, (str, int)):
        raise ConfigError(f"vramplan.plan: context must be tokens (32768 or \"32k\"), got {type(context).__name__}")
    spec = _model(model) if isinstance(model, str) else model
    hw = hardware if hardware is not None and not isinstance(hardware, str) else _hardware(hardware)
    for text in ("vram_budget", "ram_budget", "headroom"):
        if text in options:
            options[f"{text}_bytes"] = parse_bytes(str(options.pop(text)), what=text)
    for field in ("quant", "kv_dtype"):
        if isinstance(options.get(field), str):
            options[field] = (options[field],)
        if field in options and not (isinstance(options[field], (tuple, list))
                                     and all(isinstance(x, str) for x in options[field])):
            raise ConfigError(f"vramplan.plan: {field} must be a name or a list of names, got {options[field]!r}")
        if field in options:
            options[field] = tuple(options[field])
    try:
        req = Request(context=parse_context(str(context)), **options)
    except TypeError as e:  # an option Request does not have
        raise ConfigError(f"vramplan.plan: {e}") from None
    return plan_for_engine(spec, hw, req)


def _check_text(value: Any, what: str, expected: str) -> None:
    """A str argument, or a one-line ConfigError (a VramplanError) naming what was given instead."""
    if not isinstance(value, str):
        from .planner.errors import ConfigError

        raise ConfigError(f"{what} must be {expected}, got {type(value).__name__}")


_model, _hardware = model, hardware  # plan()'s arguments shadow the functions' names
