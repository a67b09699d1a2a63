"""Probes for the next design step on the GPU machine (see the issue 6 notes).

    python tests/bench/gpu_mapped_probe.py --store /root/q30/store --out $OUT/mapped_q30.json

1. Full residency: stock mlx-lm vs moestream's pool (managed memory, kept on the GPU) vs
   the same pool replaced by device-memory copies made on the GPU; greedy tokens
   compared, tokens/s per round, ratios to stock per round.
2. A "mapped" pool: every expert addressable in managed memory, the hottest share of
   each layer's experts (by a warm-up's routing) placed in GPU memory and the rest in
   host memory, read by the kernels over the link; no host sync per layer. Decode at
   temperature 1 for shares 12.5/25/50%, with the share of routed experts that were on
   the GPU.
3. What reading the routing back costs: the same decode reading, after each token, the
   expert ids of the token two steps back (already computed), against not reading them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from moestream._native import CudaCopier
from moestream.daemon.bench.decode import timed_decode
from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
from moestream.shared.settings import Settings

_SAME_WIDTH_UINT = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8}


def device_copy(a: mx.array) -> mx.array:
    """A bit-exact copy computed on the GPU (so it lives in device memory)."""
    u = _SAME_WIDTH_UINT[a.dtype.size]
    return (a.view(u) + 0).view(a.dtype)


def full_residency(store: Path, rounds: int, tokens: int) -> dict:
    prompt = list(range(100, 132))
    stock = load_stock_model(store)
    managed = load_streaming_model(store, Settings(capacity=1.0))
    dev = load_streaming_model(store, Settings(capacity=1.0))
    for moe in _moes(dev.model):
        pool = moe.pool
        pool.arrays = {k: device_copy(v) for k, v in pool.arrays.items()}
        mx.eval(list(pool.arrays.values()))
        moe._use(pool.arrays)
    configs = {"stock": stock, "managed": managed.model, "device_copy": dev.model}
    want = timed_decode(stock, prompt, tokens, 0.0, 0)[1]
    same = {name: timed_decode(m, prompt, tokens, 0.0, 0)[1] == want for name, m in configs.items()}
    identity = all(m.pool.identity for m in _moes(managed.model))
    build = {name: _graph_build_seconds(m, prompt) for name, m in configs.items()}
    runs: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds):
        for name, m in configs.items():
            seconds, _ = timed_decode(m, prompt, tokens, 0.0, 0)
            runs[name].append(tokens / seconds)
    out = {"same_tokens_as_stock": same, "identity_slots": identity, "graph_build_ms_per_token": build, "runs": runs}
    for name in ("managed", "device_copy"):
        ratios = [a / b for a, b in zip(runs[name], runs["stock"])]
        out[f"{name}_vs_stock_per_round"] = ratios
        out[f"{name}_vs_stock_median"] = statistics.median(ratios)
    return out


def _graph_build_seconds(model, prompt: list[int], steps: int = 16) -> float:
    """Host milliseconds to build one decode step's lazy graph (no evaluation timed)."""
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array(prompt)[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    spent = []
    for _ in range(steps):
        tic = time.perf_counter()
        logits = model(y[None], cache=cache)
        spent.append(time.perf_counter() - tic)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
    return 1e3 * statistics.median(spent)


def _moes(model):
    from moestream.daemon.model.streaming_moe import StreamingMoE

    return [m for _, m in model.named_modules() if isinstance(m, StreamingMoE)]


def _decode_with_readback(sm, prompt: list[int], steps: int, readback: bool) -> tuple[float, np.ndarray]:
    """Sampled decode (temperature 1, seed 0); with readback, after each token the ids
    of every layer two forwards back are read to the host. Returns seconds and counts."""
    layers = len(sm.pools)
    counts = np.zeros((layers, sm.pools[0].layer.num_experts), np.int64)
    for p in sm.pools:
        p.route_log = []
    mx.random.seed(0)
    cache = make_prompt_cache(sm.model)
    y = mx.random.categorical(sm.model(mx.array(prompt)[None], cache=cache)[:, -1, :])
    mx.eval(y)
    for p in sm.pools:
        p.route_log.clear()
    tic = time.perf_counter()
    for step in range(steps):
        next_y = mx.random.categorical(sm.model(y[None], cache=cache)[:, -1, :])
        mx.async_eval(next_y)
        int(y.item())
        if readback and step >= 2:
            for i, p in enumerate(sm.pools):
                ids = np.array(p.route_log[step - 2]).reshape(-1)
                np.add.at(counts[i], ids, 1)
        y = next_y
    mx.eval(y)
    seconds = time.perf_counter() - tic
    if not readback:
        for i, p in enumerate(sm.pools):
            for a in p.route_log:
                np.add.at(counts[i], np.array(a).reshape(-1), 1)
    for p in sm.pools:
        p.route_log = None
    return seconds, counts


def mapped(store: Path, tokens: int) -> dict:
    prompt = list(range(100, 132))
    sm = load_streaming_model(store, Settings(capacity=1.0))
    copier = CudaCopier(1)
    _, heat = _decode_with_readback(sm, prompt, tokens, readback=False)  # warm-up and routing counts
    out: dict = {}
    for share in (0.125, 0.25, 0.5):
        tic = time.perf_counter()
        on_gpu = []
        for i, pool in enumerate(sm.pools):
            n = pool.layer.num_experts
            hot = set(np.argsort(-heat[i], kind="stable")[: int(round(share * n))].tolist())
            on_gpu.append(hot)
            for t in pool.layer.tensors:
                if not t.name.endswith("weight"):
                    continue  # scales and biases are small and not page-aligned per expert: GPU
                a = pool.arrays[t.name]
                copier.place(a, "device")
                for e in range(n):
                    if e not in hot:
                        copier.place(a, "host", e * t.nbytes, t.nbytes)
        placing = time.perf_counter() - tic
        rates, gpu_share = [], []
        for r in range(4):
            seconds, counts = _decode_with_readback(sm, prompt, tokens, readback=False)
            if r:
                rates.append(tokens / seconds)
            routed = counts.sum()
            gpu_share.append(sum(counts[i, sorted(h)].sum() for i, h in enumerate(on_gpu)) / routed)
        seconds, _ = _decode_with_readback(sm, prompt, tokens, readback=True)
        out[f"share_{share:g}"] = {
            "tokens_per_s": statistics.median(rates),
            "runs": rates,
            "routed_on_gpu": statistics.median(gpu_share),
            "placing_seconds": placing,
            "with_readback_tokens_per_s": tokens / seconds,
        }
        print(json.dumps({f"share_{share:g}": out[f"share_{share:g}"]}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True, type=Path)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parts", default="full,mapped", help="comma-separated: full, mapped")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    mx.set_memory_limit(100 * 2**30)
    report: dict = {}
    if "full" in parts:
        report["full_residency"] = full_residency(args.store, args.rounds, args.tokens)
        print(json.dumps(report), flush=True)
        mx.clear_cache()
    if "mapped" in parts:
        report["mapped"] = mapped(args.store, args.tokens)
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
