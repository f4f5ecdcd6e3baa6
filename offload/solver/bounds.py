"""Lower bounds on the optimal makespan, so every result carries an honest gap.

* ``ideal``: the sum of all op durations (no stall at all).
* ``fluid LP``: a relaxation with O(L) variables.  It relaxes integrality (a unit may be
  offloaded in part, ``0 <= f_i <= 1``), the copies' granularity and order (bytes flow at
  the channel's bandwidth like a fluid, no latency, no FIFO), and the release/prefetch
  points (memory is freed as soon as bytes have left and counted only once bytes have
  arrived).  Every schedule of the class maps to a feasible LP point with the same
  makespan, so the LP optimum is a valid lower bound; it also implies the boundary
  (volume) and prefix (fluid) bounds of the literature, which are therefore not computed
  separately.  Its fractional ``f`` is what the ``relax-lp`` heuristic rounds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pulp

from offload.step.chain import Chain, Stage

from .deadline import Deadline
from .pulp_backend import run


@dataclass(frozen=True)
class FluidLP:
    makespan_s: float  # the bound, when proven
    fraction: dict[int, float]  # offloaded share of each offloadable unit
    proven: bool = True  # solved to optimality: makespan_s is a lower bound (else only a guide)


def fluid_lp(chain: Chain, budget: int, deadline: Deadline | None = None) -> FluidLP | None:
    """Solve the fluid relaxation for an activation ``budget`` by ``deadline``; ``None`` if even it
    is infeasible, or no solution was found in time."""
    L, U = chain.L, chain.offloadable
    tau, mu = chain.time_unit_s, chain.memory_unit_bytes
    f, b = chain.f / tau, (chain.b - chain.rc) / tau  # every weight cast kept: the fastest backward
    a = {i: chain.a[i] / mu for i in range(1, L + 1)}
    # volume is memory freed; a copy may move less than its unit frees (``Stage.moved``): the
    # link then frees memory faster than it moves bytes, at most by the least moved share
    share = min([chain.mv[i] / chain.a[i] for i in U], default=1.0)  # (> 0: a unit moves a byte at least)
    bw_d = chain.platform.d2h_bytes_per_s * tau / mu / share
    bw_h = chain.platform.h2d_bytes_per_s * tau / mu / share
    B = budget / mu
    if chain.fp[1] > budget:
        return None
    prob = pulp.LpProblem("fluid", pulp.LpMinimize)
    x = {i: prob.add_variable(f"f{i}", 0, 1) for i in U}
    # cum[j]: offloaded volume of stages <= j; due[j]: of units needed at B_j or earlier in
    # the backward (need_from >= j).  State recurrences keep the LP at O(L) nonzeros.
    cum = [0.0] + [prob.add_variable(f"A{j}", 0) for j in range(1, L + 1)]
    due = [prob.add_variable(f"N{j}", 0) for j in range(L + 2)]
    w = [0.0] + [prob.add_variable(f"w{j}", 0) for j in range(1, L + 1)]  # start of next op after boundary j
    ship = [0.0] + [prob.add_variable(f"S{j}", 0) for j in range(1, L + 1)]  # D2H volume done by w_j
    rel = [0.0] + [prob.add_variable(f"V{j}", 0) for j in range(1, L + 1)]  # volume released by boundary j
    s = [None] + [prob.add_variable(f"s{j}", 0) for j in range(1, L + 1)]  # start of B_j
    back = [None] + [prob.add_variable(f"P{j}", 0) for j in range(1, L + 1)]  # H2D volume done by s_j
    by_need: dict[int, list[int]] = {}
    for i in U:
        by_need.setdefault(int(chain.need[i]), []).append(i)
    prefix = 0.0  # sum of a_i, i <= j
    for j in range(1, L + 1):
        prob += cum[j] == cum[j - 1] + (a[j] * x[j] if j in x else 0)
        prob += w[j] >= w[j - 1] + f[j]
        prob += ship[j] <= ship[j - 1] + bw_d * (w[j] - w[j - 1])
        prob += ship[j] <= cum[j]
        prob += rel[j] <= ship[j]
        prob += rel[j] <= cum[j - 1]
        prob += rel[j] >= rel[j - 1]
        if j >= 2:  # memory during F_j: units of stages < j not yet released, plus the op's peak
            prob += prefix - rel[j - 1] + chain.fp[j] / mu <= B
        prefix += a[j]
    prob += rel[L] == cum[L]
    prob += due[L + 1] == 0
    prob += s[L] >= w[L]
    prob += back[L] <= bw_h * (s[L] - w[L])
    prefix = sum(a.values())
    for j in range(L, 0, -1):
        prob += due[j] == due[j + 1] + pulp.lpSum(a[i] * x[i] for i in by_need.get(j, ()))
        if j < L:
            prob += s[j] >= s[j + 1] + b[j + 1]
            prob += back[j] <= back[j + 1] + bw_h * (s[j] - s[j + 1])
        prob += back[j] <= cum[L]
        prob += back[j] >= due[j]
        # memory during B_j: kept units of stages <= j, plus arrived bytes of offloaded units
        # of stages <= j (= back[j] - volume of stages > j), plus the op's peak
        prob += prefix - cum[L] + back[j] + chain.bp[j] / mu <= B
        prefix -= a[j]
    prob += s[1] + b[1]
    if deadline is not None and deadline.expired():
        return None
    out = run(prob, "highs", deadline=deadline)
    if not out.has_solution:
        return None
    frac = {i: min(1.0, max(0.0, float(x[i].varValue or 0.0))) for i in U}
    return FluidLP(makespan_s=max(out.objective * tau, chain.ideal_makespan_s), fraction=frac, proven=out.proven)


def coarsened(chain: Chain, groups: int) -> tuple[Chain, np.ndarray]:
    """The chain with runs of consecutive stages merged into ``groups`` stages, and the group of
    each stage (index 0 unused).  A merged stage holds its stages' units until it ends, so it
    is a cruder model: its fluid LP is no lower bound, only a guide to what to offload."""
    L = chain.L
    edges = np.linspace(0, L, min(groups, L) + 1).round().astype(int)
    group = np.zeros(L + 1, dtype=np.int64)
    stages = []
    for g, (lo, hi) in enumerate(zip(edges[:-1] + 1, edges[1:]), start=1):
        group[lo: hi + 1] = g
        a, moved = chain.a[lo: hi + 1], chain.mv[lo: hi + 1]
        before = np.concatenate([[0], np.cumsum(a)[:-1]])  # own units saved earlier in the group
        after = a.sum() - np.cumsum(a)  # own units of later stages of the group
        stages.append(Stage(name=f"{chain.stage(lo).name}..{chain.stage(hi).name}", kind="group",
                            fwd_s=float(chain.f[lo: hi + 1].sum()), bwd_s=float(chain.b[lo: hi + 1].sum()),
                            saved_bytes=int(a.sum()), fwd_peak_bytes=int(max(a.sum(), (chain.fp[lo: hi + 1] + before).max())),
                            bwd_peak_bytes=int(max(0, (chain.bp[lo: hi + 1] - after).max())), need_from=0,
                            moved_bytes=int(moved.sum()) if moved.sum() < a.sum() else None))
    need = [int(group[chain.need[lo: hi + 1].max()]) for lo, hi in zip(edges[:-1] + 1, edges[1:])]
    stages = [replace(s, need_from=n) for s, n in zip(stages, need)]
    return replace(chain, stages=tuple(stages)), group


def rounding_lp(chain: Chain, budget: int, max_stages: int, deadline: Deadline | None = None) -> FluidLP | None:
    """The fluid LP whose fractions ``relax-lp`` rounds: the chain's own up to ``max_stages``
    stages, beyond that the coarsened chain's (each stage takes its group's fraction; the
    value is then no bound); ``None`` when none is solved by ``deadline``."""
    if chain.L <= max_stages:
        return fluid_lp(chain, budget, deadline)
    coarse, group = coarsened(chain, max_stages)
    lp = fluid_lp(coarse, budget, deadline)
    if lp is None:  # the cruder model did not fit: guide by the largest budget it can take
        lp = fluid_lp(coarse, int(np.iinfo(np.int64).max // 4), deadline)
        if lp is None:
            return None
    fraction = {i: lp.fraction.get(int(group[i]), 1.0) for i in chain.offloadable}
    return FluidLP(makespan_s=chain.ideal_makespan_s, fraction=fraction, proven=False)
