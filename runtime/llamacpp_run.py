"""`vramplan run --engine llama.cpp`: a llama.cpp plan run by llama.cpp itself, measured like the torch runtime.

The plan (planner/engines/llamacpp.py, llama.cpp's own memory rules) is made for the GGUF file's type, read from its
header; the llama-server command `vramplan plan --emit llama.cpp` writes is started on the file (llama-server from
--llama-server, $VRAMPLAN_LLAMA_SERVER or PATH), one request streams the tokens, and the report has the same predicted
and measured numbers as a torch run: decode tok/s and TTFT from llama-server's own timings and the token stream, peak
RAM from the server's VmHWM, load time until /health answers.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Callable

from vramplan.planner.errors import VramplanError
from vramplan.planner.gguf import GGUF_FILE_TYPES

from .execute import DEFAULT_PROMPT_TOKENS, Metrics, RunReport

SERVER_ENV = "VRAMPLAN_LLAMA_SERVER"
START_TIMEOUT_S = 600.0
# gguf.h enum gguf_type (llama.cpp 0c1e57098): the byte size of each scalar type; 8 is a string, 9 an array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FTYPE_NAMES = {f.ftype_id: name for name, f in GGUF_FILE_TYPES.items()}


def gguf_file_type(path: str | os.PathLike) -> str:
    """The GGUF file type (`general.file_type`, llama.h's llama_ftype) of a GGUF file, by the planner's names."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise VramplanError(f"{path} is not a GGUF file (no GGUF magic)")
            version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                raise VramplanError(f"{path}: GGUF version {version} is older than llama.cpp reads")
            for _ in range(n_kv):
                key = _string(f)
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.file_type" and kind in (4, 5):
                    ftype = struct.unpack("<I" if kind == 4 else "<i", f.read(4))[0]
                    if ftype not in _FTYPE_NAMES:
                        raise VramplanError(f"{path}: GGUF file type {ftype} is not one vramplan sizes "
                                            f"({', '.join(GGUF_FILE_TYPES)})")
                    return _FTYPE_NAMES[ftype]
                _skip(f, kind)
    except (OSError, struct.error) as e:
        raise VramplanError(f"{path}: cannot read its GGUF header ({type(e).__name__}: {e})") from None
    raise VramplanError(f"{path}: its GGUF header has no general.file_type")


def _string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _skip(f, kind: int) -> None:
    if kind in _SCALAR_BYTES:
        f.seek(_SCALAR_BYTES[kind], 1)
    elif kind == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == 9:
        inner, count = struct.unpack("<IQ", f.read(12))
        if inner in _SCALAR_BYTES:
            f.seek(_SCALAR_BYTES[inner] * count, 1)
        else:
            for _ in range(count):
                _skip(f, inner)
    else:
        raise struct.error(f"unknown GGUF value type {kind}")


def plan_for_file(spec, hw, req, gguf: str | os.PathLike, max_new_tokens: int, *, prompt_given: bool):
    """llama.cpp's plan (planner/engines/llamacpp.py) for the GGUF file's own type; the torch runtime's synthetic prompt
    length (DEFAULT_PROMPT_TOKENS, fewer when the context is short) where neither a prompt nor a length is given."""
    from vramplan.planner.engines.llamacpp import plan_llamacpp

    file_type = gguf_file_type(gguf)
    if req.quant and req.quant != (file_type,) and tuple(q.upper() for q in req.quant) != (file_type,):
        raise VramplanError(f"--quant {','.join(req.quant)}: {gguf} is {file_type}")
    req = replace(req, quant=(file_type,), engine="llama.cpp")
    if not prompt_given and req.prompt_tokens is None:
        req = replace(req, prompt_tokens=min(DEFAULT_PROMPT_TOKENS, max(1, req.context - max_new_tokens)))
    return plan_llamacpp(spec, hw, req)


def find_llama_server(explicit: str | None) -> Path:
    candidate = explicit or os.environ.get(SERVER_ENV) or shutil.which("llama-server")
    if not candidate or not Path(candidate).is_file() or not os.access(candidate, os.X_OK):
        where = explicit or os.environ.get(SERVER_ENV)
        raise VramplanError(f"llama-server {'at ' + where + ' ' if where else ''}was not found: build llama.cpp "
                            f"(cmake --build build --target llama-server) and pass --llama-server PATH, set "
                            f"${SERVER_ENV}, or put it on PATH")
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
    """Start llama-server with the plan's command on `gguf`, stream one completion, stop it; the report."""
    from vramplan.planner.engines.llamacpp import llama_server_command, plan_llamacpp

    report, gguf = RunReport(plan=p, device="cuda" if p.choice.on_gpu else "cpu"), Path(gguf)
    n_prompt = prompt_tokens if prompt_text is None else None
    argv = llama_server_command(spec, p)
    port = free_port()
    cmd = [str(server), *argv[1:], "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads or os.cpu_count() or 1)]
    cmd[cmd.index("-m") + 1] = str(gguf)
    report.notes.append("llama-server: " + " ".join(cmd))
    say(f"starting {server.name} on {gguf.name}")
    log: list[str] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        wait_healthy(proc, port, log)
        report.measured.load_s = time.perf_counter() - t0
        body: dict = {"n_predict": max_new_tokens, "stream": True, "cache_prompt": False, "seed": seed,
                      "temperature": temperature, "return_tokens": True}
        if n_prompt is not None:  # synthetic: random token ids, generated to the end like the torch runtime's
            rng = random.Random(seed)
            body.update(prompt=[rng.randrange(300, spec.vocab_size) for _ in range(n_prompt)], ignore_eos=True)
        else:
            body["prompt"] = prompt_text
        timings = _stream(port, body, report, on_text)
    except KeyboardInterrupt:
        report.interrupted = True
        report.notes.append("interrupted: the numbers are what was measured until then")
        timings = None
    finally:
        peak = proc_memory(proc.pid).get("VmHWM")
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    m = report.measured
    m.peak_ram_bytes = peak
    if timings:
        report.prompt_tokens = int(timings.get("prompt_n") or 0)
        m.prefill_tokens_per_s = timings.get("prompt_per_second")
        m.decode_tokens_per_s = timings.get("predicted_per_second")
        m.generated_tokens = int(timings.get("predicted_n") or 0)
        m.ttft_s = m.token_timestamps_s[0] if m.token_timestamps_s else timings["prompt_ms"] / 1e3
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
            event = json.loads(line[6:])
            if event.get("content") or event.get("tokens"):
                stamps.append(time.perf_counter() - t0)
                report.tokens.extend(event.get("tokens") or [])
                report.text += event.get("content", "")
                if on_text is not None and event.get("content"):
                    on_text(event["content"])
            if event.get("stop"):
                timings = event.get("timings")
                report.stopped_reason = event.get("stop_type") or "stop"
    return timings
