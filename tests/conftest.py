"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_model(arch, quant="4bit", seed=0, shards=1) -> Path`: a tiny model folder in
    the mlx-community layout (see tests/tiny_models.py), built once per session and
    shared: copy it before changing it."""
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")

    def build(arch: str, quant: str = "4bit", seed: int = 0, shards: int = 1) -> Path:
        path = root / f"{arch}-{quant}-seed{seed}-shards{shards}"
        if not (path / "config.json").is_file():
            make_tiny_model(path, arch, quant=quant, seed=seed, shards=shards)
        return path

    return build


@pytest.fixture(scope="session")
def pool_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny store of the pool's tests (tests/pool_store.py), built once per session:
    copy it before changing it."""
    from pool_store import make_pool_store

    return make_pool_store(tmp_path_factory.mktemp("pool"))
