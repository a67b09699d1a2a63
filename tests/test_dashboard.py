"""The live dashboard (`GET /` of the gateway): its heat map and token counter from a
status, its JSON route against a real daemon, and the page in a real headless Chromium
(Debian's `chromium`): it renders without console errors, shows what `status --json`
says, and a screenshot is saved."""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import httpx
import pytest
from daemon_cli import clean_env, ctl, wait_for
from test_openai_gateway import Gateway

from moestream.client.client import Client
from moestream.client.dashboard import heat_map
from moestream.client.dashboard.app import tokens_made
from moestream.client.dashboard.png import HIGH, LOW, encode_png, write_heat_png
from moestream.shared.heat_file import write_usage
from moestream.shared.settings import Settings, demo_store_path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Where the browser test leaves its screenshot (tests/bench/results/dashboard_demo.png is one).
SHOT_ENV = "MOESTREAM_TEST_SCREENSHOT"


def test_heat_map_rows_from_the_heat_file(tmp_path):
    status = {
        "model": str(tmp_path / "store"),
        "moe_layers": 2,
        "experts_per_layer": 4,
        "settings": {**Settings().flag_values(), "heat_dir": str(tmp_path)},
    }
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
    assert tokens_made({"requests": {"tokens": 10, "running": [{"tokens": 3}]}}) == 13


class _Dom(html.parser.HTMLParser):
    """Elements by id (their attributes and text) and the layer rows of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict] = {}
        self.layers: list[dict] = []
        self._open: list[dict] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        node = {"tag": tag, "attrs": a, "text": ""}
        if "id" in a:
            self.by_id[a["id"]] = node
        if tag == "tr" and "data-layer" in a:
            self.layers.append(a)
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


@pytest.mark.slow  # a daemon, a gateway and two browser runs: about 30 s on a shared 2-core machine
def test_the_page_in_headless_chromium_shows_what_status_says(tmp_path):
    if CHROMIUM is None:
        pytest.fail("needs a headless Chromium: apt-get install chromium (Debian's package)")
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="dsh"))
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "heat"), MOESTREAM_HEAT_FLUSH_SECONDS="0.2")
    out = ctl("start", "--model", str(demo_store_path()), "--runtime-dir", str(rt), "--capacity", "0.5", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    gateway = None
    try:
        with Client(rt, timeout=30.0) as c:
            for prompt in ("def route(hidden, gate, k=2):", "import os"):
                c.complete(prompt, max_tokens=16)
            wait_for(lambda: (tmp_path / "heat" / "pool_usage.json").exists(), 10, "the heat file")
        gateway = Gateway(rt, rt / "gateway.log")
        state = httpx.get(gateway.url + "/dashboard/state", timeout=10).json()
        assert state["status"]["state"] == "ready" and len(state["heat"]["rows"]) == 5
        assert state["heat"]["total"] > 0 and len(state["heat"]["rows"][0]) == 64

        page = _chromium("--dump-dom", gateway.url + "/")
        assert page.returncode == 0, page.stderr[-2000:]
        st = json.loads(ctl("status", "--runtime-dir", str(rt), "--json", env=env).stdout)
        dom = _Dom()
        dom.feed(page.stdout)
        # Rendered, with no script error, no failed fetch and no console error.
        assert dom.by_id["errors"]["text"] == "", dom.by_id["errors"]["text"]
        console = [line for line in page.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
        assert not console, console
        assert dom.by_id["state"]["attrs"].get("data-value") == "ready"

        def value(element: str) -> str:
            return dom.by_id[element]["attrs"]["data-value"]

        assert value("model") == st["model"] and int(value("pid")) == st["pid"]
        mem, req = st["memory"], st["requests"]
        assert int(value("mem-resident")) == mem["resident_weights_bytes"]
        assert int(value("mem-pool")) == mem["pool_bytes"]
        assert int(value("mem-tier")) == mem["host_tier_bytes"]
        assert abs(int(value("mem-rss")) - mem["rss_bytes"]) < 0.1 * mem["rss_bytes"]
        assert int(value("req-completed")) == req["completed"] == 2
        assert int(value("req-tokens")) == req["tokens"] == 32
        assert float(value("hit-rate")) == pytest.approx(st["pool"]["hit_rate"])
        shown = [(int(r["data-resident"]), int(r["data-capacity"]), int(r["data-pinned"])) for r in dom.layers]
        assert shown == [(la["resident"], la["capacity"], la["pinned"]) for la in st["pool"]["layers"]]
        assert int(dom.by_id["heat"]["attrs"]["data-layers"]) == 5
        assert int(dom.by_id["heat"]["attrs"]["data-total"]) > 0

        shot = Path(os.environ.get(SHOT_ENV) or tmp_path / "dashboard.png")
        taken = _chromium(f"--screenshot={shot}", "--window-size=1280,900", "--hide-scrollbars", gateway.url + "/")
        assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        if gateway is not None:
            gateway.stop()
        stopped = ctl("stop", "--runtime-dir", str(rt), env=env)
        shutil.rmtree(rt, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stderr


def test_the_heat_png_decodes_to_the_counts_colours(tmp_path):
    rows = [[0, 5, 10], [3, 0, 0]]
    out = tmp_path / "heat.png"
    write_heat_png(out, rows, cell=2)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (6, 2 * 2 + 1)  # two layers of 2-pixel cells, one line between
    idat = data.index(b"IDAT")
    raw = zlib.decompress(data[idat + 4 : idat + 4 + struct.unpack(">I", data[idat - 4 : idat])[0]])
    stride = 1 + 3 * width
    first = raw[1:stride]
    assert tuple(first[0:3]) == LOW and tuple(first[12:15]) == HIGH  # 0 and the layer's hottest
    assert tuple(raw[4 * stride + 1 : 4 * stride + 4]) == HIGH  # layer 1's hottest, its own scale
    with pytest.raises(ValueError):
        encode_png([])


def test_heatmap_command_writes_the_demo_models_png(tmp_path):
    env = clean_env(MOESTREAM_HEAT_DIR=str(tmp_path / "none"))
    out = ctl("heatmap", "--model", str(demo_store_path()), "--out", str(tmp_path / "h.png"), env=env)
    assert out.returncode == 0 and "5 layers x 64 experts from" in out.stdout and "routing_counts.json" in out.stdout
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
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
