"""Expert-parallel streaming: N processes of one `mx.distributed` group share every MoE
layer's experts (docs/scale-out.md has the design and its figures).

Every rank holds the resident weights (attention, routers, norms, embeddings) and runs
the same forward, or, in a daemon's group, follows rank 0's MoE layers (MODES). Rank r
owns the experts e with e % N == r of every layer, and only those are in its pool, read
from its disk and counted in its statistics. Interleaved rather than contiguous: the
shares differ by at most one expert for any N, and the map from a global id to a row of
the share (e // N) is one integer division on the device.

An MoE layer's expert module returns one row per routed (token, k) pair, [..., k, hidden],
which the model's own block then weights by the router's scores and sums over k. Each
rank computes the rows of the pairs it owns (the others run on a placeholder slot and are
zeroed, so the kernel sees the same number of rows as in one process) and the ranks
`all_sum` those rows. Exactly one rank contributes each row, and x + 0 is x in every
floating-point format (but for a -0.0, which becomes +0.0: equal, and it changes no sum
it enters unless every term is zero), so every row is the single-process row and the
model's weighted sum over k runs unchanged: the output is exact. (Summing the ranks'
weighted partials instead would send k times fewer bytes but add in another order.)

Invariant: `local` of an owned expert is its row in the rank's share of the layer
(`layer_view`), which is what the rank's pool indexes; a pair the rank does not own is
`NOT_HERE` (-1) on the host side and never reaches its pool.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import mlx.core as mx
import numpy as np

from ...shared.store_format import Manifest, MoELayer

# A routed pair of an expert another rank owns, in the ids a share's pool is given.
NOT_HERE = -1


@dataclass
class ShareStats:
    """What crossed the group: one all_sum per MoE forward, of the bytes it summed; and,
    in a daemon's group, what rank 0 sent the others (each forward's input and routing)."""

    collectives: int = 0
    collective_bytes: int = 0
    # Seconds inside the all_sums, measured only by the benchmark's timed share
    # (daemon/bench/expert_parallel.py `--time-collectives`).
    collective_seconds: float = 0.0
    broadcasts: int = 0
    broadcast_bytes: int = 0


# How the ranks of a group take part in a forward. Replicated: every rank runs the whole
# forward (the same tokens, the same cache), and only the expert rows are summed. Leader
# and follower: rank 0 runs the forward (the daemon, daemon/expert_worker.py) and hands
# each MoE layer's input and routing to the followers, which run only that layer's share.
MODES = ("replicated", "leader", "follower")

# A leader's command to its followers: a header of HEADER_LEN int32s, all_gathered.
FORWARD, STATS, STOP = 1, 2, 3
HEADER_LEN = 16
MAX_DIMS = 5
DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint32, mx.int64, mx.uint64)
# Per rank, for the leader's status: bytes read, hits, misses, experts owned (over all
# layers), pool bytes, all_sums; its pool's slots per layer, experts resident and pinned
# (over all layers); its heat (daemon/heat.py `Heat.summary`): the state's code, routing
# counts sent to its keeper and dropped, counts loaded at its warm start, experts pinned
# from them.
STAT_FIELDS = (
    "bytes_read",
    "hits",
    "misses",
    "experts",
    "pool_bytes",
    "collectives",
    "capacity",
    "resident",
    "pinned",
    "heat_state",
    "heat_sent",
    "heat_dropped",
    "heat_loaded",
    "heat_pinned",
)
# How long the leader waits for a control command (STATS, STOP) to be answered before it
# takes the group for broken: a rank that died never answers, and a collective with a
# dead peer may block for good. Long enough for the decode step queued before it.
CONTROL_SECONDS = 30.0


class GroupError(RuntimeError):
    """The group no longer answers (a rank died or its link failed); the message says what."""


@dataclass(frozen=True)
class Command:
    """What a follower is told to do next: FORWARD (the MoE layer `ordinal` on `x` and
    `indices`), STATS or STOP."""

    op: int
    ordinal: int = -1
    x: mx.array | None = None
    indices: mx.array | None = None


class ExpertShare:
    """This rank's share of every MoE layer in a group of `size` ranks."""

    def __init__(
        self,
        group: Any,
        *,
        rank: int | None = None,
        size: int | None = None,
        mode: str = "replicated",
    ):
        """`group`: an `mx.distributed` group (`rank`/`size` default to its own)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.group = group
        self.rank = group.rank() if rank is None else rank
        self.size = group.size() if size is None else size
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if mode == "leader" and self.rank != 0 or mode == "follower" and self.rank == 0:
            raise ValueError(f"rank {self.rank} cannot be the {mode}: rank 0 leads")
        self.mode = mode
        self.stats = ShareStats()
        # Outside the replicated mode, the last collective: every new one depends on it, so
        # that each rank's lazy graph runs them in the order they were made, the same on
        # every rank (independent ones, such as a forward's input and routing, could run
        # in either order and receive each other's bytes).
        self._last: mx.array | None = None
        # Why the group is taken for broken (a control command unanswered), else None.
        self.broken: str | None = None

    def owned(self, num_experts: int) -> list[int]:
        """The global ids of this rank's experts in a layer of `num_experts`."""
        return list(range(self.rank, num_experts, self.size))

    def layer_view(self, layer: MoELayer) -> MoELayer:
        """The layer as this rank's pool sees it: its own experts only, row j being global
        expert j * size + rank, each read at its place in the full store's layer file."""
        mine = self.owned(layer.num_experts)
        if not mine:
            raise ValueError(
                f"layer {layer.module_path} has {layer.num_experts} experts: too few for {self.size} ranks"
            )
        return dataclasses.replace(layer, num_experts=len(mine), experts=tuple(layer.experts[e] for e in mine))

    def manifest_view(self, manifest: Manifest) -> Manifest:
        """The manifest with every MoE layer replaced by this rank's view of it."""
        return dataclasses.replace(manifest, layers=tuple(self.layer_view(layer) for layer in manifest.layers))

    def local_ids(self, ids: np.ndarray) -> np.ndarray:
        """Global expert ids -> rows of this rank's share, NOT_HERE where another owns them."""
        return np.where(ids % self.size == self.rank, ids // self.size, NOT_HERE).astype(np.int32)

    def global_counts(self, local: np.ndarray) -> np.ndarray:
        """Per-row counts of this rank's share -> per-expert counts by global id (0 for the
        experts of other ranks), long enough to hold every owned id."""
        out = np.zeros(len(local) * self.size, np.int64)
        out[self.rank :: self.size] = local
        return out

    def local_counts(
        self, counts: Mapping[int, Mapping[int, int]], rows: Mapping[int, int]
    ) -> tuple[dict[int, dict[int, int]], int]:
        """{layer: {global id: count}} -> the same by rows of this rank's share (`rows`:
        {layer: rows of the share}), and how many entries were left out: of an expert
        another rank owns, past the layer's experts, or of a layer `rows` lacks."""
        out: dict[int, dict[int, int]] = {}
        foreign = 0
        for layer, experts in counts.items():
            mine = out.setdefault(layer, {}) if layer in rows else {}
            for e, c in experts.items():
                if layer in rows and e % self.size == self.rank and e // self.size < rows[layer]:
                    mine[e // self.size] = c
                else:
                    foreign += 1
        return out, foreign

    def local_device(self, indices: mx.array) -> tuple[mx.array, mx.array]:
        """On the device: (this rank's rows for the owned pairs, 0 for the others; the mask
        of the owned pairs)."""
        mine = (indices % self.size) == self.rank
        return mx.where(mine, indices // self.size, 0).astype(indices.dtype), mine

    def combine(self, y: mx.array, mine: mx.array) -> mx.array:
        """Every rank's rows of its owned pairs, summed over the group: each pair's row as
        its owner computed it (see the module's docstring for why this is exact)."""
        part = mx.where(mine[..., None], y, mx.zeros_like(y))
        self.stats.collectives += 1
        self.stats.collective_bytes += part.nbytes
        return self._chain(mx.distributed.all_sum(self._after(part), group=self.group))

    # ---- leader and followers ----------------------------------------------------------

    def _after(self, a: mx.array) -> mx.array:
        return a if self._last is None else mx.depends(a, self._last)

    def _chain(self, a: mx.array) -> mx.array:
        if self.mode != "replicated":
            self._last = a
        return a

    def _from_leader(self, a: mx.array) -> mx.array:
        """Rank 0's `a` on every rank (an all_gather: rank 0's slice is its bytes as they are)."""
        out = self._chain(mx.distributed.all_gather(self._after(a), group=self.group))
        self.stats.broadcasts += 1
        self.stats.broadcast_bytes += a.nbytes
        return out[: a.shape[0]] if a.ndim else out[:1].reshape(())

    def _header(self, op: int, *fields: int) -> mx.array:
        head = np.zeros(HEADER_LEN, np.int32)
        head[0] = op
        head[1 : 1 + len(fields)] = fields
        return self._from_leader(mx.array(head))

    def _control(self, op: int, what: str, row: np.ndarray | None = None) -> np.ndarray | None:
        """Leader: send the command `op` (and gather every rank's `row`, if given) within
        CONTROL_SECONDS; GroupError when it fails or does not finish, and for every later
        command. Everything queued before is run first, on this thread; the command then
        runs on a thread of its own, made there (MLX's streams belong to their thread),
        while this one waits: MLX is still used by one thread at a time unless the group
        is broken, and then it is never used again."""
        self.check()
        if self._last is not None:
            mx.eval(self._last)
            self._last = None
        box: dict[str, Any] = {}

        def send() -> None:
            try:
                head = np.zeros(HEADER_LEN, np.int32)
                head[0] = op
                mx.eval(mx.distributed.all_gather(mx.array(head), group=self.group))
                if row is not None:
                    box["value"] = np.array(mx.distributed.all_gather(mx.array(row[None]), group=self.group))
            except Exception as e:  # handed to the engine thread below
                box["error"] = e

        sender = threading.Thread(target=send, name="group-control", daemon=True)
        sender.start()
        sender.join(CONTROL_SECONDS)
        if sender.is_alive():
            self.broken = f"{what}: no answer from the group within {CONTROL_SECONDS:.0f} s (a rank gone?)"
        elif "error" in box:
            self.broken = f"{what}: {type(box['error']).__name__}: {box['error']}"
        self.check()
        self.stats.broadcasts += 1
        self.stats.broadcast_bytes += HEADER_LEN * 4
        return box.get("value")

    def barrier(self) -> None:
        """Wait, unbounded, until every rank has come here: once, when all have loaded their
        share (a load of a large share may take minutes; the control commands' bound is for
        ranks that wait for them, which from then on every follower does)."""
        mx.eval(mx.distributed.all_sum(mx.array(1), group=self.group))

    def check(self) -> None:
        """Raise GroupError once the group is taken for broken."""
        if self.broken is not None:
            raise GroupError(f"the expert-parallel group is broken: {self.broken}")

    def lead(self, ordinal: int, x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array]:
        """Leader: send the followers layer `ordinal`'s input and routing; returns them as
        the followers get them (the same bytes), after the send in the graph."""
        self.check()
        if x.ndim > MAX_DIMS or indices.ndim > MAX_DIMS:
            raise ValueError(f"an MoE input of {x.ndim} or routing of {indices.ndim} dims (at most {MAX_DIMS})")
        dims = [x.ndim, *x.shape, *[0] * (MAX_DIMS - x.ndim), indices.ndim, *indices.shape]
        dims += [0] * (MAX_DIMS - indices.ndim) + [DTYPES.index(x.dtype), DTYPES.index(indices.dtype)]
        self._header(FORWARD, ordinal, *dims)
        return self._from_leader(x), self._from_leader(indices)

    def follow(self) -> Command:
        """Follower: wait for the leader's next command (and, for a forward, its input)."""
        head = np.array(self._header(0)).tolist()
        op = head[0]
        if op != FORWARD:
            return Command(op)
        ordinal, xd = head[1], head[2]
        x_shape = head[3 : 3 + xd]
        idx_at = 3 + MAX_DIMS
        idd = head[idx_at]
        idx_shape = head[idx_at + 1 : idx_at + 1 + idd]
        x_dtype, idx_dtype = DTYPES[head[idx_at + 1 + MAX_DIMS]], DTYPES[head[idx_at + 2 + MAX_DIMS]]
        x = self._from_leader(mx.zeros(x_shape, x_dtype))
        indices = self._from_leader(mx.zeros(idx_shape, idx_dtype))
        return Command(FORWARD, ordinal, x, indices)

    def gather_stats(self, mine: list[int]) -> list[list[int]]:
        """Every rank's STAT_FIELDS, rank by rank (the leader asks with STATS; a follower
        answers with its own when `follow` returned STATS)."""
        row = np.array(mine, np.int64)
        if self.mode == "leader":
            every = self._control(STATS, "STATS", row)
            assert every is not None
            return every.tolist()
        every = mx.distributed.all_gather(self._after(mx.array(row[None])), group=self.group)
        return np.array(self._chain(every)).tolist()

    def stop(self) -> None:
        """Leader: tell the followers to end (after every command queued before)."""
        self._control(STOP, "STOP")

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "size": self.size,
            "mode": self.mode,
            "ownership": "e % size == rank",
            "broken": self.broken,
            **dataclasses.asdict(self.stats),
        }


def join_group(backend: str = "any", mode: str = "replicated") -> ExpertShare | None:
    """This process's share in the group `mlx.launch` started it in, or None when it runs
    alone (a group of one: the ordinary single-process paths). In a daemon's group
    (`mode` "leader") rank 0 leads and the others follow."""
    group = mx.distributed.init(backend=backend)
    if group.size() == 1:
        return None
    if mode == "leader" and group.rank() != 0:
        mode = "follower"
    return ExpertShare(group, mode=mode)
