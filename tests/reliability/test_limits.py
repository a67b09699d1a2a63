"""Limits that fail one client, never the daemon: idle connections past the file limit,
a client that never reads its replies, a queue filled by one client, many draft models.

Each test runs a real daemon (a child process) and checks afterwards that a greedy
request still gives exactly what `generate --local` gives."""

from __future__ import annotations

import resource
import socket
import time

import pytest
from daemon_cli import wait_for

from moestream.client.client import Client, RequestRejected
from moestream.daemon.bench.soak import attacks
from moestream.daemon.bench.soak.run import _attack_line, _figures

from .conftest import CASES


def _exact(daemon, reference) -> None:
    prompt, max_tokens = CASES[0]
    with Client(daemon.paths, timeout=30) as c:
        done = c.complete(prompt, max_tokens=max_tokens)
    ref = reference[(prompt, max_tokens)]
    assert (done.text, tuple(done.tokens)) == (ref.text, ref.tokens)


def _open_idle(path: str, n: int) -> list[socket.socket]:
    return attacks.open_idle(path, n)


def test_2100_idle_connections_leave_the_daemon_serving(rel_store, rel_reference, start_daemon):
    d = start_daemon(rel_store)
    socks = _open_idle(str(d.paths.socket), 2100)
    try:
        time.sleep(1.0)
        assert d.alive(), d.tail()
        _exact(d, rel_reference)
        with Client(d.paths) as c:
            assert c.status().clients.connected >= 2100
    finally:
        for s in socks:
            s.close()
    assert d.alive(), d.tail()


def test_connections_past_max_connections_get_a_clear_refusal(rel_store, rel_reference, start_daemon):
    d = start_daemon(rel_store, flags={"max_connections": "8"})
    socks = _open_idle(str(d.paths.socket), 12)
    try:
        time.sleep(0.5)
        with pytest.raises(RequestRejected) as e:
            with Client(d.paths, timeout=5) as c:
                c.ping()
        assert e.value.code == "busy" and "max_connections" in e.value.message
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    _exact(d, rel_reference)


def test_connections_past_the_file_limit_are_shut_not_fatal(rel_store, rel_reference, start_daemon):
    d = start_daemon(rel_store)
    # Room for about 500 connections, and a burst of 512 beyond them (daemon/limits.py).
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (1400, 1400))
    socks = []
    try:
        # Near the limit the socket file is renamed away: a connect then finds nothing.
        # One connect a millisecond, as the churn below reconnects: libzmq accepts on a
        # thread of its own, and a client faster than the daemon's I/O thread's wake-up on
        # a loaded machine outruns the BURST_FDS margin (daemon/limits.py says so).
        with pytest.raises(FileNotFoundError):
            for _ in range(1500):
                socks.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                socks[-1].connect(str(d.paths.socket))
                time.sleep(0.001)
        assert 500 < len(socks) < 1400
        assert d.paths.paused_socket.exists()
        assert d.alive(), d.tail()
        with pytest.raises(RequestRejected) as e:  # a new client hears busy
            with Client(d.paths, timeout=1) as c:
                c.ping()
        assert e.value.code == "busy" and "no new connections" in e.value.message
        for s in socks[:1000]:
            s.close()
        # Back once enough have closed.
        deadline = time.monotonic() + 10
        while not d.paths.socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _exact(d, rel_reference)
        assert "near the open-file limit" in d.paths.log.read_text()
    finally:
        for s in socks:
            s.close()


def test_connection_churn_past_the_file_room_is_refused_not_fatal(rel_store, rel_reference, start_daemon):
    """1,500 sockets reconnecting 1 ms after each refusal against a daemon with room for
    about 200 connections: it aborted inside libzmq's accept (EMFILE) within seconds.
    Now a new client hears busy (or a pong), never silence, and the daemon serves on."""
    d = start_daemon(rel_store)
    report = attacks.connection_churn(d, rel_reference, 1500, 3.0)
    assert d.alive(), d.tail()
    assert report["ok"], report
    clients = report["clients"]
    # The setting (4096) lowered to the room the file limit leaves; the socket renamed
    # away while the churn held every file, and back once it ended.
    assert clients["max_connections"] < attacks.CHURN_FILE_LIMIT - 512, clients
    assert clients["paused_accepting"] >= 1 and clients["accepting"], clients
    assert clients["refused_busy"] > 0, clients
    assert not d.paths.paused_socket.exists()


def test_a_fixed_routing_id_is_served_again_after_a_disconnect_mid_stream(rel_store, rel_reference, start_daemon):
    """A client with a routing id of its own (ZMQ_ROUTING_ID) leaves in the middle of a
    stream and connects again under the same id: it is served (it was ignored for good)."""
    import zmq

    from moestream.shared import protocol as proto

    d = start_daemon(rel_store)
    prompt, max_tokens = CASES[0]
    ctx = zmq.Context()

    def connect() -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"fixed-id")
        s.connect(d.paths.endpoint)
        return s

    def until(s: zmq.Socket, kind: type) -> proto.Reply:
        while True:
            assert s.poll(30_000), f"no {kind.__name__} within 30 s"
            reply = proto.decode_reply(s.recv())
            if isinstance(reply, kind):
                return reply

    no_end = proto.SamplingControls(logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))
    try:
        s = connect()
        s.send(proto.encode(proto.Generate(id="a", prompt=prompt, max_tokens=400, sampling=no_end)))
        until(s, proto.Token)
        s.close()

        def disconnected() -> bool:
            with Client(d.paths) as c:
                return c.status().requests.disconnected == 1

        wait_for(disconnected, 30, "the daemon to stop the request")
        s = connect()
        s.send(proto.encode(proto.Generate(id="b", prompt=prompt, max_tokens=max_tokens)))
        done = until(s, proto.Done)
        assert tuple(done.tokens) == rel_reference[(prompt, max_tokens)].tokens
        s.close()
    finally:
        ctx.term()


def _check_flood(daemon, reference, seconds: float, limit_mib: float) -> None:
    start, end = attacks.flood_without_reading(daemon, seconds)
    assert daemon.alive(), daemon.tail()
    assert end - start < limit_mib * 2**20, f"RSS grew {(end - start) / 2**20:.1f} MiB in {seconds} s"
    log = daemon.paths.log.read_text()
    assert log.count("not reading its replies") == 1, log[-3000:]
    _exact(daemon, reference)


def test_a_client_that_never_reads_is_dropped_and_memory_stays_flat(rel_store, rel_reference, start_daemon):
    # Unbounded, the queue grows about 1.2 MiB/s at this pace (9.5 MiB in 8 s measured).
    _check_flood(start_daemon(rel_store), rel_reference, 6.0, 4.5)


@pytest.mark.slow
def test_a_client_that_never_reads_for_60_s_grows_the_daemon_under_20_mib(rel_store, rel_reference, start_daemon):
    _check_flood(start_daemon(rel_store), rel_reference, 60.0, 20.0)


def _draft_paths(store, workdir, n: int) -> list[str]:
    """`n` distinct folders holding the store (hard links): n distinct draft models."""
    import os
    import shutil

    out = []
    for i in range(n):
        dst = workdir / f"draft{i}"
        shutil.copytree(store, dst, copy_function=os.link, ignore=shutil.ignore_patterns("pool_usage.json*"))
        out.append(str(dst))
    return out


def _store_bytes(store) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def _drafts_stay_bounded(store, workdir, reference, start_daemon, n: int) -> None:
    d = start_daemon(store)
    prompt, max_tokens = CASES[0]
    ref = reference[(prompt, max_tokens)]
    active = []
    with Client(d.paths, timeout=60) as c:
        for path in _draft_paths(store, workdir, n):
            done = c.complete(prompt, max_tokens=max_tokens, speculative="draft", draft_model=path)
            assert tuple(done.tokens) == ref.tokens
            active.append(c.status().memory.mlx_active_bytes)
    one = _store_bytes(store)  # a draft model's weights are at most this
    # Past the first two (the cache's one and what warms up), no draft model stays behind.
    assert active[-1] - active[1] < one, f"MLX memory grew {(active[-1] - active[1]) / one:.1f} draft models"


def test_draft_models_are_an_lru_of_one(rel_store, workdir, rel_reference, start_daemon):
    _drafts_stay_bounded(rel_store, workdir, rel_reference, start_daemon, 4)


@pytest.mark.slow
def test_forty_draft_paths_keep_memory_bounded(rel_store, workdir, rel_reference, start_daemon):
    _drafts_stay_bounded(rel_store, workdir, rel_reference, start_daemon, 40)


# A wall-clock bound (< 2 s) that a loaded machine cannot promise: with `-m slow`, which
# runs alone (it measured 8.3 s with CI, the slow run and a build sharing two cores).
@pytest.mark.slow
def test_oversized_prompts_of_one_client_do_not_hold_up_another(rel_store, rel_reference, start_daemon):
    """260 prompts of 256K characters, each refused as too long after tokenizing (about
    0.16 s each on the engine thread): another client's request still comes in < 2 s."""
    import zmq

    from moestream.shared import protocol as proto

    d = start_daemon(rel_store)
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(d.paths.endpoint)
    big = ("lorem ipsum dolor " * (proto.MAX_PROMPT_CHARS // 18 + 1))[: proto.MAX_PROMPT_CHARS]
    prompt, max_tokens = CASES[0]
    ref = rel_reference[(prompt, max_tokens)]
    try:
        for i in range(260):
            flood.send(proto.encode(proto.Generate(id=f"big{i}", prompt=big, max_tokens=16)))
        time.sleep(0.5)  # all of them with the daemon
        tic = time.monotonic()
        with Client(d.paths, timeout=60) as c:
            done = c.complete(prompt, max_tokens=max_tokens)
        waited = time.monotonic() - tic
        assert tuple(done.tokens) == ref.tokens
        assert waited < 2.0, f"the other client waited {waited:.1f} s"
        # One client's share is max_active (8) + a quarter of max_queued (64): the rest are busy at once.
        codes: dict[str, int] = {}
        while codes.get("busy", 0) < 260 - 72 or not codes.get("too_long"):
            assert flood.poll(30_000), codes
            reply = proto.decode_reply(flood.recv())
            codes[reply.code] = codes.get(reply.code, 0) + 1
        assert set(codes) == {"too_long", "busy"} and codes["busy"] == 260 - 72, codes
        with Client(d.paths) as c:
            assert c.status().requests.busy == 260 - 72
    finally:
        flood.close()
        ctx.term()


@pytest.mark.slow
def test_bench_soak_attacks_all_hold(rel_store, rel_reference, start_daemon):
    report = attacks.run_attacks(start_daemon(rel_store), rel_reference, seconds=5.0)
    assert report["ok"], report
    figures = _figures({"soak": _NO_SOAK, "attacks": report})
    assert _attack_line(figures).startswith("ok: 2100 idle connections ok")


_NO_SOAK = {
    "daemon_alive": True,
    "requests": 0,
    "exact": 0,
    "cancelled": 0,
    "disconnected_seen_by_daemon": 0,
    "lost_responses": 0,
    "mismatched": 0,
    "stray_messages": 0,
    "rss_after_warmup_bytes": 0,
    "rss_end_bytes": 0,
    "rss_growth_pct": 0.0,
}
