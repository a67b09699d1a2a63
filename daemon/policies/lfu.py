"""Least frequently used, with exponential decay: evict the resident expert routed
least often lately.

Why it works: MoE routers are skewed; some experts of a layer are routed far more than
others across all tokens and requests, and recency alone (LRU) forgets them between two
uses. Counting keeps them. Pure counts never forget, though, and a request on another
topic shifts which experts are hot, so counts decay with a half-life measured in routed
tokens (Redis' LFU decays its counter with idle minutes for the same reason).

How: instead of multiplying every counter by 2^(-1/half_life) per token (O(experts)),
each access adds an increment that grows by 2^(1/half_life) per token. The ratio of any
two counters is then exactly that of decayed counts, so the order of residents only
changes when one of them is accessed, and a heap with static keys finds the victim in
O(log n). When the increment passes 2^64, all counters are divided by it (O(experts),
once per 64 half-lives) so floats never overflow.

What must stay true: `_count[e] / _inc` is e's decayed count, for every expert, resident
or not (experts per layer are few, a float each is cheap, and a returning expert keeps
its history); the heap holds exactly the admitted, not evicted experts, keyed by
(count, last access tick) so that equal counts evict the least recent first.
"""

from __future__ import annotations

from typing import Collection, Sequence

from .base import EvictionPolicy
from .resident_heap import ResidentHeap
from .victims import fallback_victim

_RESCALE_AT = 2.0**64


class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self, num_experts: int, capacity: int, *, half_life: float = 128.0) -> None:
        super().__init__(num_experts, capacity)
        if half_life <= 0:
            raise ValueError(f"[lfu] half_life {half_life} must be > 0 (tokens)")
        self.half_life = half_life
        self._growth = 2.0 ** (1.0 / half_life)
        self._inc = 1.0
        self._tick = 0
        self._count = [0.0] * num_experts
        self._last = [-1] * num_experts
        self._heap = ResidentHeap()

    def access(self, experts: Sequence[int]) -> None:
        self._tick += 1
        self._inc *= self._growth
        if self._inc > _RESCALE_AT:
            self._rescale()
        for e in experts:
            self._count[e] += self._inc
            self._last[e] = self._tick
            if e in self._heap:
                self._heap.set(e, (self._count[e], self._tick))

    def victim(self, resident: Collection[int], protected: Collection[int]) -> int:
        e = self._heap.min_excluding(protected)
        return e if e is not None else fallback_victim(self.name, resident, protected)

    def admitted(self, expert: int) -> None:
        self._heap.set(expert, (self._count[expert], self._last[expert]))

    def evicted(self, expert: int) -> None:
        self._heap.discard(expert)

    def _rescale(self) -> None:
        scale = self._inc
        self._count = [c / scale for c in self._count]
        self._inc = 1.0
        self._heap.rekey({e: (self._count[e], self._last[e]) for e in range(self.num_experts) if e in self._heap})
