"""Where moestream at 100% loses to stock mlx-lm on the GPU machine, if it does.

    python tests/bench/gpu_full_residency_probe.py --store /root/q30/store --out $OUT/full_residency.json

With every expert resident, moestream's layer calls mlx-lm's own SwitchGLU on the pool's
arrays with the routed ids as they are, so the kernels are stock's. What is left to
differ: the streaming layer's Python around that call (host time per layer, and decode
on the GPU machine is bound by the host) and where the expert arrays live (the pool's
arrays are allocated on the GPU stream and advised to GPU memory; stock's come from
NumPy). Four variants take turns in every round, each for at least --min-seconds:

- stock: mlx-lm's model as `load_stock_model` holds it;
- moestream@1: the streaming model at 100%;
- unwrapped: the same model with each streaming layer replaced by the SwitchGLU inside
  it, which holds the pool's arrays (so: the wrapper's cost);
- unwrapped+stock-experts: that, with stock's expert arrays put in (so: the memory's).

Per token it splits the host's time into building the graph (the model's Python),
launching it (`mx.async_eval`) and waiting for the token (`.item()`).

On the H200 that split shows decode to be bound by the host (the wait is ~0) and the
host's own speed to swing by 1.5x from one round to the next, which moves every variant
alike. `--abba N` therefore also times stock and moestream@1 in N blocks of four
decodes, A B B A, so that a drift of the host's speed within a block cancels, and takes
the ratio per block.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable

import mlx.core as mx

from moestream.daemon.bench_decode import timed_decode
from moestream.daemon.store.loader import _module_at, load_stock_model, load_streaming_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


def decode_split(model, prompt: list[int], steps: int) -> dict[str, float]:
    """mlx-lm's pipelined greedy decode (`bench decode`'s loop), timing each step's parts
    on the host: building the graph (the model's call), launching it, waiting."""
    split: dict[str, float] = {}
    seconds, _ = timed_decode(model, prompt, steps, 0.0, 0, split=split)
    return {"seconds": seconds, "build_s": split["call_s"], "launch_s": split["launch_s"], "wait_s": split["wait_s"]}


def timed(run: Callable[[], dict[str, float]], steps: int, min_seconds: float) -> dict[str, float]:
    acc = {"seconds": 0.0, "build_s": 0.0, "launch_s": 0.0, "wait_s": 0.0}
    tokens = 0
    while True:
        r = run()
        for k in acc:
            acc[k] += r[k]
        tokens += steps
        if acc["seconds"] >= min_seconds:
            break
    return {
        "tokens_per_s": tokens / acc["seconds"],
        "build_ms": 1e3 * acc["build_s"] / tokens,
        "launch_ms": 1e3 * acc["launch_s"] / tokens,
        "wait_ms": 1e3 * acc["wait_s"] / tokens,
    }


def abba(stock: Callable[[], dict[str, float]], ours: Callable[[], dict[str, float]], blocks: int, tokens: int,
         out: str, report: dict) -> dict:
    """Blocks of A B B A decodes (A stock, B moestream@1): the ratio of their tokens/s per
    block. Written to `out` after every block, so that a run cut off keeps its blocks."""
    ratios, rows = [], []
    for i in range(blocks):
        a1, b1, b2, a2 = stock(), ours(), ours(), stock()
        a_s, b_s = a1["seconds"] + a2["seconds"], b1["seconds"] + b2["seconds"]
        rows.append({"stock_tokens_per_s": 2 * tokens / a_s, "moestream_tokens_per_s": 2 * tokens / b_s})
        ratios.append(a_s / b_s)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        result = {"blocks": rows, "ratios": ratios, "median": statistics.median(ratios), "quartiles": [q[0], q[2]]}
        report["abba"] = result
        Path(out).write_text(json.dumps(report, indent=1))
        print(json.dumps({"block": i + 1, **rows[-1], "ratio": round(ratios[-1], 4), "median": round(result["median"], 4)}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True, type=Path)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--abba", type=int, default=0, help="blocks of stock/moestream@1/moestream@1/stock decodes")
    args = parser.parse_args()
    mx.set_memory_limit(100 * 2**30)
    manifest = load_manifest(args.store)
    stock = load_stock_model(args.store)
    sm = load_streaming_model(args.store, Settings(capacity=1.0))
    wrapped, inner, stock_experts, pool_experts = [], [], [], []
    for layer in manifest.layers:
        parent, key, module = _module_at(sm.model, layer.module_path)
        wrapped.append((parent, key, module))
        inner.append(module.inner)
        _, _, stock_module = _module_at(stock, layer.module_path)
        names = [t.name for t in layer.tensors]
        stock_experts.append({n: getattr(stock_module, n.rsplit(".", 1)[0])[n.rsplit(".", 1)[1]] for n in names})
        pool_experts.append(dict(module.pool.arrays))

    def put(experts: list[dict[str, mx.array]]) -> None:
        for module, arrays in zip(inner, experts):
            for name, a in arrays.items():
                projection, param = name.rsplit(".", 1)
                getattr(module, projection)[param] = a

    def set_wrapped(on: bool) -> None:
        for (parent, key, module), m in zip(wrapped, inner):
            parent[key] = module if on else m

    def variant(name: str):
        def run() -> dict[str, float]:
            set_wrapped(name == "moestream@1")
            put(stock_experts if name == "unwrapped+stock-experts" else pool_experts)
            model = stock if name == "stock" else sm.model
            return decode_split(model, prompt, args.tokens)

        return run

    prompt = list(range(100, 132))
    names = ["stock", "moestream@1", "unwrapped", "unwrapped+stock-experts"]
    runs = {n: variant(n) for n in names}
    for n in names:
        runs[n]()
        runs[n]()
    report: dict = {"tokens": args.tokens, "min_seconds": args.min_seconds}
    if args.abba:
        report["abba"] = abba(runs["stock"], runs["moestream@1"], args.abba, args.tokens, args.out, report)
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        row = {n: timed(runs[n], args.tokens, args.min_seconds) for n in names}
        rounds.append(row)
        print(json.dumps({"round": i + 1, **{n: {k: round(v, 3) for k, v in r.items()} for n, r in row.items()}}), flush=True)
    summary = {}
    for n in names:
        ratios = [r[n]["tokens_per_s"] / r["stock"]["tokens_per_s"] for r in rounds]
        summary[n] = {
            "tokens_per_s_median": statistics.median(r[n]["tokens_per_s"] for r in rounds),
            "paired_vs_stock_median": statistics.median(ratios),
            "paired_vs_stock": ratios,
            **{k: statistics.median(r[n][k] for r in rounds) for k in ("build_ms", "launch_ms", "wait_ms")},
        }
    report.update(rounds=rounds, summary=summary)
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
