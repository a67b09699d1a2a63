"""The elastic pool as `status` gives it (`elastic`): its size now, the pressure it reads,
and each resize with why (daemon/pool/elastic.py makes these; `moestreamctl status` and
the dashboard read them back with `from_dict`). Imports no MLX."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class ResizeEvent:
    """One resize of the pool (and host tier), between two decode steps."""

    at: float  # wall-clock seconds (time.time()) when the pool reached its new size
    level: str  # the pressure read: normal, warn or critical
    reason: str  # why, in words: the level and what the source saw
    slots_from: int  # slots per MoE layer (the widest layer's)
    slots_to: int
    pool_bytes_from: int
    pool_bytes_to: int
    tier_bytes_from: int  # the host tier's (0: none)
    tier_bytes_to: int
    experts_moved: int  # given back (a shrink) or read back in (a grow), over every layer
    seconds: float  # from the reading to the pool at its new size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ResizeEvent":
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class ElasticStatus:
    """`status`'s `elastic`: off (with why) or the pool's size, bounds and last events."""

    source: str | None  # where the pressure is read; None: off
    note: str  # why off, or the rule in a few words
    level: str  # the last level read
    detail: str  # what the source saw then
    slots: int  # slots per MoE layer now (the widest layer's)
    configured_slots: int  # what the pool was made with (--capacity, --memory-budget)
    floor_slots: int  # the floor: top-k
    tier_bytes: int  # the host tier now (0: none)
    configured_tier_bytes: int
    # Below the floor: new requests are refused until the pressure passes.
    refusing: bool
    refused: int  # requests refused so far
    events: list[ResizeEvent] = field(default_factory=list)  # the last ones, oldest first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ElasticStatus":
        values = _known(cls, d)
        values["events"] = [ResizeEvent.from_dict(e) for e in d.get("events") or []]
        return cls(**values)
