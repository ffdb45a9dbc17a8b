"""Where a model comes from: a local directory, the local Hugging Face cache, or the catalog.

`resolve_model("meta-llama/Llama-3.1-8B")` -> ModelSource (what was found) and
`load_spec(source)` -> ModelSpec. Local safetensors checkpoints are read header-only
(exact dtypes and sizes, never the tensors). File reads only; no torch.
"""

from __future__ import annotations

import difflib
import json
import os
import stat
import struct
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path

from .architectures import spec_from_config
from .errors import CheckpointError, ConfigError, ModelNotFoundError
from .modelspec import ModelSpec, canonical_dtype, dtype_bytes

# A safetensors header larger than this is corrupt, not big (real ones are a few MB).
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    kind: str  # "directory", "hf-cache" or "catalog"
    id: str  # what to call the model: hub id or directory name
    config: dict = field(repr=False, compare=False)
    path: Path | None = None  # the directory holding config.json (and maybe weights)
    origin: str = ""  # human description: "catalog", "/path/to/dir", "HF cache snapshot abc123"

    @property
    def has_weights(self) -> bool:
        return self.path is not None and bool(weight_files(self.path))


# ------------------------------------------------------------------ catalog
@dataclass(frozen=True)
class CatalogEntry:
    id: str
    file: str
    aliases: tuple[str, ...]
    provenance: str = ""


@lru_cache(maxsize=1)
def catalog() -> tuple[CatalogEntry, ...]:
    index = json.loads(resources.files("planner.catalog").joinpath("index.json").read_text())
    return tuple(
        CatalogEntry(e["id"], e["file"], tuple(e.get("aliases", ())), e.get("provenance", "")) for e in index["models"]
    )


@lru_cache(maxsize=None)
def catalog_config(entry_id: str) -> dict:
    entry = next(e for e in catalog() if e.id == entry_id)
    return json.loads(resources.files("planner.catalog").joinpath(entry.file).read_text())


def catalog_rows() -> list[dict]:
    """What `vramplan models` lists: each catalog model's id, aliases and headline facts."""
    rows = []
    for e in catalog():
        s = spec_from_config(catalog_config(e.id), name=e.id, source="built-in catalog")
        rows.append({"id": e.id, "aliases": list(e.aliases), "model_type": s.model_type, "params_total": s.params_total,
                     "params_active": s.params_active, "num_layers": s.num_layers, "max_context": s.max_context,
                     "checkpoint_dtype": s.dtype})
    return rows


def find_in_catalog(name: str) -> CatalogEntry:
    """Exact id or alias (case-insensitive), else a unique substring; ambiguous or unknown names raise."""
    q = name.strip().lower()
    entries = catalog()
    for e in entries:
        if q == e.id.lower() or q in e.aliases:
            return e
    hits = [e for e in entries if q and (q in e.id.lower())]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise ModelNotFoundError(f"model name {name!r} is ambiguous; candidates: {', '.join(e.id for e in hits)}")
    names = [e.id.lower() for e in entries] + [a for e in entries for a in e.aliases]
    close = difflib.get_close_matches(q, names, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(dict.fromkeys(close))}" if close else "; see `vramplan models` for the catalog"
    raise ModelNotFoundError(
        f"no model {name!r}: not a local directory with config.json, not in the local Hugging Face cache, "
        f"not in the catalog{hint}"
    )


# ------------------------------------------------------------------ Hugging Face cache
def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


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
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); truncated?") from None
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


def resolve_model(name: str) -> ModelSource:
    """1. a local directory with config.json; 2. a hub id in the local HF cache; 3. the catalog."""
    if not name or not name.strip():
        raise ModelNotFoundError("--model is empty")
    p = Path(name).expanduser()
    if p.is_dir():
        if not os.access(p, os.R_OK | os.X_OK):
            raise ModelNotFoundError(f"{p}: directory is not readable")
        cfg = p / "config.json"
        if not cfg.exists():
            raise ModelNotFoundError(f"{p}: directory has no config.json")
        return ModelSource(kind="directory", id=p.resolve().name, config=read_config(cfg), path=p, origin=str(p))
    if p.is_file() and p.name.endswith(".json"):
        return ModelSource(kind="directory", id=p.stem, config=read_config(p), path=p.parent, origin=str(p))
    if name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{name}: no such directory")
    snap = find_in_hf_cache(name)
    if snap is not None:
        return ModelSource(kind="hf-cache", id=name, config=read_config(snap / "config.json"), path=snap,
                           origin=f"Hugging Face cache {snap}")
    entry = find_in_catalog(name)
    return ModelSource(kind="catalog", id=entry.id, config=catalog_config(entry.id), origin="built-in catalog")


def load_spec(source: ModelSource) -> ModelSpec:
    spec = spec_from_config(source.config, name=source.id, source=source.origin, where=source.origin or source.id)
    if source.path is not None and weight_files(source.path):
        spec = apply_checkpoint(spec, source.path)
    return spec


def model_spec(name: str) -> ModelSpec:
    return load_spec(resolve_model(name))


# ------------------------------------------------------------------ safetensors headers
def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (index.json's shards when present)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, OSError) as e:
            raise CheckpointError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: weight_map is not an object")
        shards = sorted(set(wm.values()))
        if not all(isinstance(x, str) and x and "/" not in x and ".." not in x for x in shards):
            raise CheckpointError(f"{index}: weight_map names files outside the directory")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {', '.join(missing[:3])}")
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    odd = [f.name for f in files if not _regular_file(f)]
    if odd:
        raise CheckpointError(f"{path}: {', '.join(odd)} is not a regular file (a FIFO, socket or device?)")
    return files


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> list[HeaderTensor]:
    """Parse a safetensors header without reading any tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_SAFETENSORS_HEADER_BYTES or n + 8 > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (declared length {n} bytes, file {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    out = []
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = canonical_dtype(info["dtype"])
            shape = tuple(int(x) for x in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, ConfigError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry {name!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if end < start or end > data_len or end - start != int(numel * dtype_bytes(dtype)):
            raise CheckpointError(f"{path}: tensor {name!r} has data offsets that do not fit its shape or the file (truncated?)")
        out.append(HeaderTensor(name, dtype, shape, end - start))
    return out


def _normalize_name(name: str) -> str:
    """Checkpoint names of the multimodal gemma3 wrap the text model; map them to ForCausalLM names."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def apply_checkpoint(spec: ModelSpec, path: Path) -> ModelSpec:
    """Attach on-disk dtypes and the exact checkpoint size from safetensors headers."""
    header: dict[str, HeaderTensor] = {}
    for f in weight_files(path):
        for t in read_safetensors_header(f):
            header[_normalize_name(t.name)] = t
    prequantized = "quantization_config" in spec.config
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
                f"{path}: tensor {t.name} has shape {list(h.shape)} in the checkpoint but the config implies {list(t.shape)}"
            )
        matched += 1
        bytes_by_dtype[h.dtype] = bytes_by_dtype.get(h.dtype, 0) + h.nbytes
        tensors.append(replace(t, dtype=h.dtype))
    notes = list(spec.notes)
    missing = len(spec.tensors) - matched
    if missing:
        notes.append(f"checkpoint: {missing} of {len(spec.tensors)} tensors the config implies are not in the safetensors files")
    extra = len(header) - matched
    if extra:
        notes.append(f"checkpoint: {extra} tensors in the safetensors files are not part of the model transformers builds")
    dtype = max(bytes_by_dtype, key=bytes_by_dtype.get) if bytes_by_dtype else spec.dtype
    return replace(spec, tensors=tuple(tensors), notes=tuple(notes), dtype=dtype,
                   checkpoint_bytes=sum(h.nbytes for h in header.values()))
