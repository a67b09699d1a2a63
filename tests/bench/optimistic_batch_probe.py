"""Issue 55's optimistic forwards in a batch step: the daemon's batch step (`RowBatch`) of B
requests on a partial pool, each step checked every few layers (daemon/model/optimistic.py)
against the same step with a sync at every layer, in A B B A blocks (the pool, the
prompts and the tokens the same; each block's two runs of each path start from the same
prefilled caches' copies, greedy); `--rule`: the A side as the miss rule picks it.

    python tests/bench/optimistic_batch_probe.py --store STORE --capacity 0.5 --batch 4 \
        --steps 24 --blocks 4 --out optimistic_batch_probe.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.model.row_batch import RowBatch
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings


def _prefilled(model, prompt: list[int]) -> list:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))
    return cache


def _run(sm, rows: RowBatch, caches: list, tokens: list[int], steps: int, mode: bool | None) -> tuple[float, list]:
    """Seconds for `steps` batch steps from copies of `caches`, and the tokens made;
    `mode`: forced optimistic (True), per-layer (False), or the miss rule (None)."""
    sm.optimistic.force(mode)
    caches = copy.deepcopy(caches)
    made = []
    tic = time.perf_counter()
    for _ in range(steps):
        logits = rows.step(tokens, caches)
        tokens = np.array(mx.argmax(logits, axis=-1)).tolist()
        made.append(tokens)
    return time.perf_counter() - tic, made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--capacity", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rule", action="store_true", help="the A side by the miss rule, not forced optimistic")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    mode = None if args.rule else True
    sm = load_streaming_model(args.store, Settings(capacity=args.capacity, prefetch="off"))
    rng = np.random.default_rng(5)
    vocab = sm.manifest.config.get("text_config", sm.manifest.config)["vocab_size"]
    prompts = [rng.integers(0, vocab, size=args.prompt_tokens).tolist() for _ in range(args.batch)]
    rows = RowBatch(sm.model)
    assert rows.probe() and sm.optimistic is not None
    caches = [_prefilled(sm.model, p) for p in prompts]
    tokens = [p[-1] for p in prompts]
    _run(sm, rows, caches, tokens, args.steps, mode)  # warm-up: the pool fills, the first forward probes
    _run(sm, rows, caches, tokens, args.steps, False)
    forwards, redos = sm.optimistic.forwards, sm.optimistic.redos
    ratios, runs = [], {"optimistic": [], "per_layer": []}
    same = True
    for _ in range(args.blocks):
        a1, ta = _run(sm, rows, caches, tokens, args.steps, mode)
        b1, tb = _run(sm, rows, caches, tokens, args.steps, False)
        b2, _ = _run(sm, rows, caches, tokens, args.steps, False)
        a2, _ = _run(sm, rows, caches, tokens, args.steps, mode)
        same = same and ta == tb
        runs["optimistic"] += [args.steps / a1, args.steps / a2]
        runs["per_layer"] += [args.steps / b1, args.steps / b2]
        ratios.append((b1 + b2) / (a1 + a2))  # steps/s optimistic over per-layer
    stats = sm.pool_stats()
    out = {
        "store": args.store,
        "capacity": args.capacity,
        "batch": args.batch,
        "steps": args.steps,
        "blocks": args.blocks,
        "steps_per_s": {k: statistics.median(v) for k, v in runs.items()},
        "optimistic_over_per_layer": {"median": statistics.median(ratios), "blocks": ratios},
        "same_tokens": same,
        "a_side": "miss rule" if args.rule else "forced optimistic",
        "timed_steps": 2 * args.blocks * args.steps,
        "redos": sm.optimistic.redos - redos,
        "optimistic_forwards": sm.optimistic.forwards - forwards,
        "hit_rate_decode": stats.hits_decode / max(1, stats.hits_decode + stats.misses_decode),
    }
    sm.close()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
