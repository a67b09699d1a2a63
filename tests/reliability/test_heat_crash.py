"""Crash safety of the heat file: kill -9 of the heat keeper, of a process that owns a
HeatPublisher, and of the real daemon, at random moments while pool_usage.json is being
rewritten. After every kill the file parses, never goes backwards, and holds at least
what was reported written (small counts; `moestreamctl bench soak --kills 500`).

A full disk under a running daemon: writes fail loudly in `status`, the old file stays
intact, requests go on being served, and the counts reach the file once there is room.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Iterator

import pytest
from tmpfs import fill, mounted_tmpfs

from moestream.client.client import Client
from moestream.daemon.bench.soak import heat_kills
from moestream.shared.heat_file import parse_usage, temp_files, usage_path

from .conftest import CASES


@pytest.fixture
def heat_dirs(workdir: Path) -> tuple[Path, Path]:
    (workdir / "s").mkdir()
    (workdir / "r").mkdir(mode=0o700)
    return workdir / "s", workdir / "r"


def test_kill9_keeper_and_stand_in_daemon(heat_dirs):
    store, runtime = heat_dirs
    k = heat_kills.keeper_kills(store, runtime, 10, random.Random(11))
    assert k["invalid_files"] == 0 and k["violations"] == 0, k["examples"]
    assert k["final_write_ok"] and k["temp_files_left"] == 0
    assert k["counts_lost"] <= k["counts_lost_reported"]  # the daemon never under-reports a loss
    s = heat_kills.stand_in_kills(store, runtime, 6, random.Random(12))
    assert s["invalid_files"] == 0 and s["violations"] == 0, s["examples"]


def test_kill9_real_daemon_while_serving(store_copy, workdir):
    r = heat_kills.daemon_kills(store_copy, workdir / "rk", 2, random.Random(13))
    assert r["invalid_files"] == 0 and r["violations"] == 0, r["examples"]
    assert r["final_total"] > 0, "the killed daemons' routing counts must reach the file"


@pytest.fixture
def small_tmpfs(rel_store) -> Iterator[Path]:
    size = sum(p.stat().st_size for p in rel_store.rglob("*") if p.is_file())
    with mounted_tmpfs(size + 512 * 1024, "msfull") as mnt:
        yield mnt


def test_full_disk_under_a_running_daemon(small_tmpfs, rel_store, start_daemon, rel_reference):
    store = Path(shutil.copytree(rel_store, small_tmpfs / "store", ignore=shutil.ignore_patterns("pool_usage.json*")))
    path = usage_path(store)
    daemon = start_daemon(store, env={"MOESTREAM_HEAT_FLUSH_SECONDS": "0.1"})
    with Client(daemon.paths, timeout=30) as c:
        c.complete(CASES[0][0], max_tokens=8)
        _wait(lambda: path.exists() and c.status().heat["last_flush_ok"], "a first heat write")
        old = path.read_bytes()
        fill(small_tmpfs)
        for case in CASES[:4]:  # served exactly while heat cannot be written
            result = c.complete(case[0], max_tokens=case[1])
            assert tuple(result.tokens) == rel_reference[case].tokens
        _wait(lambda: c.status().heat["last_flush_ok"] is False, "a failed heat write")
        heat = c.status().heat
        assert "No space left on device" in heat["last_error"] and str(path) in heat["last_error"]
        assert path.read_bytes() == old and temp_files(path) == []
        assert heat["alive"], "the keeper survives a failed write"

        (small_tmpfs / "filler").unlink()
        _wait(lambda: c.status().heat["last_flush_ok"] is True, "heat writes to succeed again")
        assert sum(sum(d.values()) for d in parse_usage(path.read_bytes()).values()) > sum(
            sum(d.values()) for d in parse_usage(old).values()
        ), "the counts kept in memory during the full disk reach the file"
    assert daemon.stop() == 0


def _wait(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)
