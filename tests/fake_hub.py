"""A Hugging Face hub on loopback: the endpoints huggingface_hub 2.4 calls for model info and file resolves.

- GET  /api/models/{org}/{name}[/revision/{rev}]   -> model info JSON (commit sha, siblings, gated)
- HEAD /{org}/{name}/resolve/{rev}/{file}           -> X-Repo-Commit, ETag, Content-Length
- GET  /{org}/{name}/resolve/{rev}/{file}           -> the file, or with `Range: bytes=a-b` a 206 slice
Errors carry the hub's X-Error-Code headers (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), which
huggingface_hub's hf_raise_for_status turns into its exception types. Every request is logged (method, path,
Range, Authorization, bytes of body sent) so tests can assert what was asked and that no weights left.

Below the server: a tiny llama's files as a hub serves them, and the CLI run in a subprocess against the fake hub
(huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, when it is imported).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from vramplan.planner.architectures import spec_from_config


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    gated: bool = False
    tokens: tuple[str, ...] = ()  # tokens with access to a gated repo
    ignore_range: bool = False  # answer range requests with the whole file (200), as a plain file server would
    range_delay_s: float = 0.0  # wait this long before answering a range request (a hub too slow to answer)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    auth: str | None
    status: int = 0
    body_bytes: int = 0  # bytes of body the client took
    aborted: bool = False  # the client closed the connection before the whole body was sent


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[Request] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._handle(self, head=False)

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, files: dict[str, bytes], *, refs: dict[str, str] | None = None, gated: bool = False,
            tokens: tuple[str, ...] = (), ignore_range: bool = False, range_delay_s: float = 0.0) -> Repo:
        """Serve `files` as repo_id's main (replacing what it served before: a new commit)."""
        sha = hashlib.sha1(repo_id.encode() + b"".join(files[f] for f in sorted(files))).hexdigest()
        repo = Repo(files=files, sha=sha, refs={"main": sha, **(refs or {})}, gated=gated, tokens=tokens,
                    ignore_range=ignore_range, range_delay_s=range_delay_s)
        self.repos[repo_id] = repo
        return repo

    def requests(self, method: str | None = None, file: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method)
                    and (file is None or r.path.endswith("/" + file))]

    # ------------------------------------------------------------------ serving
    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        req = Request(method="HEAD" if head else "GET", path=path, range=h.headers.get("Range"),
                      auth=h.headers.get("Authorization"))
        with self._lock:
            self.log.append(req)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        if m:
            return self._info(h, req, m.group(1), m.group(2) or "main")
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(h, req, m.group(1), m.group(2), m.group(3), head)
        self._send(h, req, 404, b"", {"X-Error-Code": "RepoNotFound"})

    def _commit(self, repo: Repo, rev: str) -> str | None:
        return repo.sha if rev == repo.sha else repo.refs.get(rev)

    def _info(self, h, req: Request, repo_id: str, rev: str) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._send(h, req, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        commit = self._commit(repo, rev)
        if commit is None:
            return self._send(h, req, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
        body = json.dumps({"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                           "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                           "tags": [], "siblings": [{"rfilename": f} for f in sorted(repo.files)]}).encode()
        self._send(h, req, 200, body, {"Content-Type": "application/json"})

    def _resolve(self, h, req: Request, repo_id: str, rev: str, filename: str, head: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._send(h, req, 404, b"", {"X-Error-Code": "RepoNotFound"}, head)
        commit = self._commit(repo, rev)
        if commit is None:
            return self._send(h, req, 404, b"", {"X-Error-Code": "RevisionNotFound"}, head)
        if repo.gated and (req.auth or "").removeprefix("Bearer ") not in repo.tokens:
            status = 403 if req.auth else 401
            msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
            return self._send(h, req, status, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": msg}, head)
        data = repo.files.get(filename)
        if data is None:
            return self._send(h, req, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, head)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", req.range or "")
        if m and not head and repo.range_delay_s:
            time.sleep(repo.range_delay_s)
        if m and not head and not repo.ignore_range:
            start, end = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(h, req, 206, data[start:end + 1], headers)
        self._send(h, req, 200, data, headers, head)

    def _send(self, h, req: Request, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
        req.status = status
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        try:
            h.wfile.write(body)
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            req.aborted = True
        else:
            req.body_bytes = len(body)


def safetensors_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """A real safetensors file (zeros) written by hand, and its header length (the JSON after the 8 bytes)."""
    size = {"BF16": 2, "F32": 4, "F16": 2, "U8": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(offset), len(raw)


# ------------------------------------------------------------------ a tiny model, and the CLI against the fake hub
ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
# The caller's variables that would point huggingface_hub at another hub, cache or token, or change vramplan's limits.
HUB_ENV_VARS = ("HF_TOKEN", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE",
                "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "HF_HOME", "XDG_CACHE_HOME", "VRAMPLAN_HUB_DEADLINE_S")


def llama_files(shards: int = 1) -> tuple[dict[str, bytes], dict[str, int]]:
    """config.json and the safetensors files of TINY_LLAMA (norms in F32, the rest BF16), and header lengths."""
    tensors = spec_from_config(TINY_LLAMA, name="t").tensors
    dtype = {t.name: ("F32" if "norm" in t.name else "BF16", t.shape) for t in tensors}
    files = {"config.json": json.dumps(TINY_LLAMA).encode(), "README.md": b"# tiny\n"}
    header_lengths = {}
    if shards == 1:
        files["model.safetensors"], header_lengths["model.safetensors"] = safetensors_bytes(dtype)
        return files, header_lengths
    names = list(dtype)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, part in enumerate(parts, 1):
        f = f"model-{i:05d}-of-{shards:05d}.safetensors"
        files[f], header_lengths[f] = safetensors_bytes({n: dtype[n] for n in part})
        weight_map.update({n: f for n in part})
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files, header_lengths


def exact_bytes() -> int:
    """TINY_LLAMA's checkpoint size as llama_files writes it."""
    return sum(t.numel * (4 if "norm" in t.name else 2) for t in spec_from_config(TINY_LLAMA, name="t").tensors)


def hub_env(tmp_path, hub: FakeHub) -> dict[str, str]:
    """This environment pointed at `hub`, with the HF cache and vramplan's cache under tmp_path."""
    e = {k: v for k, v in os.environ.items() if k not in HUB_ENV_VARS}
    e.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), VRAMPLAN_CACHE_DIR=str(tmp_path / "vramplan"),
             HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    return e


def cli(env, *args, **extra) -> subprocess.CompletedProcess:
    """`vramplan ARGS` in a subprocess with `env` (and `extra` variables); .elapsed is its wall time."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                       env={**env, **extra}, cwd=ROOT, timeout=120)
    r.elapsed = time.perf_counter() - t0
    return r


def one_line_error(r, rc=2) -> str:
    """The exit code and exactly one line on stderr, no traceback; returns stderr."""
    assert r.returncode == rc, (r.returncode, r.stdout[-500:], r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


def inspect(env, model, *args, **extra) -> dict:
    """`vramplan inspect --json` of `model`, which must succeed."""
    r = cli(env, "inspect", "--model", model, "--json", *args, **extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
