"""Loading a store as a streaming model (daemon/model/streaming_model.py)."""

from __future__ import annotations

import pytest

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings


def test_missing_store_is_a_clear_error(tmp_path):
    from moestream.shared.store_format import StoreError

    with pytest.raises(StoreError, match="does not exist"):
        load_streaming_model(tmp_path / "nope", Settings())


def _random_key_graph_edges() -> int:
    """The edges of the graph behind MLX's global random key (0: an evaluated key)."""
    import io

    import mlx.core as mx

    dot = io.StringIO()
    mx.export_to_dot(dot, mx.random.state[0])
    return dot.getvalue().count("->")


def test_model_builds_leave_no_graph_behind_the_random_key(tiny_model):
    """Each build drew its initial weights from the global random key, lazily: the key's
    graph grew by every draw of every build, for the process's life (0.11 MiB of the
    daemon's RSS per keep-alive reload or draft model)."""
    from tiny_models import tiny_store

    from moestream.daemon.model.speculative import load_draft_model

    with tiny_store("msrk") as store:
        for _ in range(3):
            load_streaming_model(store, Settings(capacity=4)).close()
            assert _random_key_graph_edges() == 0
        load_draft_model(store)
        assert _random_key_graph_edges() == 0
    load_draft_model(tiny_model("qwen3_moe"))  # an mlx-lm folder
    assert _random_key_graph_edges() == 0
