"""The CUDA copier on the GPU machine: it loads, moves bytes exactly, and how fast.

    python tests/bench/gpu_copy_check.py --out $OUT/copy_check.json

Copies a known pattern from a pinned HostBuffer into an MLX array kept on the device and
compares on the GPU; reports the memory kinds MLX's arrays have before and after, and the
host->GPU bandwidth from pinned and from pageable memory. Then what queuing one layer's
prefetch costs the host: 8 experts of Qwen3-30B-A3B's shape (9 tensors each, 72 spans)
into pool arrays, one cudaMemcpyAsync per span against the copy kernel (one launch for
all 72, Settings.copy_kernel),
each checked for exact bytes. The kernel is also checked on the pattern, on spans of odd
offsets and lengths (its byte loop), and with a pageable source (which goes by
cudaMemcpyAsync instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
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
    report["kernel"] = kernel_checks(copier, host, pattern, rows, cols)
    # A driver that refuses the kernel makes the copier fall back to cudaMemcpyAsync
    # (the bytes above are then its): the counters say whether the kernel ran, and why not.
    counters = copier.counters()
    report["kernel"]["launched"] = counters["kernel_launches"] > 0
    if counters["kernel_error"]:
        report["kernel_error"] = counters["kernel_error"]
    report["probe"] = copier.probe(1 << 30, 5)
    report["layer_prefetch"] = {"per_span": layer_prefetch(copier)}
    if "kernel_error" not in report:
        report["layer_prefetch"]["kernel"] = layer_prefetch(copier, kernel=True)
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))
    exact = [report["copy_exact"], report["copy_exact_after_use"], *report["kernel"].values()]
    exact += [m["exact"] for m in report["layer_prefetch"].values()]
    if not all(exact):
        raise SystemExit("copy check FAILED")


def kernel_checks(copier: CudaCopier, host: HostBuffer, pattern: np.ndarray, rows: int, cols: int) -> dict[str, bool]:
    """The copy kernel moves exactly the bytes cudaMemcpyAsync would: the reversed rows of
    the pattern; spans of odd offsets and lengths; a pageable (numpy) source."""
    out: dict[str, bool] = {}
    a = mx.zeros((rows, cols), dtype=mx.uint32)
    mx.eval(a)
    copier.place(a, "device")
    copier.copy([(a, r * cols * 4, host, (rows - 1 - r) * cols * 4, cols * 4) for r in range(rows)], kernel=True)
    out["rows_exact"] = bool(mx.array_equal(a, mx.array(pattern.reshape(rows, cols)[::-1].copy())).item())
    b = mx.zeros((1 << 20,), dtype=mx.uint8)
    mx.eval(b)
    copier.place(b, "device")
    raw = np.frombuffer(host, np.uint8)
    odd = [(3, 101, 1001), (5000, 7, 4093), (20000, 16, 160)]  # (dst offset, src offset, bytes)
    copier.copy([(b, d, host, o, n) for d, o, n in odd], kernel=True)
    got = np.array(b)
    out["odd_spans_exact"] = all(np.array_equal(got[d : d + n], raw[o : o + n]) for d, o, n in odd)
    pageable = np.arange(4096, dtype=np.uint8)
    copier.copy([(b, 65536, pageable, 0, 4096)], kernel=True)
    out["pageable_source_exact"] = bool(np.array_equal(np.array(b)[65536 : 65536 + 4096], pageable))
    return out


def layer_prefetch(
    copier: CudaCopier, *, kernel: bool = False, experts: int = 8, slots: int = 32, repeats: int = 50
) -> dict:
    """Queue 8 experts into 9 pool arrays (Qwen3-30B-A3B, 4-bit): host ms of the call
    that queues them and of the whole copy, medians; and whether the bytes are exact."""
    shapes = [((slots, 768, 256), mx.uint32), ((slots, 768, 32), mx.bfloat16), ((slots, 768, 32), mx.bfloat16)] * 3
    pools = [mx.zeros(shape, dtype=dtype) for shape, dtype in shapes]
    mx.eval(pools)
    for t in pools:
        copier.place(t, "device")
    row = [t.nbytes // slots for t in pools]
    stride = sum(row)
    host = HostBuffer(experts * stride, copier)
    raw = np.frombuffer(host, np.uint8)
    raw[:] = (np.arange(raw.size, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)
    # Expert e goes to slot 3 e + 1: rows spread over the pool as eviction leaves them.
    spans = []
    for e in range(experts):
        off = e * stride
        for t, n in zip(pools, row):
            spans.append((t, (3 * e + 1) * n, host, off, n))
            off += n
    queue, total = [], []
    for _ in range(repeats):
        tic = time.perf_counter()
        copier.copy(spans, wait=False, kernel=kernel)
        queued = time.perf_counter()
        copier.sync()
        queue.append(queued - tic)
        total.append(time.perf_counter() - tic)
    exact = True
    for e in range(experts):
        off = e * stride
        for t, n in zip(pools, row):
            got = np.array(t[3 * e + 1].view(mx.uint8)).reshape(-1)
            exact &= bool(np.array_equal(got, raw[off : off + n]))
            off += n
    return {
        "spans": len(spans),
        "bytes": experts * stride,
        "queue_ms": 1e3 * statistics.median(queue),
        "total_ms": 1e3 * statistics.median(total),
        "us_per_span_queued": 1e6 * statistics.median(queue) / len(spans),
        "bytes_per_s": experts * stride / statistics.median(total),
        "exact": exact,
    }


if __name__ == "__main__":
    main()
