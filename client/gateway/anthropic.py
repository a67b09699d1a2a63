"""Anthropic's Messages API onto the gateway's one request path (daemon_link.py), no MLX, no I/O
of its own:

    POST /v1/messages               system, messages of text / image / document / tool_use /
                                    tool_result / thinking blocks, tools, tool_choice,
                                    thinking, max_tokens, stop_sequences, temperature, top_p,
                                    top_k, stream (Anthropic's event sequence),
                                    output_config.format (JSON of a schema, enforced);
                                    beyond Anthropic's, as on the OpenAI routes: min_p,
                                    presence_penalty, frequency_penalty,
                                    repetition_penalty, logit_bias, seed
    POST /v1/messages/count_tokens  the prompt's tokens, as the daemon counts them

Requests are taken as Claude Code sends them (tests/data/claude_code/): `cache_control` on
any block, `metadata`, the `anthropic-beta` / `anthropic-version` headers and other
fields that do not change the answer are accepted and ignored. A tool_use block becomes
an assistant message's tool call, a tool_result block a `tool` message, both rendered by
the model's chat template; the model's calls (parsed in the daemon) come back as
tool_use blocks with `stop_reason: "tool_use"`. Tools of Anthropic's own types (server
tools such as web search: they run on Anthropic's servers) are left out, with a log
line. A `system` message inside `messages` (Claude Code sends one mid-conversation) is
folded in where it stands, as user text, which every chat template takes and which
leaves the prompt before it (and its cached KV) as it was. Images and documents reach a
model that takes no images as a short text placeholder (a text document as its text);
bodies may be as large as Anthropic's own limit (MAX_BODY_BYTES), for the images.

`thinking` ({type: enabled | adaptive} or {type: disabled}) turns the chat template's
thinking switch on or off (absent: the model's default); a thinking model's reasoning
comes back as `thinking` blocks (streamed as `thinking_delta`, then a `signature_delta`:
a digest of the block, as only this server reads it), and earlier turns' thinking blocks
go back to the template as that turn's reasoning (`redacted_thinking` is dropped).
`max_tokens` past what the daemon's context leaves the prompt is lowered to it by the
daemon (Claude Code asks for 32000 whatever the model). Usage is Anthropic's:
`input_tokens` the prompt tokens not read from the daemon's prompt cache,
`cache_read_input_tokens` those read from it (the three input counts add up to the
prompt's length; `message_start` carries the whole prompt as `input_tokens`, before the
cache is looked up). Counting tokens renders and tokenizes the prompt in the daemon's
prompt-check thread (`Client.count_tokens`): no forward, milliseconds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...shared import protocol as proto
from ...shared.protocol import Done
from ..client import Accepted, Token, ToolCall
from . import images
from .call_texts import CallTexts
from .daemon_link import ApiError, ApiRequest, EventStream, bad_request, rest_of
from .keep_alive import KeepAlive
from .openai import _is_int, _number, declared_identity, json_constraint, sampling_controls, stop_strings_ok

if TYPE_CHECKING:
    from .daemon_link import DaemonRequest, Gateway

PREFIX = "/v1/messages"
MAX_TEMPERATURE = 1.0
# Anthropic's own request limit: Claude Code sends screenshots as base64 images, megabytes
# each and again in every later turn, which reach the daemon as a line of placeholder text.
MAX_BODY_BYTES = 32 << 20
THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}

log = logging.getLogger("moestream.anthropic")

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
}


def owns(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


# ---- requests ------------------------------------------------------------------------


def _placeholder(block: dict[str, Any]) -> str:
    """What a model without vision reads in place of an image or a binary document."""
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    media = source.get("media_type") or source.get("type") or "unknown"
    title = f" {block['title']!r}" if isinstance(block.get("title"), str) else ""
    return f"[{block['type']}{title} ({media}): not shown, this model reads text only]"


def _document_text(block: dict[str, Any], where: str) -> str:
    """A document or search result block as text: its title and its text, where it has
    text (a plain-text or content source); else a placeholder."""
    source = block.get("source")
    if block["type"] == "search_result":
        body = _text_of(block.get("content", []), f"{where}.content")
    elif isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif isinstance(source, dict) and source.get("type") == "content":
        body = _text_of(source.get("content", []), f"{where}.source.content")
    else:
        return _placeholder(block)
    title = block.get("title")
    return f"{title}\n\n{body}" if isinstance(title, str) and title else body


def _block_text(block: Any, where: str) -> str | None:
    """The text a content block puts in the prompt; None for a block that is not text
    (tool use, tool results, thinking: the caller's)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{where}: a text block has a 'text' string", where)
        return block["text"]
    if kind == "image":
        return _placeholder(block)
    if kind in ("document", "search_result"):
        return _document_text(block, where)
    if kind == "server_tool_use" or (isinstance(kind, str) and kind.endswith("_tool_result")):
        # The results of Anthropic's server tools, in a conversation begun with Anthropic.
        return f"[{kind}: not available on this server]"
    return None


def _image(block: dict[str, Any], where: str) -> proto.ImageData:
    """An image block's bytes: a base64 source (a URL source is refused: never fetched)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{where}: an image block has a 'source'", where)
    if source.get("type") == "url":
        return images.from_url(source.get("url"), f"{where}.source.url")  # a remote one is a 400
    if source.get("type") != "base64":
        raise bad_request(f"{where}.source: an image's source is {{type: 'base64', media_type, data}}", where)
    return images.from_base64(source.get("data"), f"{where}.source.data")


def _text_of(value: Any, where: str, pictures: list[proto.ImageData] | None = None) -> str:
    """A string, or a list of text-like blocks (text, image, document), as one string;
    with `pictures`, its image blocks are added to it instead of their placeholders."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, block in enumerate(value):
            if pictures is not None and isinstance(block, dict) and block.get("type") == "image":
                pictures.append(_image(block, f"{where}.{j}"))
                continue
            text = _block_text(block, f"{where}.{j}")
            if text is None:
                kind = block.get("type") if isinstance(block, dict) else None
                raise bad_request(f"{where}.{j}: content blocks of type {kind!r} are not supported here", where)
            parts.append(text)
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of content blocks", where)


def _message(
    m: Any, i: int, kept: CallTexts | None = None, client: str = "", vision: bool = True
) -> list[dict[str, Any]]:
    """One Anthropic message as the protocol's chat messages (tool results are `tool`
    turns; a system message is user text where it stands); a tool_use block whose text
    `kept` has for `client` comes with it (`call_texts`). `vision`: image blocks as the
    messages' `images`; else as placeholders (a model that reads text only)."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise bad_request(f"{where}: a message is {{role: 'user' | 'assistant', content}}", where)
    role, content = m["role"], m.get("content")
    if role == "system":
        return [{"role": "user", "content": _text_of(content, f"{where}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    sampled: list[str | None] = []  # the text the model wrote for each call, where kept
    pictures: list[proto.ImageData] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if vision and kind == "image" and role == "user":
            pictures.append(_image(block, at))
            continue
        text = _block_text(block, at)
        if text is not None:
            texts.append(text)
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(block.get("name"), str) and block["name"] and isinstance(block.get("input"), dict)):
                raise bad_request(f"{at}: a tool_use block has a 'name' and an 'input' object", at)
            calls.append({"name": block["name"], "arguments": block["input"]})
            sampled.append(kept.find(client, block.get("id"), block["name"], block["input"]) if kept else None)
        elif kind == "tool_result" and role == "user":
            tool_id = block.get("tool_use_id")
            if not (isinstance(tool_id, str) and 0 < len(tool_id) <= proto.MAX_NAME_CHARS):
                raise bad_request(f"{at}: a tool_result block has a 'tool_use_id'", at)
            shown: list[proto.ImageData] | None = [] if vision else None
            result = _text_of(block.get("content", ""), f"{at}.content", shown)
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "content": result, "tool_call_id": tool_id})
            if shown:
                out[-1]["images"] = shown
        elif kind == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{at}: a thinking block has a 'thinking' string", at)
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by Anthropic: nothing a template can render
        else:
            raise bad_request(f"{at}: content blocks of type {kind!r} are not supported here", at)
    if texts or calls or thoughts or pictures or not out:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if pictures:
            msg["images"] = pictures
        if calls:
            msg["tool_calls"] = calls
        if any(t is not None for t in sampled):
            msg["call_texts"] = sampled
        if thoughts:
            msg["reasoning"] = "\n\n".join(thoughts)
        out.append(msg)
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list) or len(tools) > proto.MAX_TOOLS):
        raise bad_request(f"'tools' must be a list of at most {proto.MAX_TOOLS} tools", "tools")
    schemas, skipped = [], []
    for i, t in enumerate(tools or ()):
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"]):
            raise bad_request(f"tools.{i}: a tool is {{name, description, input_schema}}", "tools")
        if t.get("type") not in (None, "custom"):
            skipped.append(f"{t['name']} ({t['type']})")
            continue
        if not isinstance(t.get("input_schema", {}), dict):
            raise bad_request(f"tools.{i}.input_schema must be a JSON schema object", "tools")
        fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("input_schema", {})}
        schemas.append({"type": "function", "function": fn})
    if skipped:
        log.info("tools of Anthropic's own types left out (this server runs client tools only): %s", ", ".join(skipped))
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "any", "tool", "none"):
        raise bad_request(
            "'tool_choice' must be {type: 'auto' | 'any' | 'none'} or {type: 'tool', name}", "tool_choice"
        )
    if not schemas:
        if kind in ("any", "tool"):
            raise bad_request("'tool_choice' any or tool needs 'tools'", "tool_choice")
        return {}
    names = [s["function"]["name"] for s in schemas]
    if kind == "tool" and choice.get("name") not in names:
        raise bad_request("'tool_choice' {type: 'tool', name} must name one of 'tools'", "tool_choice")
    mode: Any = {"any": "required", "none": "none"}.get(kind, "auto")
    if kind == "tool":
        mode = {"name": choice["name"]}
    return {"tools": schemas, "tool_choice": mode}


def _chat(
    body: dict[str, Any], kept: CallTexts | None = None, client: str = "", vision: bool = True
) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of {role, content}", "messages")
    if len(messages) > proto.MAX_MESSAGES:
        raise bad_request(f"{len(messages)} messages are over the limit of {proto.MAX_MESSAGES}", "messages")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            chat.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        for msg in _message(m, i, kept, client, vision):
            # Consecutive user turns are one (as Anthropic's API takes them): a folded
            # system message beside the user's own text.
            if chat and _plain_user(chat[-1]) and _plain_user(msg):
                chat[-1]["content"] = "\n\n".join(filter(None, (chat[-1]["content"], msg["content"])))
            else:
                chat.append(msg)
    if vision:
        images.count_images(chat)
    return chat


def _plain_user(msg: dict[str, Any]) -> bool:
    return msg["role"] == "user" and msg.keys() == {"role", "content"}


def _thinking(body: dict[str, Any]) -> bool | None:
    """The template's thinking switch from `thinking` (absent: the model's default)."""
    value = body.get("thinking")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    budget = value.get("budget_tokens") if isinstance(value, dict) else None
    if kind not in THINKING_TYPES or not (budget is None or (_is_int(budget) and budget >= 0)):
        raise bad_request(
            "thinking: must be {type: 'enabled', budget_tokens}, {type: 'adaptive'} or {type: 'disabled'}", "thinking"
        )
    return THINKING_TYPES[kind]


def _output_format(body: dict[str, Any]) -> dict[str, Any]:
    """`output_config.format` (structured outputs: {type: 'json_schema', schema}; the
    beta's top-level `output_format` too) as the daemon's constraint."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config: must be an object", "output_config")
    fmt = (config or {}).get("format", body.get("output_format"))
    if fmt is None:
        return {}
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and fmt.get("schema") is not None):
        raise bad_request("output_config.format: must be {type: 'json_schema', schema}", "output_config")
    return {"constraint": json_constraint(fmt["schema"], "output_config.format.schema")}


def parse_request(body: Any, *, count_only: bool = False, kept: CallTexts | None = None) -> ApiRequest:
    """A decoded JSON body of /v1/messages (or, `count_only`, of count_tokens: its
    `generate` then holds `Client.count_tokens`'s arguments); a resent tool_use block
    comes with the text the model wrote for it where `kept` has it."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a string", "model")
    client = declared_identity(body) or ""
    # A model that takes no images reads placeholders in their place (Claude Code sends
    # screenshots whatever the model): an image it could not read is no error for it.
    chat: list[dict[str, Any]] | None = None
    image_error = None
    try:
        chat = _chat(body, kept, client)
    except ApiError as e:
        image_error = e
    text_chat = _chat(body, kept, client, vision=False) if chat is None or any(m.get("images") for m in chat) else None
    kwargs: dict[str, Any] = {"messages": chat or text_chat, **_tools(body), "thinking": _thinking(body)}
    stream = False  # count_tokens: only the prompt
    if not count_only:
        max_tokens = body.get("max_tokens")
        if not (_is_int(max_tokens) and 1 <= max_tokens):
            raise bad_request("'max_tokens' is required: a whole number of at least 1", "max_tokens")
        if max_tokens > proto.MAX_TOKENS_LIMIT:
            raise bad_request(f"max_tokens: at most {proto.MAX_TOKENS_LIMIT}", "max_tokens")
        stop = body.get("stop_sequences") or []
        if not stop_strings_ok(stop):
            raise bad_request(
                f"stop_sequences: at most {proto.MAX_STOP_STRINGS} non-empty strings of at most "
                f"{proto.MAX_STOP_CHARS} characters",
                "stop_sequences",
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request("stream: must be true or false", "stream")
        top_k = body.get("top_k")
        if top_k is not None and not (_is_int(top_k) and 0 <= top_k < 2**31):
            raise bad_request("top_k: must be a whole number of at least 0", "top_k")
        kwargs |= _output_format(body) | {
            "max_tokens": max_tokens,
            # Anthropic's default temperature is 1.0, as OpenAI's.
            "temp": _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE, head="temperature:"),
            "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True, head="top_p:"),
            "top_k": top_k or None,
            "stop": stop,
            "sampling": sampling_controls(body),
        }
        seed = body.get("seed")
        if seed is not None:
            if not (_is_int(seed) and 0 <= seed < 2**63):
                raise bad_request("seed: must be a whole number in 0..2^63-1", "seed")
            kwargs["seed"] = seed
    return ApiRequest(
        chat=True,
        model=model,
        stream=stream,
        include_usage=False,
        generate=kwargs,
        client=client,
        text_only=None if text_chat is None else kwargs | {"messages": text_chat},
        image_error=image_error,
    )


# ---- responses -----------------------------------------------------------------------


def stop_reason(done: Done) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the daemon's done."""
    if done.tool_calls:
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    hit = done.stats.stop_string
    return ("stop_sequence", hit) if hit else ("end_turn", None)


def signature(thinking: str) -> str:
    """A thinking block's signature: Anthropic's proves that its servers wrote the block;
    this server reads none back, so a digest of the text stands in for it."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _tool_use(name: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": name, "input": {}}


def usage(done: Done) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens read from the daemon's prompt cache apart
    from the rest (the three input counts add up to the prompt's length)."""
    prompt, cached = done.stats.prompt_tokens, done.stats.cached_tokens
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(done.tokens),
    }


def message(msg_id: str, model: str, done: Done) -> dict[str, Any]:
    """The whole answer of a non-streaming request."""
    content: list[dict[str, Any]] = []
    if done.reasoning:
        content.append({"type": "thinking", "thinking": done.reasoning, "signature": signature(done.reasoning)})
    if done.text or not (done.tool_calls or done.reasoning):
        content.append({"type": "text", "text": done.text})
    for call in done.tool_calls:
        content.append(_tool_use(call["name"]) | {"input": json.loads(call["arguments"])})
    reason, sequence = stop_reason(done)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(done),
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class _Blocks:
    """The content blocks of a streamed answer: each piece of text goes to the open block
    of its kind (thinking or text), or closes it and opens one."""

    index: int = 0
    open: str | None = None  # "thinking" | "text"
    thought: list[str] = field(default_factory=list)  # the open thinking block's text
    calls: list[tuple[str, ToolCall]] = field(default_factory=list)  # (tool_use id, call) sent

    def piece(self, thinking: bool, text: str) -> Iterator[str]:
        kind = "thinking" if thinking else "text"
        if self.open != kind:
            yield from self.close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if thinking else {"type": "text", "text": ""}
            yield _event("content_block_start", {"index": self.index, "content_block": block})
            self.open = kind
        if thinking:
            self.thought.append(text)
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        yield _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> Iterator[str]:
        if self.open is None:
            return
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": signature("".join(self.thought))}
            yield _event("content_block_delta", {"index": self.index, "delta": delta})
            self.thought.clear()
        yield _event("content_block_stop", {"index": self.index})
        self.index, self.open = self.index + 1, None

    def tool(self, call: ToolCall) -> Iterator[str]:
        yield from self.close()
        block = _tool_use(call.name)
        self.calls.append((block["id"], call))
        yield _event("content_block_start", {"index": self.index, "content_block": block})
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        yield _event("content_block_delta", {"index": self.index, "delta": delta})
        yield _event("content_block_stop", {"index": self.index})
        self.index += 1


class AnthropicApi:
    """The Messages API's routes over a `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    def routes(self) -> list[Route]:
        return [
            Route(PREFIX, self.messages, methods=["POST"]),
            Route(PREFIX + "/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def messages(self, request: Request) -> Response:
        self._gw._authorize(request)
        body = await self._gw._read_json(request, MAX_BODY_BYTES)
        req = parse_request(body, kept=self._gw.call_texts)
        opened = await self._gw.open_request(request, req, "msg_")
        if opened is None:
            return Response(status_code=499)
        daemon, model = opened
        if not req.stream:
            done = await self._gw.whole(request, daemon)
            if done is None:
                return Response(status_code=499)
            answer = message(daemon.id, model, done)
            uses = [b for b in answer["content"] if b["type"] == "tool_use"]
            for block, call in zip(uses, done.tool_calls):
                self._gw.call_texts.keep(req.client, block["id"], call["name"], call["arguments"], call.get("text"))
            return JSONResponse(answer)
        head = await self._gw.first_event(request, daemon)
        if head is None:
            return Response(status_code=499)
        return EventStream(self._stream(daemon, model, head, req.client), daemon)

    async def count_tokens(self, request: Request) -> Response:
        self._gw._authorize(request)
        body = await self._gw._read_json(request, MAX_BODY_BYTES)
        req = parse_request(body, count_only=True, kept=self._gw.call_texts)
        return JSONResponse({"input_tokens": await self._gw.count_tokens(req)})

    async def _stream(self, daemon: DaemonRequest, model: str, head: Any, client: str = "") -> AsyncIterator[str]:
        """message_start (once the daemon has accepted the prompt: its length), then per
        block content_block_start / _delta* / _stop, then message_delta (stop reason,
        usage) and message_stop."""
        blocks = _Blocks()
        started = False
        sent: list[str] = []
        thought: list[str] = []
        try:
            async for event in self._gw.events(daemon, head):
                if not started and isinstance(event, (Accepted, Token, ToolCall, Done)):
                    started = True
                    prompt = event.prompt_tokens if isinstance(event, Accepted) else 0
                    yield _event("message_start", {"message": self._start(daemon.id, model, prompt)})
                if isinstance(event, KeepAlive):
                    yield _event("ping", {})
                pieces: list[tuple[bool, str]] = []
                if isinstance(event, Token) and event.text:
                    pieces.append((bool(event.reasoning), event.text))
                elif isinstance(event, Done) and event.finish_reason != "shutdown":
                    # Text held back for a possible stop string or marker: the rest of each.
                    pieces += [
                        (True, rest_of(event.reasoning, thought)),
                        (False, rest_of(event.text, sent)),
                    ]
                for thinking, text in pieces:
                    if text:
                        (thought if thinking else sent).append(text)
                        for line in blocks.piece(thinking, text):
                            yield line
                if isinstance(event, ToolCall):
                    for line in blocks.tool(event):
                        yield line
                    call_id, call = blocks.calls[-1]
                    self._gw.call_texts.keep(client, call_id, call.name, call.arguments, call.text)
        except ApiError as e:
            yield _event("error", {"error": error_body(e)["error"]})
            return
        if event.finish_reason == "shutdown":
            yield _event("error", {"error": {"type": "overloaded_error", "message": "the daemon shut down"}})
            return
        for line in blocks.close():
            yield line
        reason, sequence = stop_reason(event)
        delta = {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(event)}
        yield _event("message_delta", delta)
        yield _event("message_stop", {})

    @staticmethod
    def _start(msg_id: str, model: str, prompt_tokens: int) -> dict[str, Any]:
        use = {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        start = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": []}
        return start | {"stop_reason": None, "stop_sequence": None, "usage": use | {"output_tokens": 0}}
