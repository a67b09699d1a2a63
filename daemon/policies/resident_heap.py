"""A min-heap over resident experts whose keys only change when the expert is touched.

LFU (decayed), LFUDA and Belady's MIN all rank residents by a key that is fixed between
two accesses of the same expert, so a binary heap with lazy invalidation gives the
victim in O(log n) amortised instead of a scan of every resident on each miss.

Invariant: `_key[e]` is the live key of every tracked expert; a heap entry `(key, e)`
is live only while `_key.get(e) == key`, every other entry is stale and skipped. The
heap is rebuilt from `_key` when stale entries outnumber live ones, so it stays O(n).
"""

from __future__ import annotations

import heapq
from typing import Any, Collection


class ResidentHeap:
    """Tracked experts ordered by key, smallest first; keys must be comparable."""

    def __init__(self) -> None:
        self._key: dict[int, Any] = {}
        self._heap: list[tuple] = []

    def __contains__(self, expert: int) -> bool:
        return expert in self._key

    def __len__(self) -> int:
        return len(self._key)

    def key(self, expert: int) -> Any | None:
        return self._key.get(expert)

    def set(self, expert: int, key: Any) -> None:
        """Track `expert` with `key` (replacing its old key)."""
        self._key[expert] = key
        heapq.heappush(self._heap, (key, expert))
        if len(self._heap) > 2 * len(self._key) + 64:
            self.rekey(self._key)

    def discard(self, expert: int) -> None:
        self._key.pop(expert, None)

    def rekey(self, keys: dict[int, Any]) -> None:
        """Replace every key at once (used when a policy rescales its counters)."""
        self._key = dict(keys)
        self._heap = [(k, e) for e, k in self._key.items()]
        heapq.heapify(self._heap)

    def min_excluding(self, protected: Collection[int]) -> int | None:
        """The tracked expert with the smallest key that is not in `protected`, or None.
        Nothing is removed: the caller evicts through `discard`."""
        skipped = []
        found = None
        while self._heap:
            key, e = heapq.heappop(self._heap)
            if self._key.get(e) != key:
                continue
            skipped.append((key, e))
            if e not in protected:
                found = e
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found
