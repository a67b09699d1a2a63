"""Belady's MIN, the offline optimum: evict the resident expert whose next use lies
farthest in the future (never used again counts as infinitely far).

Why it is optimal here: with the current token's experts protected, any schedule that
evicts some x where MIN evicts y (y's next use later than x's, neither needed now) can
keep x and drop y instead, then mimic the original until x is next needed; it has no
more misses, and by induction neither has MIN. The tests check this against an
exhaustive search on small traces.

It needs the whole future, so it is not in the registry: only the evaluator builds it,
with the sequence it is about to replay. Each `access` call advances one step of that
sequence and must receive exactly that step's experts.

What must stay true: a resident's key (its next use after the current step) changes only
when that expert is accessed, so a heap with static keys gives the victim in O(log n);
`_cursor[e]` indexes the first use of e after the current step.
"""

from __future__ import annotations

from typing import Collection, Sequence

from ...policies.base import EvictionPolicy
from ...policies.resident_heap import ResidentHeap
from ...policies.victims import fallback_victim


class BeladyMIN(EvictionPolicy):
    name = "min"

    def __init__(self, num_experts: int, capacity: int, future: Sequence[Sequence[int]]) -> None:
        super().__init__(num_experts, capacity)
        self._future = future
        self._uses: list[list[int]] = [[] for _ in range(num_experts)]
        for step, experts in enumerate(future):
            for e in experts:
                if not self._uses[e] or self._uses[e][-1] != step:
                    self._uses[e].append(step)
        self._cursor = [0] * num_experts
        self._step = -1
        self._never = len(future)
        self._heap = ResidentHeap()

    def next_use(self, expert: int) -> int:
        """The first step after the current one that routes to `expert` (len(future)
        when none)."""
        uses, i = self._uses[expert], self._cursor[expert]
        return uses[i] if i < len(uses) else self._never

    def access(self, experts: Sequence[int]) -> None:
        self._step += 1
        if self._step >= len(self._future):
            raise IndexError(
                f"[min.access] step {self._step} is past the {len(self._future)} steps this MIN was built for"
            )
        expected = self._future[self._step]
        if sorted(set(experts)) != sorted(set(expected)):
            raise ValueError(
                f"[min.access] step {self._step}: got experts {list(experts)}, "
                f"the sequence it was built for has {list(expected)}"
            )
        for e in set(experts):
            self._cursor[e] += 1
            if e in self._heap:
                self._heap.set(e, (-self.next_use(e), e))

    def victim(self, resident: Collection[int], protected: Collection[int]) -> int:
        e = self._heap.min_excluding(protected)
        return e if e is not None else fallback_victim(self.name, resident, protected)

    def admitted(self, expert: int) -> None:
        self._heap.set(expert, (-self.next_use(expert), expert))

    def evicted(self, expert: int) -> None:
        self._heap.discard(expert)
