"""Large-neighbourhood search over the MILP: the ILP's way on chains too long to solve whole.

Beyond a few hundred stages the whole MILP (O(L^2) binaries) is out of reach within a
time limit, but the choice of a few consecutive units, with every other unit's choice
fixed, is a small exact sub-MILP (``solver.ilp.Model`` with ``decided`` units): the
timeline rows still span the whole chain, so the sub-MILP's optimum is the true best
makespan over that neighbourhood.  Windows of ``width`` consecutive offloadable units
are re-optimized in turn, worst first (the most stall around them in the incumbent's
timeline), each warm-started from the incumbent, so a window can only keep or improve
it.  A free unit's prefetch point is capped a little above its need (prefetching far
ahead of need only costs memory); every accepted schedule is replayed by the simulator.
Window models are solved without HiGHS's presolve: most of their rows are the fixed
timeline, which presolve takes long to eliminate (and it ignores the deadline meanwhile).
The search stops at the deadline or after a full pass without improvement.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from offload.step.actions import Offload
from offload.step.chain import Chain, Encoding
from offload.step.simulate import simulate

from .deadline import Deadline, OutOfTime
from .ilp import RAW, Decided, solve_ilp


@dataclass
class Incumbent:
    offloads: list[Offload]
    encode: dict[int, str]
    makespan_s: float
    casts_kept: tuple[int, ...] = ()  # kept as they are: the windows choose offloads and encodings
    log: list[dict] = field(default_factory=list)  # one entry per window tried


def _windows(chain: Chain, inc: Incumbent, width: int) -> list[list[int]]:
    """Windows of ``width`` consecutive offloadable units (overlapping by half), the ones with
    the most stall in the incumbent's timeline first."""
    units = list(chain.offloadable)
    if not units:
        return []
    step = max(1, width // 2)
    starts = list(range(0, max(1, len(units) - width + 1), step))
    if starts[-1] + width < len(units):
        starts.append(len(units) - width)
    sim = simulate(chain, inc.offloads, encode=inc.encode, casts_kept=inc.casts_kept)
    stall = sim.start - sim.ready  # per op, execution order
    L = chain.L

    def weight(window: list[int]) -> float:
        lo, hi = window[0], window[-1]
        forward = stall[lo - 1: min(L, hi + width)].sum()
        need = max(int(chain.need[i]) for i in window)
        backward = stall[2 * L - min(L, need + width): 2 * L - lo + 1].sum()
        return float(forward + backward)

    windows = [units[s: s + width] for s in starts]
    return sorted(windows, key=lambda w: (-weight(w), w[0]))


def improve(chain: Chain, budget: int, start: Incumbent, *, options: Mapping[int, Sequence[Encoding]],
            deadline: Deadline, width: int = 16, window_time_s: float = 10.0, solver: str = "highs",
            threads: int | None = None, msg: bool = False) -> Incumbent:
    """Re-optimize windows of the schedule ``start`` until the deadline (see the module docstring)."""
    inc = start
    by_stage = {o.stage: o for o in inc.offloads}
    improved = True
    while improved and deadline.remaining() > 0.5:
        improved = False
        for window in _windows(chain, inc, width):
            if deadline.remaining() <= 0.5:
                break
            free = set(window)
            decided = {i: Decided(inc.encode.get(i, RAW), by_stage.get(i)) for i in range(1, chain.L + 1)
                       if i not in free}
            reach = max(int(chain.need[i]) for i in window) + 2 * width
            caps = {i: reach for i in window}
            try:
                res = solve_ilp(chain, budget, warm=inc.offloads, warm_encode=inc.encode,
                                options={i: options[i] for i in window if i in options}, decided=decided,
                                prefetch_cap=caps, cut_width=8, solver=solver,
                                time_limit=min(window_time_s, deadline.remaining()), gap=1e-6, threads=threads,
                                msg=msg, deadline=deadline, presolve=False, casts_kept=inc.casts_kept)
            except OutOfTime:
                break
            entry = {"window": [window[0], window[-1]], "status": res.outcome.stop,
                     "seconds": round(res.build_s + res.outcome.seconds, 3)}
            inc.log.append(entry)
            if res.offloads is None:
                continue
            sim = simulate(chain, res.offloads, encode=res.encode, casts_kept=inc.casts_kept)
            if sim.peak_bytes <= budget and sim.makespan_s < inc.makespan_s * (1 - 1e-9):
                entry["gain_s"] = inc.makespan_s - sim.makespan_s
                inc = Incumbent(list(res.offloads), dict(res.encode), sim.makespan_s, inc.casts_kept, inc.log)
                by_stage = {o.stage: o for o in inc.offloads}
                improved = True
    return inc

