"""Would a pool of one block per slot work on CUDA? (the next design step of issue 5/6)

Today a pool holds one MLX array per expert tensor (9 for a quantized SwitchGLU), so
admitting an expert is 9 copies, and on the H200 queuing each costs about 7 us: some
2,700 copies and 17 to 19 ms per token with the host tier
(tests/bench/results/bench_predict_q30_h200.json). If each slot were one block laid out
as the store lays out an expert, and the tensors were strided views of it
(`mx.as_strided`), an expert would be one copy (and one read). This probe checks, for
the Qwen3-30B-A3B expert shape, on the current device:

1. `gather_qmm` on the strided views gives bit-equal output to contiguous arrays, for a
   decode step (8 experts, one token) and a sorted prefill (64 tokens);
2. its time against the contiguous arrays (a hidden copy of the whole pool per call
   would show here);
3. on CUDA, the host time to queue one layer's admission of 8 experts as 72 copies (one
   per tensor) against 8 (one per block), with the native copier.

    python tests/bench/gpu_block_probe.py --out $OUT/block_probe_h200.json

Expected on CUDA: not equal. MLX's CUDA `gather_qmv` (mlx/backend/cuda/quantized/qmm/
qmv.cu upstream) finds expert i's rows at `w + (row + n * i) * bytes_per_row`, that is,
it assumes the experts lie back to back, and `GatherQMM::eval_gpu` passes `w` on without
making it contiguous. The CPU honours the strides (equal, same speed here), and Metal's
`GatherQMM` makes only the last two dimensions contiguous. So on CUDA the copies would
have to be cut another way (see gpu_copy_cost_probe.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from probe_timing import median_ms

HIDDEN, WIDTH, EXPERTS, TOP_K, GROUP, BITS = 2048, 768, 128, 8, 64, 4
ALIGN = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    mx.random.seed(0)
    # gate, up: [E, WIDTH, HIDDEN]; down: [E, HIDDEN, WIDTH]; each quantized to w, scales, biases.
    tensors = {}
    for name, shape in (("gate", (WIDTH, HIDDEN)), ("up", (WIDTH, HIDDEN)), ("down", (HIDDEN, WIDTH))):
        w = (mx.random.normal((EXPERTS, *shape)) * 0.02).astype(mx.bfloat16)
        q, s, b = mx.quantize(w, group_size=GROUP, bits=BITS)
        tensors |= {f"{name}.weight": q, f"{name}.scales": s, f"{name}.biases": b}
    mx.eval(list(tensors.values()))
    # One block per expert: the tensors back to back at ALIGN-byte offsets.
    offsets, at = {}, 0
    for name, a in tensors.items():
        offsets[name] = at
        at += -(-(a.nbytes // EXPERTS) // ALIGN) * ALIGN
    stride = -(-at // 16384) * 16384
    host = np.zeros((EXPERTS, stride), np.uint8)
    for name, a in tensors.items():
        raw = np.array(a.view(mx.uint8) if a.dtype == mx.uint32 else a.view(mx.uint16)).view(np.uint8).reshape(EXPERTS, -1)
        host[:, offsets[name]: offsets[name] + raw.shape[1]] = raw
    block = mx.array(host.reshape(-1))
    mx.eval(block)
    views = {}
    for name, a in tensors.items():
        size = a.dtype.size
        inner = [int(np.prod(a.shape[i + 2:])) for i in range(a.ndim - 1)]
        views[name] = mx.as_strided(block.view(a.dtype), (EXPERTS, *a.shape[1:]), (stride // size, *inner), offsets[name] // size)
    mx.eval(list(views.values()))
    same_bytes = all(bool(mx.array_equal(views[n], tensors[n])) for n in tensors)

    def glu(ws, x, idx, sort):
        def proj(name, h):
            return mx.gather_qmm(h, ws[f"{name}.weight"], ws[f"{name}.scales"], ws[f"{name}.biases"], rhs_indices=idx,
                                 transpose=True, group_size=GROUP, bits=BITS, sorted_indices=sort)
        h = nn_silu(proj("gate", x)) * proj("up", x)
        return proj("down", h)

    rows = {}
    rng = np.random.default_rng(0)
    for label, tokens in (("decode", 1), ("prefill", 64)):
        ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)]).astype(np.uint32)
        if tokens == 1:
            x = mx.random.normal((1, 1, 1, HIDDEN)).astype(mx.bfloat16)
            idx, sort = mx.array(ids.reshape(1, 1, TOP_K)), False
        else:
            # SwitchGLU's sorted path: one row per (token, expert), ids sorted.
            order = np.argsort(ids.reshape(-1), kind="stable")
            idx = mx.array(ids.reshape(-1)[order])
            x = mx.random.normal((tokens * TOP_K, 1, HIDDEN)).astype(mx.bfloat16)
            sort = True
        want = glu(tensors, x, idx, sort)
        got = glu(views, x, idx, sort)
        rows[label] = {
            "equal": bool(mx.array_equal(want, got)),
            "contiguous_ms": median_ms(lambda: glu(tensors, x, idx, sort), args.reps),
            "views_ms": median_ms(lambda: glu(views, x, idx, sort), args.reps),
        }
        print(label, json.dumps(rows[label]), flush=True)
    out = {"device": str(mx.default_device()), "stride": stride, "same_bytes": same_bytes, "gather_qmm": rows}
    out["queue"] = queue_times(tensors, views, block, stride, offsets, args.reps)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def nn_silu(x):
    return x * mx.sigmoid(x)


def queue_times(tensors, views, block, stride, offsets, reps: int) -> dict | None:
    """Host ms to queue 8 experts' admission from pinned memory: per tensor vs per block."""
    try:
        from moestream._native import CudaCopier, HostBuffer
        copier = CudaCopier(4)
    except ImportError as e:
        return {"skipped": str(e)}
    staging = HostBuffer(TOP_K * stride, copier)
    pool = {name: mx.zeros(a.shape, a.dtype) for name, a in tensors.items()}
    target = mx.zeros(block.shape, block.dtype)
    mx.eval(list(pool.values()), target)
    per_tensor = [(pool[name], (10 + i) * (a.nbytes // EXPERTS), staging, i * stride + offsets[name], a.nbytes // EXPERTS)
                  for i in range(TOP_K) for name, a in tensors.items()]
    expert_bytes = max(offsets[n] + tensors[n].nbytes // EXPERTS for n in tensors)
    per_block = [(target, (10 + i) * stride, staging, i * stride, expert_bytes) for i in range(TOP_K)]
    out = {}
    for label, spans in (("per_tensor", per_tensor), ("per_block", per_block)):
        copier.copy(spans)  # exports and first-touch costs out of the timing
        queue = []
        for _ in range(reps):
            tic = time.perf_counter()
            copier.copy(spans, wait=False)
            queue.append(time.perf_counter() - tic)
            copier.sync()
        out[label] = {"copies": len(spans), "queue_ms": 1e3 * statistics.median(queue)}
    return out


if __name__ == "__main__":
    main()
