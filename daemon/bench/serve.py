"""`moestreamctl bench serve`: a load generator through the real daemon and the real
client library, as vLLM's serving benchmark does.

One daemon is started on the store (in its own runtime folder) and warmed with one
request. Then, for each client count N (after N untimed requests, one per client, that
compile the kernels of a new batch size), N threads (each with its own `Client`, so its
own socket) take requests from one queue of `requests` until it is empty; each request
is a random prompt of `prompt_tokens` token ids and asks for `max_tokens` tokens,
sampled at `temp` with a seed of its own. Reported per N: aggregate tokens/s (tokens
made over the level's wall time), time to the first token and inter-token latency
(p50 and p99, over every request and every gap between its `token` events), and the
daemon's own per-request tokens/s. Every level runs the same requests, so their tokens
can be compared across levels: with seeds, a request's text does not depend on its
company (`same_tokens_at_every_level`). The daemon runs without a prompt cache, so that
each level prefills those prompts itself. `rounds` runs every level again in turn.

Imports no MLX: it drives a real daemon through the client library.
"""

from __future__ import annotations

import queue
import random
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ...client.cli.daemon import start_daemon, stop_daemon
from ...client.client import Client
from ...shared import protocol as proto
from ...shared.runtime_dir import RuntimePaths
from ...shared.settings import Settings
from ...shared.store_format import load_manifest
from .common import default_of, timed_progress


@dataclass(frozen=True)
class BenchServeSettings:
    store: Path
    clients: tuple[int, ...] = (1, 2, 4, 8)
    # Requests per level, shared by its clients (at least one per client).
    requests: int = 8
    prompt_tokens: int = 32
    max_tokens: int = 64
    # Sampled, seeded per request: a random-weight model decodes greedily into loops,
    # which route far more regularly than a real model.
    temp: float = 1.0
    seed: int = 0
    capacity: str | None = None
    host_cache: str | None = None
    # None: the daemon's own choice (mapped = auto).
    mapped: bool | None = None
    io_threads: int = default_of("io_threads")
    # The daemon's max_batch; 0: its default, which batches up to 8 while its steps measure
    # faster a token than lone ones (1 measures the requests taking turns).
    max_batch: int = 0
    # Before each level, one untimed request per client (prompts of their own): a batch
    # of a size not seen yet compiles its kernels on its first steps (on the H200, 40 s
    # of an 8-client level's 43).
    warmup: bool = True
    # Times every level runs, every other round in reverse order (1 2 4 8, 8 4 2 1, ...):
    # the H200's decode is paced by its host, whose speed drifts by up to 2x over
    # minutes (tests/bench/RESULTS.md), so that levels run once each in turn compare
    # moments, not client counts. Each level reports its medians over the rounds.
    rounds: int = 1
    # Beside the batching daemon, a second one whose requests take turns (max_batch 1),
    # each level run on both within each round (in alternating order): the batch's gain
    # measured side by side, and a lone request's cost of batching (the one-client level).
    against_turns: bool = False


def _percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


@dataclass(frozen=True)
class _Request:
    index: int
    prompt_ids: tuple[int, ...]
    seed: int


def _one_request(
    client: Client, req: _Request, settings: BenchServeSettings, t0: float | None = None
) -> dict[str, Any]:
    """One request's tokens and timings; `t0`: the level's start, from which its
    `timeline_s` (sent, first token, done) is measured."""
    tic = time.perf_counter()
    stamps: list[float] = []
    done: proto.Done | None = None
    for event in client.generate(
        prompt_ids=req.prompt_ids, max_tokens=settings.max_tokens, temp=settings.temp, seed=req.seed
    ):
        if isinstance(event, proto.Token):
            stamps.append(time.perf_counter())
        elif isinstance(event, proto.Done):
            done = event
    end = time.perf_counter()
    if done is None:
        raise RuntimeError(f"request {req.index} ended without its result")
    return {
        "index": req.index,
        "tokens": list(done.tokens),
        "finish_reason": done.finish_reason,
        "ttft_s": (stamps[0] - tic) if stamps else None,
        "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])],
        "seconds": end - tic,
        "daemon_tokens_per_s": done.stats.tokens_per_s,
        "cached_tokens": done.stats.cached_tokens,
        "timeline_s": [x - t0 for x in (tic, stamps[0] if stamps else end, end)] if t0 is not None else None,
    }


def _numeric(d: dict[str, Any] | None) -> dict[str, float]:
    return {k: v for k, v in (d or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _counts(paths: RuntimePaths) -> tuple[dict[str, float], dict[str, float]]:
    """The daemon's counters now (`status`), the numeric ones: its batch's, and its
    mapped pool's placement (empty without one)."""
    with Client(paths, timeout=60.0) as client:
        status = client.status()
    return _numeric(status.batch), _numeric(status.pool.mapped_pool)


def _placement_during(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a mapped pool's placement did between two readings: routed pairs, those
    found in GPU memory (and their share), moves, rebalances, and the seconds of its
    read-backs (on the decode thread), decisions and driver calls (on its worker)."""
    if not after:
        return {}
    out = {k: after[k] - before.get(k, 0) for k in after if k not in ("gpu_hit_rate", "gpu_slots")}
    out["gpu_hit_rate"] = out["routed_on_gpu"] / out["routed"] if out.get("routed") else None
    return out


def _batch_during(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the batch did between two readings of its counters: steps, tokens, joins and
    the seconds of each kind of work (decode steps, prefills), beside which the level's
    wall shows the rest."""
    if not after:
        return {}
    keep = ("steps", "tokens", "joined")
    out = {k: after[k] - before.get(k, 0) for k in after if k in keep or k.endswith("_s")}
    out["max_size"] = after.get("max_size", 0)
    return out


def steps_only_tokens_per_s(tokens: int, batch: dict[str, float]) -> float | None:
    """`tokens` over the seconds of a level's decode steps alone; None where it has none."""
    stepping = batch.get("decode_s", 0.0)
    return tokens / stepping if stepping else None


def _level(paths: RuntimePaths, n: int, requests: list[_Request], settings: BenchServeSettings) -> dict[str, Any]:
    before, placed_before = _counts(paths)
    work: queue.SimpleQueue[_Request] = queue.SimpleQueue()
    for r in requests:
        work.put(r)
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client_thread() -> None:
        try:
            with Client(paths, timeout=600.0) as client:
                while True:
                    try:
                        req = work.get_nowait()
                    except queue.Empty:
                        return
                    out = _one_request(client, req, settings, tic)
                    with lock:
                        results.append(out)
        except BaseException as e:  # handed to the caller below, which raises it
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=client_thread, name=f"bench-serve-{i}") for i in range(n)]
    # Read by the threads once started: when the level began.
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    after, placed_after = _counts(paths)
    batch = _batch_during(before, after)
    if errors:
        raise RuntimeError(f"{n} clients: a client failed: {errors[0]}") from errors[0]
    results.sort(key=lambda r: r["index"])
    tokens = sum(len(r["tokens"]) for r in results)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    gaps = [g for r in results for g in r["gaps_s"]]
    daemon_tps = [r["daemon_tokens_per_s"] for r in results if r["daemon_tokens_per_s"]]
    return {
        "clients": n,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall if wall else None,
        "ttft_p50_s": _percentile(ttft, 0.5),
        "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_p50_s": _percentile(gaps, 0.5),
        "itl_p99_s": _percentile(gaps, 0.99),
        "daemon_tokens_per_s_median": statistics.median(daemon_tps) if daemon_tps else None,
        # Prompt tokens the daemon served from its prompt cache (none: it runs without one).
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "token_ids": [r["tokens"] for r in results],
        # Each request's (sent, first token, done), seconds from the level's start: where
        # the level's wall goes beside its decode steps (joins, prefills, its tail).
        "timeline_s": [r["timeline_s"] for r in results],
        # The daemon's batch over the level (empty when it does not batch).
        "batch": batch,
        # A mapped pool's placement over the level (empty without one).
        "placement": _placement_during(placed_before, placed_after),
        # What the level would make if nothing but its decode steps took time (the batch's
        # and the lone request's): the ceiling that prefills, joins and clients lower.
        "steps_only_tokens_per_s": steps_only_tokens_per_s(tokens, batch),
    }


# A level's figures that its rounds report as their median.
_MEDIAN_KEYS = (
    "aggregate_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "daemon_tokens_per_s_median",
    "steps_only_tokens_per_s",
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _over_rounds(rounds: list[dict[str, Any]], one: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One client count's level from its rounds: the median of each figure over them,
    and its ratios to one client (aggregate tok/s, inter-token p50) as the median of
    each round's ratio to the same round's one-client level (None without one). The
    rest (tokens, wall, the batch's counters, the timeline) is the first round's, and
    `rounds` holds each round's own figures and counters."""
    first = rounds[0]
    level = dict(first)
    for key in _MEDIAN_KEYS:
        values = [r[key] for r in rounds if r[key] is not None]
        level[key] = statistics.median(values) if values else None
    per_round = []
    for i, r in enumerate(rounds):
        base = one[i] if one is not None and i < len(one) else {}
        per_round.append(
            {
                **{k: r[k] for k in ("wall_s", "tokens", *_MEDIAN_KEYS)},
                "batch": r["batch"],
                "placement": r["placement"],
                "aggregate_over_one_client": _ratio(r["aggregate_tokens_per_s"], base.get("aggregate_tokens_per_s")),
                "itl_p50_over_one_client": _ratio(r["itl_p50_s"], base.get("itl_p50_s")),
            }
        )
    for key in ("aggregate_over_one_client", "itl_p50_over_one_client"):
        values = [r[key] for r in per_round if r[key] is not None]
        level[key] = statistics.median(values) if values else None
    level["rounds"] = per_round
    return level


def run_bench_serve(settings: BenchServeSettings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = timed_progress(progress)
    manifest = load_manifest(settings.store)
    vocab = int(manifest.config.get("text_config", manifest.config)["vocab_size"])
    rng = random.Random(settings.seed)
    count = max(settings.requests, max(settings.clients))
    requests = [
        _Request(i, tuple(rng.randrange(vocab) for _ in range(settings.prompt_tokens)), settings.seed + 1 + i)
        for i in range(count)
    ]
    warmups = [
        _Request(-1 - i, tuple(rng.randrange(vocab) for _ in range(settings.prompt_tokens)), settings.seed + count + i)
        for i in range(max(settings.clients))
    ]
    batched = settings.max_batch
    kinds = {"batch": batched, "turns": 1} if settings.against_turns else {"batch": batched}
    daemons: dict[str, RuntimePaths] = {}
    runtimes = {kind: Path(tempfile.mkdtemp(dir="/tmp", prefix="msserve")) for kind in kinds}
    try:
        for kind, max_batch in kinds.items():
            given: dict[str, Any] = {
                "model": str(settings.store),
                "io_threads": settings.io_threads,
                "runtime_dir": str(runtimes[kind]),
                "max_batch": max_batch,
                # Every level (and round) sends the same prompts, which a prompt cache would serve
                # to the later ones from the earlier ones' caches: each level prefills its own.
                "prompt_cache_bytes": 0,
            }
            for key in ("capacity", "host_cache", "mapped"):
                if getattr(settings, key) is not None:
                    given[key] = getattr(settings, key)
            daemon_settings = Settings.resolve(given)
            say(f"starting a daemon (max_batch {max_batch})")
            start_daemon(daemon_settings, given, timeout=600.0, echo=False)
            daemons[kind] = paths = RuntimePaths.from_settings(daemon_settings)
            with Client(paths, timeout=600.0) as client:
                say("warming up with one request")
                _one_request(client, _Request(-1, requests[0].prompt_ids, settings.seed), settings)
                if kind == "batch":
                    status = client.status()
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {kind: {n: [] for n in settings.clients} for kind in kinds}
        for r in range(settings.rounds):
            order = settings.clients if r % 2 == 0 else tuple(reversed(settings.clients))
            label = f"round {r + 1} of {settings.rounds}, " if settings.rounds > 1 else ""
            for n in order:
                for kind in list(kinds) if (r + n) % 2 == 0 else list(reversed(kinds)):
                    paths, named = daemons[kind], f"{label}{n} client(s){', in turns' if kind == 'turns' else ''}"
                    if settings.warmup and r == 0:
                        say(f"{named}: warming up with {n} untimed requests")
                        _level(paths, n, warmups[:n], settings)
                    say(f"{named}: {len(requests)} requests")
                    level = _level(paths, n, requests, settings)
                    say(
                        f"{named}: {level['aggregate_tokens_per_s']:.1f} tok/s aggregate, TTFT p50 "
                        f"{level['ttft_p50_s']:.3f} s, inter-token p50 {level['itl_p50_s'] or 0:.4f} s"
                    )
                    runs[kind][n].append(level)
    finally:
        for paths in daemons.values():
            stop_daemon(paths, timeout=60.0)
        for runtime in runtimes.values():
            shutil.rmtree(runtime, ignore_errors=True)
    one = runs["batch"].get(1)
    levels = [_over_rounds(runs["batch"][n], one) for n in settings.clients if runs["batch"][n]]
    if settings.against_turns:
        for level in levels:
            n = level["clients"]
            turns = _over_rounds(runs["turns"][n], runs["turns"].get(1))
            level["turns"] = {k: turns[k] for k in ("aggregate_tokens_per_s", "ttft_p50_s", "itl_p50_s")}
            # Each round's batched level against the same round's in turns, their median.
            ratios = [
                _ratio(b["aggregate_tokens_per_s"], t["aggregate_tokens_per_s"])
                for b, t in zip(runs["batch"][n], runs["turns"][n])
            ]
            level["over_turns"] = statistics.median([x for x in ratios if x is not None] or [0.0]) or None
            level["over_turns_by_round"] = ratios
    every = [run for by_n in runs.values() for rounds in by_n.values() for run in rounds]
    same = all(run["token_ids"] == levels[0]["token_ids"] for run in every)
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "daemon": {
            "capacity": status.capacity,
            "mapped": status.pool.mapped,
            "policy": status.policy,
            "max_batch": (status.batch or {}).get("max_batch", 1),
        },
        "levels": levels,
        "same_tokens_at_every_level": same,
    }


def _ms(x: float | None) -> str:
    return f"{1000 * x:.1f}" if x is not None else "n/a"


def format_report(r: dict[str, Any]) -> str:
    s, d = r["settings"], r["daemon"]
    rounds = s.get("rounds", 1)
    lines = [
        f"bench serve: {s['requests']} requests per level, {s['prompt_tokens']}-token prompts, {s['max_tokens']} "
        f"tokens each at temperature {s['temp']}; daemon pool {d['capacity']} slots per layer"
        f"{' (mapped)' if d.get('mapped') else ''}, batches of at most {d.get('max_batch', 1)}"
        + (f"; medians of {rounds} rounds (ratios: of each round's to its one client)" if rounds > 1 else ""),
        f"{'clients':>7} {'tok/s':>8} {'x one':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'ITL x one':>9} {'daemon tok/s':>12}"
        + (f" {'in turns':>9} {'x turns':>8}" if s.get("against_turns") else ""),
    ]

    def ratio_text(x: float | None) -> str:
        return f"{x:.2f}" if x else "n/a"

    for level in r["levels"]:
        latencies = f"{_ms(level['ttft_p50_s']):>7}ms {_ms(level['ttft_p99_s']):>7}ms "
        lines.append(
            f"{level['clients']:>7} {level['aggregate_tokens_per_s']:>8.1f} "
            f"{ratio_text(level.get('aggregate_over_one_client')):>6} {latencies}"
            f"{_ms(level['itl_p50_s']):>6}ms {_ms(level['itl_p99_s']):>6}ms "
            f"{ratio_text(level.get('itl_p50_over_one_client')):>9} "
            f"{(level['daemon_tokens_per_s_median'] or 0):>12.1f}"
            + (
                f" {level['turns']['aggregate_tokens_per_s']:>9.1f} {ratio_text(level.get('over_turns')):>8}"
                if "turns" in level
                else ""
            )
        )
    for level in r["levels"]:
        b = level.get("batch") or {}
        if b.get("steps"):
            lines.append(
                f"{level['clients']} client(s), of {level['wall_s']:.2f} s{' (round 1)' if rounds > 1 else ''}: "
                f"batch steps {b.get('decode_s', 0):.2f} s ({b.get('steps', 0)} steps), prefills "
                f"{b.get('prefill_s', 0):.2f} s; decode steps alone would make "
                f"{level['steps_only_tokens_per_s'] or 0:.1f} tok/s"
            )
    for level in r["levels"]:
        p = level.get("placement") or {}
        if p.get("routed"):
            lines.append(
                f"{level['clients']} client(s), the mapped pool: {p['gpu_hit_rate']:.2f} of routed experts in GPU "
                f"memory, {p.get('moves', 0)} moves in {p.get('rebalances', 0)} rebalances, read-backs "
                f"{p.get('readback_seconds', 0):.2f} s, the worker {p.get('decide_seconds', 0):.2f} s deciding and "
                f"{p.get('place_seconds', 0):.2f} s in the driver"
            )
    lines.append(
        f"same tokens at every level (seeded requests){', batched and in turns' if s.get('against_turns') else ''}: "
        f"{r['same_tokens_at_every_level']}"
    )
    return "\n".join(lines)
