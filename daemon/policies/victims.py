"""What every policy does when its own order offers no victim."""

from __future__ import annotations

from typing import Collection


class NoVictimError(RuntimeError):
    """Every resident expert is protected: the pool is too small for what it must hold."""


def fallback_victim(policy: str, resident: Collection[int], protected: Collection[int]) -> int:
    """The last resort, reached when every expert the policy tracks is protected: any
    resident, unprotected expert (one the pool placed without calling `admitted`).
    Raises `NoVictimError` when every resident expert is protected."""
    for e in resident:
        if e not in protected:
            return int(e)
    raise NoVictimError(
        f"[{policy}.victim] all {len(resident)} resident experts are protected "
        f"({len(protected)} pinned or needed by the current token): raise the pool "
        "capacity above top-k plus the pinned experts"
    )
