"""The built-in demo model: it is the default, it streams, and it is exact like any model."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
from moestream.daemon.pool.capacity import top_k_of
from moestream.shared.settings import Settings, demo_store_path
from moestream.shared.store_format import load_manifest

STEPS = 24


def _logits(model, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    tokens, rows = [], []
    for _ in range(STEPS):
        token = mx.argmax(logits, axis=-1)
        rows.append(np.array(logits.astype(mx.float32)))
        tokens.append(int(token.item()))
        logits = model(token[None], cache=cache)[:, -1, :]
    return tokens, rows


def test_demo_store_ships_and_is_the_default():
    store = demo_store_path()
    manifest = load_manifest(store)
    size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file() and not f.name.startswith("pool_usage"))
    assert size <= 8 * 10**6, f"the demo store is {size} bytes; the budget is 8 MB"
    assert manifest.model_type == "qwen3_moe"
    assert Settings.resolve({}, env={}).model == str(store)


@pytest.fixture(scope="module")
def stock():
    store = demo_store_path()
    tokenizer_prompt = load_streaming_model(store, Settings(capacity=1.0))
    try:
        prompt = tokenizer_prompt.tokenizer.encode("def fibonacci(n):\n    ")
    finally:
        tokenizer_prompt.close()
    return prompt, _logits(load_stock_model(store), prompt)


def test_demo_model_is_exact_against_stock_at_every_capacity(stock):
    prompt, (want_tokens, want_logits) = stock
    manifest = load_manifest(demo_store_path())
    k, experts = top_k_of(manifest.config), manifest.layers[0].num_experts
    for slots in (k, math.ceil(0.25 * experts), math.ceil(0.5 * experts), experts):
        sm = load_streaming_model(demo_store_path(), Settings(capacity=slots, policy="lru"))
        try:
            got_tokens, got_logits = _logits(sm.model, prompt)
        finally:
            sm.close()
        assert got_tokens == want_tokens, f"capacity {slots}: tokens differ"
        for step, (a, b) in enumerate(zip(got_logits, want_logits)):
            assert np.array_equal(a, b), f"capacity {slots} step {step}: logits differ"


def test_generate_uses_the_demo_model_and_writes_python(tmp_path):
    exe = Path(sys.executable).with_name("moestreamctl")
    env = {"PATH": str(exe.parent), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    out = subprocess.run(
        [
            str(exe),
            "generate",
            "--local",
            "--max-tokens",
            "48",
            "--temp",
            "0.6",
            "--top-p",
            "0.9",
            "--seed",
            "2",
            "--json",
            "def fibonacci(n):",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["tokens"]) > 8
    text = result["text"]
    # Trained on the standard library: the continuation looks like Python source.
    assert any(word in text for word in ("return", "self", "def ", "if ", "import", '"""', "    ")), text


def test_the_demo_models_heat_goes_to_the_users_state_folder(tmp_path):
    """The demo store lives inside the installed package: its pool_usage.json is kept
    in the user's state folder, never written into the package.

    The runtime folder is a short one under /tmp, not under tmp_path: on macOS tmp_path
    (under /private/var/folders/...) puts the socket past the 103-byte limit. There the
    test checks the same thing: a daemon started by `generate`, its heat in the state
    folder."""
    import tempfile

    from moestream.shared.settings import Settings, demo_store_path
    from moestream.shared.store_format import POOL_USAGE_NAME

    in_package = demo_store_path() / POOL_USAGE_NAME
    before = in_package.stat().st_mtime_ns if in_package.exists() else None
    exe = Path(sys.executable).with_name("moestreamctl")
    env = {
        "PATH": str(exe.parent),
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msdm"))
    env["MOESTREAM_RUNTIME_DIR"] = str(rt)
    out = subprocess.run(
        [str(exe), "generate", "--max-tokens", "8", "def f(x):"], capture_output=True, text=True, timeout=120, env=env
    )
    try:
        assert out.returncode == 0, out.stderr
    finally:
        stopped = subprocess.run(
            [str(exe), "stop", "--runtime-dir", str(rt)], capture_output=True, text=True, timeout=60, env=env
        )
        shutil.rmtree(rt, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stderr
    folder = Settings().heat_folder(demo_store_path(), env)
    assert folder.is_relative_to(tmp_path / "state" / "moestream" / "heat")
    assert (folder / POOL_USAGE_NAME).is_file(), "the daemon flushes the heat when it stops"
    after = in_package.stat().st_mtime_ns if in_package.exists() else None
    assert after == before, "heat was written into the installed package"


def test_heat_folder_rules(tmp_path):
    from moestream.shared.settings import Settings, demo_store_path

    store = tmp_path / "store"
    store.mkdir()
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    assert Settings().heat_folder(store, env) == store.resolve()
    assert Settings(heat_dir=str(tmp_path / "mine")).heat_folder(store, env) == tmp_path / "mine"
    demo = Settings().heat_folder(demo_store_path(), env)
    assert demo.parent == tmp_path / "state" / "moestream" / "heat" and demo.name.startswith("store-")
    # A reinstall puts the demo elsewhere: the same store (by id), so the same heat.
    moved = shutil.copytree(demo_store_path(), tmp_path / "site-packages" / "store")
    assert Settings().heat_folder(moved, env) == demo
