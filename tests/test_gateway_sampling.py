"""Sampling controls, log-probabilities and n > 1 through the gateway's APIs, with the real
`openai`, `anthropic` and `ollama` packages against a real daemon and gateway on the demo
model. Each API's answer is compared with the daemon's own answer to the same controls
(`Client` with `SamplingControls`; the daemon's answers are checked against stock mlx-lm
in tests/test_sampling_controls.py), and each control is shown to act."""

from __future__ import annotations

import httpx
import pytest
from test_openai_gateway import real_clients, served_gateway

from moestream.client.client import Client
from moestream.shared import protocol as proto
from moestream.shared.protocol import SamplingControls
from moestream.shared.settings import demo_store_path

KEY = "sk-sampling-0123456789"
N = 12
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What does zip do?"}]
# A Qwen3.5 model card's settings.
CARD = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5}
CARD_CONTROLS = SamplingControls(presence_penalty=1.5)


@pytest.fixture(scope="module")
def served():
    with served_gateway(demo_store_path(), "mss", KEY) as both:
        yield both


@pytest.fixture(scope="module")
def clients(served):
    return real_clients(served[1].url, KEY)


def _daemon(served, **kw) -> proto.Done:
    with Client(served[0]) as c:
        return c.complete(messages=CHAT, max_tokens=N, **kw)


def test_logit_bias_removes_a_greedy_token_and_logprobs_make_the_text(served, clients):
    oa, _, _ = clients
    greedy = _daemon(served)
    first = greedy.tokens[0]
    out = oa.chat.completions.create(
        model="m",
        messages=CHAT,
        max_tokens=N,
        temperature=0,
        logit_bias={str(first): -100},
        logprobs=True,
        top_logprobs=3,
    )
    biased = _daemon(served, sampling=SamplingControls(logit_bias=((first, -100.0),)))
    assert first not in biased.tokens and out.choices[0].message.content == biased.text != greedy.text
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 3 for c in content)
    # Greedy: each token is the likeliest of its position.
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)
    # Streamed: the chunks' entries make the streamed text.
    chunks = list(
        oa.chat.completions.create(
            model="m", messages=CHAT, max_tokens=N, temperature=0, logprobs=True, top_logprobs=1, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = "".join(
        e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    )
    assert text == tokens == greedy.text


def test_completions_logprobs_and_the_cards_settings_on_each_api(served, clients):
    oa, an, ol = clients
    out = oa.completions.create(model="m", prompt="def route(hidden):", max_tokens=N, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) >= 1 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    # The card's settings (seeded) give the daemon's answer to the same controls on each API.
    want = _daemon(served, temp=0.7, top_p=0.8, top_k=20, seed=4, sampling=CARD_CONTROLS).text
    plain = _daemon(served, temp=0.7, top_p=0.8, top_k=20, seed=4).text
    assert want != plain  # the penalty acts
    card = dict(CARD, seed=4)
    chat = oa.chat.completions.create(
        model="m",
        messages=CHAT,
        max_tokens=N,
        **{k: card[k] for k in ("temperature", "top_p", "presence_penalty", "seed")},
        extra_body={"top_k": 20, "min_p": 0.0},
    )
    assert chat.choices[0].message.content == want
    message = an.messages.create(
        model="m",
        system=CHAT[0]["content"],
        messages=CHAT[1:],
        max_tokens=N,
        extra_body={"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5, "min_p": 0.0, "seed": 4},
    )
    assert "".join(b.text for b in message.content) == want
    options = {"num_predict": N, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "seed": 4}
    reply = ol.chat(model="m", messages=CHAT, options=options | {"presence_penalty": 1.5})
    assert reply.message.content == want
    # Ollama's repeat_penalty over repeat_last_n, and its logprobs.
    repeat = SamplingControls(repetition_penalty=1.3, penalty_window=16)
    want = _daemon(served, sampling=repeat).text
    reply = ol.chat(
        model="m",
        messages=CHAT,
        options={"num_predict": N, "temperature": 0, "repeat_penalty": 1.3, "repeat_last_n": 16},
        logprobs=True,
        top_logprobs=2,
    )
    assert reply.message.content == want
    assert "".join(e.token for e in reply.logprobs) == want and all(len(e.top_logprobs) == 2 for e in reply.logprobs)
    streamed = list(
        ol.generate(
            model="m",
            prompt="def route(hidden):",
            options={"num_predict": N, "temperature": 0},
            logprobs=True,
            stream=True,
        )
    )
    assert "".join(p.response for p in streamed) == "".join(e.token for p in streamed for e in p.logprobs or ())


def test_responses_logprobs(served, clients):
    oa, _, _ = clients
    greedy = _daemon(served, sampling=SamplingControls(logprobs=2))
    out = oa.responses.create(
        model="m",
        instructions=CHAT[0]["content"],
        input=CHAT[1]["content"],
        max_output_tokens=N,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = out.output[-1].content[0]
    assert part.text == greedy.text == "".join(e.token for e in part.logprobs)
    assert [e.logprob for e in part.logprobs] == [e.logprob for e in greedy.logprobs]
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    deltas = []
    with oa.responses.stream(
        model="m",
        instructions=CHAT[0]["content"],
        input=CHAT[1]["content"],
        max_output_tokens=N,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=1,
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas += [e.token for e in event.logprobs]
    assert "".join(deltas) == greedy.text


def test_n_choices_are_n_requests_with_seeds_in_turn(served, clients):
    oa, _, _ = clients
    kw = dict(model="m", messages=CHAT, max_tokens=N, temperature=1.0, seed=7)
    out = oa.chat.completions.create(**kw, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    want = [_daemon(served, temp=1.0, seed=s).text for s in (7, 8)]
    assert [c.message.content for c in out.choices] == want and want[0] != want[1]
    assert out.usage.completion_tokens == sum(len(_daemon(served, temp=1.0, seed=s).tokens) for s in (7, 8))
    texts = ["", ""]
    for chunk in oa.chat.completions.create(**kw, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == want
    out = oa.completions.create(model="m", prompt="def route(hidden):", max_tokens=N, temperature=0, n=2)
    assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text
    r = httpx.post(
        served[1].url + "/v1/chat/completions",
        json={"model": "m", "messages": CHAT, "n": 0},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_bad_controls_get_each_apis_400_and_the_gateway_serves_on(served):
    url, auth = served[1].url, {"Authorization": f"Bearer {KEY}"}
    ollama_chat = {"model": "m", "messages": CHAT, "stream": False}
    anthropic_body = {"model": "m", "messages": CHAT[1:], "max_tokens": 4}
    cases = [
        ("/api/chat", ollama_chat | {"options": {"repeat_last_n": -5}}, "repeat_last_n"),
        ("/api/chat", ollama_chat | {"options": {"repeat_penalty": "x"}}, "repeat_penalty"),
        ("/api/chat", ollama_chat | {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("/v1/messages", anthropic_body | {"presence_penalty": 5}, "presence_penalty"),
        ("/v1/messages", anthropic_body | {"logit_bias": {"1": 500}}, "logit_bias"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
    ]
    with httpx.Client(timeout=60) as http:
        for path, body, word in cases:
            r = http.post(url + path, json=body, headers=auth)
            assert r.status_code == 400 and word in r.text, (path, body, r.text)
        r = http.post(url + "/api/chat", json=ollama_chat | {"options": {"num_predict": 2}}, headers=auth)
        assert r.status_code == 200
