"""`vramplan run --engine llama.cpp`: the GGUF header read for the file type, the CLI's checks, runs against a
stand-in llama-server (its stream well formed, malformed, interrupted; its command quoted), and (where a built
llama-server and a GGUF file are given by $VRAMPLAN_LLAMA_SERVER and $VRAMPLAN_TEST_GGUF with
$VRAMPLAN_TEST_GGUF_MODEL) a real run."""

from __future__ import annotations

import json
import os
import shlex
import struct
import sys
from types import SimpleNamespace

import pytest

from cli_helpers import assert_one_line_error, isolate, run_cli
from test_audit_gguf import HW, tiny_model_dir, write_model_gguf
from vramplan.planner.errors import VramplanError
from vramplan.runtime.llamacpp_run import gguf_file_type


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path, file_type: int | None, *, magic: bytes = b"GGUF") -> None:
    """A GGUF v3 header as llama.cpp's gguf.cpp writes it: strings, an array of strings, an array of floats, a
    uint64 and a bool before `general.file_type` (a uint32), then a string after it; no tensors."""
    kvs = [("general.architecture", 8, _string("llama")),
           ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + _string("a") + _string("bc") + _string("<s>")),
           ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0.0, 1.0, 2.0)),
           ("llama.context_length", 10, struct.pack("<Q", 8192)),
           ("general.quantized", 7, b"\x01")]
    if file_type is not None:
        kvs.append(("general.file_type", 4, struct.pack("<I", file_type)))
    kvs.append(("general.name", 8, _string("tiny")))
    body = b"".join(_string(k) + struct.pack("<I", t) + v for k, t, v in kvs)
    path.write_bytes(magic + struct.pack("<IQQ", 3, 0, len(kvs)) + body)


@pytest.mark.parametrize("ftype, name", [(15, "Q4_K_M"), (2, "Q4_0"), (7, "Q8_0"), (32, "BF16"), (1, "F16")])
def test_the_file_type_is_read_from_the_gguf_header_past_strings_and_arrays(tmp_path, ftype, name):
    write_gguf(tmp_path / "m.gguf", ftype)
    assert gguf_file_type(tmp_path / "m.gguf") == name


def test_a_file_that_is_not_a_usable_gguf_is_a_one_line_error(tmp_path):
    write_gguf(tmp_path / "bad.gguf", 15, magic=b"GGML")
    with pytest.raises(VramplanError, match="not a GGUF file"):
        gguf_file_type(tmp_path / "bad.gguf")
    write_gguf(tmp_path / "none.gguf", None)
    with pytest.raises(VramplanError, match="no general.file_type"):
        gguf_file_type(tmp_path / "none.gguf")
    write_gguf(tmp_path / "odd.gguf", 99)  # no llama_ftype of that id: not a type vramplan sizes
    with pytest.raises(VramplanError, match="not one vramplan sizes"):
        gguf_file_type(tmp_path / "odd.gguf")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(VramplanError, match="short.gguf: the GGUF version needs 4 bytes at byte 4 but the file ends 2 "
                                            "bytes later"):
        gguf_file_type(tmp_path / "short.gguf")


def test_run_with_llamacpp_needs_a_gguf_and_a_server_and_says_so(tmp_path, monkeypatch, capsys):
    isolate(tmp_path, monkeypatch)
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # no prompt piped in
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", "qwen2.5-0.5b")
    assert "--gguf PATH" in assert_one_line_error(code, err)
    d, spec = tiny_model_dir(tmp_path)
    write_model_gguf(tmp_path / "m.gguf", spec, "Q4_0")
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", d, "--gguf", tmp_path / "m.gguf",
                           "-H", HW)
    assert "llama-server at" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model", d, "--gguf", tmp_path / "m.gguf",
                           "-H", HW, "--quant", "Q8_0")
    assert "is Q4_0" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "run", "--model", "qwen2.5-0.5b", "--gguf", tmp_path / "m.gguf")
    assert "--engine llama.cpp" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "run", "--engine", "ollama", "--model", "qwen2.5-0.5b")
    assert "vramplan or llama.cpp" in assert_one_line_error(code, err)


@pytest.mark.skipif(not (os.environ.get("VRAMPLAN_LLAMA_SERVER") and os.environ.get("VRAMPLAN_TEST_GGUF")),
                    reason="needs a built llama-server ($VRAMPLAN_LLAMA_SERVER) and a GGUF file ($VRAMPLAN_TEST_GGUF, "
                           "converted from $VRAMPLAN_TEST_GGUF_MODEL)")
def test_a_real_llama_server_run_reports_predicted_and_measured(tmp_path, monkeypatch, capsys):
    server, gguf = os.environ["VRAMPLAN_LLAMA_SERVER"], os.environ["VRAMPLAN_TEST_GGUF"]
    isolate(tmp_path, monkeypatch)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", server)
    code, out, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--model",
                             os.environ.get("VRAMPLAN_TEST_GGUF_MODEL", "qwen2.5-0.5b"), "--gguf", gguf,
                             "--prompt-tokens", "32", "-n", "8", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["measured"]["generated_tokens"] == 8 and d["measured"]["decode_tokens_per_s"] > 0
    assert d["measured"]["peak_ram_bytes"] > 0 and d["predicted"]["decode_tokens_per_s"] > 0
    assert d["plan"]["request"]["engine"] == "llama.cpp" and len(d["measured"]["token_timestamps_s"]) >= 8


def test_calibrate_with_llamacpp_checks_its_inputs_before_any_server(tmp_path, monkeypatch, capsys):
    from vramplan.planner.profiles import resolve_profile
    from vramplan.planner.sources import model_spec
    from vramplan.runtime.llamacpp_calibrate import calibrate_llamacpp

    isolate(tmp_path, monkeypatch)
    d, spec = tiny_model_dir(tmp_path)
    write_model_gguf(tmp_path / "m.gguf", spec, "Q4_0")
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b,llama-3.2-1b",
                           "--gguf", tmp_path / "m.gguf")
    assert "one --models entry per --gguf file (2 models, 1 files)" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b",
                           "--gguf", tmp_path / "M-missing.gguf")
    assert "--gguf " + str(tmp_path / "M-missing.gguf") + ": no such file" in assert_one_line_error(code, err)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", d, "--gguf", tmp_path / "m.gguf")
    assert "llama-server at" in assert_one_line_error(code, err)
    # another model's file: refused before the server is looked for (and before any probe)
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b",
                           "--gguf", tmp_path / "m.gguf")
    assert "with 2 layers of width 64; --model" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "calibrate", "--gguf", tmp_path / "m.gguf")
    assert "go with --engine llama.cpp" in assert_one_line_error(code, err)
    code, _, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--models", "qwen2.5-0.5b", "--gguf",
                           tmp_path / "m.gguf", "--quants", "bf16", "--repeats", "2")
    assert "--quants, --repeats: not for --engine llama.cpp" in assert_one_line_error(code, err)
    with pytest.raises(VramplanError, match="has a GPU"):  # the fit's model is every layer on the CPU
        calibrate_llamacpp(resolve_profile("h100-sxm")[0], [(model_spec("qwen2.5-0.5b"), str(tmp_path / "m.gguf"))],
                           tmp_path / "server")


@pytest.mark.skipif(not (os.environ.get("VRAMPLAN_LLAMA_SERVER") and os.environ.get("VRAMPLAN_TEST_GGUF")),
                    reason="needs a built llama-server ($VRAMPLAN_LLAMA_SERVER) and a GGUF file ($VRAMPLAN_TEST_GGUF, "
                           "converted from $VRAMPLAN_TEST_GGUF_MODEL)")
def test_calibrate_with_a_real_llama_server_fits_what_llamacpp_plans_then_use(tmp_path, monkeypatch, capsys):
    from vramplan.planner.engines.llamacpp import plan_llamacpp
    from vramplan.planner.profile_yaml import loads_profile
    from vramplan.planner.request import Request
    from vramplan.planner.sources import model_spec

    gguf, model = os.environ["VRAMPLAN_TEST_GGUF"], os.environ.get("VRAMPLAN_TEST_GGUF_MODEL", "qwen2.5-0.5b")
    server = os.environ["VRAMPLAN_LLAMA_SERVER"]
    isolate(tmp_path, monkeypatch)
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", server)
    code, _, err = run_cli(capsys, "probe", "--save", tmp_path / "here.yaml")
    assert code == 0, err
    code, out, err = run_cli(capsys, "calibrate", "--engine", "llama.cpp", "--hardware", tmp_path / "here.yaml",
                             "--models", model, "--gguf", gguf, "--prompts", "32,96", "--new-tokens", "8",
                             "--save", tmp_path / "cal.yaml", "--json")
    assert code == 0, err
    d = json.loads(out)
    file_type = gguf_file_type(gguf)
    assert {(r["file_type"], r["prompt_tokens"]) for r in d["runs"]} == {(file_type, 32), (file_type, 96)}
    hw = loads_profile((tmp_path / "cal.yaml").read_text())
    p = plan_llamacpp(model_spec(model), hw, Request(context=104, prompt_tokens=96, engine="llama.cpp",
                                                     quant=(file_type,)))
    assert p.chosen.speed.terms["efficiency_source"].startswith("calibrated")


# ------------------------------------------------------------------ a stand-in llama-server
FAKE_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

with open(os.environ["FAKE_LLAMA_ARGV"], "w") as f:
    json.dump(sys.argv, f)
port = int(sys.argv[sys.argv.index("--port") + 1])
with open(os.environ["FAKE_LLAMA_EVENTS"]) as f:
    lines = f.read().splitlines()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in lines:
            self.wfile.write(line.encode() + b"\\n\\n")
            self.wfile.flush()


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def token_events(n: int) -> list[str]:
    """n server-sent events of one token each, as llama-server's /completion streams them."""
    return ["data: " + json.dumps({"content": f"w{i} ", "tokens": [300 + i], "stop": False}) for i in range(n)]


def stop_event(prompt_n: int, predicted_n: int) -> str:
    timings = {"prompt_n": prompt_n, "prompt_ms": 20.0, "prompt_per_second": prompt_n / 0.02,
               "predicted_n": predicted_n, "predicted_ms": predicted_n * 20.0, "predicted_per_second": 50.0}
    return "data: " + json.dumps({"content": "", "stop": True, "stop_type": "limit", "timings": timings})


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """A tiny model and its GGUF in a directory whose name needs quoting, and a stand-in llama-server (Python's
    http.server: /health answers, /completion streams `events` as set) on $VRAMPLAN_LLAMA_SERVER; run(*extra) runs
    `vramplan run --engine llama.cpp` on them and returns (code, stdout, stderr); argv() is the server's argv."""
    isolate(tmp_path, monkeypatch)
    where = tmp_path / "models $(touch pwned) 'q'"
    where.mkdir()
    d, spec = tiny_model_dir(where)
    gguf = where / "tiny Q4_K_M.gguf"
    write_model_gguf(gguf, spec, "Q4_K_M")
    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    events, argv = tmp_path / "events.txt", tmp_path / "argv.json"
    monkeypatch.setenv("VRAMPLAN_LLAMA_SERVER", str(server))
    monkeypatch.setenv("FAKE_LLAMA_EVENTS", str(events))
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv))

    def run(capsys, lines: list[str], *extra):
        events.write_text("\n".join(lines) + "\n")
        return run_cli(capsys, "run", "--engine", "llama.cpp", "--model", d, "--gguf", gguf, "-H", HW,
                       "--prompt-tokens", "8", *extra)

    return SimpleNamespace(run=run, argv=lambda: json.loads(argv.read_text()), gguf=gguf, tmp=tmp_path)


def test_a_run_reports_llama_servers_timings_and_its_command_quoted(fake_run, capsys):
    code, out, err = fake_run.run(capsys, [*token_events(5), stop_event(8, 5)], "-n", "5", "--json")
    assert code == 0, err
    d = json.loads(out)
    m = d["measured"]
    assert (m["generated_tokens"], m["decode_tokens_per_s"], d["prompt_tokens"]) == (5, 50.0, 8)
    assert d["tokens"] == [300, 301, 302, 303, 304] and d["text"] == "w0 w1 w2 w3 w4 " and not d["errors"]
    argv = fake_run.argv()
    note = next(n for n in d["notes"] if n.startswith("llama-server: "))
    assert note == "llama-server: " + shlex.join(argv)  # quoted: the path's space, quotes and $(...) survive a shell
    assert shlex.split(note.removeprefix("llama-server: ")) == argv and str(fake_run.gguf) in argv
    assert not (fake_run.tmp / "pwned").exists()
    assert "llama.cpp ran 13 tokens" in " ".join(d["notes"])


@pytest.mark.parametrize("bad", ["data: {\"content\": \"w3\", \"tok", "data: [1, 2]"])
def test_a_malformed_event_reports_what_was_measured_and_the_error(fake_run, capsys, bad):
    code, out, err = fake_run.run(capsys, [*token_events(3), bad, *token_events(2), stop_event(8, 5)], "-n", "5",
                                  "--json")
    assert code == 1 and "internal error" not in err and "Traceback" not in err, err
    d = json.loads(out)
    assert d["measured"]["generated_tokens"] == 3 and d["tokens"] == [300, 301, 302]
    assert len(d["errors"]) == 1 and d["errors"][0].startswith("llama-server's stream broke off after 3 tokens: ")
    assert ("a malformed event" if "{" in bad else "no JSON object") in d["errors"][0]


def test_an_interrupted_run_counts_the_tokens_that_streamed(fake_run, capsys, monkeypatch):
    """The audit's case: Ctrl-C after 207 tokens streamed reported "0 tokens"."""
    from vramplan.render import out

    shown: list[str] = []
    raw = out.raw

    def ctrl_c_at_207(text: str) -> None:
        shown.append(text)
        if len(shown) == 207:
            raise KeyboardInterrupt
        raw(text)

    monkeypatch.setattr(out, "raw", ctrl_c_at_207)
    code, _, err = fake_run.run(capsys, [*token_events(300), stop_event(8, 300)], "-n", "300", "--save",
                                fake_run.tmp / "report.json")
    assert code == 130, err
    d = json.loads((fake_run.tmp / "report.json").read_text())
    assert d["interrupted"] and d["measured"]["generated_tokens"] == 207 and len(d["tokens"]) == 207
    assert d["prompt_tokens"] == 8 and "llama.cpp ran 215 tokens" in " ".join(d["notes"])
    assert d["measured"]["ttft_s"] is not None and d["measured"]["decode_tokens_per_s"] > 0
