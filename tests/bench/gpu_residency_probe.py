"""Two measurements on the GPU machine that decide how experts should reach the kernels.

    python tests/bench/gpu_residency_probe.py --store /root/q30/store --out $OUT/residency.json

1. Admission copies: the spans of 64 experts (9 tensors each) from a pinned host tier into
   pool rows, with 1, 2, 4 and 8 CUDA streams, against the pinned bandwidth of one large copy.
2. Decode with every expert resident, stock mlx-lm vs moestream at 100%, rounds taking
   turns, the ratio taken per round; then the same moestream pool with a share of each
   layer's experts placed in host memory, read by the kernels over the link (zero-copy):
   the speed a pool would have if misses were served that way instead of by admission.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from moestream._native import CudaCopier, HostBuffer
from moestream.daemon.bench.decode import timed_decode
from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
from moestream.daemon.pool.host_tier import expert_stride
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest


def copy_rates(store: Path, experts: int = 64) -> dict:
    manifest = load_manifest(store)
    layer = manifest.layers[0]
    stride = expert_stride(manifest)
    out = {}
    for streams in (1, 2, 4, 8):
        copier = CudaCopier(streams)
        host = HostBuffer(experts * stride, copier)
        rows = {t.name: mx.zeros((experts, *t.shape), dtype=getattr(mx, t.dtype)) for t in layer.tensors}
        mx.eval(list(rows.values()))
        for a in rows.values():
            copier.place(a, "device")
        spans = [
            (rows[t.name], e * t.nbytes, host, e * stride + t.offset, t.nbytes)
            for e in range(experts)
            for t in layer.tensors
        ]
        nbytes = sum(s[4] for s in spans)
        copier.copy(spans)
        rates = [nbytes / copier.copy(spans) for _ in range(7)]
        out[f"streams_{streams}"] = statistics.median(rates)
    out["pinned_one_copy"] = CudaCopier(1).probe(1 << 30, 5)["pinned_bytes_per_s"]
    out["spans"] = len(spans)
    out["bytes"] = nbytes
    return out


def decode_rates(store: Path, rounds: int, tokens: int) -> dict:
    prompt = list(range(100, 132))
    stock = load_stock_model(store)
    sm = load_streaming_model(store, Settings(capacity=1.0))
    copier = CudaCopier(1)
    configs = {"stock": stock, "moestream@1": sm.model}
    for m in configs.values():
        timed_decode(m, prompt, tokens, 0.0, 0)
    runs: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds):
        for name, m in configs.items():
            seconds, _ = timed_decode(m, prompt, tokens, 0.0, 0)
            runs[name].append(tokens / seconds)
    ratios = [a / b for a, b in zip(runs["moestream@1"], runs["stock"])]
    out = {"runs": runs, "ratio_per_round": ratios, "ratio_median": statistics.median(ratios)}
    del stock, configs
    # Zero-copy: place the last share of each pool's rows in host memory.
    for share in (0.25, 0.75, 1.0):
        try:
            for pool in sm.pools:
                n = pool.capacity
                first = n - int(round(share * n))
                for t in pool.layer.tensors:
                    a = pool.arrays[t.name]
                    copier.place(a, "device")
                    if first < n:
                        copier.place(a, "host", first * t.nbytes, (n - first) * t.nbytes)
            timed_decode(sm.model, prompt, tokens, 0.0, 0)
            rates = []
            for _ in range(3):
                seconds, _ = timed_decode(sm.model, prompt, tokens, 0.0, 0)
                rates.append(tokens / seconds)
            out[f"zero_copy_{share:g}"] = {"tokens_per_s": statistics.median(rates), "runs": rates}
        except RuntimeError as e:
            out[f"zero_copy_{share:g}"] = {"error": str(e)}
        print(json.dumps({k: v for k, v in out.items() if k.startswith("zero")}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True, type=Path)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    mx.set_memory_limit(64 * 2**30)
    tic = time.perf_counter()
    report = {"copy": copy_rates(args.store)}
    print(json.dumps(report), flush=True)
    report["decode"] = decode_rates(args.store, args.rounds, args.tokens)
    report["seconds"] = time.perf_counter() - tic
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
