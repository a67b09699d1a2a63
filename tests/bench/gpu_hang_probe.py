"""Does MLX's CUDA build stall on this machine on stock mlx-lm alone? Prefills of random
lengths (8-200 tokens), each followed by decodes pipelined as mlx-lm's generate does, on
a store's stock model, every one timed on its own line; one that takes longer than
--stall seconds prints every thread's stack and ends the process (exit 1).

Two stages stalled so on an H200 (2026-12-07): decode-q30 in its first timed round and
row-batch-q30 in stock's prefill, each waiting on the GPU. gpu_run.sh's hang-probe runs
this under MLX's switches that change how work reaches the GPU, to tell them apart. The
next lease (an H100) answered: with --stall 150 the first prefill (171 tokens) finished
in 118 s, the GPU idle meanwhile, and the decodes after it took 0.07 s: MLX compiling its
kernels on a fresh machine, not a stall (tests/bench/RESULTS.md, "Wave 3 on the GPU")."""

from __future__ import annotations

import argparse
import faulthandler
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from moestream.daemon.model.streaming_model import load_stock_model
from moestream.shared.settings import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--seconds", type=float, default=60.0, help="how long to keep going")
    p.add_argument("--stall", type=float, default=20.0, help="one prefill and its decodes longer than this: a stall")
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--mlx-memory-limit", default="60G")
    args = p.parse_args()
    mx.set_memory_limit(parse_size(args.mlx_memory_limit))
    tic = time.perf_counter()
    model = load_stock_model(args.store)
    print(f"loaded in {time.perf_counter() - tic:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    end = time.monotonic() + args.seconds
    n = 0
    while time.monotonic() < end:
        faulthandler.dump_traceback_later(args.stall, exit=True)
        length = int(rng.integers(8, 200))
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(mx.array(rng.integers(0, vocab, length))[None], cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        t1 = time.perf_counter()
        for _ in range(args.decodes):
            next_y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(next_y)
            y.item()
            y = next_y
        y.item()
        t2 = time.perf_counter()
        print(f"{n} prompt {length}: prefill {t1 - t0:.3f} s, {args.decodes} decodes {t2 - t1:.3f} s", flush=True)
        n += 1
    faulthandler.cancel_dump_traceback_later()
    print(f"no stall: {n} prompts in {args.seconds:g} s", flush=True)


if __name__ == "__main__":
    main()
