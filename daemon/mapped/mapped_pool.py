"""A mapped pool: every expert addressable, the hot ones in GPU memory.

Where host RAM holds every expert and the GPU is an NVIDIA card, the pool can span all
experts in managed memory instead of `capacity` slots: the kernels run as at full
residency (no host sync per layer, stock mlx-lm's own call), experts placed in GPU
memory are read at its speed, and the others are read by the kernels over the link
(zero-copy) from host memory. The host's only job is placement: which `gpu_slots`
experts per layer live in GPU memory. It counts the routing of tokens already finished
(read two forwards late, so the pipeline never waits for it), and every
`rebalance_tokens` tokens (sooner at first) it sets each layer's GPU share to its most
routed experts so far (seeded with the saved heat): on measured routing that holds more
of what is routed than moving experts per token did, for a fraction of the moves (per-
token moves measured slower on the H200 and were removed; tests/bench/RESULTS.md).
Output is unchanged by construction: the bytes never change, only where they live.

The host's share of each token is kept small, since decode on a GPU is as fast as the
host can queue work: the routing of a forward is gathered into one array on the device
(one read-back per forward instead of one per layer), and the counting and the moves
go to a worker thread: its Python runs while the decode thread waits for the device
(MLX releases the GIL there), and its driver calls neither hold the GIL nor wait for the
migrations they start. Each move is two driver calls per expert tensor, which can take
longer than a token: routing read back while the worker is busy waits in one backlog,
and the worker's next turn takes all of it at once, so the worker never falls further
behind.

On the CPU and on unified memory there is nothing to move; the same bookkeeping runs
with a mover that only counts, which is what the tests here exercise.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from ..pool.expert_pool import ExpertPool
from ..pool.resident_routing import LayerRouting, ResidentRouting

# The first rebalance comes after rebalance_tokens / this many tokens; each interval
# doubles up to rebalance_tokens.
REBALANCE_RAMP = 8

# (buffer, "device" | "host", offset, nbytes)
Span = tuple[Any, str, int, int]


class Mover(Protocol):
    def place_many(self, spans: Sequence[Span], map_for_gpu: bool = False, wait: bool = False) -> None: ...


class CountingMover:
    """Where memory is one (CPU, Apple Silicon): nothing moves; ranges are counted."""

    def __init__(self) -> None:
        self.calls = 0

    def place_many(self, spans: Sequence[Span], map_for_gpu: bool = False, wait: bool = False) -> None:
        self.calls += len(spans)


@dataclass
class MappedPoolStats:
    routed: int = 0
    routed_on_gpu: int = 0
    moves: int = 0
    place_calls: int = 0
    # Worker turns: each takes every forward read back since the previous one.
    turns: int = 0
    rebalances: int = 0
    readback_seconds: float = 0.0
    decide_seconds: float = 0.0
    # Spent by the worker thread in the driver, off the decode thread.
    place_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every counter, and the share of routed experts found in GPU memory."""
        return {**asdict(self), "gpu_hit_rate": self.routed_on_gpu / self.routed if self.routed else None}


class _Worker:
    """Runs jobs in order on one thread; a failure is raised to the caller at its next
    `submit`, `drain` or `close`, and the jobs after it are dropped."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[Callable[[], None] | threading.Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="moestream-placement", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
            elif self.error is None:
                try:
                    job()
                except BaseException as e:  # handed to the decode thread, which raises it
                    self.error = e

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"placing experts between host and GPU memory failed: {self.error}") from self.error

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._queue.put(job)

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._raise()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise()


class MappedPool:
    """Which experts of each fully addressable pool live in GPU memory."""

    def __init__(self, pools: Sequence[ExpertPool], gpu_slots: int, mover: Mover, *, rebalance_tokens: int = 0) -> None:
        self.pools = list(pools)
        self.gpu_slots = gpu_slots
        self.mover = mover
        # Every `rebalance_tokens` tokens routed (0: never), each layer's GPU share is
        # set to its most routed experts so far (plus the heat autopin seeded). The first
        # intervals are shorter (an eighth, a quarter, a half of it, then all of it): a
        # first start without heat keeps an arbitrary placement until then, and on the
        # H200 a mapped pool's rounds ran faster with each rebalance (tests/bench/RESULTS.md,
        # "The mapped pool").
        self.rebalance_tokens = rebalance_tokens
        self._rebalance_interval = max(1, rebalance_tokens // REBALANCE_RAMP)
        self._counts = [np.zeros(p.layer.num_experts, np.float64) for p in self.pools]
        self._tokens_since_rebalance = 0
        self.on_gpu: list[set[int]] = [set() for _ in self.pools]
        self.stats = MappedPoolStats()
        for p in self.pools:
            if not p.fully_resident:
                raise ValueError(f"layer {p.layer.module_path}: a mapped pool must hold every expert")
        # The routing, read back a few tokens late with no sync of its own; a hit is the
        # GPU memory's here (`routed_on_gpu`), not the pool's.
        self.routing = ResidentRouting(self.pools, self._consume, hits=False)
        # Byte views of the pool arrays, taken here on the decode thread: the worker
        # hands the driver these, never touching an MLX array itself.
        self._views = [{t.name: memoryview(p.arrays[t.name]).cast("B") for t in p.layer.tensors} for p in self.pools]
        self._worker = _Worker()
        # Routing read back but not yet seen by the worker, and whether a worker turn
        # that will take it is queued (both under the lock).
        self._backlog: list[LayerRouting] = []
        self._turn_queued = False
        self._lock = threading.Lock()
        # Whether place_initial has mapped every range for the GPU yet.
        self._placed = False

    def place_initial(self, hottest: Sequence[Sequence[int]] | None = None) -> None:
        """Put each layer's first `gpu_slots` experts of `hottest` (default: 0, 1, ...)
        in GPU memory and the rest in host memory, mapped for the GPU; returns when the
        bytes are there. A later call (autopin after the loader's) moves only the
        experts whose place changes."""
        self._worker.drain()  # the counts and `on_gpu` are the worker's while it runs
        tic = time.perf_counter()
        first = not self._placed
        spans: list[Span] = []
        for i, pool in enumerate(self.pools):
            n = pool.layer.num_experts
            order = [int(e) for e in (hottest[i] if hottest is not None else [])]
            seen = set(order)
            order += [e for e in range(n) if e not in seen]
            chosen = set(order[: self.gpu_slots])
            if first:
                # Every range gets a place (and is mapped for the GPU), in runs.
                flags = np.array([e in chosen for e in range(n)])
                for start, stop, on_gpu in _runs(flags):
                    spans += self._spans(i, start, stop, "device" if on_gpu else "host")
            spans += self._reassign(i, chosen, spans=not first)
        self.mover.place_many(spans, first, True)
        self._placed = True
        self.stats.place_seconds += time.perf_counter() - tic

    def tick(self) -> None:
        """After a token is queued: gather the routing of the forwards just queued into
        one device array, read back the routing of forwards surely done, and hand it to
        the worker, which counts it and rebalances when one is due."""
        self.routing.tick()
        self.stats.readback_seconds = self.routing.readback_seconds

    def settle(self) -> None:
        """Account every forward queued so far and wait for the worker (at the end of a
        request, when the last token has been read and nothing is left to overlap with)."""
        self.routing.settle()
        self.stats.readback_seconds = self.routing.readback_seconds
        self._worker.drain()

    def _consume(self, routed: list[LayerRouting]) -> None:
        """Forwards read back (`ResidentRouting`, which counted them for the heat):
        count those in GPU memory, and hand the rebalancing's counts and moves to the
        worker: the decode thread waits for the device most of a token (MLX lets go of
        the GIL meanwhile), and that is when the worker's Python runs."""
        for r in routed:
            on_gpu = self.on_gpu[r.layer]
            self.stats.routed += r.ids.size
            self.stats.routed_on_gpu += sum(e in on_gpu for e in r.ids.reshape(-1).tolist())
        with self._lock:
            self._backlog += routed
            if self._turn_queued:
                return
            self._turn_queued = True
        self._worker.submit(self._decide)

    def _decide(self) -> None:
        """On the worker: count every forward of the backlog, and rebalance when one is
        due."""
        with self._lock:
            routed, self._backlog = self._backlog, []
            self._turn_queued = False
        self.stats.turns += 1
        tic = time.perf_counter()
        spans: list[Span] = []
        for r in routed:
            self.pools[r.layer].stack_distances.observe_step(r.ids)
        if self.rebalance_tokens:
            for r in routed:
                np.add.at(self._counts[r.layer], r.ids.reshape(-1), 1)
                if r.layer == 0:  # a forward's tokens, counted once
                    self._tokens_since_rebalance += r.ids.shape[0]
            if self._tokens_since_rebalance >= self._rebalance_interval:
                self._tokens_since_rebalance = 0
                self._rebalance_interval = min(2 * self._rebalance_interval, self.rebalance_tokens)
                spans += self._rebalance_spans()
        t1 = time.perf_counter()
        self.stats.decide_seconds += t1 - tic
        if spans:
            self.mover.place_many(spans, False, False)
        self.stats.place_seconds += time.perf_counter() - t1

    def seed_counts(self, counts: Sequence[Mapping[int, int]]) -> None:
        """Add saved heat (per pool, expert -> count) to the counts rebalancing goes by,
        so that the first rebalance weighs the long-term heat, not only a few tokens."""
        self._worker.drain()
        for layer_counts, mine in zip(counts, self._counts):
            for e, c in layer_counts.items():
                if 0 <= e < len(mine):
                    mine[e] += c

    def _rebalance_spans(self) -> list[Span]:
        self.stats.rebalances += 1
        spans: list[Span] = []
        for i, counts in enumerate(self._counts):
            on_gpu = self.on_gpu[i]
            n = len(counts)
            here = np.zeros(n, bool)
            here[list(on_gpu)] = True
            # Most routed first; among equals what is in GPU memory already (no churn),
            # then the lower id.
            order = np.lexsort((np.arange(n), ~here, -counts))
            chosen = {int(e) for e in order[: self.gpu_slots]}
            self.stats.moves += len(chosen - on_gpu)
            spans += self._reassign(i, chosen)
        return spans

    def _reassign(self, i: int, chosen: set[int], *, spans: bool = True) -> list[Span]:
        """Make `chosen` layer i's experts in GPU memory: update `on_gpu`, and return the
        spans that move each expert whose place changes (none when `spans` is False: the
        caller places whole ranges itself)."""
        on_gpu = self.on_gpu[i]
        out: list[Span] = []
        for e in sorted(on_gpu - chosen):
            on_gpu.discard(e)
            if spans:
                out += self._spans(i, e, e + 1, "host")
        for e in sorted(chosen - on_gpu):
            on_gpu.add(e)
            if spans:
                out += self._spans(i, e, e + 1, "device")
        return out

    def _spans(self, i: int, start: int, stop: int, where: str) -> list[Span]:
        tensors = self.pools[i].layer.tensors
        self.stats.place_calls += len(tensors)
        views = self._views[i]
        return [(views[t.name], where, start * t.nbytes, (stop - start) * t.nbytes) for t in tensors]

    def drain(self) -> None:
        """Wait until the worker has decided and made every move handed to it so far."""
        self._worker.drain()

    def close(self) -> None:
        self.routing.close()
        self._worker.close()


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs [start, stop) of equal flags."""
    out, start = [], 0
    for j in range(1, len(flags) + 1):
        if j == len(flags) or flags[j] != flags[start]:
            out.append((start, j, bool(flags[start])))
            start = j
    return out
