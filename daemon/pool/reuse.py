"""LRU stack distances of a layer's routing: what a pool of any size would hit.

For each expert a step routes, its stack distance is the number of other experts
the layer routed since that expert's last use (Mattson's stack algorithm); a first use
has none (the last bucket, `num_experts`). An LRU pool of `s` slots holds an expert whose
distance is below about `s`, so one histogram of distances gives the LRU hit rate of
every pool size once it is warm, locality within a text included: the share of the routing
counts that the hottest `s` experts take (all that a count table can say) misses it.
On the three routing traces in tests/data/traces the histogram's estimate is within 0.01
of the pool's LRU policy replayed warm on the same decode steps at 25%, 50% and 75% of the
experts (tests/test_reuse.py), where the hottest share was off by 0.03 to 0.2.

A step is one forward through the layer: the experts its rows route together (one
token, a batch's tokens, or a prompt's, which a pool admits at once), as the pool sees
them. Experts routed in one step share a last use, so an LRU pool evicts one somewhere
between `s - top_k + 1` and `s` distances; `lru_hit_rate` cuts a quarter of top-k below
`s`, the offset that matched the replayed pools of those traces. A pool counts every
SAMPLE_EVERY-th step only (below).

The pool's thread observes; the heat's push takes the histogram, on the same thread for
a slot pool and from the engine while a mapped pool's worker observes: a lock keeps each
count in exactly one take.

Imports no MLX.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

import numpy as np

# Distances are computed at every SAMPLE_EVERY-th step (every step keeps the last uses
# current): a systematic sample of the steps, whose histogram estimates the whole one at
# a quarter of the host time on a pool's path (about 40 us a step for 128 experts here,
# on each MoE layer of every token).
SAMPLE_EVERY = 4


class StackDistances:
    """One layer's histogram of stack distances over the steps it is shown (every
    `every`-th of them counted)."""

    def __init__(self, num_experts: int, every: int = SAMPLE_EVERY) -> None:
        self.num_experts = num_experts
        self.every = every
        # Each expert's last step (-1: never routed).
        self._last = np.full(num_experts, -1, dtype=np.int64)
        self._step = 0
        self._lock = threading.Lock()
        # Bucket d: routings at distance d; bucket num_experts: first uses. Since `take`.
        self.counts = np.zeros(num_experts + 1, dtype=np.int64)

    def observe_step(self, ids: np.ndarray) -> None:
        """Count one step's routing: non-negative expert ids of any shape, repeats
        counted once."""
        with self._lock:
            if self._step % self.every == 0:
                ids = np.unique(ids)
                last = self._last[ids]
                distance = (self._last[None, :] > last[:, None]).sum(axis=1)
                distance[last < 0] = self.num_experts
                np.add.at(self.counts, distance, 1)
            self._last[ids] = self._step
            self._step += 1

    def observe(self, steps: Iterable[np.ndarray]) -> None:
        """Count steps in order (a trace's, one row each)."""
        for ids in steps:
            self.observe_step(ids)

    def take(self) -> np.ndarray:
        """The histogram since the last call (the clock and last uses carry on)."""
        with self._lock:
            counts = self.counts
            self.counts = np.zeros_like(counts)
        return counts


def lru_hit_rate(histogram: np.ndarray | Mapping[int, int], slots: int, top_k: int, num_experts: int) -> float | None:
    """The hit rate of a warm LRU pool of `slots` from a stack-distance histogram of a
    layer of `num_experts` (an array of num_experts + 1 buckets, or {distance: count} as
    the reuse file keeps it); None where it counts nothing.

    First uses (the last bucket) are left out: a first use in a record is an expert whose
    last use came before the record began (its distance unknown, not infinite), and a
    pool that has served a while has met them all. A daemon's record of a few requests
    holds one for nearly every expert: on the H200's q30 record (55 thousand routings)
    they were 7% of the routings, and counting them as misses put an LRU pool of half
    the experts at 0.551, 0.593 without them, where it hit 0.666 (tests/bench/RESULTS.md,
    "The H200 table with the stack distances")."""
    if isinstance(histogram, Mapping):
        dense = np.zeros(num_experts + 1, dtype=np.int64)
        for d, c in histogram.items():
            dense[int(d)] = c
        histogram = dense
    elif len(histogram) != num_experts + 1:
        raise ValueError(f"a histogram of {len(histogram)} buckets for a layer of {num_experts} experts")
    total = int(np.sum(histogram[:num_experts]))
    if total == 0:
        return None
    cut = max(slots - top_k // 4, 0)
    return float(np.sum(histogram[:cut])) / total
