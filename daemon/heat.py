"""One process's heat: the warm start from the saved routing counts, and the counts since
sent to its heat keeper (`heat_publisher.py`, `heat_keeper.py`).

The daemon's engine thread owns one; in an expert-parallel group (docs/scale-out.md) every
rank owns one (rank 0 in the engine, the others in `expert_worker.py`), for the experts it
owns: its pools count routings in the rows of its share, which go to the file as global
expert ids, in a file of the rank's own (`shared/heat_file.py` `usage_name`) through a
keeper of its own, whose sockets are named after that file. A warm start of a rank pins
its hottest owned experts from its file.

Beside the counts, the pools' LRU stack distances (daemon/pool/reuse.py), from which
`moestreamctl plan` forecasts the hit rate of any pool size: taken with every push and
added to `pool_reuse.json` in the heat folder by this process itself (no keeper: a few
kilobytes, read, added to and written atomically under the file's lock) every
REUSE_SAVE_SECONDS, before an unload and at the end; a daemon killed in between loses
what it counted since its last save, which a forecast can spare. A rank of a group
records none (its pools see only its share of the experts, not the layer's reuse).

Called from the thread that runs the model only (the pools' counters are that thread's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..shared.heat_file import usage_name
from ..shared.settings import Settings

# How often the keeper's health is looked at (a dead keeper is restarted then).
CHECK_SECONDS = 1.0
# How often the stack distances counted since are added to the reuse file.
REUSE_SAVE_SECONDS = 300.0
# The states `health()` reports, in the order `state_code` numbers them (a rank's status
# crosses the group as integers: daemon/model/expert_parallel.py STAT_FIELDS).
STATES = ("not started", "starting", "running", "waiting", "down", "closed", "off")


def state_code(state: str) -> int:
    return STATES.index(state) if state in STATES else STATES.index("off")


@dataclass
class HeatCounters:
    """What this process's heat did: routing counts loaded at the last warm start and the
    experts it pinned from them (or placed, with a mapped pool)."""

    loaded_counts: int = 0
    pinned: int = 0
    foreign_entries: int = 0


class Heat:
    """The heat of one process (the daemon, or one rank of its group)."""

    def __init__(self, settings: Settings, log: logging.Logger, share: Any = None) -> None:
        """`share`: this rank's `ExpertShare` in an expert-parallel group, else None."""
        self.settings = settings
        self.log = log
        self.share = share
        self.name = usage_name() if share is None else usage_name(share.rank, share.size)
        self.publisher: Any = None
        self.state: dict[str, Any] = {"state": "not started"}
        self.autopin: dict[str, Any] | None = None
        self.counters = HeatCounters()
        self._last_push = self._last_check = self._last_reuse_save = time.monotonic()
        # Stack distances taken from the pools and not yet in the reuse file: {layer: histogram}.
        self._reuse: dict[int, Any] = {}

    def folder(self, sm: Any) -> Path:
        return self.settings.heat_folder(sm.store_dir)

    # ---- the warm start ----------------------------------------------------------------

    def pin(self, sm: Any) -> None:
        """Pin each layer's hottest experts (this rank's, in a group) from the saved heat."""
        from ..shared.heat_file import HeatReadError, read_usage, usage_path
        from .pool.autopin import autopin

        heat_dir = self.folder(sm)
        if not self.settings.heat_dir and heat_dir != Path(sm.store_dir).resolve():
            self.log.info(
                "heat: kept in %s, not beside the store (the demo, or a folder this user cannot write or does not own)",
                heat_dir,
            )
        try:
            heat_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            # The keeper will fail its writes and say so in `status`; serving goes on.
            self.log.error("heat: cannot create the heat folder %s: %s", heat_dir, e)
        try:
            # A rank's file holds global ids, which `local_counts` checks against its share.
            shape = {p.layer.ordinal: p.layer.num_experts for p in sm.pools} if self.share is None else None
            usage = read_usage(usage_path(heat_dir, self.name), shape)
        except HeatReadError as e:
            self.log.error("heat: cannot read the saved heat (%s); starting without pinned experts", e)
            return
        if usage.problem:
            self.log.error("heat: %s", usage.problem)
        counts = usage.counts
        if self.share is not None:
            counts, foreign = self.share.local_counts(counts, {p.layer.ordinal: p.layer.num_experts for p in sm.pools})
            self.counters.foreign_entries = foreign
            if foreign:
                self.log.error(
                    "heat: %s names %d experts that are not rank %d's (another rank's, or no layer's); left out",
                    usage.path,
                    foreign,
                    self.share.rank,
                )
        summary = autopin(sm, counts, self.settings.autopin_frac)
        self.counters.loaded_counts = usage.total
        self.counters.pinned = summary.placed if summary.mapped else summary.pinned
        self.autopin = {
            **summary.to_dict(),
            "routing_counts": usage.total,
            "problem": usage.problem,
            "foreign_entries": self.counters.foreign_entries,
        }
        self.log.info(
            "autopin: %d experts %s in %d layers (%d more loaded unpinned, %.0f MB read into the host tier) "
            "from %d saved routing counts (%s) in %.2f s",
            self.counters.pinned,
            "placed in GPU memory" if summary.mapped else "pinned",
            summary.layers,
            summary.preloaded,
            summary.tier_warmed_bytes / 1e6,
            usage.total,
            usage.path,
            summary.seconds,
        )

    # ---- the keeper ----------------------------------------------------------------------

    def start(self, sm: Any) -> None:
        from .heat_publisher import HeatPublisher

        self.publisher = HeatPublisher(
            self.folder(sm),
            self.settings.runtime_path(),
            flush_seconds=self.settings.heat_flush_seconds,
            usage_name=self.name,
            log=self.log.getChild("heat"),
        )
        self.publisher.start()

    def push(self, sm: Any) -> None:
        """Send the counts routed since the last push (global ids)."""
        if self.publisher is None or sm is None:
            return
        if self.share is None:
            counts = {p.layer.ordinal: p.take_routed() for p in sm.pools}
        else:
            counts = {p.layer.ordinal: self.share.global_counts(p.take_routed()) for p in sm.pools}
        self.publisher.push(counts)
        self._last_push = time.monotonic()
        self.take_reuse(sm)

    def take_reuse(self, sm: Any) -> None:
        """Take the pools' stack distances into what the next `save_reuse` adds (a rank
        of a group takes none: its pools see only its share of each layer)."""
        if self.share is not None or sm is None:
            return
        for p in sm.pools:
            taken = p.stack_distances.take()
            if taken.any():
                held = self._reuse.get(p.layer.ordinal)
                self._reuse[p.layer.ordinal] = taken if held is None else held + taken

    def save_reuse(self, sm: Any, lock_timeout: float = 0.0) -> bool:
        """Add the stack distances taken since the last save to the reuse file; False
        where it could not (they are kept for the next save, and the log says why)."""
        from ..shared.heat_file import HeatFileError, HeatLockTimeout, UsageLock, add_counts, read_usage, write_usage
        from ..shared.store_format import POOL_REUSE_NAME

        self._last_reuse_save = time.monotonic()
        if not self._reuse or sm is None:
            return True
        path = self.folder(sm) / POOL_REUSE_NAME
        lock = UsageLock(path)
        try:
            lock.acquire(lock_timeout)
            try:
                # A distance runs to num_experts (first uses); a file of another shape is set aside.
                saved = read_usage(path, {p.layer.ordinal: p.layer.num_experts + 1 for p in sm.pools})
                if saved.problem:
                    self.log.error("heat: %s", saved.problem)
                table = {layer: dict(d) for layer, d in saved.counts.items()}
                taken = {layer: {d: int(h[d]) for d in h.nonzero()[0].tolist()} for layer, h in self._reuse.items()}
                add_counts(table, taken)
                write_usage(path, table)
            finally:
                lock.release()
        except (HeatFileError, HeatLockTimeout) as e:
            self.log.warning("heat: the reuse file is not updated this time (%s); its counts are kept", e)
            return False
        self._reuse = {}
        return True

    def tick(self, sm: Any) -> None:
        """Call often: pushes every `heat_flush_seconds`, looks at the keeper every CHECK_SECONDS."""
        if self.publisher is None:
            return
        now = time.monotonic()
        if now - self._last_push >= self.settings.heat_flush_seconds:
            self.push(sm)
        if now - self._last_reuse_save >= REUSE_SAVE_SECONDS:
            self.save_reuse(sm)
        if now - self._last_check >= CHECK_SECONDS:
            self._last_check = now
            self.publisher.check()  # restarts a keeper that died

    def flush(self, sm: Any, timeout: float = 5.0) -> bool:
        """Push and have the keeper write everything; False where it did not (True where no
        keeper runs: nothing is waiting to be written)."""
        if self.publisher is None:
            return True
        self.push(sm)
        self.save_reuse(sm, lock_timeout=timeout)
        return self.publisher.flush(timeout)

    def close(self, sm: Any) -> None:
        if self.publisher is None:
            return
        if not self.flush(sm):
            self.log.error("heat: the final flush did not complete; the last counts may be lost")
        self.publisher.close(5.0)
        self.state = {"state": "closed"}
        self.publisher = None

    def health(self) -> dict[str, Any]:
        if self.publisher is None:
            return dict(self.state)
        health = self.publisher.health()
        if not health["alive"]:
            return {"state": "down", **health}
        if not health["ready"]:
            return {"state": "starting", **health}
        if health["lock_wait"]:
            # Another daemon's keeper writes this heat file: ours keeps the counts in a file
            # of its own until it can add them (daemon/heat_keeper.py, The lock).
            note = (
                f"{health['lock_wait']} (a second daemon on this store?); this daemon's counts are kept in "
                f"{health['pending']} and added to the heat file once it is free"
            )
            return {"state": "waiting", "note": note, **health}
        return {"state": "running", **health}

    def summary(self) -> list[int]:
        """For a rank's status row: the state's code, routing counts sent, dropped, loaded
        at the warm start, experts pinned."""
        health = self.health()
        return [
            state_code(health["state"]),
            int(health.get("sent_counts") or 0),
            int(health.get("dropped_counts") or 0),
            self.counters.loaded_counts,
            self.counters.pinned,
        ]
