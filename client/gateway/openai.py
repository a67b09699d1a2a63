"""The OpenAI HTTP API's shapes: request validation and response objects (no MLX, no I/O).

A request body becomes an `ApiRequest` holding the keyword arguments of
`Client.generate`; anything wrong raises `ApiError`, which carries the HTTP status and
the OpenAI-style error object `{"error": {"message", "type", "param", "code"}}`.

Accepted, beyond what every client sends: `max_tokens` or `max_completion_tokens`
(default DEFAULT_MAX_TOKENS), `temperature` (default 1.0, as OpenAI's), `top_p`, `seed`,
`stop` (a string or up to `protocol.MAX_STOP_STRINGS` strings), `stream`,
`stream_options.include_usage`, for chat `tools`, `tool_choice` (auto, none,
required, a named function) and the messages of a tool-calling turn (an assistant's
`tool_calls`, `role: "tool"` results), and Ollama's `keep_alive` ("5m", seconds, 0, -1:
how long the model stays loaded once the daemon is idle after this request).
`top_k`, `min_p`, `repetition_penalty` (as vLLM and llama.cpp take them), `presence_penalty`,
`frequency_penalty` (mlx-lm's, over the last 20 tokens, the prompt's too, or mlx-lm's
server's `repetition_context_size` / `presence_context_size` / `frequency_context_size`,
which must agree: the penalties share one window), `logit_bias`,
`logprobs` / `top_logprobs` (from the logits the sampler sees), `n` (n requests for the
same prompt; a seed s gives choice i the seed s + i). `response_format` json_object and
json_schema ({name, schema, strict}) make the answer JSON of that schema, enforced by the
daemon's grammar whether `strict` or not (a schema it cannot enforce is a 400 naming why),
as are tool_choice required, a named function (only offered functions, arguments of their
schema) and none (no tool-call markup). Thinking: `chat_template_kwargs.enable_thinking`
(or `.thinking`) sets the chat template's thinking switch, `reasoning_effort` "none" turns
it off (any other effort on), `thinking: {type: enabled | disabled}` too; a thinking
model's reasoning comes back apart from the answer as the message's `reasoning_content`
(streamed as `delta.reasoning_content`), and an assistant message's `reasoning_content`
(or `reasoning`) goes back to the template as that turn's reasoning. Parameters that
would change the answer in a way this server cannot honour (echo, suffix, best_of > 1,
legacy `functions`) are refused with a 400 rather than ignored; other unknown fields
(user, metadata, parallel_tool_calls, ...) are ignored.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...shared import protocol as proto
from ...shared.protocol import Done
from ...shared.settings import SettingsError, parse_duration
from ...shared.status import Status
from ..client import Token, ToolCall
from . import images
from .call_texts import CallTexts
from .daemon_link import (
    ApiError,
    ApiRequest,
    DaemonRequest,
    EventStream,
    Gateway,
    bad_request,
    rest_of,
    shutdown_error,
    sse,
)
from .keep_alive import KeepAlive
from .model_info import capabilities, context_length, model_id

DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 1.0
MAX_TEMPERATURE = 2.0
MAX_CHOICES = 8  # n


# ---- requests ------------------------------------------------------------------------


def declared_identity(body: dict[str, Any]) -> str | None:
    """The end user or session a request names, where the clients put it: Anthropic's
    `metadata.user_id` (Claude Code's user and session), the Responses API's
    `prompt_cache_key` (Codex CLI's conversation), `safety_identifier`, OpenAI's `user`.
    It scopes the prompt cache: requests that name none share their caller's address's."""
    metadata = body.get("metadata")
    candidates = [metadata.get("user_id") if isinstance(metadata, dict) else None]
    candidates += [body.get(name) for name in ("prompt_cache_key", "safety_identifier", "user")]
    return next((c for c in candidates if isinstance(c, str) and c), None)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, *, low_open: bool = False, head: str = ""
) -> float:
    """A number in [low, high] (`low_open`: (low, high]); 400 otherwise, its message
    beginning with `head` (default: 'name')."""
    value = body.get(name)
    if value is None:
        return default
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad_request(f"{head or repr(name)} must be a number in {bound}, got {value!r}", name)
    return float(value)


def _max_tokens(body: dict[str, Any], *names: str) -> int | None:
    """The first of `names` given, a whole number in 1..MAX_TOKENS_LIMIT; None: none given."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or not 1 <= value <= proto.MAX_TOKENS_LIMIT:
            raise bad_request(f"'{name}' must be a whole number in 1..{proto.MAX_TOKENS_LIMIT}, got {value!r}", name)
        return value
    return None


def _seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**63):
        raise bad_request(f"'seed' must be a whole number in 0..2^63-1, got {seed!r}", "seed")
    return seed


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false", name)
    return value


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object", name)
    return value


def stop_strings_ok(stop: Any) -> bool:
    """Whether `stop` is a list of stop strings the protocol takes."""
    return (
        isinstance(stop, list)
        and len(stop) <= proto.MAX_STOP_STRINGS
        and all(isinstance(s, str) and 0 < len(s) <= proto.MAX_STOP_CHARS for s in stop)
    )


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not stop_strings_ok(stop):
        raise bad_request(
            f"'stop' must be a string or a list of at most {proto.MAX_STOP_STRINGS} non-empty strings "
            f"of at most {proto.MAX_STOP_CHARS} characters",
            "stop",
        )
    return stop


# (name, the values that leave the answer unchanged): anything else is refused.
_UNSUPPORTED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("best_of", (None, 1)),
    ("echo", (None, False)),
    ("suffix", (None, "")),
    ("functions", (None, [])),
    ("function_call", (None, "none")),
)
# Refused by /v1/completions (a text prompt has no chat template to render them).
_CHAT_ONLY: tuple[tuple[str, tuple[Any, ...]], ...] = (("tools", (None, [])), ("tool_choice", (None, "none")))


def _refuse_unsupported(body: dict[str, Any], chat: bool = True) -> None:
    for name, neutral in _UNSUPPORTED if chat else _UNSUPPORTED + _CHAT_ONLY:
        value = body.get(name)
        # Same type as well as equal: True == 1 must not pass for n = 1.
        if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
            raise bad_request(
                f"'{name}' = {body[name]!r} is not supported by this server", name, "unsupported_parameter"
            )


def json_constraint(schema: Any, param: str) -> proto.Constraint:
    """An API's JSON schema (None: any JSON object) as the daemon's `constraint`; a
    schema the daemon's grammar cannot enforce comes back from it as a 400 naming why."""
    if schema is None:
        return proto.Constraint("json_object")
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"'{param}' must be a JSON schema (an object)", param)
    return proto.Constraint("json_schema", json.dumps(schema))


def _response_format(body: dict[str, Any]) -> dict[str, Any]:
    """`response_format`: text (nothing), json_object, or json_schema {name, schema,
    strict} as the daemon's constraint (enforced whether `strict` or not)."""
    fmt = body.get("response_format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"constraint": json_constraint(None, "response_format")}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise bad_request("'response_format' json_schema needs 'json_schema.schema'", "response_format")
        return {"constraint": json_constraint(spec["schema"], "response_format.json_schema.schema")}
    raise bad_request(
        "'response_format' must be {type: 'text'}, {type: 'json_object'} or {type: 'json_schema', json_schema: "
        "{name, schema, strict}}",
        "response_format",
    )


def _content(value: Any, i: int) -> tuple[str, list[proto.ImageData]]:
    """A message's content: a string, null, or a list of text and image parts (an
    image's `image_url` a data URL), as its text and its images."""
    if isinstance(value, str):
        return value, []
    if value is None:
        return "", []
    if isinstance(value, list):
        texts, pictures = [], []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                pictures.append(images.from_url(url, f"messages[{i}].content[{j}].image_url.url"))
                continue
            if not (kind == "text" and isinstance(part.get("text"), str)):
                raise bad_request(
                    f"messages[{i}].content[{j}]: only text and image_url parts are supported", f"messages[{i}].content"
                )
            texts.append(part["text"])
        return "".join(texts), pictures
    raise bad_request(
        f"messages[{i}].content must be a string or a list of text and image_url parts", f"messages[{i}].content"
    )


def _tool_call_in(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's tool call, as OpenAI writes it, as the protocol's {name, arguments}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
        raise bad_request(f"{where} must be {{type: 'function', function: {{name, arguments}}}}", where)
    return {
        "name": fn["name"],
        "arguments": json_arguments(fn.get("arguments", "{}"), f"{where}.function.arguments", where),
    }


def json_arguments(args: Any, where: str, param: str) -> dict[str, Any]:
    """A call's arguments, a JSON object or its text; 400 for anything else."""
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise bad_request(f"{where} is not valid JSON", param) from None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where} must be a JSON object", param)
    return parsed


def _messages(body: dict[str, Any], kept: CallTexts | None = None, client: str = "") -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required: a list of {role, content} objects", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > proto.MAX_MESSAGES:
        raise bad_request(f"{len(messages)} messages are over the limit of {proto.MAX_MESSAGES}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not 0 < len(role) <= proto.MAX_ROLE_CHARS:
            raise bad_request(
                f"messages[{i}].role must be a string such as 'system', 'user' or 'assistant'", f"messages[{i}].role"
            )
        text, pictures = _content(m.get("content"), i)
        msg: dict[str, Any] = {"role": role, "content": text}
        if pictures:
            msg["images"] = pictures
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_tool_call_in(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            if kept is not None:
                texts = [
                    kept.find(client, c.get("id"), t["name"], t["arguments"]) for c, t in zip(calls, msg["tool_calls"])
                ]
                if any(t is not None for t in texts):
                    msg["call_texts"] = texts
        for key in ("tool_call_id", "name"):
            value = m.get(key)
            if value is not None:
                if not (isinstance(value, str) and 0 < len(value) <= proto.MAX_NAME_CHARS):
                    raise bad_request(f"messages[{i}].{key} must be a non-empty string", f"messages[{i}].{key}")
                msg[key] = value
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning:
            if not isinstance(reasoning, str):
                raise bad_request(f"messages[{i}].reasoning_content must be a string", f"messages[{i}]")
            msg["reasoning"] = reasoning
        out.append(msg)
    images.count_images(out)
    return out


# reasoning_effort values (OpenAI's, and "none"): "none" turns thinking off, the rest on.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def thinking_switch(body: dict[str, Any]) -> bool | None:
    """The chat template's thinking switch a chat request asks for (None: the model's
    default): `chat_template_kwargs.enable_thinking` (vLLM's, SGLang's, mlx-lm's) or its
    `thinking` (DeepSeek's templates), `thinking: {type}`, `reasoning_effort`."""
    kwargs = _object(body, "chat_template_kwargs")
    for key in ("enable_thinking", "thinking"):
        value = kwargs.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise bad_request(f"'chat_template_kwargs.{key}' must be true or false", "chat_template_kwargs")
            return value
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise bad_request("'thinking' must be {type: 'enabled' | 'disabled'}", "thinking")
        return kind == "enabled"
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}", "reasoning_effort")
    return effort != "none"


def top_k(body: dict[str, Any], name: str = "top_k") -> int | None:
    """`top_k` (0 or absent: off)."""
    value = body.get(name)
    if value is not None and not (_is_int(value) and 0 <= value < 2**31):
        raise bad_request(f"'{name}' must be a whole number of at least 0, got {value!r}", name)
    return value or None


# (field of SamplingControls, lowest, highest, lowest excluded)
_CONTROL_NUMBERS = (
    ("min_p", 0.0, 1.0, False),
    ("presence_penalty", -2.0, 2.0, False),
    ("frequency_penalty", -2.0, 2.0, False),
    ("repetition_penalty", 0.0, 10.0, True),
)


def _logit_bias(value: Any, name: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias in -100..100}) as (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > proto.MAX_LOGIT_BIAS:
        raise bad_request(f"'{name}' must be an object of at most {proto.MAX_LOGIT_BIAS} token ids", name)
    out = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 else -1
        ok = (_is_int(bias) or isinstance(bias, float)) and math.isfinite(bias) and -100 <= bias <= 100
        if not (0 <= token < 2**31 and ok):
            raise bad_request(f"'{name}' maps token ids (digits) to numbers in -100..100, got {key!r}: {bias!r}", name)
        out.append((token, float(bias)))
    return tuple(out)


def top_logprobs(body: dict[str, Any], name: str = "top_logprobs") -> int:
    value = body.get(name)
    if value is None:
        return 0
    if not (_is_int(value) and 0 <= value <= proto.MAX_TOP_LOGPROBS):
        raise bad_request(f"'{name}' must be a whole number in 0..{proto.MAX_TOP_LOGPROBS}", name)
    return value


def sampling_controls(
    body: dict[str, Any],
    *,
    names: dict[str, str] | None = None,
    window: int | None = None,
    logprobs: int | None = None,
) -> proto.SamplingControls | None:
    """The daemon's `SamplingControls` from a body's min_p, presence_penalty,
    frequency_penalty, repetition_penalty and logit_bias (`names` maps a field to the
    API's own name), the penalties' `window` (None: mlx-lm's 20) and `logprobs` (None:
    none; k: with k alternatives); None where nothing is asked."""
    names = names or {}
    values: dict[str, Any] = {}
    for key, low, high, low_open in _CONTROL_NUMBERS:
        name = names.get(key, key)
        if body.get(name) is not None:
            values[key] = _number(body, name, 0.0, low, high, low_open=low_open)
    bias = _logit_bias(body.get(names.get("logit_bias", "logit_bias")), names.get("logit_bias", "logit_bias"))
    if bias:
        values["logit_bias"] = bias
    window = window if window is not None else _penalty_window(body, values)
    if window is not None:
        values["penalty_window"] = window
    if logprobs is not None:
        values["logprobs"] = logprobs
    return proto.SamplingControls(**values) if values else None


_PENALTIES_OFF = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _penalty_window(body: dict[str, Any], values: dict[str, Any]) -> int | None:
    """mlx-lm's server's `repetition_context_size`, `presence_context_size` and
    `frequency_context_size` (each 20 unless given) as the one window the daemon's
    penalties share: the penalties asked must agree on it, else the answer could not be
    the one asked for (a 400, not a silently different window)."""
    windows: dict[int, str] = {}
    for penalty, off in _PENALTIES_OFF.items():
        name = penalty.replace("_penalty", "_context_size")
        size = body.get(name)
        if size is not None and not (_is_int(size) and 1 <= size <= proto.MAX_PENALTY_WINDOW):
            raise bad_request(f"'{name}' must be a whole number in 1..{proto.MAX_PENALTY_WINDOW}, got {size!r}", name)
        if values.get(penalty, off) != off:
            windows.setdefault(proto.SamplingControls.penalty_window if size is None else size, name)
    if len(windows) > 1:
        raise bad_request(
            f"the penalties asked look back over different windows ({sorted(windows)} tokens); this server's "
            "penalties share one: give them the same context size",
            next((n for n in windows.values() if n in body), None),
        )
    return next(iter(windows), None)


def _openai_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Chat's `logprobs` (true) with `top_logprobs`, or completions' `logprobs` (k)."""
    if chat:
        value = _flag(body, "logprobs", False)
        k = top_logprobs(body)
        if k and not value:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return k if value else None
    return None if body.get("logprobs") is None else top_logprobs(body, "logprobs")


def _choices(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not (_is_int(n) and 1 <= n <= MAX_CHOICES):
        raise bad_request(f"'n' must be a whole number in 1..{MAX_CHOICES}", "n")
    return n


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """`tools` and `tool_choice` as Client.generate takes them (nothing when there are none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return {}
    if not isinstance(tools, list) or len(tools) > proto.MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {proto.MAX_TOOLS} functions", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (
            t.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]
        ):
            raise bad_request(
                f"tools[{i}] must be {{type: 'function', function: {{name, description, parameters}}}}", "tools"
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(fn["name"])
    if choice is None or choice in ("auto", "none", "required"):
        pass
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_request(f"'tool_choice' names {name!r}, which is not among 'tools'", "tool_choice")
        choice = {"name": name}
    else:
        raise bad_request(
            "'tool_choice' must be 'auto', 'none', 'required' or {type: 'function', function: {name}}", "tool_choice"
        )
    return {"tools": tools, "tool_choice": choice}


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    """`prompt` as Client.generate's prompt= or prompt_ids= (one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(_is_int(t) and 0 <= t < 2**31 for t in prompt):
        return {"prompt_ids": prompt}
    if prompt is None:
        raise bad_request("'prompt' is required: a string (or a list of token ids)", "prompt")
    raise bad_request(
        "'prompt' must be one string or one non-empty list of token ids (several prompts per request are not "
        "supported)",
        "prompt",
    )


def parse_request(body: Any, *, chat: bool, kept: CallTexts | None = None) -> ApiRequest:
    """Validate a decoded JSON body of /v1/chat/completions (chat) or /v1/completions; a
    resent tool call comes with the text the model wrote for it where `kept` has it."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    client = declared_identity(body) or ""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    stream = _flag(body, "stream", False)
    include_usage = bool(_object(body, "stream_options").get("include_usage"))
    _refuse_unsupported(body, chat)
    seed = _seed(body)
    kwargs: dict[str, Any] = (
        {"messages": _messages(body, kept, client), **_tools(body), "thinking": thinking_switch(body)}
        if chat
        else _prompt(body)
    )
    kwargs.update(
        max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens") or DEFAULT_MAX_TOKENS,
        temp=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=top_k(body),
        seed=seed,
        stop=_stop(body),
        sampling=sampling_controls(body, logprobs=_openai_logprobs(body, chat)),
        **_response_format(body),
    )
    if body.get("keep_alive") is not None:
        kwargs["keep_alive"] = keep_alive_seconds(body["keep_alive"])
    return ApiRequest(
        chat=chat,
        model=model,
        stream=stream,
        include_usage=include_usage,
        generate=kwargs,
        n=_choices(body),
        client=client,
    )


def keep_alive_seconds(value: Any) -> float:
    """Ollama's keep_alive: a duration ("5m", "30s") or seconds; negative: never unload."""
    try:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SettingsError(f"got {value!r}")
        seconds = parse_duration(value)
    except SettingsError as e:
        raise bad_request(f"'keep_alive' must be a duration (5m, 30s), seconds, 0 or -1: {e}", "keep_alive") from None
    if seconds > proto.MAX_KEEP_ALIVE_S:
        return -1.0  # longer than the protocol counts: never
    return seconds


# ---- responses -----------------------------------------------------------------------


def finish_reason(daemon_reason: str, tool_calls: bool = False) -> str:
    """OpenAI's finish_reason for the daemon's (length | stop; a cancel ends as stop;
    an answer that called tools ends as tool_calls)."""
    if tool_calls:
        return "tool_calls"
    return "length" if daemon_reason == "length" else "stop"


def tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_out(call: dict[str, Any], call_id: str, index: int | None = None) -> dict[str, Any]:
    """A parsed call ({name, arguments as JSON text}) as OpenAI's tool_calls entry."""
    out: dict[str, Any] = {"index": index} if index is not None else {}
    out |= {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
    return out


def _text_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


def chat_logprobs(entries: Sequence[proto.TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's `logprobs` object ({content: [...]}) for the daemon's entries."""
    if entries is None:
        return None
    return {
        "content": [
            {
                "token": e.text,
                "logprob": e.logprob,
                "bytes": _text_bytes(e.text),
                "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": _text_bytes(t.text)} for t in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[proto.TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """A completion choice's legacy `logprobs` object (tokens, token_logprobs,
    top_logprobs, text_offset), its offsets counted from `offset`."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Shaper:
    """Makes the response objects of one request."""

    chat: bool
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice's, of n

    def at(self, index: int) -> Shaper:
        """The shaper of choice `index` (the same id and time)."""
        return replace(self, index=index)

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def complete(
        self,
        text: str,
        reason: str,
        use: dict[str, int],
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str = "",
        logprobs: Sequence[proto.TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        """The whole answer of a non-streaming request (a chat's reasoning apart)."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["content"] = text or None
                message["tool_calls"] = [tool_call_out(c, tool_call_id()) for c in tool_calls]
            choice = {
                "index": self.index,
                "message": message,
                "logprobs": chat_logprobs(logprobs),
                "finish_reason": reason,
            }
            return self._base("chat.completion") | {"choices": [choice], "usage": use}
        lp = completion_logprobs(logprobs)
        choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": reason}
        return self._base("text_completion") | {"choices": [choice], "usage": use}

    def chunk(
        self,
        text: str | None,
        reason: str | None = None,
        *,
        first: bool = False,
        with_usage: bool = False,
        logprobs: Sequence[proto.TokenLogprob] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """One streamed piece; `first` (chat) carries the assistant role; `logprobs`, the
        entries of the tokens it completes (`offset`: where its text starts in the answer)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": self.index, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": reason}
            out = self._base("chat.completion.chunk") | {"choices": [choice]}
        else:
            lp = completion_logprobs(logprobs, offset)
            choice = {"index": self.index, "text": text or "", "logprobs": lp, "finish_reason": reason}
            out = self._base("text_completion") | {"choices": [choice]}
        if with_usage:
            out["usage"] = None  # OpenAI sends null on every chunk but the usage chunk
        return out

    def text_chunk(
        self,
        text: str,
        reasoning: bool,
        *,
        with_usage: bool = False,
        logprobs: Sequence[proto.TokenLogprob] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """A streamed piece of the answer, or of a chat's reasoning (`delta.reasoning_content`)."""
        if not (reasoning and self.chat):
            return self.chunk(text, with_usage=with_usage, logprobs=logprobs, offset=offset)
        out = self.chunk(None, with_usage=with_usage)
        out["choices"][0]["delta"] = {"reasoning_content": text}
        return out

    def tool_chunk(self, call: dict[str, Any], index: int, *, with_usage: bool = False) -> dict[str, Any]:
        """One whole tool call as a streamed `delta.tool_calls` piece."""
        out = self.chunk(None, with_usage=with_usage)
        out["choices"][0]["delta"] = {"tool_calls": [tool_call_out(call, tool_call_id(), index)]}
        return out

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._base(obj) | {"choices": [], "usage": use}


# ---- the endpoints -------------------------------------------------------------------


class OpenAIApi:
    """OpenAI's endpoints (chat completions, completions, models) onto the gateway's one
    request path (daemon_link.py)."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def routes(self) -> list[Route]:
        chat_completions = functools.partial(self._complete, chat=True)
        return [
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            # Clients set up for llama.cpp's or mlx-lm's server may leave out the /v1.
            Route("/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", functools.partial(self._complete, chat=False), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        ]

    def _model_object(self, st: Status) -> dict[str, Any]:
        created = int(time.time() - st.uptime_s)
        return {
            "id": model_id(st, self._gw.config.demo_store_id),
            "object": "model",
            "created": created,
            "owned_by": "moestream",
            # Beyond OpenAI's object, as other local servers add them: tokens per request
            # (prompt and answer) and what the model takes.
            "context_length": context_length(st),
            "capabilities": capabilities(st),
        }

    async def models(self, request: Request) -> Response:
        self._gw._authorize(request)
        st = await self._gw._status()
        return JSONResponse({"object": "list", "data": [self._model_object(st)]})

    async def model(self, request: Request) -> Response:
        self._gw._authorize(request)
        st = await self._gw._status()
        return JSONResponse(self._model_object(st) | {"id": request.path_params["model"]})

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        self._gw._authorize(request)
        body = await self._gw._read_json(request, images.IMAGE_BODY_BYTES if chat else None)
        req = parse_request(body, chat=chat, kept=self._gw.call_texts)
        opened = await self._gw.open_choices(request, req, "chatcmpl-" if chat else "cmpl-")
        if opened is None:
            return Response(status_code=499)  # nobody is there to read an answer
        daemons, model = opened
        shaper = Shaper(chat=chat, id=daemons[0].id, model=model)
        if not req.stream:
            answers = []
            for i, daemon in enumerate(daemons):
                done = await self._gw.whole(request, daemon)
                if done is None:
                    for d in daemons[i + 1 :]:
                        d.cancel()
                    return Response(status_code=499)
                reason = finish_reason(done.finish_reason, bool(done.tool_calls))
                use = _usage(done)
                answers.append(
                    shaper.at(i).complete(done.text, reason, use, done.tool_calls, done.reasoning, done.logprobs)
                )
                message = answers[-1]["choices"][0].get("message") or {}  # a chat's (not a completion's)
                for out, call in zip(message.get("tool_calls") or (), done.tool_calls):
                    self._gw.call_texts.keep(req.client, out["id"], call["name"], call["arguments"], call.get("text"))
            body = answers[0]
            if len(answers) > 1:
                # One prompt, n completions: the prompt counted once, as OpenAI counts it.
                completion = sum(a["usage"]["completion_tokens"] for a in answers)
                body["usage"] |= usage(body["usage"]["prompt_tokens"], completion)
                body["choices"] = [a["choices"][0] for a in answers]
            return JSONResponse(body)
        head = await self._gw.first_event(request, daemons[0])
        if head is None:
            for d in daemons:
                d.cancel()
            return Response(status_code=499)
        return EventStream(self._events(daemons[0], shaper, req, head, daemons[1:]), *daemons)

    async def _events(
        self,
        daemon: DaemonRequest,
        shaper: Shaper,
        req: ApiRequest,
        event: Any,
        others: Sequence[DaemonRequest] = (),
    ) -> AsyncIterator[str]:
        """The SSE body from the daemon's first `event` on: its choice's chunks, then
        those of the `others` choices in turn (n > 1: they decode meanwhile, their events
        waiting), usage, [DONE]."""
        dones: list[Done] = []
        for i, daemon in enumerate([daemon, *others]):
            if i:
                event = await daemon.next()
            async for chunk in self._choice_events(daemon, shaper.at(i), req, event, dones):
                yield chunk
            if len(dones) <= i:
                return  # an error ended the stream
        if req.include_usage:
            use = _usage(dones[0])
            use |= usage(use["prompt_tokens"], sum(len(d.tokens) for d in dones))
            yield sse(shaper.usage_chunk(use))
        yield "data: [DONE]\n\n"

    async def _choice_events(
        self, daemon: DaemonRequest, shaper: Shaper, req: ApiRequest, event: Any, dones: list[Done]
    ) -> AsyncIterator[str]:
        """One choice's chunks from its daemon's `event` on: a role chunk (chat), text
        (with the log-probabilities of the tokens it completes, where asked) and
        tool-call chunks, the finish chunk; its `Done` is added to `dones`."""
        extra = req.include_usage
        sampling = req.generate.get("sampling")
        asked = sampling is not None and sampling.logprobs is not None
        if shaper.chat:
            yield sse(shaper.chunk("", first=True, with_usage=extra))
        sent: list[str] = []
        thought: list[str] = []
        calls = 0
        held: list[proto.TokenLogprob] = []  # entries not sent yet (their text held back)
        given = 0
        try:
            async for event in self._gw.events(daemon, event):
                if isinstance(event, KeepAlive):
                    yield event.sse_comment()
                elif isinstance(event, Token):
                    if not event.reasoning:  # a thinking model's reasoning has no content logprobs
                        held.extend(event.logprobs or ())
                    else:
                        given += len(event.logprobs or ())
                    if not event.text:
                        continue
                    lp = held if asked and not event.reasoning else None
                    offset = len("".join(sent))
                    (thought if event.reasoning else sent).append(event.text)
                    yield sse(
                        shaper.text_chunk(
                            event.text, bool(event.reasoning), with_usage=extra, logprobs=lp, offset=offset
                        )
                    )
                    if lp is not None:
                        given += len(held)
                        held = []
                elif isinstance(event, ToolCall):
                    call = {"name": event.name, "arguments": event.arguments}
                    chunk = shaper.tool_chunk(call, calls, with_usage=extra)
                    call_id = chunk["choices"][0]["delta"]["tool_calls"][0]["id"]
                    self._gw.call_texts.keep(req.client, call_id, event.name, event.arguments, event.text)
                    yield sse(chunk)
                    calls += 1
        except ApiError as e:
            yield sse(e.body())  # as OpenAI reports an error after the stream began
            return
        if event.finish_reason == "shutdown":
            yield sse(shutdown_error().body())
            return
        rest_lp = list(event.logprobs[given:]) if event.logprobs is not None else None
        for thinking, rest in (
            (True, rest_of(event.reasoning, thought)),
            (False, rest_of(event.text, sent)),
        ):
            if rest:
                lp = None if thinking else rest_lp
                offset = len("".join(sent))
                yield sse(shaper.text_chunk(rest, thinking, with_usage=extra, logprobs=lp, offset=offset))
                rest_lp = None if lp is not None else rest_lp
        reason = finish_reason(event.finish_reason, bool(event.tool_calls))
        yield sse(shaper.chunk(None, reason, with_usage=extra, logprobs=rest_lp or None))
        dones.append(event)


def _usage(done: Done) -> dict[str, Any]:
    # The prompt tokens the daemon's prompt cache served, as OpenAI reports its own.
    cached = {"cached_tokens": done.stats.cached_tokens}
    return usage(done.stats.prompt_tokens, len(done.tokens)) | {"prompt_tokens_details": cached}
