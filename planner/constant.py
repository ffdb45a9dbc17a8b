"""A constant a plan or an engine's rules use: its value, and where it comes from (a profile key, a planner name, the
request, an engine's source file)."""

from __future__ import annotations

from .record import record



@record
class Constant:
    """A constant a plan used: its value, and where it comes from."""

    value: int | float | str
    source: str

    def to_dict(self) -> dict:
        return {"value": self.value, "from": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "Constant":
        return cls(d["value"], str(d["from"]))


def constants(table: dict[str, dict]) -> dict[str, Constant]:
    """Constants written as {name: {"value": v, "from": where}} (how the planner's tables spell them), as records."""
    return {name: Constant(c["value"], c["from"]) for name, c in table.items()}
