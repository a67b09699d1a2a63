"""The daemon's wire protocol: msgpack maps, never pickle.

Every message is one ZeroMQ frame holding a msgpack map with `v` (PROTOCOL_VERSION),
`type` and `id` (the request id a reply or event belongs to; chosen by the client,
1 to 64 characters, unique among its own requests). Client -> daemon:

  generate  prompt | prompt_ids | messages, max_tokens, temp, top_p, seed, stop,
            (temp below MIN_TEMP, or top_p below MIN_TOP_P: greedy, the limit they tend to)
            [speculative, draft_tokens, draft_model, diagnostics, progress] -> progress*, token*, done
  cancel    target (the id of one of this client's generate requests)  -> cancelled
  status / stats / ping / shutdown                                     -> status / stats / pong / shutdown

Any request may instead get `error` {code, message}. Limits: a message is at most
MAX_MESSAGE_BYTES; a text prompt at most MAX_PROMPT_CHARS characters, a token prompt at
most MAX_PROMPT_IDS ids, a chat (`messages`: a list of {role, content} maps that the
daemon renders with the model's chat template) at most MAX_MESSAGES messages and
MAX_PROMPT_CHARS characters of content in all (the daemon also refuses prompt +
max_tokens over its context). `messages` is left out of the encoding when it is None, so
a daemon that predates it still reads every other generate request. `progress` events
(prompt tokens processed so far, of how many) come only to a request that asks for them
with `progress: true`, so a client that predates them never sees one.
A malformed, oversized, wrongly versioned or unknown message gets an `error` reply and
changes nothing else. Validation lives here, in `decode_request`, and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Union

import msgpack

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20
MAX_PROMPT_CHARS = 256 * 1024
MAX_PROMPT_IDS = 128 * 1024
MAX_ID_CHARS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 24
SPECULATIVE_MODES = ("mtp", "draft")
MAX_DRAFT_TOKENS = 8
MAX_PATH_CHARS = 4096
MAX_MESSAGES = 1024
MAX_ROLE_CHARS = 32
# Below these, sampling is the greedy choice it tends to: float32 cannot compute it
# (1/temp overflows to inf near 1e-38, top_p underflows near 1e-45) and gave
# seed-dependent garbage; at the floors it is already greedy in all but ties.
MIN_TEMP = 1e-3
MIN_TOP_P = 1e-6

# Error codes of `error` replies.
BAD_MESSAGE = "bad_message"  # not one msgpack map, or a field of the wrong type or range
TOO_LARGE = "too_large"  # over MAX_MESSAGE_BYTES or a prompt limit
BAD_VERSION = "bad_version"
UNKNOWN_TYPE = "unknown_type"
NOT_FOUND = "not_found"  # cancel of an unknown request id
DUPLICATE_ID = "duplicate_id"  # a request id this client already has in flight
BUSY = "busy"  # the queue is full
TOO_LONG = "too_long"  # prompt + max_tokens over the daemon's context
SHUTTING_DOWN = "shutting_down"
ENGINE = "engine"  # the model failed on this request (e.g. an unreadable expert)
INTERNAL = "internal"


class ProtocolError(ValueError):
    """A message that cannot be accepted; `code` goes into the `error` reply."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# ---- client -> daemon ----------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat; on the wire a {role, content} map."""

    role: str
    content: str


@dataclass(frozen=True)
class Generate:
    TYPE: ClassVar[str] = "generate"
    # Fields sent only when they are not None (added after version 1 first shipped).
    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "messages",
        "speculative",
        "draft_tokens",
        "draft_model",
        "diagnostics",
        "progress",
    )
    id: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Speculative decoding: "mtp" (the model's MTP head) or "draft" (draft_model, a
    # store or mlx-lm folder on the daemon's machine); draft_tokens K per round.
    speculative: str | None = None
    draft_tokens: int | None = None
    draft_model: str | None = None
    # True: the done event's stats carry this request's hot-path diagnostics.
    diagnostics: bool | None = None
    # True: `progress` events report the prompt's prefill before the first token.
    progress: bool | None = None


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    id: str
    target: str


@dataclass(frozen=True)
class Status:
    TYPE: ClassVar[str] = "status"
    id: str


@dataclass(frozen=True)
class Stats:
    TYPE: ClassVar[str] = "stats"
    id: str


@dataclass(frozen=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"
    id: str


@dataclass(frozen=True)
class Ping:
    TYPE: ClassVar[str] = "ping"
    id: str


Request = Union[Generate, Cancel, Status, Stats, Shutdown, Ping]

# ---- daemon -> client ----------------------------------------------------------------


@dataclass(frozen=True)
class Token:
    """New text of a generate request (it may span several tokens; `token` is the last)."""

    TYPE: ClassVar[str] = "token"
    id: str
    text: str
    token: int


@dataclass(frozen=True)
class Progress:
    """How far the prompt's prefill has come (sent only when the request asked)."""

    TYPE: ClassVar[str] = "progress"
    id: str
    done: int
    total: int


@dataclass(frozen=True)
class Done:
    """The end of a generate request: all its text and tokens, and its statistics."""

    TYPE: ClassVar[str] = "done"
    id: str
    text: str
    tokens: list[int]
    finish_reason: str  # length | stop | cancelled | shutdown
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[str] = "error"
    id: str
    code: str
    message: str


@dataclass(frozen=True)
class Pong:
    TYPE: ClassVar[str] = "pong"
    id: str
    pid: int
    state: str  # loading | ready | stopping
    version: str


@dataclass(frozen=True)
class StatusReply:
    TYPE: ClassVar[str] = "status"
    id: str
    status: dict[str, Any]


@dataclass(frozen=True)
class StatsReply:
    TYPE: ClassVar[str] = "stats"
    id: str
    stats: dict[str, Any]


@dataclass(frozen=True)
class Cancelled:
    TYPE: ClassVar[str] = "cancelled"
    id: str
    target: str
    found: bool


@dataclass(frozen=True)
class ShutdownReply:
    TYPE: ClassVar[str] = "shutdown"
    id: str
    pid: int


Reply = Union[Token, Progress, Done, Error, Pong, StatusReply, StatsReply, Cancelled, ShutdownReply]

REQUEST_TYPES: dict[str, type] = {c.TYPE: c for c in (Generate, Cancel, Status, Stats, Shutdown, Ping)}
REPLY_TYPES: dict[str, type] = {
    c.TYPE: c for c in (Token, Progress, Done, Error, Pong, StatusReply, StatsReply, Cancelled, ShutdownReply)
}


# ---- encoding --------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    # Scalars from numpy and the like (anything with .item()) travel as plain numbers.
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} in a message")


def encode(message: Request | Reply) -> bytes:
    """One message as msgpack bytes; `ProtocolError` for text UTF-8 cannot carry (a lone
    surrogate, as JSON's "\\ud800" decodes to)."""
    body = {"v": PROTOCOL_VERSION, "type": message.TYPE}
    body.update(asdict(message))
    for name in getattr(message, "OPTIONAL", ()):
        if body[name] is None:
            del body[name]
    try:
        return msgpack.packb(body, use_bin_type=True, default=_plain)
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end] if isinstance(e.object, str) else ""
        raise ProtocolError(
            BAD_MESSAGE,
            f"the text holds a lone surrogate ({', '.join(f'U+{ord(c):04X}' for c in bad)}), which UTF-8 cannot carry",
            message.id,
        ) from None


def _unpack(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(TOO_LARGE, f"message of {len(data)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as e:
        # UnpackException covers truncated data and nesting too deep; ValueError covers
        # extra bytes, bad UTF-8 and reserved codes.
        raise ProtocolError(BAD_MESSAGE, f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError(BAD_MESSAGE, f"a message must be a msgpack map, not {type(body).__name__}")
    return body


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _header(body: dict[str, Any], types: Mapping[str, type]) -> tuple[type, str]:
    rid = body.get("id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else ""
    version = body.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            BAD_VERSION,
            f"protocol version {_short(version)} is not supported (this side speaks {PROTOCOL_VERSION})",
            rid,
        )
    kind = body.get("type")
    if not isinstance(kind, str) or kind not in types:
        raise ProtocolError(
            UNKNOWN_TYPE, f"unknown message type {_short(kind)} (known: {', '.join(sorted(types))})", rid
        )
    # Only an error may lack an id: the one answering a message whose id was unreadable.
    if not rid and not (kind == Error.TYPE and body.get("id") == ""):
        raise ProtocolError(
            BAD_MESSAGE, f"'id' must be a string of 1 to {MAX_ID_CHARS} characters, got {_short(body.get('id'))}"
        )
    return types[kind], rid


def _check(ok: bool, rid: str, message: str, code: str = BAD_MESSAGE) -> None:
    if not ok:
        raise ProtocolError(code, message, rid)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _messages_field(messages: Any, rid: str) -> tuple[ChatMessage, ...]:
    _check(
        isinstance(messages, list) and 0 < len(messages) <= MAX_MESSAGES,
        rid,
        f"'messages' must be a list of 1 to {MAX_MESSAGES} {{role, content}} maps",
    )
    out = []
    chars = 0
    for i, m in enumerate(messages):
        _check(
            isinstance(m, dict) and set(m) == {"role", "content"},
            rid,
            f"messages[{i}] must be a map with exactly the keys 'role' and 'content'",
        )
        role, content = m["role"], m["content"]
        _check(
            isinstance(role, str) and 0 < len(role) <= MAX_ROLE_CHARS,
            rid,
            f"messages[{i}].role must be a string of 1 to {MAX_ROLE_CHARS} characters",
        )
        _check(isinstance(content, str), rid, f"messages[{i}].content must be a string")
        chars += len(content)
        out.append(ChatMessage(role=role, content=content))
    _check(
        chars <= MAX_PROMPT_CHARS,
        rid,
        f"messages of {chars} characters are over the limit of {MAX_PROMPT_CHARS}",
        TOO_LARGE,
    )
    return tuple(out)


def _generate_fields(body: dict[str, Any], rid: str) -> dict[str, Any]:
    prompt, ids, messages = body.get("prompt"), body.get("prompt_ids"), body.get("messages")
    _check(
        sum(x is not None for x in (prompt, ids, messages)) == 1,
        rid,
        "give exactly one of 'prompt' (text), 'prompt_ids' and 'messages' (a chat)",
    )
    if messages is not None:
        messages = _messages_field(messages, rid)
    if prompt is not None:
        _check(isinstance(prompt, str), rid, "'prompt' must be a string")
        _check(
            len(prompt) <= MAX_PROMPT_CHARS,
            rid,
            f"prompt of {len(prompt)} characters is over the limit of {MAX_PROMPT_CHARS}",
            TOO_LARGE,
        )
    if ids is not None:
        _check(isinstance(ids, list) and len(ids) > 0, rid, "'prompt_ids' must be a non-empty list of token ids")
        _check(
            len(ids) <= MAX_PROMPT_IDS,
            rid,
            f"prompt of {len(ids)} ids is over the limit of {MAX_PROMPT_IDS}",
            TOO_LARGE,
        )
        _check(all(_is_int(t) and 0 <= t < 2**31 for t in ids), rid, "'prompt_ids' must hold token ids in 0..2^31-1")
        ids = tuple(ids)
    max_tokens = body.get("max_tokens", 256)
    _check(
        _is_int(max_tokens) and 1 <= max_tokens <= MAX_TOKENS_LIMIT,
        rid,
        f"'max_tokens' must be a whole number in 1..{MAX_TOKENS_LIMIT}",
    )
    temp = body.get("temp", 0.0)
    _check(_is_number(temp) and 0.0 <= temp <= 100.0, rid, "'temp' must be a number in 0..100")
    top_p = body.get("top_p", 1.0)
    _check(_is_number(top_p) and 0.0 < top_p <= 1.0, rid, "'top_p' must be a number in (0, 1]")
    seed = body.get("seed")
    _check(
        seed is None or (_is_int(seed) and 0 <= seed < 2**63), rid, "'seed' must be null or a whole number in 0..2^63-1"
    )
    stop = body.get("stop", [])
    _check(
        isinstance(stop, list)
        and len(stop) <= MAX_STOP_STRINGS
        and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop),
        rid,
        f"'stop' must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
    )
    if temp < MIN_TEMP or top_p < MIN_TOP_P:
        temp = 0.0
    return {
        "prompt": prompt,
        "prompt_ids": ids,
        "messages": messages,
        "max_tokens": max_tokens,
        "temp": float(temp),
        "top_p": float(top_p),
        "seed": seed,
        "stop": tuple(stop),
        **_speculative_fields(body, rid),
        "diagnostics": _flag_field(body, "diagnostics", rid),
        "progress": _flag_field(body, "progress", rid),
    }


def _flag_field(body: dict[str, Any], name: str, rid: str) -> bool | None:
    value = body.get(name)
    _check(value is None or isinstance(value, bool), rid, f"'{name}' must be null, true or false")
    return value


def _speculative_fields(body: dict[str, Any], rid: str) -> dict[str, Any]:
    mode, k, draft = body.get("speculative"), body.get("draft_tokens"), body.get("draft_model")
    _check(
        mode is None or mode in SPECULATIVE_MODES,
        rid,
        f"'speculative' must be null or one of {list(SPECULATIVE_MODES)}",
    )
    _check(
        k is None or (_is_int(k) and 1 <= k <= MAX_DRAFT_TOKENS),
        rid,
        f"'draft_tokens' must be null or a whole number in 1..{MAX_DRAFT_TOKENS}",
    )
    _check(
        draft is None or (isinstance(draft, str) and 0 < len(draft) <= MAX_PATH_CHARS),
        rid,
        f"'draft_model' must be null or a path of 1 to {MAX_PATH_CHARS} characters",
    )
    _check(
        (mode == "draft") == (draft is not None), rid, "'draft_model' goes with speculative 'draft', and only with it"
    )
    _check(mode is not None or k is None, rid, "'draft_tokens' needs 'speculative'")
    return {"speculative": mode, "draft_tokens": k, "draft_model": draft}


def _cancel_fields(body: dict[str, Any], rid: str) -> dict[str, Any]:
    target = body.get("target")
    _check(
        isinstance(target, str) and 0 < len(target) <= MAX_ID_CHARS,
        rid,
        "'target' must be the id of a generate request",
    )
    return {"target": target}


_FIELD_READERS: dict[type, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    Generate: _generate_fields,
    Cancel: _cancel_fields,
}


def decode_request(data: bytes) -> Request:
    """Parse and validate one client message; raise `ProtocolError` on anything wrong."""
    body = _unpack(data)
    cls, rid = _header(body, REQUEST_TYPES)
    allowed = {f for f in cls.__dataclass_fields__} | {"v", "type"}
    unknown = sorted(_short(k) for k in body if k not in allowed)
    _check(not unknown, rid, f"unknown field(s) {unknown} in a {cls.TYPE} message")
    reader = _FIELD_READERS.get(cls)
    values = reader(body, rid) if reader else {}
    return cls(id=rid, **values)


def decode_reply(data: bytes) -> Reply:
    """Parse one daemon message (the daemon is trusted; only the shape is checked)."""
    body = _unpack(data)
    cls, rid = _header(body, REPLY_TYPES)
    names = [f for f in cls.__dataclass_fields__ if f != "id"]
    try:
        return cls(id=rid, **{k: body[k] for k in names if k in body})
    except TypeError as e:
        raise ProtocolError(BAD_MESSAGE, f"malformed {cls.TYPE} reply: {e}", rid) from None


def error_reply(request_id: str, code: str, message: str) -> bytes:
    """An encoded `error` message."""
    return encode(Error(id=request_id, code=code, message=message))
