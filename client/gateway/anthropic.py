"""Anthropic's Messages API onto the gateway's one request path (app.py), no MLX, no I/O
of its own:

    POST /v1/messages               system, messages of text / tool_use / tool_result blocks,
                                    tools, tool_choice, max_tokens, stop_sequences,
                                    temperature, top_p, stream (Anthropic's event sequence)
    POST /v1/messages/count_tokens  the prompt's tokens, as the daemon counts them

A tool_use block becomes an assistant message's tool call, a tool_result block a `tool`
message, both rendered by the model's chat template; the model's calls (parsed in the
daemon) come back as tool_use blocks with `stop_reason: "tool_use"`. Counting renders
and prefills the prompt in the daemon with one token to make (the daemon's tokenizer and
chat template are the only ones that count right), so it costs one prefill. Parameters
this server cannot honour (top_k, thinking, images, documents) are refused with a 400.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moestream.client.client import Token, ToolCall
from moestream.client.gateway.keep_alive import KeepAlive
from moestream.client.gateway.openai import ApiError, ApiRequest, bad_request
from moestream.shared import protocol as proto
from moestream.shared.protocol import Done

if TYPE_CHECKING:
    from moestream.client.gateway.app import DaemonRequest, Gateway

PREFIX = "/v1/messages"
MAX_TEMPERATURE = 1.0

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


def _text_of(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, block in enumerate(value):
            if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
                raise bad_request(f"{where}[{j}]: only text blocks are supported here", where)
            parts.append(block["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text blocks", where)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as the protocol's chat messages (tool results are `tool` turns)."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}: a message is {{role: 'user' | 'assistant', content}}", where)
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(block.get("name"), str) and block["name"] and isinstance(block.get("input"), dict)):
                raise bad_request(f"{at}: a tool_use block has a 'name' and an 'input' object", at)
            calls.append({"name": block["name"], "arguments": block["input"]})
        elif kind == "tool_result" and role == "user":
            tool_id = block.get("tool_use_id")
            if not (isinstance(tool_id, str) and 0 < len(tool_id) <= proto.MAX_NAME_CHARS):
                raise bad_request(f"{at}: a tool_result block has a 'tool_use_id'", at)
            result = block.get("content", "")
            text = _text_of(result, f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "content": text, "tool_call_id": tool_id})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's thinking is not part of the prompt
        else:
            raise bad_request(f"{at}: content blocks of type {kind!r} are not supported here", at)
    if texts or calls or not out:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice is not None and not (isinstance(choice, dict) and choice.get("type") in ("auto", "none")):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return {}
    if not isinstance(tools, list) or len(tools) > proto.MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {proto.MAX_TOOLS} tools", "tools")
    schemas = []
    for i, t in enumerate(tools):
        ok = isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"]
        if not (ok and isinstance(t.get("input_schema", {}), dict) and t.get("type") in (None, "custom")):
            raise bad_request(f"tools.{i}: a tool is {{name, description, input_schema}} (client tools only)", "tools")
        fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("input_schema", {})}
        schemas.append({"type": "function", "function": fn})
    names = [s["function"]["name"] for s in schemas]
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None or kind == "auto":
        mode: Any = "auto"
    elif kind == "none":
        mode = "none"
    elif kind == "any":
        mode = "required"
    elif kind == "tool" and choice.get("name") in names:
        mode = {"name": choice["name"]}
    else:
        raise bad_request(
            "'tool_choice' must be {type: 'auto' | 'any' | 'none'} or {type: 'tool', name} of one of 'tools'",
            "tool_choice",
        )
    return {"tools": schemas, "tool_choice": mode}


def _chat(body: dict[str, Any]) -> list[dict[str, Any]]:
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
        chat.extend(_message(m, i))
    return chat


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (low < value if low_open else low <= value)
    if not (ok and value <= high):
        raise bad_request(f"{name}: must be a number in {'(' if low_open else '['}{low}, {high}], got {value!r}", name)
    return float(value)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a string", "model")
    return model


def parse_request(body: Any, *, count_only: bool = False) -> ApiRequest:
    """A decoded JSON body of /v1/messages (or, `count_only`, of count_tokens)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = _model(body)
    kwargs: dict[str, Any] = {"messages": _chat(body), **_tools(body)}
    if count_only:
        return ApiRequest(
            chat=True, model=model, stream=False, include_usage=False, generate=kwargs | {"max_tokens": 1}
        )
    max_tokens = body.get("max_tokens")
    if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 1 <= max_tokens):
        raise bad_request("'max_tokens' is required: a whole number of at least 1", "max_tokens")
    if max_tokens > proto.MAX_TOKENS_LIMIT:
        raise bad_request(f"max_tokens: at most {proto.MAX_TOKENS_LIMIT}", "max_tokens")
    stop = body.get("stop_sequences") or []
    if not (
        isinstance(stop, list)
        and len(stop) <= proto.MAX_STOP_STRINGS
        and all(isinstance(s, str) and 0 < len(s) <= proto.MAX_STOP_CHARS for s in stop)
    ):
        raise bad_request(
            f"stop_sequences: at most {proto.MAX_STOP_STRINGS} non-empty strings of at most "
            f"{proto.MAX_STOP_CHARS} characters",
            "stop_sequences",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be true or false", "stream")
    for name in ("top_k", "thinking"):
        if body.get(name) is not None and body.get(name) != {"type": "disabled"}:
            raise bad_request(f"{name}: not supported by this server", name)
    kwargs |= {
        "max_tokens": max_tokens,
        # Anthropic's default temperature is 1.0, as OpenAI's.
        "temp": _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE, False),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, True),
        "stop": stop,
    }
    return ApiRequest(chat=True, model=model, stream=stream, include_usage=False, generate=kwargs)


# ---- responses -----------------------------------------------------------------------


def stop_reason(done: Done) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the daemon's done."""
    if done.tool_calls:
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    hit = done.stats.get("stop_string")
    return ("stop_sequence", hit) if hit else ("end_turn", None)


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call["name"], "input": {}}


def _usage(done: Done) -> dict[str, int]:
    return {"input_tokens": int(done.stats.get("prompt_tokens", 0)), "output_tokens": len(done.tokens)}


def message(msg_id: str, model: str, done: Done) -> dict[str, Any]:
    """The whole answer of a non-streaming request."""
    content: list[dict[str, Any]] = [{"type": "text", "text": done.text}] if done.text or not done.tool_calls else []
    for call in done.tool_calls:
        content.append(_tool_use(call) | {"input": json.loads(call["arguments"])})
    reason, sequence = stop_reason(done)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(done),
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


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
        req = parse_request(await self._gw._read_json(request))
        opened = await self._gw.open_request(request, req, "msg_")
        if opened is None:
            return Response(status_code=499)
        daemon, model = opened
        if not req.stream:
            done = await self._gw.whole(request, daemon)
            if done is None:
                return Response(status_code=499)
            return JSONResponse(message(daemon.id, model, done))
        head = await self._gw.first_event(request, daemon)
        if head is None:
            return Response(status_code=499)
        return self._gw.stream(self._stream(daemon, model, head), daemon)

    async def count_tokens(self, request: Request) -> Response:
        self._gw._authorize(request)
        req = parse_request(await self._gw._read_json(request), count_only=True)
        opened = await self._gw.open_request(request, req, "count_")
        if opened is None:
            return Response(status_code=499)
        done = await self._gw.whole(request, opened[0])
        if done is None:
            return Response(status_code=499)
        return JSONResponse({"input_tokens": int(done.stats.get("prompt_tokens", 0))})

    async def _stream(self, daemon: DaemonRequest, model: str, head: Any) -> AsyncIterator[str]:
        """message_start, then per block content_block_start / _delta* / _stop, then
        message_delta (stop reason, usage) and message_stop."""
        start = {"id": daemon.id, "type": "message", "role": "assistant", "model": model, "content": []}
        start |= {"stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        yield _event("message_start", {"message": start})
        index, text_open = 0, False
        sent: list[str] = []
        try:
            async for event in self._gw.events(daemon, head):
                if isinstance(event, KeepAlive):
                    yield _event("ping", {})
                pieces: list[str] = []
                if isinstance(event, Token) and event.text:
                    pieces.append(event.text)
                elif isinstance(event, Done) and event.finish_reason != "shutdown":
                    pieces.append(self._gw.rest_of(event, sent))
                for text in filter(None, pieces):
                    if not text_open:
                        yield _event(
                            "content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}}
                        )
                        text_open = True
                    sent.append(text)
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": text}})
                if isinstance(event, ToolCall):
                    if text_open:
                        yield _event("content_block_stop", {"index": index})
                        index, text_open = index + 1, False
                    yield _event(
                        "content_block_start", {"index": index, "content_block": _tool_use({"name": event.name})}
                    )
                    delta = {"type": "input_json_delta", "partial_json": event.arguments}
                    yield _event("content_block_delta", {"index": index, "delta": delta})
                    yield _event("content_block_stop", {"index": index})
                    index += 1
        except ApiError as e:
            yield _event("error", {"error": error_body(e)["error"]})
            return
        if event.finish_reason == "shutdown":
            yield _event("error", {"error": {"type": "overloaded_error", "message": "the daemon shut down"}})
            return
        if text_open:
            yield _event("content_block_stop", {"index": index})
        reason, sequence = stop_reason(event)
        usage = _usage(event)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
        yield _event("message_stop", {})
