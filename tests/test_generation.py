"""One request's tokens and statistics (daemon/model/generation.py) over a partial pool."""

from __future__ import annotations

import pytest

from moestream.daemon.model.generation import SamplingParams, generate
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings
from moestream.shared.status import PhaseCounts
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
    assert len(r.tokens) == s.generated_tokens <= 12
    assert s.misses.prefill > 0 and s.hits.decode + s.misses.decode > 0
    assert s.bytes_read == (s.misses.prefill + s.misses.decode) * load_manifest(store).layers[0].expert_bytes
    n_moe = len(load_manifest(store).layers)
    assert s.host_syncs_per_token == pytest.approx(n_moe + 1)


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
            assert ended.stats.generated_tokens == at
    finally:
        sm.close()


def test_a_chats_end_of_turn_text_ends_the_answer_like_an_end_token(pool_store):
    """The demo's vocabulary spells ChatML's `<|im_end|>` in pieces, so no end token stops
    a chat's answer there: `turn_end` finds the marker in the chat template, and a
    request given it ends where its text appears, without it, and with no `stop_string`
    (no stop string of the client's was hit; the turn ended)."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    from moestream.daemon.model.chat import turn_end
    from moestream.shared.settings import demo_store_path

    store = demo_store_path()
    assert turn_end(load_tokenizer(Path(store))) == "<|im_end|>"
    # The tiny models' tokenizer has `<|im_end|>` as one token, not an end token: still
    # the marker; once it is an end token (as Qwen's is), the end token stops the answer.
    tiny = load_tokenizer(Path(pool_store))
    (im_end,) = tiny.encode("<|im_end|>", add_special_tokens=False)
    assert turn_end(tiny) == "<|im_end|>"
    tiny.eos_token_ids = {*tiny.eos_token_ids, im_end}
    assert turn_end(tiny) is None

    sm = load_streaming_model(store, Settings(capacity=0.5))
    try:
        prompt = sm.tokenizer.encode("def fibonacci(n):")
        free = generate(sm, prompt, SamplingParams(max_tokens=24))
        # A piece of the free answer's text, first met past its start, stands in for the marker.
        text = free.text
        at = next(p for p in range(len(text) // 3, len(text) - 4) if text.find(text[p : p + 4]) == p)
        marker = text[at : at + 4]
        ended = generate(sm, prompt, SamplingParams(max_tokens=24, turn_end=marker))
        assert ended.finish_reason == "stop" and ended.stop_string is None
        assert ended.text == free.text[: free.text.index(marker)] and marker not in ended.text
        assert ended.tokens == free.tokens[: len(ended.tokens)] and len(ended.tokens) < len(free.tokens)
        client_stop = generate(sm, prompt, SamplingParams(max_tokens=24, stop=(marker,)))
        assert client_stop.stop_string == marker and client_stop.text == ended.text
    finally:
        sm.close()


def test_a_full_pool_counts_its_routing_with_no_sync_of_its_own(store):
    """At full residency a forward's expert ids never come to the host on their own: they
    are read back once per token, a few tokens late (daemon/pool/resident_routing.py).
    The request still gets the same tokens, the same routing counts as a partial pool
    (which has its ids on the host anyway), a hit per routed expert, and one host sync
    per token (the sampled token's); the heat gets every count."""
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(max_tokens=12)
    part = load_streaming_model(store, Settings(capacity=0.5))
    try:
        want = generate(part, prompt, params)
    finally:
        part.close()
    sm = load_streaming_model(store, Settings(capacity=1.0))
    try:
        assert all(p.fully_resident for p in sm.pools)
        for _ in range(2):
            got = generate(sm, prompt, params)
            assert got.tokens == want.tokens
            s = got.stats
            assert s.routed_experts == want.stats.routed_experts > 0
            assert s.hit_rate == 1.0 and s.misses == PhaseCounts(prefill=0, decode=0)
            # A hit per distinct expert of a forward: what the partial pool looked up
            # (read back late, the prompt's hits may count among the decode's).
            hits, misses = want.stats.hits, want.stats.misses
            looked_up = hits.prefill + hits.decode + misses.prefill + misses.decode
            assert s.hits.prefill + s.hits.decode == looked_up
            assert s.host_syncs_per_token == 1.0  # the sampled token alone
        layers = sm.pool_stats().layers
        assert all(layer.hit_rate == 1.0 for layer in layers)
        # Every count reached the heat, and nothing is left logged on the device.
        assert sum(int(p.take_routed().sum()) for p in sm.pools) == 2 * want.stats.routed_experts
        assert all(p.route_log == [] for p in sm.pools)
    finally:
        sm.close()
    assert all(p.route_log is None for p in sm.pools)
