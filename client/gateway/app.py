"""The HTTP gateway: a Starlette app that is one more thin client, serving three APIs on
one port (one key, one set of checks, one request path; each API's own module only
translates its requests and answers):

    POST /v1/chat/completions   OpenAI: messages through the model's chat template (the daemon applies it);
                                also as /chat/completions, as llama.cpp's and mlx-lm's servers take it
    POST /v1/completions        OpenAI: a text prompt (or one list of token ids)
    GET  /v1/models             OpenAI: the daemon's model (context length, capabilities), and /v1/models/{id}
    POST /v1/responses          OpenAI's Responses API, stateless, as Codex CLI speaks it (responses.py)
    POST /v1/messages           Anthropic's Messages API, and /v1/messages/count_tokens (anthropic.py)
    /api/...                    Ollama's API: chat, generate, tags, ps, show, version (ollama.py)
    GET  /health                200 when the daemon answers as ready, else 503
    GET  /                      the live dashboard (client/dashboard), polling GET /dashboard/state

Any model name is served by the daemon's model (as llama.cpp's server serves its one
model): an answer names the model its request asked for.

Every request talks to the daemon only through `moestream.client.Client`. A Client is
not thread-safe, so each completion runs on a thread of its own (`DaemonRequest`) that
owns its Client and hands the daemon's events to the event loop through a queue. When
the HTTP client goes away, a disconnect watcher (until the answer starts) or the
streaming response itself (once it has) sets the thread's stop flag; the thread sees it
at the daemon's next event and sends `cancel`, which the daemon applies before its next
step: at most one token is made after the disconnect.

Sharing: a client is its address (the gateway has one key, which every caller shares).
One client holds at most half of the gateway's request slots (its connections too,
guard.py), and each request tells the daemon whose it is (`client_key`), so that the
daemon shares its queue and its slots by client too (daemon/README.md). A streamed
answer whose HTTP client stops reading is paused, then cancelled: its thread stops
reading the daemon once EVENT_BACKLOG events wait for the HTTP client (the daemon then
pauses the request), and a send that the client's full buffers hold for UNREAD_SECONDS
ends the answer, which cancels it in the daemon.

Tool calls are parsed in the daemon (mlx-lm's parsers import MLX, which a client never
does) and come as `ToolCall` events and in `Done.tool_calls`; each API shapes them.

Errors are `ApiError`s (openai.py), answered in the shape of the API whose route was
called: OpenAI's `{"error": {"message", "type", "param", "code"}}`, Anthropic's
`{"type": "error", "error": {"type", "message"}}`, Ollama's `{"error": message}`, with
the HTTP status that says what went wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from ...shared import protocol as proto
from ...shared.protocol import Done
from ...shared.runtime_dir import RuntimePaths
from ...shared.settings import demo_store_path
from ...shared.store_format import StoreError, load_manifest
from ..client import (
    Client,
    ClientError,
    DaemonNotRunning,
    Progress,
    RequestRejected,
    Token,
    ToolCall,
)
from ..dashboard import Dashboard
from . import anthropic, ollama, responses
from .call_texts import CallTexts
from .guard import GuardConfig, GuardMiddleware
from .images import IMAGE_BODY_BYTES
from .keep_alive import KEEP_ALIVE_SECONDS, KeepAlive
from .model_info import capabilities, context_length, model_id
from .openai import ApiError, ApiRequest, Shaper, finish_reason, parse_request, usage

# The protocol's own message limit: a body this size holds any prompt the daemon takes.
MAX_BODY_BYTES = proto.MAX_MESSAGE_BYTES
MAX_CONCURRENT = 64

# Daemon error codes -> (HTTP status, OpenAI error type).
_DAEMON_ERRORS: dict[str, tuple[int, str]] = {
    proto.BAD_MESSAGE: (400, "invalid_request_error"),
    proto.TOO_LARGE: (400, "invalid_request_error"),
    proto.TOO_LONG: (400, "invalid_request_error"),
    proto.BAD_IMAGE: (400, "invalid_request_error"),
    proto.DUPLICATE_ID: (400, "invalid_request_error"),
    proto.BUSY: (429, "rate_limit_error"),
    proto.SHUTTING_DOWN: (503, "server_error"),
    proto.MEMORY_PRESSURE: (503, "server_error"),
    proto.ENGINE: (500, "server_error"),
    proto.INTERNAL: (500, "server_error"),
}

log = logging.getLogger("moestream.openai")
_GONE = object()  # what `Gateway._unless_gone` returns when the HTTP client has left
# How often a request's thread looks at its stop flag while the daemon sends nothing (a
# long prompt's prefill): a client gone then is cancelled in the daemon within this.
STOP_POLL_SECONDS = 0.5
# A streamed answer's events waiting for its HTTP client, at most: past them its thread
# stops reading the daemon, whose queue for it then fills and pauses the request.
EVENT_BACKLOG = 64
# A streamed answer's send that its HTTP client's full buffers hold this long (the client
# reads nothing) ends the answer: the request is cancelled in the daemon and its slot freed.
UNREAD_SECONDS = 10.0


def _demo_store_id() -> str | None:
    try:
        return load_manifest(demo_store_path()).store_id
    except StoreError as e:  # a package built without the demo: no store is named the demo
        log.info("no built-in demo store: %s", e)
        return None


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway needs: where the daemon is, and the API key (None: no key)."""

    paths: RuntimePaths
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_concurrent: int = MAX_CONCURRENT
    # Seconds a daemon reply may take before the client pings it (see Client).
    daemon_timeout: float = 10.0
    # The built-in demo store's id: a daemon serving a store with it serves the demo.
    demo_store_id: str | None = field(default_factory=_demo_store_id)
    # A streamed answer's keep-alive before its first token (client/gateway/keep_alive.py).
    keep_alive_seconds: float = KEEP_ALIVE_SECONDS
    # Every client reuses every other's cached prompts (serve-openai --share-prompt-cache).
    cache_shared: bool = False


def _daemon_error(e: RequestRejected) -> ApiError:
    status, kind = _DAEMON_ERRORS.get(e.code, (500, "server_error"))
    code = "context_length_exceeded" if e.code == proto.TOO_LONG else e.code
    return ApiError(status, e.message, type=kind, code=code)


def _unavailable(e: ClientError) -> ApiError:
    if isinstance(e, DaemonNotRunning):
        return ApiError(
            503,
            "no moestream daemon is running; start it with `moestreamctl start`",
            type="server_error",
            code="daemon_not_running",
        )
    return ApiError(503, f"the moestream daemon is not available: {e}", type="server_error", code="daemon_unavailable")


def ready_status(client: Client) -> dict[str, Any]:
    """The daemon's status; ApiError 503 unless it is ready to serve."""
    st = client.status()
    state = st.get("state")
    if state not in proto.SERVING_STATES:  # an unloaded daemon loads the model for the request
        why = f" ({st['error']})" if st.get("error") else ""
        raise ApiError(
            503, f"the moestream daemon is {state}{why}; try again shortly", type="server_error", code=f"daemon_{state}"
        )
    return st


def has_images(generate: dict[str, Any]) -> bool:
    return any(m.get("images") for m in generate.get("messages") or ())


def for_model(req: ApiRequest, st: dict[str, Any]) -> dict[str, Any]:
    """`req`'s Client.generate arguments for the daemon's model (its `status`): a request
    with images to a model that takes none gets its text-only form (`req.text_only`,
    Anthropic's placeholders), or ApiError 400 where it has none."""
    vision = bool((st.get("capabilities") or {}).get("vision"))
    if req.image_error is not None:
        if vision:
            raise req.image_error
        return req.generate
    if not has_images(req.generate) or vision:
        return req.generate
    if req.text_only is not None:
        return req.text_only
    raise ApiError(
        400,
        f"the model {model_id(st, None)} takes no images (its store holds no vision tower); send text only, or serve a "
        "vision-language model",
        type="invalid_request_error",
        code="model_takes_no_images",
    )


def check_model(st: dict[str, Any], asked: str | None, demo_store_id: str | None) -> str:
    """The model name to answer with: the one the client asked for (any name is served by
    the daemon's one model: coding agents ask for theirs, `claude-...`), else the
    served model's id."""
    return asked or model_id(st, demo_store_id)


class RequestSlots:
    """The gateway's request slots: `total` at once, at most half of them one client's
    (its address), so that one client's requests never leave another a 429."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.per_client = max(total // 2, 1)
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, client: str) -> None:
        """One slot for `client`, or ApiError 429 saying whose share is used up."""
        with self._lock:
            mine, held = self._held.get(client, 0), sum(self._held.values())
            if held < self.total and mine < self.per_client:
                self._held[client] = mine + 1
                return
        why = (
            f"this client ({client}) already has {mine} requests in flight, its share of the gateway's {self.total}"
            if mine >= self.per_client
            else f"the gateway already serves {self.total} requests"
        )
        raise ApiError(429, f"{why}; try again shortly", type="rate_limit_error", code="busy")

    def give(self, client: str) -> None:
        with self._lock:
            left = self._held[client] - 1
            if left:
                self._held[client] = left
            else:
                del self._held[client]


def client_key(request: Request) -> str:
    """Whose request it is, for the gateway's and the daemon's shares: the caller's address."""
    return request.client.host if request.client else "?"


def client_label(request: Request) -> str:
    """Who an HTTP request came from, as the daemon's `status` lists it: the route, the
    caller's address and its User-Agent, in printable ASCII, cut to the protocol's length."""
    host = request.client.host if request.client else "?"
    agent = request.headers.get("user-agent")
    label = f"{request.url.path} from {host}" + (f" ({agent})" if agent else "")
    return "".join(c if " " <= c <= "~" else "?" for c in label)[: proto.MAX_CLIENT_CHARS]


def cache_scope(request: Request, req: ApiRequest) -> str:
    """Whose cached prompts a request may reuse: those of requests that name the same user
    or session, else of those that name none from the same address; a digest, so that the
    daemon never holds the identity itself."""
    who = f"id:{req.client}" if req.client else f"address:{request.client.host if request.client else '?'}"
    return hashlib.sha256(who.encode()).hexdigest()[:32]


class DaemonRequest:
    """One generate request on a thread of its own, which owns its Client.

    The event loop reads `next()`: first the model id (a str), then the daemon's events
    (`Accepted`, `Progress` for a streamed request, `Token`s, ...), then one `Done`; or an
    `ApiError` at any point, which ends it. `cancel()` may be called from the event loop
    at any time; the thread cancels the daemon's request within STOP_POLL_SECONDS, during
    a prefill too (the daemon keeps that prefill for the same prompt sent again).
    """

    def __init__(
        self,
        config: GatewayConfig,
        req: ApiRequest,
        request_id: str,
        slots: RequestSlots,
        key: str,
        client: str | None = None,
        scope: str | None = None,
    ) -> None:
        """`key`: the client it counts against (`client_key`), whose slot it holds; `client`:
        who sent it, as the daemon's `status` lists the request; `scope`: whose cached
        prompts it may reuse (`cache_scope`; None: everyone's)."""
        self._config = config
        self._req = req
        self._id = request_id
        self._key = key
        self._client = client
        self._scope = scope
        self._slots = slots
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._stop = threading.Event()
        # Items put and not yet taken, at most `_backlog` (None: no bound) before the
        # thread stops reading the daemon.
        self._room = threading.Condition()
        self._unread = 0
        self._backlog: int | None = EVENT_BACKLOG
        self.id = request_id
        self._thread = threading.Thread(target=self._run, name=f"daemon-request-{request_id}", daemon=True)

    def start(self) -> None:
        """Start the thread; the caller has taken one of `slots`, which the thread returns."""
        self._thread.start()

    def cancel(self) -> None:
        self._stop.set()
        with self._room:
            self._room.notify_all()

    def hold_all(self) -> None:
        """Read all its events, however many wait: a choice that waits for its turn (n > 1)
        is read in full before its turn, never paused."""
        self._backlog = None

    async def next(self) -> Any:
        item = await self._queue.get()
        with self._room:
            self._unread -= 1
            self._room.notify_all()
        return item

    def _put(self, item: Any) -> None:
        with self._room:
            self._unread += 1
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody reads this request any more
            self._stop.set()

    def _has_room(self) -> bool:
        """Whether another event may wait for the HTTP client (a while, for one to be taken)."""
        with self._room:
            return (
                self._room.wait_for(
                    lambda: self._stop.is_set() or self._backlog is None or self._unread < self._backlog,
                    STOP_POLL_SECONDS,
                )
                and not self._stop.is_set()
            )

    def _run(self) -> None:
        try:
            with Client(self._config.paths, timeout=self._config.daemon_timeout) as client:
                st = ready_status(client)
                generate = for_model(self._req, st)
                self._put(check_model(st, self._req.model, self._config.demo_store_id))
                if self._stop.is_set():
                    return
                # A streamed answer reports the prefill's progress in its keep-alives.
                stream = client.generate(
                    request_id=self._id,
                    progress=self._req.stream,
                    client=self._client,
                    cache_scope=self._scope,
                    client_key=self._key,
                    **generate,
                )
                while stream.done is None:
                    # The HTTP client reads nothing: neither does this thread, and the
                    # daemon pauses the request once its queue for this one is full.
                    event = stream.next_event(within=STOP_POLL_SECONDS) if self._has_room() else None
                    if self._stop.is_set():
                        if stream.done is None:
                            stream.abandon()  # the client closes next: no need to read up to `done`
                            log.info("request %s: the HTTP client went away; cancelled in the daemon", self._id)
                        return
                    if event is not None:
                        self._put(event)
        except ApiError as e:
            self._put(e)
        except RequestRejected as e:
            self._put(_daemon_error(e))
        except ClientError as e:
            self._put(_unavailable(e))
        except Exception as e:  # the HTTP client gets a 500 with the reason; the gateway serves on
            log.exception("request %s failed", self._id)
            self._put(ApiError(500, f"the gateway failed: {type(e).__name__}: {e}", type="server_error"))
        finally:
            self._slots.give(self._key)


class EventStream(StreamingResponse):
    """A streamed answer (server-sent events, or Ollama's NDJSON) that cancels its daemon
    request however the response ends (finished, client disconnected, server shutting down)."""

    def __init__(
        self, content: AsyncIterator[str], request: DaemonRequest | _Choices, media_type: str = "text/event-stream"
    ) -> None:
        super().__init__(
            content, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._request = request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Message) -> None:
            try:
                with anyio.fail_after(UNREAD_SECONDS):
                    await send(message)
            except TimeoutError:
                raise _NotReading from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _NotReading:
            # uvicorn closes the connection of an answer left unfinished.
            log.warning("a streamed answer's client read nothing for %g s: cancelled", UNREAD_SECONDS)
        finally:
            self._request.cancel()


class _NotReading(Exception):
    """A streamed answer's HTTP client has taken nothing for UNREAD_SECONDS."""


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the HTTP client has gone (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Gateway:
    """The app's endpoints and their shared, immutable configuration."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._slots = RequestSlots(config.max_concurrent)
        # The model's own text of the tool calls answered, for the turns that resend them.
        self.call_texts = CallTexts()

    # ---- checks --------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        """The key as OpenAI's and Ollama's clients send it (`Authorization: Bearer`) or
        as Anthropic's do (`x-api-key`)."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(
                401,
                "Incorrect or missing API key: send the header `Authorization: Bearer <key>` (or `x-api-key: <key>`) "
                "with this server's key",
                code="invalid_api_key",
            )

    async def _read_json(self, request: Request, limit: int | None = None) -> Any:
        """The request's JSON body, of at most `limit` bytes (default: the configured limit)."""
        limit = self.config.max_body_bytes if limit is None else limit
        too_large = ApiError(
            413, f"the request body is over this server's limit of {limit} bytes", code="request_too_large"
        )
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, f"Content-Length {declared!r} is not a number")
            if int(declared) > limit:
                raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(499, "the client left while sending its request") from None
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
            raise ApiError(
                400, f"the request body is not valid JSON: {type(e).__name__}: {e}", code="invalid_json"
            ) from None

    # ---- endpoints ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """200 when the daemon answers as ready; 503 (with its state) otherwise. No key needed."""

        def probe() -> tuple[int, dict[str, Any]]:
            try:
                with Client(self.config.paths, timeout=2.0) as client:
                    st = client.status()
            except DaemonNotRunning:
                return 503, {"status": "unavailable", "daemon": "not running"}
            except ClientError:
                return 503, {"status": "unavailable", "daemon": "not answering"}
            state = st.get("state")
            if state not in proto.SERVING_STATES:
                return 503, {"status": "unavailable", "daemon": state}
            if st.get("store_problem"):  # it serves on from open files, but needs a restart
                return 503, {"status": "unavailable", "daemon": state, "reason": st["store_problem"]}
            return 200, {"status": "ok", "daemon": state, "model": model_id(st, self.config.demo_store_id)}

        status, body = await anyio.to_thread.run_sync(probe)
        return JSONResponse(body, status_code=status)

    async def _status(self) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            try:
                with Client(self.config.paths, timeout=self.config.daemon_timeout) as client:
                    return ready_status(client)
            except ClientError as e:
                raise _unavailable(e) from None

        return await anyio.to_thread.run_sync(call)

    def _model_object(self, st: dict[str, Any]) -> dict[str, Any]:
        created = int(time.time() - float(st.get("uptime_s") or 0.0))
        return {
            "id": model_id(st, self.config.demo_store_id),
            "object": "model",
            "created": created,
            "owned_by": "moestream",
            # Beyond OpenAI's object, as other local servers add them: tokens per request
            # (prompt and answer) and what the model takes.
            "context_length": context_length(st),
            "capabilities": capabilities(st),
        }

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        st = await self._status()
        return JSONResponse({"object": "list", "data": [self._model_object(st)]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        st = await self._status()
        return JSONResponse(self._model_object(st) | {"id": request.path_params["model"]})

    async def count_tokens(self, req: ApiRequest) -> int:
        """The prompt's length in tokens (`req.generate`: Client.count_tokens's arguments),
        from the daemon's prompt-check thread: no forward runs."""

        def call() -> int:
            try:
                with Client(self.config.paths, timeout=self.config.daemon_timeout) as client:
                    needs = has_images(req.generate) or req.image_error is not None
                    generate = for_model(req, client.status()) if needs else req.generate
                    return client.count_tokens(**generate)
            except RequestRejected as e:
                raise _daemon_error(e) from None
            except ClientError as e:
                raise _unavailable(e) from None

        return await anyio.to_thread.run_sync(call)

    async def load(self, keep_alive: float | None) -> proto.LoadReply:
        """Ollama's load request to the daemon (keep_alive 0: its unload), answered once done."""

        def call() -> proto.LoadReply:
            try:
                with Client(self.config.paths, timeout=self.config.daemon_timeout) as client:
                    return client.load(keep_alive)
            except RequestRejected as e:
                raise _daemon_error(e) from None
            except ClientError as e:
                raise _unavailable(e) from None

        return await anyio.to_thread.run_sync(call)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def open_request(self, request: Request, req: ApiRequest, prefix: str) -> tuple[DaemonRequest, str] | None:
        """The one request path of every API: a slot, the daemon request on its thread,
        the served model checked against `req.model`; None when the HTTP client left."""
        daemon = self._start_request(request, req, prefix)
        model = await self._served_model(request, daemon)
        return None if model is None else (daemon, model)

    def _start_request(self, request: Request, req: ApiRequest, prefix: str) -> DaemonRequest:
        key = client_key(request)
        self._slots.take(key)
        scope = None if self.config.cache_shared else cache_scope(request, req)
        daemon = DaemonRequest(
            self.config, req, prefix + uuid.uuid4().hex, self._slots, key, client_label(request), scope
        )
        daemon.start()
        return daemon

    async def _served_model(self, request: Request, daemon: DaemonRequest) -> str | None:
        """The model id `daemon`'s thread checked (None when the HTTP client left)."""
        model = await self._unless_gone(request, daemon, daemon.next())
        if model is _GONE:
            return None
        if isinstance(model, ApiError):
            raise model
        return model

    async def whole(
        self, request: Request, daemon: DaemonRequest, on_event: Callable[[Any], Any] | None = None
    ) -> Done | None:
        """The daemon's `done` of a non-streaming request (each event before it to
        `on_event`); None when the HTTP client left."""
        whole = await self._unless_gone(request, daemon, self._collect(daemon, on_event))
        if whole is _GONE:
            return None
        done = whole[1]
        if done.finish_reason == "shutdown":
            raise _shutdown_error()
        return done

    async def first_event(self, request: Request, daemon: DaemonRequest) -> Any:
        """The daemon's first event of a streaming request (None when the HTTP client
        left): its `accepted`, as soon as the prompt passed its checks, however long its
        prefill will take. The status line waits for it, so that a request the daemon
        refuses (no chat template, over the context, busy) gets its own HTTP status."""
        head = await self._unless_gone(request, daemon, daemon.next())
        if isinstance(head, ApiError):
            raise head
        return None if head is _GONE else head

    @staticmethod
    def stream(content: AsyncIterator[str], daemon: DaemonRequest, media_type: str = "text/event-stream") -> Response:
        return EventStream(content, daemon, media_type)

    @staticmethod
    def rest_of(text: str, sent: list[str]) -> str:
        """What of `text` (a done's text or reasoning) was not streamed in `sent` (held
        back for a possible stop string)."""
        streamed = "".join(sent)
        return text[len(streamed) :] if text.startswith(streamed) else ""

    async def open_choices(
        self, request: Request, req: ApiRequest, prefix: str
    ) -> tuple[list[DaemonRequest], str] | None:
        """`req.n` daemon requests for one prompt (as `open_request`), all started before
        any is awaited, so that they reach the daemon together: a later one joins the
        prompt's prefill in flight (or finds its cache) rather than prefilling it again.
        None when the HTTP client left; an error cancels them all."""
        daemons: list[DaemonRequest] = []
        try:
            for i in range(req.n):
                daemons.append(self._start_request(request, req.choice(i), prefix))
                if i:
                    daemons[-1].hold_all()  # it waits for the choices before it
            models = [await self._served_model(request, d) for d in daemons]
        except BaseException:
            for d in daemons:
                d.cancel()
            raise
        if None in models:
            for d in daemons:
                d.cancel()
            return None
        return daemons, str(models[0])

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        self._authorize(request)
        body = await self._read_json(request, IMAGE_BODY_BYTES if chat else None)
        req = parse_request(body, chat=chat, kept=self.call_texts)
        opened = await self.open_choices(request, req, "chatcmpl-" if chat else "cmpl-")
        if opened is None:
            return Response(status_code=499)  # nobody is there to read an answer
        daemons, model = opened
        shaper = Shaper(chat=chat, id=daemons[0].id, model=model)
        if not req.stream:
            answers = []
            for i, daemon in enumerate(daemons):
                done = await self.whole(request, daemon)
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
                    self.call_texts.keep(req.client, out["id"], call["name"], call["arguments"], call.get("text"))
            body = answers[0]
            if len(answers) > 1:
                # One prompt, n completions: the prompt counted once, as OpenAI counts it.
                completion = sum(a["usage"]["completion_tokens"] for a in answers)
                body["usage"] |= usage(body["usage"]["prompt_tokens"], completion)
                body["choices"] = [a["choices"][0] for a in answers]
            return JSONResponse(body)
        head = await self.first_event(request, daemons[0])
        if head is None:
            for d in daemons:
                d.cancel()
            return Response(status_code=499)
        return EventStream(self._events(daemons[0], shaper, req, head, daemons[1:]), _Choices(daemons))

    @staticmethod
    async def _unless_gone(request: Request, daemon: DaemonRequest, work: Awaitable[Any]) -> Any:
        """`work`'s result, or _GONE when the HTTP client leaves first; either way, a
        request that will not be answered is cancelled in the daemon."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the server is shutting down
            task.cancel()
            daemon.cancel()
            raise
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        daemon.cancel()
        return _GONE

    async def events(self, daemon: DaemonRequest, event: Any) -> AsyncIterator[Any]:
        """The daemon's events from `event` on, through its `Done` (raising an ApiError
        that comes instead); text held back for a possible stop string comes only with
        `done`, so each API takes the rest of the text from there (`rest_of`). Until the
        first token, a `KeepAlive` (with the prefill's progress) whenever
        `keep_alive_seconds` pass without one, which each API sends in its own form."""
        every = self.config.keep_alive_seconds
        quiet_since: float | None = time.monotonic()  # None once the first token came
        progress = KeepAlive()
        pending: asyncio.Future | None = None
        try:
            while True:
                if isinstance(event, ApiError):
                    raise event
                if isinstance(event, Progress) and event.stage is None:
                    progress = KeepAlive(event.done, event.total)
                elif isinstance(event, (Token, ToolCall, Done)):
                    quiet_since = None
                yield event
                if isinstance(event, Done):
                    return
                pending = pending or asyncio.ensure_future(daemon.next())
                if quiet_since is not None:
                    await asyncio.wait({pending}, timeout=max(quiet_since + every - time.monotonic(), 0.0))
                    if not pending.done():
                        yield progress
                        quiet_since = time.monotonic()
                        continue
                event, pending = await pending, None
        finally:
            if pending is not None:
                pending.cancel()

    @staticmethod
    async def _collect(daemon: DaemonRequest, on_event: Callable[[Any], Any] | None = None) -> tuple[str, Done]:
        while True:
            event = await daemon.next()
            if isinstance(event, ApiError):
                raise event
            if isinstance(event, Done):
                return event.text, event
            if on_event is not None:
                on_event(event)

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
            yield _sse(shaper.usage_chunk(use))
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
            yield _sse(shaper.chunk("", first=True, with_usage=extra))
        sent: list[str] = []
        thought: list[str] = []
        calls = 0
        held: list[proto.TokenLogprob] = []  # entries not sent yet (their text held back)
        given = 0
        try:
            async for event in self.events(daemon, event):
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
                    yield _sse(
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
                    self.call_texts.keep(req.client, call_id, event.name, event.arguments, event.text)
                    yield _sse(chunk)
                    calls += 1
        except ApiError as e:
            yield _sse(e.body())  # as OpenAI reports an error after the stream began
            return
        if event.finish_reason == "shutdown":
            yield _sse(_shutdown_error().body())
            return
        rest_lp = list(event.logprobs[given:]) if event.logprobs is not None else None
        for thinking, rest in ((True, self.rest_of(event.reasoning, thought)), (False, self.rest_of(event.text, sent))):
            if rest:
                lp = None if thinking else rest_lp
                offset = len("".join(sent))
                yield _sse(shaper.text_chunk(rest, thinking, with_usage=extra, logprobs=lp, offset=offset))
                rest_lp = None if lp is not None else rest_lp
        reason = finish_reason(event.finish_reason, bool(event.tool_calls))
        yield _sse(shaper.chunk(None, reason, with_usage=extra, logprobs=rest_lp or None))
        dones.append(event)


@dataclass(frozen=True)
class _Choices:
    """The daemon requests of a streamed answer's choices, cancelled together."""

    daemons: list[DaemonRequest]

    def cancel(self) -> None:
        for d in self.daemons:
            d.cancel()


def _shutdown_error() -> ApiError:
    return ApiError(
        503, "the moestream daemon shut down during this request", type="server_error", code="daemon_shutdown"
    )


def _usage(done: Done) -> dict[str, Any]:
    # The prompt tokens the daemon's prompt cache served, as OpenAI reports its own.
    cached = {"cached_tokens": int(done.stats.get("cached_tokens", 0))}
    return usage(int(done.stats.get("prompt_tokens", 0)), len(done.tokens)) | {"prompt_tokens_details": cached}


def error_response(request: Request, exc: ApiError, headers: dict[str, str] | None = None) -> Response:
    """`exc` in the shape of the API whose route was called."""
    path = request.url.path
    if anthropic.owns(path):
        body = anthropic.error_body(exc)
    elif ollama.owns(path):
        body = ollama.error_body(exc)
    else:
        body = exc.body()
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
    return error_response(request, error, exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(request, ApiError(500, f"the gateway failed: {type(exc).__name__}", type="server_error"))


def create_app(config: GatewayConfig, guard: GuardConfig | None = None) -> Starlette:
    """The ASGI app of the gateway for the daemon at `config.paths`, behind the request
    guards (client/gateway/guard.py) of `guard` (default: a loopback server's)."""
    gw = Gateway(config)
    routes = [
        Route("/v1/chat/completions", gw.chat_completions, methods=["POST"]),
        # Clients set up for llama.cpp's or mlx-lm's server may leave out the /v1.
        Route("/chat/completions", gw.chat_completions, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.model, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        *responses.ResponsesApi(gw).routes(),
        *anthropic.AnthropicApi(gw).routes(),
        *ollama.OllamaApi(gw).routes(),
    ]
    # The live dashboard (client/dashboard): GET / and its JSON route; its lifespan samples
    # the daemon's tokens made for the history it draws.
    dashboard = Dashboard(config.paths, gw._authorize)
    routes += dashboard.routes()
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    middleware = [Middleware(GuardMiddleware, config=guard or GuardConfig())]
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware, lifespan=dashboard.lifespan)
