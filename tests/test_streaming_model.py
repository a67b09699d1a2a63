"""Loading a store as a streaming model (daemon/model/streaming_model.py)."""

from __future__ import annotations

import pytest

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings


def test_missing_store_is_a_clear_error(tmp_path):
    from moestream.shared.store_format import StoreError

    with pytest.raises(StoreError, match="does not exist"):
        load_streaming_model(tmp_path / "nope", Settings())
