"""Where a batched decode step of a mapped pool (25% in GPU memory, every expert in host
memory) spends its time beyond the step's compute: the link, the copy kernel, the
placement's moves.

    python tests/bench/gpu_mapped_batch_probe.py --store /root/q30/store --out $OUT/mapped_batch_probe_h200.json

1. The copy alone (daemon/mapped/row_gather.py), one layer and all layers queued at once:
   milliseconds and GB/s for n rows of experts in host memory (n = 8 .. 48, what a step
   of 1 .. 6 requests routes at most), by the call a decode step makes (`routed`), with
   distinct experts and with each expert twice (a batch whose requests route the same
   experts; each is copied once, so GB/s counts each expert's bytes once).
2. The daemon's batch (`BatchSession` driven as the engine loop drives it) at B = 1, 2, 4, 6
   requests decoding together, on a mapped pool made as the daemon makes it
   (`--capacity 0.25 --host-cache 20G`): ms per step, and per step the routed pairs
   outside GPU memory, all of them (the rows the gather copies over the link) and
   distinct ones (what a step needs), from the routing the placement reads back. Each B
   runs as the daemon runs (`daemon`: each routed expert copied once), with each routed
   pair copied (`all_pairs`, as before the copy skipped repeats), with the placement
   never moving an expert (`no_moves`), with the kernels reading host memory in place
   (`zero_copy`), and first on a pool holding every expert in GPU memory (`full`: the
   steps' compute alone).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from probe_setup import RoundRobin, mapped_quarter
from probe_timing import median_ms

from moestream.daemon.mapped.row_gather import RowGather
from moestream.daemon.model.batching import BatchSession

ROWS = (8, 16, 24, 32, 48)
SIZES = (1, 2, 4, 6)


def _copy_rates(store: str, reps: int) -> dict:
    sm, moes = mapped_quarter(store)
    try:
        gather = RowGather(use_kernel=RowGather.kernel_available())
        expert_bytes = moes[0].pool.layer.expert_bytes
        layers = []
        for moe, on_gpu in zip(moes, sm.mapped_pool.on_gpu):
            pool = moe.pool
            names = [t.name for t in pool.layer.tensors]
            host = [e for e in range(pool.layer.num_experts) if e not in on_gpu]
            layers.append(([pool.arrays[n] for n in names], host))
        rows = []
        for n in ROWS:
            for twice in (False, True):
                arrays, host = layers[0]
                picked = host[: n // 2] * 2 if twice else host[:n]
                if len(picked) != n or len(set(host[:n])) < (n // 2 if twice else n):
                    continue
                ids = mx.array(picked, dtype=mx.uint32)
                one = median_ms(lambda: gather.routed(arrays, ids)[0], reps)
                every = [(a, mx.array((h[: n // 2] * 2) if twice else h[:n], dtype=mx.uint32)) for a, h in layers]
                queued = median_ms(lambda: [gather.routed(a, i)[0] for a, i in every], max(3, reps // 5))
                link = (n // 2 if twice else n) * expert_bytes
                r = {
                    "rows": n,
                    "each_row_twice": twice,
                    "one_layer_ms": round(one, 4),
                    "one_layer_GBps": round(link / one / 1e6, 2),
                    "all_layers_ms": round(queued, 3),
                    "all_layers_GBps": round(link * len(layers) / queued / 1e6, 2),
                    "copied_bytes_per_layer": n * expert_bytes,
                    "distinct_bytes_per_layer": link,
                }
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
        return {"expert_bytes": expert_bytes, "layers": len(layers), "rows": rows}
    finally:
        sm.close()


class _HostRows:
    """Counts, from the routing the placement reads back, the routed pairs outside GPU
    memory per forward: all of them and distinct ones (per layer, summed over layers)."""

    def __init__(self, placement) -> None:
        self.placement = placement
        self.forwards = 0
        self.pairs = 0
        self.distinct = 0
        self.routed = 0
        inner = placement._consume

        def consume(ready):
            for forward in (np.array(a) for a in ready):
                self.forwards += 1
                for i, layer in enumerate(forward):
                    on_gpu = np.zeros(placement.pools[i].layer.num_experts, bool)
                    on_gpu[list(placement.on_gpu[i])] = True
                    flat = layer.reshape(-1)
                    off = flat[~on_gpu[flat]]
                    self.routed += flat.size
                    self.pairs += off.size
                    self.distinct += np.unique(off).size
            return inner(ready)

        placement._consume = consume

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.forwards, self.pairs, self.distinct, self.routed


def _steps(loop: RoundRobin, b: int, steps: int, rows: _HostRows | None, expert_bytes: int, label: str) -> dict:
    session = loop.session
    entries = [loop.start(100_000) for _ in range(b)]
    # Every request decoding in the batch, a few steps in (a new batch shape compiles).
    loop.run_until(lambda: all(e[1] >= 6 for e in entries))
    first = entries[0]
    before_steps, before_decode = session.stats.steps, session.stats.decode_s
    placement = loop.sm.mapped_pool
    before_rows = rows.snapshot() if rows is not None else (0, 0, 0, 0)
    before_moves = placement.stats.moves if placement is not None else 0
    times = []
    tic0 = time.perf_counter()
    for _ in range(steps):
        made = first[1]
        tic = time.perf_counter()
        loop.run_until(lambda: first[1] > made)
        times.append(1000 * (time.perf_counter() - tic))
    wall = time.perf_counter() - tic0
    for e in entries:
        e[0].close()
        loop.gens.remove(e)
    if placement is not None:
        placement.settle()
    after_rows = rows.snapshot() if rows is not None else (0, 0, 0, 0)
    forwards, pairs, distinct, routed = (a - c for a, c in zip(after_rows, before_rows))
    n_steps = session.stats.steps - before_steps if b > 1 else steps
    r = {
        "variant": label,
        "requests": b,
        "step_ms_median": round(statistics.median(times), 3),
        "step_ms_mean": round(1000 * wall / steps, 3),
        "decode_s": round(session.stats.decode_s - before_decode, 4),
        "steps": n_steps,
        "forwards_read_back": forwards,
        "host_pairs_per_forward": round(pairs / forwards, 1) if forwards else None,
        "host_distinct_per_forward": round(distinct / forwards, 1) if forwards else None,
        "gpu_hit_rate": round(1 - pairs / routed, 4) if routed else None,
        "all_pairs_MB_per_forward": round(pairs * expert_bytes / forwards / 1e6, 1) if forwards else None,
        "distinct_MB_per_forward": round(distinct * expert_bytes / forwards / 1e6, 1) if forwards else None,
        "moves": placement.stats.moves - before_moves if placement is not None else 0,
    }
    print(json.dumps(r), file=sys.stderr, flush=True)
    return r


def _batch_steps(store: str, steps: int) -> list[dict]:
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.shared.settings import Settings

    out = []
    # The same batches on a pool that holds every expert in GPU memory: the steps'
    # compute, with nothing over the link.
    sm = load_streaming_model(store, Settings(capacity=1.0, prefetch="off"))
    try:
        session = BatchSession(sm, 8)
        loop = RoundRobin(sm, session, sm.manifest.config["vocab_size"], 32, random.Random(0))
        for b in SIZES:
            out.append(_steps(loop, b, steps, None, 0, "full"))
        session.close()
    finally:
        sm.close()
    sm = load_streaming_model(store, Settings(capacity=0.25, host_cache=20 * 2**30), mapped=True)
    try:
        placement = sm.mapped_pool
        rows = _HostRows(placement)
        expert_bytes = sm.pools[0].layer.expert_bytes
        session = BatchSession(sm, 8)
        loop = RoundRobin(sm, session, sm.manifest.config["vocab_size"], 32, random.Random(0))
        gathers = {p.gather for p in sm.pools}
        assert len(gathers) == 1, "one RowGather for every pool"
        (gather,) = gathers
        every_pair = None if gather is None else RowGather(use_kernel=RowGather.kernel_available(), each_once=False)
        rebalance = placement.rebalance_tokens
        for label in ("daemon", "all_pairs", "no_moves", "zero_copy", "daemon"):
            placement.rebalance_tokens = 0 if label == "no_moves" else rebalance
            for p in sm.pools:
                p.gather = {"zero_copy": None, "all_pairs": every_pair}.get(label, gather)
            for b in SIZES:
                if b > session.max_batch:
                    continue
                out.append(_steps(loop, b, steps, rows, expert_bytes, label))
        session.close()
    finally:
        sm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip-copy", action="store_true", help="only the batch's steps")
    args = parser.parse_args()
    mx.set_memory_limit(64 * 2**30)
    report: dict = {"device": str(mx.default_device()), "store": args.store}
    if not args.skip_copy:
        report["copy"] = _copy_rates(args.store, args.reps)
        Path(args.out).write_text(json.dumps(report, indent=1))
    report["steps"] = _batch_steps(args.store, args.steps)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for r in report.get("copy", {}).get("rows", []):
        print(
            f"copy {r['rows']:>2} rows{' (each twice)' if r['each_row_twice'] else '':<13}"
            f" one layer {r['one_layer_ms']:7.3f} ms {r['one_layer_GBps']:6.1f} GB/s"
            f"   all layers {r['all_layers_ms']:8.2f} ms {r['all_layers_GBps']:6.1f} GB/s"
        )
    for r in report["steps"]:
        print(
            f"{r['variant']:<10} B={r['requests']}  {r['step_ms_median']:7.2f} ms a step (mean {r['step_ms_mean']:.2f})"
            f"  host pairs {r['host_pairs_per_forward']}  distinct {r['host_distinct_per_forward']}"
            f"  pairs {r['all_pairs_MB_per_forward']} MB  distinct {r['distinct_MB_per_forward']} MB"
            f"  hit {r['gpu_hit_rate']}  moves {r['moves']}"
        )


if __name__ == "__main__":
    main()
