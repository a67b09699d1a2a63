"""One request's tokens and statistics (daemon/model/generation.py) over a partial pool."""

from __future__ import annotations

import pytest

from moestream.daemon.model.generation import SamplingParams, generate
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_generate_stats(store):
    sm = load_streaming_model(store, Settings(capacity=0.25))
    try:
        r = generate(sm, [1, 2, 3, 4, 5], SamplingParams(max_tokens=12))
    finally:
        sm.close()
    s = r.stats
    assert len(r.tokens) == s["generated_tokens"] <= 12
    assert s["misses"]["prefill"] > 0 and s["hits"]["decode"] + s["misses"]["decode"] > 0
    assert (
        s["bytes_read"]
        == (s["misses"]["prefill"] + s["misses"]["decode"]) * load_manifest(store).layers[0].expert_bytes
    )
    n_moe = len(load_manifest(store).layers)
    assert s["host_syncs_per_token"] == pytest.approx(n_moe + 1)


def test_an_end_token_ends_the_request_and_is_not_among_its_tokens(store):
    """moestream's convention, the same in every path (alone, batched, speculative: one
    loop, `iter_generate`): `tokens` are the tokens of the text, so an end token that
    stops the request is not among them (stock's `generate_step` yields it last);
    `finish_reason` "stop" says an end token (or a stop string) ended it."""
    from moestream.daemon.model.batching import BatchSession

    sm = load_streaming_model(store, Settings(capacity=0.5))
    try:
        free = generate(sm, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8))
        assert free.finish_reason == "length" and len(free.tokens) == 8
        # Make a later greedy token, new at its place, an end token of this model: the
        # same request then stops there, with the tokens before it.
        at = next(i for i in range(1, 8) if free.tokens[i] not in free.tokens[:i])
        sm.tokenizer.eos_token_ids = {free.tokens[at]}
        for batch in (None, BatchSession(sm, max_batch=2)):
            ended = generate(sm, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), batch=batch)
            assert ended.finish_reason == "stop" and ended.tokens == free.tokens[:at], batch
            assert ended.stats["generated_tokens"] == at
    finally:
        sm.close()
