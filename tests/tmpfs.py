"""A small tmpfs for full-disk tests (mounting needs root; elsewhere the test skips)."""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def mounted_tmpfs(size_bytes: int, prefix: str) -> Iterator[Path]:
    mnt = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if result.returncode:
        mnt.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
        mnt.rmdir()


def fill(folder: Path) -> None:
    """Write a file in `folder` until the filesystem is full (ENOSPC)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as full:
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    assert full.value.errno == errno.ENOSPC
