"""`moestreamctl bench agent`: what a coding agent's long prompt meets through the real
daemon and the real HTTP gateway.

Coding agents (Claude Code, Codex CLI) send prompts of 25-35k tokens, give up after about
300 s without a byte and send the same request again. One daemon (the prompt cache on,
its default) and one gateway (`moestreamctl serve-openai`, its own process) are started
on the store; each request is a streamed `/v1/completions` of `prompt_tokens` random
token ids (exactly that many tokens), greedy, read from a raw socket so that every
byte's arrival is timed and a cut is made at a given instant:

- uncut: the time to the status line, the longest gap without a byte before the first
  token (from the send, the status line and keep-alives counted as bytes), the time to
  the first token (TTFT) and the daemon's own seconds for the request;
- cut and sent again: a second prompt, its connection closed at `cut_at` of the uncut
  TTFT, then the same request at once: its TTFT (from its own send) against the uncut
  one's, and the daemon's counts of prefills suspended and resumed; its answer against
  the same request once more (served from the prompt cache);
- duplicate: a third prompt, and the same request from a second connection at `cut_at`
  of the uncut TTFT: both answers, the second's status line and TTFT, and the daemon's
  counts of prefills started and joined (one prefill, two answers).

Imports no MLX: it drives a real daemon and gateway through sockets.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from ...client.client import Client
from ...shared.runtime_dir import RuntimePaths
from ...shared.store_format import load_manifest
from .common import timed_progress
from .soak.driver import DaemonProcess, child_env

# What the acceptance asks: the status line within this, no gap longer than this before
# the first token, and a cut request sent again at most this share of the uncut TTFT.
STATUS_LINE_S = 1.0
MAX_GAP_S = 10.0
RESEND_SHARE = 0.6
COUNTERS = ("prefills", "prefill_joins", "prefills_suspended", "prefills_resumed", "prefills_dropped")


@dataclass(frozen=True)
class BenchAgentSettings:
    store: Path
    capacity: str = "0.25"
    # The daemon's host-RAM tier ("20G"); None: none.
    host_cache: str | None = None
    prompt_tokens: int = 16384
    max_tokens: int = 8
    # The cut (and the duplicate's send), as a share of the uncut request's TTFT.
    cut_at: float = 0.5
    seed: int = 0


@dataclass
class Streamed:
    """One streamed request as its socket saw it (seconds from its send)."""

    status_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None
    # Arrival of every read before the first token (the status line's among them).
    arrivals_s: list[float] = field(default_factory=list)
    keep_alives: int = 0
    text: str = ""
    cut_s: float | None = None

    def max_gap_s(self) -> float | None:
        """The longest time without a byte from the send to the first token."""
        end = self.first_token_s
        if end is None:
            return None
        marks = [0.0, *(t for t in self.arrivals_s if t <= end), end]
        return max(b - a for a, b in zip(marks, marks[1:]))

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "arrivals_s"}
        out["max_gap_before_first_token_s"] = self.max_gap_s()
        return out

    def read(self, sock: socket.socket, tic: float, cut_after: float | None) -> None:
        """Read the answer to its end (or stop `cut_after` seconds after `tic`, the send:
        the caller's closing the socket is the cut), timing each read."""
        pending = b""
        while True:
            now = time.monotonic() - tic
            if cut_after is not None:
                if now >= cut_after:
                    self.cut_s = now
                    return
                sock.settimeout(cut_after - now)
            else:
                sock.settimeout(600)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            at = time.monotonic() - tic
            if not data:
                self.done_s = at
                return
            if self.first_token_s is None:
                self.arrivals_s.append(at)
            if self.status_s is None:
                self.status_s = at
                if not data.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the gateway answered {data[:200]!r}")
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                self._line(line.rstrip(b"\r"), at)

    def _line(self, line: bytes, at: float) -> None:
        if line.startswith(b": keep-alive"):
            self.keep_alives += 1
        elif line.startswith(b"data: {"):
            chunk = json.loads(line[len(b"data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the gateway reported an error: {chunk['error']}")
            text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
            if text and self.first_token_s is None:
                self.first_token_s = at
            self.text += text


def post_json(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> socket.socket:
    """A connection to `url`'s host with `body` POSTed on it as JSON (and `headers`), its
    answer left to read: the caller times each byte and may close it at any moment."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    target = f"{parts.path}?{parts.query}" if parts.query else parts.path
    fixed = {"Host": parts.netloc, "Content-Type": "application/json", "Content-Length": str(len(payload))}
    fields = (
        fixed
        | {"Connection": "close"}
        | {
            k: v
            for k, v in (headers or {}).items()
            if k.lower() not in ("host", "content-type", "content-length", "connection")
        }
    )
    head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock.sendall(head.encode() + payload)
    return sock


def stream_completion(url: str, body: dict[str, Any], cut_after: float | None = None) -> Streamed:
    """POST `body` to `url` (…/v1/completions) with `stream` on, over a raw socket, and
    read the answer to its end (or close the connection `cut_after` seconds after the
    send), timing each read."""
    out = Streamed()
    tic = time.monotonic()
    with post_json(url, body | {"stream": True}) as sock:
        out.read(sock, tic, cut_after)
    return out


class Gateway:
    """`moestreamctl serve-openai` on a free port, as its own process."""

    def __init__(self, runtime: Path) -> None:
        self.log = runtime / "gateway.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moestream.client.cli", "serve-openai", "--port", "0"]
                + ["--runtime-dir", str(runtime), "--log-level", "warning"],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
        deadline = time.monotonic() + 60
        while (base := self._base()) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.base = base  # http://127.0.0.1:PORT
        self.url = base + "/v1/completions"

    def _base(self) -> str | None:
        for line in self.log.read_text().splitlines():
            if "OpenAI API on " in line:
                return line.split("OpenAI API on ", 1)[1].split(" ", 1)[0].removesuffix("/v1")
        return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _counts(paths: RuntimePaths) -> dict[str, int]:
    with Client(paths, timeout=60) as c:
        pc = c.status().prompt_cache or {}
    return {k: int(pc.get(k, 0)) for k in COUNTERS}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTERS}


def _recent_prefill_seconds(paths: RuntimePaths) -> float | None:
    """The daemon's last finished request's seconds, from its receipt to its end."""
    with Client(paths, timeout=60) as c:
        recent = c.status().requests.recent
    return recent[-1].seconds if recent else None


def run_bench_agent(settings: BenchAgentSettings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = timed_progress(progress)
    manifest = load_manifest(settings.store)
    vocab = int(manifest.config.get("text_config", manifest.config)["vocab_size"])
    rng = random.Random(settings.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(settings.prompt_tokens)] for _ in range(4)]

    def body(prompt: list[int]) -> dict[str, Any]:
        return {"model": "moestream", "prompt": prompt, "max_tokens": settings.max_tokens, "temperature": 0}

    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="msagent"))
    runtime = base / "run"
    # The prompt and its answer within the daemon's context (a setting without a flag).
    context = str(settings.prompt_tokens + settings.max_tokens + 64)
    daemon: DaemonProcess | None = None
    gateway: Gateway | None = None
    try:
        say("starting a daemon and a gateway")
        daemon = DaemonProcess.start(
            settings.store,
            runtime,
            capacity=settings.capacity,
            flags={"host_cache": settings.host_cache} if settings.host_cache else None,
            env={"MOESTREAM_MAX_CONTEXT": context},
            timeout=600.0,
        )
        paths = daemon.paths
        gateway = Gateway(runtime)
        say("warming up with a short request")
        stream_completion(gateway.url, body(prompts[3][:64]))

        say(f"uncut: a prompt of {settings.prompt_tokens} tokens")
        uncut = stream_completion(gateway.url, body(prompts[0]))
        daemon_seconds = _recent_prefill_seconds(paths)
        if uncut.first_token_s is None:
            raise RuntimeError("the uncut request made no token")
        ttft = uncut.first_token_s
        say(f"uncut: status line {uncut.status_s:.2f} s, first token {ttft:.1f} s, {uncut.keep_alives} keep-alives")
        cut_at = settings.cut_at * ttft

        say(f"cut at {cut_at:.1f} s, then sent again")
        before = _counts(paths)
        cut = stream_completion(gateway.url, body(prompts[1]), cut_after=cut_at)
        resent = stream_completion(gateway.url, body(prompts[1]))
        cut_counts = _delta(before, _counts(paths))
        again = stream_completion(gateway.url, body(prompts[1]))
        say(f"sent again: first token {resent.first_token_s:.1f} s ({resent.first_token_s / ttft:.2f}x uncut)")

        say(f"a duplicate sent at {cut_at:.1f} s")
        before = _counts(paths)
        results: dict[str, Streamed] = {}

        def send_first() -> None:
            results["first"] = stream_completion(gateway.url, body(prompts[2]))

        first = threading.Thread(target=send_first)
        first.start()
        time.sleep(cut_at)
        results["duplicate"] = stream_completion(gateway.url, body(prompts[2]))
        first.join()
        dup_counts = _delta(before, _counts(paths))
        say(f"duplicate: first token {results['duplicate'].first_token_s:.1f} s after its send; {dup_counts}")
        status = _status(paths)
    finally:
        if gateway is not None:
            gateway.stop()
        if daemon is not None:
            daemon.stop(timeout=60.0)
        shutil.rmtree(base, ignore_errors=True)
    dup, dup_first = results["duplicate"], results["first"]
    resend_share = resent.first_token_s / ttft if resent.first_token_s is not None else None
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "daemon": status,
        "uncut": uncut.to_dict() | {"daemon_request_seconds": daemon_seconds},
        "cut_and_sent_again": {
            "cut": cut.to_dict(),
            "sent_again": resent.to_dict(),
            "sent_again_over_uncut_ttft": resend_share,
            "same_answer_as_once_more": resent.text == again.text,
            "counts": cut_counts,
        },
        "duplicate": {
            "first": dup_first.to_dict(),
            "duplicate": dup.to_dict(),
            "duplicate_sent_at_s": cut_at,
            "same_answers": dup.text == dup_first.text,
            "counts": dup_counts,
        },
        "checks": {
            "status_line_within_1s": uncut.status_s is not None and uncut.status_s <= STATUS_LINE_S,
            "no_gap_over_10s_before_first_token": (uncut.max_gap_s() or 0.0) <= MAX_GAP_S,
            "sent_again_at_most_0.6x": resend_share is not None and resend_share <= RESEND_SHARE,
            "duplicate_shared_one_prefill": dup_counts["prefills"] == 1 and dup_counts["prefill_joins"] == 1,
        },
    }


def _status(paths: RuntimePaths) -> dict[str, Any]:
    with Client(paths, timeout=60) as c:
        st = c.status()
    return {
        "capacity": st.capacity,
        "moe_layers": st.moe_layers,
        "experts_per_layer": st.experts_per_layer,
        "prefill_order": st.pool.prefill.order,
        "prompt_cache": {k: (st.prompt_cache or {}).get(k) for k in (*COUNTERS, "suspended", "entries")},
    }


def format_report(r: dict[str, Any]) -> str:
    s, u = r["settings"], r["uncut"]
    c, d = r["cut_and_sent_again"], r["duplicate"]

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    lines = [
        f"bench agent: {s['store']}, capacity {s['capacity']}, a prompt of {s['prompt_tokens']} tokens "
        f"({r['daemon']['moe_layers']} MoE layers, prefill {r['daemon']['prefill_order']})",
        f"uncut: status line {secs(u['status_s'])}, longest gap before the first token "
        f"{secs(u['max_gap_before_first_token_s'])} ({u['keep_alives']} keep-alives), first token "
        f"{secs(u['first_token_s'])}",
        f"cut at {secs(c['cut']['cut_s'])} and sent again: first token {secs(c['sent_again']['first_token_s'])} "
        f"after its send ({c['sent_again_over_uncut_ttft']:.2f}x uncut), same answer as once more: "
        f"{c['same_answer_as_once_more']}; {c['counts']}",
        f"duplicate sent at {secs(d['duplicate_sent_at_s'])}: status line {secs(d['duplicate']['status_s'])}, first "
        f"token {secs(d['duplicate']['first_token_s'])} after its send, same answers: {d['same_answers']}; "
        f"{d['counts']}",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()),
    ]
    return "\n".join(lines)
