"""How much of the copy time falls while the device computes: the simulator's prediction and a
``torch.profiler`` trace's measurement are read the same way (``Simulation.copy_overlap``,
``executor.traces``): the union of the copies' intervals against the union of the compute
intervals, so that a copy running while the device waits (for the host, for another copy)
counts as exposed in both."""
from __future__ import annotations

from typing import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def hidden(copies: Iterable[Interval], compute: Iterable[Interval]) -> tuple[float, float]:
    """(the copies' time, as a union; the part of it while some compute ran)."""
    a, b = union(copies), union(compute)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return sum(e - s for s, e in a), total
