"""User text made safe for where it goes: one line (a comment, a terminal), a shell word, a Modelfile value, a file
name. A model's name or path is the user's text (a directory may be called `x\\ntouch PWNED #`), and what vramplan
writes from it is code, or a terminal's input: it gets there only through these functions.
Pure: the standard library only."""

from __future__ import annotations

import re
import shlex

from .errors import PlanError

_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str) -> str:
    """`text` with every character that could end, hide or restyle a line escaped as \\n, \\r, \\t, \\xNN, \\uNNNN or
    \\UNNNNNNNN: whatever str.isprintable refuses (controls, ESC, format characters such as bidi overrides, line and
    paragraph separators, lone surrogates). A comment line stays one comment line in bash, Python and a Modelfile, and
    a terminal shows what is there."""
    return text if text.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return _NAMED_ESCAPES.get(c) or (f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")


def shell_quote(word: str) -> str:
    """One shell word: shlex.quote's single quotes, or bash's $'...' with every unprintable character escaped (so a
    terminal shows the command as it is) when the word holds any; a byte a file name could not decode (Python's
    surrogate escape) is written as that byte."""
    if word.isprintable():
        return shlex.quote(word)
    return "$'" + "".join(_shell_char(c) for c in word) + "'"


def shell_join(argv) -> str:
    """A command on one line, every word quoted (`shell_quote`)."""
    return " ".join(shell_quote(str(a)) for a in argv)


def _shell_char(c: str) -> str:
    if c in "\\'":
        return "\\" + c
    if 0xDC80 <= ord(c) <= 0xDCFF:  # os.fsdecode's escape of an undecodable byte
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c if c.isprintable() else _escape(c)


def python_str(text: str) -> str:
    """A Python string literal of `text`: in double quotes where nothing in it needs escaping, else repr()'s."""
    return f'"{text}"' if text.isprintable() and '"' not in text and "\\" not in text else repr(text)


def python_fstring(before: str, expression: str, after: str = "") -> str:
    """A Python f-string literal: `before` and `after` taken literally (their braces doubled) around `{expression}`
    (vramplan's own code, never user text)."""
    def literal(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    return "f" + python_str(literal(before) + "{" + expression + "}" + literal(after))


def file_stem(name: str) -> str:
    """A file name made from a model's name (the GGUF file an export suggests writing): its last path part with
    every character but letters, digits, '.', '_' and '-' as '-'; never empty, never an option or a hidden file."""
    last = name.rstrip("/").split("/")[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.") or "model"


def modelfile_value(value: str) -> str:
    """A value on a Modelfile line, as Ollama's parser reads it (parser/parser.go, ParseFile and unquote, Ollama
    v0.32.15): it ends at a space, tab or newline unless quoted "..." or \"\"\"...\"\"\" (no escapes inside), and
    characters strconv.IsPrint refuses are dropped. A value with a newline or an unprintable character has no
    faithful spelling: refused."""
    if not value or not value.isprintable():
        raise PlanError(f"{one_line(value)!r} cannot be written on a Modelfile line (Ollama drops unprintable "
                        "characters and ends a value at a newline): rename it")
    if " " not in value and '"' not in value:
        return value
    if '"' not in value:
        return f'"{value}"'
    if '"""' not in value and not value.endswith('"'):
        return f'"""{value}"""'
    raise PlanError(f"{value!r} cannot be quoted on a Modelfile line (it holds \"\"\" or ends with a quote): rename it")
