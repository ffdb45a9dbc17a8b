"""Generated text is code: every export of a model whose directory has a hostile name is run as its reader would run
it, with stub programs that record what they were given, and nothing extra runs or appears.

- llama.cpp and vLLM: the shell text runs under bash, with `llama-server` and `vllm` stubs first on PATH;
- transformers: the Python snippet runs with `torch` and `transformers` stubs first on sys.path;
- Ollama: the Modelfile is read by a port of Ollama's own parser (parser/parser.go ParseFile, v0.32.15), and its
  commands are exactly those vramplan meant.
The names hold newlines, carriage returns, quotes, `$(...)`, backticks, `;`, `#` and an ESC."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import isolate, run_cli
from vramplan.planner.quoting import file_stem, modelfile_value, one_line, shell_quote
from vramplan.planner.errors import PlanError

CONFIG = Path(__file__).resolve().parents[1] / "planner" / "catalog" / "Qwen--Qwen2.5-0.5B.json"

HOSTILE_NAMES = [
    "x\ntouch PWNED #",
    'x", __import__("os").system("touch PWNED"), "',
    "x', __import__('os').system('touch PWNED'), '",
    "$(touch PWNED)",
    "`touch PWNED`",
    "a; touch PWNED",
    "x\r\nFROM evil\r\nSYSTEM pwned",
    "x\nSYSTEM pwned\nPARAMETER num_ctx 1",
    'it\'s "quoted" # not a comment',
    "x\x1b[31mred",
]

SHELL_STUB = """#!/bin/sh
exec "{python}" -c 'import json, sys; open(sys.argv[1], "a").write(json.dumps(sys.argv[2:]) + "\\n")' "{log}" "$0" "$@"
"""

TORCH_STUB = "bfloat16 = 'bfloat16'\nfloat16 = 'float16'\n"
TRANSFORMERS_STUB = """import json, os
class AutoModelForCausalLM:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        with open(os.environ["STUB_LOG"], "a") as f:
            f.write(json.dumps({"args": list(args), "kwargs": sorted(kwargs)}) + "\\n")
class _Config:
    def __init__(self, *args, **kwargs):
        pass
BitsAndBytesConfig = QuantoConfig = TorchAoConfig = _Config
"""


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate(tmp_path, monkeypatch, offline_hub=True)


def model_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / "models" / name
    d.mkdir(parents=True)
    shutil.copy(CONFIG, d / "config.json")
    return d


def emit(capsys, model: Path, engine: str, *extra: str) -> str:
    code, out, err = run_cli(capsys, "plan", "--model", model, "-H", "rtx-4090", "--context", "4k", "--emit", engine,
                             *extra)
    assert code == 0, err
    return out


def nothing_extra(work: Path) -> None:
    assert not list(work.rglob("PWNED")), "the export ran the name"


def run_shell(tmp_path: Path, text: str, programs: tuple[str, ...]) -> list[list[str]]:
    """The export's shell text run by bash with stub programs; each call's argv (program name first)."""
    work, stubs, log = tmp_path / "work", tmp_path / "stubs", tmp_path / "calls.jsonl"
    work.mkdir(exist_ok=True)
    stubs.mkdir(exist_ok=True)
    for program in programs:
        stub = stubs / program
        stub.write_text(SHELL_STUB.format(python=sys.executable, log=log))
        stub.chmod(0o755)
    (work / "serve.sh").write_text(text)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-eu", "serve.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    nothing_extra(tmp_path)
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_the_llama_cpp_command_runs_llama_server_alone(capsys, tmp_path, name):
    text = emit(capsys, model_dir(tmp_path, name), "llama.cpp")
    calls = run_shell(tmp_path, text, ("llama-server",))
    assert len(calls) == 1
    argv = calls[0]
    assert Path(argv[0]).name == "llama-server"
    gguf = argv[argv.index("-m") + 1]
    assert gguf.startswith(f"{file_stem(name)}-") and gguf.endswith(".gguf") and gguf.isprintable()


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_the_vllm_command_serves_the_directory_itself(capsys, tmp_path, name):
    d = model_dir(tmp_path, name)
    calls = run_shell(tmp_path, emit(capsys, d, "vllm"), ("vllm",))
    assert len(calls) == 1
    assert calls[0][1:3] == ["serve", str(d.resolve())]  # the path, not the name another directory may share


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("extra", [(), ("--gpu-layers", "12", "--quant", "bnb-nf4")])
def test_the_transformers_snippet_loads_the_directory_itself(capsys, tmp_path, name, extra):
    d = model_dir(tmp_path, name)
    text = emit(capsys, d, "transformers", *extra)
    stubs, work, log = tmp_path / "pystubs", tmp_path / "work", tmp_path / "calls.jsonl"
    (stubs / "transformers").mkdir(parents=True)
    (stubs / "transformers" / "__init__.py").write_text(TRANSFORMERS_STUB)
    (stubs / "torch.py").write_text(TORCH_STUB)
    work.mkdir()
    (work / "load.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": str(stubs), "STUB_LOG": str(log)}
    done = subprocess.run([sys.executable, "load.py"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    nothing_extra(tmp_path)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [{"args": [str(d.resolve())], "kwargs": calls[0]["kwargs"]}]
    assert "device_map" in calls[0]["kwargs"]


# ---------------------------------------------------------------- Ollama's Modelfile parser, ported
def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """Ollama's ParseFile (parser/parser.go, v0.32.15): its states and transitions rune by rune; the (name, args)
    commands, FROM as "model". Raises ValueError where Ollama's parser errs."""
    commands, b, state, role, name = [], "", "nil", "", ""

    def unquote(s: str) -> tuple[str, bool]:
        if s[:3] == '"""':
            return (s[3:-3], True) if len(s) >= 6 and s[-3:] == '"""' else ("", False)
        if s[:1] == '"':
            return (s[1:-1], True) if len(s) >= 2 and s[-1] == '"' else ("", False)
        return s, True

    def next_state(r: str, cs: str) -> tuple[str, str]:
        space, newline, alpha = r in " \t", r in "\r\n", r.isascii() and r.isalpha()
        if cs == "nil":
            return ("comment", "") if r == "#" else ("nil", "") if space or newline else ("name", r)
        if cs == "name":
            if alpha:
                return "name", r
            if space:
                return "value", ""
            raise ValueError("invalid command")
        if cs == "value":
            return ("nil", r) if newline or space else ("value", r)
        if cs == "parameter":
            if alpha or r.isdigit() or r == "_":
                return "parameter", r
            if space:
                return "value", ""
            raise ValueError("unexpected EOF")
        if cs == "message":
            if alpha:
                return "message", r
            if space:
                return "value", ""
            raise ValueError("unexpected EOF")
        return ("nil", "") if newline else ("comment", "")

    for r in text:
        nxt, r2 = next_state(r, state)
        if nxt != state:
            if state == "name":
                word = b.lower()
                if word not in ("from", "license", "template", "system", "adapter", "draft", "renderer", "parser",
                                "parameter", "message", "requires"):
                    raise ValueError("invalid command")
                if word == "from":
                    name = "model"
                elif word == "parameter":
                    nxt = "parameter"
                else:
                    if word == "message":
                        nxt = "message"
                    name = word
            elif state == "parameter":
                name = b
            elif state == "message":
                role = b
            elif state == "value":
                s, ok = unquote(b.strip())
                if not ok or r2 in (" ", "\t"):
                    b += r2
                    continue
                commands.append((name, f"{role}: {s}" if role else s))
                role = ""
            b, state = "", nxt
        if r2 and r2.isprintable():
            b += r2
    if state == "value":
        s, ok = unquote(b.strip())
        if not ok:
            raise ValueError("unexpected EOF")
        commands.append((name, s))
    elif state not in ("nil", "comment"):
        raise ValueError("unexpected EOF")
    return commands


def test_the_ported_parser_reads_what_ollama_reads():
    assert parse_modelfile('FROM llama3\nPARAMETER num_ctx 4096\n# c\nSYSTEM """a "b"\nc"""\n') == [
        ("model", "llama3"), ("num_ctx", "4096"), ("system", 'a "b"\nc')]
    assert parse_modelfile('FROM "./a b.gguf"\n') == [("model", "./a b.gguf")]
    assert parse_modelfile("# x\nFROM a\r\nSYSTEM evil\n") == [("model", "a"), ("system", "evil")]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_the_modelfile_holds_only_its_own_commands(capsys, tmp_path, name):
    text = emit(capsys, model_dir(tmp_path, name), "ollama")
    commands = parse_modelfile(text)
    assert [c for c, _ in commands] == ["model", "num_ctx"] and commands[1] == ("num_ctx", "4096")
    assert commands[0][1].startswith(f"./{file_stem(name)}-") and commands[0][1].endswith(".gguf")


@pytest.mark.parametrize("value", ["./a b.gguf", 'a"b c', "plain:tag", 'x"y'])
def test_modelfile_values_read_back_as_written(value):
    assert parse_modelfile(f"FROM {modelfile_value(value)}\n") == [("model", value)]


@pytest.mark.parametrize("value", ["a\nSYSTEM x", "a\rb", "a\x1bb", "", 'a """b" c'])
def test_modelfile_values_without_a_faithful_spelling_are_refused(value):
    with pytest.raises(PlanError):
        modelfile_value(value)


# ---------------------------------------------------------------- the quoting functions themselves
@pytest.mark.parametrize("word", [*HOSTILE_NAMES, "a\\b'c\n", "\u202eevil", "a\udc80b", "plain-1.0"])
def test_a_shell_word_reads_back_as_itself(word):
    done = subprocess.run(["bash", "-c", f"printf %s {shell_quote(word)}"], capture_output=True, timeout=10)
    assert done.stdout == word.encode("utf-8", "surrogateescape")
    assert shell_quote(word).isprintable()


def test_one_line_escapes_whatever_could_end_or_restyle_a_line():
    assert one_line("a\nb\r\x1b[1m\u2028\u202e\t") == "a\\nb\\r\\x1b[1m\\u2028\\u202e\\t"
    assert one_line("plain · text ≥ 2") == "plain · text ≥ 2"


def test_the_terminal_sees_escapes_not_control_characters(capsys, tmp_path):
    d = model_dir(tmp_path, "y\x1b]0;title\x07\x1b[31mred")
    code, out, err = run_cli(capsys, "plan", "--model", d, "-H", "rtx-4090", "--context", "4k")
    assert code == 0, err
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert "y\\x1b]0;title\\x07\\x1b[31mred on rtx-4090" in out
