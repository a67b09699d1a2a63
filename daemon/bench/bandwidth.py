"""The bandwidths the benchmarks' bounds are made of, measured in the run that uses them:
the store's read rate through the native engine, and the host-to-pool copy rate."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from moestream._native import ReadEngine
from moestream.daemon.pool.admission import cuda_copier
from moestream.shared.store_format import load_manifest


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


def page_cache_reason(store: Path) -> str | None:
    """Why the store's reads go through the page cache (the read engine's fallback where
    the filesystem refuses direct I/O), or None where they bypass it. Through the page
    cache a read costs what its cached pages cost, which the measured read bandwidth, a
    mix of cache and disk, does not give."""
    manifest = load_manifest(store)
    with ReadEngine(threads=1, direct=True) as engine:
        for file in sorted({layer.file for layer in manifest.layers}):
            info = engine.file_info(engine.open(str(store / file)))
            if not info["direct"]:
                return info["fallback_reason"] or "buffered reads"
    return None


def measure_link_bandwidth() -> tuple[float, str, dict[str, Any]]:
    """Bytes/s of host -> pool copies at their best: pinned DMA on CUDA, else memcpy."""
    copier, _ = cuda_copier()
    if copier is not None:
        probe = copier.probe(1 << 30, 5)
        return probe["pinned_bytes_per_s"], "pinned host->GPU (cudaMemcpyAsync)", dict(probe)
    src = np.ones(256 << 20, np.uint8)
    dst = np.empty_like(src)
    rates = []
    for _ in range(5):
        tic = time.perf_counter()
        np.copyto(dst, src)
        rates.append(src.nbytes / (time.perf_counter() - tic))
    return statistics.median(rates), "host memcpy", {}
