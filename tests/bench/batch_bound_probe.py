"""Issue 56's target for partial pools: a batch step at capacity c against its bound, the
same step on a full pool plus the bytes its union of experts read over the store's
measured bandwidth. The daemon's batch step (`RowBatch`; a lone request's is the model's
own call) of B requests runs on two models of one store, a full pool (A) and a pool of
capacity c (B), in A B B A blocks; each run starts from copies of the same prefilled
caches and samples the same tokens (seeded, temperature 1: a random-weight model decodes
greedily into loops that route far more regularly than a real one), so both make the
same tokens and the bound of each block is `A's seconds + B's bytes read / bandwidth`.

    python tests/bench/batch_bound_probe.py --store STORE --capacity 0.5 --batch 1 --batch 4 \
        --steps 16 --blocks 4 --out batch_bound_probe.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.model.batching import batch_cap
from moestream.daemon.model.row_batch import RowBatch
from moestream.daemon.model.streaming_model import StreamingModel, load_streaming_model
from moestream.daemon.planning.bandwidth import measure_read_bandwidth, settle_writes
from moestream.daemon.planning.pool_probe import decode_counters
from moestream.shared.settings import Settings


def _run(sm: StreamingModel, rows: RowBatch, caches: list, tokens: list[int], steps: int, seed: int):
    """Seconds for `steps` steps from copies of `caches`, the tokens made, and the bytes
    read from the store (on demand and by the prefetcher)."""
    caches = copy.deepcopy(caches)
    before = decode_counters(sm)
    mx.random.seed(seed)
    made = []
    tic = time.perf_counter()
    for _ in range(steps):
        if len(tokens) == 1:
            logits = sm.model(mx.array(tokens)[None], cache=caches[0])[:, -1, :]
        else:
            logits = rows.step(mx.array(tokens), caches)
        tokens = np.array(mx.random.categorical(logits)).tolist()
        made.append(tokens)
    seconds = time.perf_counter() - tic
    after = decode_counters(sm)
    read = sum(after[k] - before[k] for k in ("bytes_from_disk", "prefetch_bytes_read"))
    return seconds, made, read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--capacity", type=float, default=0.5)
    ap.add_argument("--batch", type=int, action="append", help="requests per step (repeatable; default 1 and 4)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    batches = args.batch or [1, 4]
    full = load_streaming_model(args.store, Settings(capacity=1.0))
    part = load_streaming_model(args.store, Settings(capacity=args.capacity))
    cap = batch_cap(part, max(batches))
    if cap < max(batches):
        raise SystemExit(f"capacity {args.capacity} caps the batch at {cap} (B x top-k within the slots)")
    rng = np.random.default_rng(5)
    vocab = full.manifest.config.get("text_config", full.manifest.config)["vocab_size"]
    out = {"store": args.store, "capacity": args.capacity, "steps": args.steps, "blocks": args.blocks, "batches": {}}
    for b in batches:
        prompts = [rng.integers(0, vocab, size=args.prompt_tokens).tolist() for _ in range(b)]
        caches = []
        for p in prompts:
            cache = make_prompt_cache(full.model)
            mx.eval(full.model(mx.array(p[:-1])[None], cache=cache))
            caches.append(cache)
        tokens = [p[-1] for p in prompts]
        full_side, part_side = (full, RowBatch(full.model)), (part, RowBatch(part.model))
        assert b == 1 or (full_side[1].probe() and part_side[1].probe())
        for side in (full_side, part_side):  # warm-up: the pool fills, the kernels of this size compile
            _run(*side, caches, tokens, args.steps, 0)
        seconds = {"full": [], "part": []}
        read, same = [], True
        for block in range(args.blocks):
            seed = 1 + block
            a1, ta, _ = _run(*full_side, caches, tokens, args.steps, seed)
            b1, tb, r1 = _run(*part_side, caches, tokens, args.steps, seed)
            b2, _, r2 = _run(*part_side, caches, tokens, args.steps, seed)
            a2, _, _ = _run(*full_side, caches, tokens, args.steps, seed)
            same = same and ta == tb
            seconds["full"].append((a1 + a2) / 2)
            seconds["part"].append((b1 + b2) / 2)
            read.append((r1 + r2) / 2)
        out["batches"][str(b)] = {"seconds": seconds, "bytes_read": read, "same_tokens": same}
    settle_writes()
    bandwidth = measure_read_bandwidth(Path(args.store), Settings().io_threads)
    out["read_bandwidth_bytes_per_s"] = bandwidth
    for b, r in out["batches"].items():
        bounds = [f + n / bandwidth for f, n in zip(r["seconds"]["full"], r["bytes_read"])]
        ratios = [p / bound for p, bound in zip(r["seconds"]["part"], bounds)]
        r["step_ms"] = {k: 1e3 * statistics.median(v) / args.steps for k, v in r["seconds"].items()}
        r["bytes_read_per_step"] = statistics.median(r["bytes_read"]) / args.steps
        r["over_bound"] = {"median": statistics.median(ratios), "blocks": ratios}
        r["over_full"] = statistics.median(p / f for p, f in zip(r["seconds"]["part"], r["seconds"]["full"]))
    stats = part.pool_stats()
    out["hit_rate_decode"] = stats.hits_decode / max(1, stats.hits_decode + stats.misses_decode)
    full.close()
    part.close()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(
        json.dumps(
            {
                b: {k: r[k] for k in ("step_ms", "bytes_read_per_step", "over_bound", "over_full", "same_tokens")}
                for b, r in out["batches"].items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
