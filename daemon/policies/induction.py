"""Induction: the predictive policy plus "what followed the last time this token came".

Why it works: text repeats itself within a request (numbers, names and phrases of the
prompt come back in the answer), and a repeated token routes to the same experts, so
the steps that followed the last step with exactly this step's expert set are a good
guess of the steps to come. On the Qwen1.5-MoE GSM8K trace the set of the first traced
layer recurs at 38% of steps, and then the next step shares 62% of its experts with the
step after the earlier match (chance: 7%). Higher layers route by context as well as by
token, so their own sets recur less; the lowest MoE layer's set is close to the token's
identity and, in a forward, is known before any higher layer routes the same token. So
there are two match keys: this layer's set, and the lowest layer's set when the pool
passes it through `observe_lower` (without the hint both keys are this layer's set).

How: each key maps (by a hash of the sorted ids) to the last step it was seen at; the
induction feature of expert e is the discounted number of uses of e in the
`induction_horizon` steps after that step, as far as they are known. The two columns
join the predictive policy's features (long-run rate, context, decayed rates, now with
a 4-token half-life too), and the same online ridge regression decides how much each is
worth, per layer. The regression is fitted to the discount of each expert's first use
over the horizon (Belady's criterion: who is needed soonest) instead of the use count.

What must stay true: as in `predictive`, features at a step use only routing up to that
step; `_hist[-1]` is the current step's experts and `_hist` holds at most `memory`
steps; a key's stored step is the last step before the current one where it was seen,
and a match older than `_hist` is ignored. Memory per layer: the predictive policy's,
plus `memory` steps of ids and up to 2 x `memory` keys per map (pruned as they age out).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np

from .predictive import PredictivePolicy

_KEYS = 2  # this layer's set; the lowest layer's set (or this layer's without a hint)


class InductionPolicy(PredictivePolicy):
    name = "induction"

    def __init__(
        self,
        num_experts: int,
        capacity: int,
        *,
        memory: int = 1024,
        induction_horizon: int = 8,
        induction_decay: float = 0.8,
        half_lives: Sequence[float] = (4.0, 16.0, 64.0),
        target: str = "next_use",
        **predictive: Any,
    ) -> None:
        super().__init__(num_experts, capacity, half_lives=half_lives, target=target, **predictive)
        if memory < 2 or induction_horizon < 1:
            raise ValueError("[induction] memory must be >= 2, induction_horizon >= 1")
        if not 0.0 < induction_decay <= 1.0:
            raise ValueError("[induction] induction_decay must be in (0, 1]")
        self.memory = memory
        self._ind_w = induction_decay ** np.arange(induction_horizon)
        self._hist: deque[list[int]] = deque(maxlen=memory)
        self._seen: list[dict[int, int]] = [{} for _ in range(_KEYS)]
        self._match: list[int | None] = [None] * _KEYS
        self._lower_key: int | None = None

    # ---- the interface ---------------------------------------------------------------

    def observe_lower(self, lower: Sequence[Sequence[int]]) -> None:
        """Remember the lowest given layer's experts for this token's `access`."""
        self._lower_key = _key(lower[0]) if lower and len(lower[0]) else None

    def access(self, experts: Sequence[int]) -> None:
        super().access(experts)
        t = self._steps - 1  # this step's index (the predictive policy counted it)
        own = _key(experts)
        keys = (own, own if self._lower_key is None else self._lower_key)
        self._lower_key = None  # a hint is for one token only
        for i, key in enumerate(keys):
            seen = self._seen[i]
            self._match[i] = seen.get(key)
            seen[key] = t
            if len(seen) > 2 * self.memory:
                self._seen[i] = {k: s for k, s in seen.items() if t - s < self.memory}
        self._hist.append(sorted({int(e) for e in experts}))

    # ---- the extra features -----------------------------------------------------------

    def _extra_features(self) -> int:
        return _KEYS

    def _fill_extra(self, x: np.ndarray) -> None:
        t, hist = self._steps - 1, self._hist
        for i, s in enumerate(self._match):
            col = x[:, i]
            col[:] = 0.0
            if s is None or t - s >= len(hist):
                continue
            # Steps s+1 .. t are known; hist[-1] is step t.
            for d, u in enumerate(range(s + 1, min(s + 1 + len(self._ind_w), t + 1))):
                col[hist[len(hist) - 1 - (t - u)]] += self._ind_w[d]


def _key(experts: Sequence[int]) -> int:
    """One step's expert set, as a hash that ignores order and repeats."""
    return hash(tuple(sorted({int(e) for e in experts})))
