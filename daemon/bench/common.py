"""What the benchmarks share: their progress lines, and the settings' defaults and
capacity as the benchmarks read them (the product reads its settings through `Settings`)."""

from __future__ import annotations

import time
from typing import Any, Callable

from ...shared.settings import SettingsError, definition, knob


def timed_progress(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    """A `say(line)` that hands `progress` the line prefixed by the seconds since this
    call; with no `progress`, one that does nothing. Each stage says when it starts and
    ends, so that a long run shows where it is and a run cut short shows what it measured;
    the commands send these lines to stderr, which keeps --json output on stdout one JSON
    object."""
    start = time.perf_counter()

    def say(line: str) -> None:
        if progress is not None:
            progress(f"[{time.perf_counter() - start:7.1f} s] {line}")

    return say


def default_of(name: str) -> Any:
    """The default of setting or bench knob `name` (for the benches, whose settings start
    from the daemon's)."""
    try:
        return knob(name).default
    except KeyError:
        return definition(name).default


def parse_capacity(text: str | float | int | None) -> float | int | None:
    """'16' -> 16 slots per layer; '0.25' or '25%' -> a fraction of each layer's experts."""
    try:
        return definition("capacity").coerce(text)
    except SettingsError as e:
        raise SettingsError(f"--capacity: {e}") from None
