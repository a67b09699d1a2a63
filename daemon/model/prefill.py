"""Layer-major prefill: a prompt's chunks go through the model one layer at a time.

Stock mlx-lm prefills chunk by chunk: `prefill_step_size` tokens through every layer,
then the next chunk. With a partial pool that brings each layer's routed experts in once
per chunk, so an 8k prompt reads the experts four times. Here every chunk goes through
layer 0, then every chunk through layer 1, and so on; a layer whose pool lacks experts
stages them once for all its chunks (`StreamingMoE.begin_stack`): a slot pool reads the
missing ones from the store into a transient stack of the whole layer, a mapped pool
copies the layer into GPU memory, so its kernels no longer read host memory tile by tile.

Why the output is unchanged: each chunk meets each layer with exactly the inputs stock
gives it. Its hidden state comes from the layer below; the layer's cache holds the
earlier chunks (they passed this layer first, in order), as in stock; the masks are
made by the model's own code from a copy of each cache whose offset is what stock's
would be when the chunk starts (`_capture`). The expert call is mlx-lm's own, on a
stack whose row e is expert e, as in stock's stacked weights. The chunk boundaries are
stock's: the prompt but its last token in steps of `prefill_step_size`; the last token
then goes through `generate_step` as in stock.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.model.kv_buckets import continue_prompt, end_continuation, padded_continuation
from moestream.daemon.model.streaming_moe import StreamingMoE

if TYPE_CHECKING:
    from moestream.daemon.model.streaming_model import StreamingModel

# mlx-lm's `generate_step` default.
PREFILL_STEP = 2048


def chunk_sizes(prompt_tokens: int, step: int = PREFILL_STEP) -> list[int]:
    """The chunks stock `generate_step` prefills a prompt of `prompt_tokens` in: every
    token but the last, `step` at a time (the last token is its first decode step)."""
    rest = max(prompt_tokens - 1, 0)
    return [min(step, rest - start) for start in range(0, rest, step)]


@dataclass
class PrefillStats:
    """What one layer-major prefill did."""

    chunks: int = 0
    tokens: int = 0
    # Prefilled in stock's order, chunk by chunk (then only the counts and `seconds` apply).
    chunked: bool = False
    # MoE layers that staged their experts into a transient stack, and the bytes moved
    # into those stacks from the pool's own memory (slots, or a mapped pool's host memory).
    staged_layers: int = 0
    staged_bytes: int = 0
    # Bytes read from the store (or the host tier) into the stacks: the routed experts
    # the pool lacked, each once.
    read_bytes: int = 0
    # Experts whose reads started a layer ahead, while the layers below computed
    # (`StreamingMoE.read_ahead`).
    read_ahead: int = 0
    # Mapped layers whose stack was copied while the layer below computed (`stage_ahead`).
    staged_ahead: int = 0
    # Continuations padded to a shape met before (daemon/model/kv_buckets.py), and the
    # tokens of padding they computed beside `tokens`.
    padded: int = 0
    pad_tokens: int = 0
    seconds: float = 0.0
    # Building the forward of each chunk (the model's own code up to the first layer,
    # with the masks and each layer's arguments), before any layer runs.
    capture_seconds: float = 0.0
    # Where the time went, by phase of each layer (each phase ends in a wait for the
    # device or the disk, so the split needs no extra sync): staging the pool's experts
    # into the stack, the chunks' calls up to their routing (a slot pool reads each
    # chunk's routing back), reading the missing experts, computing the layer, and
    # keeping the last tokens' experts in the pool. A mapped pool's stack is copied
    # lazily, so its staging counts as compute.
    stage_seconds: float = 0.0
    route_seconds: float = 0.0
    read_seconds: float = 0.0
    compute_seconds: float = 0.0
    keep_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        return {"mode": "chunked" if fields.pop("chunked") else "layer-major", **fields}


class _Capture:
    """Stands in for decoder layer `index` while the model's own forward runs, to record
    what the model hands the layer (its input, mask, cache, ...) without running it."""

    def __init__(self, layer: nn.Module, index: int, sink: list[tuple[int, mx.array, tuple, dict]]) -> None:
        self._layer = layer
        self._index = index
        self._sink = sink

    def __getattr__(self, name: str) -> Any:
        # The model's loop may ask a layer what it is (qwen3_next's `is_linear`).
        return getattr(self._layer, name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        self._sink.append((self._index, h, args, kwargs))
        return h


def _at_offset(cache: Any, prefix: int) -> Any:
    """A shallow copy of a layer's cache that reports `prefix` more tokens than it
    holds: what the cache will hold when the chunk starting there reaches the layer.
    Only read for masks (a windowed or array mask depends on the offset)."""
    if cache is None:
        return None
    view = copy.copy(cache)
    if isinstance(getattr(cache, "offset", None), int):
        view.offset = cache.offset + prefix
    return view


class UnsupportedModel(Exception):
    """The model's forward does not have the shape the layer-major prefill drives."""


def decoder_of(model: nn.Module) -> nn.Module:
    """The module whose forward loops over the decoder layers, its list under "layers"
    (`model.layers` may be a slice of that list, as mlx-lm's pipeline models give it)."""
    if not isinstance(getattr(model, "layers", None), (list, tuple)):
        raise UnsupportedModel("the model has no list of decoder layers")
    layers = list(model.layers)
    for _, module in model.named_modules():
        held = module.get("layers") if isinstance(module, nn.Module) else None
        if isinstance(held, list) and len(held) == len(layers) and all(a is b for a, b in zip(held, layers)):
            return module
    raise UnsupportedModel("no module holds the model's decoder layers")


class LayerMajorPrefill:
    """Drives one model's prefill layer by layer (see the module docstring)."""

    def __init__(self, model: nn.Module, stage_ahead_blocks: int = 0) -> None:
        """`stage_ahead_blocks`: where above 0, a mapped pool's stack of the next stacked
        layer is copied while this layer computes, with at most that many blocks per
        expert row (Settings.mapped_stage_ahead_blocks; 0: each layer stages its own)."""
        self.model = model
        self.stage_ahead_blocks = stage_ahead_blocks
        self._decoder = decoder_of(model)  # UnsupportedModel where there is no list of layers
        self.layers: list[nn.Module] = list(model.layers)
        self._held = self._decoder["layers"]
        # The streaming layer of each decoder layer (None for a dense one).
        self.moes: list[StreamingMoE | None] = []
        for layer in self.layers:
            found = [m for m in layer.modules() if isinstance(m, StreamingMoE)]
            if len(found) > 1:
                raise UnsupportedModel("a decoder layer with more than one streaming MoE")
            self.moes.append(found[0] if found else None)

    def wanted(self, prompt_tokens: int, step: int = PREFILL_STEP) -> bool:
        """Whether this prompt gains from going layer by layer: some layer stages its
        experts (`StreamingMoE.stacks_for`)."""
        sizes = chunk_sizes(prompt_tokens, step)
        if not sizes:
            return False
        for moe in self.moes:
            if moe is None:
                continue
            if moe.stacks_for(sizes):
                return True
        return False

    def run(
        self,
        tokens: mx.array,
        cache: Sequence[Any],
        step: int = PREFILL_STEP,
        on_progress: Callable[[int], None] | None = None,
        stats: PrefillStats | None = None,
        pad: int = 0,
    ) -> PrefillStats:
        """Prefill `tokens` (1-D: the prompt but its last token) into `cache`, the
        model's prompt cache, in stock's chunks of `step` (`generate_step`'s
        `prefill_step_size`); `on_progress(tokens_done)` after each layer, in
        proportion. `pad`: the last `pad` tokens are a padded continuation's copies
        (daemon/model/kv_buckets.py), left out of the counts. Returns what it did.

        Raises `UnsupportedModel` before anything is computed or the cache changes
        where the model's forward does not call its layers as this drives them."""
        return drained(self.pieces(tokens, cache, step, on_progress, stats, pad))

    def pieces(
        self,
        tokens: mx.array,
        cache: Sequence[Any],
        step: int = PREFILL_STEP,
        on_progress: Callable[[int], None] | None = None,
        stats: PrefillStats | None = None,
        pad: int = 0,
    ) -> Generator[None, None, PrefillStats]:
        """`run`, one decoder layer per step of the generator (it yields after each;
        its value is what `run` returns): between two layers nothing of the prefill is
        in flight, so other work (a batch's decode steps) may use the pools there."""
        stats = stats if stats is not None else PrefillStats()
        tic = time.perf_counter()
        n = int(tokens.size)
        sizes = chunk_sizes(n + 1, step)
        if pad and len(sizes) != 1:
            raise ValueError("only a prompt of one chunk is padded")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        hidden: list[mx.array] = []
        calls: list[list[tuple[tuple, dict]]] = []
        for start, size in zip(starts, sizes):
            h, args = self._capture(tokens[start : start + size], cache, start)
            hidden.append(h)
            calls.append(args)
        stats.chunks += len(sizes)
        stats.tokens += n - pad
        stats.pad_tokens += pad
        clock = time.perf_counter
        stats.capture_seconds += clock() - tic
        stacked = [moe is not None and moe.stacks_for(sizes) for moe in self.moes]
        # The next stacked layer after each layer (None after the last): its reads start
        # once this layer's own are done, so the disk works while this layer computes.
        after: list[StreamingMoE | None] = [None] * len(self.layers)
        following = None
        for i in range(len(self.layers) - 1, -1, -1):
            after[i] = following
            if stacked[i]:
                following = self.moes[i]
        routes = (n - pad) * max((moe.pool.top_k for moe in self.moes if moe is not None), default=0)
        if following is not None:
            stats.read_ahead += following.read_ahead(routes)
        try:
            for i, layer in enumerate(self.layers):
                moe = self.moes[i]
                stack = stacked[i]
                t0 = clock()
                if stack:
                    stats.staged_bytes += moe.begin_stack(pad)
                    stats.staged_layers += 1
                t1 = clock()
                ran = False
                try:
                    for k in range(len(sizes)):
                        args, kwargs = calls[k][i]
                        hidden[k] = layer(hidden[k], *args, **kwargs)
                    t2 = clock()
                    if stack:
                        stats.read_bytes += moe.fill_stack()
                    nxt = after[i]
                    if stack and nxt is not None:
                        stats.read_ahead += nxt.read_ahead(routes)
                    # A mapped pool's next stack needs no routing: its copy goes into this
                    # layer's graph, beside its kernels, instead of before the next layer's.
                    ahead: list[mx.array] = []
                    # Once, where dense layers come between (the first of them copies it).
                    if nxt is not None and nxt.pool.host_memory and self.stage_ahead_blocks > 0 and not nxt.ahead:
                        ahead = nxt.stage_ahead(self.stage_ahead_blocks)
                        stats.staged_ahead += 1
                    t3 = clock()
                    for k in range(len(sizes)):
                        mx.eval(hidden[k], *(ahead if k == 0 else ()))
                    # The cache list need not follow the layers (a hybrid model keeps none for
                    # its MoE-only layers): evaluate all, of which only this layer's is new.
                    mx.eval([a for c in cache for a in _state(c)])
                    t4 = clock()
                    ran = True
                finally:
                    if stack:
                        moe.end_stack(keep=ran)
                stats.stage_seconds += t1 - t0
                stats.route_seconds += t2 - t1
                stats.read_seconds += t3 - t2
                stats.compute_seconds += t4 - t3
                stats.keep_seconds += clock() - t4
                if on_progress is not None:
                    on_progress((n - pad) * (i + 1) // len(self.layers))
                if i + 1 < len(self.layers):
                    stats.seconds += time.perf_counter() - tic
                    yield
                    tic = time.perf_counter()
        finally:
            # A prefill that stopped (an error, or a cancelled request's generator
            # closed) leaves no stack staged ahead behind.
            for moe in self.moes:
                if moe is not None:
                    moe.drop_ahead()
        stats.seconds += time.perf_counter() - tic
        return stats

    def _capture(self, chunk: mx.array, cache: Sequence[Any], prefix: int) -> tuple[mx.array, list[tuple[tuple, dict]]]:
        """Run the model's own forward on `chunk` with every decoder layer replaced by a
        `_Capture`, over cache copies at the chunk's offset: the first layer's input
        and each layer's other arguments, the copies swapped back for the real caches."""
        views = [_at_offset(c, prefix) for c in cache]
        sink: list[tuple[int, mx.array, tuple, dict]] = []
        self._decoder["layers"] = [_Capture(layer, i, sink) for i, layer in enumerate(self.layers)]
        try:
            self.model(chunk[None], cache=views)
        finally:
            self._decoder["layers"] = self._held
        if [i for i, *_ in sink] != list(range(len(self.layers))):
            raise UnsupportedModel("the model's forward does not call each decoder layer once, in order")
        real = {id(v): c for v, c in zip(views, cache) if v is not None}

        def back(a: Any) -> Any:
            return real.get(id(a), a)

        args = [(tuple(back(a) for a in a_args), {key: back(v) for key, v in kw.items()}) for _, _, a_args, kw in sink]
        return sink[0][1], args


def _state(cache: Any) -> list[Any]:
    if cache is None:
        return []
    state = cache.state
    return [a for a in (state if isinstance(state, (list, tuple)) else [state]) if a is not None]


def _ended(cache: list[Any], views: list[Any], pad: int, stats: PrefillStats | None) -> list[Any]:
    """`cache` after a layer-major prefill on `views` (the padded continuation's caches,
    or `cache` itself where `views` is it)."""
    if views is not cache:
        end_continuation(cache, views, pad)
        if stats is not None:
            stats.padded += 1
    return cache


def release_staged(sm: StreamingModel) -> None:
    """Drop what a layer-major prefill staged ahead for its next layer (a mapped pool's
    copy of the layer in GPU memory), as it does when it ends: for a prefill suspended
    between two layers, which a later `begin_stack` of that layer stages again."""
    lm = sm.layer_major
    for moe in lm.moes if lm is not None else ():
        if moe is not None:
            moe.drop_ahead()


def drained(pieces: Generator[None, None, Any]) -> Any:
    """Run a generator of pieces to its end; its return value."""
    while True:
        try:
            next(pieces)
        except StopIteration as end:
            return end.value


def prefill_cache(
    sm: StreamingModel,
    prompt: mx.array,
    step: int = PREFILL_STEP,
    on_progress: Callable[[int], None] | None = None,
    stats: PrefillStats | None = None,
    *,
    cache: list[Any] | None = None,
    layer_major: bool = True,
) -> list[Any]:
    """A prompt cache holding `prompt` (1-D), made as `generate_step` makes it before its
    last prompt token: layer by layer where the layer-major prefill wants it (and
    `layer_major`), else in stock's chunks. `on_progress(tokens_done)` as it goes. With
    `cache` (one that holds a prefix already, from the prompt cache), `prompt` goes on
    after what it holds, as `generate_step` given that cache would take it."""
    return drained(prefill_pieces(sm, prompt, step, on_progress, stats, cache=cache, layer_major=layer_major))


def prefill_pieces(
    sm: StreamingModel,
    prompt: mx.array,
    step: int = PREFILL_STEP,
    on_progress: Callable[[int], None] | None = None,
    stats: PrefillStats | None = None,
    *,
    cache: list[Any] | None = None,
    layer_major: bool = True,
) -> Generator[None, None, list[Any]]:
    """`prefill_cache` in pieces: the generator yields after each decoder layer of a
    layer-major prefill, or after each of stock's chunks, and its value is the cache.
    Each piece runs on mlx-lm's generation stream; between pieces the caller's work runs
    on its own (a batch decodes its other requests there, so that a long prompt holds
    them back for one piece at a time)."""
    cache = make_prompt_cache(sm.model) if cache is None else cache
    n = int(prompt.size)
    if n == 0:
        return cache
    lm = sm.layer_major if layer_major else None
    if lm is not None and lm.wanted(n + 1, step):
        # A continuation from the prompt cache runs padded where the chunked path below
        # pads it, so that a chat's turns meet the shapes met before (kv_buckets.py).
        padded = padded_continuation(prompt, cache, sm.continuation_bucket)
        if padded is not None and len(chunk_sizes(int(padded[0].size) + 1, step)) != 1:
            padded = None
        fed, views, pad = padded if padded is not None else (prompt, cache, 0)
        layers = lm.pieces(fed, views, step, on_progress=on_progress, stats=stats, pad=pad)
        try:
            with mx.stream(generation_stream):
                next(layers)
        except UnsupportedModel:
            pass  # refused before anything ran: stock's chunks below
        except StopIteration:
            return _ended(cache, views, pad, stats)
        else:
            while True:
                yield
                try:
                    with mx.stream(generation_stream):
                        next(layers)
                except StopIteration:
                    return _ended(cache, views, pad, stats)
    for start in range(0, n, step):
        if start:
            yield
        tic = time.perf_counter()
        with mx.stream(generation_stream):
            continue_prompt(sm.model, prompt[start : start + step], cache, sm.continuation_bucket)
            mx.eval([c.state for c in cache])
        if stats is not None:
            stats.chunked = True
            stats.chunks += 1
            stats.tokens += min(step, n - start)
            stats.seconds += time.perf_counter() - tic
        if on_progress is not None:
            on_progress(min(start + step, n))
    return cache
