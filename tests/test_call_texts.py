"""A resent tool call is rendered as the model wrote it (issue 53, point 3): the gateway
keeps each call's text by the id it gave the call (client/gateway/call_texts.py), and the
daemon renders a resent call with that text in place of the template's serialisation
(daemon/model/tool_calls.py `render_call_texts`), so that an agent's next turn reuses
every cached token up to the tool's result.

End to end with the real `anthropic` and `openai` packages: the demo model behind a real
daemon and gateway, its chat template changed to write tool calls as compact JSON (the
template's serialisation then differs from what the model wrote under the tool_choice
grammar, `{"name": "Read", "arguments": {...}}` with spaces: the case of a model whose own
spelling of a call is not its template's), a call forced with tool_choice, and the next
turn resending it with its result."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import anthropic
import msgpack
import openai
import pytest
from test_openai_gateway import served_gateway

from moestream.client.gateway.call_texts import CallTexts, same_json
from moestream.daemon.model.generation import render_chat
from moestream.daemon.model.tool_calls import render_call_texts
from moestream.shared import protocol as proto
from moestream.shared.protocol import ChatMessage
from moestream.shared.settings import demo_store_path

KEY = "sk-call-texts-0123456789"
SPACED = '{"name": {{ tool_call.name | tojson }}, "arguments": {{ tool_call.arguments | tojson'
COMPACT = '{"name":{{ tool_call.name | tojson }},"arguments":{{ tool_call.arguments | tojson(separators=(",", ":"))'
READ = {
    "name": "Read",
    "description": "Reads a file.",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string", "enum": ["/home/user/project/parser.py"]}},
        "required": ["file_path"],
        "additionalProperties": False,
    },
}
ASK = "Read the parser."
RESULT = "def parse(text):\n    return text.split(',')"


# ---- the kept texts ---------------------------------------------------------------------


def test_a_kept_text_is_found_only_for_the_same_call_of_the_same_client():
    kept = CallTexts()
    kept.keep("alice", "toolu_1", "Read", '{"file_path": "/a", "limit": 2.0}', "<tool_call>A</tool_call>")
    assert kept.find("alice", "toolu_1", "Read", {"file_path": "/a", "limit": 2}) == "<tool_call>A</tool_call>"
    assert kept.find("bob", "toolu_1", "Read", {"file_path": "/a", "limit": 2.0}) is None
    assert kept.find("alice", "toolu_2", "Read", {"file_path": "/a", "limit": 2.0}) is None
    assert kept.find("alice", "toolu_1", "Write", {"file_path": "/a", "limit": 2.0}) is None
    assert kept.find("alice", "toolu_1", "Read", {"file_path": "/b", "limit": 2.0}) is None
    assert kept.find("alice", None, "Read", {"file_path": "/a", "limit": 2.0}) is None
    kept.keep("alice", "toolu_3", "Read", "{}", None)  # nothing to keep
    kept.keep("alice", "toolu_4", "Read", "not json", "<tool_call>x</tool_call>")
    assert len(kept) == 1


def test_json_sameness_takes_numbers_by_value_but_not_booleans_for_numbers():
    assert same_json({"a": [1, 2.0]}, {"a": [1.0, 2]})
    assert not same_json({"a": True}, {"a": 1}) and not same_json(0, False)
    assert not same_json({"a": 1}, {"a": 1, "b": None}) and not same_json([1], [1, 1]) and not same_json("1", 1)


def test_the_kept_texts_are_bounded_per_client_and_in_clients_least_recent_first():
    kept = CallTexts(per_client=3, clients=2)
    for i in range(5):
        kept.keep("a", f"c{i}", "f", "{}", f"t{i}")
    assert [kept.find("a", f"c{i}", "f", {}) for i in range(5)] == [None, None, "t2", "t3", "t4"]
    kept.keep("b", "c0", "f", "{}", "b0")
    kept.find("a", "c4", "f", {})  # a used last: c goes in and b goes out
    kept.keep("c", "c0", "f", "{}", "c0")
    assert kept.find("b", "c0", "f", {}) is None and kept.find("a", "c4", "f", {}) == "t4"
    # And in characters of text, in all: the least recent client's oldest calls go first.
    kept = CallTexts(max_chars=10)
    kept.keep("a", "c0", "f", "{}", "aaaa")
    kept.keep("b", "c0", "f", "{}", "bbbb")
    kept.keep("a", "c1", "f", "{}", "cccc")  # 12 characters: b's call goes (b used least recently)
    assert kept.find("b", "c0", "f", {}) is None and kept.find("a", "c0", "f", {}) == "aaaa"
    assert len(kept) == 2
    kept.keep("a", "c2", "f", "{}", "x" * 11)  # longer than the bound: not kept
    assert kept.find("a", "c2", "f", {}) is None and len(kept) == 2


# ---- the rendering ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_store_path())


TOOLS = [{"type": "function", "function": {"name": "Read", "parameters": READ["input_schema"]}}]
CALL = {"name": "Read", "arguments": {"file_path": "/home/user/project/parser.py"}}
WRITTEN = '<tool_call>\n{"name":"Read","arguments":{"file_path":"/home/user/project/parser.py"}}\n</tool_call>'


def _chat(texts: tuple[str | None, ...] | None) -> list[ChatMessage]:
    return [
        ChatMessage("user", ASK),
        ChatMessage("assistant", "", tool_calls=(CALL,), call_texts=texts),
        ChatMessage("tool", RESULT, tool_call_id="toolu_1"),
    ]


def test_a_call_with_its_text_is_rendered_as_written_and_the_rest_as_the_template_renders_it(demo_tokenizer):
    with_text = render_chat(demo_tokenizer, _chat((WRITTEN,)), TOOLS)
    plain = render_chat(demo_tokenizer, _chat(None), TOOLS)
    spelled = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/home/user/project/parser.py"}}\n</tool_call>'
    assert spelled in plain and WRITTEN not in plain
    assert with_text == plain.replace(spelled, WRITTEN)
    # None for a call leaves that call to the template.
    assert render_chat(demo_tokenizer, _chat((None,)), TOOLS) == plain


def test_where_the_call_cannot_be_found_exactly_the_template_renders_it(demo_tokenizer):
    chat = [m.to_template() for m in _chat(None)]

    def render(c):
        return demo_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False, tools=TOOLS)

    # A text that is not one whole call between the markers; a template writing the name twice.
    assert render_call_texts(demo_tokenizer, chat, {(1, 0): WRITTEN[:-3]}, render) is None

    def twice(c):
        names = [call["function"]["name"] for m in c for call in m.get("tool_calls", [])]
        return render(c) + "".join(names)

    assert render_call_texts(demo_tokenizer, chat, {(1, 0): WRITTEN}, twice) is None
    assert render_call_texts(demo_tokenizer, chat, {(1, 0): WRITTEN}, render) == render(chat).replace(
        '{"name": "Read", "arguments": {"file_path": "/home/user/project/parser.py"}}', WRITTEN[12:-13]
    )


def test_call_texts_travel_in_the_protocol_one_for_each_call():
    msg = proto.Generate(id="r", messages=tuple(_chat((WRITTEN,))), max_tokens=4)
    back = proto.decode_request(proto.encode(msg))
    assert back.messages[1].call_texts == (WRITTEN,) and back.messages[1].to_template().keys() == {
        "role",
        "content",
        "tool_calls",
    }
    for bad in ([WRITTEN, WRITTEN], [3], "text"):
        body = msgpack.unpackb(proto.encode(msg))
        body["messages"][1]["call_texts"] = bad
        with pytest.raises(proto.ProtocolError, match="call_texts"):
            proto.decode_request(msgpack.packb(body))


# ---- end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """The demo model (its template writing tool calls as compact JSON) behind a real
    daemon and gateway."""
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mct"))
    try:
        store = root / "store"
        shutil.copytree(demo_store_path(), store)
        config = json.loads((store / "tokenizer_config.json").read_text())
        assert SPACED in config["chat_template"]
        config["chat_template"] = config["chat_template"].replace(SPACED, COMPACT)
        (store / "tokenizer_config.json").write_text(json.dumps(config))
        with served_gateway(store, "mctg", KEY) as both:
            yield both
    finally:
        shutil.rmtree(root)


def test_claude_code_resending_a_call_reuses_every_token_up_to_its_result(served):
    claude = anthropic.Anthropic(base_url=served[1].url, api_key=KEY, max_retries=0, timeout=600)
    user = {"role": "user", "content": ASK}
    meta = {"user_id": "user_abc_account__session_1"}
    args = dict(model="claude-sonnet-4-5", max_tokens=48, tools=[READ], metadata=meta, extra_body={"temperature": 0})
    first = claude.messages.create(messages=[user], tool_choice={"type": "any"}, **args)
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.input == {"file_path": "/home/user/project/parser.py"} and first.stop_reason == "tool_use"
    answered = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens

    def resend(call_id: str, client: dict[str, str]) -> anthropic.types.Usage:
        turn = {"type": "tool_use", "id": call_id, "name": call.name, "input": call.input}
        result = {"type": "tool_result", "tool_use_id": call_id, "content": RESULT}
        history = [user, {"role": "assistant", "content": [turn]}, {"role": "user", "content": [result]}]
        return claude.messages.create(messages=history, **(args | {"max_tokens": 2, "metadata": client})).usage

    # The call as Claude Code sends it back: every token of the first turn's prompt and answer reused.
    assert resend(call.id, meta).cache_read_input_tokens == answered
    # The same call from another client (its own metadata.user_id) gets the template's
    # compact JSON: the prompt parts from the cache inside the call. (One such resend:
    # the cache then holds its prompt, which a second one would share.)
    assert resend(call.id, {"user_id": "someone else"}).cache_read_input_tokens < answered


def test_an_openai_client_resending_a_call_reuses_every_token_up_to_its_result(served):
    chat = openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0, timeout=600).chat.completions
    tools = [{"type": "function", "function": {"name": "Read", "parameters": READ["input_schema"]}}]
    user = {"role": "user", "content": ASK}
    args = dict(model="gpt-5", tools=tools, temperature=0, user="codex-session-1")
    first = chat.create(messages=[user], tool_choice="required", max_tokens=48, **args)
    (call,) = first.choices[0].message.tool_calls
    answered = first.usage.prompt_tokens + first.usage.completion_tokens
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    history = [user, assistant, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    again = chat.create(messages=history, max_tokens=2, **args)
    assert again.usage.prompt_tokens_details.cached_tokens == answered


def test_codex_resending_a_call_through_the_responses_api_reuses_every_token_up_to_its_result(served):
    responses = openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0, timeout=600).responses
    tools = [{"type": "function", "name": "Read", "parameters": READ["input_schema"], "strict": False}]
    user = {"role": "user", "content": ASK}
    args = dict(model="gpt-5-codex", tools=tools, temperature=0, prompt_cache_key="codex-conversation-1")
    first = responses.create(input=[user], tool_choice="required", max_output_tokens=48, **args)
    (call,) = [item for item in first.output if item.type == "function_call"]
    answered = first.usage.input_tokens + first.usage.output_tokens
    history = [user, call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id}]
    history[-1]["output"] = RESULT
    again = responses.create(input=history, max_output_tokens=2, **args)
    assert again.usage.input_tokens_details.cached_tokens == answered
