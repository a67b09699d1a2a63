"""Families beyond the common ones, streamed exactly: a top-k under another config name
(ernie4_5_moe's `moe_k`, found on the model's own MoE blocks) and a latent MoE
(nemotron_h with `moe_latent_size`, whose experts compute on a projection of the hidden
state: the next layer's router cannot score that input, so its prediction is off and
prefetch never crashes a request). Greedy logits against stock mlx-lm at top-k and 50%,
prefetch on and off."""

from __future__ import annotations

import math

import pytest
from mlx_lm import load as stock_load
from test_exactness import STEPS, assert_same_as_stock, greedy_logits
from tiny_models import MORE_MOE_ARCHS, make_tiny_model

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.capacity import top_k_of, top_k_of_blocks
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@pytest.fixture(scope="module", params=MORE_MOE_ARCHS)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_model(root / "model", request.param, quant="4bit", seed=2)
    convert_model(src, root / "store")
    model, _ = stock_load(str(src))
    lengths = {7: list(range(3, 10)), 40: list(range(5, 45))}
    prompts = {n: (p, greedy_logits(model, p, STEPS)) for n, p in lengths.items()}
    return request.param, root / "store", prompts


@pytest.mark.parametrize("prefetch", ["on", "off"])
def test_exact_at_top_k_and_half(converted, prefetch):
    arch, store, prompts = converted
    manifest = load_manifest(store)
    experts = manifest.layers[0].num_experts
    sm = load_streaming_model(store, Settings(capacity=2, prefetch=prefetch, direct_io=True))
    try:
        assert sm.pools[0].top_k == 2
        if arch == "nemotron_h":
            # The latent layers' routers are not used to predict: no layer predicts for them.
            assert all(moe.next is None for moe in _streaming_layers(sm))
        assert_same_as_stock(sm, prompts, f"{arch} top-k prefetch {prefetch}")
    finally:
        sm.close()
    sm = load_streaming_model(store, Settings(capacity=math.ceil(experts / 2), prefetch=prefetch, direct_io=True))
    try:
        assert_same_as_stock(sm, prompts, f"{arch} 50% prefetch {prefetch}")
    finally:
        sm.close()


def test_top_k_under_other_names():
    assert top_k_of({"moe_k": 6}) == 6
    assert top_k_of({"text_config": {"top_k_experts": 4}}) == 4
    assert top_k_of({"moe_topk": [2, 8, 8]}) == 8  # one per layer: the pool needs the largest
    with pytest.raises(Exception, match="moe_topk"):
        top_k_of({"hidden_size": 8})

    class Block:
        def __init__(self, k):
            self.top_k = k

    assert top_k_of_blocks([Block(2), Block(6)], {}) == 6
    # A block that does not say leaves it to the config.
    assert top_k_of_blocks([Block(2), object()], {"num_experts_per_tok": 3}) == 3


def _streaming_layers(sm):
    from moestream.daemon.model.streaming_moe import StreamingMoE

    return [m for _, m in sm.model.named_modules() if isinstance(m, StreamingMoE)]
