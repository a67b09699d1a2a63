"""Reading a small file that another user (or a mistake) may have put something else in
its place: opened without blocking (a FIFO would hang the reader for good), optionally
without following a link, checked with fstat to be a regular file, and read up to a
bound (`/dev/zero` or a huge file would fill memory)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class NotARegularFile(ValueError):
    """The path is a link (where links are not followed), not a regular file, or too large."""


def read_small_file(path: str | os.PathLike, limit: int, *, follow_links: bool = False) -> bytes:
    """The file's bytes. FileNotFoundError where it is missing; `NotARegularFile` for a
    symlink (unless `follow_links`), a FIFO, a device or a file over `limit` bytes (none
    of them read); OSError where the OS refuses."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(Path(path), flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise NotARegularFile("a symbolic link, not a file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile("not a regular file")
        if st.st_size > limit:
            raise NotARegularFile(f"{st.st_size} bytes, over the limit of {limit}")
        raw = _read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(raw) > limit:  # it grew since fstat
        raise NotARegularFile(f"over the limit of {limit} bytes")
    return raw


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
