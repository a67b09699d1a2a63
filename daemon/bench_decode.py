"""`moestreamctl bench decode`: decode speed of stock mlx-lm, moestream at each pool
capacity, and the naive on-demand baseline, measured side by side in one run.

Every configuration decodes the same prompt greedily for the same number of tokens. The
configurations take turns, `rounds` times, so drift of the machine hits all alike; the
medians are reported. The bound for a configuration is the speed it would reach if its
reads cost exactly what the engine's measured bandwidth says, on top of fully resident
compute: 1 / (1/tps_resident + bytes_read_per_token / read_bandwidth).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from moestream._native import ReadEngine
from moestream.daemon.store.loader import StreamingModel, load_stock_model, load_streaming_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


@dataclass(frozen=True)
class BenchDecodeSettings:
    store: Path
    capacities: tuple[float, ...] = (1.0, 0.5, 0.25)
    prompt_tokens: int = 32
    decode_tokens: int = 64
    rounds: int = 3
    policy: str = "lru"
    io_threads: int = 4
    stock: bool = True
    naive: bool = True
    seed: int = 0
    mlx_memory_limit: int | None = None


@dataclass
class Config:
    name: str
    capacity: float | None
    run: Callable[[], dict[str, Any]]
    close: Callable[[], None]
    samples: list[dict[str, Any]] = field(default_factory=list)


def _decode(model, prompt: list[int], steps: int, after_prefill: Callable[[], None] | None = None) -> tuple[float, list[int]]:
    """Greedy decode with mlx-lm's pipelining (step n+1 queued before n is read);
    returns the seconds of the decode steps alone."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    mx.eval(y)
    if after_prefill is not None:
        after_prefill()
    tokens = []
    tic = time.perf_counter()
    for _ in range(steps):
        next_y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(next_y)
        tokens.append(int(y.item()))
        y = next_y
    mx.eval(y)
    return time.perf_counter() - tic, tokens


def _pool_counters(sm: StreamingModel) -> dict[str, int]:
    s = sm.pool_stats()
    return {k: s[k] for k in ("hits_decode", "misses_decode", "bytes_read", "host_syncs")}


def _streaming_config(name: str, capacity: float | None, settings: BenchDecodeSettings, prompt: list[int], naive: bool = False) -> Config:
    sm = load_streaming_model(
        settings.store,
        Settings(capacity=capacity, policy=settings.policy, io_threads=settings.io_threads),
        naive=naive,
    )

    def run() -> dict[str, Any]:
        before: dict[str, int] = {}
        seconds, tokens = _decode(sm.model, prompt, settings.decode_tokens, lambda: before.update(_pool_counters(sm)))
        after = _pool_counters(sm)
        d = {k: after[k] - before[k] for k in before}
        hits, misses = d["hits_decode"], d["misses_decode"]
        return {
            "tokens_per_s": settings.decode_tokens / seconds,
            "tokens": tokens,
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "bytes_read_per_token": d["bytes_read"] / settings.decode_tokens,
            "host_syncs_per_token": d["host_syncs"] / settings.decode_tokens + 1,
        }

    return Config(name, capacity, run, sm.close)


def _stock_config(settings: BenchDecodeSettings, prompt: list[int]) -> Config:
    model = load_stock_model(settings.store)

    def run() -> dict[str, Any]:
        seconds, tokens = _decode(model, prompt, settings.decode_tokens)
        return {"tokens_per_s": settings.decode_tokens / seconds, "tokens": tokens, "hit_rate": 1.0, "bytes_read_per_token": 0.0, "host_syncs_per_token": 1.0}

    return Config("stock-mlx-lm", None, run, lambda: None)


def measure_read_bandwidth(store: Path, threads: int, samples: int = 128, seed: int = 0) -> float:
    """Bytes/s of random whole-expert reads through the engine (direct I/O)."""
    manifest = load_manifest(store)
    rng = random.Random(seed)
    with ReadEngine(threads=threads, direct=True) as engine:
        fids = {layer.file: engine.open(str(store / layer.file)) for layer in manifest.layers}
        batch = []
        for _ in range(samples):
            layer = rng.choice(manifest.layers)
            e = layer.experts[rng.randrange(layer.num_experts)]
            batch.append((fids[layer.file], e.offset, e.length, [], None))
        tic = time.perf_counter()
        ids = engine.submit_batch(batch)
        done = engine.wait(ids)
        seconds = time.perf_counter() - tic
    bad = [c.error for c in done if not c.ok]
    if bad:
        raise OSError(f"reading the store failed: {bad[0]}")
    return sum(c.nbytes for c in done) / seconds


def run_bench_decode(settings: BenchDecodeSettings) -> dict[str, Any]:
    if settings.mlx_memory_limit:
        mx.set_memory_limit(settings.mlx_memory_limit)
    manifest = load_manifest(settings.store)
    vocab = manifest.config.get("text_config", manifest.config)["vocab_size"]
    rng = random.Random(settings.seed)
    prompt = [rng.randrange(vocab) for _ in range(settings.prompt_tokens)]

    configs: list[Config] = []
    try:
        if settings.stock:
            configs.append(_stock_config(settings, prompt))
        for c in settings.capacities:
            configs.append(_streaming_config(f"moestream@{c:g}", c, settings, prompt))
        if settings.naive:
            configs.append(_streaming_config("naive-on-demand", None, settings, prompt, naive=True))
        for c in configs:  # warm-up: kernels, page tables, first reads
            c.run()
        for _ in range(settings.rounds):
            for c in configs:
                gc.collect()
                c.samples.append(c.run())
    finally:
        for c in configs:
            c.close()
    bandwidth = measure_read_bandwidth(settings.store, settings.io_threads, seed=settings.seed)

    rows = []
    reference_tokens = configs[0].samples[0]["tokens"] if configs else None
    for c in configs:
        row: dict[str, Any] = {"name": c.name, "capacity": c.capacity}
        for key in ("tokens_per_s", "hit_rate", "bytes_read_per_token", "host_syncs_per_token"):
            row[key] = statistics.median(s[key] for s in c.samples)
        row["tokens_per_s_runs"] = [s["tokens_per_s"] for s in c.samples]
        row["same_tokens_as_first"] = all(s["tokens"] == reference_tokens for s in c.samples)
        rows.append(row)
    resident = next((r for r in rows if r["name"] == "stock-mlx-lm"), None) or next(
        (r for r in rows if r["capacity"] == 1.0), None
    )
    for row in rows:
        if resident is not None:
            row["vs_resident"] = row["tokens_per_s"] / resident["tokens_per_s"]
            bound = 1.0 / (1.0 / resident["tokens_per_s"] + row["bytes_read_per_token"] / bandwidth)
            row["bound_tokens_per_s"] = bound
            row["fraction_of_bound"] = row["tokens_per_s"] / bound
    return {
        "store": str(settings.store),
        "model_type": manifest.model_type,
        "experts_per_layer": manifest.layers[0].num_experts,
        "moe_layers": len(manifest.layers),
        "expert_bytes": manifest.layers[0].expert_bytes,
        "policy": settings.policy,
        "prompt_tokens": settings.prompt_tokens,
        "decode_tokens": settings.decode_tokens,
        "rounds": settings.rounds,
        "read_bandwidth_bytes_per_s": bandwidth,
        "device": str(mx.default_device()),
        "results": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['model_type']}: {report['moe_layers']} MoE layers x {report['experts_per_layer']} experts, "
        f"{report['decode_tokens']} decode tokens, median of {report['rounds']}, "
        f"read bandwidth {report['read_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s",
        f"{'config':<18} {'tok/s':>9} {'x resident':>10} {'hit rate':>9} {'MB/token':>9} {'syncs/tok':>9} {'bound':>9} {'of bound':>8}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['name']:<18} {r['tokens_per_s']:>9.1f} {r.get('vs_resident', float('nan')):>10.3f} "
            f"{r['hit_rate']:>9.3f} {r['bytes_read_per_token'] / 1e6:>9.3f} {r['host_syncs_per_token']:>9.1f} "
            f"{r.get('bound_tokens_per_s', float('nan')):>9.1f} {r.get('fraction_of_bound', float('nan')):>8.2f}"
        )
    return "\n".join(lines)
