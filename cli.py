"""vramplan's command line: thin. Parse, call the library, hand data to one renderer.

Errors the user can fix (planner.errors.VramplanError) become one line on stderr and
exit code 2 (or the error's own code); set VRAMPLAN_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from planner.errors import VramplanError

app = typer.Typer(
    name="vramplan",
    help="Will this LLM run on my machine, how, and how fast?",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output keeps full table widths instead of wrapping at 80 columns.
out = Console(width=None if sys.stdout.isatty() else 160)  # results
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)  # progress, warnings, errors


# ---------------------------------------------------------------- shared options
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="A local model directory (config.json), a Hugging Face id in the local cache, "
        "or a catalog name (see `vramplan models`).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
HardwareOpt = Annotated[
    Optional[str],
    typer.Option(
        "--hardware",
        "-H",
        help="A hardware profile: a YAML path or a name from $VRAMPLAN_PROFILES, the user's config "
        "directory or the shipped profiles/. Default: this machine (quick probe, cached).",
    ),
]


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_data(data: Any, *, as_yaml: bool = False) -> None:
    """The machine-readable sink: JSON (default) or YAML on stdout."""
    if as_yaml:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    else:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")


def table(title: str | None, columns: list[str], rows: list[list[Any]], *, justify_right: set[int] | None = None) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    justify_right = justify_right or set()
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i in justify_right else "left")
    for r in rows:
        t.add_row(*["-" if v is None else str(v) for v in r])
    return t


# ---------------------------------------------------------------- model commands
@app.command("models")
def models_cmd(as_json: JsonOpt = False) -> None:
    """The built-in catalog: architectures known without any download."""
    from planner.sources import catalog, catalog_config
    from planner.architectures import spec_from_config
    from planner.units import format_count, format_tokens

    rows = []
    for e in catalog():
        s = spec_from_config(catalog_config(e.id), name=e.id, source="built-in catalog")
        rows.append({
            "id": e.id,
            "aliases": list(e.aliases),
            "model_type": s.model_type,
            "params_total": s.params_total,
            "params_active": s.params_active,
            "num_layers": s.num_layers,
            "max_context": s.max_context,
            "checkpoint_dtype": s.dtype,
        })
    if as_json:
        print_data(rows)
        return
    out.print(table(
        f"vramplan catalog ({len(rows)} models; use the id or alias with --model)",
        ["id", "alias", "architecture", "params", "active", "layers", "max context"],
        [[r["id"], r["aliases"][0], r["model_type"], format_count(r["params_total"]), format_count(r["params_active"]),
          r["num_layers"], format_tokens(r["max_context"])] for r in rows],
        justify_right={3, 4, 5, 6},
    ))


@app.command("inspect")
def inspect_cmd(model: ModelOpt, as_json: JsonOpt = False) -> None:
    """A model's exact facts: parameters by role, bytes per dtype, KV cache per token."""
    from planner.sources import model_spec
    from planner.units import format_bytes, format_count, format_tokens

    spec = model_spec(model)
    facts = spec.summary()
    if as_json:
        print_data(facts)
        return
    a = facts["attention"]
    kv_layers = facts["kv_bytes_per_token_per_layer"]
    attn = (f"{a['kind'].upper()} {a['num_heads']} heads / {a['num_kv_heads']} KV heads x {a['head_dim']}"
            + (f", MLA cache {a['mla_cache_dim']}/token/layer" if a["kind"] == "mla" else "")
            + (f", sliding windows {a['sliding_windows']} on {facts['sliding_window_layers']} of {spec.num_layers} layers"
               if a["sliding_windows"] else ""))
    rows = [
        ["model", f"{spec.name} ({spec.architecture}, model_type {spec.model_type})"],
        ["source", spec.source],
        ["parameters", f"{facts['params_total']:,} ({format_count(facts['params_total'])})"],
        ["active per token", f"{facts['params_active']:,} ({format_count(facts['params_active'])})"],
        ["layers / hidden / vocab", f"{spec.num_layers} / {spec.hidden_size} / {spec.vocab_size}"],
        ["attention", attn],
        ["max context", format_tokens(spec.max_context)],
        ["tied embeddings", str(spec.tie_word_embeddings)],
        ["checkpoint dtype", spec.dtype],
        ["weights bf16", f"{facts['weight_bytes']['bf16']:,} B ({format_bytes(facts['weight_bytes']['bf16'])})"],
        ["weights fp32", f"{facts['weight_bytes']['fp32']:,} B ({format_bytes(facts['weight_bytes']['fp32'])})"],
        ["KV cache bf16 / token", f"{facts['kv_bytes_per_token']:,} B ({format_bytes(facts['kv_bytes_per_token'])}; "
                                  f"{format_bytes(kv_layers[0])} per layer)"],
    ]
    if "checkpoint" in facts["weight_bytes"]:
        rows.append(["checkpoint on disk", f"{facts['weight_bytes']['checkpoint']:,} B (safetensors headers)"])
    if spec.moe:
        m = facts["moe"]
        rows.append(["mixture of experts", f"{m['num_experts']} experts, top-{m['experts_per_token']}, "
                                           f"{m['num_shared_experts']} shared, {m['moe_layers']} MoE layers"])
    out.print(table("model", ["fact", "value"], rows))
    total = facts["params_total"]
    out.print(table("parameters by role", ["role", "parameters", "share"],
                    [[r, f"{n:,}", f"{100 * n / total:.1f} %"] for r, n in facts["params_by_role"].items()],
                    justify_right={1, 2}))
    for note in spec.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False)

# ---------------------------------------------------------------- hardware commands
# (probe, profiles list/show/validate)
profiles_app = typer.Typer(
    help="Hardware profiles: the shipped ones, yours ($VRAMPLAN_PROFILES, ~/.config/vramplan/profiles), and checks.",
    no_args_is_help=True,
)
app.add_typer(profiles_app, name="profiles")


def _profile_kind(p: Any) -> str:
    if not p.gpus:
        return "CPU only"
    return "unified memory (GPU shares RAM)" if p.unified_memory else "discrete GPU"


def _render_profile(p: Any, path: Any = None) -> None:
    """One profile as tables on stdout (people); notes follow."""
    from planner.units import format_bandwidth, format_bytes, format_flops

    rows: list[list[Any]] = [
        ["name", p.name],
        ["description", p.description],
        ["source", p.source],
        ["kind", _profile_kind(p)],
        ["measured", "yes (vramplan probe)" if p.measured else "no (datasheet / typical / estimated figures)"],
    ]
    if path is not None:
        rows.append(["file", str(path)])
    for i, g in enumerate(p.gpus):
        cc = f", compute capability {g.compute_capability}" if g.compute_capability else ""
        rows += [
            [f"GPU {i}", f"{g.count}x {g.name}{cc}"],
            ["  memory", f"{format_bytes(g.memory_bytes)} ({g.memory_bytes:,} B) per device"],
            ["  memory bandwidth", format_bandwidth(g.memory_bandwidth_bytes_per_s)],
            ["  bf16 compute (dense)", format_flops(g.bf16_flops)],
        ]
    h = p.host
    rows += [
        ["host RAM", f"{format_bytes(h.ram_bytes)} ({h.ram_bytes:,} B)"],
        ["  RAM bandwidth", format_bandwidth(h.ram_bandwidth_bytes_per_s)],
        ["  CPU cores", h.cpu_cores],
        ["  CPU bf16 compute", format_flops(h.cpu_bf16_flops)],
    ]
    if p.link is not None:
        lk = p.link
        rows += [
            ["link", lk.name],
            ["  host->GPU pinned / pageable", f"{format_bandwidth(lk.h2d_pinned_bytes_per_s)} / {format_bandwidth(lk.h2d_pageable_bytes_per_s)}"],
            ["  GPU->host pinned / pageable", f"{format_bandwidth(lk.d2h_pinned_bytes_per_s)} / {format_bandwidth(lk.d2h_pageable_bytes_per_s)}"],
        ]
    o = p.overheads
    if p.gpus:
        rows += [
            ["CUDA context", format_bytes(o.cuda_context_bytes)],
            ["allocator reserve", format_bytes(o.allocator_reserve_bytes)],
            ["kernel launch", f"{o.kernel_launch_s * 1e6:g} us"],
        ]
    out.print(table(f"hardware profile {p.name}", ["", "value"], rows))
    if p.calibration is not None:
        c = p.calibration
        out.print(table(
            f"calibration ({c.measured_at})",
            ["device", "backend", "quant", "bandwidth eff.", "compute eff.", "per layer", "per token"],
            [[e.device, e.backend, e.quant, f"{e.bandwidth_efficiency:.2f}", f"{e.compute_efficiency:.2f}",
              f"{e.per_layer_overhead_s * 1e6:g} us", f"{e.per_token_overhead_s * 1e3:g} ms"] for e in c.entries],
            justify_right={3, 4, 5, 6},
        ))
    if p.notes:
        out.print("[bold]notes[/]")
        for n in p.notes:
            out.print(f"  - {n}", highlight=False, soft_wrap=True)


@app.command("probe")
def probe_cmd(
    quick: Annotated[bool, typer.Option("--quick", help="Read only (NVML, psutil): < 2 s, no torch, peaks from datasheets.")] = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the profile as YAML to this path (its name becomes the file's stem).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Read and measure this machine and print its hardware profile."""
    import re

    from planner.hardware import profile_to_dict, save_profile
    from runtime.probe import probe

    with err.status("probing this machine", spinner="dots") as status:
        result = probe(quick=quick, progress=lambda msg: status.update(f"probing: {msg}"))
    profile = result.profile
    if save:
        from pathlib import Path

        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(save).stem).strip("-.") or profile.name
        profile = profile.replace(name=stem)
        path = save_profile(profile, save)
        err.print(f"saved {path} (use it with --hardware {path})", highlight=False)
    if as_json:
        print_data({"profile": profile_to_dict(profile), "readings": result.readings, "elapsed_s": round(result.elapsed_s, 3)})
        return
    _render_profile(profile)
    err.print(f"{'quick ' if quick else ''}probe took {result.elapsed_s:.1f} s", highlight=False)


@profiles_app.command("list")
def profiles_list_cmd(as_json: JsonOpt = False) -> None:
    """Every profile usable by name, where it lives, and whether it validates."""
    from planner.errors import ProfileError
    from planner.profiles import list_profiles, search_dirs
    from planner.units import format_bandwidth, format_bytes

    entries = list_profiles()
    if as_json:
        data = []
        for e in entries:
            d: dict[str, Any] = {"name": e.name, "path": str(e.path), "origin": e.origin, "valid": not isinstance(e.profile, ProfileError)}
            if isinstance(e.profile, ProfileError):
                d["error"] = str(e.profile)
            else:
                p = e.profile
                d.update(
                    description=p.description,
                    kind=_profile_kind(p),
                    gpus=[{"name": g.name, "count": g.count, "memory_bytes": g.memory_bytes} for g in p.gpus],
                    ram_bytes=p.host.ram_bytes,
                    measured=p.measured,
                )
            data.append(d)
        print_data(data)
        return
    rows = []
    for e in entries:
        if isinstance(e.profile, ProfileError):
            rows.append([e.name, e.origin, f"[red]invalid:[/] {e.profile}", "", "", ""])
            continue
        p = e.profile
        gpu = ", ".join(f"{g.count}x {g.name}" for g in p.gpus) or "CPU only"
        mem = format_bytes(p.gpu_memory_bytes) if p.gpus else "-"
        bw = format_bandwidth(p.gpu_memory_bandwidth_bytes_per_s) if p.gpus else format_bandwidth(p.host.ram_bandwidth_bytes_per_s)
        rows.append([e.name, e.origin, gpu + (" (unified)" if p.unified_memory else ""), mem, bw, format_bytes(p.host.ram_bytes)])
    out.print(table(
        f"hardware profiles ({len(rows)}; use the name with --hardware)",
        ["name", "from", "GPU", "GPU memory", "bandwidth", "RAM"],
        rows,
        justify_right={3, 4, 5},
    ))
    err.print("searched: " + "; ".join(f"{d} ({o})" for d, o in search_dirs()), highlight=False, soft_wrap=True)


@profiles_app.command("show")
def profiles_show_cmd(
    name: Annotated[str, typer.Argument(help="A profile name (see `vramplan profiles list`) or a YAML path.")],
    as_json: JsonOpt = False,
    as_yaml: Annotated[bool, typer.Option("--yaml", help="Print the profile as YAML (a starting point for your own).")] = False,
) -> None:
    """One profile in full: GPUs, host, link, overheads, calibration, notes."""
    from planner.hardware import dumps_profile, profile_to_dict
    from planner.profiles import resolve_profile

    profile, path = resolve_profile(name)
    if as_json:
        print_data({"path": str(path), "profile": profile_to_dict(profile)})
    elif as_yaml:
        sys.stdout.write(dumps_profile(profile))
    else:
        _render_profile(profile, path)


@profiles_app.command("validate")
def profiles_validate_cmd(
    paths: Annotated[list[str], typer.Argument(help="Profile YAML files to check.")],
) -> None:
    """Check profile files strictly; exit 1 if any is invalid (one message per bad file)."""
    from planner.errors import ProfileError
    from planner.hardware import load_profile

    bad = 0
    for p in paths:
        try:
            prof = load_profile(p)
        except ProfileError as e:
            bad += 1
            err.print(f"[bold red]invalid:[/] {e}", highlight=False, soft_wrap=True)
            continue
        out.print(f"ok: {p} ({prof.name})", highlight=False, soft_wrap=True)
    if bad:
        raise typer.Exit(1)


# ---------------------------------------------------------------- plan / run commands
ContextOpt = Annotated[str, typer.Option("--context", "-c", help="Target context per sequence: 4096, 32k, 128k, 1m.")]
BatchOpt = Annotated[int, typer.Option("--batch", help="Concurrent sequences.")]
PromptTokensOpt = Annotated[Optional[int], typer.Option(
    "--prompt-tokens", help="Prompt length for the TTFT prediction (default: the whole context); for run, a synthetic prompt.")]
PreferOpt = Annotated[str, typer.Option("--prefer", help="quality, speed or balanced (best quality within reach of the fastest).")]
QuantOpt = Annotated[Optional[str], typer.Option("--quant", "-q", help="Force weight quantization (comma list): bf16, fp16, bnb-int8, bnb-nf4, bnb-nf4-dq, bnb-fp4, bnb-fp4-dq, quanto-int8, quanto-int4.")]
KVOpt = Annotated[Optional[str], typer.Option("--kv-dtype", help="Force KV-cache dtype (comma list): bf16, fp16, fp8, quanto-int4, quanto-int2.")]
GpuLayersOpt = Annotated[Optional[int], typer.Option("--gpu-layers", help="Force decoder layers on the GPU (>= layers: all).")]
OffloadOpt = Annotated[Optional[str], typer.Option("--offload", help="Force the offload mode: stream or cpu.")]
VramOpt = Annotated[Optional[str], typer.Option("--vram-budget", help="GPU memory to plan for, e.g. 24GiB.")]
RamOpt = Annotated[Optional[str], typer.Option("--ram-budget", help="Host RAM to plan for, e.g. 64GiB.")]
HeadroomOpt = Annotated[Optional[str], typer.Option("--headroom", help="GPU memory kept free (default 512MiB).")]
ChunkOpt = Annotated[Optional[int], typer.Option("--prefill-chunk", help="Prefill chunk in tokens (default 2048).")]


def _split(v: str | None) -> tuple[str, ...]:
    return tuple(x.strip().lower() for x in v.split(",") if x.strip()) if v else ()


def build_request(context: str, batch: int, prompt_tokens: int | None, prefer: str, quant: str | None,
                  kv_dtype: str | None, gpu_layers: int | None, offload: str | None, vram_budget: str | None,
                  ram_budget: str | None, headroom: str | None, prefill_chunk: int | None):
    from planner.request import DEFAULT_HEADROOM_BYTES, DEFAULT_PREFILL_CHUNK, Request
    from planner.units import parse_bytes, parse_context

    return Request(
        context=parse_context(context), batch=batch, prompt_tokens=prompt_tokens, prefer=prefer.lower(),
        quant=_split(quant), kv_dtype=_split(kv_dtype), gpu_layers=gpu_layers,
        offload=offload.lower() if offload else None,
        vram_budget_bytes=parse_bytes(vram_budget, what="--vram-budget") if vram_budget else None,
        ram_budget_bytes=parse_bytes(ram_budget, what="--ram-budget") if ram_budget else None,
        headroom_bytes=parse_bytes(headroom, what="--headroom") if headroom else DEFAULT_HEADROOM_BYTES,
        prefill_chunk=prefill_chunk if prefill_chunk is not None else DEFAULT_PREFILL_CHUNK,
    )


def resolve_hardware(hardware: str | None):
    from planner.profiles import resolve_profile, this_machine_profile

    if hardware:
        return resolve_profile(hardware)[0]
    return this_machine_profile()


def render_plan(p) -> None:
    """The human report of a Plan."""
    from planner.units import format_bytes as fb, format_tokens

    d = p.to_dict()
    m, h, r = d["model"], d["hardware"], d["request"]
    head = (f"[bold]{m['id']}[/] on [bold]{h['name']}[/] ({h['gpu'] or 'no GPU'}"
            f"{', ' + fb(h['gpu_memory_bytes']) if h['gpu'] else ''}, RAM {fb(h['ram_bytes'])}"
            f"{', measured' if h['measured'] else ''}{', calibrated' if h['calibrated'] else ''}) - "
            f"context {format_tokens(r['context'])} x batch {r['batch']}, prefer {r['prefer']}")
    out.print(head)
    c = d["choice"]
    if c:
        where = ("CPU only (no GPU)" if c["compute_device"] == "cpu" else
                 f"{c['gpu_layers']}/{c['total_layers']} layers on the GPU"
                 + (f", {c['total_layers'] - c['gpu_layers']} offloaded ({c['offload']})" if c["offload"] != "none" else ""))
        pr = d["predicted"]
        out.print(f"[bold green]plan:[/] {c['weight_quant']} weights + {c['kv_dtype']} KV cache, {where}")
        out.print(f"  predicted: decode {pr['decode_tokens_per_s']:.2f} tok/s (at full context "
                  f"{pr['decode_tokens_per_s_full_context']:.2f}), TTFT {pr['ttft_s']:.2f} s for "
                  f"{r['prompt_tokens'] or r['context']} prompt tokens; ceiling (bandwidth roofline) "
                  f"{d['ceiling']['decode_tokens_per_s']:.2f} tok/s; efficiencies: {d['speed_terms']['efficiency_source']}")
        where_ctx = "in RAM (CPU only)" if c["compute_device"] == "cpu" else "entirely on the GPU"
        out.print(f"  largest context {where_ctx} with this scheme: {format_tokens(d['max_context_tokens'])}")
    else:
        out.print("[bold red]nothing fits[/]")
    for reason in d["reasons"]:
        out.print(f"  - {reason}", highlight=False)
    if d["memory"]:
        rows = []
        gpu, cpu = d["memory"]["gpu"] or {}, d["memory"]["cpu"]
        keys = list(dict.fromkeys([k for k in list(gpu) + list(cpu) if k not in ("capacity_bytes", "free_bytes", "total_bytes")]))
        for k in keys + ["total_bytes", "capacity_bytes", "free_bytes"]:
            rows.append([k.removesuffix("_bytes").replace("_", " "), fb(gpu.get(k)) if k in gpu else "-",
                         fb(cpu.get(k)) if k in cpu else "-"])
        out.print(table("memory by device", ["term", "GPU", "RAM"], rows, justify_right={1, 2}))
    cand_rows = []
    for x in d["candidates"]:
        pr = x["predicted"]
        cand_rows.append([
            x["weight_quant"], x["kv_dtype"], "yes" if x["fits"] else "no",
            "all" if x["fits_on_gpu"] else (f"{x['gpu_layers']}/{x['total_layers']} {x['offload']}" if x["fits"] else "-"),
            fb(x["vram_bytes"]), fb(x["ram_bytes"]),
            f"{x['ceiling']['decode_tokens_per_s']:.2f}" if x["ceiling"]["decode_tokens_per_s"] else "-",
            f"{pr['decode_tokens_per_s']:.2f}" if pr["decode_tokens_per_s"] else "-",
            format_tokens(x["max_context_tokens"]), f"{x['quality_cost_pct']:.1f}",
        ])
    out.print(table("candidates", ["weights", "KV", "fits", "GPU layers", "VRAM", "RAM", "ceiling tok/s",
                                   "predicted tok/s", "max ctx on GPU", "ppl +%"], cand_rows,
                    justify_right={4, 5, 6, 7, 8, 9}))
    consts = [[k, f"{v['value']:.4g}" if isinstance(v["value"], float) else f"{v['value']:,}", v["from"]]
              for k, v in d["constants"].items()]
    out.print(table("constants used", ["name", "value", "from"], consts, justify_right={1}))
    for a in d["alternatives"][:5]:
        out.print(f"[yellow]would fit:[/] {a['weight_quant']} + {a['kv_dtype']} KV up to "
                  f"{format_tokens(a['max_context_tokens'])} tokens of context")
    for w in d["warnings"]:
        err.print(f"[yellow]warning:[/] {w}", highlight=False)


@app.command("plan")
def plan_cmd(
    model: ModelOpt,
    context: ContextOpt = "4k",
    hardware: HardwareOpt = None,
    batch: BatchOpt = 1,
    prompt_tokens: PromptTokensOpt = None,
    prefer: PreferOpt = "balanced",
    quant: QuantOpt = None,
    kv_dtype: KVOpt = None,
    gpu_layers: GpuLayersOpt = None,
    offload: OffloadOpt = None,
    vram_budget: VramOpt = None,
    ram_budget: RamOpt = None,
    headroom: HeadroomOpt = None,
    prefill_chunk: ChunkOpt = None,
    as_json: JsonOpt = False,
    as_yaml: Annotated[bool, typer.Option("--yaml", help="Print the plan as YAML.")] = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the plan (YAML) for `vramplan run --plan`.")] = None,
) -> None:
    """Will it fit, how, and how fast: quantization, KV dtype and GPU/CPU split for a target context."""
    from planner.search import plan
    from planner.sources import model_spec

    req = build_request(context, batch, prompt_tokens, prefer, quant, kv_dtype, gpu_layers, offload, vram_budget,
                        ram_budget, headroom, prefill_chunk)
    spec = model_spec(model)
    hw = resolve_hardware(hardware)
    p = plan(spec, hw, req)
    if save:
        try:
            with open(save, "w") as f:
                yaml.safe_dump(p.to_dict(), f, sort_keys=False)
        except OSError as e:
            fail(f"--save {save}: {e.strerror or e}")
    if as_json or as_yaml:
        print_data(p.to_dict(), as_yaml=as_yaml)
    else:
        render_plan(p)
        if save:
            err.print(f"plan saved to {save}")
    if not p.fits:
        raise typer.Exit(1)


def render_run(r: dict) -> None:
    from planner.units import format_bytes as fb

    def show(metric, v):
        if v is None:
            return "-"
        if "bytes" in metric:
            return fb(v)
        return f"{v:.3f} s" if metric in ("ttft_s", "load_s") else f"{v:.2f}"

    rows = []
    for metric in ("decode_tokens_per_s", "ttft_s", "peak_vram_bytes", "peak_ram_bytes"):
        e = r["error_pct"].get(metric)
        rows.append([metric, show(metric, r["predicted"].get(metric)), show(metric, r["measured"].get(metric)),
                     "-" if e is None else f"{e:+.1f} %"])
    m = r["measured"]
    for metric in ("load_s", "prefill_tokens_per_s", "decode_tokens_per_s_start", "decode_tokens_per_s_end",
                   "generated_tokens"):
        if m.get(metric) is not None:
            rows.append([metric, "", show(metric, m[metric]) if metric != "generated_tokens" else str(m[metric]), ""])
    err.print(table(f"predicted vs measured ({r['device']}, prompt {r['prompt_tokens']} tokens, "
                    f"stopped: {r['stopped_reason'] or '-'})", ["metric", "predicted", "measured", "error"], rows,
                    justify_right={1, 2, 3}))
    for n in r["notes"]:
        err.print(f"[yellow]note:[/] {n}", highlight=False)
    for e in r["errors"]:
        err.print(f"[red]error during the run:[/] {e}", highlight=False)


@app.command("calibrate")
def calibrate_cmd(
    hardware: HardwareOpt = None,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the calibrated profile (YAML) here.")] = None,
    models: Annotated[Optional[str], typer.Option("--models", help="Comma list of catalog models (default: a matrix sized for this machine).")] = None,
    quants: Annotated[Optional[str], typer.Option("--quants", help="Comma list of weight schemes.")] = None,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Comma list of prompt lengths, e.g. 64,384.")] = None,
    new_tokens: Annotated[Optional[int], typer.Option("--new-tokens", help="Tokens generated per run.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a small matrix of real runs here and fit the speed model into the profile's calibration."""
    from dataclasses import replace as dc_replace

    from planner.hardware import profile_to_dict, save_profile
    from planner.quant import SCHEMES
    from planner.units import parse_context
    from runtime.calibrate import CPU_MATRIX, GPU_MATRIX, calibrate

    if hardware:
        hw = resolve_hardware(hardware)
    else:
        from runtime.probe import probe

        with err.status("probing this machine (full measurements)..."):
            hw = probe(quick=False).profile
    import torch

    m = GPU_MATRIX if hw.has_gpu and torch.cuda.is_available() else CPU_MATRIX
    if models:
        m = dc_replace(m, models=_split(models))
    if quants:
        for q in _split(quants):
            if q not in SCHEMES:
                fail(f"unknown quantization {q!r}; choose from {', '.join(SCHEMES)}")
        m = dc_replace(m, quants=_split(quants))
    if prompts:
        m = dc_replace(m, prompts=tuple(parse_context(p) for p in _split(prompts)))
    if new_tokens is not None:
        if new_tokens < 2:
            fail("--new-tokens must be at least 2")
        m = dc_replace(m, new_tokens=new_tokens)
    calibrated, records = calibrate(hw, m, progress=lambda s: err.print(f"[dim]{s}[/]", highlight=False))
    if save:
        save_profile(calibrated, save)
        err.print(f"calibrated profile saved to {save}")
    c = calibrated.calibration
    if as_json:
        print_data({"profile": profile_to_dict(calibrated),
                    "runs": [{"model": r.model, "quant": r.quant, "prompt": r.prompt, "ttft_s": r.ttft_s,
                              "decode_tokens_per_s": r.decode_tokens_per_s, "peak_rss_bytes": r.peak_rss_bytes}
                             for r in records]})
        return
    out.print(table("calibration", ["device", "backend", "quant", "bandwidth eff", "compute eff", "per layer",
                                    "per token"],
                    [[e.device, e.backend, e.quant, f"{e.bandwidth_efficiency:.3f}", f"{e.compute_efficiency:.3f}",
                      f"{e.per_layer_overhead_s * 1e6:.1f} us", f"{e.per_token_overhead_s * 1e3:.2f} ms"]
                     for e in c.entries], justify_right={3, 4, 5, 6}))
    out.print(table("fit residuals (on the calibration runs)", ["name", "value"],
                    [[k, f"{v:.2f} %"] for k, v in c.residuals]))
    if c.runtime_ram_bytes is not None:
        out.print(f"runtime RAM beyond what plans count: {c.runtime_ram_bytes / 2**20:.0f} MiB")


@app.command("run")
def run_cmd(
    model: ModelOpt,
    plan_file: Annotated[Optional[str], typer.Option("--plan", help="Run a plan saved by `vramplan plan --save`.")] = None,
    context: ContextOpt = "4k",
    hardware: HardwareOpt = None,
    dummy_weights: Annotated[bool, typer.Option("--dummy-weights", help="The real architecture with random weights (no download).")] = False,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[str], typer.Option("--prompt-file", help="Read the prompt from a file.")] = None,
    prompt_tokens: PromptTokensOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    batch: BatchOpt = 1,
    prefer: PreferOpt = "balanced",
    quant: QuantOpt = None,
    kv_dtype: KVOpt = None,
    gpu_layers: GpuLayersOpt = None,
    offload: OffloadOpt = None,
    vram_budget: VramOpt = None,
    ram_budget: RamOpt = None,
    headroom: HeadroomOpt = None,
    prefill_chunk: ChunkOpt = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Allow pickle (.bin) checkpoints.")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
    as_json: JsonOpt = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write the run report (JSON).")] = None,
) -> None:
    """Run the model as planned, stream the text, and report predicted versus measured."""
    from planner.plan import Plan
    from planner.search import plan
    from planner.sources import load_spec, resolve_model

    if max_new_tokens < 1:
        fail("--max-new-tokens must be at least 1")
    if temperature < 0:
        fail("--temperature must not be negative")
    if prompt is not None and prompt_file is not None:
        fail("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            prompt = open(prompt_file).read()
        except OSError as e:
            fail(f"--prompt-file {prompt_file}: {e.strerror or e}")
    elif prompt is None and prompt_tokens is None and not sys.stdin.isatty():
        piped = sys.stdin.read()
        prompt = piped if piped.strip() else None
    if prompt is not None and prompt_tokens is not None:
        fail("give a prompt or --prompt-tokens, not both")
    if batch != 1:
        fail("run executes batch 1 for now; plan larger batches with `vramplan plan --batch`")
    source = resolve_model(model)
    if source.path is None and not dummy_weights:
        fail(f"{source.id} comes from the built-in catalog: there are no weights here; "
             "add --dummy-weights to measure its speed and memory with random weights")
    spec = load_spec(source)
    hw = resolve_hardware(hardware)
    if plan_file:
        try:
            p = Plan.from_dict(yaml.safe_load(open(plan_file)))
        except OSError as e:
            fail(f"--plan {plan_file}: {e.strerror or e}")
        except yaml.YAMLError:
            fail(f"--plan {plan_file}: not valid YAML")
    else:
        req = build_request(context, batch, prompt_tokens, prefer, quant, kv_dtype, gpu_layers, offload,
                            vram_budget, ram_budget, headroom, prefill_chunk)
        p = plan(spec, hw, req)
        if not p.fits:
            render_plan(p)
            raise typer.Exit(1)
    c = p.choice
    err.print(f"[bold green]plan:[/] {c.weight_quant} weights + {c.kv_dtype} KV, "
              + ("CPU only" if c.compute_device == "cpu" else f"{c.gpu_layers}/{c.total_layers} layers on the GPU"
                 + (f", offload {c.offload}" if c.offload != "none" else "")), highlight=False)
    from runtime.execute import execute

    stream_out = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    report = execute(p, spec, hw, source, dummy_weights=dummy_weights, prompt_text=prompt,
                     prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                     allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, on_text=stream_out,
                     progress=lambda s: err.print(f"[dim]{s}[/]", highlight=False))
    d = report.to_dict()
    if not as_json:
        sys.stdout.write("\n")
        sys.stdout.flush()
        render_run(d)
    else:
        print_data(d)
    if save:
        try:
            with open(save, "w") as f:
                json.dump(d, f, indent=2)
        except OSError as e:
            fail(f"--save {save}: {e.strerror or e}")
    if report.errors:
        raise typer.Exit(1)



def main() -> None:
    """Console-script entry point: one-line errors, tracebacks only under VRAMPLAN_DEBUG."""
    try:
        rc = app(standalone_mode=False)  # click returns the code of a typer.Exit instead of raising it
        sys.exit(rc if isinstance(rc, int) else 0)
    except VramplanError as e:
        if os.environ.get("VRAMPLAN_DEBUG"):
            raise
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except Exception as e:  # click usage errors and anything unexpected
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        if os.environ.get("VRAMPLAN_DEBUG"):
            raise
        err.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {e} (set VRAMPLAN_DEBUG=1 for the traceback)",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(3)


if __name__ == "__main__":
    main()
