"""A compiled step metered op by op: marks (``offload::mark``) at its stage boundaries, the
clock and the allocator read at each.

The profile of a compiled graph (``offload.profiler.compiled``) measures a step of the model
compiled with marks and no schedule; ``offload train --op-memory`` on such a chain, a step of
the schedule compiled again with them, to compare each op with the model's prediction.  The
marks come where the model puts the boundaries (``compiled_copies.place_marks``): a stage's
D2H copies and releases before its mark, the next backward stage's prefetches after it.
"""
from __future__ import annotations

import gc
import json
import time
from typing import Any

import torch

from offload.core.meters import QuietProfile, chrome_trace, cpu_allocations
from offload.models.spec import ModelSpec
from offload.step.chain import Chain
from offload.step.memory import op_name

from .compiled import SchedulePartitioner, compile_with

MARK = "offload.mark."  # the CPU marks' names in torch.profiler's trace
# steps before a metered one: the first compiles and makes the gradients, and the second still
# allocates state that stays from then on (32 B at every op of a ConvNeXt's, read as over)
WARM_STEPS = 2


def intervals(L: int) -> list[tuple[int, int]]:
    """Per op, in step order (``F1 … FL``, ``BL … B1``), the marks it runs between: ``k`` ends
    ``Fk``, ``L + 1`` begins the backward, ``2L - k + 2`` ends ``Bk``; ``0`` is the step's start
    and ``2L + 2`` its end (read by the loop)."""
    forward = [(k - 1, k) if k < L else (L - 1, L + 1) for k in range(1, L + 1)]
    backward = [(2 * L - k + 1, 2 * L - k + 2 if k > 1 else 2 * L + 2) for k in range(L, 0, -1)]
    return forward + backward


class Marks:
    """The readings at the marks of one step: the time, and on CUDA the allocator's bytes now
    and at most since the mark before."""

    def __init__(self, device: torch.device, count: int) -> None:
        self.cuda = device.type == "cuda"
        self.clock: list[Any] = [None] * count
        self.now = [0] * count
        self.peak = [0] * count

    def __call__(self, index: int) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.clock[index] = event
            self.now[index], self.peak[index] = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.clock[index] = time.perf_counter()
            with torch.profiler.record_function(f"{MARK}{index}"):
                pass

    def seconds(self, a: int, b: int) -> float:
        if self.cuda:
            return self.clock[a].elapsed_time(self.clock[b]) / 1e3
        return self.clock[b] - self.clock[a]

    def cuda_peaks(self, spans: list[tuple[int, int]]) -> list[int]:
        """Per span of marks, the most bytes allocated in it beyond those at mark 0 (CUDA)."""
        return [max(self.peak[a + 1:b + 1]) - self.now[0] for a, b in spans]

    def missing(self) -> list[int]:
        return [i for i, c in enumerate(self.clock) if c is None]


def _cpu_peaks(prof: torch.profiler.profile, count: int, spans: list[tuple[int, int]]) -> list[int]:
    """Per span of marks, the most bytes allocated in it beyond those allocated at mark 0, from
    ``torch.profiler``'s memory events (every allocation, a compiled kernel's too)."""
    events = json.loads(chrome_trace(prof))["traceEvents"]
    at = [None] * count
    for e in events:
        name = e.get("name", "")
        if name.startswith(MARK) and e.get("ph") == "X":
            at[int(name[len(MARK):])] = float(e["ts"])
    memory = cpu_allocations(prof, events)

    def level(t: float) -> int:
        before = [total for ts, total in memory if ts <= t]
        return before[-1] if before else 0
    start = level(at[0])
    return [max([level(at[a]), *(total for ts, total in memory if at[a] < ts <= at[b])]) - start for a, b in spans]


class MarkedRun:
    """``spec.module`` compiled whole with ``partitioner``, whose marks (``marks=True``) end its
    stages: its steps timed and metered op by op (``intervals``)."""

    def __init__(self, spec: ModelSpec, partitioner: SchedulePartitioner, device: torch.device, backend: str) -> None:
        self.spec, self.partitioner, self.device = spec, partitioner, device
        self.L = partitioner.events.L
        torch._dynamo.reset()
        self.module = compile_with(spec.module, partitioner, backend, fullgraph=False)
        self.params = [p for p in spec.module.parameters() if p.requires_grad]

    def step(self) -> Marks:
        """One step (the first compiles), and the readings at its marks."""
        L, spec = self.L, self.spec
        marks = Marks(self.device, 2 * L + 3)
        spec.zero_grads(self.params)
        args, kwargs = spec.batch()
        self.partitioner.runtime.marks = marks
        marks(0)
        with spec.autocasting():
            loss = spec.loss(self.module(*args, **kwargs))
        loss.backward()
        marks(2 * L + 2)
        if marks.cuda:
            torch.cuda.synchronize(self.device)
        if marks.missing():
            raise RuntimeError(f"the compiled step reached no mark {marks.missing()[0]} of the {len(marks.clock)} that "
                               "end its stages: code of the stages ran outside the one graph (a graph break inside "
                               "them; TORCH_LOGS=graph_breaks names it)")
        return marks

    def seconds(self) -> list[float]:
        """Each op's time in one step."""
        marks = self.step()
        return [marks.seconds(a, b) for a, b in intervals(self.L)]

    def op_peaks(self, chain: Chain) -> dict[str, int]:
        """``peaks`` by op name (``F1`` … ``B1``), as the eager executor's ``--op-memory`` reads them."""
        return {op_name(chain, o): peak for o, peak in enumerate(self.peaks())}

    def peaks(self) -> list[int]:
        """Per op, the most bytes allocated in one step's interval of it beyond those allocated
        as the step began.  The garbage of earlier steps and compiles is collected first: freed
        by the collector inside the step, it read as the step's memory falling (a U-Net's peak
        read 0.66 MiB under what it held, once in seven runs)."""
        gc.collect()
        if self.device.type == "cuda":
            return self.step().cuda_peaks(intervals(self.L))
        with QuietProfile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step()
        return _cpu_peaks(prof, 2 * self.L + 3, intervals(self.L))
