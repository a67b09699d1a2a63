"""Running `moestreamctl` as a child process in tests, with none of the developer's
moestream settings (environment or config file), and waiting for what it does."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from moestream.daemon.bench.soak.driver import child_env
from moestream.shared.runtime_dir import RuntimePaths


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for child processes, without the developer's moestream settings."""
    return child_env(extra)


def ctl(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, input_text: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream.client.cli", *args],
        capture_output=True,
        text=True,
        env=env or clean_env(),
        timeout=timeout,
        input=input_text,
    )


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `predicate` until it returns something true; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@contextmanager
def started_daemon(store: Path, prefix: str, *flags: str, env: dict[str, str] | None = None) -> Iterator[RuntimePaths]:
    """`moestreamctl start` on `store` in a fresh short runtime folder under /tmp (ipc
    socket paths are limited to about 107 bytes), with `env` added to the clean
    environment (settings without a flag); stopped and removed afterwards."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))
    out = ctl("start", "--model", str(store), "--runtime-dir", str(rt), *flags, env=clean_env(**(env or {})))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "daemon started" in out.stderr
    try:
        yield RuntimePaths(dir=rt, log=rt / "daemon.log")
    finally:
        stopped = ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)
        assert stopped.returncode == 0, stopped.stderr
