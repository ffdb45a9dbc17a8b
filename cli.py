"""vramplan's command line: thin. Parse, call the library, hand data to the one output sink (render.py).

Exit codes: 0 done; 1 nothing fits (or a run that failed after measuring); 2 bad input or usage
(one line, no traceback); 3 an internal error (VRAMPLAN_DEBUG=1 shows the traceback); 130
interrupted (a run still reports and saves what it measured).
"""

import gc
import math
from dataclasses import replace
import sys
from typing import Annotated, Any, Optional

import typer

from vramplan import render
from vramplan.planner.quant import KV_SCHEMES, SCHEMES
from vramplan.render import out
from vramplan.cli_inputs import (UsageError, build_request, fit_default_context, given_files, hardware_files,
                                 model_files, named_profile, not_empty, output_format, prompt_text, resolve_hardware,
                                 resolve_model, run_hardware, save_path, split_list, with_gpus)

from vramplan.cli_errors import (EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NOTHING_FITS,  # noqa: F401 - the
                        RUNTIME_PACKAGES, error_table, exit_code, on_sigterm)  # codes and table, as cli.py's docstring
# What the runtime extra installs: a command that needs one of these says how to get it.

app = typer.Typer(name="vramplan", help="Will this LLM run on my machine, how, and how fast?",
                  no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False)
profiles_app = typer.Typer(help="Hardware profiles: the shipped ones, yours ($VRAMPLAN_PROFILES, "
                                "~/.config/vramplan/profiles), and checks.", no_args_is_help=True)
app.add_typer(profiles_app, name="profiles")
# The version of the JSON `models --json` and `inspect --json` print (a plan's has its own: PLAN_SCHEMA_VERSION).
JSON_SCHEMA_VERSION = 1


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("vramplan")
        except PackageNotFoundError:  # run from a checkout that was never installed
            v = "unknown (not installed)"
        out.raw(f"vramplan {v}\n")
        raise typer.Exit(0)


@app.callback()
def _main(version_: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                 help="Print vramplan's version and exit.")] = False) -> None:
    """Will this LLM run on my machine, how, and how fast?"""


# ---------------------------------------------------------------- shared options
def _complete_model(incomplete: str) -> list[str]:
    """Shell completion of --model: the catalog's names and aliases (a path or a hub id is the shell's to complete)."""
    from vramplan.planner.sources import catalog

    names = [n for e in catalog() for n in (*e.aliases, *(a for v in e.variants for a in v.aliases))]
    return [n for n in dict.fromkeys(names) if n.startswith(incomplete.lower())]


def _complete_profile(incomplete: str) -> list[str]:
    """Shell completion of --hardware: every profile usable by name."""
    from vramplan.planner.profiles import profile_files

    return [n for n in dict.fromkeys(f.stem for f in profile_files()) if n.lower().startswith(incomplete.lower())]


ModelOpt = Annotated[str, typer.Option("--model", "-m", autocompletion=_complete_model,
                                       help="A local model directory (config.json), a Hugging Face id in the "
                                       "local cache, a catalog name (see `vramplan models`), any hub id (org/name: "
                                       "config.json and safetensors headers only, never weights), a GGUF file "
                                       "(PATH.gguf) or a GGUF on the hub by its type (org/repo:Q4_K_M).")]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="The hub revision (branch, tag or commit) of "
                                                    "--model org/name.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
YamlOpt = Annotated[bool, typer.Option("--yaml", help="Print YAML instead of tables.")]
HardwareOpt = Annotated[Optional[str], typer.Option(
    "--hardware", "-H", autocompletion=_complete_profile, help="A hardware profile: a YAML path or a name from "
    "$VRAMPLAN_PROFILES, the user's config directory or the shipped profiles/. Default: this machine (quick probe, "
    "cached; `vramplan probe` refreshes it).")]
ContextOpt = Annotated[Optional[str], typer.Option("--context", "-c", help="Target context per sequence: 4096, 32k, "
                                                   "128k, 1m (default 4k).")]
BatchOpt = Annotated[Optional[int], typer.Option("--batch", help="Concurrent sequences (default 1).")]
PromptTokensOpt = Annotated[Optional[int], typer.Option(
    "--prompt-tokens", help="Prompt length for the TTFT prediction (default: the whole context); for run, a synthetic "
    "prompt of this many tokens.")]
PreferOpt = Annotated[Optional[str], typer.Option("--prefer", help="quality, speed or balanced (default: the best "
                                                  "quality within reach of the fastest).")]
# The scheme names come from the registries (planner/quant.py): a new scheme is in the help with nothing to edit.
QuantOpt = Annotated[Optional[str], typer.Option("--quant", "-q", help="Force weight quantization (comma list): "
                     f"{', '.join(SCHEMES)}.")]
KVOpt = Annotated[Optional[str], typer.Option("--kv-dtype", help="Force KV-cache dtype (comma list): "
                                              f"{', '.join(KV_SCHEMES)}.")]
GpuLayersOpt = Annotated[Optional[int], typer.Option("--gpu-layers", help="Force decoder layers on the GPU "
                                                     "(>= layers: all).")]
OffloadOpt = Annotated[Optional[str], typer.Option("--offload", help="Force the offload mode: stream or cpu.")]
ExpertsOpt = Annotated[Optional[str], typer.Option("--expert-placement", help="Force where an MoE's routed experts "
                       "live: gpu (with their layers), cpu (all in RAM, computed by the CPU) or N (those of the first "
                       "N MoE layers in RAM).")]
VramOpt = Annotated[Optional[str], typer.Option("--vram-budget", help="GPU memory to plan for, e.g. 24GiB.")]
RamOpt = Annotated[Optional[str], typer.Option("--ram-budget", help="Host RAM to plan for, e.g. 64GiB.")]
HeadroomOpt = Annotated[Optional[str], typer.Option("--headroom", help="GPU memory kept free (default 512MiB).")]
ChunkOpt = Annotated[Optional[int], typer.Option("--prefill-chunk", help="Prefill chunk in tokens (default 2048).")]
# A list so that a repeated --emit can be refused (a plain option keeps only the last one given).
EmitOpt = Annotated[Optional[list[str]], typer.Option("--emit", help="Also write the plan for another engine: vllm, "
                    "llama.cpp, ollama or transformers (printed to stdout; with --json, as an \"emit\" object).")]
EngineOpt = Annotated[Optional[str], typer.Option("--engine", help="Whose own search to plan by: vramplan (its own "
                      "runtime, default), llama.cpp or ollama (GGUF file types x llama.cpp KV caches; --quant takes "
                      "GGUF types such as Q4_K_M, --kv-dtype f16, q8_0 or q4_0), or transformers (plain transformers "
                      "+ accelerate). Every plan also shows each engine's own best answer to the request.")]
OverflowOpt = Annotated[bool, typer.Option("--allow-context-overflow", help="Plan a context beyond the model's "
                       "max_position_embeddings (or its rope scaling's reach) instead of refusing it.")]
CompileOpt = Annotated[bool, typer.Option("--compile", help="Decode compiled (a static KV cache and torch.compile, "
                      "CUDA graphs on a GPU): bf16/fp16 weights, every layer on one device; on an NVIDIA GPU also "
                      "int8-wo/int4-wo (compiled only), and on a machine without a GPU quanto-int8/int4/w8a8; priced "
                      "without the eager dispatch.")]
EagerOpt = Annotated[bool, typer.Option("--eager", help="Decode eager, never compiled (on a GPU the plan otherwise "
                    "prices each scheme that compiles both ways and keeps the faster), by transformers' forward (on a "
                    "CPU, cpu-w4a8 otherwise runs vramplan's own decoder step).")]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help="Machines of this profile an engine that scales out "
                     "may use (vLLM over Ray; default 1).")]
GpusOpt = Annotated[Optional[int], typer.Option("--gpus", help="Plan N of the profile's GPU (two 3090s: -H rtx-3090 "
                    "--gpus 2), instead of the count the profile has.")]


# ---------------------------------------------------------------- model commands
@app.command("models")
def models_cmd(as_json: JsonOpt = False) -> None:
    """The built-in catalog: architectures known without any download."""
    from vramplan.planner.sources import catalog_rows

    rows = catalog_rows()
    if as_json:
        out.data({"schema_version": JSON_SCHEMA_VERSION, "models": rows})
    else:
        render.models(rows)


@app.command("inspect")
def inspect_cmd(model: ModelOpt, revision: RevisionOpt = None, as_json: JsonOpt = False) -> None:
    """A model's exact facts: parameters by role, bytes per dtype, KV cache per token."""
    _, spec = resolve_model(model, revision)
    from vramplan.planner.published_scheme import published_summary

    facts = {"schema_version": JSON_SCHEMA_VERSION, **spec.summary(), **published_summary(spec)}
    if as_json:
        out.data(facts)
    else:
        render.inspect(facts, list(spec.notes))


SCHEMAS = ("plan", "models", "inspect", "probe", "profiles-list", "profiles-show", "run")


@app.command("schema")
def schema_cmd(name: Annotated[str, typer.Argument(help=f"Whose --json output: {', '.join(SCHEMAS)}.")]) -> None:
    """Print the JSON Schema (draft 2020-12) of a command's --json output, as shipped with this version."""
    from importlib import resources

    key = name.strip().lower().replace(" ", "-")
    if key not in SCHEMAS:
        raise UsageError(f"no schema named {name!r}: choose one of {', '.join(SCHEMAS)}")
    out.raw(resources.files("vramplan.planner.schemas").joinpath(f"{key}.schema.json").read_text())


# ---------------------------------------------------------------- hardware commands
@app.command("probe")
def probe_cmd(
    quick: Annotated[bool, typer.Option("--quick", help="Read only (NVML, psutil) and a short RAM copy: about a "
                                        "second, no torch; GPU peaks from datasheets.")] = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the profile as YAML to this path (its name "
                                                "becomes the file's stem).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Read and measure this machine, print its hardware profile, and refresh the cached one `plan` uses."""
    _long_command()
    from vramplan.planner.profile_yaml import profile_to_dict
    from vramplan.planner.quoting import shell_quote
    from vramplan.runtime.files import save_profile
    from vramplan.runtime.probe import probe
    from vramplan.runtime.this_machine import store_or_why

    path = save_path(save)
    with out.status("probing this machine") as status:
        result = probe(quick=quick, progress=lambda msg: status.update(f"probing: {msg}"))
    profile = result.profile
    cached, unsaved = store_or_why(profile)
    if cached is not None:
        out.info(f"this machine's cached profile refreshed: {cached}")
    else:
        out.info(f"this machine's cached profile not refreshed: {unsaved}")
    if path:
        profile = named_after(profile, path)
        out.info(f"saved {save_profile(profile, path)} (use it with --hardware {shell_quote(path)})")
    if as_json:
        out.data({"schema_version": JSON_SCHEMA_VERSION, "profile": profile_to_dict(profile),
                  "readings": result.readings, "elapsed_s": round(result.elapsed_s, 3)})
        return
    render.profile(profile)
    out.info(f"{'quick ' if quick else ''}probe took {result.elapsed_s:.1f} s")


@profiles_app.command("list")
def profiles_list_cmd(as_json: JsonOpt = False) -> None:
    """Every profile usable by name, where it lives, and whether it validates."""
    from vramplan.planner.profiles import list_profiles, search_dirs
    from vramplan.runtime.yaml_cache import load_profile

    entries = list_profiles(load_profile)
    if not as_json:
        render.profiles_list(entries, search_dirs())
        return
    data = []
    for e in entries:
        d: dict[str, Any] = {"name": e.name, "path": str(e.path), "origin": e.origin, "valid": e.error is None}
        if e.shadows:
            d["shadows"] = [{"path": str(p), "origin": origin} for p, origin in e.shadows]
        if e.error is not None:
            d["error"] = e.error
        else:
            p = e.profile
            d.update(description=p.description, kind=render._profile_kind(p), ram_bytes=p.host.ram_bytes,
                     gpus=[{"name": g.name, "count": g.count, "memory_bytes": g.memory_bytes} for g in p.gpus],
                     measured=p.measured)
        data.append(d)
    out.data({"schema_version": JSON_SCHEMA_VERSION, "profiles": data})


@profiles_app.command("show")
def profiles_show_cmd(
    name: Annotated[str, typer.Argument(help="A profile name (see `vramplan profiles list`) or a YAML path.")],
    as_json: JsonOpt = False,
    as_yaml: Annotated[bool, typer.Option("--yaml", help="Print the profile as YAML (a starting point for your "
                                          "own).")] = False,
) -> None:
    """One profile in full: GPUs, host, link, overheads, calibration, notes."""
    from vramplan.planner.profile_yaml import dumps_profile, profile_to_dict

    fmt = output_format(as_json, as_yaml)
    profile, path = named_profile(name)
    if fmt == "json":
        out.data({"schema_version": JSON_SCHEMA_VERSION, "path": str(path), "profile": profile_to_dict(profile)})
    elif fmt == "yaml":
        out.raw(dumps_profile(profile))
    else:
        render.profile(profile, path)


@profiles_app.command("validate")
def profiles_validate_cmd(
    paths: Annotated[Optional[list[str]], typer.Argument(
        help="Profile YAML files, or profile names, to check; none: every profile file of the search directories "
             "($VRAMPLAN_PROFILES, yours, the shipped set).")] = None,
) -> None:
    """Check profile files strictly; exit 1 if any is invalid (one message per bad file, every file checked)."""
    from vramplan.planner.errors import ProfileError
    from vramplan.planner.profile_yaml import load_profile, profile_errors
    from vramplan.planner.profiles import looks_like_path, profile_files, resolve_profile

    targets = list(paths) if paths else [str(f) for f in profile_files()]
    bad = 0
    for p in targets:
        try:  # a name: the file it finds (found, not read: profile_errors reads it)
            path = p if looks_like_path(p) else resolve_profile(p, lambda f: None)[1]
        except ProfileError as e:
            errors = [str(e)]
        else:
            errors = profile_errors(path)
        if errors:
            bad += 1
            for message in errors:
                out.labelled("invalid:", "bold red", message)
            continue
        prof = load_profile(path)
        out.line(f"ok: {p} ({prof.name})" + (f" = {path}" if str(path) != p else ""))
    if bad:
        raise typer.Exit(1)


def named_after(profile, path: str):
    """A profile to be saved at `path`, named after the file (its stem, made a safe name), as `--hardware NAME` finds
    it; its own name where the stem has nothing usable."""
    import re
    from pathlib import Path

    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).stem).strip("-.")
    return profile.replace(name=stem or profile.name)


# ---------------------------------------------------------------- plan / calibrate / run
@app.command("plan")
def plan_cmd(
    model: ModelOpt,
    revision: RevisionOpt = None,
    context: ContextOpt = None,
    hardware: HardwareOpt = None,
    batch: BatchOpt = None,
    prompt_tokens: PromptTokensOpt = None,
    prefer: PreferOpt = None,
    quant: QuantOpt = None,
    kv_dtype: KVOpt = None,
    gpu_layers: GpuLayersOpt = None,
    offload: OffloadOpt = None,
    expert_placement: ExpertsOpt = None,
    vram_budget: VramOpt = None,
    ram_budget: RamOpt = None,
    headroom: HeadroomOpt = None,
    prefill_chunk: ChunkOpt = None,
    emit: EmitOpt = None,
    engine: EngineOpt = None,
    nodes: NodesOpt = None,
    gpus: GpusOpt = None,
    allow_context_overflow: OverflowOpt = False,
    compiled: CompileOpt = False,
    eager: EagerOpt = False,
    min_tok_s: Annotated[Optional[float], typer.Option(
        "--min-tok-s", help="The least decode speed (tokens/s) a plan must reach to be called usable (default 1; a "
        "slower plan that fits is reported as fitting but not usable).")] = None,
    max_ttft: Annotated[Optional[str], typer.Option(
        "--max-ttft", help="The longest time to first token a usable plan may take: seconds, or 90s, 10m, 2h "
        "(default 10m).")] = None,
    as_json: JsonOpt = False,
    as_yaml: YamlOpt = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the plan for `vramplan run --plan` (YAML; "
                                                "JSON for a .json path).")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Show every candidate and the constants used (by default: "
                                           "the plan, its memory and the best alternatives; --json has "
                                           "everything).")] = False,
    concurrency: Annotated[bool, typer.Option("--concurrency", help="Also say how many sequences of this context "
                                              "each engine runs at once with the format it chose, and their "
                                              "aggregate decode (vLLM: what its KV pool holds).")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Say where the predicted speed's constants come from: "
                                          "calibrated, defaults, or fitted to which public measurements "
                                          "(each record's source is printed; the corpus installs with "
                                          "vramplan).")] = False,
) -> None:
    """Will it fit, how, and how fast: quantization, KV dtype and GPU/CPU split for a target context."""
    from vramplan.planner.engines import EMIT_ENGINES, check_emit
    from vramplan.planner.engines import emit as write_for
    from vramplan.planner.engines import plan_for_engine

    fmt = output_format(as_json, as_yaml)
    path = save_path(save, inputs={"--hardware": hardware_files(hardware), "--model": model_files(model)})
    req = build_request(context, batch, prompt_tokens, prefer, quant, kv_dtype, gpu_layers, offload, vram_budget,
                        ram_budget, headroom, prefill_chunk, nodes=nodes, engine=engine,
                        allow_context_overflow=allow_context_overflow, expert_placement=expert_placement,
                        compiled=compiled, eager=eager, min_tok_s=min_tok_s, max_ttft=max_ttft)
    if emit and len(emit) > 1:
        raise UsageError(f"--emit was given {len(emit)} times ({', '.join(emit)}): one export per plan; run `vramplan "
                         "plan` once per engine")
    target = emit[0].lower() if emit else None
    if nodes is not None and target != "vllm":
        raise UsageError("--nodes only applies to the vLLM export (its scale-out over Ray): add --emit vllm, or drop "
                         "--nodes")
    if target is not None:
        if target not in EMIT_ENGINES:
            raise UsageError(f"--emit {emit[0]!r}: choose one of {', '.join(EMIT_ENGINES)} "
                             "(see `vramplan plan --help`)")
        check_emit(target, req.engine)
    _, spec = resolve_model(model, revision)
    req = fit_default_context(req, context, spec)
    hw = with_gpus(resolve_hardware(hardware), gpus)
    p = plan_for_engine(spec, hw, req)
    if concurrency:
        from vramplan.planner.concurrency import concurrency as each_engine
        from vramplan.planner.engines import ENGINES

        p = replace(p, concurrency=each_engine(ENGINES, spec, hw, p.request, p))
    export = write_for(target, spec, hw, p) if target is not None else None
    d = p.to_dict()
    if path:
        from vramplan.runtime.files import save_data

        save_data(path, d, default="yaml")
    if export is not None:
        d["emit"] = export.to_dict()
    fits = export.fits if export is not None else p.fits
    out.outcome = 0 if fits else EXIT_NOTHING_FITS  # kept if the reader closes stdout mid-report
    if fmt:
        out.data(d, fmt)
    elif export is not None:
        out.raw(export.text)
        out.info(f"{target} export of {spec.name}: {'fits' if export.fits else 'does not fit'} "
                 f"(the plan itself: `vramplan plan` without --emit)")
    else:
        render.plan(d, full=show_all)
        if explain:
            render.speed_sources(d)
    if path and not fmt:
        out.info(f"plan saved to {path}")
    if not fits:
        raise typer.Exit(EXIT_NOTHING_FITS)


@app.command("calibrate")
def calibrate_cmd(
    hardware: HardwareOpt = None,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the calibrated profile (YAML) here.")] = None,
    models: Annotated[Optional[str], typer.Option("--models", help="Comma list of catalog models or config.json "
                                                  "dirs (default: a matrix sized for this machine).")] = None,
    quants: Annotated[Optional[str], typer.Option("--quants", help="Comma list of weight schemes.")] = None,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Comma list of prompt lengths, e.g. "
                                                   "64,384.")] = None,
    new_tokens: Annotated[Optional[int], typer.Option("--new-tokens", help="Tokens generated per run.")] = None,
    repeats: Annotated[Optional[int], typer.Option("--repeats", help="Runs per point; the fastest is kept.")] = None,
    kv_dtypes: Annotated[Optional[str], typer.Option("--kv-dtypes", help="Quantized KV caches to time on the first "
                                                     "model (comma list; 'none' for none).")] = None,
    save_runs: Annotated[Optional[str], typer.Option("--save-runs", help="Also write the measured runs (JSON; YAML for "
                                                     "a .yaml path), to fit them again with later ones "
                                                     "(--add-runs).")] = None,
    add_runs: Annotated[Optional[str], typer.Option("--add-runs", help="Comma list of run files saved by an earlier "
                                                    "--save-runs on this machine: fitted together with these "
                                                    "runs.")] = None,
    engine: Annotated[Optional[str], typer.Option("--engine", help="vramplan (its torch runtime, default) or "
                      "llama.cpp (llama-server on each --gguf file, fitted into llama.cpp's entries).")] = None,
    gguf: Annotated[Optional[str], typer.Option("--gguf", help="Comma list of GGUF files for --engine llama.cpp, one "
                    "per --models entry (the model each was converted from).")] = None,
    llama_server: Annotated[Optional[str], typer.Option("--llama-server", help="llama-server (default: "
                            "$VRAMPLAN_LLAMA_SERVER, else PATH).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a small matrix of real runs here and fit the speed model into the profile's calibration."""
    _long_command()
    from vramplan.planner.profile_yaml import profile_to_dict
    from vramplan.planner.units import parse_context
    from vramplan.runtime.calibrate import calibrate, check_fits, load_runs, matrix_for
    from vramplan.runtime.files import save_data, save_profile
    from vramplan.runtime.this_machine import differences, this_machine_inventory

    out.set_mode(json=as_json)
    run_files = tuple(p.strip() for p in add_runs.split(",") if p.strip()) if add_runs else ()
    inputs = {"--hardware": hardware_files(hardware), "--add-runs": given_files(*run_files)}
    path = save_path(save, inputs=inputs)
    runs_path = save_path(save_runs, "--save-runs", {**inputs, "--save": [path] if path else []})
    earlier = load_runs(run_files) if run_files else []
    here = this_machine_inventory()  # what this machine holds, before any load (no torch imported)
    hw = resolve_hardware(hardware) if hardware is not None else None
    if hw is not None and (differs := differences(hw, here)):
        raise UsageError(f"--hardware {hardware}: its hardware is not this machine's, so runs here cannot calibrate "
                         f"it: {'; '.join(differs)} (calibrate on that machine, or save this one's with "
                         "`vramplan probe --save`)")
    named = split_list(models, "--models", keep_case=True)  # a directory's path keeps its case
    not_empty(engine, "--engine")
    if (engine or "vramplan").lower() == "llama.cpp":
        ignored = [f for f, v in (("--quants", quants), ("--repeats", repeats), ("--kv-dtypes", kv_dtypes),
                                  ("--add-runs", add_runs)) if v is not None]
        if ignored:
            raise UsageError(f"{', '.join(ignored)}: not for --engine llama.cpp (its file types are the --gguf files')")
        return _calibrate_llamacpp(hw, here, named, split_list(gguf, "--gguf", keep_case=True), llama_server, prompts,
                                   new_tokens, path, runs_path, as_json)
    if (engine or "vramplan").lower() != "vramplan" or gguf or llama_server:
        raise UsageError("--engine is vramplan or llama.cpp; --gguf and --llama-server go with --engine llama.cpp")
    m = matrix_for(hw or here, models=named, quants=split_list(quants, "--quants"),
                   prompts=tuple(parse_context(x) for x in split_list(prompts, "--prompts")), new_tokens=new_tokens,
                   repeats=repeats, kv_dtypes=None if kv_dtypes is None else
                   tuple(k for k in split_list(kv_dtypes, "--kv-dtypes") if k != "none"))
    m, dropped = check_fits(hw or here, m, named=named)  # refuses a named model that cannot fit: nothing loaded
    for w in dropped:
        out.warn(w)
    if hw is None:
        from vramplan.runtime.probe import probe

        with out.status("probing this machine (full measurements)..."):
            hw = probe(quick=False).profile
    result = calibrate(hw, m, progress=out.info, earlier=earlier, track=out.progress)
    for w in result.warnings:
        out.warn(w)
    if runs_path:
        save_data(runs_path, {"runs": [r.to_dict() for r in result.records]}, default="json")
        out.info(f"runs saved to {runs_path}")
    if path:  # named after its file, as probe --save names it: two team profiles never share a name
        save_profile(named_after(result.profile, path), path)
        out.info(f"calibrated profile saved to {path} (name {named_after(result.profile, path).name})")
    if as_json:
        out.data({"schema_version": JSON_SCHEMA_VERSION, "profile": profile_to_dict(result.profile),
                  "warnings": list(result.warnings),
                  "runs": [r.to_dict() for r in result.records]})
        return
    render.calibration(result.profile.calibration)


def _calibrate_llamacpp(hw, here, models, ggufs, llama_server, prompts, new_tokens, path, runs_path, as_json):
    from vramplan.planner.profile_yaml import profile_to_dict
    from vramplan.planner.units import parse_context
    from vramplan.runtime.files import save_data, save_profile
    from vramplan.runtime.llamacpp_calibrate import DEFAULT_NEW_TOKENS, DEFAULT_PROMPTS, calibrate_llamacpp
    from vramplan.runtime.llamacpp_run import check_gguf_paths, find_llama_server, read_checked

    if not ggufs or len(ggufs) != len(models):
        raise UsageError(f"--engine llama.cpp: give one --models entry per --gguf file ({len(models)} models, "
                         f"{len(ggufs)} files): the model each file was converted from")
    check_gguf_paths(ggufs)  # regular files: a FIFO would block the header's read
    pairs = [(resolve_model(m, None)[1], f) for m, f in zip(models, ggufs)]
    read_checked(pairs)  # each file is its model's: refused before the server and the probe
    server = find_llama_server(llama_server)
    if hw is None:  # the fit divides by this machine's measured bandwidth and compute
        from vramplan.runtime.probe import probe

        with out.status("probing this machine (full measurements)..."):
            hw = probe(quick=False).profile
    result = calibrate_llamacpp(hw, pairs, server, prompts=tuple(parse_context(x) for x in split_list(
        prompts, "--prompts")) or DEFAULT_PROMPTS, new_tokens=new_tokens or DEFAULT_NEW_TOKENS, say=out.info)
    for w in result.warnings:
        out.warn(w)
    if runs_path:
        save_data(runs_path, {"llama_cpp": result.commit, "runs": result.runs}, default="json")
        out.info(f"runs saved to {runs_path}")
    if path:  # named after its file, as probe --save names it: two team profiles never share a name
        save_profile(named_after(result.profile, path), path)
        out.info(f"calibrated profile saved to {path} (name {named_after(result.profile, path).name})")
    if as_json:
        out.data({"schema_version": JSON_SCHEMA_VERSION, "profile": profile_to_dict(result.profile),
                  "warnings": result.warnings, "runs": result.runs, "llama_cpp": result.commit})
        return
    render.calibration(result.profile.calibration)


@app.command("run")
def run_cmd(
    model: ModelOpt,
    revision: RevisionOpt = None,
    plan_file: Annotated[Optional[str], typer.Option("--plan", help="Run a plan saved by `vramplan plan "
                                                     "--save`.")] = None,
    context: ContextOpt = None,
    hardware: HardwareOpt = None,
    dummy_weights: Annotated[bool, typer.Option("--dummy-weights", help="The real architecture with random weights "
                                                "(no download).")] = False,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[str], typer.Option("--prompt-file", help="Read the prompt from a file.")] = None,
    prompt_tokens: PromptTokensOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    batch: BatchOpt = None,
    prefer: PreferOpt = None,
    quant: QuantOpt = None,
    kv_dtype: KVOpt = None,
    gpu_layers: GpuLayersOpt = None,
    offload: OffloadOpt = None,
    expert_placement: ExpertsOpt = None,
    vram_budget: VramOpt = None,
    ram_budget: RamOpt = None,
    headroom: HeadroomOpt = None,
    prefill_chunk: ChunkOpt = None,
    allow_context_overflow: OverflowOpt = False,
    compiled: CompileOpt = False,
    eager: EagerOpt = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Allow pickle (.bin) checkpoints.")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
    as_json: JsonOpt = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the run report (JSON; YAML for a .yaml "
                                                "path).")] = None,
    engine: Annotated[Optional[str], typer.Option("--engine", help="vramplan (its torch runtime, default) or "
                      "llama.cpp (llama-server on --gguf, planned by llama.cpp's rules for the file's type).")] = None,
    gguf: Annotated[Optional[str], typer.Option("--gguf", help="The GGUF file (of --model) llama.cpp runs.")] = None,
    llama_server: Annotated[Optional[str], typer.Option("--llama-server", help="llama-server (default: "
                            "$VRAMPLAN_LLAMA_SERVER, else PATH).")] = None,
) -> None:
    """Run the model as planned, stream the text, and report predicted versus measured."""
    _long_command()
    from vramplan.planner.plan import load_plan
    from vramplan.planner.search import plan

    out.set_mode(json=as_json)
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0, got {temperature}")
    if batch not in (None, 1):
        raise UsageError("run executes batch 1; plan larger batches with `vramplan plan --batch`")
    planning = {"--context": context, "--batch": batch, "--prefer": prefer, "--quant": quant, "--kv-dtype": kv_dtype,
                "--gpu-layers": gpu_layers, "--offload": offload, "--expert-placement": expert_placement,
                "--vram-budget": vram_budget,
                "--ram-budget": ram_budget, "--headroom": headroom, "--prefill-chunk": prefill_chunk,
                "--allow-context-overflow": allow_context_overflow or None, "--compile": compiled or None,
                "--eager": eager or None}
    if plan_file is not None:
        given = [flag for flag, v in planning.items() if v is not None]
        if given:
            raise UsageError(f"--plan fixes the configuration; drop {', '.join(given)} (or plan again without --plan)")
    path = save_path(save, inputs={"--plan": given_files(plan_file), "--hardware": hardware_files(hardware),
                                    "--prompt-file": given_files(prompt_file), "--model": model_files(model)})
    text = prompt_text(prompt, prompt_file, prompt_tokens)
    not_empty(engine, "--engine")
    if (engine := (engine or "vramplan").lower()) not in ("vramplan", "llama.cpp"):
        raise UsageError(f"--engine {engine!r}: run executes vramplan or llama.cpp")
    if engine == "llama.cpp" and (compiled or eager):
        raise UsageError(f"{'--compile' if compiled else '--eager'} is vramplan's torch runtime's decode mode; "
                         "llama.cpp decodes its own way")
    if engine == "llama.cpp":
        return _report_run(_run_llamacpp(model, revision, plan_file, planning, hardware, gguf, llama_server, text,
                                         prompt_tokens, max_new_tokens, temperature, seed, as_json), as_json, path)
    if gguf is not None or llama_server is not None:
        raise UsageError("--gguf and --llama-server go with --engine llama.cpp")
    source, spec = resolve_model(model, revision)
    from vramplan.planner.published_scheme import PUBLISHED_BACKEND, loaders_note, published_scheme

    if (ps := published_scheme(spec)) is not None and ps.backend == PUBLISHED_BACKEND:
        raise UsageError(f"vramplan's runtime does not load {ps.name} checkpoints: {loaders_note(spec)}")
    if not source.has_weights and not dummy_weights:
        raise UsageError(f"{source.id} has no weights here ({source.origin}); add --dummy-weights to measure its "
                         "speed and memory with random weights")
    hw = run_hardware(hardware)
    if plan_file is not None:
        p = load_plan(plan_file)
    else:
        req = build_request(context, batch, prompt_tokens, prefer, quant, kv_dtype, gpu_layers, offload, vram_budget,
                            ram_budget, headroom, prefill_chunk, allow_context_overflow=allow_context_overflow,
                            expert_placement=expert_placement, compiled=compiled, eager=eager)
        req = fit_default_context(req, context, spec)
        if not req.kv_dtype:  # only the caches this transformers can build
            from dataclasses import replace

            from vramplan.runtime.kvcache import available_kv_dtypes

            req = replace(req, kv_dtype=available_kv_dtypes())
        p = plan(spec, hw, req)
        if not p.fits:
            out.outcome = EXIT_NOTHING_FITS
            render.plan(p.to_dict())
            raise typer.Exit(EXIT_NOTHING_FITS)
    from vramplan.runtime.execute import execute

    # main() turns SIGTERM into KeyboardInterrupt: execute stops generating and still reports
    report = execute(p, spec, hw, source, dummy_weights=dummy_weights, prompt_text=text,
                     prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature,
                     seed=seed, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                     on_text=None if as_json else out.raw, progress=out.info, track=out.progress)
    _report_run(report, as_json, path)


def _report_run(report, as_json: bool, path) -> None:
    """A run's report printed (or its JSON), saved with --save, and its exit code."""
    d = report.to_dict()
    code = EXIT_INTERRUPTED if report.interrupted else EXIT_NOTHING_FITS if report.errors else 0
    out.outcome = code  # kept if the reader closes stdout mid-report
    if as_json:
        out.data(d)
    else:
        out.raw("\n")
        render.run_report(d)
    if path:
        from vramplan.runtime.files import save_data

        save_data(path, d, default="json")
        out.info(f"run report saved to {path}")
    if code:
        raise typer.Exit(code)


def _run_llamacpp(model, revision, plan_file, planning: dict, hardware, gguf, llama_server, text, prompt_tokens,
                  max_new_tokens, temperature, seed, as_json):
    """`run --engine llama.cpp`: llama.cpp's plan for the GGUF file's type, run by llama-server; the report."""
    from vramplan.runtime.llamacpp_run import check_gguf_paths, find_llama_server, plan_for_file, run_llamacpp

    if gguf is None and model.lower().endswith(".gguf"):
        gguf = model  # --model FILE.gguf: that file
    if gguf is None:
        raise UsageError("--engine llama.cpp runs a GGUF file: pass --gguf PATH (convert_hf_to_gguf.py's output)")
    check_gguf_paths([gguf])  # a regular file: a FIFO would block the header's read
    for flag in ("--plan", "--offload", "--prefill-chunk"):
        if (plan_file if flag == "--plan" else planning.get(flag)) is not None:
            raise UsageError(f"{flag} is vramplan's runtime's; llama.cpp plans and places by its own rules")
    _, spec = resolve_model(model, revision)
    hw = run_hardware(hardware)
    req = build_request(*(planning[f] for f in ("--context", "--batch")), prompt_tokens,
                        *(planning[f] for f in ("--prefer", "--quant", "--kv-dtype", "--gpu-layers")), None,
                        *(planning[f] for f in ("--vram-budget", "--ram-budget", "--headroom")), None,
                        engine="llama.cpp", allow_context_overflow=bool(planning["--allow-context-overflow"]),
                        expert_placement=planning["--expert-placement"])
    p = plan_for_file(spec, hw, fit_default_context(req, planning["--context"], spec), gguf, max_new_tokens,
                      prompt_given=text is not None)
    if not p.fits:
        out.outcome = EXIT_NOTHING_FITS
        render.plan(p.to_dict())
        raise typer.Exit(EXIT_NOTHING_FITS)
    return run_llamacpp(p, spec, hw, gguf, find_llama_server(llama_server), prompt_text=text,
                        prompt_tokens=None if text is not None else p.request.prompt_tokens,
                        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                        on_text=None if as_json else out.raw, say=out.info)


def _long_command() -> None:
    """A command that loads models and runs for minutes (run, calibrate, probe) collects its cyclic garbage."""
    gc.enable()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


# ---------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: one-line errors and the exit codes in this module's docstring."""
    previous = on_sigterm(_interrupt)  # SIGTERM ends every command like Ctrl-C
    collecting = gc.isenabled()
    gc.disable()  # a short command frees little; the cyclic collector cost `vramplan plan` 12 ms (bench/startup.py)
    try:
        rc = app(args=argv, prog_name="vramplan", standalone_mode=False)
        out.flush()  # inside the try: a full disk under stdout is reported here, not at the interpreter's exit
        if rc == EXIT_INTERRUPTED:  # typer turns Ctrl-C (and SIGTERM) into this code (run reports first)
            out.err.print("interrupted", highlight=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except SystemExit:
        raise
    except BaseException as e:  # everything else, KeyboardInterrupt included, goes through the table
        sys.exit(exit_code(e))
    finally:
        on_sigterm(previous)
        if collecting:
            gc.enable()


if __name__ == "__main__":
    main()
