"""`moestreamctl bench policy` on the real routing traces.

The traces ship with the tests (tests/data/traces, with their provenance in each
`meta.json`), so a fresh clone runs these tests as they are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from moestream.client.cli import main as cli
from moestream.daemon.policies import POLICIES

REAL_TRACES = ("qwen15moe_gsm8k_dev", "granite31_decode")
TRACES = Path(__file__).resolve().parent / "data" / "traces"


def moestreamctl() -> list[str]:
    script = Path(sys.executable).with_name("moestreamctl")
    if not script.is_file():
        pytest.fail(f"{script} not found: install moestream into this environment")
    return [str(script)]


def test_json_on_the_real_trace_folder() -> None:
    folder = TRACES / REAL_TRACES[0]
    meta = json.loads((folder / "meta.json").read_text())
    records = [json.loads(line) for line in (folder / "trace.jsonl").read_text().splitlines()]
    run = subprocess.run(
        [*moestreamctl(), "bench", "policy", "--trace", str(folder), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)

    n, k, layers = meta["num_experts"], meta["top_k"], meta["num_layers"]
    assert (report["num_experts"], report["top_k"]) == (n, k)
    assert report["layers"] == meta["layer_ids_in_model"]
    assert report["steps"] == len(records)
    assert report["requests"] == len({r["req"] for r in records})
    assert "leave-one-out" in report["prior"]
    assert [r["capacity_fraction"] for r in report["results"]] == [0.25, 0.5]
    for result in report["results"]:
        assert result["slots"] == max(k, int(result["capacity_fraction"] * n + 0.5))
        policies = result["policies"]
        assert set(policies) == set(POLICIES) | {"min"}
        best = policies["min"]
        for name, r in policies.items():
            for field in (
                "hit_rate",
                "decode_hit_rate",
                "per_layer",
                "decode_per_layer",
                "hits",
                "misses",
                "accesses",
                "gap_closed",
            ):
                assert field in r, (name, field)
            assert len(r["per_layer"]) == layers
            assert r["hits"] + r["misses"] == r["accesses"] == len(records) * k * layers
            assert r["hit_rate"] <= best["hit_rate"] + 1e-12, name
            assert all(a <= b + 1e-12 for a, b in zip(r["per_layer"], best["per_layer"]))
            lru = policies["lru"]["hit_rate"]
            assert r["gap_closed"] == pytest.approx((r["hit_rate"] - lru) / (best["hit_rate"] - lru))
        # On real routing, MIN is well above LRU at these capacities.
        assert best["hit_rate"] > policies["lru"]["hit_rate"]
        # Recalling what followed a repeated step (with the lower layers' hint) helps on
        # real routing: induction beats the predictive policy it extends.
        assert policies["induction"]["hit_rate"] > policies["predictive"]["hit_rate"]
        # Similar (not only identical) earlier steps vote too: recall beats induction.
        assert policies["recall"]["hit_rate"] > policies["induction"]["hit_rate"]
        # The prior's hottest, held fixed: counted over the same routed experts; on
        # real routing better than LRU, and never better than MIN.
        static = result["static_hottest"]
        assert static["hits"] + static["misses"] == static["accesses"] == len(records) * k * layers
        assert policies["lru"]["hit_rate"] < static["hit_rate"] < best["hit_rate"]
    assert "lower traced layers" in report["cross_layer"]


def test_static_hits_hold_each_requests_prior_hottest() -> None:
    from moestream.daemon.bench.policy.replay import static_hits

    steps = [(0, 1), (1, 2), (2, 3), (0, 3)]
    phases = ["prefill", "decode", "prefill", "decode"]
    # Request one (steps 0-1) holds {1, 2}; request two (steps 2-3) holds {0, 3}.
    priors = {0: [0, 5, 4, 1], 2: [3, 0, 1, 3]}
    counts = static_hits(steps, phases, priors, slots=2)
    assert (counts.hits["prefill"], counts.misses["prefill"]) == (1 + 1, 1 + 1)
    assert (counts.hits["decode"], counts.misses["decode"]) == (2 + 2, 0)


# The JSON test replays the first trace already: the table's default run takes the
# second, `-m slow` both.
@pytest.mark.parametrize(
    "name", [pytest.param(REAL_TRACES[0], marks=pytest.mark.slow), REAL_TRACES[1]], ids=lambda name: name
)
def test_table_and_capacities_on_each_real_trace(name: str) -> None:
    runner = CliRunner()
    trace = TRACES / name / "trace.jsonl"
    result = runner.invoke(
        cli,
        ["bench", "policy", "--trace", str(trace), "--capacity", "0.5", "--capacity", "0.75", "--prior", "none"],
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "capacity 0.5 (" in out and "capacity 0.75 (" in out
    assert "capacity 0.25" not in out
    assert "prior   none" in out
    for policy in [*POLICIES, "min"]:
        assert any(line.startswith(policy + " ") for line in out.splitlines()), policy


@pytest.mark.parametrize(
    "args, message",
    [
        (["--capacity", "1.5"], "not a fraction"),
        (["--capacity", "0"], "not a fraction"),
        (["--prior", "future"], "future"),
    ],
)
def test_bad_options_are_refused(args: list[str], message: str) -> None:
    trace = TRACES / REAL_TRACES[1]
    result = CliRunner().invoke(cli, ["bench", "policy", "--trace", str(trace), *args])
    assert result.exit_code != 0 and message in result.output


def test_folder_without_a_trace_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "policy", "--trace", str(tmp_path)])
    assert result.exit_code != 0
    assert "no trace at" in result.output and "trace.jsonl" in result.output
