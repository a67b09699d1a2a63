"""The HTTP test suites of peer servers, re-expressed against moestream's gateway (issue 61):
llama.cpp's server (tools/server/tests/unit/test_compat_anthropic.py,
test_compat_oai_responses.py, test_chat_completion.py, test_tool_call.py) and mlx-lm's
(tests/test_server.py). Each test is named after the peer's check it ports; what was
ported and what does not apply is listed, check by check, in tests/data/peer_suites.md.
The checks are our own code, asserting our behaviour exactly (token counts from the
tokenizer and the chat template, greedy text equal to the daemon's own answer), never
the peers' strings.

Real parts, as the other gateway tests: the demo model in a real daemon, the gateway as
its own process, raw HTTP (httpx) where the peer sends raw HTTP and the real `openai` /
`anthropic` packages where the peer uses them; the thinking blocks' check runs on the
tiny thinking model (tests/thinking_model.py) in a second daemon.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from test_openai_gateway import served_gateway
from thinking_model import CHAT as THINKING_CHAT
from thinking_model import THINK_END, make_thinking_store

from moestream.client.client import Client, Done
from moestream.client.gateway import anthropic as anth
from moestream.daemon.model.generation import render_chat
from moestream.shared.protocol import SamplingControls
from moestream.shared.settings import demo_store_path

KEY = "sk-peers-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ANTHROPIC_AUTH = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
N = 8  # tokens of an answer: the peers ask for 8 or 10
SYSTEM = "You answer briefly."
QUESTION = "What does zip do?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
FUNCTION = {
    "type": "function",
    "function": {"name": TOOL["name"], "description": TOOL["description"], "parameters": TOOL["input_schema"]},
}
# An assistant turn that called a tool, and the tool's result, in OpenAI's shape.
TOOL_TURN = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]
# Tokens for a constrained answer to end in: the demo model, which has learnt no JSON,
# writes a short JSON object well within them at temperature 0.
JSON_BUDGET = 96
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# A 1x1 PNG, as llama.cpp's image check sends it.
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_store_path())


@pytest.fixture(scope="module")
def served():
    """(daemon paths, gateway) on the demo model, the gateway with an API key."""
    with served_gateway(demo_store_path(), "msp", KEY) as both:
        yield both


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[1].url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oa(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def rendered_tokens(tokenizer, messages: list[dict[str, Any]], tools: list | None = None, **kw: Any) -> int:
    """The prompt's tokens as the daemon renders `messages` (protocol shape) with the template."""
    text = render_chat(tokenizer, messages, tools, **kw)
    return len(tokenizer.encode(text, add_special_tokens=False))


def daemon_answer(served, messages: list[dict[str, Any]], max_tokens: int = N, **kw: Any) -> Done:
    """The daemon's own greedy answer to `messages` (no gateway in between)."""
    with Client(served[0]) as c:
        events = list(c.generate(messages=messages, max_tokens=max_tokens, temp=0.0, **kw))
    done = events[-1]
    assert isinstance(done, Done)
    return done


def anthropic_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The data of each server-sent event, checked against its `event:` line."""
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name, (name, data)
            out.append(data)
    return out


def openai_chunks(response: httpx.Response) -> list[Any]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post_messages(http: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return http.post(
        "/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": N} | body, headers=ANTHROPIC_AUTH
    )


def _check_anthropic_message(body: dict[str, Any], want: Done, prompt_tokens: int) -> None:
    """A non-streamed Messages answer with `want`'s text, its usage adding up to the prompt."""
    assert body["type"] == "message" and body["role"] == "assistant" and body["id"].startswith("msg_")
    assert body["content"] == [{"type": "text", "text": want.text}]
    assert body["stop_reason"] == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    use = body["usage"]
    assert all(isinstance(use[k], int) for k in ("input_tokens", "output_tokens", "cache_read_input_tokens"))
    assert use["input_tokens"] + use["cache_read_input_tokens"] == prompt_tokens
    assert use["output_tokens"] == len(want.tokens) > 0
    assert "timings" not in body  # llama.cpp's own field


# ---- llama.cpp: test_compat_anthropic.py ---------------------------------------------------


def test_anthropic_basic_message_shape_and_usage(served, http, tokenizer):
    user = [{"role": "user", "content": QUESTION}]
    r = post_messages(http, {"messages": user, "temperature": 0})
    assert r.status_code == 200, r.text
    _check_anthropic_message(r.json(), daemon_answer(served, user), rendered_tokens(tokenizer, user))


def test_anthropic_system_string(served, http, tokenizer):
    r = post_messages(http, {"system": SYSTEM, "messages": CHAT[1:], "temperature": 0})
    assert r.status_code == 200, r.text
    _check_anthropic_message(r.json(), daemon_answer(served, CHAT), rendered_tokens(tokenizer, CHAT))


def test_anthropic_user_content_as_text_blocks(served, http, tokenizer):
    blocks = [{"type": "text", "text": "What does "}, {"type": "text", "text": "zip do?"}]
    r = post_messages(http, {"messages": [{"role": "user", "content": blocks}], "temperature": 0})
    assert r.status_code == 200, r.text
    # The blocks are one text, as the daemon gets it.
    user = [{"role": "user", "content": QUESTION}]
    _check_anthropic_message(r.json(), daemon_answer(served, user), rendered_tokens(tokenizer, user))


def test_anthropic_multi_turn(served, http, tokenizer):
    turns = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": QUESTION},
    ]
    r = post_messages(http, {"messages": turns, "temperature": 0})
    assert r.status_code == 200, r.text
    _check_anthropic_message(r.json(), daemon_answer(served, turns), rendered_tokens(tokenizer, turns))


def test_anthropic_stream_event_sequence(served, http, tokenizer):
    body = {"model": "claude-sonnet-4-5", "max_tokens": N, "system": SYSTEM, "messages": CHAT[1:], "temperature": 0}
    with http.stream("POST", "/v1/messages", json=body | {"stream": True}, headers=ANTHROPIC_AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = anthropic_events(r)
    want = daemon_answer(served, CHAT)
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == []
    assert start["usage"]["input_tokens"] == rendered_tokens(tokenizer, CHAT)
    block = next(e for e in events if e["type"] == "content_block_start")
    assert block["index"] == 0 and block["content_block"] == {"type": "text", "text": ""}
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" for e in deltas)
    assert "".join(e["delta"]["text"] for e in deltas) == want.text
    assert next(e for e in events if e["type"] == "content_block_stop")["index"] == 0
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"]["stop_reason"] == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert end["usage"]["output_tokens"] == len(want.tokens) > 0
    assert "timings" not in events[-1]


def test_anthropic_count_tokens(http, tokenizer):
    for body, messages in (
        ({"messages": CHAT[1:]}, CHAT[1:]),
        ({"system": SYSTEM, "messages": CHAT[1:]}, CHAT),
    ):
        r = http.post("/v1/messages/count_tokens", json={"model": "claude-sonnet-4-5"} | body, headers=ANTHROPIC_AUTH)
        assert r.status_code == 200, r.text
        assert r.json() == {"input_tokens": rendered_tokens(tokenizer, messages)}  # no output_tokens, no max_tokens


def test_anthropic_tools_reach_the_template(served, http, tokenizer):
    """The demo model has not learnt to call tools: the check is that the tools are in
    the prompt (its counted tokens), the answer is the daemon's, and any tool_use block
    would be well formed (the shapes of a call are checked in tests/test_gateway_apis.py)."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = post_messages(http, {"messages": user, "tools": [TOOL], "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    want = daemon_answer(served, user, tools=[FUNCTION], tool_choice="auto")
    use = body["usage"]
    assert use["input_tokens"] + use["cache_read_input_tokens"] == rendered_tokens(tokenizer, user, [FUNCTION])
    assert rendered_tokens(tokenizer, user, [FUNCTION]) > rendered_tokens(tokenizer, user)
    assert body["content"] and use["output_tokens"] == len(want.tokens)
    calls = [b for b in body["content"] if b["type"] == "tool_use"]
    assert len(calls) == len(want.tool_calls)
    assert (body["stop_reason"] == "tool_use") == bool(calls)
    for b in calls:
        assert b["id"].startswith("toolu_") and b["name"] == "get_weather" and isinstance(b["input"], dict)


# The tool turn in Anthropic's shape: a tool_use block, then a user turn's tool_result.
ANTHROPIC_TOOL_TURN = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "test123", "name": "get_weather", "input": {"city": "Paris"}}],
    },
]
TOOL_CALLED = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
]


@pytest.mark.parametrize(
    "result, rendered",
    [
        pytest.param(
            [{"type": "tool_result", "tool_use_id": "test123", "content": "Sunny, 21 C"}],
            [{"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "test123"}],
            id="tool_result",
        ),
        pytest.param(
            [
                {"type": "tool_result", "tool_use_id": "test123", "content": "Sunny, 21 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
            [
                {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "test123"},
                {"role": "user", "content": "And tomorrow?"},
            ],
            id="tool_result_with_text",
        ),
        pytest.param(
            [{"type": "tool_result", "tool_use_id": "test123", "content": "no such city", "is_error": True}],
            [{"role": "tool", "content": "Error: no such city", "tool_call_id": "test123"}],
            id="tool_result_is_error",
        ),
    ],
)
def test_anthropic_tool_result(served, http, tokenizer, result, rendered):
    turns = [*ANTHROPIC_TOOL_TURN, {"role": "user", "content": result}]
    r = post_messages(http, {"messages": turns, "tools": [TOOL], "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    chat = TOOL_CALLED + rendered
    want = daemon_answer(served, chat, tools=[FUNCTION], tool_choice="auto")
    assert body["content"][0]["type"] == "text" and body["content"][0]["text"] == want.text
    use = body["usage"]
    assert use["input_tokens"] + use["cache_read_input_tokens"] == rendered_tokens(tokenizer, chat, [FUNCTION])


def test_anthropic_tool_streaming(served, http):
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": "m", "max_tokens": N, "messages": user, "tools": [TOOL], "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/messages", json=body, headers=ANTHROPIC_AUTH) as r:
        assert r.status_code == 200
        events = anthropic_events(r)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    for e in events:
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            assert isinstance(e["index"], int) and e["content_block"]["name"] == "get_weather"
    want = daemon_answer(served, user, tools=[FUNCTION], tool_choice="auto")
    assert sum(e["type"] == "content_block_start" for e in events) == bool(want.text) + len(want.tool_calls)


def test_anthropic_image_to_a_text_model_is_a_placeholder(served, http, tokenizer):
    """llama.cpp answers 500 "image input is not supported"; a model without vision reads
    a placeholder here (issue 61: Claude Code sends screenshots), answered with 200."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    content = [image, {"type": "text", "text": "What is in this image?"}]
    r = post_messages(http, {"messages": [{"role": "user", "content": content}], "temperature": 0})
    assert r.status_code == 200, r.text
    text = "[image (image/png): not shown, this model reads text only]What is in this image?"
    user = [{"role": "user", "content": text}]
    _check_anthropic_message(r.json(), daemon_answer(served, user), rendered_tokens(tokenizer, user))


@pytest.mark.parametrize(
    "fields",
    [
        {"stop_sequences": ["\n", "END"]},
        {"temperature": 0.5},
        {"top_p": 0.9},
        {"top_k": 40},
        {"metadata": {"user_id": "test_user_123"}},
        {"thinking": {"type": "enabled", "budget_tokens": 50}},
    ],
    ids=lambda f: next(iter(f)),
)
def test_anthropic_optional_fields_are_accepted(http, fields):
    r = post_messages(http, {"messages": [{"role": "user", "content": QUESTION}]} | fields)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"


def test_anthropic_stop_sequences_cut_the_answer(served, http):
    user = [{"role": "user", "content": QUESTION}]
    want = daemon_answer(served, user, max_tokens=N)
    stop = want.text[2:4]
    assert stop and stop in want.text
    r = post_messages(http, {"messages": user, "temperature": 0, "stop_sequences": [stop, "END"]})
    body = r.json()
    assert body["content"][0]["text"] == want.text[: want.text.index(stop)]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", stop)


@pytest.mark.parametrize(
    "body",
    [pytest.param({}, id="missing"), pytest.param({"messages": []}, id="empty")],
)
def test_anthropic_missing_or_empty_messages_is_a_400(http, body):
    """llama.cpp answers an empty list with 200; Anthropic's API refuses it, as we do."""
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": N} | body, headers=ANTHROPIC_AUTH)
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "messages" in error["error"]["message"]


@pytest.mark.parametrize(
    "messages",
    [
        "string",
        [123],
        [{}],
        [{"role": 123, "content": "Hi"}],
        [{"role": "user", "content": 123}],
        [{"role": "user", "content": [123]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}],
        [{"role": "user", "content": [{"type": "tool_result", "content": "no id"}]}],
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]}]}],
        [{"role": "user", "content": [{"type": "document", "source": {"type": "content", "content": 1}}]}],
    ],
    ids=[
        "string",
        "number",
        "empty_object",
        "role_number",
        "content_number",
        "block_number",
        "text_without_text",
        "tool_use_input",
        "tool_result_without_id",
        "tool_result_content",
        "document_content",
    ],
)
def test_anthropic_invalid_messages_are_a_400(http, messages):
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": N, "messages": messages}, headers=ANTHROPIC_AUTH)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and error["error"]["message"]


def test_anthropic_stream_block_indices(http):
    body = {"model": "m", "max_tokens": N, "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    with http.stream("POST", "/v1/messages", json=body | {"temperature": 0}, headers=ANTHROPIC_AUTH) as r:
        events = anthropic_events(r)
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == list(range(len(starts))) and stops == starts
    open_at: int | None = None
    for e in events:  # each delta belongs to the one open block
        if e["type"] == "content_block_start":
            assert open_at is None
            open_at = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_at
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_at
            open_at = None


def test_anthropic_and_openai_answer_the_same_prompt_each_in_its_shape(http, tokenizer):
    n = rendered_tokens(tokenizer, CHAT)
    chat = http.post(
        "/v1/chat/completions", json={"model": "m", "max_tokens": N, "messages": CHAT, "temperature": 0}, headers=AUTH
    ).json()
    assert chat["object"] == "chat.completion" and chat["choices"]
    assert chat["usage"]["prompt_tokens"] == n
    msg = post_messages(http, {"system": SYSTEM, "messages": CHAT[1:], "temperature": 0}).json()
    assert msg["type"] == "message" and msg["content"]
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == n
    assert msg["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert msg["content"][0]["text"] == chat["choices"][0]["message"]["content"]


# ---- the thinking check (llama.cpp's needs a real reasoning model: ours is tiny) ------------


@pytest.fixture(scope="module")
def thinking_served():
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mpt"))
    try:
        with served_gateway(make_thinking_store(root), "mpk", KEY) as both:
            yield both
    finally:
        shutil.rmtree(root)


def test_anthropic_thinking_blocks_have_signatures(thinking_served):
    """Non-streamed: a thinking block (text and `signature`) then a text block; streamed:
    a thinking block at index 0 (thinking_delta events, then a signature_delta before it
    closes), then the text block at index 1; the `anthropic` package folds the stream
    into the same content."""
    paths, gateway = thinking_served
    want = daemon_answer(thinking_served, THINKING_CHAT, max_tokens=24)
    assert want.reasoning and want.text and THINK_END not in want.text
    body = {
        "model": "claude-opus-4-1",
        "max_tokens": 24,
        "system": THINKING_CHAT[0]["content"],
        "messages": THINKING_CHAT[1:],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "temperature": 0,
    }
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        message = http.post("/v1/messages", json=body, headers=ANTHROPIC_AUTH).json()
        assert message["content"] == [
            {"type": "thinking", "thinking": want.reasoning, "signature": anth.signature(want.reasoning)},
            {"type": "text", "text": want.text},
        ]
        with http.stream("POST", "/v1/messages", json=body | {"stream": True}, headers=ANTHROPIC_AUTH) as r:
            events = [e for e in anthropic_events(r) if e["type"].startswith("content_block")]
    assert events[0] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
    }
    first_stop = next(i for i, e in enumerate(events) if e["type"] == "content_block_stop")
    thinking = events[1:first_stop]
    assert [e["delta"]["type"] for e in thinking[:-1]] == ["thinking_delta"] * (len(thinking) - 1)
    assert "".join(e["delta"]["thinking"] for e in thinking[:-1]) == want.reasoning
    assert thinking[-1]["delta"] == {"type": "signature_delta", "signature": anth.signature(want.reasoning)}
    assert events[first_stop]["index"] == 0
    assert events[first_stop + 1]["content_block"] == {"type": "text", "text": ""}
    assert events[first_stop + 1]["index"] == 1 and events[-1] == {"type": "content_block_stop", "index": 1}
    claude = anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=120)
    args = {k: v for k, v in body.items() if k != "temperature"}
    with claude.messages.stream(**args, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == message["content"]


# ---- llama.cpp: test_compat_oai_responses.py -----------------------------------------------


@pytest.mark.parametrize(
    "fmt, status",
    [
        pytest.param({"type": "text"}, 200, id="text"),
        pytest.param({"type": "json_schema", "name": "foo"}, 400, id="json_schema_without_schema"),
    ],
)
def test_responses_text_format(http, fmt, status):
    body = {"model": "m", "input": QUESTION, "max_output_tokens": N, "temperature": 0, "text": {"format": fmt}}
    r = http.post("/v1/responses", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        assert error["message"] and error["param"] == "text.format"


@pytest.mark.parametrize(
    "fmt, want",
    [
        pytest.param({"type": "json_schema", "name": "foo", "schema": {"const": "foooooo"}}, "foooooo", id="const"),
        pytest.param({"type": "json_object"}, None, id="json_object"),
    ],
)
def test_responses_text_format_gives_that_json(http, fmt, want):
    """The demo model has learnt no JSON: what it writes is JSON because the daemon's
    grammar allows nothing else; the budget lets a JSON object end."""
    body = {"model": "m", "input": QUESTION, "max_output_tokens": JSON_BUDGET, "temperature": 0}
    r = http.post("/v1/responses", json=body | {"text": {"format": fmt}}, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "completed", out
    answer = json.loads(out["output"][-1]["content"][0]["text"])
    assert answer == want if want is not None else isinstance(answer, dict)


def test_responses_ids_and_output_text(served, oa):
    """The peer samples at temperature 0.8; greedy here, so that the text is the daemon's."""
    res = oa.responses.create(
        model="gpt-4.1",
        input=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_output_tokens=N,
        temperature=0,
    )
    want = daemon_answer(served, CHAT)
    assert res.id.startswith("resp_") and res.model == "gpt-4.1"
    assert [item.type for item in res.output] == ["message"] and res.output[0].id.startswith("msg_")
    assert res.output_text == want.text and res.usage.output_tokens == len(want.tokens)


def test_responses_stream_ids_are_consistent(served, oa, tokenizer):
    events = list(
        oa.responses.create(
            model="gpt-4.1",
            input=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            max_output_tokens=N,
            temperature=0,
            stream=True,
        )
    )
    by_type: dict[str, list[Any]] = {}
    for e in events:
        by_type.setdefault(e.type, []).append(e)
    rid = by_type["response.created"][0].response.id
    assert rid.startswith("resp_") and by_type["response.in_progress"][0].response.id == rid
    item_id = by_type["response.output_item.added"][0].item.id
    assert item_id.startswith("msg_")
    for kind in (
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
    ):
        assert by_type[kind] and all(e.item_id == item_id for e in by_type[kind]), kind
    assert by_type["response.output_item.done"][0].item.id == item_id
    last = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and last.id == rid
    text = "".join(e.delta for e in by_type["response.output_text.delta"])
    assert text == last.output_text == daemon_answer(served, CHAT).text
    assert last.output[0].id == item_id and last.usage.input_tokens == rendered_tokens(tokenizer, CHAT)


# ---- llama.cpp: test_chat_completion.py ----------------------------------------------------


@pytest.mark.parametrize(
    "path, model, user",
    [
        pytest.param("/v1/chat/completions", "gpt-3.5-turbo", QUESTION, id="named_model"),
        pytest.param("/chat/completions", "gpt-3.5-turbo", QUESTION, id="without_v1"),
        pytest.param("/v1/chat/completions", None, QUESTION, id="no_model"),
        pytest.param("/v1/chat/completions", "anything", [{"type": "text", "text": QUESTION}], id="text_parts"),
    ],
)
def test_chat_completion_shape_and_usage(served, http, tokenizer, path, model, user):
    body = {"max_tokens": N, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    r = http.post(path, json=body | {"temperature": 0} | ({"model": model} if model else {}))
    assert r.status_code == 200, r.text
    out = r.json()
    want = daemon_answer(served, CHAT)
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["model"] == (model or "moestream-demo")
    assert isinstance(out.get("system_fingerprint", ""), str)
    assert out["usage"]["prompt_tokens"] == rendered_tokens(tokenizer, CHAT)
    assert out["usage"]["completion_tokens"] == len(want.tokens)
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == ("length" if want.finish_reason == "length" else "stop")


def test_chat_completion_stream_chunk_shape(served, http, tokenizer):
    body = {"model": "gpt-3.5-turbo", "max_tokens": N, "messages": CHAT, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body | {"stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        chunks = openai_chunks(r)
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    want = daemon_answer(served, CHAT)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["model"] for c in chunks} == {"gpt-3.5-turbo"}
    # The first carries the role; content "" as OpenAI's own API sends it (llama.cpp: null).
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *texts, finish, last = chunks[1:]
    for c in texts:
        assert "role" not in c["choices"][0]["delta"] and c["choices"][0]["finish_reason"] is None
    assert "".join(c["choices"][0]["delta"]["content"] for c in texts) == want.text
    assert finish["choices"][0]["delta"] == {}  # no content in the finish chunk
    assert finish["choices"][0]["finish_reason"] == ("length" if want.finish_reason == "length" else "stop")
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == rendered_tokens(tokenizer, CHAT)
    assert last["usage"]["completion_tokens"] == len(want.tokens)


def test_chat_completion_with_openai_client_and_a_seed(oa):
    args = dict(model="gpt-3.5-turbo-instruct", messages=CHAT, max_tokens=N, seed=42, temperature=0.8)
    first = oa.chat.completions.create(**args)
    choice = first.choices[0]
    assert choice.message.content is not None
    assert choice.finish_reason in ("length", "stop") and first.usage.completion_tokens <= N
    assert choice.finish_reason == "stop" or first.usage.completion_tokens == N
    assert oa.chat.completions.create(**args).choices[0].message.content == choice.message.content


@pytest.mark.parametrize(
    "last",
    [
        pytest.param("The answer is", id="string"),
        pytest.param([{"type": "text", "text": "The answer"}, {"type": "text", "text": " is"}], id="text_parts"),
    ],
)
def test_chat_completion_trailing_assistant_message(served, http, tokenizer, last):
    """A last assistant message is rendered as a finished turn and the answer is a new
    one, as mlx-lm's server does (its template call always adds the generation prompt);
    llama.cpp and Anthropic's API continue it instead (prefill). Deliberate: see
    tests/data/peer_suites.md."""
    messages = [*CHAT, {"role": "assistant", "content": last}]
    r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": N, "messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    chat = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    assert r.json()["usage"]["prompt_tokens"] == rendered_tokens(tokenizer, chat)
    assert r.json()["choices"][0]["message"]["content"] == daemon_answer(served, chat).text


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param({"type": "sound"}, id="unknown_type"),
        pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": 123}}, id="schema_not_object"),
        pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 123}}}, id="type_123"),
        pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "hiccup"}}}, id="hiccup"),
    ],
)
def test_chat_completion_invalid_response_format_is_a_400(http, fmt):
    body = {"model": "m", "max_tokens": N, "messages": CHAT, "response_format": fmt}
    r = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    # The gateway names the field it refused; a schema only the daemon's grammar compiler
    # refuses comes back with the compiler's reason.
    assert (error["param"] or "response_format").startswith("response_format"), error
    assert "schema" in error["message"] or "response_format" in error["message"], error


@pytest.mark.parametrize(
    "fmt, schema",
    [
        pytest.param({"type": "json_object"}, {"type": "object"}, id="json_object"),
        pytest.param(
            {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": "foooooo"}}},
            {"const": "foooooo"},
            id="json_schema_const",
        ),
        pytest.param(
            {"type": "json_schema", "json_schema": {"name": "o", "schema": SMALL_SCHEMA, "strict": True}},
            SMALL_SCHEMA,
            id="json_schema_object",
        ),
    ],
)
def test_chat_completion_response_format_constrains_the_answer(http, fmt, schema):
    body = {"model": "m", "max_tokens": JSON_BUDGET, "messages": CHAT, "temperature": 0, "response_format": fmt}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def _check_logprobs(entries: list[Any], content: str) -> None:
    assert entries and "".join(e.token for e in entries) == content
    for e in entries:
        assert e.logprob <= 0 and e.bytes is not None and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 10 and e.top_logprobs[0].logprob == e.logprob  # greedy: the likeliest
        assert all(t.logprob <= 0 and t.bytes is not None for t in e.top_logprobs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completion_logprobs_with_the_openai_client(served, oa, stream):
    args = dict(model="gpt-4o", messages=CHAT, max_tokens=N, temperature=0, logprobs=True, top_logprobs=10)
    want = daemon_answer(served, CHAT).text
    if not stream:
        choice = oa.chat.completions.create(**args).choices[0]
        assert choice.message.content == want
        _check_logprobs(choice.logprobs.content, want)
        return
    chunks = [c for c in oa.chat.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    _check_logprobs([e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content], want)


def test_chat_completion_logit_bias_keeps_the_greedy_tokens_out(served, oa, tokenizer):
    """The peer bans the tokens of a phrase (its /tokenize: the demo tokenizer here), those
    of the greedy answer, which then never comes back."""
    greedy = daemon_answer(served, CHAT)
    banned = sorted(set(tokenizer.encode(greedy.text, add_special_tokens=False)))
    out = oa.chat.completions.create(
        model="m", messages=CHAT, max_tokens=N, temperature=0, logit_bias={str(t): -100 for t in banned}
    )
    biased = daemon_answer(served, CHAT, sampling=SamplingControls(logit_bias=tuple((t, -100.0) for t in banned)))
    assert out.choices[0].message.content == biased.text != greedy.text
    assert biased.tokens and not set(biased.tokens) & set(banned)


def test_chat_completion_n_2(served, oa):
    out = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=N, temperature=0, n=2)
    want = daemon_answer(served, CHAT)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.finish_reason == ("length" if want.finish_reason == "length" else "stop")
        assert c.message.content == want.text
    assert out.usage.completion_tokens == 2 * len(want.tokens)


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "string",
        [123],
        [{}],
        [{"role": 123}],
        [{"role": "system", "content": 123}],
        [{"role": "system", "content": "test"}, {}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
    ],
    ids=["none", "string", "number", "empty_object", "role_number", "content_number", "second_empty", "part", "args"],
)
def test_chat_completion_invalid_messages_are_a_400(http, messages):
    r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": N, "messages": messages}, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"].startswith("messages")


def test_chat_completion_two_assistant_messages_in_a_row_are_the_templates_to_take(served, http, tokenizer):
    """llama.cpp's last invalid case depends on its template; the demo's ChatML renders it."""
    messages = [*CHAT, {"role": "assistant", "content": "Hi."}, {"role": "assistant", "content": "Again."}]
    r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": messages})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == rendered_tokens(tokenizer, messages)


@pytest.fixture(scope="module")
def over_the_context(oa, tokenizer) -> list[dict[str, str]]:
    """A chat past the daemon's context: the peer's messages repeated 100 times, each
    question long enough."""
    context = oa.models.list().data[0].context_length
    user = {"role": "user", "content": " ".join([QUESTION] * (context // 200 + 1))}
    messages = [CHAT[0], *[user] * 100]
    assert rendered_tokens(tokenizer, messages) > context
    return messages


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completion_context_exceeded_is_a_400_before_any_byte(http, over_the_context, stream):
    body = {"model": "m", "max_tokens": N, "messages": over_the_context, "stream": stream}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        error = json.loads(r.read())["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    messages = [{"role": m["role"], "content": m["content"]} for m in over_the_context]
    with http.stream("POST", "/v1/messages", json=body | {"messages": messages}, headers=ANTHROPIC_AUTH) as r:
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        assert json.loads(r.read())["error"]["type"] == "invalid_request_error"


# ---- llama.cpp: test_tool_call.py --------------------------------------------------------


def test_tool_call_tools_offered_without_tool_choice(served, oa, tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = oa.chat.completions.create(model="m", messages=messages, tools=[FUNCTION], max_tokens=N, temperature=0)
    want = daemon_answer(served, messages, tools=[FUNCTION], tool_choice="auto")
    message = out.choices[0].message
    assert message.content == (want.text or None) and len(message.tool_calls or []) == len(want.tool_calls)
    assert out.usage.prompt_tokens == rendered_tokens(tokenizer, messages, [FUNCTION])


def _folded(oa: openai.OpenAI, stream: bool, **args: Any) -> Any:
    """The answer's message, streamed chunks folded by the `openai` package's own helper."""
    if not stream:
        return oa.chat.completions.create(**args).choices[0].message
    with oa.chat.completions.stream(**args) as s:
        return s.get_final_completion().choices[0].message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_required_is_exactly_one_call_of_the_offered_tool(oa, stream):
    """The demo has not learnt tool calls: the daemon's grammar writes the one call."""
    message = _folded(
        oa,
        stream,
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[FUNCTION],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=JSON_BUDGET,
        temperature=0,
    )
    assert message.content in (None, "")
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, TOOL["input_schema"])
    assert isinstance(arguments["city"], str)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_none_writes_no_call(oa, stream):
    # The prompt ends inside the call markup's start: unconstrained, the demo goes on writing it.
    ask = [{"role": "user", "content": "Call get_weather for Paris. Reply with <tool_call>"}]
    args = dict(model="m", messages=ask, tools=[FUNCTION], max_tokens=2 * N, temperature=0)
    if stream:  # the package's fold refuses an answer cut at max_tokens: the chunks by hand
        chunks = [
            c.choices[0] for c in oa.chat.completions.create(**args, tool_choice="none", stream=True) if c.choices
        ]
        assert not any(c.delta.tool_calls for c in chunks)
        content = "".join(c.delta.content or "" for c in chunks)
    else:
        message = oa.chat.completions.create(**args, tool_choice="none").choices[0].message
        assert not message.tool_calls
        content = message.content
        free = oa.chat.completions.create(**args).choices[0].message  # unconstrained, it writes a call
        assert free.tool_calls or "<tool_call>" in (free.content or "")
    assert content and "<tool_call>" not in content and "</tool_call>" not in content


def test_tool_call_history_with_null_content_and_a_tool_message(served, oa, tokenizer):
    out = oa.chat.completions.create(model="m", messages=TOOL_TURN, tools=[FUNCTION], max_tokens=N, temperature=0)
    chat = [
        TOOL_CALLED[0],
        TOOL_CALLED[1],
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1", "name": "get_weather"},
    ]
    want = daemon_answer(served, chat, tools=[FUNCTION], tool_choice="auto")
    assert out.choices[0].message.content == want.text
    assert out.usage.prompt_tokens == rendered_tokens(tokenizer, chat, [FUNCTION])
    assert "Sunny, 21 C" in render_chat(tokenizer, chat, [FUNCTION])


def test_tool_call_streamed_answer_folds_into_the_same_message(oa):
    args = dict(model="m", messages=TOOL_TURN, tools=[FUNCTION], max_tokens=N, temperature=0)
    whole = oa.chat.completions.create(**args).choices[0].message
    chunks = list(oa.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices) and not whole.tool_calls


# ---- mlx-lm: tests/test_server.py --------------------------------------------------------


def test_mlx_lm_completions_repeat_with_a_seed(http):
    body = {
        "model": "default_model",
        "prompt": "Once upon a time",
        "max_tokens": 10,
        "temperature": 0.5,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "repetition_context_size": 20,
        "seed": 999,
        "stop": "stop sequence",
    }
    first = http.post("/v1/completions", json=body, headers=AUTH).json()
    assert first["id"].startswith("cmpl-") and first["object"] == "text_completion" and first["choices"]
    assert first["usage"]["completion_tokens"] > 0
    again = http.post("/v1/completions", json=body, headers=AUTH).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param(CHAT, id="plain"),
        pytest.param(
            [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
            ],
            id="content_fragments",
        ),
    ],
)
def test_mlx_lm_chat_completions(served, http, tokenizer, messages):
    sampling = {"temperature": 0.7, "top_p": 0.85, "repetition_penalty": 1.2}
    r = http.post(
        "/v1/chat/completions", json={"model": "chat_model", "max_tokens": 10, "messages": messages} | sampling
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] == rendered_tokens(tokenizer, CHAT) and out["usage"]["completion_tokens"] > 0


def test_mlx_lm_chat_completions_with_null_tool_content(http, tokenizer):
    messages = [
        {"role": "user", "content": "what is 2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "id": "123", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "content": "5", "tool_call_id": "123"},
    ]
    r = http.post("/v1/chat/completions", json={"model": "chat_model", "max_tokens": 10, "messages": messages})
    assert r.status_code == 200, r.text
    chat = [
        messages[0],
        {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"role": "tool", "content": "5", "tool_call_id": "123"},
    ]
    assert r.json()["usage"]["prompt_tokens"] == rendered_tokens(tokenizer, chat)


def test_mlx_lm_models(http):
    r = http.get("/v1/models", headers=AUTH)
    assert r.status_code == 200
    listing = r.json()
    assert listing["object"] == "list" and len(listing["data"]) == 1
    model = listing["data"][0]
    assert model["id"] == "moestream-demo" and model["object"] == "model" and isinstance(model["created"], int)


def test_mlx_lm_streaming_chunks_have_one_choice_with_a_delta(http):
    body = {"model": "chat_model", "max_tokens": 10, "temperature": 0.0, "stream": True, "messages": CHAT}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [c for c in openai_chunks(r) if c != "[DONE]"]
    assert len(chunks) > 2
    assert all(len(c["choices"]) == 1 and "delta" in c["choices"][0] for c in chunks)


def test_mlx_lm_prompt_cache_through_the_server(served, http, tokenizer):
    """Two chats with one start: the second reads the first's prompt from the daemon's
    prompt cache (usage says how much) and answers as without it."""
    first = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a story about"},
    ]
    second = [first[0], {"role": "user", "content": "Tell me a story about dragons."}]
    answers = []
    for messages in (first, second):
        r = http.post(
            "/v1/chat/completions", json={"model": "m", "max_tokens": 5, "temperature": 0, "messages": messages}
        )
        assert r.status_code == 200, r.text
        answers.append(r.json())
    a, b = (tokenizer.encode(render_chat(tokenizer, m), add_special_tokens=False) for m in (first, second))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    cached = answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= shared
    for out, messages in zip(answers, (first, second)):
        assert out["choices"][0]["message"]["content"] == daemon_answer(served, messages, max_tokens=5).text


def test_mlx_lm_repetition_context_size_is_the_penalty_window(served, http):
    """mlx-lm's server's `repetition_context_size` (its completions test sends it) is the
    window of the daemon's penalties: the answer is the daemon's for that window, not
    the default 20's. mlx-lm gives each penalty its own window; the daemon's penalties
    share one, so windows that differ are a 400 rather than a different answer."""
    # A question whose answer repeats tokens further apart than 2 (CHAT's answer repeats none).
    chat = [{"role": "user", "content": "Show an example of a for loop in Python."}]
    body = {"model": "m", "messages": chat, "max_tokens": 2 * N, "temperature": 0, "repetition_penalty": 1.5}
    answers = {}
    for window in (2, 20):
        r = http.post("/v1/chat/completions", json=body | {"repetition_context_size": window})
        assert r.status_code == 200, r.text
        answers[window] = r.json()["choices"][0]["message"]["content"]
        controls = SamplingControls(repetition_penalty=1.5, penalty_window=window)
        assert answers[window] == daemon_answer(served, chat, max_tokens=2 * N, sampling=controls).text
    assert answers[2] != answers[20]
    r = http.post("/v1/chat/completions", json=body | {"repetition_context_size": 2, "presence_penalty": 0.5})
    assert r.status_code == 400 and "same context size" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "repetition_context_size"
    r = http.post("/v1/completions", json={"prompt": "x", "repetition_penalty": 1.1, "repetition_context_size": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_context_size"
