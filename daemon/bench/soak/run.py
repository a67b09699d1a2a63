"""`moestreamctl bench soak`: the reliability drivers at full counts, in one report.

On a private copy of the store: the greedy reference in-process, then one daemon that
takes the fuzz run (with a good client in parallel), the soak and the attacks
(`attacks`: "daemon" runs daemon/bench/soak/attacks.py, idle connections, a client that
never reads, oversized prompts, sampling below its floors, connection churn, and then
cache_attacks.py on daemons of their own, planted files and FIFOs in the prompt-cache
folder; "gateway" runs gateway_attacks.py through three gateways on it, slowloris,
connection caps, a web page's cross-origin and DNS-rebound requests, oversized bodies, a
greedy client, cached-token probing), then the kill -9
rounds (heat keeper, publisher process, real daemon). Every part says `ok`; the report's
`ok` is all of them and an RSS growth under RSS_LIMIT_PCT.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ....shared.store_format import StoreError, load_manifest
from ...pool.expert_reader import ExpertReadError
from . import heat_kills
from .attacks import run_attacks
from .cache_attacks import run_cache_attacks
from .driver import DaemonProcess, reference_outputs, run_soak, soak_cases
from .fuzz import exact_request, run_fuzz
from .gateway_attacks import SLOWLORIS_CONNECTIONS, run_gateway_attacks

RSS_LIMIT_PCT = 5.0
MAX_REAL_DAEMON_KILLS = 20
# What `attacks` may choose: the daemon's, the gateway's, both, or none.
ATTACK_CHOICES = {"all": ("daemon", "gateway"), "daemon": ("daemon",), "gateway": ("gateway",), "none": ()}


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
    attacks: str = "all",
    echo: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run everything; returns the report (see `format_report`). A store that cannot be
    loaded raises `SoakSetupError`; `attacks` is a key of ATTACK_CHOICES."""
    if attacks not in ATTACK_CHOICES:
        raise ValueError(f"[run_bench_soak] attacks must be one of {', '.join(ATTACK_CHOICES)}, got {attacks!r}")
    chosen = ATTACK_CHOICES[attacks]
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
            if "daemon" in chosen and attack_seconds:
                echo(f"attacks: 2100 idle connections, a client not reading for {attack_seconds:g} s, ...")
                report["attacks"] = run_attacks(daemon, reference, seconds=attack_seconds)
            if "gateway" in chosen:
                echo(f"gateway attacks: {SLOWLORIS_CONNECTIONS} slowloris connections, cross-origin requests, ...")
                report["gateway_attacks"] = run_gateway_attacks(daemon, reference)
            report["daemon_exit_status"] = daemon.stop(60.0)
        if "daemon" in chosen and attack_seconds:
            echo("prompt-cache folder: planted links, relabelled and corrupt files, FIFOs...")
            report["cache_attacks"] = run_cache_attacks(own, root / "cache", reference, capacity=capacity)
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
        and ("cache_attacks" not in report or report["cache_attacks"]["ok"])
        and ("gateway_attacks" not in report or report["gateway_attacks"]["ok"])
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
        "churn_ok": attacks.get("connection_churn", {}).get("ok"),
        "churn_sockets": attacks.get("connection_churn", {}).get("sockets"),
        "churn_refused_busy": attacks.get("connection_churn", {}).get("clients", {}).get("refused_busy"),
        **cache_figures(report.get("cache_attacks", {})),
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
        **gateway_figures(report.get("gateway_attacks", {})),
    }


def gateway_figures(gw: dict[str, Any]) -> dict[str, Any]:
    """The figures of `run_gateway_attacks`' report (None each where it did not run)."""
    slow, caps = gw.get("slowloris", {}), gw.get("connection_caps", {})
    browser, bodies = gw.get("browser_requests", {}), gw.get("oversized_bodies", {})
    return {
        "gateway_attacks_ok": gw.get("ok"),
        "slowloris_connections": slow.get("connections"),
        "slowloris_keyed_latency_max_s": slow.get("keyed_latency_max_s"),
        "slowloris_keyed_baseline_max_s": max(slow["keyed_baseline_s"]) if slow else None,
        "slowloris_keyed_exact": slow.get("keyed_exact"),
        "gateway_connections_closed": caps.get("closed_by_gateway"),
        "gateway_connections_left_open": caps.get("left_open"),
        "cross_origin_403": _got(browser, "cross_origin"),
        "foreign_host_403": _got(browser, "foreign_host"),
        "not_json_415": _got(browser, "not_json"),
        "oversized_bodies": bodies.get("bodies"),
        "oversized_413": (bodies.get("declared_413", 0) + bodies.get("chunked_413", 0)) if bodies else None,
        "gateway_rss_growth_mib": bodies.get("gateway_rss_growth_mib"),
        "gateway_log_bytes": gw.get("log_bytes"),
        "greedy_refused_429": gw.get("greedy_client", {}).get("refused_429"),
        "greedy_other_waited_s": gw.get("greedy_client", {}).get("other_waited_s"),
        "greedy_other_alone_s": gw.get("greedy_client", {}).get("other_alone_s"),
        "probes": gw.get("cached_token_probing", {}).get("probes"),
        "probe_tokens_learned": gw.get("cached_token_probing", {}).get("tokens_learned"),
        "probe_shared_learned": gw.get("cached_token_probing", {}).get("shared_learned"),
    }


def cache_figures(cache: dict[str, Any]) -> dict[str, Any]:
    """The figures of `run_cache_attacks`' report (None each where it did not run)."""
    planted, fifo = cache.get("planted_cache_files", {}), cache.get("cache_fifo", {})
    return {
        "cache_attacks_ok": cache.get("ok"),
        "planted_cache_files": planted.get("planted"),
        "planted_refused_removed": min(planted["refused"], planted["removed"]) if planted else None,
        "planted_answers_exact": f"{planted['exact']}/{planted['requests']}" if planted else None,
        "fifo_ready_s": fifo.get("ready_s"),
        "fifo_stop_s": fifo.get("stop_s"),
    }


def _got(browser: dict[str, Any], kind: str) -> str | None:
    part = browser.get(kind)
    return f"{part['got_expected']}/{part['requests']}" if part else None


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
        f"  prompt-cache folder        {_cache_line(f)}",
        *gateway_lines(f),
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
        + ("" if f.get("churn_ok") is None else f", churn {'ok' if f['churn_ok'] else 'FAILED'}")
    )


def _cache_line(f: dict[str, Any]) -> str:
    if f["cache_attacks_ok"] is None:
        return "not run"
    return (
        f"{'ok' if f['cache_attacks_ok'] else 'FAILED'}: {f['planted_refused_removed']} of "
        f"{f['planted_cache_files']} planted files refused and removed, answers {f['planted_answers_exact']} exact; "
        f"FIFOs: ready in {f['fifo_ready_s']:.1f} s, stopped in {f['fifo_stop_s']:.1f} s"
    )


def gateway_lines(f: dict[str, Any]) -> list[str]:
    """The report's lines on the gateway attacks."""
    if f["gateway_attacks_ok"] is None:
        return ["  gateway attacks            not run"]
    return [
        f"  gateway attacks            {'ok' if f['gateway_attacks_ok'] else 'FAILED'}; log "
        f"{f['gateway_log_bytes'] / 2**10:.0f} KiB",
        f"    slowloris                keyed completions within {f['slowloris_keyed_latency_max_s']:.2f} s "
        f"({f['slowloris_keyed_baseline_max_s']:.2f} s without), "
        f"{'exact' if f['slowloris_keyed_exact'] else 'NOT exact'}, beside {f['slowloris_connections']} "
        f"half-open connections",
        f"    connection caps          {f['gateway_connections_closed']} of them closed, "
        f"{f['gateway_connections_left_open']} left open",
        f"    browser pages            403 for {f['cross_origin_403']} cross-origin and {f['foreign_host_403']} "
        f"foreign-Host requests, 415 for {f['not_json_415']} not JSON",
        f"    oversized bodies         413 for {f['oversized_413']} of {f['oversized_bodies']} (gateway RSS "
        f"{f['gateway_rss_growth_mib']:+.1f} MiB)",
        *(
            []
            if f.get("greedy_refused_429") is None
            else [
                f"    greedy client            {f['greedy_refused_429']} refused; the other waited "
                f"{f['greedy_other_waited_s']:.2f} s ({f['greedy_other_alone_s']:.2f} s alone)"
            ]
        ),
        *(
            []
            if f.get("probes") is None
            else [
                f"    cached-token probing     {f['probe_tokens_learned']} tokens learned in {f['probes']} probes "
                f"({f['probe_shared_learned']} with a shared cache)"
            ]
        ),
    ]


def _yes(ok: Any, text: str) -> str:
    return text if ok else f"FAILED ({text})"


def reliability_table_markdown(report: dict[str, Any], name: str) -> str:
    """The README's reliability table: each attack, what the daemon or gateway does, and
    its figure from `report` (a `bench soak --json` report saved as `name`)."""
    f, soak = report["figures"], report["soak"]
    attacks, gw = report.get("attacks", {}), report.get("gateway_attacks", {})
    bodies = gw.get("oversized_bodies", {})
    rows = [
        (
            "protocol fuzzing: random bytes, broken msgpack, wrong types, huge fields",
            "the reply `shared/protocol.py` predicts for each; same process throughout",
            f"{f['messages_fuzzed']} messages, {f['fuzz_wrong_replies']} wrong replies, {f['crashes']} crashes",
        ),
        (
            f"{soak['clients']} clients × {soak['requests_per_client']} requests, {soak['cancel_frac']:.0%} cancelled "
            "or disconnected",
            "every response equals `--local` (a cancelled one a prefix of it); none lost or crossed",
            f"{f['requests']}: {f['completed_exact']} exact ({f['cancelled']} cancelled), {f['disconnected']} "
            f"disconnected, {f['lost_responses']} lost; RSS {f['rss_growth_pct']:+.2f}%",
        ),
        (
            "kill -9 of the heat keeper, a publisher, the daemon",
            "`pool_usage.json` always parses, never goes backwards",
            f"{f['kills_survived']} of {f['kills']} survived, {f['invalid_heat_files']} invalid files",
        ),
    ]
    if attacks:
        idle, reader = attacks["idle_connections"], attacks["non_reading_client"]
        rows += [
            (
                f"{idle['connections']:,} idle connections",
                "file limit raised to the hard limit; past `max_connections` refused as busy",
                _yes(idle["ok"], "served exactly"),
            ),
            (
                "a client that never reads its replies",
                "its reply queue is bounded: dropped, its requests cancelled, logged once",
                _yes(reader["ok"], f"daemon RSS {reader['rss_growth_mib']:+.1f} MiB in {reader['seconds']:g} s"),
            ),
            (
                f"{attacks['oversized_prompts']['prompts']} prompts at the size limit from one client",
                "checked off the engine thread, in turns by client",
                _yes(
                    attacks["oversized_prompts"]["ok"],
                    f"another client waited {f['oversized_other_wait_s']:.2f} s",
                ),
            ),
            (
                "temperature 1e-39, top_p 1e-46",
                "greedy (below 0.001 and 1e-6)",
                _yes(f["tiny_sampling_greedy"], "greedy for every seed"),
            ),
        ]
        if "connection_churn" in attacks:
            churn = attacks["connection_churn"]
            rows.append(
                (
                    f"{churn['sockets']:,} sockets reconnecting every 1 ms, past a 1,000-file limit",
                    "`max_connections` at most the file room; near the limit the socket is renamed away: busy, "
                    "never EMFILE",
                    _yes(
                        churn["ok"],
                        f"{churn['pings']:,} pings, {churn['clients'].get('refused_busy', 0):,} refused as busy; "
                        f"a new client heard {churn['new_client_heard'][0]}; served exactly",
                    ),
                )
            )
    cache = report.get("cache_attacks", {})
    if cache:
        planted, fifo = cache["planted_cache_files"], cache["cache_fifo"]
        rows += [
            (
                "prompt-cache folder: links at a cache file's and a temporary file's names, another prompt's file "
                "relabelled, flipped bytes",
                "opened without following links; a file's MAC under the user's key; refused files removed, never "
                "served",
                _yes(
                    planted["ok"],
                    f"{min(planted['refused'], planted['removed'])} of {planted['planted']} refused and removed, "
                    f"{planted['targets_changed']} written through; {planted['exact']}/{planted['requests']} exact",
                ),
            ),
            (
                f"prompt-cache folder: {fifo['fifos']} FIFOs at a cache, temporary and budget file's names",
                "never opened blocking: skipped, removed or written over",
                _yes(
                    fifo["ok"],
                    f"ready in {fifo['ready_s']:.1f} s ({fifo['ready_without_s']:.1f} s without), served exactly, "
                    f"`stop` in {fifo['stop_s']:.1f} s",
                ),
            ),
        ]
    if gw:
        rows += [
            (
                f"gateway: {f['slowloris_connections']:,} slowloris connections past its file limit",
                "header and body timeouts; caps per address and in all close the oldest idle or half-open one",
                _yes(
                    gw["slowloris"]["ok"] and gw["connection_caps"]["ok"],
                    f"keyed completion in {f['slowloris_keyed_latency_max_s']:.2f} s "
                    f"({f['slowloris_keyed_baseline_max_s']:.2f} s alone); {f['gateway_connections_closed']} "
                    "closed",
                ),
            ),
            (
                "gateway: a web page's cross-origin, DNS-rebound (Host) and not-JSON requests",
                "403, 403 and 415 (`gateway_origins` allows more origins)",
                _yes(
                    gw["browser_requests"]["ok"],
                    f"{f['cross_origin_403']}, {f['foreign_host_403']}, {f['not_json_415']}",
                ),
            ),
            (
                f"gateway: bodies of {bodies['body_bytes'] / 2**20:g} MiB, declared or chunked",
                f"413 once past {bodies['limit_bytes'] / 2**20:g} MiB, unread",
                _yes(
                    bodies["ok"],
                    f"{f['oversized_413']} of {f['oversized_bodies']}; RSS {f['gateway_rss_growth_mib']:+.1f} MiB",
                ),
            ),
        ]
        if "greedy_client" in gw:
            greedy = gw["greedy_client"]
            rows.append(
                (
                    f"gateway: one address's {greedy['streams']} streams, never read, then another address's request",
                    "half the request slots per address (429 past them); the daemon's next slot to the client that "
                    "waited; an unread stream paused, then cancelled",
                    _yes(
                        greedy["ok"],
                        f"{greedy['refused_429']} refused; the other served exactly in "
                        f"{greedy['other_waited_s']:.2f} s"
                        + (f" ({greedy['other_alone_s']:.2f} s alone)" if "other_alone_s" in greedy else ""),
                    ),
                )
            )
        if "cached_token_probing" in gw:
            probing = gw["cached_token_probing"]
            rows.append(
                (
                    f"gateway: {probing['probes']} guesses of another client's secret prompt, the right one among "
                    "them, read from `cached_tokens`",
                    "cached prompts reused only by requests naming the same user, or none from the same address",
                    _yes(
                        probing["ok"],
                        f"{probing['tokens_learned']} tokens learned ({probing['shared_learned']} with "
                        "`--share-prompt-cache`)",
                    ),
                )
            )
    out = ["| attack | what the daemon or gateway does | figure (`" + name + "`) |", "| --- | --- | --- |"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moestream.daemon.bench.soak.run", description="The README's reliability table."
    )
    parser.add_argument("report", help="a `moestreamctl bench soak --json` report")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    sys.stdout.write(reliability_table_markdown(report, args.report.rsplit("/", 1)[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
