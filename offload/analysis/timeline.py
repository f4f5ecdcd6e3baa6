"""One schedule's replayed timeline as lanes (compute, codec, D2H, H2D), stalls and a memory
curve, and its export as a Chrome / Perfetto trace.

Both the timeline plot and the trace are drawn from ``timeline()``, which walks the step's
events (``offload.step.events``) as the simulator replayed them, and nothing else, so the
picture is exactly what the numbers say: each op with the stall before it, each re-run
forward op, each copy, and in the codec lane the part of an op that encodes a unit (the
end of ``Fi``) or decodes it (the start of its first reader).
"""
from __future__ import annotations

from dataclasses import dataclass

from offload.step.chain import Chain
from offload.step.events import BACKWARD, D2H, DECODE, ENCODE, FORWARD, H2D, RECOMPUTE
from offload.step.memory import op_name
from offload.step.schedule import Schedule
from offload.step.simulate import Simulation

LANES = ("compute", "D2H", "H2D", "codec")  # the trace's threads, in this order


@dataclass(frozen=True)
class Span:
    lane: str  # compute | codec | D2H | H2D
    name: str  # F3, B3, R3 (F3 re-run), stall; E3, D3 (U3 encoded, decoded); U3 (a copy of unit 3), C3 (of its checkpoint)
    start: float
    end: float
    nbytes: int = 0


@dataclass
class Timeline:
    chain: Chain
    schedule: Schedule
    simulation: Simulation
    spans: list[Span]  # ops, stalls and copies
    memory: list[tuple[float, float, int]]  # (from, to, activation bytes + base) per op, stall included
    base_bytes: int  # added to memory: base_bytes for a total budget, 0 for an activation one

    @property
    def budget_bytes(self) -> int | None:
        return self.schedule.budget.nbytes if self.schedule.budget else None


def timeline(chain: Chain, schedule: Schedule) -> Timeline:
    sim = schedule.simulate(chain)
    base = schedule.budget.base(chain) if schedule.budget else 0
    spans: list[Span] = []
    memory = []
    copies, reruns = iter(sim.copies), iter(sim.recomputes)
    o = 0  # the next op
    for e in sim.events.sequence:
        if e.kind in (FORWARD, BACKWARD):
            ready, start, end = (float(a[o]) for a in (sim.ready, sim.start, sim.end))
            if sim.stalls[o] > 0:  # after the op's recomputations, if any
                spans.append(Span("compute", "stall", start - float(sim.stalls[o]), start))
            spans.append(Span("compute", op_name(chain, o), start, end))
            memory.append((ready, end, int(sim.memory[o]) + base))
            o += 1
        elif e.kind in (D2H, H2D):
            c = next(copies)
            spans.append(Span(c.direction, f"{'C' if c.checkpoint else 'U'}{c.stage}", c.start, c.end, c.nbytes))
        elif e.kind == RECOMPUTE:
            spans += [Span("compute", f"R{r.stage}", r.start, r.end) for r in (next(reruns) for _ in e.run.stages)]
        elif e.kind == ENCODE:  # the end of the op that just ran
            end = float(sim.end[o - 1])
            spans.append(Span("codec", f"E{e.stage}", end - chain.stage(e.stage).encoding(e.encoding).encode_s, end))
        elif e.kind == DECODE:  # the start of the op about to run
            start = float(sim.start[o])
            spans.append(Span("codec", f"D{e.stage}", start, start + chain.stage(e.stage).encoding(e.encoding).decode_s))
    return Timeline(chain, schedule, sim, spans, memory, base)


def chrome_trace(t: Timeline) -> dict:
    """The trace-event format (``traceEvents`` of complete ``X`` events, ``C`` counters for
    memory, ``M`` names for the lanes); times in microseconds, as the format wants."""
    us = 1e6
    pid = 1
    events: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name",
                           "args": {"name": f"{t.chain.name}: {t.schedule.method or 'schedule'} (simulated)"}}]
    for tid, lane in enumerate(LANES, 1):
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    tids = {lane: tid for tid, lane in enumerate(LANES, 1)}
    for s in t.spans:
        kind = "stall" if s.name == "stall" else {"compute": s.name[0], "codec": "codec"}.get(s.lane, "copy")
        args = {"bytes": s.nbytes} if s.nbytes else {}
        events.append({"ph": "X", "pid": pid, "tid": tids[s.lane], "name": s.name, "cat": kind,
                       "ts": s.start * us, "dur": (s.end - s.start) * us, "args": args})
    for start, _, nbytes in t.memory:
        events.append({"ph": "C", "pid": pid, "name": "memory", "ts": start * us, "args": {"bytes": nbytes}})
    if t.memory:
        events.append({"ph": "C", "pid": pid, "name": "memory", "ts": t.memory[-1][1] * us, "args": {"bytes": t.base_bytes}})
    sim = t.simulation
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"chain": t.chain.name, "chain_sha256": t.chain.sha256, "method": t.schedule.method,
                          "makespan_s": sim.makespan_s, "stall_s": sim.stall_s, "peak_bytes": sim.peak_bytes + t.base_bytes,
                          "budget_bytes": t.budget_bytes,
                          "budget_scope": t.schedule.budget.scope if t.schedule.budget else None}}
