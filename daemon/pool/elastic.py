"""The elastic pool: the pool and host tier give memory back under memory pressure and take
it again once the pressure passes.

The engine reads the machine's pressure (daemon/pool/pressure.py) every POLL_SECONDS at
its loop's turns, between two steps, never inside one (`EngineLoop._loop`), and sets a
share of what the pool was made with above its floor:

- critical: the floor at once (top-k slots per layer, no pinned expert; the host tier at
  top-k experts); still critical SETTLE_SECONDS after the pool reached it, new requests are
  refused with a clear error (`refusing`) until a reading below critical;
- warn: half of the share left, every SETTLE_SECONDS while it lasts (the system needs a
  while to see what was given back), down to the floor;
- normal for SETTLE_SECONDS: all of it again.

Each layer's slots are then `floor + share x (made - floor)` (`ExpertPool.resize`: the
coldest given back first, pinned ones last), the tier's `share x made` experts
(`HostTier.resize`), and MLX's buffer cache is emptied so that the memory leaves the
process. A resize changes which experts are resident, never the bytes a forward reads nor
how it computes: output stays bit-identical (tests/test_elastic_pool.py). A mapped pool
(every expert in host memory already) and an expert-parallel group are not resized.

Loaded by the engine before MLX is (the daemon answers while the model loads): MLX and
the pools' modules are imported where a model is attached or resized.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ...shared.settings import format_size
from ...shared.status import ElasticStatus, ResizeEvent
from .pressure import Level, Pressure, PressureSource

if TYPE_CHECKING:
    from .host_tier import TieredAdmitter

POLL_SECONDS = 0.25
SETTLE_SECONDS = 1.0
KEPT_EVENTS = 64


class ElasticPool:
    """The rule above, for the model `attach` gives it; `tick()` at the engine's turns."""

    def __init__(
        self,
        source: PressureSource | None,
        log: logging.Logger,
        *,
        poll_seconds: float = POLL_SECONDS,
        settle_seconds: float = SETTLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.log = log
        self.poll_seconds = poll_seconds
        self.settle_seconds = settle_seconds
        self.clock = clock
        self.level: Level = "normal"
        self.detail = ""
        # Of what the pool was made with above its floor: 1 all of it, 0 the floor.
        self.share = 1.0
        self.refusing = False
        self.refused = 0
        # Resizes so far: a request's stats count those made while it ran.
        self.resizes = 0
        self.events: deque[ResizeEvent] = deque(maxlen=KEPT_EVENTS)
        self._sm: Any = None
        self._note = "off: no memory-pressure source" if source is None else "no model loaded"
        self._made: list[int] = []
        self._tier: TieredAdmitter | None = None
        self._last_poll = float("-inf")
        # When the share last changed, and when a reading last saw pressure.
        self._changed = float("-inf")
        self._pressed = float("-inf")

    # ---- the model --------------------------------------------------------------------

    def attach(self, sm: Any) -> None:
        """A model was loaded: resize its pools from now on (from all of them again)."""
        self._sm, self.share, self.refusing = None, 1.0, False
        if self.source is None:
            return
        if sm.mapped_pool is not None:
            self._note = "off: a mapped pool keeps every expert in host memory"
            return
        if sm.share is not None:
            self._note = "off: an expert-parallel group's pools"
            return
        self._sm = sm
        self._made = [p.capacity for p in sm.pools]
        from .host_tier import TieredAdmitter

        admitter = sm.admitter
        self._tier = admitter if isinstance(admitter, TieredAdmitter) and admitter.caching else None
        self._note = (
            "critical: the floor (top-k), then new requests refused; warn: half the rest; normal: all of it again"
        )

    def detach(self) -> None:
        """The model was released (keep_alive): nothing to resize, nothing refused."""
        self._sm, self.refusing = None, False
        if self.source is not None:
            self._note = "no model loaded"

    @property
    def watching(self) -> bool:
        """Whether it reads the pressure for a model's pools now."""
        return self.source is not None and self._sm is not None

    @property
    def floor(self) -> int:
        return max((p.top_k for p in self._sm.pools), default=0) if self._sm is not None else 0

    def made_pool_bytes(self) -> int:
        """The pools' bytes at the size they were made with (0 without a model)."""
        if self._sm is None:
            return 0
        return sum(made * p.layer.expert_bytes for made, p in zip(self._made, self._sm.pools))

    def slots(self) -> int:
        return max((p.capacity for p in self._sm.pools), default=0) if self._sm is not None else 0

    def _tier_bytes(self) -> int:
        return self._tier.tier.slots * self._tier.tier.stride if self._tier is not None else 0

    # ---- the rule ---------------------------------------------------------------------

    def tick(self, force: bool = False) -> ResizeEvent | None:
        """At a turn of the engine's loop, between steps: read the pressure (every
        `poll_seconds`, or now with `force`) and resize where the rule says so."""
        if self.source is None:
            return None
        now = self.clock()
        if not force and now - self._last_poll < self.poll_seconds:
            return None
        self._last_poll = now
        tic = time.perf_counter()
        reading = self.source.read()
        self.level, self.detail = reading.level, reading.detail
        if reading.level != "normal":
            self._pressed = now
        if self._sm is None:
            return None
        share = self._next_share(reading.level, now)
        if self._sizes(share) == self._sizes(self.share) and self._tier_slots(share) == self._tier_slots(self.share):
            self.share = share  # nothing to move (a floor reached already)
            return None
        return self._resize(share, reading, tic)

    def _next_share(self, level: Level, now: float) -> float:
        settled = now - self._changed >= self.settle_seconds
        if level == "critical":
            # Still critical a while after the pool reached its floor: no more requests.
            self.refusing = self.share == 0.0 and settled
            return 0.0
        self.refusing = False
        if level == "warn":
            if not settled or self.share == 0.0:
                return self.share
            half = self.share / 2
            # Down to the floor once halving no longer changes a layer's slots.
            return half if self._sizes(half) != self._sizes(self.share) else 0.0
        return 1.0 if now - self._pressed >= self.settle_seconds else self.share

    def _sizes(self, share: float) -> list[int]:
        floor = self.floor
        return [floor + round(share * (made - floor)) for made in self._made]

    def _tier_slots(self, share: float) -> int:
        if self._tier is None:
            return 0
        most = self._tier.tier.most
        return min(most, max(self.floor, round(share * most)))

    def _resize(self, share: float, reading: Pressure, tic: float) -> ResizeEvent:
        """Resize to `share`; `tic`: when `reading` was taken (perf_counter)."""
        import mlx.core as mx

        sm = self._sm
        before = (self.slots(), sm.pool_bytes, self._tier_bytes())
        moved = 0
        tier_slots = self._tier_slots(share)
        if self._tier is not None and share < self.share:
            self._tier.resize_tier(tier_slots)
        # The forward queued before the resize holds the old arrays: once it has run, each
        # layer's go as its new ones replace them, and MLX's cache gives their memory back
        # to the system then, so that a shrink holds one layer's arrays twice at the most.
        mx.synchronize()
        for pool, size in zip(sm.pools, self._sizes(share)):
            moved += pool.resize(size)
            mx.clear_cache()
        if self._tier is not None and share > self.share:
            self._tier.resize_tier(tier_slots)
        self.share, self._changed = share, self.clock()
        after = (self.slots(), sm.pool_bytes, self._tier_bytes())
        why = f"memory pressure {reading.level} ({reading.detail})"
        if reading.level == "normal":
            why = f"the memory pressure passed ({reading.detail})"
        event = ResizeEvent(
            at=time.time(),
            level=reading.level,
            reason=why,
            slots_from=before[0],
            slots_to=after[0],
            pool_bytes_from=before[1],
            pool_bytes_to=after[1],
            tier_bytes_from=before[2],
            tier_bytes_to=after[2],
            experts_moved=moved,
            seconds=time.perf_counter() - tic,
        )
        self.events.append(event)
        self.resizes += 1
        self.log.info(
            "elastic pool: %s: %d -> %d slots per layer, pool %s -> %s, host tier %s -> %s, %d experts %s in %.3f s",
            why,
            before[0],
            after[0],
            format_size(before[1]),
            format_size(after[1]),
            format_size(before[2]),
            format_size(after[2]),
            moved,
            "given back" if share < 1.0 and after[0] < before[0] else "read back",
            event.seconds,
        )
        return event

    # ---- what clients see -------------------------------------------------------------

    def why_refused(self) -> str:
        return (
            f"the machine is under critical memory pressure ({self.detail}) and the expert pool is at its floor "
            f"({self.floor} slots per layer, the experts one token routes to): new requests are refused until the "
            "pressure passes; try again later"
        )

    def refuse(self) -> str:
        """Count a request refused; the message it gets."""
        self.refused += 1
        return self.why_refused()

    def status(self) -> ElasticStatus:
        sm = self._sm
        return ElasticStatus(
            source=self.source.name if self.source is not None else None,
            note=self._note,
            level=self.level,
            detail=self.detail,
            slots=self.slots(),
            configured_slots=max(self._made, default=0) if sm is not None else 0,
            floor_slots=self.floor,
            tier_bytes=self._tier_bytes() if sm is not None else 0,
            configured_tier_bytes=self._tier.tier.most * self._tier.tier.stride if sm is not None and self._tier else 0,
            refusing=self.refusing,
            refused=self.refused,
            events=list(self.events),
        )
