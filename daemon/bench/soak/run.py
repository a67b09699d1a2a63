"""`moestreamctl bench soak`: the reliability drivers at full counts, in one report.

On a private copy of the store: the greedy reference in-process, then one daemon that
takes the fuzz run (with a good client in parallel), the soak and the attacks
(daemon/bench/soak/attacks.py: idle connections, a client that never reads, oversized
prompts, sampling below its floors), then the kill -9
rounds (heat keeper, publisher process, real daemon). Every part says `ok`; the report's
`ok` is all of them and an RSS growth under RSS_LIMIT_PCT.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from moestream.daemon.bench.soak import heat_kills
from moestream.daemon.bench.soak.attacks import run_attacks
from moestream.daemon.bench.soak.driver import DaemonProcess, reference_outputs, run_soak, soak_cases
from moestream.daemon.bench.soak.fuzz import exact_request, run_fuzz
from moestream.daemon.pool.expert_reader import ExpertReadError
from moestream.shared.store_format import StoreError, load_manifest

RSS_LIMIT_PCT = 5.0
MAX_REAL_DAEMON_KILLS = 20


class SoakSetupError(Exception):
    """The store cannot be soaked; the message names it as the caller gave it, never its copy."""


def run_bench_soak(
    store: Path | str,
    *,
    capacity: str = "0.25",
    clients: int = 8,
    requests: int = 200,
    cancel_frac: float = 0.2,
    kills: int = 500,
    fuzz: int = 5000,
    seed: int = 0,
    attack_seconds: float = 60.0,
    echo: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run everything; returns the report (see `format_report`). A store that cannot be
    loaded raises `SoakSetupError`."""
    try:
        load_manifest(store)  # before any copy: a folder that is no store is named as given
    except StoreError as e:
        raise SoakSetupError(str(e)) from e
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mssoak"))
    rng = random.Random(seed)
    report: dict[str, Any] = {"store": str(store), "capacity": capacity, "seed": seed}
    tic = time.perf_counter()
    try:
        try:
            own = Path(shutil.copytree(store, root / "store", ignore=shutil.ignore_patterns("pool_usage.json*")))
        except OSError as e:
            raise SoakSetupError(f"cannot copy the store {store} into {root}: {e}") from e
        echo("reference outputs (in-process, greedy)...")
        try:
            reference = reference_outputs(own, capacity, soak_cases())
        except (StoreError, ExpertReadError, ValueError) as e:
            # The first load of the copy is where a broken store shows: say which store it is.
            raise SoakSetupError(str(e).replace(str(own), str(store))) from e
        with DaemonProcess.start(own, root / "rt", capacity=capacity) as daemon:
            if fuzz:
                echo(f"fuzz: {fuzz} messages...")
                report["fuzz"] = run_fuzz(
                    daemon.paths,
                    daemon.pid,
                    fuzz,
                    seed=seed,
                    good_client=exact_request(reference, random.Random(seed + 1)),
                )
            echo(f"soak: {clients} clients x {requests} requests, {cancel_frac:.0%} cancelled or disconnected...")
            report["soak"] = run_soak(
                daemon, reference, clients=clients, requests=requests, cancel_frac=cancel_frac, seed=seed
            )
            report["soak"]["rss_limit_pct"] = RSS_LIMIT_PCT
            if attack_seconds:
                echo(f"attacks: 2100 idle connections, a client not reading for {attack_seconds:g} s, ...")
                report["attacks"] = run_attacks(daemon, reference, seconds=attack_seconds)
            report["daemon_exit_status"] = daemon.stop(60.0)
        if kills:
            real = min(MAX_REAL_DAEMON_KILLS, max(1, kills // 25))
            keeper = (kills - real) // 2
            stand_in = kills - real - keeper
            heat_store, runtime = root / "heat-store", root / "hr"
            heat_store.mkdir()
            runtime.mkdir(mode=0o700)
            echo(f"kill -9: {keeper} heat keepers, {stand_in} publisher processes, {real} daemons...")
            report["kills"] = {
                "keeper": heat_kills.keeper_kills(heat_store, runtime, keeper, rng),
                "stand_in": heat_kills.stand_in_kills(heat_store, runtime, stand_in, rng),
                "daemon": heat_kills.daemon_kills(own, root / "rk", real, rng, capacity=capacity),
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = time.perf_counter() - tic
    report["figures"] = _figures(report)
    f = report["figures"]
    report["ok"] = bool(
        report.get("daemon_exit_status") == 0
        and report["soak"]["ok"]
        and f["rss_growth_pct"] is not None
        and f["rss_growth_pct"] < RSS_LIMIT_PCT
        and ("fuzz" not in report or report["fuzz"]["ok"])
        and ("attacks" not in report or report["attacks"]["ok"])
        and f["invalid_heat_files"] == 0
        and f["heat_bound_violations"] == 0
    )
    return report


def _figures(report: dict[str, Any]) -> dict[str, Any]:
    soak = report["soak"]
    kills = report.get("kills", {})
    fuzz = report.get("fuzz", {})
    attacks = report.get("attacks", {})
    return {
        "attacks_ok": attacks.get("ok"),
        "idle_connections_ok": attacks.get("idle_connections", {}).get("ok"),
        "non_reading_rss_growth_mib": attacks.get("non_reading_client", {}).get("rss_growth_mib"),
        "oversized_other_wait_s": attacks.get("oversized_prompts", {}).get("other_client_waited_s"),
        "tiny_sampling_greedy": attacks.get("tiny_sampling", {}).get("ok"),
        "messages_fuzzed": fuzz.get("messages", 0),
        "fuzz_wrong_replies": fuzz.get("wrong_replies", 0),
        "crashes": fuzz.get("crashes", 0) + (0 if soak["daemon_alive"] else 1),
        "requests": soak["requests"],
        "completed_exact": soak["exact"],
        "cancelled": soak["cancelled"],
        "disconnected": soak["disconnected_seen_by_daemon"],
        "lost_responses": soak["lost_responses"],
        "mismatched_responses": soak["mismatched"],
        "stray_messages": soak["stray_messages"],
        "rss_after_warmup_mib": soak["rss_after_warmup_bytes"] / 2**20,
        "rss_end_mib": soak["rss_end_bytes"] / 2**20,
        "rss_growth_pct": soak["rss_growth_pct"],
        "kills_survived": sum(k["kills"] - k["invalid_files"] - k["violations"] for k in kills.values()),
        "kills": sum(k["kills"] for k in kills.values()),
        "invalid_heat_files": sum(k["invalid_files"] for k in kills.values()),
        "heat_bound_violations": sum(k["violations"] for k in kills.values()),
        "kills_mid_write": kills.get("keeper", {}).get("kills_mid_write", 0),
    }


def format_report(report: dict[str, Any]) -> str:
    f = report["figures"]
    lines = [
        f"store {report['store']}, capacity {report['capacity']}, seed {report['seed']}, {report['seconds']:.0f} s",
        f"  messages fuzzed            {f['messages_fuzzed']} ({f['fuzz_wrong_replies']} wrong replies)",
        f"  daemon crashes             {f['crashes']}",
        f"  soak requests              {f['requests']}: {f['completed_exact']} exact (of which {f['cancelled']} "
        "cancelled, "
        f"a prefix of the reference), {f['disconnected']} disconnected",
        f"  lost responses             {f['lost_responses']} (mismatched {f['mismatched_responses']}, stray "
        f"{f['stray_messages']})",
        f"  daemon RSS                 {f['rss_after_warmup_mib']:.1f} MiB after warm-up -> {f['rss_end_mib']:.1f} MiB "
        f"({f['rss_growth_pct']:+.2f}%, limit {RSS_LIMIT_PCT:g}%)",
        f"  kill -9 survived           {f['kills_survived']} of {f['kills']} ({f['kills_mid_write']} keeper kills "
        "mid-write)",
        f"  invalid heat files         {f['invalid_heat_files']} (bound violations {f['heat_bound_violations']})",
        f"  attacks                    {_attack_line(f)}",
        f"  all checks                 {'ok' if report['ok'] else 'FAILED'}",
    ]
    return "\n".join(lines)


def _attack_line(f: dict[str, Any]) -> str:
    if f["attacks_ok"] is None:
        return "not run"
    idle = "ok" if f["idle_connections_ok"] else "FAILED"
    return (
        f"{'ok' if f['attacks_ok'] else 'FAILED'}: 2100 idle connections {idle}, "
        f"non-reading client {f['non_reading_rss_growth_mib']:+.1f} MiB, other client waited "
        f"{f['oversized_other_wait_s']:.2f} s behind 260 oversized prompts, tiny temperature "
        f"{'greedy' if f['tiny_sampling_greedy'] else 'NOT greedy'}"
    )
