"""One HTTP client cannot take the gateway and the daemon: real processes (a daemon on a
tiny model, the gateway as its own process), a greedy client on 127.0.0.1 and another on
127.0.0.2 (a loopback address of its own, as a second machine would have).

What is asserted is counted or ordered (429s, the daemon's order of requests), never timed."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from daemon_cli import clean_env, ctl, wait_for
from test_openai_gateway import Gateway
from tiny_models import tiny_store

from moestream.client.client import Client
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.status import RecentRequest, RequestsStatus

PROMPT = "The farmer counted his hens"
# The tiny tokenizer's special tokens (tests/tiny_models.py), banned: a request makes
# all its max_tokens.
NO_END = {"0": -100, "1": -100, "2": -100}
HOLD = 30000  # tokens: a stream that holds its slot until the test closes it
LONG = 400  # tokens (the tiny model's context is 512): a request that holds the one slot a while
SLOTS = 64  # client/gateway/app.py MAX_CONCURRENT: a client holds half


@contextmanager
def _served(prefix: str, max_active: int) -> Iterator[tuple[RuntimePaths, Gateway]]:
    """(daemon paths, gateway): a daemon with `max_active` slots and a context of 32768 tokens."""
    with tiny_store(prefix) as store:
        rt = Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))
        env = clean_env(MOESTREAM_MAX_ACTIVE=str(max_active), MOESTREAM_MAX_CONTEXT="32768")
        out = ctl("start", "--model", str(store), "--capacity", "0.25", "--runtime-dir", str(rt), env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        gateway = Gateway(rt, rt / "gateway.log")
        try:
            yield RuntimePaths(dir=rt, log=rt / "daemon.log"), gateway
        finally:
            gateway.stop()
            ctl("stop", "--runtime-dir", str(rt))
            shutil.rmtree(rt)


@pytest.fixture(scope="module")
def served():
    """One slot in the daemon (max_active 1)."""
    with _served("msf", 1) as both:
        yield both


@pytest.fixture(scope="module")
def four_slots():
    """Four slots in the daemon (max_active 4: one more for a client with none running
    while another holds several)."""
    with _served("msf4", 4) as both:
        yield both


def _other_client(gateway: Gateway) -> openai.OpenAI:
    """An OpenAI client from 127.0.0.2: a loopback address of its own, as a second machine would have."""
    return openai.OpenAI(
        base_url=gateway.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")),
    )


def _daemon_requests(paths: RuntimePaths) -> RequestsStatus:
    with Client(paths) as c:
        return c.status().requests


def test_one_client_takes_half_the_gateway_and_another_is_served_before_its_queue(served):
    """A client opens 33 streams at once (read or not): 32 are its share, the 33rd is a
    429 that says so (they took all 64 slots: every other client got 429s). Another
    client's request is served next, before the greedy client's queued 31 (each HTTP
    request was a daemon client of its own: the queue's order served them first)."""
    paths, gateway = served
    body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
    body["logit_bias"] = NO_END
    with ExitStack() as stack:
        greedy = stack.enter_context(httpx.Client(base_url=gateway.url, timeout=120))
        # The first holds the daemon's one slot until it is closed below: read (never
        # paused, then cancelled, as an unread stream is) and longer than a loaded machine
        # takes to open the others (one that ended would give its slot to the 33rd).
        holder = stack.enter_context(greedy.stream("POST", "/v1/completions", json={**body, "max_tokens": HOLD}))
        first = wait_for(lambda: _daemon_requests(paths).running, 30, "the first to run")[0].id
        reader = threading.Thread(target=_drain, args=(holder,), daemon=True)
        reader.start()
        streams = [holder]
        for _ in range(SLOTS // 2):
            streams.append(stack.enter_context(greedy.stream("POST", "/v1/completions", json=body)))
        codes = [r.status_code for r in streams]
        assert codes == [200] * (SLOTS // 2) + [429], codes
        refused = streams[-1].read().decode()
        assert "127.0.0.1" in refused and f"its share of the gateway's {SLOTS}" in refused, refused
        wait_for(lambda: _daemon_requests(paths).queued == SLOTS // 2 - 1, 30, "the greedy client's queue")

        other = _other_client(gateway)
        answers = []
        asker = threading.Thread(
            target=lambda: answers.append(
                other.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
            )
        )
        asker.start()
        wait_for(lambda: _daemon_requests(paths).queued == SLOTS // 2, 30, "the other client's request queued")
        holder.close()  # its slot frees: the other client's request takes it
        asker.join(120)
        reader.join(30)
        (answer,) = answers
        recent = [r.id for r in _daemon_requests(paths).recent]
        assert recent[-2:] == [first, answer.id], (first, answer.id, recent)
        with Client(paths) as c:  # the same answer as the daemon's own
            assert answer.choices[0].text == c.complete(PROMPT, max_tokens=8).text


def _drain(response: httpx.Response) -> None:
    try:
        for _ in response.iter_bytes():
            pass
    except (httpx.HTTPError, RuntimeError):  # closed by the test
        pass


@pytest.mark.slow  # about UNREAD_SECONDS and the tokens that fill the buffers
def test_streams_their_client_does_not_read_are_cancelled_and_free_their_slots(served):
    """Streams whose client reads nothing (a socket with a small receive buffer): the
    gateway stops reading the daemon for them, the daemon pauses them, and within
    UNREAD_SECONDS of the buffers filling they are cancelled, far short of max_tokens;
    their slots come back (they ran to max_tokens, holding them)."""
    from moestream.client.gateway.daemon_link import UNREAD_SECONDS

    paths, gateway = served
    want = 30000
    host, port = gateway.url.removeprefix("http://").split(":")
    request = (
        f'{{"model": "m", "prompt": "{PROMPT}", "max_tokens": {want}, "stream": true, "logit_bias": '
        f'{{"0": -100, "1": -100, "2": -100}}}}'
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(request)}\r\n\r\n"
    )
    socks = []
    try:
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall((head + request).encode())
            socks.append(s)

        def ended() -> list[RecentRequest]:
            done = [r for r in _daemon_requests(paths).recent if r.tokens > LONG]
            return done if len(done) >= 2 else []

        gone = wait_for(ended, 120 + 2 * UNREAD_SECONDS, "the unread streams to be cancelled")
        assert all(r.finish_reason != "length" and r.tokens < want // 4 for r in gone), gone
        assert "read nothing for" in (paths.dir / "gateway.log").read_text()
    finally:
        for s in socks:
            s.close()


def test_a_client_with_none_running_starts_while_another_holds_every_slot(four_slots):
    """A client's five long streams take the four slots and queue one; another client's
    request starts at once beside them (a fifth slot, for a client with none running),
    not when one of the long answers ends, and is answered as the daemon answers it
    alone. The greedy client's fifth stays queued: the extra slot is not its own."""
    paths, gateway = four_slots
    body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
    body["logit_bias"] = NO_END
    answers: list[str] = []
    with ExitStack() as stack:
        greedy = stack.enter_context(httpx.Client(base_url=gateway.url, timeout=120))
        for _ in range(5):
            assert stack.enter_context(greedy.stream("POST", "/v1/completions", json=body)).status_code == 200
        wait_for(lambda: (r := _daemon_requests(paths)).active == 4 and r.queued == 1, 30, "four running, one queued")
        other = _other_client(gateway)

        def ask() -> None:
            answers.append(
                other.completions.create(model="m", prompt=PROMPT, max_tokens=64, temperature=0).choices[0].text
            )

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            # Counted, not timed: on a daemon without the fifth slot it waits in the queue
            # until a long answer ends, so five never run at once.
            both = wait_for(lambda: (r := _daemon_requests(paths)).active == 5 and r, 60, "the other client's start")
            assert both.queued == 1 and not [r for r in both.recent if r.tokens >= LONG], both
        finally:
            asker.join(120)
    with Client(paths) as c:  # the same answer as the daemon's own
        assert answers == [c.complete(PROMPT, max_tokens=64).text]
