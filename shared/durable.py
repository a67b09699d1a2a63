"""Making renames durable: after `os.replace` into a folder, fsync the folder itself,
or a crash can lose the rename even though the file's bytes reached the disk."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(folder: str | os.PathLike) -> None:
    fd = os.open(Path(folder), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
