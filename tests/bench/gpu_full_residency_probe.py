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

import mlx.core as mx

from moestream.daemon.bench.decode import host_split_per_token, paired_blocks, timed_decode, timed_round
from moestream.daemon.model.streaming_model import _module_at, load_stock_model, load_streaming_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


def decode_split(model, prompt: list[int], steps: int) -> dict[str, float]:
    """mlx-lm's pipelined greedy decode (`bench decode`'s loop): tokens/s, and the host's
    ms per token building the graph (the model's call), launching it and waiting."""
    split: dict[str, float] = {}
    seconds, _ = timed_decode(model, prompt, steps, 0.0, 0, split=split)
    ms = host_split_per_token(split, steps)
    return {
        "tokens_per_s": steps / seconds,
        "build_ms": ms["host_call_ms_per_token"],
        "launch_ms": ms["host_launch_ms_per_token"],
        "wait_ms": ms["host_wait_ms_per_token"],
    }


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

    def keep(rows: list[dict[str, float]], ratios: list[float]) -> None:
        # Written after every block, so that a run cut off keeps its blocks.
        report["abba"] = {"blocks": rows, "ratios": ratios}
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(
            json.dumps(
                {
                    "block": len(ratios),
                    **rows[-1],
                    "ratio": round(ratios[-1], 4),
                    "median": round(statistics.median(ratios), 4),
                }
            ),
            flush=True,
        )

    if args.abba:
        report["abba"] = paired_blocks(runs["stock"], runs["moestream@1"], args.abba, keep)
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        row = {n: timed_round(lambda _seed, n=n: runs[n](), args.tokens, args.min_seconds) for n in names}
        rounds.append(row)
        print(
            json.dumps({"round": i + 1, **{n: {k: round(v, 3) for k, v in r.items()} for n, r in row.items()}}),
            flush=True,
        )
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
