"""The interface every eviction policy implements.

One policy object serves one MoE layer. It knows experts by id only; the expert pool
owns the slots and asks the policy which resident expert to give up. The offline
evaluator (`moestreamctl bench policy`) drives the very same objects with a routing
trace, so what is measured offline is what runs online.

Call order, per token (or per forward, for prefill):
    observe_lower(lower)         optional: the same token's routing in the lower MoE layers
    access(experts)              every routed expert, hits and misses alike
    victim(...) / evicted(e)     for each miss, while the pool is full
    admitted(e)                  for each miss, once it holds a slot
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Collection, Sequence


class EvictionPolicy(ABC):
    name: str = "base"

    def __init__(self, num_experts: int, capacity: int) -> None:
        if capacity < 1 or capacity > num_experts:
            raise ValueError(f"capacity {capacity} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.capacity = capacity

    @abstractmethod
    def access(self, experts: Sequence[int]) -> None:
        """The experts one token routed to in this layer (hits and misses)."""

    @abstractmethod
    def victim(self, resident: Collection[int], protected: Collection[int]) -> int:
        """Choose a resident expert to evict; never one in `protected` (pinned
        experts, and those the current token still needs)."""

    def admitted(self, expert: int) -> None:
        """`expert` now holds a slot."""

    def evicted(self, expert: int) -> None:
        """`expert` lost its slot."""

    def observe_lower(self, lower: Sequence[Sequence[int]]) -> None:
        """Optional cross-layer hint, called right before `access` for the same token:
        the experts that token routed to in each lower MoE layer, lowest layer first
        (they route before this one in the forward, so this is known online). A caller
        may pass only some lower layers, but always the same ones for one policy; an
        empty sequence means no hint. The default ignores it."""

    def set_prior(self, heat: Sequence[float]) -> None:
        """Per-expert routing counts from earlier runs (pool_usage.json); optional."""
