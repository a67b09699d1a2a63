"""Fixtures of the reliability suite: one tiny store and its greedy reference outputs,
built once per session, and daemons started as child processes in private runtime
folders under /tmp (short paths: ipc socket paths are limited to about 107 bytes)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from moestream.daemon.bench.soak.driver import DaemonProcess, Reference, reference_outputs, soak_cases

CAPACITY = "0.25"
# A small slice of the soak cases keeps the reference quick to compute.
CASES = soak_cases(max_tokens=(8, 16))


@pytest.fixture(scope="session")
def rel_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="msr"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def rel_store(rel_root: Path) -> Path:
    """A tiny qwen3_moe expert store (2 MoE layers of 16 experts); copy it before
    changing it (`store_copy`)."""
    from tiny_models import make_tiny_model

    from moestream.daemon.store.convert import convert_model

    src = make_tiny_model(rel_root / "model", "qwen3_moe", quant="4bit", seed=11)
    convert_model(src, rel_root / "store")
    return rel_root / "store"


@pytest.fixture(scope="session")
def rel_reference(rel_store: Path) -> dict[tuple[str, int], Reference]:
    """What `generate --local` gives for each case of CASES."""
    return reference_outputs(rel_store, CAPACITY, CASES)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A fresh folder under /tmp for one test's store copy and runtime folders."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="msw"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store_copy(rel_store: Path, workdir: Path) -> Path:
    """A private copy of the tiny store, free to damage."""
    return Path(shutil.copytree(rel_store, workdir / "store", ignore=shutil.ignore_patterns("pool_usage.json*")))


@pytest.fixture
def start_daemon(workdir: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """`start_daemon(store, name="rt", **kw) -> DaemonProcess` (see DaemonProcess.start);
    every daemon started is stopped (or killed) at the end of the test."""
    started: list[DaemonProcess] = []

    def start(store: Path, name: str = "rt", **kw) -> DaemonProcess:
        d = DaemonProcess.start(store, workdir / name, capacity=kw.pop("capacity", CAPACITY), **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.alive():
            try:
                d.stop(15.0)
            except RuntimeError:
                d.kill()
