"""When decode forwards skip the per-layer sync (daemon/model/optimistic.py).

Their exactness is checked on every architecture (tests/test_every_architecture.py, forced
on at top-k, where most tokens redo a forward) and their accounting against the per-layer
path's fixture (tests/test_pool_accounting.py); here, the rule that picks the path, and a rotating window put back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from stock_runs import GREEDY

from moestream.daemon.model.generation import SamplingParams, generate
from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
from moestream.shared.settings import Settings, demo_store_path

PROMPT = "The history of the city"
TOKENS = 24


def _decode(capacity: float, forced: bool | None) -> tuple[list[int], int, int]:
    """A greedy request on the demo, the second of two (the first fills the pool): its
    tokens, and its forwards run optimistically and redone."""
    sm = load_streaming_model(demo_store_path(), Settings(capacity=capacity, prefetch="off"))
    try:
        assert sm.optimistic is not None
        sm.optimistic.force(forced)
        ids = sm.tokenizer.encode(PROMPT)
        generate(sm, ids, SamplingParams(max_tokens=TOKENS))
        forwards, redos = sm.optimistic.forwards, sm.optimistic.redos
        result = generate(sm, ids, SamplingParams(max_tokens=TOKENS))
        return result.tokens, sm.optimistic.forwards - forwards, sm.optimistic.redos - redos
    finally:
        sm.close()


def test_a_pool_that_misses_in_most_layers_stays_on_the_per_layer_path():
    # The demo at 25% misses in nearly every layer of every token (hits about 0.4).
    tokens, forwards, redos = _decode(0.25, None)
    assert forwards <= 1 and redos <= 4
    assert tokens == _decode(0.25, False)[0]


def test_a_pool_that_holds_what_it_routes_skips_the_per_layer_syncs():
    # At 95% the demo's decode steps find their experts resident once the first request
    # has filled the pool: the second's run optimistically, with the per-layer path's tokens.
    tokens, forwards, redos = _decode(0.95, None)
    assert forwards >= TOKENS // 2 and redos <= 2
    assert tokens == _decode(0.95, False)[0]


def test_a_rotating_window_is_put_back_exactly():
    # mlx-lm's cache with max_kv_size is a rotating window, which writes each token over
    # its oldest keys: at 25% nearly every forward is run again from a layer that missed
    # after the window has wrapped, and each step's log-probabilities are stock's.
    stock = load_stock_model(demo_store_path())
    sm = load_streaming_model(demo_store_path(), Settings(capacity=0.25, prefetch="off"))
    try:
        sm.optimistic.force(True)
        prompt = mx.array(sm.tokenizer.encode(PROMPT))
        runs = []
        for model in (stock, sm.model):
            cache = make_prompt_cache(model, max_kv_size=8)
            steps = generate_step(prompt, model, prompt_cache=cache, max_tokens=TOKENS, sampler=GREEDY)
            runs.append([(int(t), np.array(lp)) for t, lp in steps])
        assert [t for t, _ in runs[1]] == [t for t, _ in runs[0]]
        for step, ((_, want), (_, got)) in enumerate(zip(*runs)):
            assert np.array_equal(got, want), f"step {step}"
        assert sm.optimistic.forwards >= TOKENS - 2 and sm.optimistic.redos > TOKENS
    finally:
        sm.close()
