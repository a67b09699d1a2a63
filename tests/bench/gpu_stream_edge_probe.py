"""What a dependency between two MLX streams costs inside one evaluation, on the GPU
machine: the question behind mapped-pool prefetch's slowdown (0.54x of gathering alone,
tests/bench/results/bench_decode_q30_mapped_prefetch_h200.json), which adds two such
edges per layer (the prediction to the second stream, the stack back).

    python tests/bench/gpu_stream_edge_probe.py --out $OUT/stream_edge_probe_h200.json

A chain of `--layers` small matmuls (a decode step's shape: one token, hidden 2048)
evaluated at once, four ways: the chain alone; with a side copy per layer on the same
stream; with the side copy on a second stream that the next layer waits for (two
cross-stream edges per layer, as mapped prefetch has); and the same with a side copy
that nothing waits for until the end (one edge per layer, and one at the end). Milliseconds per evaluation,
median of `--reps`. MLX's CUDA backend resolves such an edge within one evaluation
with a fence (mlx/backend/cuda/fence.cu): both streams' pending work is committed and
the waiting stream runs a kernel spinning on an atomic in managed memory; if that is
what costs, the cross-stream rows cost far more per edge than the same-stream row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from probe_timing import median_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    mx.set_memory_limit(16 * 2**30)
    n, h = args.layers, args.hidden
    weights = [mx.random.normal((h, h)).astype(mx.bfloat16) * (h**-0.5) for _ in range(n)]
    # Side work of a staged copy's size: 8 rows of 2.6 MB, as one layer's experts.
    side_src = mx.random.normal((8, 1 << 20)).astype(mx.bfloat16)
    x0 = mx.random.normal((1, h)).astype(mx.bfloat16)
    mx.eval(weights, side_src, x0)
    second = mx.new_stream(mx.default_device())

    def chain(mode: str) -> list[mx.array]:
        x, acc = x0, None
        for w in weights:
            if mode == "alone":
                x = x @ w
                continue
            stream = second if mode in ("cross-wait", "cross-nowait") else mx.default_stream(mx.default_device())
            # The side copy depends on this layer's input (as a prediction does) ...
            side = mx.multiply(side_src, x[0, :1], stream=stream)
            x = x @ w
            if mode in ("same", "cross-wait"):
                # ... and the next layer waits for it (as the next layer's gather does).
                x = mx.depends(x, side)
            else:
                # ... or nothing waits for it but a sum on its own stream, read at the end.
                acc = side if acc is None else mx.add(acc, side, stream=second)
        return [x] if acc is None else [x, acc]

    rows = {mode: median_ms(lambda m=mode: chain(m), args.reps) for mode in ("alone", "same", "cross-wait", "cross-nowait")}
    edges = {"same": 0, "cross-wait": 2 * n, "cross-nowait": n + 1}
    report = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "layers": n,
        "hidden": h,
        "ms": rows,
        "per_edge_us": {m: 1e3 * (rows[m] - rows["same"]) / edges[m] for m in ("cross-wait", "cross-nowait")},
    }
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
