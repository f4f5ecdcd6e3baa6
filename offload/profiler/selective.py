"""The in-stage options the profiler measures: some ops' outputs kept, the rest re-run.

A stage is kept, offloaded or recomputed whole.  The practice that beats per-block
checkpointing on transformers decides per op (torchtitan's selective activation
checkpointing; Rockmate's menus of options per block): keep what the matmuls,
convolutions and attention kernels made, which costs the most to recompute, and re-run the
cheap rest (norms, activations, elementwise products, dropout masks: in a SwiGLU MLP the
largest tensors) before the backward.  Two candidates per stage
(``offload.core.selective.KeepRule``): ``matmuls`` keeps every such op's output;
``every-other-matmul`` re-runs every second matmul too (torchtitan's default op policy:
half the matmuls' bytes for re-running them).  This pass measures each:

* ``kept_bytes``: the bytes of what the kept ops output (all of it, saved for the backward
  or not: a re-run reads it instead of running them again);
* ``recompute_s``: the stage's forward time (``fwd_s``, the timed steps' median) times the
  share of it that the re-run ops took, each op timed in this pass (CUDA events around each
  op on a GPU, a clock on the CPU);
* ``fwd_peak_bytes``: the stage's forward transient when autograd keeps none of its unit and
  the kept outputs are held, as the executor runs it (the holding pass with ``KeptOutputs``);
* ``rerun_peak_bytes``: what re-running it from its checkpoint, the kept outputs handed back,
  holds over the checkpoint and the kept outputs (``_rerun_peaks``: each such stage replayed
  as the executor replays it, metered).

A stage's menu (``_menu``) holds the candidates of a stage that can be re-run
(``recomputable``, not the last) that keep less than the whole unit and re-run less than
the whole forward (else keeping or recomputing the stage whole does as well), and that no
other candidate beats in both (the Pareto front).  The chain carries it (``StageOption``),
``offload show`` prints it, the solver may choose an option as a recomputed run of the
stage, and the executor runs it (``offload.core.selective.KeptOutputs``).
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
from offload.core.selective import KeepRule, KeptOutputs
from offload.core.units import UnitTracker, plain, storage_key
from offload.models.spec import tensors_in
from offload.step.chain import EVERY_OTHER_MATMUL, MATMULS, StageOption

from .measure import Boundaries, StageMeasurement, StepRunner, holding_pass

OPTIONS = (MATMULS, EVERY_OTHER_MATMUL)  # the candidates of each stage's menu

class _OpTimes(TorchDispatchMode):
    """Per stage and option, the bytes of what the option keeps and the time of the ops it
    re-runs; per stage, the time of all its forward ops."""

    def __init__(self, tracker: UnitTracker, device: torch.device, L: int) -> None:
        super().__init__()
        self.tracker, self.cuda = tracker, device.type == "cuda"
        self.spans: list[tuple[int, tuple[bool, ...], Any, Any]] = []  # (stage, kept per option, start, end)
        self.kept = [[0] * len(OPTIONS) for _ in range(L)]  # per stage, per option: bytes its kept ops output
        self.rules: dict[int, list[KeepRule]] = {}  # per stage, each option's rule over its forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stage = self.tracker.stage
        rules = self.rules.setdefault(stage, [KeepRule(o) for o in OPTIONS])
        kept = tuple(rule(func, args, kwargs or {}) for rule in rules)
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
        self.spans.append((stage, kept, start, end))
        if any(kept):
            nbytes = sum({storage_key(t): t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                          if isinstance(t, torch.Tensor) and plain(t)}.values())
            for n, k in enumerate(kept):
                self.kept[stage - 1][n] += nbytes if k else 0
        return out

    def shares(self) -> list[list[float]]:
        """Per stage and option, the share of the stage's forward op time the re-run ops took
        (1.0: no op timed)."""
        if self.cuda:
            torch.cuda.synchronize()
        L = len(self.kept)
        rerun, total = [[0.0] * len(OPTIONS) for _ in range(L)], [0.0] * L
        for stage, kept, start, end in self.spans:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            total[stage - 1] += seconds
            for n, k in enumerate(kept):
                rerun[stage - 1][n] += 0.0 if k else seconds
        return [[r / t if t > 0 else 1.0 for r in per] for per, t in zip(rerun, total)]


def _menu(candidates: dict[str, tuple[int, float]], saved: int, fwd_s: float) -> dict[str, tuple[int, float]]:
    """The options worth offering, ``name -> (kept bytes, re-run seconds)``: each keeps less
    than the unit and re-runs less than the forward (else keeping or recomputing the stage
    whole is as good), and no other keeps no more and re-runs no more (the Pareto front)."""
    inside = {n: c for n, c in candidates.items() if 0 < c[0] < saved and c[1] < fwd_s}
    return {n: c for n, c in inside.items()
            if not any(o != c and o[0] <= c[0] and o[1] <= c[1] for o in inside.values())}


def selective_pass(runner: StepRunner, stages: list[StageMeasurement]) -> list[tuple[StageOption, ...]]:
    """Per stage, its menu of in-stage options (``_menu``), each measured (module docstring)."""
    tracker = UnitTracker(runner.device, persistent_tensors(runner.spec.module, runner.optimizer, runner.device))
    ops = _OpTimes(tracker, runner.device, runner.L)
    with runner.batch() as (args, kwargs):
        with ops:  # the forward only: the backward is not re-run
            loss = runner.forward(args, kwargs, Boundaries(runner.L, lambda: None, tracker))
        loss.backward()
        del loss
    runner.zero_grads()
    shares = ops.shares()
    menus = {k: _menu({o: (ops.kept[k - 1][n], s.fwd_s * shares[k - 1][n]) for n, o in enumerate(OPTIONS)},
                      s.saved_bytes, s.fwd_s)
             for k, s in enumerate(stages, 1) if k < runner.L and s.recomputable}
    measured: dict[tuple[int, str], tuple[int, int]] = {}
    for option in OPTIONS:  # one forward holding and one replaying each option's stages
        keeping = {k: option for k, menu in menus.items() if option in menu}
        if keeping:
            fwd = holding_pass(runner, None, [], [], keeping=keeping)
            rerun = _rerun_peaks(runner, keeping)
            measured.update({(k, option): (fwd[k - 1].recomputed_fwd_peak_bytes, rerun[k]) for k in keeping})
    return [tuple(StageOption(o, *menus[k][o], *measured[k, o]) for o in OPTIONS if o in menus.get(k, {}))
            for k in range(1, runner.L + 1)]


class _Replaying(Boundaries):
    """Records each stage of ``stages`` (stage -> option) as the executor records a stage it
    re-runs in part: its calls (kept), its input, its kept ops' outputs."""

    def __init__(self, L: int, tracker: UnitTracker, device: torch.device, stages: dict[int, str]) -> None:
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
            kept = KeptOutputs(k, self.stages[k])
            self.running = (StageRecorder(k, x, self.device, self.tracker.excluded), kept,
                            x.detach() if x is not None else None)
            kept.__enter__()

    def close(self) -> None:
        if self.running is not None:
            self.running[0].close()
            self.running[1].__exit__(None, None, None)
            self.running = None


def _rerun_peaks(runner: StepRunner, stages: dict[int, str]) -> dict[int, int]:
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
