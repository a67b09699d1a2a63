"""One layer's expert pool (daemon/pool/expert_pool.py): residency, pinning, its invariants,
waits before slots are written, and experts that fail to read."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from pool_store import run_tokens

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.expert_reader import ExpertReadError
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_full_capacity_needs_no_host_sync(store):
    sm = load_streaming_model(store, Settings())
    try:
        assert all(p.fully_resident for p in sm.pools)
        run_tokens(sm)
        assert sm.pool_stats().host_syncs == 0
        assert sm.pool_stats().misses_decode == 0
    finally:
        sm.close()


def test_pinned_experts_are_never_evicted(store):
    sm = load_streaming_model(store, Settings(capacity=8, policy="lru"))
    try:
        pinned = {}
        for p in sm.pools:
            hot = [0, 5, 9]
            assert p.pin(hot) == 3
            pinned[p.layer.ordinal] = {e: int(p.slot_of[e]) for e in hot}
        run_tokens(sm, n_prompt=60, steps=40)
        for p in sm.pools:
            assert p.stats.evictions > 0
            for e, slot in pinned[p.layer.ordinal].items():
                assert p.slot_of[e] == slot and p.expert_in[slot] == e
    finally:
        sm.close()


def test_pool_invariants_hold_after_a_run(store):
    sm = load_streaming_model(store, Settings(capacity=5, policy="predictive"))
    try:
        run_tokens(sm, n_prompt=50, steps=30)
        for p in sm.pools:
            resident = np.flatnonzero(p.slot_of >= 0)
            assert len(resident) <= p.capacity
            assert all(p.expert_in[p.slot_of[e]] == e for e in resident)
            assert len(set(p.slot_of[resident].tolist())) == len(resident)
    finally:
        sm.close()


def _logits_run(sm, stream=None, n_prompt=1, steps=16) -> list[np.ndarray]:
    """Greedy logits of a short decode, on `stream` (default: the default stream). A
    one-token prompt's experts fit a pool of 5 (top-4): no overflow."""
    out = []
    with mx.stream(stream if stream is not None else mx.default_stream(mx.default_device())):
        cache = make_prompt_cache(sm.model)
        logits = sm.model(mx.arange(n_prompt)[None] % 500, cache=cache)[:, -1, :]
        for _ in range(steps):
            out.append(np.array(logits.astype(mx.float32)))
            logits = sm.model(mx.argmax(logits, axis=-1)[None], cache=cache)[:, -1, :]
    return out


def test_admission_waits_for_the_streams_only_when_a_read_may_be_in_flight(store):
    """A forward's router sync drains its stream, so admission needs no wait of its own
    while every read of a pool was queued on that stream (where streams run in order:
    CUDA and the CPU, not Metal); a read queued on another stream makes the next
    admission wait. The logits stay those of a fully resident model either way."""
    ordered = not mx.metal.is_available()
    full = load_streaming_model(store, Settings(capacity=1.0))
    sm = load_streaming_model(store, Settings(capacity=5, prefetch="off"))
    try:
        want = _logits_run(full)
        got = _logits_run(sm)
        stats = sm.pool_stats()
        assert stats.misses_decode > 0 and stats.overflow_forwards == 0
        assert (stats.quiesces == 0) == ordered
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        # Another stream: each pool's first admission there waits once, then no more.
        before = stats.quiesces
        other = mx.new_stream(mx.default_device())
        got = _logits_run(sm, stream=other)
        waited = sm.pool_stats().quiesces - before
        assert 0 < waited and (waited <= len(sm.pools)) == ordered
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        _logits_run(sm, stream=other)
        assert (sm.pool_stats().quiesces == before + waited) == ordered
    finally:
        sm.close()
        full.close()


def test_truncated_expert_file_names_layer_and_expert(store, tmp_path):
    broken = tmp_path / "store"
    shutil.copytree(store, broken)
    manifest = load_manifest(broken)
    layer = manifest.layers[1]
    path = broken / layer.file
    path.write_bytes(path.read_bytes()[: 3 * layer.stride])  # experts 3.. are gone
    sm = load_streaming_model(broken, Settings(capacity=4))
    try:
        with pytest.raises(ExpertReadError, match=r"expert \d+ of layer 1 .*layer_001"):
            run_tokens(sm, n_prompt=30, steps=10)
        pool = sm.pools[1]
        resident = np.flatnonzero(pool.slot_of >= 0)
        assert all(e < 3 for e in resident), "an expert that failed to read was left resident"
    finally:
        sm.close()
