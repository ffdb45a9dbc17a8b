"""Finding hardware profiles by name or path, and this machine's cached quick probe.

Search order for a name (first hit wins, case-insensitive NAME.yaml / NAME.yml):
  1. the directories in $VRAMPLAN_PROFILES (os.pathsep-separated, ':' on POSIX)
  2. the user's profile directory: $VRAMPLAN_CONFIG_DIR/profiles if that variable is set,
     else $XDG_CONFIG_HOME/vramplan/profiles, else ~/.config/vramplan/profiles
  3. the shipped profiles/ package directory
A bare name (no path separator, no .yaml / .yml) is looked up there first: a file of that name in the
current directory is read only when no profile has the name, or when written as a path (`./NAME`).

File reads only: no torch, nothing written. This machine's own profile (a cached quick
probe) is the runtime's: runtime/this_machine.py.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Callable, NamedTuple

from .errors import ProfileError
from .hardware import HardwareProfile
from .profile_yaml import load_profile
from .textfiles import file_kind

PROFILE_SUFFIXES = (".yaml", ".yml")
# How a found file is read: planner.profile_yaml.load_profile, or a caller's equal (the runtime's caches the parse).
Loader = Callable[[Path], HardwareProfile]


class ProfileEntry(NamedTuple):
    name: str
    path: Path
    origin: str  # "$VRAMPLAN_PROFILES", "user", "shipped"
    profile: HardwareProfile | None  # the loaded profile, or None when it does not load
    error: str | None  # why it does not load
    shadows: tuple[tuple[Path, str], ...] = ()  # files of the same name found later (path, origin): never used


def shipped_profiles_dir() -> Path:
    from vramplan import profiles  # the package that holds the shipped YAML files

    return Path(profiles.__file__).resolve().parent


def user_profiles_dir() -> Path | None:
    """The user's profile directory; None when there is no home directory to find it in (and no variable names it)."""
    if os.environ.get("VRAMPLAN_CONFIG_DIR"):
        return expand_user(os.environ["VRAMPLAN_CONFIG_DIR"], "$VRAMPLAN_CONFIG_DIR") / "profiles"
    if os.environ.get("XDG_CONFIG_HOME"):
        return expand_user(os.environ["XDG_CONFIG_HOME"], "$XDG_CONFIG_HOME") / "vramplan" / "profiles"
    try:
        return Path.home() / ".config" / "vramplan" / "profiles"
    except RuntimeError:  # no $HOME and no password entry: no user directory
        return None


def expand_user(text: str, what: str) -> Path:
    """`text` as a path, a leading `~` or `~user` expanded; a one-line ProfileError naming `what` when that user has
    no home directory (Path.expanduser raises RuntimeError)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        head = text.split("/")[0].split(os.sep)[0]
        raise ProfileError(f"{what} {text!r}: cannot expand {head!r} (no such user, or no home directory); "
                           "write the path without it") from None


def search_dirs() -> list[tuple[Path, str]]:
    """The profile directories in lookup order, each with a label saying where it came from."""
    dirs: list[tuple[Path, str]] = []
    for part in os.environ.get("VRAMPLAN_PROFILES", "").split(os.pathsep):
        if part.strip():
            d = expand_user(part.strip(), "$VRAMPLAN_PROFILES lists")
            if not d.is_dir():
                raise ProfileError(f"$VRAMPLAN_PROFILES lists {d}, which is not a directory")
            dirs.append((d, "$VRAMPLAN_PROFILES"))
    user = user_profiles_dir()
    if user is not None:
        dirs.append((user, "user"))
    dirs.append((shipped_profiles_dir(), "shipped"))
    return dirs


def _profile_files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.suffix.lower() in PROFILE_SUFFIXES and p.is_file())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.lower().endswith(PROFILE_SUFFIXES)


def resolve_profile(name_or_path: str | os.PathLike[str], load: Loader = load_profile
                    ) -> tuple[HardwareProfile, Path]:
    """A profile read by `load`: a bare name (no path separator, no YAML suffix) is a profile of the search directories
    when one has that name, even where a file of that name lies in the current directory (name_shadows says so;
    `./NAME` reads that file); anything else is a path, and a bare name no profile has may name a file too."""
    text = os.fspath(name_or_path)
    if not text.strip():
        raise ProfileError("the hardware profile name is empty")
    bare = not looks_like_path(text)
    dirs = search_dirs() if bare else []
    found = _named(text.strip().lower(), dirs)
    if found:
        return load(found[0][0]), found[0][0]
    candidate = expand_user(text, "the hardware profile path")
    if candidate.is_file():
        return load(candidate), candidate
    if candidate.is_dir():
        raise ProfileError(f"{text}: is a directory, not a hardware profile file")
    if candidate.exists():  # a FIFO, a socket, a device: reading it would block or never end
        raise ProfileError(f"{text}: is {file_kind(candidate.stat().st_mode)}, not a hardware profile file")
    if not bare:
        raise ProfileError(f"{text}: no such profile file")
    raise _unknown_name(text, dirs)


def _unknown_name(text: str, dirs: list[tuple[Path, str]]) -> ProfileError:
    """The error for a name no profile has: the closest names, and where they were looked for."""
    known = sorted({f.stem for d, _o in dirs for f in _profile_files(d)})
    close = difflib.get_close_matches(text.strip().lower(), [k.lower() for k in known], n=4, cutoff=0.5)
    by_lower = {k.lower(): k for k in known}
    close_names = [by_lower[c] for c in close]
    hint = f"; did you mean: {', '.join(close_names)}?" if close_names else ""
    where = "; ".join(f"{d} ({o})" for d, o in dirs)
    return ProfileError(
        f'unknown hardware profile "{text}"{hint} Looked in: {where}. '
        "See `vramplan profiles list`, or pass a YAML path."
    )


def _named(wanted: str, dirs: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """The files a lower-case profile name finds, in lookup order (path, origin): the first one is used."""
    return [(f, origin) for directory, origin in dirs for f in _profile_files(directory) if f.stem.lower() == wanted]


def name_shadows(name_or_path: str | os.PathLike[str]) -> list[tuple[Path, str]]:
    """The files a profile name finds but does not use (path, origin): later ones of the same name in the search
    order, and a file of that name in the current directory; none for a path, or a name no profile has."""
    text = os.fspath(name_or_path)
    if not text.strip() or looks_like_path(text):
        return []
    found = _named(text.strip().lower(), search_dirs())
    if not found:
        return []
    local = Path(text)
    here = [(local.absolute(), f"the current directory; `./{text}` reads it")] if os.path.lexists(local) else []
    return found[1:] + here


def profile_files() -> list[Path]:
    """Every profile file of the search directories, in lookup order (shadowed ones too: each is checked)."""
    return [f for directory, _origin in search_dirs() for f in _profile_files(directory)]


def list_profiles(load: Loader = load_profile) -> list[ProfileEntry]:
    """Every profile visible by name, sorted by name, read by `load`; earlier directories shadow later ones, and each
    entry lists the files of its name it shadows."""
    seen: dict[str, ProfileEntry] = {}
    for directory, origin in search_dirs():
        for f in _profile_files(directory):
            key = f.stem.lower()
            if key in seen:
                seen[key] = seen[key]._replace(shadows=seen[key].shadows + ((f, origin),))
                continue
            try:
                seen[key] = ProfileEntry(f.stem, f, origin, load(f), None)
            except ProfileError as e:
                seen[key] = ProfileEntry(f.stem, f, origin, None, str(e))
    return sorted(seen.values(), key=lambda e: e.name.lower())
