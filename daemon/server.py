"""The daemon's I/O side: the ROUTER socket, message validation, replies, shutdown.

`Server.run()` runs the engine on the calling (main) thread and this I/O loop on a
thread of its own, which never waits on the model: ping, status and stats are answered
at once, status from the snapshot the engine publishes. Generate and cancel go to the
engine's command queue; the engine's events come back over an inproc PULL socket and
leave through the ROUTER.

Signals: the handlers (main thread) only set a flag; `signal.set_wakeup_fd` writes the
signal number to a socket pair that the I/O loop polls, so a stop is noticed at once
even while the main thread is inside a long forward pass.

Disconnects: the ROUTER has ROUTER_MANDATORY set, so a send to a client whose socket is
gone fails with EHOSTUNREACH instead of vanishing; the engine is then told to stop that
client's requests. Every active request sends an event per token, so a client that
disconnects mid-stream is noticed at the next token.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import __version__
from ..shared import protocol as proto
from ..shared.runtime_dir import RuntimePaths
from ..shared.settings import Settings
from ..shared.store_format import vanished_store_problem
from .engine_loop import EXIT_FRAME, EngineLoop
from .limits import FileLimit

# Hard cap above the protocol's limit: up to it an oversized message gets an error
# reply; past it ZeroMQ drops the connection without reading the message into memory.
HARD_MAX_MESSAGE_BYTES = 16 * proto.MAX_MESSAGE_BYTES
POLL_MS = 500
# Bounded wait at close so the last `done` events (e.g. finish reason "shutdown") still
# reach their clients; a stuck client cannot hold the daemon longer than this.
CLOSE_LINGER_MS = 500
# Messages queued for one client that does not read them, before it is dropped: far more
# than a reading client ever has waiting (a token event is sent as it is made).
REPLY_QUEUE_MESSAGES = 1000
# Clients dropped (disconnected, or not reading) whose later messages are discarded.
GONE_REMEMBERED = 4096
# How often the descriptors the process holds besides its connections are counted again.
FD_RECOUNT_SECONDS = 5.0


@dataclass
class ServerCounters:
    """What the I/O thread refused or dropped, for `status` (clients)."""

    refused_busy: int = 0  # requests of new clients past max_connections
    shut_near_file_limit: int = 0  # connections shut down at once, near the open-file limit
    dropped: int = 0  # clients gone, or not reading their replies
    ignored_messages: int = 0  # messages of dropped clients, not served

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Server:
    """One daemon's I/O loop. `run()` returns the process exit code."""

    def __init__(
        self,
        settings: Settings,
        paths: RuntimePaths,
        log: logging.Logger,
        *,
        handle_signals: bool = True,
        file_limit: FileLimit | None = None,
        share: Any = None,
    ) -> None:
        """`share`: rank 0's share of an expert-parallel group (`--distributed`), else None."""
        self.settings = settings
        self.share = share
        self.file_limit = file_limit or FileLimit.at_start()
        self.paths = paths
        self.log = log
        self.handle_signals = handle_signals and threading.current_thread() is threading.main_thread()
        self.started = time.monotonic()
        self._process = psutil.Process()
        self._stop_requested = False
        self._stop_sent = False
        self._io_failed = False
        self._clients = 0
        # Peers whose requests are served; a new one past max_connections is refused.
        self._admitted: OrderedDict[bytes, None] = OrderedDict()
        self._refusing = False
        self._other_fds = 0
        self._fds_counted = 0.0
        self.counters = ServerCounters()
        self._gone: OrderedDict[bytes, None] = OrderedDict()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # Only a flag; the wake-up fd has already woken the I/O loop.
        self._stop_requested = True

    def run(self) -> int:
        """Bind, load, serve until shutdown; returns the exit code (0 after a clean stop)."""
        ctx = zmq.Context()
        events_endpoint = f"inproc://engine-events-{id(self)}"
        engine = EngineLoop(self.settings, ctx, events_endpoint, self.log, file_limit=self.file_limit, share=self.share)
        wake_r, wake_w = socket.socketpair()
        bound = threading.Event()
        io = threading.Thread(target=self._io_main, args=(ctx, events_endpoint, engine, wake_r, bound), name="io")
        old_handlers: dict[int, Any] = {}
        old_wakeup = -1
        try:
            if self.handle_signals:
                wake_w.setblocking(False)
                old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    old_handlers[sig] = signal.signal(sig, self._on_signal)
            io.start()
            bound.wait()
            if self._io_failed:
                return 1
            engine.run()  # until a stop; its last act is the exit frame for the I/O loop
        finally:
            engine.stop()
            io.join()
            if self.handle_signals:
                for sig, handler in old_handlers.items():
                    signal.signal(sig, handler)
                signal.set_wakeup_fd(old_wakeup)
            wake_r.close()
            wake_w.close()
            ctx.term()
        if self._io_failed:
            return 1
        return self._exit_code(engine)

    def _io_main(
        self, ctx: zmq.Context, events_endpoint: str, engine: EngineLoop, wake: socket.socket, bound: threading.Event
    ) -> None:
        router = ctx.socket(zmq.ROUTER)
        pull = ctx.socket(zmq.PULL)
        monitor = None
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
            # Each client's reply queue is bounded: one that stops reading (while it goes on
            # sending) would otherwise grow the daemon without end. A full queue fails the
            # send with EAGAIN, and `_send` drops that client like a disconnected one.
            router.setsockopt(zmq.SNDHWM, REPLY_QUEUE_MESSAGES)
            router.bind(self.paths.endpoint)
            os.chmod(self.paths.socket, 0o600)
            monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.RCVHWM, 0)
            pull.bind(events_endpoint)
            self.log.info("listening on %s (pid %d)", self.paths.endpoint, os.getpid())
            bound.set()
            self._loop(router, pull, monitor, wake, engine)
        except Exception:
            self.log.exception("the I/O thread failed")
            self._io_failed = True
            engine.stop()
            # Until the engine has exited, its PUSH socket must stay connectable.
            if bound.is_set():
                engine.finished.wait()
        finally:
            bound.set()
            if monitor is not None:
                router.disable_monitor()
                monitor.close(linger=0)
            pull.close(linger=0)
            router.close(linger=CLOSE_LINGER_MS)

    def _loop(
        self, router: zmq.Socket, pull: zmq.Socket, monitor: zmq.Socket, wake: socket.socket, engine: EngineLoop
    ) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(wake.fileno(), zmq.POLLIN)
        while True:
            ready = dict(poller.poll(POLL_MS))
            if wake.fileno() in ready:
                signals = wake.recv(4096)
                if any(n in (signal.SIGTERM, signal.SIGINT) for n in signals):
                    self._stop_requested = True
            if time.monotonic() - self._fds_counted > FD_RECOUNT_SECONDS:
                self._count_fds()
            if monitor in ready:
                self._read_monitor(monitor)
            if pull in ready and self._forward_events(router, pull, engine):
                return
            if router in ready:
                self._read_requests(router, engine)
            if self._stop_requested and not self._stop_sent:
                self.log.info(
                    "shutting down: cancelling %d request(s)",
                    len(engine.snapshot.get("requests", {}).get("active", [])),
                )
                engine.stop()
                self._stop_sent = True
            if engine.finished.is_set():
                # It sends its exit frame last: forward what is left, then go.
                self._forward_events(router, pull, engine)
                return

    def _exit_code(self, engine: EngineLoop) -> int:
        if engine.state == "failed":
            self.log.error("exiting: %s", engine.error)
            return 1
        self.log.info("stopped cleanly")
        return 0

    # ---- engine -> clients ---------------------------------------------------------------

    def _forward_events(self, router: zmq.Socket, pull: zmq.Socket, engine: EngineLoop) -> bool:
        """Send every event the engine has queued; True once it has exited."""
        while True:
            try:
                peer, data = pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            if peer.bytes == b"" and data.bytes == EXIT_FRAME:
                return True
            self._send(router, peer.bytes, data, engine)

    def _send(self, router: zmq.Socket, peer: bytes, data: Any, engine: EngineLoop | None) -> None:
        if peer in self._gone:
            return
        try:
            router.send_multipart([peer, data], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                why = "disconnected"
            elif e.errno == zmq.EAGAIN:
                why = "not reading its replies (send queue full)"
            else:
                raise
            self.log.info("client %s %s: stopping its requests; its later messages are ignored", peer.hex(), why)
            self.counters.dropped += 1
            self._gone[peer] = None
            if len(self._gone) > GONE_REMEMBERED:
                self._gone.popitem(last=False)
            if engine is not None:
                engine.peer_gone(peer)

    # ---- clients -> daemon ---------------------------------------------------------------

    def _read_requests(self, router: zmq.Socket, engine: EngineLoop) -> None:
        for _ in range(256):  # then let events and signals through
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = frames[0]
            if peer in self._gone:
                # A routing id is one connection's: a dropped client never comes back under it,
                # so what it sent before it went (or while not reading) is not worth serving.
                self.counters.ignored_messages += 1
                continue
            if not self._admit(router, peer, frames[-1]):
                continue
            if len(frames) != 2:
                self._reply(
                    router,
                    peer,
                    proto.Error("", proto.BAD_MESSAGE, f"expected one frame per message, got {len(frames) - 1}"),
                )
                continue
            try:
                msg = proto.decode_request(frames[1])
            except proto.ProtocolError as e:
                self.log.info("refused a message from %s: %s: %s", peer.hex(), e.code, e.message)
                self._reply(router, peer, proto.Error(e.request_id, e.code, e.message))
                continue
            self._dispatch(router, peer, msg, engine)

    def _admit(self, router: zmq.Socket, peer: bytes, data: bytes) -> bool:
        """Whether `peer`'s requests are served: one served before is; a new one is while
        the daemon has at most max_connections connections, else it hears why not."""
        if peer in self._admitted:
            self._admitted.move_to_end(peer)
            return True
        limit = self.settings.max_connections
        if self._clients <= limit:
            self._admitted[peer] = None
            if len(self._admitted) > 2 * limit:
                self._admitted.popitem(last=False)
            self._refusing = False
            return True
        self.counters.refused_busy += 1
        if not self._refusing:
            self.log.warning("%d connections open (max_connections %d): refusing new clients", self._clients, limit)
            self._refusing = True
        rid = ""
        try:
            rid = proto.decode_request(data).id
        except proto.ProtocolError as e:
            rid = e.request_id
        self._reply(
            router,
            peer,
            proto.Error(
                rid,
                proto.BUSY,
                f"the daemon has {self._clients} connections open (setting max_connections {limit}); "
                "close some and try again",
            ),
        )
        return False

    def _dispatch(self, router: zmq.Socket, peer: bytes, msg: proto.Request, engine: EngineLoop) -> None:
        if isinstance(msg, proto.Ping):
            self._reply(router, peer, proto.Pong(msg.id, os.getpid(), self._state(engine), __version__))
        elif isinstance(msg, proto.Status):
            self._reply(router, peer, proto.StatusReply(msg.id, self.status(engine)))
        elif isinstance(msg, proto.Stats):
            self._reply(router, peer, proto.StatsReply(msg.id, self.stats(engine)))
        elif isinstance(msg, proto.Shutdown):
            self.log.info("shutdown asked by client %s", peer.hex())
            self._reply(router, peer, proto.ShutdownReply(msg.id, os.getpid()))
            self._stop_requested = True
        elif isinstance(msg, (proto.Generate, proto.CountTokens, proto.Load)):
            if self._stop_requested:
                self._reply(router, peer, proto.Error(msg.id, proto.SHUTTING_DOWN, "the daemon is shutting down"))
            elif isinstance(msg, proto.Generate):
                engine.submit(peer, msg)
            elif isinstance(msg, proto.Load):
                engine.load(peer, msg)
            else:
                engine.count(peer, msg)
        elif isinstance(msg, proto.Cancel):
            engine.cancel(peer, msg)

    def _reply(self, router: zmq.Socket, peer: bytes, message: proto.Reply) -> None:
        self._send(router, peer, proto.encode(message), None)

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._clients += 1
                if self._clients > self.file_limit.connection_room(self._other_fds):
                    self._shut_down(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._clients = max(self._clients - 1, 0)

    def _count_fds(self) -> None:
        self._fds_counted = time.monotonic()
        try:
            self._other_fds = max(self._process.num_fds() - self._clients, 0)
        except psutil.Error as e:
            self.log.warning("cannot count open files: %s", e)

    def _shut_down(self, fd: int) -> None:
        """End a connection past the file limit: shut its socket down (libzmq then sees
        it end and closes its descriptor), so that `accept` never fails with EMFILE."""
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError as e:
            self.log.warning("cannot shut down connection fd %d: %s", fd, e)
            return
        self.counters.shut_near_file_limit += 1
        n = self.counters.shut_near_file_limit
        if n in (1, 10, 100) or n % 1000 == 0:
            self.log.warning(
                "%d connections open, near the open-file limit: %d connection(s) shut down so far",
                self._clients,
                n,
            )

    # ---- status ------------------------------------------------------------------------

    def _state(self, engine: EngineLoop) -> str:
        return "stopping" if self._stop_requested else engine.state

    def status(self, engine: EngineLoop) -> dict[str, Any]:
        """The daemon's state, built from the engine's last snapshot (never waits on it)."""
        snap = engine.snapshot
        now = time.monotonic()
        pool = snap.get("pool", {})
        requests = snap.get("requests", {})
        s = self.settings
        # Set when the model folder has gone or changed under the loaded model.
        problem = vanished_store_problem(snap["model"], snap.get("store_stamp")) if "model" in snap else None
        return {
            "pid": os.getpid(),
            "version": __version__,
            "protocol": proto.PROTOCOL_VERSION,
            "state": self._state(engine),
            "error": engine.error,
            "uptime_s": now - self.started,
            "model": snap.get("model", s.model),
            "store_id": snap.get("store_id"),
            "store_problem": problem,
            # chat, tools, thinking, vision: what the model takes (None before its first load).
            "capabilities": snap.get("capabilities"),
            "capacity": snap.get("capacity"),
            "policy": snap.get("policy", s.policy),
            "moe_layers": snap.get("moe_layers"),
            "experts_per_layer": snap.get("experts_per_layer"),
            # Every setting, as `restart` passes them back as flags.
            "settings": s.flag_values(),
            "pool": {
                "hit_rate": pool.get("hit_rate"),
                "evictions": pool.get("evictions"),
                "bytes_read": pool.get("bytes_read"),
                # Experts prefetch copied into a layer's slots ahead of use, and of them
                # those the layer then routed to (counted among the hits).
                "prestaged": pool.get("prestaged", 0),
                "prestaged_used": pool.get("prestaged_used", 0),
                "layers": pool.get("layers", []),
                "mapped": pool.get("mapped", False),
                # With `mapped = auto`: what it chose and why.
                "mapped_auto": pool.get("admission", {}).get("mapped_auto"),
                "mapped_pool": pool.get("mapped_pool"),
                # The prefill's order (daemon/model/prefill.py) and what its layer stacks
                # staged from the pool's memory (what they read from the store is in
                # bytes_read).
                "prefill": {
                    "order": pool.get("prefill_order"),
                    "stacked_layers": pool.get("stacked_layers", 0),
                    "staged_bytes": pool.get("staged_bytes", 0),
                },
            },
            # A request's context (prompt + generated) and how it was found: max_context,
            # or the model's own at most what the memory left for KV caches holds.
            "context": snap.get("context"),
            # Continuous batching: its size now and its totals (None: max_batch 1).
            "batch": snap.get("batch"),
            "prompt_cache": snap.get("prompt_cache"),
            "memory": {
                "rss_bytes": self._process.memory_info().rss,
                "mlx_active_bytes": snap.get("mlx_active_bytes"),
                "mlx_peak_bytes": snap.get("mlx_peak_bytes"),
                "resident_weights_bytes": snap.get("resident_bytes"),
                "pool_bytes": snap.get("pool_bytes"),
                "host_tier_bytes": _host_tier_bytes(pool.get("admission", {})),
                "kv_bytes": snap.get("kv_bytes"),
                "mlx_cache_bytes": snap.get("mlx_cache_bytes"),
            },
            "clients": {
                "connected": self._clients,
                "with_requests": requests.get("clients", 0),
                "max_connections": s.max_connections,
                **self.counters.to_dict(),
            },
            "requests": {
                "active": len(requests.get("active", [])),
                "queued": requests.get("queued", 0),
                # Why the first queued request waits (max_active, or a full batch).
                "why_queued": requests.get("why_queued"),
                # Each as shared/request_info.py `RequestInfo` has it: the active requests,
                # and the first LISTED_WAITING queued ones.
                "running": requests.get("active", []),
                "waiting": requests.get("waiting", []),
                "recent": requests.get("recent", []),
                **{
                    k: requests[k]
                    for k in (
                        "requests",
                        "completed",
                        "cancelled",
                        "disconnected",
                        "failed",
                        "tokens",
                        "busy",
                        "waited_for_batch",
                        "waited_for_memory",
                    )
                    if k in requests
                },
            },
            "heat": snap.get("heat", {}),
            "autopin": snap.get("autopin"),
            # `--distributed`: each rank's share, pool, hit rate and bytes (docs/scale-out.md), else None.
            "expert_parallel": snap.get("expert_parallel"),
            # The idle unload (daemon/keep_alive.py): the clock, and what the last unload gave back.
            "keep_alive": snap.get("keep_alive"),
            "snapshot_age_s": now - snap.get("at", now),
            "log": str(self.paths.log),
            "runtime_dir": str(self.paths.dir),
            "socket": str(self.paths.socket),
        }

    def stats(self, engine: EngineLoop) -> dict[str, Any]:
        """Pool and read-engine statistics (totals and per layer) and request counters."""
        snap = engine.snapshot
        return {
            "state": self._state(engine),
            "model": snap.get("model"),
            "capacity": snap.get("capacity"),
            "policy": snap.get("policy"),
            "pool": snap.get("pool", {}),
            "reader": snap.get("reader", {}),
            "prefetch": snap.get("prefetch"),
            "diagnostics": snap.get("diagnostics"),
            "requests": {k: v for k, v in snap.get("requests", {}).items() if k not in ("active", "waiting", "recent")},
            "snapshot_age_s": time.monotonic() - snap.get("at", time.monotonic()),
        }


def _host_tier_bytes(admission: dict[str, Any]) -> int | None:
    """The host tier's memory (None: the model is not loaded; 0: no tier)."""
    if not admission:
        return None
    return admission.get("tier_bytes", 0) if admission.get("mode") == "host-tier" else 0
