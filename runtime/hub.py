"""Models from the Hugging Face hub without downloading weights: config.json, the safetensors index, and
every safetensors file's header by HTTP range reads.

`resolve(name, revision=None)` is --model as plan, inspect and run take it: planner.sources.resolve_model
(a local directory, the local HF cache, the catalog), then the hub for an `org/name` none of those knows,
or for any hub id when --revision is given. What goes over the wire, all through huggingface_hub (its
endpoint HF_ENDPOINT, token HF_TOKEN or `hf auth login`, offline mode HF_HUB_OFFLINE, cache HF_HOME):
  GET  {endpoint}/api/models/{repo}[/revision/{rev}]           model_info: commit, file list (HfApi.model_info)
  HEAD {endpoint}/{repo}/resolve/{rev}/config.json              hf_hub_download: commit, ETag, size
  GET  {endpoint}/{repo}/resolve/{rev}/config.json              into the HF cache; refs/{rev} -> commit
  HEAD + GET .../resolve/{commit}/model.safetensors.index.json   sharded repos, into the same snapshot
  GET  {endpoint}/{repo}/resolve/{commit}/{file}   Range: bytes=0-7          a header's length n
  GET  {endpoint}/{repo}/resolve/{commit}/{file}   Range: bytes=8-(8+n-1)    the header, nothing more
The two range reads per file use huggingface_hub's session and headers and are streamed, so a server that
ignored Range would still not send a weight file. (huggingface_hub.get_safetensors_metadata asks for the
first 100,000 bytes of every file instead: tensor data, for any header shorter than that.)

The headers are cached as JSON in vramplan's cache directory, keyed by the commit (immutable, so never
stale): $VRAMPLAN_CACHE_DIR (else ~/.cache/vramplan)/hub/models--{org}--{name}/{commit}.json. The next
`resolve` finds the model in the HF cache (refs/main -> the snapshot holding config.json) and attaches
them, so a re-plan offline is exact too. Not inside the HF cache: huggingface_hub owns that layout (its
scans and deletes expect only its own files there).

Errors are one-line VramplanErrors: not found, gated (how to get access; HF_TOKEN is read), no network
or a hub too slow to answer (each request within HUB_DEADLINE_S in all; offline mode reads the cache), offline
with nothing cached, GGUF-only or pickle-only repos, malformed headers. No torch; huggingface_hub is imported
only when the hub is asked.

A socket timeout bounds each wait for the next bytes, not the whole answer: a server that trickles a byte
every few seconds (or huggingface_hub's own retries) would keep a request alive for ever. So each request
(model info, a file download, a header's range reads) runs on a daemon thread that is waited for at most
HUB_DEADLINE_S ($VRAMPLAN_HUB_DEADLINE_S overrides); past it the call fails with HubUnreachableError and the
thread is abandoned (it ends with its socket; a daemon thread never holds the process open).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace
from pathlib import Path

from vramplan.planner.errors import (AmbiguousModelError, CheckpointError, ConfigError, HubAccessError, HubError,
                            HubUnreachableError, ModelNotFoundError, VramplanError)
from vramplan.planner.modelspec import canonical_dtype
from vramplan.planner.sources import (HeaderTensor, ModelSource, hf_cache_dir, index_shards, parse_safetensors_header,
                             read_config, resolve_model, safetensors_header_length, weight_files)

# Seconds to wait for the hub to connect or to send the next bytes.
HUB_TIMEOUT_S = 5.0
# Seconds one request to the hub may take in all, however its bytes trickle in: the README promises an answer
# ("unreachable") within 5 s. VRAMPLAN_HUB_DEADLINE_S overrides it (a slow link; the tests).
HUB_DEADLINE_S = 5.0
HUB_DEADLINE_ENV = "VRAMPLAN_HUB_DEADLINE_S"
# Parallel header reads of a sharded checkpoint.
MAX_PARALLEL_HEADER_READS = 8
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HEADER_CACHE_FORMAT = 1
# huggingface_hub's rule for repo ids (validate_repo_id), without importing it for every --model.
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def resolve(name: str, *, revision: str | None = None) -> ModelSource:
    """--model: a local directory, the local HF cache, the catalog, then the hub (config and headers only)."""
    if revision is None:
        try:
            return with_cached_headers(resolve_model(name))
        except AmbiguousModelError:
            raise
        except ModelNotFoundError as e:
            if not REPO_ID.match(name):
                raise
            return from_hub(name, None, catalog_miss=str(e))
    if not revision.strip():
        raise ModelNotFoundError("--revision is empty")
    if Path(name).expanduser().exists() or not REPO_ID.match(name):
        raise ModelNotFoundError(f"--revision applies to a hub id (org/name), not to {name!r}")
    return from_hub(name, revision)


# ------------------------------------------------------------------ vramplan's cache of headers
def header_cache_path(snapshot: Path) -> Path:
    """Where the headers of an HF-cache snapshot (…/models--{org}--{name}/snapshots/{commit}) are cached."""
    from vramplan.runtime.files import cache_dir

    return cache_dir() / "hub" / snapshot.parent.parent.name / f"{snapshot.name}.json"


def with_cached_headers(source: ModelSource) -> ModelSource:
    """An HF-cache snapshot without weight files, with the headers vramplan cached for its commit (if any)."""
    if source.kind != "hf-cache" or source.path is None or source.has_weights:
        return source
    path = header_cache_path(source.path)
    if not path.is_file():
        return source
    return replace(source, headers=load_headers(path), origin=f"{source.origin}; safetensors headers cached in {path}")


def load_headers(path: Path) -> tuple[HeaderTensor, ...]:
    try:
        data = json.loads(path.read_text())
        if data["format"] != HEADER_CACHE_FORMAT:
            raise ValueError(f"format {data['format']!r}")
        return tuple(HeaderTensor(str(n), canonical_dtype(d), tuple(int(x) for x in shape), int(nbytes))
                     for tensors in data["files"].values() for n, d, shape, nbytes in tensors)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ConfigError) as e:
        raise CheckpointError(f"{path}: vramplan's cached safetensors headers are unreadable ({type(e).__name__}: "
                              f"{e}); delete the file to fetch them again") from None


def save_headers(path: Path, repo: str, commit: str, files: dict[str, list[HeaderTensor]]) -> str | None:
    """Write the headers for the next (maybe offline) call; the reason when that failed, else None."""
    from vramplan.runtime.files import WriteError, save_json

    data = {"format": HEADER_CACHE_FORMAT, "repo": repo, "commit": commit,
            "files": {f: [[t.name, t.dtype, list(t.shape), t.nbytes] for t in ts] for f, ts in files.items()}}
    try:
        save_json(path, data)
    except WriteError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ the hub
def from_hub(repo: str, revision: str | None, catalog_miss: str = "") -> ModelSource:
    """config.json (and the index) into the HF cache, every safetensors header by range reads."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        return _from_cache_offline(repo, revision, endpoint)
    try:
        return _fetch(repo, revision, endpoint)
    except VramplanError:
        raise
    except Exception as e:
        raise hub_error(e, repo, revision, endpoint, catalog_miss) from None


def hub_deadline_s() -> float:
    """HUB_DEADLINE_S, or $VRAMPLAN_HUB_DEADLINE_S (seconds > 0)."""
    from vramplan.runtime.this_machine import env_number

    return env_number(HUB_DEADLINE_ENV, HUB_DEADLINE_S, unit="seconds", allow_zero=False)


def within_deadline(call, what: str, endpoint: str):
    """call() on a daemon thread, waited for at most hub_deadline_s(); its result or its exception, or
    HubUnreachableError naming `what` when the deadline passes first."""
    deadline_s = hub_deadline_s()
    done = threading.Event()
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # handed to the caller, who raises it
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"vramplan hub: {what}", daemon=True).start()
    if not done.wait(deadline_s):
        raise HubUnreachableError(
            f"cannot reach the Hugging Face hub at {endpoint} for {what} (Timeout: no complete answer within "
            f"{deadline_s:g} s; ${HUB_DEADLINE_ENV} changes the limit); check the network or HF_ENDPOINT; offline "
            "mode (HF_HUB_OFFLINE=1) plans from the local cache only")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _fetch(repo: str, revision: str | None, endpoint: str) -> ModelSource:
    from huggingface_hub import HfApi, hf_hub_download

    info = within_deadline(lambda: HfApi().model_info(repo, revision=revision, timeout=HUB_TIMEOUT_S),
                           f"the model info of {repo}", endpoint)
    files = [s.rfilename for s in info.siblings or ()]
    weights = _safetensors_files(files)
    if not weights:
        _refuse_other_weights(repo, files)
    if "config.json" not in files:
        raise CheckpointError(f"{repo} on {endpoint} has no config.json: vramplan counts a model from its config and "
                              "safetensors headers")
    cache = hf_cache_dir()
    config_path = Path(within_deadline(lambda: hf_hub_download(repo, "config.json", revision=revision, cache_dir=cache,
                                                               etag_timeout=HUB_TIMEOUT_S),
                                       f"{repo}/config.json", endpoint))
    snapshot, commit = config_path.parent, config_path.parent.name
    source = ModelSource(kind="hub", id=repo, config=read_config(config_path), path=snapshot,
                         origin=f"Hugging Face hub {endpoint}/{repo} at {commit[:12]}")
    if weights == [INDEX_FILE]:
        index = Path(within_deadline(lambda: hf_hub_download(repo, INDEX_FILE, revision=commit, cache_dir=cache,
                                                             etag_timeout=HUB_TIMEOUT_S),
                                     f"{repo}/{INDEX_FILE}", endpoint))
        weights = index_shards(index.read_text(), f"{repo}/{INDEX_FILE}")
    if not weights or weight_files(snapshot):  # no weights on the hub, or downloaded earlier: read them here
        return source
    headers = fetch_headers(repo, commit, weights, endpoint)
    unsaved = save_headers(header_cache_path(snapshot), repo, commit, headers)
    origin = source.origin + (f" (headers not cached: {unsaved})" if unsaved else "")
    return replace(source, headers=tuple(t for ts in headers.values() for t in ts), origin=origin)


def _safetensors_files(files: list[str]) -> list[str]:
    """The index when there is one, else model.safetensors, else the top-level *.safetensors (consolidated.* are
    mistral-format duplicates of the transformers files)."""
    if INDEX_FILE in files:
        return [INDEX_FILE]
    if SINGLE_FILE in files:
        return [SINGLE_FILE]
    return sorted(f for f in files if f.endswith(".safetensors") and "/" not in f and not f.startswith("consolidated"))


def _refuse_other_weights(repo: str, files: list[str]) -> None:
    gguf = [f for f in files if f.endswith(".gguf")]
    pickle = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    if gguf or pickle:
        kinds = " and ".join(k for k, fs in (("GGUF", gguf), ("pickle (.bin/.pt)", pickle)) if fs)
        named = ", ".join((gguf + pickle)[:3]) + (", ..." if len(gguf + pickle) > 3 else "")
        raise CheckpointError(
            f"{repo} has only {kinds} weight files ({named}), no safetensors: vramplan counts a model from "
            "config.json and safetensors headers and never downloads weights; plan the safetensors repo it was "
            "converted from")


def fetch_headers(repo: str, commit: str, files: list[str], endpoint: str) -> dict[str, list[HeaderTensor]]:
    """Every file's safetensors header, read in parallel by two range reads each."""
    workers = max(1, min(MAX_PARALLEL_HEADER_READS, len(files)))
    from concurrent.futures import ThreadPoolExecutor  # here, not at the top: 4 ms of every command's start-up

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda f: within_deadline(lambda: remote_header(repo, commit, f, endpoint),
                                                     f"the safetensors header of {repo}/{f}", endpoint), files)
        return dict(zip(files, results))


def remote_header(repo: str, commit: str, filename: str, endpoint: str) -> list[HeaderTensor]:
    """One file's header: its 8-byte length, then exactly that many bytes."""
    where = f"{endpoint}/{repo}/{filename}"
    first8, size = _read_range(repo, commit, filename, endpoint, 0, 8, where)
    if len(first8) < 8:
        raise CheckpointError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    n = safetensors_header_length(first8, size, where)
    raw = _read_range(repo, commit, filename, endpoint, 8, n, where)[0] if n else b""
    return parse_safetensors_header(raw, size - 8 - n, where)


def _read_range(repo: str, commit: str, filename: str, endpoint: str, start: int, length: int,
                where: str) -> tuple[bytes, int]:
    """`length` bytes from `start` and the file's size. Streamed and closed after those bytes: a server that sends
    the whole file (200 instead of 206) is cut off there."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo, filename, revision=commit, endpoint=endpoint)
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{start + length - 1}"}
    with get_session().stream("GET", url, headers=headers, timeout=HUB_TIMEOUT_S) as r:
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        skip = 0 if r.status_code == 206 else start  # 200: the body starts at byte 0
        buf = bytearray()
        for chunk in r.iter_bytes():
            buf += chunk
            if len(buf) >= skip + length:
                break
        size = _file_size(r.headers, where)
    return bytes(buf[skip:skip + length]), size


def _file_size(headers, where: str) -> int:
    content_range = headers.get("Content-Range", "")
    m = re.fullmatch(r"bytes \d+-\d+/(\d+)", content_range.strip())
    if m:
        return int(m.group(1))
    if not content_range and headers.get("Content-Length", "").isdigit():
        return int(headers["Content-Length"])
    raise CheckpointError(f"{where}: the hub did not say the file's size (Content-Range {content_range!r})")


def _from_cache_offline(repo: str, revision: str | None, endpoint: str) -> ModelSource:
    """Offline mode: what an earlier call cached (config, index, headers), else a one-line error."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if revision is not None:
        try:
            config_path = Path(hf_hub_download(repo, "config.json", revision=revision, cache_dir=hf_cache_dir()))
        except LocalEntryNotFoundError:
            pass
        else:
            snap = config_path.parent
            return with_cached_headers(ModelSource(kind="hf-cache", id=repo, config=read_config(config_path),
                                                   path=snap, origin=f"Hugging Face cache {snap}"))
    at = f" at revision {revision!r}" if revision else ""
    raise HubUnreachableError(
        f"offline mode (HF_HUB_OFFLINE=1) reads only the local cache, and {repo}{at} is not in it ({hf_cache_dir()}): "
        f"not a local directory or a catalog name either; run once online to cache its config and safetensors headers")


def hub_error(e: Exception, repo: str, revision: str | None, endpoint: str, catalog_miss: str = "") -> VramplanError:
    """huggingface_hub's and the HTTP client's exceptions as one-line VramplanErrors."""
    import httpx2
    from huggingface_hub import get_token
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    token = "the token vramplan read (HF_TOKEN or `hf auth login`) has no access" if get_token() else \
        "no token was found (vramplan reads HF_TOKEN, or the token `hf auth login` saved)"
    if isinstance(e, GatedRepoError):
        return HubAccessError(f"{repo} is gated: request access on {endpoint}/{repo} with your account, then give a "
                              f"token of that account; {token}")
    if isinstance(e, RepositoryNotFoundError):
        before = "not a local directory, not in the local Hugging Face cache, not in the catalog, and " if \
            catalog_miss else ""
        return ModelNotFoundError(f"no model {repo!r}: {before}no such repo on the hub at {endpoint} (a private "
                                  f"repo needs a token with access: {token})")
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFoundError(f"{repo} has no revision {revision!r} on the hub at {endpoint}")
    if isinstance(e, RemoteEntryNotFoundError):
        return CheckpointError(f"{repo}: a file the hub lists is not there ({_first_line(e)})")
    if isinstance(e, (OfflineModeIsEnabled, LocalEntryNotFoundError, httpx2.TransportError)):
        return HubUnreachableError(
            f"cannot reach the Hugging Face hub at {endpoint} for {repo} ({type(e).__name__}: {_first_line(e)}); "
            "check the network or HF_ENDPOINT; offline mode (HF_HUB_OFFLINE=1) plans from the local cache only")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return HubError(f"the hub at {endpoint} answered HTTP {status} for {repo}: {_first_line(e)}")
    raise e


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[:2])[:300] if lines else type(e).__name__
