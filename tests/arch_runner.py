"""The one runner of tests/test_every_architecture.py: a tiny model of an architecture
(tests/arch_table.py), converted to an expert store, streamed at a capacity and checked
bit for bit against stock mlx-lm (`mlx_lm.load` of the source folder): greedy tokens and
every step's logits, `STEPS` steps after each prompt."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from arch_table import ARCHS, tiny_arch_config
from test_exactness import greedy_logits
from tiny_models import make_tiny_model

STEPS = 8
# A short prompt, and one long enough that its prefill routes to more experts than a
# top-k pool holds (the overflow path).
PROMPT_LENGTHS = (5, 24)


@dataclass
class Converted:
    model_type: str
    quant: str
    store: Path
    # SwitchGLU/SwitchMLP modules of the stock model: the layers the store must stream
    switch_layers: int
    # prompt length -> (prompt, (greedy tokens, logits per step)) of stock mlx-lm
    reference: dict[int, tuple[list[int], tuple[list[int], list[np.ndarray]]]]


def convert_arch(model_type: str, quant: str, root: Path, *, seed: int = 3) -> Converted:
    """Build the tiny model, convert it, and record stock mlx-lm's greedy run on it."""
    from mlx_lm import load as stock_load
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from moestream.daemon.store.convert import convert_model

    config = tiny_arch_config(model_type)
    src = make_tiny_model(root / "model", model_type, quant=quant, seed=seed, config=config)
    convert_model(src, root / "store")
    model, _ = stock_load(str(src))
    switch_layers = sum(isinstance(m, (SwitchGLU, SwitchMLP)) for _, m in model.named_modules())
    vocab = config.get("text_config", config).get("vocab_size", 512)
    rng = np.random.default_rng(7)
    reference = {}
    for n in PROMPT_LENGTHS:
        prompt = rng.integers(0, vocab, size=n).tolist()
        reference[n] = (prompt, greedy_logits(model, prompt, STEPS))
    return Converted(model_type, quant, root / "store", switch_layers, reference)


def capacity_slots(converted: Converted, capacity: str) -> int | float:
    """ "topk": the table's top-k, as slots; "half": 0.5 (half of every layer's experts,
    or the top-k where that is more)."""
    k = ARCHS[converted.model_type].top_k
    if capacity == "topk":
        return k
    from moestream.shared.store_format import load_manifest

    experts = max(layer.num_experts for layer in load_manifest(converted.store).layers)
    return 0.5 if math.ceil(0.5 * experts) >= k else k


def check_streamed(converted: Converted, capacity: str, prefetch: str) -> None:
    """Stream the store at `capacity` ("topk" or "half") with prefetch on or off: the
    model's top-k is the table's, every SwitchGLU/SwitchMLP of stock's model is streamed,
    a top-k pool smaller than its layer read experts back after evicting them, and every token
    and logit equals stock mlx-lm's."""
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.shared.settings import Settings

    label = f"{converted.model_type} {converted.quant} {capacity} prefetch {prefetch}"
    sm = load_streaming_model(
        converted.store, Settings(capacity=capacity_slots(converted, capacity), prefetch=prefetch, direct_io=True)
    )
    try:
        k = ARCHS[converted.model_type].top_k
        assert len(sm.pools) == converted.switch_layers > 0, f"{label}: streamed layers != stock's expert layers"
        assert [p.top_k for p in sm.pools] == [k] * len(sm.pools), f"{label}: top-k is not {k}"
        for n, (prompt, (want_tokens, want_logits)) in converted.reference.items():
            got_tokens, got_logits = greedy_logits(sm.model, prompt, STEPS)
            for step, (a, b) in enumerate(zip(got_logits, want_logits)):
                assert np.array_equal(a, b), (
                    f"{label} prompt={n} step={step}: logits differ (max |d|={np.abs(a - b).max()})"
                )
            assert got_tokens == want_tokens, f"{label} prompt={n}: tokens differ"
        stats = sm.pool_stats()
        slots = sum(p.capacity for p in sm.pools)
        if capacity == "topk" and slots < sum(p.layer.num_experts for p in sm.pools):
            misses = stats["misses_prefill"] + stats["misses_decode"]
            assert misses > slots, f"{label}: {misses} misses for {slots} slots, nothing was evicted and read back"
    finally:
        sm.close()
