"""Slots per layer from `--capacity` and `--memory-budget` (daemon/pool/capacity.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.expert_pool import PoolCapacityError
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_capacity_below_top_k_is_refused(store):
    with pytest.raises(PoolCapacityError, match="below the minimum 4"):
        load_streaming_model(store, Settings(capacity=3))


def test_memory_budget_below_minimum_is_refused(store):
    with pytest.raises(PoolCapacityError, match="below the minimum"):
        load_streaming_model(store, Settings(memory_budget=1024))


def _budget_parts(store):
    from moestream.daemon.pool.capacity import kv_cache_bytes

    manifest = load_manifest(store)
    per_slot = sum(layer.expert_bytes for layer in manifest.layers)
    resident = sum(a.nbytes for f in manifest.resident_files for a in mx.load(str(store / f)).values())
    # The prompt cache's memory is reserved out of the budget too.
    return manifest, per_slot, resident + kv_cache_bytes(manifest.config, 64) + Settings().prompt_cache_bytes


def test_memory_budget_sizes_the_pool():
    """Weights + KV cache + pool + room for a long prompt's transient stack of experts
    fit the budget (the demo store: 5 MoE layers of 64 experts)."""
    from moestream.daemon.pool.capacity import overflow_reserve_bytes
    from moestream.shared.settings import demo_store_path

    store = demo_store_path()
    manifest, per_slot, fixed = _budget_parts(store)
    expert = manifest.layers[0].expert_bytes
    overflow = overflow_reserve_bytes(manifest, 12)
    budget = fixed + 12 * per_slot + overflow + (per_slot - expert) // 2
    sm = load_streaming_model(store, Settings(memory_budget=budget), max_tokens=64)
    try:
        assert sm.capacity == 12
        assert fixed + sm.pool_bytes + overflow <= budget
    finally:
        sm.close()


def test_the_prompt_cache_is_reserved_out_of_the_budget():
    """The same budget gives a smaller pool when the prompt cache's bytes come out of it
    (the demo store, as above)."""
    from moestream.daemon.pool.capacity import overflow_reserve_bytes
    from moestream.shared.settings import demo_store_path

    store = demo_store_path()
    manifest, per_slot, fixed = _budget_parts(store)
    budget = fixed + 12 * per_slot + overflow_reserve_bytes(manifest, 12)
    sizes = []
    for more in (0, 2 * per_slot):
        reserved = Settings().prompt_cache_bytes + more
        sm = load_streaming_model(store, Settings(memory_budget=budget, prompt_cache_bytes=reserved), max_tokens=64)
        try:
            sizes.append(sm.capacity)
        finally:
            sm.close()
    assert sizes[0] == 12 and sizes[1] < 12
    with pytest.raises(PoolCapacityError, match="prompt cache"):
        load_streaming_model(store, Settings(memory_budget=budget, prompt_cache_bytes=budget), max_tokens=64)


def test_a_budget_that_holds_every_expert_needs_no_room_for_overflow(store):
    """With 2 MoE layers a partial pool plus its overflow room costs more than all
    experts: a budget for all of them gives a full pool."""
    manifest, per_slot, fixed = _budget_parts(store)
    experts = manifest.layers[0].num_experts
    sm = load_streaming_model(store, Settings(memory_budget=fixed + experts * per_slot), max_tokens=64)
    try:
        assert sm.capacity == experts
    finally:
        sm.close()
    with pytest.raises(PoolCapacityError, match="room for a long prompt"):
        load_streaming_model(store, Settings(memory_budget=fixed + experts * per_slot - 1), max_tokens=64)
