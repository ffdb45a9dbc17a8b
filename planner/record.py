"""The planner's records: `@record` is `@dataclass(frozen=True)` whose __repr__, __eq__ and __hash__ are three shared
functions instead of three generated per class, and (Python 3.11 and 3.12) so are the frozen __setattr__ and
__delattr__.

Why: Python 3.11 compiles every method a dataclass generates with an `exec` of its own, 70-130 us each, and a frozen
dataclass gets six. `vramplan plan` imports some 76 of the planner's; sharing the three that need no per-class code
saved 13 ms of its start-up (bench/startup.py), and sharing the frozen pair 0.26 ms a class more: only __init__ is
compiled per class. (Python 3.13 compiles a class's methods in one go: there dataclass makes the frozen pair.)

They behave as dataclass's own, field flags included:
- repr: `Name(a=1, b='x')` over the fields with repr=True, the class's __qualname__ first;
- eq: NotImplemented for another class (a subclass included), else the tuples of the compare=True fields compared;
- hash: the hash of the tuple of the fields dataclass hashes (hash=True, or hash=None and compare=True).
tests/test_structure.py checks this against dataclass's generated methods over every field flag and for
subclasses, and that every frozen dataclass the planner defines is a record.
- __setattr__ / __delattr__: FrozenInstanceError on a record, or on a field of a subclass that is not one; other
  attributes of such a subclass are set as object sets them.
__init__, __match_args__, `dataclasses.replace` and `fields` are dataclass's.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from dataclasses import FrozenInstanceError, dataclass, field, fields
from operator import attrgetter
from typing import Any, Callable, TypeVar, dataclass_transform, overload

T = TypeVar("T", bound=type)


def _key(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """The tuple of these attributes, built in C (operator.attrgetter) for two or more."""
    if len(names) >= 2:
        return attrgetter(*names)
    if names:
        name = names[0]
        return lambda o: (getattr(o, name),)
    return lambda o: ()


def _repr(self) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__record__[0])
    return f"{type(self).__qualname__}({shown})"


def _eq(self, other: Any) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    key = self.__record__[1]
    return key(self) == key(other)


def _hash(self) -> int:
    return hash(self.__record__[2](self))


SHARED = {"__repr__": _repr, "__eq__": _eq, "__hash__": _hash}


def _frozen(self, name: str) -> bool:
    cls = type(self)
    return "__record__" in cls.__dict__ or name in cls.__dataclass_fields__


def _setattr(self, name: str, value: Any) -> None:
    if _frozen(self, name):
        raise FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)


def _delattr(self, name: str) -> None:
    if _frozen(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}")
    object.__delattr__(self, name)


_setattr.__name__, _delattr.__name__ = "__setattr__", "__delattr__"  # the names dataclass sets them under
# dataclass builds a frozen class's pair with dataclasses._frozen_get_del_attr(cls, fields, globals) in 3.11 and 3.12
FROZEN = {"__setattr__": _setattr, "__delattr__": _delattr} if sys.version_info[:2] in ((3, 11), (3, 12)) else {}


def _frozen_dataclass(c: T, kw_only: bool) -> T:
    """dataclass(c, frozen=True, ...) with the shared frozen pair where this Python lets it be given."""
    if not FROZEN:
        return dataclass(c, frozen=True, repr=False, eq=False, kw_only=kw_only)
    with _SWAP:  # a frozen dataclass another thread defines meanwhile keeps its own pair
        made = dataclasses._frozen_get_del_attr  # type: ignore[attr-defined]
        dataclasses._frozen_get_del_attr = lambda cls, fields, globals: tuple(FROZEN.values())  # type: ignore
        try:
            c = dataclass(c, frozen=True, repr=False, eq=False, kw_only=kw_only)
        finally:
            dataclasses._frozen_get_del_attr = made  # type: ignore[attr-defined]
    for fn in FROZEN.values():  # dataclass names the shared functions after the class it set them on last
        fn.__qualname__ = f"record.{fn.__name__}"
    return c


_SWAP = threading.Lock()


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
        c = _frozen_dataclass(c, kw_only)
        fs = fields(c)
        # what repr shows, and the keys eq compares and hash hashes, as dataclass picks them
        c.__record__ = (tuple(f.name for f in fs if f.repr), _key(tuple(f.name for f in fs if f.compare)),
                        _key(tuple(f.name for f in fs if (f.compare if f.hash is None else f.hash))))
        for name, fn in SHARED.items():
            setattr(c, name, fn)
        return c

    return wrap if cls is None else wrap(cls)
