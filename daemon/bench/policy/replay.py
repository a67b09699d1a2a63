"""Offline evaluation of eviction policies on a routing trace.

Each traced layer gets its own pool of `slots` experts, replayed step by step exactly as
the expert pool drives its policy: `access(experts)` with every routed expert, then for
each miss, while the pool is full, `victim(resident, protected)` and `evicted(v)`, then
`admitted(e)` for the misses. The current step's experts are protected while it is
served; the pool starts empty and is carried from one request to the next; prefill and
decode steps are both replayed, one token per step. Belady's MIN, replayed under the same
rules, is the optimum that the gap closed by each policy is measured against:
(policy - LRU) / (MIN - LRU), on the mean hit rate over layers.

Cross-layer hint: before each `access`, a policy gets `observe_lower` with the same
step's experts in every lower traced layer (in a forward they route first, so a pool
can know them online); `lower=False` in `evaluate` withholds it.

Heat prior: with `prior="loo"` (leave-one-out), at the first step of each request every
policy gets `set_prior` with that layer's routing counts over all *other* requests of
the trace, so nothing a policy is scored on is in its prior. With `prior="none"` no
policy gets one. With the prior, each capacity also reports `static_hottest`: the hit
rate of the prior's hottest experts held fixed for the request and never moved (a
mapped pool's GPU memory with autopin and no rebalance).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ...policies import POLICIES, make_policy
from ...policies.base import EvictionPolicy
from .belady import BeladyMIN
from .trace import PHASES, Trace

PRIORS = {
    "loo": "leave-one-out: each request's prior is the layer's counts over the other requests",
    "none": "none: no policy gets a heat prior",
}
BASELINE, OPTIMUM = "lru", "min"


@dataclass
class ReplayCounts:
    """Hits and misses of one pool over a replay, per phase."""

    hits: Counter[str] = field(default_factory=Counter)
    misses: Counter[str] = field(default_factory=Counter)

    def accesses(self, phase: str | None = None) -> int:
        return self.count(self.hits, phase) + self.count(self.misses, phase)

    def hit_rate(self, phase: str | None = None) -> float | None:
        n = self.accesses(phase)
        return self.count(self.hits, phase) / n if n else None

    @staticmethod
    def count(counter: Counter[str], phase: str | None) -> int:
        return sum(counter.values()) if phase is None else counter[phase]


def capacity_slots(fraction: float, num_experts: int, top_k: int) -> int:
    """`fraction` of the experts, rounded half up, at least top-k, at most all."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"capacity fraction {fraction} must be in (0, 1]")
    return min(num_experts, max(top_k, int(fraction * num_experts + 0.5)))


def replay(
    policy: EvictionPolicy,
    steps: Sequence[Sequence[int]],
    phases: Sequence[str],
    *,
    priors: dict[int, Sequence[float]] | None = None,
    lower: Sequence[Sequence[Sequence[int]]] | None = None,
    step_misses: list[int] | None = None,
) -> ReplayCounts:
    """Drive `policy` through `steps` as the pool would, with `policy.capacity` slots.
    `priors` maps a step index to the heat prior given to the policy before that step;
    `lower[t]`, when given, is step t's experts in the lower layers (`observe_lower`);
    `step_misses`, when given, gets each step's miss count appended.
    Raises RuntimeError if the policy picks a protected or non-resident victim."""
    resident: set[int] = set()
    counts = ReplayCounts()
    for t, experts in enumerate(steps):
        if priors and t in priors:
            policy.set_prior(priors[t])
        protected = set(experts)
        if lower is not None:
            policy.observe_lower(lower[t])
        policy.access(experts)
        misses = [e for e in experts if e not in resident]
        counts.hits[phases[t]] += len(protected) - len(misses)
        counts.misses[phases[t]] += len(misses)
        if step_misses is not None:
            step_misses.append(len(misses))
        for e in misses:
            if len(resident) >= policy.capacity:
                v = policy.victim(resident, protected)
                if v in protected or v not in resident:
                    raise RuntimeError(
                        f"[replay] policy {policy.name} chose expert {v} at step {t}, "
                        f"which is {'protected' if v in protected else 'not resident'}"
                    )
                resident.discard(v)
                policy.evicted(v)
            resident.add(e)
        for e in misses:
            policy.admitted(e)
    return counts


def leave_one_out_priors(trace: Trace, layer: int) -> dict[int, list[float]]:
    """For the first step of each request: the layer's counts over all other requests."""
    total = [0.0] * trace.num_experts
    per_request: dict[int, list[float]] = {}
    for req, step in zip(trace.requests, trace.steps):
        mine = per_request.setdefault(req, [0.0] * trace.num_experts)
        for e in step[layer]:
            total[e] += 1.0
            mine[e] += 1.0
    priors: dict[int, list[float]] = {}
    for t, req in enumerate(trace.requests):
        if t == 0 or trace.requests[t - 1] != req:
            priors[t] = [a - b for a, b in zip(total, per_request[req])]
    return priors


def static_hits(
    steps: Sequence[Sequence[int]], phases: Sequence[str], priors: dict[int, Sequence[float]], slots: int
) -> ReplayCounts:
    """Hits of a placement fixed per request: from each request's first step on, the
    `slots` experts its heat prior ranks hottest (ties: lower id), never moved; what a
    mapped pool with autopin and no moves keeps in GPU memory."""
    counts = ReplayCounts()
    hot: set[int] = set()
    for t, experts in enumerate(steps):
        if t in priors:
            prior = priors[t]
            hot = set(sorted(range(len(prior)), key=lambda e: (-prior[e], e))[:slots])
        for e in set(experts):
            if e in hot:
                counts.hits[phases[t]] += 1
            else:
                counts.misses[phases[t]] += 1
    return counts


def _policy_result(per_layer: list[ReplayCounts]) -> dict[str, Any]:
    def mean(values: Iterable[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return sum(vals) / len(vals) if vals else None

    overall = [c.hit_rate() for c in per_layer]
    decode = [c.hit_rate("decode") for c in per_layer]
    return {
        "hit_rate": mean(overall),
        "decode_hit_rate": mean(decode),
        "per_layer": overall,
        "decode_per_layer": decode,
        "hits": sum(sum(c.hits.values()) for c in per_layer),
        "misses": sum(sum(c.misses.values()) for c in per_layer),
        "accesses": sum(c.accesses() for c in per_layer),
    }


def evaluate(
    trace: Trace,
    capacities: Sequence[float] = (0.25, 0.5),
    *,
    policies: Sequence[str] | None = None,
    prior: str = "loo",
    lower: bool = True,
    factory: Callable[[str, int, int], EvictionPolicy] = make_policy,
) -> dict[str, Any]:
    """Hit rates of every policy (all registered ones by default) and of MIN on `trace`,
    per capacity fraction; a JSON-ready dict (see `moestreamctl bench policy --json`).
    `lower`: give each layer's policies the same step's lower-layer routing."""
    if prior not in PRIORS:
        raise ValueError(f"prior {prior!r}: valid values are {', '.join(PRIORS)}")
    names = list(POLICIES) if policies is None else list(policies)
    if BASELINE not in names:
        names.insert(0, BASELINE)
    priors = [leave_one_out_priors(trace, i) if prior == "loo" else None for i in range(trace.num_layers)]
    results = []
    for fraction in capacities:
        slots = capacity_slots(fraction, trace.num_experts, trace.top_k)
        by_policy: dict[str, dict[str, Any]] = {}
        for name in [*names, OPTIMUM]:
            per_layer = []
            for i in range(trace.num_layers):
                steps = trace.layer(i)
                if name == OPTIMUM:
                    policy: EvictionPolicy = BeladyMIN(trace.num_experts, slots, steps)
                else:
                    policy = factory(name, trace.num_experts, slots)
                below = [step[:i] for step in trace.steps] if lower else None
                per_layer.append(replay(policy, steps, trace.phases, priors=priors[i], lower=below))
            by_policy[name] = _policy_result(per_layer)
        lru, best = by_policy[BASELINE]["hit_rate"], by_policy[OPTIMUM]["hit_rate"]
        for r in by_policy.values():
            gap = best - lru
            r["gap_closed"] = (r["hit_rate"] - lru) / gap if gap > 1e-12 else None
        result = {"capacity_fraction": fraction, "slots": slots, "policies": by_policy}
        if prior == "loo" and len(set(trace.requests)) > 1:
            # Not an eviction policy (misses are not admitted), so apart from them.
            result["static_hottest"] = _policy_result(
                [static_hits(trace.layer(i), trace.phases, priors[i], slots) for i in range(trace.num_layers)]
            )
        results.append(result)
    phase_steps = Counter(trace.phases)
    requests = len(set(trace.requests))
    prior_text = PRIORS[prior]
    if prior == "loo" and requests == 1:
        prior_text += " (this trace has one request, so every prior is empty)"
    return {
        "trace": str(trace.path),
        "model": trace.meta.get("model"),
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "layers": list(trace.layer_ids),
        "steps": len(trace.steps),
        "requests": requests,
        "phase_steps": {p: phase_steps[p] for p in PHASES},
        "prior": prior_text,
        "cross_layer": (
            "each policy sees the same step's experts of the lower traced layers (observe_lower) before its access"
            if lower
            else "none"
        ),
        "replay": (
            "one pool per layer, empty at start and carried across requests; the "
            "current step's experts protected; prefill and decode replayed per token"
        ),
        "results": results,
    }
