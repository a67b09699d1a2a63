"""The dashboard's two routes, and the history of tokens made that the gateway samples."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ...shared.heat_file import group_usage, peek_usage, usage_path
from ...shared.runtime_dir import RuntimePaths
from ...shared.settings import Settings, SettingsError
from ...shared.status import RequestInfo, Status
from ..client import Client, ClientError, DaemonNotRunning

log = logging.getLogger("moestream.dashboard")
PAGE = Path(__file__).resolve().parent / "static" / "dashboard.html"
# The gateway reads the daemon's tokens made every SAMPLE_SECONDS, whether or not a page
# is open, and keeps HISTORY_SECONDS of them: a page opened now draws the last half hour.
SAMPLE_SECONDS = 2.0
HISTORY_SECONDS = 30 * 60
# A sample later than this many periods after the one before: the gateway was not
# sampling in between (the machine slept), and the chart shows a gap, not a line.
GAP_PERIODS = 3


@dataclass(frozen=True)
class Sample:
    at: float  # wall-clock seconds
    tokens: int | None  # tokens made so far (finished and running requests); None: no daemon answered
    pid: int | None  # the daemon's: a restarted daemon counts from 0 again
    routed: tuple[int, ...] = ()  # each MoE layer's routings so far


def requests_of(st: Status) -> list[RequestInfo]:
    """The daemon's running requests, then the first of its queued ones."""
    return [*st.requests.running, *st.requests.waiting]


def tokens_made(st: Status) -> int:
    """Tokens made so far: those of ended requests and of running ones."""
    return st.requests.tokens + sum(j.tokens for j in requests_of(st))


class History:
    """Tokens made, sampled by `run()` every `period` seconds (a bounded ring of
    `keep` samples); `read()` gives the daemon's status, or None where none answers."""

    def __init__(
        self,
        read: Callable[[], Status | None],
        period: float = SAMPLE_SECONDS,
        keep: int = round(HISTORY_SECONDS / SAMPLE_SECONDS),
    ) -> None:
        self.read = read
        self.period = period
        self.samples: deque[Sample] = deque(maxlen=keep)

    def add(self, st: Status | None, at: float) -> None:
        if st is None:
            self.samples.append(Sample(at, None, None))
        else:
            routed = tuple(la.routed for la in st.pool.layers)
            self.samples.append(Sample(at, tokens_made(st), st.pid, routed))

    def sample(self) -> None:
        try:
            st = self.read()
        except Exception as e:  # the sampler goes on; this sample is a gap
            log.warning("the dashboard's history could not read the daemon's status: %s: %s", type(e).__name__, e)
            st = None
        self.add(st, time.time())

    async def run(self) -> None:
        """Sample until cancelled (the status call on a worker thread)."""
        while True:
            tic = time.monotonic()
            await anyio.to_thread.run_sync(self.sample)
            await asyncio.sleep(max(self.period - (time.monotonic() - tic), 0.0))

    def _interval(self, prev: Sample | None, s: Sample) -> float | None:
        """Seconds from `prev` to `s` where `s` continues it (the same daemon answered
        both, with no gap between them), else None."""
        if prev is None or prev.tokens is None or s.tokens is None or s.pid != prev.pid:
            return None
        dt = s.at - prev.at
        return dt if 0 < dt <= GAP_PERIODS * self.period else None

    def points(self) -> list[dict[str, float | None]]:
        """Each sample's time and tokens/s since the one before; tokens/s is None where
        the chart has a gap: no daemon, a restarted one, or no sample in between."""
        out: list[dict[str, float | None]] = []
        prev: Sample | None = None
        for s in self.samples:
            dt = self._interval(prev, s)  # where set, both counts are too
            rate = None if dt is None else max(s.tokens - prev.tokens, 0) / dt
            out.append({"at": s.at, "tokens": s.tokens, "tps": rate})
            prev = s
        return out

    def layer_rates(self) -> list[float] | None:
        """Each layer's routings per second over the last two samples (None: a gap)."""
        if len(self.samples) < 2:
            return None
        prev, s = self.samples[-2], self.samples[-1]
        dt = self._interval(prev, s)
        if dt is None or len(s.routed) != len(prev.routed):
            return None
        return [max(b - a, 0) / dt for a, b in zip(prev.routed, s.routed)]


def pool_sizes(st: Status | None, now: float) -> dict[str, Any]:
    """The pool's slots per layer over time, from the elastic pool's resizes in `status`
    (daemon/pool/elastic.py): the size before the first resize kept, then a step at each
    (with why), up to its size at `now` (wall-clock seconds); with what it was made with,
    its floor and the pressure read last, for the page's chart and list."""
    el = st.elastic if st is not None else None
    if el is None:
        return {"steps": [], "note": "no elastic pool (a daemon before it, or not running)"}
    if el.source is None or not el.configured_slots:
        return {"steps": [], "note": el.note}
    first = el.events[0].slots_from if el.events else el.slots
    steps = [{"at": None, "slots": first, "reason": "as made" if el.events else "unchanged", "level": None}]
    steps += [{"at": e.at, "slots": e.slots_to, "reason": e.reason, "level": e.level} for e in el.events]
    return {
        "steps": steps,
        "now": now,
        "slots": el.slots,
        "made": el.configured_slots,
        "floor": el.floor_slots,
        "level": el.level,
        "detail": el.detail,
        "refusing": el.refusing,
        "refused": el.refused,
        "events": [e.to_dict() for e in reversed(el.events)],
        "note": None,
    }


def heat_map(st: Status) -> dict[str, Any]:
    """The routing counts of the served store as rows of layers x experts, from the heat
    file (read only: a corrupt one is the daemon's to set aside)."""
    model, layers, experts = st.model, st.moe_layers, st.experts_per_layer
    if not model:
        return {"rows": [], "note": "no model"}
    try:
        values = {k: v for k, v in st.settings.items() if v is not None and v != "auto"}
        folder = Settings.from_values(values).heat_folder(model)
    except SettingsError as e:
        return {"rows": [], "note": f"cannot tell where the heat is: {e}"}
    path = usage_path(folder)
    try:
        counts = peek_usage(path)
    except FileNotFoundError:
        # An expert-parallel group keeps a file per rank, of disjoint experts: their sum.
        try:
            counts, ranks = group_usage(folder)
        except (OSError, ValueError) as e:
            return {"rows": [], "path": str(folder), "note": f"cannot read the group's heat: {e}"}
        if not ranks:
            return {"rows": [], "path": str(path), "note": "no heat saved yet"}
    except (OSError, ValueError) as e:
        return {"rows": [], "path": str(path), "note": f"cannot read the heat: {e}"}
    n_layers = layers or (max(counts) + 1 if counts else 0)
    n_experts = experts or max((max(c) + 1 for c in counts.values() if c), default=0)
    rows = [[counts.get(layer, {}).get(e, 0) for e in range(n_experts)] for layer in range(n_layers)]
    return {"rows": rows, "path": str(path), "total": sum(map(sum, rows)), "note": None}


class Dashboard:
    """The page and its state route for the daemon at `paths`; `authorize(request)` raises
    where the request lacks the gateway's key (the page sends it when given one).
    `lifespan` runs the history's sampling for as long as the gateway serves."""

    def __init__(self, paths: RuntimePaths, authorize: Callable[[Request], None], timeout: float = 5.0) -> None:
        self.paths = paths
        self.authorize = authorize
        self.timeout = timeout
        self.history = History(self._sampled_status)

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page, methods=["GET"]),
            Route("/dashboard/state", self.state, methods=["GET"]),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        task = asyncio.create_task(self.history.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _status(self, timeout: float) -> tuple[Status | None, str | None]:
        """The daemon's status, or None and why (None: no daemon running)."""
        try:
            with Client(self.paths, timeout=timeout) as client:
                return client.status(), None
        except DaemonNotRunning:
            return None, None
        except ClientError as e:
            return None, str(e)

    def _sampled_status(self) -> Status | None:
        return self._status(min(self.timeout, self.history.period))[0]

    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"cache-control": "no-store"})

    async def state(self, request: Request) -> Response:
        self.authorize(request)
        st, error = await anyio.to_thread.run_sync(self._status, self.timeout)
        # The page reads the status under the names the daemon gives it (shared/status.py).
        shown = {"running": True, **st.to_dict()} if st is not None else {"running": False}
        body: dict[str, Any] = {
            "status": shown | ({"error": error} if error else {}),
            "history": self.history.points(),
            "layer_rates": self.history.layer_rates(),
            "requests": [],
            "heat": {"rows": []},
            "pool_sizes": pool_sizes(st, time.time()),
        }
        if st is not None:
            body["requests"] = [r.to_dict() for r in requests_of(st)]
            body["tokens_made"] = tokens_made(st)
            body["heat"] = await anyio.to_thread.run_sync(heat_map, st)
        return JSONResponse(body, headers={"cache-control": "no-store"})
