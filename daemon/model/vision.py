"""Images in: a vision-language model's vision tower beside the streamed language model.

A store converted from a vision-language model keeps the vision tower and projector as
mlx-vlm loads them (`vision_files`, daemon/store/convert.py); they stay resident, as the
language model's dense weights do, and only the experts stream. At load, mlx-vlm's own
model is built from the store's config and given the same arrays: the language model's
weights are the streamed mlx-lm model's (shared, not copied), its expert modules are
wrapped in `StreamingMoE`s on the same pools. So a request with images runs mlx-vlm's
code throughout (its processor, vision tower, the merge of image features into the
prompt's embeddings, its language model with multimodal positions) and stock's output
is kept by running its code, as for text.

A request with images decodes alone (not batched, not speculative, stock's chunked
prefill), on its own shallow copy of mlx-vlm's language model: that object keeps the
request's multimodal positions between steps (`_rope_deltas`), which two requests
in turns must not share.

The prompt cache keys such a prompt by `image_key`: the prompt's ids with each image's
tokens replaced by ids drawn from the image's content hash, and its first id marked (a
prompt with images never shares KV with text prompts, which the mlx-lm model computed):
a conversation that sends the same screenshot again finds its cached prefix, image
included, and a different image parts from it at its first token.

The checks and the processor run on the prompt-check thread (`prepare`): numpy and PIL
only, no MLX.
"""

from __future__ import annotations

import copy
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...shared import protocol as proto
from ...shared.store_format import Manifest, StoreError

# Ids of a prompt-cache key of a prompt with images (`image_key`); token ids are >= 0.
# A text token t first in such a key is -1 - t (above IMAGE_ID_TOP); an image's tokens
# are IMAGE_ID_TOP - 1 down to -2**31.
IMAGE_ID_TOP = -(2**30)
_IMAGE_ID_SPAN = 2**30


class ImageError(ValueError):
    """An image the daemon cannot use (the request is refused with `bad_image`)."""


@dataclass(frozen=True)
class PreparedImages:
    """A chat's images as the model's processor made them, with the prompt's ids."""

    # The processor's output besides the ids (pixel_values, image_grid_thw, ...), numpy;
    # a list of arrays where the images' shapes differ (Gemma 4's pixel_values).
    inputs: dict[str, np.ndarray | list[np.ndarray]]
    # Each image's content hash (sha256 of its file's bytes), in the prompt's order.
    digests: tuple[bytes, ...]
    # The prompt-cache key (`image_key`).
    cache_key: tuple[int, ...]


@dataclass
class Vision:
    """mlx-vlm's model of the store, its language model streamed, and its processor."""

    model: nn.Module
    processor: Any
    image_token_id: int
    # Bytes of the vision tower and projector (resident beside the language model's).
    nbytes: int = 0

    def request_model(self) -> nn.Module:
        """mlx-vlm's model for one request: shallow copies of it and of its language model
        (which keeps a request's multimodal positions between its steps); every weight
        and module below is shared."""
        model = copy.copy(self.model)
        model["language_model"] = copy.copy(self.model.language_model)
        return model

    def request_cache(self, cache: list[Any], fresh: bool) -> list[Any]:
        """A request's cache for mlx-vlm's language model, from `cache` (mlx-lm's classes,
        as the prompt cache keeps them): its KVCache layers as they are (mlx-vlm's
        attention takes mlx-lm's KVCache, whose rows the prompt cache shares), any other
        layer (linear attention's state) in mlx-vlm's own class, with `cache`'s state
        unless `fresh`. A layer mlx-lm keeps as a CacheList of one KVCache where mlx-vlm
        keeps a KVCache (minimax_m3_vl's dense attention: mlx-lm's sparse layers add
        their indexer's keys as a second cache) is that KVCache, shared the same way."""
        from mlx_vlm.models.cache import make_prompt_cache

        own = make_prompt_cache(self.model.language_model)
        out = []
        for kept, c in zip(cache, own, strict=True):
            inner = getattr(kept, "caches", ())
            if type(c).__name__ == "KVCache" and len(inner) == 1 and type(inner[0]).__name__ == "KVCache":
                kept = inner[0]
            if type(c).__name__ == "KVCache" or type(kept) is type(c):
                out.append(kept)
                continue
            if not fresh:
                c.state = kept.state  # as mlx-lm's cache objects take their contents
            out.append(c)
        return out


def _vlm_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(config)
    arch, _ = get_model_and_args(config)
    config.setdefault("text_config", config.pop("llm_config", {}))
    config.setdefault("vision_config", {})
    config.setdefault("audio_config", {})
    model_config = arch.ModelConfig.from_dict(config)
    model_config = update_module_configs(
        model_config, arch, config, ["text", "vision", "perceiver", "projector", "audio"]
    )
    return arch, model_config


def load_vision(
    store: Path,
    manifest: Manifest,
    weights: dict[str, mx.array],
    quantize: Callable[[nn.Module, dict[str, mx.array]], None],
    stream: Callable[[nn.Module], None],
) -> Vision:
    """mlx-vlm's model of the store: the vision weights from its `vision_files`, the
    language model's from `weights` (the streamed model's resident arrays, shared);
    `quantize(model, weights)` quantizes it as the store's weights say, and
    `stream(model)` wraps its MoE layers' expert modules on the pools."""
    from mlx_vlm.utils import load_processor

    arch, model_config = _vlm_classes(manifest.config)
    model = arch.Model(model_config)
    vision: dict[str, mx.array] = {}
    for name in manifest.vision_files:
        path = store / name
        try:
            vision.update(mx.load(str(path)))
        except (RuntimeError, ValueError, FileNotFoundError) as e:
            raise StoreError(
                f"{store}: vision weights file {name} cannot be read ({e}); convert the store again"
            ) from e
    every = {**weights, **vision}
    _drop_towers_without_weights(model, every)
    quantize(model, every)
    experts = tuple(
        f"{layer.module_path}.{t.name.rsplit('.', 1)[0]}." for layer in manifest.layers for t in layer.tensors
    )
    expected = {k for k, _ in tree_flatten(model.parameters()) if not k.startswith(experts)}
    missing = expected - every.keys()
    if missing:
        raise StoreError(f"{store}: mlx-vlm's model needs weights the store lacks: {sorted(missing)[:5]}")
    model.load_weights([(k, v) for k, v in every.items() if k in expected], strict=False)
    model.eval()
    stream(model)
    processor = load_processor(store, add_detokenizer=False)
    if type(processor).__name__ == "Llama4Processor":
        # mlx-vlm 0.7's Llama 4 processor splits a large image into tiles but makes no
        # global tile, while the prompt it writes has one: those tokens get no features
        # of the image's own (the next image's, or values past them: embeddings of 1e11
        # on the tiny model, and a follow-up turn that reused the cache answered
        # otherwise than afresh). One tile an image, as it gives any image that fits
        # one, keeps every image whole.
        processor.image_processor.max_patches = 1
    image_token_id = getattr(model_config, "image_token_index", None) or getattr(model_config, "image_token_id")
    return Vision(
        model=model,
        processor=processor,
        image_token_id=int(image_token_id),
        nbytes=sum(v.nbytes for v in vision.values()),
    )


def _drop_towers_without_weights(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Unset the model's top-level towers that `weights` has nothing of (gemma4's audio
    tower in a checkpoint without one), as mlx-vlm's `load` does: the model then skips
    them, and no weight of theirs is asked of the store."""
    present = {k.partition(".")[0] for k in weights}
    for name, child in list(model.items()):
        if name != "language_model" and isinstance(child, nn.Module) and name not in present:
            if tree_flatten(child.parameters()):
                setattr(model, name, None)


# ---- the prompt-check thread: no MLX --------------------------------------------------


def open_image(image: proto.ImageData, where: str) -> Any:
    """`image` decoded as an RGB PIL image; ImageError for bytes that are not a whole
    image of a known format, or over MAX_IMAGE_PIXELS (checked from the header, before
    the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(image.data)) as probe:
            kind = probe.format
            width, height = probe.size
    except UnidentifiedImageError:
        raise ImageError(f"{where} is not an image of a known format (PNG, JPEG, GIF or WebP)") from None
    except (OSError, ValueError) as e:
        raise ImageError(f"{where} is not an image (PNG, JPEG, GIF or WebP): {e}") from None
    if kind not in ("PNG", "JPEG", "GIF", "WEBP"):
        raise ImageError(f"{where} is a {kind} image; send PNG, JPEG, GIF or WebP")
    if width * height > proto.MAX_IMAGE_PIXELS:
        raise ImageError(
            f"{where} is {width}x{height}, {width * height} pixels: over the limit of {proto.MAX_IMAGE_PIXELS}"
        )
    try:
        with Image.open(io.BytesIO(image.data)) as im:
            im.load()  # a truncated file fails here, not later in the processor
            return im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where} cannot be decoded (truncated or corrupt?): {e}") from None


def image_key(ids: Sequence[int], image_token_id: int, digests: Sequence[bytes]) -> tuple[int, ...]:
    """The prompt-cache key of a prompt with images, one id per token as the cache's
    trie takes them: `ids` with the tokens of the i-th image (each maximal run of
    `image_token_id`) replaced by ids drawn from `digests[i]` and the token's place in
    it, and a text token first made negative (-1 - t), so that no key of a prompt with
    images is a text prompt's (whose KV the mlx-lm model computed).

    An image in several runs (Llama 4's tiles, Mistral 3's rows) has its later runs
    keyed by the next images' digests: no two prompts with other images share a key all
    the same (image i's digest keys run i, at or before the image's first token), and a
    turn that adds an image reuses the earlier ones' KV up to the end of their i-th run
    only. Keying each image's runs by its own digest would reuse more, but is not exact
    where a model's image tokens take other images' features: mlx-vlm's Llama 4
    processor gives a multi-tile image no global tile, so that image's last run takes
    the next image's features (a prompt's first image alone: other values)."""
    key = []
    image, place = -1, 0
    previous = None
    for t in ids:
        if t == image_token_id:
            if previous != image_token_id:
                image, place = image + 1, 0
            digest = digests[min(image, len(digests) - 1)]
            h = hashlib.blake2b(digest + place.to_bytes(4, "little"), digest_size=8).digest()
            key.append(IMAGE_ID_TOP - 1 - int.from_bytes(h, "little") % _IMAGE_ID_SPAN)
            place += 1
        else:
            key.append(int(t))
        previous = t
    if key and key[0] >= 0:
        key[0] = -1 - key[0]
    return tuple(key)


def prepare(vision: Vision, text: str, images: Sequence[proto.ImageData]) -> tuple[list[int], PreparedImages]:
    """The prompt `text` (the chat rendered, one image placeholder per image) and its
    `images` through the model's processor, as mlx-vlm's `prepare_inputs` sends them:
    the prompt's ids (each image's tokens expanded) and the images' inputs."""
    from mlx_vlm.utils import process_inputs

    pictures = [open_image(im, f"image {i + 1}") for i, im in enumerate(images)]
    try:
        out = process_inputs(vision.processor, prompts=[text], images=pictures, return_tensors="np")
    except (ValueError, TypeError) as e:
        raise ImageError(f"the model's processor refused the images: {e}") from None
    ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
    inputs: dict[str, np.ndarray | list[np.ndarray]] = {}
    for k, v in out.items():
        if k in ("input_ids", "attention_mask") or v is None or isinstance(v, str):
            continue
        if not isinstance(v, list):
            inputs[k] = np.asarray(v)
        elif v and all(isinstance(x, np.ndarray) for x in v):
            inputs[k] = [np.asarray(x) for x in v]  # one array per image, of its own shape
    digests = tuple(hashlib.sha256(im.data).digest() for im in images)
    return ids, PreparedImages(inputs=inputs, digests=digests, cache_key=image_key(ids, vision.image_token_id, digests))


# ---- the engine thread ------------------------------------------------------------------


def vision_steps(
    vision: Vision,
    prompt_ids: Sequence[int],
    images: PreparedImages,
    cache: list[Any],
    start: int,
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    processors: Sequence[Callable[[mx.array, mx.array], mx.array]] = (),
    prefill_step: int = 2048,
    on_progress: Callable[[int, int], None] | None = None,
    on_prefilled: Callable[[list[Any]], None] | None = None,
) -> Iterator[tuple[mx.array | None, mx.array | None]]:
    """mlx-vlm's `generate_step` on `vision`'s model, for a prompt with images: its
    embeddings (the vision tower's features merged), a prefill in stock's chunks from
    `start` (the tokens `cache` holds already: a cached prefix), then one token a step.
    Yields (None, None) after each prefill chunk, then (token, logprobs) as mlx-lm's
    `generate_step` does; every token yielded has gone into `cache`. `on_prefilled(cache)`
    once the cache holds the prompt but its last token (the prompt cache's snapshot of a
    cache that cannot be trimmed back to there later)."""
    model = vision.request_model()
    lm = model.language_model
    ids = mx.array([list(prompt_ids)])
    arrays = {k: [mx.array(x) for x in v] if isinstance(v, list) else mx.array(v) for k, v in images.inputs.items()}
    kwargs = {k: v for k, v in arrays.items() if k != "pixel_values"}
    features = model.get_input_embeddings(ids, arrays["pixel_values"], mask=None, **kwargs)
    embeds = features.inputs_embeds
    extra = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
    extra.update(kwargs)
    n = len(prompt_ids)
    done = start
    progress = on_progress or (lambda d, t: None)
    progress(done, n)
    # The prompt but its last token, in chunks; the language model takes the full
    # prompt's positions and visual masks, and slices them at the cache's offset.
    while n - done > 1:
        take = min(prefill_step, n - 1 - done)
        lm(
            ids[:, done : done + take],
            inputs_embeds=embeds[:, done : done + take],
            cache=cache,
            n_to_process=take,
            logits_to_keep=1,
            **extra,
        )
        mx.eval([c.state for c in cache])
        done += take
        progress(done, n)
        yield None, None
    if on_prefilled is not None and done > start:
        on_prefilled(cache)
    history = mx.array(list(prompt_ids[:-1]), dtype=mx.uint32)

    def step(y: mx.array, inputs_embeds: mx.array | None, kw: dict[str, Any]) -> tuple[mx.array, mx.array]:
        nonlocal history
        logits = lm(y, inputs_embeds=inputs_embeds, cache=cache, logits_to_keep=1, **kw).logits[:, -1, :]
        if processors:
            history = mx.concatenate([history, y.flatten().astype(history.dtype)])
            for p in processors:
                logits = p(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs.squeeze(0)

    y, logprobs = step(ids[:, -1:], embeds[:, -1:], extra)
    mx.async_eval(y, logprobs)
    made = 0
    while True:
        if made != max_tokens:
            next_y, next_logprobs = step(y[None] if y.ndim == 1 else y, None, {})
            mx.async_eval(next_y, next_logprobs)
        if made == max_tokens:
            break
        yield y.reshape(-1)[0], logprobs
        made += 1
        y, logprobs = next_y, next_logprobs
