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
  op on a GPU, a clock on the CPU).

A stage gets the option where it keeps less than the whole unit and re-runs less than the
whole forward (a stage without an expensive op, or whose unit is all matmul outputs, has
only "all kept" and "all recomputed").

It is a measurement the chain carries (``StageOption``) and ``offload show`` prints; the
solver does not choose it yet, nor does the executor run it (issue #33).
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from offload.core.devices import persistent_tensors
from offload.core.selective import EXPENSIVE
from offload.core.units import UnitTracker, plain, storage_key
from offload.step.chain import StageOption

from .measure import Boundaries, StepRunner

OPTION = "matmuls"  # the option's name: the expensive ops' outputs kept


class _OpTimes(TorchDispatchMode):
    """Per stage, the time of its expensive ops and of the rest, and the bytes the expensive ops output."""

    def __init__(self, tracker: UnitTracker, device: torch.device, L: int) -> None:
        super().__init__()
        self.tracker, self.cuda = tracker, device.type == "cuda"
        self.spans: list[tuple[int, bool, Any, Any]] = []  # (stage, expensive, start, end)
        self.kept = [0] * L  # per stage, the bytes its expensive ops output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        expensive = func.overloadpacket in EXPENSIVE
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


def selective_pass(runner: StepRunner, saved: list[int], fwd_s: list[float]) -> list[tuple[StageOption, ...]]:
    """Per stage, its ``matmuls`` option, where it keeps less than the unit (``saved``) and
    re-runs less than the forward (``fwd_s``)."""
    tracker = UnitTracker(runner.device, persistent_tensors(runner.spec.module, runner.optimizer, runner.device))
    ops = _OpTimes(tracker, runner.device, runner.L)
    with runner.batch() as (args, kwargs):
        with ops:  # the forward only: the backward is not re-run
            loss = runner.forward(args, kwargs, Boundaries(runner.L, lambda: None, tracker))
        loss.backward()
        del loss
    runner.zero_grads()
    return [(StageOption(OPTION, kept, fwd * share),) if 0 < kept < unit and share < 1 else ()
            for kept, unit, fwd, share in zip(ops.kept, saved, fwd_s, ops.shares())]
