"""What a command reads before it works: its options made into a Request, the model and the hardware it names (the
hardware a run plans for), the prompt, and the files it may write (`--save`, never over one of its inputs).

cli.py's commands call these; one-line UsageErrors (exit 2) say what is wrong before any work starts.
"""

import os
import re
import sys

from vramplan.planner.errors import VramplanError
from vramplan.render import out


class UsageError(VramplanError):
    """Options that contradict each other or are empty."""


def split_list(v: str | None, flag: str, *, keep_case: bool = False) -> tuple[str, ...]:
    """A comma list: names lower-cased, paths (keep_case) as given."""
    if v is None:
        return ()
    items = tuple(x.strip() if keep_case else x.strip().lower() for x in v.split(",") if x.strip())
    if not items:
        raise UsageError(f"{flag} is empty: give one or more names, comma-separated")
    return items


def not_empty(given: str | None, flag: str) -> None:
    """A name option given as "" (or spaces) is refused, not read as its default."""
    if given is not None and not given.strip():
        raise UsageError(f"{flag} is empty: give a value, or leave the option out for its default")


def output_format(as_json: bool, as_yaml: bool) -> str | None:
    if as_json and as_yaml:
        raise UsageError("give --json or --yaml, not both")
    return "json" if as_json else "yaml" if as_yaml else None


def save_path(save: str | None, flag: str = "--save", inputs: dict[str, list[str]] | None = None) -> str | None:
    """The --save path, checked writable now (before any work), or None. `inputs` (flag -> the files it names) are
    what the command reads: saving over one of them is refused, before any work too."""
    if save is None:
        return None
    from vramplan.runtime.files import check_writable

    path = str(check_writable(save))
    for name, files in (inputs or {}).items():
        if any(same_file(path, f) for f in files):
            kind = "output" if name.startswith("--save") else "input"
            raise UsageError(f"{flag} {save} is also the {name} {kind}; choose another path")
    return path


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through symlinks, `..` or hard links); a path not there yet by its name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def given_files(*paths: str | None) -> list[str]:
    """Of the inputs a command was given, those that name files (a profile or model named, not a path: none)."""
    return [p for p in paths if p is not None and os.path.isfile(os.path.expanduser(p))]


def hardware_files(hardware: str | None) -> list[str]:
    """The profile file --hardware reads, named by path or by name (found as `named_profile` finds it, unread)."""
    if hardware is None:
        return []
    from vramplan.planner.errors import ProfileError
    from vramplan.planner.profiles import resolve_profile

    try:
        return [str(resolve_profile(hardware, lambda path: None)[1])]
    except ProfileError:  # no such profile: said when it is read
        return []


def model_files(model: str) -> list[str]:
    """The file --model reads when it names one: a config.json, or the one in a model directory."""
    path = os.path.expanduser(model)
    return given_files(os.path.join(path, "config.json") if os.path.isdir(path) else path)


def _budget(text: str | None, flag: str) -> int | None:
    """A budget's bytes; one written in decimal units (24GB) is read as such, and said so, since most people who
    write GB mean the GiB their tools print."""
    if text is None:
        return None
    from vramplan.planner.units import format_bytes, parse_bytes

    n = parse_bytes(text, what=flag)
    if re.search(r"\d\s*[kKmMgGtTpP][bB]\s*$", text.strip()):
        out.info(f"{flag} {text.strip()} read as decimal units: {format_bytes(n)} ({n:,} B; write GiB for binary)")
    return n


def build_request(context: str | None, batch: int | None, prompt_tokens: int | None, prefer: str | None,
                  quant: str | None, kv_dtype: str | None, gpu_layers: int | None, offload: str | None,
                  vram_budget: str | None, ram_budget: str | None, headroom: str | None, prefill_chunk: int | None,
                  *, nodes: int | None = None, engine: str | None = None, allow_context_overflow: bool = False,
                  expert_placement: str | None = None, compiled: bool = False, eager: bool = False,
                  min_tok_s: float | None = None,
                  max_ttft: str | None = None):
    from vramplan.planner.request import (DEFAULT_HEADROOM_BYTES, DEFAULT_PREFILL_CHUNK, USABLE_MAX_TTFT_S,
                                          USABLE_MIN_DECODE_TOK_S, Request)
    from vramplan.planner.units import parse_bytes, parse_context

    for flag, given in (("--prefer", prefer), ("--offload", offload), ("--engine", engine),
                        ("--expert-placement", expert_placement)):
        not_empty(given, flag)
    return Request(
        context=parse_context(context if context is not None else "4k"), batch=1 if batch is None else batch,
        prompt_tokens=prompt_tokens, prefer=(prefer or "balanced").lower(), quant=split_list(quant, "--quant"),
        kv_dtype=split_list(kv_dtype, "--kv-dtype"), gpu_layers=gpu_layers,
        offload=offload.lower() if offload else None,
        vram_budget_bytes=_budget(vram_budget, "--vram-budget"),
        ram_budget_bytes=_budget(ram_budget, "--ram-budget"),
        headroom_bytes=parse_bytes(headroom, what="--headroom") if headroom is not None else DEFAULT_HEADROOM_BYTES,
        prefill_chunk=prefill_chunk if prefill_chunk is not None else DEFAULT_PREFILL_CHUNK,
        nodes=1 if nodes is None else nodes, engine=(engine or "vramplan").lower(),
        allow_context_overflow=allow_context_overflow, expert_placement=expert_placement, compiled=compiled,
        eager=eager,
        usable_min_decode_tok_s=USABLE_MIN_DECODE_TOK_S if min_tok_s is None else min_tok_s,
        usable_max_ttft_s=USABLE_MAX_TTFT_S if max_ttft is None else _seconds(max_ttft, "--max-ttft"),
    )


def _seconds(text: str, flag: str) -> float:
    """A duration as a flag takes it: bare seconds ("90") or with a unit ("90s", "10m", "2h": units.parse_seconds)."""
    from vramplan.planner.units import parse_seconds

    return parse_seconds(float(text) if re.fullmatch(r"\s*\d+(\.\d+)?\s*", text) else text, what=flag)


def fit_default_context(req, context_flag: str | None, spec):
    """Without --context the default (4k) is cut to what the model is made for, when that is shorter."""
    from dataclasses import replace

    from vramplan.planner.modelspec import context_limit

    limit = context_limit(spec)[0]
    if context_flag is not None or not 0 < limit < req.context:
        return req
    out.info(f"context: {limit} tokens, {spec.name}'s maximum (the default 4k is longer)")
    return replace(req, context=limit)  # a --prompt-tokens beyond it is then refused as longer than the context


def resolve_model(model: str, revision: str | None):
    """--model and --revision: where the model comes from (a directory, the HF cache, the catalog, the hub) and its
    exact inventory."""
    from vramplan.runtime.hub import resolve
    from vramplan.runtime.inventory import load_spec

    from vramplan.runtime.hub_gguf import is_hub_gguf

    if model.lower().endswith(".gguf"):
        return gguf_model_source(model)
    if is_hub_gguf(model) and not os.path.exists(model):
        return gguf_model_source(model, revision=revision)
    source = resolve(model, revision=revision)
    if source.note:
        out.info(source.note)
    return source, load_spec(source)


def gguf_model_source(path: str, *, revision: str | None = None):
    """--model FILE.gguf, or org/repo:TYPE on the hub (runtime/hub_gguf.py): the model its metadata describes
    (planner/gguf_model.py), with the file's own tensors, which llama.cpp's and Ollama's plans take as they are (the
    other engines plan the model the file was converted from). A hub file's location is `hf.co/org/repo:TYPE`, as
    Ollama names it (llama.cpp's -hf takes it without the host)."""
    from dataclasses import replace

    from vramplan.planner.gguf_model import load_gguf_model
    from vramplan.planner.sources import ModelSource, spec_from_config
    from vramplan.runtime.hub_gguf import HUB_GGUF_PREFIX, hub_gguf_model, is_hub_gguf

    if is_hub_gguf(path) and not path.lower().endswith(".gguf"):
        m, where = hub_gguf_model(path, revision)
        location = HUB_GGUF_PREFIX + path
    else:
        if revision is not None:
            raise UsageError("--revision applies to a hub id, not to a local GGUF file")
        m = load_gguf_model(os.path.expanduser(path))
        where = location = os.path.abspath(os.path.expanduser(path))
    if m.file_type is None:
        raise UsageError(f"{path}: its general.file_type is none vramplan names: llama.cpp's plans need the file type")
    spec = spec_from_config(m.config, name=m.path_name, source=f"GGUF file {where}", where=where)
    note = (f"{m.path_name}: a {m.file_type} GGUF file ({m.architecture}), {m.file_bytes:,} B; llama.cpp and Ollama "
            "plan it as it is, the other engines the model it was converted from")
    spec = replace(spec, gguf=m, location=location, notes=(*spec.notes, *m.notes, note))
    out.info(note)
    return ModelSource(kind="gguf", id=m.path_name, config=m.config, origin=where), spec


MAX_GPUS = 64  # --gpus: more than any one machine holds


def with_gpus(hw, gpus: int | None):
    """--gpus N: the profile with N of its GPU (its first kind), named so (rtx-3090-x2); the profile itself without."""
    if gpus is None:
        return hw
    from dataclasses import replace

    if not 1 <= gpus <= MAX_GPUS:
        raise UsageError(f"--gpus must be a whole number from 1 to {MAX_GPUS}, got {gpus}")
    if not hw.gpus:
        raise UsageError(f"--gpus {gpus}: hardware {hw.name!r} has no GPU to count")
    if len(hw.gpus) > 1:
        raise UsageError(f"--gpus {gpus}: hardware {hw.name!r} has GPUs of {len(hw.gpus)} kinds; edit the profile")
    return hw.replace(name=f"{hw.name}-x{gpus}", gpus=(replace(hw.gpus[0], count=gpus),))


def resolve_hardware(hardware: str | None):
    """The profile named or at a path; without --hardware, this machine's cached quick probe."""
    if hardware is not None:
        return named_profile(hardware)[0]
    from vramplan.runtime.this_machine import busy_note, this_machine

    here = this_machine()
    if here.probed_now:
        why = f" ({here.why_probed})" if here.why_probed else ""
        where = f"cached in {here.cache_file}" if here.cache_file else f"not cached: {here.why_not_cached}"
        how = f"quick probe taken now{why}, {where}"
    else:
        how = f"quick probe cached in {here.cache_file}; `vramplan probe --quick` refreshes it"
    out.info(f"hardware: this machine ({how})")
    busy = busy_note(here.profile)
    if busy:
        out.warn(f"this machine's {'' if here.probed_now else 'cached '}probe was {busy}")
    return here.profile


def run_hardware(hardware: str | None):
    """The hardware a run plans for: this machine, or a profile within it (a calibrated or shared copy of its probe, a
    CPU-only profile on a GPU machine, less RAM). A run happens here, so a profile with GPUs or RAM this machine does
    not have is refused before anything loads."""
    if hardware is None:
        return resolve_hardware(None)
    from vramplan.runtime.this_machine import beyond_this_machine, this_machine_inventory

    hw = resolve_hardware(hardware)
    if beyond := beyond_this_machine(hw, this_machine_inventory()):
        raise UsageError(f"--hardware {hardware} describes more than this machine has ({'; '.join(beyond)}): a run "
                         "happens here, so it plans for what is here; drop --hardware, or give a profile of this "
                         "machine (`vramplan probe --save FILE`)")
    return hw


def named_profile(name: str):
    """A profile by name or path, and its file; a name that other files of the search path share says which won."""
    from vramplan.planner.profiles import name_shadows, resolve_profile
    from vramplan.runtime.yaml_cache import load_profile

    profile, path = resolve_profile(name, load_profile)
    shadows = name_shadows(name)
    if shadows:
        out.info(f"hardware profile {name!r}: using {path}; it shadows "
                 + ", ".join(f"{p} ({origin})" for p, origin in shadows))
    return profile, path


def prompt_text(prompt: str | None, prompt_file: str | None, prompt_tokens: int | None) -> str | None:
    if prompt is not None and prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        from vramplan.planner.textfiles import read_text

        try:
            prompt = read_text(prompt_file)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {prompt_file}: {getattr(e, 'strerror', None) or e}") from None
    elif prompt is None and prompt_tokens is None and not sys.stdin.isatty():
        piped = sys.stdin.read()
        prompt = piped if piped.strip() else None
    if prompt is not None and prompt_tokens is not None:
        raise UsageError("give a prompt or --prompt-tokens, not both")
    if prompt is not None and not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt
