"""Fuzzing the daemon's message handling over its real socket: every message gets the
reply `decode_request` predicts (an error with its code, or the valid request's reply),
the daemon never crashes, and a well-formed client streams exact output meanwhile.

`moestreamctl bench soak --fuzz N` runs the same driver with thousands of messages.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moestream.daemon.bench.soak.driver import DaemonProcess
from moestream.daemon.bench.soak.fuzz import Dealer, FuzzCase, check_one, exact_request, run_fuzz

from .conftest import CAPACITY


@pytest.fixture(scope="module")
def daemon(rel_store) -> Iterator[DaemonProcess]:
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="msf"))
    try:
        with DaemonProcess.start(rel_store, folder / "rt", capacity=CAPACITY) as d:
            yield d
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def dealer(daemon) -> Iterator[Dealer]:
    d = Dealer(daemon.paths)
    yield d
    d.close()


def test_driver_mix_with_a_good_client_in_parallel(daemon, rel_reference):
    report = run_fuzz(daemon.paths, daemon.pid, 400, seed=1, good_client=exact_request(rel_reference, random.Random(2)))
    print({k: report[k] for k in ("messages", "wrong_replies", "crashes", "good_client_requests", "seconds")})
    assert report["wrong_replies"] == 0, report["wrong_examples"]
    assert report["crashes"] == 0 and daemon.alive()
    assert report["good_client_requests"] > 0 and report["good_client_mismatched"] == 0, report["good_client_errors"]
    assert report["ok"]
    # every kind of bad input was in the mix
    assert set(report["by_kind"]) >= {
        "bytes",
        "truncated",
        "wrong_type",
        "huge",
        "version",
        "frames",
        "nested",
        "oversize_drop",
    }
    log = daemon.paths.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, "bad input must be refused, never raise inside the daemon"


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
FIELDS = [
    "v",
    "type",
    "id",
    "prompt",
    "prompt_ids",
    "messages",
    "max_tokens",
    "temp",
    "top_p",
    "seed",
    "stop",
    "target",
    "zz",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.dictionaries(st.sampled_from(FIELDS), values, max_size=8),
    kind=st.sampled_from(["generate", "cancel", "ping", "status", "stats", "unknown"]),
    version=st.sampled_from([1, 1, 1, 0, 2, "1", None]),
)
def test_hypothesis_maps_get_the_predicted_reply(dealer, daemon, body, kind, version):
    body = {"v": version, "id": "h", "type": kind, **body}
    if body.get("type") == "shutdown":
        body["type"] = "ping"
    frame = msgpack.packb(body, use_bin_type=True)
    assert check_one(dealer, FuzzCase("hypothesis", (frame,))) is None
    assert daemon.alive()


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=400), frames=st.integers(1, 3))
def test_hypothesis_bytes_get_the_predicted_reply(dealer, daemon, data, frames):
    assert check_one(dealer, FuzzCase("hypothesis", (data,) * frames)) is None
    assert daemon.alive()
