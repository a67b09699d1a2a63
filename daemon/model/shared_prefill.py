"""Prefills that requests share, and prefills kept when no request waits on them.

Why: a coding agent sends prompts of 25-35k tokens, which a partial pool takes minutes to
prefill; it gives up after a few minutes without a byte and sends the same request
again. Two things keep the work done for it: a request whose prompt (but its last token)
is being prefilled for another request waits on that prefill instead of starting its own,
and then decodes on a copy of its cache; and a prefill whose requests have all gone
(cancelled, disconnected, the daemon stopping) stops at the end of its piece (a layer of
the layer-major order, a chunk of stock's) and stays, suspended, in the prompt cache
(within its bytes and entries): the same prompt sent again takes it up where it stopped.
And a long prefill leaves checkpoints: a copy of its cache in the prompt cache every
CHECKPOINT_TOKENS (written to its folder too, when idle or at a stop), so that a prompt
cut and then sent again after a restart, or another that starts the same way, begins from
the last one.

How: a prefill is a generator of pieces (daemon/model/prefill.py `prefill_pieces`), driven
one piece per step by whichever of its requests the engine steps; between two pieces its
state (the cache, the layer-major order's hidden states) is its own, so it may wait there
for any time while other requests use the pools. It runs in segments of whole chunks,
CHECKPOINT_TOKENS at most, each prefilled as a prompt of its own on the cache so far, the
checkpoint taken at each segment's end: the layer-major order stages each layer's
experts once per segment, not once per prompt (at most every 4096 tokens, for a
checkpoint at most that much work away).

Why the output is unchanged: the pools serve each forward exactly whatever they hold, so
a prefill driven by several requests, or suspended and taken up later, computes what it
computes in one go; a request that joins one gets the cache its own prefill would have
made, since the key is the prompt but its last token, the prefill order and the chunk
size, and the prefix it started from is the prompt cache's when it started (what a
request arriving alone then would have fetched). The segments end on the chunks'
boundaries, so each chunk meets the same cache as in one prefill; a request that starts
from a checkpoint prefills the chunks after it, as they were.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Generator, Hashable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from .prefill import PrefillStats, prefill_pieces, release_staged
from .prompt_cache import cache_nbytes

if TYPE_CHECKING:
    from .prompt_cache import PromptCache
    from .streaming_model import StreamingModel

# A prefill of at least this many tokens leaves a copy of its cache in the prompt cache
# when it ends (as one whose cache cannot be trimmed always does): the same prompt
# arriving too late to join it (its prompt checked after the last piece, or during the
# decode) starts from there instead of prefilling it all again.
KEEP_AFTER_TOKENS = 4096
# The most prompt tokens a prefill computes between two checkpoints (or fewer: whole
# chunks of it; one chunk where the chunk is longer).
CHECKPOINT_TOKENS = 4096


def segment_tokens(step: int) -> int:
    """A segment's tokens (but the last one's): the most whole chunks of `step` within
    CHECKPOINT_TOKENS, one at least."""
    return step * max(1, CHECKPOINT_TOKENS // step)


def prefill_key(prompt_ids: Sequence[int], layer_major: bool, step: int, scope: str = "") -> tuple[Hashable, ...]:
    """What two requests' prefills must share to be one: the prompt but its last token,
    the order, the chunk size and the prompt cache's scope (joining another client's
    prefill would tell it what that client sent)."""
    return (tuple(int(t) for t in prompt_ids[:-1]), layer_major, step, scope)


class SharedPrefill:
    """One prompt's prefill (all of it but its last token), in pieces, for every request
    that waits on it."""

    def __init__(
        self,
        sm: StreamingModel,
        prompt_cache: PromptCache,
        key: tuple[Hashable, ...],
        prompt_ids: Sequence[int],
        cache: list[Any],
        start: int,
        step: int,
        layer_major: bool,
        stats: PrefillStats,
        scope: str = "",
    ) -> None:
        """`cache` holds the prompt's first `start` tokens (from the prompt cache, or none);
        its checkpoints go to the prompt cache's `scope`."""
        self.sm = sm
        self.key = key
        self.scope = scope
        self.prompt_ids = list(prompt_ids)
        self.start = start
        self.stats = stats
        self._prompt_cache = prompt_cache
        self._cache = cache
        n = len(self.prompt_ids)
        # Prompt tokens in the cache so far (a layer-major prefill's in proportion to its layers).
        self.done = start
        # Requests waiting on it, and those of them that have not taken their cache yet.
        self.waiting = 0
        self.result: list[Any] | None = None
        # What ended it, where a piece raised.
        self.error: Exception | None = None
        self._segment = segment_tokens(step)
        self._pieces: Generator[None, None, list[Any]] | None = self._segments(step, layer_major)
        # The hidden states a layer-major prefill holds between its layers (float32 at most).
        hidden = int(sm.manifest.config.get("text_config", sm.manifest.config).get("hidden_size", 0))
        self._hidden_bytes = 4 * hidden * min(max(n - 1 - start, 0), self._segment) if layer_major else 0

    def _segments(self, step: int, layer_major: bool) -> Generator[None, None, list[Any]]:
        """The prefill's pieces, segment by segment, a checkpoint between two."""
        cache, end = self._cache, len(self.prompt_ids) - 1
        begin = self.start
        while True:
            stop = min(begin + self._segment, end)
            cache = yield from prefill_pieces(
                self.sm,
                mx.array(self.prompt_ids[begin:stop]),
                step,
                on_progress=lambda done, at=begin: self._progress(at + done),
                stats=self.stats,
                cache=cache,
                layer_major=layer_major,
            )
            self._cache = cache
            if stop == end:
                return cache
            # A checkpoint: the prompt cache keeps its own copy; the prefill goes on in this cache.
            self._prompt_cache.insert(self.prompt_ids[:stop], cache, persist=True, scope=self.scope)
            begin = stop
            yield

    def _progress(self, done: int) -> None:
        self.done = done

    @property
    def finished(self) -> bool:
        return self.result is not None

    def advance(self) -> None:
        """Run its next piece (the last one sets `result`). A piece that raises (an
        expert the store cannot read) ends the prefill: every request on it fails with
        that error, and it is never suspended, since its work cannot go on."""
        if self.error is not None:
            raise self.error
        assert self._pieces is not None and self.result is None
        try:
            next(self._pieces)
        except StopIteration as end:
            self.result = end.value
            self._pieces = None
            self.done = len(self.prompt_ids) - 1
            self._prompt_cache.prefill_ended(self)
            computed = self.done - self.start
            if computed >= KEEP_AFTER_TOKENS or (computed > 0 and not can_trim_prompt_cache(self.result)):
                # A snapshot at the prompt's boundary, which an untrimmable cache could
                # not be trimmed back to later.
                self._prompt_cache.insert(self.prompt_ids[:-1], self.result, scope=self.scope)
        except Exception as e:
            self.error, self._pieces = e, None
            self._prompt_cache.prefill_ended(self)
            raise

    def join(self) -> None:
        self.waiting += 1

    def leave(self) -> bool:
        """A waiting request goes; whether it was the last and the prefill is unfinished
        (then it is to be suspended)."""
        self.waiting -= 1
        return not self.finished and self.error is None and self.waiting == 0

    def take(self) -> list[Any]:
        """The finished cache for one waiting request: the last to take it gets it, the
        others a copy of it."""
        assert self.result is not None
        return self.result if self.waiting <= 1 else copy.deepcopy(self.result)

    def held_bytes(self) -> int:
        """What it holds while suspended: its cache and, in the layer-major order, the hidden states."""
        return cache_nbytes(self._cache) + self._hidden_bytes

    def suspend(self) -> None:
        """No request waits on it any more: it stops between two pieces. What a mapped
        pool's layer-major prefill staged for its next layer goes (taken up again, that
        layer stages its own)."""
        release_staged(self.sm)

    def close(self) -> None:
        """Drop its work (evicted, or the prompt cache closes)."""
        if self._pieces is not None:
            self._pieces.close()
            self._pieces = None
