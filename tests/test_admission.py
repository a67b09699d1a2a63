"""Which admitter a machine and its settings get (daemon/pool/admission.py `make_admitter`)."""

from __future__ import annotations

import pytest

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_host_cache_below_one_expert_is_refused(store):
    from moestream.shared.settings import SettingsError

    with pytest.raises(SettingsError, match="below one expert"):
        load_streaming_model(store, Settings(capacity=0.25, host_cache=1000))
