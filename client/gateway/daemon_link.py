"""The gateway's one request path onto the daemon, below every API module (openai.py,
responses.py, anthropic.py, ollama.py), which only translate: an `ApiRequest` in, the
daemon's events out, errors as `ApiError`.

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
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ...shared import protocol as proto
from ...shared.protocol import Done
from ...shared.runtime_dir import RuntimePaths
from ...shared.settings import demo_store_path
from ...shared.status import Status
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
from .call_texts import CallTexts
from .keep_alive import KEEP_ALIVE_SECONDS, KeepAlive
from .model_info import model_id

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
T = TypeVar("T")
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


class ApiError(Exception):
    """An HTTP error answered as OpenAI does: `status` and an error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ApiRequest:
    """One validated completion request."""

    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    model: str | None  # as the client named it; None when it gave none
    stream: bool
    include_usage: bool
    generate: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Client.generate
    n: int = 1  # choices: as many daemon requests
    # Who the request says it comes from (`declared_identity`), or "": the scope of the
    # tool-call texts the gateway keeps (call_texts.py) and of the prompt cache (app.py).
    client: str = ""
    # For a model that takes no images: `generate` with each image as text (Anthropic's
    # placeholders); None: such a model refuses a request with images (400).
    text_only: dict[str, Any] | None = None
    # Why its images could not be read (then `generate` is `text_only`): the answer to a
    # model that takes images; None: they were read.
    image_error: ApiError | None = None

    def choice(self, i: int) -> ApiRequest:
        """The request of choice `i` of n: its own seed (s + i) where a seed is given."""
        seed = self.generate.get("seed")
        if i == 0 or seed is None:
            return self
        return replace(self, generate={**self.generate, "seed": (seed + i) % 2**63})


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


def ready_status(client: Client) -> Status:
    """The daemon's status; ApiError 503 unless it is ready to serve."""
    st = client.status()
    state = st.state
    if state not in proto.SERVING_STATES:  # an unloaded daemon loads the model for the request
        why = f" ({st.error})" if st.error else ""
        raise ApiError(
            503, f"the moestream daemon is {state}{why}; try again shortly", type="server_error", code=f"daemon_{state}"
        )
    return st


def has_images(generate: dict[str, Any]) -> bool:
    return any(m.get("images") for m in generate.get("messages") or ())


def for_model(req: ApiRequest, st: Status) -> dict[str, Any]:
    """`req`'s Client.generate arguments for the daemon's model (its `status`): a request
    with images to a model that takes none gets its text-only form (`req.text_only`,
    Anthropic's placeholders), or ApiError 400 where it has none."""
    vision = bool((st.capabilities or {}).get("vision"))
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
    agent = request.headers.get("user-agent")
    label = f"{request.url.path} from {client_key(request)}" + (f" ({agent})" if agent else "")
    return "".join(c if " " <= c <= "~" else "?" for c in label)[: proto.MAX_CLIENT_CHARS]


def cache_scope(request: Request, req: ApiRequest) -> str:
    """Whose cached prompts a request may reuse: those of requests that name the same user
    or session, else of those that name none from the same address; a digest, so that the
    daemon never holds the identity itself."""
    who = f"id:{req.client}" if req.client else f"address:{client_key(request)}"
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
                # The model name to answer with: the one the client asked for (any name is
                # served by the daemon's one model: coding agents ask for theirs,
                # `claude-...`), else the served model's id.
                self._put(self._req.model or model_id(st, self._config.demo_store_id))
                if self._stop.is_set():
                    return
                # A streamed answer reports the prefill's progress in its keep-alives.
                stream = client.generate(
                    request_id=self.id,
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
                            log.info("request %s: the HTTP client went away; cancelled in the daemon", self.id)
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
            log.exception("request %s failed", self.id)
            self._put(ApiError(500, f"the gateway failed: {type(e).__name__}: {e}", type="server_error"))
        finally:
            self._slots.give(self._key)


class EventStream(StreamingResponse):
    """A streamed answer (server-sent events, or Ollama's NDJSON) that cancels its daemon
    requests (those of its choices, n > 1) however the response ends (finished, client
    disconnected, server shutting down)."""

    def __init__(
        self, content: AsyncIterator[str], *daemons: DaemonRequest, media_type: str = "text/event-stream"
    ) -> None:
        super().__init__(
            content, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._daemons = daemons

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
            for d in self._daemons:
                d.cancel()


class _NotReading(Exception):
    """A streamed answer's HTTP client has taken nothing for UNREAD_SECONDS."""


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the HTTP client has gone (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Gateway:
    """The request path every API module takes to the daemon, with the checks they share
    (the key, the body), and their shared, immutable configuration."""

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

    # ---- the daemon ----------------------------------------------------------------------

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
            state = st.state
            if state not in proto.SERVING_STATES:
                return 503, {"status": "unavailable", "daemon": state}
            if st.store_problem:  # it serves on from open files, but needs a restart
                return 503, {"status": "unavailable", "daemon": state, "reason": st.store_problem}
            return 200, {"status": "ok", "daemon": state, "model": model_id(st, self.config.demo_store_id)}

        status, body = await anyio.to_thread.run_sync(probe)
        return JSONResponse(body, status_code=status)

    async def _ask(self, ask: Callable[[Client], T]) -> T:
        """`ask(client)` on a worker thread; the daemon's refusal, or its absence, as an ApiError."""

        def call() -> T:
            try:
                with Client(self.config.paths, timeout=self.config.daemon_timeout) as client:
                    return ask(client)
            except RequestRejected as e:
                raise _daemon_error(e) from None
            except ClientError as e:
                raise _unavailable(e) from None

        return await anyio.to_thread.run_sync(call)

    async def _status(self) -> Status:
        return await self._ask(ready_status)

    async def count_tokens(self, req: ApiRequest) -> int:
        """The prompt's length in tokens (`req.generate`: Client.count_tokens's arguments),
        from the daemon's prompt-check thread: no forward runs; a request with images is
        fitted to the model first (`for_model`)."""

        def ask(client: Client) -> int:
            needs = has_images(req.generate) or req.image_error is not None
            return client.count_tokens(**(for_model(req, client.status()) if needs else req.generate))

        return await self._ask(ask)

    async def load(self, keep_alive: float | None) -> proto.LoadReply:
        """Ollama's load request to the daemon (keep_alive 0: its unload), answered once done."""
        return await self._ask(lambda client: client.load(keep_alive))

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
        done = await self._unless_gone(request, daemon, self._collect(daemon, on_event))
        if done is _GONE:
            return None
        if done.finish_reason == "shutdown":
            raise shutdown_error()
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
    async def _collect(daemon: DaemonRequest, on_event: Callable[[Any], Any] | None = None) -> Done:
        while True:
            event = await daemon.next()
            if isinstance(event, ApiError):
                raise event
            if isinstance(event, Done):
                return event
            if on_event is not None:
                on_event(event)


def rest_of(text: str, sent: list[str]) -> str:
    """What of `text` (a done's text or reasoning) was not streamed in `sent` (held back
    for a possible stop string)."""
    streamed = "".join(sent)
    return text[len(streamed) :] if text.startswith(streamed) else ""


def shutdown_error() -> ApiError:
    return ApiError(
        503, "the moestream daemon shut down during this request", type="server_error", code="daemon_shutdown"
    )
