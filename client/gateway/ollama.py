"""Ollama's API onto the gateway's one request path (daemon_link.py), no MLX, no I/O of its own:

    POST /api/chat       messages (with tool_calls and `tool` results), tools, options
    POST /api/generate   a text prompt, continued as it is (Ollama's `raw` mode: use
                         /api/chat for the chat template)
    GET  /api/tags, /api/ps, /api/version; POST /api/show

Streaming is Ollama's default (`stream` true): one JSON object per line, the last with
`done: true` and the counts. Options: num_predict, temperature, top_p, top_k, min_p, seed,
stop, repeat_penalty, presence_penalty, frequency_penalty over repeat_last_n tokens (0: no
penalty; -1: the context; absent: mlx-lm's 20; a penalty absent is off, not Ollama's 1.1),
and `logprobs` / `top_logprobs` (each token's, from the logits the sampler sees); other
options that change the answer are refused;
`format` ("json", or a JSON schema) makes the answer JSON of it, enforced by the daemon;
`keep_alive` ("5m", seconds, 0, -1) is how long the daemon keeps the model loaded once
idle after this request; a request with no messages (or no prompt) only loads the model,
or with keep_alive 0 unloads it (`ollama stop`). `think` (true / false, or an effort: "low", "medium", "high",
which turn it on) sets the chat template's thinking switch; a thinking model's reasoning
comes back in `message.thinking`, and a message's `thinking` goes back to the template.
Any model name is served; `/api/show` and `/api/tags` say the model's capabilities
(completion, tools, thinking) and its context length (the daemon's max_context).
Errors are `{"error": message}` with the HTTP status.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ... import __version__
from ...shared import protocol as proto
from ...shared.protocol import Done
from ...shared.status import KeepAliveStatus
from ..client import Token, ToolCall
from . import images
from .daemon_link import ApiError, ApiRequest, EventStream, bad_request, rest_of
from .model_info import capabilities, context_length, model_id
from .openai import (
    _is_int,
    json_constraint,
    keep_alive_seconds,
    sampling_controls,
    stop_strings_ok,
    top_k,
    top_logprobs,
)

if TYPE_CHECKING:
    from .daemon_link import DaemonRequest, Gateway

PREFIX = "/api/"
DEFAULT_NUM_PREDICT = 512
# Options that leave the answer unchanged whatever their value (resources, context).
_IGNORED_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "num_thread", "main_gpu", "use_mmap", "num_keep"})
# Options that are `SamplingControls` (read by `sampling_controls`), by Ollama's names.
_CONTROL_OPTIONS = frozenset({"min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n"})


def owns(path: str) -> bool:
    return path.startswith(PREFIX)


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": e.message}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _expires_at(ka: KeepAliveStatus | None) -> str:
    """When the daemon will release the model (its keep-alive clock): idle, after what is
    left; busy, a keep_alive after now at the earliest; never (keep_alive < 0), the far
    future Ollama's clients read as no expiry."""
    left = ka.unload_in_s if ka is not None else None
    if left is None:
        if ka is None or ka.keep_alive_s < 0:
            return "9999-12-31T23:59:59Z"
        left = ka.keep_alive_s
    at = datetime.now(timezone.utc) + timedelta(seconds=float(left))
    return at.isoformat().replace("+00:00", "Z")


def _is_number(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and x == x and abs(x) != float("inf")


# ---- requests ------------------------------------------------------------------------


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's options as Client.generate's sampling arguments."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("options must be an object")
    out: dict[str, Any] = {"max_tokens": DEFAULT_NUM_PREDICT, "temp": 0.8, "top_p": 0.9, "seed": None, "stop": []}
    for name, value in options.items():
        if value is None or name in _IGNORED_OPTIONS:
            continue
        if name == "num_predict":
            if not _is_int(value) or value == 0 or value < -2 or value > proto.MAX_TOKENS_LIMIT:
                raise bad_request(f"options.num_predict must be a whole number in 1..{proto.MAX_TOKENS_LIMIT}")
            # -1 and -2 (until the context is full): this server's default.
            out["max_tokens"] = value if value > 0 else DEFAULT_NUM_PREDICT
        elif name == "temperature":
            if not (_is_number(value) and 0 <= value <= 2):
                raise bad_request("options.temperature must be a number in [0, 2]")
            out["temp"] = float(value)
        elif name == "top_p":
            if not (_is_number(value) and 0 < value <= 1):
                raise bad_request("options.top_p must be a number in (0, 1]")
            out["top_p"] = float(value)
        elif name == "top_k":
            out["top_k"] = top_k(options, "top_k")
        elif name == "seed":
            if not (_is_int(value) and -(2**63) <= value < 2**63):
                raise bad_request("options.seed must be a whole number")
            out["seed"] = value if value >= 0 else None  # Ollama's -1: a random seed
        elif name == "stop":
            stop = [value] if isinstance(value, str) else value
            if not stop_strings_ok(stop):
                raise bad_request(f"options.stop must be at most {proto.MAX_STOP_STRINGS} non-empty strings")
            out["stop"] = stop
        elif name not in _CONTROL_OPTIONS:
            raise bad_request(f"options.{name} is not supported by this server")
    out["sampling"] = _controls(body, options)
    return out


def _controls(body: dict[str, Any], options: dict[str, Any]) -> proto.SamplingControls | None:
    """min_p, the penalties over repeat_last_n tokens, and logprobs (top level)."""
    last = options.get("repeat_last_n")
    if last is not None and not (_is_int(last) and -1 <= last <= proto.MAX_PENALTY_WINDOW):
        raise bad_request(
            f"options.repeat_last_n must be -1 (the context), 0 (off) or up to {proto.MAX_PENALTY_WINDOW}"
        )
    if last == 0:  # Ollama's "no penalty"
        options = {k: v for k, v in options.items() if not k.endswith("_penalty")}
    window = proto.MAX_PENALTY_WINDOW if last == -1 else last or None
    wants = body.get("logprobs")
    if wants is not None and not isinstance(wants, bool):
        raise bad_request("logprobs must be true or false")
    k = top_logprobs(body)
    controls = sampling_controls(
        options, names={"repetition_penalty": "repeat_penalty", "logit_bias": ""}, logprobs=k if wants else None
    )
    if controls is not None and window is not None:
        controls = replace(controls, penalty_window=window)
    return controls


def _common(body: Any) -> tuple[str, bool]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false")
    return model.removesuffix(":latest"), stream


def _format(body: dict[str, Any]) -> dict[str, Any]:
    """`format`: "json" (any JSON object) or a JSON schema, as the daemon's constraint."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"constraint": json_constraint(None, "format")}
    if not isinstance(fmt, dict):
        raise bad_request('format must be "json" or a JSON schema (an object)')
    return {"constraint": json_constraint(fmt, "format")}


def _keep_alive(body: dict[str, Any]) -> dict[str, Any]:
    """The request's keep_alive for the daemon, where the body gives one."""
    value = body.get("keep_alive")
    return {} if value is None else {"keep_alive": keep_alive_seconds(value)}


def _tool_calls_in(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"] and isinstance(args, dict)):
            raise bad_request(f"messages[{i}].tool_calls: each is {{function: {{name, arguments}}}}")
        out.append({"name": fn["name"], "arguments": args})
    return out


def _loads_only(body: Any, chat: bool) -> bool:
    if not (isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]):
        return False
    # Ollama's own server reads an absent list or prompt as an empty one.
    return body.get("messages") in (None, []) if chat else body.get("prompt") in (None, "")


def parse_chat(body: Any) -> ApiRequest:
    model, stream = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty list of {role, content}")
    if len(messages) > proto.MAX_MESSAGES:
        raise bad_request(f"{len(messages)} messages are over the limit of {proto.MAX_MESSAGES}")
    chat = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and 0 < len(m["role"]) <= proto.MAX_ROLE_CHARS):
            raise bad_request(f"messages[{i}] must be an object with a role and content")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        pictures = m.get("images")
        if pictures:
            if not isinstance(pictures, list):
                raise bad_request(f"messages[{i}].images must be a list of base64 images")
            msg["images"] = [images.from_base64(p, f"messages[{i}].images[{j}]") for j, p in enumerate(pictures)]
        if m.get("thinking"):
            if not isinstance(m["thinking"], str):
                raise bad_request(f"messages[{i}].thinking must be a string")
            msg["reasoning"] = m["thinking"]
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls_in(m["tool_calls"], i)
        name = m.get("tool_name") or m.get("name")
        if isinstance(name, str) and 0 < len(name) <= proto.MAX_NAME_CHARS:
            msg["name"] = name
        chat.append(msg)
    images.count_images(chat)
    kwargs: dict[str, Any] = {"messages": chat}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or len(tools) > proto.MAX_TOOLS:
            raise bad_request(f"tools must be a list of at most {proto.MAX_TOOLS} functions")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
                raise bad_request(
                    f"tools[{i}] must be {{type: 'function', function: {{name, description, parameters}}}}"
                )
        kwargs["tools"] = [{"type": "function", **t} if "type" not in t else t for t in tools]
    kwargs["thinking"] = _think(body.get("think"))
    return ApiRequest(
        chat=True,
        model=model,
        stream=stream,
        include_usage=False,
        generate=kwargs | _options(body) | _keep_alive(body) | _format(body),
    )


def _think(value: Any) -> bool | None:
    """Ollama's `think`: true / false, or an effort (gpt-oss's), which turns it on."""
    if value is None or isinstance(value, bool):
        return value
    if value in ("low", "medium", "high"):
        return True
    raise bad_request("think must be true, false, or one of 'low', 'medium', 'high'")


def parse_generate(body: Any) -> ApiRequest:
    model, stream = _common(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("prompt is required: a string (an empty one only loads the model)")
    for name in ("system", "template", "suffix", "images", "context"):
        if body.get(name):
            raise bad_request(
                f"{name} is not supported by this server: /api/generate continues the prompt as it is; "
                "use /api/chat for the model's chat template"
            )
    generate = {"prompt": prompt} | _options(body) | _keep_alive(body) | _format(body)
    return ApiRequest(chat=False, model=model, stream=stream, include_usage=False, generate=generate)


# ---- responses -----------------------------------------------------------------------


def _final(model: str, done: Done, started: float) -> dict[str, Any]:
    stats = done.stats
    total = int((time.monotonic() - started) * 1e9)
    return {
        "model": model,
        "created_at": _now(),
        "done": True,
        "done_reason": "length" if done.finish_reason == "length" else "stop",
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": int(stats.prompt_seconds * 1e9),
        "eval_count": len(done.tokens),
        "eval_duration": int(stats.decode_seconds * 1e9),
    }


def _logprobs_out(entries: Any) -> list[dict[str, Any]]:
    """The daemon's log-probabilities as Ollama's `logprobs` list."""
    return [
        {
            "token": e.text,
            "logprob": e.logprob,
            "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in e.top],
        }
        for e in entries
    ]


def _call_out(call: dict[str, Any]) -> dict[str, Any]:
    return {"function": {"name": call["name"], "arguments": json.loads(call["arguments"])}}


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


class OllamaApi:
    """Ollama's routes over a `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    def routes(self) -> list[Route]:
        return [
            Route("/api/chat", functools.partial(self._answer, chat=True), methods=["POST"]),
            Route("/api/generate", functools.partial(self._answer, chat=False), methods=["POST"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/version", self.version, methods=["GET"]),
        ]

    async def _answer(self, request: Request, *, chat: bool) -> Response:
        self._gw._authorize(request)
        body = await self._gw._read_json(request, images.IMAGE_BODY_BYTES if chat else None)
        if _loads_only(body, chat):
            return await self._load(body, chat)
        req = parse_chat(body) if chat else parse_generate(body)
        started = time.monotonic()
        opened = await self._gw.open_request(request, req, "ollama-")
        if opened is None:
            return Response(status_code=499)
        daemon, _ = opened
        model = body["model"]  # Ollama's clients expect the name they asked for
        if not req.stream:
            done = await self._gw.whole(request, daemon)
            if done is None:
                return Response(status_code=499)
            out = _final(model, done, started)
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": done.text}
                if done.reasoning:
                    message["thinking"] = done.reasoning
                if done.tool_calls:
                    message["tool_calls"] = [_call_out(c) for c in done.tool_calls]
                out["message"] = message
            else:
                out["response"] = done.text
            if done.logprobs is not None:
                out["logprobs"] = _logprobs_out(done.logprobs)
            return JSONResponse(out)
        head = await self._gw.first_event(request, daemon)
        if head is None:
            return Response(status_code=499)
        return EventStream(self._lines(daemon, model, head, chat, started), daemon, media_type="application/x-ndjson")

    async def _load(self, body: dict[str, Any], chat: bool) -> Response:
        """Ollama's "load the model" request (no messages, or no prompt): the daemon loads
        its model if it was unloaded, and keeps it `keep_alive` once idle; keep_alive 0
        unloads it (`ollama stop`), answered once it is released (or, with requests in
        flight, once they end)."""
        keep_alive = _keep_alive(body).get("keep_alive")
        await self._gw.load(keep_alive)
        reason = "unload" if keep_alive == 0 else "load"
        out: dict[str, Any] = {"model": body["model"], "created_at": _now()}
        out |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return JSONResponse(out | {"done": True, "done_reason": reason})

    async def _lines(
        self, daemon: DaemonRequest, model: str, head: Any, chat: bool, started: float
    ) -> AsyncIterator[str]:
        def piece(text: str, calls: list[dict[str, Any]] | None = None, thinking: bool = False) -> dict[str, Any]:
            out: dict[str, Any] = {"model": model, "created_at": _now()}
            if chat:
                out["message"] = {"role": "assistant", "content": "" if thinking else text}
                if thinking:
                    out["message"]["thinking"] = text
                if calls:
                    out["message"]["tool_calls"] = [_call_out(c) for c in calls]
            else:
                out["response"] = text
            return out | {"done": False}

        sent: list[str] = []
        thought: list[str] = []
        given = 0  # log-probability entries sent
        try:
            async for event in self._gw.events(daemon, head):
                if isinstance(event, Token) and (event.text or event.logprobs):
                    (thought if event.reasoning else sent).append(event.text)
                    line = piece(event.text, thinking=bool(event.reasoning))
                    if event.logprobs:
                        line["logprobs"] = _logprobs_out(event.logprobs)
                        given += len(event.logprobs)
                    yield _line(line)
                elif isinstance(event, ToolCall):
                    yield _line(piece("", [{"name": event.name, "arguments": event.arguments}]))
        except ApiError as e:
            yield _line(error_body(e))
            return
        if event.finish_reason == "shutdown":
            yield _line({"error": "the moestream daemon shut down during this request"})
            return
        for thinking, rest in (
            (True, rest_of(event.reasoning, thought)),
            (False, rest_of(event.text, sent)),
        ):
            if rest:
                yield _line(piece(rest, thinking=thinking))
        last = piece("") | _final(model, event, started)
        if event.logprobs is not None and len(event.logprobs) > given:
            last["logprobs"] = _logprobs_out(event.logprobs[given:])
        yield _line(last)

    async def _model(self) -> dict[str, Any]:
        st = await self._gw._status()
        name = model_id(st, self._gw.config.demo_store_id)
        size = (st.memory.resident_weights_bytes or 0) + (st.memory.pool_bytes or 0)
        details = {
            "format": "moestream",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        }
        return {
            "name": name,
            "model": name,
            "modified_at": _now(),
            "size": size,
            "digest": st.store_id or "",
            "details": details,
            # Beyond Ollama's listing: what /api/show says, for clients that read the list only.
            "capabilities": capabilities(st),
            "context_length": context_length(st),
        }

    async def tags(self, request: Request) -> Response:
        self._gw._authorize(request)
        return JSONResponse({"models": [await self._model()]})

    async def ps(self, request: Request) -> Response:
        self._gw._authorize(request)
        st = await self._gw._status()
        if st.state == "unloaded":  # released after keep_alive: nothing runs (Ollama lists none)
            return JSONResponse({"models": []})
        m = await self._model()
        return JSONResponse({"models": [m | {"expires_at": _expires_at(st.keep_alive), "size_vram": m["size"]}]})

    async def show(self, request: Request) -> Response:
        self._gw._authorize(request)
        body = await self._gw._read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        asked = body.get("model") or body.get("name")
        if not isinstance(asked, str) or not asked:
            raise bad_request("model is required")
        m = await self._model()
        info = {
            "general.architecture": "moestream",
            "moestream.store_id": m["digest"],
            # Where Ollama's clients read a model's context: "<architecture>.context_length".
            "moestream.context_length": m["context_length"],
        }
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": m["details"],
                "model_info": info,
                "capabilities": m["capabilities"],
                "modified_at": m["modified_at"],
            }
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})
