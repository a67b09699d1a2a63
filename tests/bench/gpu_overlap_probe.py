"""Does a DMA copy into one pool slow the expert kernels reading another? (GPU machine)

    python tests/bench/gpu_overlap_probe.py --out $OUT/overlap.json

Session 4's `bench predict` on the H200 saw the expert matmul of a 25% slot pool take
1.84 ms per layer with prefetch on against 0.41 ms with it off, while the prefetch copies
(the next layer's predicted experts, from the pinned host tier into that layer's pool,
queued on the copier's streams) ran beside it. Pool arrays are managed memory (MLX moves
an array there when its buffer is first exported to the copier). This probe times the
same gather_qmm over pool A of Qwen3-30B-A3B's expert shape:

1. alone;
2. while the copier writes 8 experts into pool B (another managed array), as prefetch
   does for the next layer while this one computes;
3. right after such a copy into pool A itself, waited for (the way demand admission
   writes a pool and then the layer reads it);
4. over pool B right after an overlapped copy into it was waited for (the way the next
   layer reads what prefetch copied into it);
5. after a copy into pool A followed by advising and prefetching the copied rows to the
   GPU again (does the DMA leave pages the kernel must fault back?);
6. over a pool MLX allocated and never exported (the memory MLX's own weights live in);

each the median of many calls, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from moestream._native import CudaCopier, HostBuffer

HIDDEN, WIDTH, EXPERTS, TOP_K, BITS, GROUP = 2048, 768, 32, 8, 4, 64


def pool(rng_key: int) -> tuple[mx.array, mx.array, mx.array]:
    w = mx.random.normal((EXPERTS, WIDTH, HIDDEN), key=mx.random.key(rng_key)).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=GROUP, bits=BITS)
    mx.eval(q, s, b)
    return q, s, b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    mx.set_memory_limit(32 * 2**30)
    copier = CudaCopier(4)
    a, b = pool(1), pool(2)
    for arrays in (a, b):
        for t in arrays:
            copier.place(t, "device")  # exports the buffer (now managed), keeps it on the GPU
    # One decode token as SwitchGLU hands it to gather_qmm: [batch, seq, 1, 1, hidden].
    x = mx.random.normal((1, 1, 1, 1, HIDDEN)).astype(mx.bfloat16)
    idx = mx.array([[[0, 3, 5, 9, 12, 17, 21, 30]]], dtype=mx.uint32)  # [batch, seq, top-k]
    per_expert = sum(t.nbytes // EXPERTS for t in b)
    host = HostBuffer(TOP_K * per_expert, copier)

    def spans_into(dst: tuple[mx.array, ...]) -> list:
        # The last 8 rows: rows the matmul (experts 0..30 of `idx`) may also read.
        spans, off = [], 0
        for t in dst:
            n = t.nbytes // EXPERTS
            spans += [(t, (EXPERTS - 1 - e) * n, host, off + e * n, n) for e in range(TOP_K)]
            off += TOP_K * n
        return spans

    def matmul(p: tuple[mx.array, ...]) -> float:
        tic = time.perf_counter()
        y = mx.gather_qmm(x, p[0], p[1], p[2], rhs_indices=idx, transpose=True, group_size=GROUP, bits=BITS)
        mx.eval(y)
        return time.perf_counter() - tic

    def alone() -> float:
        return matmul(a)

    def overlapped() -> float:
        copier.copy(spans_into(b), wait=False)
        t = matmul(a)
        copier.sync()
        return t

    def after_copy_here() -> float:
        copier.copy(spans_into(a))
        return matmul(a)

    def after_copy_here_placed() -> float:
        # The same copy, then the copied rows advised and prefetched to the GPU again: if
        # this is fast where `after_copy_here` is slow, the DMA left those pages
        # somewhere the kernel has to fault them back from.
        spans = spans_into(a)
        copier.copy(spans)
        copier.place_many([(t, "device", off, n) for t, off, _, _, n in spans], wait=True)
        return matmul(a)

    fresh = pool(3)  # MLX's own memory, never exported to the copier

    def alone_unexported() -> float:
        return matmul(fresh)

    def after_overlapped_copy_there() -> float:
        copier.copy(spans_into(b), wait=False)
        matmul(a)
        copier.sync()
        return matmul(b)

    for _ in range(20):  # warm-up: kernels compiled, pages placed
        matmul(a), matmul(b), matmul(fresh)
    out = {}
    for case in (alone, alone_unexported, overlapped, after_copy_here, after_copy_here_placed, after_overlapped_copy_there):
        times = [case() for _ in range(args.calls)]
        out[case.__name__] = {"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))]}
        print(case.__name__, out[case.__name__], flush=True)
    out["copy_bytes"] = TOP_K * per_expert
    # Asked only now: asking exports the buffer, which may change its kind.
    out["memory_kind"] = {"pool": copier.memory_kind(a[0]), "unexported_pool_when_asked": copier.memory_kind(fresh[0])}
    out["device"] = str(mx.default_device())
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
