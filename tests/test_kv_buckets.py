"""Bucketed attention caches (daemon/model/kv_buckets.py): padded keys and their mask give the
attention of the unpadded ones; the key length of short multi-token forwards moves only
at bucket boundaries; decode steps and long prefills keep mlx-lm's own path. A padded
continuation after a cached prefix leaves the cache and the next tokens as stock's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from tiny_models import build_tiny_model

from moestream.daemon.model.kv_buckets import BucketedKVCache, bucketed, continue_prompt, query_bucket

HEADS, DIM = 2, 16


def _step(cache, n: int, key: int) -> tuple[mx.array, int]:
    """One attention forward of n queries through `cache`: (output, key length seen)."""
    r = mx.random.split(mx.random.key(key), 3)
    q, k, v = (mx.random.normal((1, HEADS, n, DIM), key=r[i]) for i in range(3))
    mask = create_attention_mask(mx.zeros((1, n, DIM)), cache)
    keys, values = cache.update_and_fetch(k, v)
    return scaled_dot_product_attention(q, keys, values, cache, scale=DIM**-0.5, mask=mask), keys.shape[2]


def test_padded_attention_equals_stock_and_moves_in_buckets():
    stock, padded = KVCache(), BucketedKVCache(bucket=16, max_query=8)
    lengths, stock_lengths = [], []
    # Prefill beyond max_query, verifies of 4, trims (rejected drafts), decode steps.
    for i, (n, trim) in enumerate([(20, 0), (4, 2), (4, 0), (1, 0), (4, 3), (1, 0), (3, 0), (4, 1)] * 3):
        want, stock_len = _step(stock, n, i)
        got, padded_len = _step(padded, n, i)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
        assert stock.offset == padded.offset == stock_len
        if 1 < n <= 8:
            assert padded_len % 16 == 0 and padded_len >= stock_len
            lengths.append(padded_len)
            stock_lengths.append(stock_len)
        else:  # decode steps and long forwards: exactly mlx-lm's shapes
            assert padded_len == stock_len
        stock.trim(trim)
        padded.trim(trim)
    # 15 short forwards at 15 key lengths, over 6 buckets: 6 shapes.
    assert len(set(stock_lengths)) == 15
    assert len(set(lengths)) == len({-(-n // 16) for n in stock_lengths}) == 6


def test_bucketed_swaps_only_plain_caches_of_empty_lists():
    caches = bucketed([KVCache(), ArraysCache(2), KVCache()], 32)
    assert [type(c) for c in caches] == [BucketedKVCache, ArraysCache, BucketedKVCache]
    assert caches[0].bucket == 32
    # A sliding-window cache builds its own mask: the list is left as it is.
    mixed = [KVCache(), RotatingKVCache(max_size=8)]
    assert bucketed(mixed, 32) is mixed
    plain = [KVCache()]
    assert bucketed(plain, 0) is plain
    used = KVCache()
    used.update_and_fetch(mx.zeros((1, HEADS, 3, DIM)), mx.zeros((1, HEADS, 3, DIM)))
    with pytest.raises(ValueError, match="empty"):
        bucketed([used], 32)
    with pytest.raises(ValueError, match="bucket"):
        BucketedKVCache(0)


def _greedy(model, cache, token: int, steps: int) -> tuple[list[int], mx.array]:
    """`steps` greedy tokens after `token` on `cache`, and the first step's logits."""
    out, first = [], None
    for _ in range(steps):
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        first = logits if first is None else first
        token = int(mx.argmax(logits))
        out.append(token)
    return out, first


def _recording(monkeypatch, seen: list[tuple[int, ...]]) -> None:
    """Record the shape of the keys every padded attention forward sees."""
    fetch = BucketedKVCache.update_and_fetch

    def spy(self, keys, values):
        got = fetch(self, keys, values)
        seen.append(tuple(got[0].shape))
        return got

    monkeypatch.setattr(BucketedKVCache, "update_and_fetch", spy)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_padded_continuation_leaves_stock_cache_and_tokens(arch):
    model, config = build_tiny_model(arch, seed=3)
    vocab = config["vocab_size"]
    prefix = mx.array([i * 37 % vocab for i in range(29)])
    for n in (2, 5, 16, 23):
        turn = mx.array([(i * 11 + n) % vocab for i in range(n)])
        stock, padded = make_prompt_cache(model), make_prompt_cache(model)
        model(prefix[None], cache=stock)
        model(prefix[None], cache=padded)
        model(turn[None], cache=stock)
        assert continue_prompt(model, turn, padded, key_bucket=16, smallest=4)
        for a, b in zip(stock, padded):
            assert a.offset == b.offset == 29 + n
            np.testing.assert_allclose(np.array(b.keys[..., : b.offset, :]), np.array(a.keys[..., : a.offset, :]),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
            # The buffer is exactly the padded key length: its strides are part of the shape too.
            assert b.keys.shape[2] % 16 == 0 and b.keys.shape[2] >= 29 + query_bucket(n, 4)
        want, want_logits = _greedy(model, stock, int(turn[-1]), 6)
        got, got_logits = _greedy(model, padded, int(turn[-1]), 6)
        np.testing.assert_allclose(np.array(got_logits), np.array(want_logits), rtol=1e-4, atol=1e-4)
        assert got == want


def test_continuations_meet_few_shapes_and_others_keep_stock_path(monkeypatch):
    model, config = build_tiny_model("qwen3_moe", seed=5)
    cache, seen = make_prompt_cache(model), []
    model(mx.array([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
    _recording(monkeypatch, seen)
    # Turns of 9..15 tokens: 7 query lengths at 7 key lengths, padded to 16 queries and
    # two key lengths (offsets 16..91 plus 16).
    for n in range(9, 16):
        assert continue_prompt(model, mx.array([n] * n), cache, key_bucket=64, smallest=16)
        assert cache[0].offset == 7 + sum(range(9, n + 1))
    assert {s[2] for s in seen} == {64, 128}
    assert len(seen) == 7 * len(cache)
    assert [query_bucket(n, 16) for n in (2, 16, 17, 33, 64, 65, 256)] == [16, 16, 32, 64, 64, 128, 256]
    assert [query_bucket(n) for n in (2, 64, 65)] == [64, 64, 128]
    # No bucket (the CPU's default), one token, an empty cache, a long forward: stock's call.
    fresh = make_prompt_cache(model)
    assert not continue_prompt(model, mx.array([1, 2, 3]), fresh, key_bucket=64)
    assert not continue_prompt(model, mx.array([4, 5]), cache, key_bucket=0)
    assert not continue_prompt(model, mx.array([4]), cache, key_bucket=64)
    assert not continue_prompt(model, mx.array([4] * 300), cache, key_bucket=64)
    # Linear-attention layers cannot be trimmed of the padding.
    linear, _ = build_tiny_model("qwen3_next", seed=5)
    lc = make_prompt_cache(linear)
    linear(mx.array([[1, 2, 3]]), cache=lc)
    assert not continue_prompt(linear, mx.array([4, 5, 6]), lc, key_bucket=64)
