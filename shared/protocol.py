"""The daemon's wire protocol: msgpack maps, never pickle.

Every message is one ZeroMQ frame holding a msgpack map with `v` (PROTOCOL_VERSION),
`type` and `id` (the request id a reply or event belongs to; chosen by the client,
1 to 64 characters, unique among its own requests). Client -> daemon:

  generate  prompt | prompt_ids | messages, max_tokens, temp, top_p, seed, stop,
            (temp below MIN_TEMP, or top_p below MIN_TOP_P: greedy, the limit they tend to)
            [tools, tool_choice, constraint, speculative, draft_tokens, draft_model, diagnostics, progress,
             keep_alive, thinking, top_k, sampling, client, client_key]
                                                        -> accepted, progress*, (token | tool_call)*, done
  count_tokens  prompt | prompt_ids | messages, [tools, tool_choice, thinking]  -> token_count
  cancel    target (the id of one of this client's generate requests)  -> cancelled
  load      [keep_alive]                                               -> load
  status / stats / ping / shutdown                                     -> status / stats / pong / shutdown

Any request may instead get `error` {code, message}. Limits: a message is at most
MAX_MESSAGE_BYTES; a text prompt at most MAX_PROMPT_CHARS characters, a token prompt at
most MAX_PROMPT_IDS ids, a chat (`messages`: a list of {role, content} maps that the
daemon renders with the model's chat template) at most MAX_MESSAGES messages and
MAX_PROMPT_CHARS characters of content in all (the daemon also refuses a prompt that
fills its context, and cuts a max_tokens past it to the room left: the request then ends
with finish_reason "length"). `messages` is left out of the encoding when it is None, so
a daemon that predates it still reads every other generate request. `progress` events
(prompt tokens processed so far, of how many) come only to a request that asks for them
with `progress: true`, so a client that predates them never sees one; a request that
finds the model unloaded (after `keep_alive`) first gets `progress` events with `stage`
"load" (steps of the load done, of how many). `keep_alive` (seconds; -1: never) is how
long the model stays loaded once the daemon is idle after this request, in place of the
daemon's setting (Ollama's per-request keep_alive).
`accepted` comes as soon as the prompt has passed its checks (tokenized, within the
context) and the request is queued, with the prompt's length in tokens: an HTTP gateway
sends its status line and headers then, not at the first token, which a long prefill may
put minutes away. A `cancel` (or a shutdown) takes effect at the end of the prefill piece
in flight (a layer, or a chunk), and `cancelled` comes then. `thinking` (true / false)
turns the chat template's thinking switch on or off where the model has one (None: the
template's default); a thinking model's
reasoning comes as `token` events with `reasoning` true, and `done` holds it apart from
the answer's `text` in `reasoning`. `top_k` (None or 0: off) keeps only the k likeliest
tokens before sampling. `sampling` (a `SamplingControls` map, None: none of them) holds
the rest of mlx-lm's sampler and logits processors (min_p, the presence, frequency and
repetition penalties over a window of the last tokens, logit_bias) and `logprobs`: with
it each `token` event carries the log-probabilities of the tokens it completes (each
with its `logprobs` likeliest alternatives) and `done` all of them, taken from the
logits the sampler sees (after the processors, before temperature).
A max_tokens past the daemon's context is lowered to what the prompt leaves (the answer
then ends "length": Anthropic's clients ask for 32000 whatever the model); a prompt that
leaves no room at all is refused as too long. An assistant's chat message may carry its
earlier `reasoning`, which the template renders where it renders reasoning (its
`reasoning_content`).
A user's chat message may carry `images` ({data, media_type} maps, `data` the image
file's bytes: never a path or URL), at most MAX_IMAGES a request of MAX_IMAGE_BYTES each;
a message with images may pass MAX_MESSAGE_BYTES by their bytes. The daemon decodes them
(MAX_IMAGE_PIXELS) and refuses with `bad_image` an image it cannot use, or any image
where its model takes none (`status`'s capabilities say `vision`).
`count_tokens` renders and tokenizes a prompt as `generate` would (its thinking switch,
tools) and answers with its length in tokens, from the daemon's prompt-check thread: it
never waits on the model's forwards and runs none (an unloaded model is loaded first).
`load` is Ollama's load request: an unloaded model is loaded, and the idle clock starts
again with the request's `keep_alive` (as a generate's would); keep_alive 0 releases the
model as soon as nothing is in flight (Ollama's `ollama stop`). Its reply comes once that
is done, with the engine's state (ready, or unloaded) and the requests still in flight.
`client` (at most MAX_CLIENT_CHARS printable characters) names who
sent the request, as `status` lists it ("moestreamctl generate", a gateway's caller).
`cache_scope` (as many characters) says whose cached prompts it may reuse: only those of
requests with the same scope (the gateway sends a digest of its caller's identity, so that
one client cannot learn another's prompt from what is cached); none: the shared scope.
`client_key` (as many characters, printable) is the client it counts against when the
daemon shares its queue and its active slots (None: its connection): the gateway sends its
caller's address, so that the many connections of one HTTP client are one client.
Tools (`tools`: function schemas as OpenAI writes them, `{"type": "function", "function":
{name, description, parameters}}`; `tool_choice`: auto | none | required | {"name": N})
are rendered by the model's chat template; the daemon parses the model's tool-call text
with the model's mlx-lm tool parser and sends each call as a `tool_call` event (never as
`token` text), and `done` lists them in `tool_calls`; each carries the call's `text` as the
model wrote it (its markers included) where that text is one whole call. A chat message may
carry the assistant's earlier `tool_calls` ({name, arguments} maps) with their `call_texts`
(that text, kept by the gateway, or None: the template then renders the call itself), and a
`tool` message its `tool_call_id` and `name`; these keys are left out of the encoding when
unused.
`constraint` ({kind, schema}) makes the answer JSON: kind "json_object" (any JSON object) or
"json_schema" (`schema`: a JSON schema's text, which the answer then matches); the daemon
enforces it with a grammar (daemon/model/constrain.py) and refuses a schema it cannot
enforce. `tool_choice` required, a named function and none are enforced the same way.
A malformed, oversized, wrongly versioned or unknown message gets an `error` reply and
changes nothing else. Validation lives here, in `decode_request`, and nowhere else.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Union, get_args

import msgpack

from .status import RequestStats, from_wire
from .status import Stats as DaemonStats  # beside the `Stats` request below
from .status import Status as DaemonStatus  # beside the `Status` request below

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20
MAX_PROMPT_CHARS = 256 * 1024
MAX_PROMPT_IDS = 128 * 1024
MAX_ID_CHARS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_CLIENT_CHARS = 120
MAX_TOKENS_LIMIT = 1 << 24
SPECULATIVE_MODES = ("mtp", "draft")
MAX_DRAFT_TOKENS = 8
MAX_PATH_CHARS = 4096
MAX_MESSAGES = 1024
MAX_ROLE_CHARS = 32
MAX_TOOLS = 128
MAX_NAME_CHARS = 256
MAX_JSON_DEPTH = 32
# Images (a chat message's `images`): bytes of one (Anthropic's own limit), images per
# request, and the pixels of one (its header's width x height, checked before it is decoded).
MAX_IMAGE_BYTES = 5 << 20
MAX_IMAGES = 8
MAX_IMAGE_PIXELS = 5000 * 5000
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
# A message with images may be larger than MAX_MESSAGE_BYTES by its images' bytes.
MAX_IMAGE_MESSAGE_BYTES = MAX_MESSAGE_BYTES + MAX_IMAGES * MAX_IMAGE_BYTES
TOOL_CHOICES = ("auto", "none", "required")
CONSTRAINT_KINDS = ("json_object", "json_schema")
MAX_KEEP_ALIVE_S = 2**31  # seconds; above it means never, as -1 does
# The engine's states in which a request is served: "unloaded" loads the model first.
SERVING_STATES = ("ready", "unloaded")
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
TOO_LONG = "too_long"  # a prompt that fills the daemon's context
SHUTTING_DOWN = "shutting_down"
ENGINE = "engine"  # the model failed on this request (e.g. an unreadable expert)
# The machine is under critical memory pressure with the pool at its floor
# (daemon/pool/elastic.py): new requests are refused until it passes.
MEMORY_PRESSURE = "memory_pressure"
INTERNAL = "internal"
# An image the daemon cannot use: not an image, truncated, over the pixel limit, or sent
# to a model that takes no images (an HTTP gateway answers 400).
BAD_IMAGE = "bad_image"


class ProtocolError(ValueError):
    """A message that cannot be accepted; `code` goes into the `error` reply."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# ---- client -> daemon ----------------------------------------------------------------


@dataclass(frozen=True)
class ImageData:
    """One image of a chat message, as its file's bytes (PNG, JPEG, GIF or WebP), never a
    path or URL: the daemon reads no files and fetches nothing for a client. On the wire
    a {data, media_type} map, `data` msgpack bin."""

    data: bytes
    media_type: str = ""


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat; on the wire a {role, content} map, plus the optional keys
    when set: an assistant's `tool_calls` ({name, arguments} maps, arguments a map), the
    text the model wrote for each (`call_texts`, None where not known) and earlier
    `reasoning`, and a tool result's `tool_call_id` and `name`."""

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    # Beside `tool_calls`, one each: the call's text as the model sampled it (start and end
    # markers included), which the daemon renders in place of the template's own
    # serialisation of that call, so that a resent turn's tokens are the ones it sampled
    # (daemon/model/tool_calls.py `render_call_texts`); None: the template's.
    call_texts: tuple[str | None, ...] | None = None
    # Images of a user's message, shown to the model before its text (a vision model's
    # chat template places them); None: none.
    images: tuple[ImageData, ...] | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates (Hugging Face's convention) take it."""
        content: Any = self.content
        if self.images:
            # Content parts, as vision models' templates take them: the images, then the text.
            content = [{"type": "image"} for _ in self.images] + [{"type": "text", "text": self.content}]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning:
            out["reasoning_content"] = self.reasoning  # the name thinking models' templates read
        return out


MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI caps top_logprobs
MAX_PENALTY_WINDOW = 1 << 20  # tokens a penalty looks back over


@dataclass(frozen=True)
class SamplingControls:
    """A request's sampling beyond temperature, top-p and top-k, as mlx-lm's
    `make_sampler` (min_p) and `make_logits_processors` take it. The defaults change
    nothing; a penalty of 0 (repetition: 1) is off."""

    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Multiplies (divides) a repeated token's negative (positive) logit: 1 is off.
    repetition_penalty: float = 1.0
    # The last tokens (the prompt's too) the three penalties look at (mlx-lm's context sizes,
    # Ollama's repeat_last_n).
    penalty_window: int = 20
    # (token id, bias) pairs added to the logits (OpenAI's logit_bias; -100 bans a token).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no log-probabilities; k: each token's, with its k likeliest alternatives.
    logprobs: int | None = None

    def has_processors(self) -> bool:
        """Whether any logits processor runs (the penalties, logit_bias)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def needs_logits(self) -> bool:
        """Whether the request needs each token's logits (processors, logprobs): it then
        decodes without speculation, which verifies drafts on the model's own logits."""
        return self.has_processors() or self.logprobs is not None


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must be: a JSON object ("json_object"), or JSON that
    matches `schema` ("json_schema"; the schema as JSON text, so that msgpack carries it
    as the client wrote it). On the wire a {kind, schema} map."""

    kind: str
    schema: str | None = None


@dataclass(frozen=True)
class Generate:
    TYPE: ClassVar[str] = "generate"
    # Sent even when None, as version 1 first shipped them (`encode` leaves out the other
    # fields whose default is None while they are None: those added since).
    SENT_AS_NIL: ClassVar[tuple[str, ...]] = ("prompt", "prompt_ids", "seed")
    id: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Function schemas for the chat template, and which the model may or must call:
    # "auto" (default), "none", "required", or {"name": N} (that function).
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | dict[str, str] | None = None
    # The answer's form (JSON, JSON of a schema), enforced while it is sampled; None: free.
    constraint: Constraint | None = None
    # Speculative decoding: "mtp" (the model's MTP head) or "draft" (draft_model, a
    # store or mlx-lm folder on the daemon's machine); draft_tokens K per round.
    speculative: str | None = None
    draft_tokens: int | None = None
    draft_model: str | None = None
    # True: the done event's stats carry this request's hot-path diagnostics.
    diagnostics: bool | None = None
    # True: `progress` events report the prompt's prefill before the first token.
    progress: bool | None = None
    # Seconds the model stays loaded once idle after this request (-1: never); None: the daemon's.
    keep_alive: float | None = None
    # True / False: the chat template's thinking switch (enable_thinking); None: its default.
    thinking: bool | None = None
    # Sample from the k likeliest tokens only; None or 0: all of them.
    top_k: int | None = None
    # min_p, penalties, logit_bias, logprobs; None: none of them.
    sampling: SamplingControls | None = None
    # Who sent it, as `status` lists the request; None: the client's connection.
    client: str | None = None
    # Whose cached prompts it may reuse, and who may reuse its own: requests of the same
    # scope (the gateway sends a digest of the client's identity); None: the shared scope.
    cache_scope: str | None = None
    # The client it counts against in the daemon's shares of queue and slots; None: its connection.
    client_key: str | None = None

    def speculates(self) -> bool:
        """Whether it decodes speculatively (it asks, and needs no logits)."""
        return self.speculative is not None and not (self.sampling is not None and self.sampling.needs_logits())


@dataclass(frozen=True)
class CountTokens:
    """The length in tokens of a prompt as `generate` would render it (no forward runs)."""

    TYPE: ClassVar[str] = "count_tokens"
    id: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | dict[str, str] | None = None
    thinking: bool | None = None


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    id: str
    target: str


@dataclass(frozen=True)
class Load:
    """The model loaded (now, if it was unloaded) and kept `keep_alive` seconds once idle
    (-1: never; None: the daemon's setting); 0 releases it once nothing is in flight."""

    TYPE: ClassVar[str] = "load"
    id: str
    keep_alive: float | None = None


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


Request = Union[Generate, CountTokens, Cancel, Load, Status, Stats, Shutdown, Ping]

# ---- daemon -> client ----------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """The request passed its checks and is queued: `prompt_tokens` is the prompt's length
    in tokens (the chat rendered by the template). Sent before any other event (but the
    load's progress of a model that was unloaded), at once, even while the engine prefills
    another request's prompt."""

    TYPE: ClassVar[str] = "accepted"
    id: str
    prompt_tokens: int


@dataclass(frozen=True)
class TopLogprob:
    """One of the likeliest tokens at a position: its id, its text alone, its log-probability."""

    token: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token the model made: its id, the text it added to the answer (these concatenate
    to the text they cover), its log-probability and the likeliest alternatives, best first."""

    token: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Token:
    """New text of a generate request (it may span several tokens; `token` is the last).
    `reasoning` True: the text is the model's reasoning (between its thinking markers).
    `logprobs` (a request that asked): the tokens made since the last event that carried them."""

    TYPE: ClassVar[str] = "token"
    id: str
    text: str
    token: int
    reasoning: bool | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made, parsed by the model's tool parser: the function's
    name and its arguments as a JSON object's text; `index` counts the request's calls.
    `text`: the call as the model wrote it, markers included (None where its text held
    several calls, or the answer ended inside it)."""

    TYPE: ClassVar[str] = "tool_call"
    id: str
    index: int
    name: str
    arguments: str
    text: str | None = None


@dataclass(frozen=True)
class Progress:
    """How far the prompt's prefill has come (sent only when the request asked), or, with
    `stage` "load", how far the load of an unloaded model has come."""

    TYPE: ClassVar[str] = "progress"
    id: str
    done: int
    total: int
    stage: str | None = None  # None: the prefill; "load": the model's load


@dataclass(frozen=True)
class Done:
    """The end of a generate request: all its text and tokens, and its statistics.

    `tokens` are the tokens of `text`: an end token that stopped the request is not among
    them (stock mlx-lm's `generate_step` yields it last); `finish_reason` "stop" says an
    end token or a stop string ended it."""

    TYPE: ClassVar[str] = "done"
    id: str
    text: str
    tokens: list[int]
    finish_reason: str  # length | stop | cancelled | shutdown
    stats: RequestStats = field(default_factory=RequestStats)
    # The request's tool calls ({name, arguments} maps, arguments as JSON text, and the
    # call's `text` where the tool_call event has one), all of them (each was sent as a
    # tool_call event too); `text` then holds the rest.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # A thinking model's reasoning, apart from `text` (the answer).
    reasoning: str = ""
    # A request that asked for log-probabilities: every token's (the reasoning's too), in order.
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class TokenCount:
    """The answer to `count_tokens`: the prompt's length in tokens."""

    TYPE: ClassVar[str] = "token_count"
    id: str
    prompt_tokens: int


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
    status: DaemonStatus


@dataclass(frozen=True)
class StatsReply:
    TYPE: ClassVar[str] = "stats"
    id: str
    stats: DaemonStats


@dataclass(frozen=True)
class Cancelled:
    TYPE: ClassVar[str] = "cancelled"
    id: str
    target: str
    found: bool


@dataclass(frozen=True)
class LoadReply:
    """A load done: the engine's state now (ready; unloaded after a keep_alive 0, unless
    requests are still in flight, which it then waits for) and those requests."""

    TYPE: ClassVar[str] = "load"
    id: str
    state: str
    in_flight: int


@dataclass(frozen=True)
class ShutdownReply:
    TYPE: ClassVar[str] = "shutdown"
    id: str
    pid: int


Reply = Union[
    Accepted,
    Token,
    ToolCall,
    Progress,
    Done,
    TokenCount,
    Error,
    Pong,
    StatusReply,
    StatsReply,
    Cancelled,
    LoadReply,
    ShutdownReply,
]

REQUEST_TYPES: dict[str, type] = {c.TYPE: c for c in get_args(Request)}
REPLY_TYPES: dict[str, type] = {c.TYPE: c for c in get_args(Reply)}


# ---- encoding --------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    # Scalars from numpy and the like (anything with .item()) travel as plain numbers.
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} in a message")


def _left_out_when_none(cls: type) -> list[str]:
    """The fields `encode` leaves out while they are None: those whose default is None
    (added after version 1 first shipped), but for the class's SENT_AS_NIL."""
    return [f.name for f in fields(cls) if f.default is None and f.name not in getattr(cls, "SENT_AS_NIL", ())]


def encode(message: Request | Reply) -> bytes:
    """One message as msgpack bytes; `ProtocolError` for text UTF-8 cannot carry (a lone
    surrogate, as JSON's "\\ud800" decodes to)."""
    body = {"v": PROTOCOL_VERSION, "type": message.TYPE}
    body.update(asdict(message))
    for name in _left_out_when_none(type(message)):
        if body[name] is None:
            del body[name]
    if body.get("messages"):
        body["messages"] = [{k: v for k, v in m.items() if v is not None} for m in body["messages"]]
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
    # A msgpack map may carry images past MAX_MESSAGE_BYTES (their bytes are counted out
    # once it is read: `_images_field`); anything else over it is refused unread.
    is_map = bool(data) and (data[0] & 0xF0 == 0x80 or data[0] in (0xDE, 0xDF))
    limit = MAX_IMAGE_MESSAGE_BYTES if is_map else MAX_MESSAGE_BYTES
    if len(data) > limit:
        raise ProtocolError(TOO_LARGE, f"message of {len(data)} bytes is over the limit of {limit}")
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


def _json_value(x: Any, depth: int = 0) -> bool:
    """Whether `x` is JSON data (maps with string keys, lists, strings, numbers, booleans,
    null) nested at most MAX_JSON_DEPTH deep."""
    if depth > MAX_JSON_DEPTH:
        return False
    if x is None or isinstance(x, (str, bool, int)):
        return True
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, list):
        return all(_json_value(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return all(isinstance(k, str) and _json_value(v, depth + 1) for k, v in x.items())
    return False


def _name(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_NAME_CHARS


def _tool_calls_field(calls: Any, where: str, rid: str) -> tuple[dict[str, Any], ...]:
    _check(isinstance(calls, list), rid, f"{where} must be a list of {{name, arguments}} maps")
    out = []
    for j, c in enumerate(calls):
        _check(
            isinstance(c, dict)
            and set(c) == {"name", "arguments"}
            and _name(c["name"])
            and isinstance(c["arguments"], dict)
            and _json_value(c["arguments"]),
            rid,
            f"{where}[{j}] must be a map of 'name' (a string of 1 to {MAX_NAME_CHARS} characters) and "
            "'arguments' (a map of JSON data)",
        )
        out.append({"name": c["name"], "arguments": c["arguments"]})
    return tuple(out)


def _images_field(images: Any, where: str, rid: str) -> tuple[ImageData, ...]:
    _check(
        isinstance(images, list) and 0 < len(images) <= MAX_IMAGES,
        rid,
        f"{where} must be a list of 1 to {MAX_IMAGES} {{data, media_type}} maps",
    )
    out = []
    for j, im in enumerate(images):
        _check(
            isinstance(im, dict)
            and set(im) <= {"data", "media_type"}
            and isinstance(im.get("data"), bytes)
            and isinstance(im.get("media_type", ""), str)
            and len(im.get("media_type", "")) <= MAX_NAME_CHARS,
            rid,
            f"{where}[{j}] must be a map of 'data' (the image file's bytes) and optionally 'media_type' (a string)",
        )
        size = len(im["data"])
        _check(
            0 < size <= MAX_IMAGE_BYTES,
            rid,
            f"{where}[{j}] has {size} bytes: 1 to {MAX_IMAGE_BYTES} allowed",
            BAD_IMAGE,
        )
        out.append(ImageData(im["data"], im.get("media_type", "")))
    return tuple(out)


def _messages_field(messages: Any, rid: str) -> tuple[ChatMessage, ...]:
    _check(
        isinstance(messages, list) and 0 < len(messages) <= MAX_MESSAGES,
        rid,
        f"'messages' must be a list of 1 to {MAX_MESSAGES} {{role, content}} maps",
    )
    out = []
    chars = n_images = 0
    optional = _left_out_when_none(ChatMessage)
    keys = {"role", "content", *optional}
    for i, m in enumerate(messages):
        _check(
            isinstance(m, dict) and {"role", "content"} <= set(m) <= keys,
            rid,
            f"messages[{i}] must be a map with the keys 'role' and 'content', and optionally {optional}",
        )
        role, content = m["role"], m["content"]
        _check(
            isinstance(role, str) and 0 < len(role) <= MAX_ROLE_CHARS,
            rid,
            f"messages[{i}].role must be a string of 1 to {MAX_ROLE_CHARS} characters",
        )
        _check(isinstance(content, str), rid, f"messages[{i}].content must be a string")
        calls = m.get("tool_calls")
        if calls is not None:
            calls = _tool_calls_field(calls, f"messages[{i}].tool_calls", rid)
        for key in ("tool_call_id", "name"):
            _check(
                m.get(key) is None or _name(m[key]),
                rid,
                f"messages[{i}].{key} must be a string of 1 to {MAX_NAME_CHARS} characters",
            )
        reasoning = m.get("reasoning")
        _check(reasoning is None or isinstance(reasoning, str), rid, f"messages[{i}].reasoning must be a string")
        texts = m.get("call_texts")
        if texts is not None:
            _check(
                calls is not None
                and isinstance(texts, list)
                and len(texts) == len(calls)
                and all(t is None or isinstance(t, str) for t in texts),
                rid,
                f"messages[{i}].call_texts must be a list of strings or nulls, one for each of its tool_calls",
            )
            texts = tuple(texts)
        images = m.get("images")
        if images is not None:
            images = _images_field(images, f"messages[{i}].images", rid)
            n_images += len(images)
        chars += len(content) + len(reasoning or "") + sum(len(t or "") for t in texts or ())
        ids = {"tool_call_id": m.get("tool_call_id"), "name": m.get("name")}
        out.append(
            ChatMessage(
                role=role,
                content=content,
                tool_calls=calls,
                reasoning=reasoning,
                call_texts=texts,
                images=images,
                **ids,
            )
        )
    _check(
        n_images <= MAX_IMAGES,
        rid,
        f"{n_images} images in one request are over the limit of {MAX_IMAGES}",
        BAD_IMAGE,
    )
    _check(
        chars <= MAX_PROMPT_CHARS,
        rid,
        f"messages of {chars} characters are over the limit of {MAX_PROMPT_CHARS}",
        TOO_LARGE,
    )
    return tuple(out)


def _tools_fields(body: dict[str, Any], rid: str) -> dict[str, Any]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        _check(
            isinstance(tools, list) and len(tools) <= MAX_TOOLS,
            rid,
            f"'tools' must be a list of at most {MAX_TOOLS} function schemas",
        )
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            _check(
                isinstance(fn, dict) and t.get("type") == "function" and _name(fn.get("name")) and _json_value(t),
                rid,
                f"tools[{i}] must be a map {{type: 'function', function: {{name, description, parameters}}}} "
                "of JSON data",
            )
        tools = tuple(tools)
    named = isinstance(choice, dict) and set(choice) == {"name"} and _name(choice["name"])
    _check(
        choice is None or choice in TOOL_CHOICES or named,
        rid,
        f"'tool_choice' must be null, one of {list(TOOL_CHOICES)} or {{name: N}}",
    )
    if named:
        _check(
            any(t["function"]["name"] == choice["name"] for t in tools or ()),
            rid,
            f"'tool_choice' names {choice['name']!r}, which is not among 'tools'",
        )
    _check(
        choice in (None, "auto", "none") or tools,
        rid,
        "'tool_choice' required or named needs 'tools'",
    )
    return {"tools": tools, "tool_choice": choice}


def _prompt_fields(body: dict[str, Any], rid: str) -> dict[str, Any]:
    """The prompt of a generate or count_tokens request: one of text, ids or a chat (with
    its tools and thinking switch)."""
    prompt, ids, messages = body.get("prompt"), body.get("prompt_ids"), body.get("messages")
    _check(
        sum(x is not None for x in (prompt, ids, messages)) == 1,
        rid,
        "give exactly one of 'prompt' (text), 'prompt_ids' and 'messages' (a chat)",
    )
    if messages is not None:
        messages = _messages_field(messages, rid)
    _check(
        messages is not None or (body.get("tools") is None and body.get("tool_choice") is None),
        rid,
        "'tools' and 'tool_choice' go with 'messages' (a chat)",
    )
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
    return {
        "prompt": prompt,
        "prompt_ids": ids,
        "messages": messages,
        **_tools_fields(body, rid),
        "thinking": _flag_field(body, "thinking", rid),
    }


def _generate_fields(body: dict[str, Any], rid: str) -> dict[str, Any]:
    fields = _prompt_fields(body, rid)
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
    constraint = _constraint_field(body, rid)
    _check(
        constraint is None or fields["tool_choice"] in (None, "auto", "none"),
        rid,
        "'constraint' and a 'tool_choice' that forces a call (required, or a named function) exclude each other",
    )
    return {
        **fields,
        "constraint": constraint,
        "max_tokens": max_tokens,
        "temp": float(temp),
        "top_p": float(top_p),
        "seed": seed,
        "stop": tuple(stop),
        **_speculative_fields(body, rid),
        "diagnostics": _flag_field(body, "diagnostics", rid),
        "progress": _flag_field(body, "progress", rid),
        "keep_alive": _keep_alive_field(body, rid),
        "top_k": _top_k_field(body, rid),
        "sampling": _sampling_field(body, rid),
        "client": _client_field(body, rid),
        "cache_scope": _client_field(body, rid, "cache_scope"),
        "client_key": _client_field(body, rid, "client_key"),
    }


def _constraint_field(body: dict[str, Any], rid: str) -> Constraint | None:
    value = body.get("constraint")
    if value is None:
        return None
    _check(
        isinstance(value, dict) and set(value) <= {"kind", "schema"} and value.get("kind") in CONSTRAINT_KINDS,
        rid,
        f"'constraint' must be null or a map {{kind, schema}} with kind one of {list(CONSTRAINT_KINDS)}",
    )
    kind, schema = value["kind"], value.get("schema")
    if kind == "json_object":
        _check(schema is None, rid, "'constraint' json_object takes no schema (use json_schema)")
        return Constraint(kind)
    _check(isinstance(schema, str), rid, "'constraint' json_schema needs 'schema': a JSON schema as JSON text")
    try:
        parsed = json.loads(schema)
    except ValueError as e:
        raise ProtocolError(BAD_MESSAGE, f"'constraint' schema is not JSON: {e}", rid) from None
    _check(
        isinstance(parsed, (dict, bool)),
        rid,
        f"'constraint' schema must be a JSON schema (an object or a boolean), not {type(parsed).__name__}",
    )
    return Constraint(kind, schema)


def _client_field(body: dict[str, Any], rid: str, name: str = "client") -> str | None:
    value = body.get(name)
    _check(
        value is None or (isinstance(value, str) and 0 < len(value) <= MAX_CLIENT_CHARS and value.isprintable()),
        rid,
        f"'{name}' must be null or 1 to {MAX_CLIENT_CHARS} printable characters",
    )
    return value


def _top_k_field(body: dict[str, Any], rid: str) -> int | None:
    value = body.get("top_k")
    _check(
        value is None or (_is_int(value) and 0 <= value < 2**31),
        rid,
        "'top_k' must be null or a whole number in 0..2^31-1 (0: off)",
    )
    return value or None


def _sampling_field(body: dict[str, Any], rid: str) -> SamplingControls | None:
    value = body.get("sampling")
    if value is None:
        return None
    names = set(SamplingControls.__dataclass_fields__)
    _check(
        isinstance(value, dict) and set(value) <= names,
        rid,
        f"'sampling' must be null or a map of {sorted(names)}",
    )
    out: dict[str, Any] = {}
    bounds = {
        "min_p": (0.0, 1.0),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
        "repetition_penalty": (0.0, 10.0),
    }
    for name, (low, high) in bounds.items():
        if name in value:
            x = value[name]
            _check(_is_number(x) and low <= x <= high, rid, f"'sampling.{name}' must be a number in {low}..{high}")
            out[name] = float(x)
    _check(out.get("repetition_penalty", 1.0) > 0, rid, "'sampling.repetition_penalty' must be above 0 (1: off)")
    if "penalty_window" in value:
        x = value["penalty_window"]
        _check(
            _is_int(x) and 1 <= x <= MAX_PENALTY_WINDOW,
            rid,
            f"'sampling.penalty_window' must be a whole number in 1..{MAX_PENALTY_WINDOW}",
        )
        out["penalty_window"] = x
    bias = value.get("logit_bias", [])
    _check(
        isinstance(bias, list)
        and len(bias) <= MAX_LOGIT_BIAS
        and all(
            isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and 0 <= b[0] < 2**31 and _is_number(b[1])
            for b in bias
        )
        and all(-100 <= b[1] <= 100 for b in bias),
        rid,
        f"'sampling.logit_bias' must be a list of at most {MAX_LOGIT_BIAS} [token id, bias] pairs, bias in -100..100",
    )
    _check(len({b[0] for b in bias}) == len(bias), rid, "'sampling.logit_bias' names a token twice")
    out["logit_bias"] = tuple((b[0], float(b[1])) for b in bias)
    k = value.get("logprobs")
    _check(
        k is None or (_is_int(k) and 0 <= k <= MAX_TOP_LOGPROBS),
        rid,
        f"'sampling.logprobs' must be null or a whole number in 0..{MAX_TOP_LOGPROBS} (alternatives per token)",
    )
    out["logprobs"] = k
    return SamplingControls(**out)


def _keep_alive_field(body: dict[str, Any], rid: str) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    _check(
        _is_number(value) and (value == -1 or 0 <= value <= MAX_KEEP_ALIVE_S),
        rid,
        f"'keep_alive' must be null, -1 (never unload) or seconds in 0..{MAX_KEEP_ALIVE_S}",
    )
    return float(value)


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


def _load_fields(body: dict[str, Any], rid: str) -> dict[str, Any]:
    return {"keep_alive": _keep_alive_field(body, rid)}


_FIELD_READERS: dict[type, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    Generate: _generate_fields,
    CountTokens: _prompt_fields,
    Cancel: _cancel_fields,
    Load: _load_fields,
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
    if len(data) > MAX_MESSAGE_BYTES:
        images = sum(len(im.data) for m in values.get("messages") or () for im in m.images or ())
        _check(
            len(data) - images <= MAX_MESSAGE_BYTES,
            rid,
            f"message of {len(data) - images} bytes besides its images is over the limit of {MAX_MESSAGE_BYTES}",
            TOO_LARGE,
        )
    return cls(id=rid, **values)


def decode_reply(data: bytes) -> Reply:
    """Parse one daemon message (the daemon is trusted; only the shape is checked)."""
    body = _unpack(data)
    cls, rid = _header(body, REPLY_TYPES)
    try:
        # Typed at the edge (shared/status.py), nested dataclasses too: a client never sees
        # a status, statistics or log-probabilities as plain maps.
        return from_wire(cls, {**body, "id": rid})
    except (TypeError, KeyError, ValueError) as e:
        raise ProtocolError(BAD_MESSAGE, f"malformed {cls.TYPE} reply: {e}", rid) from None
