"""Hot-path diagnostics: every figure present and self-consistent, and nothing changed
(output, host syncs per token) when they are off."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from test_daemon import clean_env, ctl, paths_of, wait_for

from moestream.daemon.model.diagnostics import BUCKETS, NULL_RECORDER, SEGMENTS
from moestream.daemon.model.generation import SamplingParams, generate
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings, demo_store_path

# 24 tokens of code (`def route(hidden, gate, k=2):\n    scores = gate(hidden)\n` in the demo's
# tokenizer): a prefill that overflows a 25% pool, and an answer that runs all TOKENS
# (the chat fine-tune ends a turn of arbitrary ids at once).
PROMPT = [
    315,
    994,
    1275,
    8,
    72,
    3814,
    278,
    12,
    477,
    387,
    12,
    754,
    29,
    18,
    302,
    270,
    299,
    334,
    1031,
    277,
    477,
    387,
    8,
    72,
]
TOKENS = 24


def _run(prefetch: str, diagnostics: bool, capacity: float = 0.25):
    sm = load_streaming_model(demo_store_path(), Settings(capacity=capacity, prefetch=prefetch))
    try:
        result = generate(sm, PROMPT, SamplingParams(max_tokens=TOKENS, diagnostics=diagnostics))
        return result, sm.pool_stats(), sm.diagnostics
    finally:
        sm.close()


@pytest.fixture(scope="module")
def diagnosed():
    return _run("on", True)


def test_every_diagnostic_is_present_and_consistent(diagnosed):
    result, pool, hub = diagnosed
    d = result.stats.diagnostics
    k = 8  # the demo model's top-k
    # Attribution covers every routed expert exactly once, by the pool's own phases.
    for phase in ("prefill", "decode"):
        buckets = d["attribution"][phase]
        assert set(buckets) == set(BUCKETS)
        assert sum(buckets.values()) == getattr(pool, f"hits_{phase}") + getattr(pool, f"misses_{phase}") > 0
        assert buckets["resident_hit"] == getattr(pool, f"hits_{phase}")
    assert d["attribution"]["decode"]["prefetched"] > 0
    assert d["attribution"]["prefill"]["prefetched"] == 0  # prefills are not prefetched
    for phase, recall in d["recall"].items():
        values = [recall["top_k"], recall["top_2k"], recall["top_4k"]]
        assert all(0.0 <= v <= 1.0 for v in values), (phase, recall)
        assert values == sorted(values)
        assert recall["routed"] > 0
    for name in SEGMENTS:
        assert d["segments"][name]["count"] > 0 and d["segments"][name]["seconds"] > 0, name
    for name in ("predict", "submit", "promote_take", "promote_route", "promote_place"):
        assert d["host"][name]["count"] > 0, name
    assert d["window"]["count"] > 0 and d["window"]["mean_ms"] > 0
    layers = d["layers"]
    assert len(layers) == 5
    for ordinal, layer in layers.items():
        union = layer["union"]
        # mlx-lm prefills all but the prompt's last token, which goes with the decode steps.
        chunk = str(len(PROMPT) - 1)
        assert set(union) == {"1", chunk}
        decode = union["1"]
        assert decode["forwards"] >= TOKENS
        assert k <= decode["p50"] <= decode["p99"] <= decode["max"] <= k  # one token: exactly k
        prefill = union[chunk]
        assert prefill["forwards"] == 1 and k <= prefill["max"] <= 64
    # The first MoE layer has no layer before it to predict it.
    assert layers["0"]["recall"]["decode"]["routed"] == 0
    assert layers["1"]["recall"]["decode"]["routed"] > 0
    # The request's recorder went into the totals, and the switch is off again.
    assert hub.recorder is NULL_RECORDER
    assert hub.totals()["attribution"] == d["attribution"]
    # Promoted: finished reads, and those still in flight that the layer waited for.
    decode = d["attribution"]["decode"]
    assert result.stats.prefetch["promoted"] == decode["prefetched"] + decode["predicted_not_finished"]
    assert result.stats.prefetch["waited"] <= decode["predicted_not_finished"]
    json.dumps(result.stats.to_dict())  # travels as plain data


def test_off_changes_neither_output_nor_syncs(diagnosed):
    on_result, _, _ = diagnosed
    plain, plain_pool, hub = _run("off", False)
    prefetched, _, hub_pf = _run("on", False)
    assert plain.tokens == prefetched.tokens == on_result.tokens
    # Prefetch adds no host sync: its prediction is read in the layer's one sync.
    assert plain.stats.host_syncs_per_token == prefetched.stats.host_syncs_per_token == 5 + 1
    assert plain_pool.host_syncs % 5 == 0
    assert plain.stats.diagnostics is None and prefetched.stats.diagnostics is None
    assert hub.totals() is None and hub_pf.totals() is None and hub.recorder is NULL_RECORDER


def test_daemon_reports_diagnostics_per_request_and_in_stats():
    from moestream.client.client import Client

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msdg"))
    env = clean_env()
    out = ctl(
        "start",
        "--model",
        str(demo_store_path()),
        "--capacity",
        "0.25",
        "--runtime-dir",
        str(rt),
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        with Client(paths_of(rt)) as c:
            plain = c.complete(prompt_ids=PROMPT, max_tokens=8)
            assert plain.stats.diagnostics is None
            assert c.stats().diagnostics["totals"] is None
            done = c.complete(prompt_ids=PROMPT, max_tokens=8, diagnostics=True)
            assert done.tokens == plain.tokens
            d = done.stats.diagnostics
            assert sum(d["attribution"]["decode"].values()) > 0
            # The status snapshot is published just after the done event.
            st = wait_for(
                lambda: (lambda s: s if s.diagnostics["totals"] else None)(c.stats()), 10, "diagnostics in stats"
            )
        # Prefetch is the daemon's to decide (auto: measured at its start); the diagnostics are recorded either way.
        assert st.prefetch["mode"] == "auto"
        assert st.prefetch["enabled"] or st.prefetch["submitted"] == 0
        assert st.diagnostics["totals"]["attribution"] == d["attribution"]
        text = ctl("stats", "--runtime-dir", str(rt), env=env)
        assert text.returncode == 0, text.stderr
        assert "prefetch: auto (" in text.stdout and "diagnostics: recall top_k" in text.stdout
        assert "union by tokens per sequence: 1: p50 8" in text.stdout
    finally:
        stopped = ctl("stop", "--runtime-dir", str(rt), env=env)
        shutil.rmtree(rt)
        assert stopped.returncode == 0, stopped.stderr


def test_the_request_flag_is_checked_and_left_out_when_unset():
    import msgpack

    from moestream.shared import protocol as proto

    plain = proto.encode(proto.Generate(id="a", prompt="hi"))
    assert "diagnostics" not in msgpack.unpackb(plain)
    assert proto.decode_request(plain).diagnostics is None
    flagged = proto.decode_request(proto.encode(proto.Generate(id="a", prompt="hi", diagnostics=True)))
    assert flagged.diagnostics is True
    body = msgpack.unpackb(plain) | {"diagnostics": "yes"}
    with pytest.raises(proto.ProtocolError, match="'diagnostics' must be"):
        proto.decode_request(msgpack.packb(body))


def test_the_daemon_wide_switch_records_every_request():
    sm = load_streaming_model(demo_store_path(), Settings(capacity=0.25, diagnostics=True, prefetch="off"))
    try:
        result = generate(sm, PROMPT, SamplingParams(max_tokens=4))
        d = result.stats.diagnostics
        # Prefetch off: predictions still feed recall and attribution, nothing is read.
        assert d["attribution"]["decode"]["prefetched"] == 0
        assert d["recall"]["decode"]["routed"] > 0
        assert result.stats.prefetch["submitted"] == 0
    finally:
        sm.close()


def test_off_the_hot_path_records_into_a_recorder_that_does_nothing():
    """The layers record through `Diagnostics.recorder` either way: off, the null
    recorder, whose `with` blocks are one shared object (nothing made per call)."""
    from moestream.daemon.model.diagnostics import Diagnostics, NullRecorder, Recorder

    hub = Diagnostics()
    assert hub.recorder is NULL_RECORDER and isinstance(hub.recorder, NullRecorder) and not hub.recorder.active
    assert hub.recorder.segment(0, "read") is hub.recorder.host(1, "predict")
    rec = Recorder()
    with hub.recording(rec):
        assert hub.recorder is rec and rec.active
        with hub.recording(None):  # a request without diagnostics, inside
            assert hub.recorder is NULL_RECORDER
        assert hub.recorder is rec
    assert hub.recorder is NULL_RECORDER


def test_a_fully_resident_pool_records_the_same_figures_and_tokens():
    """At full residency diagnostics read the routing back for the union (the only
    sync they add there) and time the expert call; the tokens are those without."""
    plain, _, _ = _run("off", False, capacity=1.0)
    diagnosed, pool, _ = _run("off", True, capacity=1.0)
    assert diagnosed.tokens == plain.tokens
    assert pool.host_syncs == 0
    d = diagnosed.stats.diagnostics
    for name in ("outside", "route", "matmul", "combine"):
        assert d["segments"][name]["count"] > 0, name
    for layer in d["layers"].values():
        assert layer["union"]["1"]["max"] == 8  # one token: exactly k
