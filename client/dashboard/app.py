"""The dashboard's two routes and the short history of tokens/s they keep."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from moestream.client.client import Client, ClientError, DaemonNotRunning
from moestream.shared.heat_file import group_usage, peek_usage, usage_path
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.settings import Settings, SettingsError

PAGE = Path(__file__).resolve().parent / "static" / "dashboard.html"
# Samples of the token counter kept for the tokens/s chart: 10 minutes at one a second.
HISTORY_SAMPLES = 600
MIN_SAMPLE_SECONDS = 0.5


@dataclass(frozen=True)
class Sample:
    at: float  # wall-clock seconds
    tokens: int  # tokens made so far: those of finished requests and of running ones

    def to_dict(self) -> dict[str, float]:
        return {"at": self.at, "tokens": self.tokens}


def tokens_made(st: dict[str, Any]) -> int:
    req = st.get("requests", {})
    return int(req.get("tokens", 0)) + sum(int(j.get("tokens", 0)) for j in req.get("running", []))


def heat_map(st: dict[str, Any]) -> dict[str, Any]:
    """The routing counts of the served store as rows of layers x experts, from the heat
    file (read only: a corrupt one is the daemon's to set aside)."""
    model, layers, experts = st.get("model"), st.get("moe_layers"), st.get("experts_per_layer")
    if not model:
        return {"rows": [], "note": "no model"}
    try:
        values = {k: v for k, v in (st.get("settings") or {}).items() if v is not None and v != "auto"}
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
    where the request lacks the gateway's key (the page sends it when given one)."""

    def __init__(self, paths: RuntimePaths, authorize: Callable[[Request], None], timeout: float = 5.0) -> None:
        self.paths = paths
        self.authorize = authorize
        self.timeout = timeout
        self.history: deque[Sample] = deque(maxlen=HISTORY_SAMPLES)

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page, methods=["GET"]),
            Route("/dashboard/state", self.state, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"cache-control": "no-store"})

    async def state(self, request: Request) -> Response:
        self.authorize(request)

        def call() -> dict[str, Any]:
            try:
                with Client(self.paths, timeout=self.timeout) as client:
                    st = client.status()
            except DaemonNotRunning:
                return {"running": False}
            except ClientError as e:
                return {"running": False, "error": str(e)}
            return {"running": True, **st}

        st = await anyio.to_thread.run_sync(call)
        if not st["running"]:
            return JSONResponse({"status": st, "heat": {"rows": []}, "history": [s.to_dict() for s in self.history]})
        now = time.time()
        if not self.history or now - self.history[-1].at >= MIN_SAMPLE_SECONDS:
            self.history.append(Sample(now, tokens_made(st)))
        heat = await anyio.to_thread.run_sync(heat_map, st)
        body = {"status": st, "heat": heat, "history": [s.to_dict() for s in self.history]}
        return JSONResponse(body, headers={"cache-control": "no-store"})
