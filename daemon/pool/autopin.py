"""Warm start (AUTOPIN): pin each layer's hottest experts from `pool_usage.json`.

Each layer pins its N most routed experts, N = floor(capacity × frac), but always leaves
top-k slots unpinned so that any token can still be served. Pinned experts are loaded
before the daemon reports ready and are never evicted. The rest of the pool is filled
with the next hottest experts, unpinned (evicted as the policy says), so that a warm
start starts with a full pool; and a host-RAM tier (`--host-cache`) is first filled with
the hottest experts of all layers that fit, read in parallel. A layer whose pool already
holds every expert, or that has no recorded heat, is skipped. `frac` 0 is a cold start:
nothing is loaded.

With a mapped pool (daemon/mapped/mapped_pool.py) every expert is already addressable, so nothing
is pinned: each layer's experts are placed in GPU memory hottest first instead (layers
without heat keep the default order), and the placement's policy moves them from there
as routing goes. `frac` 0 leaves the default placement (a cold start).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ...shared.heat_file import hottest
from ..model.streaming_model import StreamingModel


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
    # Unpinned experts loaded into the pools' remaining slots, and experts read into
    # the host-RAM tier (bytes).
    preloaded: int = 0
    tier_warmed_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def autopin(sm: StreamingModel, counts: Mapping[int, Mapping[int, int]], frac: float) -> AutopinSummary:
    """Pin (or, with a mapped pool, place in GPU memory) each layer's hottest experts."""
    if sm.mapped_pool is not None:
        return _place_hottest(sm, counts, frac)
    tic = time.perf_counter()
    bytes_before = sum(p.stats.bytes_read for p in sm.pools)
    tier_warmed_bytes = 0
    warm = getattr(sm.admitter, "warm", None)
    if frac > 0 and warm is not None and not all(p.fully_resident for p in sm.pools):
        # Hottest first over all layers (ties: lower layer, then lower id).
        ranked = sorted(
            (-c, ordinal, e) for ordinal, layer_counts in counts.items() for e, c in layer_counts.items() if c > 0
        )
        known = {p.layer.ordinal: p.layer.num_experts for p in sm.pools}
        keys = [(ordinal, e) for _, ordinal, e in ranked if 0 <= e < known.get(ordinal, 0)]
        tier_warmed_bytes = warm([p.layer for p in sm.pools], keys)
    layers = pinned = skipped = preloaded = 0
    for pool in sm.pools:
        order = hottest(counts, pool.layer.ordinal, pool.layer.num_experts) if frac > 0 else []
        # `pin` itself leaves top-k slots unpinned, whatever is asked.
        experts = order[: math.floor(pool.capacity * frac)]
        if pool.fully_resident or not experts:
            skipped += 1
            continue
        pinned += pool.pin(experts)
        preloaded += pool.preload(order)
        layers += 1
    bytes_read = sum(p.stats.bytes_read for p in sm.pools) - bytes_before
    return AutopinSummary(
        layers,
        pinned,
        skipped,
        time.perf_counter() - tic,
        bytes_read,
        preloaded=preloaded,
        tier_warmed_bytes=tier_warmed_bytes,
    )


def _place_hottest(sm: StreamingModel, counts: Mapping[int, Mapping[int, int]], frac: float) -> AutopinSummary:
    placement = sm.mapped_pool
    tic = time.perf_counter()
    orders = [hottest(counts, pool.layer.ordinal, pool.layer.num_experts) if frac > 0 else [] for pool in sm.pools]
    layers = sum(1 for order in orders if order)
    if not layers:
        return AutopinSummary(0, 0, len(sm.pools), time.perf_counter() - tic, 0, mapped=True)
    placement.place_initial(orders)
    # Later rebalancing goes by the same heat plus what is routed from now on.
    placement.seed_counts([counts.get(pool.layer.ordinal, {}) for pool in sm.pools])
    placed = sum(min(len(order), placement.gpu_slots) for order in orders)
    return AutopinSummary(layers, 0, len(sm.pools) - layers, time.perf_counter() - tic, 0, placed=placed, mapped=True)
