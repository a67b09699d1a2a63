"""A mapped pool: every expert addressable, the hot ones in GPU memory (experimental).

Where host RAM holds every expert and the GPU is an NVIDIA card, the pool can span all
experts in managed memory instead of `capacity` slots: the kernels run as at full
residency (no host sync per layer, stock mlx-lm's own call), experts placed in GPU
memory are read at its speed, and the others are read by the kernels over the link
(zero-copy) from host memory. The host's only job is placement: which `gpu_slots`
experts per layer live in GPU memory. It learns that from the routing of tokens already
finished (read two forwards late, so the pipeline never waits for it) through the same
eviction policies as the slot pool, and moves at most `max_moves` experts per layer per
token. Output is unchanged by construction: the bytes never change, only where they live.

On the CPU and on unified memory there is nothing to move; the same bookkeeping runs
with a mover that only counts, which is what the tests here exercise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from moestream.daemon.expert_pool import ExpertPool
from moestream.daemon.policies import make_policy

# Forwards whose routing is read back: older than this many forwards, so already computed.
READBACK_LAG = 2


class Mover(Protocol):
    def place(self, buffer: Any, where: str, offset: int, nbytes: int) -> None: ...


class CountingMover:
    """Where memory is one (CPU, Apple Silicon): nothing moves; calls are counted."""

    def __init__(self) -> None:
        self.calls = 0

    def place(self, buffer: Any, where: str, offset: int, nbytes: int) -> None:
        self.calls += 1


@dataclass
class PlacementStats:
    routed: int = 0
    routed_on_gpu: int = 0
    moves: int = 0
    place_calls: int = 0
    readback_seconds: float = 0.0
    place_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "routed": self.routed,
            "routed_on_gpu": self.routed_on_gpu,
            "gpu_hit_rate": self.routed_on_gpu / self.routed if self.routed else None,
            "moves": self.moves,
            "place_calls": self.place_calls,
            "readback_seconds": self.readback_seconds,
            "place_seconds": self.place_seconds,
        }


class Placement:
    """Which experts of each fully addressable pool live in GPU memory."""

    def __init__(self, pools: Sequence[ExpertPool], gpu_slots: int, mover: Mover, policy: str, *, max_moves: int = 2) -> None:
        self.pools = list(pools)
        self.gpu_slots = gpu_slots
        self.mover = mover
        self.max_moves = max_moves
        self.policies = [make_policy(policy, p.layer.num_experts, gpu_slots) for p in self.pools]
        self.on_gpu: list[set[int]] = [set() for _ in self.pools]
        self.stats = PlacementStats()
        for p in self.pools:
            if not p.fully_resident:
                raise ValueError(f"layer {p.layer.module_path}: a mapped pool must hold every expert")
            p.route_log = []

    def place_initial(self, hottest: Sequence[Sequence[int]] | None = None) -> None:
        """Put each layer's first `gpu_slots` experts of `hottest` (default: 0, 1, ...)
        in GPU memory and the rest in host memory."""
        tic = time.perf_counter()
        for i, pool in enumerate(self.pools):
            n = pool.layer.num_experts
            order = list(hottest[i]) if hottest is not None else []
            order += [e for e in range(n) if e not in set(order)]
            chosen = set(order[: self.gpu_slots])
            flags = np.array([e in chosen for e in range(n)])
            for start, stop, on_gpu in _runs(flags):
                self._place_rows(pool, start, stop, "device" if on_gpu else "host")
            self.on_gpu[i] = chosen
            for e in sorted(chosen):
                self.policies[i].admitted(e)
        self.stats.place_seconds += time.perf_counter() - tic

    def tick(self) -> None:
        """After a token: read the routing of forwards that are surely done, tell the
        policies, and move what they say (at most `max_moves` experts per layer)."""
        for i, pool in enumerate(self.pools):
            log = pool.route_log
            if log is None or len(log) <= READBACK_LAG:
                continue
            ready, pool.route_log = log[:-READBACK_LAG], log[-READBACK_LAG:]
            tic = time.perf_counter()
            rows = [np.array(a).reshape(-1, a.shape[-1]) for a in ready]
            self.stats.readback_seconds += time.perf_counter() - tic
            for token_experts in rows:
                self._observe(i, token_experts)

    def _observe(self, i: int, token_experts: np.ndarray) -> None:
        pool, policy, on_gpu = self.pools[i], self.policies[i], self.on_gpu[i]
        moves = 0
        for row in token_experts:
            experts = [int(e) for e in row]
            policy.access(experts)
            self.stats.routed += len(experts)
            self.stats.routed_on_gpu += sum(e in on_gpu for e in experts)
            for e in experts:
                if e in on_gpu or moves >= self.max_moves:
                    continue
                tic = time.perf_counter()
                if len(on_gpu) >= self.gpu_slots:
                    victim = policy.victim(on_gpu, set(experts))
                    on_gpu.discard(victim)
                    policy.evicted(victim)
                    self._place_rows(pool, victim, victim + 1, "host")
                on_gpu.add(e)
                policy.admitted(e)
                self._place_rows(pool, e, e + 1, "device")
                self.stats.place_seconds += time.perf_counter() - tic
                self.stats.moves += 1
                moves += 1

    def _place_rows(self, pool: ExpertPool, start: int, stop: int, where: str) -> None:
        for t in pool.layer.tensors:
            self.mover.place(pool.arrays[t.name], where, start * t.nbytes, (stop - start) * t.nbytes)
            self.stats.place_calls += 1

    def close(self) -> None:
        for p in self.pools:
            p.route_log = None


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs [start, stop) of equal flags."""
    out, start = [], 0
    for j in range(1, len(flags) + 1):
        if j == len(flags) or flags[j] != flags[start]:
            out.append((start, j, bool(flags[start])))
            start = j
    return out

