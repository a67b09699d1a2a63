"""Sampling controls (min_p, the penalties, logit_bias) and log-probabilities against stock mlx-lm.

Stock: `mlx_lm.load` of the source folder and `generate_step` over the whole prompt, with
the sampler the daemon builds for the request (its own seeded key: `request_sampler`) and
the logits processors made by stock's own `make_logits_processors` from the same values.
moestream: the request's `generate` on the store (its prompt prefilled layer by layer at
25%, so the processors must be shown the prompt it prefilled apart), at a 25% and a full
pool, for four architectures; then the same requests decoding together in one batch, each
with its own controls, must make what each makes alone.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as stock_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from tiny_models import make_tiny_model

from moestream.daemon.model.batching import BatchSession
from moestream.daemon.model.generation import (
    GenerationResult,
    SamplingParams,
    generate,
    iter_generate,
    request_sampler,
)
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.capacity import top_k_of
from moestream.daemon.store.convert import convert_model
from moestream.shared.protocol import SamplingControls
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest

ARCHS = ("qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3")
TOKENS = 12
PROMPT = np.random.default_rng(5).integers(0, 500, size=19).tolist()
# A Qwen3.5 model card's settings, and each control alone (greedy, so that only it acts).
CARD = dict(temp=0.7, top_p=0.8, top_k=20, seed=9)
CONTROLS: dict[str, tuple[dict, SamplingControls]] = {
    "presence": ({}, SamplingControls(presence_penalty=1.5)),
    "frequency": ({}, SamplingControls(frequency_penalty=1.0)),
    "repetition": ({}, SamplingControls(repetition_penalty=1.3, penalty_window=8)),
    "card": (CARD, SamplingControls(min_p=0.05, presence_penalty=1.5)),
    "sampled repetition": (dict(temp=1.0, seed=3), SamplingControls(repetition_penalty=1.2, penalty_window=64)),
}


def _params(kw: dict, controls: SamplingControls, logprobs: int | None = 3) -> SamplingParams:
    controls = SamplingControls(**{**controls.__dict__, "logprobs": logprobs})
    return SamplingParams(max_tokens=TOKENS, controls=controls, **kw)


def _stock(model, params: SamplingParams) -> tuple[list[int], list[mx.array]]:
    c = params.controls
    processors = make_logits_processors(
        logit_bias=dict(c.logit_bias) or None,
        repetition_penalty=c.repetition_penalty if c.repetition_penalty != 1.0 else None,
        repetition_context_size=c.penalty_window,
        presence_penalty=c.presence_penalty or None,
        presence_context_size=c.penalty_window,
        frequency_penalty=c.frequency_penalty or None,
        frequency_context_size=c.penalty_window,
    )
    out = list(
        generate_step(
            mx.array(PROMPT), model, max_tokens=TOKENS, sampler=request_sampler(params), logits_processors=processors
        )
    )
    return [int(t) for t, _ in out], [lp for _, lp in out]


def _check_logprobs(result: GenerationResult, want: list[mx.array], k: int) -> None:
    """Each token's log-probability and its k likeliest are stock's (the logits its
    sampler saw); the entries' texts make the answer's text."""
    assert len(result.logprobs) == len(result.tokens)
    assert "".join(e.text for e in result.logprobs) == result.text
    for e, lp in zip(result.logprobs, want):
        assert e.logprob == lp[e.token].item() <= 0
        best = np.argsort(-np.array(lp.astype(mx.float32)), kind="stable")[:k].tolist()
        assert [t.token for t in e.top] == best and e.top[0].logprob >= e.top[-1].logprob


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"controls-{request.param}")
    src = make_tiny_model(root / "model", request.param, quant="4bit", seed=6)
    convert_model(src, root / "store")
    model, _ = stock_load(str(src))
    greedy = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=TOKENS)]
    # logit_bias -100 on the greedy answer's first token: it never comes.
    controls = dict(CONTROLS, bias=({}, SamplingControls(logit_bias=((greedy[0], -100.0), (greedy[1], 2.5)))))
    want = {name: _stock(model, _params(kw, c)) for name, (kw, c) in controls.items()}
    return root / "store", controls, want, greedy


def _settings(store, share: float) -> Settings:
    manifest = load_manifest(store)
    k, experts = top_k_of(manifest.config), manifest.layers[0].num_experts
    return Settings(capacity=max(k, math.ceil(experts * share)), direct_io=True)


@pytest.mark.parametrize("share", [0.25, 1.0])
def test_each_control_makes_stock_tokens_and_logprobs(converted, share):
    store, controls, want, greedy = converted
    sm = load_streaming_model(store, _settings(store, share))
    try:
        plain = generate(sm, PROMPT, _params({}, SamplingControls()))
        assert plain.tokens == greedy[: len(plain.tokens)]
        for name, (kw, c) in controls.items():
            result = generate(sm, PROMPT, _params(kw, c))
            tokens, logprobs = want[name]
            assert result.tokens == tokens[: len(result.tokens)], f"{name} at {share:.0%}: not stock's tokens"
            _check_logprobs(result, logprobs, 3)
            # The control acts: the answer or its distributions are not the plain ones.
            assert [e.top for e in result.logprobs] != [e.top for e in plain.logprobs], name
        assert greedy[0] not in generate(sm, PROMPT, _params(*controls["bias"])).tokens
    finally:
        sm.close()


def test_a_batch_of_different_controls_gives_each_its_alone_tokens(converted):
    """Every request in one batch with its own sampler and processors (the first alone,
    then handed over; the others prefilled jointly as they arrive) makes the tokens and
    log-probabilities it makes alone, and those are stock's."""
    store, controls, want, _ = converted
    sm = load_streaming_model(store, _settings(store, 1.0))
    try:
        params = {name: _params(kw, c) for name, (kw, c) in controls.items()}
        session = BatchSession(sm, max_batch=8)
        results = {name: GenerationResult() for name in params}
        gens = {name: iter_generate(sm, PROMPT, p, results[name], batch=session) for name, p in params.items()}
        live = list(gens)
        while live:
            for name in list(live):
                if next(gens[name], StopIteration) is StopIteration:
                    live.remove(name)
        assert session.stats.max_size == len(params)
        for name, p in params.items():
            alone = generate(sm, PROMPT, p)
            assert results[name].tokens == alone.tokens == want[name][0][: len(alone.tokens)], name
            for a, b in zip(results[name].logprobs, alone.logprobs):
                assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        session.close()
    finally:
        sm.close()


def test_min_p_reaches_the_sampler(converted):
    """min_p 1 keeps only the likeliest tokens (ties too: bfloat16 logits tie often):
    each token sampled at temperature 1.5 is then one of the likeliest; without it, not."""
    store, _, _, _ = converted
    sm = load_streaming_model(store, _settings(store, 1.0))
    try:
        made = {}
        for min_p in (0.0, 1.0):
            controls = SamplingControls(min_p=min_p, logprobs=1)
            made[min_p] = generate(sm, PROMPT, SamplingParams(max_tokens=TOKENS, temp=1.5, seed=1, controls=controls))
        assert all(e.logprob == e.top[0].logprob for e in made[1.0].logprobs)
        assert any(e.logprob < e.top[0].logprob for e in made[0.0].logprobs)
    finally:
        sm.close()
