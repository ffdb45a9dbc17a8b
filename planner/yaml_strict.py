"""YAML read strictly: `yaml.safe_load`, except that a key given twice in one mapping is an error.

PyYAML keeps the last of duplicate keys silently, so a profile edited by two people can lose a
field without a word. Pure: reading text only. PyYAML is imported on the first parse, not with this
module: importing it costs 10 ms, and a profile whose parsed document is cached (runtime.yaml_cache)
is never parsed.
"""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _loader() -> type:
    import yaml

    class DuplicateKeyError(yaml.constructor.ConstructorError):
        """A mapping with the same key twice."""

    # libyaml's parser where PyYAML was built with it (10x faster: 1 ms, not 10, for a profile); the constructor, and
    # so the duplicate-key check, stays PyYAML's own
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class StrictLoader(base):
        def construct_mapping(self, node, deep=False):
            seen: set = set()
            for key_node, _value in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: let the base class report it
                    break
                if duplicate:
                    raise DuplicateKeyError(None, None, f"duplicate key {key!r} (the second is ignored by plain YAML "
                                            "readers; remove one)", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def safe_load_strict(text: str) -> Any:
    """Like yaml.safe_load, refusing duplicate keys; raises yaml.YAMLError (or RecursionError when nested absurdly)."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
