"""The exact MILP over the schedule class of DESIGN section 3.

Decisions (binaries, for each unit ``i`` and each option ``o``: raw, or one of the
encodings the stage offers and the caller allows):
  ``e_{i,o}``    unit stored with encoding ``o`` (at most one; none means raw);
  ``x_{i,o}``    unit offloaded in option ``o`` (offloadable units only);
  ``z_{i,o,j}``  released at or before boundary ``j`` (end of ``Fj``), monotone in ``j``;
  ``y_{i,o,j}``  resident again (prefetched) during ``Bj``, monotone as ``j`` falls.
Memory depends on these alone, so each op's budget row is linear in them.  Encoding
``o`` changes the unit's size, the copy durations, ``Fi`` (encode) and ``B(need_i)``
(decode) linearly in ``e_{i,o}`` (``solver.encoding`` fixes the meaning).  Without
encodings the model is the plain one: one option per unit.

Times (continuous) follow the simulator's max-plus recurrences: ``w_j`` (start of the op
after boundary ``j``), the D2H channel clock ``d_i``, the start ``s_j`` of ``Bj``, and one
H2D clock per (unit, prefetch point) slot in the FIFO's fixed order (points from ``L``
down, within a point larger ``need_from`` first).  A wait that applies only under some
decision is a big-M row whose M is the tightest valid one, from a bound on the channel
backlog.  For fixed decisions the least solution of the rows is exactly the simulator's
timeline, so the optimum equals the simulated makespan.

Exact reductions: a release later than the first boundary where the copy can never still
be running (backlog bound <= forward time elapsed) is dominated and not modelled, and rows
whose M is 0 never bind and are dropped.  Valid cuts, free of big-M, which lift the root
bound (ResNet-101, link-bound, 50%: root gap 7.0% -> 1.3%): the copies of units ``k..j-1``
released by ``j`` ran one after another after ``Fk`` ended; the units needed by ``Bj``
and fetched at or after boundary ``k`` ran one after another after that boundary; the
objective is at least the fluid LP bound.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import pulp

from .chain import Chain, Encoding
from .encoding import encoded_bytes
from .pulp_backend import SolveOutcome, run
from .schedule import Offload
from .simulate import simulate


@dataclass
class IlpResult:
    offloads: list[Offload] | None  # None: no schedule
    encode: dict[int, str]  # stage -> chosen encoding
    outcome: SolveOutcome
    objective_s: float | None  # the MILP objective, in seconds
    dual_bound_s: float | None
    build_s: float
    variables: int
    constraints: int


RAW = ""  # the option "not encoded"


class _Model:
    """The MILP of one (chain, budget, allowed encodings), with helpers to load and read schedules."""

    def __init__(self, chain: Chain, budget: int, lower_bound_s: float = 0.0,
                 options: Mapping[int, Sequence[Encoding]] | None = None) -> None:
        self.chain = chain
        L, U = chain.L, chain.offloadable
        options = dict(options or {})
        self.tau = tau = max(chain.ideal_makespan_s / (2 * L), 1e-12)
        mu = float(max(int(chain.a.max()), 1))
        f, b = chain.f / tau, chain.b / tau
        need = {i: int(chain.need[i]) for i in range(1, L + 1)}
        p = chain.platform
        enc = {(i, e.name): e for i, es in options.items() for e in es}
        # per (unit, option): bytes resident once encoded, copy durations
        self.opts = {i: [RAW] + [e.name for e in options.get(i, ())] for i in range(1, L + 1)}
        size = {(i, o): (chain.a[i] if o == RAW else encoded_bytes(chain, i, enc[i, o])) / mu
                for i in range(1, L + 1) for o in self.opts[i]}
        dd = {(i, o): p.d2h_s(size[i, o] * mu) / tau for i in U for o in self.opts[i]}
        hd = {(i, o): p.h2d_s(size[i, o] * mu) / tau for i in U for o in self.opts[i]}
        B = budget / mu
        lp = self.lp = pulp.LpProblem("offload", pulp.LpMinimize)
        Bin = pulp.LpBinary

        # --- exact release windows from the forward backlog bound (raw copies are the longest)
        self.R: dict[int, int] = {}
        M_rel: dict[tuple[int, int], float] = {}
        backlog = 0.0
        for i in range(1, L + 1):
            backlog = max(0.0, backlog - f[i]) + (dd[i, RAW] if i in U else 0.0)
            if i not in U:
                continue
            self.R[i], acc = L, 0.0
            for j in range(i + 1, L + 1):
                acc += f[j]
                if backlog - acc <= 0.0:
                    self.R[i] = j
                    break
                M_rel[i, j] = backlog - acc

        # --- decisions: encoding chosen (c), offloaded (x), released by j (z), fetched at j (y)
        c = self.c = {(i, o): lp.add_variable(f"e{i}_{n}", cat=Bin)
                      for i in range(1, L + 1) for n, o in enumerate(self.opts[i]) if o != RAW}

        def chosen(i: int, o: str):
            if o != RAW:
                return c[i, o]
            return 1 - pulp.lpSum(c[i, e] for e in self.opts[i] if e != RAW) if len(self.opts[i]) > 1 else 1

        for i in range(1, L + 1):
            if len(self.opts[i]) > 1:
                lp += pulp.lpSum(c[i, e] for e in self.opts[i] if e != RAW) <= 1
        keys = [(i, o) for i in U for o in self.opts[i]]
        x = self.x = {(i, o): lp.add_variable(f"x{i}_{n}", cat=Bin) for i in U for n, o in enumerate(self.opts[i])}
        for (i, o), v in x.items():
            if len(self.opts[i]) > 1:
                lp += v <= chosen(i, o)
        tag = {(i, o): n for i in U for n, o in enumerate(self.opts[i])}
        z = self.z = {(i, o, j): lp.add_variable(f"z{i}_{tag[i, o]}_{j}", cat=Bin)
                      for i, o in keys for j in range(i + 1, self.R[i])}
        y = self.y = {(i, o, j): lp.add_variable(f"y{i}_{tag[i, o]}_{j}", cat=Bin)
                      for i, o in keys for j in range(need[i] + 1, L + 1)}

        def released(i: int, o: str, j: int):  # z_{i,o,j} with its fixed ends
            if j <= i:
                return 0
            return x[i, o] if j >= self.R[i] else z[i, o, j]

        def fetched(i: int, o: str, j: int):  # y_{i,o,j}; resident throughout [i, need_i]
            if j <= need[i]:
                return x[i, o]
            return y[i, o, j] if j <= L else 0

        for (i, o, j), v in z.items():
            lp += v <= released(i, o, j + 1)
        for (i, o, j), v in y.items():
            lp += v <= fetched(i, o, j - 1)

        def extra(i: int, what: str):  # bytes an encoding adds in its raw windows (solver.encoding)
            return pulp.lpSum(getattr(enc[i, e], what) / mu * c[i, e] for e in self.opts[i] if e != RAW)

        # --- memory, one row per op
        for j in range(1, L + 1):  # F_j
            terms = []
            for i in range(1, j):
                for o in self.opts[i]:
                    held = chosen(i, o) - released(i, o, j - 1) if i in U else chosen(i, o)
                    terms.append(size[i, o] * held)
            row = pulp.lpSum(terms) + chain.fp[j] / mu + extra(j, "fwd_extra_bytes")
            if j > 1:
                row += extra(j - 1, "output_bytes")
            if j > 1 or len(self.opts[1]) > 1:
                lp += row <= B, f"memF{j}"
        for j in range(L, 0, -1):  # B_j
            terms = []
            for i in range(1, j + 1):
                for o in self.opts[i]:
                    if i not in U or j <= need[i]:
                        terms.append(size[i, o] * chosen(i, o))
                    else:
                        terms.append(size[i, o] * (chosen(i, o) - x[i, o] + fetched(i, o, j)))
                if j <= need[i]:
                    terms.append(extra(i, "bwd_extra_bytes"))
            lp += pulp.lpSum(terms) + chain.bp[j] / mu <= B, f"memB{j}"

        # --- op durations: encoders run at the end of F_i, decoders in B(need_i)
        fdur = [None] + [f[j] + pulp.lpSum(enc[j, e].encode_s / tau * c[j, e] for e in self.opts[j] if e != RAW)
                         for j in range(1, L + 1)]
        bdur = [None] + [b[j] + pulp.lpSum(enc[i, e].decode_s / tau * c[i, e] for i in range(1, L + 1)
                                           if need[i] == j for e in self.opts[i] if e != RAW)
                         for j in range(1, L + 1)]

        def moved_d2h(i: int):
            return pulp.lpSum(dd[i, o] * x[i, o] for o in self.opts[i])

        # --- forward times
        w = self.w = [0.0] + [lp.add_variable(f"w{j}", 0) for j in range(1, L + 1)]
        d = self.d = {i: lp.add_variable(f"d{i}", 0) for i in U}
        prev = None
        for j in range(1, L + 1):
            lp += w[j] >= w[j - 1] + fdur[j]
            if j in d:
                lp += d[j] >= w[j - 1] + fdur[j] + moved_d2h(j)
                if prev is not None:
                    lp += d[j] >= d[prev] + moved_d2h(j)
                prev = j
        for (i, j), M in M_rel.items():  # release waits that can bind
            lp += w[j] >= d[i] - M * (1 - pulp.lpSum(released(i, o, j) for o in self.opts[i]))
        for j in range(2, L + 1):  # cuts: copies of units k..j-1 released by j ran one after another after F_k
            for k in range(1, j):
                due = [dd[i, o] * released(i, o, j) for i in U if k <= i < j for o in self.opts[i]]
                if due:
                    lp += w[j] >= w[k - 1] + fdur[k] + pulp.lpSum(due)

        # --- backward times and the H2D FIFO
        s = self.s = [None] + [lp.add_variable(f"s{j}", 0) for j in range(1, L + 1)]
        issue = [None] + [s[k + 1] + bdur[k + 1] for k in range(1, L)] + [w[L]]
        self.groups: list[tuple[int, list[int]]] = []
        h2d_total = sum(hd[i, RAW] for i in U)
        span = 0.0  # bound on (H2D clock - issue time) within the current group
        self.clock: dict[tuple[int, int], pulp.LpVariable] = {}
        clock = None
        for k in range(L, 0, -1):
            lp += s[k] >= issue[k]
            if k < L:
                span = max(0.0, span - b[k + 1])
            members = sorted((i for i in U if need[i] <= k), key=lambda i: (-need[i], -i))
            if not members:
                continue
            self.groups.append((k, members))
            span = min(h2d_total, span + sum(hd[i, RAW] for i in members))
            first = True
            for i in members:
                v = self.clock[i, k] = lp.add_variable(f"c{i}_{k}", 0)
                moved = {o: fetched(i, o, k) - fetched(i, o, k + 1) for o in self.opts[i]}  # prefetch point is k
                dur = pulp.lpSum(hd[i, o] * m for o, m in moved.items())
                if first:
                    lp += v >= issue[k] + dur
                if clock is not None:
                    lp += v >= clock + dur
                clock, first = v, False
                M = span - sum(b[m] for m in range(need[i] + 1, k + 1))
                if M > 0:
                    lp += s[need[i]] >= v - M * (1 - pulp.lpSum(moved.values()))
        for j in range(1, L + 1):  # cuts: units needed by B_j and fetched at or after boundary k came after it
            for k in range(L, j - 1, -1):
                due = [hd[i, o] * (x[i, o] - fetched(i, o, k + 1)) for i in U if j <= need[i] <= k for o in self.opts[i]]
                if due:
                    lp += s[j] >= issue[k] + pulp.lpSum(due)
        self.makespan = s[1] + bdur[1]
        lp += self.makespan
        if lower_bound_s > 0:
            lp += self.makespan >= lower_bound_s / tau * (1 - 1e-9), "bound"

    # ------------------------------------------------------------------ warm start
    def load(self, offloads: Sequence[Offload], encode: Mapping[int, str] | None = None) -> float:
        """Set every variable to the least solution for ``offloads`` and ``encode``; returns its objective (s)."""
        encode = dict(encode or {})
        L, tau = self.chain.L, self.tau
        # a release after R_i is dominated by one at R_i (no wait there, less memory)
        offloads = [Offload(o.stage, min(o.release, self.R[o.stage]), o.prefetch) for o in offloads]
        by = {o.stage: o for o in offloads}
        for (i, o), v in self.c.items():
            v.setInitialValue(1 if encode.get(i) == o else 0)

        def mine(i: int, o: str) -> bool:
            return i in by and encode.get(i, RAW) == o

        for (i, o), v in self.x.items():
            v.setInitialValue(1 if mine(i, o) else 0)
        for (i, o, j), v in self.z.items():
            v.setInitialValue(1 if mine(i, o) and by[i].release <= j else 0)
        for (i, o, j), v in self.y.items():
            v.setInitialValue(1 if mine(i, o) and by[i].prefetch >= j else 0)
        sim = simulate(self.chain, offloads, encode=encode)
        derived = sim.chain
        # forward: w_j is the start of F_{j+1}; for j = L the start of B_L before prefetch waits
        for j in range(1, L):
            self.w[j].setInitialValue(sim.start[j] / tau)
        last_release = max([sim.end[L - 1]] + [c.end for c in sim.copies if c.direction == "D2H"
                                                and by[c.stage].release == L])
        self.w[L].setInitialValue(last_release / tau)
        clock = 0.0
        for i, v in self.d.items():
            end_f = sim.end[i - 1] / tau
            clock = max(clock, end_f) + (derived.d2h_s(i) / tau if i in by else 0.0)
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
                self.clock[i, k].setInitialValue(clock)
        return sim.makespan_s

    def read(self) -> tuple[list[Offload], dict[int, str]]:
        """The schedule in the solver's incumbent (binaries rounded)."""
        encode = {i: o for (i, o), v in self.c.items() if (v.varValue or 0) > 0.5}
        out = []
        L = self.chain.L
        for (i, o), v in self.x.items():
            if (v.varValue or 0) < 0.5:
                continue
            r = next(j for j in range(i + 1, L + 1) if j >= self.R[i] or (self.z[i, o, j].varValue or 0) > 0.5)
            need = int(self.chain.need[i])
            k = max([need] + [j for j in range(need + 1, L + 1) if (self.y[i, o, j].varValue or 0) > 0.5])
            out.append(Offload(i, r, k))
        return out, encode


def solve_ilp(chain: Chain, budget: int, *, warm: Sequence[Offload] | None = None,
              warm_encode: Mapping[int, str] | None = None, options: Mapping[int, Sequence[Encoding]] | None = None,
              lower_bound_s: float = 0.0, solver: str = "highs", time_limit: float | None = 60.0,
              gap: float | None = 1e-4, threads: int | None = None, msg: bool = False) -> IlpResult:
    """Build and solve the MILP for an activation ``budget``; ``options`` are the encodings
    it may choose per stage (``solver.encoding.allowed``)."""
    t0 = time.perf_counter()
    model = _Model(chain, budget, lower_bound_s, options)
    if warm is not None:
        model.load(warm, warm_encode)
    build_s = time.perf_counter() - t0
    out = run(model.lp, solver, time_limit=time_limit, gap=gap, threads=threads, warm=warm is not None, msg=msg)
    tau = model.tau
    offloads, encode = model.read() if out.has_solution else (None, {})
    return IlpResult(
        offloads=offloads,
        encode=encode,
        outcome=out,
        objective_s=out.objective * tau if out.objective is not None else None,
        dual_bound_s=out.dual_bound * tau if out.dual_bound is not None else None,
        build_s=build_s,
        variables=len(model.lp.variables()),
        constraints=model.lp.numConstraints(),
    )
