"""Pinning and preloading the hottest experts at start, and warming the host tier
(daemon/pool/autopin.py)."""

from __future__ import annotations

import numpy as np
import pytest
from pool_store import run_tokens

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_autopin_pins_the_hottest_experts_and_keeps_them(store):
    from moestream.daemon.pool.autopin import autopin

    manifest = load_manifest(store)
    counts = {layer.ordinal: {e: (e * 7919) % 97 + 1 for e in range(layer.num_experts)} for layer in manifest.layers}
    counts[0] = {}  # no heat recorded for layer 0: it is skipped
    sm = load_streaming_model(store, Settings(capacity=8))
    try:
        summary = autopin(sm, counts, frac=0.5)
        assert summary.layers == len(manifest.layers) - 1 and summary.skipped_layers == 1
        assert summary.pinned == 4 * (len(manifest.layers) - 1)
        # The other 4 slots of each warmed layer hold the next hottest, unpinned.
        assert summary.preloaded == 4 * (len(manifest.layers) - 1)
        assert summary.bytes_read == (summary.pinned + summary.preloaded) * manifest.layers[0].expert_bytes
        assert summary.tier_warmed_bytes == 0  # no host tier
        for p in sm.pools[1:]:
            ranked = sorted(counts[p.layer.ordinal], key=lambda e: (-counts[p.layer.ordinal][e], e))
            assert p.pinned == set(ranked[:4])
            assert set(np.flatnonzero(p.slot_of >= 0).tolist()) == set(ranked[:8])
        assert not (sm.pools[0].slot_of >= 0).any()
        run_tokens(sm, n_prompt=40, steps=30)
        for p in sm.pools[1:]:
            assert all(p.slot_of[e] >= 0 for e in p.pinned)
        assert not sm.pools[0].pinned
    finally:
        sm.close()


def test_a_warm_start_fills_the_host_tier_with_the_hottest_experts_first(store):
    """A tier with room for two thirds of the experts: autopin reads the hottest of all
    layers into it before serving, and the pools' warm-up then comes from the tier;
    a cold start (frac 0) reads nothing."""
    from moestream.daemon.pool.autopin import autopin
    from moestream.daemon.pool.host_tier import expert_stride

    manifest = load_manifest(store)
    total = sum(layer.num_experts for layer in manifest.layers)
    room = total * 2 // 3
    counts = {
        layer.ordinal: {e: 1000 * (layer.ordinal + 1) + e for e in range(layer.num_experts)}
        for layer in manifest.layers
    }
    ranked = sorted(((c, o, e) for o, lc in counts.items() for e, c in lc.items()), reverse=True)
    settings = Settings(capacity=8, host_cache=expert_stride(manifest) * room)
    cold = load_streaming_model(store, settings)
    try:
        summary = autopin(cold, counts, frac=0.0)
        assert summary.tier_warmed_bytes == summary.bytes_read == summary.preloaded == 0
        assert cold.pool_stats().admission["tier_resident_experts"] == 0
    finally:
        cold.close()
    sm = load_streaming_model(store, settings)
    try:
        summary = autopin(sm, counts, frac=0.5)
        tier = sm.admitter.tier
        expert_bytes = manifest.layers[0].experts[0].length
        assert summary.tier_warmed_bytes == room * expert_bytes
        stats = sm.pool_stats().admission
        # The pools' experts that the tier lacked came from the disk and took the tier
        # slots of the coldest warmed ones; the rest of the pools came from the tier.
        extra = stats["bytes_from_disk"] // expert_bytes - room
        assert 0 < extra < summary.pinned + summary.preloaded
        assert len(tier) == room
        held = [tier.holds((o, e)) for _, o, e in ranked[:room]]
        assert room > 4 * extra and sum(held) >= room - extra and all(held[: room // 2])
        run_tokens(sm)
    finally:
        sm.close()
