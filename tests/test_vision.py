"""Images in (daemon/model/vision.py): a vision-language MoE model's vision tower resident
beside its streamed language model, against stock mlx-vlm on tiny models built from
mlx-vlm's own classes (tests/tiny_vision.py)."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model
from tiny_vision import VLM_ARCHS, make_tiny_deepseek_v41, make_tiny_vlm, png

from moestream.daemon.model.generation import render_chat
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.model.vision import IMAGE_ID_TOP, ImageError, image_key, prepare, vision_steps
from moestream.daemon.store.convert import VISION_FILE, convert_model
from moestream.shared import protocol as proto
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest

QUESTION = "What is in this picture?"
TOKENS = 8
# Small chunks: the prompt's prefill takes several, the last one of 2 to 8 tokens
# (mlx-vlm's SwitchGLU has a path of its own for those).
PREFILL_STEP = 8


@pytest.fixture(scope="module", params=VLM_ARCHS)
def vlm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_vlm(root / "model", request.param, seed=5)
    convert_model(src, root / "store")
    return src, root / "store"


def _stock(src, image: bytes) -> tuple[list[int], list[np.ndarray], list[int]]:
    """Stock mlx-vlm: its load, its prompt, its inputs, its generate_step (greedy)."""
    import io

    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load, prepare_inputs
    from PIL import Image

    model, processor = load(str(src))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    # The tokenizer's template (Llama 4's processor is given none; the daemon renders with it).
    prompt = processor.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    picture = Image.open(io.BytesIO(image))
    inputs = prepare_inputs(processor, images=[picture], prompts=[prompt])
    # The model's own inputs besides these (Qwen-VL's image_grid_thw, Gemma 4's
    # mm_token_type_ids), as mlx-vlm's `generate` passes them on.
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    steps = generate_step(
        inputs["input_ids"],
        model,
        inputs["pixel_values"],
        inputs["attention_mask"],
        max_tokens=TOKENS,
        temperature=0.0,
        prefill_step_size=PREFILL_STEP,
        **extra,
    )
    tokens, logprobs = [], []
    for token, lp in steps:
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)))
    return tokens, logprobs, [int(t) for t in np.array(inputs["input_ids"])[0]]


def _streamed(store, image: bytes, capacity: float) -> tuple[list[int], list[np.ndarray], list[int]]:
    from mlx_lm.models.cache import make_prompt_cache

    sm = load_streaming_model(store, Settings(capacity=capacity))
    try:
        assert sm.vision is not None
        message = proto.ChatMessage("user", QUESTION, images=(proto.ImageData(image, "image/png"),))
        ids, images = prepare(sm.vision, render_chat(sm.tokenizer, [message]), message.images)
        cache = sm.vision.request_cache(make_prompt_cache(sm.model), fresh=True)
        tokens, logprobs = [], []
        steps = vision_steps(
            sm.vision, ids, images, cache, 0, lambda lp: mx.argmax(lp, axis=-1), TOKENS, prefill_step=PREFILL_STEP
        )
        for token, lp in steps:
            if token is None:
                continue
            tokens.append(int(token))
            logprobs.append(np.array(lp.astype(mx.float32)))
        misses = sum(p.stats.misses_prefill + p.stats.misses_decode for p in sm.pools)
        assert capacity == 1.0 or misses > 0, "a partial pool read no expert: the test streams nothing"
        return tokens, logprobs, ids
    finally:
        sm.close()


@pytest.mark.parametrize("capacity", [0.25, 1.0])
def test_streamed_equals_stock_mlx_vlm(vlm, capacity):
    src, store = vlm
    image = png(3)
    want_tokens, want_logprobs, want_ids = _stock(src, image)
    tokens, logprobs, ids = _streamed(store, image, capacity)
    assert ids == want_ids  # the same prompt, its image's tokens expanded the same
    assert tokens == want_tokens
    assert len(logprobs) == len(want_logprobs) == TOKENS
    for got, want in zip(logprobs, want_logprobs):
        assert np.array_equal(got, want)
    # The image matters: another image gives other logits.
    assert not np.array_equal(_stock(src, png(4))[1][0], want_logprobs[0])


def test_convert_keeps_the_vision_tower_resident(vlm):
    src, store = vlm
    manifest = load_manifest(store)
    assert manifest.takes_images and manifest.vision_files == (VISION_FILE,)
    source = set(mx.load(str(src / "model.safetensors")))
    resident = set().union(*(mx.load(str(store / f)).keys() for f in manifest.resident_files))
    # The vision tower and projector (whatever the model names them), and of the language
    # model's weights only those mlx-lm holds in others: the MLA attention's kv_b_proj of
    # kimi_vl and mistral3 (Mistral 4), split into embed_q and unembed_out among the
    # resident weights; no other arch's.
    names = set(mx.load(str(store / VISION_FILE)))
    own = {n for n in source if n.startswith("language_model.") and "kv_b_proj" in n}
    assert names and names == {n for n in source if not n.startswith("language_model.")} | own
    assert bool(own) == (manifest.model_type in ("kimi_vl", "mistral3")) and not own & resident
    assert {n.replace("kv_b_proj", part) for n in own for part in ("embed_q", "unembed_out")} <= resident
    # The language model's experts are in the expert store, not among the resident weights.
    # Each MoE layer's stacked experts (Qwen's mlp.switch_mlp, Gemma 4's experts.switch_glu,
    # Llama 4's feed_forward.experts; not a shared expert), by the module that holds them.
    experts = {n.rsplit(".", 2)[0] for n in source if re.search(r"\.(experts|switch_mlp|switch_glu)\.", n)}
    assert {layer.module_path for layer in manifest.layers} == experts
    assert len(experts) == len(manifest.layers) >= 2
    assert not any(n.startswith(tuple(experts)) for n in resident)


def test_a_text_only_store_takes_no_images(tmp_path):
    src = make_tiny_model(tmp_path / "model", "qwen3_moe", quant="f32")
    convert_model(src, tmp_path / "store")
    manifest = load_manifest(tmp_path / "store")
    assert not manifest.takes_images
    assert "vision_files" not in json.loads((tmp_path / "store" / "manifest.json").read_text())
    sm = load_streaming_model(tmp_path / "store", Settings(capacity=1.0))
    try:
        assert sm.vision is None
    finally:
        sm.close()


def test_a_vlm_whose_experts_mlx_vlm_keeps_elsewhere_converts_text_only(tmp_path):
    """deepseek_v41: mlx-vlm's language model is its own (tests/tiny_vision.py, above
    VLM_ARCHS), its experts not at the store's module paths; the store takes no images
    (its vision file held the whole language model, and the store failed to load)."""
    src = make_tiny_deepseek_v41(tmp_path / "model", seed=5)
    convert_model(src, tmp_path / "store")
    manifest = load_manifest(tmp_path / "store")
    assert not manifest.takes_images and not (tmp_path / "store" / VISION_FILE).exists()
    assert [layer.module_path for layer in manifest.layers] == [
        f"model.layers.{i}.mlp.experts.switch_mlp" for i in (0, 1)
    ]
    sm = load_streaming_model(tmp_path / "store", Settings(capacity=1.0))
    try:
        assert sm.vision is None
    finally:
        sm.close()


def test_bad_images_are_refused(vlm):
    _, store = vlm
    sm = load_streaming_model(store, Settings(capacity=1.0))
    try:
        text = render_chat(sm.tokenizer, [proto.ChatMessage("user", "hi", images=(proto.ImageData(b"x"),))])
        good = png(1)
        for data, why in [
            (b"not an image at all", "not an image"),
            (good[: len(good) // 2], "cannot be decoded"),
        ]:
            with pytest.raises(ImageError, match=why):
                prepare(sm.vision, text, [proto.ImageData(data, "image/png")])
        ids, images = prepare(sm.vision, text, [proto.ImageData(good, "image/png")])
        assert len(images.cache_key) == len(ids) and images.cache_key[0] == -1 - ids[0] < 0
    finally:
        sm.close()


def test_image_key_is_the_content():
    a, b = b"a" * 32, b"b" * 32
    ids = [5, 9, 9, 9, 6]
    assert image_key(ids, 9, [a]) == image_key(ids, 9, [a])
    assert image_key(ids, 9, [a])[:1] == image_key(ids, 9, [b])[:1] == (-6,)
    assert image_key(ids, 9, [a])[1] != image_key(ids, 9, [b])[1]
    assert all(t < IMAGE_ID_TOP for t in image_key(ids, 9, [a])[1:4])
    assert image_key(ids, 9, [a])[4] == 6 and len(set(image_key(ids, 9, [a])[1:4])) == 3


def _cached_answer(sm, chat, cache) -> tuple:
    """iter_generate's greedy answer to `chat` (its images those of its messages, in
    order) with the prompt cache `cache` (None: afresh), and the prompt's ids."""
    from moestream.daemon.model.generation import GenerationResult, SamplingParams, iter_generate

    images = [im for m in chat for im in m.images or ()]
    ids, prepared = prepare(sm.vision, render_chat(sm.tokenizer, chat), images)
    result = GenerationResult()
    for _ in iter_generate(sm, ids, SamplingParams(max_tokens=TOKENS), result, prompt_cache=cache, images=prepared):
        pass
    return result, ids


def _prompt_cache(sm):
    from mlx_lm.models.cache import make_prompt_cache

    from moestream.daemon.model.prompt_cache import PromptCache

    layout = [type(c).__name__ for c in make_prompt_cache(sm.model)]
    return PromptCache("test-store", layout, max_bytes=2**30, max_entries=16)


def test_a_resent_image_is_served_from_the_prompt_cache_exactly(vlm):
    """iter_generate with the prompt cache: the same chat with its image again reuses all
    of its prompt but the last token (the image's tokens among them), a follow-up turn
    the first turn's prompt and answer, and each answer is the one computed afresh; a
    linear-attention model's state (qwen3_5_moe) comes back as snapshots."""
    _, store = vlm
    sm = load_streaming_model(store, Settings(capacity=0.25))
    try:
        pc = _prompt_cache(sm)
        image = proto.ImageData(png(6), "image/png")

        def answer(chat, cache):
            return _cached_answer(sm, chat, cache)

        chat = [proto.ChatMessage("user", QUESTION, images=(image,))]
        (first, ids), (again, _), (cold, _) = answer(chat, pc), answer(chat, pc), answer(chat, None)
        n = len(ids)
        image_at = ids.index(sm.vision.image_token_id)
        assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == n - 1 > image_at
        assert first.tokens == again.tokens == cold.tokens
        turn = [*chat, proto.ChatMessage("assistant", first.text), proto.ChatMessage("user", "And then?")]
        (follow, _), (follow_cold, _) = answer(turn, pc), answer(turn, None)
        assert follow.stats.cached_tokens > image_at and follow.tokens == follow_cold.tokens
    finally:
        sm.close()


def test_a_turn_that_adds_an_image_reuses_the_earlier_one(vlm):
    """A follow-up turn that sends a second image (of another size) reuses the first
    image's KV (whole where its tokens are one run; its first run where there are more:
    Llama 4's tiles of a wide image, Mistral 3's rows) and answers as computed afresh."""
    _, store = vlm
    sm = load_streaming_model(store, Settings(capacity=1.0))
    try:
        pc = _prompt_cache(sm)
        wide, other = proto.ImageData(png(7, (96, 160)), "image/png"), proto.ImageData(png(8), "image/png")

        def answer(chat, cache):
            return _cached_answer(sm, chat, cache)

        chat = [proto.ChatMessage("user", QUESTION, images=(wide,))]
        first, ids = answer(chat, pc)
        image = sm.vision.image_token_id
        runs = sum(1 for a, b in zip([None, *ids], ids) if b == image and a != b)
        more = proto.ChatMessage("user", "And this?", images=(other,))
        turn = [*chat, proto.ChatMessage("assistant", first.text), more]
        (follow, turn_ids), (cold, _) = answer(turn, pc), answer(turn, None)
        # Llama 4's wide image is one tile (daemon/model/vision.py: mlx-vlm's processor
        # gives its tiles no global tile), Mistral 3's image rows of tokens.
        assert (runs == 1) == (load_manifest(store).model_type != "mistral3"), runs
        first_run = ids.index(image)
        while first_run < len(ids) and ids[first_run] == image:
            first_run += 1
        whole = max(i for i, t in enumerate(ids) if t == image) + 1
        assert turn_ids[:whole] == ids[:whole]
        assert follow.stats.cached_tokens >= (whole if runs == 1 else first_run) > 0
        assert follow.tokens == cold.tokens
    finally:
        sm.close()
