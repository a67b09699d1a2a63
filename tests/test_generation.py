"""One request's tokens and statistics (daemon/model/generation.py) over a partial pool."""

from __future__ import annotations

import pytest

from moestream.daemon.model.generation import SamplingParams, generate
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_generate_stats(store):
    sm = load_streaming_model(store, Settings(capacity=0.25))
    try:
        r = generate(sm, [1, 2, 3, 4, 5], SamplingParams(max_tokens=12))
    finally:
        sm.close()
    s = r.stats
    assert len(r.tokens) == s["generated_tokens"] <= 12
    assert s["misses"]["prefill"] > 0 and s["hits"]["decode"] + s["misses"]["decode"] > 0
    assert (
        s["bytes_read"]
        == (s["misses"]["prefill"] + s["misses"]["decode"]) * load_manifest(store).layers[0].expert_bytes
    )
    n_moe = len(load_manifest(store).layers)
    assert s["host_syncs_per_token"] == pytest.approx(n_moe + 1)
