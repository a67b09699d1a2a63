"""The streaming replacement for mlx-lm's `SwitchGLU`/`SwitchMLP`.

The original module is kept and called as it is, with its stacked expert tensors swapped
for the pool's slot arrays and expert ids swapped for slot ids. So the same kernels
(`gather_qmm`/`gather_mm`) run on the same bytes, and each output row is what stock
mlx-lm computes: exactness comes from running their code, not from imitating it.

A forward is always one call of that code: when a prefill's experts do not fit in the
pool, the pool hands over a transient stack of exactly those experts instead of slots.
Splitting the tokens into several calls would be exact on the CPU but not on CUDA, whose
quantized gather kernels round differently for a different number of rows.

A layer-major prefill (daemon/model/prefill.py) hands a layer all of a prompt's chunks
in a row: between `begin_stack` and `end_stack` every forward runs on one transient stack
of the whole layer (`_stacked`), which the pool fills once for all of them.

Otherwise a forward takes one of three paths: `_resident` (every expert has a slot: nothing leaves
the device), `_slots` (the routed experts fit in the pool: misses are admitted into
slots) and `_overflow` (they do not: a transient stack). The last two share the layer's
one host sync, `_route`. In a decode forward that daemon/model/optimistic.py runs, a
partial pool's layer syncs not at all: it runs on the device's slot lookup and the
forward checks every few layers.

With a partial pool and a predictor (daemon/prefetch/predictor.py), layer L also ranks the
experts of layer L+1 in the same evaluation as its own ids, and once its experts are
queued on the device it starts reading the missing ones (daemon/prefetch/prefetcher.py); layer
L+1's pool promotes what arrived. Diagnostics (daemon/model/diagnostics.py) are recorded
through the hub's recorder on every path; off, that recorder does nothing, and on, it
syncs around each segment to time it.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..mapped.row_gather import MAX_GATHERED
from ..pool.expert_pool import ExpertPool
from ..prefetch.predictor import NextLayer, Prediction
from ..prefetch.prefetcher import MAX_PREFETCH_TOKENS, Prefetcher
from .diagnostics import AnyRecorder, Diagnostics
from .expert_parallel import ExpertShare
from .optimistic import OptimisticDecode


class StreamingMoE(nn.Module):
    def __init__(
        self,
        inner: nn.Module,
        pool: ExpertPool,
        hub: Diagnostics,
        nxt: NextLayer | None = None,
        prefetcher: Prefetcher | None = None,
        share: ExpertShare | None = None,
        optimistic: OptimisticDecode | None = None,
    ) -> None:
        """`inner`: mlx-lm's module; `hub`: the model's diagnostics switch; `nxt`: the next
        layer as this one predicts for it, with the `prefetcher` that reads its experts
        (both None without prediction); `share`: this rank's share of the experts in an
        expert-parallel group (daemon/model/expert_parallel.py), whose pool holds only
        those, else None; `optimistic`: the model's optimistic decode forwards
        (daemon/model/optimistic.py), else None."""
        super().__init__()
        self.inner = inner
        self.pool = pool
        # Plain attributes (not modules).
        self.hub = hub
        self.share = share
        self.next = nxt if prefetcher is not None else None
        self.prefetcher = prefetcher if nxt is not None else None
        # What every recording of this layer is filed under.
        self.ordinal = pool.layer.ordinal
        # The transient stack of a layer-major prefill, between begin_stack and end_stack.
        self._stack: dict[str, mx.array] | None = None
        # A mapped pool's stack staged while the layers below computed (`stage_ahead`),
        # with its bytes: what the next `begin_stack` takes.
        self._ahead: tuple[dict[str, mx.array], int] | None = None
        # Tokens at the end of the stacked forwards that are padding (`begin_stack`).
        self._pad = 0
        # The layer-major prefill's probe of the model's forward at load (`idle`).
        self._idle = False
        self._last_ids: np.ndarray | None = None
        self.optimistic = optimistic
        self._use(pool.arrays)
        # A resize of the pool (daemon/pool/elastic.py) hands the module its new arrays at
        # once, so that the old ones go with the last forward queued on them.
        pool.watch_arrays(self._use)

    def __getattr__(self, key: str) -> Any:
        # What the MoE block around mlx-lm's module reaches through it (muse_spark's MoE
        # calls `self.experts.post_expert_norm`): the wrapped module's children.
        value = self.get(key)
        if value is not None:
            return value
        inner = self.get("inner")
        if inner is not None and key in inner:
            return inner[key]
        return super().__getattr__(key)

    def _use(self, arrays: dict[str, mx.array]) -> None:
        for t in self.pool.layer.tensors:
            projection, param = t.name.rsplit(".", 1)
            getattr(self.inner, projection)[param] = arrays[t.name]

    # ---- layer-major prefill ---------------------------------------------------------

    def stacks_for(self, chunks: Sequence[int]) -> bool:
        """Whether a prefill of chunks of these sizes should stage this layer's experts:
        a partial slot pool with more than one chunk, or one whose routed pairs outnumber
        its slots (then they cannot all fit; one stack serves them, as an overflow
        forward's would); a mapped pool once a chunk routes as many experts as the layer
        has (its kernels would otherwise read host memory tile by tile)."""
        pool = self.pool
        if not pool.reuse or not chunks:
            return False
        if pool.host_memory:
            return max(chunks) * pool.top_k >= pool.layer.num_experts
        return not pool.fully_resident and (len(chunks) > 1 or max(chunks) * pool.top_k > pool.capacity)

    def begin_stack(self, pad: int = 0) -> int:
        """Run the next forwards on a transient stack of the whole layer (the one
        `stage_ahead` made, if any); returns the bytes staged into it from the pool.
        `pad`: the last `pad` tokens of the forwards are a padded continuation's copies
        of its last token (daemon/model/kv_buckets.py): computed, but not counted as
        routed. They route what that token routes, so the stack's rows are the same."""
        ahead, self._ahead = self._ahead, None
        self._stack, staged = ahead if ahead is not None else self.pool.stage_layer()
        self._last_ids = None
        self._pad = pad
        return staged

    def stage_ahead(self, blocks: int) -> list[mx.array]:
        """A mapped pool's stack for the next `begin_stack`, made now, with at most
        `blocks` blocks per expert row of the copy kernel: its arrays, to be evaluated
        with the layer below, whose kernels the copy then runs beside (it reads no
        routing, so it needs nothing of that layer). A slot pool's stack depends on the
        routing its forwards read back, so only a mapped pool stages ahead."""
        assert self.pool.host_memory
        self._ahead = self.pool.stage_layer(blocks)
        return list(self._ahead[0].values())

    @property
    def ahead(self) -> bool:
        """Whether a stack staged ahead waits for the next `begin_stack`."""
        return self._ahead is not None

    def drop_ahead(self) -> None:
        """Forget a stack staged ahead that no `begin_stack` took (a prefill that
        stopped before this layer), so that its memory goes."""
        self._ahead = None

    def read_ahead(self, routes: int) -> int:
        """Start reading, before this layer's stacked forwards, the experts its pool lacks
        where a prompt of `routes` (tokens x top-k) routes nearly all of them
        (`ExpertPool.read_ahead`); returns the reads started."""
        return self.pool.read_ahead(routes)

    def fill_stack(self) -> int:
        """Bring in what the forwards since `begin_stack` routed and the pool lacks,
        once each, before any of them runs; returns the bytes read."""
        assert self._stack is not None
        return self.pool.fill_stack(self._stack)

    def idle(self, on: bool) -> None:
        """While on, a forward leaves the pool alone and its output is a lazy stand-in of
        the right shape (computed on slot 0 only if something evaluates it): how the
        layer-major prefill drives the model's forward once at load, over a throwaway
        cache, to learn whether it can (daemon/model/prefill.py `LayerMajorPrefill`)."""
        self._idle = on

    def end_stack(self, keep: bool = True) -> None:
        """Back to the pool's own arrays, keeping in it the last tokens' experts when
        `keep` (the layer ran: every row they need was filled; after a failed read some
        were not, and a pool must never hold such a row as an expert)."""
        stack, self._stack = self._stack, None
        last, self._last_ids = self._last_ids, None
        if keep and stack is not None and last is not None:
            self.pool.keep_from_stack(last, stack)

    def _stacked(self, x: mx.array, indices: mx.array) -> mx.array:
        """mlx-lm's call with the routing as it is, on the stack (row e is expert e, as
        in stock's stacked weights). A slot pool reads the routing back to learn what
        to bring in; a mapped pool's stack holds every expert already."""
        pool = self.pool
        counted = indices[..., : indices.shape[-2] - self._pad, :] if self._pad else indices
        if pool.host_memory:
            if pool.route_log is not None:
                pool.route_log.append(counted)
        else:
            ids = np.array(counted)
            pool.synced()
            self._last_ids = ids.reshape(-1, ids.shape[-1])
            pool.note_stacked(self._last_ids, self.hub.recorder)
        assert self._stack is not None
        self._use(self._stack)
        try:
            # As with an overflow stack, the lazy graph holds its own references.
            return self.inner(x, indices)
        finally:
            self._use(pool.arrays)

    # ---- one forward -----------------------------------------------------------------

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        clock = self.hub.clock
        if clock is None:
            return self._forward(x, indices)
        clock.start()
        try:
            return self._forward(x, indices)
        finally:
            clock.stop()

    def _forward(self, x: mx.array, indices: mx.array) -> mx.array:
        pool = self.pool
        if pool.identity and self._stack is None and not pool.host_memory and not self._idle and self.share is None:
            if not self.hub.recorder.active:
                # A full pool whose slot e holds expert e: stock's call on the pool's arrays,
                # its ids logged on the device for the heat (`_resident` without diagnostics).
                if pool.route_log is not None:
                    pool.route_log.append(indices)
                return self.inner(x, indices)
        if self._idle:
            # The call's shape, lazily, on slot 0: nothing is read, counted or predicted.
            return self.inner(x, mx.zeros_like(indices))
        if self.share is not None:
            return self._expert_parallel(x, indices, self.share)
        if self._stack is not None:
            return self._stacked(x, indices)
        rec = self.hub.recorder
        if self.pool.fully_resident:
            return self._resident(x, indices, rec)
        seq = indices.shape[-2] if indices.ndim >= 2 else 1
        ctl = self.optimistic
        if ctl is not None and ctl.active:
            if seq == 1 and ctl.takes(self) and pool.device_lookup:
                # A decode step that does not stop here (daemon/model/optimistic.py): the
                # experts run on the device's lookup, a missing one's -1 as slot 0, and
                # the least slot waits for the next check.
                slots = pool.table()[indices]
                ctl.ran(self, slots.min(), indices, self._sync)
                return self.inner(x, mx.maximum(slots, 0))
            # This layer's ids come to the host below: the layers under it checked first,
            # so that a miss there is found before ids computed from it are acted on.
            ctl.settle(self._sync)
        if seq == 1 and not rec.active and pool.device_lookup and (self.next is None or not self.next.ahead):
            return self._decode(x, indices)
        rec.wait_for(self.ordinal, "outside", x)
        ids, ranked, ahead = self._route(x, indices, seq, rec)
        if seq == 1 and not rec.active:
            # A decode step whose experts are all resident: the lookup, the experts and the
            # next layers' reads; the accounting waits for the pool's `flush`.
            slots = self.pool.hit(ids)
            if slots is None and self.optimistic is not None:
                self.optimistic.missed()
            if slots is not None:
                y = self.inner(x, mx.array(slots))
                self._sync(y, wait=False)
                if ranked is not None:
                    self._predict_next(ranked, seq, rec, ahead)
                return y
        return self._serve(x, indices, ids, ranked, ahead, seq, rec)

    def _decode(self, x: mx.array, indices: mx.array) -> mx.array:
        """A decode step without diagnostics: the slots looked up on the device in the
        pool's table, and the next layer's predicted experts in its table, so that the
        layer's one sync brings the host two numbers (the least slot of each) instead of
        every id. Where both are slots the experts run on the device's lookup, no read is
        started and the pool accounts the forward later (`hit_on_device`); else the ids
        come to the host and the forward goes on as `_route`'s would."""
        pool, nxt, pf, rec = self.pool, self.next, self.prefetcher, self.hub.recorder
        slots = pool.table()[indices]
        reading = pf is not None and pf.enabled and nxt is not None and not nxt.pool.fully_resident
        ranked = nxt.router.ranked(x, pf.top_k, ordered=False) if reading else None
        if ranked is None:
            least = slots.min()
            self._sync(least, indices)
            own, predicted = least.item(), 0
        else:
            least = mx.stack([slots.min(), nxt.pool.table()[ranked].min()])
            self._sync(least, indices, ranked)
            own, predicted = least.tolist()
        pool.synced()
        if own < 0:
            if self.optimistic is not None:
                self.optimistic.missed()
            ids = np.array(indices)
            ranked_np = np.array(ranked).reshape(-1, ranked.shape[-1]) if ranked is not None else None
            return self._serve(x, indices, ids, ranked_np, (), 1, rec)
        pool.hit_on_device(indices)
        y = self.inner(x, slots)
        self._sync(y, wait=False)
        if predicted < 0:
            self._predict_next(np.array(ranked).reshape(-1, ranked.shape[-1]), 1, rec)
        return y

    def _serve(
        self,
        x: mx.array,
        indices: mx.array,
        ids: np.ndarray,
        ranked: np.ndarray | None,
        ahead: Sequence[tuple[NextLayer, np.ndarray]],
        seq: int,
        rec: AnyRecorder,
    ) -> mx.array:
        """A forward whose ids are on the host: its misses admitted (or an overflow
        stack), the experts run, the next layers' reads started."""
        flat = ids.reshape(-1, ids.shape[-1])
        rec.union(self.ordinal, seq, flat)
        if self.pool.fits(flat):
            y = self._slots(x, ids, flat, seq == 1, rec)
            rec.experts(self.ordinal, y, indices)
            # Start the experts now: the host builds the next layer (up to its router,
            # the next sync) while the device computes this one.
            self._sync(y, wait=False)
        else:
            y = self._overflow(x, ids, flat, rec)
            rec.experts(self.ordinal, y, indices)
        if ranked is not None:
            self._predict_next(ranked, seq, rec, ahead)
        return y

    def _expert_parallel(self, x: mx.array, indices: mx.array, share: ExpertShare) -> mx.array:
        """This rank's rows of the pairs it owns, through its pool (every pair runs, the
        others on row or slot 0, so the kernel's row count is the single process's), then
        summed with the other ranks' (`ExpertShare.combine`)."""
        pool = self.pool
        if share.mode == "leader":
            x, indices = share.lead(self.ordinal, x, indices)
        local, mine = share.local_device(indices)
        if pool.fully_resident:
            y = self.inner(x, local if pool.identity else pool.remap[local])
            return share.combine(y, mine)
        seq = indices.shape[-2] if indices.ndim >= 2 else 1
        rec = self.hub.recorder
        # The next layers' rankings are of global ids: each rank prefetches its own of them.
        ids, ranked, ahead = self._route(x, indices, seq, rec)
        here = share.local_ids(ids.reshape(-1, ids.shape[-1]))
        owned = here >= 0
        if pool.fits(here):
            pool.ensure(here, decode=seq == 1, synced=True, rec=rec)
            rows, arrays = pool.slot_of, None
        else:
            arrays, rows = pool.gather_overflow(here, rec)
        picked = np.where(owned, rows[np.where(owned, here, 0)], 0).reshape(ids.shape)
        if arrays is not None:
            self._use(arrays)
        try:
            # As with an overflow stack, the lazy graph holds its own references.
            y = share.combine(self.inner(x, mx.array(picked)), mine)
        finally:
            self._use(pool.arrays)
        if ranked is not None:
            mx.async_eval(y)  # as in `__call__`: the device computes while the reads start
            self._predict_next(share.local_ids(ranked), seq, rec, [(a, share.local_ids(r)) for a, r in ahead])
        return y

    def _resident(self, x: mx.array, indices: mx.array, rec: AnyRecorder) -> mx.array:
        """Every expert has a slot: no host sync (diagnostics read the routing back for
        the union of its experts). Where slot == expert id (the usual case) this is
        exactly stock mlx-lm's call; else ids map to slots on the device."""
        pool = self.pool
        rec.wait_for(self.ordinal, "outside", x)
        rec.read_routes(self.ordinal, indices)
        if pool.route_log is not None:
            pool.route_log.append(indices)
        if pool.host_memory and indices.size >= pool.layer.num_experts:
            y = self._staged_once(x, indices)
            rec.experts(self.ordinal, y, indices)
            return y
        ids = indices if pool.identity else pool.remap[indices]
        if pool.gather is not None and indices.size <= MAX_GATHERED:
            y = self._gathered(x, ids)
        else:
            y = self.inner(x, ids)
        rec.experts(self.ordinal, y, indices)
        return y

    def _route(
        self, x: mx.array, indices: mx.array, seq: int, rec: AnyRecorder
    ) -> tuple[np.ndarray, np.ndarray | None, Sequence[tuple[NextLayer, np.ndarray]]]:
        """The layer's one host sync: its expert ids on the host; with them, where
        prefetch reads or diagnostics are on, the next layer's ranking of this input
        ([tokens, n] expert ids, else None) and the rankings of the layers read further
        ahead (each with its layer)."""
        nxt, pf = self.next, self.prefetcher
        reading = pf is not None and pf.enabled and seq <= MAX_PREFETCH_TOKENS
        with rec.segment(self.ordinal, "route"):
            if nxt is None or nxt.pool.fully_resident or not (reading or rec.active):
                self._sync(indices)
                ids = np.array(indices)
                ranked_np, ahead = None, ()
            else:
                # Diagnostics rank 4k experts best first (recall at k, 2k, 4k); prefetch
                # alone needs only the top k, in any order.
                ranked = nxt.router.ranked(x, rec.ranked_width(pf.top_k), ordered=rec.active)
                # With a prefetch depth above 1, the layers after the next, ranked on the
                # same input: their reads get more than one layer's compute to finish in.
                later = [a for a in nxt.ahead if not a.pool.fully_resident] if reading else ()
                later_ranked = [a.router.ranked(x, pf.top_k, ordered=False) for a in later]
                self._sync(indices, ranked, *later_ranked)  # the one host sync of this layer, for all
                ids = np.array(indices)
                ranked_np = np.array(ranked).reshape(-1, ranked.shape[-1])
                ahead = [(a, np.array(r).reshape(-1, r.shape[-1])) for a, r in zip(later, later_ranked)]
        self.pool.synced()
        return ids, ranked_np, ahead

    def _sync(self, *arrays: mx.array, wait: bool = True) -> None:
        """Evaluate `arrays` (a host sync), or with `wait` False only launch them; timed
        for the hub's clock where it has one (MLX's own time: on the CPU a launch
        encodes every op on the host, which stock pays in its launch too)."""
        run = mx.eval if wait else mx.async_eval
        clock = self.hub.clock
        if clock is None:
            run(*arrays)
            return
        clock.evaluate(run, arrays)

    def _slots(self, x: mx.array, ids: np.ndarray, flat: np.ndarray, decode: bool, rec: AnyRecorder) -> mx.array:
        """The routed experts fit in the pool: admit the missing ones into slots and call
        mlx-lm's code on the slots."""
        pool = self.pool
        # One token per sequence is a decode step (batched or not); more is prefill.
        pool.ensure(flat, decode=decode, synced=True, rec=rec)  # the route's sync
        return self.inner(x, mx.array(pool.slot_of[ids]))

    def _overflow(self, x: mx.array, ids: np.ndarray, flat: np.ndarray, rec: AnyRecorder) -> mx.array:
        """A prefill whose experts do not fit in the pool: one call on a transient stack
        of exactly those experts."""
        pool = self.pool
        stacked, row_of = pool.gather_overflow(flat, rec)
        self._use(stacked)
        try:
            # The lazy graph keeps its own references to `stacked`, so the pool's
            # arrays can be put back before it runs.
            return self.inner(x, mx.array(row_of[ids]))
        finally:
            self._use(pool.arrays)

    def _staged_once(self, x: mx.array, indices: mx.array) -> mx.array:
        """A mapped pool's forward that routes as many pairs as the layer has experts (a
        joint prefill of several short prompts): on a stack of the whole layer copied
        in once, as a layer-major prefill stages it, instead of kernels reading host
        memory tile by tile. Evaluated here, so that one layer's stack at a time is alive."""
        pool = self.pool
        stack, _ = pool.stage_layer()
        self._use(stack)
        try:
            y = self.inner(x, indices)
        finally:
            self._use(pool.arrays)
        mx.eval(y)
        return y

    def _gathered(self, x: mx.array, ids: mx.array) -> mx.array:
        """mlx-lm's call on a stack of just the routed experts' rows, each expert once (a
        mapped pool's small forwards, daemon/mapped/row_gather.py), with each routed pair
        pointed at its expert's row."""
        pool = self.pool
        names = [t.name for t in pool.layer.tensors]
        rows, where = pool.gather.routed([pool.arrays[name] for name in names], ids)
        self._use(dict(zip(names, rows)))
        try:
            # As with an overflow stack, the lazy graph holds its own references.
            return self.inner(x, where)
        finally:
            self._use(pool.arrays)

    def _predict_next(
        self, ranked: np.ndarray, seq: int, rec: AnyRecorder, ahead: Sequence[tuple[NextLayer, np.ndarray]] = ()
    ) -> None:
        """Hand layer L+1 this forward's prediction and start reading what it lacks; then
        what the layers `ahead` (L+2, ..., each with its ranking) lack, after L+1's reads."""
        nxt, pf = self.next, self.prefetcher
        ordinal = nxt.pool.layer.ordinal
        with rec.host(ordinal, "predict"):
            top = ranked[:, : pf.top_k]
            if self.share is None and len(top) == 1:
                named = np.sort(top[0])  # one token's top k are distinct: np.unique's answer
            else:
                named = np.unique(top)
                named = named[named >= 0]  # an expert share's ranking names others' experts NOT_HERE
            # The prediction is the diagnostics' (recall, attribution, the window) alone.
            prediction = Prediction(ranked=ranked, named=named) if rec.active else None
            if prediction is not None:
                nxt.pool.expect(prediction)
            if not (pf.enabled and seq <= MAX_PREFETCH_TOKENS):
                return
            missing = named[nxt.pool.slot_of.take(named) < 0]
        with rec.host(ordinal, "submit"):
            if missing.size:
                # What host memory holds goes straight into layer L+1's slots (this layer's
                # sync ran every earlier computation, and what it queued since reads only
                # this layer's pool); the rest is read from the store into the buffer.
                if nxt.pool.prestage(named, missing):
                    missing = missing[nxt.pool.slot_of[missing] < 0]
                if missing.size:
                    pf.submit(nxt.pool.layer, missing.tolist())
            for layer, later in ahead:
                # Only reads: no prestage into those pools, whose slots may be taken by the
                # layers in between. Experts the tier holds are skipped by submit and copied
                # when their layer is next.
                named_later = np.unique(later)
                named_later = named_later[named_later >= 0]
                missing_later = named_later[layer.pool.slot_of[named_later] < 0]
                if missing_later.size:
                    pf.submit(layer.pool.layer, missing_later.tolist())
        if prediction is not None:
            prediction.submitted = True
            prediction.submitted_at = rec.now()
