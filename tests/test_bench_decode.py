"""`moestreamctl bench decode` (daemon/bench/decode.py): configurations side by side, rounds,
paired blocks, the daemon's loop, and the bound."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from moestream.daemon.pool.expert_pool import PoolCapacityError
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_bench_decode_reports_every_configuration_side_by_side(store):
    """`bench decode` on a tiny store: each configuration decodes the same tokens in every
    round, the warm-up rounds are run and recorded, and the bound and ratios are there."""
    from moestream.daemon.bench.decode import BenchDecodeSettings, run_bench_decode

    lines: list[str] = []
    report = run_bench_decode(
        BenchDecodeSettings(
            store=store,
            capacities=(1.0, 0.5),
            prompt_tokens=3,
            decode_tokens=4,
            rounds=2,
            warmup_rounds=2,
            host_cache=1 << 20,
            temp=1.0,
            mapped=True,
            mapped_gather=(False, True),
        ),
        progress=lines.append,
    )
    names = [r["name"] for r in report["results"]]
    assert names == [
        "stock-mlx-lm",
        "moestream@1",
        "moestream@0.5",
        "moestream@0.5+host",
        "moestream@0.5+mapped",
        "moestream@0.5+mapped:g",
        "naive-on-demand",
    ]
    assert report["warmup_rounds"] == 2
    assert sum("warm-up 2/2" in line for line in lines) == len(names)
    for r in report["results"]:
        assert len(r["tokens_per_s_runs"]) == 2 and r["same_tokens_as_first"], r["name"]
        assert r["bound_tokens_per_s"] > 0 and r["vs_naive"] > 0
        # The strictest bound is the fastest resident round's.
        assert r["best_bound_tokens_per_s"] >= r["bound_tokens_per_s"]
        assert r["fraction_of_best_bound"] <= r["fraction_of_bound"] and r["fraction_of_bound_paired"] > 0
    rows = {r["name"]: r for r in report["results"]}
    assert rows["moestream@1"]["hit_rate"] == 1.0 and rows["naive-on-demand"]["hit_rate"] == 0.0
    assert rows["moestream@0.5+host"]["tier_hit_rate"] is not None
    assert report["mapped_gather"] == [False, True]
    assert rows["moestream@0.5+mapped:g"]["host_syncs_per_token"] == 1.0  # the sampled token alone
    # Per-layer host microseconds for every streaming row (none for stock, whose layers
    # are mlx-lm's), and the syncs a token waits for: a slot pool's one per MoE layer.
    assert rows["stock-mlx-lm"]["host_us_per_layer_median"] is None
    for name in ("moestream@1", "moestream@0.5", "moestream@0.5+mapped"):
        r = rows[name]
        assert 0 < r["host_us_per_layer_median"] <= r["host_us_per_layer_p99"], name
    assert rows["moestream@1"]["syncs_per_token"] == 1.0
    assert rows["moestream@0.5"]["syncs_per_token"] >= rows["moestream@0.5"]["host_syncs_per_token"] > 1
    assert rows["moestream@0.5+host"]["host_tier"] == "slots" and rows["moestream@0.5+mapped"]["host_tier"] == "mapped"
    assert rows["moestream@0.5"]["host_tier"] is None and rows["stock-mlx-lm"]["host_tier"] is None
    # Here (MLX on the CPU) the loader keeps a host tier in the slot pool, and says why.
    assert report["host_tier_mapped"] == "off: MLX runs on the CPU"


def test_bench_decode_makes_a_tier_that_holds_every_expert_a_mapped_pool(store):
    """`--host-tier mapped` (what auto does on an NVIDIA GPU when the tier holds every
    expert): "+host" is then the mapped pool, one host sync per token, with the slot
    pool's tier beside it as "+host:slots"; a tier too small for that is refused."""
    from moestream.daemon.bench.decode import BenchDecodeSettings, run_bench_decode

    every = load_manifest(store).expert_bytes_total
    base = BenchDecodeSettings(
        store=store,
        capacities=(0.5,),
        prompt_tokens=3,
        decode_tokens=4,
        rounds=1,
        warmup_rounds=1,
        host_cache=every,
        host_tier="mapped",
        temp=1.0,
        stock=False,
        naive=False,
        slot_pool=False,
    )
    report = run_bench_decode(base)
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == ["moestream@0.5+host", "moestream@0.5+host:slots"]
    assert (
        rows["moestream@0.5+host"]["host_tier"] == "mapped"
        and rows["moestream@0.5+host"]["host_syncs_per_token"] == 1.0
    )
    assert (
        rows["moestream@0.5+host:slots"]["host_tier"] == "slots"
        # Filled before timing (`warm_tier`): a tier of every expert never misses.
        and rows["moestream@0.5+host:slots"]["tier_hit_rate"] == 1.0
        and rows["moestream@0.5+host:slots"]["disk_bytes_per_token"] == 0
    )
    assert (
        rows["moestream@0.5+host"]["same_tokens_as_first"] and rows["moestream@0.5+host:slots"]["same_tokens_as_first"]
    )
    assert report["host_tier_mapped"] == "mapped: --host-tier"
    # Read into the tier before timing (`warm_tier`), as a daemon's warm start fills it: as
    # many experts as its slots (each aligned, so a few fewer than `every` bytes) hold.
    assert 0.9 * every <= report["host_tier_warmed_bytes"] <= every
    with pytest.raises(PoolCapacityError, match="--host-cache"):
        run_bench_decode(dataclasses.replace(base, host_cache=every - 1))
    # The capacity plot puts each row on its family's line, by its host tier where the
    # name alone ("+host") no longer says (tests/bench/plot_capacity.py).
    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    from plot_capacity import family

    assert family(rows["moestream@0.5+host"]) == "mapped pool (host RAM holds every expert)"
    assert family(rows["moestream@0.5+host:slots"]) == "slot pool + host tier"
    assert family({"name": "moestream@0.25+host"}) == "slot pool + host tier"  # a report older than the mapped pool
    assert family({"name": "moestream@0.25"}) == "slot pool" and family({"name": "stock-mlx-lm"}) is None
    assert family({"name": "moestream@0.25+mapped:g:p"}) == "+mapped:g:p"


def test_a_round_repeats_its_decode_until_the_minimum_time_has_passed():
    """`--min-round-seconds`: fast configurations decode again within a round; tokens/s
    is all tokens over all seconds, per-token figures the mean, and a repeat that
    decoded other tokens leaves none to compare (so `same_tokens_as_first` fails)."""
    from moestream.daemon.bench.decode import timed_round

    speeds = iter([8.0, 4.0, 8.0, 100.0])  # 4 tokens: 0.5 s, 1 s, 0.5 s
    calls = []

    def run(seed):
        calls.append(seed)
        return {
            "tokens_per_s": next(speeds),
            "tokens": [1, 2],
            "hit_rate": 0.5 * len(calls),
            "host_tier": "slots",
            "admission_bytes_per_s": None,
        }

    r = timed_round(run, tokens=4, min_seconds=1.8, seed=7)
    assert r["repeats"] == 3 and calls == [7, 7, 7]
    assert r["tokens_per_s"] == pytest.approx(12 / 2.0)
    assert r["hit_rate"] == pytest.approx(1.0) and r["tokens"] == [1, 2]
    assert r["host_tier"] == "slots" and r["admission_bytes_per_s"] is None
    once = timed_round(lambda _: {"tokens_per_s": 2.0, "tokens": [3]}, tokens=4, min_seconds=1.0)
    assert once == {"tokens_per_s": 2.0, "tokens": [3], "repeats": 1}
    toks = iter([[1], [2]])
    differing = timed_round(lambda _: {"tokens_per_s": 8.0, "tokens": next(toks)}, tokens=4, min_seconds=0.9)
    assert differing["repeats"] == 2 and differing["tokens"] is None
    # Fresh text: each repeat takes the next seed, and its other tokens are expected: the
    # first decode's are kept, to compare with the other configurations' first.
    seeds = []
    fresh = timed_round(
        lambda seed: seeds.append(seed) or {"tokens_per_s": 8.0, "tokens": [seed]}, 4, 1.4, seed=1000, fresh=True
    )
    assert seeds == [1000, 1001, 1002] and fresh["tokens"] == [1000]


def test_bench_decode_rounds_of_a_minimum_time(store):
    from moestream.daemon.bench.decode import BenchDecodeSettings, format_report, run_bench_decode

    report = run_bench_decode(
        BenchDecodeSettings(
            store=store,
            capacities=(1.0,),
            prompt_tokens=3,
            decode_tokens=2,
            rounds=2,
            temp=1.0,
            naive=False,
            min_round_seconds=0.2,
        )
    )
    assert report["min_round_seconds"] == 0.2
    for r in report["results"]:
        # Each round decodes until 0.2 s of decoding have passed (two tokens of a tiny
        # model take milliseconds, so alone on a machine it decodes again; a loaded one
        # may take the 0.2 s in one decode, which the check allows).
        seconds = [n * 2 / tps for n, tps in zip(r["decodes_per_round"], r["tokens_per_s_runs"])]
        assert all(s >= 0.2 - 1e-9 for s in seconds) and r["same_tokens_as_first"], r
        assert len(seconds) == 2, r
    assert "rounds of at least 0.2 s" in format_report(report)


def test_bench_decode_with_fresh_text_compares_each_rounds_first_decode(store):
    """`--fresh-text`: every decode samples new text, each round's first with the same
    seed in every configuration, so the streaming rows still decode stock's tokens;
    greedy has one text only, and says so."""
    from moestream.daemon.bench.decode import BenchDecodeSettings, run_bench_decode

    settings = BenchDecodeSettings(
        store=store,
        capacities=(1.0, 0.25),
        prompt_tokens=3,
        decode_tokens=3,
        rounds=2,
        temp=1.0,
        naive=False,
        # Long enough for a second decode of 3 tokens on a loaded CI machine (at 0.1 s a
        # round there once held one decode).
        min_round_seconds=1.0,
        fresh_text=True,
    )
    report = run_bench_decode(settings)
    assert report["fresh_text"] is True
    for r in report["results"]:
        assert r["same_tokens_as_first"] and all(n > 1 for n in r["decodes_per_round"]), r
    with pytest.raises(ValueError, match="temperature above 0"):
        run_bench_decode(dataclasses.replace(settings, temp=0.0))


def test_paired_blocks_run_a_b_b_a_and_cancel_a_linear_drift():
    """`--paired-blocks`: each block runs stock, ours, ours, stock; with the machine
    slowing down linearly and ours exactly as fast as stock at each moment, every block's
    ratio is 1 (within the harmonic mean's curvature), where a plain A B order would
    favour stock."""
    from moestream.daemon.bench.decode import paired_blocks

    order, clock = [], iter(range(1000))

    def at(name):
        def run():
            order.append(name)
            return {"tokens_per_s": 100.0 - 0.5 * next(clock)}

        return run

    r = paired_blocks(at("stock"), at("ours"), 5)
    assert order[:8] == ["stock", "ours", "ours", "stock"] * 2 and len(order) == 20
    assert len(r["ratios"]) == 5 and all(x == pytest.approx(1.0, abs=1e-3) for x in r["ratios"])
    assert r["interval_95"][0] <= r["geometric_mean"] <= r["interval_95"][1]
    assert r["quartiles"][0] <= r["median"] <= r["quartiles"][1]
    # Ours twice as fast: the ratio says so.
    fast = paired_blocks(lambda: {"tokens_per_s": 10.0}, lambda: {"tokens_per_s": 20.0}, 3)
    assert fast["median"] == pytest.approx(2.0) and fast["interval_95"] == pytest.approx([2.0, 2.0])
    with pytest.raises(ValueError):
        paired_blocks(at("stock"), at("ours"), 1)


def test_bench_decode_pairs_full_residency_with_stock_and_splits_host_time(store):
    """The 100% configuration gets its A B B A blocks against stock; every row says where
    the host spent each token (call, launch, wait), which adds up to no more than the
    decode's time per token."""
    from moestream.daemon.bench.decode import BenchDecodeSettings, format_report, run_bench_decode

    report = run_bench_decode(
        BenchDecodeSettings(
            store=store, capacities=(1.0, 0.5), prompt_tokens=3, decode_tokens=3, rounds=1, paired_blocks=3
        )
    )
    rows = {r["name"]: r for r in report["results"]}
    pb = rows["moestream@1"]["paired_blocks"]
    assert report["paired_blocks"] == 3 and len(pb["ratios"]) == 3 and all(x > 0 for x in pb["ratios"])
    assert "paired_blocks" not in rows["moestream@0.5"] and "paired_blocks" not in rows["stock-mlx-lm"]
    for r in rows.values():
        parts = [r["host_call_ms_per_token"], r["host_launch_ms_per_token"], r["host_wait_ms_per_token"]]
        assert all(p >= 0 for p in parts) and r["host_call_ms_per_token"] > 0, r
        assert sum(parts) <= 1e3 / r["tokens_per_s"] * 1.001, r
    text = format_report(report)
    assert "moestream@1 against stock in 3 A B B A blocks" in text and "host ms per token" in text


def test_bench_decode_times_checksums_against_the_same_pool_without(store):
    """`--checksums`: each partial slot pool again with every read verified ("+crc"),
    paired in A B B A blocks against the same pool without; the same tokens both ways."""
    from moestream.daemon.bench.decode import BenchDecodeSettings, format_report, run_bench_decode

    report = run_bench_decode(
        BenchDecodeSettings(
            store=store,
            capacities=(1.0, 0.25),
            prompt_tokens=3,
            decode_tokens=3,
            rounds=1,
            paired_blocks=2,
            checksums=True,
            stock=False,
            naive=False,
        )
    )
    rows = {r["name"]: r for r in report["results"]}
    assert set(rows) == {"moestream@1", "moestream@0.25", "moestream@0.25+crc"} and report["checksums"] is True
    pb = rows["moestream@0.25+crc"]["paired_blocks"]
    assert pb["against"] == "moestream@0.25" and len(pb["ratios"]) == 2
    assert rows["moestream@0.25+crc"]["hit_rate"] == rows["moestream@0.25"]["hit_rate"]
    assert "moestream@0.25+crc against moestream@0.25 in 2 A B B A blocks" in format_report(report)


def test_bench_decode_times_the_daemons_generation_loop_beside_its_own(store):
    """`--generation-loop`: each streaming configuration is also timed through the
    daemon's generation loop, round by round; greedy, both loops decode the same tokens."""
    from moestream.daemon.bench.decode import BenchDecodeSettings, format_report, run_bench_decode

    report = run_bench_decode(
        BenchDecodeSettings(
            store=store, capacities=(1.0, 0.5), prompt_tokens=3, decode_tokens=4, rounds=2, generation_loop=True
        )
    )
    rows = {r["name"]: r for r in report["results"]}
    assert report["generation_loop"] is True
    for name in ("moestream@1", "moestream@0.5"):
        r = rows[name]
        assert len(r["generate_tokens_per_s_runs"]) == 2 and r["generate_tokens_per_s"] > 0
        assert r["generate_vs_bench_paired"] > 0 and r["generate_same_tokens"] is True, r
    # Stock mlx-lm and the naive reader have no daemon loop to time.
    assert (
        "generate_tokens_per_s" not in rows["stock-mlx-lm"] and "generate_tokens_per_s" not in rows["naive-on-demand"]
    )
    text = format_report(report)
    assert "through the daemon's generation loop" in text and "other tokens" not in text


def _decode_row(name: str, capacity: float | None, tps: float, disk: float, link: float = 0.0) -> dict:
    """A `bench decode` result row as run_bench_decode builds it, before add_bound."""
    return {
        "name": name,
        "capacity": capacity,
        "host_tier": None,
        "tokens_per_s": tps,
        "tokens_per_s_runs": [tps, tps],
        "hit_rate": 1.0,
        "tier_hit_rate": None,
        "disk_bytes_per_token": disk,
        "host_to_pool_bytes_per_token": link,
        "admission_bytes_per_s": None,
        "host_syncs_per_token": 1.0,
        "vs_naive": None,
    }


def _decode_report(page_cache: str | None) -> dict:
    """A report of four rows, stock at 20 tok/s (50 ms a token), 1 GB/s from the store."""
    from moestream.daemon.bench.decode import add_bound

    stock = _decode_row("stock-mlx-lm", None, 20.0, 0.0)
    rows = [
        stock,
        _decode_row("moestream@1", 1.0, 24.0, 0.0),  # faster than stock this time: 1.2 of its "bound"
        _decode_row("moestream@0.5", 0.5, 21.0, 0.2e6, 0.1e6),  # 0.2 ms of reads in a 50 ms token
        _decode_row("moestream@0.25", 0.25, 8.0, 50e6),  # 50 ms of reads: a bound of 10 tok/s
    ]
    for r in rows:
        add_bound(r, stock, read_bandwidth=1e9, link_bandwidth=1e10, page_cache=page_cache)
    return {
        "model_type": "qwen3_moe",
        "moe_layers": 5,
        "experts_per_layer": 64,
        "decode_tokens": 16,
        "temp": 0.0,
        "rounds": 2,
        "read_bandwidth_bytes_per_s": 1e9,
        "read_page_cache": page_cache,
        "link_kind": "host memcpy",
        "link_bandwidth_bytes_per_s": 1e10,
        "results": rows,
    }


def _up_to(table: list[str], line: str, column: str) -> str:
    """`line` up to the end of a right-aligned column, where the header's name ends."""
    return line[: table[0].index(column) + len(column)]


def _cell(table: list[str], line: str, column: str) -> str:
    """The (one-word) text of a right-aligned column's cell in `line`."""
    return _up_to(table, line, column).split(" ")[-1]


def test_bench_decode_says_where_its_bound_does_not_apply():
    """A configuration that moves no bytes, or too few for the bandwidths to matter (the
    demo model's), or that reads through the page cache, gets "n/a" and a footnote that
    says why instead of a ratio to a bound that is only the resident speed (and lands
    above 1 as often as below); the JSON keeps the numbers and says whether it applies."""
    from moestream.daemon.bench.decode import BOUND_MIN_MOVE_SHARE, format_report

    report = _decode_report(page_cache=None)
    rows = {r["name"]: r for r in report["results"]}
    assert [r["bound_why_not"] for r in report["results"]] == ["no_bytes", "no_bytes", "few_bytes", None]
    assert [r["bound_applies"] for r in report["results"]] == [False, False, False, True]
    assert rows["moestream@1"]["fraction_of_bound"] == pytest.approx(1.2)  # kept, not shown
    assert 0 < rows["moestream@0.5"]["bound_move_share"] < BOUND_MIN_MOVE_SHARE
    assert rows["moestream@0.25"]["bound_move_share"] == pytest.approx(0.5)
    lines = format_report(report).splitlines()
    table = lines[1:6]
    # Every column lines up: cells without a value are padded like the rest.
    assert len({len(line) for line in table}) == 1, table
    by_name = {line.split()[0]: line for line in table[1:]}
    for name in ("stock-mlx-lm", "moestream@1"):
        assert _up_to(table, by_name[name], "bound").endswith(" n/a 1")
    assert _up_to(table, by_name["moestream@0.5"], "bound").endswith(" n/a 2")
    for line in table[1:]:
        for column in ("of bound", "paired", "of best"):
            cell = _cell(table, line, column)
            assert cell == "-" or float(cell) <= 1.0, (column, line)
    row = by_name["moestream@0.25"]
    assert _cell(table, row, "bound") == "10.0" and _cell(table, row, "of bound") == "0.80" and "n/a" not in row
    assert lines[6].startswith("n/a 1: stock-mlx-lm, moestream@1: no bytes moved per token")
    assert lines[7].startswith("n/a 2: moestream@0.5: moving their bytes takes under 5% of a token")
    # Through the page cache, the read bandwidth says nothing about the reads: no bound
    # where the store was read, the link's still where only the link moved bytes.
    cached = _decode_report(page_cache="the filesystem refuses direct I/O")
    assert [r["bound_why_not"] for r in cached["results"]] == ["no_bytes", "no_bytes", "page_cache", "page_cache"]
    text = format_report(cached)
    assert "disk 953.7 MiB/s (through the page cache)" in text.splitlines()[0]
    assert (
        "n/a 2: moestream@0.5, moestream@0.25: the store was read through the page cache (the filesystem "
        "refuses direct I/O)"
    ) in text
    link_only = _decode_row("moestream@0.5+host", 0.5, 10.0, 0.0, 1e9)
    from moestream.daemon.bench.decode import add_bound

    add_bound(link_only, cached["results"][0], read_bandwidth=1e9, link_bandwidth=1e10, page_cache="refused")
    assert link_only["bound_applies"]


def test_bound_is_reported_against_the_median_each_round_and_the_fastest_round():
    from moestream.daemon.bench.decode import add_bound

    resident = {"tokens_per_s": 75.0, "tokens_per_s_runs": [50.0, 100.0]}
    # 10 ms per token over the link on top of resident compute.
    row = {
        "tokens_per_s": 25.0,
        "tokens_per_s_runs": [20.0, 30.0],
        "disk_bytes_per_token": 0.0,
        "host_to_pool_bytes_per_token": 1e9,
    }
    add_bound(row, resident, read_bandwidth=1e9, link_bandwidth=1e11)
    assert row["bound_tokens_per_s"] == pytest.approx(1 / (1 / 75 + 0.01))
    assert row["fraction_of_bound"] == pytest.approx(25 * (1 / 75 + 0.01))
    assert row["fraction_of_bound_paired"] == pytest.approx(0.6)  # 20 of 33.3, 30 of 50
    assert row["best_bound_tokens_per_s"] == pytest.approx(50.0)
    assert row["fraction_of_best_bound"] == pytest.approx(0.5)
    assert row["vs_resident_paired"] == pytest.approx(0.35)  # median of 0.4 and 0.3
    assert row["bound_applies"] and row["bound_why_not"] is None  # 10 ms of link in a 23 ms token


def test_bench_decode_times_a_json_schema_request_beside_the_same_request_unconstrained(store):
    """`--constrained`: each streaming configuration decodes a json_schema request and the
    same request unconstrained through the generation loop in every round; the report
    gives both speeds, their paired cost and the grammar's own time per token."""
    from moestream.daemon.bench.decode import BenchDecodeSettings, format_report, run_bench_decode

    report = run_bench_decode(
        BenchDecodeSettings(
            store=store, capacities=(1.0, 0.25), prompt_tokens=3, decode_tokens=6, rounds=2, constrained=True
        )
    )
    rows = {r["name"]: r for r in report["results"]}
    assert report["constrained"] is True
    for name in ("moestream@1", "moestream@0.25"):
        j = rows[name]["json_schema"]
        assert j["tokens_per_s"] > 0 and j["unconstrained_tokens_per_s"] > 0 and len(j["cost_runs"]) == 2, j
        assert j["mask_ms_per_token"] > 0 and j["compile_ms"] > 0 and 0 < j["mask_share"] < 1, j
    assert "json_schema" not in rows["stock-mlx-lm"] and "json_schema" not in rows["naive-on-demand"]
    assert "a json_schema request against the same request unconstrained" in format_report(report)
