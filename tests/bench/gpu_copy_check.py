"""The CUDA copier on the GPU machine: it loads, moves bytes exactly, and how fast.

    python tests/bench/gpu_copy_check.py --out $OUT/copy_check.json

Copies a known pattern from a pinned HostBuffer into an MLX array kept on the device and
compares on the GPU; reports the memory kinds MLX's arrays have before and after, and the
host->GPU bandwidth from pinned and from pageable memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from moestream._native import CudaCopier, HostBuffer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mx.set_memory_limit(32 * 2**30)
    copier = CudaCopier()
    report: dict = {"library": copier.library, "runtime_version": copier.runtime_version}
    rows, cols = 64, 1 << 16
    a = mx.zeros((rows, cols), dtype=mx.uint32)
    mx.eval(a)
    copier.place(a, "device")
    report["pool_memory_kind"] = copier.memory_kind(a)
    host = HostBuffer(rows * cols * 4, copier)
    pattern = np.frombuffer(host, np.uint32)
    pattern[:] = (np.arange(rows * cols, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    # Rows in reverse order, one span each: offsets on both sides are exercised.
    spans = [(a, r * cols * 4, host, (rows - 1 - r) * cols * 4, cols * 4) for r in range(rows)]
    seconds = copier.copy(spans)
    want = mx.array(pattern.reshape(rows, cols)[::-1].copy())
    report["copy_exact"] = bool(mx.array_equal(a, want).item())
    report["copy_bytes_per_s_64_spans"] = rows * cols * 4 / seconds
    # The GPU reads what DMA wrote, also after a kernel used the array before.
    b = (a + 1).sum()
    mx.eval(b)
    seconds = copier.copy(spans[:1])
    report["copy_exact_after_use"] = bool(mx.array_equal(a[0], want[0]).item())
    report["probe"] = copier.probe(1 << 30, 5)
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))
    if not (report["copy_exact"] and report["copy_exact_after_use"]):
        raise SystemExit("copy check FAILED")


if __name__ == "__main__":
    main()
