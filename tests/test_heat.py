"""Heat: the heat file, the keeper process and the daemon's publisher, with real
processes, real ipc sockets and real files (a real full tmpfs for the disk-full case)."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import msgpack
import numpy as np
import psutil
import pytest
import zmq
from tmpfs import fill, mounted_tmpfs

from moestream.daemon.bench.soak.heat_kills import durable_marks
from moestream.daemon.heat_publisher import HeatPublisher
from moestream.shared.heat_file import (
    HeatWriteError,
    UsageCounts,
    hottest,
    parse_usage,
    read_usage,
    temp_files,
    usage_path,
    write_usage,
)

LOG = logging.getLogger("test_heat")


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    """(store, runtime): short paths under /tmp, because ipc socket paths are limited."""
    root = Path(tempfile.mkdtemp(prefix="ht", dir="/tmp"))
    (root / "s").mkdir()
    (root / "r").mkdir(mode=0o700)
    yield root / "s", root / "r"
    shutil.rmtree(root)


@pytest.fixture
def publisher() -> Iterator[Callable[..., HeatPublisher]]:
    """`publisher(store, runtime, **kw)`; whatever a failing test leaves open is closed."""
    made: list[HeatPublisher] = []

    def make(store: Path, runtime: Path, **kw) -> HeatPublisher:
        kw.setdefault("flush_seconds", 60.0)
        made.append(HeatPublisher(store, runtime, log=LOG, **kw))
        return made[-1]

    yield make
    for pub in made:
        pub.close(5.0)


def add(total: UsageCounts, counts: dict[int, np.ndarray]) -> None:
    for layer, values in counts.items():
        for expert, c in enumerate(values.tolist()):
            if c:
                total.setdefault(layer, {})
                total[layer][expert] = total[layer].get(expert, 0) + c


def nonzero(counts: UsageCounts) -> UsageCounts:
    return {l: {e: c for e, c in d.items() if c} for l, d in counts.items() if any(d.values())}


def total_of(counts: UsageCounts) -> int:
    return sum(sum(d.values()) for d in counts.values())


def file_counts(store: Path) -> UsageCounts:
    """The heat file's counts; fails the test if the file is not valid."""
    return parse_usage(usage_path(store).read_bytes())


def random_counts(rng: np.random.Generator, layers: int = 6, experts: int = 32) -> dict[int, np.ndarray]:
    return {l: rng.integers(0, 4, experts) for l in range(layers) if rng.random() < 0.8}


def wait_for(cond: Callable[[], bool], timeout: float, what: str, every: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        if every is not None:
            every()
        time.sleep(0.005)


def wait_ready(pub: HeatPublisher, timeout: float = 10.0) -> int:
    wait_for(lambda: pub.health()["ready"], timeout, "the heat keeper to be ready", every=pub.check)
    return pub.health()["pid"]


# -- the file ---------------------------------------------------------------------


def test_write_read_roundtrip_and_hottest(dirs):
    store, _ = dirs
    path = usage_path(store)
    assert read_usage(path).counts == {} and read_usage(path).problem is None  # missing: empty, no problem
    counts = {3: {0: 5, 7: 9, 2: 9, 4: 0}, 0: {1: 1}}
    write_usage(path, counts)
    assert json.loads(path.read_text()) == {"0": {"1": 1}, "3": {"0": 5, "2": 9, "7": 9}}
    loaded = read_usage(usage_path(store))
    assert loaded.problem is None and loaded.counts == nonzero(counts) and loaded.total == 24
    assert hottest(loaded.counts, 3, 2) == [2, 7]  # ties broken by expert id
    assert hottest(loaded.counts, 3, 10) == [2, 7, 0]  # never-routed experts are not pinned
    assert hottest(loaded.counts, 9, 4) == [] and hottest(loaded.counts, 3, 0) == []
    with pytest.raises(ValueError, match="count -1"):
        write_usage(path, {0: {1: -1}})
    assert json.loads(path.read_text())["3"]["7"] == 9 and temp_files(path) == []


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"", "not valid JSON"),
        (b'{"0": {"1": 3}', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "top level is a JSON list"),
        (b'{"0": [1, 2]}', "expected an object of experts"),
        (b'{"0": {"1": -5}}', "not a non-negative integer"),
        (b'{"0": {"1": 2.5}}', "not a non-negative integer"),
        (b'{"0": {"1": true}}', "not a non-negative integer"),
        (b'{"0": {"1": "7"}}', "not a non-negative integer"),
        (b'{"x": {"1": 1}}', "layer key 'x'"),
        (b'{"01": {"1": 1}}', "layer key '01'"),
        (b'{"0": {"-1": 1}}', "expert key '-1'"),
        (b'{"0": {"99999999": 1}}', "expert key"),
        (b'{"0": {"1": 9223372036854775808}}', "not a non-negative integer"),
    ],
)
def test_corrupt_file_is_set_aside_and_reported(dirs, raw, why):
    store, _ = dirs
    path = usage_path(store)
    path.write_bytes(raw)
    loaded = read_usage(path)
    assert loaded.counts == {}
    assert loaded.problem is not None and why in loaded.problem and str(path) in loaded.problem
    assert loaded.set_aside is not None and loaded.set_aside.name.startswith("pool_usage.json.corrupt-")
    assert loaded.set_aside.read_bytes() == raw
    assert not path.exists()
    assert read_usage(path).problem is None  # the next start is clean


# -- the keeper through the publisher --------------------------------------------


def test_counts_sum_exactly_across_flushes_and_restart(dirs, publisher):
    store, runtime = dirs
    rng = np.random.default_rng(0)
    expected: UsageCounts = {}
    pub = publisher(store, runtime)
    assert pub.start()
    for _ in range(3):
        for _ in range(20):
            c = random_counts(rng)
            assert pub.push(c)
            add(expected, c)
        assert pub.flush(5.0)
        assert file_counts(store) == nonzero(expected)
    assert pub.close(5.0)
    assert pub.health()["dropped_counts"] == 0
    assert list(runtime.iterdir()) == []  # socket files removed

    # A new keeper continues from the file; this one also writes every 5 batches.
    loaded_total = total_of(expected)
    pub = publisher(store, runtime, flush_batches=5)
    assert pub.start()
    assert pub.health()["load_problem"] is None
    pushed = 0
    for i in range(12):
        c = random_counts(rng)
        assert pub.push(c)
        add(expected, c)
        pushed += int(sum(v.sum() for v in c.values()))
        if i == 4:
            wait_for(lambda: file_counts(store) == nonzero(expected), 5.0, "the write after 5 batches")
    assert pub.close(5.0)
    assert file_counts(store) == nonzero(expected)
    h = pub.health()
    assert h["dropped_counts"] == 0 and h["sent_counts"] == pushed and h["unconfirmed_counts"] == 0
    assert h["keeper"]["loaded_total"] == loaded_total and h["keeper"]["writes_failed"] == 0


def test_kill9_keeper_midrun_restarts_and_reports_drops(dirs, publisher):
    store, runtime = dirs
    rng = np.random.default_rng(1)
    pub = publisher(store, runtime, backoff=(0.05, 1.0))
    assert pub.start()
    durable: UsageCounts = {}
    for _ in range(10):
        c = random_counts(rng)
        assert pub.push(c)
        add(durable, c)
    assert pub.flush(5.0)
    lost = 0
    for _ in range(10):  # received by the keeper, never written
        c = random_counts(rng)
        assert pub.push(c)
        lost += int(sum(v.sum() for v in c.values()))
    pid = pub.health()["pid"]
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, left for the publisher to reap
    assert file_counts(store) == nonzero(durable)  # never behind the last completed write
    for _ in range(5):  # while it is down: dropped, never waited for
        c = random_counts(rng)
        started = time.monotonic()
        pub.push(c)
        assert time.monotonic() - started < 0.05
        lost += int(sum(v.sum() for v in c.values()))
    new_pid = wait_ready(pub)
    assert new_pid != pid
    h = pub.health()
    assert h["restarts"] == 1 and h["exit_codes"] == [-9] and "killed by signal 9" in h["last_error"]
    assert h["keeper"] == {} or h["keeper"]["pid"] == new_pid
    for _ in range(10):
        c = random_counts(rng)
        assert pub.push(c)
        add(durable, c)
    assert pub.flush(5.0)
    assert pub.health()["keeper"]["loaded_total"] > 0
    assert pub.close(5.0)
    assert file_counts(store) == nonzero(durable)
    assert pub.health()["dropped_counts"] == lost


# Kills per run: six in the default run, 50 with `-m slow`.
KILLS = [6, pytest.param(50, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kills", KILLS)
def test_kill9_keeper_while_it_writes_many_times(dirs, publisher, kills):
    store, runtime = dirs
    path = usage_path(store)
    rng = np.random.default_rng(2)
    # A big file, rewritten every 2 ms while counts keep coming: most kills land mid-write.
    seed = {l: {e: int(c) for e, c in enumerate(rng.integers(1, 10**6, 384))} for l in range(32)}
    write_usage(path, seed)
    seed_total = total_of(seed)
    pub = publisher(store, runtime, flush_seconds=0.002, backoff=(0.01, 0.01))
    assert pub.start()
    accepted = refused = 0
    previous = seed_total
    mid_write = 0
    for _ in range(kills):
        pid = wait_ready(pub)
        until = time.monotonic() + random.uniform(0.003, 0.02)
        while time.monotonic() < until:
            c = {int(rng.integers(32)): rng.integers(0, 3, 384)}
            n = int(sum(v.sum() for v in c.values()))
            if pub.push(c):
                accepted += n
            else:
                refused += n
            time.sleep(0.0005)
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        mid_write += bool(temp_files(path))  # the next keeper removes them
        counts = file_counts(store)
        assert set(counts) == set(range(32))
        now = total_of(counts)
        assert previous <= now <= seed_total + accepted
        previous = now
    wait_ready(pub)
    assert pub.close(5.0)
    final = total_of(file_counts(store))
    lost = pub.health()["dropped_counts"] - refused
    assert seed_total + accepted - lost <= final <= seed_total + accepted
    assert temp_files(path) == []
    LOG.info("kills that landed mid-write: %d of %d", mid_write, kills)
    assert mid_write >= kills // 10, (
        f"only {mid_write} of {kills} kills landed mid-write: the test is not testing what it claims"
    )


def test_durable_marks_take_only_complete_lines():
    """A stand-in killed mid-write leaves a partial last line; it must not count (nor
    break the parse, as it once did in CI)."""
    assert durable_marks("ready 12 1\ndurable 4\ndurable 8\ndurable") == [4, 8]
    assert durable_marks("durable 4\ndurable 1") == [4]
    assert durable_marks("durable \n") == []


@pytest.mark.parametrize("kills", KILLS)
def test_kill9_daemon_while_keeper_writes_many_times(dirs, kills):
    """The real path: SIGKILL the process that owns the publisher. Its keeper notices
    (getppid), takes what was queued, writes once more and exits; the file stays valid."""
    store, runtime = dirs
    rng = np.random.default_rng(3)
    write_usage(
        usage_path(store), {l: {e: int(c) for e, c in enumerate(rng.integers(1, 1000, 256))} for l in range(16)}
    )
    per_message, limit = 4 * 256, 200
    previous = total_of(file_counts(store))

    def spawn() -> subprocess.Popen:
        # The stand-in daemon: the daemon's heat publisher alone (shared with `bench soak`).
        cmd = [sys.executable, "-m", "moestream.daemon.bench.soak.heat_kills", str(store), str(runtime), str(limit)]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    following = spawn()
    try:
        for i in range(kills):
            daemon, following = following, None
            try:
                daemon.stdin.write("go\n")
                daemon.stdin.flush()
                assert select.select([daemon.stdout], [], [], 20.0)[0], "stand-in daemon did not start"
                word, keeper_pid, ready = daemon.stdout.readline().split()
                assert word == "ready" and ready == "1"
                if i < kills - 1:
                    following = spawn()  # its imports overlap this round
                time.sleep(random.uniform(0.005, 0.05))
            finally:
                daemon.kill()
                daemon.wait()
            try:
                keeper = psutil.Process(int(keeper_pid))
            except psutil.NoSuchProcess:
                keeper = None

            def keeper_gone() -> bool:
                try:
                    return keeper is None or not keeper.is_running() or keeper.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    return True

            try:
                # Generous: on a loaded 2-core CI machine the keeper's 50 ms parent check
                # and its final write can be scheduled late.
                wait_for(
                    keeper_gone,
                    15.0,
                    f"orphaned keeper {keeper_pid} to exit (round {i})",
                )
            except AssertionError:
                keeper.kill()  # do not leave it running after the failure
                raise
            durable = durable_marks(daemon.stdout.read())
            daemon.stdout.close()
            daemon.stdin.close()
            now = total_of(file_counts(store))
            assert previous + per_message * max(durable, default=0) <= now <= previous + per_message * limit
            assert temp_files(usage_path(store)) == []
            previous = now
    finally:
        if following is not None:
            following.kill()
            following.wait()


def test_keeper_sets_corrupt_file_aside_and_restarts_from_zero(dirs, publisher):
    store, runtime = dirs
    path = usage_path(store)
    raw = b'{"0": {"1": 12}, "1": "oops"}'
    path.write_bytes(raw)
    pub = publisher(store, runtime)
    assert pub.start()
    h = pub.health()
    assert h["load_problem"] and "corrupt" in h["load_problem"] and str(path) in h["load_problem"]
    aside = list(store.glob("pool_usage.json.corrupt-*"))
    assert [str(p) for p in aside] == [h["set_aside"]] and aside[0].read_bytes() == raw
    assert pub.push({0: np.array([0, 2, 0, 1])})
    assert pub.close(5.0)
    assert file_counts(store) == {0: {1: 2, 3: 1}}


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    with mounted_tmpfs(64 * 1024, "hf") as mnt:
        yield mnt


def test_full_disk_fails_loudly_keeps_old_file_and_counts(small_tmpfs, publisher):
    store = small_tmpfs / "s"
    store.mkdir()
    runtime = Path(tempfile.mkdtemp(prefix="hr", dir="/tmp"))
    path = usage_path(store)
    rng = np.random.default_rng(4)
    seed = {l: {e: int(c) for e, c in enumerate(rng.integers(1, 1000, 64))} for l in range(8)}
    write_usage(path, seed)
    pub = publisher(store, runtime)
    try:
        assert pub.start()
        fill(small_tmpfs)  # every free page
        old = path.read_bytes()
        expected = {l: dict(d) for l, d in seed.items()}
        c = {l: rng.integers(1, 5, 64) for l in range(8)}
        assert pub.push(c)
        add(expected, c)

        assert not pub.flush(5.0)
        h = pub.health()
        assert h["alive"] and h["last_flush_ok"] is False and h["keeper"]["writes_failed"] == 1
        assert "No space left on device" in h["last_error"] and str(path) in h["last_error"]
        assert path.read_bytes() == old and temp_files(path) == []

        with pytest.raises(HeatWriteError) as err:  # the function itself, directly
            write_usage(path, expected)
        assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
        assert str(path) in str(err.value) and "previous heat file is unchanged" in str(err.value)
        assert path.read_bytes() == old and temp_files(path) == []

        (small_tmpfs / "filler").unlink()
        assert pub.flush(5.0)  # the counts stayed in memory
        assert file_counts(store) == expected
    finally:
        closed = pub.close(5.0)
        shutil.rmtree(runtime)
    assert closed and pub.health()["dropped_counts"] == 0
    assert sorted(p.name for p in store.iterdir()) == ["pool_usage.json", "pool_usage.json.lock"]


# -- the keeper on its own, fed by hand -------------------------------------------


def _recv(sock: zmq.Socket, kind: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        msg = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
        if msg["type"] == kind:
            return msg
    raise AssertionError(f"no {kind!r} from the keeper within {timeout}s")


def _pack(**msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def test_keeper_counts_malformed_messages_and_survives(dirs):
    store, runtime = dirs
    ctx = zmq.Context()
    push, acks = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{runtime}/d.sock")
    acks.bind(f"ipc://{runtime}/a.sock")
    keeper_cmd = [
        sys.executable, "-m", "moestream.daemon.heat_keeper", "--endpoint", f"ipc://{runtime}/d.sock",
        "--ack-endpoint", f"ipc://{runtime}/a.sock", "--store", str(store), "--flush-seconds", "60",
    ]  # fmt: skip
    keeper = subprocess.Popen(keeper_cmd)
    try:
        assert _recv(acks, "hello")["pid"] == keeper.pid
        wait_for(lambda: _try_send(push, _pack(v=1, type="ping")), 5.0, "the data pipe")
        r = random.Random(5)
        bad = [bytes(r.randrange(256) for _ in range(r.randrange(1, 64))) for _ in range(200)]
        le = np.array([1, 2, 3], "<i8").tobytes()
        bad += [
            b"",
            b"\x91" * 100_000,  # nested too deep
            b"\x81\x91\x01\x02",  # a map keyed by a list
            _pack(v=2, type="counts", seq=1, layers={0: le}),
            _pack(v=1),
            _pack(v=1, type="bogus"),
            msgpack.packb([1, 2, 3]),
            _pack(v=1, type="counts", layers={0: le}),
            _pack(v=1, type="counts", seq=-1, layers={0: le}),
            _pack(v=1, type="counts", seq="3", layers={0: le}),
            _pack(v=1, type="counts", seq=1, layers=[le]),
            _pack(v=1, type="counts", seq=1, layers={"0": le}),
            _pack(v=1, type="counts", seq=1, layers={-1: le}),
            _pack(v=1, type="counts", seq=1, layers={0: "abc"}),
            _pack(v=1, type="counts", seq=1, layers={0: le[:7]}),
            _pack(v=1, type="counts", seq=1, layers={0: np.array([1, -1], "<i8").tobytes()}),
            _pack(v=1, type="counts", seq=1, layers={0: [1, -2]}),
            _pack(v=1, type="counts", seq=1, layers={0: [1, 2.5]}),
            _pack(v=1, type="counts", seq=1, layers={0: [True]}),
            _pack(v=1, type="counts", seq=1, layers={0: [1 << 41]}),
            _pack(v=1, type="counts", seq=1, layers={5: [4], 6: [-4]}),  # all or nothing
            _pack(v=1, type="flush"),
            _pack(v=1, type="flush", token="x"),
        ]
        for frame in bad:
            push.send(frame)
        push.send_multipart([_pack(v=1, type="stop"), b"extra"])  # two frames: malformed, not a stop
        malformed = len(bad) + 1
        push.send(_pack(v=1, type="counts", seq=1, layers={0: le, 2: [0, 0, 7]}))
        push.send(_pack(v=1, type="flush", token=7))
        report = _recv(acks, "report")
        assert report["token"] == 7 and report["ok"] and keeper.poll() is None
        assert report["stats"]["malformed"] == malformed and report["stats"]["counts_received"] == 13
        assert file_counts(store) == {0: {0: 1, 1: 2, 2: 3}, 2: {2: 7}}

        push.send(_pack(v=1, type="counts", seq=2, layers={2: [0, 0, 1]}))
        time.sleep(0.1)
        keeper.send_signal(signal.SIGTERM)  # writes what it has, then exits 0
        assert keeper.wait(10) == 0
        assert _recv(acks, "report")["reason"] == "SIGTERM"
        assert file_counts(store) == {0: {0: 1, 1: 2, 2: 3}, 2: {2: 8}}
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()
        push.close(linger=0)
        acks.close(linger=0)
        ctx.term()


def _keeper(store: Path, runtime: Path, name: str, ctx: zmq.Context) -> tuple[subprocess.Popen, zmq.Socket, zmq.Socket]:
    """A keeper of `store` on sockets of its own (as each daemon has), its pipe connected."""
    push, acks = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{runtime}/{name}d.sock")
    acks.bind(f"ipc://{runtime}/{name}a.sock")
    cmd = [
        sys.executable, "-m", "moestream.daemon.heat_keeper", "--endpoint", f"ipc://{runtime}/{name}d.sock",
        "--ack-endpoint", f"ipc://{runtime}/{name}a.sock", "--store", str(store), "--flush-seconds", "60",
        "--lock-timeout", "0.2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    return proc, push, acks


def test_a_keeper_without_the_lock_keeps_its_counts_and_adds_them_once_it_is_free(dirs):
    """Two daemons on one store: the second's keeper writes a pending file of its own,
    and whichever keeper takes the lock next adds it to the heat file."""
    store, runtime = dirs
    ctx = zmq.Context()
    procs, socks = [], []

    def start(name: str) -> tuple[subprocess.Popen, zmq.Socket, zmq.Socket, dict]:
        proc, push, acks = _keeper(store, runtime, name, ctx)
        procs.append(proc)
        socks.extend((push, acks))
        hello = _recv(acks, "hello")
        wait_for(lambda: _try_send(push, _pack(v=1, type="ping")), 5.0, "the data pipe")
        return proc, push, acks, hello

    def flush(push: zmq.Socket, acks: zmq.Socket, token: int) -> dict:
        push.send(_pack(v=1, type="flush", token=token))
        report = _recv(acks, "report")
        assert report["ok"] and report["token"] == token, report
        return report

    try:
        first, push1, acks1, hello = start("k1")
        assert hello["lock_wait"] is None and hello["pending"] is None
        push1.send(_pack(v=1, type="counts", seq=1, layers={0: [1, 2]}))
        flush(push1, acks1, 1)
        assert file_counts(store) == {0: {0: 1, 1: 2}}

        second, push2, acks2, hello = start("k2")
        assert f"pid {first.pid}" in hello["lock_wait"] and hello["pending"], hello
        push2.send(_pack(v=1, type="counts", seq=1, layers={0: [0, 0, 5]}))
        report = flush(push2, acks2, 1)
        pending = Path(report["pending"])
        assert report["durable_counts"] == 5 and parse_usage(pending.read_bytes()) == {0: {2: 5}}
        assert file_counts(store) == {0: {0: 1, 1: 2}}  # not the second keeper's to write
        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0 and parse_usage(pending.read_bytes()) == {0: {2: 5}}
        socks.remove(push2)
        socks.remove(acks2)
        push2.close(linger=0)
        acks2.close(linger=0)

        # Two waiting at once, both alive: neither may add the other's pending file.
        third, push3, acks3, hello = start("k3")
        assert hello["lock_wait"] and Path(hello["pending"]) != pending
        push3.send(_pack(v=1, type="counts", seq=1, layers={1: [4]}))
        fourth, push4, acks4, _ = start("k4")
        push4.send(_pack(v=1, type="counts", seq=1, layers={1: [0, 3]}))
        flush(push4, acks4, 1)  # its pending file is on disk
        first.send_signal(signal.SIGTERM)
        assert first.wait(10) == 0
        # The lock is free: one of them takes it and adds the second's (orphaned) pending
        # file and its own counts, not the other live keeper's.
        winner = _first_report(store, {third: acks3, fourth: acks4}, "lock")
        loser = fourth if winner is third else third
        both = {0: {0: 1, 1: 2, 2: 5}, 1: {0: 4, 1: 3}}
        alone = {0: {0: 1, 1: 2, 2: 5}, 1: {0: 4} if winner is third else {1: 3}}
        assert file_counts(store) == alone
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(10) == 0
        _first_report(store, {loser: acks3 if loser is third else acks4}, "lock")
        assert file_counts(store) == both
        loser.send_signal(signal.SIGTERM)
        assert loser.wait(10) == 0
        assert file_counts(store) == both
        assert sorted(p.name for p in store.iterdir()) == ["pool_usage.json", "pool_usage.json.lock"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def _first_report(store: Path, keepers: dict[subprocess.Popen, zmq.Socket], reason: str) -> subprocess.Popen:
    """The keeper whose report for `reason` comes first."""
    poller = zmq.Poller()
    for sock in keepers.values():
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            msg = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
            if msg["type"] == "report" and msg["reason"] == reason:
                assert msg["ok"] and msg["lock_wait"] is None, msg
                return next(proc for proc, s in keepers.items() if s is sock)
    raise AssertionError(f"no keeper of {store} reported {reason!r} within 10 s")


def _try_send(sock: zmq.Socket, frame: bytes) -> bool:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
