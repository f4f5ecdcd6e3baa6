"""The simulator: replays a schedule exactly as docs/model.md defines it.

It is the single source of truth for every number the tool prints.  It walks the step's
events (``events.step_events``: what happens, in order) with times: each op is ready when
the previous one ends and starts once the events before it are done: a ``RELEASE`` waits
for that unit's D2H copy, an ``H2D`` is issued then (no earlier than its own D2H ended),
a ``RECOMPUTE`` re-runs its run's forward ops (an in-stage option the ops it re-runs), a ``WAIT`` waits for that unit's H2D copy.
An offloaded checkpoint's copies (the events of a run) take its unit's place, with its
moved bytes (``recompute.moved_checkpoint_bytes``), and its ``WAIT`` delays the rebuild.
A ``D2H`` is issued as its forward op ends.  A ``RESTORE`` copies a held part back (an H2D
copy, issued before its forward op) and ``RESTORED`` waits for it; ``EVICT`` takes no time.
Copies run one at a time per direction, in issue order.  On a GPU the host issues the kernels: a second clock adds up each op's host
time (``fwd_host_s``/``bwd_host_s``; a recomputed stage's ``Fi`` adds what recording it
costs, ``recording_host_s``, and its re-run takes ``rerun_host_s``; a copy adds
``copy_host_s`` per storage it moves, a held part's restore too, and starts no earlier than
it was issued; a unit moved, encoded or rebuilt adds ``handle_host_s`` per saved tensor of it
to ``Fi`` and to ``Bi``, ``handling_host``), and an op
cannot end before the host has issued it (its end is the later of the device's and the
host's; the host never waits for the device within a step).  Memory per op is ``memory``'s (it depends on the actions alone).  Encoded
units are replayed on the derived chain of ``encoding.apply``, whose op times include the
encoders and decoders (``ENCODE`` and ``DECODE`` take no time of their own).  A recomputed
stage's ``Fi``, re-run and ``Bi`` take its recorded times (``recompute``).  Where the host
runs the ops itself (a CPU), a handled unit's ``Fi`` and ``Bi`` take ``handle_device_s`` per
saved tensor longer, and an op that issues copies ``copy_device_s`` per storage they move
(``op_seconds``).  A stage whose
weight casts are kept runs ``Bi`` without recasting them (``recast_s`` less).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from offload.errors import ScheduleRejected

from .actions import Offload, Recompute, check_casts, check_offloads, check_recompute, check_restores
from .budget import Budget
from .chain import Chain
from .encoding import apply
from .events import (BACKWARD, D2H, FORWARD, H2D, RECOMPUTE, RELEASE, RESTORE, RESTORED, WAIT, Event, StepEvents,
                     step_events)
from .intervals import hidden
from .memory import memory_profile, op_name
from .recompute import forward_seconds, moved_checkpoint_bytes, recording_host, run_seconds


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
    checkpoint: bool = False  # a recomputed run's checkpoint, not the stage's unit
    held: bool = False  # the unit's held part, copied back before its next forward reader


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
    events: StepEvents | None = None  # what was replayed, in order
    host_wait: np.ndarray | None = None  # per op, how long its end waited for the host to issue it
    casts_kept: tuple[int, ...] = ()  # stages whose weight casts were kept

    @property
    def host_wait_s(self) -> float:
        """Time the device spent waiting for the host to issue its work."""
        return float(self.host_wait.sum()) if self.host_wait is not None else 0.0

    @property
    def makespan_s(self) -> float:
        return float(self.end[-1])

    @property
    def stalls(self) -> np.ndarray:
        """Per op, the time it waited for copies (never below 0: ``start`` is at least ``ready``
        plus the rebuild time, and their difference may round a hair under it)."""
        rt = self.recompute_s if self.recompute_s is not None else 0.0
        return np.maximum(0.0, self.start - self.ready - rt)

    @property
    def stall_s(self) -> float:
        return float(self.stalls.sum())

    @property
    def recomputed_s(self) -> float:
        """Compute time spent re-running forward ops."""
        return float(sum(r.end - r.start for r in self.recomputes))

    @property
    def copy_overlap(self) -> float | None:
        """The share of copy time hidden under compute: while the device ran an op or a
        rebuild, not while it waited for a copy or for the host (``None`` without copies;
        read as a trace is, ``intervals``)."""
        wait = self.host_wait if self.host_wait is not None else np.zeros(len(self.end))
        busy = [(float(s), float(e - w)) for s, e, w in zip(self.start, self.end, wait)]
        busy += [(r.start, r.end) for r in self.recomputes]
        copy_s, under = hidden(((c.start, c.end) for c in self.copies), busy)
        return under / copy_s if copy_s > 0 else None

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
        over = np.nonzero(budget.excess(self.chain, self.memory) > 0)[0]
        if len(over):
            o = int(over[0])
            need = budget.counted(self.chain, int(self.memory[o]))
            raise ScheduleRejected(
                f"{op_name(self.chain, o)} at t={self.start[o]:.6g} s holds {need} bytes "
                f"({budget.scope}), budget {budget.nbytes}: over by {need - budget.nbytes} bytes"
                + (f"; {len(over)} ops exceed it in all" if len(over) > 1 else ""),
                "raise the budget or solve again for this budget",
            )


def handled_stages(offloads: Iterable[Offload], encode: Mapping[int, str], runs: Iterable[Recompute]) -> set[int]:
    """The units whose saved tensors pass to the executor: moved, encoded or rebuilt by a re-run."""
    return {o.stage for o in offloads} | set(encode) | {j for r in runs for j in r.stages}


def handling_host(chain: Chain, handled: Iterable[int]) -> np.ndarray:
    """Per stage (index 0 unused), the host time each way that its unit's saved tensors add
    when the executor handles them (``Chain.handle_host_s``): charged to ``Fi`` and to ``Bi``."""
    out = np.zeros(chain.L + 1)
    if chain.platform.handle_host_s:
        for i in handled:
            out[i] = chain.handle_host_s(i)
    return out


def copied_out(chain: Chain, units: Iterable[int], runs: Iterable[Recompute]) -> np.ndarray:
    """Per stage (index 0 unused), what issuing its D2H copies adds to ``Fi`` where the host runs
    the ops (``Chain.issue_device_s``): the copy of its unit, offloaded, and of the checkpoint
    of a run of it that offloads one, each issued as ``Fi`` ends."""
    out = np.zeros(chain.L + 1)
    if chain.platform.copy_device_s:
        for i in units:
            out[i] += chain.issue_device_s(i)
        for r in runs:
            if r.moves:
                out[r.first] += chain.issue_device_s(r.first, checkpoint=r.option)
    return out


def op_seconds(chain: Chain, offloads: Iterable[Offload], handled: Iterable[int],
               runs: Iterable[Recompute]) -> tuple[np.ndarray, np.ndarray]:
    """Per stage (index 0 unused), how long ``Fi`` and ``Bi`` run on the device for this choice:
    a recomputed stage's recorded times (its forward recorded for its re-run, in part with an
    option; its backward after the rebuild), and where the host runs the ops (a CPU) the
    executor's work in them: a handled unit's saved tensors' handling, each way
    (``Chain.handle_device_s``), and the copies each op issues (``Chain.issue_device_s``: a
    D2H as ``Fi`` ends, ``copied_out``; an H2D at its prefetch point, before ``Bk``; a held
    part's restore before the forward it precedes)."""
    offloads, runs = tuple(offloads), tuple(runs)
    f, b = chain.f.copy(), chain.b.copy()
    for run in runs:
        for j in run.stages:
            f[j], b[j] = forward_seconds(chain, run, j), chain.br[j]
    if chain.platform.handle_device_s:
        for i in handled:
            f[i] += chain.handle_device_s(i)
            b[i] += chain.handle_device_s(i)
    if chain.platform.copy_device_s:
        f += copied_out(chain, (o.stage for o in offloads), runs)
        for o in offloads:
            b[o.prefetch] += chain.issue_device_s(o.stage)
            if o.restore:
                f[o.restore] += chain.restore_device_s(o.stage)
        for r in runs:
            if r.moves:
                b[r.prefetch] += chain.issue_device_s(r.first, checkpoint=r.option)
    return f, b


def simulate(chain: Chain, offloads: Iterable[Offload], budget: Budget | int | None = None,
             encode: Mapping[int, str] | None = None, recompute: Iterable[Recompute] = (),
             casts_kept: Iterable[int] = ()) -> Simulation:
    """Replay ``offloads`` and the recomputed runs ``recompute`` (with the units of
    ``encode`` encoded, the weight casts of the stages ``casts_kept`` kept) on ``chain``;
    with a budget (an ``int``: activation bytes), refuse it if memory exceeds it."""
    encode = dict(encode or {})
    chain = apply(chain, encode)
    offloads = tuple(sorted(offloads))
    runs = tuple(sorted(recompute))
    check_offloads(chain, offloads)
    check_recompute(chain, runs, offloads, encode)
    check_restores(offloads, runs, encode)
    kept = tuple(sorted(casts_kept))
    check_casts(chain, kept, runs)
    events = step_events(chain, offloads, runs, encode)
    memory, rebuilt_memory = memory_profile(chain, offloads, runs, kept)
    sub_memory = {j: nbytes for _, j, nbytes in rebuilt_memory}
    L, p = chain.L, chain.platform
    handled = handled_stages(offloads, encode, runs)
    handling = handling_host(chain, handled)
    fh = chain.fh + recording_host(chain, runs) + handling
    bh = chain.bh + handling
    f, b = op_seconds(chain, offloads, handled, runs)
    b[list(kept)] -= chain.rc[list(kept)]
    d2h_free = h2d_free = 0.0
    d2h_end = np.zeros(L + 1)
    h2d_end = np.zeros(L + 1)
    restore_end = np.zeros(L + 1)
    ready = np.empty(2 * L)
    start = np.empty(2 * L)
    end = np.empty(2 * L)
    copies: list[CopyRecord] = []
    recomputes: list[RecomputeRecord] = []
    rt = np.zeros(2 * L)
    host_wait = np.zeros(2 * L)
    o = 0  # the next op, in execution order
    t = s = 0.0  # t: when the last op ended; s: when the next one can start
    h = 0.0  # when the host has issued everything so far
    def moved(e: Event) -> int:
        """The bytes a copy moves: the unit's, or the offloaded checkpoint's of a run."""
        return moved_checkpoint_bytes(chain, e.run) if e.run is not None else int(chain.mv[e.stage])

    def issue(e: Event) -> float:
        """The host's time to issue a copy: the unit's or the run's checkpoint's."""
        return chain.issue_host_s(e.stage, checkpoint=e.run.option if e.run is not None else None)

    for e in events.sequence:
        i = e.stage
        if e.kind in (FORWARD, BACKWARD):
            ready[o], start[o] = t, s
            forward = e.kind == FORWARD
            h += fh[i] if forward else bh[i]
            done = s + (f[i] if forward else b[i])
            host_wait[o] = max(0.0, h - done)
            t = s = end[o] = max(done, h)
            o += 1
        elif e.kind == D2H:
            h += issue(e)
            c0, nbytes = max(t, d2h_free, h), moved(e)
            d2h_end[i] = d2h_free = c0 + p.d2h_s(float(nbytes))
            copies.append(CopyRecord(i, "D2H", float(t), float(c0), float(d2h_end[i]), nbytes, e.run is not None))
        elif e.kind == RELEASE:
            s = max(s, d2h_end[i])
        elif e.kind == H2D:
            h += issue(e)
            c0, nbytes = max(s, h2d_free, d2h_end[i], h), moved(e)
            h2d_end[i] = h2d_free = c0 + p.h2d_s(float(nbytes))
            copies.append(CopyRecord(i, "H2D", float(s), float(c0), float(h2d_end[i]), nbytes, e.run is not None))
        elif e.kind == RECOMPUTE:
            for j in e.run.stages:
                took = run_seconds(chain, e.run) if e.run.option else float(chain.rr[j])
                recomputes.append(RecomputeRecord(j, 2 * L - o, float(s), float(s + took), sub_memory[j]))
                s += took
                rt[o] += took
                h += chain.rh[j]
        elif e.kind == WAIT:
            s = max(s, h2d_end[i])
        elif e.kind == RESTORE:
            h += chain.restore_host_s(i)
            c0, nbytes = max(s, h2d_free, d2h_end[i], h), int(chain.held[i])
            restore_end[i] = h2d_free = c0 + p.h2d_s(float(nbytes))
            copies.append(CopyRecord(i, "H2D", float(s), float(c0), float(restore_end[i]), nbytes, held=True))
        elif e.kind == RESTORED:
            s = max(s, restore_end[i])
    sim = Simulation(chain, offloads, ready, start, end, memory, copies, encode, runs, recomputes, rt, events,
                     host_wait, kept)
    if budget is not None:
        sim.check_budget(Budget.of(budget))
    return sim
