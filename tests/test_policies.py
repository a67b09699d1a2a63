"""Eviction policies, Belady's MIN and the offline evaluator, on hand-built sequences.

Each policy is driven through `EvictionPolicy` exactly as the expert pool drives it:
access, then victim/evicted while full, then admitted.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from moestream.daemon.bench.policy.belady import BeladyMIN
from moestream.daemon.bench.policy.replay import (
    capacity_slots,
    evaluate,
    leave_one_out_priors,
    replay,
)
from moestream.daemon.bench.policy.trace import TraceError, load_trace
from moestream.daemon.policies import POLICIES, make_policy
from moestream.daemon.policies.base import EvictionPolicy
from moestream.daemon.policies.induction import InductionPolicy
from moestream.daemon.policies.lfu import LFUPolicy
from moestream.daemon.policies.lfuda import LFUDAPolicy
from moestream.daemon.policies.lru import LRUPolicy
from moestream.daemon.policies.predictive import PredictivePolicy
from moestream.daemon.policies.recall import RecallPolicy
from moestream.daemon.policies.victims import NoVictimError


def fill(policy: EvictionPolicy, experts: Sequence[int]) -> set[int]:
    """Admit `experts` one token each, as a pool with free slots would."""
    for e in experts:
        policy.access([e])
        policy.admitted(e)
    return set(experts)


# ---- registry -------------------------------------------------------------------------


def test_registry_names_classes_and_is_read_only() -> None:
    assert set(POLICIES) >= {"lru", "lfu", "lfuda", "predictive"}
    for name, cls in POLICIES.items():
        policy = make_policy(name, 8, 3)
        assert isinstance(policy, cls) and policy.name == name
        assert (policy.num_experts, policy.capacity) == (8, 3)
    with pytest.raises(TypeError):
        POLICIES["mine"] = LRUPolicy  # type: ignore[index]


def test_make_policy_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        make_policy("fifo", 8, 2)
    for name in POLICIES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_capacity_out_of_range_is_refused(name: str) -> None:
    with pytest.raises(ValueError):
        make_policy(name, 8, 0)
    with pytest.raises(ValueError):
        make_policy(name, 8, 9)


# ---- ordering -----------------------------------------------------------------------------


def test_lru_evicts_least_recent_and_skips_protected() -> None:
    p = LRUPolicy(8, 3)
    resident = fill(p, [0, 1, 2])
    p.access([0])
    assert p.victim(resident, protected={0}) == 1
    assert p.victim(resident, protected={1}) == 2
    p.access([1])
    assert p.victim(resident, protected=set()) == 2
    p.evicted(2)
    assert p.victim(resident - {2}, protected={5}) == 0


def test_lfu_evicts_least_frequent() -> None:
    p = LFUPolicy(8, 3, half_life=1e9)
    resident = fill(p, [0, 1, 2])
    for _ in range(3):
        p.access([0])
    p.access([2])
    assert p.victim(resident, protected=set()) == 1
    assert p.victim(resident, protected={1}) == 2


def test_lfu_equal_counts_evict_least_recent() -> None:
    p = LFUPolicy(8, 3, half_life=1e9)
    resident = fill(p, [2, 0, 1])
    assert p.victim(resident, protected=set()) == 2


def decayed_count(p: LFUPolicy, expert: int) -> float:
    """Accesses of `expert`, each weighted 2^(-age / half_life)."""
    return p._count[expert] / p._inc


def test_lfu_decay_forgets_old_popularity() -> None:
    old_then_new = [[0]] * 10 + [[5]] * 20 + [[1]] * 2
    decayed, undecayed = LFUPolicy(8, 3, half_life=4.0), LFUPolicy(8, 3, half_life=1e9)
    for p in (decayed, undecayed):
        fill(p, [0, 1])
        for step in old_then_new:
            p.access(step)
    # Ten uses long ago weigh less than three recent ones...
    assert decayed_count(decayed, 0) < decayed_count(decayed, 1)
    assert decayed.victim({0, 1}, protected=set()) == 0
    # ...which plain counting never lets happen.
    assert undecayed.victim({0, 1}, protected=set()) == 1


def test_lfu_decayed_count_survives_rescaling() -> None:
    # A half-life of half a token multiplies the increment by 4 per token, so the
    # counters are rescaled every 32 tokens; no decayed count may change by it.
    h = 0.5
    p = LFUPolicy(4, 2, half_life=h)
    uses: dict[int, list[int]] = {0: [], 1: []}
    for t in range(1, 101):
        e = 0 if t % 3 else 1
        p.access([e])
        uses[e].append(t)
    for e, times in uses.items():
        expected = sum(2.0 ** (-(100 - t) / h) for t in times)
        assert decayed_count(p, e) == pytest.approx(expected, rel=1e-9)


def test_lfuda_ages_out_a_once_popular_expert() -> None:
    aged, plain = LFUDAPolicy(8, 2), LFUPolicy(8, 2, half_life=1e9)
    results = {}
    for p in (aged, plain):
        resident = fill(p, [0, 1])
        for _ in range(4):
            p.access([0])  # expert 0 earns a high count, then is never used again
        evicted_at = None
        for step, e in enumerate(range(2, 8)):  # a stream of new experts
            p.access([e])
            v = p.victim(resident, protected={e})
            resident.discard(v)
            p.evicted(v)
            resident.add(e)
            p.admitted(e)
            if v == 0:
                evicted_at = step
                break
        results[p.name] = evicted_at
    # The cache age rises with every victim until it overtakes expert 0's count.
    assert results["lfuda"] is not None and aged.age >= 5
    assert results["lfu"] is None


def test_lfuda_key_is_age_plus_count() -> None:
    p = LFUDAPolicy(8, 2)
    resident = fill(p, [0, 1])
    p.access([0])
    assert (p.key(0), p.key(1)) == (2, 1)
    p.access([2])
    v = p.victim(resident, protected={2})
    assert v == 1
    p.evicted(v)
    p.admitted(2)
    assert p.age == 1 and p.key(2) == 2 and p.key(1) is None


def drive(policy: EvictionPolicy, steps: list[list[int]], pinned: set[int]) -> None:
    """The pool's loop with pinned experts: they are loaded first and always protected;
    fails if a policy ever names a protected or non-resident victim."""
    resident: set[int] = set()
    for e in pinned:
        resident.add(e)
        policy.admitted(e)
    for experts in steps:
        protected = set(experts) | pinned
        policy.access(experts)
        misses = [e for e in experts if e not in resident]
        for e in misses:
            if len(resident) >= policy.capacity:
                v = policy.victim(resident, protected)
                assert v in resident and v not in protected, (policy.name, v)
                resident.discard(v)
                policy.evicted(v)
            resident.add(e)
        for e in misses:
            policy.admitted(e)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_protected_and_pinned_are_never_chosen(name: str) -> None:
    rng = random.Random(7)
    for trial in range(20):
        n, k = rng.randint(6, 16), rng.randint(1, 4)
        pinned = set(rng.sample(range(n), rng.randint(0, 2)))
        cap = rng.randint(k + len(pinned), n)
        steps = [rng.sample(range(n), k) for _ in range(60)]
        drive(make_policy(name, n, cap), steps, pinned)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_victim_when_everything_is_protected(name: str) -> None:
    p = make_policy(name, 6, 2)
    resident = fill(p, [0, 1])
    p.access([0, 1])
    with pytest.raises(NoVictimError, match="protected"):
        p.victim(resident, protected={0, 1})


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_expert_the_policy_never_saw_admitted_is_the_last_resort(name: str) -> None:
    p = make_policy(name, 6, 3)
    fill(p, [0, 1])
    p.access([0, 1])
    # The pool placed expert 4 without telling the policy: it may still be evicted.
    assert p.victim({0, 1, 4}, protected={0, 1}) == 4


# ---- predictive -----------------------------------------------------------------------


def test_predictive_learns_a_sequence_lru_thrashes_on() -> None:
    # A cycle over 10 experts with 6 slots: LRU always evicts the next one needed.
    cycle = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    steps = cycle * 40
    phases = ["decode"] * len(steps)
    lru = replay(LRUPolicy(12, 6), steps, phases)
    pred = replay(PredictivePolicy(12, 6), steps, phases)
    best = replay(BeladyMIN(12, 6, steps), steps, phases)
    assert lru.hit_rate() == 0.0
    assert pred.hit_rate() > 0.25
    assert best.hit_rate() >= pred.hit_rate()


def test_predictive_bookkeeping_invariants() -> None:
    rng = random.Random(5)
    p = PredictivePolicy(20, 6, context_tokens=3, context_decay=0.5)
    steps = [rng.sample(range(20), 4) for _ in range(200)]
    drive(p, steps, pinned=set())
    np.testing.assert_allclose(p._rows, p._trans.sum(axis=1), rtol=1e-4)
    ctx = np.zeros(20)
    for d, s in enumerate(reversed(steps[-3:])):
        ctx[s] += 0.5**d
    np.testing.assert_allclose(p._ctx, ctx, atol=1e-9)
    assert not np.array_equal(p.weights, p._w0)  # the mix was refit from evidence


def test_predictive_prior_ranks_a_cold_pool() -> None:
    p = PredictivePolicy(6, 3)
    resident = fill(p, [0, 1, 2])
    p.set_prior([100.0, 1.0, 50.0, 0.0, 0.0, 0.0])
    p.access([3])
    assert p.victim(resident | {3}, protected={3}) == 1
    with pytest.raises(ValueError, match="6 non-negative counts"):
        p.set_prior([1.0, 2.0])


# ---- induction -------------------------------------------------------------------------


def phrase_text(seed: int, n: int = 32, k: int = 2) -> tuple[list[list[int]], list[list[int]]]:
    """Two layers of a text made of phrases that change every 150 tokens: the lower
    layer routes by token only, the upper one by token and previous token."""
    rng = random.Random(seed)
    emb = [rng.sample(range(n), k) for _ in range(60)]
    tokens: list[int] = []
    for _ in range(4):
        phrases = [[rng.randrange(60) for _ in range(10)] for _ in range(3)]
        segment: list[int] = []
        while len(segment) < 150:
            repeat = rng.random() < 0.6
            segment += phrases[rng.randrange(3)] if repeat else [rng.randrange(60)]
        tokens += segment[:150]
    lower = [emb[t] for t in tokens]
    upper = []
    for prev, t in zip([0, *tokens], tokens):
        a, b = emb[t][0], (emb[prev][1] + 7) % n
        upper.append([a, b] if a != b else [a, (b + 1) % n])
    return lower, upper


@pytest.mark.parametrize("seed", [0, 1])
def test_induction_recalls_what_followed_a_repeated_step(seed: int) -> None:
    lower, _ = phrase_text(seed)
    phases = ["decode"] * len(lower)
    pred = replay(PredictivePolicy(32, 8), lower, phases).hit_rate()
    ind = replay(InductionPolicy(32, 8), lower, phases).hit_rate()
    best = replay(BeladyMIN(32, 8, lower), lower, phases).hit_rate()
    assert pred is not None and ind is not None and best is not None
    assert pred + 0.02 < ind <= best


def test_induction_matches_on_the_lower_layer_hint() -> None:
    p = InductionPolicy(16, 6)
    for step, low in [([0, 1], [9]), ([2, 3], [8]), ([4, 5], [7]), ([6, 7], [9])]:
        p.observe_lower([low, [15]])
        p.access(step)
    cols = np.zeros((16, 2))
    p._fill_extra(cols)
    # Own set [6, 7] never came before; the lowest layer's [9] did, at step 0, and
    # steps 1..3 followed it (the horizon weights 1, 0.8, 0.64).
    np.testing.assert_array_equal(cols[:, 0], 0.0)
    np.testing.assert_allclose(cols[[2, 3, 4, 5, 6, 7], 1], [1, 1, 0.8, 0.8, 0.64, 0.64])
    assert cols[[0, 1], 1].sum() == 0.0
    # A hint is for one token: without one, the second key is this layer's set, which
    # no earlier hint matches; the own key finds step 1, followed by steps 2..4.
    p.access([2, 3])
    p._fill_extra(cols)
    np.testing.assert_allclose(cols[[4, 5, 6, 7, 2, 3], 0], [1, 1, 0.8, 0.8, 0.64, 0.64])
    np.testing.assert_array_equal(cols[:, 1], 0.0)


def test_induction_memory_stays_bounded() -> None:
    rng = random.Random(2)
    p = InductionPolicy(24, 6, memory=16)
    steps = [rng.sample(range(24), 3) for _ in range(300)]
    drive(p, steps, pinned=set())
    assert len(p._hist) == 16 and p._hist[-1] == sorted(steps[-1])
    assert all(len(seen) <= 2 * 16 + 1 for seen in p._seen)
    with pytest.raises(ValueError, match="memory"):
        InductionPolicy(24, 6, memory=1)


@pytest.mark.parametrize("cls", [PredictivePolicy, InductionPolicy])
def test_learned_scores_use_only_the_past(cls: type[PredictivePolicy]) -> None:
    rng = random.Random(3)
    past = [rng.sample(range(16), 3) for _ in range(40)]
    a, b = cls(16, 5), cls(16, 5)
    for p in (a, b):
        for s in past:
            p.access(s)
    np.testing.assert_array_equal(a.predicted(), b.predicted())
    a.access([0, 1, 2])
    b.access([7, 8, 9])
    assert not np.array_equal(a.predicted(), b.predicted())


def test_predictive_target_is_checked() -> None:
    with pytest.raises(ValueError, match="next_use"):
        PredictivePolicy(8, 3, target="future")


# ---- Belady's MIN ---------------------------------------------------------------------


def brute_force_min_misses(steps: list[list[int]], cap: int) -> int:
    """Fewest misses over every eviction choice, under the pool's rules: no eviction
    while a slot is free, the current step's experts protected."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for experts in steps:
        need = set(experts)
        nxt: dict[frozenset[int], int] = {}
        for state, cost in best.items():
            misses = need - state
            cost += len(misses)
            surplus = len(state) + len(misses) - cap
            if surplus <= 0:
                options = [frozenset(state | need)]
            else:
                options = [
                    frozenset((state - set(drop)) | need)
                    for drop in itertools.combinations(sorted(state - need), surplus)
                ]
            for s in options:
                if cost < nxt.get(s, 1 << 30):
                    nxt[s] = cost
        best = nxt
    return min(best.values())


def test_belady_min_is_optimal_on_small_random_traces() -> None:
    rng = random.Random(11)
    for trial in range(150):
        n = rng.randint(3, 7)
        k = rng.randint(1, min(3, n - 1))
        cap = rng.randint(k, n - 1)
        steps = [rng.sample(range(n), k) for _ in range(rng.randint(3, 12))]
        counts = replay(BeladyMIN(n, cap, steps), steps, ["decode"] * len(steps))
        assert counts.misses["decode"] == brute_force_min_misses(steps, cap), (steps, cap)


def test_belady_min_refuses_a_different_sequence() -> None:
    p = BeladyMIN(4, 2, [[0], [1]])
    p.access([0])
    with pytest.raises(ValueError, match="step 1"):
        p.access([2])


# ---- evaluator ------------------------------------------------------------------------


def write_trace(folder: Path, records: list[dict], **meta: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "meta.json").write_text(json.dumps({"model": "synthetic", **meta}))
    return folder


def synthetic_records(seed: int, n: int, k: int, layers: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for req in range(3):
        for pos in range(30):
            phase = "prefill" if pos < 10 else "decode"
            hot = list(range(req, req + k + 2))  # a per-request topic
            records.append(
                {
                    "req": req,
                    "pos": pos,
                    "phase": phase,
                    "layers": [rng.sample(hot if rng.random() < 0.5 else range(n), k) for _ in range(layers)],
                }
            )
    return records


def test_evaluator_counts_are_consistent(tmp_path: Path) -> None:
    n, k, layers = 12, 3, 2
    records = synthetic_records(1, n, k, layers)
    trace = load_trace(write_trace(tmp_path / "t", records, num_experts=n, top_k=k))
    report = evaluate(trace, [0.25, 0.5])
    per_phase = {p: sum(1 for r in records if r["phase"] == p) for p in ("prefill", "decode")}
    assert report["phase_steps"] == per_phase
    assert report["steps"] == len(records) and report["requests"] == 3
    for result in report["results"]:
        assert result["slots"] == capacity_slots(result["capacity_fraction"], n, k)
        best = result["policies"]["min"]
        for name, r in result["policies"].items():
            assert r["hits"] + r["misses"] == r["accesses"] == len(records) * k * layers
            assert r["hit_rate"] == pytest.approx(sum(r["per_layer"]) / layers)
            assert all(0.0 <= h <= 1.0 for h in r["per_layer"] + r["decode_per_layer"])
            for mine, opt in zip(r["per_layer"], best["per_layer"]):
                assert mine <= opt + 1e-12, name
        if result["slots"] == k:
            # One token fills the pool: no choice is left, every policy is MIN.
            assert {r["hits"] for r in result["policies"].values()} == {best["hits"]}
            assert all(r["gap_closed"] is None for r in result["policies"].values())
        else:
            assert result["policies"]["lru"]["gap_closed"] == 0.0
            assert best["gap_closed"] == 1.0
    assert [r["slots"] for r in report["results"]] == [k, 6]


class HintRecorder(LRUPolicy):
    """LRU that keeps every cross-layer hint it is given."""

    def __init__(self, num_experts: int, capacity: int) -> None:
        super().__init__(num_experts, capacity)
        self.hints: list[list[list[int]]] = []

    def observe_lower(self, lower: Sequence[Sequence[int]]) -> None:
        self.hints.append([list(layer) for layer in lower])


def test_evaluator_gives_each_layer_the_lower_layers_of_the_same_step(tmp_path: Path) -> None:
    records = synthetic_records(4, 12, 3, 3)
    trace = load_trace(write_trace(tmp_path / "t", records, num_experts=12, top_k=3))
    made: list[HintRecorder] = []

    def factory(name: str, n: int, cap: int) -> EvictionPolicy:
        made.append(HintRecorder(n, cap))
        return made[-1]

    report = evaluate(trace, [0.5], policies=["lru"], factory=factory)
    assert "lower traced layers" in report["cross_layer"]
    assert len(made) == 3  # one per layer
    for i, policy in enumerate(made):
        assert policy.hints == [[list(x) for x in r["layers"][:i]] for r in records]
    made.clear()
    report = evaluate(trace, [0.5], policies=["lru"], factory=factory, lower=False)
    assert report["cross_layer"] == "none" and all(not p.hints for p in made)


def test_replay_splits_hits_by_phase() -> None:
    steps = [[0, 1], [0, 1], [0, 2], [0, 1]]
    phases = ["prefill", "prefill", "decode", "decode"]
    counts = replay(LRUPolicy(4, 2), steps, phases)
    assert (counts.hits["prefill"], counts.misses["prefill"]) == (2, 2)
    # step 2 evicts 1 for 2 (0 was used since); step 3 evicts 2 for 1.
    assert (counts.hits["decode"], counts.misses["decode"]) == (2, 2)
    assert counts.hit_rate("decode") == 0.5 and counts.accesses() == 8


def test_leave_one_out_prior_excludes_the_request_itself(tmp_path: Path) -> None:
    records = [
        {"req": 0, "pos": 0, "phase": "decode", "layers": [[0, 1]]},
        {"req": 0, "pos": 1, "phase": "decode", "layers": [[0, 2]]},
        {"req": 1, "pos": 0, "phase": "decode", "layers": [[3, 1]]},
    ]
    trace = load_trace(write_trace(tmp_path / "t", records, num_experts=4, top_k=2))
    priors = leave_one_out_priors(trace, 0)
    assert priors == {0: [0.0, 1.0, 0.0, 1.0], 2: [2.0, 1.0, 1.0, 0.0]}


def test_capacity_slots_rounds_and_bounds() -> None:
    assert capacity_slots(0.25, 60, 4) == 15
    assert capacity_slots(0.125, 20, 2) == 3  # 2.5 rounds half up
    assert capacity_slots(0.01, 60, 4) == 4  # at least top-k
    with pytest.raises(ValueError):
        capacity_slots(0.0, 60, 4)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"req": 0, "pos": 0, "phase": "decode", "layers": [[1, 1]]}, "distinct"),
        ({"req": 0, "pos": 0, "phase": "decode", "layers": [[1, 9]]}, "in \\[0, 4\\)"),
        ({"req": 0, "pos": 0, "phase": "warmup", "layers": [[1, 2]]}, "phase"),
        ({"req": 0, "pos": 0, "layers": [[1, 2]]}, "not a trace record"),
    ],
)
def test_bad_trace_records_are_named(tmp_path: Path, record: dict, message: str) -> None:
    folder = write_trace(tmp_path / "t", [record], num_experts=4, top_k=2)
    with pytest.raises(TraceError, match=message) as err:
        load_trace(folder)
    assert "trace.jsonl:1" in str(err.value)


def test_trace_without_meta_is_refused(tmp_path: Path) -> None:
    (tmp_path / "trace.jsonl").write_text("")
    with pytest.raises(TraceError, match="meta.json"):
        load_trace(tmp_path / "trace.jsonl")


# ---- recall ----------------------------------------------------------------------------


def noisy_phrases(seed: int, n: int = 32, k: int = 4, vocab: int = 40) -> list[list[int]]:
    """Phrases of tokens that recur, each token routed to its own k experts, but half
    the time one of them is swapped for another: a repeat is similar, rarely identical."""
    rng = random.Random(seed)
    emb = [rng.sample(range(n), k) for _ in range(vocab)]
    phrases = [[rng.randrange(vocab) for _ in range(8)] for _ in range(4)]
    tokens: list[int] = []
    while len(tokens) < 400:
        tokens += phrases[rng.randrange(4)] if rng.random() < 0.6 else [rng.randrange(vocab)]
    steps = []
    for t in tokens[:400]:
        s = list(emb[t])
        if rng.random() < 0.5:
            s[rng.randrange(k)] = rng.choice([e for e in range(n) if e not in s])
        steps.append(s)
    return steps


@pytest.mark.parametrize("seed", [0, 1])
def test_recall_beats_exact_induction_on_inexact_repeats(seed: int) -> None:
    steps = noisy_phrases(seed)
    phases = ["decode"] * len(steps)
    ind = replay(InductionPolicy(32, 10), steps, phases).hit_rate()
    rec = replay(RecallPolicy(32, 10), steps, phases).hit_rate()
    best = replay(BeladyMIN(32, 10, steps), steps, phases).hit_rate()
    assert ind is not None and rec is not None and best is not None
    assert ind + 0.01 < rec <= best


def test_recall_weights_voters_by_how_much_they_share() -> None:
    p = RecallPolicy(16, 6, induction_horizon=1)
    for step in ([0, 1, 2, 3], [8], [0, 1, 2, 5], [9]):
        p.access(step)
    assert not p.recalled().any()  # [9] shares nothing with any earlier step
    p.access([0, 1, 2, 3])
    # Step 0 shares all 4 ids (weight 1) and was followed by [8]; step 2 shares 3 of 4
    # (weight (3/4)^4) and was followed by [9]; the current step never votes.
    w = 0.75**4
    expected = np.zeros(16)
    expected[8], expected[9] = 1 / (1 + w), w / (1 + w)
    np.testing.assert_allclose(p.recalled(), expected)
    strict = RecallPolicy(16, 6, induction_horizon=1, min_shared=4)
    for step in ([0, 1, 2, 5], [9], [0, 1, 2, 3]):
        strict.access(step)
    assert not strict.recalled().any()


def test_recall_fingerprint_keeps_lower_layers_apart() -> None:
    p = RecallPolicy(16, 6, induction_horizon=2, min_shared=2)
    p.observe_lower([[5, 6]])
    p.access([0, 1])
    p.access([9])
    p.observe_lower([[5, 6]])
    p.access([2, 3])
    # Only the lower layer's [5, 6] is shared with step 0 (followed by [9], [2, 3]).
    expected = np.zeros(16)
    expected[9], expected[[2, 3]] = 1.0, 0.8
    np.testing.assert_allclose(p.recalled(), expected)
    # This layer's [5, 6] is not the lower layer's [5, 6]: no earlier step matches.
    p.access([5, 6])
    assert not p.recalled().any()


def test_recall_memory_stays_bounded() -> None:
    rng = random.Random(4)
    p = RecallPolicy(24, 6, memory=16)
    for _ in range(300):
        p.observe_lower([rng.sample(range(24), 3), rng.sample(range(24), 3)])
        p.access(rng.sample(range(24), 3))
    t = 299
    assert p._ring.shape == (16, 3)
    assert all(len(steps) <= 16 for steps in p._postings)
    for i in p._fingerprint.tolist():
        assert all(t - 16 < s <= t for s in p._postings[i])
    assert len(p._postings) == 24 * (1 + p.key_layers)
    with pytest.raises(ValueError, match="min_shared"):
        RecallPolicy(24, 6, min_shared=0)


def test_recall_uses_only_the_past() -> None:
    rng = random.Random(3)
    past = [rng.sample(range(16), 3) for _ in range(40)]
    a, b = RecallPolicy(16, 5), RecallPolicy(16, 5)
    for p in (a, b):
        for s in past:
            p.access(s)
    np.testing.assert_array_equal(a.recalled(), b.recalled())
    a.access(past[5])
    b.access([13, 14, 15])
    assert not np.array_equal(a.recalled(), b.recalled())
