"""Attacks on the HTTP gateway (`serve-openai`) in front of a running daemon, each
followed by a request that must still be served exactly: what
`tests/test_gateway_guard.py` checks at small counts and `bench soak` reports.

  slowloris          n connections that send half a request's headers and stop, past the
                     gateway's file limit (1024, as most systems set it), while a client
                     with the API key asks for completions: how long each one took, and
                     how much longer than without the attack (the bound: a loaded machine
                     is slow with or without it)
  connection_caps    the same connections, counted: how many the gateway closed to stay
                     under its caps (client/gateway/guard.py), how many it kept open
  browser_requests   a web page's requests to the keyless loopback gateway: cross-origin
                     (`Origin: http://evil.example`), DNS-rebound (`Host: evil.example`),
                     and a body not declared JSON (what a page can send without a CORS
                     preflight): how many got 403 and 415
  oversized_bodies   bodies over the gateway's limit, declared (Content-Length) and sent
                     chunked without a length: how many got 413, the gateway's RSS growth
  greedy_client      one address's streamed completions, as many as the gateway's
                     request slots, never read, then another address's completion: how
                     many of the first got 429, whether the other was served exactly, and
                     how long it waited (and alone, before them)
  cached_token_probing
                     a client's secret prompt, then other clients' guesses of it (the
                     right one among them), each a new client (a user name of its own, or
                     none from an address of its own, so nothing of its own is cached):
                     the prompt tokens `usage.prompt_tokens_details.cached_tokens` said
                     were cached for them, all of which would be the secret's; and the
                     same right guess through a gateway that shares the cache
                     (--share-prompt-cache), to show the probe sees a shared cache

Three gateway processes on the daemon's runtime folder: one keyed, one keyless (the one a
browser's page can reach), one keyless that shares the prompt cache. Only the standard library's HTTP client; no MLX.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import psutil

from ....client.gateway.daemon_link import MAX_BODY_BYTES, MAX_CONCURRENT
from ..common import default_of
from .driver import DaemonProcess, Reference, child_env

# The file limit most systems give a process (ulimit -n): the gateway's own limit during
# the slowloris attack, which the connections go past.
GATEWAY_FILE_LIMIT = 1024
SLOWLORIS_CONNECTIONS = 1100
KEYED_WITHIN_S = 2.0  # the most slowloris may add to a keyed completion
OVERSIZED_FACTOR = 2  # bodies twice the gateway's limit
GATEWAY_RSS_LIMIT_MIB = 20.0
GATEWAY_LOG_LIMIT_BYTES = 2 * 2**20
# The greedy client's streams: all the gateway's request slots, twice its half.
GREEDY_STREAMS = MAX_CONCURRENT
# Guesses of the secret prompt, the right one among them.
PROBES = 12
# The other client's own loopback address (Linux routes all of 127.0.0.0/8 to lo).
OTHER_ADDRESS = "127.0.0.2"


class GatewayProcess:
    """`moestreamctl serve-openai` as a child process on a free loopback port."""

    def __init__(self, runtime: Path, log: Path, *args: str, timeout: float = 60.0) -> None:
        self.log = log
        argv = [sys.executable, "-m", "moestream.client.cli", "serve-openai", "--port", "0", "--runtime-dir"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*argv, str(runtime), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
        deadline = time.monotonic() + timeout
        self.port = 0
        while time.monotonic() < deadline and not self.port:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with status {self.proc.returncode}: {self.tail()}")
            for line in log.read_text(errors="replace").splitlines():
                if "OpenAI API on http://127.0.0.1:" in line:
                    self.port = int(line.split("OpenAI API on http://127.0.0.1:", 1)[1].split("/", 1)[0])
            time.sleep(0.05)
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the gateway did not answer within {timeout:g} s: {self.tail()}")

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None, **kw: Any
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=kw.get("timeout", 60))
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _completion(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": "moestream", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()


def _served_exactly(gw: GatewayProcess, reference: Mapping[tuple[str, int], Reference], key: str | None) -> bool:
    (prompt, max_tokens), ref = min(reference.items())
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    status, body = gw.request("POST", "/v1/completions", _completion(prompt, max_tokens), headers)
    return status == 200 and json.loads(body)["choices"][0]["text"] == ref.text


def _half_open(port: int, n: int) -> list[socket.socket]:
    """`n` connections that each send half of a request's headers and nothing more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass  # in progress: all a half-open client ever does
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        try:
            s.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        except OSError:
            continue
    time.sleep(0.5)
    return socks


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _timed(
    gw: GatewayProcess, reference: Mapping[tuple[str, int], Reference], key: str, n: int
) -> tuple[list[float], bool]:
    """`n` keyed completions in turn: the seconds of each, and whether all were exact."""
    seconds, exact = [], True
    for _ in range(n):
        tic = time.monotonic()
        exact = _served_exactly(gw, reference, key) and exact
        seconds.append(time.monotonic() - tic)
    return seconds, exact


def slowloris(gw: GatewayProcess, reference: Mapping[tuple[str, int], Reference], key: str, n: int) -> dict:
    """Slowloris past the file limit against the keyed gateway; also its connection caps."""
    baseline, exact = _timed(gw, reference, key, 3)
    limit = None
    if hasattr(resource, "prlimit"):  # Linux; elsewhere the gateway keeps the limit it raised itself
        resource.prlimit(gw.proc.pid, resource.RLIMIT_NOFILE, (GATEWAY_FILE_LIMIT, GATEWAY_FILE_LIMIT))
        limit = GATEWAY_FILE_LIMIT
    socks = _half_open(gw.port, n)
    try:
        latencies, exact_under = _timed(gw, reference, key, 5)
        exact = exact and exact_under
        tic = time.monotonic()
        health = gw.request("GET", "/health", timeout=10)[0]
        health_s = time.monotonic() - tic
        closed = sum(_closed_by_peer(s) for s in socks)
    finally:
        for s in socks:
            s.close()
    slow = {
        "connections": n,
        "gateway_file_limit": limit,
        "keyed_baseline_s": baseline,
        "keyed_latency_s": latencies,
        "keyed_latency_max_s": max(latencies),
        "keyed_added_s": max(latencies) - max(baseline),
        "keyed_exact": exact,
        "health_status": health,
        "health_s": health_s,
    }
    slow["ok"] = bool(exact and slow["keyed_added_s"] < KEYED_WITHIN_S and health == 200)
    per_client = max(default_of("gateway_max_connections") // 2, 1)  # GuardConfig.from_settings
    caps = {
        "connections": n,
        "per_client_cap": per_client,
        "closed_by_gateway": closed,
        "left_open": n - closed,
        "gateway_alive": gw.proc.poll() is None,
    }
    caps["ok"] = bool(caps["gateway_alive"] and 0 < closed and n - closed <= per_client)
    return {"slowloris": slow, "connection_caps": caps}


def browser_requests(gw: GatewayProcess, reference: Mapping[tuple[str, int], Reference], n: int) -> dict:
    """A page's requests to the keyless gateway, `n` of each kind, then a plain client's."""
    body = _completion("hi", 2)
    port = gw.port
    kinds = {
        "cross_origin": ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403),
        "foreign_host": ({"Content-Type": "application/json", "Host": f"evil.example:{port}"}, 403),
        "not_json": ({"Content-Type": "text/plain"}, 415),
    }
    out: dict[str, Any] = {}
    for name, (headers, expected) in kinds.items():
        statuses = [gw.request("POST", "/v1/completions", body, headers)[0] for _ in range(n)]
        out[name] = {"requests": n, "expected_status": expected, "got_expected": statuses.count(expected)}
    out["exact_after"] = _served_exactly(gw, reference, None)
    out["ok"] = bool(out["exact_after"] and all(out[k]["got_expected"] == n for k in kinds))
    return out


def _oversized(port: int, total: int, *, chunked: bool) -> int:
    """POST a body of `total` bytes, declared by Content-Length or sent in chunks with no
    length; the response's status (0 for none)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(total))))
        conn.endheaders()
        chunk = b" " * 65536
        try:
            for _ in range(total // len(chunk)):
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if chunked:
                conn.send(b"0\r\n\r\n")
        except OSError:
            pass  # the gateway answered and closed before the rest: that is the refusal
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def oversized_bodies(gw: GatewayProcess, reference: Mapping[tuple[str, int], Reference], n: int) -> dict:
    """`n` bodies over the limit declared by Content-Length, `n` sent chunked without one."""
    size = OVERSIZED_FACTOR * MAX_BODY_BYTES
    rss_before = gw.rss()
    declared = sum(_oversized(gw.port, size, chunked=False) == 413 for _ in range(n))
    chunked = sum(_oversized(gw.port, size, chunked=True) == 413 for _ in range(n))
    growth = (gw.rss() - rss_before) / 2**20
    exact = _served_exactly(gw, reference, None)
    out = {
        "bodies": 2 * n,
        "body_bytes": size,
        "limit_bytes": MAX_BODY_BYTES,
        "declared_413": declared,
        "chunked_413": chunked,
        "gateway_rss_growth_mib": growth,
        "exact_after": exact,
    }
    out["ok"] = bool(exact and declared == n and chunked == n and growth < GATEWAY_RSS_LIMIT_MIB)
    return out


def _post_from(gw: GatewayProcess, source: str, path: str, body: bytes) -> tuple[int, bytes]:
    """A JSON POST from the loopback address `source`: its status and body."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=300, source_address=(source, 0))
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _other_client(gw: GatewayProcess, prompt: str, max_tokens: int) -> tuple[int, bytes, float]:
    """A completion from OTHER_ADDRESS: its status, body and seconds."""
    tic = time.monotonic()
    status, body = _post_from(gw, OTHER_ADDRESS, "/v1/completions", _completion(prompt, max_tokens))
    return status, body, time.monotonic() - tic


def greedy_client(gw: GatewayProcess, reference: Mapping[tuple[str, int], Reference], n: int) -> dict:
    (prompt, max_tokens), ref = min(reference.items())
    alone = _other_client(gw, prompt, max_tokens)[2]
    body = json.dumps({"model": "moestream", "prompt": prompt, "max_tokens": 16, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks: list[socket.socket] = []
    statuses = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing of the stream
            s.settimeout(120)
            s.connect(("127.0.0.1", gw.port))
            socks.append(s)
        # All sent before any status is read: at once, so that none of the accepted
        # streams ends (freeing its slot) before the last request arrives.
        for s in socks:
            s.sendall(head + body)
        for s in socks:
            statuses.append(int(s.recv(64).split(b" ", 2)[1]))  # the status line only
        status, answer, waited = _other_client(gw, prompt, max_tokens)
    finally:
        for s in socks:
            s.close()
    exact = status == 200 and json.loads(answer)["choices"][0]["text"] == ref.text
    refused = statuses.count(429)
    share = MAX_CONCURRENT // 2
    return {
        "streams": n,
        "accepted": statuses.count(200),
        "refused_429": refused,
        "other_exact": exact,
        "other_waited_s": waited,
        "other_alone_s": alone,
        "ok": bool(exact and statuses.count(200) == share and refused == n - share),
    }


def _cached_tokens(gw: GatewayProcess, text: str, *, user: str | None = None, source: str = "127.0.0.1") -> int:
    """A one-message chat's cached prompt tokens, as `usage` reports them (-1: not answered)."""
    body: dict[str, Any] = {"model": "moestream", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    if user is not None:
        body["user"] = user
    status, answer = _post_from(gw, source, "/v1/chat/completions", json.dumps(body).encode())
    return int(json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"]) if status == 200 else -1


@dataclass
class CachedTokenProbing:
    probes: int
    # Prompt tokens reported cached for the probes (each a new client): all another's.
    tokens_learned: int
    # The secret's owner's next request (its own history: cached); the right guess through
    # the gateway that shares the cache.
    owner_cached: int
    shared_learned: int
    ok: bool


def cached_token_probing(scoped: GatewayProcess, shared: GatewayProcess, n: int) -> dict:
    def secret(code: int) -> str:
        return f"The secret code is {code}. " * 6

    right = 4800 + n // 2
    answered = [_cached_tokens(scoped, secret(right) + "Remember it.", user="alice")]
    owner = _cached_tokens(scoped, secret(right) + "Say it.", user="alice")
    for i in range(n):
        guess = secret(4800 + i) + "Say it."
        # Half name a user of their own, half none from a loopback address of their own.
        if i % 2:
            answered.append(_cached_tokens(scoped, guess, source=f"127.0.1.{i}"))
        else:
            answered.append(_cached_tokens(scoped, guess, user=f"probe-{i}"))
    _cached_tokens(shared, secret(right) + "Remember it.", user="alice")
    seen_shared = _cached_tokens(shared, secret(right) + "Say it.", user="probe-shared")
    probed = answered[1:]
    out = CachedTokenProbing(
        probes=n,
        tokens_learned=sum(max(c, 0) for c in probed),
        owner_cached=owner,
        shared_learned=seen_shared,
        ok=False,
    )
    out = replace(out, ok=bool(min(answered) >= 0 and out.tokens_learned == 0 and owner > 0 and seen_shared > 0))
    return asdict(out)


def run_gateway_attacks(
    daemon: DaemonProcess, reference: Mapping[tuple[str, int], Reference], *, requests: int = 100
) -> dict:
    """Every attack above through gateways on `daemon`, in turn; `ok` when each is and
    neither gateway's log grew past GATEWAY_LOG_LIMIT_BYTES."""
    key = secrets.token_hex(16)
    runtime = daemon.paths.dir
    gateways: list[GatewayProcess] = []
    try:
        keyed = GatewayProcess(runtime, runtime.parent / "gw-keyed.log", "--api-key", key)
        gateways.append(keyed)
        keyless = GatewayProcess(runtime, runtime.parent / "gw-keyless.log")
        gateways.append(keyless)
        shared = GatewayProcess(runtime, runtime.parent / "gw-shared.log", "--share-prompt-cache")
        gateways.append(shared)
        out: dict[str, Any] = slowloris(keyed, reference, key, SLOWLORIS_CONNECTIONS)
        out["browser_requests"] = browser_requests(keyless, reference, requests)
        out["oversized_bodies"] = oversized_bodies(keyless, reference, max(1, requests // 20))
        # Before the greedy client, whose cancelled streams' caches could push the secret's out.
        out["cached_token_probing"] = cached_token_probing(keyless, shared, PROBES)
        out["greedy_client"] = greedy_client(keyless, reference, GREEDY_STREAMS)
        alive = all(gw.proc.poll() is None for gw in gateways)
    finally:
        for gw in gateways:
            gw.stop()
    out["log_bytes"] = max(os.path.getsize(gw.log) for gw in gateways)
    out["gateways_alive"] = alive
    out["ok"] = bool(
        alive
        and out["log_bytes"] < GATEWAY_LOG_LIMIT_BYTES
        and all(part["ok"] for part in out.values() if isinstance(part, dict))
    )
    return out
