"""Does a forward at a key length the device has not seen before cost extra? (GPU machine)

    python tests/bench/gpu_shape_probe.py --store daemon/demo/store --out $OUT/shape_probe.json

On the H200, `bench decode --speculative mtp` with the probe on (auto) ran some requests
at a tenth of plain decode's speed, and its three rounds differed by up to 6x, while the
forced runs (K fixed, no probe) were steady. A forced run repeats the warm-up's exact
sequence of (query length, key length) pairs; an auto run, whose switches depend on
timings, does not. If the CUDA backend builds something per attention shape (a cuDNN
graph, a JIT kernel), each new pair pays for it. This probe times, at key lengths never
used before and then again at the same lengths:

1. `mx.fast.scaled_dot_product_attention` alone, query lengths 1 (decode) and 2..5
   (verify of K = 1..4 drafts), causal mask as mlx-lm passes it;
2. a whole forward of the model in the store (capacity 1: every expert resident) with
   the same query lengths, by trimming the KV cache back and running again;
3. the same with the cache speculation uses on CUDA (daemon/model/kv_buckets.py: keys padded
   to multiples of 256, so a new key length is mostly not a new shape).

Each figure is the median over the key lengths; "first" at a new length, "again" at a
length just used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.model.kv_buckets import CUDA_KEY_BUCKET, bucketed
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings


def _ms(fn) -> float:
    tic = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - tic)


def sdpa_probe(heads: int, kv_heads: int, dim: int, start: int, lengths: int) -> dict:
    out = {}
    for q_len in (1, 2, 3, 4, 5):
        first, again = [], []
        for i in range(lengths):
            kv = start + 7 * i + 1000 * q_len  # never used before, by this or another query length
            q = mx.random.normal((1, heads, q_len, dim)).astype(mx.bfloat16)
            k = mx.random.normal((1, kv_heads, kv, dim)).astype(mx.bfloat16)
            v = mx.random.normal((1, kv_heads, kv, dim)).astype(mx.bfloat16)
            mx.eval(q, k, v)
            mask = "causal" if q_len > 1 else None

            def call() -> None:
                mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask))

            first.append(_ms(call))
            again.append(_ms(call))
        out[f"q{q_len}"] = {
            "first_ms": statistics.median(first),
            "again_ms": statistics.median(again),
            "first_max_ms": max(first),
        }
        print("sdpa", q_len, out[f"q{q_len}"], flush=True)
    return out


def forward_probe(store: Path, lengths: int, bucket: int = 0) -> dict:
    sm = load_streaming_model(store, Settings(capacity=1.0, mapped=False))
    try:
        model = sm.model
        out = {}
        for q_len in (1, 2, 3, 4, 5):
            cache = bucketed(make_prompt_cache(model), bucket)
            tokens = mx.array([[1 + (i % 50) for i in range(64 + 13 * q_len)]])
            mx.eval(model(tokens, cache=cache))
            step = mx.array([[3 + i for i in range(q_len)]])
            first, again = [], []
            for _ in range(lengths):
                first.append(_ms(lambda: mx.eval(model(step, cache=cache))))
                for c in cache:
                    c.trim(q_len)
                again.append(_ms(lambda: mx.eval(model(step, cache=cache))))
            out[f"q{q_len}"] = {
                "first_ms": statistics.median(first),
                "again_ms": statistics.median(again),
                "first_max_ms": max(first),
            }
            print("forward", bucket, q_len, out[f"q{q_len}"], flush=True)
        return out
    finally:
        sm.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", type=int, default=24)
    args = parser.parse_args()
    mx.set_memory_limit(32 * 2**30)
    # Warm-up at lengths far from those probed.
    sdpa_probe(8, 2, 64, 20000, 2)
    result = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "sdpa": sdpa_probe(16, 4, 128, 200, args.lengths),
        "forward": forward_probe(args.store, args.lengths),
        "forward_bucketed": forward_probe(args.store, args.lengths, CUDA_KEY_BUCKET),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
