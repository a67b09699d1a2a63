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
client's requests. A client that sends nothing meanwhile (a long prompt's prefill, with no
progress asked for) is noticed by its connection's end: each message's descriptor
(ZMQ_SRCFD) ties the connection to its routing id, and the monitor's disconnect event
names the descriptor (read before any message, so a descriptor used again by a new
connection is never taken for the old one).

A client that does not read (its reply queue full: EAGAIN) is paused: what it was sent is
held here, the engine stops stepping its requests, and both go on when it reads again;
held UNREAD_SECONDS, or past HELD_MESSAGES, it is dropped and its requests are stopped.
A routing id that comes back after a drop is served again: after a disconnect its next
message is a new connection's (a client with a fixed routing id; libzmq reads a closed
connection to its end before a send finds it gone, and what a connection sent just before
it ended is served to no one: its replies find it gone); after a drop for not reading,
its next message is answered with why, once it reads again.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import __version__
from ..shared import protocol as proto
from ..shared.runtime_dir import RuntimePaths
from ..shared.settings import Settings
from ..shared.status import ClientsStatus, ServerCounters, Stats, Status
from ..shared.store_format import vanished_store_problem
from .engine_loop import EXIT_FRAME, EngineLoop
from .limits import FileLimit

# Hard cap above the protocol's limit: up to it an oversized message gets an error
# reply; past it ZeroMQ drops the connection without reading the message into memory.
HARD_MAX_MESSAGE_BYTES = 16 * proto.MAX_MESSAGE_BYTES + proto.MAX_IMAGE_MESSAGE_BYTES
POLL_MS = 500
# Bounded wait at close so the last `done` events (e.g. finish reason "shutdown") still
# reach their clients; a stuck client cannot hold the daemon longer than this.
CLOSE_LINGER_MS = 500
# Messages queued in ZeroMQ for one client before the daemon holds the rest and pauses
# its requests: more than a reading client has waiting (a token event is sent as it is made).
REPLY_QUEUE_MESSAGES = 128
# Each connection's kernel send buffer (doubled by Linux), so that a client that stops
# reading fills its queue after a few hundred token events, not thousands (libzmq sets
# SO_SNDBUF on TCP connections only).
SEND_BUFFER_BYTES = 16 * 1024
# A client that reads nothing of what is held for it this long is dropped (its requests
# stopped): an unread stream is paused, then cancelled, not run to max_tokens.
UNREAD_SECONDS = 10.0
# Messages held for one paused client, at most: one that goes on sending requests without
# reading their replies is dropped then (a paused client's requests make nothing more).
HELD_MESSAGES = 64
# While something is held, how often its sending is tried again.
HELD_RETRY_MS = 20
# Clients dropped (disconnected, or not reading) and why, for their later messages.
GONE_REMEMBERED = 4096
DISCONNECTED = "disconnected"
NOT_READING = "not reading its replies"
# How often the descriptors the process holds besides its connections are counted again.
FD_RECOUNT_SECONDS = 5.0
# While the socket is renamed away (near the open-file limit), how often the open files
# are counted to see whether it may come back.
PAUSED_RECOUNT_SECONDS = 0.2


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
        # Near the open-file limit the socket file is renamed away (daemon/limits.py).
        self._not_accepting = False
        self.counters = ServerCounters()
        # Dropped clients and why (DISCONNECTED, NOT_READING).
        self._gone: OrderedDict[bytes, str] = OrderedDict()
        # Paused clients: what could not be sent to each yet, and since when.
        self._held: dict[bytes, deque[Any]] = {}
        self._held_since: dict[bytes, float] = {}
        # Each connection's routing id by its descriptor (from its messages' ZMQ_SRCFD).
        self._fd_peers: dict[int, bytes] = {}
        self._engine: EngineLoop | None = None
        self._monitor_socket: zmq.Socket | None = None

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
            monitor = self._monitor(ctx, router)
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

    @staticmethod
    def _monitor(ctx: zmq.Context, router: zmq.Socket) -> zmq.Socket:
        """The ROUTER's accept and disconnect events, none dropped: libzmq drops what its
        monitor pipe cannot hold, and a lost disconnect would skew the count of clients."""
        address = f"inproc://monitor-{id(router)}"
        router.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        monitor = ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.connect(address)
        return monitor

    def _loop(
        self, router: zmq.Socket, pull: zmq.Socket, monitor: zmq.Socket, wake: socket.socket, engine: EngineLoop
    ) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(wake.fileno(), zmq.POLLIN)
        self._engine, self._monitor_socket = engine, monitor
        while True:
            ready = dict(poller.poll(HELD_RETRY_MS if self._held else POLL_MS))
            if wake.fileno() in ready:
                signals = wake.recv(4096)
                if any(n in (signal.SIGTERM, signal.SIGINT) for n in signals):
                    self._stop_requested = True
            since = time.monotonic() - self._fds_counted
            if since > FD_RECOUNT_SECONDS or (self._not_accepting and since > PAUSED_RECOUNT_SECONDS):
                self._count_fds()
            if monitor in ready:
                self._read_monitor(monitor)
            if self._held:
                self._send_held(router)
            if pull in ready and self._forward_events(router, pull, engine):
                return
            if router in ready:
                self._read_requests(router, engine)
            if self._stop_requested and not self._stop_sent:
                self.log.info(
                    "shutting down: cancelling %d request(s)",
                    engine.snapshot.status.requests.active,
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
            self._send(router, peer.bytes, data)

    def _send(self, router: zmq.Socket, peer: bytes, data: Any) -> None:
        if peer in self._gone:
            return
        held = self._held.get(peer)
        if held is not None:  # behind what waits already, in order
            held.append(data)
            if len(held) > HELD_MESSAGES:
                self._drop(peer, NOT_READING, f"{len(held)} replies held")
            return
        sent = self._try_send(router, peer, data)
        if sent is False:
            self._held[peer] = deque([data])
            self._held_since[peer] = time.monotonic()
            self.counters.paused += 1
            if self._engine is not None:
                self._engine.peer_paused(peer, True)

    def _try_send(self, router: zmq.Socket, peer: bytes, data: Any) -> bool | None:
        """True: sent; False: its queue is full (EAGAIN); None: it has gone (dropped now)."""
        try:
            router.send_multipart([peer, data], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            if e.errno == zmq.EAGAIN:
                return False
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._drop(peer, DISCONNECTED)
            return None
        return True

    def _send_held(self, router: zmq.Socket) -> None:
        """Send what is held for paused clients, as far as each reads; a client that has
        read nothing for UNREAD_SECONDS is dropped. One that has all of it resumes."""
        now = time.monotonic()
        for peer in list(self._held):
            held = self._held[peer]
            while held:
                sent = self._try_send(router, peer, held[0])
                if sent is None:
                    break
                if not sent:
                    if now - self._held_since[peer] > UNREAD_SECONDS:
                        self._drop(peer, NOT_READING, f"nothing read for {UNREAD_SECONDS:g} s")
                    break
                held.popleft()
                self._held_since[peer] = now
            if not held and peer in self._held:
                del self._held[peer], self._held_since[peer]
                if self._engine is not None:
                    self._engine.peer_paused(peer, False)

    def _drop(self, peer: bytes, why: str, detail: str = "", *, quiet: bool = False) -> None:
        """Stop a client's requests (disconnected, or not reading), and what was held for it.
        `quiet`: a connection that ended (most clients end so, their requests done)."""
        if not quiet:
            self.log.info("client %s %s%s: stopping its requests", peer.hex(), why, f" ({detail})" if detail else "")
            self.counters.dropped += 1
        if why == NOT_READING:
            self.counters.dropped_not_reading += 1
        self._gone[peer] = why
        if len(self._gone) > GONE_REMEMBERED:
            self._gone.popitem(last=False)
        if self._held.pop(peer, None) is not None:
            del self._held_since[peer]
        if self._engine is not None:
            self._engine.peer_gone(peer)

    def _back(self, router: zmq.Socket, peer: bytes, data: bytes) -> bool:
        """Whether a message from a dropped client is served. After a disconnect: served
        (a new connection's under the same routing id). After a drop for not reading, it
        is answered with why once the client reads again (and the client is served from
        then on); else ignored."""
        if self._gone[peer] == DISCONNECTED:
            del self._gone[peer]
            return True
        error = proto.Error(
            _request_id(data),
            proto.BUSY,
            "this connection was dropped: it read none of its replies for a while, and its requests were "
            "stopped; send the request again",
        )
        try:
            router.send_multipart([peer, proto.encode(error)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EAGAIN, zmq.EHOSTUNREACH):
                raise
            self.counters.ignored_messages += 1
            return False
        del self._gone[peer]
        return False

    # ---- clients -> daemon ---------------------------------------------------------------

    def _read_requests(self, router: zmq.Socket, engine: EngineLoop) -> None:
        for _ in range(256):  # then let events and signals through
            # Every disconnect before this message first: its descriptor may be a new
            # connection's that an old one's event still names.
            if self._monitor_socket is not None:
                self._read_monitor(self._monitor_socket)
            try:
                parts = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [f.bytes for f in parts]
            peer = frames[0]
            self._fd_peers[parts[-1].get(zmq.SRCFD)] = peer
            if peer in self._gone and not self._back(router, peer, frames[-1]):
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
        limit = self.max_connections()
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
        self._reply(
            router,
            peer,
            proto.Error(
                _request_id(data),
                proto.BUSY,
                f"the daemon has {self._clients} connections open (max_connections {limit}: "
                f"{self._limit_why(limit)}); close some and try again",
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
        self._send(router, peer, proto.encode(message))

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._clients += 1
                if self.file_limit.past_the_line(event["value"]):
                    self._pause_accepting()
                    self._shut_down(event["value"])
                else:
                    _bound_send_buffer(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._clients = max(self._clients - 1, 0)
                peer = self._fd_peers.pop(event["value"], None)
                if peer is not None and peer not in self._gone:
                    # Its requests stop now, not at their next event (none in a prefill).
                    self._drop(peer, DISCONNECTED, quiet=True)

    def max_connections(self) -> int:
        """The setting, at most the room the open-file limit leaves beside the daemon's own files."""
        return max(min(self.settings.max_connections, self.file_limit.connection_room(self._other_fds)), 1)

    def _limit_why(self, limit: int) -> str:
        if limit >= self.settings.max_connections:
            return "the setting"
        return f"what the open-file limit {self.file_limit.soft()} leaves beside the daemon's own {self._other_fds}"

    def _count_fds(self) -> None:
        self._fds_counted = time.monotonic()
        try:
            fds = self._process.num_fds()
        except psutil.Error as e:
            self.log.warning("cannot count open files: %s", e)
            return
        self._other_fds = max(fds - self._clients, 0)
        if self._not_accepting and self.file_limit.below_the_line(fds):
            self._resume_accepting(fds)

    def _pause_accepting(self) -> None:
        """Take no new connection: the socket file renamed away, so a connect finds
        nothing and costs the daemon no file. Those open stay served."""
        if self._not_accepting or not self._rename_socket(self.paths.socket, self.paths.paused_socket):
            return
        self._not_accepting = True
        self._fds_counted = time.monotonic()
        self.counters.paused_accepting += 1
        n = self.counters.paused_accepting
        if n in (1, 10, 100) or n % 1000 == 0:
            self.log.warning(
                "%d connections open, near the open-file limit %d: no new connections until some close "
                "(%d time(s) so far)",
                self._clients,
                self.file_limit.soft(),
                n,
            )

    def _resume_accepting(self, fds: int) -> None:
        if not self._rename_socket(self.paths.paused_socket, self.paths.socket):
            return
        self._not_accepting = False
        if self.counters.paused_accepting in (1, 10, 100):
            self.log.info("%d files open: taking new connections again", fds)

    def _rename_socket(self, source: Path, target: Path) -> bool:
        try:
            os.rename(source, target)
        except OSError as e:
            self.log.error("cannot rename the socket %s to %s: %s", source, target, e)
            return False
        return True

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

    def status(self, engine: EngineLoop) -> Status:
        """The daemon's state: the engine's last snapshot (never waits on it) with what this
        thread knows (the process, its connections, its files)."""
        snap = engine.snapshot
        now = time.monotonic()
        st = snap.status
        return replace(
            st,
            pid=os.getpid(),
            version=__version__,
            protocol=proto.PROTOCOL_VERSION,
            state=self._state(engine),
            error=engine.error,
            uptime_s=now - self.started,
            # Set when the model folder has gone or changed under the loaded model.
            store_problem=vanished_store_problem(snap.served, snap.store_stamp) if snap.served else None,
            settings=self.settings.flag_values(),
            memory=replace(st.memory, rss_bytes=self._process.memory_info().rss),
            clients=ClientsStatus(
                connected=self._clients,
                with_requests=st.clients.with_requests,
                max_connections=self.max_connections(),
                accepting=not self._not_accepting,
                **self.counters.to_dict(),
            ),
            snapshot_age_s=now - snap.at,
            log=str(self.paths.log),
            runtime_dir=str(self.paths.dir),
            socket=str(self.paths.socket),
        )

    def stats(self, engine: EngineLoop) -> Stats:
        """Pool and read-engine statistics (totals and per layer) and request counters."""
        snap = engine.snapshot
        return replace(snap.stats, state=self._state(engine), snapshot_age_s=time.monotonic() - snap.at)


def _bound_send_buffer(fd: int) -> None:
    """A new connection's send buffer to SEND_BUFFER_BYTES."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    except OSError:
        pass  # closed already (a late event): nothing to bound


def _request_id(data: bytes) -> str:
    """The request id of a message, where it has one."""
    try:
        return proto.decode_request(data).id
    except proto.ProtocolError as e:
        return e.request_id
