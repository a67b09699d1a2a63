"""A chat's next turn after a cached prefix, on the GPU: the continuation (a few dozen
tokens on a cache holding a 2048-token history) forwarded as stock does and padded in
both lengths (daemon/model/kv_buckets.py `continue_prompt`), each at turn lengths it has
not met before, in one process on the same weights. Per turn: ms of each forward
(evaluated), the next token's logits (max abs difference, padded against stock) and 16
greedy tokens after it (equal or not).

    python tests/bench/gpu_continuation_probe.py --store /root/q30/store --out /tmp/out/continuation_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.model.kv_buckets import continue_prompt, default_continuation_bucket
from moestream.daemon.model.streaming_model import load_stock_model

HISTORY = 2048
GREEDY = 16


def _timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - tic)


def _greedy(model, cache, token: int) -> tuple[list[int], mx.array]:
    out, first = [], None
    for _ in range(GREEDY):
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        first = logits if first is None else first
        token = int(mx.argmax(logits))
        out.append(token)
    return out, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--turns", default="33,40,47,52,61,70,29,38")
    args = parser.parse_args()
    mx.set_memory_limit(96 * 2**30)
    model = load_stock_model(args.store)
    vocab = model.args.vocab_size if hasattr(model, "args") else 151936
    bucket = default_continuation_bucket()
    history = mx.array([i * 7919 % vocab for i in range(HISTORY)])
    base = make_prompt_cache(model)
    model(history[None], cache=base)
    mx.eval([c.state for c in base])

    def copy_of(cache):
        out = make_prompt_cache(model)
        for a, b in zip(out, cache):
            a.state = (mx.array(b.keys), mx.array(b.values), b.offset)
        mx.eval([c.state for c in out])
        return out

    rows = []
    for i, n in enumerate(int(t) for t in args.turns.split(",")):
        turn = mx.array([(j * 104729 + i) % vocab for j in range(n)])
        stock, padded = copy_of(base), copy_of(base)
        stock_ms = _timed(lambda: (model(turn[None], cache=stock), mx.eval([c.state for c in stock])))
        padded_ms = _timed(lambda: (continue_prompt(model, turn, padded, bucket), mx.eval([c.state for c in padded])))
        want, want_logits = _greedy(model, stock, int(turn[-1]))
        got, got_logits = _greedy(model, padded, int(turn[-1]))
        rows.append({
            "turn_tokens": n,
            "stock_ms": stock_ms,
            "padded_ms": padded_ms,
            "logits_max_abs_diff": float(mx.abs(got_logits - want_logits).max()),
            "same_greedy_tokens": got == want,
        })  # fmt: skip
        print(rows[-1], flush=True)
        Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "key_bucket": bucket,
                                              "history": HISTORY, "turns": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
