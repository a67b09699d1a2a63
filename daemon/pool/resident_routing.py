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
        # Per tick: every logged id on the device, flat, and per logged forward of a layer
        # (layer, whether it was a decode step, k, how many ids).
        self._pending: deque[tuple[mx.array, list[tuple[int, bool, int, int]]]] = deque()
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
            flat = mx.concatenate([ids.reshape(-1) for _, ids in logged])
            # One token per sequence is a decode step (batched or not), as the slot pool counts it.
            meta = [(i, ids.shape[-2] == 1, ids.shape[-1], ids.size) for i, ids in logged]
            mx.async_eval(flat)
            self._pending.append((flat, meta))
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

    def _read(self, ready: tuple[mx.array, list[tuple[int, bool, int, int]]]) -> None:
        tic = time.perf_counter()
        flat, meta = ready
        host = np.array(flat)
        routed: list[LayerRouting] = []
        at = 0
        for i, decode, k, size in meta:
            ids = host[at : at + size]
            at += size
            stats = self.pools[i].stats
            np.add.at(stats.routed, ids, 1)
            stats.routed_total += size
            if self._hits:
                hits = np.unique(ids).size
                if decode:
                    stats.hits_decode += hits
                else:
                    stats.hits_prefill += hits
            routed.append(LayerRouting(i, ids.reshape(-1, k)))
        if self._consume is not None:
            self._consume(routed)
        self.readback_seconds += time.perf_counter() - tic
