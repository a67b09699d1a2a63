"""Issue 60 run 4's first half on the GPU: a request's logits, bit for bit, alone and in
batches of 2 to 8 with random companions of unequal prompt lengths.

For each model (stock mlx-lm's, and the streaming model at each --capacity), request 0
is decoded alone (its own cache, one token a forward, as `generate_step` feeds it), then
beside random companions through the daemon's batch step (`RowBatch`, every dense matmul
on at most ROW_LIMIT rows, each request's attention on its own cache), fed the same
tokens. Beside it, for contrast, the same batch as stock batches it (the caches merged
into one left-padded cache, one forward of every row: `BatchGenerator`'s step) and the
batch step with its row limit lifted (one dense matmul over all B rows). CUDA's kernels
change with the row count, so the contrast rows are expected to differ; the batch step's
rows must not.

    python tests/bench/gpu_row_batch_probe.py --store /root/q30/store --capacity 1 \
        --capacity 0.25 --host-cache 20G --out row_batch_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from moestream.daemon.model import row_batch
from moestream.daemon.model.row_batch import RowBatch
from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
from moestream.shared.settings import Settings, parse_size


def _prefilled(model, prompt: list[int]) -> list:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))
    return cache


def _alone(model, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    cache, token, out, fed = _prefilled(model, prompt), prompt[-1], [], []
    for _ in range(steps):
        fed.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
        token = int(np.argmax(out[-1]))
    return out, fed


def _batched(rows: RowBatch, model, prompts: list[list[int]], fed: list[list[int]]) -> list[np.ndarray]:
    """Request 0's logits at each step of a batch step over every prompt."""
    caches = [_prefilled(model, p) for p in prompts]
    out = []
    for s in range(len(fed[0])):
        logits = rows.step([f[s] for f in fed], caches)
        mx.eval(logits)
        out.append(np.array(logits[0].astype(mx.float32)))
    return out


def _stock_style(model, prompts: list[list[int]]) -> np.ndarray:
    """Row 0's logits of the first step as stock batches it (one left-padded cache)."""
    caches = [_prefilled(model, p) for p in prompts]
    merged = [KVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    logits = model(mx.array([[p[-1]] for p in prompts]), cache=merged)[0, -1]
    mx.eval(logits)
    return np.array(logits.astype(mx.float32))


def _diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(max(np.abs(x - y).max() for x, y in zip(a, b)))


def probe(model, label: str, vocab: int, steps: int, trials: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 200, size=8 * trials + 1)
    pool = [rng.integers(0, vocab, size=int(n)).tolist() for n in lengths]
    alone, fed0 = _alone(model, pool[0], steps)
    rows = RowBatch(model)
    assert rows.probe(), rows.why_not
    cases = []
    for b in range(1, 9):
        for t in range(trials):
            companions = [pool[int(i)] for i in rng.choice(np.arange(1, len(pool)), size=b - 1, replace=False)]
            prompts = [pool[0], *companions]
            # Each companion fed its own greedy tokens would need its own lone run; any
            # tokens do for them (a row must not depend on its companions' at all).
            fed = [fed0] + [rng.integers(0, vocab, size=steps).tolist() for _ in companions]
            got = _batched(rows, model, prompts, fed)
            case = {
                "batch": b,
                "trial": t,
                "lengths": [len(p) for p in prompts],
                "same": _diff(got, alone) == 0.0,
                "max_abs_diff": _diff(got, alone),
            }
            if b > 1 and t == 0:
                case["stock_style_max_abs_diff"] = float(np.abs(_stock_style(model, prompts) - alone[0]).max())
                limit = row_batch.ROW_LIMIT
                row_batch.ROW_LIMIT = 64
                try:
                    case["unsplit_max_abs_diff"] = _diff(_batched(rows, model, prompts, fed), alone)
                finally:
                    row_batch.ROW_LIMIT = limit
            cases.append(case)
            print(
                f"{label} B={b} trial {t}: same {case['same']} (max |d| {case['max_abs_diff']:.3g})"
                + (
                    f", stock-style {case['stock_style_max_abs_diff']:.3g}, unsplit {case['unsplit_max_abs_diff']:.3g}"
                    if "unsplit_max_abs_diff" in case
                    else ""
                ),
                file=sys.stderr,
                flush=True,
            )
    return {"model": label, "steps": steps, "all_same": all(c["same"] for c in cases), "cases": cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--capacity", type=float, action="append", default=[])
    p.add_argument("--host-cache", default=None, help="the host tier of capacities below 1")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trials", type=int, default=2, help="random companion sets per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlx-memory-limit", default="60G")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    mx.set_memory_limit(parse_size(args.mlx_memory_limit))
    results = {"device": str(mx.default_device()), "row_limit": row_batch.ROW_LIMIT, "models": []}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    stock = load_stock_model(args.store)
    vocab = stock.args.vocab_size
    results["models"].append(probe(stock, "stock", vocab, args.steps, args.trials, args.seed))
    save()
    del stock
    mx.clear_cache()
    for capacity in args.capacity or [1.0]:
        host = args.host_cache if capacity < 1 else None
        sm = load_streaming_model(
            args.store, Settings(capacity=capacity, host_cache=parse_size(host or 0), prefetch="off")
        )
        try:
            label = f"{capacity:g}" + (f"+host {host}" if host else "")
            results["models"].append(probe(sm.model, label, vocab, args.steps, args.trials, args.seed))
            save()
        finally:
            sm.close()
        mx.clear_cache()
    print(json.dumps({m["model"]: m["all_same"] for m in results["models"]}))


if __name__ == "__main__":
    main()
