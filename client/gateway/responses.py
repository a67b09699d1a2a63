"""OpenAI's Responses API (`POST /v1/responses`, what Codex CLI speaks) onto the gateway's
one request path (daemon_link.py), no MLX, no I/O of its own.

Stateless, as Codex uses it with `store: false`: every request carries the whole
conversation in `input`. `instructions` and the leading `system`/`developer` messages
become the chat's first system message (later ones stay system turns where they are);
message items (text parts `input_text`/`output_text`), `function_call` and
`custom_tool_call` items (an assistant's tool calls), `function_call_output` and
`custom_tool_call_output` items (`tool` turns) are rendered by the model's chat template.
`reasoning` items are left out of the prompt (chat templates drop an earlier turn's
reasoning; their `encrypted_content` is another server's).

Tools: `function` tools as they are; a `custom` (free-form) tool, such as Codex's
`apply_patch` with its Lark grammar, goes to the template as a function of one string
parameter `input` (the grammar in its description), and the model's call of it comes
back as a `custom_tool_call` with that `input`. Built-in tool types (`web_search`,
`local_shell`, `file_search`, ...) are not run here: they are left out of the prompt,
with a note in the log the first time each type is seen. `tool_choice`: auto, none,
required, a named function or custom tool, `allowed_tools`.

The answer: a `reasoning` item (a thinking model's reasoning, as `reasoning_text`
content, or as its summary when the request asks `reasoning.summary`: there is no other
summary to give), then the `message` and the call items in the order the model made
them, streamed as the events the `openai` package folds into `response.completed`
(`response.incomplete` when `max_output_tokens` cut the answer, `response.failed` when
the daemon failed after the stream began), each with its `sequence_number`.

Accepted and used: `model`, `input`, `instructions`, `tools`, `tool_choice`,
`max_output_tokens` (default DEFAULT_MAX_OUTPUT_TOKENS), `temperature`, `top_p`,
`stream`, `text.format` (json_object, json_schema {name, schema, strict}: the answer
enforced as JSON of the schema), `reasoning.effort` ("none" and "minimal" turn the template's
thinking switch off, the others on; absent: the template's default), `include`'s
"message.output_text.logprobs" with `top_logprobs` (each token's log-probability in the
output text's `logprobs`, and in its deltas), and as on the chat route `top_k`, `min_p`,
the penalties, `logit_bias` and `seed`. Accepted and ignored, harmless
here: `store` (nothing is stored either way), the rest of `include` (no encrypted
reasoning is made), `parallel_tool_calls` (the model makes the calls it makes),
`prompt_cache_key` (the daemon's prompt cache matches by prefix on its own),
`text.verbosity`, `truncation`, `metadata`, `user`, `safety_identifier`, `service_tier`,
`max_tool_calls`, `stream_options`, `context_management`. Refused with a 400:
`previous_response_id` and `conversation` (nothing is stored: send the whole
conversation), `background`, `prompt` (stored prompts), image, file and audio input,
`item_reference` items.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...shared import protocol as proto
from ...shared.protocol import Done
from ..client import Token, ToolCall
from . import images
from .call_texts import CallTexts
from .daemon_link import ApiError, ApiRequest, EventStream, bad_request, rest_of, shutdown_error
from .keep_alive import KeepAlive
from .openai import (
    DEFAULT_TEMPERATURE,
    MAX_TEMPERATURE,
    _flag,
    _max_tokens,
    _number,
    _object,
    _seed,
    chat_logprobs,
    declared_identity,
    json_arguments,
    json_constraint,
    sampling_controls,
    tool_call_id,
    top_k,
    top_logprobs,
)

if TYPE_CHECKING:
    from .daemon_link import DaemonRequest, Gateway

PATH = "/v1/responses"
# OpenAI's default is the model's whole output budget; the daemon refuses a prompt whose
# length plus max_tokens is over its context, so the default leaves most of it to the prompt.
DEFAULT_MAX_OUTPUT_TOKENS = 4096
# The free-form tool's one parameter, as the chat template sees it.
CUSTOM_INPUT = "input"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# (field, the values that leave the answer unchanged): anything else is refused.
_REFUSED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    (
        "previous_response_id",
        (None,),
        "this server keeps no responses: send the whole conversation in 'input' (as Codex does with store: false)",
    ),
    ("conversation", (None,), "this server keeps no conversations: send the whole conversation in 'input'"),
    ("background", (None, False), "background responses are not supported by this server"),
    ("prompt", (None,), "stored prompts are not supported by this server: send 'instructions' and 'input'"),
)

log = logging.getLogger("moestream.openai")
_noted: set[str] = set()  # built-in tool types already noted in the log
MAX_NOTED = 64


@dataclass(frozen=True)
class ResponsesRequest:
    """One validated Responses request: what goes to the daemon, and what shapes the answer."""

    api: ApiRequest
    custom_tools: frozenset[str]  # names of free-form tools: their calls come back as custom_tool_call
    summary: bool  # reasoning as a summary (the request asked for one) rather than as reasoning_text
    echo: dict[str, Any] = field(default_factory=dict)  # the request's fields the Response object repeats
    logprobs: bool = False  # include: message.output_text.logprobs


# ---- requests ------------------------------------------------------------------------


def _text_of(content: Any, where: str, pictures: list[proto.ImageData] | None = None) -> str:
    """A message's content (a string or a list of text parts) as one string; with
    `pictures`, its `input_image` parts (data URLs) are added to it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_file", "input_audio") or (kind == "input_image" and pictures is None):
            raise bad_request(f"{where}[{j}]: {kind} is not supported here (this server reads text and images)", where)
        elif kind == "input_image":
            assert pictures is not None
            pictures.append(images.from_url(part.get("image_url"), f"{where}[{j}].image_url"))
        else:
            raise bad_request(f"{where}[{j}] must be a text part {{type: 'input_text', text}}, got {kind!r}", where)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str, limit: int | None = None) -> str:
    value = item.get(key)
    if not (isinstance(value, str) and value and (limit is None or len(value) <= limit)):
        bound = f" of at most {limit} characters" if limit else ""
        raise bad_request(f"{where}.{key} must be a non-empty string{bound}", f"{where}.{key}")
    return value


class _Chat:
    """The chat messages the daemon renders, built item by item."""

    def __init__(self, instructions: str) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        self._names: dict[str, str] = {}  # call_id -> the called tool's name, for its result

    def message(self, role: str, text: str, pictures: list[proto.ImageData] | None = None) -> None:
        if role == "system" and all(m["role"] == "system" for m in self.messages) and not pictures:
            # Templates take one system message, first: the leading ones are folded into it.
            if self.messages:
                self.messages[0]["content"] += "\n\n" + text
                return
        msg: dict[str, Any] = {"role": role, "content": text}
        if pictures:
            msg["images"] = pictures
        self.messages.append(msg)

    def call(self, name: str, arguments: dict[str, Any], call_id: str, text: str | None = None) -> None:
        """A call of the assistant's: with the assistant's message it follows, if any;
        `text`: the model's own text of it, where the gateway kept it (call_texts.py)."""
        self._names[call_id] = name
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        calls = last.setdefault("tool_calls", [])
        texts = last.get("call_texts") or [None] * len(calls)
        calls.append({"name": name, "arguments": arguments})
        if text is not None or "call_texts" in last:
            last["call_texts"] = [*texts, text]

    def result(self, call_id: str, text: str) -> None:
        msg = {"role": "tool", "content": text, "tool_call_id": call_id}
        if call_id in self._names:
            msg["name"] = self._names[call_id]
        self.messages.append(msg)


def _output_text(item: dict[str, Any], where: str) -> str:
    """A tool call's output: a string or a list of text parts."""
    output = item.get("output")
    if output is None:
        raise bad_request(f"{where}.output is required: the tool's output", f"{where}.output")
    return _text_of(output, f"{where}.output")


def _input(body: dict[str, Any], kept: CallTexts | None = None, client: str = "") -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    chat = _Chat(instructions or "")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' is required: a string or a non-empty list of input items", "input")
    if len(items) > proto.MAX_MESSAGES:
        raise bad_request(f"{len(items)} input items are over the limit of {proto.MAX_MESSAGES}", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item)", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise bad_request(f"{where}.role must be one of {list(_ROLES)}", f"{where}.role")
            pictures: list[proto.ImageData] = []
            chat.message(role, _text_of(item.get("content"), f"{where}.content", pictures), pictures)
        elif kind == "function_call":
            name = _string(item, "name", where, proto.MAX_NAME_CHARS)
            call_id = _string(item, "call_id", where, proto.MAX_NAME_CHARS)
            arguments = json_arguments(item.get("arguments", "{}"), f"{where}.arguments", f"{where}.arguments")
            chat.call(name, arguments, call_id, kept.find(client, call_id, name, arguments) if kept else None)
        elif kind == "custom_tool_call":
            name = _string(item, "name", where, proto.MAX_NAME_CHARS)
            call_id = _string(item, "call_id", where, proto.MAX_NAME_CHARS)
            if not isinstance(item.get("input"), str):
                raise bad_request(f"{where}.input must be a string", f"{where}.input")
            arguments = {CUSTOM_INPUT: item["input"]}
            chat.call(name, arguments, call_id, kept.find(client, call_id, name, arguments) if kept else None)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            chat.result(_string(item, "call_id", where, proto.MAX_NAME_CHARS), _output_text(item, where))
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning is not part of the prompt
        elif kind == "item_reference":
            raise bad_request(f"{where}: this server keeps no items to refer to: send the item itself", where)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported by this server", where)
    if not any(m["role"] != "system" for m in chat.messages):
        raise bad_request("'input' holds no message, call or tool output to answer", "input")
    images.count_images(chat.messages)
    return chat.messages


def _custom_schema(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A free-form tool as a function of one string parameter, its format described."""
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise bad_request(f"tools[{i}].format must be {{type: 'text'}} or {{type: 'grammar', ...}}", "tools")
    about = "The tool's input, as plain text (not JSON)"
    if fmt["type"] == "grammar":
        if not isinstance(fmt.get("definition"), str):
            raise bad_request(f"tools[{i}].format.definition must be the grammar's text", "tools")
        about += f", in this {fmt.get('syntax', 'lark')} grammar:\n{fmt['definition']}"
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": about}},
        "required": [CUSTOM_INPUT],
    }
    return {"name": tool["name"], "description": tool.get("description") or "", "parameters": parameters}


def _tools(body: dict[str, Any]) -> tuple[dict[str, Any], frozenset[str], list[dict[str, Any]]]:
    """(Client.generate's tools and tool_choice, the free-form tools' names, the tools the
    Response object repeats)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not isinstance(tools, list) or len(tools) > proto.MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {proto.MAX_TOOLS} tools", "tools")
    schemas: dict[str, dict[str, Any]] = {}
    custom: set[str] = set()
    kept: list[dict[str, Any]] = []
    skipped: list[str] = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"tools[{i}] must be an object with a 'type'", "tools")
        if kind not in ("function", "custom"):
            skipped.append(kind)
            continue
        name = _string(t, "name", f"tools[{i}]", proto.MAX_NAME_CHARS)
        if name in schemas:
            raise bad_request(f"tools[{i}]: two tools are named {name!r}", "tools")
        if kind == "function":
            if not isinstance(t.get("parameters") or {}, dict):
                raise bad_request(f"tools[{i}].parameters must be a JSON schema object", "tools")
            fn = {"name": name, "description": t.get("description") or "", "parameters": t.get("parameters") or {}}
        else:
            fn = _custom_schema(t, i)
            custom.add(name)
        schemas[name] = {"type": "function", "function": fn}
        kept.append(t)
    new = {kind[:64] for kind in skipped} - _noted
    if new and len(_noted) < MAX_NOTED:  # a client sending made-up types must not grow the set
        _noted.update(new)
        log.info("tools of type %s skipped: this server runs function and custom tools only", ", ".join(sorted(new)))
    chosen, names = _tool_choice(choice)
    if names is not None:
        unknown = [n for n in names if n not in schemas]
        if unknown:
            raise bad_request(f"'tool_choice' names {unknown[0]!r}, which is not among the function or custom tools")
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            schemas = {n: s for n, s in schemas.items() if n in names}
    if not schemas:
        if chosen not in ("auto", "none"):
            raise bad_request("'tool_choice' needs function or custom tools in 'tools'", "tool_choice")
        return {}, frozenset(), kept
    return {"tools": list(schemas.values()), "tool_choice": chosen}, frozenset(custom), kept


def _tool_choice(choice: Any) -> tuple[Any, list[str] | None]:
    """(the protocol's tool_choice, the tool names it refers to, if any)."""
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}, [choice["name"]]
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required") and isinstance(choice.get("tools"), list):
        names = [t.get("name") if isinstance(t, dict) else None for t in choice["tools"]]
        if all(isinstance(n, str) for n in names):
            return choice["mode"], names
    if isinstance(kind, str) and kind not in ("function", "custom", "allowed_tools"):
        raise bad_request(f"'tool_choice' names the built-in tool type {kind!r}, which this server does not run")
    raise bad_request(
        "'tool_choice' must be 'auto', 'none', 'required', {type: 'function' | 'custom', name} or "
        "{type: 'allowed_tools', mode, tools}",
        "tool_choice",
    )


def _reasoning(body: dict[str, Any]) -> tuple[bool | None, bool, dict[str, Any] | None]:
    """(the template's thinking switch, whether a summary was asked for, the echo)."""
    reasoning = _object(body, "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"'reasoning.effort' must be one of {list(EFFORTS)}, got {effort!r}", "reasoning.effort")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary not in (None, "none", *SUMMARIES):
        raise bad_request(f"'reasoning.summary' must be one of {list(SUMMARIES)}, got {summary!r}", "reasoning")
    summary = None if summary == "none" else summary
    thinking = None if effort is None else effort not in ("none", "minimal")
    echo = {"effort": effort, "summary": summary} if body.get("reasoning") is not None else None
    return thinking, summary is not None, echo


def _text(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`text`: its echo in the response, and its `format` (text, json_object, or
    json_schema {name, schema, strict}) as the daemon's constraint."""
    text = _object(body, "text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        fmt, constraint = {"type": "text"}, {}
    elif kind == "json_object":
        constraint = {"constraint": json_constraint(None, "text.format")}
    elif kind == "json_schema":
        if fmt.get("schema") is None:
            raise bad_request("'text.format' json_schema needs 'schema'", "text.format")
        constraint = {"constraint": json_constraint(fmt["schema"], "text.format.schema")}
    else:
        raise bad_request(
            f"'text.format' must be of type 'text', 'json_object' or 'json_schema', not {kind!r}", "text.format"
        )
    verbosity = text.get("verbosity")
    if verbosity not in (None, "low", "medium", "high"):
        raise bad_request("'text.verbosity' must be 'low', 'medium' or 'high'", "text.verbosity")
    return {"format": fmt, "verbosity": verbosity or "medium"}, constraint


def parse_request(body: Any, call_texts: CallTexts | None = None) -> ResponsesRequest:
    """Validate a decoded JSON body of POST /v1/responses; a resent function call comes
    with the text the model wrote for it where `call_texts` has it (for the conversation's
    `prompt_cache_key`, Codex's id of it, else the `user`)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    for name, neutral, why in _REFUSED:
        value = body.get(name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
            raise bad_request(f"'{name}': {why}", name, "unsupported_parameter")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad_request("'include' must be a list of strings", "include")
    logprobs = "message.output_text.logprobs" in include
    k = top_logprobs(body)
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise bad_request("'prompt_cache_key' must be a string", "prompt_cache_key")
    max_output = _max_tokens(body, "max_output_tokens")
    stream = _flag(body, "stream", False)
    client = declared_identity(body) or ""
    messages = _input(body, call_texts, client)
    tools, custom, kept = _tools(body)
    thinking, summary, reasoning = _reasoning(body)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    text, constraint = _text(body)
    generate: dict[str, Any] = {"messages": messages, **tools, **constraint}
    generate |= {"max_tokens": max_output or DEFAULT_MAX_OUTPUT_TOKENS, "temp": temperature, "top_p": top_p}
    generate |= {
        "top_k": top_k(body),
        "seed": _seed(body),
        "sampling": sampling_controls(body, logprobs=k if logprobs else None),
    }
    if thinking is not None:
        generate["thinking"] = thinking
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": max_output,
        "parallel_tool_calls": _flag(body, "parallel_tool_calls", True),
        "previous_response_id": None,
        "prompt_cache_key": key,
        "reasoning": reasoning,
        "store": _flag(body, "store", True),
        "temperature": temperature,
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": kept,
        "top_p": top_p,
        "top_logprobs": k,
        "truncation": "disabled",
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
    }
    api = ApiRequest(chat=True, model=model, stream=stream, include_usage=False, generate=generate, client=client)
    return ResponsesRequest(api=api, custom_tools=custom, summary=summary, echo=echo, logprobs=logprobs)


# ---- responses -----------------------------------------------------------------------


def _custom_input(arguments: str) -> str:
    """A free-form tool's input from the model's call of it as a function: its `input`
    (or its one string argument); other arguments as the JSON they are."""
    args = json.loads(arguments)
    if isinstance(args, dict):
        if isinstance(args.get(CUSTOM_INPUT), str):
            return args[CUSTOM_INPUT]
        strings = [v for v in args.values() if isinstance(v, str)]
        if len(args) == 1 and strings:
            return strings[0]
    return arguments


def _error_code(e: ApiError) -> str:
    """ResponseError's code for an error after the stream began."""
    return "rate_limit_exceeded" if e.status == 429 else "invalid_prompt" if e.status == 400 else "server_error"


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class Fold:
    """Folds one request's daemon events into the Response: its output items and, for a
    stream, the events that build them. Pure: no I/O."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest) -> None:
        self._id = response_id
        self._model = model
        self._req = req
        self._created = int(time.time())
        self._seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self._item: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self._parts: list[str] = []  # its text so far
        self.sent: list[str] = []  # the answer's text streamed so far
        self.thought: list[str] = []  # the reasoning streamed so far
        self._thought_events = 0  # token events of reasoning (each one token or more)
        # Log-probability entries (a request that asked): come, not yet in a delta; and the
        # message item's so far.
        self._held: list[proto.TokenLogprob] = []
        self._given = 0
        self._item_logprobs: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None  # the whole Response, once ended
        self.calls: list[tuple[str, ToolCall]] = []  # (call_id, the daemon's call) answered

    @property
    def client(self) -> str:
        """The request's client identity (the scope of its kept call texts)."""
        return self._req.api.client

    # ---- the Response object ----

    def response(self, status: str, usage: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        out = {
            "id": self._id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self._model,
            "output": list(self.output),
            "usage": usage,
            "user": None,
        }
        return out | self._req.echo | extra

    def _event(self, kind: str, **data: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    # ---- items ----

    def _open(self, kind: str) -> list[dict[str, Any]]:
        """Open a reasoning or message item (closing the other kind first)."""
        if self._item is not None and self._item["type"] == kind:
            return []
        events = self._close()
        index = len(self.output)
        if kind == "message":
            item = {"id": _new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant"}
            item["content"] = []
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": _new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": []}
            part = {"type": "summary_text" if self._req.summary else "reasoning_text", "text": ""}
        self._item, self._parts = item, []
        where = {"item_id": item["id"], "output_index": index}
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if kind == "reasoning" and self._req.summary:
            events.append(self._event("response.reasoning_summary_part.added", **where, summary_index=0, part=part))
        else:
            events.append(self._event("response.content_part.added", **where, content_index=0, part=part))
        return events

    def _delta(self, text: str) -> dict[str, Any]:
        assert self._item is not None
        self._parts.append(text)
        where = {"item_id": self._item["id"], "output_index": len(self.output)}
        if self._item["type"] == "message":
            lp = self._take_logprobs()
            return self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=lp)
        if self._req.summary:
            return self._event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text)
        return self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)

    def _take_logprobs(self) -> list[dict[str, Any]]:
        """The held entries as the Responses API's logprobs, now counted in the message's."""
        if not self._req.logprobs or not self._held:
            return []
        out = (chat_logprobs(self._held) or {})["content"]
        self._given += len(self._held)
        self._held = []
        self._item_logprobs += out
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._item
        if item is None:
            return []
        self._item = None
        text = "".join(self._parts)
        where = {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            self._take_logprobs()  # entries of tokens whose text came with none
            lp, self._item_logprobs = self._item_logprobs, []
            if self._req.logprobs:
                part["logprobs"] = lp
            events = [
                self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=lp),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
            done = item | {"status": status, "content": [part]}
        elif self._req.summary:
            part = {"type": "summary_text", "text": text}
            events = [
                self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=part),
            ]
            done = item | {"status": status, "summary": [part]}
        else:
            part = {"type": "reasoning_text", "text": text}
            events = [
                self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
            done = item | {"status": status, "content": [part]}
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=done))
        self.output.append(done)
        return events

    def _call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        """A whole tool call as its item's events: a function_call, or a custom_tool_call
        for a free-form tool."""
        events = self._close()
        index = len(self.output)
        if name in self._req.custom_tools:
            text, kind, key, prefix = _custom_input(arguments), "custom_tool_call", "input", "ctc_"
        else:
            text, kind, key, prefix = arguments, "function_call", "arguments", "fc_"
        item = {"id": _new_id(prefix), "type": kind, "call_id": tool_call_id(), "name": name}
        done = item | {key: text}
        if kind == "function_call":  # a custom_tool_call item has no status
            item, done = item | {"status": "in_progress"}, done | {"status": "completed"}
        where = {"item_id": item["id"], "output_index": index}
        topic = "custom_tool_call_input" if kind == "custom_tool_call" else "function_call_arguments"
        events += [
            self._event("response.output_item.added", output_index=index, item=item | {key: ""}),
            self._event(f"response.{topic}.delta", **where, delta=text),
            self._event(f"response.{topic}.done", **where, **{key: text}),
            self._event("response.output_item.done", output_index=index, item=done),
        ]
        self.output.append(done)
        return events

    # ---- the daemon's events ----

    def feed(self, event: Any) -> list[dict[str, Any]]:
        """The stream events for one daemon event (none for `Accepted` and progress)."""
        if isinstance(event, Token) and event.reasoning:
            self._given += len(event.logprobs or ())  # the message's logprobs leave the reasoning out
        elif isinstance(event, Token):
            self._held += event.logprobs or ()
        if isinstance(event, Token) and event.text:
            if event.reasoning:
                self.thought.append(event.text)
                self._thought_events += 1
                return self._open("reasoning") + [self._delta(event.text)]
            self.sent.append(event.text)
            return self._open("message") + [self._delta(event.text)]
        if isinstance(event, ToolCall):
            events = self._call(event.name, event.arguments)
            self.calls.append((self.output[-1]["call_id"], event))
            return events
        if isinstance(event, Done):
            return self._end(event)
        return []  # Accepted (the prompt's length comes again in done), progress, empty tokens

    def _end(self, done: Done) -> list[dict[str, Any]]:
        if done.finish_reason == "shutdown":
            return self.fail(shutdown_error())
        events: list[dict[str, Any]] = []
        if done.logprobs is not None:
            self._held = list(done.logprobs[self._given :])
        # Text held back in the daemon (a call's marker that was not one) comes only with done.
        for kind, whole, streamed in (("reasoning", done.reasoning, self.thought), ("message", done.text, self.sent)):
            rest = rest_of(whole, streamed)
            if rest:
                streamed.append(rest)
                events += self._open(kind) + [self._delta(rest)]
        cut = done.finish_reason == "length"
        if not any(item["type"] in ("message", "function_call", "custom_tool_call") for item in self.output):
            events += self._open("message")  # an empty answer is still an assistant message
        events += self._close("incomplete" if cut else "completed")
        prompt = done.stats.prompt_tokens
        output = len(done.tokens)
        reasoning = self._thought_events
        usage = {
            "input_tokens": prompt,
            # The daemon does not count what it writes to its prompt cache.
            "input_tokens_details": {"cached_tokens": done.stats.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output,
        }
        if cut:
            self.final = self.response(
                "incomplete", usage, incomplete_details={"reason": "max_output_tokens"}, completed_at=None
            )
            return events + [self._event("response.incomplete", response=self.final)]
        self.final = self.response("completed", usage, completed_at=int(time.time()))
        return events + [self._event("response.completed", response=self.final)]

    def fail(self, e: ApiError) -> list[dict[str, Any]]:
        """The end of a stream whose request failed after it began."""
        events = self._close("incomplete")
        error = {"code": _error_code(e), "message": e.message}
        self.final = self.response("failed", error=error)
        return events + [self._event("response.failed", response=self.final)]


def _sse(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


class ResponsesApi:
    """The Responses API's route over a `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    def routes(self) -> list[Route]:
        return [Route(PATH, self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        gw = self._gw
        gw._authorize(request)
        req = parse_request(await gw._read_json(request, images.IMAGE_BODY_BYTES), gw.call_texts)
        opened = await gw.open_request(request, req.api, "resp_")
        if opened is None:
            return Response(status_code=499)
        daemon, model = opened
        fold = Fold(daemon.id, model, req)
        if not req.api.stream:
            done = await gw.whole(request, daemon, on_event=fold.feed)
            if done is None:
                return Response(status_code=499)
            fold.feed(done)
            self._keep(fold)
            return JSONResponse(fold.final)
        head = await gw.first_event(request, daemon)
        if head is None:
            return Response(status_code=499)
        return EventStream(self._stream(daemon, fold, head), daemon)

    async def _stream(self, daemon: DaemonRequest, fold: Fold, head: Any) -> AsyncIterator[str]:
        for e in fold.start():
            yield _sse(e)
        try:
            async for event in self._gw.events(daemon, head):
                if isinstance(event, KeepAlive):
                    yield event.sse_comment()  # Codex gives up on a stream quiet for 300 s
                for e in fold.feed(event):
                    yield _sse(e)
        except ApiError as error:
            for e in fold.fail(error):
                yield _sse(e)
        self._keep(fold)

    def _keep(self, fold: Fold) -> None:
        """The model's own text of each call answered, for the turn that sends it back."""
        for call_id, call in fold.calls:
            self._gw.call_texts.keep(fold.client, call_id, call.name, call.arguments, call.text)
