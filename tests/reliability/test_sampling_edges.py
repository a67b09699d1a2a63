"""Sampling parameters at the edge of what float32 can compute: a temperature or top_p
below its floor (shared/protocol.py MIN_TEMP, MIN_TOP_P) is the greedy choice it tends
to, for every seed, never garbage; text UTF-8 cannot carry is a clear refusal."""

from __future__ import annotations

import time

import pytest

from moestream.client.client import Client, RequestRejected

from .conftest import CASES


@pytest.fixture(scope="module")
def daemon(rel_store, tmp_path_factory):
    import tempfile
    from pathlib import Path

    from moestream.daemon.bench.soak.driver import DaemonProcess

    from .conftest import CAPACITY

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mse"))
    with DaemonProcess.start(rel_store, rt / "rt", capacity=CAPACITY) as d:
        yield d


@pytest.mark.parametrize(("temp", "top_p"), [(1e-39, 1.0), (1e-30, 1.0), (0.5, 1e-46), (1.0, 1e-9)])
def test_tiny_temperature_or_top_p_is_greedy_for_every_seed(daemon, rel_reference, temp, top_p):
    prompt, max_tokens = CASES[0]
    ref = rel_reference[(prompt, max_tokens)]
    with Client(daemon.paths, timeout=30) as c:
        for seed in (1, 2, 3):
            done = c.complete(prompt, max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed)
            assert tuple(done.tokens) == ref.tokens, (temp, top_p, seed)


def test_lone_surrogates_are_refused_clearly(daemon, rel_reference):
    with Client(daemon.paths, timeout=30) as c:
        for kwargs in ({"prompt": "a\ud800b"}, {"prompt": "ok", "stop": ["\udfff"]}):
            with pytest.raises(RequestRejected) as e:
                c.generate(max_tokens=4, **kwargs)
            assert e.value.code == "bad_message" and "surrogate" in e.value.message
        prompt, max_tokens = CASES[0]
        assert tuple(c.complete(prompt, max_tokens=max_tokens).tokens) == rel_reference[(prompt, max_tokens)].tokens


def test_speculation_this_store_cannot_do_is_a_bad_message(daemon, workdir):
    with Client(daemon.paths, timeout=30) as c:
        for kwargs in ({"speculative": "mtp"}, {"speculative": "draft", "draft_model": str(workdir / "nothing")}):
            with pytest.raises(RequestRejected) as e:
                c.complete("hi", max_tokens=4, **kwargs)
            assert e.value.code == "bad_message", e.value


def test_a_stopped_daemon_is_reported_with_the_time_really_waited(daemon):
    import os
    import signal

    from moestream.client.client import DaemonDied

    with Client(daemon.paths, timeout=1.0) as c:
        stream = c.generate(CASES[0][0], max_tokens=400)
        next(stream)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            tic = time.monotonic()
            with pytest.raises(DaemonDied) as e:
                list(stream)
            waited = time.monotonic() - tic
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    assert f"for {waited:.0f} s, nor to a ping" in str(e.value) or f"for {waited - 1:.0f} s" in str(e.value), (
        waited,
        str(e.value),
    )
