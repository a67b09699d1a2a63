"""The bandwidths the benchmarks' bounds are made of, measured in the run that uses them:
the store's read rate through the native engine, and the host-to-pool copy rate."""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..._native import ReadEngine
from ...shared.durable import sync_file
from ...shared.store_format import MoELayer, load_manifest
from ..pool.admission import cuda_copier


def settle_writes() -> None:
    """Write back what the system holds dirty before the disk is timed: files written just
    before (a store just converted, the pool probe's own stores) are otherwise written back
    while the reads run and share the disk with them (on the H200 the probe before loading
    ran beside such writeback and read slower than the same probe after the rounds:
    tests/bench/RESULTS.md, "The H200 table with the stack distances")."""
    os.sync()


def measure_read_bandwidth(
    store: Path, threads: int, samples: int = 128, seed: int = 0, layers: Sequence[MoELayer] | None = None
) -> float:
    """Bytes/s of random whole-expert reads through the engine (direct I/O), of the
    store's `layers` (default: its manifest's)."""
    layers = layers or load_manifest(store).layers
    rng = random.Random(seed)
    with ReadEngine(threads=threads, direct=True) as engine:
        fids = {layer.file: engine.open(str(store / layer.file)) for layer in layers}
        batch = []
        for _ in range(samples):
            layer = rng.choice(layers)
            e = layer.experts[rng.randrange(layer.num_experts)]
            batch.append((fids[layer.file], e.offset, e.length, [], None))
        nbytes, seconds = _timed_reads(engine, batch)
    return nbytes / seconds


def _timed_reads(engine: ReadEngine, requests: list[tuple]) -> tuple[int, float]:
    """Submit `requests` together and wait for them: (bytes read, seconds taken)."""
    tic = time.perf_counter()
    done = engine.wait(engine.submit_batch(requests))
    seconds = time.perf_counter() - tic
    bad = [c.error for c in done if not c.ok]
    if bad:
        raise OSError(f"reading the store failed: {bad[0]}")
    return sum(c.nbytes for c in done), seconds


# The batch sizes of `measure_layer_reads`: a decode step's misses in one layer are a few
# experts (top-k times the miss rate), read together and waited for before the layer runs.
LAYER_READ_BATCHES = (1, 2, 4, 8, 16)


def measure_layer_reads(
    store: Path,
    threads: int,
    batches: tuple[int, ...] = LAYER_READ_BATCHES,
    reads: int = 32,
    seed: int = 0,
    layers: Sequence[MoELayer] | None = None,
) -> dict[int, float]:
    """{batch: bytes/s} of reads as a decode step makes them: `batch` distinct experts of
    one random layer submitted together, waited for, then the next batch (at least
    `reads` experts and 4 batches per size). A few reads in flight keep a disk far from
    the rate of many (`measure_read_bandwidth`): each batch pays the latency of its
    slowest read, and nothing overlaps the next layer's reads with it."""
    layers = layers or load_manifest(store).layers
    rng = random.Random(seed)
    out: dict[int, float] = {}
    with ReadEngine(threads=threads, direct=True) as engine:
        fids = {layer.file: engine.open(str(store / layer.file)) for layer in layers}
        for batch in batches:
            nbytes, seconds = 0, 0.0
            for _ in range(max(4, -(-reads // batch))):
                layer = rng.choice(layers)
                picked = rng.sample(range(layer.num_experts), min(batch, layer.num_experts))
                experts = [layer.experts[e] for e in picked]
                read, took = _timed_reads(engine, [(fids[layer.file], e.offset, e.length, [], None) for e in experts])
                nbytes, seconds = nbytes + read, seconds + took
            out[batch] = nbytes / seconds
    return out


# A scratch layer's size at most: enough experts that random reads of them are the disk's.
SCRATCH_BYTES = 512 << 20


@contextmanager
def scratch_layer(near: Path, layer: MoELayer) -> Iterator[tuple[Path, list[MoELayer]]]:
    """A file of `layer`'s expert blocks (random bytes; as many as SCRATCH_BYTES hold, at
    least 16) on the disk of `near` (its nearest folder that exists), synced, for the read
    probes of a store not yet pulled there; (its folder, [the layer]), removed after."""
    folder = near
    while not folder.is_dir():
        folder = folder.parent
    count = min(layer.num_experts, max(16, SCRATCH_BYTES // layer.stride))
    scratch = replace(layer, num_experts=count, experts=layer.experts[:count])
    with tempfile.TemporaryDirectory(prefix=".moestream-disk-probe-", dir=folder) as tmp:
        path = Path(tmp) / layer.file
        path.parent.mkdir(parents=True, exist_ok=True)
        block = np.random.default_rng(0).integers(0, 256, layer.stride, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            for _ in range(count):
                f.write(block)
            sync_file(f)
        yield Path(tmp), [scratch]


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
