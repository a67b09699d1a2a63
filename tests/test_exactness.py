"""Streaming never changes the output: logits and greedy tokens equal stock mlx-lm's.

For every architecture and quantization, each prompt length, each pool capacity from
top-k to all experts and each eviction policy, the streamed model's logits at every step
are compared bit for bit with `mlx_lm.load` of the source folder, run by the same loop.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as stock_load
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import make_tiny_model

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.policies import POLICIES
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings

ARCHS = ["qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3"]
# MLX's CPU build runs gather_mm in float32 only (stock mlx-lm cannot run a bf16 MoE
# there either), so on a CPU the unquantized case is f32; on a GPU bf16 is checked too.
QUANTS = ["4bit", "f32"] + (["bf16"] if mx.default_device().type == mx.gpu else [])
PROMPT_LENGTHS = [1, 7, 100]
# Greedy steps after each prompt: at top-k and 25% nearly every step evicts, so 32 steps
# of three prompts refill each layer's slots dozens of times (64 took this file twice as
# long, in a suite that must stay inside CI's 15 minutes).
STEPS = 32


def greedy_logits(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill the whole prompt in one forward, then `steps` greedy decode steps."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    tokens, rows = [], []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        mx.eval(token, logits)
        rows.append(np.array(logits.astype(mx.float32)))
        tokens.append(int(token.item()))
        logits = model(token[None], cache=cache)[:, -1, :]
    return tokens, rows


def assert_same_as_stock(sm, prompts, label: str) -> None:
    """Every prompt's greedy tokens and every step's logits equal stock mlx-lm's."""
    for n, (prompt, (want_tokens, want_logits)) in prompts.items():
        got_tokens, got_logits = greedy_logits(sm.model, prompt, STEPS)
        assert got_tokens == want_tokens, f"{label} prompt={n}: tokens differ"
        for step, (a, b) in enumerate(zip(got_logits, want_logits)):
            assert np.array_equal(a, b), (
                f"{label} prompt={n} step={step}: logits differ (max |d|={np.abs(a - b).max()})"
            )


CONVERSIONS = [(a, q) for a in ARCHS for q in QUANTS]


def _policy_cases() -> list:
    """Every policy on every conversion; the default run keeps LRU (the default policy)
    everywhere and each other policy on the first conversion, `-m slow` runs the rest."""
    cases = []
    for conversion in CONVERSIONS:
        for policy in sorted(POLICIES):
            slow = policy != "lru" and conversion != CONVERSIONS[0]
            cases.append(
                pytest.param(
                    conversion,
                    policy,
                    id=f"{conversion[0]}-{conversion[1]}-{policy}",
                    marks=[pytest.mark.slow] if slow else [],
                )
            )
    return cases


# The data paths' default architectures: one with plain attention and one with linear
# attention beside it and a shared expert; the others' expert bytes take the same paths.
PATHS_DEFAULT = ("qwen3_moe", "qwen3_5_moe")


def _paths_cases() -> list:
    """The conversions for the tests of one data path (host tier, prefetch): 4-bit of
    PATHS_DEFAULT in the default run (every architecture meets every capacity in
    `test_logits_identical_at_every_capacity`); the others with `-m slow`."""
    return [
        pytest.param(
            c,
            id=f"{c[0]}-{c[1]}",
            marks=[] if c[1] == "4bit" and c[0] in PATHS_DEFAULT else [pytest.mark.slow],
        )
        for c in CONVERSIONS
    ]


@pytest.fixture(scope="module", params=CONVERSIONS, ids=lambda p: f"{p[0]}-{p[1]}")
def converted(request, tmp_path_factory):
    arch, quant = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{quant}")
    src = make_tiny_model(root / "model", arch, quant=quant, seed=1)
    convert_model(src, root / "store")
    model, _ = stock_load(str(src))
    cfg = model.args if hasattr(model, "args") else None
    prompts = {}
    rng = np.random.default_rng(7)
    vocab = _vocab(src)
    for n in PROMPT_LENGTHS:
        prompt = rng.integers(0, vocab, size=n).tolist()
        prompts[n] = (prompt, greedy_logits(model, prompt, STEPS))
    del model, cfg
    return root / "store", prompts


def _vocab(model_dir) -> int:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)["vocab_size"]


def _capacities(store) -> list[tuple[str, int]]:
    from moestream.daemon.pool.capacity import top_k_of
    from moestream.shared.store_format import load_manifest

    manifest = load_manifest(store)
    k = top_k_of(manifest.config)
    experts = manifest.layers[0].num_experts
    return [
        ("topk", k),
        ("25%", max(k, math.ceil(0.25 * experts))),
        ("50%", max(k, math.ceil(0.5 * experts))),
        ("100%", experts),
    ]


@pytest.mark.parametrize("converted,policy", _policy_cases(), indirect=["converted"])
def test_logits_identical_at_every_capacity(converted, policy):
    store, prompts = converted
    for label, slots in _capacities(store):
        if label == "100%" and policy != "lru":
            continue  # a full pool never evicts, so the policy plays no part
        sm = load_streaming_model(store, Settings(capacity=slots, policy=policy, direct_io=True))
        try:
            assert_same_as_stock(sm, prompts, label)
            stats = sm.pool_stats()
            if label == "topk":
                # The 100-token prompt's experts cannot fit: the overflow path ran.
                assert stats.overflow_forwards > 0
            if label == "100%":
                assert stats.host_syncs == 0, "a full pool must not sync with the host"
            else:
                assert stats.misses_decode + stats.misses_prefill > 0
                for p in sm.pools:
                    assert (p.slot_of >= 0).sum() <= p.capacity
        finally:
            sm.close()


@pytest.mark.parametrize("converted", _paths_cases(), indirect=True)
def test_logits_identical_through_the_host_tier(converted):
    """Experts that reach the pool through a host-RAM tier (small enough to evict)
    give the same bytes, hence the same logits."""
    from moestream.daemon.pool.host_tier import expert_stride
    from moestream.shared.store_format import load_manifest

    store, prompts = converted
    manifest = load_manifest(store)
    total = sum(layer.num_experts for layer in manifest.layers)
    tier_bytes = expert_stride(manifest) * (total // 3)
    for label, slots in _capacities(store)[:2]:
        sm = load_streaming_model(store, Settings(capacity=slots, host_cache=tier_bytes))
        try:
            assert_same_as_stock(sm, prompts, label)
            tier = sm.pool_stats().admission
            assert tier["mode"] == "host-tier"
            assert tier["tier_hits"] > 0 and tier["tier_evictions"] > 0
            assert tier["tier_resident_experts"] <= tier["tier_capacity_experts"] == total // 3
            # Every byte that reached a pool came from the tier; the disk only filled it.
            assert tier["bytes_from_disk"] < tier["bytes_to_pool"]
        finally:
            sm.close()


@pytest.mark.parametrize("converted", _paths_cases(), indirect=True)
def test_logits_identical_with_prefetch(converted):
    """Prefetched experts land in the same slots with the same bytes: with prefetch on
    (and, at top-k capacity, diagnostics recording too) every logit is unchanged, and
    prefetch did serve some of the misses; also when it reads two layers ahead
    (`prefetch_depth = 2`)."""
    from moestream.daemon.model.diagnostics import Recorder

    store, prompts = converted
    (topk, topk_slots), second = _capacities(store)[:2]
    for (label, slots), depth in (((topk, topk_slots), 1), (second, 1), ((topk, topk_slots), 2)):
        sm = load_streaming_model(store, Settings(capacity=slots, prefetch="on", prefetch_depth=depth))
        rec = Recorder() if label == "topk" and depth == 1 else None
        try:
            with sm.diagnostics.recording(rec):
                assert_same_as_stock(sm, prompts, f"{label} with prefetch (depth {depth})")
            assert sm.prefetcher.stats()["promoted"] > 0
            if rec is not None:
                assert rec.to_dict()["attribution"]["decode"]["prefetched"] > 0
        finally:
            sm.close()


@pytest.mark.parametrize("converted", _paths_cases(), indirect=True)
def test_logits_identical_with_prefetch_from_the_host_tier(converted):
    """Predicted experts that the host tier holds are copied straight into the next
    layer's slots while this layer computes (`prestage`): same logits as stock, and
    some routed experts were resident only thanks to that (attributed as prefetched,
    the buckets still summing to the routed experts)."""
    from moestream.daemon.model.diagnostics import Recorder
    from moestream.daemon.pool.host_tier import expert_stride
    from moestream.shared.store_format import load_manifest

    store, prompts = converted
    manifest = load_manifest(store)
    total = sum(layer.num_experts for layer in manifest.layers)
    for label, slots in _capacities(store)[:2]:
        sm = load_streaming_model(
            store, Settings(capacity=slots, host_cache=expert_stride(manifest) * total, prefetch="on")
        )
        rec = Recorder() if label == "topk" else None
        try:
            with sm.diagnostics.recording(rec):
                assert_same_as_stock(sm, prompts, f"{label} with prefetch from the tier")
            stats = sm.pool_stats()
            assert stats.prestaged > 0 and 0 < stats.prestaged_used <= stats.prestaged
            assert stats.admission["prestaged"] == stats.prestaged
            for p in sm.pools:
                assert (p.slot_of >= 0).sum() <= p.capacity
                resident = np.flatnonzero(p.slot_of >= 0)
                assert sorted(p.expert_in[p.slot_of[resident]].tolist()) == resident.tolist()
            if rec is not None:
                d = rec.to_dict()
                decode = d["attribution"]["decode"]
                assert decode["prefetched"] > 0
                routed = stats.hits_decode + stats.misses_decode
                assert sum(decode.values()) == routed
        finally:
            sm.close()
