"""Keep-alive: a real daemon releases its model after `keep_alive` idle (RSS and MLX
memory fall), keeps its socket and heat keeper, and serves the next request exactly as
before, loading again warm (autopin from the heat) with the load's progress shown to the
client; 0 unloads after each request, -1 never."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import msgpack
import pytest
from daemon_cli import clean_env, ctl, wait_for

from moestream.client.client import Accepted, Client, Done, Progress, RequestRejected, Token
from moestream.daemon.keep_alive import KeepAlive
from moestream.shared import protocol as proto
from moestream.shared.settings import demo_store_path

PROMPT = "The farmer counted his hens"
N_TOKENS = 24


def _generate(client: Client, **kwargs) -> tuple[list[int], list[Progress]]:
    progress, done = [], None
    for event in client.generate(PROMPT, max_tokens=N_TOKENS, progress=True, **kwargs):
        if isinstance(event, Progress):
            progress.append(event)
        elif isinstance(event, Done):
            done = event
        else:
            assert isinstance(event, (Accepted, Token))
    assert done is not None and done.finish_reason == "length"
    return done.tokens, progress


def _state(client: Client) -> str:
    return client.status().state


def test_the_idle_clock():
    ka = KeepAlive(10.0)
    assert not ka.due(100.0)  # busy until told it is idle
    ka.idle(100.0)
    ka.idle(105.0)  # the clock runs from when it first went idle
    assert not ka.due(109.9) and ka.due(110.0)
    ka.request(0.0)  # a request's own keep_alive counts for the idle time after it
    assert ka.idle_since is None and not ka.due(200.0)
    ka.idle(200.0)
    assert ka.due(200.0)
    ka.request(-1.0)
    ka.idle(300.0)
    assert not ka.due(1e9)
    ka.request(None)
    ka.idle(400.0)
    assert ka.seconds == 10.0 and ka.status(405.0).unload_in_s == pytest.approx(5.0)


@pytest.mark.slow  # a real daemon's start, idle times and loads: about 15 s on a shared 2-core machine
def test_idle_unload_frees_memory_and_the_next_request_loads_warm_and_exact(tmp_path):
    """keep_alive 1s on the demo model with a partial pool and a host tier; then a request's own
    keep_alive 0 (unloaded after it) and -1 (never)."""
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "heat"), MOESTREAM_HEAT_FLUSH_SECONDS="0.2")
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="ka"))
    out = ctl(
        "start",
        "--model",
        str(demo_store_path()),
        "--runtime-dir",
        str(rt),
        "--capacity",
        "0.5",
        "--host-cache",
        "2M",
        "--keep-alive",
        "1s",
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        with Client(rt, timeout=30.0) as c:
            first, progress = _generate(c)
            assert not [p for p in progress if p.stage == "load"]  # loaded at start
            loaded = c.status()
            assert loaded.state == "ready" and loaded.keep_alive.keep_alive_s == 1.0
            assert loaded.memory.pool_bytes > 0
            wait_for(lambda: _state(c) == "unloaded", 10, "the idle unload")
            st = c.status()
            ka = st.keep_alive
            assert ka.unloads == 1 and st.heat["state"] == "running"
            assert st.store_id == loaded.store_id  # still known, for clients that check it
            assert st.memory.pool_bytes is None and st.capacity is None
            # MLX gives back (nearly) everything; the process's RSS falls by at least the
            # weights and pool it held.
            held = loaded.memory.resident_weights_bytes + loaded.memory.pool_bytes
            assert ka.mlx_active_after_bytes < 0.05 * ka.mlx_active_before_bytes, ka
            assert ka.rss_after_bytes < ka.rss_before_bytes - held, ka
            text = ctl("status", "--runtime-dir", str(rt), env=env)
            assert "unloaded (idle " in text.stdout and "holds      the socket and the heat keeper" in text.stdout
            print("keep-alive figures:", json.dumps(ka.to_dict()))
            again, progress = _generate(c)
            assert again == first
            stages = [(p.done, p.total) for p in progress if p.stage == "load"]
            assert stages == [(0, 2), (1, 2), (2, 2)], progress
            st = c.status()
            assert st.state == "ready" and st.keep_alive.reloads == 1
            # Warm: the heat of the first request pinned experts again.
            assert st.autopin["routing_counts"] > 0 and st.autopin["pinned"] > 0, st.autopin
            assert sum(layer.pinned for layer in st.pool.layers) == st.autopin["pinned"]
            # A request's own keep_alive 0: unloaded as soon as it is done.
            assert _generate(c, keep_alive=0)[0] == first
            wait_for(lambda: _state(c) == "unloaded", 2, "the unload after a request with keep_alive 0")
            # -1: loaded for good after it (well past the daemon's 1 s).
            assert _generate(c, keep_alive=-1)[0] == first
            time.sleep(2.0)
            st = c.status()
            assert st.state == "ready" and st.keep_alive.unload_in_s is None
            assert st.keep_alive.unloads == 2 and st.keep_alive.reloads == 2
            with pytest.raises(RequestRejected, match="keep_alive"):
                c.generate(PROMPT, keep_alive=-2)
    finally:
        stopped = ctl("stop", "--runtime-dir", str(rt), env=env)
        shutil.rmtree(rt, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stderr


@pytest.mark.slow  # a real daemon: about 10 s on a shared 2-core machine
def test_the_setting_zero_unloads_after_each_request_and_minus_one_never(tmp_path):
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "heat"))
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="ka0"))
    out = ctl("start", "--model", str(demo_store_path()), "--runtime-dir", str(rt), "--keep-alive", "0", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        with Client(rt, timeout=30.0) as c:
            wait_for(lambda: _state(c) == "unloaded", 5, "the unload of an idle daemon with keep_alive 0")
            first, progress = _generate(c)
            assert [p.done for p in progress if p.stage == "load"] == [0, 1, 2]
            wait_for(lambda: _state(c) == "unloaded", 2, "the unload right after the request")
            assert c.status().keep_alive.unloads == 2
    finally:
        assert ctl("stop", "--runtime-dir", str(rt), env=env).returncode == 0
        shutil.rmtree(rt, ignore_errors=True)
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="ka1"))
    out = ctl("start", "--model", str(demo_store_path()), "--runtime-dir", str(rt), "--keep-alive", "-1", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        with Client(rt, timeout=30.0) as c:
            assert _generate(c)[0] == first
            time.sleep(1.5)
            st = c.status()
            assert st.state == "ready" and st.keep_alive.keep_alive_s == -1.0
            assert st.keep_alive.unload_in_s is None and st.keep_alive.unloads == 0
        text = ctl("status", "--runtime-dir", str(rt), env=env).stdout
        assert "keep-alive never unloads" in text, text
    finally:
        assert ctl("stop", "--runtime-dir", str(rt), env=env).returncode == 0
        shutil.rmtree(rt, ignore_errors=True)


def test_a_bad_keep_alive_is_refused_by_the_protocol():
    ok = proto.decode_request(proto.encode(proto.Generate(id="a", prompt="x", keep_alive=30.0)))
    assert ok.keep_alive == 30.0
    for bad in (-0.5, float(2**32), True, "5m"):
        data = msgpack.unpackb(proto.encode(proto.Generate(id="a", prompt="x")))
        data["keep_alive"] = bad
        with pytest.raises(proto.ProtocolError, match="keep_alive"):
            proto.decode_request(msgpack.packb(data))


def test_the_gateway_takes_ollamas_keep_alive():
    from moestream.client.gateway.openai import ApiError, parse_request

    def keep(value):
        return parse_request({"prompt": "x", "keep_alive": value}, chat=False).generate.get("keep_alive")

    assert keep("5m") == 300.0 and keep(30) == 30.0 and keep(0) == 0.0 and keep(-1) == -1.0 and keep(None) is None
    assert keep(10**12) == -1.0
    for bad in ("soon", True, [1]):
        with pytest.raises(ApiError, match="keep_alive"):
            keep(bad)
