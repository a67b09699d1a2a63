"""The prompt cache: KV caches of recent requests, kept for the next request that shares
a prefix with them (a chat's next turn resends the whole conversation; an agent and its
subagents send one long system prompt).

Why it works: a causal model's cache after tokens t[:m] depends on t[:m] alone, so a
new prompt that starts with t[:m] may start from that cache and prefill only the rest.
In memory the kept sequences are one radix tree of token segments (prompt_tree.py), each
segment holding its positions' keys and values once: a request takes the longest prefix
any branch holds, up to the first token where it leaves them (at least the prompt's last
token is always fed again, as `generate_step` needs it for the first logits). Layers that
keep no row per token (the linear-attention layers of qwen3_next and qwen3_5_moe, sliding
windows) are kept as snapshots at the ends of inserted sequences: after a prompt (before
its last token), after an answer, at a long prefill's checkpoints; such a model reuses
up to the nearest snapshot on its path (or a deeper one trimmed back, where it can be).

What must stay true: a request is served only rows of its own prompt's first m tokens,
for the store they were made on, from its own scope (`scope`: the gateway's digest of the
client's identity; a client must not learn another's prompt from what is cached); a served
cache is a new one, so the request's own tokens never reach the tree; memory stays within
`max_bytes` and `max_entries` (the least recently used branches go first).

With a folder (`prompt_cache_dir`, private to the user), the caches of finished requests
(and a long prefill's checkpoints, daemon/model/shared_prefill.py) are also written to
disk, within a day's write budget (an agent's long history rewritten every turn would wear
a drive), never one that a file already holds: a temporary file created new, fsync,
rename, fsync of the folder, with a MAC under the user's key, so that a file changed or
planted is refused and removed, never served. The folder is bounded in bytes (oldest
first, other stores' files counted) and indexed again when the daemon starts. The engine
hands a cache over only while it is idle (its arrays to host buffers); a writer thread
writes them, so no request waits on the disk (daemon/model/prompt_cache_files.py). Only
the engine thread touches MLX.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache

from ...shared.runtime_dir import RuntimeDirError, ensure_private_dir
from ...shared.settings import default_state_dir
from ...shared.store_format import MANIFEST_NAME
from .prompt_cache_files import DiskWriter, WriteBudget, host_tensors, load_cache_file, mtime, read_metadata, user_key
from .prompt_tree import PromptTree, sequence_bytes

# 2: a MAC over the metadata, which holds a digest of each block of tokens (read by prefix).
FILE_FORMAT = "moestream-prompt-cache/2"
SUFFIX = ".safetensors"
# Finished requests waiting for an idle moment to be written; older ones are dropped.
MAX_PENDING_WRITES = 8
# The user's key for the files' MACs, in the state folder.
KEY_FILE = "prompt-cache.key"
# Today's bytes written, in the folder (prompt_cache_files.WriteBudget).
BUDGET_FILE = "written-today.json"


def cache_identity(store_dir: str | os.PathLike, store_id: str | None) -> str:
    """What a cache file names as its store: the manifest's `store_id`, or for a store
    made without one, a digest of its manifest (its layout and weights' description)."""
    if store_id:
        return store_id
    return "manifest-" + hashlib.sha256((Path(store_dir) / MANIFEST_NAME).read_bytes()).hexdigest()[:32]


def token_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()[:32]


def cache_nbytes(cache: Sequence[Any]) -> int:
    """Bytes of a prompt cache's arrays (its buffers, as allocated)."""
    return sum(v.nbytes for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array))


def _attention_only(cache: Sequence[Any]) -> bool:
    """A cache read back by prefix (load_cache_file): every layer a KVCache."""
    return all(type(c) is KVCache for c in cache)


def cache_offset_ok(cache: Sequence[Any], tokens: int) -> bool:
    """Every layer cache that counts its tokens holds `tokens` of them."""
    return all(c.offset == tokens for c in cache if isinstance(getattr(c, "offset", None), int))


@dataclass
class PromptCacheStats:
    """What the prompt cache holds and did, for `status`."""

    entries: int = 0
    # Live branches: cached sequences that no other extends (the trees' leaves); scopes
    # (clients' identities) with caches.
    branches: int = 0
    scopes: int = 0
    bytes: int = 0
    max_bytes: int = 0
    max_entries: int = 0
    lookups: int = 0
    hits: int = 0
    # Prompt tokens looked up, and of them those served from the cache.
    prompt_tokens: int = 0
    tokens_reused: int = 0
    inserted: int = 0
    evicted: int = 0
    # Entries too large for max_bytes alone, or whose cache did not hold its tokens.
    refused: int = 0
    disk_dir: str | None = None
    # Why the disk cache is off although a folder was given (not private, not creatable).
    disk_problem: str | None = None
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_max_bytes: int = 0
    disk_written: int = 0
    # Bytes handed to the writer today, the day's allowance, and caches not written for it.
    disk_written_today: int = 0
    disk_write_budget: int = 0
    disk_over_budget: int = 0
    disk_loaded: int = 0
    # Bytes read from cache files (a prefix of a longer file reads the blocks it uses).
    disk_read_bytes: int = 0
    # Files skipped: another store's, unreadable, or not what their name says.
    disk_skipped: int = 0
    disk_dropped: int = 0
    disk_errors: int = 0
    # Prefills (daemon/model/shared_prefill.py): started; requests that joined one in
    # flight; stopped with no request left and kept suspended; taken up again by the
    # same prompt; dropped while suspended (evicted, or refused: over max_bytes alone).
    prefills: int = 0
    prefill_joins: int = 0
    prefills_suspended: int = 0
    prefills_resumed: int = 0
    prefills_dropped: int = 0
    # Suspended now, and their bytes (counted in `bytes`, and in `entries`' bound).
    suspended: int = 0
    suspended_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hits / self.lookups if self.lookups else None}


@dataclass(eq=False)
class _Entry:
    """A cache file on disk (the memory's caches are in the tree, prompt_tree.py)."""

    tokens: tuple[int, ...]
    trimmable: bool
    path: Path
    disk_bytes: int
    scope: str


def scope_tag(scope: str) -> str:
    """What a scope is known by in memory and on disk: a digest, never the identity
    itself (an API key, say); "" is the scope shared by every client."""
    return hashlib.sha256(scope.encode()).hexdigest()[:32] if scope else ""


@dataclass
class Reuse:
    """A private copy of a cache that holds the prompt's first `tokens` tokens."""

    cache: list[Any]
    tokens: int
    from_disk: bool = False


class _Trie:
    """Entries by token sequence, in nested dicts by token; a node holds at most one entry,
    under the key None."""

    def __init__(self) -> None:
        self.root: dict[int | None, Any] = {}

    def add(self, entry: _Entry) -> _Entry | None:
        node = self.root
        for t in entry.tokens:
            node = node.setdefault(t, {})
        prev, node[None] = node.get(None), entry
        return prev

    def remove(self, tokens: tuple[int, ...]) -> None:
        path = [self.root]
        for t in tokens:
            nxt = path[-1].get(t)
            if nxt is None:
                return
            path.append(nxt)
        path[-1].pop(None, None)
        for i in range(len(tokens), 0, -1):
            if path[i]:
                break
            del path[i - 1][tokens[i - 1]]

    def walk(self, tokens: Sequence[int]) -> tuple[list[_Entry], int, dict[int | None, Any]]:
        """The entries on the prompt's path (prefixes of it, shortest first), how far
        the prompt follows the trie, and the node where it stops."""
        node, found, depth = self.root, [], 0
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
            if None in node:
                found.append(node[None])
        return found, depth, node

    @staticmethod
    def nearest_trimmable(node: dict[int | None, Any]) -> _Entry | None:
        """The shortest trimmable entry at or below `node` (the least to copy)."""
        level = [node]
        while level:
            for n in level:
                if None in n and n[None].trimmable:
                    return n[None]
            level = [c for n in level for t, c in n.items() if t is not None]
        return None


class _Scope:
    """The caches one scope's requests may reuse: in memory and on disk."""

    def __init__(self, chunked: list[bool]) -> None:
        self.tree = PromptTree(chunked)
        # Files by token list, in a trie of their own (found like the tree's).
        self.trie = _Trie()
        self.disk: dict[tuple[int, ...], _Entry] = {}


class PromptCache:
    """One store's prompt cache (engine thread only, but for the writer thread it owns)."""

    def __init__(
        self,
        store_id: str | None,
        layout: Sequence[str],
        *,
        max_bytes: int,
        max_entries: int,
        disk_dir: str | os.PathLike | None = None,
        disk_bytes: int = 0,
        write_budget: int = 16 * 2**30,
        key_file: str | os.PathLike | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.store_id = store_id
        # The class names of the model's fresh cache, layer by layer: a file must match.
        self.layout = list(layout)
        self.log = log or logging.getLogger("moestream.prompt_cache")
        self.stats = PromptCacheStats(
            max_bytes=max_bytes, max_entries=max_entries, disk_max_bytes=disk_bytes, disk_write_budget=write_budget
        )
        self._budget = WriteBudget(write_budget)
        # The key of the files' MACs: the user's, in their private state folder.
        self._key_file = Path(key_file) if key_file is not None else default_state_dir(os.environ) / KEY_FILE
        self._key = b""
        # By scope (`scope_tag`): in memory one tree of token segments, shared prefixes
        # held once; on disk the files. A request reuses only its own scope's.
        self._scopes: dict[str, _Scope] = {}
        self._pending: list[tuple[str, tuple[int, ...]]] = []
        self._writing: dict[Path, tuple[str, tuple[int, ...]]] = {}
        # Prefills in flight or suspended, by key (shared_prefill.py `prefill_key`); the
        # suspended ones also here, oldest first, with their bytes.
        self._prefills: dict[Any, Any] = {}
        self._suspended: OrderedDict[Any, tuple[int, int]] = OrderedDict()
        # Times of use, in order (entries and suspended prefills are bounded together, LRU).
        self._uses = itertools.count(1)
        self._writer: DiskWriter | None = None
        self._folder: Path | None = None
        if disk_dir is not None and disk_bytes > 0:
            if not store_id:
                self.log.error("prompt cache: the store has no store_id, so its caches are not written to disk")
            else:
                self._start_disk(Path(disk_dir))

    @property
    def enabled(self) -> bool:
        return self.stats.max_bytes > 0 and self.stats.max_entries > 0

    # ---- lookups --------------------------------------------------------------------

    def _scope(self, tag: str) -> _Scope:
        scope = self._scopes.get(tag)
        if scope is None:
            scope = self._scopes[tag] = _Scope([name == "KVCache" for name in self.layout])
        return scope

    def fetch(self, tokens: Sequence[int], scope: str = "") -> Reuse | None:
        """A copy of the cache that serves the most of `tokens` but its last, or None,
        from the caches of requests of the same `scope` (a client's identity; "": shared)."""
        tag = scope_tag(scope)
        tree = self._scope(tag).tree
        self._take_writer_results()
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(tokens)
        limit = len(tokens) - 1
        from_disk = False
        while True:
            m, snap, trim = tree.best(tokens, limit)
            on_disk = self._best_on_disk(tag, tokens, limit)
            if on_disk is None or on_disk[0] <= m:
                break
            # A file serves more: into memory with it, then served from there.
            reused, entry = on_disk
            # A longer (trimmable) file's first `reused` tokens only are read.
            read = self._load(entry, reused)
            if read is None:
                continue  # it failed its checks and is gone: look again without it
            loaded, held = read
            self.insert(entry.tokens[:held], loaded, scope=scope)
            m, snap, trim = tree.best(tokens, limit)
            if m < reused:
                # Too large to keep in memory: served from the file's own cache.
                trim_prompt_cache(loaded, held - reused)
                return self._hit(Reuse(loaded, reused, True))
            from_disk = True
            break
        if m <= 0:
            return None
        return self._hit(Reuse(tree.serve(tokens, m, snap, trim, next(self._uses)), m, from_disk))

    def _hit(self, reuse: Reuse) -> Reuse:
        self.stats.hits += 1
        self.stats.tokens_reused += reuse.tokens
        return reuse

    def _best_on_disk(self, tag: str, tokens: Sequence[int], limit: int) -> tuple[int, _Entry] | None:
        """(tokens reused, file): the longest file whose tokens are a prefix of the prompt
        but its last token, or a trimmable file past the point where the prompt leaves the
        files' trie, trimmed back to it, whichever reuses more."""
        trie = self._scope(tag).trie
        found, depth, node = trie.walk(tokens)
        best: tuple[int, _Entry] | None = None
        for entry in found:
            if len(entry.tokens) <= limit:
                best = (len(entry.tokens), entry)
        m = min(depth, limit)
        if m > 0 and (best is None or m > best[0]):
            longer = trie.nearest_trimmable(node)
            if longer is not None:
                best = (m, longer)
        return best

    # ---- inserts ------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], cache: list[Any], *, persist: bool = False, scope: str = "") -> bool:
        """Keep what `cache` (which must hold exactly `tokens`) adds to the kept
        sequences, for later prompts: the rows of positions not kept yet, and a snapshot
        of the layers kept whole (copies: the caller's cache may go on changing).
        `persist`: write it to disk too, when idle. False if refused or not kept."""
        if not self.enabled or not tokens:
            return False
        key = tuple(int(t) for t in tokens)
        if not cache_offset_ok(cache, len(key)):
            self.stats.refused += 1
            self.log.error("prompt cache: a cache does not hold the %d tokens it was given for; not kept", len(key))
            return False
        if sequence_bytes(cache, len(key)) > self.stats.max_bytes:
            self.stats.refused += 1
            return False
        tag = scope_tag(scope)
        own = self._scope(tag)
        own.tree.insert(key, cache, next(self._uses))
        self.stats.inserted += 1
        self._count()
        self._bound()
        kept = own.tree.find(key) is not None
        if kept and persist and self._writer is not None and key not in own.disk:
            self._pending.append((tag, key))
            if len(self._pending) > MAX_PENDING_WRITES:
                self._pending.pop(0)
        return kept

    # ---- prefills in flight and suspended -----------------------------------------------

    def prefill_of(self, key: Any) -> tuple[Any, bool]:
        """(the prefill with `key` in flight or suspended, whether it was suspended), or
        (None, False); a suspended one is taken out of the bound, as a request takes it up."""
        prefill = self._prefills.get(key)
        if prefill is None:
            return None, False
        held = self._suspended.pop(key, None)
        if held is None:
            self.stats.prefill_joins += 1
            return prefill, False
        self.stats.prefills_resumed += 1
        self._count()
        return prefill, True

    def prefill_started(self, prefill: Any) -> None:
        self._prefills[prefill.key] = prefill
        self.stats.prefills += 1

    def prefill_ended(self, prefill: Any) -> None:
        """Finished: later requests find its cache among the entries, once kept."""
        if self._prefills.get(prefill.key) is prefill:
            del self._prefills[prefill.key]

    def suspend_prefill(self, prefill: Any) -> None:
        """No request waits on `prefill` any more: keep it, suspended, within the bounds
        (least recently used first, among the entries and the suspended prefills)."""
        nbytes = prefill.held_bytes()
        if nbytes > self.stats.max_bytes or not self.enabled:
            self._drop_prefill(prefill)
            return
        prefill.suspend()
        self._suspended[prefill.key] = (nbytes, next(self._uses))
        self.stats.prefills_suspended += 1
        self._count()
        self._bound()

    def _drop_prefill(self, prefill: Any) -> None:
        self.prefill_ended(prefill)
        self._suspended.pop(prefill.key, None)
        self.stats.prefills_dropped += 1
        prefill.close()
        self._count()

    def _bound(self) -> None:
        def over() -> bool:
            held = sum(s.tree.entries for s in self._scopes.values()) + len(self._suspended)
            return self.stats.bytes > self.stats.max_bytes or held > self.stats.max_entries

        while over():
            leaves = [(leaf, s.tree) for s in self._scopes.values() if (leaf := s.tree.oldest_leaf()) is not None]
            leaf, tree = min(leaves, key=lambda lt: lt[0].used, default=(None, None))
            key, (_, used) = next(iter(self._suspended.items()), (None, (0, 0)))
            if leaf is None and key is None:
                break
            if leaf is None or (key is not None and used < leaf.used):
                self._drop_prefill(self._prefills[key])
                continue
            assert tree is not None
            tree.drop(leaf)
            self.stats.evicted += 1
            self._count()

    def _count(self) -> None:
        self.stats.suspended = len(self._suspended)
        self.stats.suspended_bytes = sum(nbytes for nbytes, _ in self._suspended.values())
        trees = [s.tree for s in self._scopes.values()]
        self.stats.bytes = sum(t.nbytes for t in trees) + self.stats.suspended_bytes
        self.stats.entries = sum(t.entries for t in trees)
        self.stats.branches = sum(t.leaves() for t in trees)
        files = [e for s in self._scopes.values() for e in s.disk.values()]
        self.stats.disk_entries = len(files)
        self.stats.disk_bytes = sum(e.disk_bytes for e in files)
        self.stats.scopes = sum(1 for s in self._scopes.values() if s.tree.entries or s.disk)

    # ---- disk -----------------------------------------------------------------------

    def _start_disk(self, folder: Path) -> None:
        # Another user who made the folder first could plant links or caches in it: only a
        # folder of ours, private, not a link, is used (the runtime folder's own check).
        try:
            ensure_private_dir(folder, what="prompt cache folder", option="--prompt-cache-dir")
        except RuntimeDirError as e:
            self.log.error("prompt cache: %s; caches stay in memory only", e)
            self.stats.disk_problem = str(e)
            return
        try:
            ensure_private_dir(self._key_file.parent, what="state folder", option="XDG_STATE_HOME")
            self._key = user_key(self._key_file)
        except (OSError, ValueError, RuntimeDirError) as e:
            self.log.error("prompt cache: no key for its files (%s); caches stay in memory only", e)
            self.stats.disk_problem = f"no key for its files: {e}"
            return
        self.stats.disk_dir = str(folder)
        self._folder = folder
        self._budget.attach(folder / BUDGET_FILE, self.log)
        self.stats.disk_written_today = self._budget.written if self._budget.day == time.strftime("%Y-%m-%d") else 0
        others = self._index(folder)
        self._writer = DiskWriter(folder, self.store_id, self.stats.disk_max_bytes, self.log, self._key)
        self._writer.start()
        # The files indexed now, other stores' too (the bound is the folder's), oldest
        # first, so that the writer bounds the folder.
        mine = [e for s in self._scopes.values() for e in s.disk.values()]
        known = [(e.path, e.disk_bytes) for e in mine] + others
        self._writer.known(sorted(known, key=lambda p: mtime(p[0])))

    def _index(self, folder: Path) -> list[tuple[Path, int]]:
        """The store's files in `folder` into the trie (their caches stay on disk); returns
        the other stores' files and their sizes."""
        others = []
        for path in sorted(folder.iterdir()):
            if path.name.endswith(".tmp") and path.name.startswith(self._prefix() + "-"):
                path.unlink(missing_ok=True)  # a write that a crash interrupted
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                meta = read_metadata(path)
            except (OSError, ValueError) as e:
                self._skip(path, f"unreadable ({e})", remove=True)
                continue
            if meta.get("format") != FILE_FORMAT or meta.get("store_id") != self.store_id:
                self.stats.disk_skipped += 1
                self.log.info("prompt cache: %s is another store's or format's cache; skipped", path.name)
                others.append((path, path.stat().st_size))
                continue
            try:
                tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
            except (KeyError, ValueError, TypeError) as e:
                self._skip(path, f"no token list ({e})", remove=True)
                continue
            tag = str(meta.get("scope", ""))
            if path.name != self._file_name(tag, tokens):
                self._skip(path, "its tokens are not those its name says", remove=True)
                continue
            entry = _Entry(tokens, meta.get("trimmable") == "1", path, path.stat().st_size, tag)
            own = self._scope(tag)
            own.disk[tokens] = entry
            if own.trie.add(entry) is not None:
                raise AssertionError("prompt cache: two files for one token list")
        self._count()
        if self.stats.disk_entries:
            self.log.info(
                "prompt cache: %d cached conversations on disk (%d bytes) in %s",
                self.stats.disk_entries,
                self.stats.disk_bytes,
                folder,
            )
        return others

    def _skip(self, path: Path, why: str, *, remove: bool) -> None:
        self.stats.disk_skipped += 1
        self.log.error("prompt cache: %s is %s; skipped%s", path, why, " and removed" if remove else "")
        if remove:
            try:
                path.unlink()
            except OSError as e:
                self.log.error("prompt cache: cannot remove %s: %s", path, e)

    def _load(self, entry: _Entry, upto: int) -> tuple[list[Any], int] | None:
        """Read a disk entry's cache, checked: its first `upto` tokens where the file can
        give a prefix (attention caches only), else whole; returns it and the tokens it
        holds. On a failure drop the file and say why."""
        path = entry.path
        try:
            want = min(upto, len(entry.tokens)) if entry.trimmable else len(entry.tokens)
            cache, meta, nread = load_cache_file(path, self._key, self.stats.disk_max_bytes, want)
            self.stats.disk_read_bytes += nread
            # Whole (a file that holds no prefix of itself: not only attention caches), or the prefix.
            held = want if entry.trimmable and _attention_only(cache) else len(entry.tokens)
            problem = self._check(cache, meta, entry.tokens, entry.scope, held)
        except Exception as e:  # any failure of a file read back is a file not to serve
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem is not None:
            self._forget_disk(entry)
            self._skip(path, problem, remove=True)
            return None
        self.stats.disk_loaded += 1
        return cache, held

    def _check(
        self, cache: list[Any], meta: dict[str, str], tokens: tuple[int, ...], scope: str, upto: int
    ) -> str | None:
        if meta.get("format") != FILE_FORMAT or meta.get("store_id") != self.store_id:
            return "another store's cache"
        if tuple(json.loads(meta.get("tokens", "[]"))) != tokens or meta.get("scope", "") != scope:
            return "not the token list it was indexed with"
        if [type(c).__name__ for c in cache] != self.layout:
            return "a cache of another model's layers"
        if not cache_offset_ok(cache, upto) or any(
            type(c) is KVCache and (c.keys is None or c.keys.shape[2] < c.offset) for c in cache
        ):
            return "a cache that does not hold its tokens"
        return None

    def _forget_disk(self, entry: _Entry) -> None:
        own = self._scope(entry.scope)
        own.disk.pop(entry.tokens, None)
        own.trie.remove(entry.tokens)
        self._count()

    def _prefix(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.store_id or "")

    def _file_name(self, tag: str, tokens: Sequence[int]) -> str:
        name = (
            token_hash(tokens) if not tag else hashlib.sha256(f"{tag}:{token_hash(tokens)}".encode()).hexdigest()[:32]
        )
        return f"{self._prefix()}-{name}{SUFFIX}"

    def idle(self) -> None:
        """Hand finished requests' caches to the writer (the engine has no work now),
        within the day's write budget."""
        self._take_writer_results()
        if self._writer is None:
            return
        while self._pending:
            tag, key = self._pending.pop(0)
            own = self._scope(tag)
            node = own.tree.find(key)
            if node is None or key in own.disk or self._covered_on_disk(own, key):
                continue
            cache = own.tree.serve(key, len(key), node if node.snapshot is not None else None, 0, node.used)
            about = {
                "format": FILE_FORMAT,
                "store_id": self.store_id or "",
                "scope": tag,
                "tokens": json.dumps(list(key)),
                "trimmable": "1" if can_trim_prompt_cache(cache) else "0",
            }
            try:
                tensors, meta = host_tensors(cache, about)
            except Exception as e:  # a cache that cannot be written stays in memory; serving goes on
                self.log.error("prompt cache: a cache cannot be written (%s: %s)", type(e).__name__, e)
                self.stats.disk_errors += 1
                continue
            size = sum(len(data) for _, _, data in tensors.values())
            if not self._budget.take(size):
                self.stats.disk_over_budget += 1
                continue
            path = self._folder / self._file_name(tag, key)
            self._writing[path] = (tag, key)
            self._writer.put(path, key, tensors, meta)
        self.stats.disk_written_today = self._budget.written

    @staticmethod
    def _covered_on_disk(own: _Scope, key: tuple[int, ...]) -> bool:
        """A trimmable file that goes on past `key` serves it already: not written again."""
        found, depth, node = own.trie.walk(key)
        return depth == len(key) and own.trie.nearest_trimmable(node) is not None

    def _take_writer_results(self) -> None:
        if self._writer is None:
            return
        for kind, tokens, path, size, trimmable in self._writer.results():
            written = self._writing.pop(path, None)
            if kind == "written" and written is not None:
                tag, key = written
                own = self._scope(tag)
                entry = _Entry(key, trimmable, path, size, tag)
                own.trie.add(entry)
                own.disk[key] = entry
                self.stats.disk_written += 1
            elif kind == "removed":
                entry = next((e for s in self._scopes.values() for e in s.disk.values() if e.path == path), None)
                if entry is not None:
                    self._forget_disk(entry)
                self.stats.disk_dropped += 1
            elif kind != "written":
                self.stats.disk_errors += 1
        self._count()

    def close(self, timeout: float = 30.0) -> None:
        """Drop the suspended prefills; write what is pending and wait for the writer (at
        shutdown, or when the model is unloaded)."""
        for key in list(self._suspended):
            self._drop_prefill(self._prefills[key])
        if self._writer is None:
            return
        self.idle()
        if not self._writer.close(timeout):
            self.log.error("prompt cache: the writer did not end within %.0f s; the last caches may be lost", timeout)
        self._take_writer_results()
        self._writer = None
