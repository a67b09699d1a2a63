"""The host-RAM tier (daemon/pool/host_tier.py) under a partial pool and the prefetcher."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from pool_store import run_tokens

from moestream._native import HostBuffer, copy_spans
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def varied_store(tmp_path_factory):
    """A small random qwen3_moe whose routing changes from token to token as a real
    model's does (scaled embeddings, see make_random_moe.py), so that a partial pool
    keeps missing and the prefetcher reads."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    from make_random_moe import make_random_moe

    root = tmp_path_factory.mktemp("varied")
    convert_model(make_random_moe(root / "model", "mini", seed=2, embed_scale=64), root / "store")
    return root / "store"


def test_host_tier_reads_each_expert_from_disk_at_most_once(varied_store):
    """A tier that holds every expert: the pool (a quarter of the experts) keeps
    missing, but after the first pass nothing more comes from the disk, whether the
    pool or the prefetcher read it."""
    store = varied_store
    manifest = load_manifest(store)
    experts = sum(layer.num_experts for layer in manifest.layers)
    sm = load_streaming_model(store, Settings(capacity=0.25, host_cache=64 << 20, prefetch="on"))
    try:
        run_tokens(sm)
        first = sm.pool_stats().admission
        first_prefetch = sm.prefetcher.stats()
        run_tokens(sm)
        second = sm.pool_stats().admission
        assert second["bytes_to_pool"] > first["bytes_to_pool"], "the pool kept missing"
        assert second["bytes_from_disk"] == first["bytes_from_disk"]
        # Experts the prefetcher read went into the tier as well: none is read again.
        assert first_prefetch["bytes_read"] > 0
        assert sm.prefetcher.stats()["bytes_read"] == first_prefetch["bytes_read"]
        assert second["tier_misses"] == first["tier_misses"] <= experts
        assert second["tier_evictions"] == 0
    finally:
        sm.close()


def test_copy_spans_copies_host_buffers_and_refuses_a_bad_span_before_copying():
    # The host-to-host copy every promotion, tier copy and scratch fill goes through.
    src = np.arange(64, dtype=np.uint8)
    dst = mx.zeros((2, 32), dtype=mx.uint8)
    mx.eval(dst)
    buf = HostBuffer(4096)
    copy_spans([(dst, 0, src, 8, 4), (dst, 32, src, 60, 4), (buf, 100, src, 0, 2)])
    got = np.array(dst).ravel()
    assert got[:4].tolist() == [8, 9, 10, 11] and got[32:36].tolist() == [60, 61, 62, 63]
    assert got[4:32].sum() == 0 and got[36:].sum() == 0
    assert bytes(memoryview(buf).cast("B")[100:102]) == b"\x00\x01"
    with pytest.raises(ValueError, match=r"span 1: out of bounds"):
        copy_spans([(dst, 4, src, 0, 4), (dst, 62, src, 0, 4)])
    assert np.array(dst).ravel()[4:8].sum() == 0  # the good span before it was not copied either
    with pytest.raises(BufferError, match="not writable"):
        copy_spans([(bytes(8), 0, src, 0, 4)])
