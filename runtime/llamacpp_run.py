"""`vramplan run --engine llama.cpp`: a llama.cpp plan run by llama.cpp itself, measured like the torch runtime.

The GGUF file's header (planner/gguf_file.py, read by `read_gguf`: a regular file only) must describe the --model it
is run as: its architecture, layers, width and tensor bytes. The plan (planner/engines/llamacpp.py, llama.cpp's own
memory rules) is made for the file's type; the llama-server command `vramplan plan --emit llama.cpp` writes is started
on the file (llama-server from --llama-server, $VRAMPLAN_LLAMA_SERVER or PATH), one request streams the tokens, and
the report has the same predicted and measured numbers as a torch run: decode tok/s and TTFT from llama-server's own
timings and the token stream, peak RAM from the server's VmHWM, load time until /health answers. A stream that breaks
off or an interrupt still reports what was measured, the tokens counted as they came.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Callable

from vramplan.planner.errors import CheckpointError, VramplanError
from vramplan.planner.gguf import GGUF_FILE_TYPES
from vramplan.planner.gguf_file import GGUFHeader, check_gguf_matches
from vramplan.planner.gguf_model import open_gguf_header
from vramplan.planner.textfiles import NotRegularFileError, file_kind, require_regular_file

from .execute import DEFAULT_PROMPT_TOKENS, Metrics, RunReport

SERVER_ENV = "VRAMPLAN_LLAMA_SERVER"
START_TIMEOUT_S = 600.0
SHOWN_EVENT_CHARS = 80  # of a malformed llama-server event, in the error that reports it


class LlamaServerStreamError(VramplanError):
    """llama-server's token stream sent something that is no event: the run reports what it measured until then."""


def _path_problem(path: str | os.PathLike, e: OSError) -> str:
    """Why a path named as a file cannot be read, in words: "PATH: no such file", "PATH is a FIFO, not a regular
    file", ..."""
    if isinstance(e, NotRegularFileError):
        return f"{path} {e.strerror}"
    if isinstance(e, FileNotFoundError):
        return f"{path}: no such file"
    return f"{path}: cannot read it ({e.strerror or e})"


def check_gguf_paths(paths, flag: str = "--gguf") -> None:
    """VramplanError naming `flag` unless every path is a regular file (a FIFO or a device would block the read or
    never end): nothing is opened."""
    for path in paths:
        try:
            require_regular_file(path)
        except OSError as e:
            raise CheckpointError(f"{flag} {_path_problem(path, e)}") from None


def read_gguf(path: str | os.PathLike) -> GGUFHeader:
    """The header of a local GGUF file, by planner/gguf_file.py's parser. A path that is no regular file is refused
    before it is opened and, opened without blocking (O_NONBLOCK: a FIFO swapped in opens without a writer), again by
    fstat; a file cut short or malformed is a one-line CheckpointError."""
    try:
        return open_gguf_header(path)
    except OSError as e:
        raise CheckpointError(_path_problem(path, e)) from None


def file_type_of(header: GGUFHeader) -> str:
    """The header's general.file_type (llama.h's llama_ftype) by the planner's names; VramplanError when it has none
    or one vramplan does not size."""
    if header.file_type_id is None:
        raise CheckpointError(f"{header.where}: its GGUF header has no general.file_type")
    if header.file_type is None:
        raise CheckpointError(f"{header.where}: GGUF file type {header.file_type_id} is not one vramplan sizes "
                              f"({', '.join(GGUF_FILE_TYPES)})")
    return header.file_type


def gguf_file_type(path: str | os.PathLike) -> str:
    """The GGUF file type of a local GGUF file, by the planner's names."""
    return file_type_of(read_gguf(path))


def read_checked(pairs: list[tuple[object, str | os.PathLike]]) -> list[GGUFHeader]:
    """Each (model spec, GGUF path)'s header, once it says the file is that model's and of a type vramplan sizes."""
    headers = [read_gguf(gguf) for _, gguf in pairs]
    for (spec, _), header in zip(pairs, headers):
        check_gguf_matches(header, spec)
        file_type_of(header)
    return headers


def plan_for_file(spec, hw, req, gguf: str | os.PathLike, max_new_tokens: int, *, prompt_given: bool,
                  header: GGUFHeader | None = None):
    """llama.cpp's plan (planner/engines/llamacpp.py) for the GGUF file's own type, once its header says it is
    `spec`'s model (`header`: already read); the torch runtime's synthetic prompt length (DEFAULT_PROMPT_TOKENS, fewer
    when the context is short) where neither a prompt nor a length is given."""
    from vramplan.planner.engines.llamacpp import plan_llamacpp

    header = header or read_gguf(gguf)
    check_gguf_matches(header, spec)
    file_type = file_type_of(header)
    if req.quant and req.quant != (file_type,) and tuple(q.upper() for q in req.quant) != (file_type,):
        raise VramplanError(f"--quant {','.join(req.quant)}: {gguf} is {file_type}")
    req = replace(req, quant=(file_type,), engine="llama.cpp")
    if not prompt_given and req.prompt_tokens is None:
        req = replace(req, prompt_tokens=min(DEFAULT_PROMPT_TOKENS, max(1, req.context - max_new_tokens)))
    return plan_llamacpp(spec, hw, req)


SERVER_HINT = (f"build llama.cpp (cmake --build build --target llama-server) and pass --llama-server PATH, set "
               f"${SERVER_ENV}, or put it on PATH")


def find_llama_server(explicit: str | None) -> Path:
    """llama-server: `explicit`, else $VRAMPLAN_LLAMA_SERVER, else PATH's; VramplanError saying what the path is when
    it is missing, no regular file or not executable."""
    where = explicit or os.environ.get(SERVER_ENV)
    candidate = where or shutil.which("llama-server")
    if not candidate:
        raise VramplanError(f"llama-server was not found: {SERVER_HINT}")
    try:
        mode = os.stat(candidate).st_mode
    except OSError:
        raise VramplanError(f"llama-server at {candidate} was not found: {SERVER_HINT}") from None
    if file_kind(mode) != "a regular file":
        raise VramplanError(f"llama-server at {candidate} is {file_kind(mode)}, not a llama-server executable: "
                            f"{SERVER_HINT}")
    if not os.access(candidate, os.X_OK):
        raise VramplanError(f"llama-server at {candidate} is not executable (no execute permission), so it is no "
                            f"llama-server build: {SERVER_HINT}")
    return Path(candidate)


def free_port() -> int:
    """A TCP port free on the loopback now, for a llama-server of our own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_memory(pid: int) -> dict[str, int]:
    """A process's resident memory in bytes from /proc/PID/status (VmRSS, VmHWM: its peak, RssAnon, RssFile); empty
    once it is gone."""
    out = {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def run_llamacpp(p, spec, hw, gguf: str | os.PathLike, server: Path, *, prompt_text: str | None,
                 prompt_tokens: int | None, max_new_tokens: int, temperature: float, seed: int,
                 threads: int | None = None,
                 on_text: Callable[[str], None] | None = None,
                 say: Callable[[str], None] = lambda _: None) -> RunReport:
    """Start llama-server with the plan's command on `gguf`, stream one completion, stop it; the report. A stream that
    breaks off (a malformed event, a dropped connection) or an interrupt still reports what was measured."""
    from vramplan.planner.engines.llamacpp import plan_llamacpp

    report, gguf = RunReport(plan=p, device="cuda" if p.choice.on_gpu else "cpu"), Path(gguf)
    n_prompt = prompt_tokens if prompt_text is None else None
    port = free_port()
    cmd = server_command(spec, p, gguf, server, port, threads)
    report.notes.append("llama-server: " + shlex.join(cmd))
    say(f"starting {server.name} on {gguf.name}")
    log: list[str] = []
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise VramplanError(f"llama-server at {server} could not be started ({e.strerror or e}): {SERVER_HINT}") \
            from None
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    timings = None
    try:
        wait_healthy(proc, port, log)
        report.measured.load_s = time.perf_counter() - t0
        timings = _stream_measured(port, _request_body(spec, prompt_text, n_prompt, max_new_tokens, temperature,
                                                       seed), report, on_text)
    except KeyboardInterrupt:
        report.interrupted = True
        report.notes.append("interrupted: the numbers are what was measured until then")
    finally:
        peak = proc_memory(proc.pid).get("VmHWM")
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    m = report.measured
    m.peak_ram_bytes = peak
    _fill_measured(report, timings, n_prompt)
    total = report.prompt_tokens + (m.generated_tokens or 0)
    c = p.choice
    at_run = plan_llamacpp(spec, hw, replace(p.request, prompt_tokens=max(1, report.prompt_tokens or 1),
                                             quant=(c.weight_quant,), kv_dtype=(c.kv_dtype,)))
    speed = at_run.chosen.speed if at_run.fits and at_run.chosen is not None else None
    gpu = p.memory.gpu
    # llama-server allocates the whole -c context's KV at load: the plan's memory is the run's, whatever it fills
    report.predicted = Metrics(decode_tokens_per_s=speed.decode_tokens_per_s if speed else None,
                               ttft_s=speed.ttft_s if speed else None,
                               peak_vram_bytes=(gpu.total_bytes - gpu.headroom_bytes) if gpu else None,
                               peak_ram_bytes=p.memory.cpu.total_bytes)
    report.notes.append(f"llama.cpp ran {total} tokens; decode and prompt rates are llama-server's own timings; "
                        "peak RAM is its VmHWM" + ("; its GPU memory is not measured" if c.on_gpu else ""))
    return report


def server_command(spec, p, gguf: Path, server: Path, port: int, threads: int | None) -> list[str]:
    """The plan's llama-server argv (planner/engines/llamacpp.py) on this file and server, on a loopback port."""
    from vramplan.planner.engines.llamacpp import llama_server_command

    cmd = [str(server), *llama_server_command(spec, p)[1:], "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads or os.cpu_count() or 1)]
    cmd[cmd.index("-m") + 1] = str(gguf)
    return cmd


def _request_body(spec, prompt_text: str | None, n_prompt: int | None, max_new_tokens: int, temperature: float,
                  seed: int) -> dict:
    """POST /completion's body: the prompt text, or (synthetic) random token ids generated to the end like the torch
    runtime's."""
    body: dict = {"n_predict": max_new_tokens, "stream": True, "cache_prompt": False, "seed": seed,
                  "temperature": temperature, "return_tokens": True}
    if n_prompt is not None:
        rng = random.Random(seed)
        body.update(prompt=[rng.randrange(300, spec.vocab_size) for _ in range(n_prompt)], ignore_eos=True)
    else:
        body["prompt"] = prompt_text
    return body


def _number(d: dict, key: str) -> float | None:
    """A numeric field of llama-server's timings; None when absent or not a number."""
    v = d.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _streamed_tokens(report: RunReport) -> int:
    """Tokens the stream delivered: their ids (return_tokens), else one per event that carried text."""
    return len(report.tokens) or len(report.measured.token_timestamps_s or [])


def _fill_measured(report: RunReport, timings: dict | None, n_prompt: int | None) -> None:
    """The measured numbers from llama-server's final timings, or, when the run was cut short before them, from the
    stream itself: the tokens counted, TTFT and the decode rate from their arrival times."""
    m = report.measured
    stamps = m.token_timestamps_s or []
    if timings:
        report.prompt_tokens = int(_number(timings, "prompt_n") or 0)
        m.prefill_tokens_per_s = _number(timings, "prompt_per_second")
        m.decode_tokens_per_s = _number(timings, "predicted_per_second")
        m.generated_tokens = int(_number(timings, "predicted_n") or 0)
        prompt_ms = _number(timings, "prompt_ms")
        m.ttft_s = stamps[0] if stamps else prompt_ms / 1e3 if prompt_ms is not None else None
        return
    report.prompt_tokens = n_prompt or 0
    m.generated_tokens = _streamed_tokens(report)
    m.ttft_s = stamps[0] if stamps else None
    if len(stamps) >= 2 and stamps[-1] > stamps[0]:
        m.decode_tokens_per_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    report.notes.append(f"llama-server sent no timings (the run was cut short): {m.generated_tokens} tokens counted "
                        "as they streamed" + ("; decode rate from their arrival times" if m.decode_tokens_per_s
                                              else ""))


def wait_healthy(proc: subprocess.Popen, port: int, log: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until llama-server answers /health; VramplanError (with its last log lines) if it exits or takes longer."""
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            tail = " | ".join(line.strip() for line in log[-3:] if line.strip())
            raise VramplanError(f"llama-server exited with code {proc.returncode} before serving: {tail}")
        if time.monotonic() - start > timeout_s:
            raise VramplanError(f"llama-server did not answer /health within {timeout_s:.0f} s")
        time.sleep(0.2)


def _stream_measured(port: int, body: dict, report: RunReport, on_text) -> dict | None:
    """_stream; a stream that breaks off is one of the report's errors (what it measured until then is kept)."""
    try:
        return _stream(port, body, report, on_text)
    except (LlamaServerStreamError, OSError, http.client.HTTPException) as e:
        report.errors.append(f"llama-server's stream broke off after {_streamed_tokens(report)} tokens: "
                             f"{' '.join(str(e).split()) or type(e).__name__}")
        return None


def _event(line: str) -> dict:
    """One server-sent event's JSON object; LlamaServerStreamError for anything else."""
    try:
        event = json.loads(line[len("data: "):])
    except ValueError as e:
        raise LlamaServerStreamError(f"a malformed event {line[:SHOWN_EVENT_CHARS]!r} ({e})") from None
    if not isinstance(event, dict):
        raise LlamaServerStreamError(f"an event that is no JSON object: {line[:SHOWN_EVENT_CHARS]!r}")
    return event


def _stream(port: int, body: dict, report: RunReport, on_text) -> dict | None:
    """POST /completion with stream=true: each event's text and ids as they come, their arrival times, the timings."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    stamps = report.measured.token_timestamps_s = []
    t0 = time.perf_counter()
    timings = None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data: "):
                continue
            event = _event(line)
            content = event.get("content")
            tokens = event.get("tokens")
            if content or tokens:
                stamps.append(time.perf_counter() - t0)
                if isinstance(tokens, list):
                    report.tokens.extend(t for t in tokens if isinstance(t, int))
                if isinstance(content, str):
                    report.text += content
                    if on_text is not None and content:
                        on_text(content)
            if event.get("stop"):
                timings = event.get("timings") if isinstance(event.get("timings"), dict) else None
                report.stopped_reason = str(event.get("stop_type") or "stop")
    return timings
