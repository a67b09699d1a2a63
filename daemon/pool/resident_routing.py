"""The routing of fully resident pools, counted on the host without a host sync of its own.

A fully resident pool's forward never brings its expert ids to the host (`_resident` in
daemon/model/streaming_moe.py): they stay on the device, appended to the pool's
`route_log`. Once per token (`tick`, after the sampled token was read, which is the step's
one sync) the layers' ids logged since the last tick are joined into one device array and
evaluated asynchronously with the next token's work; the array of READBACK_LAG ticks ago,
computed by then, is read back: one small copy per token that never waits for the device.
Each layer's ids are kept apart, never paired with another layer's by position: a long
prefill yields between its layers, so between two ticks the lower layers may have run a
request's chunk that the upper ones have not, while another request's decode step ran
through all of them. `settle` reads back the rest (at the end of a request, when
nothing is left to overlap with).

The counts go where a slot pool's go (`PoolStats`: the routings per expert for the heat,
`routed_total`, and a hit per distinct expert of a forward), so the heat map, the hit
rates in `status` and a request's statistics see a full pool as they see a partial one.
A mapped pool (daemon/mapped/mapped_pool.py) reads its routing back through the same
readback, for its placement as well, and counts no hits (its hit is GPU memory's).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .expert_pool import ExpertPool

# Forwards whose routing is read back: older than this many ticks, so already computed.
READBACK_LAG = 2


@dataclass(frozen=True)
class LayerRouting:
    """One forward's routing through one layer, read back: `pools[layer]`'s ids, [rows, k]."""

    layer: int
    ids: np.ndarray


class ResidentRouting:
    """Counts the routing that `pools` (every one fully resident) log; `consume(routed)` is
    handed each read-back tick's `LayerRouting`s (each layer's in the order it ran them),
    after they are counted."""

    def __init__(
        self,
        pools: Sequence[ExpertPool],
        consume: Callable[[list[LayerRouting]], None] | None = None,
        *,
        hits: bool = True,
    ) -> None:
        self.pools = list(pools)
        self._consume = consume
        self._hits = hits
        # Per tick: the logged forwards in runs of one shape (a decode step's layers are
        # one run), each run's ids joined along the last axis on the device, with its
        # forwards' (layer, whether it was a decode step, k).
        self._pending: deque[list[tuple[mx.array, list[tuple[int, bool, int]]]]] = deque()
        # Host time of the read-backs, the counting and `consume`, on the decode thread.
        self.readback_seconds = 0.0
        for p in self.pools:
            if not p.fully_resident:
                raise ValueError(f"layer {p.layer.module_path}: its routing is on the host already (a partial pool)")
            p.start_route_log()

    def tick(self) -> None:
        """After a token is read: queue the routing of the forwards logged since the last
        tick, and count that of the forwards READBACK_LAG ticks old."""
        logged = [(i, ids) for i, p in enumerate(self.pools) for ids in p.take_route_log()]
        if logged:
            # One join per run of equal shapes, along the last axis: a strided id slice is
            # read as it is, where a flat copy of each would cost a kernel per layer (48
            # launches a token, about 1 ms of the host's time on an H100).
            runs: list[tuple[mx.array, list[tuple[int, bool, int]]]] = []
            start = 0
            for end in range(1, len(logged) + 1):
                if end == len(logged) or logged[end][1].shape != logged[start][1].shape:
                    group = logged[start:end]
                    joined = group[0][1] if len(group) == 1 else mx.concatenate([ids for _, ids in group], axis=-1)
                    # One token per sequence is a decode step (batched or not), as the slot pool counts it.
                    runs.append((joined, [(i, ids.shape[-2] == 1, ids.shape[-1]) for i, ids in group]))
                    start = end
            mx.async_eval([joined for joined, _ in runs])
            self._pending.append(runs)
        if len(self._pending) > READBACK_LAG:
            self._read(self._pending.popleft())

    def settle(self) -> None:
        """Count every forward logged so far."""
        self.tick()
        while self._pending:
            self._read(self._pending.popleft())

    def close(self) -> None:
        for p in self.pools:
            p.stop_route_log()
        self._pending.clear()

    def _read(self, ready: list[tuple[mx.array, list[tuple[int, bool, int]]]]) -> None:
        tic = time.perf_counter()
        routed: list[LayerRouting] = []
        for joined, forwards in ready:
            k = forwards[0][2]
            # [rows, forwards, k]: each forward's ids for every row (sequence and position).
            host = np.array(joined).reshape(-1, len(forwards), k)
            per_forward = host.transpose(1, 0, 2).reshape(len(forwards), -1)
            if self._hits:
                # Distinct experts per forward: one sort for the run.
                ordered = np.sort(per_forward, axis=1)
                distinct = 1 + np.count_nonzero(np.diff(ordered, axis=1), axis=1)
            # Routings per expert of every forward in one count: forward j's ids offset by j * width.
            width = max(self.pools[i].stats.routed.size for i, _, _ in forwards)
            offsets = np.arange(len(forwards))[:, None] * width
            counts = np.bincount((per_forward + offsets).ravel(), minlength=len(forwards) * width)
            counts = counts.reshape(len(forwards), width)
            for j, (i, decode, _) in enumerate(forwards):
                stats = self.pools[i].stats
                stats.routed += counts[j, : stats.routed.size]
                stats.routed_total += per_forward.shape[1]
                if self._hits:
                    if decode:
                        stats.hits_decode += int(distinct[j])
                    else:
                        stats.hits_prefill += int(distinct[j])
                if self._consume is not None:
                    routed.append(LayerRouting(i, host[:, j, :]))
        if self._consume is not None:
            self._consume(routed)
        self.readback_seconds += time.perf_counter() - tic
