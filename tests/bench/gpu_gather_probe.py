"""One MoE layer of a mapped pool on the GPU machine: the expert call reading host memory
over the link as it computes (zero-copy) against a copy of the routed experts into a
stack first (daemon/mapped/row_gather.py), by the CUDA copy kernel or by `mx.take`.

    python tests/bench/gpu_gather_probe.py --store /root/q30/store --out $OUT/gather_probe_h200.json

For 0, 4 and 8 of the 8 routed experts in host memory: milliseconds per call (median of
`--reps`, each evaluated alone after a warm-up), the copy alone, the effective link rate
(host bytes / time over the all-on-GPU call) and whether the outputs are bit-equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from probe_setup import mapped_quarter, store_probe_args
from probe_timing import median_ms

from moestream.daemon.mapped.row_gather import RowGather


def main() -> None:
    args = store_probe_args()
    sm, moes = mapped_quarter(args.store)
    moe = moes[0]
    pool = moe.pool
    on_gpu = sorted(sm.mapped_pool.on_gpu[0])
    off_gpu = [e for e in range(pool.layer.num_experts) if e not in sm.mapped_pool.on_gpu[0]]
    k = pool.top_k
    hidden = sm.manifest.config.get("text_config", sm.manifest.config)["hidden_size"]
    names = [t.name for t in pool.layer.tensors]
    arrays = [pool.arrays[n] for n in names]
    expert_bytes = pool.layer.expert_bytes
    x = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)
    # Off the GPU (a dry run of this script) both are `mx.take`.
    kernel, take = RowGather(use_kernel=RowGather.kernel_available()), RowGather(use_kernel=False)
    rows = []
    for host in (0, k // 2, k):
        ids = mx.array([off_gpu[:host] + on_gpu[: k - host]], dtype=mx.uint32).reshape(1, 1, k)

        def zero_copy():
            return moe.inner(x, ids)

        def gathered(g):
            def run():
                stack = g(arrays, ids)
                moe._use(dict(zip(names, stack)))
                try:
                    return moe.inner(x, mx.arange(k, dtype=mx.uint32).reshape(ids.shape))
                finally:
                    moe._use(pool.arrays)

            return run

        want = zero_copy()
        r = {
            "host_experts": host,
            "zero_copy_ms": median_ms(zero_copy, args.reps),
            "kernel_gather_ms": median_ms(gathered(kernel), args.reps),
            "take_gather_ms": median_ms(gathered(take), args.reps),
            "kernel_copy_only_ms": median_ms(lambda: kernel(arrays, ids), args.reps),
            "take_copy_only_ms": median_ms(lambda: take(arrays, ids), args.reps),
            "kernel_equal": bool(mx.array_equal(want, gathered(kernel)())),
            "take_equal": bool(mx.array_equal(want, gathered(take)())),
            "host_bytes": host * expert_bytes,
        }
        rows.append(r)
        print(json.dumps(r), flush=True)
    base = rows[0]
    for r in rows[1:]:
        for key in ("zero_copy_ms", "kernel_gather_ms", "take_gather_ms"):
            extra = r[key] - base[key]
            r[key.replace("_ms", "_link_GBps")] = r["host_bytes"] / extra / 1e6 if extra > 0 else None
        r["kernel_copy_GBps"] = r["host_bytes"] / r["kernel_copy_only_ms"] / 1e6
    sm.close()
    Path(args.out).write_text(
        json.dumps(
            {
                "store": args.store,
                "expert_bytes": expert_bytes,
                "top_k": k,
                "device": str(mx.default_device()),
                "rows": rows,
            },
            indent=1,
        )
    )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
