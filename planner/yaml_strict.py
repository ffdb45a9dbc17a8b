"""YAML read strictly: `yaml.safe_load`, except that a key given twice in one mapping is an error, and numbers are
read only as they are plainly written.

PyYAML keeps the last of duplicate keys silently, so a profile edited by two people can lose a
field without a word. It also reads YAML 1.1's other spellings of numbers: `1:00` is 60 (base 60),
`0x10` 16, `017` 15 (octal), `1_000` 1000. Here an integer is plain decimal digits (`16`, `-3`) and
a float is digits with a decimal point (`0.85`, `1.5e+3`, `.inf`); any other spelling stays the
string it was written as, which a field that wants a number then refuses in one line. An integer
longer than Python converts (sys.get_int_max_str_digits(): 4300 digits) is a YAML error, not a
ValueError. Pure: reading text only. PyYAML is imported on the first parse, not with this
module: importing it costs 10 ms, and a profile whose parsed document is cached (runtime.yaml_cache)
is never parsed.
"""

from __future__ import annotations

import re
import sys
from functools import cache
from typing import Any

INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"
# The only spellings read as numbers: YAML 1.1's (PyYAML's resolver) without base 60, bases 2, 8 and 16, or `_`.
PLAIN_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$")
PLAIN_FLOAT = re.compile(r"""^(?:[-+]?[0-9]+\.[0-9]*(?:[eE][-+][0-9]+)?
                                |\.[0-9]+(?:[eE][-+][0-9]+)?
                                |[-+]?\.(?:inf|Inf|INF)
                                |\.(?:nan|NaN|NAN))$""", re.X)
INT_FIRST_CHARS = "-+0123456789"
FLOAT_FIRST_CHARS = "-+0123456789."


def _plain_numbers_only(resolvers: dict) -> dict:
    """A copy of PyYAML's implicit resolvers (first character -> [(tag, regex)]) without its int and float ones."""
    return {first: [(tag, rx) for tag, rx in pairs if tag not in (INT_TAG, FLOAT_TAG)]
            for first, pairs in resolvers.items()}


def _int_problem(text: str) -> str | None:
    """Why `text`, tagged an integer, is not read as one (None: it is)."""
    if not PLAIN_INT.match(text):
        return f"{text[:40]!r} is not a plain decimal integer (write the number in decimal digits)"
    limit = sys.get_int_max_str_digits()
    digits = len(text.lstrip("+-"))
    if limit and digits > limit:
        return f"an integer of {digits} digits: longer than Python reads ({limit})"
    return None


@cache
def _loader() -> type:
    import yaml

    class DuplicateKeyError(yaml.constructor.ConstructorError):
        """A mapping with the same key twice."""

    class NumberError(yaml.constructor.ConstructorError):
        """An integer tagged !!int in another spelling than decimal digits, or too long to convert."""

    # libyaml's parser where PyYAML was built with it (10x faster: 1 ms, not 10, for a profile); the constructor, and
    # so the duplicate-key check, stays PyYAML's own
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class StrictLoader(base):
        yaml_implicit_resolvers = _plain_numbers_only(base.yaml_implicit_resolvers)

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

        def construct_plain_int(self, node) -> int:
            text = self.construct_scalar(node)
            problem = _int_problem(text)
            if problem is not None:
                raise NumberError(None, None, problem, node.start_mark)
            return int(text)

    StrictLoader.add_implicit_resolver(INT_TAG, PLAIN_INT, list(INT_FIRST_CHARS))
    StrictLoader.add_implicit_resolver(FLOAT_TAG, PLAIN_FLOAT, list(FLOAT_FIRST_CHARS))
    StrictLoader.add_constructor(INT_TAG, StrictLoader.construct_plain_int)  # also an explicit `!!int 0x10`
    return StrictLoader


def safe_load_strict(text: str) -> Any:
    """Like yaml.safe_load, refusing duplicate keys and reading numbers only in their plain spellings; raises
    yaml.YAMLError (or RecursionError when nested absurdly)."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
