"""One wall-clock budget for a whole solve: every phase asks it how much time is left.

``--time-limit`` promises wall time for everything a solve does (heuristics, bounds,
building the MILP, the solver, the replay), not only for the MILP solver's own clock.
A ``Deadline`` is created when a solve starts and handed down; long loops call
``check()`` (which raises ``OutOfTime``) or size their own budgets with ``share()``.
"""
from __future__ import annotations

import math
import time


class OutOfTime(Exception):
    """Raised inside a phase whose deadline passed; the caller keeps what it has so far."""


class Deadline:
    """The wall-clock end of a solve (``None`` seconds: no end)."""

    def __init__(self, seconds: float | None = None) -> None:
        self.start = time.perf_counter()
        self.end = math.inf if seconds is None else self.start + seconds

    def remaining(self) -> float:
        """Seconds left (``inf`` without an end; never negative)."""
        return max(0.0, self.end - time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def expired(self) -> bool:
        return time.perf_counter() >= self.end

    def check(self, what: str = "") -> None:
        """Raise ``OutOfTime`` once the deadline has passed."""
        if self.expired():
            raise OutOfTime(what)

    def share(self, fraction: float, cap: float = math.inf) -> float:
        """``fraction`` of what is left, at most ``cap`` seconds: a phase's own budget."""
        return min(cap, fraction * self.remaining())
