"""Least recently used: evict the resident expert whose last routing is oldest.

Why it works: routing has some short-range reuse (consecutive tokens of one request
share experts more often than chance), and LRU keeps exactly what was used last. It
is the baseline every other policy is measured against.

What must stay true: `_order` holds every admitted, not yet evicted expert, oldest
first. A hit moves the expert to the end; an admitted expert enters at the end (it was
just routed). `victim` walks from the front and skips protected experts, so it costs
O(1 + protected experts at the front), never a scan of all experts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Collection, Sequence

from .base import EvictionPolicy
from .victims import fallback_victim


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, num_experts: int, capacity: int) -> None:
        super().__init__(num_experts, capacity)
        self._order: OrderedDict[int, None] = OrderedDict()

    def access(self, experts: Sequence[int]) -> None:
        order = self._order
        for e in experts:
            if e in order:
                order.move_to_end(e)

    def victim(self, resident: Collection[int], protected: Collection[int]) -> int:
        for e in self._order:
            if e not in protected:
                return e
        return fallback_victim(self.name, resident, protected)

    def admitted(self, expert: int) -> None:
        self._order[expert] = None
        self._order.move_to_end(expert)

    def evicted(self, expert: int) -> None:
        self._order.pop(expert, None)
