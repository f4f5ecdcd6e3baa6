"""The two relaxation heuristics (the seed paper's approach: relax, solve, round back, repair).

Both choose *which* units to offload through a relaxation, then let ``policy.plan_greedy``
pick the release and prefetch points (optimal for the forward given the set, need-order
optimal for the backward), and finish with the same local search over the set, every
candidate scored by the simulator.  The result is always a simulator-checked schedule
within budget (the all-offload floor schedule is the fallback), never a guess.

``relax-lp``  relaxes integrality, copy granularity and order: the fluid LP of
              ``bounds.fluid_lp`` (O(L) variables) gives a fractional offload share per
              unit; rounding thresholds turn it into sets, repaired to fit memory.
              Cost: one small LP plus a handful of simulations.  Guarantee: the LP value
              is a lower bound, so the printed gap is certified.
``relax-bw``  relaxes bandwidth (copies take no time): then every set that fits memory
              with instant release and on-demand fetch reaches the ideal makespan, and
              the relaxed problem is a covering problem over the op sequence (unit ``i``
              covers the ops from ``F(i+2)`` to ``B(need_i + 1)``), solved greedily for the
              least moved volume, earlier stages first on ties (more time to hide).  The
              real bandwidth is then restored and the stalls repaired by local search.
              Cost: O(L) covering steps plus the search; no solver needed.

With encodings allowed, ``with_encodings`` wraps either one: the set heuristic runs on
the derived chains of a few encoding choices, then single units' encodings are toggled.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import numpy as np

from . import encoding
from .bounds import FluidLP
from .chain import Chain
from .memory import floor_offloads, smallest_feasible_budget
from .policy import absent_ops, cover_peaks, floor_memory, plan_greedy
from .schedule import Offload
from .simulate import simulate


class _Scorer:
    """Memoized makespan of the greedy plan for a set (``inf`` if the set cannot fit)."""

    def __init__(self, chain: Chain, budget: int) -> None:
        self.chain, self.budget = chain, budget
        self.cache: dict[frozenset[int], tuple[float, list[Offload] | None]] = {}

    def __call__(self, units: Iterable[int]) -> float:
        key = frozenset(units)
        if key not in self.cache:
            plan = plan_greedy(self.chain, key, self.budget)
            span = simulate(self.chain, plan).makespan_s if plan is not None else np.inf
            self.cache[key] = (span, plan)
        return self.cache[key][0]

    def plan(self, units: Iterable[int]) -> list[Offload] | None:
        self(units)
        return self.cache[frozenset(units)][1]


def _fill(chain: Chain, budget: int, units: set[int], order: list[int]) -> set[int]:
    """Add units in ``order`` until the set fits memory (the floor schedule always does).

    Incremental: adding unit ``i`` lowers the floor memory by ``a_i`` on its ``absent_ops``."""
    units = set(units)
    mem = floor_memory(chain, units)
    for i in order:
        if mem.max() <= budget:
            break
        if i not in units:
            units.add(i)
            span = absent_ops(chain, i)
            mem[span.start: span.stop] -= chain.a[i]
    return units


def local_search(chain: Chain, score: _Scorer, start: set[int], deadline: float, ideal: float) -> set[int]:
    """First-improvement search over drop / add / swap moves, until no move helps or time is up.

    Large chains get a neighbourhood restricted to nearby stages, so that a pass stays
    within the heuristic's time budget."""
    U = list(chain.offloadable)
    best, best_s = set(start), score(start)
    radius = len(U) if len(U) <= 80 else 8
    improved = True
    while improved and best_s > ideal * (1 + 1e-12) and time.perf_counter() < deadline:
        improved = False
        inside = sorted(best)
        outside = [i for i in U if i not in best]
        moves: list[tuple[set[int], set[int]]] = [({u}, set()) for u in inside]
        moves += [(set(), {v}) for v in outside]
        moves += [({u}, {v}) for u in inside for v in outside if abs(u - v) <= radius]
        for drop, add in moves:
            if time.perf_counter() >= deadline:
                break
            cand = (best - drop) | add
            s = score(cand)
            if s < best_s * (1 - 1e-12):
                best, best_s, improved = cand, s, True
                break
    return best


def _finish(chain: Chain, budget: int, score: _Scorer, starts: list[set[int]], deadline: float) -> list[Offload]:
    ideal = chain.ideal_makespan_s
    start = min(starts, key=score)
    best = local_search(chain, score, start, deadline, ideal)
    plan = score.plan(best)
    return plan if plan is not None else floor_offloads(chain)


def relax_lp(chain: Chain, budget: int, lp: FluidLP, time_budget_s: float = 1.0) -> list[Offload]:
    """Round the fluid LP's fractional offload and repair it (see module docstring)."""
    deadline = time.perf_counter() + time_budget_s
    score = _Scorer(chain, budget)
    U = chain.offloadable
    by_share = sorted(U, key=lambda i: (-lp.fraction[i], i))
    starts = []
    for theta in (0.999, 0.9, 0.75, 0.5, 0.25, 0.1, 0.01):
        chosen = {i for i in U if lp.fraction[i] >= theta}
        starts.append(_fill(chain, budget, chosen, by_share))
    return _finish(chain, budget, score, starts, deadline)


def cover_without_bandwidth(chain: Chain, budget: int) -> set[int]:
    """Least-volume set that fits memory when copies are instant (greedy interval cover):
    the smallest unit that covers the peak's excess alone, else the largest."""
    def pick(cands: list[int], excess: int) -> int:
        enough = [i for i in cands if chain.a[i] >= excess]
        return min(enough, key=lambda i: (chain.a[i], i)) if enough else max(cands, key=lambda i: (chain.a[i], -i))
    chosen = cover_peaks(chain, budget, pick)
    return chosen if chosen is not None else set(chain.offloadable)


def relax_bw(chain: Chain, budget: int, time_budget_s: float = 1.0) -> list[Offload]:
    """Solve the infinite-bandwidth relaxation, then repair its stalls (see module docstring)."""
    deadline = time.perf_counter() + time_budget_s
    score = _Scorer(chain, budget)
    cover = cover_without_bandwidth(chain, budget)
    # second start: the same volume taken from the earliest stages (most time to hide copies)
    early = _fill(chain, budget, set(), sorted(chain.offloadable))
    return _finish(chain, budget, score, [cover, early], deadline)


def with_encodings(chain: Chain, budget: int, mode: str, heuristic: Callable[[Chain], list[Offload]],
                   time_budget_s: float = 1.0) -> tuple[list[Offload], dict[int, str]]:
    """Choose encodings around a set heuristic: run it on the derived chains of a few
    choices (none, Gist's smallest everywhere, the floor's), keep the best simulated one,
    then toggle single units' encodings (keeping the offloaded set, timing re-planned by
    ``plan_greedy``) while that shortens the step."""
    opts = encoding.allowed(chain, mode)
    if not opts:
        return heuristic(chain), {}
    deadline = time.perf_counter() + time_budget_s
    starts = [{}, encoding.smallest(chain, mode), encoding.floor(chain, mode)[1]]
    best: tuple[float, list[Offload], dict[int, str]] | None = None
    for choice in {tuple(sorted(c.items())): c for c in starts}.values():
        derived = encoding.apply(chain, choice)
        if smallest_feasible_budget(derived) > budget:
            continue
        plan = heuristic(derived)
        sim = simulate(derived, plan)
        if sim.peak_bytes <= budget and (best is None or sim.makespan_s < best[0]):
            best = (sim.makespan_s, plan, dict(choice))
    if best is None:  # the floor's choice always fits: unreachable unless the budget is below the floor
        raise ValueError("no encoding choice fits the budget")
    span, plan, choice = best
    gain = sorted(opts, key=lambda i: -(chain.a[i] - min(encoding.encoded_bytes(chain, i, e) for e in opts[i])))
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        units = {o.stage for o in plan}
        for i in gain:
            for name in [None] + [e.name for e in opts[i]]:
                if name == choice.get(i) or time.perf_counter() >= deadline:
                    continue
                cand = {k: v for k, v in choice.items() if k != i} | ({i: name} if name else {})
                derived = encoding.apply(chain, cand)
                cand_plan = plan_greedy(derived, units, budget)
                if cand_plan is None:
                    continue
                s = simulate(derived, cand_plan).makespan_s
                if s < span * (1 - 1e-12):
                    span, plan, choice, improved = s, cand_plan, cand, True
                    break
    return plan, choice
