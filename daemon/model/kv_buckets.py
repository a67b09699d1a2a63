"""Attention caches whose key length moves in buckets for short multi-token forwards.

Why: on MLX's CUDA backend, `mx.fast.scaled_dot_product_attention` with more than one
query costs about 40 ms the first time it meets a key length, against 0.2-0.4 ms again
(tests/bench/results/probes/shape_probe_h200.json: a cuDNN graph is built per shape). A
speculative verify forwards K+1 tokens, and the MTP head the tokens it accepted, each
round at a key length never seen before, so every round paid that: speculation ran at a
tenth of plain decode's speed. Padding the keys up to a multiple of `bucket`, with an
explicit mask that hides the padding, keeps the shape fixed for `bucket` tokens.

Only forwards of 2..`max_query` tokens are padded: a decode step (one query) and a long
prefill keep mlx-lm's own path, so plain decode is exactly stock mlx-lm's. Padded keys
are zeros or entries of trimmed (rejected) tokens; the mask gives them weight zero.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

# Key lengths grow in steps of this many tokens; one shape is built per step.
CUDA_KEY_BUCKET = 256
# The longest forward that is padded: a verify (K+1 <= 9) and the MTP head's catch-up on
# a plain block of the fallback probe, well above both.
MAX_PADDED_QUERY = 64


def default_key_bucket() -> int:
    """The bucket where per-shape costs were measured (CUDA), else 0 (no padding)."""
    return CUDA_KEY_BUCKET if mx.default_device() == mx.gpu and mx.cuda.is_available() else 0


class BucketedKVCache(KVCache):
    """mlx-lm's KVCache, returning keys padded to a multiple of `bucket` (and the mask
    that matches them) for forwards of 2..`max_query` tokens."""

    def __init__(
        self, bucket: int, max_query: int = MAX_PADDED_QUERY, state: tuple[mx.array, mx.array, int] | None = None
    ) -> None:
        """`state`: (keys, values, offset) to start from, as mlx-lm's `KVCache.state`."""
        if bucket < 1:
            raise ValueError(f"bucket must be >= 1, not {bucket}")
        super().__init__()
        self.bucket = bucket
        self.max_query = max_query
        if state is not None:
            self.keys, self.values, self.offset = state

    def _pads(self, n: int) -> bool:
        return 1 < n <= self.max_query

    def _padded(self, end: int) -> int:
        return -(-end // self.bucket) * self.bucket

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if window_size is not None or not self._pads(n):
            return super().make_mask(n, return_array=return_array, window_size=window_size)
        # Called before the forward's keys are added: they will span [offset, offset + n).
        end = self.offset + n
        return mx.arange(self.offset, end)[:, None] >= mx.arange(self._padded(end))[None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = super().update_and_fetch(keys, values)
        if not self._pads(keys.shape[2]):
            return k, v
        padded = self._padded(self.offset)
        short = padded - self.keys.shape[2]
        if short > 0:  # the buffer grows in steps of its own, which need not line up
            b, h, _, dk = self.keys.shape
            self.keys = mx.concatenate([self.keys, mx.zeros((b, h, short, dk), self.keys.dtype)], axis=2)
            self.values = mx.concatenate(
                [self.values, mx.zeros((b, h, short, self.values.shape[3]), self.values.dtype)], axis=2
            )
        return self.keys[..., :padded, :], self.values[..., :padded, :]


def bucketed(caches: list[Any], bucket: int) -> list[Any]:
    """`caches` (fresh, from `make_prompt_cache`) with every KVCache bucketed, when that is
    all the attention caches there are; else unchanged (a sliding-window or quantized
    cache builds its own mask, which would not match padded keys)."""
    if not bucket or not all(type(c) is KVCache or isinstance(c, ArraysCache) for c in caches):
        return caches
    if any(type(c) is KVCache and not c.empty() for c in caches):
        raise ValueError("only an empty cache can be bucketed")
    return [BucketedKVCache(bucket) if type(c) is KVCache else c for c in caches]


# A prompt that goes on after a cached prefix (a chat's next turn from the prompt cache)
# is a forward of a few dozen tokens at a key length never seen before, and of a query
# length never seen before either: on CUDA each such forward builds a cuDNN graph (25-90
# ms, as long as the forward itself; tests/bench/results/probes/continuation_probe_h200.json).
# Such continuations of up to MAX_PADDED_CONTINUATION tokens are padded (copies of their
# last token, trimmed from the cache after the forward) to a power of two of at least
# MIN_QUERY_BUCKET tokens, their keys to a multiple of CONTINUATION_KEY_BUCKET, so that
# the turns of a chat meet few shapes: a user's message of up to 64 tokens is one, and
# the keys move to a new bucket once per 1024 tokens of history. A forward of up to a few
# dozen tokens takes its layers' latency, so the padded tokens cost little (a turn of 31
# tokens took 52 ms padded to 32 and 75 ms padded to 64 on the H200), and attention over
# up to 1023 padded keys is small beside a layer; the price is up to that many tokens'
# worth of unused cache buffer.
MAX_PADDED_CONTINUATION = 256
MIN_QUERY_BUCKET = 64
CONTINUATION_KEY_BUCKET = 1024


def default_continuation_bucket() -> int:
    """CONTINUATION_KEY_BUCKET where graphs are built per shape (CUDA), else 0 (stock's path)."""
    return CONTINUATION_KEY_BUCKET if default_key_bucket() else 0


def query_bucket(n: int, smallest: int = MIN_QUERY_BUCKET) -> int:
    """The padded length of a continuation of `n` tokens: the power of two >= n, at least `smallest`."""
    return max(smallest, 1 << (n - 1).bit_length())


def padded_continuation(
    tokens: mx.array, cache: list[Any], key_bucket: int, smallest: int = MIN_QUERY_BUCKET
) -> tuple[mx.array, list[BucketedKVCache], int] | None:
    """Where a continuation of `tokens` (1-D) on `cache` runs padded (see above; with
    `key_bucket`, 2 to MAX_PADDED_CONTINUATION tokens on plain attention caches that hold
    a prefix): the tokens to forward, the caches to forward them on and the pad, for
    `end_continuation` after the forward; else None (stock's forward)."""
    n = int(tokens.size)
    plain = all(type(c) is KVCache and not c.empty() for c in cache)
    if not key_bucket or not plain or not 1 < n <= MAX_PADDED_CONTINUATION:
        return None
    pad = query_bucket(n, smallest) - n
    fed = mx.concatenate([tokens, mx.repeat(tokens[-1:], pad)]) if pad else tokens
    return fed, [_adopt(c, key_bucket, n + pad) for c in cache], pad


def end_continuation(cache: list[Any], views: list[BucketedKVCache], pad: int) -> None:
    """After a padded forward on `views`: `cache` holds exactly the tokens (the pad
    trimmed), as plain KVCaches in place of the ones given, in the same list."""
    for i, view in enumerate(views):
        view.trim(pad)
        cache[i] = KVCache.from_state((view.keys, view.values, view.offset))


def continue_prompt(
    model: Any, tokens: mx.array, cache: list[Any], key_bucket: int, smallest: int = MIN_QUERY_BUCKET
) -> bool:
    """Forward `tokens` (1-D) on `cache` as `model(tokens[None], cache=cache)` does, the
    outputs dropped (a prefill's chunk). With `key_bucket`, a continuation of 2 to
    MAX_PADDED_CONTINUATION tokens on plain attention caches that hold a prefix runs
    padded in both lengths (see above): the tokens' own keys, values and hidden states
    are those of the unpadded forward (the padding comes after them, and the causal mask
    hides it from them), and the cache ends holding exactly the tokens (its entries are
    then plain KVCaches in place of the ones given, in the same list). Whether it padded."""
    padded = padded_continuation(tokens, cache, key_bucket, smallest)
    if padded is None:
        model(tokens[None], cache=cache)
        return False
    fed, views, pad = padded
    model(fed[None], cache=views)
    end_continuation(cache, views, pad)
    return True


def _adopt(cache: KVCache, bucket: int, n: int) -> BucketedKVCache:
    """A bucketed cache over `cache`'s entries, for one forward of `n` tokens, its
    buffer exactly the padded key length: the strides of the keys are part of the cuDNN
    graph's shape too, and a cache restored from the prompt cache has a buffer of any size."""
    o = cache.offset
    end = -(-(o + n) // bucket) * bucket
    keys, values = cache.keys, cache.values
    if keys.shape[2] != end:
        b, h, _, dk = keys.shape
        keys = mx.concatenate([keys[..., :o, :], mx.zeros((b, h, end - o, dk), keys.dtype)], axis=2)
        values = mx.concatenate([values[..., :o, :], mx.zeros((b, h, end - o, values.shape[3]), values.dtype)], axis=2)
    return BucketedKVCache(bucket, max_query=n, state=(keys, values, o))
