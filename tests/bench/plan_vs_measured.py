"""`moestreamctl plan`'s forecast beside what `bench decode` and `bench prefill` measure, in
paired rounds on one machine: each round runs the plan's compute probe, then times the
same store's decode (bench decode's loop, 64 tokens, a full pool) and its first token of a
prompt (bench prefill's run) at each capacity, so that the forecast and the measurement
meet the same machine.

On a shared machine the load moves wall-clock figures 2-3x within minutes; with `--clock
cpu` every clock (the probe's and the measurements') is the process's CPU time, which the
load does not move: the forecast's own error, apart from the machine's. (The probe scales
its wall-clock times by the share of a core it had, to an idle machine's: `--clock wall`
against a busy machine measures slower than it.) The disk and link are not timed here: a
store whose misses cost reads needs `bench decode --forecast`.

    python tests/bench/plan_vs_measured.py --model daemon/demo/store --prompt-tokens 2048 --rounds 3 --out F.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an expert store")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capacity", type=float, action="append", help="pool shares (repeat); default 1.0 and 0.25")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--out", help="write the rounds here as JSON")
    args = parser.parse_args(argv)
    import moestream.daemon.bench.decode as bench_decode
    import moestream.daemon.bench.prefill as bench_prefill
    import moestream.daemon.planning.plan as plan

    if args.clock == "cpu":
        cpu = types.SimpleNamespace(perf_counter=time.process_time, process_time=time.process_time)
        plan.time = bench_prefill.time = bench_decode.time = cpu
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.daemon.planning.probe_models import resident_dtype
    from moestream.shared.settings import Settings
    from moestream.shared.store_format import load_manifest

    store, n, caps = Path(args.model), args.prompt_tokens, args.capacity or [1.0, 0.25]
    manifest = load_manifest(store)
    vocab = int(manifest.config.get("text_config", manifest.config)["vocab_size"])
    prompt = np.random.default_rng(0).integers(0, vocab, size=n).tolist()
    pools = {c: load_streaming_model(store, Settings(model=str(store), capacity=c), max_tokens=n + 1) for c in caps}
    for sm in pools.values():  # kernels built
        bench_prefill._first_token_seconds(bench_prefill._streamed_run(sm, prompt[:64], 2048))
    bench_decode.timed_decode(pools[caps[0]].model, prompt[:32], 8, 0.0, 0)
    bandwidths = plan.Bandwidths(1e12, 1e12, "not timed", "given")  # compute alone: see the docstring
    rounds = []
    for r in range(args.rounds):
        compute = plan.probe_compute(manifest, resident_dtype(store, manifest), repeats=1)
        row: dict[str, list[float]] = {}
        for cap in caps:
            settings = Settings(model=str(store), capacity=cap)
            counts, source = plan.heat_counts(store, settings, manifest)
            p = plan.make_plan(store, settings, bandwidths, compute, counts, source, prompt_tokens=n)
            ttft = bench_prefill._first_token_seconds(bench_prefill._streamed_run(pools[cap], prompt, 2048))
            row[f"ttft_s@{cap:g}"] = [p.ttft.seconds, ttft]
            if cap == 1.0:
                seconds, _ = bench_decode.timed_decode(pools[cap].model, prompt[:32], 64, 0.0, 0)
                row["decode_tok_s@1"] = [p.decode.tokens_per_s, 64 / seconds]
        rounds.append(row)
        print(
            f"round {r + 1}: " + "; ".join(f"{k} forecast {f:.3g} measured {m:.3g}" for k, (f, m) in row.items()),
            file=sys.stderr,
            flush=True,
        )
    # measured over forecast for times, forecast over measured for rates: above 1, slower than forecast.
    ratios = {
        k: statistics.median((m / f) if k.startswith("ttft") else (f / m) for f, m in (row[k] for row in rounds))
        for k in rounds[0]
    }
    report = {
        "argv": sys.argv,
        "clock": args.clock,
        "store": str(store),
        "rounds": rounds,
        "slower_than_forecast": ratios,
    }
    print(json.dumps(ratios))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
