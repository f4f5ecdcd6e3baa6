"""The exact MILP over the schedule class (docs/model.md), whole or around a window.

Decisions (binaries, for each unit ``i`` and each option ``o``: raw, or one of the
encodings the stage offers and the caller allows):
  ``e_{i,o}``    unit stored with encoding ``o`` (at most one; none means raw);
  ``x_{i,o}``    unit offloaded in option ``o`` (offloadable units only);
  ``z_{i,o,j}``  released at or before boundary ``j`` (end of ``Fj``), monotone in ``j``;
  ``y_{i,o,j}``  resident again (prefetched) during ``Bj``, monotone as ``j`` falls.
Memory depends on these alone, so each op's budget row is linear in them.  Encoding
``o`` changes the unit's size, the copy durations, ``Fi`` (encode) and ``B(need_i)``
(decode) linearly in ``e_{i,o}`` (``offload.step.encoding`` fixes the meaning).

Times (continuous) follow the simulator's max-plus recurrences: ``w_j`` (start of the op
after boundary ``j``), the D2H channel clock ``d_i``, the start ``s_j`` of ``Bj``, and one
H2D clock per (unit, prefetch point) slot in the FIFO's fixed order (points from ``L``
down, within a point the step's own order, ``offload.step.events.prefetch_key``).  A wait that applies only under some
decision is a big-M row whose M is the tightest valid one, from a bound on the channel
backlog.  For fixed decisions the least solution of the rows is exactly the simulator's
timeline, so the optimum equals the simulated makespan.

Exact reductions: a release later than the first boundary where the copy can never still
be running (backlog bound <= forward time elapsed) is dominated and not modelled; rows
whose M is 0 never bind and are dropped; memory rows with the same variable part keep
only the largest constant.  Valid cuts, free of big-M, lift the root bound (ResNet-101,
link-bound, 50%: root gap 7.0% -> 1.3%): the copies of units ``k..j-1`` released by ``j``
ran one after another after ``Fk`` ended; the units needed by ``Bj`` and fetched at or
after boundary ``k`` ran one after another after that boundary; the objective is at least
the fluid LP bound.  Each cut family has O(L^2) rows of O(L) terms, so beyond a size only
the pairs ``(k, j)`` closest together (and the whole-phase ones) are kept: any subset of
valid cuts leaves the model exact, and the build stays O(L^2).

A unit whose held part a schedule may take off the device (``chain.restorable``) gets one
binary ``h_{i,p}`` per restore point ``p`` (``Offload.restore``: raw and released by
``p - 2``, never with stage ``i + 1`` recomputed), and per forward op ``Fj`` it may miss a
continuous ``v_{i,j} <= released by j - 1``, ``<= sum of h_{i,p} over p > j``, which the
budget rows subtract (they only gain from it, so it takes the product's value).  The
restores' H2D copies have a clock per (unit, point) slot in the order a step issues them
(points first, then stages), issued as ``Fp`` may start (``w_{p-1}``) and, on a host that
pays ``copy_host_s`` per storage, no earlier than the host's clock there (its charge in the
forward's host clock before ``Fp``), and the reader's start ``f_m`` (``>= w_{m-1}``) waits
for the chosen one.

With ``max_run > 0`` the model also chooses recomputation (docs/model.md, "Recomputation"):
one binary ``g_{s,e}`` per run ``s..e`` of at most ``max_run`` stages, and one per in-stage
option of a stage (a run of that stage re-run in part), a stage in at most one run and
never also offloaded or encoded.  A run of one stage whose checkpoint can move may offload
it (docs/model.md, "Offloaded checkpoints"): the checkpoint is another *form* of the
stage's slot, beside its encodings (``x``, ``z``, ``y`` for it, ``x <= g``), so its copies
take the unit's places in the D2H and H2D clocks; its memory terms are the checkpoint's, and
its H2D wait delays the rebuild (that run's and the ones rebuilt after it) rather than
``Bn``'s own start.  A run's memory terms (its units gone from
the boundary after ``F(i+1)`` to its rebuild, its checkpoint meanwhile) are linear in
``g``; each re-run forward op gets a budget row that binds only when its run is chosen
(a big-M row); the rebuild delays ``Bn``'s start after its prefetches are issued.  Where a
run's checkpoint shares storages with the unit before (``recompute.shared_checkpoint_bytes``),
two continuous variables take them off its rows, ``<=`` the run chosen with its checkpoint on
the device and, summed over the runs that start there, ``<=`` that unit kept (raw, for its
held part), as ``v_{i,j}`` do.

A stage that makes weight casts (docs/model.md, "Weight casts") gets a binary ``k_i``: its
casts kept, ``cast_bytes`` in the memory rows of the ops ``Fi`` through ``Bi``,
``recast_s`` less in ``Bi``, never in a recomputed stage.  The backlog bounds behind the
big-M rows count the backward ops at their shortest.

A model may also leave most units *decided* (``Decided``): their choice is a constant,
only the other units are free, and a free unit's prefetch point may be capped; the kept
casts are then a constant too (``casts_kept``).  That is
the sub-MILP of the large-neighbourhood search (``solver.lns``), built from the same rows.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Mapping, Sequence

import numpy as np
import pulp

from offload.step.actions import Choice, Offload, Recompute, first_checkpoint_release
from offload.step.chain import Chain, Encoding
from offload.step.encoding import apply, encoded_bytes
from offload.step.events import prefetch_order
from offload.step.memory import forward_checkpoint, kept_units, op_memory
from offload.step.recompute import (checkpoint_bytes, forward_peak, forward_seconds,
                                    moved_checkpoint_bytes, rerun_checkpoint, rerun_peak, run_op, run_seconds)
from offload.step.simulate import simulate

from .deadline import Deadline
from .pulp_backend import SolveOutcome, run

RAW = ""  # the option "not encoded"
CHECKPOINT = "@"  # a slot's form that moves a recomputed run's checkpoint ("@" + its in-stage option)


def _checkpoint_form(run: Recompute) -> str:
    """The form of ``run``'s first stage's slot that moves its checkpoint."""
    return CHECKPOINT + run.option
CUT_NONZEROS = 400_000  # per cut family, beyond which only the closest (k, j) pairs are kept


@dataclass(frozen=True)
class Decided:
    """A unit whose choice this model does not make: its encoding and, if offloaded, its points."""

    encoding: str = RAW
    offload: Offload | None = None


@dataclass
class IlpResult:
    offloads: list[Offload] | None  # None: no schedule
    encode: dict[int, str]  # stage -> chosen encoding
    recompute: list[Recompute]
    casts_kept: list[int]
    outcome: SolveOutcome
    objective_s: float | None  # the MILP objective, in seconds
    dual_bound_s: float | None
    build_s: float
    variables: int
    constraints: int


class _Affine:
    """A linear form ``const + sum coef * var`` being accumulated (cheaper than PuLP arithmetic)."""

    __slots__ = ("terms", "const")

    def __init__(self, const: float = 0.0) -> None:
        self.terms: dict[pulp.LpVariable, float] = {}
        self.const = const

    def add(self, form: "_Form", coef: float = 1.0) -> "_Affine":
        if isinstance(form, (int, float)):
            self.const += coef * form
        elif isinstance(form, pulp.LpVariable):
            self.terms[form] = self.terms.get(form, 0.0) + coef
        else:
            for var, c in form.terms.items():
                self.terms[var] = self.terms.get(var, 0.0) + coef * c
            self.const += coef * form.const
        return self

    def expression(self) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression([(v, c) for v, c in self.terms.items() if c], self.const)


_Form = _Affine | pulp.LpVariable | float | int


def _value(form: pulp.LpVariable | float) -> float:
    """A variable's value in the solver's incumbent, or a constant."""
    return (form.varValue or 0.0) if isinstance(form, pulp.LpVariable) else float(form)


def _evaluated(form: _Affine) -> float:
    """A linear form's value at its variables' values (the warm start's, or the incumbent's)."""
    return form.const + sum(c * _value(var) for var, c in form.terms.items())


def _affine(*parts: tuple[_Form, float]) -> _Affine:
    out = _Affine()
    for form, coef in parts:
        out.add(form, coef)
    return out


class Model:
    """The MILP of one (chain, budget, allowed encodings, decided units)."""

    def __init__(self, chain: Chain, budget: int, lower_bound_s: float = 0.0,
                 options: Mapping[int, Sequence[Encoding]] | None = None,
                 decided: Mapping[int, Decided] | None = None, prefetch_cap: Mapping[int, int] | None = None,
                 deadline: Deadline | None = None, cut_width: int | None = None, max_run: int = 0,
                 offload: bool = True, casts_kept: Sequence[int] = ()) -> None:
        self.chain, self.deadline = chain, deadline
        self.decided = dict(decided or {})
        if max_run and self.decided:
            raise ValueError("recomputation is modelled in whole models only (no decided units)")
        if casts_kept and not self.decided:
            raise ValueError("kept casts are a constant in decided models only (a whole model chooses them)")
        self.casts_fixed = tuple(sorted(casts_kept))
        L = chain.L
        self.free = [i for i in range(1, L + 1) if i not in self.decided]
        self.U = set(chain.offloadable) if offload else set()  # units that may move
        self.need = {i: int(chain.need[i]) for i in range(1, L + 1)}
        self.cap = {i: min(L, max(self.need[i], (prefetch_cap or {}).get(i, L))) for i in self.free}
        self.tau, self.mu = chain.time_unit_s, chain.memory_unit_bytes
        self.B = budget / self.mu
        self.lp = pulp.LpProblem("offload", pulp.LpMinimize)
        self._rows = 0
        self.run_list = self._candidate_runs(max_run)
        self._options(dict(options or {}))
        self._release_windows()
        self._decisions()
        self._runs()
        self._restores()
        self._casts()
        self._memory_rows()
        self._durations()
        self._forward_times()
        self._backward_times()
        self.cut_width = cut_width if cut_width is not None else self._cut_width(L, CUT_NONZEROS)
        self._forward_cuts()
        self._backward_cuts()
        makespan = _affine((self.s[1], 1.0), (self.bdur[1], 1.0))
        self.makespan = makespan.expression()  # in units of ``tau``
        self.lp.setObjective(self.makespan)
        if lower_bound_s > 0:
            self._row("bound", makespan, ">=", lower_bound_s / self.tau * (1 - 1e-9))

    @property
    def offload_only(self) -> bool:
        """No encoding, recomputation or cast to choose: only which units move and when."""
        return not self.g and not self.k and all(len(o) == 1 for o in self.opts.values())

    # ------------------------------------------------------------------ plumbing
    def _row(self, name: str, lhs: _Affine, sense: str, rhs: float = 0.0) -> None:
        """Add ``lhs sense rhs``; with no variable left, nothing when its constant satisfies it,
        and a row no decision can satisfy when it does not (an op over the budget whatever the
        schedule: the model is infeasible, not free of that row)."""
        if not any(lhs.terms.values()):
            slack = rhs - lhs.const if sense == "<=" else lhs.const - rhs
            if slack >= -1e-9 * max(1.0, abs(rhs)):
                return
            never = self._var(f"unsatisfiable_{name}")
            never.upBound = 0
            lhs = _Affine(1.0).add(never)
            sense, rhs = "<=", 0.0
        op = {"<=": pulp.LpConstraintLE, ">=": pulp.LpConstraintGE}[sense]
        self.lp.addConstraint(pulp.LpConstraint(lhs.expression(), op, rhs=rhs), name)
        self._rows += 1
        if self.deadline is not None and self._rows % 2000 == 0:
            self.deadline.check("building the MILP")

    def _var(self, name: str, binary: bool = False) -> pulp.LpVariable:
        return self.lp.add_variable(name, 0, 1 if binary else None, cat=pulp.LpBinary if binary else pulp.LpContinuous)

    # ------------------------------------------------------------------ options and sizes
    def _options(self, options: dict[int, Sequence[Encoding]]) -> None:
        """Per unit its options (raw first), their sizes and copy durations in model units."""
        chain, L, p = self.chain, self.chain.L, self.chain.platform
        enc = {(i, e.name): e for i, es in options.items() for e in es}
        for i, d in self.decided.items():
            if d.encoding != RAW:
                enc[i, d.encoding] = chain.stage(i).encoding(d.encoding)
        self.enc = enc
        self.opts = {i: [RAW] + [e.name for e in options.get(i, ())] for i in self.free}
        for i, d in self.decided.items():
            self.opts[i] = [d.encoding]
        self.size = {(i, o): (chain.a[i] if o == RAW else encoded_bytes(chain, i, enc[i, o])) / self.mu
                     for i in range(1, L + 1) for o in self.opts[i]}
        self.moving: dict[tuple[int, str], Recompute] = {}  # (stage, form) -> the run whose checkpoint it moves
        self.forms = {i: list(o) for i, o in self.opts.items()}  # what may move in a stage's slot
        for r in self.run_list:
            moved = moved_checkpoint_bytes(chain, r)
            if moved and r.first in self.U:
                form = _checkpoint_form(r)
                self.moving[r.first, form] = r
                self.forms[r.first].append(form)
                self.size[r.first, form] = moved / self.mu
        # a copy's time is its moved bytes' (a unit's raw copy may move less than it frees: ``Stage.moved``)
        copied = {(i, o): float(chain.mv[i]) if o == RAW else self.size[i, o] * self.mu
                  for i in self.U for o in self.forms[i]}
        self.dd = {slot: p.d2h_s(nbytes) / self.tau for slot, nbytes in copied.items()}
        self.hd = {slot: p.h2d_s(nbytes) / self.tau for slot, nbytes in copied.items()}
        # the host's time to issue a slot's copy, either way: per storage
        storages = {(i, o): chain.copied_storages(i, self.moving[i, o].option if (i, o) in self.moving else None)
                    for i in self.U for o in self.forms[i]}
        self.ih = {slot: p.copy_host_s * n / self.tau for slot, n in storages.items()}
        self.copy_host = p.copy_host_s > 0
        # where the host runs the ops (a CPU): what issuing a slot's copy adds to the op that issues it
        self.idv = {slot: p.copy_device_s * n / self.tau for slot, n in storages.items()}
        self.f = self.chain.f / self.tau
        self.b = (self.chain.b - self.chain.rc) / self.tau  # each backward op at its shortest (casts kept)

    def _moves(self, i: int) -> bool:
        """Whether unit ``i`` may be offloaded in this model (free and offloadable, or decided so)."""
        d = self.decided.get(i)
        return i in self.U and (d is None or d.offload is not None)

    def _max_d2h(self, i: int) -> float:
        return max(self.dd[i, o] for o in self.forms[i]) if self._moves(i) else 0.0

    def _max_h2d(self, i: int) -> float:
        return max(self.hd[i, o] for o in self.forms[i]) if self._moves(i) else 0.0

    def _max_issue(self, i: int) -> float:
        return max(self.ih[i, o] for o in self.forms[i]) if self._moves(i) else 0.0

    def _release_windows(self) -> None:
        """``R_i``: the first boundary by which ``Ui``'s copy has surely ended (later releases are
        dominated), and, for free units, the big-M of each earlier release wait, from a bound on
        the D2H backlog."""
        L, f = self.chain.L, self.f
        ends = np.cumsum(np.asarray(f, dtype=float)[1:])  # ends[j - 1]: forward compute through F_j
        self.R: dict[int, int] = {}
        self.M_rel: dict[tuple[int, int], float] = {}
        self.wait_at_L: set[int] = set()  # decided units released at L whose copy may still run then
        backlog = 0.0
        for i in range(1, L + 1):
            backlog = max(0.0, backlog - f[i]) + self._max_d2h(i) + self._max_issue(i)  # issued late: ends late
            if not self._moves(i):
                continue
            # first j > i with ends[j-1] - ends[i-1] >= backlog
            j = int(np.searchsorted(ends, ends[i - 1] + backlog, side="left")) + 1
            self.R[i] = min(L, max(i + 1, j))
            # at L, where every release happens at the latest, the copy may still run: B_L waits
            # for it (the cuts bound that wait only from F_i's device end, which the host may delay)
            last = self.R[i] + 1 if j > L else self.R[i]
            if i not in self.decided:
                for j in range(i + 1, last):
                    self.M_rel[i, j] = backlog - (ends[j - 1] - ends[i - 1])
            elif last > self.R[i]:
                self.wait_at_L.add(i)

    # ------------------------------------------------------------------ decisions
    def _decisions(self) -> None:
        self.c = {(i, o): self._var(f"enc_{i}_{n}", True)
                  for i in self.free for n, o in enumerate(self.opts[i]) if o != RAW}
        for i in self.free:
            if len(self.opts[i]) > 1:
                self._row(f"one_encoding_{i}", _affine(*((self.c[i, o], 1.0) for o in self.opts[i][1:])), "<=", 1)
        movable = [i for i in self.free if i in self.U]
        self.x = {(i, o): self._var(f"offload_{i}_{n}", True) for i in movable for n, o in enumerate(self.forms[i])}
        for (i, o), v in self.x.items():
            if len(self.opts[i]) > 1 and (i, o) not in self.moving:  # a checkpoint's: x <= g (``_runs``)
                self._row(f"offload_needs_choice_{i}_{self.forms[i].index(o)}",
                          _affine((v, 1.0)).add(self.chosen(i, o), -1.0), "<=")
        self.z = {(i, o, j): self._var(f"released_{i}_{self.forms[i].index(o)}_{j}", True)
                  for i in movable for o in self.forms[i] for j in range(self.first_release(i, o), self.R[i])}
        self.y = {(i, o, j): self._var(f"fetched_{i}_{self.forms[i].index(o)}_{j}", True)
                  for i in movable for o in self.forms[i] for j in range(self.need[i] + 1, self.cap[i] + 1)}
        for (i, o, j), v in self.z.items():
            self._row(f"release_monotone_{i}_{self.forms[i].index(o)}_{j}",
                      _affine((v, 1.0)).add(self.released(i, o, j + 1), -1.0), "<=")
        for (i, o, j), v in self.y.items():
            self._row(f"fetch_monotone_{i}_{self.forms[i].index(o)}_{j}",
                      _affine((v, 1.0)).add(self.fetched(i, o, j - 1), -1.0), "<=")

    def _candidate_runs(self, max_run: int) -> list[Recompute]:
        """The runs this model may choose: of at most ``max_run`` stages, and the in-stage options."""
        L = self.chain.L
        if not max_run:
            return []
        runs = [Recompute(s, e) for s in range(1, L) for e in range(s, min(L - 1, s + max_run - 1) + 1)
                if self.chain.can_recompute(s, e)]
        return runs + [Recompute(i, i, name) for i, name in self.chain.optional]

    def _runs(self) -> None:
        """``g_{s,e}``: stages ``s..e`` recomputed as one run; a stage in one run at most, and
        then neither offloaded nor encoded; its checkpoint offloaded only when it runs."""
        L = self.chain.L
        self.g = {r: self._var(f"recompute_{r.first}_{r.last}" + (f"_{r.option}" if r.option else ""), True)
                  for r in self.run_list}
        for (i, o), r in self.moving.items():
            if (i, o) in self.x:
                self._row(f"checkpoint_needs_run_{i}_{self.forms[i].index(o)}",
                          _affine((self.x[i, o], 1.0), (self.g[r], -1.0)), "<=")
        self.run_at: dict[int, list[Recompute]] = {}  # n -> runs rebuilt at the start of B_n
        a = self.chain.a
        self.unbuilt: dict[Recompute, float] = {}  # run -> its checkpoint less its units (model units)
        for r in self.g:
            self.run_at.setdefault(run_op(self.chain, r), []).append(r)
            self.unbuilt[r] = (checkpoint_bytes(self.chain, r) - int(sum(a[r.first:r.last + 1]))) / self.mu
        for i in range(1, L):
            row = self.recomputed(i)
            if not row.terms:
                continue
            for o in self.opts[i]:  # offloaded encoded implies encoded: counted once
                if o != RAW:
                    row.add(self.c[i, o])
                elif (i, o) in self.x:
                    row.add(self.x[i, o])
            self._row(f"one_fate_{i}", row, "<=", 1)
        # run -> 1 where its checkpoint shares storages with the unit before: kept, and with its held part
        self.shared: dict[Recompute, tuple[pulp.LpVariable, pulp.LpVariable | None]] = {}
        for r, g in self.g.items():
            s = r.first
            if not self.chain.xp[s]:
                continue
            kept = self._var(f"shared_{g.name}")
            held = self._var(f"shared_held_{g.name}") if self.chain.xph[s] else None
            form = (s, _checkpoint_form(r))
            for v in [v for v in (kept, held) if v is not None]:  # the run chosen, its checkpoint not moved
                on_device = _affine((v, 1.0), (g, -1.0))
                if self.moving.get(form) == r and form in self.x:
                    on_device.add(self.x[form])
                self._row(f"shared_needs_run_{v.name}", on_device, "<=")
            self.shared[r] = (kept, held)
        # the unit before kept (raw, for its held part), summed over the runs that start after it:
        # one of them at most is chosen, and the sum keeps the relaxation from counting it for each
        for s in sorted({r.first for r in self.shared}):
            mine = [v for r, v in self.shared.items() if r.first == s]
            self._row(f"shared_needs_kept_{s}", _affine(*((k, 1.0) for k, _ in mine)).add(self.handled(s - 1)), "<=", 1)
            if mine[0][1] is not None:  # any fate of the unit before but an encoding
                self._row(f"shared_needs_raw_{s}", _affine(*((h, 1.0) for _, h in mine)).add(self.chosen(s - 1, RAW), -1.0),
                          "<=")

    def _restores(self) -> None:
        """``h_{i,p}`` (a constant for a decided unit) and ``v_{i,j}`` (module docstring)."""
        chain = self.chain
        self.h: dict[tuple[int, int], _Form] = {}
        self.gone: dict[tuple[int, int], pulp.LpVariable] = {}
        for i in chain.restorable:
            d = self.decided.get(i)
            if d is not None:
                if d.offload is not None and d.offload.restore:
                    self.h[i, d.offload.restore] = 1.0
                continue
            if i not in self.U:
                continue
            reader = int(chain.held_read[i])
            points = range(i + 3, reader + 1)
            for p in points:
                v = self.h[i, p] = self._var(f"restore_{i}_{p}", True)
                self._row(f"restore_after_release_{i}_{p}", _affine((v, 1.0)).add(self.released(i, RAW, p - 2), -1.0),
                          "<=")
            if not points:
                continue
            self._row(f"one_restore_{i}", _affine(*((self.h[i, p], 1.0) for p in points)).add(self.recomputed(i + 1)),
                      "<=", 1)
            for j in range(i + 2, min(reader, int(chain.held_until[i]) + 1)):
                v = self.gone[i, j] = self._var(f"held_gone_{i}_{j}")
                self._row(f"gone_after_release_{i}_{j}", _affine((v, 1.0)).add(self.released(i, RAW, j - 1), -1.0), "<=")
                self._row(f"gone_until_restore_{i}_{j}", _affine((v, 1.0), *((self.h[i, p], -1.0) for p in points if p > j)),
                          "<=")

    def _casts(self) -> None:
        """``k_i``: stage ``i``'s weight casts kept (whole models only), never in a recomputed run."""
        self.k = {i: self._var(f"casts_kept_{i}", True) for i in self.chain.castable} if not self.decided else {}
        for i, v in self.k.items():
            row = self.recomputed(i)
            if row.terms:
                self._row(f"casts_or_recompute_{i}", row.add(v), "<=", 1)

    def casts(self, through: int) -> _Affine:
        """The bytes (model units) of the casts the model may keep among stages ``1..through``."""
        return _affine(*((v, self.chain.cb[i] / self.mu) for i, v in self.k.items() if i <= through))

    def recomputed(self, i: int) -> _Affine:
        """1 if stage ``i`` is in a recomputed run."""
        return _affine(*((v, 1.0) for r, v in self.g.items() if r.first <= i <= r.last))

    def handled(self, i: int) -> _Affine:
        """1 if unit ``i``'s saved tensors pass to the executor: rebuilt, encoded or offloaded
        (one fate at most, ``_runs``; offloaded encoded is encoded)."""
        out = self.recomputed(i)
        for o in self.opts[i]:
            out.add(self.chosen(i, o) if o != RAW else self.offloaded(i, RAW))
        return out

    def handling(self, i: int) -> _Affine:
        """The host's time, each way, that handling unit ``i``'s saved tensors adds (model units)."""
        return _Affine().add(self.handled(i), self.chain.handle_host_s(i) / self.tau)

    def forward_host(self, j: int) -> _Affine:
        """The host's time to issue ``Fj`` (model units): recording it for a re-run costs more,
        and so does handing its unit's saved tensors to the executor."""
        out = _Affine(float(self.chain.fh[j]) / self.tau)
        if self.chain.rech[j]:
            out.add(self.recomputed(j), float(self.chain.rech[j]) / self.tau)
        if self.chain.handle_host_s(j):
            out.add(self.handling(j))
        return out

    def chosen(self, i: int, o: str) -> _Form:
        """1 if unit ``i`` is stored with option ``o``."""
        if i in self.decided:
            return 1.0
        if o != RAW:
            return self.c[i, o]
        if len(self.opts[i]) == 1:
            return 1.0
        return _affine((1.0, 1.0), *((self.c[i, e], -1.0) for e in self.opts[i][1:]))

    def offloaded(self, i: int, o: str) -> _Form:
        if i in self.decided:
            return float(self._moves(i))
        return self.x.get((i, o), 0.0)

    def checkpoint_forms(self, i: int) -> list[str]:
        """The forms of stage ``i``'s slot that move a recomputed run's checkpoint."""
        return self.forms[i][len(self.opts[i]):]

    def first_release(self, i: int, o: str) -> int:
        """The earliest release point of what moves in stage ``i``'s slot in form ``o``."""
        run = self.moving.get((i, o))
        return i + 1 if run is None else first_checkpoint_release(self.chain, run)

    def released(self, i: int, o: str, j: int) -> _Form:
        """1 if ``Ui`` (option ``o``: an encoding, or a checkpoint's form) is released at or
        before boundary ``j``."""
        if j <= i or not self._moves(i) or j < self.first_release(i, o):
            return 0.0
        d = self.decided.get(i)
        if d is not None:
            return float(j >= min(d.offload.release, self.R[i]))
        return self.x[i, o] if j >= self.R[i] else self.z[i, o, j]

    def fetched(self, i: int, o: str, j: int) -> _Form:
        """1 if an offloaded ``Ui`` is resident during ``Bj`` (always from ``B(need_i)`` down)."""
        if not self._moves(i) or j > self.chain.L:
            return 0.0
        d = self.decided.get(i)
        if d is not None:
            return float(j <= d.offload.prefetch)
        if j <= self.need[i]:
            return self.x[i, o]
        return self.y[i, o, j] if j <= self.cap[i] else 0.0

    def _extra(self, i: int, held: Callable[[Encoding], int]) -> _Affine:
        """Bytes an encoding adds in its raw windows (``offload.step.encoding``), for a free
        unit: ``held(encoding)`` at the op the row is for."""
        out = _Affine()
        if i not in self.decided:
            for o in self.opts[i][1:]:
                out.add(self.c[i, o], held(self.enc[i, o]) / self.mu)
        return out

    # ------------------------------------------------------------------ memory
    def _constant_memory(self) -> np.ndarray:
        """Per op, what decided units and transients hold (model units): the free units' share is zero."""
        chain = apply(self.chain, {i: d.encoding for i, d in self.decided.items() if d.encoding != RAW})
        free = set(self.free)
        bare = replace(chain, stages=tuple(replace(s, saved_bytes=0) if i in free else s
                                           for i, s in enumerate(chain.stages, start=1)))
        offloads = [replace(d.offload, release=min(d.offload.release, self.R.get(i, d.offload.release)))
                    for i, d in self.decided.items() if d.offload is not None]
        return op_memory(bare, offloads, casts_kept=self.casts_fixed) / self.mu

    def _memory_rows(self) -> None:
        """One row per op; ops whose free part is the same share one row (the largest constant)."""
        L, need = self.chain.L, self.need
        const = self._constant_memory()
        rows: dict[tuple, tuple[float, _Affine, str]] = {}
        a, mu = self.chain.a, self.mu
        checkpoint = partial(forward_checkpoint, self.chain)
        self.bwd_rows: dict[int, _Affine] = {}  # B_j's variable part, for the re-run ops' rows
        for o in range(2 * L):
            row = _Affine()
            if o < L:  # F_j
                j = o + 1
                for i in self.free:
                    if i >= j:
                        break
                    held = self.chain.held[i] / self.mu if j <= self.chain.held_until[i] else 0.0
                    for opt in self.opts[i]:
                        row.add(self.chosen(i, opt), self.size[i, opt])
                        row.add(self.released(i, opt, j - 1), -max(0.0, self.size[i, opt] - held))
                    for opt in self.checkpoint_forms(i):  # an offloaded checkpoint, once released
                        row.add(self.released(i, opt, j - 1), -self.size[i, opt])
                    if (i, j) in self.gone:  # its held part off the device
                        row.add(self.gone[i, j], -self.chain.held[i] / self.mu)
                if j not in self.decided:
                    row.add(self._extra(j, lambda e: e.fwd_extra_bytes))
                if j > 1 and j - 1 not in self.decided:
                    row.add(self._extra(j - 1, lambda e: e.next_extra_bytes))
                row.add(self.casts(j))
                for r, g in self.g.items():
                    s, e = r.first, r.last
                    if s < j:  # the checkpoint, from F_{s+1} (during F_s the stage's own memory counts it)
                        row.add(g, checkpoint(r, j) / mu)
                        self._shared(row, r, j)
                    if s <= j <= e:  # autograd keeps none of U_j
                        row.add(g, (forward_peak(self.chain, r, j) - int(self.chain.fp[j])) / mu)
                    for i in range(s, min(e, j - 1) + 1):  # its carried part through F_{i+1}, held part after
                        if i == j - 1:
                            kept = self.chain.carry[i]
                        else:
                            kept = self.chain.held[i] if j <= self.chain.held_until[i] else 0
                        row.add(g, -max(0, int(a[i]) - int(kept)) / mu)
                name = f"memory_F{j}"
            else:  # B_j
                j = 2 * L - o
                decoding = _Affine()  # the decoders' raw windows: B_j's transient, not its re-run ops'
                for i in self.free:
                    if i > j:
                        break
                    for opt in self.forms[i]:
                        if opt in self.opts[i]:
                            row.add(self.chosen(i, opt), self.size[i, opt])
                        if self._moves(i) and j > need[i]:  # a unit, or a checkpoint not rebuilt yet
                            row.add(self.offloaded(i, opt), -self.size[i, opt])
                            row.add(self.fetched(i, opt, j), self.size[i, opt])
                    if j <= need[i]:
                        decoding.add(self._extra(i, lambda e, after=j - i: e.bwd_extra(after)))
                row.add(self.casts(j))
                for n, at_n in self.run_at.items():
                    for span in at_n:
                        if n < j:  # not rebuilt yet: the checkpoint instead of the units
                            row.add(self.g[span], self.unbuilt[span])
                            self._shared(row, span)
                        elif span.first <= j:  # rebuilt: what it keeps live of its units not consumed yet
                            row.add(self.g[span], -self._unkept(span, j))
                self.bwd_rows[j] = _Affine().add(row)  # a copy: the row's constant changes below
                row.add(decoding)
                name = f"memory_B{j}"
            key = tuple(sorted((v.name, round(c, 12)) for v, c in row.terms.items() if c))
            total = row.const + float(const[o])
            if key not in rows or total > rows[key][0]:
                rows[key] = (total, row, name)
        for total, row, name in rows.values():
            row.const = total
            self._row(name, row, "<=", self.B)
        self._rebuild_rows()

    def _shared(self, row: _Affine, run: Recompute, j: int = 0) -> None:
        """Take off ``row`` (``Fj``'s, else a backward op's) what ``run``'s checkpoint shares
        with the unit before it (``recompute.shared_checkpoint_bytes``): ``shared <=`` the run
        chosen with its checkpoint on the device and ``<=`` the unit kept (raw, for its held
        part); the rows only gain from them, so they take the products' values."""
        if run not in self.shared:
            return
        s = run.first
        kept, held = self.shared[run]
        both, part = float(self.chain.xp[s]), float(self.chain.xph[s])
        if held is not None and j and j <= self.chain.held_until[s - 1]:  # the held part counts it whatever the fate
            row.add(held, -part / self.mu)
            both -= part
        row.add(kept, -both / self.mu)

    def _unkept(self, run: Recompute, j: int) -> float:
        """What ``run``'s rebuild does not keep live of its units ``i <= j`` (model units)."""
        a, rb = self.chain.a, self.chain.rb
        return sum(int(a[i]) - int(rb[i]) for i in run.stages if i <= j) / self.mu

    def _rebuild_rows(self) -> None:
        """Each re-run forward op ``Rj`` of a run ``s..e`` rebuilt at ``Bn`` holds ``Bn``'s
        units less those not rebuilt yet (``j..e``, and the runs at ``n`` that come after),
        plus ``Fj``'s transient: a budget row that binds only when the run is chosen."""
        rb, bs, mu = self.chain.rb, self.chain.bs, self.mu
        for n, at_n in self.run_at.items():
            for rerun in at_n:
                s, e, g = rerun.first, rerun.last, self.g[rerun]
                later = _Affine()
                for span in at_n:
                    if span.first < s:  # rebuilt after this run: its checkpoint, not what B_n keeps of its units
                        later.add(self.g[span], self.unbuilt[span] + self._unkept(span, n))
                        self._shared(later, span)
                for j in range(s, e + 1):
                    row = _Affine().add(self.bwd_rows[n]).add(later)
                    if j == s:  # R_s reads the checkpoint
                        self._shared(row, rerun)
                    row.const += (rerun_peak(self.chain, rerun, j) - int(sum(rb[j:e + 1])) + rerun_checkpoint(self.chain, rerun, j)
                                  + int(bs[n])) / mu
                    big = sum(c for c in row.terms.values() if c > 0) + row.const - self.B
                    if big <= 0:
                        continue
                    row.add(g, big)  # lhs <= B + big (1 - g)
                    self._row(f"memory_R{j}_{g.name}", row, "<=", self.B + big)

    # ------------------------------------------------------------------ times
    def _durations(self) -> None:
        """Op durations (model units): encoders run at the end of ``Fi``, decoders in ``B(need_i)``;
        a recomputed stage's ``Fi`` and ``Bi`` take its recorded times (``recompute``), and one
        re-run in part records what its option keeps during ``Fi``; where the host runs the ops
        (a CPU), a handled unit's ``Fi`` and ``Bi`` take its saved tensors' handling longer, and an
        op that issues copies their issue (``simulate.op_seconds``)."""
        L = self.chain.L
        self.fdur: list[_Affine] = [_Affine()]
        self.bdur: list[_Affine] = [_Affine()]
        for j in range(1, L + 1):
            fd = _Affine(self.f[j])
            bd = _Affine(self.chain.b[j] / self.tau)
            for r in (r for r in self.g if r.first <= j <= r.last):
                more_f = forward_seconds(self.chain, r, j) - self.chain.f[j]
                more_b = self.chain.br[j] - self.chain.b[j]
                if more_f:
                    fd.add(self.g[r], more_f / self.tau)
                if more_b:
                    bd.add(self.g[r], more_b / self.tau)
            if self.chain.handle_device_s(j):
                fd.add(self.handled(j), self.chain.handle_device_s(j) / self.tau)
                bd.add(self.handled(j), self.chain.handle_device_s(j) / self.tau)
            d = self.decided.get(j)
            if d is not None and d.encoding != RAW:
                fd.add(self.enc[j, d.encoding].encode_s / self.tau)
            elif d is None:
                for o in self.opts[j][1:]:
                    fd.add(self.c[j, o], self.enc[j, o].encode_s / self.tau)
            self.fdur.append(fd)
            if j in self.casts_fixed or j in self.k:
                bd.add(self.k.get(j, 1.0), -self.chain.rc[j] / self.tau)
            self.bdur.append(bd)
        if self.chain.platform.copy_device_s:  # the copies' issue, where the host runs the ops: in the ops
            for j in range(1, L + 1):
                self.fdur[j].add(self.restore_issue(j, device=True))
                if self._moves(j):
                    self.fdur[j].add(self.moved_issue(j, device=True))
            for k, members in self._slots().items():
                for i in members:
                    for o, m in self._prefetched_at(i, k).items():
                        self.bdur[k].add(m, self.idv[i, o])
        for i in range(1, L + 1):
            d = self.decided.get(i)
            if d is not None and d.encoding != RAW:
                self.bdur[self.need[i]].add(self.enc[i, d.encoding].decode_s / self.tau)
            elif d is None:
                for o in self.opts[i][1:]:
                    self.bdur[self.need[i]].add(self.c[i, o], self.enc[i, o].decode_s / self.tau)

    def moved_d2h(self, i: int) -> _Affine:
        """Duration of the D2H copy in stage ``i``'s slot (0 when nothing moves)."""
        out = _Affine()
        for o in self.forms[i]:
            out.add(self.offloaded(i, o), self.dd[i, o])
        return out

    def restore_issue(self, j: int, upto: int | None = None, device: bool = False) -> _Affine:
        """The host's time to issue the restores before ``Fj`` (model units; 0 when none is
        chosen), in stage order, through unit ``upto`` (``None``: all of them); ``device``: what
        issuing them adds to ``Fj`` where the host runs the ops."""
        out = _Affine()
        for i, p in self.h:
            if p == j and (upto is None or i <= upto):
                seconds = self.chain.restore_device_s(i) if device else self.chain.restore_host_s(i)
                out.add(self.h[i, p], seconds / self.tau)
        return out

    def moved_issue(self, i: int, device: bool = False) -> _Affine:
        """The host's time to issue the copy in stage ``i``'s slot, one way (0 when nothing moves);
        ``device``: what issuing it adds to the op that issues it where the host runs the ops."""
        out = _Affine()
        for o in self.forms[i]:
            out.add(self.offloaded(i, o), (self.idv if device else self.ih)[i, o])
        return out

    def _forward_times(self) -> None:
        L = self.chain.L
        self.w: list[_Form] = [0.0] + [self._var(f"w{j}") for j in range(1, L + 1)]
        readers = {int(self.chain.held_read[i]) for i, _ in self.h}
        # f_j: the start of F_j, after the waits for the held parts it reads (w_{j-1} where it has none)
        self.fstart: list[_Form] = [0.0] + [self._var(f"f{j}") if j in readers else self.w[j - 1]
                                            for j in range(1, L + 1)]
        self.d: dict[int, pulp.LpVariable] = {}
        self.restore_issued: dict[tuple[int, int], _Affine] = {}  # (unit, point) -> the host's clock as it issues it
        prev = None
        issued = _Affine()  # when the host has issued F_j: F_j ends no earlier
        for j in range(1, L + 1):
            for i, p in self.h:  # each restore before F_j, issued after those of earlier stages
                if p == j:
                    self.restore_issued[i, p] = _Affine().add(issued).add(self.restore_issue(j, upto=i))
            issued.add(self.restore_issue(j))
            issued.add(self.forward_host(j))
            if j in readers:
                self._row(f"after_releases_{j}", _affine((self.fstart[j], 1.0), (self.w[j - 1], -1.0)), ">=")
            end_f = _affine((self.fstart[j], 1.0), (self.fdur[j], 1.0))
            self._row(f"forward_{j}", _affine((self.w[j], 1.0)).add(end_f, -1.0), ">=")
            host = issued.const > 0 or issued.terms
            if host:
                self._row(f"forward_host_{j}", _affine((self.w[j], 1.0)).add(issued, -1.0), ">=")
            if not self._moves(j):
                continue
            v = self.d[j] = self._var(f"d{j}")
            self._row(f"d2h_after_F{j}", _affine((v, 1.0)).add(end_f, -1.0).add(self.moved_d2h(j), -1.0), ">=")
            if self.copy_host:  # issued after F_j, before F_(j+1): the copy starts no earlier
                issued.add(self.moved_issue(j))
                host = True
            if host:
                self._row(f"d2h_host_{j}", _affine((v, 1.0)).add(self.moved_d2h(j), -1.0).add(issued, -1.0), ">=")
            if prev is not None:
                self._row(f"d2h_fifo_{j}", _affine((v, 1.0), (self.d[prev], -1.0)).add(self.moved_d2h(j), -1.0), ">=")
            prev = j
        for i, d in self.decided.items():  # a decided release before R_i (or at L, see above) waits for its copy
            if d.offload is not None and (d.offload.release < self.R[i] or i in self.wait_at_L):
                j = min(d.offload.release, self.R[i])
                self._row(f"release_wait_{i}_{j}", _affine((self.w[j], 1.0), (self.d[i], -1.0)), ">=")
        for (i, j), M in self.M_rel.items():  # release waits that can bind
            # w_j >= d_i - M (1 - released_by_j)
            row = _affine((self.w[j], 1.0), (self.d[i], -1.0), (M, 1.0))
            for o in self.forms[i]:
                row.add(self.released(i, o, j), -M)
            self._row(f"release_wait_{i}_{j}", row, ">=")
        self._restore_times()

    def _restore_times(self) -> None:
        """The restores' H2D clocks, one per (unit, point) slot in issue order, and the readers' waits."""
        self.rclock: dict[tuple[int, int], pulp.LpVariable] = {}
        clock, backlog = None, 0.0
        for i, p in sorted(self.h, key=lambda key: (key[1], key[0])):
            v = self.rclock[i, p] = self._var(f"r{i}_{p}")
            dur = self.chain.platform.h2d_s(float(self.chain.held[i])) / self.tau
            backlog += dur
            chosen = self.h[i, p]
            self._row(f"restore_issue_{i}_{p}", _affine((v, 1.0), (self.w[p - 1], -1.0), (chosen, -dur)), ">=")
            host = self.restore_issued[i, p]
            if host.const > 0 or host.terms:  # no earlier than the host issued it
                self._row(f"restore_host_{i}_{p}", _affine((v, 1.0), (chosen, -dur)).add(host, -1.0), ">=")
            if clock is not None:
                self._row(f"restore_fifo_{i}_{p}", _affine((v, 1.0), (clock, -1.0), (chosen, -dur)), ">=")
            clock = v
            # f_m >= clock - M (1 - h): issued no later than w_{m-1} (or by a host at most the copies issued
            # since F_(p-1) ahead of it), a clock is at most the copies so far past it
            m = int(self.chain.held_read[i])
            restores = self.restore_issue(p)  # the most: every restore at p chosen
            M = backlog + (self._max_issue(p - 1) if self.copy_host else 0.0) + restores.const + sum(restores.terms.values())
            self._row(f"restore_wait_{i}_{p}", _affine((self.fstart[m], 1.0), (v, -1.0), (M, 1.0), (chosen, -M)), ">=")

    def _backward_times(self) -> None:
        L, need = self.chain.L, self.need
        self.s: list = [None] + [self._var(f"s{j}") for j in range(1, L + 1)]
        self.issue: list = [None] + [_affine((self.s[k + 1], 1.0), (self.bdur[k + 1], 1.0)) for k in range(1, L)]
        self.issue.append(_affine((self.w[L], 1.0)))
        self.groups: list[tuple[int, list[int]]] = []
        self.clock: dict[tuple[int, int], pulp.LpVariable] = {}
        h2d_total = sum(self._max_h2d(i) + self._max_issue(i) for i in range(1, L + 1))
        slots = self._slots()
        span, clock = 0.0, None  # span: bound on (H2D clock - issue time) within the current group
        bh, rh = self.chain.bh, self.chain.rh
        host = _Affine()  # when the host has issued B_k: B_k ends no earlier
        for j in range(1, L + 1):
            host.add(self.restore_issue(j))
            host.add(self.forward_host(j))
            if self.copy_host and self._moves(j):
                host.add(self.moved_issue(j))
        # k -> when the host starts issuing the prefetches at k (copy_host), and the form of its value
        self.fetch_host: dict[int, tuple[pulp.LpVariable, _Affine]] = {}
        for k in range(L, 0, -1):
            start = _affine((self.s[k], 1.0)).add(self.issue[k], -1.0)
            if self.copy_host and slots.get(k):
                v = self._var(f"hb{k}")
                self.fetch_host[k] = (v, _Affine().add(host))
                self._row(f"h2d_host_{k}", _affine((v, 1.0)).add(host, -1.0), ">=")
                for i in slots[k]:
                    for o, m in self._prefetched_at(i, k).items():
                        host.add(m, self.ih[i, o])
            host.add(float(bh[k]) / self.tau)
            if self.chain.handle_host_s(k):
                host.add(self.handling(k))
            for r in self.run_at.get(k, ()):  # rebuilt after the prefetches are issued
                start.add(self.g[r], -run_seconds(self.chain, r) / self.tau)
                host.add(self.g[r], float(rh[r.first:r.last + 1].sum()) / self.tau)
            self._row(f"backward_{k}", start, ">=")
            if host.const > 0 or host.terms:
                self._row(f"backward_host_{k}", _affine((self.s[k], 1.0), (self.bdur[k], 1.0)).add(host, -1.0), ">=")
            if k < L:
                span = max(0.0, span - self.b[k + 1])
            members = slots.get(k)
            if not members:
                continue
            self.groups.append((k, members))
            # issued late (copy_host), a copy ends late as if it took longer
            span = min(h2d_total, span + sum(self._max_h2d(i) + self._max_issue(i) for i in members))
            issued = _affine((self.fetch_host[k][0], 1.0)) if k in self.fetch_host else None  # host clock through member n
            for n, i in enumerate(members):
                v = self.clock[i, k] = self._var(f"c{i}_{k}")
                moved = self._prefetched_at(i, k)
                dur = _Affine()
                for o, m in moved.items():
                    dur.add(m, self.hd[i, o])
                if n == 0:
                    self._row(f"h2d_issue_{i}_{k}", _affine((v, 1.0)).add(self.issue[k], -1.0).add(dur, -1.0), ">=")
                if issued is not None:
                    for o, m in moved.items():
                        issued.add(m, self.ih[i, o])
                    self._row(f"h2d_issued_{i}_{k}", _affine((v, 1.0)).add(issued, -1.0).add(dur, -1.0), ">=")
                if clock is not None:
                    self._row(f"h2d_fifo_{i}_{k}", _affine((v, 1.0), (clock, -1.0)).add(dur, -1.0), ">=")
                clock = v
                M = span - sum(self.b[m] for m in range(need[i] + 1, k + 1))
                if M <= 0:
                    continue
                # s_need >= clock - M (1 - prefetched at k)
                row = _affine((self.s[need[i]], 1.0), (v, -1.0), (M, 1.0))
                for o in self.opts[i]:
                    row.add(moved[o], -M)
                self._row(f"h2d_wait_{i}_{k}", row, ">=")
                for o in self.checkpoint_forms(i):
                    # the rebuild waits: s_need >= clock + (this run's and later rebuilds) - M (1 - prefetched at k)
                    run = self.moving[i, o]
                    row = _affine((self.s[need[i]], 1.0), (v, -1.0), (M, 1.0), (moved[o], -M))
                    for r in self.run_at[need[i]]:
                        if r.first <= run.first:
                            row.add(self.g[r], -run_seconds(self.chain, r) / self.tau)
                    self._row(f"rebuild_wait_{i}_{self.forms[i].index(o)}_{k}", row, ">=")

    def _slots(self) -> dict[int, list[int]]:
        """Per prefetch point ``k``, the units that can be prefetched there in this model (each
        gets an H2D clock at ``k``), in the H2D order of a step (``offload.step.events.prefetch_key``)."""
        slots: dict[int, list[int]] = {}
        for i in prefetch_order(self.chain, self.U):
            if not self._moves(i):
                continue
            d = self.decided.get(i)
            points = [d.offload.prefetch] if d is not None else range(self.need[i], self.cap[i] + 1)
            for k in points:
                slots.setdefault(k, []).append(i)
        return slots

    def _prefetched_at(self, i: int, k: int) -> dict[str, _Form]:
        """Per form of stage ``i``'s slot, 1 if its prefetch point is exactly ``k``."""
        return {o: _affine((self.fetched(i, o, k), 1.0), (self.fetched(i, o, k + 1), -1.0)) for o in self.forms[i]}

    # ------------------------------------------------------------------ cuts
    @staticmethod
    def _cut_width(L: int, budget: int) -> int:
        """The largest ``j - k`` kept so that a family's terms (about ``L w^2 / 2``) stay within ``budget``."""
        return L if L ** 3 <= 6 * budget else max(2, int(math.sqrt(2 * budget / L)))

    def _free_between(self) -> np.ndarray:
        """``n[m]``: free movable units with index below ``m`` (a cut with none of them is implied)."""
        marks = np.zeros(self.chain.L + 2, dtype=np.int64)
        for i in self.free:
            if self._moves(i):
                marks[i + 1] += 1
        return np.cumsum(marks)

    def _cut_pairs(self) -> list[tuple[int, int]]:
        """``(lo, hi)`` stage ranges of the cuts: close pairs, and the whole phase in a full model."""
        L, width = self.chain.L, self.cut_width
        pairs = {(k, j) for k in range(1, L + 1) for j in range(k, min(L, k + width) + 1)}
        if not self.decided:
            pairs |= {(1, j) for j in range(1, L + 1)} | {(j, L) for j in range(1, L + 1)}
        return sorted(pairs)

    def _forward_cuts(self) -> None:
        """The D2H copies of units ``k..j-1`` released by ``j`` ran one after another after ``Fk`` ended."""
        n = self._free_between()
        for k, last in self._cut_pairs():
            j = last + 1
            if j > self.chain.L or n[j] - n[k] == 0:
                continue
            row = _affine((self.w[j], 1.0), (self.w[k - 1], -1.0)).add(self.fdur[k], -1.0)
            for i in range(k, j):
                if self._moves(i):
                    for o in self.forms[i]:
                        row.add(self.released(i, o, j), -self.dd[i, o])
            self._row(f"cut_d2h_{k}_{j}", row, ">=")

    def _backward_cuts(self) -> None:
        """The H2D copies of units needed by ``Bj`` and fetched at or after boundary ``k`` ran one
        after another after that boundary."""
        by_need: dict[int, list[int]] = {}
        for i in sorted(self.U):
            if self._moves(i):
                by_need.setdefault(self.need[i], []).append(i)
        for j, k in self._cut_pairs():
            units = [i for n in range(j, k + 1) for i in by_need.get(n, ())]
            if all(i in self.decided for i in units):
                continue
            row = _affine((self.s[j], 1.0)).add(self.issue[k], -1.0)
            for i in units:
                for o in self.forms[i]:
                    row.add(self.offloaded(i, o), -self.hd[i, o])
                    row.add(self.fetched(i, o, k + 1), self.hd[i, o])
            self._row(f"cut_h2d_{j}_{k}", row, ">=")

    # ------------------------------------------------------------------ warm start
    def load(self, offloads: Sequence[Offload], encode: Choice | None = None,
             runs: Sequence[Recompute] = (), casts_kept: Sequence[int] = ()) -> float:
        """Set every variable to the least solution for ``offloads``, ``encode``, the
        recomputed ``runs`` and the kept casts (decided units as decided); returns its
        makespan (s)."""
        encode = dict(encode or {})
        chosen_runs = {r.kept_on_device() for r in runs}
        if not chosen_runs <= set(self.g):
            raise ValueError(f"runs {sorted(chosen_runs - set(self.g))} are not in this model")
        stuck = [r for r in runs if r.moves and (r.first, _checkpoint_form(r)) not in self.x]
        if stuck:
            raise ValueError(f"runs {stuck} offload checkpoints, which this model does not")
        for key, v in self.g.items():
            v.setInitialValue(1 if key in chosen_runs else 0)
        kept = self.casts_fixed if self.decided else tuple(casts_kept)
        for i, v in self.k.items():
            v.setInitialValue(1 if i in kept else 0)
        L, tau = self.chain.L, self.tau
        offloads = [replace(o, release=min(o.release, self.R.get(o.stage, o.release))) for o in offloads]
        runs = [replace(r, release=min(r.release, max(self.R[r.first], self.first_release(r.first, _checkpoint_form(r)))))
                if r.moves else r for r in runs]
        by = {o.stage: o for o in offloads}  # per slot what moves in it: (release, prefetch) and its form
        by.update({r.first: Offload(r.first, r.release, r.prefetch) for r in runs if r.moves})
        form = {r.first: _checkpoint_form(r) for r in runs if r.moves}
        for (i, o), v in self.c.items():
            v.setInitialValue(1 if encode.get(i) == o else 0)
        stay = kept_units(self.chain, offloads, runs) - set(encode)
        for r, (whole, part) in self.shared.items():
            chosen = next((c for c in runs if c.kept_on_device() == r), None)
            on = chosen is not None and not chosen.moves
            whole.setInitialValue(1 if on and r.first - 1 in stay else 0)
            if part is not None:
                part.setInitialValue(1 if on and r.first - 1 not in encode else 0)

        def mine(i: int, o: str) -> bool:
            return i in by and form.get(i, encode.get(i, RAW)) == o

        for (i, o), v in self.x.items():
            v.setInitialValue(1 if mine(i, o) else 0)
        for (i, o, j), v in self.z.items():
            v.setInitialValue(1 if mine(i, o) and by[i].release <= j else 0)
        for (i, o, j), v in self.y.items():
            v.setInitialValue(1 if mine(i, o) and by[i].prefetch >= j else 0)
        back = {o.stage: o for o in offloads if o.restore}  # what restores its held part
        for (i, p), v in self.h.items():
            if isinstance(v, pulp.LpVariable):
                v.setInitialValue(1 if i in back and back[i].restore == p else 0)
        for (i, j), v in self.gone.items():
            v.setInitialValue(1 if i in back and back[i].release < j < back[i].restore else 0)
        sim = simulate(self.chain, offloads, encode=encode, recompute=runs, casts_kept=kept)
        d2h_done = {c.stage: c.end for c in sim.copies if c.direction == "D2H"}
        for j in range(1, L):  # w_j: F_{j+1} may start (its releases waited for); f_{j+1}: it starts
            waits = [d2h_done[i] for i, o in by.items() if o.release == j and i in d2h_done]
            self.w[j].setInitialValue(max([sim.end[j - 1]] + waits) / tau)
        for j in range(1, L + 1):
            if isinstance(self.fstart[j], pulp.LpVariable):
                self.fstart[j].setInitialValue(sim.start[j - 1] / tau)
        restore_end = {c.stage: c.end / tau for c in sim.copies if c.held}
        clock = None
        for i, p in sorted(self.rclock, key=lambda key: (key[1], key[0])):
            base = max(_value(self.w[p - 1]), _evaluated(self.restore_issued[i, p]), *([] if clock is None else [clock]))
            clock = restore_end[i] if i in back and back[i].restore == p else base
            self.rclock[i, p].setInitialValue(clock)
        last_release = max([sim.end[L - 1]] + [c.end for c in sim.copies if c.direction == "D2H"
                                                and by[c.stage].release == L])
        self.w[L].setInitialValue(last_release / tau)
        clock = 0.0
        for i, v in self.d.items():  # a copy's clock ends with it (issued when the host got to it)
            clock = d2h_done[i] / tau if i in d2h_done else max(clock, sim.end[i - 1] / tau)
            v.setInitialValue(clock)
        for v, form in self.fetch_host.values():
            v.setInitialValue(_evaluated(form))
        for j in range(1, L + 1):  # s_j ends B_j at its end, a wait for the host included
            self.s[j].setInitialValue((sim.start[2 * L - j] + sim.host_wait[2 * L - j]) / tau)
        h2d_end = {c.stage: c.end / tau for c in sim.copies if c.direction == "H2D"}
        clock = None
        for k, members in self.groups:
            issue = (last_release if k == L else sim.end[2 * L - k - 1]) / tau
            for n, i in enumerate(members):
                base = issue if clock is None else (max(issue, clock) if n == 0 else clock)
                clock = h2d_end[i] if i in by and by[i].prefetch == k else base
                self.clock[i, k].setInitialValue(clock)
        return sim.makespan_s

    def read_casts(self) -> list[int]:
        """The stages whose casts the solver's incumbent keeps (the constant ones included)."""
        return sorted({i for i, v in self.k.items() if (v.varValue or 0) > 0.5} | set(self.casts_fixed))

    def read_runs(self) -> list[Recompute]:
        """The recomputed runs in the solver's incumbent, with their checkpoints' points where moved."""
        out = {r: r for r, v in self.g.items() if (v.varValue or 0) > 0.5}
        for (i, o), r in self.moving.items():
            if r in out and (self.x[i, o].varValue or 0) > 0.5:
                out[r] = replace(r, **dict(zip(("release", "prefetch"), self._points(i, o))))
        return sorted(out.values())

    def _points(self, i: int, o: str) -> tuple[int, int]:
        """The release and prefetch points of what moves in stage ``i``'s slot in form ``o``."""
        L = self.chain.L
        r = next(j for j in range(i + 1, L + 1) if _value(self.released(i, o, j)) > 0.5)
        k = max([self.need[i]] + [j for j in range(self.need[i] + 1, self.cap[i] + 1)
                                  if (self.y[i, o, j].varValue or 0) > 0.5])
        return r, k

    def read(self) -> tuple[list[Offload], dict[int, str]]:
        """The schedule in the solver's incumbent (binaries rounded), decided units included."""
        encode = {i: o for (i, o), v in self.c.items() if (v.varValue or 0) > 0.5}
        out = []
        restores = {i: p for (i, p), v in self.h.items() if _value(v) > 0.5}
        for (i, o), v in self.x.items():
            if (v.varValue or 0) > 0.5 and (i, o) not in self.moving:
                out.append(Offload(i, *self._points(i, o), restores.get(i, 0) if o == RAW else 0))
        for i, d in self.decided.items():
            if d.encoding != RAW:
                encode[i] = d.encoding
            if d.offload is not None:
                out.append(d.offload)
        return sorted(out), encode


def solve_ilp(chain: Chain, budget: int, *, warm: Sequence[Offload] | None = None,
              warm_encode: Mapping[int, str] | None = None, options: Mapping[int, Sequence[Encoding]] | None = None,
              decided: Mapping[int, Decided] | None = None, prefetch_cap: Mapping[int, int] | None = None,
              cut_width: int | None = None, lower_bound_s: float = 0.0, solver: str = "highs", time_limit: float | None = 60.0,
              gap: float | None = 1e-4, threads: int | None = None, msg: bool = False,
              deadline: Deadline | None = None, presolve: bool = True, max_run: int = 0,
              warm_runs: Sequence[Recompute] = (), offload: bool = True, warm_casts: Sequence[int] = (),
              casts_kept: Sequence[int] = ()) -> IlpResult:
    """Build and solve the MILP for an activation ``budget``; ``options`` are the encodings
    it may choose per stage (``offload.step.encoding.allowed``), ``decided`` the units it may not
    change (and ``casts_kept`` the stages whose weight casts are kept, a constant then),
    ``max_run`` the longest recomputed run (0: no recomputation), ``offload`` whether units
    may move at all (off: the recompute-only optimum).  Raises ``OutOfTime`` if the
    ``deadline`` passes while the model is built."""
    t0 = time.perf_counter()
    model = Model(chain, budget, lower_bound_s, options, decided, prefetch_cap, deadline, cut_width, max_run, offload,
                  casts_kept)
    if warm is not None:
        model.load(warm, warm_encode, warm_runs, warm_casts)
    build_s = time.perf_counter() - t0
    out = run(model.lp, solver, time_limit=time_limit, gap=gap, threads=threads, warm=warm is not None, msg=msg,
              deadline=deadline, presolve=presolve, sub_mips=not (model.offload_only and warm is not None))
    tau = model.tau
    offloads, encode = model.read() if out.has_solution else (None, {})
    return IlpResult(
        offloads=offloads,
        encode=encode,
        recompute=model.read_runs() if out.has_solution else [],
        casts_kept=model.read_casts() if out.has_solution else [],
        outcome=out,
        objective_s=out.objective * tau if out.objective is not None else None,
        dual_bound_s=out.dual_bound * tau if out.dual_bound is not None else None,
        build_s=build_s,
        variables=len(model.lp.variables()),
        constraints=model.lp.numConstraints(),
    )
