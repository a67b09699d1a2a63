"""Stock mlx-lm runs that tests (and the GPU exactness check) compare moestream with."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

GREEDY = make_sampler(temp=0.0)


def stepped(steps: Iterable[tuple[Any, mx.array]]) -> tuple[list[int], list[np.ndarray]]:
    """(tokens, log-probs per step as float32) of a `generate_step`-like generator."""
    tokens, rows = [], []
    for token, logprobs in steps:
        tokens.append(int(token))
        rows.append(np.array(logprobs.astype(mx.float32)))
    return tokens, rows


def stock_batched(
    model, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], eos: Sequence[int]
) -> list[list[int]]:
    """Greedy tokens of `prompts` decoded together by stock's `BatchGenerator`, fed as
    moestream's `BatchSession` feeds it when the requests arrive together: the first
    prompt but its last token prefilled on its own cache, as `generate_step` prefills it
    (a request alone), then its last token inserted with that cache (how `BatchGenerator`
    takes a prompt with a cache); once it has its first token, the others' whole prompts
    inserted, which the generator prefills together at its next step (its own batching
    of prompts)."""
    first = prompts[0]
    cache = make_prompt_cache(model)
    model(mx.array(list(first[:-1]))[None], cache=cache)
    mx.eval([c.state for c in cache])
    gen = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=8, prefill_batch_size=8)
    uids = gen.insert([[first[-1]]], max_tokens=[max_tokens[0]], caches=[cache], samplers=[GREEDY])
    out: dict[int, list[int]] = {uids[0]: []}
    done: set[int] = set()

    def step() -> None:
        for r in gen.next()[1]:
            out[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                done.add(r.uid)

    while not out[uids[0]]:
        step()
    rest = gen.insert(
        [list(p) for p in prompts[1:]], max_tokens=list(max_tokens[1:]), samplers=[GREEDY] * (len(prompts) - 1)
    )
    out.update({u: [] for u in rest})
    uids += rest
    while len(done) < len(uids):
        step()
    gen.close()
    return [out[u] for u in uids]
