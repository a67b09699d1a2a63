"""The expert pool of one MoE layer: `capacity` slots per expert tensor.

Invariants:
- `slot_of[e] >= 0` exactly when expert `e` is resident, and then `expert_in[slot_of[e]] == e`;
  a slot is either in `_free` or holds exactly one expert.
- Pinned experts are resident and never evicted; nor is any expert that the tokens being
  served need (`protected`), so one forward never overwrites a slot it reads.
- Slot bytes are only written while no queued computation reads that slot: admission
  first waits for the streams that run the model to drain, unless the forward has just
  synced on the one stream every read of this pool was queued on (`ensure`).
- `resize` (daemon/pool/elastic.py) runs between forwards, never inside one: it copies the
  experts it keeps into new arrays and only reads the old ones, which a forward queued
  before keeps alive with its own slot ids; so no slot a computation reads is rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from ...shared.status import PoolCounters
from ...shared.store_format import MoELayer
from ..model.diagnostics import NULL_RECORDER, AnyRecorder
from ..policies.base import EvictionPolicy
from .admission import Admitter
from .expert_reader import ExpertReadError
from .reuse import StackDistances

if TYPE_CHECKING:
    from ..mapped.row_gather import RowGather
    from ..prefetch.predictor import Prediction
    from ..prefetch.prefetcher import Prefetcher


@dataclass
class PoolStats(PoolCounters):
    """Counts over unique experts per forward (one token in decode, a chunk in prefill)
    (`PoolCounters`), and the per-expert routed counts heat takes."""

    # Routed (token, expert) pairs per expert since the last `take_routed()`, for heat.
    routed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def hit_rate(self) -> float | None:
        hits = self.hits_prefill + self.hits_decode
        misses = self.misses_prefill + self.misses_decode
        return hits / (hits + misses) if hits + misses else None


def _take_rows(arrays: Sequence[mx.array], rows: mx.array) -> list[mx.array]:
    return [mx.take(a, rows, axis=0) for a in arrays]


def _here(row: np.ndarray) -> list[int]:
    """A token's routed experts that this pool serves: all of them, but with an expert
    share (daemon/model/expert_parallel.py), whose other ranks' pairs come as negative ids."""
    return [int(e) for e in row if e >= 0]


def _host_rows(ids: mx.array) -> np.ndarray:
    """Evaluated expert ids of any shape as [tokens, k] on the host."""
    return np.array(ids).reshape(-1, ids.shape[-1])


def _current_stream() -> mx.Stream:
    return mx.default_stream(mx.default_device())


# A layer-major prefill reads a layer's missing experts ahead once its prompt routes this
# many (token, expert) pairs per expert: 1 - e^-3 = 95% of them are routed if routing
# were uniform, and real routing at such counts leaves few unrouted (the q30 runs of
# tests/bench/RESULTS.md route every expert from 512 tokens on).
READ_AHEAD_ROUTES = 3
# Decode forwards `hit` keeps for `flush` at most (a benchmark reads no counter for a
# whole decode): their accounting then runs as one batch.
MAX_PENDING = 64


class PoolCapacityError(ValueError):
    """The pool cannot hold what is asked of it; the message says what would fit."""


class ExpertPool:
    def __init__(
        self,
        layer: MoELayer,
        capacity: int,
        policy: EvictionPolicy,
        admitter: Admitter,
        *,
        top_k: int,
        reuse: bool = True,
        host_memory: bool = False,
        gather: RowGather | None = None,
        lower: Sequence[ExpertPool] = (),
        prefetcher: Prefetcher | None = None,
    ) -> None:
        if capacity < top_k:
            raise PoolCapacityError(
                f"layer {layer.module_path}: capacity {capacity} is below the minimum "
                f"{top_k} (the experts one token routes to)"
            )
        self.layer = layer
        self.capacity = min(capacity, layer.num_experts)
        self.top_k = top_k
        self.policy = policy
        self.admitter = admitter
        # reuse=False is the naive on-demand baseline of `bench decode`: nothing is
        # reused from one forward to the next, every routed expert is read each time.
        self.reuse = reuse
        self.host_memory = host_memory
        # host_memory=True (a mapped pool, daemon/mapped/mapped_pool.py): made on the CPU stream,
        # the arrays are allocated where the host writes them (managed memory on CUDA)
        # rather than as GPU memory the size of every expert.
        self.arrays: dict[str, mx.array] = {
            t.name: mx.zeros(
                (self.capacity, *t.shape), dtype=getattr(mx, t.dtype), stream=mx.cpu if host_memory else None
            )
            for t in layer.tensors
        }
        mx.eval(list(self.arrays.values()))
        admitter.prepare(self.arrays)
        self.slot_of = np.full(layer.num_experts, -1, np.int32)
        # `slot_of` on the device (`table`), made again after any change.
        self._table: mx.array | None = None
        self.expert_in = np.full(self.capacity, -1, np.int32)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._resident: set[int] = set()
        self.pinned: set[int] = set()
        self._stats = PoolStats(routed=np.zeros(layer.num_experts, np.int64))
        # Every forward's routing as LRU stack distances (daemon/pool/reuse.py), for the
        # heat's reuse file, from which `plan` forecasts the hit rate of any pool size.
        self._distances = StackDistances(layer.num_experts)
        # Decode forwards whose experts were all resident (`hit`), not yet told to the
        # policy, the counts and the stack distances: each [tokens, k] ids with the lower
        # layers' rows of the same tokens (for a policy that reads them), in order.
        # `flush` tells them, before anything reads or changes what they change.
        self._pending: list[tuple[np.ndarray | mx.array, list[np.ndarray]]] = []
        # Whether the policy reads the lower layers' routing (`observe_lower`).
        self._hinted = type(policy).observe_lower is not EvictionPolicy.observe_lower
        # Set once every expert is resident: lookups then stay on the device.
        self.remap: mx.array | None = None
        self.identity = False
        # A mapped pool's copy of routed experts into a stack before small forwards
        # (Settings.mapped_gather), else None.
        self.gather = gather
        # The lowest MoE layers' pools (lowest first), whose routing of the same tokens
        # some policies use as a hint (they route first in a forward); and this
        # forward's routing.
        self.lower = list(lower)
        self.last_rows: np.ndarray | None = None
        # While a list (`start_route_log`), a fully resident pool's forwards append their
        # (device) expert ids here: a mapped pool's placement and speculative decoding
        # count the experts routed from them.
        self.route_log: list[mx.array] | None = None
        # The prefetcher whose buffer may hold this layer's experts (None without
        # prediction), and the previous layer's prediction for this forward (`expect`,
        # consumed by the next ensure).
        self.prefetcher = prefetcher
        self.prediction: Prediction | None = None
        # Experts `prestage` admitted since this layer's last forward; their copies may
        # still be running until `_settle`.
        self._prestaged: set[int] = set()
        # A layer-major prefill's experts routed so far that the pool lacks (`note_stacked`).
        self._stack_missing: set[int] = set()
        # How many of the last forward's routed experts were resident thanks to prestage.
        self.last_prestaged_used = 0
        # The stream of the forward that last queued a read of this pool's slots.
        self._reader_stream: mx.Stream | None = None
        # What uses `arrays` (the layer's StreamingMoEs, the mlx-lm model's and a vision
        # model's, hand their modules the new ones when `resize` replaces them), and the
        # pin order and routings since load that rank experts by heat when a shrink
        # unpins or gives them back; the experts a shrink unpinned, hottest first, pinned
        # again when the pool grows.
        self.on_arrays: list[Callable[[dict[str, mx.array]], None]] = []
        self._pin_rank: dict[int, int] = {}
        self._routed_earlier = np.zeros(layer.num_experts, np.int64)
        self.unpinned: list[int] = []
        # Whether a sync on a stream means that everything queued on it before has run:
        # so on CUDA (one CUDA stream per MLX stream) and on the CPU (one worker per
        # stream). Not relied on with Metal, whose command buffers of one queue may
        # overlap when they share no tracked buffer (another request's last layer).
        self._ordered_streams = not mx.metal.is_available()

    @property
    def stats(self) -> PoolStats:
        """The counters, with every forward so far in them."""
        if self._pending:
            self.flush()
        return self._stats

    @property
    def stack_distances(self) -> StackDistances:
        """The stack distances, with every forward so far in them."""
        if self._pending:
            self.flush()
        return self._distances

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    @property
    def fully_resident(self) -> bool:
        return self.remap is not None

    # ---- what other layers hand this one --------------------------------------------

    def expect(self, prediction: Prediction) -> None:
        """The previous layer's prediction for this layer's next forward."""
        self.prediction = prediction

    def start_route_log(self) -> None:
        """Log the expert ids of every forward of a fully resident pool from now on."""
        self.route_log = []

    def take_route_log(self) -> list[mx.array]:
        """The ids logged since the last take (logging goes on); none when not logging."""
        if self.route_log is None:
            return []
        logged, self.route_log = self.route_log, []
        return logged

    def stop_route_log(self) -> None:
        self.route_log = None

    # ---- admission -----------------------------------------------------------------

    def load_all(self) -> None:
        """Make every expert resident (capacity == experts); lookups become device-only."""
        if self.capacity < self.layer.num_experts:
            raise PoolCapacityError("load_all needs a slot for every expert")
        self._admit([e for e in range(self.layer.num_experts) if self.slot_of[e] < 0], set())
        self.pinned = set(range(self.layer.num_experts))
        self.remap = mx.array(self.slot_of)
        self.identity = bool(np.array_equal(self.slot_of, np.arange(self.layer.num_experts)))

    def pin(self, experts: Iterable[int]) -> int:
        """Load and pin `experts` (hottest first); returns how many were pinned."""
        wanted = [int(e) for e in experts if int(e) not in self.pinned]
        room = self.capacity - self.top_k - len(self.pinned)
        wanted = wanted[: max(room, 0)]
        self._admit([e for e in wanted if self.slot_of[e] < 0], set(wanted) | self.pinned)
        self.pinned.update(wanted)
        for e in wanted:
            self._pin_rank.setdefault(e, len(self._pin_rank))
        return len(wanted)

    def preload(self, experts: Sequence[int]) -> int:
        """Admit `experts` (hottest first), unpinned, into the free slots only (nothing
        is evicted): a warm start fills the pool beyond its pinned part. Returns how many
        were admitted."""
        if self.fully_resident:
            return 0
        wanted = [int(e) for e in experts if self.slot_of[int(e)] < 0][: len(self._free)]
        if wanted:
            # Coldest first, so that recency-based policies evict the hottest last.
            self._admit(wanted[::-1], set(wanted) | self.pinned)
        return len(wanted)

    def prestage(self, experts: np.ndarray, absent: np.ndarray | None = None) -> int:
        """Admit those of `experts` (the next forward's prediction) that are missing here
        but held in host memory, copying them into their slots without waiting: the
        copies run while the device computes the layers before this one, and the next
        `ensure` waits for them. Victims are never pinned or among `experts`. Returns how
        many were admitted.

        Called between this layer's forwards, after a host sync of the same forward at a
        lower layer with only that layer's work queued since: where streams run in order
        and every read of this pool was queued on the current stream, no queued
        computation reads it any more; elsewhere it waits for the streams first.
        `absent`: those of `experts` not resident, in increasing order, where the caller
        has them (a decode step's prediction): then an admitter that holds nothing in
        host memory costs one call."""
        if not self.reuse or self.fully_resident:
            return 0
        if absent is None:
            absent = np.array(sorted({int(e) for e in experts if self.slot_of[int(e)] < 0}), np.int64)
        missing = self.admitter.held(self.layer, absent.tolist())
        if not missing:
            return 0
        named = {int(e) for e in experts}
        protected = named | self.pinned
        room = len(self._free) + len(self._resident - protected)
        missing = missing[:room]
        if not missing:
            return 0
        if not self._reads_drained(_current_stream()):
            self._quiesce()
        placements = self._assign_slots(missing, protected)
        for e in missing:
            self.policy.admitted(e)
        # An expert evicted here and prestaged before (unused) simply leaves the set.
        self._prestaged = {e for e in self._prestaged if self.slot_of[e] >= 0} | set(missing)
        try:
            self.admitter.prestage(self.layer, placements, self.arrays)
        except Exception:
            self._drop_prestaged()
            raise
        self.stats.prestaged += len(missing)
        self.stats.bytes_read += len(missing) * self.layer.expert_bytes
        return len(missing)

    def _settle(self) -> None:
        """Wait for prestaged copies before this pool's slots are read or rewritten."""
        if not self._prestaged:
            return
        try:
            self.admitter.settle()
        except Exception:
            self._drop_prestaged()
            raise

    def _drop_prestaged(self) -> None:
        # Their bytes may never have arrived: make them missing again.
        for e in self._prestaged:
            if self.slot_of[e] >= 0:
                self._release(e)
                self.policy.evicted(e)
        self._prestaged = set()

    def _account(self, token_experts: np.ndarray, *, decode: bool) -> tuple[np.ndarray, list[int]]:
        """Tell the policy and the statistics what these tokens routed to; return the
        unique experts they need and those of them that are not resident."""
        if self._pending:
            self.flush()
        self._settle()
        if not self.reuse:
            for e in list(self._resident - self.pinned):
                self._release(e)
                self.policy.evicted(e)
        # Only rows of this forward count (a resident layer records none).
        lower = [p.last_rows for p in self.lower if p.last_rows is not None and len(p.last_rows) == len(token_experts)]
        policy = self.policy
        # Python lists, not numpy: a decode step's few ids cost several numpy calls'
        # overhead each (np.unique alone 6 us a layer here), on the path of every miss.
        routed: list[int] = []
        for i, row in enumerate(token_experts.tolist()):
            if lower:
                policy.observe_lower([_here(rows[i]) for rows in lower])
            here = [e for e in row if e >= 0]
            policy.access(here)
            routed += here
        self.last_rows = token_experts
        unique = sorted(set(routed))
        needed = np.array(unique, dtype=np.int64)
        stats = self._stats  # flushed above: the property's check, once
        stats.routed += np.bincount(routed, minlength=stats.routed.size)
        stats.routed_total += len(routed)
        self._distances.observe_step(needed)
        slot_of = self.slot_of
        missing = [e for e in unique if slot_of[e] < 0]
        hits = len(unique) - len(missing)
        if self._prestaged:
            self.last_prestaged_used = sum(1 for e in unique if e in self._prestaged)
            stats.prestaged_used += self.last_prestaged_used
            self._prestaged = set()
        else:
            self.last_prestaged_used = 0
        if decode:
            stats.hits_decode += hits
            stats.misses_decode += len(missing)
        else:
            stats.hits_prefill += hits
            stats.misses_prefill += len(missing)
        return needed, missing

    def hit(self, token_experts: np.ndarray) -> np.ndarray | None:
        """A decode forward's slot ids ([..., k] expert ids in, the same shape out) where
        every expert it routes is resident and no prestaged copy waits: the critical path
        of a hit is this lookup. What `ensure` would account for it (the policy, the
        heat's counts, the stack distances, the hits) waits in `_pending` for `flush`,
        which tells it in order before anything reads or changes what it changes, so the
        totals and every eviction are those of `ensure`. None where some expert is
        missing (then `ensure`)."""
        if self._prestaged or not self.reuse:
            return None
        slots = self.slot_of.take(token_experts)
        if min(slots.ravel().tolist()) < 0:  # faster than numpy's min for a few ids
            return None
        rows = token_experts.reshape(-1, token_experts.shape[-1])
        lower: list[np.ndarray] = []
        if self._hinted:
            lower = [p.last_rows for p in self.lower if p.last_rows is not None and len(p.last_rows) == len(rows)]
        self._pend(rows, lower)
        self.last_rows = rows
        return slots

    @property
    def device_lookup(self) -> bool:
        """Whether a decode forward may find its slots on the device (`table`) and tell
        the pool only that they were all there (`hit_on_device`): a pool that reuses
        experts, with no prestaged copy to settle, under a policy that does not read the
        lower layers' routing (which would need every forward's ids on the host)."""
        return self.reuse and not self._prestaged and not self._hinted

    def table(self) -> mx.array:
        """`slot_of` on the device (expert id -> slot, -1 where not resident), the same
        array until the slots change."""
        if self._table is None:
            self._table = mx.array(self.slot_of)
        return self._table

    def hit_on_device(self, indices: mx.array) -> None:
        """A decode forward whose routed experts (`indices`, evaluated) the device found
        all resident in `table`: accounted by `flush` as `hit` accounts its forwards."""
        self._pend(indices, [])
        self.last_rows = None  # read by policies of lower-layer hints only, which `hit` serves

    def _pend(self, rows: np.ndarray | mx.array, lower: list[np.ndarray]) -> None:
        """Keep a forward served from the slots for `flush` (flushed every MAX_PENDING)."""
        self._pending.append((rows, lower))
        self.last_prestaged_used = 0
        self._reader_stream = _current_stream()
        if len(self._pending) >= MAX_PENDING:
            self.flush()

    def synced(self) -> None:
        """Count a host sync of this layer's forward (without a `flush`: a hit's path)."""
        self._stats.host_syncs += 1

    def flush(self) -> None:
        """Tell the policy, the counters and the stack distances the forwards `hit`
        served, in their order, as `_account` would have told them at each."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        policy, stats = self.policy, self._stats
        # Ids a forward left on the device (`hit_on_device`) come to the host here.
        pending = [(r if isinstance(r, np.ndarray) else _host_rows(r), low) for r, low in pending]
        for rows, lower in pending:
            for i, row in enumerate(rows.tolist()):
                if lower:
                    policy.observe_lower([_here(r[i]) for r in lower])
                policy.access(row)
            self._distances.observe_step(rows)
            stats.hits_decode += int(np.unique(rows).size)
        routed = np.concatenate([rows.ravel() for rows, _ in pending])
        stats.routed += np.bincount(routed, minlength=stats.routed.size)
        stats.routed_total += routed.size

    def _account_prefill(
        self, token_experts: np.ndarray, prediction: Prediction | None, rec: AnyRecorder
    ) -> tuple[np.ndarray, list[int]]:
        """`_account` for a prefill forward that is not served from slots (an overflow
        or stacked one), its misses attributed by the forward's diagnostics `rec`."""
        needed, missing = self._account(token_experts, decode=False)
        rec.attribute(self, False, needed, missing, prediction, promotable=False)
        return needed, missing

    def ensure(
        self, token_experts: np.ndarray, *, decode: bool, synced: bool = False, rec: AnyRecorder = NULL_RECORDER
    ) -> None:
        """Make resident every expert routed by these tokens ([tokens, k] ids),
        promoting what the prefetcher has read for them; the caller then queues the
        forward's read of the slots on the current stream. `rec`: the forward's
        diagnostics (daemon/model/diagnostics.py).

        `synced`: this forward has just synced a computation on the current stream (its
        router). Where a stream runs its work in order (`_ordered_streams`), every read of
        the slots queued on it before has run too; when every earlier read was queued on
        this stream, slots may be written without waiting for the streams again."""
        prediction, self.prediction = self.prediction, None
        ordinal = self.layer.ordinal
        with rec.segment(ordinal, "lookup"):
            needed, missing = self._account(token_experts, decode=decode)
        rec.attribute(self, decode, needed, missing, prediction, promotable=True)
        stream = _current_stream()
        if missing:
            self._admit(
                missing, set(needed.tolist()) | self.pinned, rec=rec, drained=synced and self._reads_drained(stream)
            )
        self._reader_stream = stream

    def fits(self, token_experts: np.ndarray) -> bool:
        """Whether the experts of these tokens fit in the pool at once."""
        if token_experts.size <= self.capacity - len(self.pinned):
            return True  # a decode step's few: no set to build
        needed = set(np.unique(token_experts[token_experts >= 0]).tolist())
        return len(needed - self.pinned) <= self.capacity - len(self.pinned)

    def gather_overflow(
        self, token_experts: np.ndarray, rec: AnyRecorder = NULL_RECORDER
    ) -> tuple[dict[str, mx.array], np.ndarray]:
        """Serve a forward whose experts do not fit in the pool, as one kernel call.

        Returns stacked arrays holding exactly the experts these tokens need (resident
        ones copied from their slots, missing ones read from the store into scratch) and
        the map expert id -> row in them. Afterwards the pool keeps the experts of the
        latest tokens, copied from the scratch, so decoding starts warm. Memory: one
        transient copy of this layer's needed experts. `rec`: the forward's diagnostics.
        """
        prediction, self.prediction = self.prediction, None
        needed, missing = self._account_prefill(token_experts, prediction, rec)
        self.stats.overflow_forwards += 1
        resident = [int(e) for e in needed if self.slot_of[e] >= 0]
        scratch = self._read_scratch(missing)
        row_of = np.full(self.layer.num_experts, -1, np.int32)
        row_of[resident] = np.arange(len(resident), dtype=np.int32)
        row_of[missing] = np.arange(len(resident), len(resident) + len(missing), dtype=np.int32)
        take = mx.array(self.slot_of[resident]) if resident else None
        stacked = {}
        for name, pool_array in self.arrays.items():
            parts = ([pool_array[take]] if take is not None else []) + ([scratch[name]] if missing else [])
            stacked[name] = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        mx.eval(list(stacked.values()))
        self._keep_latest(token_experts, scratch, {e: j for j, e in enumerate(missing)})
        return stacked, row_of

    # ---- a layer-major prefill's stack (daemon/model/prefill.py) -----------------------

    def stage_layer(self, blocks: int | None = None) -> tuple[dict[str, mx.array], int]:
        """A stack of the whole layer in GPU memory, row e for expert e, and the bytes
        staged into it. A mapped pool copies every expert in (lazily: it runs with the
        graph that first evaluates it; `blocks` caps the copy kernel's blocks per row,
        else the kernel's own); a slot pool copies its resident experts now and leaves
        the rows of the others to `fill_stack`."""
        layer = self.layer
        n = layer.num_experts
        names = [t.name for t in layer.tensors]
        arrays = [self.arrays[name] for name in names]
        self.prediction = None
        self._stack_missing = set()
        if self.host_memory:
            everything = mx.arange(n, dtype=mx.uint32)
            cap = {} if blocks is None else {"max_blocks": blocks}
            rows = _take_rows(arrays, everything) if self.gather is None else self.gather(arrays, everything, **cap)
            staged = n
        else:
            self._settle()
            resident = self.slot_of >= 0
            # Rows of experts not resident take slot 0's bytes until filled (or never read).
            rows = _take_rows(arrays, mx.array(np.where(resident, self.slot_of, 0).astype(np.uint32)))
            mx.eval(rows)
            staged = int(resident.sum())
        self.stats.stacked_layers += 1
        self.stats.staged_bytes += staged * layer.expert_bytes
        return dict(zip(names, rows)), staged * layer.expert_bytes

    def note_stacked(self, token_experts: np.ndarray, rec: AnyRecorder = NULL_RECORDER) -> None:
        """A stacked forward's routing ([tokens, k]): counted as a prefill forward's
        (and attributed by the forward's diagnostics `rec`), and what the pool lacks of
        it remembered for `fill_stack`."""
        _, missing = self._account_prefill(token_experts, None, rec)
        self._stack_missing.update(missing)

    def read_ahead(self, routes: int) -> int:
        """Before a layer-major prefill reaches this layer: start reading the experts the
        pool lacks into the prefetch buffer (hottest first, as many as it holds), so that
        the disk works while the layers below compute; `fill_stack` takes them from there.
        Only where the prompt's `routes` (tokens x top-k) make nearly every expert routed
        (`READ_AHEAD_ROUTES` per expert: under uniform routing 95% of them), so that
        what is read ahead is what the stack needs anyway. Returns the reads started."""
        pf = self.prefetcher
        layer = self.layer
        if pf is None or self.host_memory or not self.reuse or self.fully_resident:
            return 0
        if routes < READ_AHEAD_ROUTES * layer.num_experts:
            return 0
        missing = np.flatnonzero(self.slot_of < 0)
        hottest = missing[np.argsort(-self.stats.routed[missing], kind="stable")]
        return pf.submit(layer, hottest[: pf.slots].tolist())

    def fill_stack(self, stack: dict[str, mx.array]) -> int:
        """Bring the experts the stacked forwards routed and the pool lacks into their
        rows of `stack`, once each (from the prefetch buffer where `read_ahead` read
        them, else from the store); returns the bytes read."""
        missing, self._stack_missing = sorted(self._stack_missing), set()
        if not missing:
            return 0
        placements = [(e, e) for e in missing]
        to_read = self._promote_buffered(placements, stack)
        promoted = (len(placements) - len(to_read)) * self.layer.expert_bytes
        self.stats.bytes_read += promoted
        return promoted + (self._fill_rows(to_read, stack) if to_read else 0)

    def _promote_buffered(
        self, placements: Sequence[tuple[int, int]], arrays: dict[str, mx.array], rec: AnyRecorder = NULL_RECORDER
    ) -> list[tuple[int, int]]:
        """Copy the experts of (expert, row) placements that the prefetch buffer holds
        into their rows of `arrays`; returns the placements still to read."""
        pf = self.prefetcher
        ordinal = self.layer.ordinal
        if pf is None:
            return list(placements)
        buffered = [(e, row) for e, row in placements if pf.has(ordinal, e)]
        if not buffered:
            return list(placements)
        # Promotion may also write the host tier: no tier copy may be in flight.
        self.admitter.settle()
        left, _ = pf.promote(self.layer, buffered, arrays, rec)
        done = {e for e, _ in buffered} - {e for e, _ in left}
        return [p for p in placements if p[0] not in done]

    def _fill_rows(self, placements: Sequence[tuple[int, int]], arrays: dict[str, mx.array]) -> int:
        """Read (expert, row) placements into `arrays` outside the slots (a stack or
        scratch), counted as read; raises on the first failure. Returns the bytes read."""
        failed = self.admitter.fill(self.layer, placements, arrays)
        read = (len(placements) - len(failed)) * self.layer.expert_bytes
        self.stats.bytes_read += read
        if failed:
            self._raise(failed)
        return read

    def keep_from_stack(self, token_experts: np.ndarray, stack: dict[str, mx.array]) -> None:
        """After the stacked forwards ran: keep the experts of the last tokens, copied
        from the stack, so decoding starts warm."""
        n = self.layer.num_experts
        self._keep_latest(token_experts, stack, {e: e for e in range(n)})

    def _read_scratch(self, experts: Sequence[int]) -> dict[str, mx.array]:
        if not experts:
            return {}
        scratch = {t.name: mx.zeros((len(experts), *t.shape), dtype=getattr(mx, t.dtype)) for t in self.layer.tensors}
        mx.eval(list(scratch.values()))
        self._fill_rows([(e, j) for j, e in enumerate(experts)], scratch)
        return scratch

    def _keep_latest(
        self, token_experts: np.ndarray, scratch: dict[str, mx.array], scratch_row: dict[int, int]
    ) -> None:
        """Admit, from the scratch, the experts of the last tokens that fit in the pool."""
        room = self.capacity - len(self.pinned)
        keep: set[int] = set()
        for row in token_experts[::-1]:
            row_set = {e for e in _here(row) if e not in self.pinned}
            if len(keep | row_set) > room:
                break
            keep |= row_set
        self._quiesce()
        missing = [e for e in sorted(keep) if self.slot_of[e] < 0]
        placements = self._assign_slots(missing, keep | self.pinned)
        for e in missing:
            self.policy.admitted(e)
        self.admitter.copy_rows(self.layer, self.arrays, scratch, [(slot, scratch_row[e]) for e, slot in placements])

    def _reads_drained(self, stream: mx.Stream) -> bool:
        """After a sync on `stream` (the current one): whether every read of this pool
        queued before has run (see `ensure`)."""
        return self._ordered_streams and (self._reader_stream is None or self._reader_stream == stream)

    def _quiesce(self) -> None:
        """Work queued earlier (e.g. another request's step, interleaved with this one)
        may still read the slots about to be overwritten: let it finish first."""
        self.stats.quiesces += 1
        mx.synchronize(generation_stream)
        mx.synchronize()

    def _take_slot(self, protected: set[int]) -> int:
        """A free slot, or the slot of the policy's victim (never a protected expert)."""
        if self._pending:
            self.flush()
        if self._free:
            return self._free.pop()
        victim = self.policy.victim(self._resident, protected)
        if victim in protected or self.slot_of[victim] < 0:
            raise RuntimeError(
                f"policy {self.policy.name} chose expert {victim} of "
                f"{self.layer.module_path}, which is protected or not resident"
            )
        slot = int(self.slot_of[victim])
        self.slot_of[victim] = -1
        self._table = None
        self._resident.discard(victim)
        self.policy.evicted(victim)
        self.stats.evictions += 1
        return slot

    def _assign_slots(self, missing: Sequence[int], protected: set[int]) -> list[tuple[int, int]]:
        """A slot for each of `missing` (evicting unprotected experts where none is
        free), recorded as resident; returns the (expert, slot) placements."""
        placements = []
        for e in missing:
            slot = self._take_slot(protected)
            self.slot_of[e] = slot
            self._table = None
            self.expert_in[slot] = e
            self._resident.add(e)
            placements.append((e, slot))
        return placements

    def _admit(
        self, missing: Sequence[int], protected: set[int], rec: AnyRecorder = NULL_RECORDER, drained: bool = False
    ) -> None:
        ordinal = self.layer.ordinal
        with rec.segment(ordinal, "admit"):
            if not drained:
                self._quiesce()
            placements = self._assign_slots(missing, protected)
        with rec.segment(ordinal, "read"):
            to_read = self._promote_buffered(placements, self.arrays, rec)
            failed = self.admitter.fill(self.layer, to_read, self.arrays) if to_read else []
        failed_experts = {e for e, _ in failed}
        for e in missing:
            if e in failed_experts:
                self._release(e)
            else:
                self.policy.admitted(e)
        self.stats.bytes_read += (len(placements) - len(failed)) * self.layer.expert_bytes
        if failed:
            self._raise(failed)

    def _raise(self, failed: Sequence[tuple[int, str]]) -> None:
        expert, error = failed[0]
        raise ExpertReadError(
            f"cannot read expert {expert} of layer {self.layer.ordinal} ({self.layer.module_path}): {error}"
        )

    def _release(self, expert: int) -> None:
        slot = int(self.slot_of[expert])
        self.slot_of[expert] = -1
        self._table = None
        self.expert_in[slot] = -1
        self._resident.discard(expert)
        self._free.append(slot)

    def take_routed(self) -> np.ndarray:
        """Per-expert routed counts since the last call (for the heat keeper)."""
        counts = self.stats.routed
        self.stats.routed = np.zeros_like(counts)
        self._routed_earlier += counts
        return counts

    # ---- resizing (daemon/pool/elastic.py) ---------------------------------------------

    def watch_arrays(self, use: Callable[[dict[str, mx.array]], None]) -> None:
        """`use(arrays)` once `resize` has replaced the arrays (the layer's StreamingMoE
        hands its module the new ones)."""
        self.on_arrays.append(use)

    def hottest_first(self, experts: Iterable[int]) -> list[int]:
        """`experts` by heat: routings since load, then the order they were pinned in
        (the saved heat's), then id."""
        routed = self._routed_earlier + self.stats.routed
        last = len(self._pin_rank)
        return sorted((int(e) for e in experts), key=lambda e: (-int(routed[e]), self._pin_rank.get(e, last), e))

    def resize(self, capacity: int) -> int:
        """Give the pool `capacity` slots (top-k at the least, every expert at the most),
        between two forwards; returns the experts given back (a shrink) or read (a grow).

        A shrink keeps at most `capacity - top_k` pinned experts (as `pin` does), the
        hottest, and unpins the rest; it gives back the policy's victims first (the coldest
        by its own measure), then the unpinned, least routed first. A grow pins again what
        a shrink unpinned (reading those that left, hottest first), or, with a slot for
        every expert, loads them all (`load_all`). Either way the experts kept are copied
        into new arrays of `capacity` rows, and the old arrays go once nothing holds them:
        a forward queued before still reads them, under the slot ids it was given, and no
        byte of an expert changes, so neither does what the model computes."""
        self.flush()
        n = self.layer.num_experts
        capacity = max(self.top_k, min(int(capacity), n))
        if capacity == self.capacity or self.host_memory or not self.reuse:
            return 0
        # Copies still in flight into slots land first; those experts are residents now.
        self.admitter.settle()
        self._prestaged = set()
        if capacity < self.capacity:
            return self._shrink(capacity)
        return self._grow(capacity)

    def _shrink(self, capacity: int) -> int:
        if self.remap is not None:
            self.remap, self.identity = None, False
        pins = self.hottest_first(self.pinned)
        kept, unpinned = pins[: capacity - self.top_k], pins[capacity - self.top_k :]
        self.pinned = set(kept)
        # Hottest first: these were pinned until now, those of an earlier shrink before.
        self.unpinned = unpinned + [e for e in self.unpinned if e not in self.pinned]
        protected = self.pinned | set(self.unpinned)
        excess = len(self._resident) - capacity
        given = 0
        # The policy's own victims first, never a pinned or unpinned one.
        while given < excess and len(self._resident - protected):
            victim = self.policy.victim(self._resident, protected)
            self._release(victim)
            self.policy.evicted(victim)
            given += 1
        for e in reversed(self.hottest_first(e for e in self.unpinned if self.slot_of[e] >= 0)):
            if given >= excess:
                break
            self._release(e)
            self.policy.evicted(e)
            given += 1
        # The experts kept stay in their slots below `capacity`; those above move down.
        used = [int(s) for s in np.flatnonzero(self.expert_in >= 0)]
        low_free = [s for s in range(capacity) if self.expert_in[s] < 0]
        moves = [(low_free.pop(0), s) for s in used if s >= capacity]
        rows = [(s, s) for s in used if s < capacity] + moves
        self._replace_arrays(capacity, rows)
        return given

    def _grow(self, capacity: int) -> int:
        rows = [(s, s) for s in np.flatnonzero(self.expert_in >= 0).tolist()]
        self._replace_arrays(capacity, rows)
        read_before = self.stats.bytes_read
        if capacity == self.layer.num_experts:
            self.load_all()
            self.unpinned = []
        else:
            wanted = self.unpinned[: max(capacity - self.top_k - len(self.pinned), 0)]
            self.pin(wanted)
            self.unpinned = [e for e in self.unpinned if e not in self.pinned]
        return (self.stats.bytes_read - read_before) // max(self.layer.expert_bytes, 1)

    def _replace_arrays(self, capacity: int, rows: Sequence[tuple[int, int]]) -> None:
        """New arrays of `capacity` rows holding the old rows' bytes at (new row, old
        row) `rows`, the slot table renumbered to match; the rest of the slots free."""
        old = self.arrays
        arrays = {t.name: mx.zeros((capacity, *t.shape), dtype=getattr(mx, t.dtype)) for t in self.layer.tensors}
        mx.eval(list(arrays.values()))
        self.admitter.prepare(arrays)
        self.admitter.copy_rows(self.layer, arrays, old, rows)
        expert_in = np.full(capacity, -1, np.int32)
        for new, was in rows:
            e = int(self.expert_in[was])
            expert_in[new] = e
            self.slot_of[e] = new
        self._table = None
        self.arrays, self.expert_in, self.capacity = arrays, expert_in, capacity
        self.policy.capacity = capacity
        self._free = [s for s in range(capacity - 1, -1, -1) if expert_in[s] < 0]
        # Nothing queued reads the new arrays yet.
        self._reader_stream = None
        for use in self.on_arrays:
            use(arrays)
