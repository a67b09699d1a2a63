"""LFU with dynamic aging (LFUDA, Arlitt et al. 2000): evict the resident expert with the
smallest key, where key = cache age + accesses since admission.

Why it works: plain LFU lets an expert that was hot long ago keep its slot forever (cache
pollution). LFUDA adds the cache age L, which rises to the key of every victim: a newly
admitted expert starts at L + 1, level with the residents that are about to go, and an
old expert's past hits are worth less and less against it. Frequency still wins while it
is being earned, and no counter ever needs to be decayed by a scan.

What must stay true: L never decreases (it is raised to a victim's key, never lowered:
with protected experts a victim's key need not be the smallest); a resident's key is
fixed between two of its accesses, so the heap gives the victim in O(log n); counts
restart on admission (a re-admitted expert earns its place again); ties evict the least
recently accessed.
"""

from __future__ import annotations

from typing import Collection, Sequence

from .base import EvictionPolicy
from .resident_heap import ResidentHeap
from .victims import fallback_victim


class LFUDAPolicy(EvictionPolicy):
    name = "lfuda"

    def __init__(self, num_experts: int, capacity: int) -> None:
        super().__init__(num_experts, capacity)
        self.age = 0.0
        self._tick = 0
        self._freq: dict[int, int] = {}
        # Accesses of experts not yet admitted (a prefill chunk accesses many rows first).
        self._pending: dict[int, int] = {}
        self._heap = ResidentHeap()

    def key(self, expert: int) -> float | None:
        """The expert's LFUDA key, or None when it is not resident."""
        k = self._heap.key(expert)
        return None if k is None else k[0]

    def access(self, experts: Sequence[int]) -> None:
        self._tick += 1
        for e in experts:
            if e in self._heap:
                self._freq[e] += 1
                self._heap.set(e, (self.age + self._freq[e], self._tick))
            else:
                self._pending[e] = self._pending.get(e, 0) + 1

    def victim(self, resident: Collection[int], protected: Collection[int]) -> int:
        e = self._heap.min_excluding(protected)
        return e if e is not None else fallback_victim(self.name, resident, protected)

    def admitted(self, expert: int) -> None:
        self._freq[expert] = max(self._pending.pop(expert, 0), 1)
        self._heap.set(expert, (self.age + self._freq[expert], self._tick))

    def evicted(self, expert: int) -> None:
        key = self._heap.key(expert)
        if key is not None:
            self.age = max(self.age, key[0])
        self._heap.discard(expert)
        self._freq.pop(expert, None)
