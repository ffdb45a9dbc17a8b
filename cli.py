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

# ---------------------------------------------------------------- plan / run commands


def main() -> None:
    """Console-script entry point: one-line errors, tracebacks only under VRAMPLAN_DEBUG."""
    try:
        app(standalone_mode=False)
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
