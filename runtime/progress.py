"""How long work reports its progress: a `Track` opens a display for one piece of work and yields `advance`.

    with track("prefill", total=n_prompt_tokens, predicted_s=predicted_ttft_s) as advance:
        ...  # advance(tokens) after each chunk

The runtime calls it; the CLI passes render.Output.progress (a progress bar on a terminal, with the ETA from
`predicted_s`, shown only for long work), the library's callers nothing (`no_track`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator

Advance = Callable[[int], None]
# track(description, total steps, predicted seconds or None) -> a context manager yielding advance(steps done)
Track = Callable[[str, int, "float | None"], AbstractContextManager[Advance]]


@contextmanager
def no_track(description: str, total: int, predicted_s: float | None = None) -> Iterator[Advance]:
    """A Track that shows nothing."""
    yield lambda steps: None
