"""The daemon's open-file limit and how many client connections fit under it.

Every client connection holds a file descriptor; libzmq aborts the whole process when
`accept` fails with EMFILE (ipc_listener.cpp), so the daemon must never reach the
limit. Two guards, both in `Server`:

  max_connections   past this many connections, a new client's requests get a `busy`
                    error that says so (its connection stays open, so it can read it);
  the file limit    past the limit less `RESERVED_FDS` (the store, the log, the heat
                    keeper's pipes, libzmq's own) and `BURST_FDS` (what libzmq accepts
                    before the I/O thread hears of it), a new connection is shut down
                    at once.

Importing mlx-lm sets the limit to (2048, 4096) (mlx_lm/utils.py, for models of many
files), so `FileLimit.raise_soft` runs at start and again after that import. Without
CAP_SYS_RESOURCE the lowered hard limit cannot be raised again: the daemon then has 4096
files, room for about 3,800 connections; the guards keep it alive past that.
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass

RESERVED_FDS = 256
# Connections libzmq may accept between two turns of the I/O thread in a burst.
BURST_FDS = 512
# macOS refuses a soft limit above OPEN_MAX even where the hard limit is unlimited.
MACOS_OPEN_MAX = 10240
# The soft limit asked for under an unlimited hard limit (Linux's default nr_open).
UNLIMITED_SOFT = 1 << 20


def _as_number(limit: int) -> float:
    return float("inf") if limit == resource.RLIM_INFINITY else float(limit)


@dataclass(frozen=True)
class FileLimit:
    """The limit the process started with; `raise_soft` brings the soft limit back up to
    that hard limit (or to the highest hard limit still allowed)."""

    original_hard: int

    @classmethod
    def at_start(cls) -> "FileLimit":
        return cls(resource.getrlimit(resource.RLIMIT_NOFILE)[1])

    def raise_soft(self, log: logging.Logger | None = None) -> int:
        """Raise the soft limit as far as allowed; returns it (RLIM_INFINITY: unlimited)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return soft
        # The hard limit the process started with first (only a privileged process may
        # raise it again after mlx-lm lowered it), then the one it has now.
        for want_hard in sorted({self.original_hard, hard}, key=_as_number, reverse=True):
            want_soft = want_hard if want_hard != resource.RLIM_INFINITY else UNLIMITED_SOFT
            if sys.platform == "darwin":
                want_soft = min(want_soft, MACOS_OPEN_MAX)
            if want_soft <= soft:
                break
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want_soft, want_hard))
            except (ValueError, OSError):
                continue
            if log is not None:
                log.info("open-file limit raised from %d to %d", soft, want_soft)
            break
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    @staticmethod
    def connection_room(fds_in_use: int) -> int:
        """How many descriptors connections may hold under the soft limit now, less
        BURST_FDS: libzmq accepts on its own thread and the I/O thread learns of each
        connection (and shuts it) only a little later, so a burst must fit in between."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return 1 << 30
        return max(soft - RESERVED_FDS - BURST_FDS - fds_in_use, 0)
