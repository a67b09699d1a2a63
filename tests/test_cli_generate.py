"""`moestreamctl generate --local` (client/cli/generate.py) against the library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moestream.daemon.model.generation import SamplingParams, generate
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings


@pytest.fixture(scope="module")
def store(pool_store):
    return pool_store


def test_cli_generate_local_json_matches_library(store):
    exe = Path(sys.executable).with_name("moestreamctl")
    out = subprocess.run(
        [
            str(exe),
            "generate",
            "--local",
            "--model",
            str(store),
            "--prompt-ids",
            "1,2,3,4,5",
            "--capacity",
            "25%",
            "--max-tokens",
            "12",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    sm = load_streaming_model(store, Settings(capacity=0.25))
    try:
        want = generate(sm, [1, 2, 3, 4, 5], SamplingParams(max_tokens=12))
    finally:
        sm.close()
    assert got["tokens"] == want.tokens and got["text"] == want.text
    for key in (
        "hits",
        "misses",
        "bytes_read",
        "host_syncs_per_token",
        "tokens_per_s",
        "peak_memory_bytes",
        "rss_bytes",
    ):
        assert key in got["stats"]


def test_cli_refuses_bad_capacity(store):
    exe = Path(sys.executable).with_name("moestreamctl")
    out = subprocess.run(
        [str(exe), "generate", "--local", "--model", str(store), "--capacity", "1", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "below the minimum" in out.stderr


def test_cli_local_on_a_truncated_resident_file_says_one_clean_line(store, tmp_path):
    """A store whose resident weights file was cut short: `--local` says which file and
    what to do, as the daemon does, not MLX's traceback."""
    from moestream.shared.store_format import load_manifest

    broken = Path(shutil.copytree(store, tmp_path / "store"))
    name = load_manifest(broken).resident_files[0]
    os.truncate(broken / name, (broken / name).stat().st_size // 2)
    exe = Path(sys.executable).with_name("moestreamctl")
    out = subprocess.run(
        [str(exe), "generate", "--local", "--model", str(broken), "--max-tokens", "2", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{broken}: resident weights file {name} cannot be read" in out.stderr
