"""The simulator: replays a schedule exactly as docs/model.md defines it.

It is the single source of truth for every number the tool prints.  Timing: each op is
ready when the previous one ends; at ready it first waits for the D2H copies of the units
released before it, then (for ``Bk``) issues the prefetches whose point is ``k`` (larger
``need_from`` first, ties larger stage), then waits for the H2D copies of the units whose
``need_from`` is its stage, then runs.  D2H copies are issued at the end of ``Fi`` in
stage order.  Copies run one at a time per direction in issue order, an H2D copy never
before its own D2H has ended.  Recomputed runs (``solver.recompute``) re-run their
forward ops at the start of their ``Bn``, after its prefetches are issued and before it
waits for its copies.  Encoded units are replayed on the derived chain of
``solver.encoding.apply``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from offload.errors import ScheduleRejected

from .actions import Offload, Recompute, check_offloads, check_recompute
from .budget import Budget
from .chain import Chain
from .encoding import apply
from .memory import memory_profile, op_name
from .recompute import by_op


@dataclass(frozen=True)
class OpRecord:
    name: str
    ready: float
    start: float
    end: float
    stall: float
    mem_bytes: int  # activation bytes during the op


@dataclass(frozen=True)
class CopyRecord:
    stage: int
    direction: str  # "D2H" or "H2D"
    issue: float
    start: float
    end: float
    nbytes: int


@dataclass(frozen=True)
class RecomputeRecord:
    """One re-run forward op ``Rj``, at the start of ``B(op_stage)``."""

    stage: int
    op_stage: int
    start: float
    end: float
    mem_bytes: int


@dataclass
class Simulation:
    """The replayed timeline of one schedule (``chain`` is the one replayed: with the
    schedule's encodings applied)."""

    chain: Chain
    offloads: tuple[Offload, ...]
    ready: np.ndarray  # per op, execution order
    start: np.ndarray
    end: np.ndarray
    memory: np.ndarray  # activation bytes per op
    copies: list[CopyRecord]
    encode: Mapping[int, str] = field(default_factory=dict)
    recompute: tuple[Recompute, ...] = ()
    recomputes: list[RecomputeRecord] = field(default_factory=list)
    recompute_s: np.ndarray | None = None  # per op, the recomputation it starts with

    @property
    def makespan_s(self) -> float:
        return float(self.end[-1])

    @property
    def stalls(self) -> np.ndarray:
        """Per op, the time it waited for copies."""
        rt = self.recompute_s if self.recompute_s is not None else 0.0
        return self.start - self.ready - rt

    @property
    def stall_s(self) -> float:
        return float(self.stalls.sum())

    @property
    def recomputed_s(self) -> float:
        """Compute time spent re-running forward ops."""
        return float(sum(r.end - r.start for r in self.recomputes))

    @property
    def peak_bytes(self) -> int:
        """Activation peak (add ``chain.base_bytes`` for the total)."""
        return int(self.memory.max())

    @property
    def peak_op(self) -> str:
        return op_name(self.chain, int(self.memory.argmax()))

    @property
    def d2h_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies if c.direction == "D2H")

    @property
    def h2d_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies if c.direction == "H2D")

    @property
    def ops(self) -> list[OpRecord]:
        return [
            OpRecord(op_name(self.chain, o), float(self.ready[o]), float(self.start[o]), float(self.end[o]),
                     float(self.stalls[o]), int(self.memory[o]))
            for o in range(len(self.end))
        ]

    def check_budget(self, budget: Budget) -> None:
        """Refuse the schedule if any op exceeds the budget; name the first such op."""
        base = budget.base(self.chain)
        over = np.nonzero(self.memory + base > budget.nbytes)[0]
        if len(over):
            o = int(over[0])
            need = int(self.memory[o]) + base
            raise ScheduleRejected(
                f"{op_name(self.chain, o)} at t={self.start[o]:.6g} s holds {need} bytes "
                f"({budget.scope}), budget {budget.nbytes}: over by {need - budget.nbytes} bytes"
                + (f"; {len(over)} ops exceed it in all" if len(over) > 1 else ""),
                "raise the budget or solve again for this budget",
            )


def simulate(chain: Chain, offloads: Iterable[Offload], budget: Budget | int | None = None,
             encode: Mapping[int, str] | None = None, recompute: Iterable[Recompute] = ()) -> Simulation:
    """Replay ``offloads`` and the recomputed runs ``recompute`` (with the units of
    ``encode`` encoded) on ``chain``; with a budget (an ``int``: activation bytes), refuse it
    if memory exceeds it."""
    encode = dict(encode or {})
    chain = apply(chain, encode)
    offloads = tuple(sorted(offloads))
    runs = tuple(sorted(recompute))
    check_offloads(chain, offloads)
    check_recompute(chain, runs, offloads, encode)
    rebuilt = by_op(chain, runs)
    memory, rebuilt_memory = memory_profile(chain, offloads, runs)
    sub_memory = {j: nbytes for _, j, nbytes in rebuilt_memory}
    L, p = chain.L, chain.platform
    f, b, a = chain.f, chain.b, chain.a
    released_at: list[list[int]] = [[] for _ in range(L + 1)]
    issued_at: list[list[int]] = [[] for _ in range(L + 1)]
    needed_at: list[list[int]] = [[] for _ in range(L + 1)]
    offloaded = np.zeros(L + 1, dtype=bool)
    for o in offloads:
        offloaded[o.stage] = True
        released_at[o.release].append(o.stage)
        issued_at[o.prefetch].append(o.stage)
        needed_at[int(chain.need[o.stage])].append(o.stage)
    for k in range(1, L + 1):
        issued_at[k].sort(key=lambda i: (-int(chain.need[i]), -i))

    d2h_free = h2d_free = 0.0
    d2h_end = np.zeros(L + 1)
    h2d_end = np.zeros(L + 1)
    ready = np.empty(2 * L)
    start = np.empty(2 * L)
    end = np.empty(2 * L)
    copies: list[CopyRecord] = []
    recomputes: list[RecomputeRecord] = []
    rt = np.zeros(2 * L)
    t = 0.0
    for j in range(1, L + 1):  # forward
        o = j - 1
        ready[o] = t
        s = t
        for i in released_at[j - 1]:
            s = max(s, d2h_end[i])
        start[o] = s
        t = end[o] = s + f[j]
        if offloaded[j]:
            c0 = max(t, d2h_free)
            d2h_end[j] = d2h_free = c0 + p.d2h_s(float(a[j]))
            copies.append(CopyRecord(j, "D2H", float(t), float(c0), float(d2h_end[j]), int(a[j])))
    for j in range(L, 0, -1):  # backward
        o = 2 * L - j
        ready[o] = t
        s = t
        if j == L:
            for i in released_at[L]:
                s = max(s, d2h_end[i])
        for i in issued_at[j]:
            c0 = max(s, h2d_free, d2h_end[i])
            h2d_end[i] = h2d_free = c0 + p.h2d_s(float(a[i]))
            copies.append(CopyRecord(i, "H2D", float(s), float(c0), float(h2d_end[i]), int(a[i])))
        for run in rebuilt.get(j, ()):
            for i in run.stages:
                recomputes.append(RecomputeRecord(i, j, float(s), float(s + f[i]), sub_memory[i]))
                s += f[i]
                rt[o] += f[i]
        for i in needed_at[j]:
            s = max(s, h2d_end[i])
        start[o] = s
        t = end[o] = s + b[j]
    sim = Simulation(chain, offloads, ready, start, end, memory, copies, encode, runs, recomputes, rt)
    if budget is not None:
        sim.check_budget(budget if isinstance(budget, Budget) else Budget(int(budget)))
    return sim
