"""Predictive: evict the resident expert predicted to be needed least in the next few
tokens. An online approximation of Belady's MIN.

Why it works: MIN evicts the expert whose next use is farthest away; online we cannot
know it, but we can estimate, for every expert, how much it will be routed over the next
`horizon` tokens and evict the smallest estimate. Three things in a layer's own routing
predict that:
  * context: which experts the last few tokens used. A token's experts say what kind of
    token it is, and kinds follow each other (digits, operators, recurring phrases), so
    a table of "experts of a recent token -> experts of the next token", counted online,
    gives P(x next | context) above chance;
  * local rate: exponentially decayed counts (half-lives of `half_lives` tokens) follow
    the request's topic;
  * long-run rate: all counts since start, plus the heat prior (`set_prior`) from earlier
    runs, follow the router's skew.
The score is a linear mix of these features. The weights are not hand-tuned: they are
refit by ridge regression on what actually happened, since every score made `horizon`
tokens ago now has its answer (the discounted number of uses in those tokens), so the
mix adapts to each layer and model. Scoring is lazy: a step is scored on its first
`victim` call (steps without an eviction cost no feature work, and only scored steps
are trained on); residents are then ranked once (O(capacity log capacity) in numpy) and
further victims of the step are taken in that order at O(1) each. Features cost
O(context experts x experts) per scored step.

Subclasses add feature columns through `_extra_features` / `_fill_extra` (they sit
between the built-in ones and the bias column) and may train on `target="next_use"`
(the horizon weight of each expert's first use) instead of the discounted use count.

What must stay true: features at a step use only routing up to that step (the policy
never sees the future); a feature row is trained on only once its `horizon` following
steps have been seen; `_rows[y]` is the sum of row y of `_trans`; `_ctx` is the decayed
sum of the last `context_tokens` steps' experts; protected experts are never returned.
Memory per layer: one float32 experts x experts table and `horizon` + 1 feature rows
(about 1.2 MiB at 512 experts).
"""

from __future__ import annotations

from collections import deque
from typing import Collection, Sequence

import numpy as np

from .base import EvictionPolicy
from .victims import fallback_victim

# Additive smoothing (in pseudo-counts spread over all experts) of every probability.
_SMOOTH = 0.5
# What the mix is fitted to, over the next `horizon` steps, per expert.
_TARGETS = {
    "uses": "discounted number of uses",
    "next_use": "discount of the first use (0 when unused): Belady's criterion",
}


class PredictivePolicy(EvictionPolicy):
    name = "predictive"

    def __init__(
        self,
        num_experts: int,
        capacity: int,
        *,
        context_tokens: int = 6,
        context_decay: float = 0.5,
        half_lives: Sequence[float] = (16.0, 64.0),
        horizon: int = 8,
        horizon_decay: float = 0.8,
        refit_every: int = 4,
        ridge: float = 1.0,
        prior_weight: float = 4096.0,
        target: str = "uses",
    ) -> None:
        super().__init__(num_experts, capacity)
        if context_tokens < 1 or horizon < 1 or refit_every < 1:
            raise ValueError("[predictive] context_tokens, horizon and refit_every must be >= 1")
        if not 0.0 < context_decay <= 1.0 or not 0.0 < horizon_decay <= 1.0:
            raise ValueError("[predictive] decays must be in (0, 1]")
        if target not in _TARGETS:
            raise ValueError(f"[{self.name}] target {target!r}: valid values are {', '.join(_TARGETS)}")
        if any(h <= 0 for h in half_lives):
            raise ValueError(f"[predictive] half_lives {half_lives} must be > 0")
        n = num_experts
        self.horizon = horizon
        self.refit_every = refit_every
        self.prior_weight = prior_weight
        self.target = target
        # Context: decayed counts of the experts of the last `context_tokens` steps.
        self._decay = context_decay
        self._fade = context_decay**context_tokens  # weight of the step leaving it
        self._recent_steps: deque[np.ndarray] = deque(maxlen=max(context_tokens, horizon))
        self._context_tokens = context_tokens
        self._ctx = np.zeros(n)
        self._ctx_idx = np.zeros(0, np.intp)
        self._ctx_w = np.zeros(0)
        self._trans = np.zeros((n, n), np.float32)
        self._rows = np.zeros(n)
        self._counts = np.zeros(n)
        self._prior = np.zeros(n)
        self._keep = np.array([2.0 ** (-1.0 / h) for h in half_lives])[:, None]
        self._recent = np.zeros((len(half_lives), n))
        self._per_step = 0.0  # mean experts per step, to normalise rates
        self._steps = 0
        # Ridge regression: features -> discounted uses over the next `horizon` steps.
        self._extra_at = 2 + len(half_lives)
        nf = self._extra_at + self._extra_features() + 1
        self._horizon_w = horizon_decay ** np.arange(horizon)
        self._x = np.zeros((horizon + 1, n, nf))  # feature rows of the last steps
        self._x[:, :, -1] = 1.0
        self._x_step = np.full(horizon + 1, -1)  # the step each row was scored at
        self._since_refit = 0
        self._w0 = np.zeros(nf)
        self._w0[:2] = 1.0  # before any evidence: log long-run rate + log context rate
        self._gram = np.eye(nf) * ridge * n
        self._rhs = self._gram @ self._w0
        self.weights = self._w0.copy()
        self._score = np.zeros(n)
        self._resident = np.zeros(n, bool)
        self._scored = False
        self._order: list[int] | None = None
        self._next = 0

    # ---- the interface ---------------------------------------------------------------

    def set_prior(self, heat: Sequence[float]) -> None:
        """Routing counts per expert from other runs; scaled to at most `prior_weight`
        routed pairs so that this run's own counts can still move it. Replaces any
        earlier prior."""
        prior = np.asarray(heat, float)
        if prior.shape != (self.num_experts,) or (prior < 0).any():
            raise ValueError(
                f"[predictive.set_prior] need {self.num_experts} non-negative counts, got shape {prior.shape}"
            )
        total = prior.sum()
        if total > self.prior_weight:
            prior = prior * (self.prior_weight / total)
        self._prior = prior
        self._order = None
        self._scored = False

    def access(self, experts: Sequence[int]) -> None:
        now = np.unique(np.asarray(experts, np.intp))
        if self._ctx_idx.size and now.size:
            # The context before this step predicts this step's experts.
            self._trans[np.ix_(self._ctx_idx, now)] += self._ctx_w[:, None]
            self._rows[self._ctx_idx] += self._ctx_w * now.size
        self._steps += 1
        self._per_step += (now.size - self._per_step) / min(self._steps, 64)
        self._counts[now] += 1.0
        self._recent *= self._keep
        self._recent[:, now] += 1.0
        self._push_context(now)
        self._train()
        self._order = None
        self._scored = False

    def victim(self, resident: Collection[int], protected: Collection[int]) -> int:
        if self._order is None:
            self._rescore()
            cand = np.flatnonzero(self._resident)
            self._order = cand[np.argsort(self._score[cand], kind="stable")].tolist()
            self._next = 0
        order = self._order
        while self._next < len(order):
            e = order[self._next]
            if self._resident[e] and e not in protected:
                return e
            self._next += 1
        return fallback_victim(self.name, resident, protected)

    def admitted(self, expert: int) -> None:
        self._resident[expert] = True

    def evicted(self, expert: int) -> None:
        self._resident[expert] = False

    # ---- the model -------------------------------------------------------------------

    def predicted(self) -> np.ndarray:
        """The current score of every expert (higher: needed sooner)."""
        self._rescore()
        return self._score.copy()

    def _rescore(self) -> None:
        """Score this step, once, when a victim is first needed: steps without an
        eviction (hits, free slots, most prefill rows) cost no feature work."""
        if self._scored:
            return
        slot = self._steps % len(self._x)
        if self._since_refit >= self.refit_every:
            self.weights = np.linalg.solve(self._gram, self._rhs)
            self._since_refit = 0
        self._fill_features(self._x[slot])
        self._x_step[slot] = self._steps
        self._score = self._x[slot] @ self.weights
        self._scored = True

    def _push_context(self, now: np.ndarray) -> None:
        steps = self._recent_steps
        ctx = self._ctx
        ctx *= self._decay
        if len(steps) >= self._context_tokens:
            ctx[steps[-self._context_tokens]] -= self._fade
        ctx[now] += 1.0
        steps.append(now)
        idx = np.flatnonzero(ctx > 1e-9)
        w = ctx[idx]
        self._ctx_idx, self._ctx_w = idx, w / w.sum()

    def _train(self) -> None:
        """The feature rows of `horizon` steps ago now have their answer."""
        slot = (self._steps - self.horizon) % len(self._x)
        if self._steps < self.horizon or self._x_step[slot] != self._steps - self.horizon:
            return  # that step was never scored (no eviction), or is not complete yet
        x = self._x[slot]
        self._since_refit += 1
        steps = list(self._recent_steps)[-self.horizon :]
        if self.target == "next_use":
            # Later steps first, so each expert keeps the weight of its first use.
            y = np.zeros(self.num_experts)
            for i in range(len(steps) - 1, -1, -1):
                y[steps[i]] = self._horizon_w[i]
        else:
            uses = np.concatenate(steps)
            weight = np.repeat(self._horizon_w, [len(s) for s in steps])
            y = np.bincount(uses, weights=weight, minlength=self.num_experts)
        self._gram += x.T @ x
        self._rhs += x.T @ y

    def _fill_features(self, x: np.ndarray) -> None:
        n = self.num_experts
        total = self._counts + self._prior
        x[:, 0] = np.log((total + _SMOOTH) * (n / (total.sum() + _SMOOTH * n)))
        if self._ctx_idx.size:
            idx = self._ctx_idx
            scale = self._ctx_w / (self._rows[idx] + _SMOOTH)
            nxt = scale @ self._trans[idx] + scale.sum() * (_SMOOTH / n)
            x[:, 1] = np.log(nxt * n)
        else:
            x[:, 1] = 0.0
        per_step = max(self._per_step, 1.0)
        x[:, 2 : self._extra_at] = (self._recent * ((1.0 - self._keep) * n / per_step)).T
        if self._extra_features():
            self._fill_extra(x[:, self._extra_at : -1])

    # ---- hooks for subclasses --------------------------------------------------------

    def _extra_features(self) -> int:
        """How many feature columns a subclass adds (fixed for the object's life)."""
        return 0

    def _fill_extra(self, x: np.ndarray) -> None:
        """Write the subclass's columns (a view of experts x `_extra_features()`)."""
