"""Layer-major prefill: a prompt's chunks go through the model one layer at a time.

Stock mlx-lm prefills chunk by chunk: `prefill_step_size` tokens through every layer,
then the next chunk. With a partial pool that brings each layer's routed experts in once
per chunk, so an 8k prompt reads the experts four times. Here every chunk goes through
layer 0, then every chunk through layer 1, and so on; a layer whose pool lacks experts
stages them once for all its chunks (`StreamingMoE.begin_stack`): a slot pool reads the
missing ones from the store into a transient stack of the whole layer, a mapped pool
copies the layer into GPU memory, so its kernels no longer read host memory tile by tile.

Why the output is unchanged: each chunk meets each layer with exactly the inputs stock
gives it. The model's own forward runs for every chunk, as its own coroutine (a greenlet,
`_Forward`) that stops at each decoder layer's call: the prefill runs that layer on every
chunk's call in turn and resumes each forward with what its layer returned. So whatever
the model's loop passes from layer to layer (the hidden state, hunyuan's shared KV
states, gemma4's KV of an earlier layer, deepseek_v41's streams and the dict its layers
fill, kimi_k3's residual blocks) is what its own code made of the layers' own outputs.
A chunk's cache holds the earlier chunks when the chunk reaches a layer (they passed it
first, in order), as in stock. A chunk's forward starts right after the chunk before it
went through the first layer, so the first layer's cache holds then what stock's holds;
the others lack the chunk before, and the forward's own code gets copies of them that
report stock's offset (masks depend on it), whose methods it calls are called again on
the real cache when the chunk reaches its layer (`_Early`: llama4 trims its caches). The expert call is mlx-lm's
own, on a stack whose row e is expert e, as in stock's stacked weights. The chunk
boundaries are stock's: the prompt but its last token in steps of `prefill_step_size`;
the last token then goes through `generate_step` as in stock.

Whether the prefill can drive a model is decided at load (`LayerMajorPrefill`): its
forward runs once this way over a throwaway cache with its experts idle; a model that
fails that (no list of layers, a layer called twice or out of order, a forward that
raises) is prefilled in stock's chunks, and `status` says why (`prefill.order`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from greenlet import getcurrent, greenlet
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from .kv_buckets import continue_prompt, end_continuation, padded_continuation
from .streaming_moe import StreamingMoE

if TYPE_CHECKING:
    from .streaming_model import StreamingModel

# mlx-lm's `generate_step` default.
PREFILL_STEP = 2048
# A prompt of one chunk from this many tokens goes layer by layer even where no layer
# stages: a 1,231-token prompt on a CPU took 44 s at 0% (its one chunk reported once).
LAYER_PROGRESS_TOKENS = 64


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
    # The model's own code around its layers in each chunk's forward (embeddings, masks,
    # what its loop does between two layers), which hands each layer its arguments.
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


class _Stop:
    """Stands in for decoder layer `index` while the prefill drives the model's forwards:
    a `_Forward`'s call of the layer stops that forward and hands the call to the prefill,
    which runs the layer and resumes the forward with what it returned. Called by anything
    else, it is the layer."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        self._layer = layer
        self._index = index

    def __getattr__(self, name: str) -> Any:
        # The model's loop may ask a layer what it is (qwen3_next's `is_linear`).
        return getattr(self._layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        here = getcurrent()
        if not isinstance(here, _Forward):
            return self._layer(*args, **kwargs)
        return here.parent.switch((self._index, args, kwargs))


# What a `_Forward` hands back once the model's forward has returned.
_DONE = object()


class _Forward(greenlet):
    """One chunk's forward through the model's own code (the module docstring), stopped
    at each decoder layer's call."""

    def __init__(self, model: nn.Module, tokens: mx.array, cache: Sequence[Any], offsets: list[int | None]) -> None:
        super().__init__()
        self._model = model
        self._tokens = tokens
        self._cache = cache
        self._offsets = offsets
        # The copies of the caches the forward reads (by id), behind their layers.
        self._early: dict[int, _Early] = {}
        # What the layer it called last returned (None before its first call).
        self._returned: Any = None

    def run(self, *_: Any) -> Any:
        views = []
        for c, offset in zip(self._cache, self._offsets):
            if c is None or (offset is not None and _offset(c) == offset):
                views.append(c)  # it holds what stock's holds when the chunk starts
            else:
                early = _Early(c, offset)
                self._early[id(early.view)] = early
                views.append(early.view)
        self._model(self._tokens[None], cache=views)
        return _DONE

    def _resume(self) -> Any:
        self.parent = getcurrent()
        return self.switch(self._returned)

    def call(self, index: int) -> tuple[tuple, dict]:
        """Resume the forward up to its call of layer `index`: that call's arguments, with
        the real caches for the copies."""
        got = self._resume()
        if got is _DONE or got[0] != index:
            raise UnsupportedModel("the model's forward does not call each decoder layer once, in order")
        _, args, kwargs = got
        return tuple(map(self._real, args)), {k: self._real(v) for k, v in kwargs.items()}

    def _real(self, arg: Any) -> Any:
        early = self._early.get(id(arg))
        return arg if early is None else early.catch_up()

    def returns(self, value: Any) -> None:
        """What its call of the layer returned: the forward resumes with it."""
        self._returned = value

    def finish(self) -> None:
        """Resume the forward after its last layer, to its end."""
        if self._resume() is not _DONE:
            raise UnsupportedModel("the model's forward does not call each decoder layer once, in order")

    def stop(self) -> None:
        """End a forward left stopped at a layer (a prefill that stopped early). It may
        be stopped from inside another forward (a dropped prefill's generator finalized by
        the garbage collector there): its end must come back here, not to the greenlet
        that resumed it last, which would then resume mid-layer with the wrong value."""
        if not self:
            return
        try:
            self.parent = getcurrent()
        except ValueError:  # another thread's: greenlet ends it on its own thread when freed
            return
        self.throw()


class _Chunks:
    """Every chunk's `_Forward`, taken through the layers one at a time."""

    def __init__(self, prefill: LayerMajorPrefill, tokens: mx.array, cache: Sequence[Any], sizes: list[int]) -> None:
        self._prefill = prefill
        # Each cache's offset where the first chunk starts (None where it keeps none).
        base = [_offset(c) for c in cache]
        self._forwards = []
        start = 0
        for size in sizes:
            offsets = [None if b is None else b + start for b in base]
            self._forwards.append(_Forward(prefill.model, tokens[start : start + size], cache, offsets))
            start += size
        # Seconds spent in the model's own code around its layers.
        self.seconds = 0.0
        # Whether a layer has run (on the real cache).
        self.ran = False

    def through(self, index: int, layer: nn.Module) -> list[Any]:
        """Every chunk through decoder layer `index` (`layer`), in order: each forward
        resumed up to its call of the layer, then the layer called as it asked; what the
        calls returned, which the forwards resume with at the next layer."""
        out = []
        with self._prefill.stopping():
            for forward in self._forwards:
                args, kwargs = self._resume(lambda: forward.call(index))
                self.ran = True
                out.append(layer(*args, **kwargs))
                forward.returns(out[-1])
        return out

    def finish(self) -> None:
        """Every forward to its end (what the model computes after its layers stays lazy
        and unused)."""
        with self._prefill.stopping():
            for forward in self._forwards:
                self._resume(forward.finish)

    def _resume(self, step: Callable[[], Any]) -> Any:
        tic = time.perf_counter()
        try:
            return step()
        except UnsupportedModel as e:
            if not self.ran:
                raise
            # Too late for stock's chunks: a layer changed the cache already.
            raise RuntimeError(f"layer-major prefill: {e}") from e
        finally:
            self.seconds += time.perf_counter() - tic

    def close(self) -> None:
        for forward in self._forwards:
            forward.stop()


def _offset(cache: Any) -> int | None:
    offset = getattr(cache, "offset", None) if cache is not None else None
    return offset if isinstance(offset, int) else None


class _Early:
    """A layer's cache as a chunk's forward finds it before the chunk reaches the layer,
    while the real one lacks the chunks before it (the layer has not taken them yet): a
    shallow copy (`view`) that reports the offset stock's has when the chunk starts (a
    windowed or array mask depends on it), and whose methods the forward calls (llama4's
    trims its chunked caches before its layers) are called again, with the same
    arguments, on the real cache when the chunk reaches the layer (`catch_up`): then it
    holds what stock's holds when the chunk starts, and they do to it what they do in
    stock. The layer itself gets the real cache."""

    def __init__(self, real: Any, offset: int | None) -> None:
        self.real = real
        self._calls: list[tuple[str, tuple, dict]] = []
        self._depth = 0
        view = copy.copy(real)
        if offset is not None:
            with contextlib.suppress(AttributeError):  # an offset it works out, not keeps
                view.offset = offset
        for name in dir(type(real)):
            if not name.startswith("__") and inspect.isfunction(getattr(type(real), name, None)):
                view.__dict__[name] = self._kept(name, getattr(view, name))
        self.view = view

    def _kept(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # not the calls one method makes of others
                self._calls.append((name, args, kwargs))
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1

        return call

    def catch_up(self) -> Any:
        """The real cache, once the chunk reaches its layer, with the forward's calls of
        the copy's methods made on it."""
        calls, self._calls = self._calls, []
        for name, args, kwargs in calls:
            getattr(self.real, name)(*args, **kwargs)
        return self.real


class UnsupportedModel(Exception):
    """The model's forward does not have the shape the layer-major prefill drives."""


def decoder_of(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose forward loops over the decoder layers, and the name it keeps
    their list under ("layers"; phixtral's "h"): `model.layers` may be a slice of that
    list, as mlx-lm's pipeline models give it, or a property that returns it."""
    if not isinstance(getattr(model, "layers", None), (list, tuple)):
        raise UnsupportedModel("the model has no list of decoder layers")
    layers = list(model.layers)
    for _, module in model.named_modules():
        if not isinstance(module, nn.Module):
            continue
        for key, held in module.items():
            if isinstance(held, list) and len(held) == len(layers) and all(a is b for a, b in zip(held, layers)):
                return module, key
    raise UnsupportedModel("no module holds the model's decoder layers")


class LayerMajorPrefill:
    """Drives one model's prefill layer by layer (see the module docstring)."""

    def __init__(self, model: nn.Module, stage_ahead_blocks: int = 0) -> None:
        """`stage_ahead_blocks`: where above 0, a mapped pool's stack of the next stacked
        layer is copied while this layer computes, with at most that many blocks per
        expert row (Settings.mapped_stage_ahead_blocks; 0: each layer stages its own)."""
        self.model = model
        self.stage_ahead_blocks = stage_ahead_blocks
        # UnsupportedModel where there is no list of layers.
        self._decoder, self._key = decoder_of(model)
        self.layers: list[nn.Module] = list(model.layers)
        self._held = self._decoder[self._key]
        # The streaming layer of each decoder layer (None for a dense one).
        self.moes: list[StreamingMoE | None] = []
        for layer in self.layers:
            found = [m for m in layer.modules() if isinstance(m, StreamingMoE)]
            if len(found) > 1:
                raise UnsupportedModel("a decoder layer with more than one streaming MoE")
            self.moes.append(found[0] if found else None)
        self._stops = [_Stop(layer, i) for i, layer in enumerate(self.layers)]
        self._probe()

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """The decoder's layers as `_Stop`s, for the time the forwards run (the model is
        the model again between two pieces, when other requests' steps may use it)."""
        self._decoder[self._key] = self._stops
        try:
            yield
        finally:
            self._decoder[self._key] = self._held

    def _probe(self) -> None:
        """Drive the model's forward of two chunks of two tokens layer by layer over a
        throwaway cache, its experts idle (`StreamingMoE.idle`), nothing evaluated: raises
        `UnsupportedModel` where it cannot be driven, so the choice is made at load and
        not at a user's first prompt."""
        moes = [moe for moe in self.moes if moe is not None]
        chunks = _Chunks(self, mx.zeros((4,), dtype=mx.int32), make_prompt_cache(self.model), [2, 2])
        for moe in moes:
            moe.idle(True)
        try:
            for i, layer in enumerate(self.layers):
                chunks.through(i, layer)
            chunks.finish()
        except UnsupportedModel:
            raise
        except Exception as e:
            if isinstance(e.__cause__, UnsupportedModel):  # it strayed after a layer ran
                raise e.__cause__ from None
            raise UnsupportedModel(
                f"the model's forward failed when driven layer by layer ({type(e).__name__}: {e})"
            ) from e
        finally:
            chunks.close()
            for moe in moes:
                moe.idle(False)

    def wanted(self, prompt_tokens: int, step: int = PREFILL_STEP) -> bool:
        """Whether this prompt gains from going layer by layer: some layer stages its
        experts (`StreamingMoE.stacks_for`), or it is one chunk long enough to be waited
        on, whose progress (and the engine's turns between pieces) then come per layer
        rather than once at its end; one chunk's layers compute as stock's chunk does."""
        sizes = chunk_sizes(prompt_tokens, step)
        if not sizes:
            return False
        if len(sizes) == 1 and prompt_tokens >= LAYER_PROGRESS_TOKENS:
            return True
        return any(moe is not None and moe.stacks_for(sizes) for moe in self.moes)

    def pieces(
        self,
        tokens: mx.array,
        cache: Sequence[Any],
        step: int = PREFILL_STEP,
        on_progress: Callable[[int], None] | None = None,
        stats: PrefillStats | None = None,
        pad: int = 0,
    ) -> Generator[None, None, PrefillStats]:
        """Prefill `tokens` (1-D: the prompt but its last token) into `cache`, the
        model's prompt cache, in stock's chunks of `step` (`generate_step`'s
        `prefill_step_size`); `on_progress(tokens_done)` after each layer, in
        proportion. `pad`: the last `pad` tokens are a padded continuation's copies
        (daemon/model/kv_buckets.py), left out of the counts. One decoder layer per step
        of the generator (it yields after each; its value is what it did): between two
        layers nothing of the prefill is in flight, so other work (a batch's decode
        steps) may use the pools there.

        Raises `UnsupportedModel` before anything is computed or the cache changes
        where the model's forward does not call its first layer first (the probe at
        load refused any model that does not call each layer once, in order; one that
        strays later all the same raises a RuntimeError)."""
        stats = stats if stats is not None else PrefillStats()
        tic = time.perf_counter()
        n = int(tokens.size)
        sizes = chunk_sizes(n + 1, step)
        if pad and len(sizes) != 1:
            raise ValueError("only a prompt of one chunk is padded")
        chunks = _Chunks(self, tokens, cache, sizes)
        stats.chunks += len(sizes)
        stats.tokens += n - pad
        stats.pad_tokens += pad
        clock = time.perf_counter
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
                    glue = chunks.seconds
                    out = chunks.through(i, layer)
                    glue = chunks.seconds - glue
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
                    for k, returned in enumerate(out):
                        mx.eval(returned, *(ahead if k == 0 else ()))
                    # The cache list need not follow the layers (a hybrid model keeps none for
                    # its MoE-only layers): evaluate all, of which only this layer's is new.
                    mx.eval([a for c in cache for a in _state(c)])
                    t4 = clock()
                    ran = True
                finally:
                    if stack:
                        moe.end_stack(keep=ran)
                stats.stage_seconds += t1 - t0
                # The model's own code between the layers counts as capture.
                stats.capture_seconds += glue
                stats.route_seconds += t2 - t1 - glue
                stats.read_seconds += t3 - t2
                stats.compute_seconds += t4 - t3
                stats.keep_seconds += clock() - t4
                if on_progress is not None:
                    on_progress((n - pad) * (i + 1) // len(self.layers))
                if i + 1 < len(self.layers):
                    stats.seconds += time.perf_counter() - tic
                    yield
                    tic = time.perf_counter()
            glue = chunks.seconds
            chunks.finish()
            stats.capture_seconds += chunks.seconds - glue
        finally:
            # A prefill that stopped (an error, or a cancelled request's generator
            # closed) leaves no stack staged ahead behind, and no forward stopped.
            chunks.close()
            for moe in self.moes:
                if moe is not None:
                    moe.drop_ahead()
        stats.seconds += time.perf_counter() - tic
        return stats


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
    """A prompt cache holding `prompt` (1-D), made as `generate_step` makes it before its
    last prompt token: layer by layer where the layer-major prefill wants it (and
    `layer_major`), else in stock's chunks. `on_progress(tokens_done)` as it goes. With
    `cache` (one that holds a prefix already, from the prompt cache), `prompt` goes on
    after what it holds, as `generate_step` given that cache would take it. In pieces:
    the generator yields after each decoder layer of a layer-major prefill, or after
    each of stock's chunks, and its value is the cache.
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
            while True:
                yield
                with mx.stream(generation_stream):
                    next(layers)
        except UnsupportedModel:
            # Refused before anything ran (once a layer has run, `pieces` raises a
            # RuntimeError instead): stock's chunks below.
            pass
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
