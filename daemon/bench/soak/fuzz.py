"""Protocol fuzz driver: bad messages at a live daemon while a good client keeps working.

`fuzz_cases(rng, n)` makes a reproducible mix of random bytes, truncated and bit-flipped
msgpack, fields of the wrong type or range, huge fields, unknown versions and types,
extra fields, deep nesting, several frames per message, and some valid requests.
`run_fuzz` sends them one at a time over a DEALER socket and checks that each gets
exactly the reply `shared/protocol.py` itself predicts (`decode_request` is the oracle:
an `error` with its code and request id, or the reply type of the valid request), while
a second thread streams greedy requests and compares them with the reference. The
daemon must still be the same live process at the end.

Valid `shutdown` requests are never sent (they would end the run); a valid `generate`
is cancelled after its first token so that a fuzzed max_tokens cannot stall the run.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import msgpack
import zmq

from ....client.client import Client, ClientError, Token
from ....shared import protocol as proto
from ....shared.runtime_dir import RuntimePaths
from ...server import HARD_MAX_MESSAGE_BYTES

REPLY_WAIT_S = 10.0
# Valid generate requests in the mix stay short.
VALID_MAX_TOKENS = 4


@dataclass(frozen=True)
class FuzzCase:
    kind: str
    frames: tuple[bytes, ...]


def _pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(12 if depth < 3 else 8)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if pick == 3:
        return rng.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), -1e308, rng.random()])
    if pick == 4:
        return "".join(rng.choice("ab\x00é\U0001f600\n ") for _ in range(rng.randrange(0, 12)))
    if pick == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 12)))
    if pick == 6:
        return rng.choice(["generate", "ping", "status", "stats", "cancel", "", "x" * 70])
    if pick == 7:
        return rng.randrange(0, 600)
    if pick in (8, 9):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {str(_random_value(rng, depth + 1))[:8]: _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _valid_body(rng: random.Random, rid: str) -> dict[str, Any]:
    kind = rng.choice(["generate", "generate", "ping", "status", "stats", "cancel"])
    body: dict[str, Any] = {"v": proto.PROTOCOL_VERSION, "type": kind, "id": rid}
    if kind == "generate":
        if rng.random() < 0.5:
            body["prompt"] = rng.choice(["hi", "def f(x):", "The farmer", "é\U0001f600"])
        else:
            body["prompt_ids"] = [rng.randrange(0, 300) for _ in range(rng.randrange(1, 8))]
        body["max_tokens"] = rng.randrange(1, VALID_MAX_TOKENS + 1)
        if rng.random() < 0.3:
            body.update(temp=rng.random(), top_p=rng.uniform(0.1, 1.0), seed=rng.randrange(0, 2**32))
        if rng.random() < 0.2:
            body["stop"] = ["\n"]
    elif kind == "cancel":
        body["target"] = rng.choice(["nothing", rid, "g" * 64])
    return body


def _field_names() -> list[str]:
    names = set()
    for cls in proto.REQUEST_TYPES.values():
        names |= set(cls.__dataclass_fields__)
    return sorted(names | {"v", "type"})


def _case(rng: random.Random, i: int) -> FuzzCase:
    rid = f"f{i}"
    kind = rng.choice(
        ["bytes", "truncated", "flipped", "wrong_type", "huge", "version", "unknown_type", "extra_field",
         "nested", "frames", "valid", "map"]
    )  # fmt: skip
    body = _valid_body(rng, rid)
    if kind == "bytes":
        frame = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
    elif kind == "truncated":
        data = _pack(body)
        frame = data[: rng.randrange(0, len(data))]
    elif kind == "flipped":
        data = bytearray(_pack(body))
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        frame = bytes(data)
    elif kind == "wrong_type":
        body[rng.choice(_field_names())] = _random_value(rng)
        frame = _pack(body)
    elif kind == "huge":
        what = rng.choice(["prompt", "prompt_ids", "id", "stop", "message", "type"])
        if what == "prompt":
            body = {
                "v": 1,
                "type": "generate",
                "id": rid,
                "prompt": "x" * rng.choice([proto.MAX_PROMPT_CHARS + 1, 900_000]),
            }
        elif what == "prompt_ids":
            body = {
                "v": 1,
                "type": "generate",
                "id": rid,
                "prompt_ids": [7] * (proto.MAX_PROMPT_IDS + rng.randrange(1, 1000)),
            }
        elif what == "id":
            body["id"] = "i" * rng.choice([65, 10_000, 500_000])
        elif what == "stop":
            body = {"v": 1, "type": "generate", "id": rid, "prompt": "a", "stop": ["s" * 300] * rng.randrange(1, 40)}
        elif what == "type":
            body["type"] = "t" * 200_000
        else:
            body = {
                "v": 1,
                "type": "ping",
                "id": rid,
                "pad": b"\0" * rng.choice([proto.MAX_MESSAGE_BYTES, 3 * proto.MAX_MESSAGE_BYTES]),
            }
        frame = _pack(body)
    elif kind == "version":
        body["v"] = rng.choice([0, 2, 99, -1, 1.0, "1", None, True, [1], 2**64 - 1])
        frame = _pack(body)
    elif kind == "unknown_type":
        body["type"] = rng.choice(["shutdown_now", "GENERATE", "", 5, None, "generate\0", "token", "done"])
        frame = _pack(body)
    elif kind == "extra_field":
        body[rng.choice(["zz", "", "V", "prompt2", "\0"])] = _random_value(rng)
        frame = _pack(body)
    elif kind == "nested":
        depth = rng.choice([100, 1000, 100_000])
        frame = b"\x91" * depth + b"\x00" if rng.random() < 0.5 else b"\x81\xa1a" * depth + b"\x00"
    elif kind == "frames":
        return FuzzCase(
            kind, tuple(_pack(body) for _ in range(rng.randrange(2, 4))) if rng.random() < 0.7 else (_pack(body), b"")
        )
    elif kind == "map":
        frame = _pack(
            {str(_random_value(rng))[:6]: _random_value(rng) for _ in range(rng.randrange(0, 6))} | {"v": 1, "id": rid}
        )
    else:
        frame = _pack(body)
    return FuzzCase(kind, (frame,))


def fuzz_cases(rng: random.Random, n: int) -> Iterator[FuzzCase]:
    """`n` reproducible cases (valid shutdown requests are replaced by pings)."""
    for i in range(n):
        case = _case(rng, i)
        if len(case.frames) == 1:
            try:
                msg = proto.decode_request(case.frames[0])
            except proto.ProtocolError:
                msg = None
            if isinstance(msg, proto.Shutdown):
                case = FuzzCase("valid", (_pack({"v": 1, "type": "ping", "id": msg.id}),))
        yield case


@dataclass(frozen=True)
class Expected:
    """What the daemon must answer: an error (code, id) or a reply type for a valid request."""

    error_code: str | None
    request_id: str
    reply: type | None = None


def expected_reply(frames: tuple[bytes, ...]) -> Expected:
    """The protocol module's own verdict on a message, as the daemon must give it."""
    if len(frames) != 1:
        return Expected(proto.BAD_MESSAGE, "")
    try:
        msg = proto.decode_request(frames[0])
    except proto.ProtocolError as e:
        return Expected(e.code, e.request_id)
    replies = {
        proto.Ping: proto.Pong,
        proto.Status: proto.StatusReply,
        proto.Stats: proto.StatsReply,
        proto.Cancel: proto.Cancelled,
        proto.Generate: proto.Done,
        proto.CountTokens: proto.TokenCount,
        proto.Load: proto.LoadReply,
    }
    return Expected(None, msg.id, replies[type(msg)])


class Dealer:
    """A bare DEALER socket on the daemon's endpoint: sends any frames, reads replies."""

    def __init__(self, paths: RuntimePaths) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(paths.endpoint)

    def recv(self, timeout: float) -> proto.Reply | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return proto.decode_reply(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)


def check_one(dealer: Dealer, case: FuzzCase) -> str | None:
    """Send one case; None when the reply is what the protocol predicts, else why not."""
    want = expected_reply(case.frames)
    dealer.sock.send_multipart(list(case.frames))
    reply = dealer.recv(REPLY_WAIT_S)
    if reply is None:
        return f"{case.kind}: no reply within {REPLY_WAIT_S:g} s"
    if want.error_code is not None:
        if not isinstance(reply, proto.Error):
            return f"{case.kind}: expected error {want.error_code}, got {reply.TYPE}"
        if (reply.code, reply.id) != (want.error_code, want.request_id):
            return (
                f"{case.kind}: expected error {want.error_code} for {want.request_id!r}, "
                f"got {reply.code} for {reply.id!r}: {reply.message}"
            )
        return None
    if reply.id != want.request_id:
        return f"{case.kind}: a reply for {reply.id!r}, expected one for {want.request_id!r}"
    if want.reply is proto.Done:
        # A valid generate: accepted, tokens (after progress events, if it asked) then done, or an
        # error the engine gives (unknown token ids, too long). Cancel after the first
        # event; the stream still ends with done.
        # Each cancel gets its own reply, which may come after the stream's end: all are
        # awaited here, so that none is taken for the next case's reply on a slow machine.
        cancel_id = "c" + want.request_id[:60]
        cancels = acks = 0
        stream_events = (proto.Accepted, proto.Token, proto.Progress)
        while isinstance(reply, stream_events):
            dealer.sock.send(proto.encode(proto.Cancel(id=cancel_id, target=want.request_id)))
            cancels += 1
            while True:
                reply = dealer.recv(REPLY_WAIT_S)
                if reply is None:
                    return f"{case.kind}: generate {want.request_id!r} never ended"
                if reply.id == cancel_id:
                    acks += 1
                elif reply.id == want.request_id and not isinstance(reply, stream_events):
                    break
        if not isinstance(reply, (proto.Done, proto.Error)):
            return f"{case.kind}: a generate ended with {reply.TYPE}"
        while acks < cancels:
            reply = dealer.recv(REPLY_WAIT_S)
            if reply is None:
                return f"{case.kind}: no reply to cancel {cancel_id!r} within {REPLY_WAIT_S:g} s"
            if reply.id != cancel_id:
                return f"{case.kind}: a reply for {reply.id!r}, expected the reply to cancel {cancel_id!r}"
            acks += 1
        return None
    if not isinstance(reply, want.reply):
        return f"{case.kind}: expected {want.reply.TYPE}, got {reply.TYPE} ({getattr(reply, 'message', '')})"
    return None


def _drain(dealer: Dealer, wait: float) -> None:
    while dealer.recv(wait) is not None:
        continue


def oversize_drop(paths: RuntimePaths) -> str | None:
    """A message over the hard cap: ZeroMQ drops that connection without reading it into
    memory; the daemon must go on serving (checked with a ping on a new socket)."""
    dealer = Dealer(paths)
    try:
        dealer.sock.send(b"\0" * (HARD_MAX_MESSAGE_BYTES + 1))
        reply = dealer.recv(1.0)
        if reply is not None:
            return f"oversize: expected no reply (connection dropped), got {reply.TYPE}"
    finally:
        dealer.close()
    with Client(paths, timeout=REPLY_WAIT_S) as c:
        c.ping()
    return None


def run_fuzz(
    paths: RuntimePaths,
    daemon_pid: int,
    n: int,
    *,
    seed: int = 0,
    good_client: Callable[[Client], bool] | None = None,
    cases: Iterator[FuzzCase] | None = None,
) -> dict[str, Any]:
    """Send `n` fuzz cases (or `cases`) and return the figures.

    `good_client(client) -> exact?` runs in a loop on its own thread meanwhile (one
    greedy request per call, compared with its reference by the caller)."""
    rng = random.Random(seed)
    source = cases if cases is not None else fuzz_cases(rng, n)
    stop = threading.Event()
    good = {"requests": 0, "mismatched": 0, "errors": []}

    def good_loop() -> None:
        try:
            with Client(paths, timeout=30.0) as c:
                while not stop.is_set():
                    exact = good_client(c)
                    good["requests"] += 1
                    good["mismatched"] += 0 if exact else 1
        except (ClientError, AssertionError) as e:
            good["errors"].append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=good_loop, name="fuzz-good-client") if good_client else None
    if thread:
        thread.start()
    by_kind: dict[str, int] = {}
    wrong: list[str] = []
    sent = 0
    dealer = Dealer(paths)
    tic = time.perf_counter()
    try:
        for case in source:
            sent += 1
            by_kind[case.kind] = by_kind.get(case.kind, 0) + 1
            why = check_one(dealer, case)
            if why is not None:
                wrong.append(why)
                _drain(dealer, 0.2)  # resynchronize
        why = oversize_drop(paths)
        if why:
            wrong.append(why)
        sent += 1
        by_kind["oversize_drop"] = 1
    finally:
        dealer.close()
        stop.set()
        if thread:
            thread.join(60)
    seconds = time.perf_counter() - tic
    with Client(paths, timeout=REPLY_WAIT_S) as c:
        pid = c.ping().pid
    report = {
        "messages": sent,
        "by_kind": by_kind,
        "seconds": seconds,
        "wrong_replies": len(wrong),
        "wrong_examples": wrong[:10],
        "crashes": 0 if pid == daemon_pid else 1,
        "daemon_pid_same": pid == daemon_pid,
        "good_client_requests": good["requests"],
        "good_client_mismatched": good["mismatched"],
        "good_client_errors": good["errors"],
    }
    report["ok"] = bool(
        not wrong
        and pid == daemon_pid
        and not good["errors"]
        and good["mismatched"] == 0
        and (good_client is None or good["requests"] > 0)
    )
    return report


def exact_request(reference: Mapping[tuple[str, int], Any], rng: random.Random) -> Callable[[Client], bool]:
    """A `good_client` for `run_fuzz`: one random reference case, compared exactly."""
    cases = sorted(reference)

    def one(c: Client) -> bool:
        prompt, max_tokens = rng.choice(cases)
        ref = reference[(prompt, max_tokens)]
        stream = c.generate(prompt, max_tokens=max_tokens)
        streamed = "".join(e.text for e in stream if isinstance(e, Token))
        done = stream.done
        return tuple(done.tokens) == tuple(ref.tokens) and done.text == ref.text == streamed

    return one
