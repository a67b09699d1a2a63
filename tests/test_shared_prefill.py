"""Prefills in pieces, shared by the same prompt's requests and kept suspended when they
have all gone (daemon/model/shared_prefill.py), change no output.

Each case steps `plain_steps` as the engine loop steps it (`pieces=True`: a turn back
after each layer of the layer-major order at 25%, each chunk of stock's at 100%) and
compares log-probabilities bit for bit and greedy tokens with the same prompt prefilled
in one go. Two architectures: qwen3_moe, and qwen3_5_moe, whose linear-attention caches
cannot be trimmed.
"""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from tiny_models import make_tiny_model

from moestream.daemon.model import shared_prefill
from moestream.daemon.model.generation import CacheUse, plain_steps
from moestream.daemon.model.prompt_cache import PromptCache
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest

STEP = 16  # several chunks per prompt in CI time
GEN = 4
GREEDY = make_sampler(temp=0.0)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def store(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"shared-{request.param}")
    convert_model(make_tiny_model(root / "model", request.param, quant="4bit", seed=3), root / "store")
    return root / "store"


def _orders(store) -> list[tuple[str, Settings]]:
    experts = load_manifest(store).layers[0].num_experts
    return [
        ("layer-major 25%", Settings(capacity=max(4, math.ceil(0.25 * experts)), direct_io=True)),
        ("chunks 100%", Settings(capacity=experts, direct_io=True)),
    ]


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, size=n).tolist()


def _cache(sm, **kw) -> PromptCache:
    layout = [type(c).__name__ for c in make_prompt_cache(sm.model)]
    return PromptCache("test-store", layout, max_bytes=kw.pop("max_bytes", 2**30), max_entries=16, **kw)


def _request(sm, pc: PromptCache, prompt: list[int]) -> tuple[CacheUse, object]:
    use = CacheUse(pc)
    return use, plain_steps(sm, prompt, GREEDY, GEN, prefill_step=STEP, cache_use=use, pieces=True)


def _run(steps, tokens: list[int], rows: list[np.ndarray]) -> int:
    """Step to the end; the tokens and log-probs into the lists; the prefill turns taken."""
    turns = 0
    for token, logprobs in steps:
        if token is None:
            turns += 1
            continue
        tokens.append(int(token))
        rows.append(np.array(logprobs.astype(mx.float32)))
    return turns


def _same(got: tuple[list[int], list[np.ndarray]], want: tuple[list[int], list[np.ndarray]], label: str) -> None:
    assert got[0] == want[0], f"{label}: tokens differ"
    for step, (a, b) in enumerate(zip(got[1], want[1])):
        assert np.array_equal(a, b), f"{label} step {step}: log-probs differ"


def _alone(sm, prompt: list[int]) -> tuple[tuple[list[int], list[np.ndarray]], int]:
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    _, steps = _request(sm, _cache(sm), prompt)
    return (tokens, rows), _run(steps, tokens, rows)


def _turns_then_close(steps, k: int) -> None:
    for _ in range(k):
        token, _ = next(steps)
        assert token is None
    steps.close()


def test_a_cut_prefill_is_taken_up_where_it_stopped_with_the_same_output(store):
    """A request closed after one piece of its prefill leaves it suspended in the prompt
    cache; another request with another prompt runs meanwhile; the same prompt sent again
    takes it up (only the pieces left run) and makes exactly the uncut request's output."""
    prompt, other = _prompt(60, seed=1), _prompt(45, seed=2)
    for label, settings in _orders(store):
        sm = load_streaming_model(store, settings)
        try:
            want, turns = _alone(sm, prompt)
            assert turns >= 1, label  # pieces: a cut in the middle of the prefill
            pc = _cache(sm)
            cut, steps = _request(sm, pc, prompt)
            _turns_then_close(steps, 1)
            assert (pc.stats.suspended, pc.stats.prefills_suspended, pc.stats.entries) == (1, 1, 0), label
            assert pc.stats.suspended_bytes == pc.stats.bytes > 0
            assert cut.kv is None  # nothing to keep as an entry: the prefill is kept as it is
            _run(_request(sm, pc, other)[1], [], [])  # the pools serve another prompt meanwhile
            again, steps = _request(sm, pc, prompt)
            got: tuple[list[int], list[np.ndarray]] = ([], [])
            left = _run(steps, *got)
            _same(got, want, f"{label}: taken up")
            assert again.resumed and not again.joined and left == turns - 1, (label, left, turns)
            assert (pc.stats.prefills_resumed, pc.stats.suspended, pc.stats.suspended_bytes) == (1, 0, 0)
        finally:
            sm.close()


def test_the_same_prompt_in_flight_is_prefilled_once_for_both(store):
    """A request that arrives while the same prompt is being prefilled waits on that
    prefill; stepped in turns as the engine steps them, both make the output of one
    alone, from one prefill. Whichever of them is closed first, the other finishes the
    prefill alone, exactly."""
    prompt = _prompt(60, seed=4)
    for label, settings in _orders(store):
        sm = load_streaming_model(store, settings)
        try:
            want, turns = _alone(sm, prompt)
            for closed in (None, "first", "second"):
                pc = _cache(sm)
                a_use, a = _request(sm, pc, prompt)
                assert next(a)[0] is None  # a's first piece
                b_use, b = _request(sm, pc, prompt)
                outs: dict[str, tuple[list[int], list[np.ndarray]]] = {"first": ([], []), "second": ([], [])}
                # b joins: its step runs the shared prefill's next piece (the last, where only two)
                _run(itertools.islice(b, 1), *outs["second"])
                assert b_use.joined and not a_use.joined and pc.stats.prefill_joins == 1, label
                live = {"first": a, "second": b}
                if closed is not None:
                    live.pop(closed).close()
                    assert pc.stats.suspended == 0  # the other still waits on it
                for name, steps in live.items():
                    _run(steps, *outs[name])
                for name in live:
                    _same(outs[name], want, f"{label}, {name} with {closed} closed")
                assert pc.stats.prefills == 1, label  # one prefill for both
        finally:
            sm.close()


def test_a_suspended_prefill_stays_within_the_prompt_caches_bounds(store):
    """Suspended prefills count in the prompt cache's bytes and entries, evicted least
    recently used first among the entries; one larger than the whole bound is dropped."""
    settings = _orders(store)[0][1]
    sm = load_streaming_model(store, settings)
    try:
        probe = _cache(sm)
        _turns_then_close(_request(sm, probe, _prompt(60, seed=5))[1], 1)
        held = probe.stats.suspended_bytes
        assert held > 0
        small = _cache(sm, max_bytes=held - 1)
        _turns_then_close(_request(sm, small, _prompt(60, seed=5))[1], 1)
        assert (small.stats.suspended, small.stats.prefills_dropped, small.stats.bytes) == (0, 1, 0)
        pc = _cache(sm, max_bytes=3 * held)
        _turns_then_close(_request(sm, pc, _prompt(60, seed=5))[1], 1)
        for seed in (6, 7, 8, 9):  # finished requests' caches push the older suspended prefill out
            use, steps = _request(sm, pc, [seed] + _prompt(59, seed=seed))
            tokens: list[int] = []
            _run(steps, tokens, [])
            use.keep([seed] + _prompt(59, seed=seed), tokens)
            assert pc.stats.bytes <= 3 * held
        assert pc.stats.suspended == 0 and pc.stats.prefills_dropped == 1 and pc.stats.entries > 0
        # Gone: the same prompt now prefills from the start.
        again, steps = _request(sm, pc, _prompt(60, seed=5))
        _run(steps, [], [])
        assert not again.resumed and pc.stats.prefills_resumed == 0
    finally:
        sm.close()


def test_a_long_prefill_leaves_checkpoints_that_a_restarted_cache_takes_up(store, monkeypatch, tmp_path):
    """Every CHECKPOINT_TOKENS (here two chunks) a prefill leaves a copy of its cache in the
    prompt cache, written to its folder; a request cut after two of them, the cache closed
    (the daemon stopping: its suspended prefill dropped) and opened again from the folder,
    the same prompt starts from the last checkpoint. The prefill in segments, uncut or
    taken up from a checkpoint, makes exactly the output of one prefill in one go."""
    monkeypatch.setattr(shared_prefill, "CHECKPOINT_TOKENS", 2 * STEP)
    prompt = _prompt(5 * STEP + 1, seed=10)  # checkpoints after 32 and 64 tokens; the prefill ends at 80
    for label, settings in _orders(store):
        sm = load_streaming_model(store, settings)
        try:
            tokens: list[int] = []
            rows: list[np.ndarray] = []
            for token, logprobs in plain_steps(sm, prompt, GREEDY, GEN, prefill_step=STEP):
                tokens.append(int(token))
                rows.append(np.array(logprobs.astype(mx.float32)))
            want = (tokens, rows)  # one prefill, no prompt cache, no segments
            uncut, _ = _alone(sm, prompt)
            _same(uncut, want, f"{label}: uncut, in segments")
            folder = tmp_path / label.replace(" ", "-").replace("%", "")
            pc = _cache(sm, disk_dir=folder, disk_bytes=2**30)
            cut, steps = _request(sm, pc, prompt)
            while pc.stats.inserted < 2:  # each piece's turn, until the second checkpoint
                assert next(steps)[0] is None, label
            steps.close()
            assert cut.kv is None and pc.stats.suspended == 1, label
            pc.close()
            assert pc.stats.disk_written >= 1 and pc.stats.disk_errors == 0, label
            again_pc = _cache(sm, disk_dir=folder, disk_bytes=2**30)
            again, steps = _request(sm, again_pc, prompt)
            got: tuple[list[int], list[np.ndarray]] = ([], [])
            _run(steps, *got)
            assert (again.reused, again.from_disk, again.resumed) == (4 * STEP, True, False), label
            _same(got, want, f"{label}: from the last checkpoint")
            again_pc.close()
        finally:
            sm.close()
