"""The planner's records: `@record` is `@dataclass(frozen=True)` whose __repr__, __eq__ and __hash__ are three shared
functions instead of three generated per class.

Why: Python 3.11 compiles every method a dataclass generates with an `exec` of its own, 70-90 us each, and a frozen
dataclass gets six. `vramplan plan` imports some 70 of the planner's, and creating them cost 44 ms of its 0.2 s start-up
(bench/startup.py); sharing the three that need no per-class code saves 16 ms of it. (Python 3.13 compiles a class's
methods in one go.)

They behave as dataclass's own, field flags included:
- repr: `Name(a=1, b='x')` over the fields with repr=True, the class's __qualname__ first;
- eq: NotImplemented for another class (a subclass included), else the tuples of the compare=True fields compared;
- hash: the hash of the tuple of the fields dataclass hashes (hash=True, or hash=None and compare=True).
tests/test_structure.py checks this against dataclass's generated methods for every record the planner defines.
__init__, the frozen __setattr__/__delattr__, __match_args__, `dataclasses.replace` and `fields` are dataclass's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, TypeVar, dataclass_transform, overload

T = TypeVar("T", bound=type)

# per class: the names of the fields repr shows, eq compares and hash hashes
_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    names = _NAMES.get(cls)
    if names is None:
        fs = fields(cls)
        names = _NAMES[cls] = (tuple(f.name for f in fs if f.repr), tuple(f.name for f in fs if f.compare),
                               tuple(f.name for f in fs if (f.compare if f.hash is None else f.hash)))
    return names


def _repr(self) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in _names(type(self))[0])
    return f"{type(self).__qualname__}({shown})"


def _eq(self, other: Any) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    names = _names(type(self))[1]
    return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)


def _hash(self) -> int:
    return hash(tuple(getattr(self, n) for n in _names(type(self))[2]))


SHARED = {"__repr__": _repr, "__eq__": _eq, "__hash__": _hash}


@overload
def record(cls: T, /) -> T: ...


@overload
def record(*, kw_only: bool = False) -> Callable[[T], T]: ...


@dataclass_transform(field_specifiers=(field,))
def record(cls=None, /, *, kw_only: bool = False):
    """A frozen dataclass (`kw_only` as dataclass takes it) with the shared __repr__, __eq__ and __hash__."""
    def wrap(c: T) -> T:
        own = sorted(set(SHARED) & {k for k, v in vars(c).items() if v is not None})
        if own:
            raise TypeError(f"{c.__qualname__} defines {', '.join(own)}: a record shares them; use @dataclass")
        c = dataclass(c, frozen=True, repr=False, eq=False, kw_only=kw_only)
        for name, fn in SHARED.items():
            setattr(c, name, fn)
        return c

    return wrap if cls is None else wrap(cls)
