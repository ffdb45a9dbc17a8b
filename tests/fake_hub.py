"""A Hugging Face hub on loopback: the endpoints huggingface_hub 2.4 calls for model info and file resolves.

- GET  /api/models/{org}/{name}[/revision/{rev}]   -> model info JSON (commit sha, siblings, gated)
- HEAD /{org}/{name}/resolve/{rev}/{file}           -> X-Repo-Commit, ETag, Content-Length
- GET  /{org}/{name}/resolve/{rev}/{file}           -> the file, or with `Range: bytes=a-b` a 206 slice
Errors carry the hub's X-Error-Code headers (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), which
huggingface_hub's hf_raise_for_status turns into its exception types. Every request is logged (method, path,
Range, Authorization, bytes of body sent) so tests can assert what was asked and that no weights left.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    gated: bool = False
    tokens: tuple[str, ...] = ()  # tokens with access to a gated repo
    ignore_range: bool = False  # answer range requests with the whole file (200), as a plain file server would


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
            tokens: tuple[str, ...] = (), ignore_range: bool = False) -> Repo:
        sha = hashlib.sha1(repo_id.encode() + b"".join(files[f] for f in sorted(files))).hexdigest()
        repo = Repo(files=files, sha=sha, refs={"main": sha, **(refs or {})}, gated=gated, tokens=tokens,
                    ignore_range=ignore_range)
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
