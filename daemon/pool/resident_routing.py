"""The routing of fully resident pools, counted on the host without a host sync of its own.

A fully resident pool's forward never brings its expert ids to the host (`_resident` in
daemon/model/streaming_moe.py): they stay on the device, appended to the pool's
`route_log`. Once per token (`tick`, after the sampled token was read, which is the step's
one sync) the forwards logged since the last tick are stacked into one device array each
([layers, rows, k]) and evaluated asynchronously with the next token's work; the arrays of
READBACK_LAG ticks ago, computed by then, are read back: one small copy per token that
never waits for the device. `settle` reads back the rest (at the end of a request, when
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
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from moestream.daemon.pool.expert_pool import ExpertPool

# Forwards whose routing is read back: older than this many ticks, so already computed.
READBACK_LAG = 2


class ResidentRouting:
    """Counts the routing that `pools` (every one fully resident) log; `consume(rows)` is
    handed each read-back tick's forwards, [layers, rows, k] ids each, after they are counted."""

    def __init__(
        self,
        pools: Sequence[ExpertPool],
        consume: Callable[[list[np.ndarray]], None] | None = None,
        *,
        hits: bool = True,
    ) -> None:
        self.pools = list(pools)
        self._consume = consume
        self._hits = hits
        # Per tick: (the forward's ids on the device, whether it was a decode step).
        self._pending: deque[list[tuple[mx.array, bool]]] = deque()
        # Host time of the read-backs, the counting and `consume`, on the decode thread.
        self.readback_seconds = 0.0
        for p in self.pools:
            if not p.fully_resident:
                raise ValueError(f"layer {p.layer.module_path}: its routing is on the host already (a partial pool)")
            p.start_route_log()

    def tick(self) -> None:
        """After a token is read: queue the routing of the forwards logged since the last
        tick, and count that of the forwards READBACK_LAG ticks old."""
        logs = [p.take_route_log() for p in self.pools]
        forwards = min(map(len, logs), default=0)
        if forwards:
            # One token per sequence is a decode step (batched or not), as the slot pool counts it.
            batch = [
                (mx.stack([log[j].reshape(-1, log[j].shape[-1]) for log in logs]), logs[0][j].shape[-2] == 1)
                for j in range(forwards)
            ]
            mx.async_eval([ids for ids, _ in batch])
            self._pending.append(batch)
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

    def _read(self, ready: list[tuple[mx.array, bool]]) -> None:
        tic = time.perf_counter()
        rows = [np.array(ids) for ids, _ in ready]
        for forward, (_, decode) in zip(rows, ready):
            for i, pool in enumerate(self.pools):
                flat = forward[i].reshape(-1)
                stats = pool.stats
                np.add.at(stats.routed, flat, 1)
                stats.routed_total += flat.size
                if self._hits:
                    hits = np.unique(flat).size
                    if decode:
                        stats.hits_decode += hits
                    else:
                        stats.hits_prefill += hits
        if self._consume is not None:
            self._consume(rows)
        self.readback_seconds += time.perf_counter() - tic
