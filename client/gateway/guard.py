"""The gateway's guards: what an HTTP server on the user's machine must refuse.

Two layers, both independent of the routes (any API the gateway serves gets them):

  connections (`ConnectionGuard`, a uvicorn h11 protocol that reports to it)
      a connection must send its request's headers within `header_timeout` of opening
      (or of its previous response) and its body within `body_timeout` of the headers;
      at most `max_connections` at once (and fewer than the open-file limit allows) and
      `max_per_client` per client address, each with a bounded kernel send buffer
      (SEND_BUFFER_BYTES: a client that stops reading is noticed). Past a cap, the oldest connection that is
      not in the middle of a request (still sending headers, or idle between requests)
      is closed to make room, so that half-open connections (slowloris) cannot keep a
      client that sends its request at once from being served; only when every
      connection is inside a request is the new one closed instead.

  requests (`GuardMiddleware`, ASGI)
      on a loopback server, the Host header must name it (loopback names or the bound
      address), so a DNS-rebinding page cannot read answers; a browser's Origin must be a loopback page
      or one configured (`gateway_origins`, as OLLAMA_ORIGINS); a POST must declare
      `Content-Type: application/json`, which a page can send only after a CORS
      preflight this server never grants.

Log lines are rate-limited (`limit_log_rate`): an attack must not fill the disk.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import socket
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from uvicorn.protocols.http.h11_impl import H11Protocol

from ...shared.log_rate import RateLimitFilter
from ...shared.settings import Settings
from .openai import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Descriptors kept free of connections: the daemon's sockets, the log, the listener.
RESERVED_FDS = 64
LOG_WINDOW_SECONDS = 10.0
# Each connection's kernel send buffer (doubled by Linux; autotuned up to 4 MiB without
# it): a streamed answer whose client stops reading fills it after a few hundred events,
# and its send then blocks (app.py cancels it after UNREAD_SECONDS), not after 25,000.
SEND_BUFFER_BYTES = 64 * 1024
LOG_LINES_PER_WINDOW = 20

log = logging.getLogger("moestream.openai")


@dataclass(frozen=True)
class GuardConfig:
    """The guards' limits and what they let through."""

    bound_host: str = "127.0.0.1"
    origins: tuple[str, ...] = ()  # extra allowed browser origins; "*" allows every one
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 512
    max_per_client: int = 256

    @classmethod
    def from_settings(cls, settings: Settings, bound_host: str) -> "GuardConfig":
        origins = tuple(o.strip().rstrip("/") for o in (settings.gateway_origins or "").split(",") if o.strip())
        return cls(
            bound_host=bound_host,
            origins=origins,
            header_timeout=settings.gateway_read_timeout,
            body_timeout=settings.gateway_read_timeout,
            max_connections=settings.gateway_max_connections,
            max_per_client=max(settings.gateway_max_connections // 2, 1),
        )

    def host_allowed(self, host: str) -> bool:
        bound = self.bound_host.strip("[]").lower()
        if bound not in LOOPBACK_NAMES and not _is_loopback_ip(bound):
            # Reachable from other machines by any of its names: serve-openai requires an
            # API key there, which a rebinding page does not have.
            return True
        return host in LOOPBACK_NAMES or _is_loopback_ip(host) or host == bound

    def origin_allowed(self, origin: str) -> bool:
        if "*" in self.origins or origin.rstrip("/") in self.origins:
            return True
        try:
            host = urlsplit(origin).hostname or ""
        except ValueError:
            return False
        return host in LOOPBACK_NAMES or _is_loopback_ip(host)


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(value: str) -> str:
    """'Example.com:8080' -> 'example.com'; '[::1]:8080' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass
class ConnectionGuard:
    """Every open connection of the gateway, oldest first, and the limits on them."""

    config: GuardConfig
    evicted: int = 0  # idle or half-open connections closed to make room, for the log
    _open: OrderedDict[Any, str] = field(default_factory=OrderedDict)
    _per_client: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))

    def protocol_class(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol, reporting each connection's life to this guard."""
        guard = self

        class GuardedH11Protocol(H11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                guard.opened(self)

            def connection_lost(self, exc: Exception | None) -> None:
                guard.forget(self)
                super().connection_lost(exc)

            def handle_events(self) -> None:
                before = self.cycle
                super().handle_events()
                if self.cycle is not None and self.cycle is not before:
                    guard.deadline(self, guard.config.body_timeout, self.cycle, body=True)

            def on_response_complete(self) -> None:
                super().on_response_complete()
                guard.deadline(self, guard.config.header_timeout, self.cycle, body=False)

        return GuardedH11Protocol

    def limit(self) -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        room = soft - RESERVED_FDS if soft != resource.RLIM_INFINITY else self.config.max_connections
        return max(1, min(self.config.max_connections, room))

    def opened(self, conn: H11Protocol) -> None:
        client = conn.client[0] if conn.client else ""
        self._open[conn] = client
        self._per_client[client] += 1
        self.deadline(conn, self.config.header_timeout, None, body=False)
        if len(self._open) > self.limit():
            self._make_room(conn, None)
        elif self._per_client[client] > self.config.max_per_client:
            self._make_room(conn, client)

    def forget(self, conn: H11Protocol) -> None:
        client = self._open.pop(conn, None)
        if client is not None:
            self._per_client[client] -= 1
            if self._per_client[client] <= 0:
                del self._per_client[client]

    def _make_room(self, new: H11Protocol, client: str | None) -> None:
        for conn, addr in self._open.items():
            if conn is not new and (client is None or addr == client) and _between_requests(conn):
                self.evicted += 1
                self._close(conn)
                if self.evicted in (1, 100) or self.evicted % 10_000 == 0:
                    log.warning(
                        "%d connections open (limit %d, %d per client): closed %d idle or half-open so far",
                        len(self._open),
                        self.limit(),
                        self.config.max_per_client,
                        self.evicted,
                    )
                return
        self._close(new)  # every open connection is inside a request

    def _close(self, conn: H11Protocol) -> None:
        self.forget(conn)
        conn.transport.close()

    def deadline(self, conn: H11Protocol, seconds: float, cycle: Any, *, body: bool) -> None:
        """Close `conn` after `seconds` unless it has moved on: past `cycle` (headers), or
        with `cycle`'s body all received (body)."""

        def check() -> None:
            if conn not in self._open:
                return
            if conn.cycle is cycle and (not body or (cycle.more_body and not cycle.response_complete)):
                self._close(conn)

        conn.loop.call_later(seconds, check)


def _between_requests(conn: H11Protocol) -> bool:
    return conn.cycle is None or conn.cycle.response_complete


class GuardMiddleware:
    """ASGI middleware: Host, Origin and Content-Type checks before any route runs."""

    def __init__(self, app: Any, config: GuardConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            problem = self._problem(scope)
            if problem is not None:
                await _send_error(send, problem)
                return
        await self.app(scope, receive, send)

    def _problem(self, scope: dict[str, Any]) -> ApiError | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = _host_of(headers.get("host", ""))
        if not self.config.host_allowed(host):
            return ApiError(
                403,
                f"Host {headers.get('host', '')!r} is not this server: it answers only to its own address "
                "(a page served elsewhere cannot rebind its name to it)",
                code="forbidden_host",
            )
        origin = headers.get("origin")
        if origin is not None and not self.config.origin_allowed(origin):
            return ApiError(
                403,
                f"Origin {origin!r} may not use this server: only pages on this machine may, unless "
                "MOESTREAM_GATEWAY_ORIGINS lists it",
                code="forbidden_origin",
            )
        if scope.get("method") == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return ApiError(
                    415,
                    f"send the request body as JSON with `Content-Type: application/json` (got {kind or 'none'!r})",
                    code="unsupported_media_type",
                )
        return None


async def _send_error(send: Any, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def limit_log_rate() -> None:
    """Rate-limit the gateway's log: the handlers of the root, uvicorn and asyncio loggers."""
    shared = RateLimitFilter(LOG_LINES_PER_WINDOW, LOG_WINDOW_SECONDS)
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(shared)


def raise_file_limit() -> int:
    """The soft open-file limit raised to the hard limit (connections are files); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 10240)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
