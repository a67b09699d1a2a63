"""Stack distances (daemon/pool/reuse.py): their LRU hit rate against the pool's own LRU
policy replayed on the same routing, on the three real routing traces in the repository."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moestream.daemon.bench.policy.replay import capacity_slots, replay
from moestream.daemon.bench.policy.trace import load_trace
from moestream.daemon.policies import make_policy
from moestream.daemon.pool.reuse import StackDistances, lru_hit_rate

TRACES = Path(__file__).resolve().parent / "data" / "traces"


def test_distances_count_the_other_experts_routed_since_the_last_use():
    d = StackDistances(6, every=1)
    d.observe([np.array([0, 1]), np.array([2, 3]), np.array([0, 4]), np.array([1])])
    # 0, 1, 2, 3 first uses; 0 again after {1, 2, 3} (1 shares its step: not after it, so 2);
    # 4 first; 1 after {2, 3, 0, 4}.
    assert d.counts.tolist() == [0, 0, 1, 0, 1, 0, 5]
    assert d.take().sum() == 7 and d.counts.sum() == 0
    d.observe_step(np.array([[4], [1]]))  # one step of two rows (a batch)
    # 1 last at step 3 (nothing since: 0); 4 at step 2 (1 since: 1). The clock carried on.
    assert d.counts.tolist() == [1, 1, 0, 0, 0, 0, 0]


def test_hit_rate_of_a_histogram_and_of_a_file_s_table():
    h = np.array([5, 3, 2, 0, 10])  # 4 experts + first uses
    # Below 2 - 2 // 4, of the 10 routings with a distance: first uses are left out.
    assert lru_hit_rate(h, slots=2, top_k=2, num_experts=4) == pytest.approx(8 / 10)
    assert lru_hit_rate({0: 5, 1: 3, 2: 2, 4: 10}, 2, 2, 4) == lru_hit_rate(h, 2, 2, 4)
    # A table without first uses is read the same (its largest key is no first use).
    assert lru_hit_rate({0: 5, 1: 3, 2: 2}, 2, 2, 4) == pytest.approx(8 / 10)
    assert lru_hit_rate(np.zeros(5, dtype=np.int64), 2, 2, 4) is None
    assert lru_hit_rate(np.array([0, 0, 0, 0, 3]), 2, 2, 4) is None  # first uses alone
    with pytest.raises(ValueError, match="5 buckets for a layer of 6 experts"):
        lru_hit_rate(h, 2, 2, 6)


@pytest.mark.parametrize("name", ["qwen15moe_gsm8k_dev", "granite31_decode", "demo_stdlib"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_the_histogram_forecasts_the_lru_pool_on_real_traces(name, fraction):
    """Decode steps only, the pool carried across requests, every traced layer: the mean
    over layers of the histogram's hit rate is within 0.015 of the LRU policy replayed,
    warm (each expert's first use in the trace, a miss of the empty pool the replay
    starts with, left out, as the histogram leaves it out);
    the hottest share of the same steps' counts (what the plan had) is further off, by
    0.03-0.2 on these traces, below the replay where a text's routing repeats itself (the
    demo's) and above it elsewhere."""
    trace = load_trace(TRACES / name)
    decode = [i for i, p in enumerate(trace.phases) if p == "decode"]
    slots = capacity_slots(fraction, trace.num_experts, trace.top_k)
    replayed, forecast, hottest = [], [], []
    for layer in range(trace.num_layers):
        steps = [trace.steps[i][layer] for i in decode]
        policy = make_policy("lru", trace.num_experts, slots)
        pool = replay(policy, steps, ["decode"] * len(steps))
        first_uses = len(np.unique(np.array(steps)))
        replayed.append(pool.count(pool.hits, None) / (pool.accesses() - first_uses))
        d = StackDistances(trace.num_experts, every=1)
        d.observe(np.array(steps))
        assert d.counts[-1] == first_uses
        forecast.append(lru_hit_rate(d.counts, slots, trace.top_k, trace.num_experts))
        counts = np.bincount(np.array(steps).ravel(), minlength=trace.num_experts)
        hottest.append(np.sort(counts)[::-1][:slots].sum() / counts.sum())
    lru = np.mean(replayed)
    assert np.mean(forecast) == pytest.approx(lru, abs=0.015)
    if lru < 0.98:  # (granite at 75%, 16 steps: a warm pool hits 0.995, both within 0.01)
        assert abs(np.mean(hottest) - lru) > abs(np.mean(forecast) - lru)


def test_every_fourth_step_keeps_the_estimate_on_long_traces():
    """The pools count every SAMPLE_EVERY-th step (every step keeps the last uses): on the
    two long traces (768 and 984 decode steps) the sample's hit rate, averaged over the
    layers as a token's time sums them, stays within 0.03 of every step's."""
    from moestream.daemon.pool.reuse import SAMPLE_EVERY

    assert SAMPLE_EVERY == 4
    for name in ("qwen15moe_gsm8k_dev", "demo_stdlib"):
        trace = load_trace(TRACES / name)
        steps = [step for step, phase in zip(trace.steps, trace.phases) if phase == "decode"]
        for fraction in (0.25, 0.5):
            slots = capacity_slots(fraction, trace.num_experts, trace.top_k)
            exact, estimate = [], []
            for layer in range(trace.num_layers):
                rows = np.array([s[layer] for s in steps])
                every, sampled = StackDistances(trace.num_experts, every=1), StackDistances(trace.num_experts)
                every.observe(rows)
                sampled.observe(rows)
                assert sampled.counts.sum() == trace.top_k * -(-len(steps) // SAMPLE_EVERY)
                exact.append(lru_hit_rate(every.counts, slots, trace.top_k, trace.num_experts))
                estimate.append(lru_hit_rate(sampled.counts, slots, trace.top_k, trace.num_experts))
            assert np.mean(estimate) == pytest.approx(np.mean(exact), abs=0.03), (name, fraction)


def test_the_reuse_file_adds_each_save_and_loses_nothing_while_its_lock_is_held(tmp_path):
    """`Heat.save_reuse` adds what the pools counted to pool_reuse.json; while another
    process holds the file's lock the counts wait for the next save, none lost or doubled."""
    import logging
    from types import SimpleNamespace

    from moestream.daemon.heat import Heat
    from moestream.shared.heat_file import UsageLock, read_usage
    from moestream.shared.settings import Settings
    from moestream.shared.store_format import POOL_REUSE_NAME

    layers = [SimpleNamespace(ordinal=o, num_experts=4) for o in (3, 5)]
    pools = [SimpleNamespace(layer=layer, stack_distances=StackDistances(4, every=1)) for layer in layers]
    sm = SimpleNamespace(pools=pools, store_dir=tmp_path)
    heat = Heat(Settings(heat_dir=str(tmp_path)), logging.getLogger("test"))
    path = tmp_path / POOL_REUSE_NAME

    pools[0].stack_distances.observe([np.array([0, 1]), np.array([0, 2])])  # 0 again: nothing since, 0
    heat.take_reuse(sm)
    assert heat.save_reuse(sm) and read_usage(path).counts == {3: {0: 1, 4: 3}}

    pools[0].stack_distances.observe_step(np.array([1]))  # after 0 and 2: distance 2
    pools[1].stack_distances.observe_step(np.array([3]))
    holder = UsageLock(path)
    holder.acquire(1.0)
    try:
        heat.take_reuse(sm)
        assert not heat.save_reuse(sm)  # kept
        assert read_usage(path).counts == {3: {0: 1, 4: 3}}
    finally:
        holder.release()
    assert heat.save_reuse(sm) and read_usage(path).counts == {3: {0: 1, 2: 1, 4: 3}, 5: {4: 1}}
    assert heat.save_reuse(sm) and read_usage(path).counts == {3: {0: 1, 2: 1, 4: 3}, 5: {4: 1}}  # nothing twice
