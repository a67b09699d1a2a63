"""Attacks of a local user on a running daemon, each followed by an exact request: what
`tests/reliability/test_limits.py` checks at small counts and `bench soak` reports.

  idle_connections      n raw connections that never speak (past mlx-lm's file limit)
  connection_churn      n ZeroMQ sockets that reconnect 1 ms after each refusal, pinging,
                        past the daemon's file room
  non_reading_client    a client that sends status requests and never reads a reply
  oversized_prompts     one client's n prompts at the protocol's size limit, each refused
                        as too long, while another client asks for one request
  tiny_sampling         temperature and top_p below their floors: greedy for every seed

No MLX here: these drive the daemon's socket.
"""

from __future__ import annotations

import resource
import socket
import time
from typing import Any, Mapping

import zmq

from ....client.client import Client, ClientError, RequestRejected
from ....shared import protocol as proto
from .driver import DaemonProcess, Reference


def _exact(daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference], **kw: Any) -> bool:
    (prompt, max_tokens), ref = min(reference.items())
    with Client(daemon.paths, timeout=60) as c:
        done = c.complete(prompt, max_tokens=max_tokens, **kw)
    return tuple(done.tokens) == ref.tokens and done.text == ref.text


def open_idle(path: str, n: int) -> list[socket.socket]:
    """`n` connected Unix sockets that send nothing (this process's file limit raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))
    out: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            out.append(s)
            s.connect(path)
    except OSError:
        for s in out:
            s.close()
        raise
    return out


def idle_connections(daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference], n: int) -> dict:
    socks = open_idle(str(daemon.paths.socket), n)
    try:
        time.sleep(1.0)
        alive = daemon.alive()
        exact = alive and _exact(daemon, reference)
    finally:
        for s in socks:
            s.close()
    return {"connections": n, "alive": alive, "exact_after": bool(exact), "ok": bool(alive and exact)}


def flood_without_reading(daemon: DaemonProcess, seconds: float) -> tuple[int, int]:
    """A client that sends status requests for `seconds` and never reads a reply; the
    daemon's RSS (bytes) after warm-up and at the end."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # this side holds next to nothing either
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(daemon.paths.endpoint)
    start = None
    deadline = time.monotonic() + seconds
    n = 0
    try:
        while time.monotonic() < deadline:
            try:
                sock.send(proto.encode(proto.Status(f"s{n}")), zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.01)
            n += 1
            if n == 2000:
                start = daemon.rss()
            if n % 200 == 0:
                time.sleep(0.005)
        end = daemon.rss()
    finally:
        sock.close()
        ctx.term()
    return start or end, end


def churn(daemon: DaemonProcess, sockets: int, seconds: float, probe: Any = None) -> int:
    """`sockets` DEALER sockets that reconnect 1 ms after their connection ends, each
    pinging now and then, for `seconds`; `probe()` is called once, halfway. Returns the
    pings sent."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * sockets + 256:  # a socket's connection and its mailbox
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * sockets + 1024), hard))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, sockets + 64)
    socks = []
    pings = 0
    try:
        for _ in range(sockets):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 1)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1)
            s.connect(daemon.paths.endpoint)
            socks.append(s)
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            for s in socks[pings % sockets :][:100]:
                try:
                    s.send(proto.encode(proto.Ping(f"p{pings}")), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                pings += 1
            if probe is not None and time.monotonic() - start > seconds / 2:
                probe()
                probe = None
            time.sleep(0.005)
    finally:
        for s in socks:
            s.close()
        ctx.term()
    return pings


# The daemon's open-file limit during `connection_churn`: room for about 200 connections,
# so that a churn of a few thousand sockets (each two files here) passes it.
CHURN_FILE_LIMIT = 1000


def connection_churn(
    daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference], sockets: int, seconds: float
) -> dict:
    """`churn` past the daemon's file room (its limit lowered to CHURN_FILE_LIMIT, for
    good): a new client halfway hears a pong or busy (never silence), the daemon refuses
    some as busy, and serves exactly afterwards."""
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (CHURN_FILE_LIMIT, CHURN_FILE_LIMIT))
    heard: list[str] = []

    def probe() -> None:
        try:
            with Client(daemon.paths, timeout=3) as c:
                c.ping()
            heard.append("pong")
        except RequestRejected as e:
            heard.append(e.code)
        except ClientError as e:
            heard.append(f"error: {e}")

    pings = churn(daemon, sockets, seconds, probe)
    alive = daemon.alive()
    exact = alive and _exact(daemon, reference)
    clients: dict[str, Any] = {}
    if alive:
        with Client(daemon.paths) as c:
            clients = c.status().clients.to_dict()
    ok = bool(exact and heard and heard[0] in ("pong", proto.BUSY) and clients.get("refused_busy", 0) > 0)
    return {
        "sockets": sockets,
        "seconds": seconds,
        "pings": pings,
        "new_client_heard": heard,
        "exact_after": exact,
        "clients": clients,
        "ok": ok,
    }


def non_reading_client(daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference], seconds: float) -> dict:
    start, end = flood_without_reading(daemon, seconds)
    growth = (end - start) / 2**20
    exact = daemon.alive() and _exact(daemon, reference)
    return {"seconds": seconds, "rss_growth_mib": growth, "exact_after": bool(exact), "ok": bool(exact and growth < 20)}


def oversized_prompts(daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference], n: int) -> dict:
    """`n` prompts of MAX_PROMPT_CHARS from one client, then another client's request:
    how long that one waited."""
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(daemon.paths.endpoint)
    big = ("lorem ipsum dolor " * (proto.MAX_PROMPT_CHARS // 18 + 1))[: proto.MAX_PROMPT_CHARS]
    try:
        for i in range(n):
            flood.send(proto.encode(proto.Generate(id=f"big{i}", prompt=big, max_tokens=16)))
        time.sleep(0.5)
        tic = time.monotonic()
        exact = _exact(daemon, reference)
        waited = time.monotonic() - tic
    finally:
        flood.close()
        ctx.term()
    return {"prompts": n, "other_client_waited_s": waited, "exact": exact, "ok": bool(exact and waited < 2.0)}


def tiny_sampling(daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference]) -> dict:
    cases = [(1e-39, 1.0), (0.5, 1e-46)]
    greedy = all(_exact(daemon, reference, temp=t, top_p=p, seed=s) for t, p in cases for s in (1, 2))
    return {"greedy_every_seed": greedy, "ok": greedy}


def run_attacks(daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference], *, seconds: float) -> dict:
    """Every attack above against `daemon`, in turn; `ok` when each is."""
    out = {
        "idle_connections": idle_connections(daemon, reference, 2100),
        "non_reading_client": non_reading_client(daemon, reference, seconds),
        "oversized_prompts": oversized_prompts(daemon, reference, 260),
        "tiny_sampling": tiny_sampling(daemon, reference),
        # Last: it lowers the daemon's file limit for good.
        "connection_churn": connection_churn(daemon, reference, 1500, min(seconds, 5.0)),
    }
    out["ok"] = all(part["ok"] for part in out.values())
    return out
