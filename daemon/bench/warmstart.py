"""`moestreamctl bench warmstart`: time to the first N tokens after a daemon restart,
with and without pinning the hottest experts (AUTOPIN).

One run first routes the prompt so that the store has heat for it. Then, `rounds` times,
a daemon is started with `--autopin-frac 0` (cold: every expert comes from disk on
demand) and one with the given fraction (pinned: the hottest experts are read before the
daemon reports ready, into the pool and, with `host_cache`, into the host-RAM tier),
each answers the same greedy request and is stopped. The store's
own `pool_usage.json` is put back as it was at the end.

Imports no MLX: it drives real daemons through the client library.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ...client.cli.daemon import start_daemon, stop_daemon
from ...client.client import Client
from ...shared.runtime_dir import RuntimePaths
from ...shared.settings import Settings
from ...shared.store_format import POOL_USAGE_NAME
from .common import default_of, timed_progress


def _timed_request(paths: RuntimePaths, prompt: str, tokens: int) -> dict[str, Any]:
    with Client(paths, timeout=600.0) as client:
        tic = time.perf_counter()
        result = client.complete(prompt, max_tokens=tokens)
        seconds = time.perf_counter() - tic
        status = client.status()
    stats = result.stats
    placement = stats.mapped_pool or {}
    return {
        "seconds": seconds,
        "tokens": len(result.tokens),
        "token_ids": result.tokens,
        # A mapped pool's hits are the routed experts that were in GPU memory.
        "hit_rate": placement.get("gpu_hit_rate") if stats.mapped else stats.hit_rate,
        # Bytes admitted into the pool, from the host tier or the disk (the pool's
        # `bytes_read`): with a tier, not all of it came from the disk.
        "bytes_read": stats.bytes_read,
        "autopin": status.autopin,
    }


def _one_daemon(
    store: Path,
    capacity: str,
    autopin_frac: float,
    io_threads: int,
    prompt: str,
    tokens: int,
    mapped: bool,
    host_cache: str | None,
    say: Callable[[str], None],
    label: str,
) -> dict[str, Any]:
    runtime = Path(tempfile.mkdtemp(dir="/tmp", prefix="mswarm"))
    given: dict[str, Any] = {
        "model": str(store),
        "capacity": capacity,
        "autopin_frac": autopin_frac,
        "io_threads": io_threads,
        "runtime_dir": str(runtime),
    }
    # Said either way: the daemon's default (auto) could pick a mapped pool on its own.
    given["mapped"] = mapped
    if host_cache:
        given["host_cache"] = host_cache
    settings = Settings.resolve(given)
    paths = RuntimePaths.from_settings(settings)
    try:
        say(f"{label}: starting a daemon (autopin {autopin_frac:g})")
        tic = time.perf_counter()
        start_daemon(settings, given, timeout=600.0, echo=False)
        ready = time.perf_counter() - tic
        run = _timed_request(paths, prompt, tokens)
        run["start_to_ready_seconds"] = ready
        say(f"{label}: ready in {ready:.2f} s, {run['tokens']} tokens in {run['seconds']:.3f} s")
        return run
    finally:
        stop_daemon(paths, timeout=60.0)
        shutil.rmtree(runtime, ignore_errors=True)


def run_bench_warmstart(
    store: Path,
    *,
    capacity: str = "0.25",
    autopin_frac: float = default_of("autopin_frac"),
    prompt: str = "def fibonacci(n):",
    tokens: int = 64,
    rounds: int = 3,
    io_threads: int = default_of("io_threads"),
    mapped: bool = False,
    host_cache: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time the cold and pinned daemons; `progress` gets a line as each daemon starts
    and when it has answered (as `bench decode`'s does)."""
    say = timed_progress(progress)
    # The daemons it starts resolve the heat folder from the same environment and config.
    usage = Settings.resolve({"model": str(store)}).heat_folder(store) / POOL_USAGE_NAME
    saved = usage.read_bytes() if usage.exists() else None
    try:
        usage.unlink(missing_ok=True)
        common = (io_threads, prompt, tokens, mapped, host_cache, say)
        heat_run = _one_daemon(store, capacity, 0.0, *common, "heat (routes the prompt once)")
        cold, pinned = [], []
        for r in range(rounds):
            cold.append(_one_daemon(store, capacity, 0.0, *common, f"round {r + 1}/{rounds} cold"))
            pinned.append(_one_daemon(store, capacity, autopin_frac, *common, f"round {r + 1}/{rounds} pinned"))
    finally:
        if saved is None:
            usage.unlink(missing_ok=True)
        else:
            tmp = usage.with_name(usage.name + ".bench-restore")
            tmp.write_bytes(saved)
            tmp.replace(usage)

    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "seconds_to_tokens": statistics.median(r["seconds"] for r in runs),
            "seconds_runs": [r["seconds"] for r in runs],
            "start_to_ready_seconds": statistics.median(r["start_to_ready_seconds"] for r in runs),
            "hit_rate": statistics.median(r["hit_rate"] or 0.0 for r in runs),
            "bytes_read": statistics.median(r["bytes_read"] or 0 for r in runs),
            "autopin": runs[-1]["autopin"],
        }

    c, p = summary(cold), summary(pinned)
    same = all(r["token_ids"] == heat_run["token_ids"] for r in cold + pinned)
    return {
        "store": str(store),
        "capacity": capacity,
        "mapped": mapped,
        "host_cache": host_cache,
        "autopin_frac": autopin_frac,
        "prompt": prompt,
        "tokens": tokens,
        "rounds": rounds,
        "cold": c,
        "pinned": p,
        "pinned_over_cold": p["seconds_to_tokens"] / c["seconds_to_tokens"],
        "same_tokens_every_run": same,
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"time to the first {r['tokens']} tokens after a restart, capacity {r['capacity']}"
        f"{' (mapped pool)' if r.get('mapped') else ''}"
        f"{' with a host tier of ' + r['host_cache'] if r.get('host_cache') else ''}, median of {r['rounds']}",
        f"{'':8} {'seconds':>9} {'ready in':>9} {'hit rate':>9} {'MB admitted':>12}",
    ]
    for name in ("cold", "pinned"):
        s = r[name]
        lines.append(
            f"{name:8} {s['seconds_to_tokens']:>9.3f} {s['start_to_ready_seconds']:>9.2f} {s['hit_rate']:>9.3f} "
            f"{s['bytes_read'] / 1e6:>12.2f}"
        )
    lines.append(f"pinned / cold: {r['pinned_over_cold']:.3f}; same tokens in every run: {r['same_tokens_every_run']}")
    return "\n".join(lines)
