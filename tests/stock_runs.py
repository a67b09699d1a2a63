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


class LogitsRecorder:
    """A model that keeps the last position's logits of each of its forwards: what the
    steps of `generate_step` sampled from, to compare bit for bit (`last`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._rows: list[mx.array] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        out = self.model(*args, **kwargs)
        self._rows.append(out[:, -1, :])
        return out

    def steps(self, n: int) -> list[np.ndarray]:
        """As float32, the logits of a `generate_step` that yielded `n` tokens: its last
        n + 1 forwards (the first n sampled them; it makes one more ahead of need)."""
        return [np.array(row.astype(mx.float32)) for row in self._rows[len(self._rows) - n - 1 :]]


def stock_batched(
    model, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], eos: Sequence[int], alone: int = 2
) -> list[list[int]]:
    """Greedy tokens of `prompts` decoded together, fed as moestream's `BatchSession`
    feeds stock's `BatchGenerator` when the requests arrive together: the first prompt but
    its last token prefilled on its own cache, as `generate_step` prefills it (a request
    alone); its first `alone` tokens made alone by `generate_step`'s step (its last prompt
    token, then each token, fed while the next is sampled); when the others arrive, its
    last token sampled but not fed inserted with that cache (how `BatchGenerator` takes a
    request with a cache), then the others' whole prompts, which the generator prefills
    together at its next step (its own batching of prompts)."""
    first = prompts[0]
    cache = make_prompt_cache(model)
    model(mx.array(list(first[:-1]))[None], cache=cache)
    mx.eval([c.state for c in cache])
    made: list[int] = []
    token = first[-1]
    for _ in range(alone):
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        token = int(GREEDY(logits - mx.logsumexp(logits, keepdims=True)).item())
        made.append(token)
    gen = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=8, prefill_batch_size=8)
    uids = gen.insert([[token]], max_tokens=[max_tokens[0] - alone], caches=[cache], samplers=[GREEDY])
    out: dict[int, list[int]] = {uids[0]: made}
    done: set[int] = set()
    for p, m in zip(prompts[1:], max_tokens[1:]):
        uids += gen.insert([list(p)], max_tokens=[m], samplers=[GREEDY])
        out[uids[-1]] = []
    while len(done) < len(uids):
        for r in gen.next()[1]:
            out[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return [out[u] for u in uids]
