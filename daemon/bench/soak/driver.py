"""Soak driver: a real daemon under many clients that cancel and disconnect mid-stream.

Shared by `tests/reliability` (small counts) and `moestreamctl bench soak` (full counts).
`DaemonProcess` runs `python -m moestream.daemon.main` as a child in a private runtime
folder; `run_soak` drives it from client threads and checks three things:

  exact     every completed response equals what the same greedy request gives alone
            in-process (`reference_outputs`, i.e. `generate --local`); a cancelled one
            is a prefix of it; the streamed text adds up to the final text;
  nothing lost or crossed
            every request that was not disconnected ends with exactly one `done`, no
            client ever holds a message for a request id it is not waiting on, and the
            daemon's own counters add up to what the clients did;
  flat memory
            the daemon's RSS after warm-up (the first `warmup_frac` of requests) and at
            the end differ by less than the caller's threshold.

Only `reference_outputs` imports MLX (inside the function); the rest drives processes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import psutil

from ....client.client import Client, ClientError, RequestRejected, Token
from ....shared.runtime_dir import RuntimePaths, lock_is_held
from ....shared.status import RequestTotals

SOAK_PROMPTS = (
    "The farmer counted his hens",
    "def route(hidden, gate, k=2):",
    "Numbers and dates: 1, 2, 3",
    "In the morning",
    "There was news of rain",
    "import os\nimport sys\n",
    "Once upon a time",
    "SELECT name FROM users WHERE",
)
SOAK_MAX_TOKENS = (8, 16, 24, 32)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a daemon under test: none of the developer's moestream
    settings or config file, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOESTREAM_")}
    env["XDG_CONFIG_HOME"] = "/nonexistent-moestream-soak"
    env.update(extra or {})
    return env


# The daemon's main with bench knobs, which have no flags: the first argument is their JSON.
_MAIN_WITH_KNOBS = (
    "import json, sys; from moestream.daemon.main import main; "
    "knobs = json.loads(sys.argv.pop(1)); sys.exit(main(sys.argv[1:], knobs))"
)


class DaemonProcess:
    """A daemon started as a child process in its own runtime folder (for tests and
    benchmarks: its pid, RSS, kill -9 and clean stop are at hand)."""

    def __init__(self, proc: subprocess.Popen, paths: RuntimePaths, log_path: Path) -> None:
        self.proc = proc
        self.paths = paths
        self.output = log_path

    @classmethod
    def start(
        cls,
        store: Path | str,
        runtime: Path | str,
        *,
        capacity: str = "0.25",
        flags: Mapping[str, str] | None = None,
        knobs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> "DaemonProcess":
        """Start a daemon on `store` and wait until it answers `ready`.

        `flags` are extra `--name value` daemon flags; `env` extra environment variables
        (e.g. MOESTREAM_HEAT_FLUSH_SECONDS, LD_PRELOAD); `knobs` bench knobs such as
        verify_checksums, which no flag sets (`moestream.daemon.main.main`). Raises `RuntimeError` with the
        daemon's output when it exits or is not ready in time."""
        runtime = Path(runtime)
        paths = RuntimePaths(dir=runtime, log=runtime / "daemon.log")
        run_main = ["-m", "moestream.daemon.main"]
        if knobs:
            run_main = ["-c", _MAIN_WITH_KNOBS, json.dumps(dict(knobs))]
        argv = [
            sys.executable,
            *run_main,
            "--model",
            str(store),
            "--capacity",
            capacity,
            "--runtime-dir",
            str(runtime),
        ]
        for name, value in (flags or {}).items():
            argv += ["--" + name.replace("_", "-"), str(value)]
        out_path = runtime.parent / f"{runtime.name}.out"
        with open(out_path, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=child_env(env))
        daemon = cls(proc, paths, out_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with status {proc.returncode}: {daemon.tail()}")
            if daemon.ready():
                return daemon
            time.sleep(0.02)
        daemon.kill()
        raise RuntimeError(f"the daemon was not ready within {timeout:g} s: {daemon.tail()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self) -> bool:
        """Whether the daemon holds its lock and answers a ping as `ready`."""
        if not lock_is_held(self.paths) or not self.paths.socket.exists():
            return False
        try:
            with Client(self.paths, timeout=0.5) as c:
                return c.ping().state == "ready"
        except ClientError:
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        """The daemon's resident set size in bytes (its own process, not the keeper)."""
        return psutil.Process(self.pid).memory_info().rss

    def tail(self, chars: int = 3000) -> str:
        text = ""
        for path in (self.output, self.paths.log):
            if path.exists():
                text += f"\n--- {path} ---\n" + path.read_text(errors="replace")[-chars:]
        return text

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit status (kills it after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"the daemon did not stop within {timeout:g} s of SIGTERM: {self.tail()}") from None
        return self.proc.returncode

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.alive():
            try:
                self.stop()
            except RuntimeError:
                return


@dataclass(frozen=True)
class Reference:
    text: str
    tokens: tuple[int, ...]
    finish_reason: str


def reference_outputs(
    store: Path | str, capacity: str, cases: Iterable[tuple[str, int]]
) -> dict[tuple[str, int], Reference]:
    """What `generate --local` gives for each (prompt, max_tokens), greedy, in-process."""
    from ....shared.settings import Settings
    from ...model.generation import SamplingParams, encode_prompt, generate
    from ...model.streaming_model import load_streaming_model

    sm = load_streaming_model(store, Settings().replace(capacity=capacity))
    try:
        out = {}
        for prompt, max_tokens in sorted(set(cases)):
            r = generate(sm, encode_prompt(sm, prompt, None), SamplingParams(max_tokens=max_tokens))
            out[(prompt, max_tokens)] = Reference(r.text, tuple(r.tokens), r.finish_reason)
    finally:
        sm.close()
    return out


def soak_cases(
    prompts: Sequence[str] = SOAK_PROMPTS, max_tokens: Sequence[int] = SOAK_MAX_TOKENS
) -> list[tuple[str, int]]:
    return [(p, m) for p in prompts for m in max_tokens]


@dataclass
class SoakTally:
    """What the clients saw; summed over client threads."""

    requests: int = 0
    completed: int = 0  # ran to their end (asked to or not)
    cancelled: int = 0  # ended with finish reason "cancelled"
    cancel_asked: int = 0
    disconnect_asked: int = 0
    exact: int = 0
    mismatched: int = 0
    lost: int = 0  # no `done` (or an error) for a request that was not disconnected
    rejected: int = 0
    stray_messages: int = 0  # messages for request ids the client was not waiting on
    tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, other: "SoakTally") -> None:
        for name, value in asdict(other).items():
            if name == "failures":
                self.failures.extend(value)
            else:
                setattr(self, name, getattr(self, name) + value)

    def fail(self, why: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(why)


class _Progress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done = 0

    def tick(self) -> None:
        with self._lock:
            self.done += 1


def _one_client(
    paths: RuntimePaths,
    index: int,
    requests: int,
    cancel_frac: float,
    seed: int,
    reference: Mapping[tuple[str, int], Reference],
    progress: _Progress,
    timeout: float,
) -> SoakTally:
    rng = random.Random(seed * 7919 + index)
    cases = sorted(reference)
    tally = SoakTally()
    client = Client(paths, timeout=timeout)
    try:
        for r in range(requests):
            case = rng.choice(cases)
            ref = reference[case]
            action = "complete"
            if rng.random() < cancel_frac:
                action = "cancel" if rng.random() < 0.5 else "disconnect"
            stop_after = rng.randint(1, max(1, case[1] - 1))
            tally.requests += 1
            where = f"client {index} request {r} ({action}, {case[0]!r}, max_tokens {case[1]})"
            try:
                client, outcome = _run_request(client, paths, case, ref, action, stop_after, tally, where, timeout)
            except RequestRejected as e:
                tally.rejected += 1
                tally.lost += 1
                tally.fail(f"{where}: rejected: {e}")
            except ClientError as e:
                tally.lost += 1
                tally.fail(f"{where}: {type(e).__name__}: {e}")
                client.close()
                client = Client(paths, timeout=timeout)
            stray = sum(client.buffered().values())
            if stray:
                tally.stray_messages += stray
                tally.fail(
                    f"{where}: {stray} message(s) for request ids this client is not waiting on: {client.buffered()}"
                )
            progress.tick()
    finally:
        client.close()
    return tally


def _run_request(
    client: Client,
    paths: RuntimePaths,
    case: tuple[str, int],
    ref: Reference,
    action: str,
    stop_after: int,
    tally: SoakTally,
    where: str,
    timeout: float,
) -> tuple[Client, str]:
    prompt, max_tokens = case
    stream = client.generate(prompt, max_tokens=max_tokens)
    streamed, seen = "", 0
    for event in stream:
        if not isinstance(event, Token):
            continue
        streamed += event.text
        seen += 1
        if seen == stop_after and action == "cancel":
            tally.cancel_asked += 1
            stream.cancel()  # the stream goes on to its `done`
        elif seen == stop_after and action == "disconnect":
            tally.disconnect_asked += 1
            client.close()
            return Client(paths, timeout=timeout), "disconnected"
    done = stream.done
    tally.tokens += len(done.tokens)
    ok = streamed == done.text
    if done.finish_reason == "cancelled":
        tally.cancelled += 1
        ok = ok and tuple(done.tokens) == ref.tokens[: len(done.tokens)] and ref.text.startswith(done.text)
    else:
        tally.completed += 1
        ok = (
            ok
            and tuple(done.tokens) == ref.tokens
            and done.text == ref.text
            and done.finish_reason == ref.finish_reason
        )
    if ok:
        tally.exact += 1
    else:
        tally.mismatched += 1
        tally.fail(
            f"{where}: got {done.finish_reason} {list(done.tokens)[:12]}..., expected {list(ref.tokens)[:12]}..."
        )
    return client, done.finish_reason


def _wait_idle(paths: RuntimePaths, timeout: float) -> RequestTotals:
    """The daemon's request counters once nothing is active or queued."""
    deadline = time.monotonic() + timeout
    with Client(paths, timeout=10.0) as c:
        while True:
            stats = c.stats().requests
            status = c.status().requests
            if (status.active == 0 and status.queued == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def run_soak(
    daemon: DaemonProcess,
    reference: Mapping[tuple[str, int], Reference],
    *,
    clients: int = 8,
    requests: int = 200,
    cancel_frac: float = 0.2,
    seed: int = 0,
    warmup_frac: float = 0.1,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """`clients` threads × `requests` each against `daemon`; returns the figures.

    The report's `ok` is true when every check above holds (RSS is reported, the caller
    judges it: `rss_growth_pct`)."""
    with Client(daemon.paths) as c:
        before = c.stats().requests
    progress = _Progress()
    results: list[SoakTally] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            t = _one_client(daemon.paths, i, requests, cancel_frac, seed, reference, progress, timeout)
        except BaseException as e:  # reported in the figures; the soak goes on with the others
            with lock:
                errors.append(f"client {i}: {type(e).__name__}: {e}")
            return
        with lock:
            results.append(t)

    total = clients * requests
    warm_at = max(1, int(total * warmup_frac))
    threads = [threading.Thread(target=worker, args=(i,), name=f"soak-{i}") for i in range(clients)]
    tic = time.perf_counter()
    rss_start = daemon.rss()
    rss_warm = rss_peak = None
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(0.05)
        rss = daemon.rss() if daemon.alive() else 0
        if rss_warm is None and progress.done >= warm_at:
            rss_warm = rss
        if rss_warm is not None:
            rss_peak = max(rss_peak or 0, rss)
    for t in threads:
        t.join()
    seconds = time.perf_counter() - tic
    alive = daemon.alive()
    after = _wait_idle(daemon.paths, 30.0) if alive else RequestTotals()
    rss_end = daemon.rss() if alive else 0
    rss_warm = rss_warm if rss_warm is not None else rss_start

    tally = SoakTally()
    for t in results:
        tally.add(t)
    delta = {
        k: getattr(after, k) - getattr(before, k)
        for k in ("requests", "completed", "cancelled", "disconnected", "failed")
    }
    disconnected = delta["disconnected"]
    # A cancel or disconnect may land after the request has already ended: then the
    # daemon counts it completed and the client saw a full response.
    counters_add_up = (
        delta["requests"] == tally.requests
        and delta["failed"] == 0
        and delta["cancelled"] == tally.cancelled
        and delta["completed"] + delta["cancelled"] + disconnected == delta["requests"]
        and delta["completed"] == tally.completed + (tally.disconnect_asked - disconnected)
    )
    if not counters_add_up:
        tally.fail(
            f"the daemon's counters {delta} do not add up to what the clients saw {asdict(tally) | {'failures': None}}"
        )
    report = {
        "clients": clients,
        "requests_per_client": requests,
        "cancel_frac": cancel_frac,
        "seconds": seconds,
        "requests": tally.requests,
        "completed": tally.completed,
        "cancelled": tally.cancelled,
        "cancel_asked": tally.cancel_asked,
        "disconnect_asked": tally.disconnect_asked,
        "disconnected_seen_by_daemon": disconnected,
        "exact": tally.exact,
        "mismatched": tally.mismatched,
        "lost_responses": tally.lost,
        "stray_messages": tally.stray_messages,
        "tokens": tally.tokens,
        "tokens_per_second": tally.tokens / seconds if seconds else 0.0,
        "daemon_counters": delta,
        "counters_add_up": counters_add_up,
        "daemon_alive": alive,
        "rss_start_bytes": rss_start,
        "rss_after_warmup_bytes": rss_warm,
        "rss_peak_bytes": rss_peak,
        "rss_end_bytes": rss_end,
        "rss_growth_pct": 100.0 * (rss_end - rss_warm) / rss_warm if rss_warm else None,
        "client_errors": errors,
        "failures": tally.failures,
    }
    report["ok"] = bool(
        alive
        and not errors
        and counters_add_up
        and tally.mismatched == 0
        and tally.lost == 0
        and tally.stray_messages == 0
        and tally.requests == total
    )
    return report
