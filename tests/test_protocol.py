"""The wire protocol: round trips, validation of every field, and random input."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.shared import protocol as proto
from moestream.shared.status import (
    CacheUseStats,
    KeepAliveStatus,
    LayerStatus,
    PhaseCounts,
    PoolStatus,
    PoolTotals,
    RequestInfo,
    RequestsStatus,
    RequestStats,
    RequestTotals,
    Stats,
    Status,
)


def pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def generate_body(**fields):
    return {"v": proto.PROTOCOL_VERSION, "type": "generate", "id": "r1", "prompt": "hi", **fields}


@pytest.mark.parametrize(
    "message",
    [
        proto.Generate(id="a", prompt="hello", max_tokens=3, temp=0.5, top_p=0.9, seed=7, stop=("\n", "END")),
        proto.Generate(id="b", prompt_ids=(1, 2, 3)),
        proto.Generate(id="g", prompt="hi", client="openai 127.0.0.1 (OpenAI/Python 1.40)"),
        proto.Generate(
            id="h",
            prompt="hi",
            sampling=proto.SamplingControls(
                min_p=0.05,
                presence_penalty=1.5,
                frequency_penalty=-0.5,
                repetition_penalty=1.1,
                penalty_window=64,
                logit_bias=((3, -100.0), (9, 2.5)),
                logprobs=5,
            ),
        ),
        proto.Cancel(id="c", target="a"),
        proto.Status(id="s"),
        proto.Stats(id="t"),
        proto.Shutdown(id="x"),
        proto.Ping(id="p"),
        proto.Load(id="l"),
        proto.Load(id="l", keep_alive=0.0),
    ],
)
def test_requests_round_trip(message):
    assert proto.decode_request(proto.encode(message)) == message


@pytest.mark.parametrize(
    "message",
    [
        proto.Token(id="a", text="hé", token=5),
        proto.Token(
            id="a",
            text="hé",
            token=5,
            logprobs=(
                proto.TokenLogprob(5, "hé", -0.25, (proto.TopLogprob(5, "hé", -0.25), proto.TopLogprob(7, "x", -2.0))),
            ),
        ),
        proto.Done(id="a", text="", tokens=[], finish_reason="stop", logprobs=()),
        proto.Done(
            id="a",
            text="hé",
            tokens=[5, 6],
            finish_reason="length",
            stats=RequestStats(hit_rate=0.5, hits=PhaseCounts(3, 4), prefill={"layers": [{"x": None}]}),
        ),
        proto.Error(id="a", code=proto.ENGINE, message="cannot read expert 3 of layer 1"),
        proto.Pong(id="p", pid=12, state="ready", version="0.1.0"),
        proto.StatusReply(id="s", status=Status(state="ready", pid=1)),
        proto.StatusReply(
            id="s",
            status=Status(
                state="ready",
                pool=PoolStatus(layers=[LayerStatus(0, 3, 4, 1, 0.5, 9)]),
                requests=RequestsStatus(running=[RequestInfo("r", "c", "decode", 5, None, None, 2, 8, 0.5)]),
                keep_alive=KeepAliveStatus(keep_alive_s=300.0, setting_s=300.0, unloads=1),
            ),
        ),
        proto.StatsReply(
            id="t",
            stats=Stats(state="ready", requests=RequestTotals(requests=3, queued=1), pool=PoolTotals(evictions=2)),
        ),
        proto.Cancelled(id="c", target="a", found=True),
        proto.LoadReply(id="l", state="unloaded", in_flight=0),
        proto.ShutdownReply(id="x", pid=12),
    ],
)
def test_replies_round_trip(message):
    assert proto.decode_reply(proto.encode(message)) == message


def test_status_and_request_stats_arrive_as_dataclasses_never_as_plain_maps():
    """A client gets the daemon's status and a request's statistics typed, nested maps
    too (shared/status.py): a key a newer daemon adds is left out, a field an older one
    lacks keeps its default, and a nested map of the wrong shape is refused."""
    wire = {
        "state": "ready",
        "pool": {
            "layers": [
                {"layer": 0, "resident": 1, "capacity": 2, "pinned": 0, "hit_rate": None, "routed": 5, "new_key": 1}
            ]
        },
        "requests": {"running": [{"id": "r", "tokens": 2}]},
    }
    body = {"v": proto.PROTOCOL_VERSION, "type": "status", "id": "s", "status": wire}
    status = proto.decode_reply(msgpack.packb(body)).status
    assert isinstance(status, Status) and isinstance(status.pool, PoolStatus)
    assert status.pool.layers == [LayerStatus(0, 1, 2, 0, None, 5)]
    assert isinstance(status.requests.running[0], RequestInfo) and status.requests.running[0].tokens == 2
    assert status.memory.rss_bytes is None and status.keep_alive is None
    done = {
        "v": proto.PROTOCOL_VERSION,
        "type": "done",
        "id": "d",
        "text": "",
        "tokens": [],
        "finish_reason": "stop",
        "stats": {"hits": {"prefill": 2, "decode": 3}, "prompt_cache": {"reused_tokens": 7}},
    }
    stats = proto.decode_reply(msgpack.packb(done)).stats
    assert isinstance(stats, RequestStats) and stats.hits == PhaseCounts(2, 3)
    assert isinstance(stats.prompt_cache, CacheUseStats) and stats.prompt_cache.reused_tokens == 7
    for bad in ({"state": "ready", "pool": [1]}, {"state": "ready", "requests": {"running": {"id": "r"}}}, {}):
        with pytest.raises(proto.ProtocolError):
            proto.decode_reply(msgpack.packb(body | {"status": bad}))
    # `stats` too: its request counters and pool totals typed, the modules' reports as they sent them.
    reply = {"v": proto.PROTOCOL_VERSION, "type": "stats", "id": "t"}
    layer = {"layer": 0, "resident": 1, "capacity": 2, "pinned": 0, "hit_rate": 0.5, "routed": 3}
    wire_stats = {
        "state": "ready",
        "requests": {"completed": 4, "queued": 1, "new_key": 0},
        "pool": {"hits_decode": 9, "layers": [layer], "admission": {"mode": "direct"}, "new_key": 1},
        "reader": {"reads": 2},
    }
    got = proto.decode_reply(msgpack.packb(reply | {"stats": wire_stats})).stats
    assert isinstance(got, Stats) and got.requests == RequestTotals(completed=4, queued=1)
    assert got.pool == PoolTotals(hits_decode=9, layers=[LayerStatus(**layer)], admission={"mode": "direct"})
    assert got.reader == {"reads": 2}
    with pytest.raises(proto.ProtocolError):
        proto.decode_reply(msgpack.packb(reply | {"stats": {"requests": {}}}))  # no state


def test_numpy_scalars_travel_as_numbers():
    import numpy as np

    data = proto.encode(proto.StatsReply(id="s", stats=Stats("ready", reader={"n": np.int64(3), "f": np.float32(0.5)})))
    assert proto.decode_reply(data).stats.reader == {"n": 3, "f": 0.5}


def code_of(data: bytes) -> str:
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_request(data)
    return info.value.code


@pytest.mark.parametrize(
    "data, code",
    [
        (b"", proto.BAD_MESSAGE),
        (b"\xc1", proto.BAD_MESSAGE),  # a reserved msgpack code
        (b"\x92\x01", proto.BAD_MESSAGE),  # truncated array
        (pack([1, 2]), proto.BAD_MESSAGE),  # not a map
        (pack({1: 2}), proto.BAD_MESSAGE),  # non-string key
        (pack({"type": "ping", "id": "a"}), proto.BAD_VERSION),
        (pack({"v": 2, "type": "ping", "id": "a"}), proto.BAD_VERSION),
        (pack({"v": True, "type": "ping", "id": "a"}), proto.BAD_VERSION),
        (pack({"v": 1, "type": "launch", "id": "a"}), proto.UNKNOWN_TYPE),
        (pack({"v": 1, "type": "ping"}), proto.BAD_MESSAGE),
        (pack({"v": 1, "type": "ping", "id": ""}), proto.BAD_MESSAGE),
        (pack({"v": 1, "type": "ping", "id": "x" * 65}), proto.BAD_MESSAGE),
        (pack({"v": 1, "type": "ping", "id": "a", "extra": 1}), proto.BAD_MESSAGE),
        (pack({"v": 1, "type": "cancel", "id": "a"}), proto.BAD_MESSAGE),
        (pack(generate_body(prompt=None)), proto.BAD_MESSAGE),  # neither prompt nor ids
        (pack(generate_body(prompt_ids=[1])), proto.BAD_MESSAGE),  # both
        (pack(generate_body(prompt=b"bytes")), proto.BAD_MESSAGE),
        (pack(generate_body(prompt=None, prompt_ids=[])), proto.BAD_MESSAGE),
        (pack(generate_body(prompt=None, prompt_ids=[-1])), proto.BAD_MESSAGE),
        (pack(generate_body(prompt=None, prompt_ids=[True])), proto.BAD_MESSAGE),
        (pack(generate_body(max_tokens=0)), proto.BAD_MESSAGE),
        (pack(generate_body(max_tokens=True)), proto.BAD_MESSAGE),
        (pack(generate_body(max_tokens=2.0)), proto.BAD_MESSAGE),
        (pack(generate_body(temp=-1)), proto.BAD_MESSAGE),
        (pack(generate_body(temp=float("nan"))), proto.BAD_MESSAGE),
        (pack(generate_body(top_p=0)), proto.BAD_MESSAGE),
        (pack(generate_body(seed=-1)), proto.BAD_MESSAGE),
        (pack(generate_body(stop="x")), proto.BAD_MESSAGE),
        (pack(generate_body(stop=[""])), proto.BAD_MESSAGE),
        (pack(generate_body(stop=["x"] * 17)), proto.BAD_MESSAGE),
        (pack(generate_body(client="")), proto.BAD_MESSAGE),
        (pack(generate_body(client="x" * (proto.MAX_CLIENT_CHARS + 1))), proto.BAD_MESSAGE),
        (pack(generate_body(client="line\nbreak")), proto.BAD_MESSAGE),
        (pack(generate_body(client=7)), proto.BAD_MESSAGE),
        (pack(generate_body(sampling=[])), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"top_k": 3})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"min_p": 1.5})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"presence_penalty": 2.5})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"repetition_penalty": 0})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"penalty_window": 0})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"logit_bias": [[1, 101]]})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"logit_bias": [[1, 1], [1, 2]]})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"logit_bias": {"1": 2}})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"logprobs": 21})), proto.BAD_MESSAGE),
        (pack(generate_body(sampling={"logprobs": True})), proto.BAD_MESSAGE),
        (pack(generate_body(prompt="x" * (proto.MAX_PROMPT_CHARS + 1))), proto.TOO_LARGE),
        (pack(generate_body(prompt=None, prompt_ids=[1] * (proto.MAX_PROMPT_IDS + 1))), proto.TOO_LARGE),
        (b"\x00" * (proto.MAX_MESSAGE_BYTES + 1), proto.TOO_LARGE),
    ],
)
def test_bad_requests_are_refused_with_a_code(data, code):
    assert code_of(data) == code


def test_error_keeps_the_request_id_when_it_is_readable():
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_request(pack(generate_body(max_tokens=0)))
    assert info.value.request_id == "r1"
    assert "max_tokens" in info.value.message


def test_error_messages_stay_short_for_huge_values():
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_request(pack({"v": 1, "type": "x" * 100_000, "id": "a"}))
    assert len(info.value.message) < 300


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_escape_as_anything_but_protocol_error(data):
    try:
        proto.decode_request(data)
    except proto.ProtocolError as e:
        assert e.code in (proto.BAD_MESSAGE, proto.BAD_VERSION, proto.UNKNOWN_TYPE, proto.TOO_LARGE)


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["v", "type", "id", "prompt", "prompt_ids", "max_tokens", "temp", "top_p", "seed", "stop", "target", "zz"]
        ),
        values,
        max_size=8,
    ),
    st.sampled_from(sorted(proto.REQUEST_TYPES)),
)
def test_random_maps_are_validated(body, kind):
    body = {"v": 1, "id": "r", "type": kind, **body}
    try:
        msg = proto.decode_request(pack(body))
    except proto.ProtocolError:
        return
    # Whatever got through is well-typed and re-encodes to the same message.
    assert isinstance(msg, proto.REQUEST_TYPES[kind])
    assert proto.decode_request(proto.encode(msg)) == msg
    if isinstance(msg, proto.Generate):
        assert (msg.prompt is None) != (msg.prompt_ids is None)
        assert isinstance(msg.max_tokens, int) and msg.max_tokens >= 1


def test_client_side_imports_no_mlx():
    code = (
        "import sys; import moestream.client.client, moestream.client.cli.daemon, moestream.client.cli, "
        "moestream.shared.protocol, moestream.shared.runtime_dir; "
        "bad = [m for m in ('mlx', 'mlx_lm', 'numpy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
