"""Fair sharing between clients, through a real daemon: one client's many connections count
as one client (`client_key`, as the gateway sends its caller's address), the next slot goes
to the client that waited, and a client that stops reading is paused, then cancelled.

What is asserted is counted or ordered by the daemon (its queue shares, the order in which
requests ended, the tokens made), never timed."""

from __future__ import annotations

from contextlib import ExitStack

import zmq
from daemon_cli import wait_for

from moestream.client.client import Client
from moestream.shared import protocol as proto
from moestream.shared.status import RecentRequest, RequestInfo, Status

from .conftest import CASES

# The tiny tokenizer's special tokens (tests/tiny_models.py): banned, a request makes all
# its max_tokens.
NO_END = proto.SamplingControls(logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))
LONG = 400  # tokens: a request that holds the daemon's one slot a while (the context is 512)


def _dealer(ctx: zmq.Context, endpoint: str, *, reads: bool = True) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if not reads:  # this side holds next to nothing of what it is sent
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(endpoint)
    return s


def _until(sock: zmq.Socket, kind: type) -> proto.Reply:
    while True:
        assert sock.poll(60_000), f"no {kind.__name__} within 60 s"
        reply = proto.decode_reply(sock.recv())
        if isinstance(reply, (kind, proto.Error)):
            return reply


def _status(daemon) -> Status:
    with Client(daemon.paths) as c:
        return c.status()


def test_one_client_on_many_connections_gets_its_share_and_the_next_slot_goes_to_another(
    rel_store, rel_reference, start_daemon
):
    """A client sends its requests on 66 connections (as the gateway does, one per HTTP
    request), all with its key: a quarter of the queue and the one slot (65) are its share,
    the 66th is busy. Another client's request, queued after 64 of them, starts when the
    first ends, before any of the rest (each connection was a client of its own, every
    one with nothing running: the queue's order served them first)."""
    d = start_daemon(rel_store, flags={"max_active": "1"})
    prompt, max_tokens = CASES[0]
    share = 1 + 256 // 4
    ctx = zmq.Context()
    with ExitStack() as stack:
        stack.callback(ctx.term)
        socks = [stack.enter_context(_dealer(ctx, d.paths.endpoint)) for _ in range(share + 1)]
        for i, s in enumerate(socks):
            s.send(
                proto.encode(
                    proto.Generate(id=f"g{i}", prompt=prompt, max_tokens=LONG, sampling=NO_END, client_key="greedy")
                )
            )
            reply = _until(s, proto.Accepted)
            if i < share:
                assert isinstance(reply, proto.Accepted), reply
        assert isinstance(reply, proto.Error) and reply.code == proto.BUSY, reply
        assert "this client has 65 requests" in reply.message
        wait_for(lambda: _status(d).requests.queued == share - 1, 30, "the greedy client's queue")
        with Client(d.paths, timeout=120) as c:
            done = c.complete(prompt, max_tokens=max_tokens)
            recent = [r.id for r in c.status().requests.recent]
        ref = rel_reference[(prompt, max_tokens)]
        assert tuple(done.tokens) == ref.tokens
        # g0 ended, then this one; g1 (LONG tokens, started after it) is still running.
        assert recent[-2:] == ["g0", done.id], recent


def test_a_stream_its_client_does_not_read_is_paused_then_cancelled(rel_store, rel_reference, start_daemon):
    """A client that reads none of its tokens: once its queue is full the daemon stops
    making them (paused: not one token more), serves others meanwhile, and after
    UNREAD_SECONDS cancels the request, far short of its max_tokens."""
    from moestream.daemon.server import UNREAD_SECONDS

    want = 30000
    d = start_daemon(rel_store, flags={"max_context": "32768"})
    ctx = zmq.Context()
    with ExitStack() as stack:
        stack.callback(ctx.term)
        s = stack.enter_context(_dealer(ctx, d.paths.endpoint, reads=False))
        s.send(proto.encode(proto.Generate(id="unread", prompt=CASES[0][0], max_tokens=want, sampling=NO_END)))

        def paused() -> RequestInfo | None:
            return next((r for r in _status(d).requests.running if r.phase == "paused"), None)

        seen = wait_for(paused, 120, "the unread stream to be paused")
        prompt, max_tokens = CASES[1]
        with Client(d.paths, timeout=60) as c:  # served meanwhile
            done = c.complete(prompt, max_tokens=max_tokens)
        assert tuple(done.tokens) == rel_reference[(prompt, max_tokens)].tokens
        st = _status(d)
        assert [r.tokens for r in st.requests.running if r.id == "unread"] == [seen.tokens]

        def ended() -> RecentRequest | None:
            return next((r for r in _status(d).requests.recent if r.id == "unread"), None)

        gone = wait_for(ended, UNREAD_SECONDS + 60, "the unread stream to be cancelled")
    assert gone.finish_reason == "disconnected" and gone.tokens == seen.tokens < want // 10, gone
    clients = _status(d).clients
    assert clients.paused >= 1 and clients.dropped_not_reading == 1, clients
