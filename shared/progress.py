"""Progress lines of the benchmarks: each stage says when it starts and ends, with the
seconds since the run began, so that a long run shows where it is and a run cut short
shows what it measured. The commands send these lines to stderr, which keeps --json
output on stdout one JSON object."""

from __future__ import annotations

import time
from typing import Callable


def timed_progress(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    """A `say(line)` that hands `progress` the line prefixed by the seconds since this
    call; with no `progress`, one that does nothing."""
    start = time.perf_counter()

    def say(line: str) -> None:
        if progress is not None:
            progress(f"[{time.perf_counter() - start:7.1f} s] {line}")

    return say
