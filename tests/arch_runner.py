"""The one runner of tests/test_every_architecture.py: a tiny model of an architecture
(tests/arch_table.py), converted to an expert store, streamed at a capacity and checked
bit for bit against stock mlx-lm (`mlx_lm.load` of the source folder).

Both sides run as a user's request runs: stock's `generate_step`, and the daemon's own
path with default settings (`plain_steps`: the layer-major prefill where a partial pool
wants it, then `generate_step` over the filled cache), greedy, with the same prefill
step. Every step's logits (`LogitsRecorder`) and tokens must be equal, and the prefill
must have gone the way the model's `status` says (`prefill.order`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from arch_table import NOT_REPLAYED, arch_of, tiny_arch_config
from mlx_lm.generate import generate_step
from stock_runs import GREEDY, LogitsRecorder
from tiny_models import make_tiny_model

from moestream.daemon.model.prefill import PREFILL_STEP, PrefillStats, chunk_sizes

STEPS = 8


@dataclass(frozen=True)
class Prompt:
    tokens: int
    # generate_step's prefill_step_size, on both sides.
    step: int = PREFILL_STEP


# Prompts that take the default prefill's layer-major path at top-k and at half the
# experts: routed pairs that outnumber the slots (7 and 24 tokens, one chunk), and a
# prompt of several chunks at a small step.
SHORT = (Prompt(7), Prompt(24), Prompt(40, 16))
# One chunk of 599 tokens at mlx-lm's step (`-m slow`).
LONG = (Prompt(600),)


@dataclass
class Converted:
    model_type: str
    quant: str
    store: Path
    # SwitchGLU/SwitchMLP modules of the stock model: the layers the store must stream
    switch_layers: int
    stock: Any
    vocab: int
    # prompt -> (prompt tokens, (greedy tokens, logits per step)) of stock mlx-lm
    _reference: dict[Prompt, tuple[list[int], tuple[list[int], list[np.ndarray]]]] = field(default_factory=dict)

    def reference(self, prompt: Prompt) -> tuple[list[int], tuple[list[int], list[np.ndarray]]]:
        if prompt not in self._reference:
            ids = np.random.default_rng(prompt.tokens).integers(0, self.vocab, size=prompt.tokens).tolist()
            self._reference[prompt] = (ids, greedy_run(self.stock, ids, prompt.step))
        return self._reference[prompt]


def greedy_run(model: Any, prompt: list[int], step: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the steps' logits (`LogitsRecorder.steps`) of stock's
    `generate_step`, `STEPS` steps."""
    recorder = LogitsRecorder(model)
    steps = generate_step(mx.array(prompt), recorder, max_tokens=STEPS, sampler=GREEDY, prefill_step_size=step)
    tokens = [int(token) for token, _ in steps]
    return tokens, recorder.steps(len(tokens))


def convert_arch(model_type: str, quant: str, root: Path, *, seed: int = 3) -> Converted:
    """Build the tiny model (of a model_type or a variant), convert it, load stock's."""
    from mlx_lm import load as stock_load
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from moestream.daemon.store.convert import convert_model

    config = tiny_arch_config(model_type)
    src = make_tiny_model(root / "model", model_type, quant=quant, seed=seed, config=config)
    convert_model(src, root / "store")
    model, _ = stock_load(str(src))
    switch_layers = sum(isinstance(m, (SwitchGLU, SwitchMLP)) for _, m in model.named_modules())
    vocab = config.get("text_config", config).get("vocab_size", 512)
    return Converted(model_type, quant, root / "store", switch_layers, model, vocab)


def capacity_slots(converted: Converted, capacity: str) -> int | float:
    """ "topk": the table's top-k, as slots; "half": 0.5 (half of every layer's experts,
    or the top-k where that is more)."""
    k = arch_of(converted.model_type).top_k
    if capacity == "topk":
        return k
    from moestream.shared.store_format import load_manifest

    experts = max(layer.num_experts for layer in load_manifest(converted.store).layers)
    return 0.5 if math.ceil(0.5 * experts) >= k else k


def check_streamed(
    converted: Converted, capacity: str, prefetch: str, prompts: tuple[Prompt, ...] = SHORT, optimistic: str = "rule"
) -> None:
    """Stream the store at `capacity` ("topk" or "half") with prefetch on or off and
    otherwise default settings: the model's top-k is the table's, every
    SwitchGLU/SwitchMLP of stock's model is streamed, `status` reports the prefill order
    the table expects and each prompt's prefill went that way, a top-k pool smaller than
    its layer read experts back after evicting them, and every token and logit equals
    stock mlx-lm's. `optimistic` "always": every decode forward that can checks residency
    every few layers and is redone from a layer that missed (daemon/model/optimistic.py),
    whatever the miss rule says, and did (where the model's caches can be rewound)."""
    from mlx_lm.models.cache import make_prompt_cache

    from moestream.daemon.model.generation import plain_steps
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.shared.settings import Settings

    label = f"{converted.model_type} {converted.quant} {capacity} prefetch {prefetch} optimistic {optimistic}"
    arch = arch_of(converted.model_type)
    sm = load_streaming_model(
        converted.store, Settings(capacity=capacity_slots(converted, capacity), prefetch=prefetch, direct_io=True)
    )
    if optimistic == "always" and sm.optimistic is not None:
        sm.optimistic.force(True)
    try:
        assert len(sm.pools) == converted.switch_layers > 0, f"{label}: streamed layers != stock's expert layers"
        assert [p.top_k for p in sm.pools] == [arch.top_k] * len(sm.pools), f"{label}: top-k is not {arch.top_k}"
        order = sm.pool_stats().prefill_order  # what `status` reports as prefill.order
        assert order.split(":")[0] == arch.prefill, f"{label}: status says the prefill order is {order!r}"
        for prompt in prompts:
            ids, (want_tokens, want_logits) = converted.reference(prompt)
            stats = PrefillStats()
            recorder = LogitsRecorder(sm.model)
            sm.model, model = recorder, sm.model
            try:
                steps = plain_steps(sm, ids, GREEDY, STEPS, prefill_stats=stats, prefill_step=prompt.step)
                got_tokens = [int(token) for token, _ in steps]
            finally:
                sm.model = model
            got_logits = recorder.steps(len(got_tokens))
            where = f"{label} prompt={prompt.tokens} step={prompt.step}"
            assert len(got_logits) == len(want_logits) == STEPS + 1, where
            for step, (a, b) in enumerate(zip(got_logits, want_logits)):
                assert np.array_equal(a, b), f"{where} step={step}: logits differ (max |d|={np.abs(a - b).max()})"
            assert got_tokens == want_tokens, f"{where}: tokens differ"
            if arch.prefill == "layer":
                assert stats.to_dict()["mode"] == "layer-major", f"{where}: not prefilled layer by layer"
                assert stats.chunks == len(chunk_sizes(prompt.tokens, prompt.step)) and stats.staged_layers > 0, where
            else:
                assert stats.chunks == 0, f"{where}: prefilled layer by layer, but status says {order!r}"
        stats = sm.pool_stats()
        slots = sum(p.capacity for p in sm.pools)
        if capacity == "topk" and slots < sum(p.layer.num_experts for p in sm.pools):
            misses = stats.misses_prefill + stats.misses_decode
            assert misses > slots, f"{label}: {misses} misses for {slots} slots, nothing was evicted and read back"
        ctl = sm.optimistic
        if optimistic == "always" and ctl is not None and ctl.applies(mx.array([[0]]), make_prompt_cache(sm.model)):
            # A model whose blocks pass an object along that each changes is never replayed.
            assert (ctl.why_not is not None) == (converted.model_type in NOT_REPLAYED), f"{label}: {ctl.why_not}"
            assert ctl.forwards > 0 or ctl.why_not, f"{label}: no decode forward ran optimistically"
            if stats.misses_decode and ctl.why_not is None:
                assert ctl.redos > 0, f"{label}: decode steps missed, yet no forward was redone"
    finally:
        sm.close()
