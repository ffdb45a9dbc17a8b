"""A memo of the last few results of a function of objects, known by their identity: the search asks the same
question of the same spec, hardware, scheme or tuple many times, and these objects are not hashable by value (or
hashing them would cost what the memo saves). Each entry keeps its objects, so their ids in its key cannot be reused
while it lives. Pure."""

from __future__ import annotations

from typing import Any, Callable


class ObjectMemo:
    """The last `size` values of make() per (objects, plain values)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: dict[tuple, tuple[tuple, Any]] = {}

    def get(self, objects: tuple, values: tuple, make: Callable[[], Any]) -> Any:
        key = (*map(id, objects), *values)
        hit = self._entries.get(key)
        if hit is not None:  # an entry holds its objects: no other object can have their ids while it lives
            return hit[1]
        if len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        value = make()
        self._entries[key] = (objects, value)
        return value

    def clear(self) -> None:
        self._entries.clear()
