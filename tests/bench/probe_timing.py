"""Timing shared by the GPU probes in this folder (imported as a sibling module: the
probes run as scripts, so this folder is on sys.path)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of evaluating `fn()` alone (the device idle before each run),
    after `warmup` untimed runs (kernel compilation, first touches)."""
    for _ in range(warmup):
        mx.eval(fn())
    out = []
    for _ in range(reps):
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(out)
