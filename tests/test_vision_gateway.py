"""Images through the daemon and every API of the gateway, with the real `openai`,
`anthropic` and `ollama` packages, on a tiny vision-language MoE model (tests/tiny_vision.py;
its streamed answers equal stock mlx-vlm's: tests/test_vision.py). Each API's answer is the
daemon's own answer to the same chat; bad images get 400s and the daemon serves on; a
resent image hits the prompt cache."""

from __future__ import annotations

import base64
import io
import shutil
import tempfile
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from test_openai_gateway import real_clients, served_gateway
from tiny_vision import make_tiny_vlm, png

from moestream.client.client import Client
from moestream.daemon.store.convert import convert_model
from moestream.shared import protocol as proto
from moestream.shared.settings import demo_store_path

KEY = "sk-vision-0123456789"
N = 8
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def store():
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="msvs"))
    try:
        convert_model(make_tiny_vlm(root / "model", seed=5), root / "store")
        yield root / "store"
    finally:
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def served(store):
    with served_gateway(store, "msv", KEY) as both:
        yield both


@pytest.fixture(scope="module")
def clients(served):
    return real_clients(served[1].url, KEY)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + _b64(data)


def _daemon(served, image: bytes, question: str = QUESTION) -> proto.Done:
    with Client(served[0]) as c:
        return c.complete(messages=[{"role": "user", "content": question, "images": [image]}], max_tokens=N)


def _openai_chat(image_url: str, question: str = QUESTION) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": question}],
        }
    ]


def _anthropic_chat(data: str, question: str = QUESTION) -> list[dict]:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    return [{"role": "user", "content": [image, {"type": "text", "text": question}]}]


def test_every_api_sends_an_image_and_gets_the_daemons_answer(served, clients):
    oa, an, ol = clients
    image = png(3)
    ref = _daemon(served, image)
    assert ref.finish_reason == "length" and ref.text
    assert ref.text != _daemon(served, png(4)).text  # the image is seen
    chat = oa.chat.completions.create(model="m", messages=_openai_chat(_data_url(image)), max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == ref.text
    assert chat.usage.prompt_tokens == ref.stats.prompt_tokens
    msg = an.messages.create(
        model="m", messages=_anthropic_chat(_b64(image)), max_tokens=N, extra_body={"temperature": 0}
    )
    assert msg.content[0].text == ref.text
    out = ol.chat(
        model="m",
        messages=[{"role": "user", "content": QUESTION, "images": [image]}],
        options={"temperature": 0, "num_predict": N},
    )
    assert out.message.content == ref.text
    resp = oa.responses.create(
        model="m",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": _data_url(image)},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        max_output_tokens=N,
        temperature=0,
    )
    assert resp.output_text == ref.text
    # Streamed, too.
    chunks = oa.chat.completions.create(
        model="m", messages=_openai_chat(_data_url(image)), max_tokens=N, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def _big_png() -> bytes:
    """A PNG of 6000 x 6000 pixels (over MAX_IMAGE_PIXELS) in a few kilobytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (6000, 6000)).save(buf, "PNG")
    return buf.getvalue()


def test_bad_images_get_clear_400s_and_the_daemon_serves_on(served, clients):
    oa, an, ol = clients
    image = png(3)
    ref = _daemon(served, image)
    cases = [
        ("remote URL", "https://example.com/cat.png", "remote image URLs are not fetched"),
        ("not an image", _data_url(b"hello, this is text"), "not an image"),
        ("truncated", _data_url(image[: len(image) // 2]), "cannot be decoded"),
        ("over the pixel limit", _data_url(_big_png()), "over the limit of"),
        ("over the byte limit", _data_url(b"\x89PNG\r\n\x1a\n" + bytes(proto.MAX_IMAGE_BYTES)), "over the limit of"),
        ("not base64", "data:image/png;base64,@@@@", "not valid base64"),
    ]
    for what, url, says in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="m", messages=_openai_chat(url), max_tokens=N, temperature=0)
        assert e.value.status_code == 400 and says in str(e.value), what
    too_many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}}] * 9}]
    with pytest.raises(openai.BadRequestError, match="over the limit of 8"):
        oa.chat.completions.create(model="m", messages=too_many, max_tokens=N)
    with pytest.raises(anthropic.BadRequestError, match="cannot be decoded"):
        an.messages.create(model="m", messages=_anthropic_chat(_b64(image[:-40])), max_tokens=N)
    url_source = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    with pytest.raises(anthropic.BadRequestError, match="remote image URLs"):
        an.messages.create(model="m", messages=[{"role": "user", "content": [url_source]}], max_tokens=N)
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="m", messages=[{"role": "user", "content": "hi", "images": [_b64(b"GIF89a" + b"\0" * 20)]}])
    assert e.value.status_code == 400 and "is not an image" in str(e.value)
    # The daemon served on, exactly.
    assert _daemon(served, image).text == ref.text
    chat = oa.chat.completions.create(model="m", messages=_openai_chat(_data_url(image)), max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == ref.text


def test_status_and_models_say_the_model_takes_images(served):
    with Client(served[0]) as c:
        assert c.status().capabilities["vision"] is True
    url = served[1].url
    headers = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(url + "/v1/models", headers=headers).json()["data"]
    assert "vision" in models[0]["capabilities"]
    shown = httpx.post(url + "/api/show", json={"model": "m"}, headers=headers).json()
    assert "vision" in shown["capabilities"]


def test_a_resent_image_hits_the_prompt_cache(served, clients):
    oa, _, _ = clients
    image = png(7)
    with Client(served[0]) as c:
        # Where the image's tokens lie in the prompt (the processor's expansion).
        first = c.complete(messages=[{"role": "user", "content": "Describe it.", "images": [image]}], max_tokens=N)
    prompt = first.stats.prompt_tokens
    again = oa.chat.completions.create(
        model="m",
        messages=_openai_chat(_data_url(image), "Describe it."),
        max_tokens=N,
        temperature=0,
        user="someone",
    )
    assert again.choices[0].message.content == first.text
    # A chat that resends the screenshot with a turn after it: its prefix, image included, is cached.
    turn = _openai_chat(_data_url(image), "Describe it.") + [
        {"role": "assistant", "content": again.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    follow = oa.chat.completions.create(model="m", messages=turn, max_tokens=N, temperature=0, user="someone")
    cached = follow.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt at least, the image's tokens in it (its answer as far as the
    # template renders it as it was sampled).
    assert prompt <= cached < follow.usage.prompt_tokens, (cached, prompt)
    # Another image parts from the cache at its first token.
    other = _openai_chat(_data_url(png(8)), "Describe it.") + turn[1:]
    fresh = oa.chat.completions.create(model="m", messages=other, max_tokens=N, temperature=0, user="someone")
    assert fresh.usage.prompt_tokens_details.cached_tokens < prompt - 4
    # The same request with the cache's answer equals it computed afresh (the daemon's own, uncached).
    with Client(served[0]) as c:
        cold = c.complete(
            messages=[
                {"role": "user", "content": "Describe it.", "images": [image]},
                {"role": "assistant", "content": again.choices[0].message.content},
                {"role": "user", "content": "And the colours?"},
            ],
            max_tokens=N,
            cache_scope="nobody-else",
        )
    assert cold.stats.cached_tokens == 0 and cold.text == follow.choices[0].message.content


@pytest.fixture(scope="module")
def text_only():
    with served_gateway(demo_store_path(), "msvt", KEY) as both:
        yield both


def test_a_text_only_model_refuses_images_and_anthropic_reads_placeholders(text_only):
    oa, an, ol = real_clients(text_only[1].url, KEY)
    image = png(3)
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        oa.chat.completions.create(model="m", messages=_openai_chat(_data_url(image)), max_tokens=N)
    with pytest.raises(ollama.ResponseError, match="takes no images"):
        ol.chat(model="m", messages=[{"role": "user", "content": "hi", "images": [image]}])
    with Client(text_only[0]) as c:
        assert c.status().capabilities["vision"] is False
        with pytest.raises(Exception, match="takes no images"):
            c.complete(messages=[{"role": "user", "content": "hi", "images": [image]}], max_tokens=2)
    # Claude Code sends screenshots whatever the model: a placeholder in the image's place.
    msg = an.messages.create(
        model="m", messages=_anthropic_chat(_b64(image)), max_tokens=4, extra_body={"temperature": 0}
    )
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.input_tokens > 10
