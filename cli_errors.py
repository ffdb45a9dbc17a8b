"""How the CLI ends: the table from exception type to what the user sees (one line) and the exit code
(cli.py's docstring lists the codes); an unexpected error is one "internal error" line (the traceback under
VRAMPLAN_DEBUG=1)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from vramplan import render
from vramplan.planner.errors import VramplanError
from vramplan.render import out

EXIT_NOTHING_FITS = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130

RUNTIME_PACKAGES = ("torch", "transformers", "accelerate", "bitsandbytes", "optimum", "safetensors")


def _click_types(name: str) -> tuple[type, ...]:
    """The class `name` (ClickException, Exit, Abort, NoArgsIsHelpError) of whichever click typer runs on: its bundled
    copy (typer >= 0.28) and typer's own exceptions, or the click package, asked for only when something imported it
    (importing it costs 8 ms a run)."""
    found = []
    for module in ("typer.exceptions", "typer._click.exceptions", "click.exceptions"):
        if module.startswith("click") and "click" not in sys.modules:
            continue
        try:
            cls = getattr(__import__(module, fromlist=[name]), name, None)
        except ImportError:
            continue
        if cls is not None and cls not in found:
            found.append(cls)
    return tuple(found)


def _usage(e: Exception) -> str:
    message = e.format_message() if hasattr(e, "format_message") else str(e)
    ctx = getattr(e, "ctx", None)
    hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return " ".join(message.split()) + hint


# The library names request fields (request.<field>); the user typed flags.
_REQUEST_FLAGS = {"allow_context_overflow": "--allow-context-overflow", "vram_budget_bytes": "--vram-budget",
                  "ram_budget_bytes": "--ram-budget", "gpu_layers": "--gpu-layers", "kv_dtype": "--kv-dtype",
                  "quant": "--quant", "offload": "--offload", "context": "--context",
                  "prompt_tokens": "--prompt-tokens", "expert_placement": "--expert-placement"}


def _as_flags(message: str) -> str:
    import re

    return re.sub(r"request\.([a-z_]+)", lambda m: _REQUEST_FLAGS.get(m.group(1), m.group(0)), message)


# ---------------------------------------------------------------- errors: one table, type -> formatter
# Each formatter prints what the user sees (one line at most) and returns the exit code; None means "unexpected":
# an internal error (exit 3), or the traceback under VRAMPLAN_DEBUG=1. The first row whose types match wins.
def _closed_stdout(e: BaseException) -> int:
    out.silence_stdout()  # the reader has gone (`| head -1`): stop quietly, with the outcome the command had decided
    return out.outcome


def _vramplan_error(e: BaseException) -> int | None:
    if isinstance(e, render.OutputError):
        out.silence_stdout()
    out.plain_error(_as_flags(str(e)))
    return e.exit_code


def _interrupted(e: BaseException) -> int:
    out.err.print("interrupted", highlight=False)
    return EXIT_INTERRUPTED


def _missing_module(e: BaseException) -> int | None:
    missing = (e.name or "").split(".")[0]
    if missing not in RUNTIME_PACKAGES:
        return None
    out.plain_error(f"this command needs the runtime extra ({missing} is not installed): "
                    "pip install 'vramplan[runtime]' (from a checkout: pip install -e '.[runtime]')")
    return EXIT_BAD_INPUT


def _usage_error(e: BaseException) -> int:
    out.plain_error(_usage(e))
    return EXIT_BAD_INPUT


def error_table() -> list[tuple[tuple[type, ...], Any, bool]]:
    """(exception types, formatter, re-raised under VRAMPLAN_DEBUG) in the order they are matched."""
    return [
        ((render.StdoutClosed,), _closed_stdout, False),
        ((VramplanError,), _vramplan_error, True),
        ((KeyboardInterrupt, EOFError), _interrupted, False),
        ((ModuleNotFoundError,), _missing_module, True),
        (_click_types("Exit"), lambda e: e.exit_code, False),  # typer.Exit(code): the command chose its code
        (_click_types("Abort"), _interrupted, False),  # click's Ctrl-C at a prompt
        (_click_types("NoArgsIsHelpError"), lambda e: EXIT_BAD_INPUT, False),  # typer has printed the help
        (_click_types("ClickException"), _usage_error, False),
    ]


# What VRAMPLAN_DEBUG may say to keep tracebacks off (its unset or empty value too); anything else turns them on.
DEBUG_OFF = ("", "0", "false", "no", "off")


def debug_enabled() -> bool:
    """Whether VRAMPLAN_DEBUG asks for tracebacks: set, and not one of DEBUG_OFF (VRAMPLAN_DEBUG=0 is off)."""
    return os.environ.get("VRAMPLAN_DEBUG", "").strip().lower() not in DEBUG_OFF


def exit_code(e: BaseException) -> int:
    debug = debug_enabled()
    for types, formatter, reraise_in_debug in error_table():
        if types and isinstance(e, types):
            if debug and reraise_in_debug:
                raise e
            code = formatter(e)
            if code is not None:
                return code
            break
    if debug:
        raise e
    _internal(e)
    return EXIT_INTERNAL


def on_sigterm(handler):
    """Install `handler` for SIGTERM and return the one it replaces (None where signals cannot be set: a thread)."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _internal(e: BaseException) -> None:
    out.plain_error(f"internal error: {type(e).__name__}: {' '.join(str(e).split())[:500]} "
                    "(set VRAMPLAN_DEBUG=1 for the traceback)")
