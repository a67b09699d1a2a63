"""The gateway's guards (client/gateway/guard.py) against a real gateway process:
slowloris connections past the file limit, a web page's cross-origin or DNS-rebinding
request to the keyless loopback gateway, bodies that are not JSON, lone surrogates."""

from __future__ import annotations

import resource
import shutil
import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from daemon_cli import ctl
from test_openai_gateway import KEY, Gateway
from tiny_models import tiny_store


@pytest.fixture(scope="module")
def gateways():
    """(keyed gateway, keyless gateway), both on one daemon of a tiny store."""
    with tiny_store("msh") as store:
        rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msh"))
        out = ctl("start", "--model", str(store), "--capacity", "0.25", "--runtime-dir", str(rt))
        assert out.returncode == 0, out.stdout + out.stderr
        keyed = Gateway(rt, rt / "keyed.log", "--api-key", KEY)
        keyless = Gateway(
            rt,
            rt / "keyless.log",
            env={"MOESTREAM_GATEWAY_READ_TIMEOUT": "1", "MOESTREAM_GATEWAY_ORIGINS": "https://app.example"},
        )
        try:
            yield keyed, keyless
        finally:
            keyed.stop()
            keyless.stop()
            ctl("stop", "--runtime-dir", str(rt))
            shutil.rmtree(rt)


def _complete(url: str, **kw) -> httpx.Response:
    body = {"model": "moestream", "prompt": "In the morning", "max_tokens": 4, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=30, **kw)


def test_slowloris_past_the_file_limit_leaves_keyed_requests_served(gateways):
    keyed, _ = gateways
    resource.prlimit(keyed.proc.pid, resource.RLIMIT_NOFILE, (1024, 1024))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    host, port = keyed.url.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(1100):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect((host, int(port)))
            except BlockingIOError:
                pass  # a non-blocking connect: in progress, which is all a half-open client does
            socks.append(s)
        time.sleep(0.5)
        for s in socks:
            try:
                s.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                continue
        time.sleep(0.5)
        tic = time.monotonic()
        r = _complete(keyed.url, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        assert time.monotonic() - tic < 2.0
        assert httpx.get(keyed.url + "/health", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
    assert keyed.proc.poll() is None
    assert keyed.log.stat().st_size < 2 * 2**20


def test_cross_origin_and_foreign_host_requests_are_refused(gateways):
    _, keyless = gateways
    port = keyless.url.rsplit(":", 1)[1]
    body = '{"model": "moestream", "prompt": "hi", "max_tokens": 2}'
    page = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    r = httpx.post(keyless.url + "/v1/completions", content=body, headers=page, timeout=30)
    assert r.status_code == 403 and "Origin" in r.json()["error"]["message"], r.text
    rebound = {"Content-Type": "application/json", "Host": f"evil.example:{port}"}
    r = httpx.post(keyless.url + "/v1/completions", content=body, headers=rebound, timeout=30)
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"], r.text
    r = httpx.get(keyless.url + "/v1/models", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 403
    # A body that is not declared JSON: refused before it is read.
    r = httpx.post(keyless.url + "/v1/completions", content=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415, r.text
    # The user's own pages on loopback, and plain clients, are served.
    assert _complete(keyless.url, headers={"Origin": "http://localhost:3000"}).status_code == 200
    assert _complete(keyless.url).status_code == 200


def test_lone_surrogates_get_a_400(gateways):
    _, keyless = gateways
    for field in ('"prompt": "a\\ud800b"', '"prompt": "ok", "stop": ["\\udfff"]'):
        body = '{"model": "moestream", "max_tokens": 2, ' + field + "}"
        r = httpx.post(
            keyless.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_a_configured_origin_is_served(gateways):
    _, keyless = gateways
    assert _complete(keyless.url, headers={"Origin": "https://app.example"}).status_code == 200
    assert _complete(keyless.url, headers={"Origin": "https://app.example.evil"}).status_code == 403


def test_headers_or_a_body_sent_too_slowly_are_cut_off(gateways):
    _, keyless = gateways  # read timeout 1 s
    host, port = keyless.url.removeprefix("http://").split(":")
    headers_only = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    half_body = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": '
    )
    for start in (headers_only, half_body):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(start)
            tic = time.monotonic()
            rest = s.recv(65536)  # b"" once the gateway closes it (after a reply, for the body)
            while rest and b"\r\n\r\n" in rest and s.recv(65536):
                pass
            assert 0.5 < time.monotonic() - tic < 5.0, start
    assert _complete(keyless.url).status_code == 200


def test_the_log_is_rate_limited():
    import logging

    from moestream.client.gateway.guard import LOG_LINES_PER_WINDOW, LOG_WINDOW_SECONDS
    from moestream.shared.log_rate import RateLimitFilter

    f = RateLimitFilter(LOG_LINES_PER_WINDOW, LOG_WINDOW_SECONDS)
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "Invalid HTTP request received.", (), None)
    passed = sum(f.filter(record) for _ in range(10 * LOG_LINES_PER_WINDOW))
    assert passed == LOG_LINES_PER_WINDOW


def test_the_note_of_lines_left_out_fits_any_handlers_format(monkeypatch):
    """uvicorn's access lines are formatted from their five arguments: the note that says
    how many of them were left out goes through a logger of its own, not through theirs."""
    import io
    import logging

    from uvicorn.logging import AccessFormatter

    from moestream.shared import log_rate

    clock = [0.0]
    monkeypatch.setattr(log_rate.time, "monotonic", lambda: clock[0])
    notes, access = io.StringIO(), io.StringIO()
    shared = log_rate.RateLimitFilter(2, 10.0)
    handler = logging.StreamHandler(access)
    handler.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False))
    handler.addFilter(shared)
    logger = logging.getLogger("test.access")
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "level", logging.INFO)
    note_logger = logging.getLogger(log_rate.NOTE_LOGGER)
    monkeypatch.setattr(note_logger, "handlers", [logging.StreamHandler(notes)])
    monkeypatch.setattr(note_logger, "propagate", False)
    monkeypatch.setattr(logging, "raiseExceptions", True)
    for _ in range(5):
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/dashboard/state", "1.1", 200)
    clock[0] = 11.0
    logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/", "1.1", 200)
    assert access.getvalue().count("GET /dashboard/state") == 2 and "GET / HTTP/1.1" in access.getvalue()
    assert notes.getvalue() == "3 lines of test.access's log left out in 11 s\n"
