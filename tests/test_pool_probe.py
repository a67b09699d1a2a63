"""The pool probe (daemon/pool_probe.py): its arithmetic, its place in the plan, and a
real probe of the demo store's architecture streamed through moestream's pool."""

from __future__ import annotations

import json

import pytest

from moestream.daemon.planning.plan import (
    Bandwidths,
    ComputeProbe,
    heat_counts,
    load_pool_probes,
    make_plan,
    save_pool_probes,
)
from moestream.daemon.planning.pool_probe import PoolProbe, probe_pools
from moestream.shared.settings import Settings, demo_store_path
from moestream.shared.store_format import load_manifest

DEMO = demo_store_path()
PROBE = ComputeProbe(
    (2, 4), (0.004, 0.006), (0.0004, 0.0006), (0.00402, 0.00604), (0.0005, 0.0008), 0.0, "cpu", "bfloat16"
)
FAST = Bandwidths(1e9, 1e10, "host memcpy", "given")
# Models of 1 and 5 MoE layers: streamed, 1 ms more per token plus 0.5 ms more per MoE
# layer; 2 misses per layer of 1 MB each.
POOL = PoolProbe(0.25, False, (1, 5), (0.010, 0.030), (0.0115, 0.0335), 2.0, 0.75, 10**6, 16, 64)


def test_host_time_extrapolates_along_the_moe_layers_less_the_probes_own_copies():
    # Each layer's 2 misses of 1 MB took 2 us of the probe's extra time at 1 TB/s, 2 ms at 1 GB/s.
    assert POOL.host_s(1, 1e12) == pytest.approx(0.0015 - 2e-6)
    assert POOL.host_s(48, 1e12) == pytest.approx(0.0015 + 47 * 0.0005 - 48 * 2e-6)
    assert POOL.host_s(48, 1e9) == 0.0  # copies more than all of it: never below 0
    assert POOL.host_s(48, 1e10) == pytest.approx(0.0015 + 47 * 0.0005 - 48 * 2e-4)
    one = PoolProbe(0.25, False, (3, 3), (0.01, 0.01), (0.016, 0.016), 0.0, 1.0, 10**6, 16, 64)
    assert one.host_s(30, 1e10) == pytest.approx(0.06)  # one depth: its mean per layer
    assert PoolProbe.from_dict(json.loads(json.dumps(POOL.to_dict()))) == POOL


def test_the_pool_term_stands_for_the_sync_term(tmp_path):
    settings = Settings(model=str(DEMO), capacity=0.25, heat_dir=str(tmp_path))
    manifest = load_manifest(DEMO)
    counts, source = heat_counts(DEMO, settings, manifest)
    synced = make_plan(DEMO, settings, FAST, PROBE, counts, source)
    pooled = make_plan(DEMO, settings, FAST, PROBE, counts, source, pool=POOL)
    assert synced.decode.terms_s["sync"] > 0 and synced.decode.terms_s["pool"] == 0
    assert pooled.decode.terms_s["sync"] == 0
    assert pooled.decode.terms_s["pool"] == pytest.approx(POOL.host_s(5, FAST.link_bytes_per_s))
    assert pooled.decode.tokens_per_s == pytest.approx(1 / sum(pooled.decode.terms_s.values()))
    # The bound leaves the pool's host work out, as it leaves the syncs out.
    assert pooled.decode.bound_tokens_per_s == pytest.approx(synced.decode.bound_tokens_per_s)
    full = make_plan(DEMO, settings.replace(capacity=1.0), FAST, PROBE, counts, source, pool=POOL)
    assert full.decode.terms_s["pool"] == 0 and full.pool_probe is None
    assert json.loads(json.dumps(pooled.to_dict()))["pool_probe"]["slots"] == 16


def test_pool_probes_are_kept_by_configuration(tmp_path):
    assert load_pool_probes(tmp_path, "abc") == {}
    mapped = PoolProbe(0.5, True, (1, 5), (0.01, 0.03), (0.011, 0.031), 1.0, 0.9, 10**6, 32, 64)
    save_pool_probes(tmp_path, "abc", {(0.25, False): POOL})
    save_pool_probes(tmp_path, "abc", {(0.5, True): mapped})  # kept beside the first
    assert load_pool_probes(tmp_path, "abc") == {(0.25, False): POOL, (0.5, True): mapped}
    assert load_pool_probes(tmp_path, "other") == {}
    (tmp_path / "pools-abc.json").write_text("[{]")
    assert load_pool_probes(tmp_path, "abc") == {}  # unreadable: probe again


def test_a_real_probe_of_the_demo_architecture(tmp_path):
    """The demo's architecture at 2 and 6 layers, streamed at a quarter (a slot pool and
    a mapped one) and at all of its experts: a probe for the partial pools only, whose
    models missed (routing varies; the mapped pool read its routing back, as the
    generation loop has it do) and left no store behind."""
    manifest = load_manifest(DEMO)
    probes = probe_pools(
        DEMO,
        manifest,
        "bfloat16",
        [(0.25, False), (0.25, True), (1.0, False)],
        Settings(),
        layers=(2, 6),
        folder=tmp_path,
        steps=6,
        repeats=1,
    )
    assert set(probes) == {(0.25, False), (0.25, True)}
    mapped = probes[(0.25, True)]
    assert mapped.slots == 16 and 0 < mapped.hit_rate < 1 and 0 < mapped.misses_per_layer < 8
    p = probes[(0.25, False)]
    assert p.moe_layers == (1, 5) and p.slots == 16 and p.experts == 64
    assert all(t > 0 for t in (*p.plain_s, *p.pooled_s))
    assert 0 < p.hit_rate < 1 and p.misses_per_layer > 0
    assert p.expert_bytes == max(layer.expert_bytes for layer in manifest.layers)
    assert list(tmp_path.iterdir()) == []
