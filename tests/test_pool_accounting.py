"""The partial pool's accounting (issue 55): however its decode path does the bookkeeping
(the policy, the heat's routed counts, the LRU stack distances, the hit and miss counts,
the diagnostics), the totals after a request are those the path of before issue 55
recorded for the same greedy decode, kept in `tests/data/pool_accounting.json`; so are
those of decode forwards forced to check residency every few layers and be redone from a
layer that missed (daemon/model/optimistic.py), which leaves each pool's forwards in order.

The fixture was written by this module's `main` on the code before the change (commit
84c4ee8), on the demo store (written again there for the demo whose resident weights
became float32, with the same procedure that gives the earlier fixture byte for byte on
the earlier store): the diagnostics' prompt, 24 greedy tokens through the
daemon's generation loop, at 25% and 50% with prefetch off (with prefetch on, whether a
read finished before its layer ran is the machine's timing, so the attribution would be
too), diagnostics off and on, the LRU policy and the predictive one (which reads the
lower layers' routing of the same token). Timings and sync counts are left out: they are
what the change is for.

    python tests/test_pool_accounting.py   # rewrites the fixture from the code as it is
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_diagnostics import PROMPT, TOKENS

from moestream.daemon.model.generation import SamplingParams, generate
from moestream.daemon.model.streaming_model import POOL_COUNTERS, load_streaming_model
from moestream.shared.settings import Settings, demo_store_path

FIXTURE = Path(__file__).parent / "data" / "pool_accounting.json"
CASES = [
    (capacity, policy, diagnostics)
    for capacity in (0.25, 0.5)
    for policy in ("lru", "predictive")
    for diagnostics in (False, True)
]
# Performance counters, not accounting: how often the host waited, which the change cuts.
NOT_COMPARED = {"host_syncs", "quiesces"}


def _case_key(capacity: float, policy: str, diagnostics: bool) -> str:
    return f"{capacity:g}/{policy}/{'diagnostics' if diagnostics else 'plain'}"


def _diagnostics(d: dict[str, Any]) -> dict[str, Any]:
    """A request's diagnostics without their timings: per layer, the attribution, the
    recall's counts and the union of experts per forward."""
    out = {}
    for ordinal, layer in d["layers"].items():
        out[ordinal] = {
            "attribution": layer["attribution"],
            "recall": layer["recall"],
            "union": {seq: {k: u[k] for k in ("forwards", "p50", "p99", "max")} for seq, u in layer["union"].items()},
        }
    return out


def totals(capacity: float, policy: str, diagnostics: bool, optimistic: bool | None = None) -> dict[str, Any]:
    """One request's tokens and the accounting it left: the pools' counters, and per layer
    the heat's routed counts, the stack distances, the experts resident at the end, and
    (diagnostics on) the request's diagnostics without timings. `optimistic` True: every
    decode forward that can checks residency every few layers and is redone from a layer
    that missed (daemon/model/optimistic.py); None: where its miss rule says so."""
    sm = load_streaming_model(demo_store_path(), Settings(capacity=capacity, prefetch="off", policy=policy))
    if sm.optimistic is not None:
        sm.optimistic.force(optimistic)
    try:
        result = generate(sm, PROMPT, SamplingParams(max_tokens=TOKENS, diagnostics=diagnostics))
        stats = sm.pool_stats()
        out: dict[str, Any] = {
            "tokens": result.tokens,
            "counters": {k: getattr(stats, k) for k in POOL_COUNTERS if k not in NOT_COMPARED},
            "layers": [
                {
                    "routed": p.take_routed().tolist(),
                    "stack_distances": {str(d): int(c) for d, c in enumerate(p.stack_distances.take()) if c},
                    "resident": np.flatnonzero(p.slot_of >= 0).tolist(),
                    "hit_rate": layer.hit_rate,
                }
                for p, layer in zip(sm.pools, stats.layers)
            ],
        }
        if diagnostics:
            out["diagnostics"] = _diagnostics(result.stats.diagnostics)
        if optimistic and policy == "lru":
            # The LRU pools look their slots up on the device, so the forwards did run so.
            assert sm.optimistic.redos > 0 and sm.optimistic.forwards >= TOKENS - 1
        return out
    finally:
        sm.close()


@pytest.mark.parametrize(
    "capacity,policy,diagnostics,optimistic",
    [(*case, None) for case in CASES] + [(*case, True) for case in CASES if not case[2]],
)
def test_accounting_totals_are_todays(capacity, policy, diagnostics, optimistic):
    expected = json.loads(FIXTURE.read_text())[_case_key(capacity, policy, diagnostics)]
    got = json.loads(json.dumps(totals(capacity, policy, diagnostics, optimistic)))
    assert got["tokens"] == expected["tokens"]
    assert got["counters"] == expected["counters"]
    for ordinal, (g, e) in enumerate(zip(got["layers"], expected["layers"])):
        assert g == e, f"layer {ordinal}"
    assert got.get("diagnostics") == expected.get("diagnostics")


def main() -> None:
    FIXTURE.write_text(json.dumps({_case_key(*case): totals(*case) for case in CASES}, indent=1) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)


if __name__ == "__main__":
    main()
