"""Prefetch: reads of the experts the predictor names, started while a layer computes.

Reads land in a small buffer of host memory of its own (page-locked on CUDA, so its
bytes reach the pool by DMA), never in pool slots: a slot may only be written once the
queued work that reads it has drained (`ExpertPool._quiesce`), which is what the layer
that uses the expert does anyway. So prefetch changes where the bytes come from, never
which bytes land in which slot, and the output stays exact.

With a host-RAM tier (`--host-cache`), experts the tier holds are not read at all: the
next layer's pool copies them into its slots straight away (`ExpertPool.prestage`, safe
because nothing queued reads that pool yet), and what this buffer promotes is copied into
the tier as well, so that no expert is read from disk twice while the tier keeps it.

Buffer entries are LRU over (layer, expert). An entry is pending (its read is queued or
running on the engine's threads), done, or failed; a pending entry is never reused. An
entry leaves the buffer when it is promoted into a pool (`promote`) or dropped for a newer
prefetch; dropped entries that were never used are counted (`dropped_unused`) and
remembered until their layer's next forward, for the diagnostics' attribution.

`PrefetchGovernor` decides, with `prefetch = auto`, whether prefetch pays on this
machine: it alternates windows of decode steps with prefetch on and off, compares the
median step times, and keeps prefetch only where it is faster; the decision and its
figures are in `stats()`.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from ..._native import CudaCopier, HostBuffer, copy_spans
from ...shared.store_format import Manifest, MoELayer
from ..model.decider import ABBA
from ..model.diagnostics import NULL_RECORDER, AnyRecorder
from ..pool.expert_reader import ExpertReader
from ..pool.host_tier import expert_stride

PENDING, DONE, FAILED = 0, 1, 2
PREFETCH_MODES = ("on", "off", "auto")
# Forwards with more tokens per sequence than this (prefills) are not prefetched: they
# need most experts anyway, and the demand path reads them in one batch.
MAX_PREFETCH_TOKENS = 16


@dataclass
class _Entry:
    slot: int
    rid: int
    state: int = PENDING


@dataclass
class PrefetchStats:
    submitted: int = 0
    promoted: int = 0
    waited: int = 0  # promoted after waiting for a read that had not finished
    failed: int = 0
    dropped_unused: int = 0
    no_room: int = 0  # predicted but not read: every buffer slot had a read in flight
    bytes_read: int = 0
    wait_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every counter, and the share of the reads that a pool used."""
        return {**asdict(self), "used_fraction": self.promoted / self.submitted if self.submitted else None}


class Prefetcher:
    """Async reads of predicted experts into host memory, and their promotion into pools."""

    def __init__(
        self,
        reader: ExpertReader,
        manifest: Manifest,
        copier: CudaCopier | None,
        *,
        slots: int,
        top_k: int,
        mode: str = "auto",
        tier: Any = None,
        depth: int = 1,
    ) -> None:
        if mode not in PREFETCH_MODES:
            raise ValueError(f"prefetch mode {mode!r}: use one of {', '.join(PREFETCH_MODES)}")
        self.stride = expert_stride(manifest)
        self.slots = slots
        # Experts named per token and prefetched: the next router's top k.
        self.top_k = top_k
        # MoE layers ahead each layer reads for (Settings.prefetch_depth; for `stats`).
        self.depth = depth
        self.reader = reader
        self.copier = copier
        # The host-RAM tier of `--host-cache`, when there is one: experts it holds are
        # not prefetched (reaching the pool from it is a copy, not a read).
        self.tier = tier
        self.buffer = HostBuffer(slots * self.stride, copier)
        self._view = memoryview(self.buffer).cast("B")
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))
        self._dropped: set[tuple[int, int]] = set()
        self.mode = mode
        self.enabled = mode != "off"
        self.governor = PrefetchGovernor(self) if mode == "auto" else None
        self.s = PrefetchStats()

    # ---- the switch --------------------------------------------------------------------

    def switch(self, enabled: bool) -> bool:
        """Turn prefetch on or off from outside the governor (a benchmark comparing the
        two); returns what it was. Under `prefetch = auto` the governor may turn it
        back at its next window."""
        was, self.enabled = self.enabled, enabled
        return was

    def start_auto(self) -> PrefetchGovernor:
        """Decide afresh, as `prefetch = auto` does at start: prefetch on and a new
        governor measuring (what the daemon's generation loop feeds); returns it."""
        self.mode, self.enabled = "auto", True
        self.governor = PrefetchGovernor(self)
        return self.governor

    # ---- reads -----------------------------------------------------------------------

    def submit(self, layer: MoELayer, experts: Sequence[int]) -> int:
        """Start reading these experts of `layer` (those not already buffered); never
        waits. Returns how many reads were started."""
        batch, keys = [], []
        for e in experts:
            key = (layer.ordinal, int(e))
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            if self.tier is not None and self.tier.holds(key):
                continue
            slot = self._take_slot()
            if slot is None:
                self.s.no_room += 1
                continue
            length = layer.experts[key[1]].length
            batch.append(self.reader.request(layer, key[1], [(self.buffer, slot * self.stride, 0, length)]))
            keys.append((key, slot))
            self._dropped.discard(key)
        if not batch:
            return 0
        try:
            ids = self.reader.submit(batch)
        except ValueError:
            # A bound the engine refuses (a truncated file): leave it to the demand read,
            # which says what is wrong.
            for _, slot in keys:
                self._free.append(slot)
            return 0
        for (key, slot), rid in zip(keys, ids):
            self._entries[key] = _Entry(slot, rid)
        self.s.submitted += len(ids)
        return len(ids)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, entry in self._entries.items():  # least recently used first
            if entry.state == PENDING and not self._poll(entry):
                continue
            del self._entries[key]
            if entry.state == DONE:
                self.s.dropped_unused += 1
                self._dropped.add(key)
            return entry.slot
        return None

    def _poll(self, entry: _Entry) -> bool:
        """Whether a pending read has ended (and take its completion)."""
        c = self.reader.poll(entry.rid)
        if c is None:
            return False
        self._complete(entry, c)
        return True

    def _complete(self, entry: _Entry, c: Any) -> None:
        if c.ok:
            entry.state = DONE
            self.s.bytes_read += c.nbytes
        else:
            entry.state = FAILED
            self.s.failed += 1

    # ---- what the pool asks ----------------------------------------------------------

    def state(self, ordinal: int, expert: int) -> str:
        """'done', 'pending', 'dropped' or 'none' for this expert (for attribution)."""
        key = (ordinal, expert)
        entry = self._entries.get(key)
        if entry is None:
            return "dropped" if key in self._dropped else "none"
        if entry.state == PENDING and not self._poll(entry):
            return "pending"
        return "done" if entry.state == DONE else "none"

    def has(self, ordinal: int, expert: int) -> bool:
        entry = self._entries.get((ordinal, expert))
        return entry is not None and entry.state != FAILED

    def forget_dropped(self, ordinal: int) -> None:
        if self._dropped:
            self._dropped = {k for k in self._dropped if k[0] != ordinal}

    def promote(
        self,
        layer: MoELayer,
        placements: Sequence[tuple[int, int]],
        arrays: dict[str, mx.array],
        rec: AnyRecorder = NULL_RECORDER,
    ) -> tuple[list[tuple[int, int]], int]:
        """Copy buffered experts into pool rows ((expert, row) pairs), waiting for reads
        still in flight. Returns the placements it could not serve (failed reads) and how
        many it waited for. `rec` (diagnostics) gets the host seconds of taking the reads
        (waiting for those in flight, also given apart as `read_wait`), routing and
        placing them."""
        ordinal = layer.ordinal
        waited, wait_s = 0, 0.0
        with rec.host(ordinal, "promote_take"):
            pending = [
                self._entries[(ordinal, e)] for e, _ in placements if self._entries[(ordinal, e)].state == PENDING
            ]
            rest = [en for en in pending if not self._poll(en)]
            if rest:
                tic = time.perf_counter()
                for en, c in zip(rest, self.reader.wait([en.rid for en in rest])):
                    self._complete(en, c)
                wait_s = time.perf_counter() - tic
                self.s.wait_seconds += wait_s
                waited = len(rest)
                self.s.waited += waited
        rec.read_wait(ordinal, wait_s)
        # A file written over since it was opened: none of its reads are served (the
        # demand read then says why, expert_reader.py).
        stale = self.reader.changed(layer.file) is not None
        with rec.host(ordinal, "promote_route"):
            spans, left = [], []
            served = []
            for e, row in placements:
                entry = self._entries.pop((ordinal, e))
                if entry.state != DONE or stale:
                    left.append((e, row))
                else:
                    served.append((e, entry))
                    base = entry.slot * self.stride
                    spans += [
                        (arrays[t.name], row * t.nbytes, self.buffer, base + t.offset, t.nbytes) for t in layer.tensors
                    ]
                self._free.append(entry.slot)
        with rec.host(ordinal, "promote_place"):
            if self.copier is not None and spans:
                self.copier.copy(spans)
            else:
                copy_spans(spans)
            if self.tier is not None:
                self._keep_in_tier(layer, served)
        self.s.promoted += len(served)
        return left, waited

    def _keep_in_tier(self, layer: MoELayer, served: Sequence[tuple[int, _Entry]]) -> None:
        """Copy what was read for the pool into the host tier too, so that an expert
        prefetched once comes from host memory the next time, not from the disk again.
        The caller has waited for the tier's copies in flight, so any slot may be taken."""
        # The tier's view now: an elastic pool may have made its buffer again (HostTier.resize).
        tier, view, stride = self.tier, self.tier.view, self.stride
        for e, entry in served:
            key = (layer.ordinal, e)
            if tier.holds(key):
                continue
            slot, _ = tier.assign(key, set())
            n = layer.experts[e].length
            view[slot * tier.stride : slot * tier.stride + n] = self._view[
                entry.slot * stride : entry.slot * stride + n
            ]

    def drain(self) -> None:
        """Wait for every read in flight (before the buffer or the engine goes away)."""
        pending = [en for en in self._entries.values() if en.state == PENDING]
        if pending:
            for en, c in zip(pending, self.reader.wait([en.rid for en in pending])):
                self._complete(en, c)

    def stats(self) -> dict[str, Any]:
        """How prefetch is set up, its counters (`PrefetchStats`) and, under `prefetch =
        auto`, the governor's measurement and decision."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "enabled": self.enabled,
            "depth": self.depth,
            "buffer_experts": self.slots,
            "buffer_bytes": self.slots * self.stride,
            **self.s.to_dict(),
        }
        if self.governor is not None:
            out["auto"] = self.governor.to_dict()
        return out


@dataclass
class PrefetchGovernor:
    """`prefetch = auto`: measure decode with prefetch on and off, keep what is faster.

    Decode steps are timed in windows of `window` steps, on and off in ABBA order (on,
    off, off, on, on, off, ...), so that a drift over the measurement (a host tier still
    filling, the pool warming up) weighs on both alike; the first step after a switch is
    not counted (it pays for the switch). After `trials` windows of each, prefetch stays
    on only if its median step time is at least `margin` faster than without; the
    decision holds for the rest of the run (the daemon's life). Each window's median is
    kept for `stats`, to show how steady the two were."""

    prefetcher: Prefetcher
    window: int = 8
    trials: int = 4
    margin: float = 0.02
    decided: bool = False
    on_steps: list[float] = field(default_factory=list)
    off_steps: list[float] = field(default_factory=list)
    # (on or off, median ms) of each window, in order.
    window_medians: list[tuple[str, float]] = field(default_factory=list)
    _in_window: int = 0
    # Windows in ABBA order; the first is on (prefetch starts on for the measurement).
    _order: ABBA = field(default_factory=lambda: ABBA("on", "off"))
    _current: list[float] = field(default_factory=list)
    # Whether the current window began with a switch; the first window counts as one
    # (prefetch was just turned on for the measurement).
    _switched: bool = True
    reason: str = "measuring"

    def observe(self, seconds: float) -> None:
        """One decode step took `seconds` (with prefetch as it is now)."""
        if self.decided:
            return
        if not (self._switched and self._in_window == 0):  # this step paid for the switch
            (self.on_steps if self.prefetcher.enabled else self.off_steps).append(seconds)
            self._current.append(seconds)
        self._in_window += 1
        if self._in_window < self.window:
            return
        self.window_medians.append(("on" if self.prefetcher.enabled else "off", 1e3 * statistics.median(self._current)))
        self._in_window, self._current = 0, []
        self._order.next()
        if self._order.blocks >= 2 * self.trials:
            self._decide()
            return
        enabled = self._order.current() == "on"
        self._switched = enabled != self.prefetcher.enabled
        self.prefetcher.enabled = enabled

    def _decide(self) -> None:
        on, off = statistics.median(self.on_steps), statistics.median(self.off_steps)
        ratio = off / on if on > 0 else 0.0
        self.decided = True
        keep = ratio >= 1.0 + self.margin
        self.prefetcher.enabled = keep
        self.reason = (
            f"{'on' if keep else 'off'}: decode {1 / on:.1f} tok/s with prefetch, {1 / off:.1f} without "
            f"({ratio:.2f}x{'' if keep else ', does not pay'})"
        )

    def to_dict(self) -> dict[str, Any]:
        on = statistics.median(self.on_steps) if self.on_steps else None
        off = statistics.median(self.off_steps) if self.off_steps else None
        return {
            "decided": self.decided,
            "decision": self.reason,
            "tokens_per_s_on": 1 / on if on else None,
            "tokens_per_s_off": 1 / off if off else None,
            "speedup": off / on if on and off else None,
            "steps_measured": len(self.on_steps) + len(self.off_steps),
            "window_medians_ms": [[state, round(ms, 3)] for state, ms in self.window_medians],
        }
