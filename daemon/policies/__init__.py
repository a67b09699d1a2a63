"""Eviction policies of the expert pool, by name.

`POLICIES` maps each online policy's name to its class (read-only); `make_policy` builds
one for a layer. Belady's MIN (`belady.BeladyMIN`) is not here: it needs the future and
only the offline evaluator (`evaluate.py`) builds it. No module here imports MLX.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .base import EvictionPolicy
from .induction import InductionPolicy
from .lfu import LFUPolicy
from .lfuda import LFUDAPolicy
from .lru import LRUPolicy
from .predictive import PredictivePolicy
from .recall import RecallPolicy

POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            LRUPolicy,
            LFUPolicy,
            LFUDAPolicy,
            PredictivePolicy,
            InductionPolicy,
            RecallPolicy,
        )
    }
)


def make_policy(name: str, num_experts: int, capacity: int) -> EvictionPolicy:
    """A fresh policy `name` for one layer of `num_experts` experts and `capacity` slots."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid names: {', '.join(POLICIES)}") from None
    return cls(num_experts, capacity)


__all__ = ["POLICIES", "EvictionPolicy", "make_policy"]
