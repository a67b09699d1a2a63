"""Warm start (AUTOPIN): pin each layer's hottest experts from `pool_usage.json`.

Each layer pins its N most routed experts, N = floor(capacity × frac), but always leaves
top-k slots unpinned so that any token can still be served. Pinned experts are loaded
before the daemon reports ready and are never evicted. A layer whose pool already holds
every expert, or that has no recorded heat, is skipped.

With a mapped pool (daemon/placement.py) every expert is already addressable, so nothing
is pinned: each layer's experts are placed in GPU memory hottest first instead (layers
without heat keep the default order), and the placement's policy moves them from there
as routing goes. `frac` 0 leaves the default placement (a cold start).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from moestream.daemon.store.loader import StreamingModel
from moestream.shared.heat_file import hottest


@dataclass(frozen=True)
class AutopinSummary:
    layers: int
    pinned: int
    skipped_layers: int
    seconds: float
    bytes_read: int
    # Mapped pool: experts placed in GPU memory because the heat named them.
    placed: int = 0
    mapped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def autopin(sm: StreamingModel, counts: Mapping[int, Mapping[int, int]], frac: float) -> AutopinSummary:
    """Pin (or, with a mapped pool, place in GPU memory) each layer's hottest experts."""
    if sm.placement is not None:
        return _place_hottest(sm, counts, frac)
    tic = time.perf_counter()
    bytes_before = sum(p.stats.bytes_read for p in sm.pools)
    layers = pinned = skipped = 0
    for pool in sm.pools:
        # `pin` itself leaves top-k slots unpinned, whatever is asked.
        experts = hottest(counts, pool.layer.ordinal, math.floor(pool.capacity * frac))
        if pool.fully_resident or not experts:
            skipped += 1
            continue
        pinned += pool.pin(experts)
        layers += 1
    bytes_read = sum(p.stats.bytes_read for p in sm.pools) - bytes_before
    return AutopinSummary(layers, pinned, skipped, time.perf_counter() - tic, bytes_read)


def _place_hottest(sm: StreamingModel, counts: Mapping[int, Mapping[int, int]], frac: float) -> AutopinSummary:
    placement = sm.placement
    tic = time.perf_counter()
    orders = [hottest(counts, pool.layer.ordinal, pool.layer.num_experts) if frac > 0 else [] for pool in sm.pools]
    layers = sum(1 for order in orders if order)
    if not layers:
        return AutopinSummary(0, 0, len(sm.pools), time.perf_counter() - tic, 0, mapped=True)
    placement.place_initial(orders)
    placed = sum(min(len(order), placement.gpu_slots) for order in orders)
    return AutopinSummary(layers, 0, len(sm.pools) - layers, time.perf_counter() - tic, 0, placed=placed, mapped=True)
