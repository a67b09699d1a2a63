"""Does a copy made ahead of use slow the kernels it runs beside? (GPU machine)

    python tests/bench/gpu_background_copy_probe.py --store /root/q30/store --out $OUT/background_copy_probe_h200.json

Prefetch only pays where its copies overlap compute. On the H200 it did not pay for
either pool: mapped prefetch ran 0.54x of gathering alone, and the slot pool's prefetch
1.05x although it cut the copy wait from 16 to 2 ms per forward
(tests/bench/results/decode/bench_decode_q30_mapped_prefetch_h200.json,
predict/bench_predict_q30_kernel_h200.json). Both copy with kernels that launch up to 64 blocks
of 256 threads per expert row or span: a few thousand blocks stalled on loads over the
link, which may hold the GPU's SMs while the layer's own kernels wait for room. This
probe measures it on one Q30-shaped layer:

1. `compute`: the expert call of a decode token on 8 experts in GPU memory, four times in
   a chain (about a layer's work);
2. `mapped`: the row-gather kernel (daemon/mapped/row_gather.py) copying 8 experts held in host
   memory into a stack, with at most B blocks per row, alone, and beside `compute` in
   one evaluation on the same stream (MLX's CUDA graphs run nodes that share no buffer
   side by side) and on a second stream;
3. `copier` (with the CUDA copier): the copy kernel moving 8 experts (72 spans) from a
   pinned host buffer into GPU memory with at most B blocks per span, alone, and queued
   just before `compute` is evaluated (the way the slot pool's prefetch runs); and the
   same with cudaMemcpyAsync (the copy engines, no SMs).

For each, milliseconds (median of `--reps`) and how much of the shorter of the two the
pair hid: (alone + alone - together) / shorter, 1 = fully overlapped, 0 = serialised.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from probe_setup import mapped_quarter, store_probe_args
from probe_timing import median_ms

from moestream.daemon.mapped.row_gather import RowGather
from moestream.daemon.pool.admission import cuda_copier

BLOCKS = (64, 16, 4, 1)


def hidden_fraction(a: float, b: float, both: float) -> float:
    return (a + b - both) / min(a, b)


def main() -> None:
    args = store_probe_args()
    sm, moes = mapped_quarter(args.store)
    first, second_layer = moes[0], moes[1]
    k = first.pool.top_k
    hidden = sm.manifest.config.get("text_config", sm.manifest.config)["hidden_size"]
    on_gpu = sorted(sm.mapped_pool.on_gpu[0])[:k]
    off_gpu = [e for e in range(second_layer.pool.layer.num_experts) if e not in sm.mapped_pool.on_gpu[1]][:k]
    ids_gpu = mx.array(on_gpu, dtype=mx.uint32).reshape(1, 1, k)
    ids_host = mx.array(off_gpu, dtype=mx.uint32)
    arrays_next = [second_layer.pool.arrays[t.name] for t in second_layer.pool.layer.tensors]
    x0 = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)
    mx.eval(x0, ids_gpu, ids_host)
    gather = RowGather(use_kernel=RowGather.kernel_available())
    side = mx.new_stream(mx.default_device())

    def compute() -> mx.array:
        x = x0
        for _ in range(4):
            x = first.inner(x, ids_gpu).sum(axis=-2).astype(mx.bfloat16)
        return x

    report: dict = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "top_k": k,
        "expert_bytes": second_layer.pool.layer.expert_bytes,
        "kernel": RowGather.kernel_available(),
    }
    report["compute_ms"] = c = median_ms(compute, args.reps)
    want = gather(arrays_next, ids_host)
    rows = []
    for b in BLOCKS:

        def stage(b=b) -> list[mx.array]:
            return gather(arrays_next, ids_host, max_blocks=b)

        def same(b=b) -> list[mx.array]:
            return [compute(), *stage(b)]

        def second(b=b) -> list[mx.array]:
            y = compute()
            with mx.stream(side):
                s = stage(b)
            return [y, *s]

        alone = median_ms(stage, args.reps)
        r = {
            "blocks_per_row": b,
            "stage_ms": alone,
            "same_stream_ms": median_ms(same, args.reps),
            "second_stream_ms": median_ms(second, args.reps),
        }
        r["same_hidden"] = hidden_fraction(c, alone, r["same_stream_ms"])
        r["second_hidden"] = hidden_fraction(c, alone, r["second_stream_ms"])
        r["equal"] = all(bool(mx.array_equal(a, w)) for a, w in zip(stage(), want))
        rows.append(r)
        print(json.dumps(r), flush=True)
    report["mapped"] = rows

    copier, why_not = cuda_copier()
    if copier is None:
        report["copier"] = f"skipped: {why_not}"
    else:
        from moestream._native import HostBuffer

        layer = second_layer.pool.layer
        n = k * layer.expert_bytes
        src = HostBuffer(n, copier)
        pattern = np.frombuffer(src, np.uint8)
        pattern[:] = (np.arange(n, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)
        expect = mx.array(pattern)

        def spans_into(dst: mx.array) -> list:
            return [
                (dst, e * layer.expert_bytes + t.offset, src, e * layer.expert_bytes + t.offset, t.nbytes)
                for e in range(k)
                for t in layer.tensors
            ]

        def zeros() -> mx.array:
            out = mx.zeros((n,), dtype=mx.uint8)
            mx.eval(out)
            return out

        spans = spans_into(zeros())

        def timed(fn, reps: int) -> float:
            for _ in range(3):
                fn()
            out = []
            for _ in range(reps):
                mx.synchronize()
                copier.sync()
                tic = time.perf_counter()
                fn()
                out.append(time.perf_counter() - tic)
            return 1e3 * statistics.median(out)

        def beside(kernel: bool, blocks: int | None) -> None:
            copier.copy(spans, wait=False, kernel=kernel, blocks=blocks)
            mx.eval(compute())
            copier.sync()

        crows = []
        for kernel, blocks in [(False, None)] + [(True, b) for b in BLOCKS]:
            alone = timed(lambda: copier.copy(spans, wait=True, kernel=kernel, blocks=blocks), args.reps)
            both = timed(lambda: beside(kernel, blocks), args.reps)
            # A fresh destination for the check (every byte must come from the source);
            # on the H200 the copier refused an updated one (`dst[:] = 0`) as not C-contiguous.
            dst = zeros()
            copier.copy(spans_into(dst), wait=True, kernel=kernel, blocks=blocks)
            r = {
                "way": "kernel" if kernel else "cudaMemcpyAsync",
                "blocks_per_span": blocks,
                "copy_ms": alone,
                "exact": bool(mx.array_equal(dst, expect)),
                "beside_compute_ms": both,
                "hidden": hidden_fraction(c, alone, both),
                "copy_GBps": n / alone / 1e6,
            }
            crows.append(r)
            print(json.dumps(r), flush=True)
        report["copier"] = crows
    sm.close()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
