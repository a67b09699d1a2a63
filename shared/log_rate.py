"""A logging filter that caps how many lines a logger writes per time window: a client
that sends junk as fast as it can must not fill the disk with the log lines about it."""

from __future__ import annotations

import logging
import time

NOTE_LOGGER = "moestream.log_rate"


class RateLimitFilter(logging.Filter):
    """At most `lines` records per logger name per `window` seconds; the first record of
    the next window is preceded by one line saying how many were left out. Put it on
    handlers: they filter before they take their lock, so that line can go out first."""

    def __init__(self, lines: int, window: float) -> None:
        super().__init__()
        self.lines = lines
        self.window = window
        self._windows: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        start, count = self._windows.get(record.name, (now, 0))
        if now - start >= self.window:
            self._windows[record.name] = (now, 0)
            if count > self.lines:
                # Its own logger: a handler's formatter may expect its own records' arguments
                # (uvicorn's access lines have five), which this line does not have.
                logging.getLogger(NOTE_LOGGER).warning(
                    "%d lines of %s's log left out in %.0f s", count - self.lines, record.name, now - start
                )
            start, count = self._windows[record.name]
        count += 1
        self._windows[record.name] = (start, count)
        return count <= self.lines
