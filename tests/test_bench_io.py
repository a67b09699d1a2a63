"""`moestreamctl bench io` on a small synthetic store, against the real fio.

No speed is asserted: only that both sides ran, read what was asked, and reported it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from synthetic_store import make_synthetic_store

from moestream.client.cli import main as cli
from moestream.daemon.bench.io import huge_pages_used

needs_fio = pytest.mark.skipif(
    shutil.which("fio") is None, reason="fio is not installed (apt-get install fio / brew install fio)"
)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 256 KiB experts: enough bytes per run for fio's millisecond clock.
    path = tmp_path_factory.mktemp("bench") / "store"
    make_synthetic_store(path, layers=2, experts=16, tensors=(("w_proj.weight", "uint8", (256 * 1024,)),), seed=4)
    return path


@needs_fio
def test_bench_io_json_reports_engine_and_fio(small_store: Path) -> None:
    result = CliRunner().invoke(
        cli, ["bench", "io", "--store", str(small_store), "--threads", "2", "--samples", "48", "--seed", "3", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["store"] == str(small_store)
    assert (report["threads"], report["samples"], report["rounds"], report["seed"]) == (2, 48, 3, 3)
    assert report["files"] == 2 and report["expert_bytes"] == 256 * 1024 == report["block_bytes"]
    engine, fio = report["engine"], report["fio"]
    assert engine["gbps"] > 0 and fio["gbps"] > 0
    assert len(engine["gbps_runs"]) == len(fio["gbps_runs"]) == 3
    assert all(g > 0 for g in engine["gbps_runs"] + fio["gbps_runs"])
    assert report["ratio"] == pytest.approx(engine["gbps"] / fio["gbps"], rel=0.01)
    assert engine["mode"] in ("direct", "buffered") and fio["mode"] == "direct"
    assert engine["huge_pages"] is huge_pages_used(True)  # macOS: False, its engine has no MADV_HUGEPAGE
    assert (engine["mode"] == "buffered") == bool(engine["fallback_reasons"])
    assert fio["numjobs"] == 2 and fio["ios_per_job"] == 24 and fio["version"].startswith("fio")
    for lat in (engine["read_latency_us"], fio["clat_us"]):
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]


@needs_fio
def test_bench_io_table(small_store: Path) -> None:
    args = ["bench", "io", "--store", str(small_store), "--threads", "1", "--samples", "16", "--rounds", "1"]
    result = CliRunner().invoke(cli, [*args, "--no-huge-pages"])
    assert result.exit_code == 0, result.output
    assert "engine/fio:" in result.output and "4 KiB pages" in result.output
    assert result.output.count("direct") >= 1 and "fio " in result.output


def test_bench_io_without_fio_says_how_to_install_it(
    small_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no fio on it
    result = CliRunner().invoke(cli, ["bench", "io", "--store", str(small_store), "--json"])
    assert result.exit_code != 0
    assert "fio is not installed" in result.output
    assert "apt-get install fio" in result.output and "brew install fio" in result.output


def test_bench_io_on_a_missing_store_fails_clearly(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "io", "--store", str(tmp_path / "none")])
    assert result.exit_code != 0
    assert "does not exist" in result.output
