"""Getting bytes and renames onto the disk: the one place that syncs files.

On macOS `fsync` only hands the data to the drive, whose cache may still lose it at a
power cut; `fcntl(F_FULLFSYNC)` asks the drive to flush that cache too. Some
filesystems (network shares, FAT) refuse F_FULLFSYNC, and then plain `fsync` is the
best there is. Linux's `fsync` already flushes the drive's cache.

After `os.replace` into a folder, the folder itself is synced too (`fsync_dir`), or a
crash can lose the rename even though the file's bytes reached the disk.

Every sync in the project goes through `sync_fd` (a test greps for bare `os.fsync`).
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

FULLFSYNC = "F_FULLFSYNC"
FSYNC = "fsync"


def sync_fd(fd: int, *, platform: str | None = None) -> str:
    """Make what was written to `fd` durable; returns how: "F_FULLFSYNC" or "fsync".

    `platform` is `sys.platform` unless given. Raises OSError when even fsync fails."""
    platform = sys.platform if platform is None else platform
    full = getattr(fcntl, FULLFSYNC, None)  # only macOS's Python has it
    if platform == "darwin" and full is not None:
        try:
            fcntl.fcntl(fd, full)
        except OSError:
            # ENOTSUP and the like on filesystems without it; fsync's own error, if
            # any, is the one the caller reports.
            os.fsync(fd)
            return FSYNC
        return FULLFSYNC
    os.fsync(fd)
    return FSYNC


def sync_file(f) -> str:
    """`sync_fd` for an open Python file object, after flushing its buffer."""
    f.flush()
    return sync_fd(f.fileno())


def fsync_dir(folder: str | os.PathLike) -> None:
    fd = os.open(Path(folder), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sync_fd(fd)
    finally:
        os.close(fd)
