"""The exact MILP over the schedule class of DESIGN section 3.

Decisions (binaries, for each offloadable unit ``i``):
  ``x_i``      unit offloaded;
  ``z_{i,j}``  released at or before boundary ``j`` (end of ``Fj``), monotone in ``j``;
  ``y_{i,j}``  resident again (prefetched) during ``Bj``, monotone as ``j`` falls.
Memory depends on these alone, so each op's budget row is linear in them, with O(L) terms.

Times (continuous) follow the simulator's max-plus recurrences: ``w_j`` (start of the op
after boundary ``j``), the D2H channel clock ``d_i``, the start ``s_j`` of ``Bj``, and one
H2D clock per (unit, prefetch point) slot in the FIFO's fixed order (points from ``L``
down, within a point larger ``need_from`` first).  A wait that applies only under some
decision is a big-M row whose M is the tightest valid one, from a bound on the channel
backlog.  For fixed decisions the least solution of the rows is exactly the simulator's
timeline, so the optimum equals the simulated makespan.

Exact reductions: a release later than the first boundary where the copy can never still
be running (backlog bound <= forward time elapsed) is dominated and not modelled, and rows
whose M is 0 never bind and are dropped.  Valid cuts: every released copy ran on one
channel after ``F1``; every unit needed by ``Bj`` was fetched after the turn; the
objective is at least the fluid LP bound.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import pulp

from .chain import Chain
from .pulp_backend import SolveOutcome, run
from .schedule import Offload
from .simulate import simulate


@dataclass
class IlpResult:
    offloads: list[Offload] | None  # None: no schedule
    outcome: SolveOutcome
    objective_s: float | None  # the MILP objective, in seconds
    dual_bound_s: float | None
    build_s: float
    variables: int
    constraints: int


class _Model:
    """The MILP of one (chain, budget), with helpers to load and read schedules."""

    def __init__(self, chain: Chain, budget: int, lower_bound_s: float = 0.0) -> None:
        self.chain = chain
        L, U = chain.L, chain.offloadable
        self.tau = tau = max(chain.ideal_makespan_s / (2 * L), 1e-12)
        mu = float(max(int(chain.a.max()), 1))
        f, b = chain.f / tau, chain.b / tau
        a = chain.a / mu
        need = {i: int(chain.need[i]) for i in U}
        dd = {i: chain.d2h_s(i) / tau for i in U}
        hd = {i: chain.h2d_s(i) / tau for i in U}
        B = budget / mu
        lp = self.lp = pulp.LpProblem("offload", pulp.LpMinimize)
        Bin = pulp.LpBinary

        # --- exact release windows from the forward backlog bound
        self.R: dict[int, int] = {}
        M_rel: dict[tuple[int, int], float] = {}
        backlog = 0.0
        for i in range(1, L + 1):
            backlog = max(0.0, backlog - f[i]) + (dd[i] if i in dd else 0.0)
            if i not in dd:
                continue
            self.R[i], acc = L, 0.0
            for j in range(i + 1, L + 1):
                acc += f[j]
                if backlog - acc <= 0.0:
                    self.R[i] = j
                    break
                M_rel[i, j] = backlog - acc
        x = self.x = {i: lp.add_variable(f"x{i}", cat=Bin) for i in U}
        z = self.z = {(i, j): lp.add_variable(f"z{i}_{j}", cat=Bin) for i in U for j in range(i + 1, self.R[i])}
        y = self.y = {(i, j): lp.add_variable(f"y{i}_{j}", cat=Bin) for i in U for j in range(need[i] + 1, L + 1)}

        def released(i: int, j: int):  # z_{i,j} with its fixed ends
            if j <= i:
                return 0
            return x[i] if j >= self.R[i] else z[i, j]

        def fetched(i: int, j: int):  # y_{i,j}; resident throughout [i, need_i]
            if j <= need[i]:
                return x[i]
            return y[i, j] if j <= L else 0

        for (i, j), v in z.items():
            lp += v <= released(i, j + 1)
        for (i, j), v in y.items():
            lp += v <= fetched(i, j - 1)

        # --- memory, one row per op
        for j in range(2, L + 1):  # F_j (F_1 holds only its own peak)
            lp += pulp.lpSum(a[i] * (1 - released(i, j - 1)) if i in x else float(a[i]) for i in range(1, j)) \
                + chain.fp[j] / mu <= B, f"memF{j}"
        for j in range(L, 0, -1):  # B_j
            terms = []
            for i in range(1, j + 1):
                if i not in x or j < need[i]:
                    terms.append(float(a[i]))
                else:
                    terms.append(a[i] * (1 - x[i] + fetched(i, j)))
            lp += pulp.lpSum(terms) + chain.bp[j] / mu <= B, f"memB{j}"

        # --- forward times
        w = self.w = [0.0] + [lp.add_variable(f"w{j}", 0) for j in range(1, L + 1)]
        d = self.d = {i: lp.add_variable(f"d{i}", 0) for i in U}
        prev = None
        for j in range(1, L + 1):
            lp += w[j] >= w[j - 1] + f[j]
            if j in d:
                lp += d[j] >= w[j - 1] + f[j] + dd[j] * x[j]
                if prev is not None:
                    lp += d[j] >= d[prev] + dd[j] * x[j]
                prev = j
        for (i, j), M in M_rel.items():  # release waits that can bind
            lp += w[j] >= d[i] - M * (1 - released(i, j))
        for j in range(2, L + 1):  # cut: released copies ran one after another after F_1
            lp += w[j] >= f[1] + pulp.lpSum(dd[i] * released(i, j) for i in U if i < j)

        # --- backward times and the H2D FIFO
        s = self.s = [None] + [lp.add_variable(f"s{j}", 0) for j in range(1, L + 1)]
        issue = [None] + [s[k + 1] + b[k + 1] for k in range(1, L)] + [w[L]]
        self.groups: list[tuple[int, list[int]]] = []
        h2d_total = sum(hd.values())
        span = 0.0  # bound on (H2D clock - issue time) within the current group
        self.c: dict[tuple[int, int], pulp.LpVariable] = {}
        clock = None
        for k in range(L, 0, -1):
            lp += s[k] >= issue[k]
            if k < L:
                span = max(0.0, span - b[k + 1])
            members = sorted((i for i in U if need[i] <= k), key=lambda i: (-need[i], -i))
            if not members:
                continue
            self.groups.append((k, members))
            span = min(h2d_total, span + sum(hd[i] for i in members))
            first = True
            for i in members:
                v = self.c[i, k] = lp.add_variable(f"c{i}_{k}", 0)
                moved = fetched(i, k) - fetched(i, k + 1)  # prefetch point is k
                if first:
                    lp += v >= issue[k] + hd[i] * moved
                if clock is not None:
                    lp += v >= clock + hd[i] * moved
                clock, first = v, False
                M = span - sum(b[m] for m in range(need[i] + 1, k + 1))
                if M > 0:
                    lp += s[need[i]] >= v - M * (1 - moved)
        for j in range(1, L + 1):  # cut: units needed by B_j were all fetched after the turn
            due = [hd[i] * x[i] for i in U if need[i] >= j]
            if due:
                lp += s[j] >= w[L] + pulp.lpSum(due)
        self.makespan = s[1] + b[1]
        lp += self.makespan
        if lower_bound_s > 0:
            lp += self.makespan >= lower_bound_s / tau * (1 - 1e-9), "bound"
        self._released, self._fetched = released, fetched

    # ------------------------------------------------------------------ warm start
    def load(self, offloads: Sequence[Offload]) -> float:
        """Set every variable to the least solution for ``offloads``; returns its objective (s)."""
        chain, L, tau = self.chain, self.chain.L, self.tau
        # a release after R_i is dominated by one at R_i (no wait there, less memory)
        offloads = [Offload(o.stage, min(o.release, self.R[o.stage]), o.prefetch) for o in offloads]
        by = {o.stage: o for o in offloads}
        for i, v in self.x.items():
            v.setInitialValue(1 if i in by else 0)
        for (i, j), v in self.z.items():
            v.setInitialValue(1 if i in by and by[i].release <= j else 0)
        for (i, j), v in self.y.items():
            v.setInitialValue(1 if i in by and by[i].prefetch >= j else 0)
        sim = simulate(chain, offloads)
        # forward: w_j is the start of F_{j+1}; for j = L the start of B_L before prefetch waits
        for j in range(1, L):
            self.w[j].setInitialValue(sim.start[j] / tau)
        last_release = max([sim.end[L - 1]] + [c.end for c in sim.copies if c.direction == "D2H"
                                                and by[c.stage].release == L])
        self.w[L].setInitialValue(last_release / tau)
        clock = 0.0
        for i, v in self.d.items():
            end_f = sim.end[i - 1] / tau
            clock = max(clock, end_f) + (self.chain.d2h_s(i) / tau if i in by else 0.0)
            v.setInitialValue(clock)
        for j in range(1, L + 1):
            self.s[j].setInitialValue(sim.start[2 * L - j] / tau)
        h2d_end = {c.stage: c.end / tau for c in sim.copies if c.direction == "H2D"}
        clock = None
        for k, members in self.groups:
            issue = (last_release if k == L else sim.end[2 * L - k - 1]) / tau
            for n, i in enumerate(members):
                base = issue if n == 0 and clock is None else (max(issue, clock) if n == 0 else clock)
                clock = h2d_end[i] if i in by and by[i].prefetch == k else base
                self.c[i, k].setInitialValue(clock)
        return sim.makespan_s

    def read(self) -> list[Offload]:
        """The schedule in the solver's incumbent (binaries rounded)."""
        out = []
        for i, v in self.x.items():
            if (v.varValue or 0) < 0.5:
                continue
            r = next(j for j in range(i + 1, self.chain.L + 1) if j >= self.R[i] or (self.z[i, j].varValue or 0) > 0.5)
            need = int(self.chain.need[i])
            k = max([need] + [j for j in range(need + 1, self.chain.L + 1) if (self.y[i, j].varValue or 0) > 0.5])
            out.append(Offload(i, r, k))
        return out


def solve_ilp(chain: Chain, budget: int, *, warm: Sequence[Offload] | None = None, lower_bound_s: float = 0.0,
              solver: str = "highs", time_limit: float | None = 60.0, gap: float | None = 1e-4,
              threads: int | None = None, msg: bool = False) -> IlpResult:
    """Build and solve the MILP for an activation ``budget``."""
    t0 = time.perf_counter()
    model = _Model(chain, budget, lower_bound_s)
    if warm is not None:
        model.load(warm)
    build_s = time.perf_counter() - t0
    out = run(model.lp, solver, time_limit=time_limit, gap=gap, threads=threads, warm=warm is not None, msg=msg)
    tau = model.tau
    return IlpResult(
        offloads=model.read() if out.has_solution else None,
        outcome=out,
        objective_s=out.objective * tau if out.objective is not None else None,
        dual_bound_s=out.dual_bound * tau if out.dual_bound is not None else None,
        build_s=build_s,
        variables=len(model.lp.variables()),
        constraints=model.lp.numConstraints(),
    )
