"""The user README: short, and its reliability table made from a committed soak report."""

from __future__ import annotations

import json
from pathlib import Path

from moestream.daemon.bench.soak.run import reliability_table_markdown

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 220
SOAK_REPORT = ROOT / "tests" / "bench" / "results" / "bench_soak_demo_cpu.json"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_the_reliability_table_is_the_soak_reports():
    """Each figure in the README's table is the committed `bench soak --json` report's
    (regenerate: python -m moestream.daemon.bench.soak.run tests/bench/results/bench_soak_demo_cpu.json)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- reliability-table")
    table = text[text.index("\n", start) + 1 : text.index("<!-- end reliability-table -->")]
    report = json.loads(SOAK_REPORT.read_text())
    assert report["ok"], "the committed soak report failed a check"
    assert table == reliability_table_markdown(report, SOAK_REPORT.name), (
        "README.md's reliability table differs from the soak report: regenerate it"
    )
