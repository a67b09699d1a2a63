"""The Python side of the read engine (daemon/pool/expert_reader.py) in a pool: checksums."""

from __future__ import annotations

import shutil

import pytest
from pool_store import run_tokens

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.expert_reader import ExpertReadError
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_checksum_mismatch_is_caught(store, tmp_path):
    broken = tmp_path / "store"
    shutil.copytree(store, broken)
    layer = load_manifest(broken).layers[0]
    path = broken / layer.file
    data = bytearray(path.read_bytes())
    for e in range(layer.num_experts):
        data[e * layer.stride + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    sm = load_streaming_model(broken, Settings(capacity=4, verify_checksums=True))
    try:
        with pytest.raises(ExpertReadError, match="checksum"):
            run_tokens(sm)
    finally:
        sm.close()
