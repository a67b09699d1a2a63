"""The heat keeper: a child process of the daemon that adds up routing counts and keeps
`<store>/pool_usage.json` on disk.

    python -m moestream.daemon.heat_keeper --endpoint ipc://<runtime>/heat.sock \\
        --ack-endpoint ipc://<runtime>/heat-ack.sock --store DIR --flush-seconds S \\
        [--flush-batches N] [--parent-pid PID] [--lock-timeout S] [--name FILE]

`--name` is the heat file's name in DIR: a rank of an expert-parallel group keeps
`pool_usage.rank<r>of<N>.json` (`shared/heat_file.py` `usage_name`), with its own lock
and pending files, so the keepers of two ranks on one machine never share a file.

Sockets. The daemon binds both ends in its private runtime folder and the keeper
connects, so the daemon's sockets outlive any number of keeper restarts and a send while
no keeper is connected fails at once (counted as dropped by the daemon) instead of
queueing for a peer that may never come:

    daemon PUSH (bind --endpoint)      -> keeper PULL      counts, flush, stop, ping
    daemon PULL (bind --ack-endpoint)  <- keeper PUSH      hello, report, fatal

Messages are msgpack maps with `"v": PROTOCOL_VERSION` and a `"type"`; no pickle.
Data channel:
    counts  {"seq": int, "layers": {layer: bytes (little-endian int64, one per expert)
             | [int, ...]}}     counts to add; layers are the manifest's MoE ordinals
    flush   {"token": int}      write now, then answer with a report carrying the token
    stop    {}                  write and exit
    ping    {}                  nothing; lets the daemon see that the pipe is connected
Ack channel (every message carries the keeper's "pid"):
    hello   what was loaded: "loaded_total", "set_aside", "problem", "temps_removed",
            "lock_wait", "pending" (see The lock)
    report  after every write: "reason", "token", "ok", "error", "written_seq",
            "durable_counts" (counts received in this keeper's life that are now on
            disk), "lock_wait", "pending", "stats"
    fatal   {"error"}: the keeper cannot start (a lock file it must not use, an
            unreadable file) and exits 2

Anything else on the data channel is counted as malformed, logged (rate-limited) and
dropped; it never stops the keeper.

Lifetime. The keeper writes every `--flush-seconds` while it has unsaved counts, or after
`--flush-batches` counts messages, and on `flush`. It stops on `stop`, on SIGTERM, or when
its parent (the daemon) dies: it checks `getppid()` against `--parent-pid` twenty times a
second, so a keeper never outlives a SIGKILLed daemon by more than its final write. In
each case it first takes what is already queued, then writes once more. A failed write
(full disk, I/O error) is logged, counted, reported, and the counts stay in memory for
the next attempt; the previous file stays intact. SIGINT is ignored: Ctrl-C reaches the
whole foreground process group, and the daemon decides when its keeper stops.

The lock. Only the keeper holding `pool_usage.json.lock` writes `pool_usage.json`. One
that does not get it within `--lock-timeout` (another daemon's keeper on the same store)
still takes counts, and writes them to a pending file of its own
(`shared/heat_file.py` `pending_path`) instead; its hello and reports carry `lock_wait`
(who holds the lock) and `pending` (that file), which `status` shows. It tries the lock
again every LOCK_RETRY_SECONDS; a keeper that takes it, now or at start, adds the heat
file, its own counts and the pending files of keepers that are gone together (a live
keeper's is its own to add: it holds that file's lock), writes the heat file and removes
the pending files it added. So no daemon's counts are lost to another's lock.

Exit status: 0 after a successful final write, 1 if the final write failed, 2 if it could
not start.
"""

from __future__ import annotations

import argparse
import array
import logging
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ..shared.heat_file import (
    MAX_ID,
    HeatFileError,
    HeatLockTimeout,
    UsageCounts,
    UsageLoad,
    UsageLock,
    add_counts,
    orphaned_pending_files,
    pending_path,
    read_usage,
    remove_pending,
    remove_temp_files,
    usage_path,
    write_usage,
)
from ..shared.store_format import POOL_USAGE_NAME

PROTOCOL_VERSION = 1
# One message may add at most this much to one expert: far above any real batch, low
# enough that a bogus message cannot push a total past int64.
MAX_MESSAGE_COUNT = 1 << 40
# How often the keeper looks at its parent and its stop flag while idle.
IDLE_TICK = 0.05
# Messages taken per wake-up before the timers are looked at again.
DRAIN_BATCH = 512
# Before the final write after SIGTERM or the parent's death, take what is queued, but no
# longer than this.
FINAL_DRAIN_SECONDS = 0.5
# How often a keeper without the lock tries it again.
LOCK_RETRY_SECONDS = 0.5
EXIT_OK, EXIT_WRITE_FAILED, EXIT_CANNOT_START = 0, 1, 2

log = logging.getLogger("moestream.heat_keeper")


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **message}, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    """Decode one frame into a message map; `MalformedMessage` if it is not one."""
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # ExtraData, bad UTF-8, unhashable key
        raise MalformedMessage(f"not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(message, dict):
        raise MalformedMessage(f"a msgpack {type(message).__name__}, not a map")
    if message.get("v") != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version {message.get('v')!r}, this keeper speaks {PROTOCOL_VERSION}")
    if not isinstance(message.get("type"), str):
        raise MalformedMessage("no message type")
    return message


class MalformedMessage(ValueError):
    """A data-channel message this keeper cannot use; the text says why."""


def parse_counts(layers: Any) -> dict[int, list[int]]:
    """Validate a counts message's `layers` map into {layer: dense counts}."""
    if not isinstance(layers, dict):
        raise MalformedMessage(f"counts: 'layers' is a {type(layers).__name__}, not a map")
    out: dict[int, list[int]] = {}
    for layer, value in layers.items():
        if type(layer) is not int or not 0 <= layer < MAX_ID:
            raise MalformedMessage(f"counts: layer {layer!r} is not an integer in [0, {MAX_ID})")
        if isinstance(value, bytes):
            if len(value) % 8 or len(value) // 8 > MAX_ID:
                raise MalformedMessage(f"counts: layer {layer}: {len(value)} bytes is not a whole int64 array")
            dense = array.array("q")
            dense.frombytes(value)
            if sys.byteorder == "big":
                dense.byteswap()
            values: list[int] = dense.tolist()
        elif isinstance(value, list):
            if len(value) > MAX_ID or any(type(c) is not int for c in value):
                raise MalformedMessage(f"counts: layer {layer}: a list must hold at most {MAX_ID} integers")
            values = value
        else:
            raise MalformedMessage(f"counts: layer {layer}: a {type(value).__name__}, expected bytes or a list")
        if values and (min(values) < 0 or max(values) > MAX_MESSAGE_COUNT):
            raise MalformedMessage(f"counts: layer {layer}: counts must lie in [0, {MAX_MESSAGE_COUNT}]")
        out[layer] = values
    return out


@dataclass
class KeeperStats:
    """What the keeper reports to the daemon with every write."""

    pid: int
    loaded_total: int = 0
    messages: int = 0
    counts_received: int = 0
    malformed: int = 0
    last_malformed: str | None = None
    writes_ok: int = 0
    writes_failed: int = 0
    last_write_wall: float | None = None
    last_write_seconds: float | None = None
    last_write_bytes: int | None = None
    last_error: str | None = None
    last_seq: int | None = None
    seq_gaps: int = 0
    acks_dropped: int = 0


class HeatKeeper:
    """The keeper's state and message handling, apart from process setup."""

    def __init__(
        self,
        store_dir: Path,
        *,
        lock: UsageLock,
        name: str = POOL_USAGE_NAME,
        pull: zmq.Socket,
        ack: zmq.Socket,
        flush_seconds: float,
        flush_batches: int = 0,
        parent_pid: int = 0,
    ) -> None:
        self.path = usage_path(store_dir, name)
        self.lock = lock
        self.counts: UsageCounts = {}
        # Where writes go: the heat file while the lock is held, else this keeper's
        # pending file (see the module docstring).
        self.target = pending_path(self.path)
        self._pending_lock = UsageLock(self.target)
        self.lock_wait: str | None = None  # who holds the lock, while this keeper waits
        self._merged: list[Path] = []  # pending files in `counts`, removed after the next heat-file write
        self._next_lock_try = 0.0
        self._lock_problem: str | None = None
        self.pull = pull
        self.ack = ack
        self.flush_seconds = flush_seconds
        self.flush_batches = flush_batches
        self.parent_pid = parent_pid
        self.stats = KeeperStats(pid=os.getpid())
        self.stop_reason: str | None = None
        # Counts received in this life, and how many of them the file holds.
        self.durable_counts = 0
        self.written_seq: int | None = None
        self.batches_since_write = 0

    # -- the lock -------------------------------------------------------------------

    def take_file(self) -> tuple[UsageLoad, list[Path]]:
        """With the lock held: add the heat file and every pending file into the counts
        (the pending files are removed after the next write). Returns what was loaded and
        the temporary files removed; `HeatFileError` leaves the counts as they were."""
        removed = remove_temp_files(self.path)
        loaded = read_usage(self.path)
        extra = [(p, read_usage(p)) for p in orphaned_pending_files(self.path)]
        for load in [loaded, *(load for _, load in extra)]:
            if load.problem:
                log.error("%s", load.problem)
            add_counts(self.counts, load.counts)
        self.stats.loaded_total += loaded.total + sum(load.total for _, load in extra)
        own = [self.target] if self._pending_lock.held else []  # where this keeper waited
        self._merged = [p for p, _ in extra] + own
        self.target = self.path
        self.lock_wait = None
        if extra:
            log.info("added %d pending file(s) of keepers that waited for the lock", len(extra))
        return loaded, removed

    def wait_for_lock(self, held: HeatLockTimeout) -> None:
        """Keep counts in the pending file until the lock frees (`try_lock`)."""
        holder = f" (pid {held.holder})" if held.holder else ""
        if not self._pending_lock.held:
            # Held for this keeper's life: while it is, no other keeper adds the file.
            self._pending_lock.acquire(0.0)
        if self.lock_wait is None:
            log.warning(
                "%s is held by another heat keeper%s (a second daemon on this store?): counts are kept in %s "
                "and added to the heat file once it is free",
                self.lock.path,
                holder,
                self.target,
            )
        self.lock_wait = f"another heat keeper{holder} holds {self.lock.path}"
        self._next_lock_try = time.monotonic() + LOCK_RETRY_SECONDS

    def try_lock(self) -> bool:
        """Try the lock once, without waiting; on success the files are added and written."""
        self._next_lock_try = time.monotonic() + LOCK_RETRY_SECONDS
        try:
            self.lock.acquire(0.0)
        except HeatLockTimeout as e:
            self.wait_for_lock(e)
            return False
        except HeatFileError as e:
            self._lock_failed(str(e))
            return False
        try:
            self.take_file()
        except HeatFileError as e:
            self.lock.release()
            self._lock_failed(str(e))
            return False
        log.info("took the lock of %s", self.path)
        self.write("lock")
        return True

    def _lock_failed(self, why: str) -> None:
        if why != self._lock_problem:  # once per distinct cause: this is retried twice a second
            log.error("cannot take the heat file yet: %s; counts stay in %s", why, self.target)
        self._lock_problem = why

    # -- the loop -------------------------------------------------------------------

    def run(self) -> str:
        """Serve until stopped; returns why. The caller makes the final write."""
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        next_due = time.monotonic() + self.flush_seconds
        while self.stop_reason is None:
            if self.parent_pid and os.getppid() != self.parent_pid:
                self.stop_reason = "parent-exit"
                break
            if not self.lock.held and time.monotonic() >= self._next_lock_try and self.try_lock():
                next_due = time.monotonic() + self.flush_seconds
                continue
            now = time.monotonic()
            if self.dirty and (
                now >= next_due or (self.flush_batches and self.batches_since_write >= self.flush_batches)
            ):
                self.write("timer")
                next_due = time.monotonic() + self.flush_seconds
                continue
            wait = IDLE_TICK if not self.dirty else min(IDLE_TICK, max(0.0, next_due - now))
            if poller.poll(int(wait * 1000) if wait > 0 else 0):
                self.drain(DRAIN_BATCH)
        return self.stop_reason

    def drain(self, limit: int, seconds: float | None = None) -> int:
        """Handle queued messages without waiting: up to `limit` of them, for at most
        `seconds`; stops after a `stop` message."""
        deadline = None if seconds is None else time.monotonic() + seconds
        handled = 0
        while handled < limit and (deadline is None or time.monotonic() < deadline):
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            handled += 1
            if self.handle(frames) == "stop":
                break
        return handled

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    @property
    def dirty(self) -> bool:
        return self.stats.counts_received != self.durable_counts or bool(self._merged)

    # -- messages -------------------------------------------------------------------

    def handle(self, frames: list[bytes]) -> str | None:
        """Apply one message; returns its type, or None if it was malformed."""
        try:
            if len(frames) != 1:
                raise MalformedMessage(f"{len(frames)} frames, expected 1")
            message = unpack(frames[0])
            kind = message["type"]
            if kind == "counts":
                self._add(message)
            elif kind == "flush":
                token = message.get("token")
                if type(token) is not int:
                    raise MalformedMessage("flush: 'token' must be an integer")
                self.write("flush", token)
            elif kind == "stop":
                self.request_stop("stop")
            elif kind == "ping":
                pass
            else:
                raise MalformedMessage(f"unknown message type {kind!r}")
        except MalformedMessage as e:
            self._malformed(str(e))
            return None
        return kind

    def _add(self, message: dict[str, Any]) -> None:
        seq = message.get("seq")
        if type(seq) is not int or seq < 0:
            raise MalformedMessage("counts: 'seq' must be a non-negative integer")
        layers = parse_counts(message.get("layers"))  # all checks before any count is added
        add_counts(self.counts, {layer: {e: c for e, c in enumerate(values) if c} for layer, values in layers.items()})
        total = sum(sum(values) for values in layers.values())
        st = self.stats
        if st.last_seq is not None and seq != st.last_seq + 1:
            st.seq_gaps += 1
        st.last_seq = seq
        st.messages += 1
        st.counts_received += total
        self.batches_since_write += 1

    def _malformed(self, why: str) -> None:
        st = self.stats
        st.malformed += 1
        st.last_malformed = why
        if st.malformed <= 10 or st.malformed % 1000 == 0:
            log.warning("malformed message #%d dropped: %s", st.malformed, why)

    # -- writing --------------------------------------------------------------------

    def write(self, reason: str, token: int | None = None) -> bool:
        """Write the heat file (or, without the lock, the pending file) now and report the
        outcome to the daemon."""
        st = self.stats
        received, seq = st.counts_received, st.last_seq
        started = time.monotonic()
        try:
            # A keeper that waited and got nothing leaves no pending file behind.
            nbytes = write_usage(self.target, self.counts) if self.counts or self.target == self.path else 0
        except HeatFileError as e:
            st.writes_failed += 1
            st.last_error = str(e)
            log.error(
                "heat write #%d failed (%s): %s; %d counts kept in memory for the next attempt",
                st.writes_failed,
                reason,
                e,
                received - self.durable_counts,
            )
            ok = False
        else:
            st.writes_ok += 1
            st.last_write_wall = time.time()
            st.last_write_seconds = time.monotonic() - started
            st.last_write_bytes = nbytes
            self.durable_counts = received
            self.written_seq = seq
            self.batches_since_write = 0
            ok = True
            if self.target == self.path:
                self._remove_merged()
        self.send(
            "report",
            reason=reason,
            token=token,
            ok=ok,
            error=None if ok else st.last_error,
            written_seq=self.written_seq,
            durable_counts=self.durable_counts,
            lock_wait=self.lock_wait,
            pending=None if self.target == self.path else str(self.target),
            stats=asdict(st),
        )
        return ok

    def _remove_merged(self) -> None:
        """The heat file now holds the pending files' counts: remove them."""
        for path in self._merged:
            try:
                remove_pending(path)
            except OSError as e:
                # Left in place it would be added again by the next keeper: say so.
                log.error("cannot remove %s, whose counts are now in %s: %s", path, self.path, e)
        self._merged = []
        self._pending_lock.release()

    def close(self) -> None:
        """Let go of the pending file's lock; a keeper that never wrote one leaves no lock behind."""
        if self._pending_lock.held and not self.target.exists():
            Path(str(self.target) + ".lock").unlink(missing_ok=True)
        self._pending_lock.release()

    def send(self, kind: str, **fields: Any) -> None:
        """Tell the daemon something; never waits (a full queue drops the message)."""
        try:
            self.ack.send(pack({"type": kind, "pid": os.getpid(), **fields}), zmq.NOBLOCK)
        except zmq.Again:
            self.stats.acks_dropped += 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moestream.daemon.heat_keeper", description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="the daemon's PUSH endpoint (connected, not bound)")
    p.add_argument("--ack-endpoint", required=True, help="the daemon's PULL endpoint for replies")
    p.add_argument(
        "--store",
        required=True,
        type=Path,
        help="the folder holding pool_usage.json (the store's, or the user's heat folder)",
    )
    p.add_argument("--name", default=POOL_USAGE_NAME, help="the heat file's name in that folder")
    p.add_argument("--flush-seconds", type=float, default=5.0)
    p.add_argument("--flush-batches", type=int, default=0, help="also write after this many counts messages (0: off)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit (after a final write) when this process is gone")
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=1.0,
        help="wait this long for a previous keeper to finish before keeping counts in a pending file",
    )
    args = p.parse_args(argv)
    if not args.flush_seconds > 0:
        p.error("--flush-seconds must be positive")
    if Path(args.name).name != args.name or not args.name.endswith(".json"):
        p.error("--name must be a file name ending in .json, without a folder")
    if args.flush_batches < 0:
        p.error("--flush-batches must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"heat_keeper[{os.getpid()}] %(levelname)s %(message)s"
    )
    ctx = zmq.Context(1)
    pull = ctx.socket(zmq.PULL)
    ack = ctx.socket(zmq.PUSH)
    ack.setsockopt(zmq.SNDHWM, 10_000)
    pull.connect(args.endpoint)
    ack.connect(args.ack_endpoint)
    lock = UsageLock(usage_path(args.store, args.name))
    keeper = HeatKeeper(
        args.store,
        lock=lock,
        name=args.name,
        pull=pull,
        ack=ack,
        flush_seconds=args.flush_seconds,
        flush_batches=args.flush_batches,
        parent_pid=args.parent_pid,
    )
    stop: dict[str, str] = {}  # set by the signal handler, read while waiting for the lock

    def on_sigterm(signum: int, frame: Any) -> None:
        stop["reason"] = "SIGTERM"
        keeper.request_stop("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_linger_ms = 1000  # let the last report reach a daemon that waits for it
    try:
        loaded, removed = UsageLoad(keeper.path), []
        try:
            try:
                lock.acquire(args.lock_timeout, should_stop=lambda: "reason" in stop)
            except HeatLockTimeout as e:
                keeper.wait_for_lock(e)
            else:
                loaded, removed = keeper.take_file()
        except HeatFileError as e:
            log.error("cannot start: %s", e)
            ack.send(pack({"type": "fatal", "pid": os.getpid(), "error": str(e)}), zmq.NOBLOCK)
            return EXIT_CANNOT_START
        if removed:
            log.info("removed %d temporary file(s) left by interrupted writes", len(removed))
        keeper.send(
            "hello",
            loaded_total=keeper.stats.loaded_total,
            loaded_layers=len(loaded.counts),
            set_aside=str(loaded.set_aside) if loaded.set_aside else None,
            problem=loaded.problem,
            temps_removed=len(removed),
            lock_wait=keeper.lock_wait,
            pending=None if lock.held else str(keeper.target),
        )
        reason = keeper.run()
        if reason != "stop":
            keeper.drain(1 << 30, seconds=FINAL_DRAIN_SECONDS)  # what the daemon already sent counts too
        if reason == "parent-exit":
            # Nobody will read the report, and a daemon that starts next must not feed
            # counts to a keeper that is about to exit.
            pull.close(linger=0)
            exit_linger_ms = 0
            log.info("parent %d exited; final write", args.parent_pid)
        ok = keeper.write(reason)
        return EXIT_OK if ok else EXIT_WRITE_FAILED
    finally:
        keeper.close()
        lock.release()
        pull.close(linger=0)
        ack.close(linger=exit_linger_ms)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
