"""The store and the decode loop that the pool's tests share (tests/test_expert_pool.py,
test_capacity.py, test_autopin.py, ...): a tiny 4-bit qwen3_moe, built once per session
by the `pool_store` fixture (conftest.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.pool.pressure import Level, Pressure


def make_pool_store(root: Path) -> Path:
    from tiny_models import make_tiny_model

    from moestream.daemon.store.convert import convert_model

    src = make_tiny_model(root / "model", "qwen3_moe", quant="4bit", seed=3)
    convert_model(src, root / "store")
    return root / "store"


def run_tokens(sm, n_prompt=20, steps=24):
    """A prompt of `n_prompt` tokens, then `steps` greedy decode steps."""
    cache = make_prompt_cache(sm.model)
    logits = sm.model(mx.arange(n_prompt)[None] % 500, cache=cache)[:, -1, :]
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        logits = sm.model(token[None], cache=cache)[:, -1, :]
    mx.eval(logits)


class ManualPressure:
    """A level set by hand: the elastic pool's tests' and benchmarks' pressure source."""

    name = "manual"

    def __init__(self, level: Level = "normal", detail: str = "set by hand") -> None:
        self.level: Level = level
        self.detail = detail

    def set(self, level: Level, detail: str = "set by hand") -> None:
        self.level, self.detail = level, detail

    def read(self) -> Pressure:
        return Pressure(self.level, self.detail)
