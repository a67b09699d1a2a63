"""The layer-major prefill (daemon/model/prefill.py) changes nothing but the order.

Each case runs mlx-lm's own `generate_step` on the stock model (`mlx_lm.load` of the
source folder) and moestream's `plain_steps` on the store, with the same prefill step,
and compares every step's log-probabilities bit for bit and the greedy tokens. The
prefill step is mlx-lm's default for single-chunk prompts, and small (16) for prompts
of several chunks, so that the tiny models here take several chunks in CI time; the
3000-token prompts at the default step run with `-m slow`.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load as stock_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from stock_runs import stepped
from tiny_models import MOE_ARCHS, MORE_MOE_ARCHS, make_tiny_model

from moestream.daemon.model.generation import plain_steps
from moestream.daemon.model.kv_buckets import query_bucket
from moestream.daemon.model.prefill import (
    LAYER_PROGRESS_TOKENS,
    PREFILL_STEP,
    LayerMajorPrefill,
    PrefillStats,
    UnsupportedModel,
    chunk_sizes,
    prefill_pieces,
)
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.capacity import top_k_of
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest

STEPS = 3
SMALL_STEP = 16
GREEDY = make_sampler(temp=0.0)


def drained(pieces):
    """Run a generator of pieces to its end; its return value."""
    while True:
        try:
            next(pieces)
        except StopIteration as end:
            return end.value


def _stock(model, prompt: list[int], step: int):
    return stepped(generate_step(mx.array(prompt), model, max_tokens=STEPS, sampler=GREEDY, prefill_step_size=step))


def _streamed(sm, prompt: list[int], step: int, stats: PrefillStats | None = None):
    return stepped(plain_steps(sm, prompt, GREEDY, STEPS, prefill_stats=stats, prefill_step=step))


def _configs(store) -> list[tuple[str, Settings]]:
    manifest = load_manifest(store)
    k = top_k_of(manifest.config)
    experts = manifest.layers[0].num_experts
    quarter = max(k, math.ceil(0.25 * experts))
    return [
        ("topk", Settings(capacity=k, direct_io=True)),
        ("25%", Settings(capacity=quarter, direct_io=True)),
        ("50%", Settings(capacity=max(k, math.ceil(0.5 * experts)), direct_io=True)),
        ("100%", Settings(capacity=experts, direct_io=True)),
        ("25% + host tier", Settings(capacity=quarter, direct_io=True, host_cache=manifest.expert_bytes_total // 2)),
        ("mapped 25%", Settings(capacity=quarter, direct_io=True, mapped=True)),
    ]


@pytest.fixture(scope="module", params=MOE_ARCHS + MORE_MOE_ARCHS)
def converted(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"prefill-{arch}")
    src = make_tiny_model(root / "model", arch, quant="4bit", seed=3)
    convert_model(src, root / "store")
    model, _ = stock_load(str(src))
    return root / "store", model


def _prompt(n: int, seed: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, size=n).tolist()


def _assert_same(got, want, label: str) -> None:
    assert got[0] == want[0], f"{label}: tokens differ"
    for step, (a, b) in enumerate(zip(got[1], want[1])):
        assert np.array_equal(a, b), f"{label} step {step}: log-probs differ (max |d|={np.abs(a - b).max()})"


CASES = [(1, PREFILL_STEP), (7, PREFILL_STEP), (100, PREFILL_STEP), (40, SMALL_STEP), (100, SMALL_STEP)]


def test_identical_to_stock_generate_step(converted):
    store, stock = converted
    want = {(n, step): _stock(stock, _prompt(n), step) for n, step in CASES}
    for label, settings in _configs(store):
        sm = load_streaming_model(store, settings)
        try:
            staged_before = sm.pool_stats().stacked_layers
            for n, step in CASES:
                stats = PrefillStats()
                got = _streamed(sm, _prompt(n), step, stats)
                _assert_same(got, want[(n, step)], f"{label}, {n} tokens, step {step}")
                several = len(chunk_sizes(n, step)) > 1
                partial = label not in ("100%",)
                if several and partial:
                    # The prompts of several chunks went layer by layer, and staged.
                    assert stats.chunks == len(chunk_sizes(n, step)) and stats.staged_layers > 0, label
                if label.startswith("mapped") and stats.staged_layers:
                    # Each stacked layer's copy went into the graph of the layer below it
                    # (the first one's only where a dense layer comes before it).
                    assert stats.staged_layers - 1 <= stats.staged_ahead <= stats.staged_layers, label
                elif not label.startswith("mapped"):
                    assert stats.staged_ahead == 0, label  # a slot pool's stack waits for its routing
                if n >= LAYER_PROGRESS_TOKENS and not several:
                    # One chunk worth waiting on goes layer by layer at every pool (its
                    # progress by layer), and its output is still stock's (above).
                    assert stats.chunks == 1 and not stats.chunked, label
                if label == "topk" and (n, step) == (100, PREFILL_STEP):
                    # One chunk whose routed pairs outnumber the slots: one stack per layer.
                    assert stats.chunks == 1 and stats.staged_layers > 0 and stats.read_seconds >= 0, label
            if label == "100%":
                assert sm.pool_stats().stacked_layers == staged_before, "a full pool stages nothing"
        finally:
            sm.close()


def test_one_chunk_reports_its_progress_layer_by_layer_at_a_full_pool(converted):
    store, _ = converted
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        done: list[int] = []
        drained(prefill_pieces(sm, mx.array(_prompt(200)), PREFILL_STEP, on_progress=done.append))
        assert done == sorted(done) and done[-1] == 200 and len(done) == len(sm.layer_major.layers) >= 2, done
    finally:
        sm.close()


def test_chunk_order_is_stock_order_too(converted):
    """`prefill = chunk` is the stock path: same output, no stack."""
    store, stock = converted
    manifest = load_manifest(store)
    sm = load_streaming_model(store, Settings(capacity=top_k_of(manifest.config), prefill="chunk", direct_io=True))
    try:
        assert sm.layer_major is None and sm.prefill_note.startswith("chunk")
        _assert_same(_streamed(sm, _prompt(40), SMALL_STEP), _stock(stock, _prompt(40), SMALL_STEP), "chunk")
        assert sm.pool_stats().stacked_layers == 0
    finally:
        sm.close()


def _routed_union_reads(sm, prompt: list[int], step: int) -> tuple[int, int, PrefillStats]:
    """Prefill `prompt` (but its last token) layer by layer; return the bytes read, the
    minimum (the experts each layer routed that its pool lacked, once each) and the stats."""
    for p in sm.pools:
        p.take_routed()
    before = [set(np.flatnonzero(p.slot_of >= 0).tolist()) for p in sm.pools]
    read_before = sum(p.stats.bytes_read for p in sm.pools)
    cache = make_prompt_cache(sm.model)
    stats = drained(sm.layer_major.pieces(mx.array(prompt[:-1]), cache, step))
    minimum = 0
    for p, resident in zip(sm.pools, before):
        routed = set(np.flatnonzero(p.take_routed() > 0).tolist())
        minimum += len(routed - resident) * p.layer.expert_bytes
    return sum(p.stats.bytes_read for p in sm.pools) - read_before, minimum, stats


def test_a_prompt_of_several_chunks_reads_each_routed_expert_once_per_layer(converted):
    store, _ = converted
    manifest = load_manifest(store)
    experts = manifest.layers[0].num_experts
    quarter = max(top_k_of(manifest.config), math.ceil(0.25 * experts))
    prompt = _prompt(100, seed=9)
    sm = load_streaming_model(store, Settings(capacity=quarter, direct_io=True))
    try:
        pf = sm.prefetcher
        promoted_before = pf.s.promoted if pf is not None else 0
        read, minimum, stats = _routed_union_reads(sm, prompt, SMALL_STEP)
        assert stats.chunks == len(chunk_sizes(100, SMALL_STEP)) > 1
        assert minimum > 0 and read == minimum == stats.read_bytes
        if pf is not None:
            # Each layer's missing experts were read a layer ahead, into the prefetch
            # buffer, and the stacks took them from there.
            assert stats.read_ahead > 0 and pf.s.promoted > promoted_before
        else:
            # No prefetch buffer (no router the predictor knows): nothing read ahead.
            assert stats.read_ahead == 0
    finally:
        sm.close()
    # Stock's order through the same pool reads more: each chunk brings its experts again.
    sm = load_streaming_model(store, Settings(capacity=quarter, direct_io=True, prefill="chunk"))
    try:
        before = sum(p.stats.bytes_read for p in sm.pools)
        cache = make_prompt_cache(sm.model)
        tokens = mx.array(prompt[:-1])
        for start in range(0, tokens.size, SMALL_STEP):
            sm.model(tokens[start : start + SMALL_STEP][None], cache=cache)
            mx.eval([c.state for c in cache])
        assert sum(p.stats.bytes_read for p in sm.pools) - before > minimum
    finally:
        sm.close()


def test_a_padded_continuation_layer_by_layer_leaves_stock_cache_tokens_and_counts(converted):
    """A chat turn's continuation from a cached prefix, where the continuation is padded
    (CUDA's default, forced here): layer by layer through a partial pool, it leaves the
    cache and greedy tokens of stock's forward of the turn alone, and the pool counts
    the turn's routings without the padding's copies of its last token."""
    store, stock = converted
    manifest = load_manifest(store)
    experts = manifest.layers[0].num_experts
    quarter = max(top_k_of(manifest.config), math.ceil(0.25 * experts))
    prefix, turn = _prompt(29, seed=21), _prompt(21, seed=22)
    caches = [make_prompt_cache(stock), make_prompt_cache(stock)]
    for c in caches:
        stock(mx.array(prefix)[None], cache=c)
        stock(mx.array(turn)[None], cache=c)
    want_cache = caches[0]
    want = _greedy(stock, caches[1], turn[-1])
    for label, settings in [
        ("25%", Settings(capacity=quarter, direct_io=True)),
        ("mapped 25%", Settings(capacity=quarter, direct_io=True, mapped=True)),
    ]:
        sm = load_streaming_model(store, settings)
        try:
            # Linear-attention caches cannot be trimmed of a padding: such a model keeps
            # stock's forward.
            plain = all(type(c) is KVCache for c in make_prompt_cache(sm.model))
            sm.continuation_bucket = 16
            cache = make_prompt_cache(sm.model)
            sm.model(mx.array(prefix)[None], cache=cache)
            mx.eval([c.state for c in cache])
            settle = sm.mapped_pool.settle if sm.mapped_pool is not None else lambda: None
            settle()  # a mapped pool counts what it logged once the forwards are read back
            for p in sm.pools:
                p.take_routed()
            stats = PrefillStats()
            got_cache = drained(prefill_pieces(sm, mx.array(turn), cache=cache, stats=stats))
            settle()
            pad = query_bucket(len(turn)) - len(turn) if plain else 0
            assert stats.padded == int(plain) and stats.pad_tokens == pad, label
            assert stats.tokens == len(turn) and stats.staged_layers > 0, label
            for p in sm.pools:
                assert p.take_routed().sum() == len(turn) * p.top_k, f"{label}: the padding counted as routed"
            for a, b in zip(want_cache, got_cache):
                assert type(b) is type(a), label
                if type(a) is not KVCache:
                    continue
                assert a.offset == b.offset == len(prefix) + len(turn), label
                for x, y in ((b.keys, a.keys), (b.values, a.values)):
                    np.testing.assert_allclose(np.array(x[..., : b.offset, :].astype(mx.float32)),
                                               np.array(y[..., : a.offset, :].astype(mx.float32)),
                                               rtol=1e-5, atol=1e-5)  # fmt: skip
            got = _greedy(sm.model, got_cache, turn[-1])
            assert got[0] == want[0], label
            np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)
        finally:
            sm.close()


def _greedy(model, cache, token: int, steps: int = 4) -> tuple[list[int], np.ndarray]:
    """`steps` greedy tokens after `token` on `cache`, and the first step's logits."""
    out, first = [], None
    for _ in range(steps):
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        first = np.array(logits) if first is None else first
        token = int(mx.argmax(logits))
        out.append(token)
    return out, first


class _Toy(nn.Module):
    """Two linear layers; the forward calls them as `order(tokens)` says."""

    def __init__(self, order):
        super().__init__()
        self.layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
        self._order = order

    def __call__(self, tokens, cache=None):
        h = mx.zeros((1, tokens.shape[-1], 4))
        for i in self._order(tokens.shape[-1]):
            h = self.layers[i](h)
        return h


def test_a_model_the_prefill_cannot_drive_is_found_at_load():
    """Decided when the model loads (its forward driven once over a throwaway cache), so
    the daemon says `chunk` in `status` and no user's prompt meets the refusal."""
    from moestream.daemon.model.prefill import UnsupportedModel
    from moestream.daemon.model.streaming_model import _layer_major

    class NoLayers(nn.Module):
        pass

    with pytest.raises(UnsupportedModel, match="no list of decoder layers"):
        LayerMajorPrefill(NoLayers())
    twice = _Toy(lambda n: [0, 0, 1])
    with pytest.raises(UnsupportedModel, match="each decoder layer once"):
        LayerMajorPrefill(twice)
    assert all(isinstance(layer, nn.Linear) for layer in twice.layers)  # put back

    class Raises(_Toy):
        def __call__(self, tokens, cache=None):
            if not isinstance(self.layers[0], nn.Linear):
                raise TypeError("not my layer")
            return super().__call__(tokens, cache)

    prefill, note = _layer_major(Raises(lambda n: [0, 1]), Settings())
    assert prefill is None and note.startswith("chunk: the model's forward failed when driven layer by layer")
    assert "TypeError: not my layer" in note
    prefill, note = _layer_major(_Toy(lambda n: [0, 1]), Settings())
    assert prefill is not None and note.startswith("layer")


def test_a_forward_that_strays_at_a_prompt_is_refused_before_anything_runs_or_stops():
    """A forward whose order depends on the prompt (the probe at load passed): where its
    first call is not the first layer, nothing has run and the prompt goes in stock's
    chunks; where it strays after a layer ran, the prefill stops with an error instead of
    leaving a cache that is not stock's."""
    cache = [KVCache(), KVCache()]
    late = LayerMajorPrefill(_Toy(lambda n: [0, 1] if n <= 2 else [1, 0]))
    with pytest.raises(UnsupportedModel, match="each decoder layer once"):
        drained(late.pieces(mx.arange(40), cache, step=16))
    assert all(c.offset == 0 and c.keys is None for c in cache)  # untouched
    again = LayerMajorPrefill(_Toy(lambda n: [0, 1] if n <= 2 else [0, 1, 1]))
    with pytest.raises(RuntimeError, match="each decoder layer once"):
        drained(again.pieces(mx.arange(40), cache, step=16))
    assert all(isinstance(layer, nn.Linear) for layer in again.layers)  # put back


@pytest.mark.slow
def test_identical_at_3000_tokens_default_step(converted):
    """The acceptance prompt: 3000 tokens at mlx-lm's default step (two chunks)."""
    store, stock = converted
    prompt = _prompt(3000, seed=11)
    want = _stock(stock, prompt, PREFILL_STEP)
    for label, settings in _configs(store):
        sm = load_streaming_model(store, settings)
        try:
            stats = PrefillStats()
            _assert_same(_streamed(sm, prompt, PREFILL_STEP, stats), want, f"{label}, 3000 tokens")
        finally:
            sm.close()


def test_a_forward_stopped_from_inside_another_forward_leaves_that_one_running():
    """A dropped prefill's generator may be finalized by the garbage collector while
    another chunk's forward runs: stopping its forward there must come back there (it
    once came back to the prefill's loop, which read the wrong value mid-layer)."""
    from greenlet import getcurrent

    from moestream.daemon.model.prefill import _DONE, _Forward

    def stopped_at_its_layer(tokens, cache):
        getcurrent().parent.switch((0, (tokens,), {}))

    left = _Forward(stopped_at_its_layer, mx.array([1]), [], [])
    left.call(0)
    after: list[str] = []

    def stops_the_other(tokens, cache):
        left.stop()
        after.append("went on")

    running = _Forward(stops_the_other, mx.array([2]), [], [])
    assert running.switch() is _DONE
    assert after == ["went on"] and left.dead
