"""The in-stage option the profiler measures: the expensive ops' outputs kept, the rest re-run.

A stage today is kept, offloaded or recomputed whole.  The practice that beats per-block
checkpointing on transformers decides per op (torchtitan's selective activation
checkpointing, "save the matmuls"; Rockmate's menus of options per block): keep what the
matmuls, convolutions and attention kernels made, which costs the most to recompute, and
re-run the cheap rest (norms, activations, elementwise products, dropout masks: in a SwiGLU
MLP the largest tensors) before the backward.  This pass measures that option per stage:

* ``kept_bytes``: the bytes of what the stage's expensive ops output (all of it, saved for
  the backward or not: a re-run reads it instead of running them again, as torchtitan's
  policy keeps every matmul's output);
* ``recompute_s``: the stage's forward time (``fwd_s``, the timed steps' median) times the
  share of it that the other ops took, each op timed in this pass (CUDA events around each
  op on a GPU, a clock on the CPU);
* ``fwd_peak_bytes``: the stage's forward transient when autograd keeps none of its unit and
  the kept outputs are held, as the executor runs it (the holding pass with ``KeptOutputs``);
* ``rerun_peak_bytes``: what re-running it from its checkpoint, the kept outputs handed back,
  holds over the checkpoint and the kept outputs (``_rerun_peaks``: each such stage replayed
  as the executor replays it, metered).

A stage gets the option where it can be re-run (``recomputable``, not the last) and keeps
less than the whole unit and re-runs less than the whole forward (a stage without an
expensive op, or whose unit is all matmul outputs, has only "all kept" and "all
recomputed").  The chain carries it (``StageOption``), ``offload show`` prints it, the
solver may choose it as a recomputed run of the stage, and the executor runs it
(``offload.core.selective.KeptOutputs``).
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from offload.core.devices import persistent_tensors
from offload.core.meters import make_meter
from offload.core.rerun import StageProgram, StageRecorder
from offload.core.selective import KeptOutputs, keeps
from offload.core.units import UnitTracker, plain, storage_key
from offload.models.spec import tensors_in
from offload.step.chain import MATMULS, StageOption

from .measure import Boundaries, StageMeasurement, StepRunner, holding_pass

class _OpTimes(TorchDispatchMode):
    """Per stage, the time of its expensive ops and of the rest, and the bytes the expensive ops output."""

    def __init__(self, tracker: UnitTracker, device: torch.device, L: int) -> None:
        super().__init__()
        self.tracker, self.cuda = tracker, device.type == "cuda"
        self.spans: list[tuple[int, bool, Any, Any]] = []  # (stage, expensive, start, end)
        self.kept = [0] * L  # per stage, the bytes its expensive ops output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        expensive = keeps(func, args, kwargs or {})
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if self.cuda:
            end.record()
        else:
            end = time.perf_counter()
        stage = self.tracker.stage
        self.spans.append((stage, expensive, start, end))
        if expensive:
            storages = {storage_key(t): t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and plain(t)}
            self.kept[stage - 1] += sum(storages.values())
        return out

    def shares(self) -> list[float]:
        """Per stage, the share of its forward op time the cheap ops took (1.0: no op timed)."""
        if self.cuda:
            torch.cuda.synchronize()
        L = len(self.kept)
        cheap, total = [0.0] * L, [0.0] * L
        for stage, expensive, start, end in self.spans:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            total[stage - 1] += seconds
            if not expensive:
                cheap[stage - 1] += seconds
        return [c / t if t > 0 else 1.0 for c, t in zip(cheap, total)]


def selective_pass(runner: StepRunner, stages: list[StageMeasurement]) -> list[tuple[StageOption, ...]]:
    """Per stage, its ``matmuls`` option, where it can be re-run and keeps less than the unit
    and re-runs less than the forward (module docstring)."""
    tracker = UnitTracker(runner.device, persistent_tensors(runner.spec.module, runner.optimizer, runner.device))
    ops = _OpTimes(tracker, runner.device, runner.L)
    with runner.batch() as (args, kwargs):
        with ops:  # the forward only: the backward is not re-run
            loss = runner.forward(args, kwargs, Boundaries(runner.L, lambda: None, tracker))
        loss.backward()
        del loss
    runner.zero_grads()
    offered = {k: (kept, s.fwd_s * share) for k, (kept, s, share) in enumerate(zip(ops.kept, stages, ops.shares()), 1)
               if k < runner.L and s.recomputable and 0 < kept < s.saved_bytes and share < 1}
    if not offered:
        return [() for _ in stages]
    fwd_peaks = [h.recomputed_fwd_peak_bytes for h in holding_pass(runner, None, [], [], keeping=set(offered))]
    rerun_peaks = _rerun_peaks(runner, set(offered))
    return [(StageOption(MATMULS, *offered[k], fwd_peaks[k - 1], rerun_peaks[k]),) if k in offered else ()
            for k in range(1, runner.L + 1)]


class _Replaying(Boundaries):
    """Records each stage of ``stages`` as the executor records a stage it re-runs in part: its
    calls (kept), its input, its kept ops' outputs."""

    def __init__(self, L: int, tracker: UnitTracker, device: torch.device, stages: set[int]) -> None:
        super().__init__(L, lambda: None, tracker)
        self.device, self.stages = device, stages
        self.running: tuple[StageRecorder, KeptOutputs, torch.Tensor | None] | None = None
        self.recorded: dict[int, tuple[StageProgram, KeptOutputs, torch.Tensor | None]] = {}

    def forward_start(self) -> None:
        self._start(1, None)

    def stage_output(self, k: int, x: torch.Tensor) -> None:
        if self.running is not None:
            recorder, kept, checkpoint = self.running
            kept.__exit__(None, None, None)
            self.running = None
            self.recorded[k] = (recorder.finish(x), kept, checkpoint)
        self._start(k + 1, x)

    def _start(self, k: int, x: torch.Tensor | None) -> None:
        if k in self.stages:
            kept = KeptOutputs(k)
            self.running = (StageRecorder(k, x, self.device, self.tracker.excluded), kept,
                            x.detach() if x is not None else None)
            kept.__enter__()

    def close(self) -> None:
        if self.running is not None:
            self.running[0].close()
            self.running[1].__exit__(None, None, None)
            self.running = None


def _rerun_peaks(runner: StepRunner, stages: set[int]) -> dict[int, int]:
    """Per stage of ``stages``, the most bytes its re-run holds over its checkpoint and kept
    outputs: one forward (autograd keeping nothing) recording them, then each replayed under
    the meter, what it saves kept as the executor keeps the rebuilt unit."""
    persistent = persistent_tensors(runner.spec.module, runner.optimizer, runner.device)
    tracker = UnitTracker(runner.device, persistent)
    listener = _Replaying(runner.L, tracker, runner.device, stages)
    meter = make_meter(runner.device)
    peaks: dict[int, int] = {}
    with meter:
        meter.track(persistent)
        with runner.batch() as (args, kwargs):
            tracker.exclude(tensors_in((args, kwargs)))
            meter.track(tensors_in((args, kwargs)))
            try:
                loss = runner.forward(args, kwargs, listener, lambda t: None)  # nothing saved: no backward
            finally:
                listener.close()
            del loss
            for k in sorted(listener.recorded, reverse=True):
                program, kept, checkpoint = listener.recorded.pop(k)
                rebuilt: list[torch.Tensor] = []
                _, before = meter.boundary()
                with kept.serving():
                    out = program.run(checkpoint, runner.device, rebuilt.append)
                peak, _ = meter.boundary()
                peaks[k] = max(0, peak - before)
                del program, kept, checkpoint, rebuilt, out
    meter.close()
    return peaks
