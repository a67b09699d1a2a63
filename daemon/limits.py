"""The daemon's open-file limit and how many client connections fit under it.

Every client connection holds a file descriptor; libzmq aborts the whole process when
`accept` fails with EMFILE (ipc_listener.cpp), so the daemon must never reach the
limit. Three guards, all in `Server`:

  max_connections   past this many connections, a new client's requests get a `busy`
                    error that says so (its connection stays open, so it can read it).
                    The setting is a cap: the daemon takes at most the room its
                    open-file limit leaves (`FileLimit.connection_room`: the soft limit
                    less what it holds itself, `RESERVED_FDS` and `BURST_FDS`), so on a
                    4096-file limit about 3,300;
  the file limit    a connection accepted into a descriptor within `BURST_FDS` of the
                    soft limit is shut down at once, and the socket file is renamed
                    away (`RuntimePaths.paused_socket`) so that nothing more can connect
                    (a client whose connection is shut reconnects at once: thousands of
                    them would otherwise keep libzmq accepting faster than the I/O thread
                    shuts, and one accept then fails with EMFILE). The name comes back
                    once the open files are below the line again; meanwhile a client
                    hears `busy` (client/client.py). Descriptors are allocated lowest
                    first, so an accepted descriptor's number is a bound on the files
                    open that no lost or late event can skew.

Importing mlx-lm sets the limit to (2048, 4096) (mlx_lm/utils.py, for models of many
files), so `FileLimit.raise_soft` runs at start and again after that import. Without
CAP_SYS_RESOURCE the lowered hard limit cannot be raised again: the daemon then has 4096
files, room for about 3,300 connections; the guards keep it alive past that.

What the guards cannot promise: libzmq accepts on its own I/O thread, and the file limit's
guard acts when the daemon's I/O thread reads the accept events. A client that opens
connections back to back, with no pause, while the machine is loaded enough to keep that
thread from running while libzmq accepts `BURST_FDS` of them, can still bring an accept to
EMFILE (on 2 cores with 8 busy processes beside the daemon at nice 19, 250 of the 512
came in before the guard acted). One that waits a millisecond between connects, as a
reconnect loop does, meets the guards (tests/reliability/test_limits.py).
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
    def soft() -> int:
        """The soft limit now (a large number where it is unlimited)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return UNLIMITED_SOFT if soft == resource.RLIM_INFINITY else soft

    @classmethod
    def connection_room(cls, fds_in_use: int) -> int:
        """How many connections fit under the soft limit now beside the `fds_in_use` the
        daemon holds itself, leaving RESERVED_FDS for its own later files and BURST_FDS
        for what libzmq accepts before the I/O thread hears of it."""
        return max(cls.soft() - RESERVED_FDS - BURST_FDS - fds_in_use, 0)

    @classmethod
    def past_the_line(cls, fd: int) -> bool:
        """Whether a connection accepted into descriptor `fd` is within BURST_FDS of the
        soft limit: every descriptor below it is in use (they are allocated lowest first)."""
        return fd >= cls.soft() - BURST_FDS

    @classmethod
    def below_the_line(cls, fds_open: int) -> bool:
        """Whether the process, holding `fds_open` descriptors, may take new connections
        again after `past_the_line`: half the reserve below that line."""
        return fds_open < cls.soft() - BURST_FDS - RESERVED_FDS // 2
