"""`moestreamctl bench session`: a coding agent's session, replayed through the real
daemon and the real HTTP gateway with the prompt cache off and on, side by side in one run.

The session is recorded as Claude Code sends it (tests/data/agent_session_claude_code.json,
see tests/data/README.md): one request shape that every turn shares (system blocks with
cache_control, tools with input_schema, thinking enabled with a budget, metadata.user_id,
stream, max_tokens), and per branch a first user message and what its tools return, turn
by turn. Replayed here:

- the main agent: `turns` turns; each answer is the model's own (its text, thinking and
  tool_use blocks as the gateway streamed them, with the ids the gateway gave), sent back
  as the next request's assistant turn, then a user turn of tool_result blocks (one per
  call, the recorded result) or, where the model called no tool, the recorded user text;
- `subagents` subagents, started once the main agent's first turn has answered, beside
  its later turns (concurrently): the same system prompt and tools, a first user message
  of their own, `turns - 1` turns each;
- one client cut during a prefill and sent again (the main agent's first turn: cut once
  the daemon reports a third of its prefill done, then sent again at once), unless `cut`
  is off.

The system prompt is cut to `system_tokens` (the prompt's tokens before the first user
message, as the daemon counts them; where the tools alone are longer, the last tools are
left out first). Requests are greedy (temperature 0, which the
recorded temperature 1 would not be), so that both runs answer alike. One daemon with the
prompt cache off (`prompt_cache_bytes` 0) runs the session first, then a fresh one with it
on. Reported per request: prompt tokens and cached tokens (the gateway's usage:
`input_tokens` + `cache_read_input_tokens`), the time to the first streamed content
(client side), and the daemon's prefill seconds (its `prompt_seconds`, from `status`:
the request's start to its first token, turns of concurrent requests included); the
session's total prefill seconds with the cache off and on, and the checks issue 53 asks
for, as measured.

Imports no MLX: it drives real daemons and gateways through sockets.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...client.client import Client
from ...shared.runtime_dir import RuntimePaths
from .agent import COUNTERS, Gateway, post_json
from .common import timed_progress
from .soak.driver import DaemonProcess

# In a checkout (or an editable install): the recorded session beside the tests.
DEFAULT_SESSION = Path(__file__).resolve().parents[2] / "tests" / "data" / "agent_session_claude_code.json"
# What issue 53 asks of a session served from the prompt cache.
MIN_REUSE = 0.9
MAX_PREFILL_RATIO = 0.2
# The cut: once the daemon reports this share of the prefill done.
CUT_SHARE = 1 / 3
POLL_S = 0.05
WARM_UP_SYSTEM = "You answer in one word."


@dataclass(frozen=True)
class BenchSessionSettings:
    store: Path
    session: Path = DEFAULT_SESSION
    turns: int = 3
    subagents: int = 2
    system_tokens: int = 1200
    max_tokens: int = 32
    cut: bool = True
    # None: every expert of each layer.
    capacity: str | None = None
    # The daemons' host-RAM tier (a size such as 20G); None: none.
    host_cache: str | None = None
    # The daemon's max_context; None: the model's own.
    context: int | None = None
    # Anthropic's tool_choice type: "auto" as Claude Code sends it, or "any" (every answer
    # a call, for a model that seldom calls tools by itself).
    tool_choice: str = "auto"


@dataclass(frozen=True)
class Step:
    """What a turn's tools return (sent as each call's tool_result), or where the model
    called none, what the user says next."""

    tool_result: str
    user: str
    is_error: bool = False


@dataclass(frozen=True)
class Branch:
    first_user: list[dict[str, Any]]
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class RecordedSession:
    headers: dict[str, str]
    body: dict[str, Any]  # every request's fields but `messages`
    main: Branch
    subagents: tuple[Branch, ...]


def load_session(path: Path) -> RecordedSession:
    """The recorded session at `path`; ValueError naming what is wrong with it."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read the recorded session {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the recorded session {path} is not JSON: {e}") from None

    def branch(x: Any, where: str) -> Branch:
        if not (isinstance(x, dict) and isinstance(x.get("first_user"), list) and isinstance(x.get("steps"), list)):
            raise ValueError(f"{path}: {where} must be {{first_user: [content blocks], steps: [...]}}")
        steps = []
        for i, s in enumerate(x["steps"]):
            if not (isinstance(s, dict) and isinstance(s.get("tool_result"), str) and isinstance(s.get("user"), str)):
                raise ValueError(f"{path}: {where}.steps[{i}] must be {{tool_result: str, user: str}}")
            steps.append(Step(s["tool_result"], s["user"], bool(s.get("is_error", False))))
        if not steps:
            raise ValueError(f"{path}: {where} has no steps")
        return Branch(x["first_user"], tuple(steps))

    body = raw.get("body") if isinstance(raw, dict) else None
    if not (isinstance(body, dict) and isinstance(body.get("system"), list) and body["system"]):
        raise ValueError(f"{path}: 'body' must be a Messages request body with 'system' as a list of text blocks")
    subagents = raw.get("subagents", [])
    if not isinstance(subagents, list):
        raise ValueError(f"{path}: 'subagents' must be a list")
    return RecordedSession(
        headers={str(k): str(v) for k, v in (raw.get("headers") or {}).items()},
        body={k: v for k, v in body.items() if k != "messages"},
        main=branch(raw.get("main"), "main"),
        subagents=tuple(branch(b, f"subagents[{i}]") for i, b in enumerate(subagents)),
    )


# ---- one streamed request -------------------------------------------------------------


@dataclass
class Answer:
    """One streamed /v1/messages answer as its socket saw it (seconds from its send)."""

    id: str | None = None
    status_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None
    cut_s: float | None = None
    keep_alives: int = 0
    stop_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)
    _json: dict[int, list[str]] = field(default_factory=dict)

    def read(self, sock: socket.socket, tic: float, cut: Callable[[str], bool] | None) -> None:
        """Read the answer to its end (or, with `cut`, return before its first content
        once `cut(message id)` says so: the caller's closing the socket is the cut)."""
        refused = b""  # a status other than 200: its whole answer, for the error
        pending = b""
        while True:
            sock.settimeout(POLL_S if cut is not None else 600)
            try:
                data: bytes | None = sock.recv(65536)
            except TimeoutError:
                data = None
            at = time.monotonic() - tic
            if data == b"":
                self.done_s = at
                break
            if data and self.status_s is None:
                self.status_s = at
                refused = b"" if data.startswith(b"HTTP/1.1 200") else data
            elif data and refused:
                refused += data
            if data and not refused:
                *complete, pending = (pending + data).split(b"\n")
                for line in complete:
                    self.line(line.rstrip(b"\r"), at)
            if cut is not None and self.id is not None and self.first_token_s is None and cut(self.id):
                self.cut_s = at
                return
        if refused or self.status_s is None:
            raise RuntimeError(f"the gateway answered {refused[:2000].decode(errors='replace')!r}")

    def content(self) -> list[dict[str, Any]]:
        """The answer's content blocks, as a client sends them back (tool_use inputs
        parsed, empty text blocks left out)."""
        out = []
        for i in sorted(self.blocks):
            block = dict(self.blocks[i])
            if block["type"] == "tool_use":
                block["input"] = json.loads("".join(self._json.get(i, [])) or "{}")
            if block["type"] == "text" and not block["text"]:
                continue
            out.append(block)
        return out

    def line(self, line: bytes, at: float) -> None:
        if not line.startswith(b"data: {"):
            return
        event = json.loads(line[len(b"data: ") :])
        kind = event.get("type")
        if kind == "error":
            raise RuntimeError(f"the gateway reported an error: {event.get('error')}")
        if kind == "ping":
            self.keep_alives += 1
        elif kind == "message_start":
            self.id = event["message"]["id"]
        elif kind == "content_block_start":
            self.blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            self._delta(event["index"], event["delta"], at)
        elif kind == "message_delta":
            self.stop_reason = event["delta"].get("stop_reason")
            self.usage = dict(event.get("usage") or {})

    def _delta(self, index: int, delta: dict[str, Any], at: float) -> None:
        block = self.blocks[index]
        kind = delta.get("type")
        if kind != "signature_delta" and self.first_token_s is None:
            self.first_token_s = at
        if kind == "text_delta":
            block["text"] += delta["text"]
        elif kind == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "input_json_delta":
            self._json.setdefault(index, []).append(delta["partial_json"])


def stream_message(
    url: str, body: dict[str, Any], headers: dict[str, str], cut: Callable[[str], bool] | None = None
) -> Answer:
    """POST `body` to `url` (…/v1/messages) over a raw socket and read the streamed answer
    to its end; with `cut`, close the connection before the first content once
    `cut(message id)` says so (asked every POLL_S)."""
    out = Answer()
    tic = time.monotonic()
    with post_json(url, body, headers) as sock:
        out.read(sock, tic, cut)
    return out


# ---- one daemon's run of the session ----------------------------------------------------


@dataclass
class Turn:
    """One request of the session, as measured."""

    branch: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    prefill_s: float | None
    output_tokens: int
    stop_reason: str | None
    tool_calls: int
    content: list[dict[str, Any]]

    def answer(self) -> list[Any]:
        """What the model answered, without the ids and signatures the gateway made up."""
        keep = {"text": ("text",), "thinking": ("thinking",), "tool_use": ("name", "input")}
        return [[b["type"], *(b.get(k) for k in keep.get(b["type"], ()))] for b in self.content]


class _Run:
    """One daemon and gateway serving the session."""

    def __init__(self, session: RecordedSession, settings: BenchSessionSettings, paths: RuntimePaths, url: str):
        self.session = session
        self.settings = settings
        self.paths = paths
        self.url = url
        self.turns: list[Turn] = []
        self.errors: list[Exception] = []
        self._lock = threading.Lock()

    def body(self, messages: list[dict[str, Any]], shared: dict[str, Any]) -> dict[str, Any]:
        """A request of the session: the shared part (`fit_prefix`), then `messages`."""
        return shared | {
            "messages": messages,
            "max_tokens": self.settings.max_tokens,
            "temperature": 0,
            "stream": True,
            "tool_choice": {"type": self.settings.tool_choice},
        }

    def recent(self, request_id: str) -> dict[str, Any]:
        with Client(self.paths, timeout=60) as c:
            for r in reversed(c.status().requests.recent):
                if r.id == request_id:
                    return r.to_dict()
        return {}

    def counters(self) -> dict[str, int]:
        with Client(self.paths, timeout=60) as c:
            pc = c.status().prompt_cache or {}
        return {k: int(pc.get(k, 0)) for k in COUNTERS}

    def ask(self, branch: str, turn: int, body: dict[str, Any]) -> Answer:
        # An empty answer (the model ended its turn at once) goes back empty, as it came.
        answer = stream_message(self.url, body, self.session.headers)
        self.record(branch, turn, answer)
        return answer

    def record(self, branch: str, turn: int, answer: Answer) -> Turn:
        use = answer.usage
        recent = self.recent(answer.id or "")
        content = answer.content()
        t = Turn(
            branch=branch,
            turn=turn,
            prompt_tokens=int(use.get("input_tokens", 0)) + int(use.get("cache_read_input_tokens", 0)),
            cached_tokens=int(use.get("cache_read_input_tokens", 0)),
            ttft_s=answer.first_token_s,
            prefill_s=recent.get("prompt_seconds"),
            output_tokens=int(use.get("output_tokens", 0)),
            stop_reason=answer.stop_reason,
            tool_calls=sum(1 for b in content if b["type"] == "tool_use"),
            content=content,
        )
        with self._lock:
            self.turns.append(t)
        return t

    def cut_mid_prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send `body`, close the connection once the daemon reports CUT_SHARE of its
        prefill done (or at its first content), and say where it was cut."""
        seen: dict[str, Any] = {}
        client = Client(self.paths, timeout=60)

        def cut(request_id: str) -> bool:
            running = [r for r in client.status().requests.running if r.id == request_id]
            if running:
                seen.update(running[0].to_dict())
                done, total = running[0].prefilled_tokens, running[0].prefill_total
                return bool(done and total and done >= CUT_SHARE * total)
            return False

        try:
            before = self.counters()
            answer = stream_message(self.url, body, self.session.headers, cut=cut)
        finally:
            client.close()
        return {
            "cut_s": answer.cut_s,
            "mid_prefill": answer.cut_s is not None,
            "prefilled_tokens": seen.get("prefilled_tokens"),
            "prefill_total": seen.get("prefill_total"),
            "id": answer.id,
            "before": before,
        }

    def branch(self, name: str, branch: Branch, shared: dict[str, Any], turns: int, first: Answer | None) -> None:
        """The branch's turns (the first one already answered: `first`), on a thread of
        its own: an error is kept for the run to raise once every branch has ended."""
        try:
            self._branch(name, branch, shared, turns, first)
        except Exception as e:
            self.errors.append(e)

    def _branch(self, name: str, branch: Branch, shared: dict[str, Any], turns: int, first: Answer | None) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": branch.first_user}]
        for turn in range(1, turns + 1):
            answer = first if turn == 1 and first is not None else self.ask(name, turn, self.body(messages, shared))
            if turn == turns:
                return
            messages += [{"role": "assistant", "content": answer.content()}, _next_user(answer, branch.steps[turn - 1])]


def _next_user(answer: Answer, step: Step) -> dict[str, Any]:
    """The user turn after `answer`: a tool_result per call, or the user's text."""
    calls = [b for b in answer.content() if b["type"] == "tool_use"]
    if calls:
        blocks: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": c["id"], "content": step.tool_result}
            | ({"is_error": True} if step.is_error else {})
            for c in calls
        ]
    else:
        blocks = [{"type": "text", "text": step.user}]
    blocks[-1] = blocks[-1] | {"cache_control": {"type": "ephemeral"}}
    return {"role": "user", "content": blocks}


def _count(url: str, body: dict[str, Any]) -> int:
    """The tokens of the prompt before the first user message, as the daemon counts them:
    the prompt with a one-character user message, less that message's own turn."""
    import urllib.request

    def count(fields: dict[str, Any]) -> int:
        fields = {k: v for k, v in fields.items() if k not in ("stream", "max_tokens", "temperature", "metadata")}
        data = json.dumps(fields | {"messages": [{"role": "user", "content": "?"}]}).encode()
        req = urllib.request.Request(url + "/count_tokens", data, {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(json.loads(r.read())["input_tokens"])

    return count(body) - count({k: v for k, v in body.items() if k not in ("system", "tools")})


def fit_prefix(url: str, session: RecordedSession, tokens: int) -> tuple[dict[str, Any], int]:
    """The recorded request's shared part (system blocks and tools) cut so that the
    prompt before the first user message is at most `tokens` long: the tools from the
    last while they alone are longer, then the last system block's text. The body's
    fields and that prompt's length (longer than `tokens` only where the first system
    block and the first tool alone are)."""
    body = dict(session.body)
    blocks = body["system"]
    text = blocks[-1]["text"]

    def cut(n: int) -> dict[str, Any]:
        return body | {"system": [*blocks[:-1], blocks[-1] | {"text": text[:n]}]}

    while len(body.get("tools") or ()) > 1 and _count(url, cut(0)) > tokens:
        body["tools"] = body["tools"][:-1]
    lo, hi = 0, len(text)
    while lo < hi:  # the longest cut within `tokens`
        mid = (lo + hi + 1) // 2
        if _count(url, cut(mid)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return cut(lo), _count(url, cut(lo))


def _session_run(
    settings: BenchSessionSettings, session: RecordedSession, cache_on: bool, say: Callable[[str], None]
) -> dict[str, Any]:
    mode = "on" if cache_on else "off"
    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="mssess"))
    flags = {} if cache_on else {"prompt_cache_bytes": "0"}
    if settings.host_cache:
        flags["host_cache"] = settings.host_cache
    env = {"MOESTREAM_MAX_CONTEXT": str(settings.context)} if settings.context else None
    daemon: DaemonProcess | None = None
    gateway: Gateway | None = None
    try:
        say(f"cache {mode}: starting a daemon and a gateway")
        daemon = DaemonProcess.start(
            settings.store, base / "run", capacity=settings.capacity or "1.0", flags=flags, env=env, timeout=600.0
        )
        gateway = Gateway(base / "run")
        url = gateway.base + "/v1/messages"
        run = _Run(session, settings, daemon.paths, url)
        shared, system_tokens = fit_prefix(url, session, settings.system_tokens)
        # Untimed, and sharing no prefix with the session (its own system prompt).
        warm = {"system": [{"type": "text", "text": WARM_UP_SYSTEM}], "tools": shared.get("tools", [])[:1]}
        hello = run.body([{"role": "user", "content": "Hi."}], shared | warm) | {"max_tokens": 2}
        stream_message(url, hello, session.headers)
        tic = time.monotonic()
        main = session.main
        first_body = run.body([{"role": "user", "content": main.first_user}], shared)
        cut = None
        if settings.cut:
            cut = run.cut_mid_prefill(first_body)
            say(
                f"cache {mode}: main turn 1 cut at {cut['cut_s']} s ({cut['prefilled_tokens']} of "
                f"{cut['prefill_total']} prompt tokens prefilled), sent again"
            )
        first = run.ask("main", 1, first_body)
        if cut is not None:
            before, after = cut.pop("before"), run.counters()
            cut["counts"] = {k: after[k] - before[k] for k in COUNTERS}
            cut["seconds"] = run.recent(cut.pop("id") or "").get("seconds")
        say(f"cache {mode}: main turn 1 answered; {settings.subagents} subagents start beside the main agent")
        branches = [("main", main, settings.turns, first)] + [
            (f"subagent {i + 1}", sub, subagent_turns(settings), None)
            for i, sub in enumerate(session.subagents[: settings.subagents])
        ]
        threads = [threading.Thread(target=run.branch, args=(n, b, shared, k, a), name=n) for n, b, k, a in branches]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if run.errors:
            raise run.errors[0]
        wall = time.monotonic() - tic
        for t in sorted(run.turns, key=lambda t: (t.branch != "main", t.branch, t.turn)):
            say(
                f"cache {mode}: {t.branch} turn {t.turn}: {t.prompt_tokens} prompt tokens, {t.cached_tokens} cached, "
                f"prefill {t.prefill_s or 0:.2f} s, {t.tool_calls} tool calls"
            )
        return {
            "turns": run.turns,
            "cut": cut,
            "system_tokens": system_tokens,
            "tools": len(shared.get("tools") or ()),
            "wall_s": wall,
            "prompt_cache": {k: v for k, v in run.counters().items()},
        }
    finally:
        if gateway is not None:
            gateway.stop()
        if daemon is not None:
            daemon.stop(timeout=60.0)
        shutil.rmtree(base, ignore_errors=True)


def subagent_turns(settings: BenchSessionSettings) -> int:
    """A subagent's turns: those the main agent has left once it forks them."""
    return max(1, settings.turns - 1)


def _check_settings(settings: BenchSessionSettings, session: RecordedSession) -> None:
    if settings.turns > len(session.main.steps) + 1:
        raise ValueError(f"the recorded session's main agent has {len(session.main.steps) + 1} turns at most")
    if settings.subagents > len(session.subagents):
        raise ValueError(f"the recorded session has {len(session.subagents)} subagents")
    need = subagent_turns(settings)
    short = [i + 1 for i, b in enumerate(session.subagents[: settings.subagents]) if len(b.steps) + 1 < need]
    if short:
        raise ValueError(f"subagents {short} have fewer recorded turns than {need}")


def run_bench_session(settings: BenchSessionSettings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    session = load_session(settings.session)
    _check_settings(settings, session)
    say = timed_progress(progress)
    off = _session_run(settings, session, False, say)
    on = _session_run(settings, session, True, say)
    return summarize(settings, off, on)


def _prefill_total(run: dict[str, Any]) -> float:
    """Seconds of prefill in the run: every request's, and the cut one's to its cut."""
    cut = run["cut"] or {}
    return sum(t.prefill_s or 0.0 for t in run["turns"]) + (cut.get("cut_s") or 0.0)


def summarize(settings: BenchSessionSettings, off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """The report of the two runs: per request side by side, the totals and the checks."""
    before = {(t.branch, t.turn): t for t in off["turns"]}
    earlier = {(t.branch, t.turn + 1): t for t in on["turns"]}
    rows = []
    for t in sorted(on["turns"], key=lambda t: (t.branch != "main", t.branch, t.turn)):
        o = before.get((t.branch, t.turn))
        # Of the branch's previous turn's prompt and answer (what its cache entry holds),
        # the tokens this turn's prompt did not reuse: what re-rendering the history lost.
        p = earlier.get((t.branch, t.turn))
        lost = max(0, p.prompt_tokens + p.output_tokens - t.cached_tokens) if p is not None else None
        rows.append(
            {
                "branch": t.branch,
                "turn": t.turn,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "reuse": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else None,
                "lost_tokens": lost,
                "prompt_tokens_off": o.prompt_tokens if o else None,
                "cached_tokens_off": o.cached_tokens if o else None,
                "ttft_on_s": t.ttft_s,
                "ttft_off_s": o.ttft_s if o else None,
                "prefill_on_s": t.prefill_s,
                "prefill_off_s": o.prefill_s if o else None,
                "output_tokens": t.output_tokens,
                "tool_calls": t.tool_calls,
                "stop_reason": t.stop_reason,
                "same_answer": o is not None and o.answer() == t.answer(),
                # What the model answered (cache on): where a turn parts from the cache, why.
                "answer": t.answer(),
            }
        )
    reuse: dict[str, list[float | None]] = {}
    for r in rows:
        if r["turn"] >= 2:
            reuse.setdefault(r["branch"], []).append(r["reuse"])
    total_off, total_on = _prefill_total(off), _prefill_total(on)
    ratio = total_on / total_off if total_off else None
    prefilled = {
        mode: sum(t.prompt_tokens - t.cached_tokens for t in run["turns"]) for mode, run in (("off", off), ("on", on))
    }
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "system_tokens": on["system_tokens"],
        "tools": on["tools"],
        "turns": rows,
        "reuse_from_turn_2": reuse,
        "cut": {"off": off["cut"], "on": on["cut"]},
        "total_prefill_off_s": total_off,
        "total_prefill_on_s": total_on,
        "total_prefill_ratio": ratio,
        "prefilled_tokens_off": prefilled["off"],
        "prefilled_tokens_on": prefilled["on"],
        "wall_off_s": off["wall_s"],
        "wall_on_s": on["wall_s"],
        "same_answers": all(r["same_answer"] for r in rows),
        "prompt_cache": on["prompt_cache"],
        "checks": {
            "reuse_at_least_0.9_from_turn_2": {
                b: bool(v) and all(x is not None and x >= MIN_REUSE for x in v) for b, v in reuse.items()
            },
            "total_prefill_ratio_at_most_0.2": ratio is not None and ratio <= MAX_PREFILL_RATIO,
        },
    }


def format_report(r: dict[str, Any]) -> str:
    s = r["settings"]

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"bench session: {s['store']}, a Claude Code session of {s['turns']} main turns, {s['subagents']} subagents "
        f"beside it, a {r['system_tokens']}-token system prompt and tools, {s['max_tokens']} tokens an answer; "
        "the prompt cache off and on",
        f"{'branch':<11} {'turn':>4} {'prompt':>6} {'cached':>6} {'reuse':>6} {'lost':>4} {'TTFT off':>8} "
        f"{'TTFT on':>8} {'prefill off':>11} {'prefill on':>10} {'calls':>5} {'same':>5}",
    ]
    for t in r["turns"]:
        reuse = f"{t['reuse']:.3f}" if t["reuse"] is not None else "-"
        lines.append(
            f"{t['branch']:<11} {t['turn']:>4} {t['prompt_tokens']:>6} {t['cached_tokens']:>6} {reuse:>6} "
            f"{'-' if t['lost_tokens'] is None else t['lost_tokens']:>4} "
            f"{secs(t['ttft_off_s']):>8} {secs(t['ttft_on_s']):>8} {secs(t['prefill_off_s']):>11} "
            f"{secs(t['prefill_on_s']):>10} {t['tool_calls']:>5} {str(t['same_answer']):>5}"
        )
    for mode in ("off", "on"):
        c = r["cut"][mode]
        if c:
            lines.append(
                f"cut (cache {mode}): at {secs(c['cut_s'])} s, {c['prefilled_tokens']} of {c['prefill_total']} "
                f"prefilled; sent again: {c['counts']}"
            )
    ratio = r["total_prefill_ratio"]
    lines.append(
        f"total prefill: {r['total_prefill_off_s']:.2f} s off, {r['total_prefill_on_s']:.2f} s on "
        f"({'-' if ratio is None else f'{ratio:.3f}'}x); tokens prefilled {r['prefilled_tokens_off']} off, "
        f"{r['prefilled_tokens_on']} on"
    )
    checks = r["checks"]
    parts = [
        f"reuse >= {MIN_REUSE} from turn 2, {b}: {'ok' if v else 'FAILED'}"
        for b, v in checks["reuse_at_least_0.9_from_turn_2"].items()
    ]
    parts.append(
        f"total prefill ratio <= {MAX_PREFILL_RATIO}: {'ok' if checks['total_prefill_ratio_at_most_0.2'] else 'FAILED'}"
    )
    lines.append("checks: " + "; ".join(parts))
    return "\n".join(lines)
