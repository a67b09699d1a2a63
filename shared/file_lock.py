"""Waiting for an exclusive `flock` with a deadline (the kernel drops it when the holder
dies, even by SIGKILL)."""

from __future__ import annotations

import fcntl
import time
from typing import Callable

POLL_SECONDS = 0.02


def lock_exclusive(fd: int, timeout: float, should_stop: Callable[[], bool] | None = None) -> bool:
    """Take an exclusive flock on `fd`, retrying until `timeout` seconds have passed or
    `should_stop()` says to give up; True when taken. Other OS errors propagate."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if (should_stop is not None and should_stop()) or time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
