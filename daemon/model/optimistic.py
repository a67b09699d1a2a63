"""Decode steps that do not stop at every MoE layer to ask whether its experts are resident.

A partial slot pool's decode step has one question per MoE layer: are the routed experts
in the pool? Asked layer by layer (`StreamingMoE._decode`), that is a host sync per layer,
48 a token on a q30: each stops the host from building the next layer while the device
computes, and on Metal costs about 180 us by itself. Here a layer looks its slots up on
the device (`ExpertPool.table`), runs its experts on them (a missing expert's -1 read as
slot 0, a wrong row) and keeps the least slot; every CHECK_EVERY such layers, and at the
end of the forward, one sync reads those. All >= 0: each layer ran on its own experts,
bit for bit what the per-layer path computes. A layer with a miss: what it and the layers
after it computed is thrown away. Every cache is put back as it was before the token,
the blocks below the one that holds that layer hand back the outputs they computed (and
their caches as they left them), and the forward runs again from that block: that layer
through the per-layer path (its misses read and counted as they always are), the layers
after it looked up on the device again.

Each pool is told about each of its forwards once, in order, so the policy, the heat's
counts, the stack distances and the hit counts are the per-layer path's.

Used where it pays: a forward of one token per sequence (a lone request's, or a batch
step's, daemon/model/row_batch.py) over caches whose state can be put back
(`REWINDABLE`), no diagnostics, every block with at most one streaming layer and
arguments a replay can hand it again (`_plain`, seen in the model's first decode
forward, which runs on the per-layer path), and few misses lately: on average fewer
layers that miss a token than half its checks (`MISS_WEIGHT`'s running mean). Past that,
the layers computed twice cost more than the syncs saved, and the per-layer path's
prefetch reads the next layer's experts ahead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
)

from .diagnostics import Diagnostics
from .row_batch import RowCaches

if TYPE_CHECKING:
    from .streaming_moe import StreamingMoE

# Streaming layers between two checks. A miss costs recomputing the layers from it to its
# check (CHECK_EVERY / 2 on average); a check costs one sync.
CHECK_EVERY = 8
# Weight of the latest forward in the running mean of missed layers per token.
MISS_WEIGHT = 0.125
# Caches whose state a shallow copy of their attributes puts back: a KVCache's (and a
# chunked one's) writes past the restored offset are never read, and the token run again
# writes over them; a rotating window's decode write lands in the one slot whose keys
# leave the window with this token, which the token run again writes over in turn (a
# trim or a growth makes new arrays); an ArraysCache replaces its arrays rather than
# writing into them. A `CacheList` is rewound through its parts (`_leaves`).
REWINDABLE = (KVCache, QuantizedKVCache, RotatingKVCache, ChunkedKVCache, ArraysCache)


class RouteMiss(Exception):
    """Raised out of the model's forward at a check that found `layer` missing experts."""

    def __init__(self, layer: StreamingMoE) -> None:
        super().__init__(layer.ordinal)
        self.layer = layer


# A cache and its attributes at one moment.
_Snapshot = tuple[_BaseCache, dict[str, Any]]


@dataclass
class _Ran:
    """A streaming layer that ran on its looked-up slots, not yet checked."""

    layer: StreamingMoE
    least: mx.array  # its least slot: < 0 where an expert was missing
    indices: mx.array  # its routed expert ids, for the pool's accounting


@dataclass
class _Forward:
    """One decode forward's state across its runs."""

    # False: the per-layer path, its misses counted for the rule.
    optimistic: bool
    # Every cache of the forward (with its attributes) before the token: the model's code
    # may change one before its blocks run (longcat_flash_ngram's n-gram context).
    start: list[_Snapshot] = field(default_factory=list)
    # Blocks below this one hand back `outputs` (computed by an earlier run) and put their
    # caches as that run left them (`after`).
    replay_from: int = 0
    outputs: dict[int, Any] = field(default_factory=dict)
    after: dict[int, list[_Snapshot]] = field(default_factory=dict)
    pending: list[_Ran] = field(default_factory=list)
    # Layers that take the per-layer path in the runs left (they missed).
    synced: set[int] = field(default_factory=set)
    misses: int = 0


def _plain(value: Any) -> bool:
    """Whether a block's argument is one a replay can hand it again as it was: an array
    (which the block does not write into), a cache (rewound apart, as are the caches of a
    batch step's `RowCaches`), a constant, or a tuple of those. Anything else (kimi_k3's
    attention residuals pass an object that each block changes and returns) may hold what
    a thrown-away run wrote."""
    if value is None or isinstance(value, (mx.array, _BaseCache, RowCaches, str, bool, int, float)):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def _leaves(cache: Any) -> list[Any]:
    """The caches that hold a layer's state: a batch step's requests' (daemon/model/row_batch.py
    `RowCaches`), the parts of mlx-lm's `CacheList` (an attention's keys beside its
    indexer's, deepseek_v32's), or the one."""
    if isinstance(cache, RowCaches):
        return [leaf for row in cache.rows for leaf in _leaves(row)]
    if isinstance(cache, CacheList):
        return [leaf for part in cache.caches for leaf in _leaves(part)]
    return [cache]


def _caches_in(args: Sequence[Any], kwargs: dict[str, Any]) -> list[_BaseCache]:
    return [c for a in [*args, *kwargs.values()] for c in _leaves(a) if isinstance(c, _BaseCache)]


def _copied(attrs: dict[str, Any]) -> dict[str, Any]:
    # Lists copied: an ArraysCache sets its arrays into its list, which must not be the
    # snapshot's own (a snapshot may be put back more than once).
    return {k: list(v) if isinstance(v, list) else v for k, v in attrs.items()}


def _snapshot(caches: list[_BaseCache]) -> list[_Snapshot]:
    return [(c, _copied(vars(c))) for c in caches]


def _restore(saved: list[_Snapshot]) -> None:
    for cache, state in saved:
        attrs = vars(cache)
        attrs.clear()
        attrs.update(_copied(state))


class OptimisticDecode:
    """The check-and-redo of a model's decode forwards (see the module's docstring), handed
    to its streaming layers as they are made; `install` then gives the model and its
    blocks the calls that go through it. `hub`: the model's diagnostics switch."""

    def __init__(self, hub: Diagnostics) -> None:
        self.hub = hub
        self.layers: list[StreamingMoE] = []
        self._block_of: dict[int, int] = {}
        # Tests and `bench decode` force it on or off (`force`; None: the miss rule decides).
        self.forced: bool | None = None
        # Whether the blocks' arguments can be replayed: learned from the first decode
        # forward (run on the per-layer path), then why not if they cannot.
        self.probed = False
        self.why_not: str | None = None
        # The running mean of layers that missed per decode forward.
        self.miss_mean = 0.0
        self._now: _Forward | None = None
        # Forwards run optimistically, and the runs again after a miss (for `bench`).
        self.forwards = 0
        self.redos = 0

    def install(self, model: nn.Module, layers: Sequence[tuple[StreamingMoE, str]]) -> bool:
        """Route `model`'s forwards and its blocks' calls through this controller (mlx-lm's
        model, its streaming `layers` in place, each with its module path); False, leaving
        the model as it is, where its shape does not allow it: the layers not in one list
        of blocks (`...layers.<i>...`), or a block with two of them."""
        found: dict[int, int] = {}
        blocks_path: str | None = None
        for layer, path in layers:
            parts = path.split(".")
            at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
            if at is None or (blocks_path is not None and ".".join(parts[:at]) != blocks_path):
                return False
            blocks_path = ".".join(parts[:at])
            found[id(layer)] = int(parts[at])
        if not found or len(set(found.values())) != len(found):
            return False
        blocks: Any = model
        for part in blocks_path.split(".") if blocks_path else ():
            blocks = blocks[part] if isinstance(blocks, dict) else getattr(blocks, part)
        if not isinstance(blocks, list) or not all(isinstance(b, nn.Module) for b in blocks):
            return False
        self.layers = [layer for layer, _ in layers]
        self._block_of = found
        # Each block's class becomes a subclass whose call asks this controller first (as
        # row_batch.py does for its attention); the controller and the block's index are
        # plain attributes, outside the module's parameters.
        for i, module in enumerate([*blocks, model]):
            object.__setattr__(module, "_optimistic", self)
            object.__setattr__(module, "_optimistic_block", i if module is not model else None)
            module.__class__ = _checking_class(type(module))
        return True

    def force(self, on: bool | None) -> None:
        """Run every decode forward that can optimistically (True), none (False), or as
        the miss rule says (None)."""
        self.forced = on

    @property
    def active(self) -> bool:
        """Whether a forward is running optimistically now (what the blocks ask)."""
        return self._now is not None and self._now.optimistic

    def takes(self, layer: StreamingMoE) -> bool:
        """Whether `layer` runs on its device lookup in this forward (else the per-layer path)."""
        now = self._now
        return now is not None and now.optimistic and id(layer) not in now.synced

    def _worth_it(self) -> bool:
        if not self.probed or self.why_not is not None:
            return False
        if self.hub.recorder.active:
            return False  # diagnostics time each layer's segments around its own sync
        if self.forced is not None:
            return self.forced
        partial = sum(1 for layer in self.layers if not layer.pool.fully_resident)
        if partial == 0:
            return False
        return self.miss_mean < math.ceil(partial / CHECK_EVERY) / 2

    def applies(self, inputs: mx.array, cache: Any) -> bool:
        """Whether a forward is a decode step (alone, or a batch step's one token per
        request) over rewindable caches (then `forward` runs it, optimistically where
        the miss rule says so)."""
        if self._now is not None or inputs.ndim < 1 or inputs.shape[-1] != 1 or not isinstance(cache, list):
            return False
        return all(type(leaf) in REWINDABLE for c in cache for leaf in _leaves(c))

    def missed(self) -> None:
        """A layer of the current decode forward missed on the per-layer path."""
        if self._now is not None:
            self._now.misses += 1

    def forward(self, cache: list[Any], run: Callable[[], Any]) -> Any:
        """Run a decode forward (`run`, over `cache`): optimistically, again from the block
        of each miss its checks find, or on the per-layer path; its misses go into the
        rule's mean."""
        self._now = now = _Forward(optimistic=self._worth_it())
        try:
            if not now.optimistic:
                out = run()
                self.probed = True
            else:
                self.forwards += 1
                now.start = _snapshot([leaf for c in cache for leaf in _leaves(c)])
                while True:
                    try:
                        out = run()
                        if now.pending:
                            mx.async_eval(out)
                            self.check(mx.eval)
                        break
                    except RouteMiss as miss:
                        self._rewind(now, miss.layer)
            self.miss_mean += MISS_WEIGHT * (now.misses - self.miss_mean)
            return out
        finally:
            self._now = None

    def ran(self, layer: StreamingMoE, least: mx.array, indices: mx.array, sync: Callable[..., None]) -> None:
        """`layer` ran on its device lookup; every CHECK_EVERY of them, a check by `sync`
        (the layer's, which its host clock times)."""
        now = self._now
        assert now is not None
        now.pending.append(_Ran(layer, least, indices))
        if len(now.pending) >= CHECK_EVERY:
            self.check(sync)

    def settle(self, sync: Callable[..., None]) -> None:
        """Check the pending layers now (a layer below is about to read its ids back)."""
        if self._now is not None and self._now.pending:
            self.check(sync)

    def check(self, sync: Callable[..., None]) -> None:
        """One sync on the pending layers' least slots: each that ran on its own experts
        is accounted (in order), and the first that did not raises `RouteMiss`."""
        now = self._now
        assert now is not None
        pending, now.pending = now.pending, []
        least = pending[0].least if len(pending) == 1 else mx.stack([p.least for p in pending])
        sync(least)
        pending[-1].layer.pool.synced()
        values = least.tolist() if len(pending) > 1 else [least.item()]
        for ran, value in zip(pending, values):
            if value < 0:
                now.misses += 1
                raise RouteMiss(ran.layer)
            ran.layer.pool.hit_on_device(ran.indices)

    def _rewind(self, now: _Forward, layer: StreamingMoE) -> None:
        """Every cache back as it was before the token (what the model's code reads and
        changes before its blocks is then as the first time), and the next run computed
        from `layer`'s block (that layer on the per-layer path); the blocks below replay."""
        self.redos += 1
        start = self._block_of[id(layer)]
        _restore(now.start)
        for block in [b for b in now.outputs if b >= start]:
            del now.outputs[block], now.after[block]
        now.replay_from = start
        now.synced.add(id(layer))

    def probe(self, index: int, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """A block's arguments in the first decode forward: why not, if they cannot be replayed."""
        if self._now is not None and not self.probed and self.why_not is None:
            for key, value in [*enumerate(args), *kwargs.items()]:
                if not _plain(value):
                    self.why_not = f"block {index} takes {key!r} as a {type(value).__name__}"
                    return

    def block(self, index: int, call: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Block `index` of a forward running optimistically: where the run starts above
        it, its caches as its earlier run left them and that run's output; else computed,
        its caches' state kept after it."""
        now = self._now
        assert now is not None
        if index < now.replay_from:
            _restore(now.after[index])
            return now.outputs[index]
        out = call(*args, **kwargs)
        now.after[index] = _snapshot(_caches_in(args, kwargs))
        now.outputs[index] = out
        return out


_CLASSES: dict[type, type] = {}


def _checking_class(cls: type) -> type:
    """`cls` with a `__call__` that goes through its model's `OptimisticDecode` (the
    controller and the block's index are plain attributes of the instance)."""
    made = _CLASSES.get(cls)
    if made is not None:
        return made
    base_call = cls.__call__

    # The base call's name, docs and signature stay visible (`inspect.signature`).
    @functools.wraps(base_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctl: OptimisticDecode = self._optimistic
        index = self._optimistic_block
        if index is None:
            inputs = args[0] if args else kwargs.get("inputs")
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            if not isinstance(inputs, mx.array) or not ctl.applies(inputs, cache):
                return base_call(self, *args, **kwargs)
            return ctl.forward(cache, lambda: base_call(self, *args, **kwargs))
        if not ctl.active:
            if not ctl.probed:
                ctl.probe(index, args, kwargs)
            return base_call(self, *args, **kwargs)
        return ctl.block(index, lambda *a, **k: base_call(self, *a, **k), args, kwargs)

    made = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    _CLASSES[cls] = made
    return made
