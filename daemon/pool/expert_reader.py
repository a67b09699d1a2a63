"""Reads experts from a store's layer files into pool slots, through the native engine.

Each file's size and modification time are taken when it is opened and looked at again
after each read batch (a stat, microseconds): a file written over in place since (the
same inode) is checked once, all of it, against the manifest's checksums. If every
expert matches (a file restored, or a short one repaired), reads go on (through a fresh
descriptor where it grew); if not, every read of it is refused, naming the file and the
first expert that differs, rather than served silently wrong, until it matches again or
the daemon restarts. A file replaced by another (a new inode) or deleted is still read
through the descriptor opened on the old one, whose bytes have not changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..._native import ReadEngine, crc32
from ...shared.store_format import ABSENT, Manifest, MoELayer, permission_advice


class ExpertReadError(RuntimeError):
    """An expert could not be read; the message names the layer, the expert and why."""


@dataclass(frozen=True)
class FileStamp:
    """What a layer file was when opened: its inode, size and modification time."""

    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> "FileStamp":
        st = os.stat(path)
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


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
        self._stamps: dict[str, FileStamp] = {}
        self._layers: dict[str, MoELayer] = {}
        # Each file's path as a string: `changed` stats it after every batch of reads.
        self._paths: dict[str, str] = {}
        # Files found changed and not as the manifest describes them: the stamp seen, and why.
        self._refused: dict[str, tuple[FileStamp, str]] = {}
        for layer in manifest.layers:
            path = self.store_dir / layer.file
            try:
                stamp = FileStamp.of(path)
                fid = self.engine.open(str(path))
            except OSError as e:
                self.engine.close()
                raise ExpertReadError(
                    f"cannot open expert file of layer {layer.module_path}: {e}{permission_advice(e)}"
                ) from e
            self._fids[layer.file] = fid
            self._sizes[layer.file] = int(self.engine.file_info(fid)["size"])
            self._stamps[layer.file] = stamp
            self._layers[layer.file] = layer
            self._paths[layer.file] = str(path)

    def request(self, layer: MoELayer, expert: int, targets: Sequence[tuple[Any, int, int, int]]) -> tuple:
        """The engine's read of `expert` into `targets` (`ReadJob.targets`), for `submit`."""
        entry = layer.experts[expert]
        return (self._fids[layer.file], entry.offset, entry.length, list(targets), entry.crc32 if self.verify else None)

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
            batch.append(self.request(job.layer, job.expert, job.targets))
        if not batch:
            return failed
        ids = self.engine.submit_batch(batch)
        done = {c.id: c for c in self.engine.wait(ids)}
        # After the reads: a file written over before they ended may have given them its new bytes.
        changed = {name: self.changed(name) for name in {job.layer.file for job in submitted}}
        for rid, job in zip(ids, submitted):
            c = done[rid]
            if not c.ok:
                failed.append((job, c.error))
            elif changed[job.layer.file] is not None:
                failed.append((job, changed[job.layer.file]))
        return failed

    def changed(self, name: str) -> str | None:
        """Why file `name` can no longer be read for its experts (written over in place
        since it was opened, and not as the manifest describes it), else None."""
        path = self._paths[name]
        try:
            now = FileStamp.of(path)
        except OSError:
            return None  # deleted: the descriptor still reads the file as it was
        was = self._stamps[name]
        if now.inode != was.inode or now == was:
            return None  # replaced (the descriptor reads the old one), or unchanged
        refused = self._refused.get(name)
        if refused is not None and refused[0] == now:
            return refused[1]
        differs = self._differs(name)
        if differs is None:  # restored, or a short file repaired: read on, as it is now
            self._refused.pop(name, None)
            self._stamps[name] = now
            self._reopen_if_grown(name)
            return None
        why = (
            f"{path} was changed on disk after the daemon opened it ({was.size} -> {now.size} bytes, its "
            f"modification time too) and {differs}: served, it would answer wrong; put the store's file back, or "
            "convert the store again and restart the daemon (`moestreamctl restart`)"
        )
        self._refused[name] = (now, why)
        return why

    def _differs(self, name: str) -> str | None:
        """Where file `name` is not what the manifest describes (its first expert cut
        short or whose checksum differs), else None: one pass over it."""
        try:
            with open(self.store_dir / name, "rb") as f:
                for e, x in enumerate(self._layers[name].experts):
                    if x.offset == ABSENT:
                        continue
                    data = os.pread(f.fileno(), x.length, x.offset)
                    if len(data) < x.length:
                        return f"expert {e} is cut short"
                    if crc32(data) != x.crc32:
                        return f"expert {e} no longer matches its checksum in the manifest"
        except OSError as e:
            return f"it cannot be read ({e.strerror})"
        return None

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
            try:  # what it reads now
                self._stamps[name] = FileStamp.of(path)
            except OSError:
                pass
        return self._sizes[name]

    def stats(self) -> dict[str, Any]:
        return dict(self.engine.stats())

    def close(self) -> None:
        self.engine.close()
