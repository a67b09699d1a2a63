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
    """Greedy tokens of `prompts` decoded together by stock's `BatchGenerator`: each
    prompt but its last token prefilled on its own cache, as `generate_step` prefills
    it, then the last token inserted with that cache (how `BatchGenerator` takes a
    prompt with a cache, and how moestream's `BatchSession` feeds it)."""
    caches = []
    for p in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(list(p[:-1]))[None], cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    gen = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=8, prefill_batch_size=8)
    uids = gen.insert(
        [[p[-1]] for p in prompts], max_tokens=list(max_tokens), caches=caches, samplers=[GREEDY] * len(prompts)
    )
    out: dict[int, list[int]] = {u: [] for u in uids}
    done: set[int] = set()
    while len(done) < len(uids):
        for r in gen.next_generated():
            out[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return [out[u] for u in uids]
