"""The prompt cache's files (daemon/model/prompt_cache.py): a cache's arrays as host
bytes, safetensors written durably from them, headers read without MLX, and the writer
thread that writes them and keeps the folder within its bound.

The files are what mlx-lm's `save_prompt_cache` writes (its metadata layout, so that its
`load_prompt_cache` reads them back), written here from host buffers so that the writer
thread never touches MLX: only the engine thread does (`host_tensors`, while it is idle).

Each file carries a MAC over its metadata, and the metadata a digest of every block of
BLOCK_TOKENS tokens of each attention cache's keys and values (one digest for any other
array): a cache served for a prefix of a file's tokens reads and checks that prefix's
blocks only, not the whole file (a 587 MiB file read whole to reuse one token held 1.2 GiB).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import queue
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import KVCache

from ...shared.durable import fsync_dir, sync_file
from ...shared.small_file import read_small_file

# safetensors' dtype names, and the numpy dtype each is read as; bfloat16 goes out as its
# 16-bit pattern.
_CODES = {
    mx.float32: ("F32", np.float32),
    mx.float16: ("F16", np.float16),
    mx.bfloat16: ("BF16", np.uint16),
    mx.int32: ("I32", np.int32),
    mx.uint32: ("U32", np.uint32),
    mx.int64: ("I64", np.int64),
    mx.uint64: ("U64", np.uint64),
    mx.int16: ("I16", np.int16),
    mx.uint16: ("U16", np.uint16),
    mx.int8: ("I8", np.int8),
    mx.uint8: ("U8", np.uint8),
    mx.bool_: ("BOOL", np.bool_),
}
_NUMPY = dict(_CODES.values())
# The metadata key of a file's MAC (save_prompt_cache's metadata sits under "0.").
MAC_KEY = "0.mac"
# The metadata key of the block digests: {tensor: [tokens per block or 0, [digest, ...]]}.
BLOCKS_KEY = "0.blocks"
KEY_BYTES = 32
# Tokens per checked block of an attention cache's keys and values: a prefix read costs at
# most this many tokens more than it uses, and the digests of a 128k-token file stay
# under 100 KB of header per 48 layers.
BLOCK_TOKENS = 1024


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


def file_mac(key: bytes, metadata: dict[str, str], tensors: dict[str, tuple[str, list[int], Any]]) -> str:
    """HMAC-SHA256 over a file's metadata (but the MAC: the block digests included) and
    every tensor's name, dtype and shape: a file changed in any of them, in any block's
    bytes (its digest no longer holds), or made with another key, fails."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(json.dumps({k: v for k, v in metadata.items() if k != MAC_KEY}, sort_keys=True).encode())
    for name in sorted(tensors):
        code, shape, _ = tensors[name]
        mac.update(json.dumps([name, code, list(shape)]).encode())
    return mac.hexdigest()


def _token_blocked(name: str, shape: Sequence[int], classes: dict[str, str]) -> bool:
    """A KVCache layer's keys or values, [batch, heads, tokens, dim]: read by token blocks."""
    layer = name.split(".", 1)[0]
    return classes.get(layer) == "KVCache" and len(shape) == 4


def _classes(metadata: dict[str, str]) -> dict[str, str]:
    """Layer index -> cache class name, from save_prompt_cache's metadata ("1.<i>")."""
    return {k[2:]: v for k, v in metadata.items() if k.startswith("1.")}


def block_digests(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict[str, str]) -> str:
    """The BLOCKS_KEY entry for a file of `tensors`: the digest of each block of
    BLOCK_TOKENS tokens of an attention cache's keys and values (every row's slice of the
    block, in order), and of any other array whole."""
    classes = _classes(metadata)
    out: dict[str, list[Any]] = {}
    for name, (code, shape, data) in tensors.items():
        if not _token_blocked(name, shape, classes) or not len(data):
            out[name] = [0, [hashlib.sha256(data).hexdigest()]]
            continue
        rows = np.frombuffer(data, dtype=np.uint8).reshape(shape[0] * shape[1], shape[2], -1)
        out[name] = [BLOCK_TOKENS, [_digest(rows, j, BLOCK_TOKENS) for j in range(0, shape[2], BLOCK_TOKENS)]]
    return json.dumps(out, separators=(",", ":"))


def _digest(rows: np.ndarray, start: int, width: int) -> str:
    h = hashlib.sha256()
    for row in rows:
        h.update(row[start : start + width].tobytes())
    return h.hexdigest()


def load_cache_file(
    path: Path, key: bytes, limit: int, upto: int | None = None
) -> tuple[list[Any], dict[str, str], int]:
    """A cache file read back (as mlx-lm's `load_prompt_cache` reads it) once its MAC and
    the digests of what was read hold: whole, or with `upto` and a file of attention
    caches only, its first `upto` tokens (the blocks that hold them). Returns the cache,
    its metadata and the bytes read; raises ValueError for a file not ours as written."""
    with _opened(path) as (f, st):
        fd = f.fileno()
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than the folder's bound")
        header, n = _header(f, limit)
        flat = header.pop("__metadata__", {})
        tensors = {name: (info["dtype"], info["shape"], info["data_offsets"]) for name, info in header.items()}
        if not hmac.compare_digest(str(flat.get(MAC_KEY, "")), file_mac(key, flat, tensors)):
            raise ValueError("its MAC does not hold (changed since written, or not written with this user's key)")
        blocks = json.loads(flat.get(BLOCKS_KEY, "{}"))
        classes = _classes(flat)
        if upto is not None and set(classes.values()) != {"KVCache"}:
            upto = None  # only attention caches hold a prefix of themselves
        body = 8 + n
        arrays: dict[str, Any] = {}
        nread = 8 + n
        for name, (code, shape, (start, stop)) in tensors.items():
            width, digests = blocks.get(name, [0, []])
            item = np.dtype(_NUMPY[code]).itemsize
            if not 0 <= start <= stop <= st.st_size - body or stop - start != item * math.prod(shape):
                raise ValueError(f"tensor {name} lies outside the file or is not its shape's size")
            if width and _token_blocked(name, shape, classes):
                raw, took = _read_blocks(fd, body + start, shape, item, width, digests, upto, name)
                nread += took
                host = raw.view(_NUMPY[code]).reshape(shape[0], shape[1], raw.shape[1], *shape[3:])
            else:
                data = os.pread(fd, stop - start, body + start)
                if len(data) != stop - start or [hashlib.sha256(data).hexdigest()] != digests:
                    raise ValueError(f"tensor {name}: its digest does not hold")
                host = np.frombuffer(data, dtype=_NUMPY[code]).reshape(shape)
                nread += len(data)
            a = mx.array(host)
            arrays[name] = a.view(mx.bfloat16) if code == "BF16" else a
    metadata, class_list, scalars = tree_unflatten(list(flat.items()))
    for pos, kind in scalars[1:]:
        a = arrays[pos]
        arrays[pos] = a.item() if kind == "scalar" else "".join(map(chr, a.tolist())) if kind == "string" else None
    states = tree_unflatten(list(arrays.items()))
    if upto is not None:
        # A prefix: each KVCache's offset (its state's third item) is the tokens read, not the file's.
        states = [[s[0], s[1], s[0].shape[2], *s[3:]] if len(s) >= 3 else s for s in states]
    cache = [getattr(mlx_lm_cache, c).from_state(state) for c, state in zip(class_list, states)]
    return cache, metadata, nread


def _read_blocks(
    fd: int, at: int, shape: list[int], item: int, width: int, digests: list[str], upto: int | None, name: str
) -> tuple[np.ndarray, int]:
    """An attention cache's keys or values, [batch, heads, tokens, dim], read row by row
    up to the end of the block holding token `upto` (all tokens without it), each block
    checked against its digest; returned as bytes [rows, upto, dim * item], with the
    bytes read."""
    rows, tokens, stride = shape[0] * shape[1], shape[2], math.prod(shape[3:]) * item
    if len(digests) != -(-tokens // width):
        raise ValueError(f"tensor {name}: {len(digests)} block digests for {tokens} tokens")
    want = tokens if upto is None else min(upto, tokens)
    span = min(tokens, -(-want // width) * width)
    out = np.empty((rows, span, stride), dtype=np.uint8)
    for r in range(rows):
        data = os.pread(fd, span * stride, at + r * tokens * stride)
        if len(data) != span * stride:
            raise ValueError(f"tensor {name}: the file ends early")
        out[r] = np.frombuffer(data, dtype=np.uint8).reshape(span, stride)
    for b, start in enumerate(range(0, span, width)):
        if _digest(out, start, width) != digests[b]:
            raise ValueError(f"tensor {name}: block {b}'s digest does not hold")
    return out[:, :want], out.nbytes


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
        if a.dtype not in _CODES:
            raise ValueError(f"cache array of dtype {a.dtype} cannot be saved")
        code = _CODES[a.dtype][0]
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


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[tuple[Any, os.stat_result]]:
    """`path` open for reading, a regular file only, opened without following a link or
    blocking (a FIFO put here would hang the engine for good); and its stat."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        yield f, st


def _header(f: Any, limit: int) -> tuple[dict[str, Any], int]:
    """The JSON header of the safetensors file `f` (read from its start), and its bytes."""
    head = f.read(8)
    if len(head) != 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > min(limit, 64 * 2**20):
        raise ValueError(f"a header of {n} bytes")
    return json.loads(f.read(n)), n


def read_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (what `save_prompt_cache` calls metadata:
    the entries under "0."), read from its header alone."""
    with _opened(path) as (f, _):
        header, _ = _header(f, 64 * 2**20)
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
                job.meta[BLOCKS_KEY] = block_digests(job.tensors, job.meta)
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
