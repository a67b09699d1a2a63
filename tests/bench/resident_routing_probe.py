"""The host's time of a full pool's routing read-back per token (ResidentRouting.tick:
daemon/pool/resident_routing.py), on 48 layers of 128 experts, top-8, one decode token a
tick, the ids made as the router makes them (a slice of argpartition) and computed with
the token, as in the model. Prints the mean, median and 90th percentile in microseconds.

    python tests/bench/resident_routing_probe.py [--layers 48] [--ticks 1500]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from moestream.daemon.pool.resident_routing import ResidentRouting


class _Stats:
    def __init__(self, experts: int) -> None:
        self.routed = np.zeros(experts, np.int64)
        self.routed_total = self.hits_decode = self.hits_prefill = 0


class _Pool:
    """What ResidentRouting reads of a fully resident ExpertPool."""

    fully_resident = True

    def __init__(self, experts: int) -> None:
        self.stats = _Stats(experts)
        self.route_log: list[mx.array] | None = None

    def start_route_log(self) -> None:
        self.route_log = []

    def take_route_log(self) -> list[mx.array]:
        logged, self.route_log = self.route_log or [], []
        return logged

    def stop_route_log(self) -> None:
        self.route_log = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--ticks", type=int, default=1500)
    a = ap.parse_args()
    pools = [_Pool(a.experts) for _ in range(a.layers)]
    rr = ResidentRouting(pools)  # type: ignore[arg-type]
    logits = [mx.random.normal((1, 1, a.experts)) for _ in pools]
    mx.eval(logits)
    took = []
    for n in range(a.ticks + 50):
        for p, g in zip(pools, logits):
            p.route_log.append(mx.argpartition(-g, kth=a.k - 1, axis=-1)[..., : a.k])
        mx.eval([p.route_log[-1] for p in pools])
        tic = time.perf_counter()
        rr.tick()
        if n >= 50:  # warmed up
            took.append(time.perf_counter() - tic)
    rr.settle()
    print(
        json.dumps(
            {
                "device": str(mx.default_device()),
                "layers": a.layers,
                "tick_us_mean": round(float(np.mean(took)) * 1e6, 1),
                "tick_us_median": round(float(np.median(took)) * 1e6, 1),
                "tick_us_p90": round(float(np.percentile(took, 90)) * 1e6, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
