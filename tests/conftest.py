"""Shared pytest fixtures, and the run's own home folder.

Every test process (and every daemon, gateway and CLI it starts, which inherit the
environment) runs with a `$HOME`, XDG folders and runtime folder of the run's own, so the
suite never writes the user's heat, caches, config or sockets; at the end the user's
moestream folders are checked to be as they were."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import pytest

from moestream.shared.kernel_cache import default_kernel_cache_dir
from moestream.shared.settings import default_config_file, default_state_dir

# XDG_DATA_HOME: where `pull` keeps stores; HF_HOME: huggingface_hub's cache and token.
_ISOLATED = (
    "HOME",
    "XDG_STATE_HOME",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_RUNTIME_DIR",
    "XDG_DATA_HOME",
    "HF_HOME",
)
_HOME = pytest.StashKey[Path]()
_USERS = pytest.StashKey[tuple[list[Path], dict[str, tuple[int, int]]]]()


def _users_folders(env: dict[str, str]) -> list[Path]:
    # The runtime folder is isolated too but not compared: a daemon of the user's own,
    # running meanwhile, writes its log there.
    return [default_state_dir(env), default_kernel_cache_dir(env).parent, default_config_file(env).parent]


def _snapshot(folders: list[Path]) -> dict[str, tuple[int, int]]:
    seen: dict[str, tuple[int, int]] = {}
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                seen[path] = (st.st_mtime_ns, st.st_size)
    return seen


def pytest_configure(config: pytest.Config) -> None:
    users = _users_folders(dict(os.environ))
    config.stash[_USERS] = (users, _snapshot(users))
    home = config.stash[_HOME] = Path(tempfile.mkdtemp(prefix="moestream-test-home-"))
    for name in _ISOLATED:
        os.environ[name] = str(home if name == "HOME" else home / name.lower())
    (home / "xdg_runtime_dir").mkdir(mode=0o700)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _HOME in config.stash:
        shutil.rmtree(config.stash[_HOME], ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    folders, before = session.config.stash[_USERS]
    after = _snapshot(folders)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        shown = "\n  ".join(changed[:20])
        print(
            "\nthe user's moestream folders changed during the run (tests must use their own; or another program "
            f"of the user's wrote there meanwhile):\n  {shown}"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
