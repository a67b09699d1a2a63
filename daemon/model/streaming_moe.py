"""The streaming replacement for mlx-lm's `SwitchGLU`/`SwitchMLP`.

The original module is kept and called as it is, with its stacked expert tensors swapped
for the pool's slot arrays and expert ids swapped for slot ids. So the same kernels
(`gather_qmm`/`gather_mm`) run on the same bytes, and each output row is what stock
mlx-lm computes: exactness comes from running their code, not from imitating it.

A forward is always one call of that code: when a prefill's experts do not fit in the
pool, the pool hands over a transient stack of exactly those experts instead of slots.
Splitting the tokens into several calls would be exact on the CPU but not on CUDA, whose
quantized gather kernels round differently for a different number of rows.

With a partial pool and a predictor (daemon/prefetch/predictor.py), layer L also ranks the
experts of layer L+1 in the same evaluation as its own ids, and once its experts are
queued on the device it starts reading the missing ones (daemon/prefetch/prefetcher.py); layer
L+1's pool promotes what arrived. Diagnostics (daemon/model/diagnostics.py) are one attribute
test when off; when on they sync around each segment to time it.
"""

from __future__ import annotations

import time
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moestream.daemon.model.diagnostics import Diagnostics, Recorder
from moestream.daemon.pool.expert_pool import ExpertPool
from moestream.daemon.prefetch.predictor import NextLayer, Prediction
from moestream.daemon.prefetch.prefetcher import MAX_PREFETCH_TOKENS, Prefetcher
from moestream.daemon.mapped.row_gather import MAX_GATHERED


class StreamingMoE(nn.Module):
    def __init__(self, inner: nn.Module, pool: ExpertPool) -> None:
        super().__init__()
        self.inner = inner
        self.pool = pool
        # Plain attributes (not modules): set by predictor.install.
        self.hub = Diagnostics()
        self.next: NextLayer | None = None
        self.prefetcher: Prefetcher | None = None
        pool.hub = self.hub
        self._use(pool.arrays)

    def set_hub(self, hub: Diagnostics) -> None:
        self.hub = hub
        self.pool.hub = hub

    def set_next(self, nxt: NextLayer, prefetcher: Prefetcher) -> None:
        self.next = nxt
        self.prefetcher = prefetcher

    def _use(self, arrays: dict[str, mx.array]) -> None:
        for t in self.pool.layer.tensors:
            projection, param = t.name.rsplit(".", 1)
            getattr(self.inner, projection)[param] = arrays[t.name]

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        pool = self.pool
        rec = self.hub.rec
        if pool.fully_resident:
            if rec is not None:
                return self._resident_diagnosed(x, indices, rec)
            # Every expert has a slot: no host sync. Where slot == expert id (the usual
            # case) this is exactly stock mlx-lm's call; else ids map to slots on the device.
            if pool.route_log is not None:
                pool.route_log.append(indices)
            ids = indices if pool.identity else pool.remap[indices]
            if pool.gather is not None and indices.size <= MAX_GATHERED:
                return self._gathered(x, ids)
            return self.inner(x, ids)

        ordinal = pool.layer.ordinal
        if rec is not None:
            tic = time.perf_counter()
            mx.eval(x)
            rec.segment(ordinal, "outside", time.perf_counter() - tic)
            tic = time.perf_counter()
        seq = indices.shape[-2] if indices.ndim >= 2 else 1
        nxt, pf = self.next, self.prefetcher
        ranked_np = None
        ahead: list[tuple[NextLayer, np.ndarray]] = []
        reading = pf is not None and pf.enabled and seq <= MAX_PREFETCH_TOKENS
        if nxt is not None and not nxt.pool.fully_resident and (rec is not None or reading):
            # Diagnostics rank 4k experts best first (recall at k, 2k, 4k); prefetch
            # alone needs only the top k, in any order.
            ranked = nxt.router.ranked(x, 4 * pf.top_k if rec is not None else pf.top_k, ordered=rec is not None)
            # With a prefetch depth above 1, the layers after the next, ranked on the
            # same input: their reads get more than one layer's compute to finish in.
            later = [a for a in nxt.ahead if not a.pool.fully_resident] if reading else []
            later_ranked = [a.router.ranked(x, pf.top_k, ordered=False) for a in later]
            mx.eval(indices, ranked, *later_ranked)  # the one host sync of this layer, for all
            ids = np.array(indices)
            ranked_np = np.array(ranked).reshape(-1, ranked.shape[-1])
            ahead = [(a, np.array(r).reshape(-1, r.shape[-1])) for a, r in zip(later, later_ranked)]
        else:
            ids = np.array(indices)  # the one host sync of this layer
        pool.stats.host_syncs += 1
        if rec is not None:
            rec.segment(ordinal, "route", time.perf_counter() - tic)
        flat = ids.reshape(-1, ids.shape[-1])
        decode = seq == 1
        if rec is not None:
            rec.union(ordinal, seq, int(np.unique(flat).size))
        if pool.fits(flat):
            # One token per sequence is a decode step (batched or not); more is prefill.
            pool.ensure(flat, decode=decode, synced=True)  # the route's sync above
            y = self.inner(x, mx.array(pool.slot_of[ids]))
            if rec is not None:
                self._time_experts(y, indices, rec)
            else:
                # Start the experts now: the host builds the next layer (up to its
                # router, the next sync) while the device computes this one.
                mx.async_eval(y)
            if ranked_np is not None:
                self._predict_next(ranked_np, seq, rec, ahead)
            return y

        stacked, row_of = pool.gather_overflow(flat)
        self._use(stacked)
        try:
            # The lazy graph keeps its own references to `stacked`, so the pool's
            # arrays can be put back before it runs.
            y = self.inner(x, mx.array(row_of[ids]))
        finally:
            self._use(pool.arrays)
        if rec is not None:
            self._time_experts(y, indices, rec)
        if ranked_np is not None:
            self._predict_next(ranked_np, seq, rec, ahead)
        return y

    def _gathered(self, x: mx.array, ids: mx.array) -> mx.array:
        """mlx-lm's call on a stack of just the routed experts' rows (a mapped pool's
        small forwards, daemon/mapped/row_gather.py), with ids 0..n-1 in the routing's shape."""
        pool = self.pool
        names = [t.name for t in pool.layer.tensors]
        rows = pool.gather([pool.arrays[name] for name in names], ids)
        self._use(dict(zip(names, rows)))
        try:
            # As with an overflow stack, the lazy graph holds its own references.
            return self.inner(x, pool.gather.positions(ids.shape, ids.dtype))
        finally:
            self._use(pool.arrays)

    def _predict_next(self, ranked: np.ndarray, seq: int, rec: Recorder | None,
                      ahead: Sequence[tuple[NextLayer, np.ndarray]] = ()) -> None:
        """Hand layer L+1 this forward's prediction and start reading what it lacks; then
        what the layers `ahead` (L+2, ..., each with its ranking) lack, after L+1's reads."""
        nxt, pf = self.next, self.prefetcher
        tic = time.perf_counter() if rec is not None else 0.0
        named = np.unique(ranked[:, : pf.top_k])
        prediction = Prediction(ranked=ranked, named=named)
        nxt.pool.prediction = prediction
        if not (pf.enabled and seq <= MAX_PREFETCH_TOKENS):
            if rec is not None:
                rec.host(nxt.pool.layer.ordinal, "predict", time.perf_counter() - tic)
            return
        missing = named[nxt.pool.slot_of[named] < 0]
        if rec is not None:
            t1 = time.perf_counter()
            rec.host(nxt.pool.layer.ordinal, "predict", t1 - tic)
        if missing.size:
            # What host memory holds goes straight into layer L+1's slots (this layer's
            # sync ran every earlier computation, and what it queued since reads only
            # this layer's pool); the rest is read from the store into the buffer.
            if nxt.pool.prestage(named):
                missing = missing[nxt.pool.slot_of[missing] < 0]
            if missing.size:
                pf.submit(nxt.pool.layer, missing.tolist())
        for layer, later in ahead:
            # Only reads: no prestage into those pools, whose slots may be taken by the
            # layers in between. Experts the tier holds are skipped by submit and copied
            # when their layer is next.
            named_later = np.unique(later)
            missing_later = named_later[layer.pool.slot_of[named_later] < 0]
            if missing_later.size:
                pf.submit(layer.pool.layer, missing_later.tolist())
        prediction.submitted = True
        if rec is not None:
            now = time.perf_counter()
            rec.host(nxt.pool.layer.ordinal, "submit", now - t1)
            prediction.submitted_at = now

    def _time_experts(self, y: mx.array, indices: mx.array, rec: Recorder) -> None:
        ordinal = self.pool.layer.ordinal
        tic = time.perf_counter()
        mx.eval(y)
        rec.segment(ordinal, "matmul", time.perf_counter() - tic)
        # The block's combine is a weighted sum over this output; time the same op.
        weights = mx.ones(indices.shape, dtype=y.dtype)
        mx.eval(weights)
        tic = time.perf_counter()
        mx.eval((y * weights[..., None]).sum(axis=-2))
        rec.segment(ordinal, "combine", time.perf_counter() - tic)

    def _resident_diagnosed(self, x: mx.array, indices: mx.array, rec: Recorder) -> mx.array:
        """A fully resident pool with diagnostics on: the same call, timed, plus the
        union of its experts (which costs a sync here)."""
        pool = self.pool
        ordinal = pool.layer.ordinal
        tic = time.perf_counter()
        mx.eval(x)
        rec.segment(ordinal, "outside", time.perf_counter() - tic)
        tic = time.perf_counter()
        ids = np.array(indices)
        rec.segment(ordinal, "route", time.perf_counter() - tic)
        rec.union(ordinal, indices.shape[-2] if indices.ndim >= 2 else 1, int(np.unique(ids).size))
        if pool.route_log is not None:
            pool.route_log.append(indices)
        y = self.inner(x, indices if pool.identity else pool.remap[indices])
        self._time_experts(y, indices, rec)
        return y
