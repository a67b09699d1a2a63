"""A batch-invariant decode step: the tokens of B requests through one forward, each
request's row computed with the arithmetic its token would get alone.

Every module that keeps a cache (attention, linear attention, windows: the innermost
modules called with `cache`) runs per request, on that request's own mlx-lm cache, with
the very call a lone token makes (its projections, RoPE at its own offset, attention over
its own keys, no mask). What lies between them (embeddings, norms, the router, the
streamed experts, the LM head) runs batched: those compute each row on its own, except
that a kernel may change with the row count, so while a step runs, every dense matmul is
called on the lone token's side of its switch: a quantized one on at most ROW_LIMIT rows at
a time (CUDA's takes another kernel from 8 rows), an unquantized one on one row at a time
(CUDA's matrix-vector kernel serves one row only; from 2 rows cuBLAS's gemm sums otherwise,
as a CUDA run of tests/test_row_batch.py found on a float32 model).

So a request's logits are the same alone or in any company, whatever its companions'
lengths; on the CPU, where every kernel sums element by element, also equal to stock
mlx-lm's `generate_step` and `BatchGenerator` (tests/test_row_batch.py).

An architecture whose model-level code reads one offset from the caches (rather than
passing them down), or whose layers hand on keys of each request's own length, cannot run
this way: `RowBatch.probe` finds out on caches of its own, and the caller decodes such a
model's requests in turns instead (tests/test_row_batch.py lists them).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

# Rows a dense quantized matmul is called on at once while a step runs (CUDA's quantized
# matmul takes another kernel from 8 rows, whose sums differ from the lone token's). An
# unquantized one takes one row a call: MLX's CUDA matmul runs its matrix-vector kernel
# only where the rows are one (`can_use_gemv`), else cuBLAS's gemm.
ROW_LIMIT = 7


class RowCaches:
    """One layer's caches of the batch's requests, in batch order. It offers no offset
    and no mask: the per-request calls use each request's own."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = list(rows)

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getitem__(self, j: int) -> RowCaches:
        # A layer whose cache is a list of caches (mlx-lm's CacheList), indexed above the
        # modules that use them.
        return RowCaches([row[j] for row in self.rows])


class RowBatchUnsupported(RuntimeError):
    """The model's code cannot run a step per request (it reads one offset, say)."""


def _cached_modules(model: nn.Module) -> list[nn.Module]:
    """The innermost modules whose call takes a `cache`: those that read and write one
    layer's cache (an attention, a linear attention, an SSM mixer)."""
    takes_cache = []
    for _, module in model.named_modules():
        try:
            params = inspect.signature(type(module).__call__).parameters
        except (TypeError, ValueError):
            continue
        if "cache" in params:
            takes_cache.append(module)
    ids = {id(m) for m in takes_cache}
    return [m for m in takes_cache if not any(id(b) in ids for _, b in m.named_modules() if b is not m)]


_PER_ROW: dict[type, type] = {}
_lock = threading.Lock()


def _per_row_class(cls: type) -> type:
    """`cls` with a call that, given RowCaches, calls `cls`'s own once per request on its
    row and its cache, and joins the rows; any other cache goes straight through."""
    with _lock:
        made = _PER_ROW.get(cls)
        if made is not None:
            return made
        signature = inspect.signature(cls.__call__)

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)
            caches = bound.arguments.get("cache")
            if not isinstance(caches, RowCaches):
                return cls.__call__(self, *args, **kwargs)
            n = len(caches.rows)
            outs = []
            for i, cache in enumerate(caches.rows):
                row = dict(bound.arguments)
                row["cache"] = cache
                if "mask" in row:
                    row["mask"] = None  # a lone token's: one query sees every key it has
                for name, value in row.items():
                    # Per-row activations (the hidden states, anything else of B rows).
                    if name != "self" and isinstance(value, mx.array) and value.ndim and value.shape[0] == n:
                        row[name] = value[i : i + 1]
                outs.append(cls.__call__(**row))
            return _join(outs, cls.__name__)

        made = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        _PER_ROW[cls] = made
        return made


def _join(outs: list[Any], name: str) -> Any:
    """The rows' outputs as the batch's: arrays joined along the batch axis, tuples
    position by position (a layer that hands its keys on to the next, say)."""
    first = outs[0]
    if isinstance(first, mx.array):
        if first.ndim == 0:
            raise RowBatchUnsupported(f"{name} returns a scalar (an offset, say), one per request")
        if any(o.shape[1:] != first.shape[1:] for o in outs):
            raise RowBatchUnsupported(f"{name}'s rows differ in shape past the batch axis (a cache's length, say)")
        return mx.concatenate(outs, axis=0)
    if first is None:
        return None
    if isinstance(first, tuple):
        return tuple(_join(list(parts), name) for parts in zip(*outs))
    raise RowBatchUnsupported(f"{name} returns {type(first).__name__}, which rows cannot be joined into")


@contextlib.contextmanager
def _rows_limited() -> Iterator[None]:
    """Dense matmuls on the lone token's side of their kernel switch while the step runs:
    quantized ones (linear layers, tied quantized LM heads) on at most ROW_LIMIT rows a
    call, unquantized ones on one."""
    limits = {
        (nn.QuantizedLinear, "__call__"): ROW_LIMIT,
        (nn.QuantizedEmbedding, "as_linear"): ROW_LIMIT,
        (nn.Linear, "__call__"): 1,
        (nn.Embedding, "as_linear"): 1,
    }
    originals = {key: getattr(*key) for key in limits}

    def limited(original: Callable[..., mx.array], limit: int) -> Callable[..., mx.array]:
        def call(self: nn.Module, x: mx.array) -> mx.array:
            if x.ndim < 2 or x.shape[0] <= limit:
                return original(self, x)
            parts = [original(self, x[i : i + limit]) for i in range(0, x.shape[0], limit)]
            return mx.concatenate(parts, axis=0)

        return call

    for (cls, name), limit in limits.items():
        setattr(cls, name, limited(originals[cls, name], limit))
    try:
        yield
    finally:
        for (cls, name), original in originals.items():
            setattr(cls, name, original)


@contextlib.contextmanager
def _per_request(swaps: Sequence[tuple[nn.Module, type, type]]) -> Iterator[None]:
    """The cached modules in their per-row class while a step runs, and in their own
    after it: a lone forward (the engine's thread runs it, never during a step) pays
    nothing for the batch, where the per-row call's checks cost a 48-layer model on the
    CPU about 2% of a lone token."""
    for module, _, per_row in swaps:
        module.__class__ = per_row
    try:
        yield
    finally:
        for module, cls, _ in swaps:
            module.__class__ = cls


class RowBatch:
    """Batch-invariant decode steps of one model (prepared once: its cached modules run
    per request while a step hands them RowCaches, and as stock's otherwise)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.supported: bool | None = None  # known after the first step
        self.why_not: str | None = None
        self._swaps = [(m, type(m), _per_row_class(type(m))) for m in _cached_modules(model)]

    def probe(self) -> bool:
        """Whether this model's steps can run per request: one step of two requests on
        fresh caches of their own (a failed step leaves its caches half-fed, so the first
        is never a request's)."""
        if self.supported is None:
            fresh = [make_prompt_cache(self.model) for _ in range(2)]
            try:
                mx.eval(self.step([0, 0], fresh))
            except RowBatchUnsupported:
                pass
        return bool(self.supported)

    def step(self, tokens: Sequence[int] | mx.array, caches: Sequence[Sequence[Any]]) -> mx.array:
        """The last-position logits [B, vocab] of `tokens[b]` fed to request b, whose own
        cache (one per layer, as `make_prompt_cache` makes it) is `caches[b]`; each cache
        takes its token as it would alone. `tokens` may be an array on the device (the
        tokens a step sampled, not read back yet)."""
        if self.supported is False:
            raise RowBatchUnsupported(self.why_not or "")
        layers = len(caches[0])
        per_layer = [RowCaches([c[i] for c in caches]) for i in range(layers)]
        x = (tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.uint32))[:, None]
        try:
            with _rows_limited(), _per_request(self._swaps):
                logits = self.model(x, cache=per_layer)
        except (AttributeError, TypeError, ValueError, RowBatchUnsupported) as e:
            if self.supported is None:
                self.supported, self.why_not = False, f"{type(e).__name__}: {e}"
                raise RowBatchUnsupported(self.why_not) from e
            raise
        self.supported = True
        return logits[:, -1, :]
