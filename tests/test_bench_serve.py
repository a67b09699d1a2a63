"""`moestreamctl bench serve` end to end: a real daemon, real clients, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

from tiny_models import tiny_store

from moestream.daemon.bench.serve import _percentile


def test_levels_of_concurrent_clients_through_a_real_daemon():
    with tiny_store("bench-serve") as store:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "moestream.client.cli",
                "bench",
                "serve",
                "--model",
                str(store),
                "--capacity",
                "0.5",
                "--clients",
                "1",
                "--clients",
                "3",
                "--requests",
                "3",
                "--max-tokens",
                "5",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    levels = report["levels"]
    assert [level["clients"] for level in levels] == [1, 3]
    for level in levels:
        assert level["requests"] == 3 and 3 <= level["tokens"] <= 15
        assert level["aggregate_tokens_per_s"] > 0 and level["ttft_p50_s"] > 0
        assert level["ttft_p50_s"] <= level["ttft_p99_s"] and level["itl_p50_s"] <= level["itl_p99_s"]
        # Each request's (sent, first token, done) lies within the level's wall, in that order.
        assert len(level["timeline_s"]) == 3
        for sent, first, done in level["timeline_s"]:
            assert 0 <= sent <= first <= done <= level["wall_s"]
        # Every token of the level came from the daemon's batch or its lone request, and
        # the seconds of their work lie within the level's wall.
        b = level["batch"]
        assert b["joined"] == level["requests"] and b["tokens"] + b["solo_tokens"] == level["tokens"]
        spent = [v for k, v in b.items() if k.endswith("_s")]
        assert len(spent) == 5 and all(v >= 0 for v in spent) and sum(spent) <= level["wall_s"]
        # The steps alone make the level's tokens faster than the level did.
        assert level["steps_only_tokens_per_s"] >= level["aggregate_tokens_per_s"]
    # One client's requests each decode alone, outside the batch (whether three clients'
    # meet in it depends on their timing: tests/test_batching_daemon.py makes them).
    assert levels[0]["batch"]["steps"] == 0 and levels[0]["batch"]["solo_s"] > 0
    # One client sends its requests one after another.
    one = sorted(levels[0]["timeline_s"])
    assert all(a[2] <= b[0] for a, b in zip(one, one[1:]))
    assert levels[0]["aggregate_over_one_client"] == 1.0
    # Seeded requests: each one's tokens are its own, with or without company.
    assert report["same_tokens_at_every_level"] is True
    assert report["daemon"]["capacity"] is not None


def test_percentile_interpolates():
    assert _percentile([], 0.5) is None
    assert _percentile([3.0], 0.99) == 3.0
    assert _percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert _percentile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0
