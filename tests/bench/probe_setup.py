"""Setup shared by the GPU probes that time one layer of a mapped pool (imported as a
sibling module, like probe_timing)."""

from __future__ import annotations

import argparse
import random
from typing import Any

import mlx.core as mx

from moestream.daemon.model.batching import BatchSession
from moestream.daemon.model.generation import GenerationResult, SamplingParams, iter_generate
from moestream.daemon.model.streaming_model import StreamingModel, load_streaming_model
from moestream.shared.settings import Settings


def store_probe_args() -> argparse.Namespace:
    """--store (a Q30-shaped store), --out (the JSON), --reps (timed runs per figure)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    return parser.parse_args()


def mapped_quarter(store: str) -> tuple[StreamingModel, list[Any]]:
    """The store as a mapped pool with 25% of each layer in GPU memory, placed once and
    never moved (so the probe knows where each expert is), and its streaming layers in
    the pools' order: layer i's is `sm.pools[i]`'s, whose experts in GPU memory are
    `sm.mapped_pool.on_gpu[i]` (`named_modules` lists them last layer first)."""
    mx.set_memory_limit(64 * 2**30)
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_rebalance_tokens=0), mapped=True)
    by_pool = {id(m.pool): m for _, m in sm.model.named_modules() if type(m).__name__ == "StreamingMoE"}
    return sm, [by_pool[id(p)] for p in sm.pools]


class RoundRobin:
    """The engine loop's round robin over requests' generators, in-process: each
    request is `iter_generate` on the daemon's `BatchSession`, seeded at temperature 1."""

    def __init__(self, sm, session: BatchSession, vocab: int, prompt_tokens: int, rng: random.Random) -> None:
        self.sm, self.session, self.vocab, self.rng = sm, session, vocab, rng
        self.prompt_tokens = prompt_tokens
        self.gens: list[list] = []  # [generator, tokens so far]
        self.seed = 0

    def start(self, max_tokens: int, prompt_tokens: int | None = None, prompt: list[int] | None = None) -> list:
        """A request of `prompt` (default: random, of `prompt_tokens`) at the back of the round."""
        self.seed += 1
        if prompt is None:
            prompt = [self.rng.randrange(self.vocab) for _ in range(prompt_tokens or self.prompt_tokens)]
        params = SamplingParams(max_tokens=max_tokens, temp=1.0, seed=self.seed)
        entry = [iter_generate(self.sm, prompt, params, GenerationResult(), batch=self.session), 0]
        self.gens.append(entry)
        return entry

    def turn(self) -> None:
        """One request's turn, as the engine loop gives it."""
        entry = self.gens.pop(0)
        try:
            _, token = next(entry[0])
        except StopIteration:
            return
        if token is not None:
            entry[1] += 1
        self.gens.append(entry)

    def run_until(self, done) -> None:
        while not done():
            self.turn()
