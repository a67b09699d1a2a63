"""The gateway's three APIs (OpenAI, Anthropic, Ollama) and tool calls, with real parts:
the demo model (its chat template) in a real daemon, the gateway as its own process, and
the real `openai`, `anthropic` and `ollama` packages as clients (raw HTTP for errors).

Greedy text through each API is compared with `moestreamctl generate --json` fed the
prompt the chat template renders here. The demo model has not learnt to call tools, so
parsed calls are checked where they are made (the daemon's splitter with mlx-lm's own
parser, on the demo tokenizer's real token pieces) and shaped (each API's answer, read
by the real package's own types); through the daemon, tools reach the template, and
the model's tool-call-looking text that does not parse stays text, never lost.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import anthropic
import httpx
import ollama
import pytest
from daemon_cli import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_openai_gateway import chat_answer, generate_json, real_clients, recent, served_gateway

from moestream.client.client import Client, Token
from moestream.shared import protocol as proto
from moestream.shared.protocol import Done
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.settings import demo_store_path
from moestream.shared.status import KeepAliveStatus, RequestStats

KEY = "sk-apis-0123456789"
N = 12
LONG = 400  # never reached: the requests that ask for it are cancelled
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What does zip do?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_store_path())


# ---- without a daemon -------------------------------------------------------------------


def test_the_demo_template_renders_tools_and_mlx_lm_picks_the_json_tools_parser(tokenizer):
    from moestream.daemon.model.generation import render_chat

    assert tokenizer.has_chat_template and tokenizer.has_tool_calling
    assert tokenizer.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    plain = render_chat(tokenizer, CHAT)
    assert plain == (
        "<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\nWhat does zip do?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_tools = render_chat(tokenizer, CHAT, [WEATHER])
    assert json.dumps(WEATHER) in with_tools and with_tools.endswith("<|im_start|>assistant\n")
    assert render_chat(tokenizer, CHAT, [WEATHER], "none") == plain
    assert render_chat(tokenizer, CHAT, [WEATHER], "required") == with_tools + "<tool_call>"
    named = render_chat(tokenizer, CHAT, [WEATHER], {"name": "get_weather"})
    assert named == with_tools + '<tool_call>\n{"name": "get_weather", "arguments": '
    # A turn that called a tool and the tool's result, as the template writes them.
    turn = [
        proto.ChatMessage("user", "Weather in Paris?"),
        proto.ChatMessage("assistant", "", tool_calls=({"name": "get_weather", "arguments": {"city": "Paris"}},)),
        proto.ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather"),
    ]
    text = render_chat(tokenizer, turn, [WEATHER])
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text


def _pieces(tokenizer, text: str) -> list[str]:
    """`text` as the daemon's detokenizer hands it out, token by token."""
    detok = tokenizer.detokenizer
    detok.reset()
    out, seen = [], 0
    for t in tokenizer.encode(text):
        detok.add_token(t)
        out.append(detok.text[seen:])
        seen = len(detok.text)
    detok.finalize()
    out.append(detok.text[seen:])
    return out


def test_the_splitter_turns_the_models_call_text_into_parsed_calls_and_never_streams_it(tokenizer):
    from moestream.daemon.model.tool_calls import splitter_for

    answer = f"Let me look. {CALL} and {CALL.replace('Paris', 'Oslo')} <tool done"
    split = splitter_for(tokenizer, [WEATHER], "auto")
    streamed, calls = [], []
    for piece in _pieces(tokenizer, answer):
        text, new = split.feed(piece)
        streamed.append(text)
        calls += new
        assert "<tool_call" not in "".join(streamed)  # not even the start of a call's text
    text, new = split.finish()
    streamed.append(text)
    calls += new
    # Each whole call with its text as the model wrote it (a resent turn is rendered so).
    assert (
        calls
        == split.calls
        == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}', "text": CALL},
            {"name": "get_weather", "arguments": '{"city": "Oslo"}', "text": CALL.replace("Paris", "Oslo")},
        ]
    )
    assert "".join(streamed) == split.content == "Let me look.  and  <tool done"
    assert split.fed == len(answer)

    # A call that does not parse is given back as the text it was; so is one left open.
    for bad in ("<tool_call>\n{not json}\n</tool_call> after", 'before <tool_call>\n{"name": "get_w'):
        split = splitter_for(tokenizer, [WEATHER], "auto")
        for piece in _pieces(tokenizer, bad):
            split.feed(piece)
        split.finish()
        assert split.content == bad and split.calls == []

    # An answer forced to start with a call (tool_choice required / named), and a call the
    # model ends with end-of-sequence instead of the end marker.
    split = splitter_for(tokenizer, [WEATHER], {"name": "get_weather"})
    for piece in _pieces(tokenizer, '{"city": "Rome"}}'):
        assert split.feed(piece) == ("", [])
    assert split.finish() == ("", [{"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    assert splitter_for(tokenizer, [WEATHER], "none") is None and splitter_for(tokenizer, None, "auto") is None


def test_tools_travel_in_the_protocol_and_are_checked():
    import msgpack

    calls = ({"name": "get_weather", "arguments": {"city": "Paris"}},)
    msg = proto.Generate(
        id="t",
        messages=(
            proto.ChatMessage("user", "hi"),
            proto.ChatMessage("assistant", "", tool_calls=calls),
            proto.ChatMessage("tool", "sunny", tool_call_id="c1", name="get_weather"),
        ),
        tools=(WEATHER,),
        tool_choice={"name": "get_weather"},
    )
    assert proto.decode_request(proto.encode(msg)) == msg
    body = msgpack.unpackb(proto.encode(msg))
    assert body["messages"][0] == {"role": "user", "content": "hi"}  # unused keys are left out
    assert "tools" not in msgpack.unpackb(proto.encode(proto.Generate(id="b", prompt="x")))
    reply = proto.ToolCall(id="t", index=0, name="get_weather", arguments='{"city": "Paris"}')
    assert proto.decode_reply(proto.encode(reply)) == reply
    done = proto.decode_reply(
        proto.encode(Done("t", "", [1], "stop", RequestStats(), [{"name": "f", "arguments": "{}"}]))
    )
    assert done.tool_calls == [{"name": "f", "arguments": "{}"}]

    def code_of(**fields) -> str:
        data = msgpack.packb({"v": proto.PROTOCOL_VERSION, "type": "generate", "id": "r", **fields})
        with pytest.raises(proto.ProtocolError) as info:
            proto.decode_request(data)
        return info.value.code

    user = [{"role": "user", "content": "hi"}]
    for bad in (
        {"prompt": "x", "tools": [WEATHER]},
        {"messages": user, "tools": [{"type": "function"}]},
        {"messages": user, "tools": [{"type": "function", "function": {"name": ""}}]},
        {"messages": user, "tools": "get_weather"},
        {"messages": user, "tools": [WEATHER], "tool_choice": "always"},
        {"messages": user, "tools": [WEATHER], "tool_choice": {"name": "other"}},
        {"messages": user, "tool_choice": "required"},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{}"}]}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}]},
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": ""}]},
        {"messages": user, "tools": [{"type": "function", "function": {"name": "f", "x": float("nan")}}]},
    ):
        assert code_of(**bad) == proto.BAD_MESSAGE, bad
    deep: dict = {}
    for _ in range(proto.MAX_JSON_DEPTH + 2):
        deep = {"a": deep}
    assert code_of(messages=user, tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])


def test_tool_calls_come_back_in_each_apis_own_shape():
    """Each API's answer with the model's calls, read by the real package's own types."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from moestream.client.gateway import anthropic as anth
    from moestream.client.gateway import ollama as oll
    from moestream.client.gateway.openai import Shaper, finish_reason

    calls = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    done = Done("x", "", [5, 6, 7], "stop", RequestStats(prompt_tokens=9), calls)
    shaper = Shaper(chat=True, id="chatcmpl-1", model="m")
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    whole = ChatCompletion.model_validate(shaper.complete("", finish_reason("stop", True), usage, calls))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunk = ChatCompletionChunk.model_validate(shaper.tool_chunk(calls[0], 0))
    delta = chunk.choices[0].delta.tool_calls[0]
    assert (
        delta.index == 0 and delta.function.name == "get_weather" and delta.function.arguments == calls[0]["arguments"]
    )

    message = anthropic.types.Message.model_validate(anth.message("msg_1", "m", done))
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather" and message.content[0].input == {"city": "Paris"}
    assert message.usage.input_tokens == 9 and message.usage.output_tokens == 3
    stopped = Done("x", "abc", [1], "stop", RequestStats(stop_string="\n\n"))
    assert anth.stop_reason(stopped) == ("stop_sequence", "\n\n")
    assert anth.stop_reason(Done("x", "abc", [1], "stop", RequestStats())) == ("end_turn", None)
    assert anth.stop_reason(Done("x", "abc", [1], "length", RequestStats())) == ("max_tokens", None)

    reply = ollama.ChatResponse.model_validate(
        {"model": "m", "message": {"role": "assistant", "content": "", "tool_calls": [oll._call_out(calls[0])]}}
    )
    assert reply.message.tool_calls[0].function.name == "get_weather"
    assert reply.message.tool_calls[0].function.arguments == {"city": "Paris"}


# ---- through the daemon ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """(daemon paths, gateway) on the demo model, the gateway with an API key."""
    with served_gateway(demo_store_path(), "msa", KEY) as both:
        yield both


@pytest.fixture(scope="module")
def clients(served):
    return real_clients(served[1].url, KEY)


def test_greedy_text_through_each_api_equals_generate(served, clients, tokenizer):
    from moestream.daemon.model.generation import render_chat

    paths = served[0]
    oa, an, ol = clients
    rendered = render_chat(tokenizer, CHAT)
    ref = generate_json(demo_store_path(), paths, rendered, "--max-tokens", str(N))
    assert ref["stats"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    text, tokens = chat_answer(ref["text"], ref["tokens"], tokenizer)
    assert text

    out = oa.chat.completions.create(model="moestream-demo", messages=CHAT, max_tokens=N, temperature=0)
    assert out.choices[0].message.content == text and out.usage.completion_tokens == tokens
    chunks = list(
        oa.chat.completions.create(model="moestream", messages=CHAT, max_tokens=N, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text

    # Anthropic's newest package takes temperature only as an extra field of the body.
    system, user = CHAT[0]["content"], CHAT[1:]
    args = dict(model="moestream-demo", max_tokens=N, system=system, messages=user, extra_body={"temperature": 0})
    message = an.messages.create(**args)
    assert message.type == "message" and message.role == "assistant"
    assert [b.text for b in message.content] == [text] and message.stop_reason in ("max_tokens", "end_turn")
    # Anthropic's usage: the prompt's tokens the prompt cache served apart (the same chat came before).
    use = message.usage
    assert use.input_tokens + use.cache_read_input_tokens == ref["stats"]["prompt_tokens"]
    assert use.cache_read_input_tokens > 0 and use.output_tokens == tokens
    with an.messages.stream(**args) as stream:
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().usage.output_tokens == tokens
    assert an.messages.count_tokens(model="moestream-demo", system=system, messages=user).input_tokens == len(
        tokenizer.encode(rendered, add_special_tokens=False)
    )

    options = {"num_predict": N, "temperature": 0}
    reply = ol.chat(model="moestream-demo", messages=CHAT, options=options, keep_alive="5m")
    assert reply.message.content == text and reply.done and reply.eval_count == tokens
    assert reply.prompt_eval_count == ref["stats"]["prompt_tokens"]
    parts = list(ol.chat(model="moestream-demo:latest", messages=CHAT, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == text and parts[-1].done and not parts[0].done

    prompt = "def fibonacci(n):"
    plain = generate_json(demo_store_path(), paths, prompt, "--max-tokens", str(N))
    assert ol.generate(model="moestream-demo", prompt=prompt, options=options).response == plain["text"]
    streamed = "".join(
        p.response for p in ol.generate(model="moestream-demo", prompt=prompt, options=options, stream=True)
    )
    assert streamed == plain["text"]
    stop = plain["text"][3:6]
    stopped = ol.generate(model="moestream-demo", prompt=prompt, options=options | {"stop": [stop]})
    assert stopped.response == plain["text"][: plain["text"].index(stop)] and stopped.done_reason == "stop"
    cut = an.messages.create(
        **args | {"messages": [{"role": "user", "content": CHAT[1]["content"]}], "stop_sequences": [text[2:5]]}
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == text[2:5]


def test_the_ollama_listing_routes(served, clients):
    ol = clients[2]
    assert [m.model for m in ol.list().models] == ["moestream-demo"]
    before = datetime.now(timezone.utc)
    running = ol.ps().models
    assert [m.model for m in running] == ["moestream-demo"] and running[0].size_vram > 0
    # When the daemon's keep-alive (30 min by default) releases the model: not "never".
    assert before < running[0].expires_at <= datetime.now(timezone.utc) + timedelta(minutes=30, seconds=5)
    shown = ol.show("moestream-demo")
    assert shown.capabilities == ["completion", "tools"]  # the demo has no thinking markers
    assert ol.show("llama3").capabilities == shown.capabilities  # any name is the daemon's model
    assert httpx.get(served[1].url + "/api/version").json()["version"]
    # Ollama's "load the model" requests: no messages, an empty prompt.
    assert ol.chat(model="moestream-demo", messages=[]).done_reason == "load"


def test_ollama_unloads_on_keep_alive_zero_and_loads_on_a_load_request(served, clients):
    """`ollama stop`'s request (an empty prompt, keep_alive 0) releases the model as the
    idle unload does (/api/ps then lists nothing); with a request in flight, once it ends;
    a load request loads it again, with its keep_alive."""
    ol = clients[2]
    with Client(served[0], timeout=30.0) as c:
        unloads = c.status().keep_alive.unloads
        assert ol.generate(model="moestream-demo", prompt="", keep_alive=0).done_reason == "unload"
        assert ol.ps().models == []
        st = c.status()
        assert st.state == "unloaded" and st.keep_alive.unloads == unloads + 1
        assert ol.generate(model="moestream-demo", keep_alive="10m").done_reason == "load"  # no prompt: a load
        st = c.status()
        assert st.state == "ready" and st.keep_alive.keep_alive_s == 600.0
        running = ol.ps().models
        assert [m.model for m in running] == ["moestream-demo"]
        assert running[0].expires_at <= datetime.now(timezone.utc) + timedelta(minutes=10, seconds=5)
        # keep_alive 0 while a request runs: the model goes once it has ended.
        stream = c.generate("def f(x):", max_tokens=LONG)
        assert isinstance(next(e for e in stream if isinstance(e, Token)), Token)
        assert ol.chat(model="moestream-demo", messages=[], keep_alive=0).done_reason == "unload"
        assert [m.model for m in ol.ps().models] == ["moestream-demo"]
        stream.close()  # cancelled
        wait_for(lambda: c.status().state == "unloaded", 10, "the unload once the request in flight ended")
        assert ol.ps().models == []
        assert c.load().state == "ready" and c.status().keep_alive.keep_alive_s == 1800.0  # the setting's
    with pytest.raises(ollama.ResponseError, match="keep_alive"):
        ol.generate(model="moestream-demo", prompt="", keep_alive="soon")


def test_ollama_ps_says_when_the_keep_alive_releases_the_model():
    from moestream.client.gateway.ollama import _expires_at

    def seconds_from_now(text: str) -> float:
        return (datetime.fromisoformat(text.replace("Z", "+00:00")) - datetime.now(timezone.utc)).total_seconds()

    assert 95 < seconds_from_now(_expires_at(KeepAliveStatus(keep_alive_s=1800.0, unload_in_s=100.0))) <= 100  # idle
    assert 1795 < seconds_from_now(_expires_at(KeepAliveStatus(keep_alive_s=1800.0))) <= 1800  # busy
    assert _expires_at(KeepAliveStatus(keep_alive_s=-1.0)).startswith("9999-")  # never


@pytest.mark.slow  # seven chats with the tools' system turn: minutes on a busy CPU
def test_tools_reach_the_template_and_text_that_does_not_parse_stays_text(served, clients, tokenizer):
    """Through each API: tools rendered into the prompt (counted tokens say so), a turn
    with a tool call and its result accepted, and the demo model's answer (which has not
    learnt the format) given back as text: nothing it wrote is lost or leaks twice."""
    from moestream.daemon.model.generation import render_chat

    oa, an, ol = clients
    user = [{"role": "user", "content": "Weather in Paris?"}]
    history = user + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    as_daemon = [
        proto.ChatMessage("user", "Weather in Paris?"),
        proto.ChatMessage("assistant", "", tool_calls=({"name": "get_weather", "arguments": {"city": "Paris"}},)),
        proto.ChatMessage("tool", "sunny", tool_call_id="call_1"),
    ]
    expected = len(tokenizer.encode(render_chat(tokenizer, as_daemon, [WEATHER]), add_special_tokens=False))
    out = oa.chat.completions.create(model="moestream", messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == expected

    required = len(tokenizer.encode(render_chat(tokenizer, user, [WEATHER], "required"), add_special_tokens=False))
    whole = oa.chat.completions.create(
        model="moestream", messages=user, tools=[WEATHER], tool_choice="required", max_tokens=6, temperature=0
    )
    assert whole.usage.prompt_tokens == required
    answer = whole.choices[0].message
    assert answer.tool_calls is None and answer.content.startswith("<tool_call>")  # the forced start, as text
    chunks = list(
        oa.chat.completions.create(
            model="moestream",
            messages=user,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.content

    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]},
    ]
    assert an.messages.count_tokens(model="moestream", messages=turn, tools=[tool]).input_tokens == expected
    message = an.messages.create(
        model="moestream", max_tokens=4, messages=turn, tools=[tool], extra_body={"temperature": 0}
    )
    use = message.usage
    assert use.input_tokens + use.cache_read_input_tokens == expected
    assert message.content[0].text == out.choices[0].message.content

    turn = user + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    reply = ol.chat(model="moestream", messages=turn, tools=[WEATHER], options={"num_predict": 4, "temperature": 0})
    # Ollama's package sends the schema's keys in its own order ("required" first).
    sent = ollama.Tool.model_validate(WEATHER).model_dump(exclude_none=True)
    assert reply.prompt_eval_count == len(
        tokenizer.encode(render_chat(tokenizer, as_daemon, [sent]), add_special_tokens=False)
    )


def _leave_mid_stream(url: str, path: str, body: dict, headers: dict, lines: int) -> None:
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + path, json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            got = 0
            for line in r.iter_lines():
                got += bool(line.strip())
                if got >= lines:
                    break
    # Leaving the block closes the connection mid-stream.


def test_a_client_that_leaves_mid_stream_cancels_its_request_within_a_token_for_each_api(served):
    paths, gateway = served
    auth = {"Authorization": f"Bearer {KEY}"}
    # Greedy: the demo's chat answers end at their end of turn, most of them soon, but this
    # chat's greedy answer (no system message) runs past LONG.
    chat = [{"role": "user", "content": "Write a long story about zip and map."}]
    anthropic_body = {"model": "moestream", "messages": chat, "temperature": 0}
    responses_body = {"model": "moestream", "input": chat, "temperature": 0}
    ollama_options = {"num_predict": LONG, "temperature": 0}
    cases = [
        (
            "/v1/chat/completions",
            {"model": "moestream", "messages": chat, "max_tokens": LONG, "stream": True, "temperature": 0},
            "chatcmpl-",
        ),
        ("/v1/messages", {**anthropic_body, "max_tokens": LONG, "stream": True}, "msg_"),
        ("/v1/responses", {**responses_body, "max_output_tokens": LONG, "stream": True}, "resp_"),
        ("/api/chat", {"model": "moestream", "messages": chat, "options": ollama_options}, "ollama-"),
        ("/api/generate", {"model": "moestream", "prompt": "def f(x):", "options": {"num_predict": LONG}}, "ollama-"),
    ]
    for path, body, prefix in cases:
        before = set(recent(paths))
        _leave_mid_stream(gateway.url, path, body, {**auth, "x-api-key": KEY}, 6)

        def ended() -> dict | None:
            new = [r for rid, r in recent(paths).items() if rid not in before and rid.startswith(prefix)]
            return new[0] if new else None

        entry = wait_for(ended, 15, f"the daemon to end the request of {path}")
        assert entry["finish_reason"] == "cancelled", (path, entry)
        assert entry["tokens_after_stop"] <= 1 and 2 <= entry["tokens"] < LONG, (path, entry)
    assert httpx.get(gateway.url + "/health").status_code == 200


def _shape_of(path: str, body) -> str:
    """Which API's error shape `body` has."""
    if isinstance(body, dict) and body.get("type") == "error" and set(body["error"]) == {"type", "message"}:
        return "anthropic"
    if isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str):
        return "ollama"
    if isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}:
        return "openai"
    return f"unknown: {body!r}"


def _body_limit(path: str) -> int:
    """The gateway's body limit on `path`: Anthropic's own on its routes (Claude Code's images),
    room for the images a request may send on the other routes that take them."""
    from moestream.client.gateway import anthropic as anth
    from moestream.client.gateway.images import IMAGE_BODY_BYTES

    if path.startswith("/v1/messages"):
        return anth.MAX_BODY_BYTES
    if path in ("/v1/chat/completions", "/v1/responses", "/api/chat"):
        return IMAGE_BODY_BYTES
    return proto.MAX_MESSAGE_BYTES


def _api_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "ollama" if path.startswith("/api/") else "openai"


ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/chat",
    "/api/generate",
    "/api/show",
]


def test_bad_input_on_every_route_gets_that_apis_error_and_the_gateway_serves_on(served):
    url = served[1].url
    auth = {"Authorization": f"Bearer {KEY}"}
    good = {
        "/v1/chat/completions": {"model": "moestream", "messages": CHAT, "max_tokens": 2},
        "/v1/completions": {"model": "moestream", "prompt": "x", "max_tokens": 2},
        "/v1/responses": {"model": "moestream", "input": "x", "max_output_tokens": 2},
        "/v1/messages": {"model": "moestream", "messages": CHAT[1:], "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": "moestream", "messages": CHAT[1:]},
        "/api/chat": {"model": "moestream", "messages": CHAT, "stream": False, "options": {"num_predict": 2}},
        "/api/generate": {"model": "moestream", "prompt": "x", "stream": False, "options": {"num_predict": 2}},
        "/api/show": {"model": "moestream"},
    }
    wrong_type = {
        "/v1/chat/completions": {"messages": "hi"},
        "/v1/completions": {"max_tokens": "2"},
        "/v1/responses": {"input": [{"type": "message", "role": "user", "content": 5}]},
        "/v1/messages": {"max_tokens": "2"},
        "/v1/messages/count_tokens": {"messages": [{"role": "robot", "content": "x"}]},
        "/api/chat": {"options": {"temperature": "hot"}},
        "/api/generate": {"stream": "yes"},
        "/api/show": {"model": 5},
    }
    missing = {
        "/v1/chat/completions": "messages",
        "/v1/completions": "prompt",
        "/v1/responses": "input",
        "/v1/messages": "max_tokens",
        "/v1/messages/count_tokens": "messages",
        # No messages or prompt is Ollama's load request (as its own server reads it).
        "/api/chat": "model",
        "/api/generate": "model",
        "/api/show": "model",
    }
    with httpx.Client(timeout=60) as http:
        for path in ROUTES:
            ok = good[path]
            cases = [
                ("bad JSON", b'{"model": ', auth, 400),
                ("not an object", b"[1]", auth, 400),
                ("wrong type", ok | wrong_type[path], auth, 400),
                ("missing field", {k: v for k, v in ok.items() if k != missing[path]}, auth, 400),
                ("oversized", ok | {"padding": "x" * (_body_limit(path) + 1)}, auth, 413),
                ("wrong key", ok, {"Authorization": "Bearer sk-wrong"}, 401),
                ("wrong x-api-key", ok, {"x-api-key": "sk-wrong"}, 401),
            ]
            for what, body, headers, status in cases:
                if isinstance(body, bytes):
                    r = http.post(url + path, content=body, headers={**headers, "Content-Type": "application/json"})
                else:
                    r = http.post(url + path, json=body, headers=headers)
                assert r.status_code == status, (path, what, r.status_code, r.text)
                assert _shape_of(path, r.json()) == _api_of(path), (path, what, r.text)
                assert KEY not in r.text and "sk-wrong" not in r.text
                assert http.get(url + "/health").status_code == 200, (path, what)
            r = http.post(url + path, json=ok, headers=auth)
            assert r.status_code == 200, (path, r.text)
            # Any model name is the daemon's model.
            assert http.post(url + path, json=ok | {"model": "gpt-4o"}, headers=auth).status_code == 200, path
        for path in ("/api/tags", "/api/ps"):
            assert http.get(url + path).status_code == 401 and _shape_of(path, http.get(url + path).json()) == "ollama"
            assert http.get(url + path, headers=auth).status_code == 200
        r = http.get(url + "/api/nothing", headers=auth)
        assert r.status_code == 404 and _shape_of("/api/", r.json()) == "ollama"
        r = http.get(url + "/v1/messages", headers=auth)
        assert r.status_code == 405 and _shape_of("/v1/messages", r.json()) == "anthropic"


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_fields = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "input",
        "instructions",
        "max_tokens",
        "stream",
        "tools",
        "tool_choice",
        "system",
        "options",
        "temperature",
        "stop_sequences",
        "stop",
        "top_p",
        "role",
        "content",
        "num_predict",
        "keep_alive",
        "format",
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(ROUTES), body=st.dictionaries(_fields, _json, max_size=5))
def test_fuzzed_bodies_on_every_route_get_answers_in_that_apis_shape(served, path, body):
    # Whatever else the body holds, it asks for at most two tokens.
    body = body | {"max_tokens": 2, "max_output_tokens": 2, "options": {"num_predict": 2}, "stream": False}
    r = httpx.post(served[1].url + path, json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code in (200, 400, 404), (path, body, r.status_code, r.text)
    if r.status_code != 200:
        assert _shape_of(path, r.json()) == _api_of(path), (path, body, r.text)


class _Scripted:
    """The daemon's events of one request as the gateway's request thread hands them on
    (the demo model makes no tool calls, so these are the events a model that does
    sends: text, a call, the end)."""

    id = "scripted"

    def __init__(self, events: list) -> None:
        self._events = list(events)

    async def next(self):
        return self._events.pop(0)


def _script() -> list:
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    return [
        proto.Token("scripted", "Let me look.", 5),
        proto.Token("scripted", "", 6),  # a token of the call's text, held in the daemon
        proto.ToolCall("scripted", 0, call["name"], call["arguments"]),
        Done("scripted", "Let me look.", [5, 6, 7], "stop", RequestStats(prompt_tokens=9), [call]),
    ]


def test_streamed_tool_calls_reach_each_packages_own_accumulators(tmp_path):
    """Each API's streamed body for a request whose model called a tool, read back by the
    real packages' own types and stream accumulator."""
    import asyncio

    from anthropic.lib.streaming._messages import accumulate_event
    from openai.types.chat import ChatCompletionChunk

    from moestream.client.gateway import anthropic as anth
    from moestream.client.gateway import ollama as oll
    from moestream.client.gateway.app import GatewayConfig
    from moestream.client.gateway.daemon_link import Gateway as App
    from moestream.client.gateway.openai import ApiRequest, OpenAIApi, Shaper

    app = App(GatewayConfig(paths=RuntimePaths(dir=tmp_path, log=tmp_path / "log"), demo_store_id=None))

    async def body(stream) -> str:
        return "".join([piece async for piece in stream])

    def run(make) -> str:
        async def go() -> str:
            daemon = _Scripted(_script())
            return await body(make(daemon, await daemon.next()))

        return asyncio.run(go())

    req = ApiRequest(chat=True, model=None, stream=True, include_usage=False)
    sse = run(lambda d, head: OpenAIApi(app)._events(d, Shaper(chat=True, id="chatcmpl-1", model="m"), req, head))
    chunks = [ChatCompletionChunk.model_validate(e) for e in sse_lines(sse)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look."
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    events = run(lambda d, head: anth.AnthropicApi(app)._stream(d, "m", head))
    names = [line.removeprefix("event: ") for line in events.splitlines() if line.startswith("event: ")]
    assert names == [
        "message_start",
        *("content_block_start", "content_block_delta", "content_block_stop"),  # the text
        *("content_block_start", "content_block_delta", "content_block_stop"),  # the call
        "message_delta",
        "message_stop",
    ]
    snapshot, bufs = None, {}
    for data in sse_lines(events):
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    assert [b.type for b in snapshot.content] == ["text", "tool_use"] and snapshot.content[0].text == "Let me look."
    assert snapshot.content[1].name == "get_weather" and snapshot.content[1].input == {"city": "Paris"}
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 3

    lines = run(lambda d, head: oll.OllamaApi(app)._lines(d, "m", head, True, 0.0)).splitlines()
    parts = [ollama.ChatResponse.model_validate(json.loads(line)) for line in lines]
    assert "".join(p.message.content for p in parts) == "Let me look." and parts[-1].done
    called = [t.function for p in parts for t in p.message.tool_calls or []]
    assert [(f.name, f.arguments) for f in called] == [("get_weather", {"city": "Paris"})]


def sse_lines(text: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]
