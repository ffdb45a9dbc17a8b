"""Where a model comes from: a local directory, the local Hugging Face cache, or the catalog.

`resolve_model("meta-llama/Llama-3.1-8B")` -> ModelSource (what was found) and
`load_spec(source)` -> ModelSpec. Local safetensors checkpoints are read header-only
(exact dtypes and sizes, never the tensors); headers read elsewhere (the runtime fetches
them from the hub by range reads) come in as `ModelSource.headers` and are applied by the
same code. A model_type without a hand-written builder is counted from its headers
(planner/generic.py) or by the `generic` builder the caller passes (the runtime's
transformers-on-the-meta-device path). File reads only; no torch, no network.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import stat
import struct
from dataclasses import field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable

from .published import owner_of, published, stored_bytes
from .record import record
from .architectures import BUILDERS, spec_from_config
from .architectures.config import check_rope, weight_block_size
from .errors import AmbiguousModelError, CheckpointError, ConfigError, ModelNotFoundError, UnsupportedArchitectureError
from .generic import refuse_unmodelled_state, spec_from_headers
from .modelspec import ModelSpec, canonical_dtype, dtype_bytes

# A safetensors header larger than this is corrupt, not big (real ones are a few MB).
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024


@record(kw_only=True)
class ModelSource:
    """Where a model came from (directory, HF cache, catalog or hub), with its config and tensor headers."""

    kind: str  # "directory", "hf-cache", "catalog" or "hub"
    id: str  # what to call the model: hub id or directory name
    config: dict = field(repr=False, compare=False)
    path: Path | None = None  # the directory holding config.json (and maybe weights)
    origin: str = ""  # human description: "catalog", "/path/to/dir", "HF cache snapshot abc123"
    # safetensors headers read elsewhere (the hub, or vramplan's cache of them); None: read path's files, if any
    headers: tuple[HeaderTensor, ...] | None = field(default=None, repr=False, compare=False)
    note: str = ""  # a line for the user about how the name was resolved ("resolved 'mixtral' to ..."), or ""

    @property
    def has_weights(self) -> bool:
        return self.path is not None and bool(weight_files(self.path))


# ------------------------------------------------------------------ catalog
@record
class Variant:
    """A release of a catalog model's architecture under another name (an instruct or chat model, a point release):
    the same config shapes, with `config` the keys its own config.json sets otherwise, and the source that says so."""

    id: str
    aliases: tuple[str, ...]
    source: str
    config: dict = field(default_factory=dict, compare=False)


@record
class CatalogEntry:
    """A model of the built-in catalog: its id, config file and aliases, and the variants planned with its config."""

    id: str
    file: str
    aliases: tuple[str, ...]
    provenance: str = ""
    variants: tuple[Variant, ...] = ()


@lru_cache(maxsize=1)
def catalog() -> tuple[CatalogEntry, ...]:
    index = json.loads(resources.files("vramplan.planner.catalog").joinpath("index.json").read_text())
    return tuple(
        CatalogEntry(e["id"], e["file"], tuple(e.get("aliases", ())), e.get("provenance", ""),
                     tuple(Variant(v["id"], tuple(v.get("aliases", ())), v["source"], dict(v.get("config") or {}))
                           for v in e.get("variants", ())))
        for e in index["models"]
    )


def match_variant(name: str) -> tuple[CatalogEntry, Variant] | None:
    """The catalog entry and variant `name` names exactly (its hub id, the id's name after the org, or an alias;
    case-insensitive), or None."""
    q = name.strip().lower()
    for e in catalog():
        for v in e.variants:
            if q and q in (v.id.lower(), v.id.lower().split("/", 1)[-1], *v.aliases):
                return e, v
    return None


def variant_source(name: str) -> ModelSource | None:
    """A variant of a catalog model as a source: its own id, its base's config with the keys it sets otherwise, and a
    note saying which config was used (None: `name` is no variant)."""
    found = match_variant(name)
    if found is None:
        return None
    e, v = found
    return ModelSource(kind="catalog", id=v.id, config={**catalog_config(e.id), **v.config},
                       origin=f"built-in catalog: {e.id}'s config" + (f" with {sorted(v.config)} as {v.id} sets them"
                                                                        if v.config else ""),
                       note=f"model {name.strip()!r}: planned offline with the built-in config of {e.id} "
                            f"({v.source})")


@lru_cache(maxsize=None)
def catalog_config(entry_id: str) -> dict:
    entry = next(e for e in catalog() if e.id == entry_id)
    return json.loads(resources.files("vramplan.planner.catalog").joinpath(entry.file).read_text())


def catalog_rows() -> list[dict]:
    """What `vramplan models` lists: each catalog model's id, aliases, variants and headline facts."""
    rows = []
    for e in catalog():
        s = spec_from_config(catalog_config(e.id), name=e.id, source="built-in catalog")
        rows.append({"id": e.id, "aliases": list(e.aliases), "model_type": s.model_type, "params_total": s.params_total,
                     "params_active": s.params_active, "num_layers": s.num_layers, "max_context": s.max_context,
                     "checkpoint_dtype": s.dtype, "variants": [v.id for v in e.variants]})
    return rows


# A catalog name is completed from part of it only at these separators: "mixtral" -> Mixtral-8x7B-v0.1, but
# "llama-3.1-4" is not Llama-3.1-405B (a size or version cut short names another model: 4B, 405B, 3.1 vs 3).
NAME_SEPARATORS = "-_/"
# An ambiguous name's message lists at most this many candidates (the whole catalog is `vramplan models`).
MAX_CANDIDATES_SHOWN = 10


def find_in_catalog(name: str) -> CatalogEntry:
    """The catalog entry `name` names; an ambiguous or unknown name raises (see `match_catalog`)."""
    return match_catalog(name)[0]


def match_catalog(name: str) -> tuple[CatalogEntry, str]:
    """The catalog entry `name` names, and a line to tell the user when it was completed from part of a name ("").

    1. Exact, case-insensitive: an id (the hub id), an alias, or an id's name after its org.
    2. Else a name without an org that appears in exactly one entry's id or alias, whole at separators
       (NAME_SEPARATORS): completed, and the line says so.
    3. Else a name that appears in several entries, cuts one short ("llama-3.1-4"), or is an org/name that is
       not a catalog id: AmbiguousModelError listing the candidates (the hub is not asked).
    4. Else ModelNotFoundError with the close names."""
    q = name.strip().lower()
    entries = catalog()
    for e in entries:
        if q and q in (e.id.lower(), e.id.lower().split("/", 1)[-1], *e.aliases):
            return e, ""
    names = {e: (e.id.lower(), *e.aliases) for e in entries}
    hits = [e for e in entries if q and any(q in n for n in names[e])]
    whole = [e for e in hits if any(_whole_at_separators(q, n) for n in names[e])]
    if len(hits) == 1 and len(whole) == 1 and "/" not in q:
        return whole[0], f"model {name.strip()!r}: resolved to {whole[0].id}, the only catalog model with that name"
    if hits:  # one hit cut short: the names it may have meant are close to it
        shown = [e.id for e in hits] if len(hits) > 1 else list(dict.fromkeys([hits[0].id, *_close_ids(q, entries)]))
        more = f" and {len(shown) - MAX_CANDIDATES_SHOWN} more" if len(shown) > MAX_CANDIDATES_SHOWN else ""
        why = ("names several catalog models" if len(hits) > 1 else
               "is not a catalog id (a hub id the catalog lacks: add --revision main to ask the hub)" if "/" in q else
               "cuts a catalog name short")
        raise AmbiguousModelError(f"model name {name!r} is ambiguous: it {why}; give one exactly: "
                                  f"{', '.join(shown[:MAX_CANDIDATES_SHOWN])}{more}")
    aliases = [a for e in entries for a in e.aliases]
    near = difflib.get_close_matches(q, [e.id.lower() for e in entries] + aliases, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(dict.fromkeys(near))}" if near else "; see `vramplan models` for the catalog"
    raise ModelNotFoundError(
        f"no model {name!r}: not a local directory with config.json, not in the local Hugging Face cache, "
        f"not in the catalog{hint}"
    )


def _whole_at_separators(q: str, name: str) -> bool:
    """Whether q appears in name starting and ending at a separator (or the name's ends)."""
    start = name.find(q)
    while start >= 0:
        end = start + len(q)
        if (start == 0 or name[start - 1] in NAME_SEPARATORS) and (end == len(name) or name[end] in NAME_SEPARATORS):
            return True
        start = name.find(q, start + 1)
    return False


def _close_ids(q: str, entries: tuple[CatalogEntry, ...]) -> list[str]:
    """Catalog ids whose id or alias is close to q (difflib), closest first."""
    by_name = {n: e.id for e in entries for n in (e.id.lower(), *e.aliases)}
    return list(dict.fromkeys(by_name[n] for n in difflib.get_close_matches(q, list(by_name), n=6, cutoff=0.6)))


# ------------------------------------------------------------------ Hugging Face cache
def hf_cache_dir() -> Path:
    """Where huggingface_hub caches hub files, by its own rules (huggingface_hub.constants.HF_HUB_CACHE):
    $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def find_in_hf_cache(repo_id: str) -> Path | None:
    """The snapshot directory of a hub id in the local cache (refs/main first, else the newest), or None."""
    if repo_id.count("/") != 1:
        return None
    root = hf_cache_dir()
    if not root.is_dir():
        return None
    want = "models--" + repo_id.replace("/", "--")
    repo = next((p for p in root.iterdir() if p.name.lower() == want.lower() and p.is_dir()), None)
    if repo is None:
        return None
    snaps = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = snaps / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    candidates = [p for p in snaps.glob("*") if (p / "config.json").is_file()] if snaps.is_dir() else []
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


# ------------------------------------------------------------------ resolution
def read_config(path: Path) -> dict:
    if not _regular_file(path):
        raise ConfigError(f"{path}: not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    d = parse_config_json(text, str(path))
    return d


def parse_config_json(text: str, where: str) -> dict:
    """A config.json's text as a dict; anything that is not one is a one-line ConfigError."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                          "truncated?") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a model config") from None
    except ValueError as e:  # an integer of thousands of digits
        raise ConfigError(f"{where}: not a model config ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    return d


def _regular_file(path: Path) -> bool:
    """A plain file (not a FIFO, socket or device, which a read would block on or never end)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


# How much of an over-long --model a message quotes.
NAME_SHOWN_CHARS = 60


def local_path(name: str) -> tuple[Path, int | None]:
    """The path --model names and its stat mode (None: nothing there). A name no path can have (a part longer than
    the file system allows, an unknown ~user) or one that cannot be looked at is a one-line ModelNotFoundError."""
    shown = name if len(name) <= NAME_SHOWN_CHARS else name[:NAME_SHOWN_CHARS] + "..."
    try:
        p = Path(name).expanduser()
    except RuntimeError:  # ~user with no such user
        raise ModelNotFoundError(f"no model {shown!r}: no such user's home directory") from None
    try:
        return p, p.stat().st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL byte
        return p, None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise ModelNotFoundError(f"no model {shown!r}: name too long ({len(os.fsencode(name))} bytes) for a "
                                     "local path, and too long for a catalog name or a hub id") from None
        raise ModelNotFoundError(f"{shown}: cannot look at it ({e.strerror or e})") from None


def resolve_model(name: str) -> ModelSource:
    """1. a local directory with config.json; 2. a hub id in the local HF cache; 3. the catalog."""
    if not name or not name.strip():
        raise ModelNotFoundError("--model is empty")
    p, mode = local_path(name)
    if mode is not None and stat.S_ISDIR(mode):
        if not os.access(p, os.R_OK | os.X_OK):
            raise ModelNotFoundError(f"{p}: directory is not readable")
        cfg = p / "config.json"
        if not cfg.exists():
            raise ModelNotFoundError(f"{p}: directory has no config.json")
        return ModelSource(kind="directory", id=p.resolve().name, config=read_config(cfg), path=p, origin=str(p))
    if mode is not None and stat.S_ISREG(mode) and p.name.endswith(".json"):
        return ModelSource(kind="directory", id=p.stem, config=read_config(p), path=p.parent, origin=str(p))
    if name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{name}: no such directory")
    snap = find_in_hf_cache(name)
    if snap is not None:
        return ModelSource(kind="hf-cache", id=name, config=read_config(snap / "config.json"), path=snap,
                           origin=f"Hugging Face cache {snap}")
    if "/" not in name and (variant := variant_source(name)) is not None:  # a hub id asks the hub first (runtime)
        return variant
    entry, note = match_catalog(name)
    return ModelSource(kind="catalog", id=entry.id, config=catalog_config(entry.id), origin="built-in catalog",
                       note=note)


# The runtime's builder for a model_type without a hand-written one: (config, name, source) -> ModelSpec.
GenericBuilder = Callable[[dict, str, str], ModelSpec]


def load_spec(source: ModelSource, *, generic: GenericBuilder | None = None,
              transformers_version: str | None = None) -> ModelSpec:
    """The model's exact inventory, with the checkpoint's dtypes and size when its headers are known.

    The tensors come from the hand-written builder of the config's model_type; without one, from the
    safetensors headers (planner/generic.py); without headers (or for a pre-quantized checkpoint, whose
    headers hold packed tensors), from `generic` when the caller has one."""
    where = source.origin or source.id
    headers = source_headers(source)
    mt = source.config.get("model_type")
    if not isinstance(mt, str) or mt in BUILDERS:
        spec = spec_from_config(source.config, name=source.id, source=source.origin, where=where,
                                transformers_version=transformers_version)
    else:
        spec = _generic_spec(source, headers, generic, where, transformers_version)
    spec = replace(spec, location=source_location(source))
    return apply_headers(spec, headers, where) if headers else spec


def source_location(source: ModelSource) -> str:
    """What an engine loads the model by: a local directory's absolute path (not its name, which another directory
    may share), else the hub id."""
    if source.kind == "directory" and source.path is not None:
        return str(source.path.expanduser().resolve())
    return source.id


def _generic_spec(source: ModelSource, headers, generic: GenericBuilder | None, where: str,
                  transformers_version: str | None) -> ModelSpec:
    refuse_unmodelled_state(source.config, where)
    check_rope(source.config, where)
    weight_block_size(source.config, where)
    if headers and "quantization_config" not in source.config:
        return spec_from_headers(source.config, normalized_headers(headers), name=source.id, source=source.origin,
                                 where=where, transformers_version=transformers_version)
    if generic is not None:
        return generic(source.config, source.id, source.origin)
    why = "its checkpoint is pre-quantized (its headers hold packed tensors)" if headers else \
        "no safetensors headers are known"
    raise UnsupportedArchitectureError(
        f"{where}: unsupported architecture model_type={source.config['model_type']!r} here: no hand-written builder, "
        f"and {why}; with the runtime extra (pip install 'vramplan[runtime]') vramplan builds it with transformers on "
        "the meta device")


def source_headers(source: ModelSource) -> tuple[HeaderTensor, ...] | None:
    """The headers that came with the source, else those of its directory's safetensors files, else None."""
    if source.headers is not None:
        return source.headers
    if source.path is not None and (files := weight_files(source.path)):
        return tuple(t for f in files for t in read_safetensors_header(f))
    return None


def model_spec(name: str) -> ModelSpec:
    return load_spec(resolve_model(name))


# ------------------------------------------------------------------ safetensors headers
def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (index.json's shards when present); none when the index is there
    without any of its shards."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            text = index.read_text()
        except OSError as e:
            raise CheckpointError(f"{index}: unreadable index ({e.strerror or e})") from None
        shards = index_shards(text, str(index))
        missing = [s for s in shards if not (path / s).is_file()]
        if len(missing) == len(shards):  # the index alone: what a header-only fetch from the hub leaves
            return []
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {', '.join(missing[:3])}")
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    odd = [f.name for f in files if not _regular_file(f)]
    if odd:
        raise CheckpointError(f"{path}: {', '.join(odd)} is not a regular file (a FIFO, socket or device?)")
    return files


def index_shards(text: str, where: str) -> list[str]:
    """The shard files a model.safetensors.index.json names (each a plain file name beside the index)."""
    try:
        wm = json.loads(text)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: unreadable index ({type(e).__name__}: {e})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: unreadable index (JSON nested too deeply)") from None
    except ValueError as e:  # an integer of thousands of digits
        raise CheckpointError(f"{where}: unreadable index ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{where}: weight_map is not an object")
    shards = sorted(set(wm.values()), key=str)
    if not all(isinstance(x, str) and x and "/" not in x and ".." not in x for x in shards):
        raise CheckpointError(f"{where}: weight_map names files outside the directory")
    return shards


@record
class HeaderTensor:
    """One tensor of a safetensors header: name, dtype and shape (no data), and where its bytes start in the file (a
    local file's header, read_safetensors_header; from the end of the header where only the header was fetched; 0
    where only the shape is known: a hub listing)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    start: int = 0


def read_safetensors_header(path: Path) -> list[HeaderTensor]:
    """Parse a safetensors header without reading any tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            n = safetensors_header_length(head, size, str(path))
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_safetensors_header(raw, size - 8 - n, str(path), data_start=8 + n)


def safetensors_header_length(first8: bytes, file_size: int, where: str) -> int:
    """The header length the first 8 bytes declare, checked against the file's size."""
    (n,) = struct.unpack("<Q", first8)
    if n > MAX_SAFETENSORS_HEADER_BYTES or n + 8 > file_size:
        raise CheckpointError(f"{where}: corrupt safetensors header (declared length {n} bytes, file {file_size} "
                              "bytes)")
    return n


def parse_safetensors_header(raw: bytes, data_len: int, where: str, data_start: int = 0) -> list[HeaderTensor]:
    """A safetensors header's JSON (the bytes after the 8-byte length) as tensors, each checked against its
    dtype, shape and the `data_len` bytes of data that follow the header; each tensor's start counted from
    `data_start` (the data's offset in the file, where known)."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{where}: corrupt safetensors header (not JSON)") from None
    except RecursionError:
        raise CheckpointError(f"{where}: corrupt safetensors header (JSON nested too deeply)") from None
    except ValueError as e:  # an integer of thousands of digits
        raise CheckpointError(f"{where}: corrupt safetensors header ({' '.join(str(e).split())[:120]})") from None
    except MemoryError:
        raise CheckpointError(f"{where}: corrupt safetensors header (too large to parse: {len(raw)} bytes)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (not an object)")
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = canonical_dtype(info["dtype"])
            shape = tuple(int(x) for x in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            if min(shape, default=0) < 0:
                raise ValueError("a negative dimension")
            numel = 1
            for d in shape:
                numel *= d
            nbytes = int(numel * dtype_bytes(dtype))
        except (KeyError, TypeError, ValueError, OverflowError, ConfigError):
            raise CheckpointError(f"{where}: corrupt safetensors header entry {name!r}") from None
        if end < start or end > data_len or end - start != nbytes:
            raise CheckpointError(f"{where}: tensor {name!r} has data offsets that do not fit its shape or the file "
                                  "(truncated?)")
        out.append(HeaderTensor(name, dtype, shape, end - start, data_start + start))
    return out


def _normalize_name(name: str) -> str:
    """Checkpoint names of the multimodal gemma3 wrap the text model; map them to ForCausalLM names."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def normalized_headers(headers: Iterable[HeaderTensor]) -> dict[str, HeaderTensor]:
    """Header tensors by the name transformers' ForCausalLM gives them."""
    return {_normalize_name(t.name): t for t in headers}


def apply_headers(spec: ModelSpec, headers: Iterable[HeaderTensor], where: str) -> ModelSpec:
    """Attach on-disk dtypes and the exact checkpoint size from safetensors headers (read from local files or
    fetched from the hub)."""
    header = normalized_headers(headers)
    prequantized = "quantization_config" in spec.config
    pub = published(spec.config, where) if prequantized else None
    if pub is not None and pub.scheme is None:
        return _apply_stored_headers(spec, pub, header, where)
    tensors = []
    matched = 0
    bytes_by_dtype: dict[str, int] = {}
    for t in spec.tensors:
        h = header.get(t.name)
        if h is None:
            tensors.append(t)
            continue
        if h.shape != t.shape and not prequantized:
            raise CheckpointError(
                f"{where}: tensor {t.name} has shape {list(h.shape)} in the checkpoint but the config implies "
                f"{list(t.shape)}"
            )
        matched += 1
        bytes_by_dtype[h.dtype] = bytes_by_dtype.get(h.dtype, 0) + h.nbytes
        tensors.append(replace(t, dtype=h.dtype))
    notes = list(spec.notes)
    missing = len(spec.tensors) - matched
    if missing:
        notes.append(f"checkpoint: {missing} of {len(spec.tensors)} tensors the config implies are not in the "
                     "safetensors files")
    extra = len(header) - matched
    if extra:
        notes.append(f"checkpoint: {extra} tensors in the safetensors files are not part of the model transformers "
                     "builds")
    dtype = max(bytes_by_dtype, key=bytes_by_dtype.get) if bytes_by_dtype else spec.dtype
    return replace(spec, tensors=tuple(tensors), notes=tuple(notes), dtype=dtype,
                   checkpoint_bytes=sum(h.nbytes for h in header.values()))


def _apply_stored_headers(spec: ModelSpec, pub, header: dict[str, HeaderTensor], where: str) -> ModelSpec:
    """A pre-quantized checkpoint's headers against its format's rule (planner/published.py), parameter by parameter:
    each parameter's stored tensors (owner_of) summed; where they hold other bytes than the rule says, the headers'
    bytes are what the plan counts, and the note says how many differed."""
    owned: dict[str, list[HeaderTensor]] = {}
    for name, h in header.items():
        owned.setdefault(owner_of(name), []).append(h)
    tensors, matched, differ, first = [], 0, 0, ""
    for t in spec.tensors:
        hs = owned.pop(t.name, None)
        if hs is None:
            tensors.append(t)
            continue
        matched += 1
        have = sum(h.nbytes for h in hs)
        if have != stored_bytes(pub, t):
            differ += 1
            first = first or (f"{t.name}: {have:,} B in the headers, {stored_bytes(pub, t):,} B by the {pub.name} "
                              "rule")
            t = replace(t, stored_bytes=have)
        tensors.append(t)
    notes = list(spec.notes)
    if differ:
        notes.append(f"checkpoint: {differ} of {matched} parameters hold other bytes than the {pub.name} layout "
                     f"rule (the headers' bytes are counted; first: {first})")
    else:
        notes.append(f"checkpoint: the safetensors headers hold the {pub.name} layout as counted, parameter for "
                     f"parameter ({matched} parameters)")
    if missing := len(spec.tensors) - matched:
        notes.append(f"checkpoint: {missing} of {len(spec.tensors)} tensors the config implies are not in the "
                     "safetensors files")
    if owned:
        notes.append(f"checkpoint: {sum(map(len, owned.values()))} tensors in the safetensors files are not part of "
                     "the model transformers builds")
    return replace(spec, tensors=tuple(tensors), notes=tuple(notes),
                   checkpoint_bytes=sum(h.nbytes for h in header.values()))
