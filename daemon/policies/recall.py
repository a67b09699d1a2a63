"""Recall: induction with a soft match. Every earlier step whose routing resembles this
one votes for what followed it, weighted by how much it resembles.

Why it works: the induction policy recalls what followed the last step with *exactly*
this step's expert set, and exact repeats are rare in higher layers, which route by
context as well as by token. A token that comes back routes to mostly, not always, the
same experts, so a step that shares three of four ids with this one is still evidence
of what comes next, and many such steps together estimate it better than one exact
match. Matching on the same token's routing in the lower layers too (a fingerprint
across layers) makes "the same token in a similar context" more specific still.

How: a step's fingerprint is its experts in this layer and in up to `key_layers` of the
lower layers passed by `observe_lower` (lowest first), each layer in its own id range.
An inverted index (id -> the steps whose fingerprint holds it) gives, for the current
step, how many ids every earlier step within `memory` shares with it. Steps sharing at
least `min_shared` ids (all of them, for a smaller fingerprint) vote with weight
(shared / fingerprint size) ** `power`; the recall
feature of expert e is the weighted mean, over the voters, of the discounted uses of e
in the `induction_horizon` steps after each voter, as far as they are known. It joins
the induction policy's features, and the same online ridge regression decides its
weight per layer, so a layer where recall does not predict gives it no weight.

What must stay true: features use only routing up to the current step; the current
step never votes for itself; a voter older than `memory` steps is ignored (its row of
`_ring` has been overwritten); every posting is a step within the last `memory` steps
once that id is touched again, and each posting list holds at most `memory` steps.
Memory per layer: the induction policy's, plus `memory` x top-k ids in `_ring` and at
most `memory` postings per fingerprint id. Cost per scored step: a pass over the
postings of the fingerprint's ids, then at most `max_voters` (the most similar) x
horizon x top-k additions; per token, one posting appended per fingerprint id.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np

from .induction import InductionPolicy


class RecallPolicy(InductionPolicy):
    name = "recall"

    def __init__(
        self,
        num_experts: int,
        capacity: int,
        *,
        key_layers: int = 4,
        min_shared: int = 3,
        power: float = 4.0,
        max_voters: int = 64,
        memory: int = 1024,
        **induction: Any,
    ) -> None:
        super().__init__(num_experts, capacity, memory=memory, **induction)
        if key_layers < 0 or min_shared < 1 or power <= 0 or max_voters < 1:
            raise ValueError(
                f"[recall] key_layers {key_layers} must be >= 0, min_shared "
                f"{min_shared} >= 1, power {power} > 0 and max_voters {max_voters} >= 1"
            )
        self.key_layers = key_layers
        self.min_shared = min_shared
        self.power = power
        self.max_voters = max_voters
        n_ids = num_experts * (1 + key_layers)
        self._postings: list[deque[int]] = [deque() for _ in range(n_ids)]
        self._fingerprint = np.zeros(0, np.intp)
        self._hint: list[np.ndarray] = []
        # This layer's experts of the last `memory` steps, by step % memory, -1 padded.
        self._ring = np.full((memory, 1), -1, np.intp)

    # ---- the interface ---------------------------------------------------------------

    def observe_lower(self, lower: Sequence[Sequence[int]]) -> None:
        """Keep the lower layers' experts for this token's fingerprint."""
        super().observe_lower(lower)
        hint = [np.unique(np.asarray(layer, np.intp)) for layer in list(lower)[: self.key_layers]]
        # A lower layer with more experts than this one (no model seen has one) would
        # spill into the next layer's id range; its extra ids are left out of the key.
        self._hint = [ids[ids < self.num_experts] for ids in hint]

    def access(self, experts: Sequence[int]) -> None:
        super().access(experts)
        t = self._steps - 1
        now = np.unique(np.asarray(experts, np.intp))
        n = self.num_experts
        # This layer's ids first, so a token without a hint still has a consistent key.
        fingerprint = np.concatenate([now, *((layer + (i + 1) * n) for i, layer in enumerate(self._hint))])
        self._hint = []
        oldest = t - self.memory
        for i in fingerprint.tolist():
            steps = self._postings[i]
            while steps and steps[0] <= oldest:
                steps.popleft()
            steps.append(t)
        self._fingerprint = fingerprint
        if now.size > self._ring.shape[1]:
            wider = np.full((self.memory, now.size), -1, np.intp)
            wider[:, : self._ring.shape[1]] = self._ring
            self._ring = wider
        row = self._ring[t % self.memory]
        row[:] = -1
        row[: now.size] = now

    # ---- the recall feature ----------------------------------------------------------

    def recalled(self) -> np.ndarray:
        """Per expert: the similarity-weighted mean, over earlier steps that resemble
        the current one, of its discounted uses in the steps after them (zeros when no
        earlier step shares `min_shared` fingerprint ids)."""
        out = np.zeros(self.num_experts)
        t = self._steps - 1
        fp = self._fingerprint
        if t < 1 or not fp.size:
            return out
        chunks = [np.fromiter(self._postings[i], np.intp) for i in fp.tolist()]
        steps = np.concatenate(chunks)
        steps = steps[(steps < t) & (steps > t - self.memory)]
        if not steps.size:
            return out
        voters, shared = np.unique(steps, return_counts=True)
        keep = shared >= min(self.min_shared, fp.size)
        voters, shared = voters[keep], shared[keep]
        if not voters.size:
            return out
        if voters.size > self.max_voters:
            # The most similar, the most recent first among equals (voters ascend).
            best = np.argsort(-shared[::-1], kind="stable")[: self.max_voters]
            pick = voters.size - 1 - best
            voters, shared = voters[pick], shared[pick]
        weight = (shared / fp.size) ** self.power
        # Steps voter+1 .. t are known and still in the ring.
        ahead = np.arange(1, len(self._ind_w) + 1)
        later = voters[:, None] + ahead[None, :]
        known = later <= t
        w = weight[:, None] * self._ind_w[None, :] * known
        ids = self._ring[later % self.memory]  # voters x horizon x width
        valid = (ids >= 0) & known[:, :, None]
        w_ids = np.broadcast_to(w[:, :, None], ids.shape)
        out += np.bincount(ids[valid], weights=w_ids[valid], minlength=self.num_experts)
        return out / weight.sum()

    def _extra_features(self) -> int:
        return super()._extra_features() + 1

    def _fill_extra(self, x: np.ndarray) -> None:
        super()._fill_extra(x[:, :-1])
        x[:, -1] = self.recalled()
