"""When the engine lets go of its model: `keep_alive` seconds after the daemon went idle.

A daemon started at login lives beside the user's other work all day; holding the model,
its pool, the host tier and MLX's caches between requests an hour apart costs that memory
for nothing. Ollama's convention: the model stays loaded `keep_alive` after the last
request (a request may carry its own, which then counts for the idle time after it), 0
unloads after each request, a negative value never. The engine thread (engine_loop.py)
owns a `KeepAlive`, tells it of each request (`request`) and, while no request is in
flight, asks it whether the time is up (`idle`, `due`); it then unloads and, for the next
request, loads again (warm from the heat: autopin pins the hottest experts again).

Only the engine thread calls it; `status` goes into the snapshot it publishes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import asdict

from ..shared.status import KeepAliveStatus, UnloadStats


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim): arrays freed
    by MLX's CPU allocator and the readers' buffers otherwise stay in the process's RSS.
    False where there is no such call (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


class KeepAlive:
    """The idle clock of one engine. Times are the caller's `time.monotonic()`."""

    def __init__(self, keep_alive_s: float) -> None:
        self.default_s = keep_alive_s
        # The keep_alive of the last request received (None: the daemon's setting).
        self._requested: float | None = None
        self.idle_since: float | None = None
        self.unloaded_at: float | None = None
        self.stats = UnloadStats()

    @property
    def seconds(self) -> float:
        """The keep_alive in force now: the last request's, else the setting (negative: never)."""
        return self.default_s if self._requested is None else self._requested

    def request(self, keep_alive_s: float | None) -> None:
        """A request came in: the daemon is busy, and its keep_alive counts from now on."""
        self._requested = keep_alive_s
        self.idle_since = None

    def idle(self, now: float) -> None:
        """Nothing is in flight: the clock starts, unless it already runs."""
        if self.idle_since is None:
            self.idle_since = now

    def due(self, now: float) -> bool:
        """Whether the model should be released now (the caller checks it is loaded)."""
        if self.idle_since is None or self.seconds < 0:
            return False
        return now - self.idle_since >= self.seconds

    def unloaded(self, now: float) -> None:
        self.unloaded_at = now
        self.stats.unloads += 1

    def loaded(self, seconds: float) -> None:
        """The model was loaded again for a request."""
        self.unloaded_at = None
        self.stats.reloads += 1
        self.stats.last_load_seconds = seconds

    def status(self, now: float) -> KeepAliveStatus:
        idle = None if self.idle_since is None else now - self.idle_since
        left = None
        if idle is not None and self.unloaded_at is None and self.seconds >= 0:
            left = max(self.seconds - idle, 0.0)
        return KeepAliveStatus(
            keep_alive_s=self.seconds,
            setting_s=self.default_s,
            idle_s=idle,
            unload_in_s=left,
            unloaded_s=None if self.unloaded_at is None else now - self.unloaded_at,
            **asdict(self.stats),
        )
