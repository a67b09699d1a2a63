"""How many experts a step of B requests decoding together routes, on a real routing
trace: the distinct experts per layer of B requests' tokens at the same decode step, as a
multiple of one token's top-k, and the same outside a GPU share of each layer's hottest
experts (the mapped pool's placement; the heat counted over the other requests only, so
that the share is not fitted to the requests it serves). A mapped pool's batched step
brings those outside the share over the link, so this is its bytes a step against one
token's (tests/bench/RESULTS.md, "A mapped pool's batched step is bound by the link").

    python tests/bench/trace_batch_union.py --trace tests/data/traces/qwen15moe_gsm8k_dev --out OUT.json

Every group of B of the trace's requests, at every decode step they all have.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter
from pathlib import Path

from moestream.daemon.bench.policy.trace import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="a trace folder (trace.jsonl and meta.json)")
    parser.add_argument("--sizes", default="1,2,4,6,8")
    parser.add_argument("--gpu-share", type=float, default=0.25, help="the share of each layer's experts in GPU memory")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    trace = load_trace(args.trace)
    k, n_layers = trace.top_k, trace.num_layers
    decode: dict[int, list[tuple[tuple[int, ...], ...]]] = {}
    for req, phase, step in zip(trace.requests, trace.phases, trace.steps):
        if phase == "decode":
            decode.setdefault(req, []).append(step)
    requests = sorted(decode)
    heat = {r: [Counter() for _ in range(n_layers)] for r in requests}
    for r in requests:
        for step in decode[r]:
            for layer, ids in enumerate(step):
                heat[r][layer].update(ids)
    slots = max(1, round(args.gpu_share * trace.num_experts))
    rows = []
    for b in (int(x) for x in args.sizes.split(",")):
        if b > len(requests):
            continue
        distinct, outside = [], []
        for group in itertools.combinations(requests, b):
            others = [r for r in requests if r not in group] or list(group)
            share = []
            for layer in range(n_layers):
                counts = sum((heat[r][layer] for r in others), Counter())
                share.append({e for e, _ in counts.most_common(slots)})
            for t in range(min(len(decode[r]) for r in group)):
                for layer in range(n_layers):
                    routed = set().union(*(decode[r][t][layer] for r in group))
                    distinct.append(len(routed) / k)
                    outside.append(len(routed - share[layer]) / k)
        row = {
            "requests": b,
            "groups": sum(1 for _ in itertools.combinations(requests, b)),
            "distinct_over_top_k": round(statistics.mean(distinct), 3),
            "outside_gpu_share_over_top_k": round(statistics.mean(outside), 3),
        }
        rows.append(row)
    one = rows[0]["outside_gpu_share_over_top_k"] if rows and rows[0]["requests"] == 1 else None
    for row in rows:
        row["outside_over_one_token"] = round(row["outside_gpu_share_over_top_k"] / one, 3) if one else None
    report = {
        "trace": str(trace.path),
        "model": trace.meta.get("model"),
        "num_experts": trace.num_experts,
        "top_k": k,
        "layers": n_layers,
        "requests": len(requests),
        "gpu_share": args.gpu_share,
        "gpu_slots": slots,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    for row in rows:
        print(
            f"B={row['requests']}: {row['distinct_over_top_k']:.2f} x top-k distinct experts a layer; "
            f"{row['outside_gpu_share_over_top_k']:.2f} x top-k outside a {args.gpu_share:.0%} GPU share "
            f"({row['outside_over_one_token']}x one token's)"
        )


if __name__ == "__main__":
    main()
