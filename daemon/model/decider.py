"""The order in which an on/off measurement runs its two ways: speculation's probe
(daemon/model/speculative.py `_Probe`: speculative or plain decode) and the prefetch
governor (daemon/prefetch/prefetcher.py `PrefetchGovernor`: prefetch on or off).

Both time decode one way, then the other, in blocks, and keep the faster. A drift of
the machine's speed over the measurement (a pool or host tier warming up, a GPU clock
settling) would favour whichever way ran last; blocks in pairs whose order reverses
each time (A B, B A, A B, ...) put each way as often early as late in a pair, so a
steady drift weighs on both alike. What is timed, and how the two decide, stays with
each: they measure in different units and decide by different rules.
"""

from __future__ import annotations


class ABBA:
    """Which of two ways the current block runs: A B B A A B B A ... (`alternate`:
    A B A B ..., which does not cancel drift, for tests of the switching itself).
    Invariant: after every pair, each way has run as many blocks as the other."""

    __slots__ = ("ways", "alternate", "blocks")

    def __init__(self, a: str, b: str, *, alternate: bool = False) -> None:
        self.ways = (a, b)
        self.alternate = alternate
        self.blocks = 0  # blocks ended so far

    def current(self) -> str:
        if self.alternate:
            return self.ways[self.blocks % 2]
        return self.ways[0] if self.blocks % 4 in (0, 3) else self.ways[1]

    def next(self) -> bool:
        """The current block ended; True when it ended a pair."""
        self.blocks += 1
        return self.blocks % 2 == 0
