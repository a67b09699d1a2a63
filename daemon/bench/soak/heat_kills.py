"""Heat crash driver: kill -9 the heat keeper and the daemon while pool_usage.json is
being rewritten, many times, and check the file after every kill.

Three kinds of kill, each checked against bounds the publisher's own accounting gives:

  keeper      the keeper of a `HeatPublisher` in this process, rewriting a large file
              every 2 ms while counts arrive (most kills land mid-write); the publisher
              restarts it. After each kill the file must parse, never go backwards, hold
              at least what the keepers reported written, and at most what was sent.
  stand-in    a child process that owns a `HeatPublisher` exactly as the daemon does
              (`python -m moestream.daemon.bench.soak.heat_kills SRC RUNTIME LIMIT`); killing it
              orphans its keeper, which must notice, write once more and exit.
  daemon      the real daemon, serving requests with a 20 ms heat flush, killed at a
              random moment and restarted on the same runtime folder (which also checks
              that a crashed daemon's leftovers are cleared every time).

"Invalid" means the file does not parse as a heat file; "violations" are kills after
which the total broke a bound. Both must be 0.
"""

from __future__ import annotations

import logging
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

from ....shared.heat_file import UsageCounts, parse_usage, temp_files, usage_path, write_usage

LOG = logging.getLogger("moestream.soak.heat_kills")
# How long a daemon kill waits for its round's first counts on disk (`daemon_kills`).
FIRST_WRITE_TIMEOUT_S = 60.0


def _total(counts: UsageCounts) -> int:
    return sum(sum(d.values()) for d in counts.values())


def _file_total(store: Path) -> int | None:
    """The heat file's total, or None when it does not parse (an invalid file)."""
    try:
        return _total(parse_usage(usage_path(store).read_bytes()))
    except (ValueError, FileNotFoundError):
        return None


def _wait(cond: Callable[[], bool], timeout: float, what: str, every: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        if every is not None:
            every()
        time.sleep(0.005)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def keeper_kills(store: Path, runtime: Path, n: int, rng: random.Random) -> dict[str, Any]:
    """SIGKILL the heat keeper `n` times while it rewrites the file every 2 ms."""
    from ...heat_publisher import HeatPublisher

    path = usage_path(store)
    nprng = np.random.default_rng(rng.randrange(2**32))
    seed = {l: {e: int(c) for e, c in enumerate(nprng.integers(1, 10**6, 384))} for l in range(32)}
    write_usage(path, seed)
    seed_total = _total(seed)
    pub = HeatPublisher(store, runtime, flush_seconds=0.002, backoff=(0.01, 0.01), log=LOG)
    accepted = refused = invalid = violations = mid_write = 0
    previous = seed_total
    examples: list[str] = []
    try:
        if not pub.start():
            raise RuntimeError(f"the heat keeper did not start: {pub.health()['last_error']}")
        for i in range(n):
            _wait(lambda: pub.health()["ready"], 20.0, "the heat keeper to be ready", every=pub.check)
            pid = pub.health()["pid"]
            until = time.monotonic() + rng.uniform(0.003, 0.02)
            while time.monotonic() < until:
                c = {int(nprng.integers(32)): nprng.integers(0, 3, 384)}
                k = int(sum(v.sum() for v in c.values()))
                if pub.push(c):
                    accepted += k
                else:
                    refused += k
                time.sleep(0.0005)
            h = pub.health()
            # Everything the keepers reported on disk; a kill may lose only the rest.
            lower = seed_total + h["sent_counts"] - (h["dropped_counts"] - refused) - h["unconfirmed_counts"]
            os.kill(pid, signal.SIGKILL)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead; the publisher reaps it
            mid_write += bool(temp_files(path))
            now = _file_total(store)
            if now is None:
                invalid += 1
                examples.append(f"keeper kill {i}: the file does not parse")
                continue
            if not (max(previous, lower) <= now <= seed_total + accepted):
                violations += 1
                examples.append(
                    f"keeper kill {i}: total {now}, previous {previous}, reported durable {lower}, sent "
                    f"{seed_total + accepted}"
                )
            previous = now
        _wait(lambda: pub.health()["ready"], 20.0, "the last heat keeper", every=pub.check)
    finally:
        closed = pub.close(10.0)
    final = _file_total(store)
    lost = seed_total + accepted - (final or 0)
    return {
        "kills": n,
        "invalid_files": invalid + (final is None),
        "violations": violations,
        "kills_mid_write": mid_write,
        "counts_sent": accepted,
        "counts_lost": lost,
        "counts_lost_reported": pub.health()["dropped_counts"] - refused,
        "final_write_ok": closed,
        "temp_files_left": len(temp_files(path)),
        "examples": examples[:10],
    }


def _say(line: str) -> None:
    """One line to the parent in one write: print() writes its pieces separately, and
    with PYTHONUNBUFFERED set each piece is its own syscall, so a SIGKILL between them
    would leave the parent half a line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def durable_marks(output: str) -> list[int]:
    """The counts the stand-in reported durable, from what it printed. Only complete lines
    count: the process is killed at a random moment."""
    return [int(m.group(1)) for m in re.finditer(r"^durable (\d+)\n", output, re.MULTILINE)]


def _stand_in(store: Path, runtime: Path, limit: int) -> None:
    """The daemon's heat path, alone: push, flush every 4 messages, print what is durable."""
    from ...heat_publisher import HeatPublisher

    sys.stdin.readline()  # imports done ahead of time; start when told
    pub = HeatPublisher(store, runtime, flush_seconds=0.002, log=LOG)
    ready = pub.start(10.0)
    _say(f"ready {pub.health()['pid']} {int(ready)}")
    message = {l: np.ones(256, np.int64) for l in range(4)}
    sent = 0
    while True:
        if sent < limit and pub.push(message):
            sent += 1
            if sent % 4 == 0 and pub.flush(1.0):
                _say(f"durable {sent}")
        pub.check()
        time.sleep(0.001)


def stand_in_kills(store: Path, runtime: Path, n: int, rng: random.Random) -> dict[str, Any]:
    """SIGKILL a process that owns a HeatPublisher, `n` times; its orphaned keeper must
    write once more and exit, leaving a valid file that lost nothing reported durable."""
    per_message, limit = 4 * 256, 200
    write_usage(usage_path(store), {l: {e: rng.randrange(1, 1000) for e in range(256)} for l in range(16)})
    previous = _file_total(store)
    invalid = violations = 0
    examples: list[str] = []
    keeper_exit_s: list[float] = []

    def spawn() -> subprocess.Popen:
        cmd = [sys.executable, "-m", "moestream.daemon.bench.soak.heat_kills", str(store), str(runtime), str(limit)]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    following = spawn()
    try:
        for i in range(n):
            proc, following = following, None
            try:
                proc.stdin.write("go\n")
                proc.stdin.flush()
                if not select.select([proc.stdout], [], [], 30.0)[0]:
                    raise RuntimeError(f"stand-in daemon {i} did not start")
                word, keeper_pid, ready = proc.stdout.readline().split()
                if word != "ready" or ready != "1":
                    raise RuntimeError(f"stand-in daemon {i}: its heat keeper was not ready")
                if i < n - 1:
                    following = spawn()  # its imports overlap this round
                time.sleep(rng.uniform(0.005, 0.05))
            finally:
                proc.kill()
                proc.wait()
            killed = time.monotonic()
            try:
                _wait(lambda: _gone(int(keeper_pid)), 30.0, f"orphaned keeper {keeper_pid} to exit")
            except TimeoutError:
                os.kill(int(keeper_pid), signal.SIGKILL)
                raise
            keeper_exit_s.append(time.monotonic() - killed)
            durable = durable_marks(proc.stdout.read())
            proc.stdout.close()
            proc.stdin.close()
            now = _file_total(store)
            if now is None:
                invalid += 1
                examples.append(f"stand-in kill {i}: the file does not parse")
                continue
            low, high = previous + per_message * max(durable, default=0), previous + per_message * limit
            if not low <= now <= high or temp_files(usage_path(store)):
                violations += 1
                examples.append(f"stand-in kill {i}: total {now} outside [{low}, {high}] or temp files left")
            previous = now
    finally:
        if following is not None:
            following.kill()
            following.wait()
    return {
        "kills": n,
        "invalid_files": invalid,
        "violations": violations,
        "orphan_keeper_exit_max_s": max(keeper_exit_s, default=0.0),
        "examples": examples[:10],
    }


def daemon_kills(store: Path, runtime: Path, n: int, rng: random.Random, *, capacity: str = "0.25") -> dict[str, Any]:
    """SIGKILL the real daemon `n` times while it serves requests with a 20 ms heat flush.

    Each round starts a daemon on the same runtime folder (clearing the crashed one's
    leftovers), streams requests from a client thread, reads the daemon's heat accounting
    from `status` once some of the round's counts are on disk, kills it at a random moment
    after that and checks the file."""
    from ....client.client import Client, ClientError
    from .driver import DaemonProcess

    previous = _file_total(store) or 0
    invalid = violations = 0
    examples: list[str] = []
    for i in range(n):
        # The heat beside the store, where it is read: a copy of the demo keeps it under the
        # state folder otherwise (shared/settings.py `heat_folder`).
        daemon = DaemonProcess.start(
            store,
            runtime,
            capacity=capacity,
            flags={"heat_dir": str(store)},
            env={"MOESTREAM_HEAT_FLUSH_SECONDS": "0.02"},
        )
        stop = threading.Event()

        def load() -> None:
            try:
                with Client(daemon.paths, timeout=5.0) as c:
                    while not stop.is_set():
                        c.complete(prompt_ids=[rng.randrange(3, 300) for _ in range(8)], max_tokens=16)
            except ClientError:
                return  # the daemon was killed under it, as intended

        worker = threading.Thread(target=load, name="heat-load")
        worker.start()
        try:
            time.sleep(rng.uniform(0.2, 0.8))
            # The kill waits for the round's first counts on disk: on a loaded machine the
            # first request can take longer than the random wait, and a round killed before
            # any write checks nothing (a loaded test run once ended with no count at all).
            deadline = time.monotonic() + FIRST_WRITE_TIMEOUT_S
            with Client(daemon.paths, timeout=5.0) as c:
                while True:
                    heat = c.status().heat
                    loaded = (heat.get("keeper") or {}).get("loaded_total", previous)
                    lower = loaded + heat["sent_counts"] - heat["dropped_counts"] - heat["unconfirmed_counts"]
                    if lower > previous or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            keeper_pid = heat.get("pid")
            time.sleep(rng.uniform(0.0, 0.05))
            daemon.kill()
        finally:
            stop.set()
            daemon.kill()
            worker.join(30)
        if keeper_pid:
            _wait(lambda: _gone(keeper_pid), 30.0, f"orphaned keeper {keeper_pid} to exit")
        now = _file_total(store)
        if now is None:
            invalid += 1
            examples.append(f"daemon kill {i}: the file does not parse")
            continue
        if not max(previous, lower) <= now:
            violations += 1
            examples.append(f"daemon kill {i}: total {now}, previous {previous}, reported durable {lower}")
        previous = now
    return {
        "kills": n,
        "invalid_files": invalid,
        "violations": violations,
        "final_total": previous,
        "examples": examples[:10],
    }


def main(argv: list[str] | None = None) -> None:
    """`python -m moestream.daemon.bench.soak.heat_kills STORE RUNTIME LIMIT`: the stand-in daemon."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        sys.exit("usage: python -m moestream.daemon.bench.soak.heat_kills STORE RUNTIME LIMIT")
    _stand_in(Path(args[0]), Path(args[1]), int(args[2]))


if __name__ == "__main__":
    main()
