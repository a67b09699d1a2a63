"""Several `moestreamctl generate` at once with no daemon running: one daemon starts, and
every invocation is served by it (the others wait for the one being started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moestream.daemon.bench.soak.driver import child_env
from moestream.shared.runtime_dir import RuntimePaths, lock_is_held

from .conftest import CAPACITY, CASES


def _race(store, workdir, reference, n: int) -> None:
    rt = workdir / "rt"
    prompt, max_tokens = CASES[0]
    argv = [sys.executable, "-m", "moestream.client.cli", "generate", prompt, "--model", str(store)]
    argv += ["--capacity", CAPACITY, "--max-tokens", str(max_tokens), "--runtime-dir", str(rt), "--json"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env()) for _ in range(n)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
        codes = [p.returncode for p in procs]
        failed = [err.decode()[-600:] for (_, err), code in zip(outs, codes) if code != 0]
        assert not failed, f"{len(failed)} of {n} failed: {failed[0]}"
        ref = reference[(prompt, max_tokens)]
        for out, _ in outs:
            assert json.loads(out)["tokens"] == list(ref.tokens)
    finally:
        paths = RuntimePaths(dir=rt, log=rt / "daemon.log")
        if lock_is_held(paths):
            subprocess.run([*argv[:3], "stop", "--runtime-dir", str(rt)], env=child_env(), timeout=60)


def test_three_concurrent_autostarts_are_all_served(store_copy, workdir, rel_reference):
    _race(store_copy, workdir, rel_reference, 3)


@pytest.mark.slow
def test_twelve_concurrent_autostarts_are_all_served(store_copy, workdir, rel_reference):
    _race(store_copy, workdir, rel_reference, 12)
