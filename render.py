"""vramplan's one output sink: what the commands print, for people (rich tables) and machines (JSON/YAML).

Results go to stdout; progress, notes, warnings and errors to stderr, so that `--json` output
pipes cleanly. The renderers take plain data (the dicts the library's types produce) and print.
No torch, no planning: the CLI hands data here.

Text from outside (file contents in error messages, profile descriptions, model names, paths) is printed
literally: no rich markup ("[bold]") and no emoji codes (":x:") are read from it, and its unprintable characters
(ESC, newlines, carriage returns, bidi overrides) are shown escaped (planner.quoting.one_line): every message is
one line. Strings given to `line`,
`info`, `table` cells and titles are plain text; styles come only as rich Text built here (`styled`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.table import Table
from rich.text import Text

from vramplan.planner.choice import experts_in_ram_text
from vramplan.planner.errors import VramplanError
from vramplan.planner.modelspec import INVENTORY_HAND_WRITTEN
from vramplan.planner.hardware import CPU_DECODE_KERNELS
from vramplan.planner.quoting import one_line
from vramplan.planner.units import (format_bandwidth, format_bytes, format_count, format_duration, format_flops,
                                    format_tokens)


# Work predicted to take less than this gets no progress bar (it would only flash); work with no prediction, or
# running past a short one, gets its bar once it has taken this long. Two seconds: about when a silent terminal starts
# to look hung.
PROGRESS_MIN_S = 2.0


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



def _stderr():
    """sys.stderr as it is now (a test's capture too), unwrapped from the proxy a live progress bar puts there (rich's
    FileProxy prints through the console, which would write to the proxy again: as rich's own Console.file does)."""
    return getattr(sys.stderr, "rich_proxied_file", sys.stderr)


class _BestEffortStderr:
    """stderr as the messages' console writes to it (`_stderr`): a write that fails (stderr closed, a full disk,
    /dev/full) loses the notes and messages, not the command, which ends with its own exit code rather than with the
    error of reporting an error."""

    def write(self, text: str) -> int:
        try:
            return _stderr().write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            _stderr().flush()
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        try:
            return _stderr().isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return _stderr().fileno()

    @property
    def encoding(self) -> str:
        return getattr(_stderr(), "encoding", None) or "utf-8"


class Output:
    """Everything the CLI prints goes through one of these methods."""

    def __init__(self) -> None:
        # The exit code a command's result means, decided before the result is printed: a reader that closes stdout
        # early (`| head -1`) stops the printing, not the outcome (nothing fits stays exit 1).
        self.outcome = 0
        # Piped output keeps full table widths instead of wrapping at 80 columns.
        self.out = _Console(width=None if sys.stdout.isatty() else 160, emoji=False)
        self.err = _Console(file=_BestEffortStderr(), stderr=True, width=None if sys.stderr.isatty() else 160,
                            emoji=False)
        self.set_mode()

    def set_mode(self, *, json: bool = False) -> None:
        """Decide once per command what it prints besides its results: progress bars only for a person at a
        terminal (stderr, where they are drawn, is one; no --json)."""
        self.show_progress = self.err.is_terminal and not self.err.is_dumb_terminal and not json

    # --- machine-readable results
    def data(self, obj: Any, fmt: str = "json") -> None:
        """A result as JSON (default) or YAML on stdout."""
        if fmt == "yaml":
            import yaml  # imported here: a command that prints no YAML does not pay for it

            self.raw(yaml.safe_dump(obj, sort_keys=False))
        else:
            self.raw(json.dumps(obj, indent=2) + "\n")

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
              stderr: bool = False, compact: bool = False, drop: tuple[int, ...] = ()) -> None:
        """A table; `compact`: no borders, one line per row (what fits under a report that must stay short); `drop`:
        the columns to leave out, first ones first, while the table is wider than the console (the JSON has them).
        A cell never ends in "…": what does not fit folds onto the next line."""
        width = (self.err if stderr else self.out).width
        keep = list(range(len(columns)))
        cells = [["-" if v is None else str(v) for v in r] for r in rows]

        def needed() -> int:
            per, edge = (2, 0) if compact else (3, 1)  # the gap between columns, or a border and its padding
            return sum(max(len(x) for x in [columns[i], *(r[i] for r in cells)]) for i in keep) + per * len(keep) + edge

        for i in drop:
            if needed() <= width:
                break
            keep.remove(i)
        kw = {"box": None, "pad_edge": False, "show_edge": False} if compact else {}
        t = Table(title=_text(title) if title is not None else None, title_justify="left", header_style="bold", **kw)
        for i in keep:
            t.add_column(columns[i], justify="right" if i in right else "left", no_wrap=compact, overflow="fold")
        for r in rows:
            t.add_row(*[_text("-" if r[i] is None else r[i]) for i in keep])
        if stderr:
            self.err.print(t)
            return
        with _stdout_writes():
            self.out.print(t)

    def line(self, text: str | Text) -> None:
        """One line on stdout: a str is printed literally; styles come as Text (`styled`)."""
        with _stdout_writes():
            self.out.print(_text(text), highlight=False, soft_wrap=True)

    # --- everything else, on stderr
    def info(self, text: str) -> None:
        self.err.print(Text(one_line(text), style="dim"), highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        self.labelled("note:", "yellow", text)

    def warn(self, text: str) -> None:
        self.labelled("warning:", "yellow", text)

    def error(self, text: str) -> None:
        self.labelled("error:", "bold red", text)

    def plain_error(self, text: str) -> None:
        """An error message (printed literally, like every message)."""
        self.error(text)

    def labelled(self, label: str, style: str, text: str) -> None:
        """`label text` on stderr, the label styled, the text literal."""
        self.err.print(styled((label, style), " ", text), highlight=False, soft_wrap=True)

    @contextmanager
    def status(self, text: str) -> Iterator[Any]:
        with self.err.status(Text(one_line(text)), spinner="dots") as s:
            yield s

    @contextmanager
    def progress(self, description: str, total: int,
                 predicted_s: float | None = None) -> Iterator[Callable[[int], None]]:
        """A progress bar on stderr for `total` steps of long work; yields advance(steps). Its ETA is `predicted_s`
        (the plan's prediction) until the first step ends, then the pace so far. Shown only in progress mode (see
        set_mode), and only for work predicted to take PROGRESS_MIN_S or more, or seen to (checked at each step);
        it closes when the last step is done."""
        if not self.show_progress or total < 1:
            yield lambda steps: None
            return
        bar = _Bar(self.err, description, total, predicted_s)
        try:
            yield bar.advance
        finally:
            bar.stop()


class _Bar:
    """One progress bar, started when the work is (predicted or seen to be) long, stopped when it is done."""

    def __init__(self, console: Console, description: str, total: int, predicted_s: float | None) -> None:
        self.console, self.description, self.total, self.predicted_s = console, description, total, predicted_s
        self.t0 = time.perf_counter()
        self.done = 0
        self.progress: Any = None  # a rich.progress.Progress while shown
        self.task = None
        if predicted_s is not None and predicted_s >= PROGRESS_MIN_S:
            self._start()

    def _start(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn  # only when a bar is drawn

        self.progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                 _times_column()(), console=self.console)
        self.task = self.progress.add_task(self.description, total=self.total, completed=self.done, t0=self.t0,
                                           predicted_s=self.predicted_s)
        self.progress.start()

    def advance(self, steps: int) -> None:
        self.done += steps
        if self.progress is None and self.done < self.total and time.perf_counter() - self.t0 >= PROGRESS_MIN_S:
            self._start()
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done)
            if self.done >= self.total:
                self.stop()

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@functools.cache
def _times_column() -> type:
    """The bar's time column (a rich.progress column: defined on first use, so commands without a bar skip
    importing rich.progress)."""
    from rich.progress import ProgressColumn, Task

    class TimesColumn(ProgressColumn):
        """Elapsed, the ETA, and the prediction: "0:41 elapsed, ETA 2:10 (predicted 2:51)"."""

        def render(self, task: Task) -> Text:
            elapsed = time.perf_counter() - task.fields["t0"]
            predicted = task.fields["predicted_s"]
            done = task.completed / task.total if task.total else 0.0
            if done >= 1:
                eta = 0.0
            elif done > 0:
                eta = elapsed * (1 - done) / done  # the pace so far
            elif predicted is not None:
                eta = max(0.0, predicted - elapsed)  # nothing done yet: the prediction
            else:
                eta = None
            text = f"{_clock(elapsed)} elapsed, ETA {'?' if eta is None else _clock(eta)}"
            if predicted is not None:
                text += f" (predicted {_clock(predicted)})"
            return Text(text, style="progress.remaining")

    return TimesColumn


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _text(v: Any) -> Text:
    """A value as literal rich Text on one line, unprintable characters escaped (planner.quoting.one_line: an ESC or
    a newline in a model's name or a profile's description reaches no terminal); a Text is kept as styled."""
    return v if isinstance(v, Text) else Text(one_line(str(v)))


def styled(*parts: str | tuple[str, str]) -> Text:
    """Literal text with styled parts: styled(("plan:", "bold green"), " bf16 weights"), unprintable characters
    escaped."""
    return Text.assemble(*((one_line(p[0]), p[1]) if isinstance(p, tuple) else
                           p if isinstance(p, Text) else one_line(p) for p in parts))


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
        ["max context", format_tokens(facts["max_context"]) if facts["max_context"] else
         "unknown (the config gives no max_position_embeddings)"],
        ["tied embeddings", str(facts["tie_word_embeddings"])],
        ["checkpoint dtype", facts["checkpoint_dtype"]],
        ["weights bf16", f"{facts['weight_bytes']['bf16']:,} B ({format_bytes(facts['weight_bytes']['bf16'])})"],
        ["weights fp32", f"{facts['weight_bytes']['fp32']:,} B ({format_bytes(facts['weight_bytes']['fp32'])})"],
        ["KV cache bf16 / token", f"{facts['kv_bytes_per_token']:,} B ({format_bytes(facts['kv_bytes_per_token'])}; "
                                  f"{format_bytes(kv_layers[0])} per layer)"],
    ]
    if "published" in facts:
        pub = facts["published"]
        rows.append([f"weights as stored ({pub['format']})",
                     f"{pub['stored_bytes']:,} B ({format_bytes(pub['stored_bytes'])}): {pub['description']}"])
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
    rows += [[f"  CPU {label} compute", format_flops(v)] for label, v in (("fp32", h.cpu_fp32_flops),
                                                                          ("int8", h.cpu_int8_ops)) if v is not None]
    rows += [[f"  CPU decode {kernel} ({scheme})", format_bandwidth(rate)]
             for kernel, scheme in CPU_DECODE_KERNELS.items() if (rate := h.decode_kernel_rate(kernel))]
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
        out.line(styled(("notes", "bold")))
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
            rows.append([e.name, e.origin, styled(("invalid: ", "red"), e.error), "", "", ""])
            rows += _shadowed_rows(e)
            continue
        p = e.profile
        gpu = ", ".join(f"{g.count}x {g.name}" for g in p.gpus) or "CPU only"
        mem = format_bytes(p.gpu_memory_bytes) if p.gpus else "-"
        bw = format_bandwidth(p.gpu_memory_bandwidth_bytes_per_s if p.gpus else p.host.ram_bandwidth_bytes_per_s)
        rows.append([e.name, e.origin, gpu + (" (unified)" if p.unified_memory else ""), mem, bw,
                     format_bytes(p.host.ram_bytes)])
        rows += _shadowed_rows(e)
    out.table(f"hardware profiles ({len(entries)}; use the name with --hardware)",
              ["name", "from", "GPU", "GPU memory", "bandwidth", "RAM"], rows, right={3, 4, 5})
    shadowed = [e for e in entries if e.shadows]
    for e in shadowed:
        out.warn(f"profile {e.name!r}: {e.path} ({e.origin}) is used; it shadows "
                 + ", ".join(f"{path} ({origin})" for path, origin in e.shadows))
    out.info("searched: " + "; ".join(f"{d} ({o})" for d, o in searched))


def _shadowed_rows(e: Any) -> list[list[Any]]:
    """A row per file the entry's name also finds but never uses."""
    return [[styled(("  " + path.stem, "dim")), styled((origin, "dim")),
             styled(("shadowed (unused): ", "yellow"), f"{path}; {e.name} resolves to {e.path}"), "", "", ""]
            for path, origin in e.shadows]


# ---------------------------------------------------------------- plan
def _experts_where(c: dict) -> str:
    placement = c.get("expert_placement")
    if placement in (None, "gpu"):
        return ""
    where = c.get("expert_layers_in_ram") or []
    on_cpu = c["moe_layers"] if placement == "cpu" else placement
    flag = ""
    if c.get("engine") == "llama.cpp" and where:
        from vramplan.planner.engines.llamacpp_rules import n_cpu_moe

        flag = f" (--n-cpu-moe {n_cpu_moe(where)})"
    return f", routed experts of {experts_in_ram_text(on_cpu, c['moe_layers'], where)} in RAM{flag}"


# The default report shows this many candidates besides the chosen one (--all: every candidate).
ALTERNATIVES_SHOWN = 5


def plan(d: dict, *, full: bool = False) -> None:
    """The human report of a plan (its dict form): the decision, its reasons and memory, and the best alternatives;
    `full` adds every candidate and the constants used."""
    m, h, r = d["model"], d["hardware"], d["request"]
    gpus = h.get("gpus") or ([{"name": h["gpu"], "memory_bytes": h["gpu_memory_bytes"], "count": 1}] if h["gpu"]
                             else [])
    cards = " + ".join(f"{'%dx ' % g['count'] if g['count'] > 1 else ''}{g['name']}, "
                       f"{format_bytes(g['memory_bytes'])}{' each' if g['count'] > 1 else ''}"
                       for g in gpus) or "no GPU"
    out.line(styled((m["id"], "bold"), " on ", (h["name"], "bold"),
                    f" ({cards}, RAM {format_bytes(h['ram_bytes'])}"
                    f"{', measured' if h['measured'] else ''}{', calibrated' if h['calibrated'] else ''}) - "
                    f"context {format_tokens(r['context'])} x batch {r['batch']}, prefer {r['prefer']}"))
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
        verdict = ("plan:", "bold green") if d.get("usable", True) else ("plan (fits, too slow to use):", "bold yellow")
        out.line(styled(verdict, f" {c['weight_quant']} weights + {c['kv_dtype']} KV cache, {where}"))
        if pr["decode_tokens_per_s"] is None:
            out.line(f"  predicted: {d['reason'].split('; ', 1)[-1]}")
        else:
            _predicted_line(d, pr, r)
        where_ctx = "in RAM (CPU only)" if c["compute_device"] == "cpu" else "entirely on the GPU"
        out.line(f"  largest context {where_ctx} with this scheme: {format_tokens(d['max_context_tokens'])}")
    else:
        out.line(styled(("nothing fits", "bold red")))
    for reason in d["reasons"]:
        out.line(f"  - {reason}")
    if d["memory"]:
        _memory(d["memory"])
    cands, chosen = d["candidates"], _chosen(d)
    if full:
        _candidates(cands, chosen, "candidates")
        consts = [[k, f"{v['value']:.4g}" if isinstance(v["value"], float) else f"{v['value']:,}", v["from"]]
                  for k, v in d["constants"].items()]
        out.table("constants used", ["name", "value", "from"], consts, right={1})
    else:
        shown = _best_alternatives(cands, chosen)
        title = "best alternatives" if shown and shown[0] is not chosen else "the plan and the best alternatives"
        _candidates(shown, chosen, f"{title} (of {len(cands)} candidates)")
    for a in d["alternatives"][:5]:
        out.line(styled(("would fit:", "yellow"), f" {a['weight_quant']} + {a['kv_dtype']} KV up to "
                        f"{format_tokens(a['max_context_tokens'])} tokens of context"))
    _engines(d, full)
    _concurrency(d)
    for w in d["warnings"]:
        out.warn(w)
    if not full:
        hidden = len(cands) - len(shown)
        out.info(f"{hidden} more candidate{'s' if hidden != 1 else ''} and the {len(d['constants'])} constants used: "
                 "add --all (or --json for everything)")


def _typical_ttft(d: dict) -> str:
    t = d.get("typical_prompt_ttft")
    return (f" (the whole context; {format_duration(t['ttft_s'])} for a typical {t['prompt_tokens']}-token prompt)"
            if t else "")


def _predicted_line(d: dict, pr: dict, r: dict) -> None:
    out.line(f"  predicted: decode {pr['decode_tokens_per_s']:.2f} tok/s (at full context "
             f"{pr['decode_tokens_per_s_full_context']:.2f}), TTFT {format_duration(pr['ttft_s'])} for "
             f"{r['prompt_tokens'] or r['context']} prompt tokens" + _typical_ttft(d)
             + "; ceiling (bandwidth roofline) "
             f"{d['ceiling']['decode_tokens_per_s']:.2f} tok/s; efficiencies: "
             f"{d['speed_terms']['efficiency_source']}")


REASON_CHARS = 40  # an engine's reason in the compact table (the JSON has all of it)


def _concurrency(d: dict) -> None:
    """`plan --concurrency`: each engine's sequences of the context at once, their aggregate decode, and why not one
    more."""
    rows = d.get("concurrency")
    if not rows:
        return
    ctx = format_tokens(d["request"]["context"])
    out.line(styled((f"sequences of {ctx} tokens at once, each engine with the format it chose for one", "bold")))
    for c in rows:
        speed = ("" if c["aggregate_decode_tokens_per_s"] is None
                 else f", {c['aggregate_decode_tokens_per_s']:.1f} tok/s together")
        what = f"{c['weight_quant']} + {c['kv_dtype']}" if c["weight_quant"] != "-" else "-"
        out.line(styled((f"{c['engine']}:", "bold"), f" {c['sequences']} ({what}{speed})"))
        out.line(f"    {c['how']}")


def _engines(d: dict, full: bool) -> None:
    """One line per engine for the same request, each by its own rules (planner.engines: vramplan's first), then which
    decodes fastest here; `full` (plan --all) adds where each engine's speed comes from."""
    rows = d.get("engines") or []
    if not rows:
        return
    table, whole = [], []  # whole: each row's placement or reason uncut (the narrow layout shows all of it)
    mine = (d.get("request") or {}).get("engine", "vramplan")
    for e in rows:
        whole.append(e.get("reason", "") if not e["fits"] else e["placement"])
        how = "this plan" if e["engine"] == mine else e.get("how", "-").removeprefix("vramplan ")
        if not e["fits"]:
            reason = e.get("reason", "")
            table.append([e["engine"], f"{e.get('weight_quant', '-')} + {e.get('kv_dtype', '-')}", "no", "-", "-", "-",
                          reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 1] + "…", how])
            continue
        speed = "-" if e.get("decode_tokens_per_s") is None else f"{e['decode_tokens_per_s']:.2f}" + (
            f" ({e['decode_vs_plan']:.2f}x)" if e.get("decode_vs_plan") and e["engine"] != mine else "")
        table.append([e["engine"], f"{e['weight_quant']} + {e['kv_dtype']}", "yes", speed,
                      "-" if e.get("ttft_s") is None else format_duration(e["ttft_s"]),
                      format_tokens(e["max_context_tokens"]) if e.get("max_context_tokens") else "-", e["placement"],
                      how])
    columns = ["engine", "weights + KV", "fits", "decode tok/s", "TTFT", "ctx on GPU", "placement", "command"]
    wide = sum(max(len(str(r[i])) for r in [columns, *table]) for i in range(len(columns))) + 2 * (len(columns) - 1)
    if wide <= out.out.width:
        out.table("the same request by each engine's own rules", columns, table, right={3, 4, 5}, compact=True)
    else:  # narrower than the table: one block per engine, nothing cut, the command on its own line
        out.line(styled(("the same request by each engine's own rules", "bold")))
        for r, placement in zip(table, whole):
            facts = (f"{r[1]}, fits, decode {r[3]} tok/s, TTFT {r[4]}, context on the GPU {r[5]}" if r[2] == "yes"
                     else f"{r[1]}, does not fit")
            out.line(styled((f"{r[0]}:", "bold"), f" {facts}"))
            out.line(f"    {placement}")
            out.line(f"    {r[7]}")
    if full:
        for e in rows:
            if e["fits"] and e.get("speed_from"):
                out.info(f"{e['engine']}'s speed: {e['speed_from']}")
    best = d.get("fastest_engine")
    if best:
        vs = f", {best['decode_vs_plan']:.2f}x this plan" if best.get("decode_vs_plan") else ""
        out.line(styled(("fastest here:", "cyan"), f" {best['engine']} ({best['decode_tokens_per_s']:.2f} tok/s "
                                                     f"predicted{vs}): {best['why']}"))


# The constants planner.speed.speed_constants names for a plan's speed (their keys end so).
SPEED_CONSTANT_SUFFIXES = ("_bandwidth_efficiency", "_kv_efficiency", "_per_layer_s", "_per_token_s",
                           "_eager_dispatch_per_layer_s")


def speed_sources(d: dict) -> None:
    """`plan --explain`: each constant of the predicted speed, its value and where it comes from, with the public
    records a fitted one rests on, each with the address of its source (the corpus ships with vramplan:
    vramplan/planner/public_gpu/records.jsonl)."""
    rows = {k: v for k, v in d["constants"].items() if k.endswith(SPEED_CONSTANT_SUFFIXES)}
    if not rows:
        out.line("speed constants: none (nothing fits)")
        return
    out.line(styled(("where the predicted speed's constants come from", "bold")))
    by_source: dict[str, list[str]] = {}
    for k, v in rows.items():
        by_source.setdefault(v["from"], []).append(f"{k} = {v['value']:.4g}")
    for where, names in by_source.items():
        source, _, records = where.partition("; records ")
        source, _, host = source.partition("; host records ")
        out.line(f"  {', '.join(names)}")
        out.line(f"    from: {source}")
        for label, ids in (("records", records), ("host records", host)):
            if ids:
                out.line(f"    {label}:")
                for rid in (x.strip() for x in ids.split(",") if x.strip()):
                    out.line(f"      {rid}: {public_record_sources().get(rid, 'not in this version of the corpus')}")
    out.info(f"the records, each with its source and a quote of it: {public_records_path()}")


def public_records_path():
    from importlib import resources

    return resources.files("vramplan.planner.public_gpu").joinpath("records.jsonl")


@functools.lru_cache(maxsize=1)
def public_record_sources() -> dict[str, str]:
    """Each public record's id and the address of its source (the corpus installed with vramplan)."""
    rows = [json.loads(x) for x in public_records_path().read_text(encoding="utf-8").splitlines() if x.strip()]
    return {r["id"]: (r.get("source") or {}).get("url", "?") for r in rows}


def _chosen(d: dict) -> dict | None:
    """The candidate the plan chose, or None when nothing fits."""
    c = d["choice"]
    if not c:
        return None
    return next((x for x in d["candidates"] if x["fits"] and (x["weight_quant"], x["kv_dtype"]) ==
                 (c["weight_quant"], c["kv_dtype"])), None)


def _best_alternatives(cands: list[dict], chosen: dict | None) -> list[dict]:
    """The chosen candidate, then up to ALTERNATIVES_SHOWN others: the fastest of each other weight scheme that fits
    (its best KV option), fastest first, leaving out any with the same numbers as one shown (fp16 next to bf16);
    where fewer fit, those that miss by the least memory."""
    def numbers(x: dict) -> tuple:
        return x["vram_bytes"], x["ram_bytes"], x["predicted"]["decode_tokens_per_s"], x["quality_cost_pct"]

    best: dict[str, dict] = {}
    for x in cands:
        if x["fits"] and x is not chosen:
            speed = x["predicted"]["decode_tokens_per_s"] or 0.0
            cur = best.get(x["weight_quant"])
            if cur is None or (speed, -x["quality_cost_pct"]) > (cur["predicted"]["decode_tokens_per_s"] or 0.0,
                                                                 -cur["quality_cost_pct"]):
                best[x["weight_quant"]] = x
    fitting = sorted(best.values(), key=lambda x: (-(x["predicted"]["decode_tokens_per_s"] or 0.0),
                                                   x["quality_cost_pct"]))
    # closest to fitting first; one refused before it was sized (a device or --compile rule) has no bytes: last
    missing = sorted((x for x in cands if not x["fits"]),
                     key=lambda x: (x["vram_bytes"] is None and x["ram_bytes"] is None,
                                    (x["vram_bytes"] or 0) + (x["ram_bytes"] or 0)))
    shown = [chosen] if chosen is not None else []
    seen = {numbers(x) for x in shown}
    for x in fitting + missing:
        if len(shown) - (chosen is not None) >= ALTERNATIVES_SHOWN:
            break
        if numbers(x) not in seen:
            shown.append(x)
            seen.add(numbers(x))
    return shown


def _memory(mem: dict) -> None:
    gpus, cpu = mem.get("gpus") or ([mem["gpu"]] if mem.get("gpu") else []), mem["cpu"]
    summary = ("total_bytes", "capacity_bytes", "free_bytes")
    keys = list(dict.fromkeys(k for k in [*(k for g in gpus for k in g), *cpu] if k not in summary))
    columns = [*gpus, cpu] if gpus else [{}, cpu]
    names = (["GPU"] if len(gpus) <= 1 else [f"GPU{d}" for d in range(len(gpus))]) + ["RAM"]
    rows = [[k.removesuffix("_bytes").replace("_", " "),
             *(format_bytes(col[k]) if k in col else "-" for col in columns)] for k in [*keys, *summary]]
    out.table("memory by device", ["term", *names], rows, right=set(range(1, len(names) + 1)))


def _candidates(cands: list[dict], chosen: dict | None, title: str) -> None:
    rows = []
    for x in cands:
        pr, ceiling = x["predicted"], x["ceiling"]["decode_tokens_per_s"]
        placement = ("all" if x["fits_on_gpu"] else
                     f"{x['gpu_layers']}/{x['total_layers']} {x['offload']}" if x["fits"] else "-")
        rows.append(["plan" if x is chosen else "", x["weight_quant"], x["kv_dtype"], "yes" if x["fits"] else "no",
                     placement,
                     format_bytes(x["vram_bytes"]), format_bytes(x["ram_bytes"]),
                     f"{ceiling:.2f}" if ceiling else "-",
                     f"{pr['decode_tokens_per_s']:.2f}" if pr["decode_tokens_per_s"] else "-",
                     format_tokens(x["max_context_tokens"]), f"{x['quality_cost_pct']:.1f}"])
    out.table(title, ["", "weights", "KV", "fits", "GPU layers", "VRAM", "RAM", "ceiling", "tok/s", "max ctx",
                      "ppl +%"], rows, right={5, 6, 7, 8, 9, 10}, drop=(7, 9, 6, 3))


# ---------------------------------------------------------------- run
def run_report(r: dict) -> None:
    def show(metric: str, v: Any) -> str:
        if v is None:
            return "-"
        if "bytes" in metric:
            return format_bytes(v)
        if metric == "generated_tokens":
            return str(v)
        return f"{v:.3f} s" if metric in ("ttft_s", "load_s", "warmup_s") else f"{v:.2f}"

    rows = []
    for metric in ("decode_tokens_per_s", "ttft_s", "peak_vram_bytes", "peak_ram_bytes"):
        e = r["error_pct"].get(metric)
        rows.append([metric, show(metric, r["predicted"].get(metric)), show(metric, r["measured"].get(metric)),
                     "-" if e is None else f"{e:+.1f} %"])
    m = r["measured"]
    # decode_tokens_per_s above is tokens over wall time, first token to last; beside it, rates of single steps
    steps, edge = len(m.get("token_timestamps_s") or [0]) - 1, m.get("decode_edge_steps")
    labels = {"decode_tokens_per_s_median": "decode_tokens_per_s_median (median step)",
              "decode_tokens_per_s_start": f"decode_tokens_per_s_start (first {edge} of {steps} steps)",
              "decode_tokens_per_s_end": f"decode_tokens_per_s_end (last {edge} of {steps} steps)"}
    labels["peak_vram_load_bytes"] = "peak VRAM until timed (loading, warm-up)"
    labels["peak_ram_file_bytes"] = "of peak RAM: mapped from files (reclaimable)"
    for metric in ("load_s", "warmup_s", "peak_vram_load_bytes", "peak_ram_file_bytes", "prefill_tokens_per_s",
                   "decode_tokens_per_s_median",
                   "decode_tokens_per_s_start", "decode_tokens_per_s_end", "generated_tokens"):
        if m.get(metric) is not None:
            rows.append([labels.get(metric, metric), "", show(metric, m[metric]), ""])
    if m.get("gpu_sm_clock_mhz_median") is not None:
        rows.append(["GPU SM clock while timed (median / lowest)", "",
                     f"{m['gpu_sm_clock_mhz_median']} / {m['gpu_sm_clock_mhz_min']} MHz", ""])
    status = "INTERRUPTED" if r.get("interrupted") else (r["stopped_reason"] or "-")
    out.table(f"predicted vs measured ({r['device']}, prompt {r['prompt_tokens']} tokens, stopped: {status})",
              ["metric", "predicted", "measured", "error"], rows, right={1, 2, 3}, stderr=True)
    for n in r["notes"]:
        out.note(n)
    for e in r["errors"]:
        out.labelled("error during the run:", "red", e)
