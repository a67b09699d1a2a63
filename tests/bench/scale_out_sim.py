"""Expert-parallel decode across N hosts, simulated from the routing traces in
tests/data/traces (docs/scale-out.md explains the model and its assumptions).

Each host owns the experts e with e % N == r of every layer and keeps an LRU pool of a
fixed size per host (a fraction of *all* of a layer's experts, so the pools add up
across hosts), replayed with the project's own replay (daemon/bench/policy/replay.py).
A layer's step waits for the host with the most misses in that layer (each layer ends in
an all_sum), so the critical path per token is the sum over layers of the per-layer
maximum over hosts.

    python tests/bench/scale_out_sim.py > tests/bench/results/sim/scale_out_sim.txt
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moestream.daemon.bench.policy.replay import capacity_slots, replay
from moestream.daemon.bench.policy.trace import Trace, load_trace
from moestream.daemon.policies import make_policy

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
HOSTS = (1, 2, 4)
FRACTIONS = (0.10, 0.25)  # of a layer's experts, in each host's pool
BYTES_PER_WEIGHT = 0.5625  # 4-bit, group 64: a bf16 scale and bias per 64 weights
ACTIVATION_BYTES = 2  # bf16 hidden states


@dataclass(frozen=True)
class Shape:
    """A target model's MoE shape (its config.json) and active parameters per token."""

    name: str
    moe_layers: int
    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    active_params: float

    @property
    def expert_bytes(self) -> float:
        return 3 * self.hidden * self.moe_intermediate * BYTES_PER_WEIGHT  # gate, up, down

    def exchange_bytes(self, hosts: int) -> float:
        """Bytes each host sends per decoded token: a ring all_sum of the [k, hidden]
        expert rows, 2 (N-1)/N of the buffer, per MoE layer."""
        if hosts == 1:
            return 0.0
        return self.moe_layers * 2 * (hosts - 1) / hosts * self.top_k * self.hidden * ACTIVATION_BYTES


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s each way
    latency: float  # s per ring step


SHAPES = (
    Shape("Qwen3-30B-A3B", 48, 128, 8, 2048, 768, 3.3e9),
    Shape("Qwen3-235B-A22B", 94, 128, 8, 4096, 1536, 22e9),
    Shape("Kimi-K2 (1T)", 60, 384, 8, 7168, 2048, 32e9),
)
LINKS = (
    Link("TB5 RDMA (jaccl)", 8e9, 10e-6),
    Link("10GbE (ring, TCP)", 1.1e9, 60e-6),
)
DISK = 5e9  # bytes/s of each host's SSD, whole-expert reads
MEMORY_BANDWIDTH = 300e9  # bytes/s: the compute of a decoded token, bound by reading its active weights


def critical_misses(trace: Trace, fraction: float, hosts: int) -> tuple[float, float, float]:
    """Per traced layer and decode step, averaged: (misses of the slowest host, misses of
    all hosts, hit rate of all hosts)."""
    slots = capacity_slots(fraction, trace.num_experts, trace.top_k)
    per_host = []  # [host][layer][step]
    for r in range(hosts):
        share = list(range(r, trace.num_experts, hosts))
        local = {e: i for i, e in enumerate(share)}
        layers = []
        for index in range(trace.num_layers):
            steps = [[local[e] for e in experts if e in local] for experts in trace.layer(index)]
            misses: list[int] = []
            policy = make_policy("lru", len(share), min(len(share), max(slots, trace.top_k)))
            replay(policy, steps, trace.phases, step_misses=misses)
            layers.append(misses)
        per_host.append(layers)
    m = np.array(per_host)  # [host, layer, step]
    decode = np.array([p == "decode" for p in trace.phases])
    m = m[:, :, decode]
    routed = trace.top_k * m.shape[1] * m.shape[2]
    return float(m.max(axis=0).mean()), float(m.sum(axis=0).mean()), 1 - float(m.sum()) / routed


def token_seconds(shape: Shape, link: Link, hosts: int, crit_fraction: float) -> float:
    """Decode time of one token: each layer's slowest host's reads, then its all_sum,
    then the compute (replicated resident weights plus the routed experts)."""
    reads = shape.moe_layers * crit_fraction * shape.top_k * shape.expert_bytes / DISK
    steps = 2 * (hosts - 1)
    comm = shape.moe_layers * steps * link.latency + shape.exchange_bytes(hosts) / link.bandwidth
    compute = shape.active_params * BYTES_PER_WEIGHT / MEMORY_BANDWIDTH
    return reads + comm + compute


def order_check(tokens: int = 64, top_k: int = 8, hidden: int = 2048) -> None:
    """Why the ranks sum expert rows, not their weighted partials: the partials, added in
    another order than the model's sum over k, change float bits; the rows do not."""
    import mlx.core as mx

    mx.random.seed(0)
    print("\n## Summation order: elements of the MoE output that differ from one process's\n")
    print("| dtype | all_sum of each host's weighted partial | all_sum of the rows, then the model's sum |")
    print("| --- | --- | --- |")
    for dtype in (mx.bfloat16, mx.float32):
        y = mx.random.normal((tokens, top_k, hidden)).astype(dtype)
        scores = mx.softmax(mx.random.normal((tokens, top_k)), axis=-1).astype(dtype)[..., None]
        mine = (mx.random.randint(0, 2, (tokens, top_k)) == 0)[..., None]
        want = (y * scores).sum(axis=-2)
        partials = [(mx.where(m, y, 0) * scores).sum(axis=-2) for m in (mine, ~mine)]
        rows = mx.where(mine, y, 0) + mx.where(~mine, y, 0)
        a, b, c = (
            np.array(v.astype(mx.float32)) for v in (want, partials[0] + partials[1], (rows * scores).sum(axis=-2))
        )
        print(f"| {dtype} | {int((a != b).sum())} of {a.size} | {int((a != c).sum())} of {a.size} |")


def main() -> None:
    traces = {p.name: load_trace(p) for p in sorted(TRACES.iterdir()) if (p / "trace.jsonl").is_file()}
    print("## Replay: misses per layer and decode token, LRU, pool per host = fraction of a layer's experts\n")
    print("| trace (experts, top-k) | pool per host | hosts | hit rate | slowest host's misses / k | all misses / k |")
    print("| --- | --- | --- | --- | --- | --- |")
    crit: dict[tuple[str, float, int], float] = {}
    for name, trace in traces.items():
        for fraction in FRACTIONS:
            for hosts in HOSTS:
                worst, total, hit = critical_misses(trace, fraction, hosts)
                crit[name, fraction, hosts] = worst / trace.top_k
                print(
                    f"| {name} ({trace.num_experts}, {trace.top_k}) | {fraction:.0%} | {hosts} | {hit:.3f} "
                    f"| {worst / trace.top_k:.3f} | {total / trace.top_k:.3f} |"
                )
    print(
        f"\n## Predicted decode tok/s (disk {DISK / 1e9:.0f} GB/s per host, compute at "
        f"{MEMORY_BANDWIDTH / 1e9:.0f} GB/s of active weights; misses: range over the traces)\n"
    )
    print("| model | expert MB | link | pool per host | hosts | sent per token per host | tok/s | × 1 host |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in SHAPES:
        for link in LINKS:
            for fraction in FRACTIONS:
                base = [token_seconds(shape, link, 1, crit[n, fraction, 1]) for n in traces]
                for hosts in HOSTS:
                    t = [token_seconds(shape, link, hosts, crit[n, fraction, hosts]) for n in traces]
                    speed = [1 / s for s in t]
                    gain = [b / s for b, s in zip(base, t)]
                    print(
                        f"| {shape.name} | {shape.expert_bytes / 1e6:.1f} | {link.name} | {fraction:.0%} | {hosts} "
                        f"| {shape.exchange_bytes(hosts) / 1e6:.2f} MB | {min(speed):.1f}–{max(speed):.1f} "
                        f"| {min(gain):.2f}–{max(gain):.2f} |"
                    )
    order_check()


if __name__ == "__main__":
    main()
