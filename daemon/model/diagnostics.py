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
the streaming layers read (`rec` is None when off: one attribute test on the hot path and
nothing else) and keeps the totals of every recorder merged into it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
        return {"seconds": self.seconds, "count": self.count, "mean_ms": 1e3 * self.seconds / self.count if self.count else None}


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


class Recorder:
    """Diagnostics of one request or benchmark run, per MoE layer (by ordinal)."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerDiagnostics] = {}

    def layer(self, ordinal: int) -> LayerDiagnostics:
        d = self.layers.get(ordinal)
        if d is None:
            d = self.layers[ordinal] = LayerDiagnostics()
        return d

    # ---- recording (called only while diagnostics are on) ----------------------------

    def segment(self, ordinal: int, name: str, seconds: float) -> None:
        self.layer(ordinal).segments[name].add(seconds)

    def host(self, ordinal: int, name: str, seconds: float) -> None:
        self.layer(ordinal).host[name].add(seconds)

    def union(self, ordinal: int, seq_len: int, experts: int) -> None:
        layer = self.layer(ordinal)
        u = layer.union.get(seq_len)
        if u is None:
            u = layer.union[seq_len] = _Union()
        u.add(experts)

    def attribute(self, ordinal: int, decode: bool, bucket: str, n: int = 1) -> None:
        self.layer(ordinal).attribution[_phase(decode)][bucket] += n

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
        layers = {str(o): d.to_dict() for o, d in sorted(self.layers.items())}
        total_attr = {p: dict.fromkeys(BUCKETS, 0) for p in ("prefill", "decode")}
        total_recall = {p: {m: [0, 0] for m in RECALL_AT} for p in ("prefill", "decode")}
        segments = {s: _Timer() for s in SEGMENTS}
        host = {s: _Timer() for s in HOST_TIMES}
        window, read_wait = _Timer(), _Timer()
        for d in self.layers.values():
            for p, b in d.attribution.items():
                for k, n in b.items():
                    total_attr[p][k] += n
            for p, by_k in d.recall.items():
                for m, (hit, tot) in by_k.items():
                    total_recall[p][m][0] += hit
                    total_recall[p][m][1] += tot
            for s, t in d.segments.items():
                segments[s].merge(t)
            for s, t in d.host.items():
                host[s].merge(t)
            window.merge(d.window_total)
            read_wait.merge(d.read_wait)
        both = {m: [total_recall["prefill"][m][0] + total_recall["decode"][m][0],
                    total_recall["prefill"][m][1] + total_recall["decode"][m][1]] for m in RECALL_AT}
        return {
            "attribution": total_attr,
            "recall": {"all": _recall(both), **{p: _recall(by_k) for p, by_k in total_recall.items()}},
            "segments": {k: v.to_dict() for k, v in segments.items()},
            "host": {k: v.to_dict() for k, v in host.items()},
            "window": window.to_dict(),
            "read_wait": read_wait.to_dict(),
            "layers": layers,
        }


class Diagnostics:
    """The switch the streaming layers read, and the totals over finished recorders.

    `rec` is the recorder of the work running now, or None (diagnostics off). `default`
    is the daemon's `--diagnostics`: every request records when it is set."""

    def __init__(self, default: bool = False) -> None:
        self.default = default
        self.rec: Recorder | None = None
        self.total = Recorder()
        self.version = 0
        self._cached: tuple[int, dict[str, Any]] | None = None

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
