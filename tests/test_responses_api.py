"""OpenAI's Responses API (`POST /v1/responses`, Codex CLI's only API) through the gateway.

Without a daemon: Codex-shaped requests (tests/data/codex) become the chat the template
renders, and scripted daemon events (reasoning, text, a function call, a free-form tool's
call; the daemon's own events as a thinking model that calls tools sends them) come back
as the stream and the Response the real `openai` package folds them into, through its
own HTTP client (an httpx transport that answers with the gateway's code).

Through a real daemon on the demo model and the gateway as its own process, with the
real `openai` package: a Codex-shaped turn whose call is forced by `tool_choice`, the next
turn carrying its `function_call_output` or `custom_tool_call_output`, non-streaming,
`max_output_tokens` cutting the answer, and bad input answered with OpenAI's 400s.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from test_openai_gateway import served_gateway

from moestream.client.gateway.app import GatewayConfig
from moestream.client.gateway.daemon_link import Gateway as App
from moestream.client.gateway.openai import ApiError
from moestream.client.gateway.responses import DEFAULT_MAX_OUTPUT_TOKENS, Fold, ResponsesApi, parse_request
from moestream.shared import protocol as proto
from moestream.shared.protocol import Accepted, Done, Token, ToolCall
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.settings import demo_store_path
from moestream.shared.status import RequestStats

DATA = Path(__file__).parent / "data" / "codex"
KEY = "sk-responses-0123456789"
PATCH = '*** Begin Patch\n*** Update File: hello.py\n@@\n-print("hi")\n+print("hello")\n*** End Patch\n'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "strict": False,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def codex(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


# ---- without a daemon -------------------------------------------------------------------


def test_codex_requests_become_the_chat_the_template_renders():
    body = codex("first_turn")
    first = parse_request(body)
    g = first.api.generate
    developer = body["input"][0]["content"][0]["text"]
    # The instructions and the leading developer message: one system message, first.
    assert g["messages"][0] == {"role": "system", "content": body["instructions"] + "\n\n" + developer}
    assert [m["role"] for m in g["messages"]] == ["system", "user", "user", "user"]
    assert g["messages"][-1]["content"] == "What does zip do?"
    # web_search is a built-in tool this server does not run: left out.
    assert [t["function"]["name"] for t in g["tools"]] == ["shell", "update_plan", "apply_patch"]
    assert g["tools"][0]["function"]["parameters"] == body["tools"][0]["parameters"]
    patch = g["tools"][2]["function"]
    assert patch["description"] == body["tools"][2]["description"] and patch["parameters"]["required"] == ["input"]
    assert body["tools"][2]["format"]["definition"] in patch["parameters"]["properties"]["input"]["description"]
    assert first.custom_tools == {"apply_patch"} and first.summary and g["thinking"] is True
    assert g["tool_choice"] == "auto" and g["max_tokens"] == DEFAULT_MAX_OUTPUT_TOKENS and first.api.stream
    assert first.echo["tools"] == body["tools"][:3] and first.echo["prompt_cache_key"] == body["prompt_cache_key"]

    messages = parse_request(codex("function_call_output_turn")).api.generate["messages"]
    call = {"name": "shell", "arguments": {"command": ["bash", "-lc", "ls"], "workdir": "/home/user/project"}}
    assert messages[-3]["content"] == "List the files in this project."  # the reasoning item left no trace
    assert messages[-2] == {"role": "assistant", "content": "", "tool_calls": [call]}
    output = codex("function_call_output_turn")["input"][-1]
    result = {"role": "tool", "content": output["output"], "tool_call_id": output["call_id"], "name": "shell"}
    assert messages[-1] == result

    messages = parse_request(codex("custom_tool_call_output_turn")).api.generate["messages"]
    calls = [{"name": "apply_patch", "arguments": {"input": PATCH}}]
    assert messages[-2] == {"role": "assistant", "content": "I'll edit hello.py.", "tool_calls": calls}
    assert messages[-1]["role"] == "tool" and messages[-1]["name"] == "apply_patch"
    assert messages[-1]["content"].startswith('{"output": "Success.')


def test_tool_choice_reasoning_and_the_fields_accepted_or_refused():
    body = codex("first_turn") | {"tools": codex("first_turn")["tools"] + [WEATHER]}

    def generate(**fields) -> dict:
        return parse_request(body | fields).api.generate

    assert generate(tool_choice={"type": "function", "name": "shell"})["tool_choice"] == {"name": "shell"}
    assert generate(tool_choice={"type": "custom", "name": "apply_patch"})["tool_choice"] == {"name": "apply_patch"}
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    only = generate(tool_choice=allowed)
    assert only["tool_choice"] == "required" and [t["function"]["name"] for t in only["tools"]] == ["get_weather"]
    assert generate(reasoning={"effort": "minimal"})["thinking"] is False
    assert generate(reasoning={"effort": "high"})["thinking"] is True and "thinking" not in generate(reasoning=None)
    assert not parse_request(body | {"reasoning": {"effort": "low"}}).summary
    assert generate(input="Hi", instructions=None)["messages"] == [{"role": "user", "content": "Hi"}]
    harmless = {
        "store": True,
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
        "parallel_tool_calls": True,
        "prompt_cache_key": "k",
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "truncation": "auto",
        "metadata": {"a": "b"},
        "user": "u",
        "safety_identifier": "s",
        "service_tier": "auto",
        "max_tool_calls": 3,
        "stream_options": {"include_obfuscation": False},
        "max_output_tokens": 100,
        "temperature": 0.5,
        "top_p": 0.9,
    }
    assert generate(**harmless)["max_tokens"] == 100

    refused = [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"conversation": "conv_1"}, "conversation", "keeps no conversations"),
        ({"background": True}, "background", "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "stored prompts"),
        ({"top_logprobs": 21}, "top_logprobs", "whole number in 0..20"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs 'schema'"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "keeps no items"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]", "'web_search_call'"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "one of"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
            "input[0].content[0].image_url",
            "data URL",
        ),
        ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{"}]}, None, "not valid JSON"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", "output"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, None, "'nope'"),
        ({"tool_choice": {"type": "web_search_preview"}}, None, "built-in tool type"),
        ({"tool_choice": "required", "tools": [{"type": "web_search"}]}, "tool_choice", "needs function"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
        ({"tools": [{"type": "custom", "name": "x", "format": {"type": "regex"}}]}, "tools", "format"),
        ({"reasoning": {"effort": "enormous"}}, "reasoning.effort", "effort"),
        ({"max_output_tokens": 0}, "max_output_tokens", "whole number"),
        ({"temperature": 3}, "temperature", "number"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"model": 5}, "model", "string"),
    ]
    for fields, param, words in refused:
        with pytest.raises(ApiError) as info:
            parse_request(body | fields)
        e = info.value
        assert e.status == 400 and words.lower() in e.message.lower(), (fields, e.message)
        if param is not None:
            assert e.param == param, (fields, e.param)


def _script(rid: str, *, cut: bool = False) -> list:
    """A thinking model's events: reasoning, text, a function call, a free-form tool's call."""
    patch = json.dumps({"input": PATCH})
    stats = RequestStats(prompt_tokens=9, cached_tokens=4)
    calls = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "apply_patch", "arguments": patch}]
    return [
        Accepted(rid, 9),
        proto.Progress(rid, 9, 9),
        Token(rid, "Think", 1, reasoning=True),
        Token(rid, " more.", 2, reasoning=True),
        Token(rid, "Let me look.", 3),
        Token(rid, "", 4),  # a token of the call's text, held in the daemon
        ToolCall(rid, 0, calls[0]["name"], calls[0]["arguments"]),
        ToolCall(rid, 1, calls[1]["name"], calls[1]["arguments"]),
        Done(
            rid, "Let me look.", [1, 2, 3, 4, 5, 6], "length" if cut else "stop", stats, calls, reasoning="Think more."
        ),
    ]


class _Scripted:
    """A daemon request whose events are given (the gateway's request thread's side)."""

    def __init__(self, events: list) -> None:
        self.id = "resp_scripted"
        self._events = list(events)

    async def next(self):
        return self._events.pop(0)


def _served_by(tmp_path: Path, script) -> openai.OpenAI:
    """The real `openai` client, its requests answered by the gateway's Responses code over
    `script(rid)`'s daemon events (no daemon, no server: an httpx transport)."""
    app = App(GatewayConfig(paths=RuntimePaths(dir=tmp_path, log=tmp_path / "log"), demo_store_id=None))
    api = ResponsesApi(app)

    def handle(request: httpx.Request) -> httpx.Response:
        try:
            req = parse_request(json.loads(request.content))
        except ApiError as e:
            return httpx.Response(e.status, json=e.body())
        daemon = _Scripted(script("resp_scripted"))
        fold = Fold(daemon.id, "moestream-demo", req)
        if not req.api.stream:
            for event in daemon._events:
                fold.feed(event)
            return httpx.Response(200, json=fold.final)

        async def body() -> str:
            head = await daemon.next()
            return "".join([piece async for piece in api._stream(daemon, fold, head)])

        sse = asyncio.run(body())
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    http = httpx.Client(transport=httpx.MockTransport(handle))
    return openai.OpenAI(base_url="http://gateway.test/v1", api_key="unused", http_client=http, max_retries=0)


CODEX_TOOLS = [WEATHER, codex("first_turn")["tools"][2]]  # a function and the free-form apply_patch


def test_a_streamed_answer_is_what_the_openai_package_folds_into_its_response(tmp_path):
    client = _served_by(tmp_path, _script)
    args = dict(model="moestream-demo", input="Weather in Paris, then fix hello.py", tools=CODEX_TOOLS)
    events = list(client.responses.create(**args, stream=True))
    for e in events:  # each one of the package's own event types, strictly
        _EVENTS.validate_python(e.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item = ("response.output_item.added", "response.content_part.added")
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        *item,
        *["response.reasoning_text.delta"] * 2,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *item,
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]

    with client.responses.stream(**args) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas == ["Let me look."]
    Response.model_validate(final.to_dict())
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "custom_tool_call"]
    reasoning, message, call, custom = final.output
    assert reasoning.content[0].text == "Think more." and reasoning.summary == []
    assert final.output_text == "Let me look." and message.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert custom.name == "apply_patch" and custom.input == PATCH and custom.call_id != call.call_id
    usage = final.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (9, 6, 15)
    assert usage.input_tokens_details.cached_tokens == 4 and usage.output_tokens_details.reasoning_tokens == 2
    assert final.status == "completed" and final.model == "moestream-demo" and final.id == "resp_scripted"

    # Asked for a summary (as Codex does), the reasoning comes as one: there is no other to give.
    with client.responses.stream(**args, reasoning={"effort": "medium", "summary": "auto"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_summary_text.delta" in kinds and "response.reasoning_text.delta" not in kinds
    assert kinds.index("response.reasoning_summary_part.added") < kinds.index("response.reasoning_summary_text.delta")
    assert final.output[0].summary[0].text == "Think more." and not final.output[0].content

    whole = client.responses.create(**args)
    Response.model_validate(whole.to_dict())
    assert [i.type for i in whole.output] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert whole.output_text == "Let me look." and whole.output[3].input == PATCH
    assert whole.usage.output_tokens_details.reasoning_tokens == 2


def test_cut_failed_and_held_back_answers(tmp_path):
    # max_output_tokens reached: response.incomplete, as OpenAI ends such a stream.
    cut = _served_by(tmp_path, lambda rid: _script(rid, cut=True))
    events = list(cut.responses.create(model="m", input="x", tools=CODEX_TOOLS, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens" and last.response.usage.output_tokens == 6
    whole = cut.responses.create(model="m", input="x", tools=CODEX_TOOLS)
    assert whole.status == "incomplete" and whole.output[-1].type == "custom_tool_call"

    # Text the daemon held back (a start of a call marker that was not one) comes with done.
    held = _served_by(
        tmp_path, lambda rid: [Token(rid, "Let me", 1), Done(rid, "Let me look.", [1, 2], "stop", RequestStats())]
    )
    with held.responses.stream(model="m", input="x") as stream:
        assert stream.get_final_response().output_text == "Let me look."

    # Nothing said: still one (empty) assistant message.
    empty = _served_by(tmp_path, lambda rid: [Done(rid, "", [], "stop", RequestStats(prompt_tokens=3))])
    out = empty.responses.create(model="m", input="x")
    assert [i.type for i in out.output] == ["message"] and out.output_text == ""

    # The daemon shut down after the stream began: response.failed with the reason.
    gone = _served_by(tmp_path, lambda rid: [Token(rid, "Hi", 1), Done(rid, "Hi", [1], "shutdown", RequestStats())])
    events = list(gone.responses.create(model="m", input="x", stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "server_error"
    assert "shut down" in events[-1].response.error.message
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"

    # Bad input: the client's own error for a 400.
    with pytest.raises(openai.BadRequestError) as info:
        gone.responses.create(model="m", input="x", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id" and "keeps no responses" in info.value.message


# ---- through the daemon ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """The gateway (with an API key) in front of a daemon serving the demo model."""
    with served_gateway(demo_store_path(), "msr", KEY) as both:
        yield both


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0, timeout=600)


def short_codex(question: str, **fields) -> dict:
    """Codex's first request (tests/data/codex) cut to what a 10M demo model can still
    follow: its instructions' first sentence, the user's question, and of its tools the
    free-form `apply_patch` (its grammar) and `web_search`, after the demo's `get_weather`
    (a function, as Codex lists an MCP server's tools). Greedy; each test says whether
    it streams."""
    body = codex("first_turn")
    patch, web_search = body["tools"][2:]
    body |= {
        "instructions": body["instructions"].split(". ")[0] + ".",
        "input": [user(question)],
        "tools": [WEATHER, patch, web_search],
        "temperature": 0,
        "max_output_tokens": 96,
    }
    del body["stream"]
    return body | fields


def as_input(item) -> dict:
    """An output item as Codex sends it back in the next turn's input."""
    return item.to_dict(exclude_none=True)


def test_a_codex_turn_calls_a_function_and_the_next_carries_its_output(served, client):
    from mlx_lm.utils import load_tokenizer

    from moestream.daemon.model.generation import render_chat

    body = short_codex("What is the weather in Paris?", tool_choice={"type": "function", "name": "get_weather"})
    with client.responses.stream(**body) as stream:
        events = list(stream)
        first = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", first.output
    assert isinstance(json.loads(calls[0].arguments), dict)
    assert "tools of type web_search skipped" in served[1].log.read_text()  # the built-in tool, noted
    # What reached the template: the chat parse_request made, with the forced call's start.
    req = parse_request(body)
    g = req.api.generate
    tokenizer = load_tokenizer(demo_store_path())
    prompt = render_chat(tokenizer, g["messages"], g["tools"], g["tool_choice"])
    assert first.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    use = first.usage
    assert use.output_tokens > 0 and use.total_tokens == use.input_tokens + use.output_tokens

    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}
    turn = body | {"input": body["input"] + [as_input(i) for i in first.output] + [output], "tool_choice": "auto"}
    events = list(client.responses.create(**turn, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    second = events[-1].response
    assert second.output and second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the daemon's prompt cache served the prefix

    # The same turn, not streamed, greedy: the same answer.
    whole = client.responses.create(**turn)
    assert whole.status == second.status and [i.type for i in whole.output] == [i.type for i in second.output]
    assert whole.output_text == second.output_text


def test_a_free_form_tools_call_and_the_turn_with_its_output(served, client):
    body = short_codex("What is the weather in Paris?", tool_choice={"type": "custom", "name": "apply_patch"})
    first = client.responses.create(**body)
    calls = [i for i in first.output if i.type == "custom_tool_call"]
    # The demo has not learnt patches: its input is whatever it wrote as the one argument.
    assert len(calls) == 1 and calls[0].name == "apply_patch" and calls[0].input, first.output
    output = {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Invalid patch"}
    turn = body | {"input": body["input"] + [as_input(i) for i in first.output] + [output], "tool_choice": "auto"}
    with client.responses.stream(**turn | {"max_output_tokens": 400}) as stream:
        second = stream.get_final_response()
    assert second.status == "completed" and second.output


def test_bad_input_gets_openais_errors_and_the_gateway_serves_on(served, client):
    url = served[1].url
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "moestream", "input": "Hi", "max_output_tokens": 2, "temperature": 0}
    cases = [
        ("bad JSON", b'{"model": ', 400, "invalid_json"),
        ("previous_response_id", ok | {"previous_response_id": "resp_1"}, 400, "unsupported_parameter"),
        ("image", ok | {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, None),
        ("no input", {"model": "moestream"}, 400, None),
        ("over the context", ok | {"input": "Hi " * 9000}, 400, "context_length_exceeded"),
    ]
    with httpx.Client(timeout=120) as http:
        for what, body, status, code in cases:
            if isinstance(body, bytes):
                r = http.post(url + "/v1/responses", content=body, headers=auth | {"Content-Type": "application/json"})
            else:
                r = http.post(url + "/v1/responses", json=body, headers=auth)
            assert r.status_code == status, (what, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (what, error)
            if code is not None:
                assert error["code"] == code, (what, error)
        r = http.post(url + "/v1/responses", json=ok, headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get(url + "/v1/responses", headers=auth).status_code == 405
        assert http.get(url + "/health").status_code == 200
    # One of the package's own errors, and the next request is served.
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="moestream", input="Hi", conversation="conv_1")
    cut = client.responses.create(**ok)  # greedy, the demo's answer to "Hi" is longer
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2 and cut.output[-1].status == "incomplete"
    # Any model name is the daemon's (named back as asked), and a max_output_tokens past the
    # context is cut to the room it leaves, not refused.
    codex_model = client.responses.create(**ok | {"model": "gpt-5-codex", "max_output_tokens": 1 << 20})
    assert codex_model.model == "gpt-5-codex" and codex_model.status in ("completed", "incomplete")


@pytest.mark.slow  # Codex's whole first requests: about 1400 prompt tokens each, a minute on a busy CPU
def test_codexs_requests_as_they_are_are_answered(served, client):
    """The requests in tests/data/codex, as Codex sends them (streamed), each answered and
    folded by the `openai` package into a Response."""
    for name in ("first_turn", "function_call_output_turn", "custom_tool_call_output_turn"):
        body = codex(name) | {"max_output_tokens": 64}
        del body["stream"]
        with client.responses.stream(**body) as stream:
            kinds = [e.type for e in stream]
        events = list(client.responses.create(**body, stream=True))
        assert kinds[0] == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
        Response.model_validate(events[-1].response.to_dict())
        assert events[-1].response.output and events[-1].response.usage.input_tokens > 1000
