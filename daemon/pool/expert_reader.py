"""Reads experts from a store's layer files into pool slots, through the native engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..._native import ReadEngine
from ...shared.store_format import ABSENT, Manifest, MoELayer, permission_advice


class ExpertReadError(RuntimeError):
    """An expert could not be read; the message names the layer, the expert and why."""


@dataclass(frozen=True)
class ReadJob:
    """One expert to read, and where each of its tensors goes."""

    layer: MoELayer
    expert: int
    # (destination buffer, byte offset in it, byte offset in the expert block, bytes)
    targets: Sequence[tuple[Any, int, int, int]]


class ExpertReader:
    """Owns the native read engine and the open layer files of one store."""

    def __init__(
        self,
        store_dir: str | Path,
        manifest: Manifest,
        *,
        threads: int = 4,
        direct: bool = True,
        verify: bool = False,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.verify = verify
        self.engine = ReadEngine(threads=threads, direct=direct, verify=verify)
        self._fids: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        for layer in manifest.layers:
            path = self.store_dir / layer.file
            try:
                fid = self.engine.open(str(path))
            except OSError as e:
                self.engine.close()
                raise ExpertReadError(
                    f"cannot open expert file of layer {layer.module_path}: {e}{permission_advice(e)}"
                ) from e
            self._fids[layer.file] = fid
            self._sizes[layer.file] = int(self.engine.file_info(fid)["size"])

    def file_id(self, layer: MoELayer) -> int:
        """The engine's id of this layer's expert file (for reads submitted directly)."""
        return self._fids[layer.file]

    def read(self, jobs: Sequence[ReadJob]) -> list[tuple[ReadJob, str]]:
        """Read every job, in parallel; return the jobs that failed with their errors."""
        failed: list[tuple[ReadJob, str]] = []
        batch, submitted = [], []
        for job in jobs:
            entry = job.layer.experts[job.expert]
            if entry.offset == ABSENT:  # never asked of a rank's share; said plainly if it is
                failed.append((job, f"expert {job.expert} of {job.layer.module_path} is not in this shard store"))
                continue
            size = self._sizes[job.layer.file]
            if entry.offset + entry.length > size:
                size = self._reopen_if_grown(job.layer.file)
            if entry.offset + entry.length > size:
                failed.append(
                    (
                        job,
                        f"{self.store_dir / job.layer.file} is truncated: {size} bytes, the expert "
                        f"lies at offset {entry.offset} length {entry.length}",
                    )
                )
                continue
            submitted.append(job)
            batch.append(
                (
                    self._fids[job.layer.file],
                    entry.offset,
                    entry.length,
                    list(job.targets),
                    entry.crc32 if self.verify else None,
                )
            )
        if not batch:
            return failed
        ids = self.engine.submit_batch(batch)
        done = {c.id: c for c in self.engine.wait(ids)}
        for rid, job in zip(ids, submitted):
            c = done[rid]
            if not c.ok:
                failed.append((job, c.error))
        return failed

    # ---- reads that run while the caller goes on (the prefetcher's) ------------------

    def submit(self, batch: Sequence[tuple[int, int, int, list[tuple[Any, int, int, int]], int | None]]) -> list[int]:
        """Start these reads ((file id, offset, length, targets, crc32 or None) each) on
        the engine's threads and return their ids, without waiting. Raises ValueError for
        a read the engine refuses (beyond its file's end)."""
        return self.engine.submit_batch(batch)

    def poll(self, rid: int) -> Any:
        """The completion of read `rid` (its `ok`, `nbytes`, `error`) if it has ended,
        else None."""
        return self.engine.take(rid)

    def wait(self, rids: Sequence[int]) -> list[Any]:
        """Wait for these reads; their completions, in order."""
        return self.engine.wait(list(rids))

    def _reopen_if_grown(self, name: str) -> int:
        """A file that was short when opened may have been repaired since (rewritten in
        place or replaced): if it is now longer, read it through a fresh descriptor, since
        the engine keeps the size it saw at open. Returns the size to check against."""
        path = self.store_dir / name
        try:
            grown = os.stat(path).st_size > self._sizes[name]
        except OSError:
            return self._sizes[name]
        if grown:
            try:
                fid = self.engine.open(str(path))
            except OSError:
                return self._sizes[name]
            # The old descriptor stays open in the engine (it has no per-file close); one
            # per repair.
            self._fids[name] = fid
            self._sizes[name] = int(self.engine.file_info(fid)["size"])
        return self._sizes[name]

    def stats(self) -> dict[str, Any]:
        return dict(self.engine.stats())

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "ExpertReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
