"""Models from the Hugging Face hub without downloading weights: config.json, the safetensors index, and
every safetensors file's header by HTTP range reads.

`resolve(name, revision=None)` is --model as plan, inspect and run take it: planner.sources.resolve_model
(a local directory, the local HF cache, the catalog), then the hub for an `org/name` none of those knows,
or for any hub id when --revision is given. What goes over the wire, all through huggingface_hub (its
endpoint HF_ENDPOINT, token HF_TOKEN or `hf auth login`, offline mode HF_HUB_OFFLINE, cache HF_HOME):
  GET  {endpoint}/api/models/{repo}[/revision/{rev}]           model_info: commit, file list (HfApi.model_info)
  HEAD + GET .../resolve/{commit}/model.safetensors.index.json   sharded repos, into the HF cache's snapshot
  GET  {endpoint}/{repo}/resolve/{commit}/{file}   Range: bytes=0-7          a header's length n
  GET  {endpoint}/{repo}/resolve/{commit}/{file}   Range: bytes=8-(8+n-1)    the header, nothing more
  HEAD {endpoint}/{repo}/resolve/{rev}/config.json              hf_hub_download: commit, ETag, size
  GET  {endpoint}/{repo}/resolve/{rev}/config.json              into the same snapshot; refs/{rev} -> commit
config.json comes last: a snapshot with config.json is what later calls plan from, so a header read that fails
(corrupt, too slow) leaves none, and the next call asks the hub again rather than planning from the config alone.
A snapshot that holds config.json but no weights and no cached headers (another tool fetched the config, or the
header cache could not be written) is planned from its config with a note that says so, on every call.
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
import os
import re
import threading
from dataclasses import replace
from pathlib import Path

from vramplan.planner.errors import (AmbiguousModelError, CheckpointError, ConfigError, HubAccessError, HubError,
                            HubUnreachableError, ModelNotFoundError, VramplanError)
from vramplan.planner.modelspec import canonical_dtype
from vramplan.planner.sources import (HeaderTensor, ModelSource, hf_cache_dir, index_shards, local_path,
                                      parse_safetensors_header, read_config, resolve_model, safetensors_header_length,
                                      variant_source, weight_files)

# Seconds to wait for the hub to connect or to send the next bytes.
HUB_TIMEOUT_S = 5.0
# Seconds one request to the hub may take in all, however its bytes trickle in: the README promises an answer
# ("unreachable") within 5 s. VRAMPLAN_HUB_DEADLINE_S overrides it (a slow link; the tests).
HUB_DEADLINE_S = 5.0
HUB_DEADLINE_ENV = "VRAMPLAN_HUB_DEADLINE_S"
# The longest deadline it takes: a day is slower than any link, and far below what a thread's wait can count
# (threading.TIMEOUT_MAX; 1e20 s overflows it).
MAX_HUB_DEADLINE_S = 24 * 3600.0
# Parallel header reads of a sharded checkpoint.
MAX_PARALLEL_HEADER_READS = 8
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HEADER_CACHE_FORMAT = 1
# huggingface_hub 2.4's rules for a repo id (utils/_validators.py validate_repo_id), for the org/name ids vramplan
# asks the hub about, checked here without importing it for every --model: each part 1 to 96 ASCII letters, digits,
# '-', '_' or '.', starting and ending with a letter, a digit or '_' (its \b); no '--' or '..'; no '.git' at the end.
HUB_ID_PART_CHARS = 96
HUB_ID_PART = re.compile(rf"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{{0,{HUB_ID_PART_CHARS - 2}}}[A-Za-z0-9_])?")
HUB_ID_CHARS = re.compile(r"[A-Za-z0-9_.-]*")


def hub_id_problem(name: str) -> str | None:
    """Why `name` is not a hub id (org/name) huggingface_hub would ask about, in words; None when it is one."""
    parts = name.split("/")
    if len(parts) != 2:
        return "a hub id is org/name"
    if "--" in name or ".." in name:
        return "'--' and '..' are not allowed"
    if name.endswith(".git"):
        return "it cannot end in '.git'"
    for part in parts:
        if not part:
            return "org and name cannot be empty"
        if len(part) > HUB_ID_PART_CHARS:
            return f"org and name are at most {HUB_ID_PART_CHARS} characters each"
        if not HUB_ID_CHARS.fullmatch(part):
            return "only ASCII letters, digits, '-', '_' and '.' are allowed"
        if not HUB_ID_PART.fullmatch(part):
            return "org and name cannot start or end with '-' or '.'"
    return None


def resolve(name: str, *, revision: str | None = None) -> ModelSource:
    """--model: a local directory, the local HF cache, the catalog, then the hub (config and headers only)."""
    if revision is None:
        try:
            return with_cached_headers(resolve_model(name))
        except AmbiguousModelError:
            raise
        except ModelNotFoundError as e:
            problem = hub_id_problem(name)
            if problem is None:
                return _hub_or_variant(name, str(e))
            if name.count("/") != 1 or name.startswith((".", "/", "~")) or local_path(name)[1] is not None:
                raise  # a path, or more than a hub id: not found as it is
            raise ModelNotFoundError(f"{e}; not a valid hub id either ({problem})") from None
    if not revision.strip():
        raise ModelNotFoundError("--revision is empty")
    problem = hub_id_problem(name)
    if local_path(name)[1] is not None or problem is not None:
        why = f" ({problem})" if problem else ""
        raise ModelNotFoundError(f"--revision applies to a hub id (org/name), not to {name!r}{why}")
    return from_hub(name, revision)


def _hub_or_variant(name: str, catalog_miss: str) -> ModelSource:
    """A hub id the local places lack: the hub's own config wins; where the hub does not answer (offline, unreachable,
    gated) a variant of a catalog model (an instruct release of the same shapes) is planned with the catalog's config,
    and says so."""
    try:
        return from_hub(name, None, catalog_miss=catalog_miss)
    except HubError as e:
        variant = variant_source(name)
        if variant is None:
            raise
        why = ("the hub could not be reached" if isinstance(e, HubUnreachableError) else
               "the hub repo is gated for this token" if isinstance(e, HubAccessError) else "the hub answered an error")
        return replace(variant, note=f"{variant.note}; its own config on the hub was not read: {why}")


# ------------------------------------------------------------------ vramplan's cache of headers
def header_cache_path(snapshot: Path) -> Path:
    """Where the headers of an HF-cache snapshot (…/models--{org}--{name}/snapshots/{commit}) are cached."""
    from vramplan.runtime.files import cache_dir

    return cache_dir() / "hub" / snapshot.parent.parent.name / f"{snapshot.name}.json"


def with_cached_headers(source: ModelSource) -> ModelSource:
    """An HF-cache snapshot without weight files, with the headers vramplan cached for its commit; without them, the
    source says it is config.json only (a note the CLI prints on every call, and in its origin)."""
    if source.kind != "hf-cache" or source.path is None or source.has_weights:
        return source
    from vramplan.runtime.files import CacheDirError

    try:
        path = header_cache_path(source.path)
    except CacheDirError as e:  # no cache directory to be had: as without cached headers
        return config_only(source, f"no safetensors files in {source.path}, and vramplan has no cache ({e})")
    if not path.is_file():
        return config_only(source, f"no safetensors files in {source.path}, none cached by vramplan in {path}; "
                                   "`--revision main` asks the hub for them")
    return replace(source, headers=load_headers(path), origin=f"{source.origin}; safetensors headers cached in {path}")


def config_only(source: ModelSource, why: str) -> ModelSource:
    """`source` planned from its config.json alone: a note that says so and why, and its origin marked."""
    line = f"planned from config.json only: the safetensors headers of {source.id} were not read ({why})"
    return replace(source, note="; ".join(n for n in (source.note, line) if n),
                   origin=f"{source.origin}; config.json only, no safetensors headers")


def load_headers(path: Path) -> tuple[HeaderTensor, ...]:
    try:
        data = json.loads(path.read_text())
        if data["format"] != HEADER_CACHE_FORMAT:
            raise ValueError(f"format {data['format']!r}")
        return tuple(HeaderTensor(str(n), canonical_dtype(d), tuple(int(x) for x in shape), int(nbytes))
                     for tensors in data["files"].values() for n, d, shape, nbytes in tensors)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, ConfigError) as e:
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
    problem = hub_id_problem(repo)
    if problem is not None:
        raise ModelNotFoundError(f"no model {repo!r}: not a valid hub id ({problem})")
    try:
        if constants.HF_HUB_OFFLINE:
            return _from_cache_offline(repo, revision, endpoint)
        return _fetch(repo, revision, endpoint)
    except VramplanError:
        raise
    except Exception as e:
        raise hub_error(e, repo, revision, endpoint, catalog_miss) from None


def hub_deadline_s() -> float:
    """HUB_DEADLINE_S, or $VRAMPLAN_HUB_DEADLINE_S (seconds > 0, at most MAX_HUB_DEADLINE_S)."""
    from vramplan.runtime.this_machine import env_number

    deadline_s = env_number(HUB_DEADLINE_ENV, HUB_DEADLINE_S, unit="seconds", allow_zero=False)
    if deadline_s > MAX_HUB_DEADLINE_S:
        raise VramplanError(f"${HUB_DEADLINE_ENV}={os.environ[HUB_DEADLINE_ENV].strip()!r}: expected a number of "
                            f"seconds > 0 and at most {MAX_HUB_DEADLINE_S:g} (a day)")
    return deadline_s


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


def _fetch(repo: str, revision: str | None, endpoint: str, *, branch_moved: bool = False) -> ModelSource:
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
    if not info.sha:
        raise HubError(f"the hub at {endpoint} did not say which commit {repo} is at")
    commit, cache = info.sha, hf_cache_dir()
    snapshot = hub_snapshot(cache, repo, commit)
    if weights == [INDEX_FILE]:
        index = Path(within_deadline(lambda: hf_hub_download(repo, INDEX_FILE, revision=commit, cache_dir=cache,
                                                             etag_timeout=HUB_TIMEOUT_S),
                                     f"{repo}/{INDEX_FILE}", endpoint))
        weights = index_shards(index.read_text(), f"{repo}/{INDEX_FILE}")
    headers, unsaved = None, None
    if weights and not weight_files(snapshot):  # none on the hub, or downloaded earlier: then read them here
        headers = fetch_headers(repo, commit, weights, endpoint)
        from vramplan.runtime.files import CacheDirError

        try:
            unsaved = save_headers(header_cache_path(snapshot), repo, commit, headers)
        except CacheDirError as e:
            unsaved = str(e)
    # config.json last: the snapshot holding it is what later calls plan from, so a header read that failed above
    # leaves none behind, and the next call asks the hub again instead of planning from the config alone
    config_path = Path(within_deadline(lambda: hf_hub_download(repo, "config.json", revision=revision, cache_dir=cache,
                                                               etag_timeout=HUB_TIMEOUT_S),
                                       f"{repo}/config.json", endpoint))
    if config_path.parent.name != commit:  # the branch moved since the model info: read the commit it names now
        if branch_moved:
            raise HubError(f"the hub at {endpoint} named commit {commit[:12]} of {repo}, then served config.json of "
                           f"{config_path.parent.name[:12]}; try again")
        return _fetch(repo, config_path.parent.name, endpoint, branch_moved=True)
    source = ModelSource(kind="hub", id=repo, config=read_config(config_path), path=snapshot,
                         origin=f"Hugging Face hub {endpoint}/{repo} at {commit[:12]}")
    if headers is None:
        return source if weights else config_only(source, f"{repo} has no safetensors files on the hub")
    origin = source.origin + (f" (headers not cached: {unsaved})" if unsaved else "")
    return replace(source, headers=tuple(t for ts in headers.values() for t in ts), origin=origin)


def hub_snapshot(cache: Path, repo: str, commit: str) -> Path:
    """Where huggingface_hub keeps the files of `repo` at `commit` in the HF cache (its file_download layout)."""
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / commit


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
        hint = "plan the safetensors repo it was converted from"
        if gguf:
            hint = f"name one of its GGUF files by its type, as llama.cpp's -hf does (--model {repo}:Q4_K_M), or {hint}"
        raise CheckpointError(
            f"{repo} has only {kinds} weight files ({named}), no safetensors: vramplan counts a model from "
            f"config.json and safetensors headers and never downloads weights; {hint}")


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
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    token = "the token vramplan read (HF_TOKEN or `hf auth login`) has no access" if get_token() else \
        "no token was found (vramplan reads HF_TOKEN, or the token `hf auth login` saved)"
    if isinstance(e, HFValidationError):  # what hub_id_problem missed, or a revision it refuses
        return ModelNotFoundError(f"no model {repo!r}: not a valid hub id or revision ({_first_line(e)})")
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
