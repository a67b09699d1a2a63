"""The heat file, `<store>/pool_usage.json`: routing counts per MoE layer and expert.

Format: `{"<layer>": {"<expert>": count}}`, layers and experts as canonical decimal
strings, counts non-negative integers. Nothing else lives at the top level. Each rank of
an expert-parallel group keeps a file of its own, of its own experts (`usage_name`).

Reading never trusts the file: a file that is not exactly that shape is moved aside to
`pool_usage.json.corrupt-<UTC time>` and reported in the returned `UsageLoad`, and counting
starts from zero. Writing is atomic (temporary file in the same folder, fsync, rename,
fsync of the folder): after a crash at any instant the file is either the previous
complete version or the new complete version. A failed write raises `HeatWriteError`
and leaves the previous file untouched.

One writer at a time: the heat keeper holds `UsageLock` while it writes the file, so a
keeper that outlived its daemon finishes its last write before a new one loads the file.
A keeper that cannot have the lock (a second daemon on the same store) writes its counts
to a pending file of its own, `pool_usage.json.pending-<pid>-<random>`, in the same
format, and holds that file's own lock (`<pending>.lock`) while it lives; whichever
keeper next takes the heat file's lock adds every pending file whose owner is gone
(`orphaned_pending_files`) into the heat file and then removes them. A live owner adds
its own once it gets the lock. A crash between that write and the removal counts a
pending file twice; no order of the two can lose it instead.

This module imports no MLX and no ZeroMQ.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

from .durable import fsync_dir, sync_fd
from .file_lock import lock_exclusive
from .small_file import NotARegularFile, read_small_file
from .store_format import POOL_USAGE_NAME

# Ids above this are not a model's layers or experts: such a file is corrupt.
MAX_ID = 1 << 20
# Far more than any model's table (layers x experts x about 16 bytes): a larger file is
# not read into memory.
MAX_HEAT_BYTES = 32 * 2**20
# Counts must fit an int64 so every reader (numpy included) can hold them.
MAX_COUNT = (1 << 63) - 1

UsageCounts = dict[int, dict[int, int]]


class HeatFileError(OSError):
    """An operating-system error while reading or writing the heat file.

    `errno`, `strerror` and `filename` are those of the failing call; `str()` also says
    what was being done and what happened to the previous file.
    """

    def __init__(self, action: str, path: Path | str, cause: OSError, consequence: str = "") -> None:
        err = cause.errno if cause.errno is not None else errno.EIO
        super().__init__(err, cause.strerror or os.strerror(err), str(path))
        self.action = action
        self.consequence = consequence

    def __str__(self) -> str:
        tail = f"; {self.consequence}" if self.consequence else ""
        return f"[heat_file] {self.action} {self.filename}: {self.strerror} (errno {self.errno}){tail}"


class HeatWriteError(HeatFileError):
    """`write_usage` failed; the previous file is intact and no temporary file is left."""


class HeatReadError(HeatFileError):
    """The heat file exists but cannot be read (permissions, I/O error)."""


class HeatLockTimeout(TimeoutError):
    """Another process (another heat keeper) holds the heat file's lock; `holder` is its
    pid where the lock file names one."""

    def __init__(self, message: str, holder: int | None = None) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class UsageLoad:
    """What `read_usage` found.

    `problem` is None when the file was valid or absent. When it is set the caller must
    report it; `set_aside` is where the unusable file now lies (None if it could not be
    moved, which `problem` then says too).
    """

    path: Path
    counts: UsageCounts = field(default_factory=dict)
    set_aside: Path | None = None
    problem: str | None = None

    @property
    def total(self) -> int:
        return sum(sum(layer.values()) for layer in self.counts.values())


def usage_name(rank: int | None = None, size: int | None = None) -> str:
    """The heat file's name: `pool_usage.json` for one process; for rank `rank` of an
    expert-parallel group of `size`, `pool_usage.rank<rank>of<size>.json`, which holds
    only that rank's experts (by their global ids): each rank counts and writes its own,
    so two ranks never write one file, and a group of another size starts afresh."""
    if rank is None or size is None:
        return POOL_USAGE_NAME
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    stem, dot, ext = POOL_USAGE_NAME.rpartition(".")
    return f"{stem}.rank{rank}of{size}{dot}{ext}"


def add_counts(into: UsageCounts, counts: Mapping[int, Mapping[int, int]]) -> None:
    """Add `counts` into `into`, layer by layer and expert by expert."""
    for layer, experts in counts.items():
        target = into.setdefault(layer, {})
        for expert, c in experts.items():
            target[expert] = target.get(expert, 0) + c


def usage_path(store_dir: Path | str, name: str = POOL_USAGE_NAME) -> Path:
    return Path(store_dir) / name


def group_usage(folder: Path | str) -> tuple[UsageCounts, list[Path]]:
    """The summed heat of the last expert-parallel group that kept its heat in `folder`
    (the group size whose newest rank file is the newest; ranks own disjoint experts, so
    their counts add up to the model's), and the files read; ({}, []) where none did.
    Read only, never set aside (a corrupt file is the daemon's to deal with): ValueError
    names the file that does not parse."""
    stem, dot, ext = POOL_USAGE_NAME.rpartition(".")
    pattern = re.compile(rf"^{re.escape(stem)}\.rank(\d+)of(\d+){re.escape(dot + ext)}$")
    groups: dict[int, list[tuple[float, Path]]] = {}
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return {}, []
    for entry in entries:
        m = pattern.match(entry.name)
        if m and int(m[1]) < int(m[2]) and entry.is_file(follow_symlinks=False):
            groups.setdefault(int(m[2]), []).append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
    if not groups:
        return {}, []
    size = max(groups, key=lambda n: max(t for t, _ in groups[n]))
    paths = sorted(p for _, p in groups[size])
    total: UsageCounts = {}
    for path in paths:
        try:
            counts = peek_usage(path)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        for layer, experts in counts.items():
            into = total.setdefault(layer, {})
            for expert, count in experts.items():
                into[expert] = min(into.get(expert, 0) + count, MAX_COUNT)
    return total, paths


# The path is a link, not a regular file, or too large to be a heat file (`read_small_file`
# opens it without following links and without blocking, and reads none of those).
NotAHeatFile = NotARegularFile


def peek_usage(path: Path | str) -> UsageCounts:
    """The heat file's counts, read only and never set aside (a corrupt file is the
    daemon's to deal with): for `plan`, `heatmap` and the dashboard. FileNotFoundError
    where it is missing; ValueError where it is not a heat file or does not parse; it is
    opened as the daemon opens it (`read_small_file`), so a link planted in its place is
    not followed."""
    return parse_usage(read_small_file(path, MAX_HEAT_BYTES))


def read_usage(path: Path | str, shape: Mapping[int, int] | None = None) -> UsageLoad:
    """Load the heat file. Missing -> empty. Corrupt -> set aside, empty, `problem` set.

    `shape` ({layer: number of experts}, from the manifest) makes a file that names any
    other layer or expert corrupt too (one heat folder shared by two stores). Never
    trusted further than that: a symlink, a FIFO, a device or a file over
    MAX_HEAT_BYTES is not read at all (`NotAHeatFile`) and is set aside like a corrupt file.

    Raises `HeatReadError` only when the file exists but the OS refuses to read it: that
    is not a corrupt file, and moving it aside would hide a failing disk.
    """
    path = Path(path)
    try:
        raw = read_small_file(path, MAX_HEAT_BYTES)
    except FileNotFoundError:
        return UsageLoad(path)
    except NotAHeatFile as e:
        return _set_aside(path, b"", str(e))
    except OSError as e:
        raise HeatReadError("cannot read heat file", path, e, "fix the file or its permissions, or remove it") from e
    try:
        counts = parse_usage(raw)
        if shape is not None:
            check_shape(counts, shape)
    except ValueError as e:
        return _set_aside(path, raw, str(e))
    return UsageLoad(path, counts)


def check_shape(counts: UsageCounts, shape: Mapping[int, int]) -> None:
    """`ValueError` for a layer the model lacks, or an expert id past its layer's count."""
    for layer, experts in counts.items():
        if layer not in shape:
            raise ValueError(f"layer {layer} is not a MoE layer of this store (it has {sorted(shape)[:8]}...)")
        bad = [e for e in experts if e >= shape[layer]]
        if bad:
            raise ValueError(f"layer {layer} expert {bad[0]} is past the layer's {shape[layer]} experts")


def parse_usage(raw: bytes) -> UsageCounts:
    """Parse and validate the file's bytes; `ValueError` says what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"top level is a JSON {type(data).__name__}, expected an object of layers")
    counts: UsageCounts = {}
    for layer_key, experts in data.items():
        layer = _parse_id(layer_key, "layer")
        if not isinstance(experts, dict):
            raise ValueError(f"layer {layer_key!r}: expected an object of experts, got {type(experts).__name__}")
        layer_counts: dict[int, int] = {}
        for expert_key, count in experts.items():
            expert = _parse_id(expert_key, f"layer {layer_key!r} expert")
            if type(count) is not int or not 0 <= count <= MAX_COUNT:
                raise ValueError(
                    f"layer {layer_key!r} expert {expert_key!r}: count {count!r} is not a non-negative integer"
                )
            layer_counts[expert] = count
        counts[layer] = layer_counts
    return counts


def _parse_id(key: str, what: str) -> int:
    # Canonical decimal only ("7", not "07", "+7" or " 7"), so each id has one spelling.
    if not (key.isascii() and key.isdigit() and len(key) <= 7 and (key[0] != "0" or key == "0")) or int(key) >= MAX_ID:
        raise ValueError(f"{what} key {key!r} is not a non-negative integer below {MAX_ID}")
    return int(key)


def _set_aside(path: Path, raw: bytes, why: str) -> UsageLoad:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() // 1000 % 1_000_000:06d}Z"
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    try:
        os.rename(path, target)
    except OSError as e:
        problem = (
            f"{path} is corrupt ({why}, {len(raw)} bytes) and could not be moved aside to {target.name}: "
            f"{e.strerror}; counting starts from zero and the next write will replace it"
        )
        return UsageLoad(path, {}, None, problem)
    problem = f"{path} was corrupt ({why}, {len(raw)} bytes); moved aside to {target}; counting starts from zero"
    return UsageLoad(path, {}, target, problem)


def write_usage(path: Path | str, counts: Mapping[int, Mapping[int, int]]) -> int:
    """Write `counts` atomically to `path`; returns the bytes written.

    Experts with a zero count are left out. On any OS failure the temporary file is
    removed, the previous file is left as it was, and `HeatWriteError` is raised.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    step = "cannot create temporary file for"
    written = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            step = "cannot write"
            for chunk in _encode(counts):
                data = chunk.encode()
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                written += len(data)
            step = "cannot fsync"
            sync_fd(fd)
        finally:
            os.close(fd)
        step = "cannot rename temporary file over"
        os.replace(tmp, path)
    except OSError as e:
        _remove_quietly(tmp, e)
        raise HeatWriteError(step, path, e, "the previous heat file is unchanged") from e
    except ValueError as e:  # a bad argument, found while encoding
        _remove_quietly(tmp, e)
        raise
    try:
        fsync_dir(path.parent)
    except OSError as e:
        raise HeatWriteError(
            "cannot fsync the folder of", path, e, "the new file is in place but may not survive a power loss"
        ) from e
    return written


def _encode(counts: Mapping[int, Mapping[int, int]]) -> Iterator[str]:
    """The file's text, one chunk per layer, validated and in numeric order.

    Lazy, so a large table is never held twice in memory.
    """
    yield "{"
    first = True
    for layer in sorted(counts):
        if type(layer) is not int or not 0 <= layer < MAX_ID:
            raise ValueError(f"[write_usage] layer {layer!r} is not an integer in [0, {MAX_ID})")
        items = []
        for expert in sorted(counts[layer]):
            count = counts[layer][expert]
            if type(expert) is not int or not 0 <= expert < MAX_ID:
                raise ValueError(f"[write_usage] layer {layer} expert {expert!r} is not an integer in [0, {MAX_ID})")
            if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_COUNT:
                raise ValueError(
                    f"[write_usage] layer {layer} expert {expert}: count {count!r} is not a non-negative int64"
                )
            if count:
                items.append(f'"{expert}":{int(count)}')
        yield ("" if first else ",") + f'"{layer}":{{' + ",".join(items) + "}"
        first = False
    yield "}\n"


def _remove_quietly(tmp: Path, cause: Exception) -> None:
    """Remove a failed write's temporary file; a failure to do so joins the raised error."""
    try:
        tmp.unlink()
    except FileNotFoundError:
        return
    except OSError as e:
        cause.add_note(f"also could not remove the temporary file {tmp}: {e.strerror}")


def temp_files(path: Path | str) -> list[Path]:
    """Temporary files that interrupted writes of `path` left behind (not those of its
    pending files, which a live keeper may be writing)."""
    path = Path(path)
    return sorted(p for p in path.parent.glob(f".{path.name}.*.tmp") if not p.name.startswith(f".{path.name}.pending-"))


def remove_temp_files(path: Path | str) -> list[Path]:
    """Delete what interrupted writes left behind. Only safe while holding `lock_usage`."""
    removed = []
    for tmp in temp_files(path):
        try:
            tmp.unlink()
        except FileNotFoundError:
            continue
        removed.append(tmp)
    return removed


def pending_path(path: Path | str) -> Path:
    """A new pending file's name for this process: never one an earlier process used."""
    path = Path(path)
    return path.with_name(f"{path.name}.pending-{os.getpid()}-{secrets.token_hex(4)}")


def orphaned_pending_files(path: Path | str) -> list[Path]:
    """The pending files of keepers that could not have the lock and are gone (their
    `.lock` is free): theirs to add to the heat file (see the module docstring)."""
    path = Path(path)
    out = []
    for p in sorted(path.parent.glob(f"{path.name}.pending-*")):
        if p.name.endswith(".lock") or ".corrupt-" in p.name:
            continue
        owner = UsageLock(p)
        try:
            owner.acquire(0.0)
        except HeatLockTimeout:
            continue  # its keeper lives, and adds it itself once it has the lock
        except HeatFileError:
            continue  # a lock file it must not use: left alone, and so is its data
        owner.release()
        out.append(p)
    return out


def remove_pending(pending: Path) -> None:
    """Remove a pending file whose counts the heat file now holds, with its lock and any
    temporary file its dead keeper left; OSError if the file itself stays."""
    pending.unlink(missing_ok=True)
    for leftover in [Path(str(pending) + ".lock"), *temp_files(pending)]:
        leftover.unlink(missing_ok=True)


class UsageLock:
    """An exclusive `flock` on `<file>.lock`, held by the one process that writes the file.

    The kernel drops it when the holder dies, even by SIGKILL.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(str(path) + ".lock")
        self._fd: int | None = None

    def acquire(self, timeout: float, should_stop: Callable[[], bool] | None = None) -> None:
        """Wait up to `timeout` seconds; `should_stop()` returning true abandons the wait."""
        try:
            # Never through a symlink someone planted: the pid written below would clobber
            # whatever it points to.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise HeatFileError("cannot open lock file", self.path, e, "is the store folder writable?") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            why = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}"
            cause = OSError(errno.EPERM, f"{why}; refusing to use it")
            raise HeatFileError("cannot use lock file", self.path, cause, "remove it, or set heat_dir")
        if not lock_exclusive(fd, timeout, should_stop):
            stopped = should_stop is not None and should_stop()
            holder = _read_pid(fd)
            os.close(fd)
            who = f"another heat keeper{f' (pid {holder})' if holder else ''}"
            raise HeatLockTimeout(
                f"[heat_file] {self.path} is held by {who}; "
                + (
                    "asked to stop while waiting for it"
                    if stopped
                    else f"not free after {timeout:.1f}s: is a second daemon running on this store?"
                ),
                holder,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def hottest(counts: Mapping[int, Mapping[int, int]], layer: int, n: int) -> list[int]:
    """The `n` most routed experts of `layer`, most routed first (ties: lower id first).

    Experts never routed are not returned, so the list may be shorter than `n`.
    """
    if n <= 0:
        return []
    layer_counts = counts.get(layer, {})
    ranked = sorted((e for e, c in layer_counts.items() if c > 0), key=lambda e: (-layer_counts[e], e))
    return ranked[:n]
