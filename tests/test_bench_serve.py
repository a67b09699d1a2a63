"""`moestreamctl bench serve` end to end: a real daemon, real clients, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import tiny_store

from moestream.daemon.bench.serve import _percentile, format_report


def _bench_serve(name: str, *args: str) -> tuple[dict, str]:
    """`moestreamctl bench serve --json` with `args` on a tiny store of its own: the
    report and the progress lines."""
    with tiny_store(name) as store:
        out = subprocess.run(
            [sys.executable, "-m", "moestream.client.cli", "bench", "serve", "--model", str(store), *args, "--json"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_levels_of_concurrent_clients_through_a_real_daemon():
    report, _ = _bench_serve(
        "bench-serve",
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
        "--max-batch",
        "3",
    )
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
        # Every token of the level came from the daemon's batch steps, and the seconds of
        # their work lie within the level's wall.
        b = level["batch"]
        assert b["joined"] == level["requests"] and b["tokens"] == level["tokens"]
        spent = [v for k, v in b.items() if k.endswith("_s")]
        assert len(spent) == 2 and all(v >= 0 for v in spent) and sum(spent) <= level["wall_s"]
        # Each level prefills its own prompts: the daemon runs without a prompt cache,
        # which would serve the later levels' (the same prompts) from the earlier ones.
        assert level["cached_tokens"] == 0
        # A slot pool: no placement to report.
        assert level["placement"] == {}
        # The steps alone make the level's tokens faster than the level did.
        assert level["steps_only_tokens_per_s"] >= level["aggregate_tokens_per_s"]
    # One client's requests each decode alone, in steps of one (whether three clients'
    # meet in a step depends on their timing: tests/test_batching_daemon.py makes them).
    assert levels[0]["batch"]["max_size"] == 1 and levels[0]["batch"]["decode_s"] > 0
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


def test_rounds_run_every_level_again_in_turn_and_report_medians():
    """`--rounds 2`: each level runs twice (the second round in reverse order), and
    reports the median of its rounds' figures and of each round's ratio to the same
    round's one client. On a mapped pool, each level also reports its placement."""
    mapped = ("--capacity", "0.25", "--host-cache", "256M", "--mapped")
    levels = ("--clients", "1", "--clients", "2", "--requests", "2", "--max-tokens", "3", "--rounds", "2")
    report, progress = _bench_serve("bench-serve-rounds", *mapped, *levels, "--max-batch", "2")
    # The second round runs its levels in reverse: 2 clients, then 1.
    order = [
        line.split("round 2 of 2, ")[1].split(" client")[0]
        for line in progress.splitlines()
        if "round 2 of 2, " in line and "requests" in line
    ]
    assert order == ["2", "1"], progress
    for level in report["levels"]:
        rounds = level["rounds"]
        assert len(rounds) == 2
        rates = [r["aggregate_tokens_per_s"] for r in rounds]
        assert level["aggregate_tokens_per_s"] == pytest.approx(sum(rates) / 2)
        ratios = [r["aggregate_over_one_client"] for r in rounds]
        assert level["aggregate_over_one_client"] == pytest.approx(sum(ratios) / 2)
        for r, one in zip(rounds, report["levels"][0]["rounds"]):
            assert r["aggregate_over_one_client"] == pytest.approx(
                r["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"]
            )
            assert r["itl_p50_over_one_client"] == pytest.approx(r["itl_p50_s"] / one["itl_p50_s"])
            assert r["batch"]["joined"] == 2
            # The placement counted what the round's forwards routed, a share of it on the GPU.
            placed = r["placement"]
            assert placed["routed"] > 0 and 0 <= placed["routed_on_gpu"] <= placed["routed"]
            assert placed["gpu_hit_rate"] == pytest.approx(placed["routed_on_gpu"] / placed["routed"])
    assert [r["aggregate_over_one_client"] for r in report["levels"][0]["rounds"]] == [1.0, 1.0]
    assert report["same_tokens_at_every_level"] is True
    text = format_report(report)
    assert "medians of 2 rounds" in text and "ITL x one" in text and "the mapped pool:" in text


def test_against_turns_runs_each_level_on_a_batching_and_a_turn_taking_daemon():
    """`--against-turns`: every level also through a daemon whose requests take turns, in
    each round; the batch's gain is the median of each round's ratio, and the seeded
    requests make the same tokens batched and in turns (the batch is batch-invariant)."""
    levels = ("--clients", "1", "--clients", "3", "--requests", "3", "--max-tokens", "4", "--rounds", "2")
    report, progress = _bench_serve(
        "bench-serve-turns", "--capacity", "0.5", *levels, "--max-batch", "3", "--against-turns"
    )
    assert "starting a daemon (max_batch 3)" in progress and "starting a daemon (max_batch 1)" in progress
    assert sum("in turns: 3 requests" in line for line in progress.splitlines()) == 4  # 2 levels x 2 rounds
    assert report["settings"]["against_turns"] is True
    for level in report["levels"]:
        turns, ratios = level["turns"], level["over_turns_by_round"]
        assert turns["aggregate_tokens_per_s"] > 0 and len(ratios) == 2
        assert level["over_turns"] == pytest.approx(sum(ratios) / 2)
    # Whether the three clients meet in a step depends on their timing; their tokens do not.
    assert report["same_tokens_at_every_level"] is True
    assert "x turns" in format_report(report)
