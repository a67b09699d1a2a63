"""Continuous batching (daemon/model/batching.py) against stock mlx-lm's own batching.

Stock: `mlx_lm.load` of the source folder, fed to its `BatchGenerator` as requests that
arrive together (tests/stock_runs.py `stock_batched`), greedy. On the CPU stock's batch
is exact, so the batch-invariant step (daemon/model/row_batch.py) must agree with it.
moestream: a `BatchSession` on the store, each request's `steps` generator stepped in
turn as the engine loop does. Every request's
greedy tokens must be equal, at capacities top-k x B, 50% and 100%, for every
architecture; and each request's tokens are compared with the same request decoded
alone.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as stock_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from stock_runs import stock_batched
from tiny_models import MOE_ARCHS, make_tiny_model

from moestream.daemon.mapped.row_gather import MAX_GATHERED
from moestream.daemon.model.batching import BatchSession, StepCosts
from moestream.daemon.model.generation import SamplingParams, generate, plain_steps, request_sampler
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.capacity import top_k_of
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest

GREEDY = make_sampler(temp=0.0)
MAX_TOKENS = [6, 9, 4]
# A prompt the layer-major prefill takes (one chunk of at least LAYER_PROGRESS_TOKENS goes layer by layer).
LONG = 296
LENGTHS = [5, 23, 12]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 500, size=n).tolist() for n in LENGTHS]


def _round_robin(gens, out: list[list[int]], between=None) -> None:
    """Step the requests' generators one token each per turn, as the engine loop steps
    its jobs, until all end; each one's tokens are added to its list in `out`.
    `between()`: called after each step, where the engine's loop does its other work."""
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            try:
                token, _ = next(gens[i])
            except StopIteration:
                live.remove(i)
                continue
            if token is not None:  # None: a piece of its prompt, the others' turn next
                out[i].append(int(token))
            if between is not None:
                between()


def _ours_batched(sm, prompts: list[list[int]]) -> list[list[int]]:
    session = BatchSession(sm, max_batch=8)
    # A partial slot pool caps the batch at what one step's experts need of its slots.
    assert session.max_batch == (8 if all(p.fully_resident for p in sm.pools) else sm.capacity // sm.pools[0].top_k)
    out: list[list[int]] = [[] for _ in prompts]
    _round_robin([session.steps(p, GREEDY, m) for p, m in zip(prompts, MAX_TOKENS)], out)
    # More than one decoded together (a prompt prefilled in pieces while the batch
    # decodes may join after an earlier short request has left).
    assert session.size == 0 and 1 < session.stats.max_size <= min(len(prompts), session.max_batch)
    assert session.stats.joined == session.stats.left == len(prompts)
    session.close()
    return out


@pytest.fixture(scope="module", params=MOE_ARCHS)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"batch-{request.param}")
    src = make_tiny_model(root / "model", request.param, quant="4bit", seed=4)
    convert_model(src, root / "store")
    model, tokenizer = stock_load(str(src))
    want = stock_batched(model, _prompts(), MAX_TOKENS, sorted(tokenizer.eos_token_ids))
    alone = [
        [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=m, sampler=GREEDY)]
        for p, m in zip(_prompts(), MAX_TOKENS)
    ]
    return root / "store", want, alone


def test_batched_tokens_equal_stock_batching_at_every_capacity(converted):
    store, want, _ = converted
    manifest = load_manifest(store)
    k, experts = top_k_of(manifest.config), manifest.layers[0].num_experts
    configs = [
        ("top-k x B", Settings(capacity=min(experts, k * 3), direct_io=True)),
        ("50%", Settings(capacity=math.ceil(experts / 2), direct_io=True)),
        ("100%", Settings(capacity=experts, direct_io=True)),
        ("mapped 25%", Settings(capacity=max(k, math.ceil(experts / 4)), mapped=True, direct_io=True)),
    ]
    for label, settings in configs:
        sm = load_streaming_model(store, settings)
        try:
            got = _ours_batched(sm, _prompts())
        finally:
            sm.close()
        # Stock stops at an end token too; moestream's generation drops it from the text
        # but the batch yields it like stock: compare the streams as made.
        assert got == want, f"{label}: batched tokens differ from stock's BatchGenerator"


def test_a_request_in_a_batch_makes_the_tokens_it_makes_alone(converted):
    """On the CPU a batched request's greedy tokens equal its tokens alone (stock's
    generate_step) for these prompts; stock's own batching agrees, checked here too."""
    store, want, alone = converted
    for w, a in zip(want, alone):
        assert w == a[: len(w)], "stock's BatchGenerator and generate_step differ on this CPU"
    sm = load_streaming_model(store, Settings(capacity=0.5, direct_io=True))
    try:
        solo = [[int(t) for t, _ in plain_steps(sm, p, GREEDY, m)] for p, m in zip(_prompts(), MAX_TOKENS)]
        assert [s[: len(w)] for s, w in zip(solo, want)] == want
        # Through the daemon's own generation loop, with the batch: the same text.
        session = BatchSession(sm, max_batch=4)
        result = generate(sm, _prompts()[1], SamplingParams(max_tokens=MAX_TOKENS[1]), batch=session)
        plain = generate(sm, _prompts()[1], SamplingParams(max_tokens=MAX_TOKENS[1]))
        assert result.tokens == plain.tokens
        # 8 slots of top-4 experts: a step of more than 2 requests could not fit.
        assert result.stats.batch["requested"] == 4 and result.stats.batch["max_batch"] == session.max_batch
        assert session.max_batch == sm.capacity // sm.pools[0].top_k < 4
        session.close()
    finally:
        sm.close()


def test_seeded_requests_make_their_lone_tokens_alone_and_together(converted):
    """A lone request is a batch of one (generate_step's own forward); when another joins,
    each keeps its cache and its sampler: a seeded sampled request makes the tokens it
    makes alone (`plain_steps`), before and after, and so does the one that joined it."""
    store, _, _ = converted
    sm = load_streaming_model(store, Settings(capacity=1.0, direct_io=True))
    try:
        params = [SamplingParams(max_tokens=12, temp=1.0, seed=s) for s in (11, 12)]
        prompts = _prompts()[:2]
        alone = [
            [int(t) for t, _ in plain_steps(sm, p, request_sampler(q), q.max_tokens)] for p, q in zip(prompts, params)
        ]
        session = BatchSession(sm, max_batch=4)
        first = session.steps(prompts[0], request_sampler(params[0]), params[0].max_tokens)
        got: list[list[int]] = [[], []]
        for _ in range(5):
            got[0].append(int(next(first)[0]))
        # Five tokens made alone (the sixth sampled ahead): steps of one.
        assert session.stats.tokens == 5 and session.stats.max_size == 1 and session.size == 1
        second = session.steps(prompts[1], request_sampler(params[1]), params[1].max_tokens)
        _round_robin([first, second], got)
        assert session.stats.max_size == 2
        assert got == alone
        # Alone again.
        assert [int(t) for t, _ in session.steps(prompts[1], request_sampler(params[1]), 12)] == alone[1]
        assert session.size == 0
        session.close()
    finally:
        sm.close()


def test_a_long_prompt_joining_holds_the_batch_back_one_layer_at_a_time(converted):
    """A request whose prompt goes layer by layer joins a batch that is decoding: its
    turns give back after each decoder layer, so the request already in the batch gets
    a token between every two of them, and both still get their stock tokens."""
    store, want, _ = converted
    manifest = load_manifest(store)
    k, experts = top_k_of(manifest.config), manifest.layers[0].num_experts
    sm = load_streaming_model(store, Settings(capacity=min(experts, k * 3), direct_io=True))
    try:
        assert sm.layer_major is not None and sm.layer_major.wanted(LONG + 1)
        session = BatchSession(sm, max_batch=2)
        first = session.steps(_prompts()[0], GREEDY, 40)
        order: list[tuple[str, int | None]] = [("a", next(first)[0])]
        long_prompt = np.random.default_rng(8).integers(0, 500, size=LONG).tolist()
        second = session.steps(long_prompt, GREEDY, 3)
        while True:
            token = next(second)[0]
            order.append(("b", token))
            if token is not None:
                break
            order.append(("a", next(first)[0]))
        pieces = sum(1 for who, t in order if who == "b" and t is None)
        assert pieces == len(sm.model.layers) - 1, order  # a turn back after each layer but the last
        # Between the joining prompt's pieces the batch's member made one token each.
        assert [t is not None for who, t in order if who == "a"] == [True] * (pieces + 1)
        a_tokens = [t for who, t in order if who == "a"] + [int(t) for t, _ in first]
        b_tokens = [order[-1][1]] + [int(t) for t, _ in second]
        session.close()
        # The same tokens as each alone (alone is stock's, by the tests above).
        assert a_tokens == [int(t) for t, _ in plain_steps(sm, _prompts()[0], GREEDY, 40)][: len(a_tokens)]
        assert b_tokens == [int(t) for t, _ in plain_steps(sm, long_prompt, GREEDY, 3)]
    finally:
        sm.close()


def test_a_gathering_mapped_pool_caps_the_batch_at_its_gather(converted):
    """A mapped pool that gathers the routed experts' rows first takes at most
    MAX_GATHERED ids per step on that path, so the batch holds at most that many
    requests' routings; without the gather it is not capped."""
    store, _, _ = converted
    manifest = load_manifest(store)
    k, experts = top_k_of(manifest.config), manifest.layers[0].num_experts
    for gather, cap in ((True, MAX_GATHERED // k), (False, 64)):
        settings = Settings(capacity=max(k, math.ceil(experts / 4)), mapped=True, mapped_gather=gather, direct_io=True)
        sm = load_streaming_model(store, settings)
        try:
            assert all(p.host_memory and (p.gather is not None) == gather for p in sm.pools)
            session = BatchSession(sm, max_batch=64)
            assert session.max_batch == cap
            if gather:
                assert "gather" in session.why_full()
            session.close()
        finally:
            sm.close()


def test_step_costs_let_a_batch_grow_only_while_a_step_costs_less_a_token_than_a_lone_one():
    costs = StepCosts()
    assert costs.pays(2)  # nothing timed: tried
    for _ in range(StepCosts.MIN_STEPS):
        costs.record(1, 0.010)
    assert costs.pays(2)  # lone steps timed, steps of 2 not yet
    for seconds in (0.030, 0.019, 0.0195, 0.020):  # a CPU: about twice a lone step
        costs.record(2, seconds)
    assert costs.seconds(2) == pytest.approx(0.01975) and not costs.pays(2)
    for _ in range(StepCosts.WINDOW):  # a GPU's wide step: 1.2x a lone one
        costs.record(2, 0.012)
    assert costs.pays(2)
    costs.record(3, 0.040)  # one step is not enough to judge a size
    assert costs.pays(3) and costs.seconds(3) is None
    # A size judged not to pay is never timed again by itself: its verdict goes stale.
    for _ in range(StepCosts.WINDOW):
        costs.record(2, 0.050)
    assert not costs.pays(2)
    for _ in range(StepCosts.STALE + 1):
        costs.record(1, 0.010)
    assert costs.seconds(2) is None and costs.pays(2)


def test_the_daemons_own_batch_size_asks_the_step_costs_and_an_explicit_one_does_not(converted):
    store = converted[0]
    sm = load_streaming_model(store, Settings(capacity=1.0))
    try:
        auto, fixed = BatchSession(sm, 0), BatchSession(sm, 4)
        assert auto.auto and auto.requested == 8 and not fixed.auto
        for session in (auto, fixed):
            for _ in range(StepCosts.MIN_STEPS):
                session.costs.record(1, 0.010)
                session.costs.record(2, 0.025)
        assert auto.pays(0) and not auto.pays(1) and auto.has_room(1)
        assert fixed.pays(1)  # max_batch 4: batched as asked, whatever the timings
        assert auto.to_dict()["step_seconds"] == {"1": 0.010, "2": 0.025}
    finally:
        sm.close()
