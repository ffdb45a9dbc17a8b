"""Writing results to disk without ever leaving a truncated file: plans, run reports, profiles, caches.

Every write goes to a temporary file in the target's directory, is flushed to disk, and then
renamed over the target (atomic on POSIX): a full disk or an interrupted write leaves the old
file (or none) and no temporary behind. Only regular files are written that way: a symlink is
written through (its target is replaced, the link stays), and anything else that exists at the
path (a device, a FIFO, a socket) is refused up front. A replaced file keeps its mode and owner;
a new one gets the mode any program's new file gets (0666 less the umask). The format follows the
suffix: .json writes JSON, .yaml / .yml YAML, anything else the caller's default. Errors are
one-line VramplanErrors naming the path. No torch: the planner-only install saves plans through here too.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from vramplan.planner.errors import VramplanError
from vramplan.planner.hardware import HardwareProfile
from vramplan.planner.profile_yaml import dumps_profile, profile_to_dict
from vramplan.planner.textfiles import file_kind

# The permission bits open(2) asks for when a program creates a file; the umask is taken from them (POSIX).
NEW_FILE_MODE = 0o666
JSON_SUFFIXES = (".json",)
YAML_SUFFIXES = (".yaml", ".yml")


class CacheDirError(VramplanError):
    """A cache directory that cannot be named: a `~user` that is no user, or no home directory to put it in."""


def cache_dir() -> Path:
    """vramplan's cache: $VRAMPLAN_CACHE_DIR, else $XDG_CACHE_HOME/vramplan, else ~/.cache/vramplan; CacheDirError
    (one line) when a `~` in it names no home directory. Callers treat that as a cache they cannot use."""
    for var, below in (("VRAMPLAN_CACHE_DIR", ()), ("XDG_CACHE_HOME", ("vramplan",))):
        if os.environ.get(var):
            return _expand_home(os.environ[var], f"${var}={os.environ[var]!r}").joinpath(*below)
    return _expand_home("~/.cache", "the default cache directory ~/.cache") / "vramplan"


def _expand_home(text: str, what: str) -> Path:
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory"
        head = text.split("/")[0].split(os.sep)[0]
        raise CacheDirError(f"{what}: cannot expand {head!r} (no such user, or no home directory); set "
                            "$VRAMPLAN_CACHE_DIR to a directory path") from None


class WriteError(VramplanError):
    """A result that could not be written (read-only directory, a directory in the way, a full disk)."""


def write_target(path: str | os.PathLike[str]) -> Path:
    """Where a write to `path` lands: the path itself, or, for a symlink, the file it resolves to (written through,
    so the link stays a link). Refuses what is not a regular file (a directory, a device, a FIFO, a socket)."""
    if not str(path).strip():
        raise WriteError("the output path is empty")
    p = Path(path).expanduser()
    target = Path(os.path.realpath(p)) if p.is_symlink() else p
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        return target  # a new file (through a dangling symlink: its target)
    except OSError as e:
        raise WriteError(f"{p}: cannot write ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise WriteError(f"{p}: is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise WriteError(f"{p}: is {file_kind(mode)}: results are written to regular files only; choose a file path")
    return target


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Fail now, before minutes of work, if `path` cannot be written: say why in one line. Returns the path as given
    (expanded); the write goes to `write_target(path)`."""
    target = write_target(path)
    p = Path(path).expanduser()
    parent = target.parent
    if not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WriteError(f"{p}: cannot create its directory ({e.strerror or e})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WriteError(f"{p}: directory {parent} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise WriteError(f"{p}: file is not writable")
    try:  # what access() cannot tell (a read-only mount, /proc as root): the temporary file the write will need
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise WriteError(f"{p}: cannot write ({e.strerror or e})") from None
    os.close(fd)
    _remove(tmp)
    return p


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename; returns the path as given."""
    p = check_writable(path)
    target = write_target(path)
    try:
        old = target.stat()
    except FileNotFoundError:
        old = None
    except OSError as e:
        raise WriteError(f"{p}: cannot write ({e.strerror or e})") from None
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            _keep_mode(f.fileno(), old)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        _remove(tmp)
        raise WriteError(f"{p}: cannot write ({e.strerror or e})") from None
    except BaseException:
        _remove(tmp)
        raise
    return p


def _keep_mode(fd: int, old: os.stat_result | None) -> None:
    """The replaced file's mode and (where allowed) owner; for a new file, 0666 less the umask (mkstemp makes 0600)."""
    if old is None:
        os.fchmod(fd, NEW_FILE_MODE & ~_umask())
        return
    try:
        os.fchown(fd, old.st_uid, old.st_gid)
    except OSError:  # not root: the file becomes the writer's, as any editor's save would make it
        pass
    os.fchmod(fd, stat.S_IMODE(old.st_mode))


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove(tmp: str | None) -> None:
    if tmp is None:
        return
    try:
        os.unlink(tmp)
    except OSError:
        pass


def suffix_format(path: str | os.PathLike[str], default: str) -> str:
    """"json" or "yaml", by the path's suffix; `default` for any other suffix."""
    suffix = Path(path).suffix.lower()
    return "json" if suffix in JSON_SUFFIXES else "yaml" if suffix in YAML_SUFFIXES else default


def dumps(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def save_data(path: str | os.PathLike[str], data: Any, *, default: str) -> Path:
    """Plain data as JSON or YAML, by the path's suffix (`default`, "json" or "yaml", for any other)."""
    return write_atomic(path, dumps(data, suffix_format(path, default)))


def save_json(path: str | os.PathLike[str], data: Any) -> Path:
    return write_atomic(path, dumps(data, "json"))


def save_yaml(path: str | os.PathLike[str], data: Any) -> Path:
    return write_atomic(path, dumps(data, "yaml"))


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> Path:
    """A hardware profile as YAML (the strict schema's text form), or as JSON for a .json path (the profile reader
    reads JSON too: JSON is YAML)."""
    if suffix_format(path, "yaml") == "json":
        return write_atomic(path, dumps(profile_to_dict(profile), "json"))
    return write_atomic(path, dumps_profile(profile))
