"""Warm start (AUTOPIN): pin each layer's hottest experts from `pool_usage.json`.

Each layer pins its N most routed experts, N = floor(capacity × frac), but always leaves
top-k slots unpinned so that any token can still be served. Pinned experts are loaded
before the daemon reports ready and are never evicted. A layer whose pool already holds
every expert, or that has no recorded heat, is skipped.
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def autopin(sm: StreamingModel, counts: Mapping[int, Mapping[int, int]], frac: float) -> AutopinSummary:
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
