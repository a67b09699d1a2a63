"""The client side of the daemon's socket (no MLX: importing this is fast).

    with Client(settings) as c:
        for event in c.generate("Hello", max_tokens=32):
            if isinstance(event, Token):
                print(event.text, end="")

A `Client` holds one DEALER socket; use one per thread. Replies wait at most `timeout`
seconds; a generate stream that is silent that long (a long prompt, a cold pool) pings
the daemon, whose I/O thread answers at once even while it computes, and keeps waiting
while it answers. A daemon process that is gone raises `DaemonDied` within a fraction
of a second.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import zmq

from ..shared import protocol as proto
from ..shared.protocol import Accepted, Done, Progress, Token, ToolCall
from ..shared.runtime_dir import (
    RuntimeDirError,
    RuntimePaths,
    check_private_dir,
    daemon_running,
    pid_alive,
    read_pid,
)
from ..shared.settings import Settings
from ..shared.status import Stats, Status

__all__ = [
    "Accepted",
    "Client",
    "ClientError",
    "DaemonDied",
    "DaemonNotRunning",
    "Done",
    "GenerateStream",
    "Progress",
    "RequestRejected",
    "Token",
    "ToolCall",
]

_SLICE_S = 0.2


class ClientError(RuntimeError):
    """Base of the client's errors."""


class DaemonNotRunning(ClientError):
    """No daemon holds the runtime folder's lock."""


class DaemonDied(ClientError):
    """The daemon went away, or stopped answering, while a reply was awaited."""


class RequestRejected(ClientError):
    """The daemon answered with an `error` message."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message
        self.request_id = request_id


def runtime_paths(target: Settings | RuntimePaths | str | Path) -> RuntimePaths:
    """The daemon's paths from settings, paths, or a runtime folder."""
    if isinstance(target, RuntimePaths):
        return target
    if isinstance(target, Settings):
        return RuntimePaths.from_settings(target)
    return RuntimePaths.from_settings(Settings(runtime_dir=str(target)))


class Client:
    """A connection to the daemon. Not thread-safe: one per thread."""

    def __init__(self, target: Settings | RuntimePaths | str | Path, *, timeout: float = 10.0) -> None:
        self.paths = runtime_paths(target)
        self.timeout = timeout
        try:
            endpoint = self.paths.endpoint
            if self.paths.dir.is_dir():
                # Whoever could make a socket there could read this client's prompts.
                check_private_dir(self.paths.dir)
            # The lock, or a socket that answers: files a cleanup deleted hide no daemon.
            if not daemon_running(self.paths):
                raise DaemonNotRunning(
                    f"no moestream daemon is running (runtime folder {self.paths.dir}); "
                    "start one with `moestreamctl start --model STORE`"
                )
            self.pid = read_pid(self.paths)
        except RuntimeDirError as e:
            raise ClientError(str(e)) from None
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self._sock = sock
        # Closes the socket when the client is collected or closed, whichever comes first.
        self._finalizer = weakref.finalize(self, sock.close, 0)
        self._inbox: dict[str, deque[proto.Reply]] = {}

    def close(self) -> None:
        """Close the socket; the daemon stops this client's requests at their next token."""
        self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests ------------------------------------------------------------------------

    def ping(self) -> proto.Pong:
        """The daemon's pid, state (loading | ready | stopping) and version."""
        pong = self._call(proto.Ping(id=_new_id()), proto.Pong)
        if self.pid is None:  # its pid file is gone: the daemon says its pid itself
            self.pid = pong.pid
        return pong

    def status(self) -> Status:
        """Pid, uptime, model, pool occupancy, memory, clients, requests, heat, log path."""
        return self._call(proto.Status(id=_new_id()), proto.StatusReply).status

    def stats(self) -> Stats:
        """Pool statistics (totals and per layer), read engine counters, request counts."""
        return self._call(proto.Stats(id=_new_id()), proto.StatsReply).stats

    def shutdown(self) -> int:
        """Ask the daemon to stop (it cancels running requests); returns its pid."""
        return self._call(proto.Shutdown(id=_new_id()), proto.ShutdownReply).pid

    def load(self, keep_alive: float | None = None) -> proto.LoadReply:
        """Ollama's load request: the model loaded (an unloaded one loads now, which this
        waits for while the daemon answers pings) and kept `keep_alive` seconds once idle
        (-1: never; None: the daemon's setting); 0 releases it as soon as nothing is in
        flight. The reply says the engine's state then, and the requests in flight."""
        msg = proto.Load(id=_new_id(), keep_alive=None if keep_alive is None else float(keep_alive))
        try:
            proto.decode_request(proto.encode(msg))
        except proto.ProtocolError as e:
            raise RequestRejected(e.code, e.message, msg.id) from None
        return self._call(msg, proto.LoadReply, keep_waiting=True)

    def cancel(self, request_id: str) -> bool:
        """Cancel one of this client's generate requests; False if it had already ended.
        The daemon answers once its engine has applied it, at the end of the prefill piece
        in flight (a layer, or a chunk, which may take seconds): this waits as long as the
        daemon answers pings."""
        return self._call(proto.Cancel(id=_new_id(), target=request_id), proto.Cancelled, keep_waiting=True).found

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int = 256,
        temp: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, str] | None = None,
        constraint: proto.Constraint | None = None,
        request_id: str | None = None,
        speculative: str | None = None,
        draft_tokens: int | None = None,
        draft_model: str | None = None,
        diagnostics: bool = False,
        progress: bool = False,
        keep_alive: float | None = None,
        thinking: bool | None = None,
        top_k: int | None = None,
        sampling: proto.SamplingControls | None = None,
        client: str | None = None,
        cache_scope: str | None = None,
        client_key: str | None = None,
    ) -> "GenerateStream":
        """Send a generate request now; iterate the result for `Token` events, then `Done`.

        Give one of `prompt` (text), `prompt_ids` (token ids) and `messages` (a chat of
        {"role", "content"} maps, rendered by the daemon with the model's chat template;
        an assistant's may add `tool_calls` [{name, arguments}] and its earlier
        `reasoning`, a tool's `tool_call_id` and `name`, a user's `images`: `proto.ImageData`
        or image files' bytes, which a vision model sees before the text). `tools`
        (OpenAI's function schemas) go to the chat template;
        `tool_choice` is "auto", "none", "required" or {"name": N}; the model's calls
        come as `ToolCall` events and in `Done.tool_calls`, never as `Token` text.
        `constraint` (`proto.Constraint`: json_object, or json_schema with the schema's
        JSON text) makes the answer JSON of that form, enforced as it is sampled.
        `speculative` "mtp" or "draft" (with `draft_model`, a path on the daemon's
        machine) decodes speculatively, `draft_tokens` per round. `diagnostics=True`
        puts this request's hot-path diagnostics into the final statistics.
        `progress=True` adds `Progress` events (prompt tokens processed, of how many)
        while the prompt is prefilled, and (with `stage` "load") while an unloaded model
        loads. `keep_alive` (seconds, -1: never) is how long the model stays loaded once
        the daemon is idle after this request, in place of the daemon's setting.
        `thinking` turns the chat template's thinking switch on or off (None: its
        default); reasoning then comes as `Token`s with `reasoning` true. `top_k` keeps
        the k likeliest tokens before sampling; `sampling` adds min_p, the penalties,
        logit_bias and log-probabilities (`Token.logprobs`, `Done.logprobs`). A `max_tokens` that would pass the
        daemon's context is lowered to what the prompt leaves. The stream starts with `Accepted` (the
        prompt's length) once the daemon has checked and queued the request. `client`
        names the sender in the daemon's `status` (default: this connection);
        `cache_scope` limits prompt-cache reuse to requests of the same scope; `client_key`
        is the client the request counts against in the daemon's fair shares of its queue
        and slots (default: this connection; the gateway sends its caller's address).
        """
        msg = proto.Generate(
            id=request_id or _new_id(),
            prompt=prompt,
            prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
            messages=_chat(messages),
            max_tokens=max_tokens,
            temp=temp,
            top_p=top_p,
            seed=seed,
            stop=tuple(stop),
            tools=tuple(tools) if tools is not None else None,
            tool_choice=dict(tool_choice) if isinstance(tool_choice, Mapping) else tool_choice,
            constraint=constraint,
            speculative=speculative,
            draft_tokens=draft_tokens,
            draft_model=draft_model,
            diagnostics=True if diagnostics else None,
            progress=True if progress else None,
            keep_alive=None if keep_alive is None else float(keep_alive),
            thinking=thinking,
            top_k=top_k,
            sampling=sampling,
            client=client,
            cache_scope=cache_scope,
            client_key=client_key,
        )
        try:
            data = proto.encode(msg)
            proto.decode_request(data)  # the daemon's own checks, before anything is sent
        except proto.ProtocolError as e:
            raise RequestRejected(e.code, e.message, msg.id) from None
        self._send(data)
        return GenerateStream(self, msg.id)

    def count_tokens(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, str] | None = None,
        thinking: bool | None = None,
    ) -> int:
        """The prompt's length in tokens, as `generate` with the same arguments would
        render it (chat template, tools, thinking switch). The daemon answers from its
        prompt-check thread: no forward runs, and a busy model does not delay it."""
        msg = proto.CountTokens(
            id=_new_id(),
            prompt=prompt,
            prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
            messages=_chat(messages),
            tools=tuple(tools) if tools is not None else None,
            tool_choice=dict(tool_choice) if isinstance(tool_choice, Mapping) else tool_choice,
            thinking=thinking,
        )
        try:
            proto.decode_request(proto.encode(msg))
        except proto.ProtocolError as e:
            raise RequestRejected(e.code, e.message, msg.id) from None
        # An unloaded model loads first: wait on while the daemon answers pings.
        return self._call(msg, proto.TokenCount, keep_waiting=True).prompt_tokens

    def complete(
        self, prompt: str | None = None, *, on_text: Callable[[str], None] | None = None, **kwargs: Any
    ) -> proto.Done:
        """Run one generate request to its end: its `done` (text, tokens, finish reason,
        statistics, tool calls, reasoning)."""
        stream = self.generate(prompt, **kwargs)
        for event in stream:
            if isinstance(event, Token) and on_text is not None:
                on_text(event.text)
        return stream.done

    def buffered(self) -> dict[str, int]:
        """{request id: messages received and not yet read} for every id that has some.

        Between requests it is empty: anything here is a message the daemon sent for a
        request this client is not waiting on."""
        return {rid: len(box) for rid, box in self._inbox.items() if box}

    # ---- plumbing ----------------------------------------------------------------------

    def _call(self, msg: Any, expected: type, *, keep_waiting: bool = False) -> Any:
        self._send(proto.encode(msg))
        try:
            reply = self._next(msg.id, keep_waiting=keep_waiting)
        finally:
            # One reply per call: its inbox entry goes, or a long-lived client grows by
            # one entry per ping, status or cancel.
            self._forget(msg.id)
        if not isinstance(reply, expected):
            raise ClientError(f"expected a {expected.TYPE} reply to {msg.TYPE}, got {reply.TYPE}")
        return reply

    def _send(self, data: bytes) -> None:
        if not self._finalizer.alive:
            raise ClientError("this client is closed")
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonDied(f"cannot send to the daemon at {self.paths.socket}: its queue is full") from None

    def _next(self, request_id: str, *, keep_waiting: bool, within: float | None = None) -> proto.Reply | None:
        """The next message for `request_id`; an `error` reply raises `RequestRejected`.

        keep_waiting: after `timeout` seconds of silence, ping; wait on while it answers.
        within: return None once that many seconds have passed without one.
        """
        box = self._inbox.setdefault(request_id, deque())
        last = heard = time.monotonic()
        deadline = None if within is None else last + within
        while not box:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            wait = _SLICE_S if deadline is None else min(_SLICE_S, max(deadline - time.monotonic(), 0.0))
            if self._sock.poll(int(wait * 1000), zmq.POLLIN):
                self._receive()
                last = heard = time.monotonic()
                continue
            if self.pid is not None and not pid_alive(self.pid):
                raise DaemonDied(f"the daemon (pid {self.pid}) exited while a reply to {request_id} was awaited")
            if time.monotonic() - last >= self.timeout:
                if keep_waiting and self._alive():
                    last = time.monotonic()
                    continue
                if self.paths.paused_socket.exists():
                    # Its socket renamed away: it is near its open-file limit (daemon/limits.py).
                    raise RequestRejected(
                        proto.BUSY,
                        f"the daemon (pid {self.pid}) takes no new connections now: its open files are nearly "
                        "all client connections; try again when some have closed",
                        request_id,
                    )
                # The ping of a long wait takes up to `timeout` more: say how long it really was.
                raise DaemonDied(
                    f"no reply from the daemon (pid {self.pid}) for {time.monotonic() - heard:.0f} s"
                    f"{', nor to a ping' if keep_waiting else ''} (timeout {self.timeout:g} s); "
                    f"see its log {self.paths.log} or `moestreamctl status`"
                )
        reply = box.popleft()
        if isinstance(reply, proto.Error):
            self._inbox.pop(request_id, None)
            raise RequestRejected(reply.code, reply.message, request_id)
        return reply

    def _receive(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = proto.decode_reply(data)
            except proto.ProtocolError as e:
                raise ClientError(f"the daemon sent a message this client cannot read: {e.message}") from None
            if reply.id:
                self._inbox.setdefault(reply.id, deque()).append(reply)
            elif isinstance(reply, proto.Error):
                # An error the daemon could not tie to a request id: a message it could not read.
                raise RequestRejected(reply.code, reply.message)

    def _alive(self) -> bool:
        try:
            self.ping()
        except DaemonDied:
            return False
        return True

    def _forget(self, request_id: str) -> None:
        self._inbox.pop(request_id, None)


class GenerateStream:
    """The events of one generate request: `Accepted`, `Progress` events if asked for, `Token`s (and
    `ToolCall`s for a request with tools), then one `Done` (kept in `.done`).

    Leaving the loop early and calling `close()` cancels the request.
    """

    def __init__(self, client: Client, request_id: str) -> None:
        self.client = client
        self.id = request_id
        self.done: Done | None = None
        self._failed = False

    def __iter__(self) -> Iterator[Accepted | Progress | Token | ToolCall | Done]:
        return self

    def __next__(self) -> Accepted | Progress | Token | ToolCall | Done:
        event = self.next_event()
        assert event is not None
        return event

    def next_event(self, within: float | None = None) -> Accepted | Progress | Token | ToolCall | Done | None:
        """The next event, as iterating gives it, or None when none came within `within`
        seconds (a long prompt's prefill sends none unless asked for progress): a caller
        that must notice something else meanwhile (its own client gone) polls with it.
        StopIteration after the `Done`."""
        if self.done is not None or self._failed:
            raise StopIteration
        try:
            event = self.client._next(self.id, keep_waiting=True, within=within)
        except RequestRejected:
            self._failed = True
            raise
        if event is None:
            return None
        if isinstance(event, Done):
            self.done = event
            self.client._forget(self.id)
        elif not isinstance(event, (Token, ToolCall, Progress, Accepted)):
            raise ClientError(f"unexpected {event.TYPE} message in the stream of {self.id}")
        return event

    def cancel(self) -> bool:
        """Ask the daemon to stop this request; the stream then ends with a `Done`."""
        return self.client.cancel(self.id)

    def close(self) -> None:
        """Cancel the request if it is still running, and drop its remaining events."""
        if self.done is None and not self._failed and self.client._finalizer.alive:
            self.cancel()
            for _ in self:
                continue

    def abandon(self) -> None:
        """Cancel the request without waiting for the daemon to apply it (the engine takes
        it within a prefill's layer or chunk): returns once the daemon has the message (a
        ping sent after it was answered), so the caller may close the client and go (the
        replies still to come are not read: for a client about to close). The stream ends
        here."""
        if self.done is None and not self._failed and self.client._finalizer.alive:
            client = self.client
            client._send(proto.encode(proto.Cancel(id=_new_id(), target=self.id)))
            # One socket, in order: the ping's answer comes after the daemon read the cancel.
            client.ping()
            client._forget(self.id)
        self._failed = True

    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chat(messages: Sequence[Mapping[str, Any]] | None) -> tuple[proto.ChatMessage, ...] | None:
    if messages is None:
        return None
    try:
        return tuple(
            proto.ChatMessage(
                role=m["role"],
                content=m["content"],
                tool_calls=tuple(m["tool_calls"]) if m.get("tool_calls") is not None else None,
                tool_call_id=m.get("tool_call_id"),
                name=m.get("name"),
                reasoning=m.get("reasoning"),
                call_texts=tuple(m["call_texts"]) if m.get("call_texts") is not None else None,
                images=tuple(_image(im) for im in m["images"]) if m.get("images") else None,
            )
            for m in messages
        )
    except (KeyError, TypeError, AttributeError):
        raise RequestRejected(proto.BAD_MESSAGE, "each of 'messages' must be a map with 'role' and 'content'") from None


def _image(image: proto.ImageData | bytes) -> proto.ImageData:
    """A chat message's image: an `ImageData`, or an image file's bytes."""
    if isinstance(image, proto.ImageData):
        return image
    if isinstance(image, (bytes, bytearray)):
        return proto.ImageData(bytes(image))
    raise TypeError("an image is an ImageData or the image file's bytes")


def _new_id() -> str:
    return uuid.uuid4().hex
