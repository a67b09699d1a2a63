"""Hot-path diagnostics of the streaming layers: what a forward spends where, how well
the predictor names the next layer's experts, and why each routed expert was or was not
resident.

The measurements (all per MoE layer):

- segments: seconds of route (router + top-k, and the predictor's router), slot lookup,
  read (bytes reaching slots: store reads, prefetch promotion), admit (waiting for queued
  work, slot bookkeeping), expert matmul, combine (the block's weighted sum over this
  layer's output), and `outside` (everything between two MoE layers: attention, the
  previous combine, shared experts). Device segments need a sync each, so diagnostics
  slow the forward down; they are for finding where time goes, not for speed figures.
- window: host seconds between submitting the next layer's prefetch and promoting it,
  the time reads have to hide behind compute; `read_wait`: seconds spent waiting for
  prefetch reads that had not finished by then.
- recall at k, 2k and 4k: routed experts the predictor had named / routed experts.
- host seconds of predict, submit and promote (take, route, place).
- attribution of every routed expert (unique per forward, like the pool's hits and
  misses), prefill and decode apart: a resident hit; promoted from a finished prefetch;
  predicted but the read had not finished; predicted and read but dropped before use;
  predicted but not read (prefetch off, no room, or already in the host tier); not
  predicted. The buckets sum to the layer's hits + misses.
- union: experts one forward needs, per tokens-per-sequence (1 = decode, K = speculative
  verify, a chunk = prefill), with p50, p99 and max: the lower bound of a layer's capacity.

A `Recorder` holds one request's figures (or a benchmark's); `Diagnostics` is the switch
the streaming layers read and keeps the totals of every recorder merged into it. The hot
path records into `Diagnostics.recorder` the same way whether diagnostics are on or off:
off, that is the `NullRecorder`, whose methods do nothing (no MLX work, no host sync, no
allocation: `segment` and `host` hand back one shared context manager), so that the
code of a forward reads the same either way and costs a few empty calls per layer.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from ..pool.expert_pool import ExpertPool
    from ..prefetch.predictor import Prediction

SEGMENTS = ("outside", "route", "lookup", "read", "admit", "matmul", "combine")
HOST_TIMES = ("predict", "submit", "promote_take", "promote_route", "promote_place")
BUCKETS = (
    "resident_hit",
    "prefetched",
    "predicted_not_finished",
    "predicted_evicted",
    "predicted_not_read",
    "not_predicted",
)
RECALL_AT = (1, 2, 4)  # multiples of top-k
# Union samples kept per (layer, tokens per sequence) for the percentiles; max is exact.
UNION_SAMPLES = 4096
WINDOW_SAMPLES = 4096


def _phase(decode: bool) -> str:
    return "decode" if decode else "prefill"


@dataclass
class _Timer:
    seconds: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.count += 1

    def merge(self, other: "_Timer") -> None:
        self.seconds += other.seconds
        self.count += other.count

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "count": self.count,
            "mean_ms": 1e3 * self.seconds / self.count if self.count else None,
        }


@dataclass
class _Union:
    samples: deque = field(default_factory=lambda: deque(maxlen=UNION_SAMPLES))
    count: int = 0
    max: int = 0

    def add(self, n: int) -> None:
        self.samples.append(n)
        self.count += 1
        if n > self.max:
            self.max = n

    def merge(self, other: "_Union") -> None:
        self.samples.extend(other.samples)
        self.count += other.count
        self.max = max(self.max, other.max)

    def to_dict(self) -> dict[str, Any]:
        a = np.fromiter(self.samples, np.int64, len(self.samples))
        return {
            "forwards": self.count,
            "p50": float(np.percentile(a, 50)) if a.size else None,
            "p99": float(np.percentile(a, 99)) if a.size else None,
            "max": self.max,
        }


@dataclass
class LayerDiagnostics:
    """The figures of one MoE layer."""

    segments: dict[str, _Timer] = field(default_factory=lambda: {s: _Timer() for s in SEGMENTS})
    host: dict[str, _Timer] = field(default_factory=lambda: {s: _Timer() for s in HOST_TIMES})
    attribution: dict[str, dict[str, int]] = field(
        default_factory=lambda: {p: dict.fromkeys(BUCKETS, 0) for p in ("prefill", "decode")}
    )
    # phase -> multiple of k -> [named and routed, routed]
    recall: dict[str, dict[int, list[int]]] = field(
        default_factory=lambda: {p: {m: [0, 0] for m in RECALL_AT} for p in ("prefill", "decode")}
    )
    union: dict[int, _Union] = field(default_factory=dict)
    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW_SAMPLES))
    window_total: _Timer = field(default_factory=_Timer)
    read_wait: _Timer = field(default_factory=_Timer)

    def merge(self, other: "LayerDiagnostics") -> None:
        for name, t in other.segments.items():
            self.segments[name].merge(t)
        for name, t in other.host.items():
            self.host[name].merge(t)
        for phase, buckets in other.attribution.items():
            for b, n in buckets.items():
                self.attribution[phase][b] += n
        for phase, by_k in other.recall.items():
            for m, (hit, total) in by_k.items():
                self.recall[phase][m][0] += hit
                self.recall[phase][m][1] += total
        for seq, u in other.union.items():
            self.union.setdefault(seq, _Union()).merge(u)
        self.window.extend(other.window)
        self.window_total.merge(other.window_total)
        self.read_wait.merge(other.read_wait)

    def to_dict(self) -> dict[str, Any]:
        w = np.fromiter(self.window, np.float64, len(self.window))
        return {
            "segments": {k: v.to_dict() for k, v in self.segments.items()},
            "host": {k: v.to_dict() for k, v in self.host.items()},
            "attribution": {p: dict(b) for p, b in self.attribution.items()},
            "recall": {p: _recall(by_k) for p, by_k in self.recall.items()},
            "union": {str(seq): u.to_dict() for seq, u in sorted(self.union.items())},
            "window": {
                **self.window_total.to_dict(),
                "p50_ms": 1e3 * float(np.percentile(w, 50)) if w.size else None,
                "min_ms": 1e3 * float(w.min()) if w.size else None,
            },
            "read_wait": self.read_wait.to_dict(),
        }


def _recall(by_k: dict[int, list[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m, (hit, total) in by_k.items():
        key = "top_k" if m == 1 else f"top_{m}k"
        out[key] = hit / total if total else None
    out["routed"] = by_k[RECALL_AT[0]][1]
    return out


class _Timed:
    """Adds the seconds its `with` block took to a timer."""

    __slots__ = ("_timer", "_tic")

    def __init__(self, timer: _Timer) -> None:
        self._timer = timer
        self._tic = 0.0

    def __enter__(self) -> None:
        self._tic = time.perf_counter()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._timer.add(time.perf_counter() - self._tic)


class _Untimed:
    """A `with` block that records nothing (explicit `__exit__` arguments: no tuple per
    exit)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None


_UNTIMED = _Untimed()


class Recorder:
    """Diagnostics of one request or benchmark run, per MoE layer (by ordinal).

    The recording methods are what the streaming layers call on every forward, on this
    or on the `NullRecorder` alike; those that time device work evaluate it (a sync)."""

    # Diagnostics are on: the layers also rank 4k experts for recall (`ranked_width`).
    active = True

    def __init__(self) -> None:
        self.layers: dict[int, LayerDiagnostics] = {}

    def layer(self, ordinal: int) -> LayerDiagnostics:
        d = self.layers.get(ordinal)
        if d is None:
            d = self.layers[ordinal] = LayerDiagnostics()
        return d

    # ---- recording -------------------------------------------------------------------

    def segment(self, ordinal: int, name: str) -> _Timed:
        """A `with` block timed as segment `name` (host clock)."""
        return _Timed(self.layer(ordinal).segments[name])

    def host(self, ordinal: int, name: str) -> _Timed:
        """A `with` block timed as host time `name` (HOST_TIMES)."""
        return _Timed(self.layer(ordinal).host[name])

    def wait_for(self, ordinal: int, name: str, x: mx.array) -> None:
        """Evaluate `x` and time that as segment `name`: what was queued before it (for
        `outside`, everything since the previous MoE layer)."""
        tic = time.perf_counter()
        mx.eval(x)
        self.layer(ordinal).segments[name].add(time.perf_counter() - tic)

    def experts(self, ordinal: int, y: mx.array, indices: Any) -> None:
        """Time the expert call `y` (`matmul`) and, on an output of its shape, the block's
        combine, a weighted sum over the routed experts (`combine`); `indices` has the
        routing's shape."""
        segments = self.layer(ordinal).segments
        tic = time.perf_counter()
        mx.eval(y)
        segments["matmul"].add(time.perf_counter() - tic)
        weights = mx.ones(indices.shape, dtype=y.dtype)
        mx.eval(weights)
        tic = time.perf_counter()
        mx.eval((y * weights[..., None]).sum(axis=-2))
        segments["combine"].add(time.perf_counter() - tic)

    def read_routes(self, ordinal: int, indices: mx.array) -> None:
        """A fully resident layer's routing, which never leaves the device otherwise:
        read it back (a sync, timed as `route`) for the union of its experts."""
        tic = time.perf_counter()
        ids = np.array(indices)
        self.layer(ordinal).segments["route"].add(time.perf_counter() - tic)
        self.union(ordinal, indices.shape[-2] if indices.ndim >= 2 else 1, ids)

    def union(self, ordinal: int, seq_len: int, token_experts: np.ndarray) -> None:
        """The experts one forward of `seq_len` tokens per sequence routed to
        (`token_experts`: their ids, any shape), counted once each."""
        layer = self.layer(ordinal)
        u = layer.union.get(seq_len)
        if u is None:
            u = layer.union[seq_len] = _Union()
        u.add(int(np.unique(token_experts).size))

    def ranked_width(self, top_k: int) -> int:
        """How many experts per token a layer ranks for the next: 4k (recall at k, 2k
        and 4k), best first (`active`)."""
        return 4 * top_k

    def now(self) -> float:
        """The clock of the compute window (`attribute`)."""
        return time.perf_counter()

    def attribute(
        self,
        pool: ExpertPool,
        decode: bool,
        needed: np.ndarray,
        missing: Sequence[int],
        prediction: Prediction | None,
        *,
        promotable: bool,
    ) -> None:
        """Attribute each expert a forward of `pool` needed to a bucket (BUCKETS), and
        record the prediction's recall and compute window. `needed`: the forward's unique
        experts; `missing`: those of them not resident (its `last_prestaged_used`:
        resident only thanks to prestage); its prefetcher's buffer may hold the missing
        ones (`promotable`: the forward promotes from it; an overflow forward reads every
        miss itself)."""
        ordinal, prestaged_used, prefetcher = pool.layer.ordinal, pool.last_prestaged_used, pool.prefetcher
        count = self.layer(ordinal).attribution[_phase(decode)]
        count["resident_hit"] += len(needed) - len(missing) - prestaged_used
        count["prefetched"] += prestaged_used
        named = set(prediction.named.tolist()) if prediction is not None else ()
        for e in missing:
            state = prefetcher.state(ordinal, e) if prefetcher is not None else "none"
            if promotable and state == "done":
                bucket = "prefetched"
            elif promotable and state == "pending":
                bucket = "predicted_not_finished"
            elif e in named:
                bucket = "predicted_evicted" if state == "dropped" else "predicted_not_read"
            else:
                bucket = "not_predicted"
            count[bucket] += 1
        if prefetcher is not None:
            prefetcher.forget_dropped(ordinal)
        if prediction is not None:
            self.recall(ordinal, decode, pool.top_k, needed, prediction.ranked)
            if prediction.submitted:
                self.window(ordinal, time.perf_counter() - prediction.submitted_at)

    def recall(self, ordinal: int, decode: bool, top_k: int, routed: np.ndarray, ranked: np.ndarray) -> None:
        """`routed`: the unique experts the layer needed; `ranked`: [tokens, >= 4k] the
        predictor's experts per token, best first."""
        by_k = self.layer(ordinal).recall[_phase(decode)]
        for m in RECALL_AT:
            named = np.unique(ranked[:, : m * top_k])
            by_k[m][0] += int(np.isin(routed, named).sum())
            by_k[m][1] += int(routed.size)

    def window(self, ordinal: int, seconds: float) -> None:
        layer = self.layer(ordinal)
        layer.window.append(seconds)
        layer.window_total.add(seconds)

    def read_wait(self, ordinal: int, seconds: float) -> None:
        """Seconds a layer waited for prefetch reads that had not finished."""
        self.layer(ordinal).read_wait.add(seconds)

    # ---- results ---------------------------------------------------------------------

    def merge(self, other: "Recorder") -> None:
        for ordinal, d in other.layers.items():
            self.layer(ordinal).merge(d)

    @property
    def empty(self) -> bool:
        return not self.layers

    def to_dict(self) -> dict[str, Any]:
        """Totals over layers, then each layer's figures."""
        total = LayerDiagnostics()
        for d in self.layers.values():
            total.merge(d)
        recall = total.recall
        both = {
            m: [recall["prefill"][m][0] + recall["decode"][m][0], recall["prefill"][m][1] + recall["decode"][m][1]]
            for m in RECALL_AT
        }
        return {
            "attribution": total.attribution,
            "recall": {"all": _recall(both), **{p: _recall(by_k) for p, by_k in recall.items()}},
            "segments": {k: v.to_dict() for k, v in total.segments.items()},
            "host": {k: v.to_dict() for k, v in total.host.items()},
            "window": total.window_total.to_dict(),
            "read_wait": total.read_wait.to_dict(),
            "layers": {str(o): d.to_dict() for o, d in sorted(self.layers.items())},
        }


class NullRecorder:
    """What the streaming layers record into while diagnostics are off: the recording
    methods of `Recorder`, each doing nothing (no MLX work, no host sync, no allocation)."""

    __slots__ = ()

    active = False

    def segment(self, ordinal: int, name: str) -> _Untimed:
        return _UNTIMED

    def host(self, ordinal: int, name: str) -> _Untimed:
        return _UNTIMED

    def wait_for(self, ordinal: int, name: str, x: mx.array) -> None:
        return None

    def experts(self, ordinal: int, y: mx.array, indices: Any) -> None:
        return None

    def read_routes(self, ordinal: int, indices: mx.array) -> None:
        return None

    def union(self, ordinal: int, seq_len: int, token_experts: np.ndarray) -> None:
        return None

    def ranked_width(self, top_k: int) -> int:
        """Prefetch alone needs the next layer's top k, in any order."""
        return top_k

    def now(self) -> float:
        return 0.0

    def attribute(
        self,
        pool: ExpertPool,
        decode: bool,
        needed: np.ndarray,
        missing: Sequence[int],
        prediction: Prediction | None,
        *,
        promotable: bool,
    ) -> None:
        return None

    def read_wait(self, ordinal: int, seconds: float) -> None:
        return None


# It holds nothing, so one serves every model.
NULL_RECORDER = NullRecorder()

# What a forward records into: a request's recorder, or the null one.
AnyRecorder = Recorder | NullRecorder


class LayerClock(Protocol):
    """A per-layer host clock the streaming layers feed (`bench decode`'s, in
    daemon/bench/decode.py): a forward's start and stop, and the MLX evaluations inside
    it, whose time it leaves out."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def evaluate(self, run: Callable[..., Any], arrays: Sequence[mx.array]) -> None: ...


class Diagnostics:
    """The switch the streaming layers read, and the totals over finished recorders.

    `recording(rec)` points the hot path at a recorder for a `with` block (the work of
    one request's step, or a benchmark's run); `rec` is that recorder, or None
    (diagnostics off); the hot path reads `recorder`, the same recorder or else the
    `NullRecorder`. `default` is the daemon's `--diagnostics`: every request records
    when it is set."""

    def __init__(self, default: bool = False) -> None:
        self.default = default
        self.recorder: AnyRecorder = NULL_RECORDER
        # `bench decode`'s per-layer host clock, None otherwise.
        self.clock: LayerClock | None = None
        self.total = Recorder()
        self.version = 0
        self._cached: tuple[int, dict[str, Any]] | None = None

    @contextmanager
    def recording(self, rec: Recorder | None) -> Iterator[None]:
        """Record into `rec` (None: nothing) inside the block, and into what was recorded
        into before it after the block, however it ends. Requests interleaved on the
        engine thread each record only between their own resume and yield."""
        before = self.recorder
        self.recorder = NULL_RECORDER if rec is None else rec
        try:
            yield
        finally:
            self.recorder = before

    @contextmanager
    def clocked(self, clock: LayerClock) -> Iterator[None]:
        """Time every MoE layer's forward into `clock` inside the block (`bench decode`)."""
        before, self.clock = self.clock, clock
        try:
            yield
        finally:
            self.clock = before

    def new_recorder(self, requested: bool) -> Recorder | None:
        """A recorder for a request that asked for diagnostics (or any, when on by default)."""
        return Recorder() if requested or self.default else None

    def finish(self, rec: Recorder) -> None:
        """Add a finished recorder to the totals."""
        self.total.merge(rec)
        self.version += 1

    def totals(self) -> dict[str, Any] | None:
        """The totals as a dict (cached between changes); None when nothing was recorded."""
        if self.total.empty:
            return None
        if self._cached is None or self._cached[0] != self.version:
            self._cached = (self.version, self.total.to_dict())
        return self._cached[1]
