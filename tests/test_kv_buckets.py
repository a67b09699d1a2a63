"""Bucketed attention caches (daemon/model/kv_buckets.py): padded keys and their mask give the
attention of the unpadded ones; the key length of short multi-token forwards moves only
at bucket boundaries; decode steps and long prefills keep mlx-lm's own path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from moestream.daemon.model.kv_buckets import BucketedKVCache, bucketed

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
