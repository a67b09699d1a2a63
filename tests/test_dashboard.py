"""The live dashboard (`GET /` of the gateway): its heat map and token counter from a
status, its JSON route against a real daemon, and the page in a real headless Chromium
(Debian's `chromium`): it renders without console errors, shows what `status --json`
says, and a screenshot is saved."""

from __future__ import annotations

import contextlib
import html.parser
import json
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from daemon_cli import clean_env, ctl, wait_for
from test_openai_gateway import Gateway

from moestream.client.client import Client
from moestream.client.dashboard import heat_map
from moestream.client.dashboard.app import SAMPLE_SECONDS, History, tokens_made
from moestream.client.dashboard.png import HIGH, INK, LOW, heat_canvas, ramp, write_heat_png
from moestream.shared.heat_file import write_usage
from moestream.shared.settings import Settings, demo_store_path
from moestream.shared.status import RequestsStatus, Status, from_wire

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The folder where the browser test leaves its screenshots (docs/dashboard_*.png are theirs).
SHOT_ENV = "MOESTREAM_TEST_SCREENSHOT"


def test_heat_map_rows_from_the_heat_file(tmp_path):
    status = Status(
        state="ready",
        model=str(tmp_path / "store"),
        moe_layers=2,
        experts_per_layer=4,
        settings={**Settings().flag_values(), "heat_dir": str(tmp_path)},
    )
    assert heat_map(status)["note"] == "no heat saved yet"
    # An expert-parallel group's rank files (disjoint experts), while no single file is there.
    write_usage(tmp_path / "pool_usage.rank0of2.json", {0: {0: 4}})
    write_usage(tmp_path / "pool_usage.rank1of2.json", {0: {1: 1}, 1: {3: 2}})
    assert heat_map(status)["rows"] == [[4, 1, 0, 0], [0, 0, 0, 2]]
    write_usage(tmp_path / "pool_usage.json", {0: {1: 5, 3: 2}, 1: {0: 7}})
    heat = heat_map(status)
    assert heat["rows"] == [[0, 5, 0, 2], [7, 0, 0, 0]] and heat["total"] == 14
    (tmp_path / "pool_usage.json").write_text("{not json")
    assert "cannot read the heat" in heat_map(status)["note"]
    assert (tmp_path / "pool_usage.json").exists()  # left for the daemon to set aside


def test_tokens_made_count_the_running_requests_tokens():
    st = from_wire(
        Status,
        {
            "state": "ready",
            "requests": {"tokens": 961, "running": [{"id": "a", "tokens": 2341}], "waiting": [{"id": "b"}]},
        },
    )
    assert tokens_made(st) == 961 + 2341


def test_history_draws_rates_and_leaves_gaps_where_nothing_was_sampled():
    def status(tokens: int, pid: int = 1) -> Status:
        return Status(state="ready", pid=pid, requests=RequestsStatus(tokens=tokens))

    h = History(lambda: None, period=2.0)
    for at, st in [
        (0, status(0)),
        (2, status(10)),
        (4, status(30)),
        (6, None),  # no daemon answered
        (8, status(5, pid=2)),  # a new daemon, counting from 0 again
        (10, status(15, pid=2)),
        (30, status(25, pid=2)),  # the gateway did not sample in between
        (32, status(20, pid=2)),  # a failed request's tokens left the count: no negative rate
    ]:
        h.add(st, at)
    assert [p["tps"] for p in h.points()] == [None, 5.0, 10.0, None, None, 5.0, None, 0.0]
    assert [p["tokens"] for p in h.points()][3] is None

    def broken() -> Status:
        raise KeyError("pid")

    failing = History(broken)
    failing.sample()  # a status it cannot read is a gap, and the sampler goes on
    assert [p["tokens"] for p in failing.points()] == [None]
    bounded = History(lambda: None, keep=3)
    for at in range(5):
        bounded.add(status(at), float(at))
    assert [p["at"] for p in bounded.points()] == [2.0, 3.0, 4.0]


def test_history_is_sampled_on_its_own_timer_with_no_page_polling():
    """The gateway's sampler reads the daemon's status every period by itself, so a page
    opened later finds the minutes before it (the state route adds no sample)."""
    import asyncio
    import threading

    reads: list[int] = []
    third = threading.Event()

    def read() -> Status:
        reads.append(len(reads))
        if len(reads) == 3:
            third.set()
        return from_wire(
            Status,
            {"state": "ready", "pid": 7, "requests": {"tokens": 4 * len(reads), "running": [{"id": "r", "tokens": 1}]}},
        )

    history = History(read, period=0.01)

    async def serve() -> None:
        sampler = asyncio.create_task(history.run())
        try:
            assert await asyncio.to_thread(third.wait, 60), "the sampler did not sample"
        finally:
            sampler.cancel()

    asyncio.run(serve())
    points = history.points()
    assert len(points) >= 3 and [p["tokens"] for p in points[:3]] == [5, 9, 13]


@contextlib.contextmanager
def _served(tmp_path: Path, *flags: str) -> Iterator[tuple[Path, Gateway, dict[str, str]]]:
    """The demo's daemon (with `flags`; none: the default, full pool) and a gateway in
    front of it, started in that order and both stopped at the end: (runtime folder,
    gateway, the daemon's environment)."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="dsh"))
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "heat"), MOESTREAM_HEAT_FLUSH_SECONDS="0.2")
    out = ctl("start", "--model", str(demo_store_path()), "--runtime-dir", str(rt), *flags, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    gateway = None
    try:
        gateway = Gateway(rt, rt / "gateway.log")
        yield rt, gateway, env
    finally:
        if gateway is not None:
            gateway.stop()
        stopped = ctl("stop", "--runtime-dir", str(rt), env=env)
        shutil.rmtree(rt, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stderr


def _state(gateway: Gateway) -> dict:
    return httpx.get(gateway.url + "/dashboard/state", timeout=30).json()


def test_the_state_of_a_full_pool_shows_the_running_request_and_moving_counts(tmp_path):
    """On the default (full) pool, while an OpenAI client's request decodes: the state
    lists it (phase, tokens, the client as the gateway names it), counts its tokens among
    those made, and the layers' routings and hit rates move; the history was sampled
    before any page asked for it."""
    import openai

    with _served(tmp_path) as (rt, gateway, env):
        before = _state(gateway)  # the gateway sampled from its start, with no page open
        assert before["status"]["capacity"] == before["status"]["experts_per_layer"] == 64
        seen: list[int] = []
        stop = threading.Event()

        def chat() -> None:
            oa = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
            stream = oa.chat.completions.create(
                model="moestream",
                # An answer that runs to max_tokens at this seed (most of the demo's end soon).
                messages=[
                    {"role": "system", "content": "You write long stories."},
                    {"role": "user", "content": "Write a long story about zip and map."},
                ],
                max_tokens=2000,
                temperature=1.0,
                seed=3,
                stream=True,
            )
            for chunk in stream:
                seen.append(1)
                if stop.is_set():
                    stream.close()
                    return

        talker = threading.Thread(target=chat)
        talker.start()
        try:

            def decoding() -> dict | None:
                st = _state(gateway)
                running = [r for r in st["requests"] if r["phase"] == "decode" and r["tokens"] >= 3]
                return st if running else None

            st = wait_for(decoding, 120, "the request to decode")
        finally:
            stop.set()
            talker.join(60)
        job = next(r for r in st["requests"] if r["phase"] == "decode")
        assert job["id"].startswith("chatcmpl-") and job["max_tokens"] == 2000
        assert job["client"].startswith("/v1/chat/completions from 127.0.0.1 (OpenAI/Python"), job["client"]
        finished = st["status"]["requests"]["tokens"]
        assert st["tokens_made"] == finished + job["tokens"] > finished
        # Counted at full residency too: routings per layer, every one a hit.
        layers = st["status"]["pool"]["layers"]
        assert all(la["resident"] == la["capacity"] == 64 for la in layers)
        assert all(la["routed"] > 0 and la["hit_rate"] == 1.0 for la in layers), layers
        assert st["status"]["pool"]["hit_rate"] == 1.0
        wait_for(lambda: _state(gateway)["heat"].get("total", 0) > 0, 30, "the heat to be saved")
        # The history: the gateway's own samples, every SAMPLE_SECONDS however often a
        # page asks (these requests came every few milliseconds), from its start on.
        # Three samples at least, the last taken since tokens were made (on a loaded machine
        # all three may come before the request's first token, each counting 0).
        history = wait_for(
            lambda: (h := _state(gateway)["history"]) and len(h) >= 3 and h[-1]["tokens"] and h,
            60,
            "three samples, the last since tokens were made",
        )
        assert not before["history"] or history[0]["at"] <= before["history"][0]["at"]
        # Sampled on the gateway's clock, not per request: each sample starts a period or
        # more after the one before and takes its `at` when its status read ends (a period
        # later at most, its timeout; a loaded machine adds a little), so n samples span
        # about (n - 2) periods or more. A sample per request would have made hundreds.
        span = history[-1]["at"] - history[0]["at"]
        assert len(history) <= span / SAMPLE_SECONDS + 3, history
        assert history[-1]["tokens"] > history[0]["tokens"] == 0


class _Dom(html.parser.HTMLParser):
    """Elements by id (their attributes and text) and the layer rows of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict] = {}
        self.layers: list[dict] = []
        self.rows: list[dict] = []
        self._open: list[dict] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        node = {"tag": tag, "attrs": a, "text": ""}
        if "id" in a:
            self.by_id[a["id"]] = node
        if tag == "tr" and "data-layer" in a:
            self.layers.append(a)
        if tag == "tr":
            self.rows.append(a)
        if tag not in ("meta", "br", "img", "input", "polyline"):
            self._open.append(node)

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for node in self._open:
            node["text"] += data


def _chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}",
            "--virtual-time-budget=6000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class _Completion:
    """A streamed completion through the gateway's OpenAI API (the real `openai` client)
    on a thread of its own, until it ends or `stop()`."""

    def __init__(self, gateway: Gateway, prompt: str | list[int], max_tokens: int) -> None:
        import openai

        self._client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
        self._stop = threading.Event()
        self.chunks = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(prompt, max_tokens))
        self._thread.start()

    def _run(self, prompt: str | list[int], max_tokens: int) -> None:
        try:
            stream = self._client.completions.create(
                model="moestream", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            for _ in stream:
                self.chunks += 1
                if self._stop.is_set():
                    stream.close()  # the gateway cancels it in the daemon
                    return
        except BaseException as e:  # raised in the test by stop()
            self.error = e

    def stop(self, timeout: float = 120) -> None:
        """Stop it at its next chunk (a prompt still prefilled has none before its end)."""
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive() and self.error is None, self.error


def _page(gateway: Gateway, shot: Path) -> _Dom:
    """The page as headless Chromium renders it: a screenshot into `shot`, then its DOM
    (checked for script errors, failed fetches and console errors)."""
    taken = _chromium(f"--screenshot={shot}", "--window-size=1280,820", "--hide-scrollbars", gateway.url + "/")
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = _chromium("--dump-dom", gateway.url + "/")
    assert page.returncode == 0, page.stderr[-2000:]
    dom = _Dom()
    dom.feed(page.stdout)
    assert dom.by_id["errors"]["text"] == "", dom.by_id["errors"]["text"]
    console = [line for line in page.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    return dom


# A greedy decode of this prompt loops on the demo model and never makes its end token: a
# request that runs until it is stopped.
ENDLESS = "def fibonacci(n):"


@pytest.mark.slow  # a daemon, a gateway, a 2k-token prompt and four browser runs: minutes on a shared 2-core machine
def test_the_page_in_headless_chromium_shows_live_requests_on_the_default_pool(tmp_path):
    """The dashboard of the demo on its default (full) pool, in a real headless Chromium,
    while a request decodes and while a long prompt is prefilled beside it: it renders
    without errors, shows what `status --json` says, the running requests with their
    phase, progress and client, tokens made with the running requests' own, the layers'
    routings and hit rates, the heat and the history. The two screenshots are saved (into
    the folder MOESTREAM_TEST_SCREENSHOT names: docs/ has the ones committed)."""
    if CHROMIUM is None:
        pytest.fail("needs a headless Chromium: apt-get install chromium (Debian's package)")
    shots = Path(os.environ.get(SHOT_ENV) or tmp_path)
    # No prompt cache: each long prompt below is prefilled in full.
    with _served(tmp_path, "--prompt-cache-bytes", "0") as (rt, gateway, env):
        with Client(rt, timeout=60) as c:
            for prompt in ("def route(hidden, gate, k=2):", "import os"):
                c.complete(prompt, max_tokens=16)
        wait_for(lambda: (tmp_path / "heat" / "pool_usage.json").exists(), 30, "the heat file")
        decode = _Completion(gateway, ENDLESS, max_tokens=8000)
        try:

            def decoding(st: dict) -> list[dict]:
                return [r for r in st["requests"] if r["phase"] == "decode" and r["tokens"] >= 3]

            wait_for(lambda: decoding(_state(gateway)), 120, "the request to decode")
            # A history of a few samples while it decodes (one every 2 s): the chart has a line.
            points = len(_state(gateway)["history"])
            wait_for(lambda: len(_state(gateway)["history"]) >= points + 5, 60, "five samples of the decode")
            dom = _page(gateway, shots / "dashboard_decode.png")
            st = json.loads(ctl("status", "--runtime-dir", str(rt), "--json", env=env).stdout)

            def value(element: str) -> str:
                return dom.by_id[element]["attrs"]["data-value"]

            assert dom.by_id["state"]["attrs"].get("data-value") == "ready"
            assert value("model") == st["model"] and int(value("pid")) == st["pid"]
            mem, req = st["memory"], st["requests"]
            assert int(value("mem-resident")) == mem["resident_weights_bytes"]
            assert int(value("mem-pool")) == mem["pool_bytes"]
            assert int(value("mem-tier")) == mem["host_tier_bytes"]
            assert abs(int(value("mem-rss")) - mem["rss_bytes"]) < 0.1 * mem["rss_bytes"]
            assert int(value("req-completed")) == req["completed"] == 2 and req["tokens"] == 32
            # Tokens made: the ended requests' and the running one's.
            assert int(value("req-tokens")) > req["tokens"]
            rows = [r for r in dom.rows if r.get("data-request")]
            assert [r["data-phase"] for r in rows] == ["decode"], rows
            assert rows[0]["data-client"].startswith("/v1/completions from 127.0.0.1 (OpenAI/Python")
            assert int(rows[0]["data-tokens"]) >= 3
            # A full pool: every layer's routings counted, every one a hit.
            assert float(value("hit-rate")) == 1.0
            shown = [(int(r["data-resident"]), int(r["data-capacity"]), int(r["data-pinned"])) for r in dom.layers]
            assert shown == [(la["resident"], la["capacity"], la["pinned"]) for la in st["pool"]["layers"]]
            assert all(float(r["data-hit-rate"]) == 1.0 and int(r["data-routed"]) > 0 for r in dom.layers)
            assert int(dom.by_id["heat"]["attrs"]["data-layers"]) == 5
            assert int(dom.by_id["heat"]["attrs"]["data-total"]) > 0
            assert int(dom.by_id["tps-chart"]["attrs"]["data-points"]) > 0  # the history, on the first load

            # A long prompt beside it: shown in its prefill, with its progress. Where the
            # prefill ended before the page was drawn (a fast machine), a longer one is tried.
            for attempt, length in enumerate((2048, 8192)):
                ids = [5 + (i * (7 + attempt)) % 90 for i in range(length)]
                long = _Completion(gateway, ids, max_tokens=2)
                try:

                    def prefilling() -> bool:
                        """Its prefill on the way: past its first layer (its progress comes per layer)."""
                        return any(
                            r["phase"] == "prefill" and r["prompt_tokens"] == len(ids) and r["prefilled_tokens"]
                            for r in _state(gateway)["requests"]
                        )

                    wait_for(prefilling, 300, "the long prompt's prefill past its first layer")
                    dom = _page(gateway, shots / "dashboard_prefill.png")
                finally:
                    # MLX's CPU build prefilled the demo at 10-20 tokens/s on a shared 2-core machine.
                    long.stop(timeout=900)
                rows = {r["data-phase"]: r for r in dom.rows if r.get("data-request")}
                if "prefill" in rows:
                    break
            else:
                pytest.fail("the page never caught the long prompt in its prefill")
            assert "decode" in rows and rows["prefill"]["data-client"].startswith("/v1/completions from 127.0.0.1")
            assert 0 < int(rows["prefill"].get("data-prefilled", 0)) < len(ids)
        finally:
            decode.stop()


def _decode_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of a PNG as png.py writes it (8-bit RGB, filter 0)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat = data.index(b"IDAT")
    raw = zlib.decompress(data[idat + 4 : idat + 4 + struct.unpack(">I", data[idat - 4 : idat])[0]])
    stride = 1 + 3 * width
    assert all(raw[y * stride] == 0 for y in range(height))
    return width, height, b"".join(raw[y * stride + 1 : (y + 1) * stride] for y in range(height))


def test_the_heat_png_has_one_colour_scale_with_its_numbers_axes_and_a_title(tmp_path):
    rows = [[0, 50, 100], [30, 0, 0]]
    out = tmp_path / "heat.png"
    write_heat_png(out, rows, "demo: routings per expert")
    width, height, rgb = _decode_png(out.read_bytes())
    _, lay = heat_canvas(rows, "demo: routings per expert")

    def at(x: int, y: int) -> tuple[int, int, int]:
        i = 3 * (y * width + x)
        return tuple(rgb[i : i + 3])

    def cell(layer: int, expert: int) -> tuple[int, int, int]:
        return at(lay.grid_x + expert * lay.cell_w + 1, lay.grid_y + layer * lay.cell_h + 1)

    # One scale for every layer: 0 is white, the hottest expert of all the top colour, and
    # layer 1's hottest (30 of 100) a light one, not its own top.
    assert lay.top == 100
    assert cell(0, 0) == LOW and cell(0, 2) == HIGH and cell(0, 1) == ramp(0.5)
    assert cell(1, 0) == ramp(0.3) != HIGH
    # The scale's bar runs from the colour of 0 to the top's, its numbers under it.
    assert at(lay.scale_x, lay.scale_y + 2) == LOW
    assert at(lay.scale_x + lay.scale_w - 1, lay.scale_y + 2) == HIGH

    def inked(x0: int, y0: int, x1: int, y1: int) -> bool:
        return any(at(x, y) == INK for y in range(y0, y1) for x in range(x0, x1))

    assert inked(0, 0, width, lay.grid_y - 16)  # the title
    assert inked(0, lay.grid_y, lay.grid_x - 2, lay.grid_y + 2 * lay.cell_h)  # layer numbers
    grid_bottom = lay.grid_y + 2 * lay.cell_h
    assert inked(lay.grid_x, grid_bottom + 4, width, lay.scale_y - 2)  # expert numbers, "EXPERT"
    assert inked(lay.scale_x, lay.scale_y + 12, lay.scale_x + lay.scale_w + 1, height)  # the scale's numbers
    with pytest.raises(ValueError):
        heat_canvas([[1, 2], [3]], "ragged")


def test_heatmap_command_writes_the_demo_models_png(tmp_path):
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "none"))
    out = ctl("heatmap", "--model", str(demo_store_path()), "--out", str(tmp_path / "h.png"), env=env)
    assert out.returncode == 0 and "5 layers x 64 experts from" in out.stdout and "routing_counts.json" in out.stdout
    width, height, _ = _decode_png((tmp_path / "h.png").read_bytes())
    assert width >= 64 * 12 and height > 5 * 12
    (tmp_path / "heat").mkdir()
    write_usage(tmp_path / "heat" / "pool_usage.json", {0: {1: 3}})
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "heat"))
    own = ctl("heatmap", "--model", str(demo_store_path()), "--out", str(tmp_path / "o.png"), env=env)
    assert own.returncode == 0 and str(tmp_path / "heat") in own.stdout  # the saved heat comes first
    # Only an expert-parallel group's rank files: their sum.
    (tmp_path / "group").mkdir()
    write_usage(tmp_path / "group" / "pool_usage.rank0of2.json", {0: {0: 3}})
    write_usage(tmp_path / "group" / "pool_usage.rank1of2.json", {0: {1: 3}})
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "group"))
    grouped = ctl("heatmap", "--model", str(demo_store_path()), "--out", str(tmp_path / "g.png"), env=env)
    assert grouped.returncode == 0 and "2 ranks' heat files" in grouped.stdout, grouped.stdout + grouped.stderr
    # A link planted where the heat file goes is not followed (as the daemon does not):
    # a clear error, the file it points at untouched.
    (tmp_path / "linked").mkdir()
    secret = tmp_path / "secret.json"
    write_usage(secret, {0: {2: 5}})
    (tmp_path / "linked" / "pool_usage.json").symlink_to(secret)
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "linked"))
    linked = ctl("heatmap", "--model", str(demo_store_path()), "--out", str(tmp_path / "l.png"), env=env)
    assert linked.returncode == 1 and "symbolic link" in linked.stderr, linked.stdout + linked.stderr
    assert not (tmp_path / "l.png").exists() and secret.is_file()


def test_dashboard_command_gives_the_gateways_address():
    from click.testing import CliRunner

    from moestream.client.cli import main

    out = CliRunner().invoke(main, ["dashboard", "--print-url", "--port", "9999"])
    assert out.exit_code == 0 and out.output.strip() == "http://127.0.0.1:9999/"
    out = CliRunner().invoke(main, ["dashboard", "--print-url", "--host", "::1"])
    assert out.output.strip() == "http://[::1]:8080/"
