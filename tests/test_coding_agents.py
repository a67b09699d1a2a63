"""Coding agents on a streamed model (issue 61): Claude Code's requests, and thinking
through every API, with real parts: a tiny thinking model (tests/thinking_model.py) in a
real daemon, the gateway as its own process, the real `anthropic`, `openai` and `ollama`
packages as clients.

The Claude Code session is replayed from tests/data/claude_code/ (see its README) with
the long descriptions shortened to fit the test model's context and, but for one
request, `max_tokens` capped: a random model writes until it runs out of them. Greedy
text is compared with the daemon's own answer to the prompt the chat template renders
here (`generate --json`), split at the model's `</think>` by hand.
"""

from __future__ import annotations

import inspect
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from daemon_cli import ctl, wait_for
from test_openai_gateway import chat_answer, generate_json, served_gateway
from thinking_model import CHAT, THINK_END, load_thinking_tokenizer, make_thinking_store

from moestream.client.client import Accepted, Client, Done, Token
from moestream.client.gateway import anthropic as anth
from moestream.client.gateway.openai import ApiError
from moestream.daemon.model.generation import render_chat
from moestream.shared import protocol as proto
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.status import RequestStats

KEY = "sk-agents-0123456789"
DATA = Path(__file__).parent / "data" / "claude_code"
DESCRIPTION_CHARS = 60  # tool and property descriptions, cut to fit the test model's context
SYSTEM_CHARS = 600
CAPPED = 16  # max_tokens of the replayed requests but the one that keeps Claude Code's 32000
ROOM = 24  # what the daemon's context leaves the longest prompt of the session
N = 24


def claude_code(name: str) -> dict[str, Any]:
    """One request of the session, its descriptions shortened (see the module's doc)."""
    request = json.loads((DATA / name).read_text())
    body = request["body"]

    def cut(x: Any) -> Any:
        if isinstance(x, dict):
            return {
                k: v[:DESCRIPTION_CHARS] if k == "description" and isinstance(v, str) else cut(v) for k, v in x.items()
            }
        return [cut(v) for v in x] if isinstance(x, list) else x

    if "tools" in body:
        body["tools"] = cut(body["tools"])
    if isinstance(body.get("system"), list):
        body["system"] = [b | {"text": b["text"][:SYSTEM_CHARS]} for b in body["system"]]
    return request


def prompt_tokens(tokenizer, body: dict[str, Any]) -> int:
    """The tokens of a Messages body's prompt as the daemon renders it."""
    req = anth.parse_request(body, count_only=True)
    g = req.text_only or req.generate  # the model reads text only: images as placeholders
    text = render_chat(tokenizer, g["messages"], g.get("tools"), g.get("tool_choice"), g.get("thinking"))
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def store():
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mca"))
    try:
        yield make_thinking_store(root)
    finally:
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def tokenizer(store):
    return load_thinking_tokenizer(store)


@pytest.fixture(scope="module")
def longest(tokenizer) -> int:
    """The prompt tokens of the session's longest request (its later turn)."""
    return prompt_tokens(tokenizer, claude_code("04_later_turn.json")["body"])


@pytest.fixture(scope="module")
def served(store, longest):
    """(daemon paths, gateway): the daemon's context leaves the longest prompt ROOM tokens."""
    with served_gateway(store, "mcg", KEY, env={"MOESTREAM_MAX_CONTEXT": str(longest + ROOM)}) as both:
        yield both


@pytest.fixture(scope="module")
def clients(served):
    url = served[1].url
    return (
        anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=600),
        openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600),
        ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600),
    )


def _requests(paths: RuntimePaths) -> int:
    with Client(paths) as c:
        return c.status().requests.requests


def _reference(store: Path, paths: RuntimePaths, tokenizer, thinking: bool | None) -> tuple[str, str]:
    """(reasoning, answer) of CHAT's greedy answer: the daemon's text for the rendered
    prompt, split at `</think>` here (the template opens the block where thinking is on)."""
    rendered = render_chat(tokenizer, CHAT, thinking=thinking)
    ref = generate_json(store, paths, rendered, "--max-tokens", str(N))
    text, _ = chat_answer(ref["text"], ref["tokens"], tokenizer)
    if rendered.endswith("<think>\n"):
        reasoning, _, answer = text.partition(THINK_END)
        return reasoning.lstrip(), answer.lstrip()
    return "", text


# ---- without a daemon -----------------------------------------------------------------------


def _script() -> list:
    """A thinking model's events: accepted, reasoning, answer, a call, the end."""
    call = {"name": "Read", "arguments": '{"file_path": "/a.py"}'}
    stats = RequestStats(prompt_tokens=9, cached_tokens=4)
    return [
        Accepted("s", 9),
        Token("s", "Let me", 5, True),
        Token("s", " look.", 6, True),
        Token("s", "I'll read it.", 7),
        proto.ToolCall("s", 0, call["name"], call["arguments"]),
        Done("s", "I'll read it.", [5, 6, 7, 8, 9], "stop", stats, [call], "Let me look."),
    ]


def _cut_script() -> list:
    """One cut off by max_tokens while it reasons: the end of its reasoning, held back in
    the daemon as the possible start of a marker, comes only with `done`."""
    return [
        Accepted("s", 9),
        Token("s", "Let me", 5, True),
        Done("s", "", [5, 6], "length", RequestStats(prompt_tokens=9), [], "Let me </th"),
    ]


def test_each_apis_stream_of_a_thinking_model_reaches_the_packages_accumulators(tmp_path):
    """Reasoning, answer and a call streamed in each API's shape, read back by the real
    packages' own types and accumulators; the held-back rest of the reasoning included."""
    import asyncio

    from anthropic.lib.streaming._messages import accumulate_event
    from openai.types.chat import ChatCompletionChunk
    from test_gateway_apis import _Scripted, sse_lines

    from moestream.client.gateway import ollama as oll
    from moestream.client.gateway.app import GatewayConfig
    from moestream.client.gateway.daemon_link import Gateway as App
    from moestream.client.gateway.openai import ApiRequest, OpenAIApi, Shaper

    app = App(GatewayConfig(paths=RuntimePaths(dir=tmp_path, log=tmp_path / "log"), demo_store_id=None))

    def run(make, script=_script) -> str:
        async def go() -> str:
            daemon = _Scripted(script())
            return "".join([piece async for piece in make(daemon, await daemon.next())])

        return asyncio.run(go())

    def accumulated(script) -> Any:
        snapshot, bufs = None, {}
        for data in sse_lines(run(lambda d, head: anth.AnthropicApi(app)._stream(d, "claude-x", head), script)):
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
        return snapshot

    cut = accumulated(_cut_script)
    assert [(b.type, b.thinking) for b in cut.content] == [("thinking", "Let me </th")]
    assert cut.stop_reason == "max_tokens" and cut.usage.input_tokens == 9
    snapshot = accumulated(_script)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[0].thinking == "Let me look." and snapshot.content[0].signature == anth.signature(
        "Let me look."
    )
    assert snapshot.content[1].text == "I'll read it." and snapshot.content[2].input == {"file_path": "/a.py"}
    assert snapshot.model == "claude-x" and snapshot.stop_reason == "tool_use"
    u = snapshot.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens, u.output_tokens) == (5, 4, 0, 5)
    whole = anthropic.types.Message.model_validate(anth.message("msg_1", "claude-x", _script()[-1]))
    assert [b.model_dump() for b in whole.content[:2]] == [b.model_dump() for b in snapshot.content[:2]]

    req = ApiRequest(chat=True, model=None, stream=True, include_usage=False)
    sse = run(lambda d, head: OpenAIApi(app)._events(d, Shaper(chat=True, id="c", model="m"), req, head))
    chunks = [ChatCompletionChunk.model_validate(e) for e in sse_lines(sse)]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me look."
    assert "".join(d.content or "" for d in deltas) == "I'll read it."
    use = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
    whole = Shaper(chat=True, id="c", model="m").complete("I'll read it.", "stop", use, None, "Let me look.")
    assert openai.types.chat.ChatCompletion.model_validate(whole).choices[0].message.reasoning_content == "Let me look."

    sse = run(lambda d, head: OpenAIApi(app)._events(d, Shaper(chat=True, id="c", model="m"), req, head), _cut_script)
    deltas = [ChatCompletionChunk.model_validate(e).choices[0].delta for e in sse_lines(sse)]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me </th"

    for script, thought, said in ((_script, "Let me look.", "I'll read it."), (_cut_script, "Let me </th", "")):
        lines = run(lambda d, head: oll.OllamaApi(app)._lines(d, "m", head, True, 0.0), script).splitlines()
        parts = [ollama.ChatResponse.model_validate(json.loads(line)) for line in lines]
        assert "".join(p.message.thinking or "" for p in parts) == thought
        assert "".join(p.message.content for p in parts) == said and parts[-1].done


def test_anthropic_requests_as_claude_code_sends_them_are_read_and_bad_ones_refused():
    def parse(**body):
        return anth.parse_request({"model": "claude-x", "max_tokens": 8, **body}).generate

    user = [{"role": "user", "content": "hi"}]
    assert parse(messages=user, thinking={"type": "adaptive"})["thinking"] is True
    assert parse(messages=user, thinking={"type": "enabled", "budget_tokens": 1024})["thinking"] is True
    assert parse(messages=user, thinking={"type": "disabled"})["thinking"] is False
    assert parse(messages=user)["thinking"] is None
    assert parse(messages=user, top_k=40)["top_k"] == 40
    tool = {"name": "Read", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    server = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}
    got = parse(messages=user, tools=[tool, server], tool_choice={"type": "none"})
    assert [t["function"]["name"] for t in got["tools"]] == ["Read"] and got["tool_choice"] == "none"
    assert "tools" not in parse(messages=user, tools=[server], tool_choice={"type": "auto"})
    folded = parse(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "b"},
            {"role": "assistant", "content": "c"},
        ]
    )["messages"]
    assert folded == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]
    for bad, where in (
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": "all"}}, "thinking"),
        ({"top_k": -1}, "top_k"),
        ({"tools": [server], "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages"),
    ):
        with pytest.raises(ApiError) as info:
            parse(**{"messages": user} | bad)
        assert info.value.status == 400 and where in info.value.message


# ---- Claude Code's session ---------------------------------------------------------------


def _arguments(method: Any, request: dict[str, Any]) -> dict[str, Any]:
    """A request's body as the package's `method` takes it: the fields it names as its
    arguments, the rest (temperature, in its newest release) as its extra body."""
    names = inspect.signature(method).parameters
    body = {k: v for k, v in request["body"].items() if k != "stream"}
    known = {k: v for k, v in body.items() if k in names}
    return known | {
        "extra_body": {k: v for k, v in body.items() if k not in names},
        "extra_headers": request["headers"],
    }


def _stream(client: anthropic.Anthropic, request: dict[str, Any]) -> tuple[Any, list[Any]]:
    """A request streamed through the package's accumulator: (final message, events)."""
    with client.beta.messages.stream(**_arguments(client.beta.messages.stream, request)) as stream:
        events = list(stream)
        return stream.get_final_message(), events


def _whole(client: anthropic.Anthropic, request: dict[str, Any]) -> Any:
    return client.beta.messages.create(**_arguments(client.beta.messages.create, request), stream=False)


def _check_message(message: Any, asked: str, thinks: bool) -> None:
    """What Claude Code reads of an answer: its model, blocks and usage."""
    assert message.type == "message" and message.role == "assistant" and message.model == asked
    kinds = [b.type for b in message.content]
    assert set(kinds) <= {"thinking", "text", "tool_use"}, kinds
    assert thinks or "thinking" not in kinds, kinds
    for block in message.content:
        if block.type == "thinking":
            assert block.thinking and block.signature == anth.signature(block.thinking)
    u = message.usage
    # Sampled at the model card's temperature (Claude Code sends none): an answer may end at
    # its first token, the end of turn, with nothing in it (a loaded CI run drew that once).
    assert u.output_tokens > 0 or (message.stop_reason == "end_turn" and not message.content), (message, u)
    assert u.input_tokens + u.cache_read_input_tokens > 0
    assert u.cache_creation_input_tokens == 0
    assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_claude_codes_session_is_answered_streamed_and_whole(served, clients, tokenizer, longest):
    """Every request of the session, as Claude Code sends it (model names, thinking,
    cache_control, metadata, headers, a system message mid-conversation, images, signed
    thinking blocks, a server tool): 200, parsed by the package, streamed and not."""
    paths, gateway = served
    an = clients[0]
    names = sorted(p.name for p in DATA.glob("0*.json"))
    assert len(names) == 6
    first = claude_code("01_first_turn.json")
    counting = claude_code("03_count_tokens.json")
    counted = an.beta.messages.count_tokens(**_arguments(an.beta.messages.count_tokens, counting)).input_tokens
    assert counted == prompt_tokens(tokenizer, first["body"])
    thought = []
    for name in names:
        request = claude_code(name)
        body = request["body"]
        if name == "03_count_tokens.json":
            continue
        # No thinking parameter: the model's default, which is to think.
        thinks = body.get("thinking", {}).get("type") != "disabled"
        if name != "04_later_turn.json":
            body["max_tokens"] = min(body["max_tokens"], CAPPED)
        whole = _whole(an, request)
        _check_message(whole, body["model"], thinks)
        message, events = _stream(an, request)
        _check_message(message, body["model"], thinks)
        start = next(e for e in events if e.type == "message_start").message.usage
        # message_start: the whole prompt, before the prompt cache is looked up.
        assert start.input_tokens == prompt_tokens(tokenizer, body) and start.cache_read_input_tokens == 0
        u = message.usage
        assert u.input_tokens + u.cache_read_input_tokens == start.input_tokens
        # The second time, the prompt cache served all of it but its last token.
        assert u.cache_read_input_tokens == start.input_tokens - 1, (name, u)
        if message.content and message.content[0].type == "thinking":
            thought.append(name)
            deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
            assert deltas[0] == "thinking_delta" and "signature_delta" in deltas
        if name == "01_first_turn.json":
            assert start.input_tokens == counted
        if name == "04_later_turn.json":
            # Claude Code's max_tokens 32000, over the daemon's context: answered up to its end.
            room = longest + ROOM - start.input_tokens
            assert body["max_tokens"] == 32000 and 0 < whole.usage.output_tokens <= room
            assert (whole.stop_reason == "max_tokens") == (whole.usage.output_tokens == room)
    # The template opens the thinking block: every answer but one that closed it at once thinks.
    assert len(thought) >= 4, thought
    # A screenshot of megabytes (past the daemon's message limit): a line of text for the daemon.
    big = claude_code("04_later_turn.json")
    shot = next(b for b in big["body"]["messages"][-1]["content"] if b["type"] == "image")
    shot["source"]["data"] = "iVBO" * (1 << 20)
    big["body"]["max_tokens"] = 1
    assert len(json.dumps(big["body"])) > 4 * proto.MAX_MESSAGE_BYTES
    assert _whole(an, big).usage.output_tokens == 1
    log = (paths.dir / "gateway.log").read_text()
    assert "web_search (web_search_20250305)" in log  # the server tool, left out with a log line


def test_the_later_turns_parts_reach_the_template(tokenizer):
    """The later turn as the daemon renders it: the mid-conversation system message as
    user text in its place, images as placeholders, the text document's text, earlier
    thinking as the turns' reasoning, no redacted thinking."""
    body = claude_code("04_later_turn.json")["body"]
    req = anth.parse_request(body, count_only=True)
    g = req.text_only
    assert g is not None and any(m.get("images") for m in req.generate["messages"])
    text = render_chat(tokenizer, g["messages"], g["tools"], thinking=g["thinking"])
    assert text.count("[image (image/png): not shown, this model reads text only]") == 2
    assert "versions.txt\n\npytest 8.3.3" in text
    assert "<|im_start|>system\n<system-reminder>\nThe TodoWrite" not in text
    assert "</tool_response><|im_end|>\n<|im_start|>user\n<system-reminder>\nThe TodoWrite" in text
    assert "<think>\nThe user wants the failing test fixed." in text and "EmwKAhgB" not in text
    assert text.endswith("why does it still fail?<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_count_tokens_never_waits_on_the_engine(served, clients, tokenizer):
    """count_tokens is answered by the prompt-check thread: while the engine prefills a
    long prompt (the count is back before that request's first token), without a request
    of the engine's (its counter does not move), and for a prompt over the daemon's
    context, which a generate request is refused."""
    paths, gateway = served
    an = clients[0]
    later = claude_code("04_later_turn.json")["body"]
    # No tools, another system prompt: nothing of it is in the prompt cache, all of it is prefilled.
    body = {"model": later["model"], "max_tokens": 2, "system": "Be brief.", "messages": later["messages"]}
    whole = json.loads((DATA / "01_first_turn.json").read_text())["body"]  # not shortened: past the context
    count = {k: whole[k] for k in ("model", "system", "messages", "tools", "thinking")}
    with Client(paths) as c:
        context = c.status().context.tokens
    assert prompt_tokens(tokenizer, count) > context
    start = _requests(paths)
    stream = an.beta.messages.create(**body, stream=True)  # returns once the daemon has accepted it
    arrived: dict[str, float] = {}

    def read() -> None:
        for event in stream:
            arrived.setdefault(event.type, time.monotonic())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        # The status is a snapshot the engine publishes: it counts the stream's request a
        # moment after the acceptance (a loaded CI run read it before that once).
        deadline = time.monotonic() + 60
        while (before := _requests(paths)) == start and time.monotonic() < deadline:
            time.sleep(0.01)
        assert before == start + 1
        tic = time.monotonic()
        n = an.beta.messages.count_tokens(**count).input_tokens
        answered = time.monotonic()
        assert n == prompt_tokens(tokenizer, count)
        assert _requests(paths) == before
    finally:
        reader.join()
    assert "message_stop" in arrived
    # The prefill ran on for seconds after the count came back (a count queued behind it
    # would come after its first token).
    assert answered < arrived["content_block_start"], (answered - tic, arrived["content_block_start"] - tic)
    with pytest.raises(anthropic.BadRequestError, match="context"):
        an.messages.create(**count, max_tokens=1)


# ---- thinking through every API ------------------------------------------------------------


def test_thinking_through_each_api_equals_the_daemons_split(served, clients, store, tokenizer):
    """A thinking model's reasoning apart from its answer in each API's own shape
    (Anthropic's thinking blocks, OpenAI's reasoning_content, Ollama's message.thinking),
    streamed and not, with the template's switch on and off; any model name."""
    paths, _ = served
    an, oa, ol = clients
    reasoning, answer = _reference(store, paths, tokenizer, None)
    assert reasoning and answer  # the fixture's answer closes its reasoning, then answers
    off = _reference(store, paths, tokenizer, False)
    assert off[0] == "" and off[1]
    system, user = CHAT[0]["content"], CHAT[1:]

    # Anthropic's newest package takes temperature only as an extra field of the body.
    args = dict(model="claude-opus-4-1", max_tokens=N, system=system, messages=user, extra_body={"temperature": 0})
    for thinking, want in (({"type": "adaptive"}, (reasoning, answer)), ({"type": "disabled"}, off)):
        message = an.messages.create(**args, thinking=thinking)
        assert message.model == "claude-opus-4-1"
        got = {b.type: getattr(b, "thinking", None) or getattr(b, "text", None) for b in message.content}
        assert (got.get("thinking", ""), got["text"]) == want
        with an.messages.stream(**args, thinking=thinking) as stream:
            final = stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]

    out = oa.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=N, temperature=0)
    assert out.model == "gpt-5"
    assert (out.choices[0].message.reasoning_content, out.choices[0].message.content) == (reasoning, answer)
    chunks = list(oa.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=N, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == answer
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        plain = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=N, temperature=0, extra_body=extra)
        assert getattr(plain.choices[0].message, "reasoning_content", None) is None
        assert plain.choices[0].message.content == off[1]
    low = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=N, temperature=0, reasoning_effort="low")
    assert low.choices[0].message.reasoning_content == reasoning

    options = {"num_predict": N, "temperature": 0}
    reply = ol.chat(model="qwen3:30b", messages=CHAT, options=options, think=True)
    assert reply.model == "qwen3:30b" and (reply.message.thinking, reply.message.content) == (reasoning, answer)
    parts = list(ol.chat(model="qwen3:30b", messages=CHAT, options=options, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reasoning
    assert "".join(p.message.content for p in parts) == answer
    reply = ol.chat(model="qwen3:30b", messages=CHAT, options=options, think=False)
    assert reply.message.thinking is None and reply.message.content == off[1]


def test_earlier_reasoning_goes_back_to_the_template(served, clients, tokenizer):
    """An assistant turn's reasoning, as each API sends it back, is rendered where the
    template renders reasoning: the counted prompts of the three shapes agree."""
    an, oa, ol = clients
    turn = [*CHAT[1:], {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    thought = "The user asks for a capital."
    with_reasoning = [dict(m) for m in turn]
    with_reasoning[1]["reasoning"] = thought
    expected = len(tokenizer.encode(render_chat(tokenizer, with_reasoning), add_special_tokens=False))
    assert expected > len(tokenizer.encode(render_chat(tokenizer, turn), add_special_tokens=False))
    blocks = [{"type": "thinking", "thinking": thought, "signature": "x"}, {"type": "text", "text": "Paris."}]
    anthropic_turn = [turn[0], {"role": "assistant", "content": blocks}, turn[2]]
    assert an.messages.count_tokens(model="m", messages=anthropic_turn).input_tokens == expected
    openai_turn = [turn[0], {"role": "assistant", "content": "Paris.", "reasoning_content": thought}, turn[2]]
    out = oa.chat.completions.create(model="m", messages=openai_turn, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == expected
    ollama_turn = [turn[0], {"role": "assistant", "content": "Paris.", "thinking": thought}, turn[2]]
    reply = ol.chat(model="m", messages=ollama_turn, options={"num_predict": 1, "temperature": 0})
    assert reply.prompt_eval_count == expected


def test_top_k_reaches_the_sampler_in_each_api(served, clients, store, tokenizer):
    """top_k 1 at temperature 1 is the greedy answer whatever the seed (the likeliest
    token is the only one kept); without it, the same seeds sample other text."""
    paths, _ = served
    an, oa, ol = clients
    greedy = _reference(store, paths, tokenizer, False)[1]
    off = {"type": "disabled"}
    system, user = CHAT[0]["content"], CHAT[1:]
    args = dict(model="m", max_tokens=N, system=system, messages=user, thinking=off)
    out = an.messages.create(**args, extra_body={"temperature": 1.0, "top_k": 1})
    assert [b.text for b in out.content] == [greedy]
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    sampled = []
    for seed in (1, 2, 3):
        kw = dict(model="m", messages=CHAT, max_tokens=N, temperature=1.0, seed=seed)
        out = oa.chat.completions.create(**kw, extra_body=no_think | {"top_k": 1})
        assert out.choices[0].message.content == greedy
        sampled.append(oa.chat.completions.create(**kw, extra_body=no_think).choices[0].message.content)
    assert any(s != greedy for s in sampled)
    options = {"num_predict": N, "temperature": 1.0, "top_k": 1, "seed": 5}
    assert ol.chat(model="m", messages=CHAT, options=options, think=False).message.content == greedy


def test_any_model_name_and_listings_say_context_and_capabilities(served, clients):
    paths, gateway = served
    an, oa, ol = clients
    with Client(paths) as c:
        st = c.status()
    assert st.capabilities == {"chat": True, "tools": True, "thinking": True, "vision": False}
    context = st.context.tokens
    listed = oa.models.list().data[0]
    assert listed.context_length == context and listed.capabilities == ["completion", "tools", "thinking"]
    assert oa.models.retrieve("claude-sonnet-4-5").id == "claude-sonnet-4-5"
    shown = ol.show("llama3:8b")
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert shown.modelinfo["moestream.context_length"] == context
    tags = httpx.get(gateway.url + "/api/tags", headers={"Authorization": f"Bearer {KEY}"}).json()["models"]
    assert tags[0]["capabilities"] == ["completion", "tools", "thinking"] and tags[0]["context_length"] == context


def test_the_daemon_sends_accepted_then_reasoning_tokens(served):
    """The protocol's side: `accepted` with the prompt's length first, reasoning tokens
    marked, `done` holding the reasoning apart from the answer."""
    paths, _ = served
    with Client(paths) as c:
        n = c.count_tokens(messages=CHAT)
        events = list(c.generate(messages=CHAT, max_tokens=N))
    assert isinstance(events[0], Accepted) and events[0].prompt_tokens == n
    done = events[-1]
    assert isinstance(done, Done) and done.stats.prompt_tokens == n
    tokens = [e for e in events if isinstance(e, Token)]
    assert "".join(e.text for e in tokens if e.reasoning) == done.reasoning
    assert "".join(e.text for e in tokens if not e.reasoning) == done.text
    assert done.reasoning and done.text and THINK_END not in done.reasoning + done.text


def test_count_tokens_of_an_unloaded_model_loads_it(store):
    """A count that finds the model unloaded (keep_alive) is answered once it is loaded."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mcu"))
    try:
        out = ctl("start", "--model", str(store), "--runtime-dir", str(rt), "--keep-alive", "0")
        assert out.returncode == 0, out.stdout + out.stderr
        paths = RuntimePaths(dir=rt, log=rt / "daemon.log")
        with Client(paths) as c:
            first = c.count_tokens(messages=CHAT)
            list(c.generate(messages=CHAT, max_tokens=1))
            wait_for(lambda: c.status().state == "unloaded", 30, "the model to unload")
            assert c.count_tokens(messages=CHAT, thinking=False) > first
            assert c.status().requests.requests == 1
    finally:
        ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)
