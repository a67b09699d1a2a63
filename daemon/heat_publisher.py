"""The daemon's side of heat: send routing counts to the heat keeper, never waiting for it.

`HeatPublisher` binds two ipc sockets in the daemon's runtime folder, starts the keeper
(`python -m moestream.daemon.heat_keeper`, a fresh interpreter that inherits no MLX
state) and pushes counts to it with NOBLOCK. The keeper's protocol and lifetime are
described in `heat_keeper.py`.

Accounting of lost counts. A count can be lost in three ways, and each is added to
`dropped_counts`:
  - the send is refused (no keeper connected, or its queue is full);
  - the keeper dies: whatever it received or had queued since its last successful write
    is gone. Each keeper reports `durable_counts` (counts received in its life that are
    on disk) after every write, so on its death the loss is what was sent to it minus
    that figure;
  - the final write at `close()` fails or never happens: the same difference.
If a keeper dies right after a write whose report never reached the daemon, that write's
counts are counted as lost although they are on disk: the figure is an upper bound.

Threads: the data socket (push, flush request) and the reply socket are each guarded by
a lock, and every wait is bounded, so `push` may be called from the generation thread
while the daemon's loop calls `check()` and `health()`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import msgpack
import numpy as np
import zmq

from ..shared.store_format import POOL_USAGE_NAME
from .heat_keeper import PROTOCOL_VERSION, pack

HEAT_SOCKET = "heat.sock"
HEAT_ACK_SOCKET = "heat-ack.sock"
# sun_path is 108 bytes on Linux and 104 on macOS, the terminating NUL included.
MAX_IPC_PATH = 103


def socket_names(usage_name: str) -> tuple[str, str]:
    """The data and ack sockets' names in the runtime folder of the keeper of `usage_name`."""
    if usage_name == POOL_USAGE_NAME:
        return HEAT_SOCKET, HEAT_ACK_SOCKET
    stem = POOL_USAGE_NAME.removesuffix(".json")
    tag = usage_name.removesuffix(".json").removeprefix(stem + ".")  # rank1of2
    return f"heat-{tag}.sock", f"heat-ack-{tag}.sock"


def encode_counts(counts: Mapping[int, np.ndarray]) -> tuple[dict[int, bytes], int]:
    """{layer: per-expert counts} -> ({layer: little-endian int64 bytes}, total), leaving
    out layers with no count. Raises on arrays that are not 1-D, integer, non-negative."""
    keys = [int(k) for k in counts]
    arrays = [np.asarray(v) for v in counts.values()]
    for layer, a in zip(keys, arrays):
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise TypeError(
                f"[HeatPublisher.push] layer {layer}: expected a 1-D integer array, got {a.dtype} {a.shape}"
            )
    if not arrays:
        return {}, 0
    if len({a.shape for a in arrays}) == 1:  # the usual case: one pass over all layers
        rows = np.stack(arrays).astype("<i8", copy=False)
        negative = rows.size > 0 and rows.min() < 0
        sums = rows.sum(axis=1).tolist()
    else:
        rows = [a.astype("<i8", copy=False) for a in arrays]
        negative = any(r.size and r.min() < 0 for r in rows)
        sums = [int(r.sum()) for r in rows]
    if negative:
        bad = [k for k, a in zip(keys, arrays) if a.size and a.astype("<i8", copy=False).min() < 0]
        raise ValueError(f"[HeatPublisher.push] layer(s) {bad}: negative counts (or above int64)")
    return {keys[i]: rows[i].tobytes() for i, total in enumerate(sums) if total}, sum(sums)


class HeatPublisher:
    """Owns the heat keeper process and the sockets to it."""

    def __init__(
        self,
        store_dir: Path,
        runtime_dir: Path,
        *,
        flush_seconds: float,
        usage_name: str = POOL_USAGE_NAME,
        log: logging.Logger,
        flush_batches: int = 0,
        send_hwm: int = 1000,
        backoff: tuple[float, float] = (0.5, 30.0),
        stable_seconds: float = 30.0,
        lock_timeout: float = 1.0,
        context: zmq.Context | None = None,
    ) -> None:
        """`backoff` = (first, longest) restart delay; the delay doubles on each death
        and returns to `first` once a keeper has lived `stable_seconds`. `usage_name`:
        the heat file's name in `store_dir`; any other than `pool_usage.json` (a rank's
        own, `shared/heat_file.py` `usage_name`) has sockets named after it, so that the
        ranks of a group on one machine, which share a runtime folder, have their own."""
        if not flush_seconds > 0:
            raise ValueError(f"[HeatPublisher] flush_seconds must be positive, got {flush_seconds}")
        self.store_dir = Path(store_dir)
        self.usage_name = usage_name
        self.runtime_dir = Path(runtime_dir)
        self.flush_seconds = flush_seconds
        self.flush_batches = flush_batches
        self.log = log
        self.send_hwm = send_hwm
        self.backoff_first, self.backoff_max = backoff
        self.stable_seconds = stable_seconds
        self.lock_timeout = lock_timeout
        self._socket_names = socket_names(usage_name)
        self.data_endpoint = self._endpoint(self._socket_names[0])
        self.ack_endpoint = self._endpoint(self._socket_names[1])
        self._own_context = context is None
        self._ctx = context
        self._data: zmq.Socket | None = None
        self._ack: zmq.Socket | None = None
        self._lock = threading.Lock()  # data socket, process handle, counters
        self._ack_lock = threading.Lock()  # reply socket and what it reports
        self._proc: subprocess.Popen | None = None
        self._started_at = 0.0
        self._ready = False  # hello received and the data pipe is connected
        self._hello = False
        self._closed = False
        self._restart_at: float | None = None
        self._backoff = self.backoff_first
        self._seq = 0
        self._token = 0
        self._sent_here = 0  # counts sent to the current keeper
        self._durable_here = 0  # of which it reported on disk
        # Health figures.
        self._restarts = 0
        self._dropped = 0
        self._sent_total = 0
        self._last_flush_wall: float | None = None
        self._last_flush_ok: bool | None = None
        self._last_error: str | None = None
        self._load_problem: str | None = None
        self._set_aside: str | None = None
        self._keeper_stats: dict[str, Any] = {}
        self._exits: list[int] = []
        self._reports: dict[int, dict[str, Any]] = {}  # flush token (-1: final) -> report
        self._fatal: str | None = None  # why the current keeper could not start
        # While the current keeper cannot have the heat file's lock: who holds it, and the
        # pending file its counts go to meanwhile (heat_keeper.py, The lock).
        self._lock_wait: str | None = None
        self._pending: str | None = None

    def _endpoint(self, name: str) -> str:
        path = self.runtime_dir / name
        if len(os.fsencode(path)) > MAX_IPC_PATH:
            raise ValueError(
                f"[HeatPublisher] socket path {path} is {len(os.fsencode(path))} bytes; ipc paths must stay "
                f"under {MAX_IPC_PATH + 1}: choose a shorter runtime folder (setting runtime_dir)"
            )
        return f"ipc://{path}"

    # -- lifecycle ------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> bool:
        """Bind the sockets, spawn the keeper and wait up to `timeout` for it to load the
        file and connect. Returns whether it is ready; if not, `check()` keeps trying."""
        if self._data is not None or self._closed:
            raise RuntimeError("[HeatPublisher.start] already started")
        if not self.runtime_dir.is_dir():
            raise FileNotFoundError(
                f"[HeatPublisher] runtime folder {self.runtime_dir} does not exist; the daemon creates it (0700) first"
            )
        if self._ctx is None:
            self._ctx = zmq.Context()
        data = self._ctx.socket(zmq.PUSH)
        data.setsockopt(zmq.SNDHWM, self.send_hwm)
        data.setsockopt(zmq.LINGER, 0)
        ack = self._ctx.socket(zmq.PULL)
        ack.setsockopt(zmq.LINGER, 0)
        try:
            data.bind(self.data_endpoint)
            ack.bind(self.ack_endpoint)
        except zmq.ZMQError as e:
            data.close(linger=0)
            ack.close(linger=0)
            raise OSError(
                e.errno, f"[HeatPublisher] cannot bind {self.data_endpoint} / {self.ack_endpoint}: {e}"
            ) from e
        self._data, self._ack = data, ack
        self._spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._drain_acks(wait=0.02)
            with self._lock:
                if self._proc is None or self._proc.poll() is not None:
                    break
                self._try_ping()
                if self._ready:
                    return True
        self.check()
        if not self._ready:
            self.log.error("heat keeper not ready after %.1fs: %s", timeout, self._last_error or "no reply")
        return self._ready

    def _spawn(self) -> None:
        cmd = [
            sys.executable, "-m", "moestream.daemon.heat_keeper",
            "--endpoint", self.data_endpoint,
            "--ack-endpoint", self.ack_endpoint,
            "--store", str(self.store_dir),
            "--name", self.usage_name,
            "--flush-seconds", repr(self.flush_seconds),
            "--flush-batches", str(self.flush_batches),
            "--parent-pid", str(os.getpid()),
            "--lock-timeout", repr(self.lock_timeout),
        ]  # fmt: skip
        try:
            # Not under the lock: fork/exec takes milliseconds and push() must not wait.
            # The keeper logs to the daemon's stderr; its stdout is closed so that a pipe
            # the daemon's own parent reads is not held open by the keeper.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
        except OSError as e:
            with self._lock:
                self._last_error = f"cannot start the heat keeper ({' '.join(cmd[:3])}): {e}"
                self.log.error("%s; retrying in %.1fs", self._last_error, self._backoff)
                self._schedule_restart()
            return
        with self._lock:
            if self._closed:  # close() ran meanwhile
                proc.kill()
                proc.wait()
                return
            self._proc = proc
            self._started_at = time.monotonic()
            self._ready = self._hello = False
            self._sent_here = self._durable_here = 0
            self._keeper_stats = {}
            self._reports.clear()
            self._fatal = None
            self._lock_wait = self._pending = None
        self.log.info("heat keeper started, pid %d", proc.pid)

    def check(self) -> None:
        """Call periodically: takes the keeper's reports, notices its death, restarts it
        (after a back-off that doubles up to the maximum). Never waits long."""
        self._drain_acks()
        with self._lock:
            proc = self._proc
            dead = proc is not None and proc.poll() is not None
        if dead:
            self._drain_acks(wait=0.02)  # its last reports may still be in flight
        with self._lock:
            if self._closed:
                return
            if dead and self._proc is proc:
                self._on_death(proc)
            respawn = self._proc is None and self._restart_at is not None and time.monotonic() >= self._restart_at
            if respawn:
                self._restarts += 1
                self._restart_at = None
            elif self._proc is not None:
                self._try_ping()
                if self._ready and time.monotonic() - self._started_at >= self.stable_seconds:
                    self._backoff = self.backoff_first
        if respawn:
            self._spawn()

    def _on_death(self, proc: subprocess.Popen) -> None:
        code = proc.returncode
        self._exits.append(code)
        lost = max(0, self._sent_here - self._durable_here)
        self._dropped += lost
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        cause = self._fatal or self._keeper_stats.get("last_error")
        self._last_error = (
            f"heat keeper (pid {proc.pid}) {how}; {lost} routed counts sent since its last write were lost"
            + (f"; its last error: {cause}" if cause else "")
        )
        self._proc = None
        self._ready = False
        self.log.error("%s; restarting in %.1fs", self._last_error, self._backoff)
        self._schedule_restart()

    def _schedule_restart(self) -> None:
        self._restart_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.backoff_max)

    def close(self, timeout: float = 5.0) -> bool:
        """Ask the keeper to write and stop; wait up to `timeout`, then kill it. Closes
        the sockets. Returns whether the final write is confirmed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            proc = self._proc
            asked = False
            if proc is not None and proc.poll() is None and self._data is not None:
                try:
                    self._data.send(pack({"type": "stop"}), zmq.NOBLOCK)
                    asked = True
                except zmq.Again:
                    proc.send_signal(signal.SIGTERM)  # the keeper also writes on SIGTERM
                    asked = True
        ok = False
        if proc is not None:
            deadline = time.monotonic() + timeout
            while asked and proc.poll() is None and time.monotonic() < deadline:
                self._drain_acks(wait=0.02)
            if proc.poll() is None:
                self.log.error("heat keeper (pid %d) did not stop within %.1fs; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()
            if -1 not in self._reports:
                self._drain_acks(wait=0.05)
            final = self._reports.get(-1)
            ok = bool(final and final.get("ok") and final.get("pid") == proc.pid)
            with self._lock:
                lost = max(0, self._sent_here - self._durable_here)
                self._dropped += lost
                self._proc = None
            if not ok:
                self.log.error(
                    "heat keeper's final write is not confirmed (%s); %d routed counts not saved",
                    self._last_error or f"exit status {proc.returncode}",
                    lost,
                )
            elif lost:
                self.log.warning("%d routed counts were lost on the way to the heat keeper", lost)
        bound = self._data is not None
        for sock in (self._data, self._ack):
            if sock is not None:
                sock.close(linger=0)
        self._data = self._ack = None
        if bound:  # libzmq leaves the socket files; the runtime folder is ours alone
            for name in self._socket_names:
                (self.runtime_dir / name).unlink(missing_ok=True)
        if self._own_context and self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        return ok

    # -- counts ---------------------------------------------------------------------

    def push(self, counts: Mapping[int, np.ndarray]) -> bool:
        """Send {MoE layer ordinal: per-expert routed counts}; never blocks.

        Returns False if the counts were dropped (they are added to `dropped_counts`).
        A call costs a few hundred microseconds for ~50 layers, so call it every few
        hundred tokens or once per request (`ExpertPool.take_routed()` accumulates in
        between), not once per token.
        """
        layers, total = encode_counts(counts)
        if not layers:
            return True
        with self._lock:
            if self._data is None or self._proc is None or self._proc.returncode is not None:
                self._dropped += total
                return False
            try:
                self._data.send(pack({"type": "counts", "seq": self._seq + 1, "layers": layers}), zmq.NOBLOCK)
            except zmq.Again:
                self._dropped += total
                return False
            self._seq += 1
            self._sent_here += total
            self._sent_total += total
        return True

    def flush(self, timeout: float) -> bool:
        """Ask the keeper to write now; True once it reports a successful write of
        everything pushed before this call. False on failure, timeout, or no keeper."""
        self._drain_acks()
        with self._lock:
            proc = self._proc
            if self._data is None or proc is None or proc.poll() is not None or not self._ready:
                return False
            self._token += 1
            token = self._token
            try:
                self._data.send(pack({"type": "flush", "token": token}), zmq.NOBLOCK)
            except zmq.Again:
                self._last_error = "flush request refused: the heat keeper's queue is full"
                return False
        deadline = time.monotonic() + timeout
        while True:
            self._drain_acks(wait=min(0.05, max(0.0, deadline - time.monotonic())))
            with self._lock:
                report = self._reports.pop(token, None)
            if report is not None:
                return bool(report["ok"])
            if proc.poll() is not None or time.monotonic() >= deadline:
                return False

    # -- replies --------------------------------------------------------------------

    def _drain_acks(self, wait: float = 0.0) -> None:
        """Take every reply waiting on the ack socket, waiting up to `wait` for the first."""
        with self._ack_lock:
            sock = self._ack
            if sock is None:
                return
            if wait > 0 and not sock.poll(int(wait * 1000), zmq.POLLIN):
                return
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                self._on_reply(frame)

    def _on_reply(self, frame: bytes) -> None:
        try:
            msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            self.log.error("unreadable reply from the heat keeper dropped: %s", e)
            return
        if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
            self.log.error("reply from the heat keeper with an unknown version dropped: %r", str(msg)[:200])
            return
        with self._lock:
            current = self._proc.pid if self._proc is not None else None
            kind, pid = msg.get("type"), msg.get("pid")
            if kind == "report":
                ok, was_ok = bool(msg.get("ok")), self._last_flush_ok
                self._last_flush_ok = ok
                if ok:
                    self._last_flush_wall = (msg.get("stats") or {}).get("last_write_wall")
                    if was_ok is False:
                        self.log.info("heat writes succeed again")
                else:
                    self._last_error = str(msg.get("error"))
                    if was_ok is not False:  # the keeper logs every failure; say it once here
                        self.log.error("heat write failed: %s", self._last_error)
                if pid == current:
                    self._lock_wait, self._pending = msg.get("lock_wait"), msg.get("pending")
                    self._durable_here = int(msg.get("durable_counts") or 0)
                    self._keeper_stats = msg.get("stats") or {}
                    if msg.get("token") is not None and msg["token"] == self._token:
                        self._reports[msg["token"]] = msg
                    if msg.get("reason") in ("stop", "SIGTERM", "parent-exit"):
                        self._reports[-1] = msg
            elif kind == "hello" and pid == current:
                self._hello = True
                self._lock_wait, self._pending = msg.get("lock_wait"), msg.get("pending")
                self._load_problem = msg.get("problem")
                self._set_aside = msg.get("set_aside")
                if self._load_problem:
                    self.log.error("heat file: %s", self._load_problem)
                self._try_ping()
            elif kind == "fatal":
                self._last_error = f"heat keeper (pid {pid}) cannot start: {msg.get('error')}"
                if pid == current:
                    self._fatal = str(msg.get("error"))
                self.log.error("%s", self._last_error)

    def _try_ping(self) -> None:
        """After hello: once a ping goes through, the data pipe exists (lock held)."""
        if self._ready or not self._hello or self._data is None:
            return
        try:
            self._data.send(pack({"type": "ping"}), zmq.NOBLOCK)
        except zmq.Again:
            return
        self._ready = True

    # -- health ---------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """The keeper's state for `moestreamctl stats` and the daemon's log."""
        self._drain_acks()
        with self._lock:
            proc = self._proc
            alive = proc is not None and proc.poll() is None
            return {
                "pid": proc.pid if proc is not None else None,
                "alive": alive,
                "ready": alive and self._ready,
                "restarts": self._restarts,
                "exit_codes": list(self._exits),
                "dropped_counts": self._dropped,
                "sent_counts": self._sent_total,
                "unconfirmed_counts": max(0, self._sent_here - self._durable_here),
                "last_flush_time": self._last_flush_wall,
                "last_flush_ok": self._last_flush_ok,
                "last_error": self._last_error,
                "load_problem": self._load_problem,
                "set_aside": self._set_aside,
                "lock_wait": self._lock_wait if alive else None,
                "pending": self._pending if alive else None,
                "next_restart_in": (
                    max(0.0, self._restart_at - time.monotonic()) if self._restart_at is not None else None
                ),
                "keeper": dict(self._keeper_stats),
            }
