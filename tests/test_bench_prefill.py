"""`moestreamctl bench prefill` end to end on the CPU: a real run of the command, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import tiny_store

from moestream.shared.settings import demo_store_path


def _bench(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "moestream.client.cli", "bench", "prefill", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def tiny():
    with tiny_store("bench-prefill") as store:
        yield store


def test_layer_major_reads_the_minimum_and_chunk_order_more(tiny):
    """Three chunks of 16 tokens: the layer-major pool reads what the prompt routes and
    the pool lacks, once each (plus what the first token's forward adds); stock's order
    reads more."""
    report = _bench("--model", str(tiny), "--prompt-tokens", "48", "--prefill-step", "16", "--chunked")
    configs = {c["name"]: c for c in report["configs"]}
    assert list(configs) == ["stock", "100%", "25% disk", "25% disk, chunk order"]
    stock = configs["stock"]["results"][0]
    assert stock["prompt_tokens"] == 48 and stock["ttft_s"] > 0 and stock["peak_memory_bytes"] > 0
    full = configs["100%"]["results"][0]
    assert full["min_bytes"] == 0 and full["read_bytes"] == 0 and full["bound_s"] == stock["ttft_s"]
    layer = configs["25% disk"]["results"][0]
    chunked = configs["25% disk, chunk order"]["results"][0]
    assert layer["min_bytes"] > 0 and layer["staged_bytes"] > 0
    assert layer["min_bytes"] <= layer["read_bytes"] < chunked["read_bytes"]
    # The store's bytes count every read the engine delivered, those made a layer ahead
    # into the prefetch buffer included (the admitter's own count misses them).
    assert layer["disk_bytes"] > 0 and chunked["disk_bytes"] >= chunked["read_bytes"]
    assert configs["25% disk"]["prefill_order"].startswith("layer")
    assert layer["bound_s"] > stock["ttft_s"] and layer["ratio_to_bound"] == layer["ttft_s"] / layer["bound_s"]
    assert report["bandwidth"]["disk_bytes_per_s"] > 0 and report["bandwidth"]["link_bytes_per_s"] > 0


def test_demo_model_with_a_host_tier_prints_a_table():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moestream.client.cli",
            "bench",
            "prefill",
            "--model",
            str(demo_store_path()),
            "--prompt-tokens",
            "24",
            "--host-cache",
            "16M",
            # The forecast's compute probe (tests/test_plan.py) would double the time.
            "--no-forecast",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split()[0] for line in out.stdout.splitlines()[3:] if line.strip()]
    assert rows == ["stock", "100%", "25%", "25%"], out.stdout  # + host, then disk
    assert "25% + host 16.0 MiB" in out.stdout and "x bound" in out.stdout
