"""vramplan's one output sink: what the commands print, for people (rich tables) and machines (JSON/YAML).

Results go to stdout; progress, notes, warnings and errors to stderr, so that `--json` output
pipes cleanly. The renderers take plain data (the dicts the library's types produce) and print.
No torch, no planning: the CLI hands data here.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import yaml
from rich.console import Console
from rich.table import Table

from planner.errors import VramplanError
from planner.modelspec import INVENTORY_HAND_WRITTEN
from planner.units import format_bandwidth, format_bytes, format_count, format_flops, format_tokens


class StdoutClosed(Exception):
    """Whoever read stdout has gone (`vramplan plan | head -1`): not an error, the command just stops."""


class OutputError(VramplanError):
    """Stdout cannot be written (a full disk, /dev/full): one line, exit 2."""


@contextmanager
def _stdout_writes() -> Iterator[None]:
    """Errors writing stdout as the two types above, so that main() tells them from any other OSError."""
    try:
        yield
    except BrokenPipeError:
        raise StdoutClosed from None
    except OSError as e:
        raise OutputError(f"cannot write to stdout ({e.strerror or e})") from None


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich's own handler exits 1; a closed stdout is the reader's choice, and a closed stderr loses only notes."""
        self.quiet = True
        if not self.stderr:
            raise StdoutClosed


class Output:
    """Everything the CLI prints goes through one of these methods."""

    def __init__(self) -> None:
        # Piped output keeps full table widths instead of wrapping at 80 columns.
        self.out = _Console(width=None if sys.stdout.isatty() else 160)
        self.err = _Console(stderr=True, width=None if sys.stderr.isatty() else 160)

    # --- machine-readable results
    def data(self, obj: Any, fmt: str = "json") -> None:
        """A result as JSON (default) or YAML on stdout."""
        self.raw(yaml.safe_dump(obj, sort_keys=False) if fmt == "yaml" else json.dumps(obj, indent=2) + "\n")

    def raw(self, text: str) -> None:
        """Text exactly as given on stdout (generated tokens as they stream, a YAML document)."""
        with _stdout_writes():
            sys.stdout.write(text)
            sys.stdout.flush()

    def flush(self) -> None:
        """What stdout still buffers, written now (a full disk shows here, not at the interpreter's exit)."""
        with _stdout_writes():
            sys.stdout.flush()

    def silence_stdout(self) -> None:
        """After stdout failed: point it at /dev/null, so the interpreter's last flush does not fail again."""
        self.out.quiet = True
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # a test's captured stdout: nothing to redirect
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)

    # --- results for people
    def table(self, title: str | None, columns: list[str], rows: list[list[Any]], *, right: set[int] = frozenset(),
              stderr: bool = False) -> None:
        t = Table(title=title, title_justify="left", header_style="bold")
        for i, c in enumerate(columns):
            t.add_column(c, justify="right" if i in right else "left")
        for r in rows:
            t.add_row(*["-" if v is None else str(v) for v in r])
        if stderr:
            self.err.print(t)
            return
        with _stdout_writes():
            self.out.print(t)

    def line(self, text: str) -> None:
        with _stdout_writes():
            self.out.print(text, highlight=False, soft_wrap=True)

    # --- everything else, on stderr
    def info(self, text: str) -> None:
        self.err.print(f"[dim]{text}[/]", highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        self.err.print(f"[yellow]note:[/] {text}", highlight=False, soft_wrap=True)

    def warn(self, text: str) -> None:
        self.err.print(f"[yellow]warning:[/] {text}", highlight=False, soft_wrap=True)

    def error(self, text: str) -> None:
        self.err.print(f"[bold red]error:[/] {text}", highlight=False, soft_wrap=True, markup=True)

    def plain_error(self, text: str) -> None:
        """An error message that may hold square brackets (no rich markup parsing)."""
        self.err.print("[bold red]error:[/] ", end="", highlight=False)
        self.err.print(text, markup=False, highlight=False, soft_wrap=True)

    @contextmanager
    def status(self, text: str) -> Iterator[Any]:
        with self.err.status(text, spinner="dots") as s:
            yield s


out = Output()


# ---------------------------------------------------------------- models
def models(rows: list[dict]) -> None:
    out.table(f"vramplan catalog ({len(rows)} models; use the id or alias with --model)",
              ["id", "alias", "architecture", "params", "active", "layers", "max context"],
              [[r["id"], r["aliases"][0] if r["aliases"] else "", r["model_type"], format_count(r["params_total"]),
                format_count(r["params_active"]), r["num_layers"], format_tokens(r["max_context"])] for r in rows],
              right={3, 4, 5, 6})


def inspect(facts: dict, notes: list[str]) -> None:
    a = facts["attention"]
    kv_layers = facts["kv_bytes_per_token_per_layer"]
    L = facts["num_layers"]
    family = a.get("family") or a["kind"].upper()
    heads = (f"{a['num_heads']} heads" if family in ("MHA", "MLA") else
             f"{a['num_heads']} heads sharing {a['num_kv_heads']} KV head{'s' if a['num_kv_heads'] > 1 else ''}")
    attn = (f"{family}: {heads} x {a['head_dim']}"
            + (f", MLA cache {a['mla_cache_dim']}/token/layer" if a["kind"] == "mla" else "")
            + (f", sliding windows {a['sliding_windows']} on {facts['sliding_window_layers']} of {L} layers"
               if a["sliding_windows"] else ""))
    rows = [
        ["model", f"{facts['name']} ({facts['architecture']}, model_type {facts['model_type']})"],
        ["source", facts["source"]],
        ["inventory", facts["inventory"]],
        ["parameters", f"{facts['params_total']:,} ({format_count(facts['params_total'])})"],
        ["active per token", f"{facts['params_active']:,} ({format_count(facts['params_active'])})"],
        ["layers / hidden / vocab", f"{L} / {facts['hidden_size']} / {facts['vocab_size']}"],
        ["attention", attn],
        ["max context", format_tokens(facts["max_context"])],
        ["tied embeddings", str(facts["tie_word_embeddings"])],
        ["checkpoint dtype", facts["checkpoint_dtype"]],
        ["weights bf16", f"{facts['weight_bytes']['bf16']:,} B ({format_bytes(facts['weight_bytes']['bf16'])})"],
        ["weights fp32", f"{facts['weight_bytes']['fp32']:,} B ({format_bytes(facts['weight_bytes']['fp32'])})"],
        ["KV cache bf16 / token", f"{facts['kv_bytes_per_token']:,} B ({format_bytes(facts['kv_bytes_per_token'])}; "
                                  f"{format_bytes(kv_layers[0])} per layer)"],
    ]
    if "checkpoint" in facts["weight_bytes"]:
        rows.append(["checkpoint on disk", f"{facts['weight_bytes']['checkpoint']:,} B (safetensors headers)"])
    if "moe" in facts:
        m = facts["moe"]
        rows.append(["mixture of experts", f"{m['num_experts']} experts, top-{m['experts_per_token']}, "
                                           f"{m['num_shared_experts']} shared, {m['moe_layers']} MoE layers"])
    out.table("model", ["fact", "value"], rows)
    total = facts["params_total"]
    out.table("parameters by role", ["role", "parameters", "share"],
              [[r, f"{n:,}", f"{100 * n / total:.1f} %"] for r, n in facts["params_by_role"].items()], right={1, 2})
    for n in notes:
        out.note(n)


# ---------------------------------------------------------------- hardware
def _profile_kind(p: Any) -> str:
    if not p.gpus:
        return "CPU only"
    return "unified memory (GPU shares RAM)" if p.unified_memory else "discrete GPU"


def profile(p: Any, path: Any = None) -> None:
    """One profile as tables; notes follow."""
    rows: list[list[Any]] = [
        ["name", p.name], ["description", p.description], ["source", p.source], ["kind", _profile_kind(p)],
        ["measured", "yes (vramplan probe)" if p.measured else "no (datasheet / typical / estimated figures)"],
    ]
    if path is not None:
        rows.append(["file", str(path)])
    for i, g in enumerate(p.gpus):
        cc = f", compute capability {g.compute_capability}" if g.compute_capability else ""
        rows += [[f"GPU {i}", f"{g.count}x {g.name}{cc}"],
                 ["  memory", f"{format_bytes(g.memory_bytes)} ({g.memory_bytes:,} B) per device"],
                 ["  memory bandwidth", format_bandwidth(g.memory_bandwidth_bytes_per_s)],
                 ["  bf16 compute (dense)", format_flops(g.bf16_flops)]]
    h = p.host
    rows += [["host RAM", f"{format_bytes(h.ram_bytes)} ({h.ram_bytes:,} B)"],
             ["  RAM bandwidth", format_bandwidth(h.ram_bandwidth_bytes_per_s)], ["  CPU cores", h.cpu_cores],
             ["  CPU bf16 compute", format_flops(h.cpu_bf16_flops)]]
    if p.link is not None:
        lk = p.link
        rows += [["link", lk.name],
                 ["  host->GPU pinned / pageable",
                  f"{format_bandwidth(lk.h2d_pinned_bytes_per_s)} / {format_bandwidth(lk.h2d_pageable_bytes_per_s)}"],
                 ["  GPU->host pinned / pageable",
                  f"{format_bandwidth(lk.d2h_pinned_bytes_per_s)} / {format_bandwidth(lk.d2h_pageable_bytes_per_s)}"]]
    o = p.overheads
    if p.gpus:
        rows += [["CUDA context", format_bytes(o.cuda_context_bytes)],
                 ["allocator reserve", format_bytes(o.allocator_reserve_bytes)],
                 ["kernel launch", f"{o.kernel_launch_s * 1e6:g} us"]]
    out.table(f"hardware profile {p.name}", ["", "value"], rows)
    if p.calibration is not None:
        calibration(p.calibration)
    if p.notes:
        out.line("[bold]notes[/]")
        for n in p.notes:
            out.line(f"  - {n}")


def _eff(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def calibration(c: Any) -> None:
    out.table(f"calibration ({c.measured_at})",
              ["device", "backend", "quant", "bandwidth eff.", "compute eff.", "per layer", "per token"],
              [[e.device, e.backend, e.quant, _eff(e.bandwidth_efficiency), _eff(e.compute_efficiency),
                f"{e.per_layer_overhead_s * 1e6:.1f} us", f"{e.per_token_overhead_s * 1e3:.2f} ms"] for e in c.entries],
              right={3, 4, 5, 6})
    if c.residuals:
        out.table("fit residuals (on the calibration runs)", ["name", "value"],
                  [[k, f"{v:.2f} %" if "pct" in k else f"{v:g}"] for k, v in c.residuals])
    if c.runtime_ram_bytes is not None:
        out.line(f"runtime RAM beyond what plans count: {format_bytes(c.runtime_ram_bytes)}")


def profiles_list(entries: list[Any], searched: list[tuple[Any, str]]) -> None:
    rows = []
    for e in entries:
        if e.error is not None:
            rows.append([e.name, e.origin, f"[red]invalid:[/] {e.error}", "", "", ""])
            continue
        p = e.profile
        gpu = ", ".join(f"{g.count}x {g.name}" for g in p.gpus) or "CPU only"
        mem = format_bytes(p.gpu_memory_bytes) if p.gpus else "-"
        bw = format_bandwidth(p.gpu_memory_bandwidth_bytes_per_s if p.gpus else p.host.ram_bandwidth_bytes_per_s)
        rows.append([e.name, e.origin, gpu + (" (unified)" if p.unified_memory else ""), mem, bw,
                     format_bytes(p.host.ram_bytes)])
    out.table(f"hardware profiles ({len(rows)}; use the name with --hardware)",
              ["name", "from", "GPU", "GPU memory", "bandwidth", "RAM"], rows, right={3, 4, 5})
    out.info("searched: " + "; ".join(f"{d} ({o})" for d, o in searched))


# ---------------------------------------------------------------- plan
def _experts_where(c: dict) -> str:
    placement = c.get("expert_placement")
    if placement == "cpu":
        return ", routed experts in RAM (computed by the CPU)"
    if isinstance(placement, int):
        return f", routed experts of the first {placement} of {c['moe_layers']} MoE layers in RAM"
    return ""


def plan(d: dict) -> None:
    """The human report of a plan (its dict form)."""
    m, h, r = d["model"], d["hardware"], d["request"]
    gpus = h.get("gpus") or ([{"name": h["gpu"], "memory_bytes": h["gpu_memory_bytes"], "count": 1}] if h["gpu"] else [])
    cards = " + ".join(f"{'%dx ' % g['count'] if g['count'] > 1 else ''}{g['name']}, {format_bytes(g['memory_bytes'])}{' each' if g['count'] > 1 else ''}"
                       for g in gpus) or "no GPU"
    out.line(f"[bold]{m['id']}[/] on [bold]{h['name']}[/] ({cards}, RAM {format_bytes(h['ram_bytes'])}"
             f"{', measured' if h['measured'] else ''}{', calibrated' if h['calibrated'] else ''}) - "
             f"context {format_tokens(r['context'])} x batch {r['batch']}, prefer {r['prefer']}")
    if m.get("inventory", INVENTORY_HAND_WRITTEN) != INVENTORY_HAND_WRITTEN:
        out.note(f"model_type {m['model_type']} has no hand-written builder: its tensors were listed from "
                 f"{m['inventory']} (the generic path)")
    c = d["choice"]
    if c:
        where = ("CPU only (no GPU)" if c["compute_device"] == "cpu" else
                 f"{c['gpu_layers']}/{c['total_layers']} layers on the GPU"
                 + (f"s ({' + '.join(map(str, per))})" if len(per := c.get("gpu_layers_per_device") or []) > 1 else "")
                 + (f", {c['total_layers'] - c['gpu_layers']} offloaded ({c['offload']})" if c["offload"] != "none"
                    else "")
                 + _experts_where(c))
        pr = d["predicted"]
        out.line(f"[bold green]plan:[/] {c['weight_quant']} weights + {c['kv_dtype']} KV cache, {where}")
        out.line(f"  predicted: decode {pr['decode_tokens_per_s']:.2f} tok/s (at full context "
                 f"{pr['decode_tokens_per_s_full_context']:.2f}), TTFT {pr['ttft_s']:.2f} s for "
                 f"{r['prompt_tokens'] or r['context']} prompt tokens; ceiling (bandwidth roofline) "
                 f"{d['ceiling']['decode_tokens_per_s']:.2f} tok/s; efficiencies: {d['speed_terms']['efficiency_source']}")
        where_ctx = "in RAM (CPU only)" if c["compute_device"] == "cpu" else "entirely on the GPU"
        out.line(f"  largest context {where_ctx} with this scheme: {format_tokens(d['max_context_tokens'])}")
    else:
        out.line("[bold red]nothing fits[/]")
    for reason in d["reasons"]:
        out.line(f"  - {reason}")
    if d["memory"]:
        _memory(d["memory"])
    _candidates(d["candidates"])
    consts = [[k, f"{v['value']:.4g}" if isinstance(v["value"], float) else f"{v['value']:,}", v["from"]]
              for k, v in d["constants"].items()]
    out.table("constants used", ["name", "value", "from"], consts, right={1})
    for a in d["alternatives"][:5]:
        out.line(f"[yellow]would fit:[/] {a['weight_quant']} + {a['kv_dtype']} KV up to "
                 f"{format_tokens(a['max_context_tokens'])} tokens of context")
    for w in d["warnings"]:
        out.warn(w)


def _memory(mem: dict) -> None:
    gpus, cpu = mem.get("gpus") or ([mem["gpu"]] if mem.get("gpu") else []), mem["cpu"]
    summary = ("total_bytes", "capacity_bytes", "free_bytes")
    keys = list(dict.fromkeys(k for k in [*(k for g in gpus for k in g), *cpu] if k not in summary))
    columns = [*gpus, cpu] if gpus else [{}, cpu]
    names = (["GPU"] if len(gpus) <= 1 else [f"GPU{d}" for d in range(len(gpus))]) + ["RAM"]
    rows = [[k.removesuffix("_bytes").replace("_", " "),
             *(format_bytes(col[k]) if k in col else "-" for col in columns)] for k in [*keys, *summary]]
    out.table("memory by device", ["term", *names], rows, right=set(range(1, len(names) + 1)))


def _candidates(cands: list[dict]) -> None:
    rows = []
    for x in cands:
        pr, ceiling = x["predicted"], x["ceiling"]["decode_tokens_per_s"]
        placement = ("all" if x["fits_on_gpu"] else
                     f"{x['gpu_layers']}/{x['total_layers']} {x['offload']}" if x["fits"] else "-")
        rows.append([x["weight_quant"], x["kv_dtype"], "yes" if x["fits"] else "no", placement,
                     format_bytes(x["vram_bytes"]), format_bytes(x["ram_bytes"]),
                     f"{ceiling:.2f}" if ceiling else "-",
                     f"{pr['decode_tokens_per_s']:.2f}" if pr["decode_tokens_per_s"] else "-",
                     format_tokens(x["max_context_tokens"]), f"{x['quality_cost_pct']:.1f}"])
    out.table("candidates", ["weights", "KV", "fits", "GPU layers", "VRAM", "RAM", "ceiling tok/s", "predicted tok/s",
                             "max ctx resident", "ppl +%"], rows, right={4, 5, 6, 7, 8, 9})


# ---------------------------------------------------------------- run
def run_report(r: dict) -> None:
    def show(metric: str, v: Any) -> str:
        if v is None:
            return "-"
        if "bytes" in metric:
            return format_bytes(v)
        if metric == "generated_tokens":
            return str(v)
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
            rows.append([metric, "", show(metric, m[metric]), ""])
    status = "INTERRUPTED" if r.get("interrupted") else (r["stopped_reason"] or "-")
    out.table(f"predicted vs measured ({r['device']}, prompt {r['prompt_tokens']} tokens, stopped: {status})",
              ["metric", "predicted", "measured", "error"], rows, right={1, 2, 3}, stderr=True)
    for n in r["notes"]:
        out.note(n)
    for e in r["errors"]:
        out.err.print(f"[red]error during the run:[/] {e}", highlight=False, soft_wrap=True)
