"""The prompt cache's files (daemon/model/prompt_cache.py): a cache's arrays as host
bytes, safetensors written durably from them, headers read without MLX, and the writer
thread that writes them and keeps the folder within its bound.

The files are what mlx-lm's `save_prompt_cache` writes (its metadata layout, so that its
`load_prompt_cache` reads them back), written here from host buffers so that the writer
thread never touches MLX: only the engine thread does (`host_tensors`, while it is idle).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import KVCache

from ...shared.durable import fsync_dir, sync_file
from ...shared.small_file import read_small_file

# safetensors' dtype names; bfloat16 goes out as its 16-bit pattern.
_DTYPES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.int32: "I32",
    mx.uint32: "U32",
    mx.int64: "I64",
    mx.uint64: "U64",
    mx.int16: "I16",
    mx.uint16: "U16",
    mx.int8: "I8",
    mx.uint8: "U8",
    mx.bool_: "BOOL",
}


_NUMPY = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I32": np.int32,
    "U32": np.uint32,
    "I64": np.int64,
    "U64": np.uint64,
    "I16": np.int16,
    "U16": np.uint16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
# The metadata key of a file's MAC (save_prompt_cache's metadata sits under "0.").
MAC_KEY = "0.mac"
KEY_BYTES = 32


def user_key(path: Path) -> bytes:
    """The user's key for the cache files' MACs: made on first use (0600, created new,
    never through a link), else read and refused unless it is the user's own, private."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(f"{path} is not a private file of this user")
            key = f.read(KEY_BYTES + 1)
        if len(key) != KEY_BYTES:
            raise ValueError(f"{path} does not hold a key of {KEY_BYTES} bytes")
        return key
    key = os.urandom(KEY_BYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        sync_file(f)
    return key


def file_mac(
    key: bytes, metadata: dict[str, str], tensors: dict[str, tuple[str, list[int], bytes | memoryview]]
) -> str:
    """HMAC-SHA256 over a file's metadata (but the MAC) and every tensor's name, dtype,
    shape and bytes: a file changed in any of them, or made with another key, fails."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(json.dumps({k: v for k, v in metadata.items() if k != MAC_KEY}, sort_keys=True).encode())
    for name in sorted(tensors):
        code, shape, data = tensors[name]
        mac.update(json.dumps([name, code, list(shape), len(data)]).encode())
        mac.update(data)
    return mac.hexdigest()


def load_cache_file(path: Path, key: bytes, limit: int) -> tuple[list[Any], dict[str, str]]:
    """A cache file read back (as mlx-lm's `load_prompt_cache` reads it) once its MAC
    holds; raises ValueError for a file that is not one of ours as written."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than the folder's bound")
        blob = f.read(limit + 1)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    body = memoryview(blob)[8 + n :]
    flat = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        start, stop = info["data_offsets"]
        if not 0 <= start <= stop <= len(body):
            raise ValueError(f"tensor {name} lies outside the file")
        tensors[name] = (info["dtype"], info["shape"], body[start:stop])
    if not hmac.compare_digest(str(flat.get(MAC_KEY, "")), file_mac(key, flat, tensors)):
        raise ValueError("its MAC does not hold (changed since written, or not written with this user's key)")
    arrays: dict[str, Any] = {}
    for name, (code, shape, data) in tensors.items():
        host = np.frombuffer(data, dtype=_NUMPY[code]).reshape(shape)
        a = mx.array(host)
        arrays[name] = a.view(mx.bfloat16) if code == "BF16" else a
    metadata, classes, scalars = tree_unflatten(list(flat.items()))
    for pos, kind in scalars[1:]:
        a = arrays[pos]
        arrays[pos] = a.item() if kind == "scalar" else "".join(map(chr, a.tolist())) if kind == "string" else None
    states = tree_unflatten(list(arrays.items()))
    cache = [getattr(mlx_lm_cache, c).from_state(state) for c, state in zip(classes, states)]
    return cache, metadata


def mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def host_tensors(
    cache: Sequence[Any], metadata: dict[str, str]
) -> tuple[dict[str, tuple[str, list[int], bytes]], dict[str, str]]:
    """A prompt cache as safetensors' tensors (dtype, shape, bytes) and the file's
    metadata, `metadata` included, as mlx-lm's `save_prompt_cache` makes them (so that
    its `load_prompt_cache` reads them back)."""
    scalars: list[Any] = [""]
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    cache = [_compact(c) for c in cache]
    flat = tree_flatten([c.state for c in cache])
    arrays = {}
    for key, data in flat:
        if isinstance(data, mx.array):
            arrays[key] = data
        elif isinstance(data, (bool, int, float)):
            scalars.append((key, "scalar"))
            arrays[key] = mx.array(data)
        elif isinstance(data, str):
            scalars.append((key, "string"))
            arrays[key] = mx.array([ord(ch) for ch in data])
        elif data is None:
            scalars.append((key, "none"))
            arrays[key] = mx.array([])
        else:
            raise ValueError(f"cache state of type {type(data).__name__} cannot be saved")
    mx.eval(list(arrays.values()))
    for key, a in arrays.items():
        code = _DTYPES.get(a.dtype)
        if code is None:
            raise ValueError(f"cache array of dtype {a.dtype} cannot be saved")
        host = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=True)
        tensors[key] = (code, list(a.shape), host.tobytes())
    meta = dict(tree_flatten([metadata, [type(c).__name__ for c in cache], scalars]))
    return tensors, {k: str(v) for k, v in meta.items()}


def _compact(c: Any) -> Any:
    """A KVCache's rows in use only (its buffer grows in steps of 256 tokens): the same
    cache as far as any read of it goes, in fewer bytes on disk."""
    if type(c) is KVCache and c.keys is not None and c.offset < c.keys.shape[2]:
        return KVCache.from_state((c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset))
    return c


def read_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (what `save_prompt_cache` calls metadata:
    the entries under "0."), read from its header alone."""
    # Regular files only, opened without following a link or blocking (a FIFO put here
    # would hang the engine for good).
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 64 * 2**20:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(f.read(n))
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict[str, str]) -> int:
    """Write a safetensors file durably: a temporary file, fsync, rename, fsync of the
    folder. Returns its size."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, (code, shape, data) in tensors.items():
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        # The conversation is in it (its tokens): readable by its owner only.
        # A new file, never one that is there (a link put in its place is removed, not followed).
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for _, _, data in tensors.values():
                f.write(data)
            sync_file(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return 8 + len(blob) + offset


@dataclass
class _Job:
    path: Path
    tokens: tuple[int, ...]
    tensors: dict[str, tuple[str, list[int], bytes]]
    meta: dict[str, str]


@dataclass
class DiskWriter:
    """The thread that writes prompt-cache files and keeps the folder within its bound
    (the store's files, oldest first). Reports back through `results()`."""

    folder: Path
    store_id: str | None
    max_bytes: int
    log: logging.Logger
    key: bytes = b""
    _jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _files: OrderedDict = field(default_factory=OrderedDict)  # path -> (tokens | None, bytes), oldest first
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prompt-cache-writer", daemon=True)
        self._thread.start()

    def known(self, files: list[tuple[Path, int]]) -> None:
        self._jobs.put(("known", files))

    def put(self, path: Path, tokens: tuple[int, ...], tensors: dict, meta: dict[str, str]) -> None:
        self._jobs.put(("write", _Job(path, tokens, tensors, meta)))

    def results(self) -> list[tuple[str, tuple[int, ...], Path, int, bool]]:
        out = []
        while True:
            try:
                out.append(self._out.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float) -> bool:
        self._jobs.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        while True:
            kind, job = self._jobs.get()
            if kind == "stop":
                return
            if kind == "known":
                for path, size in job:
                    self._files[path] = (None, size)
                continue
            tic = time.perf_counter()
            try:
                job.meta[MAC_KEY] = file_mac(self.key, job.meta, job.tensors)
                size = write_safetensors(job.path, job.tensors, job.meta)
            except OSError as e:
                self.log.error("prompt cache: cannot write %s: %s (errno %s)", job.path, e.strerror, e.errno)
                self._out.put(("error", job.tokens, job.path, 0, False))
                continue
            except Exception:  # the writer must outlive one bad job: later ones still get written
                self.log.exception("prompt cache: writing %s failed", job.path)
                self._out.put(("error", job.tokens, job.path, 0, False))
                continue
            self._files.pop(job.path, None)
            self._files[job.path] = (job.tokens, size)
            self._out.put(("written", job.tokens, job.path, size, job.meta.get("trimmable") == "1"))
            took = time.perf_counter() - tic
            self.log.debug("prompt cache: wrote %s (%d bytes) in %.3f s", job.path.name, size, took)
            self._bound()

    def _bound(self) -> None:
        total = sum(size for _, size in self._files.values())
        while total > self.max_bytes and self._files:
            path, (tokens, size) = self._files.popitem(last=False)
            total -= size
            try:
                meta_tokens = tokens
                if meta_tokens is None:
                    meta_tokens = tuple(json.loads(read_metadata(path)["tokens"]))
                path.unlink()
            except (OSError, ValueError, KeyError) as e:
                self.log.error("prompt cache: cannot remove %s to stay within the disk bound: %s", path, e)
                continue
            self._out.put(("removed", tuple(meta_tokens), path, size, False))


@dataclass
class WriteBudget:
    """Bytes of cache files handed to the writer today, against a daily allowance; kept
    in the folder (`BUDGET_FILE`), so that a restart does not start the day again."""

    per_day: int
    path: Path | None = None
    day: str = ""
    written: int = 0

    def attach(self, path: Path, log: logging.Logger) -> None:
        """Read the day's count from `path` (a missing or unreadable file: nothing yet)."""
        self.path = path
        try:
            kept = json.loads(read_small_file(path, 4096))
            self.day, self.written = str(kept["day"]), int(kept["bytes"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("prompt cache: %s is unreadable (%s); today's writes counted from 0", path, e)

    def take(self, nbytes: int) -> bool:
        """Whether `nbytes` more may be written today; if so they are counted."""
        today = time.strftime("%Y-%m-%d")
        if today != self.day:
            self.day, self.written = today, 0
        if self.written + nbytes > self.per_day:
            return False
        self.written += nbytes
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                tmp.unlink(missing_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump({"day": self.day, "bytes": self.written}, f)
                os.replace(tmp, self.path)
            except OSError:
                tmp.unlink(missing_ok=True)  # the count stays in memory; at worst a restart counts from 0
        return True
