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
* ``recompute_s``: ``fwd_s`` (the timed steps' median) times the ratio of the stage's
  re-run with the option to its whole re-run, both timed as the executor replays them
  (``rerun_ratios``: the fastest of three replays each, a GPU synchronized around each).
  Both run the stage's Python code again whole; the option serves the kept ops and re-runs
  the rest under its dispatch mode, which every op passes through (about 11 us per op on
  the development machine's CPU, 124 ops in a Llama block).  A share of the forward's op
  time would leave the Python and the mode out: on a CPU, where a small block's matmuls
  take little of its time, the re-run in part measures no faster than the whole, and no
  option is offered (it would be worse than recomputing the stage whole);
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

import contextlib
import time

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

class _KeptBytes(TorchDispatchMode):
    """Per stage and option, the bytes of what the option keeps of the stage's forward."""

    def __init__(self, tracker: UnitTracker, L: int) -> None:
        super().__init__()
        self.tracker = tracker
        self.kept = [[0] * len(OPTIONS) for _ in range(L)]  # per stage, per option
        self.rules: dict[int, list[KeepRule]] = {}  # per stage, each option's rule over its forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stage = self.tracker.stage
        rules = self.rules.setdefault(stage, [KeepRule(o) for o in OPTIONS])
        kept = [rule(func, args, kwargs or {}) for rule in rules]
        out = func(*args, **(kwargs or {}))
        if any(kept):
            nbytes = sum({storage_key(t): t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                          if isinstance(t, torch.Tensor) and plain(t)}.values())
            for n, k in enumerate(kept):
                self.kept[stage - 1][n] += nbytes if k else 0
        return out


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
    sizes = _KeptBytes(tracker, runner.L)
    with runner.batch() as (args, kwargs):
        with sizes:  # the forward only: the backward is not re-run
            loss = runner.forward(args, kwargs, Boundaries(runner.L, lambda: None, tracker))
        loss.backward()
        del loss
    runner.zero_grads()
    candidates = {(k, o): sizes.kept[k - 1][n] for k, s in enumerate(stages, 1) if k < runner.L and s.recomputable
                  for n, o in enumerate(OPTIONS) if 0 < sizes.kept[k - 1][n] < s.saved_bytes}
    ratios = rerun_ratios(runner, list(candidates))
    menus = {k: _menu({o: (kept, s.fwd_s * ratios[k, o]) for (j, o), kept in candidates.items() if j == k},
                      s.saved_bytes, s.fwd_s) for k, s in enumerate(stages, 1)}
    measured: dict[tuple[int, str], tuple[int, int]] = {}
    for option in OPTIONS:  # one forward holding and one replaying each option's stages, metered
        keeping = {k: option for k, menu in menus.items() if option in menu}
        if keeping:
            fwd = holding_pass(runner, None, [], [], keeping=keeping)
            rerun = _replayed(runner, keeping, metered=True)
            measured.update({(k, option): (fwd[k - 1].recomputed_fwd_peak_bytes, int(rerun[k])) for k in keeping})
    return [tuple(StageOption(o, *menus[k][o], *measured[k, o]) for o in OPTIONS if o in menus[k])
            for k in range(1, runner.L + 1)]


def rerun_ratios(runner: StepRunner, candidates: list[tuple[int, str]]) -> dict[tuple[int, str], float]:
    """Per ``(stage, option)``, the time of re-running the stage with the option over the time of
    re-running it whole, each timed as the executor replays it (the fastest of three replays:
    the first pays what runs once)."""
    whole = {k for k, _ in candidates}
    replays: dict[tuple[int, str | None], float] = {}
    for option in (None, *OPTIONS):
        stages = {k: option for k in whole if option is None or (k, option) in candidates}
        if stages:
            timed = [_replayed(runner, stages, metered=False) for _ in range(3)]
            replays.update({(k, option): min(t[k] for t in timed) for k in stages})
    return {(k, o): replays[k, o] / replays[k, None] if replays[k, None] > 0 else 1.0 for k, o in candidates}


class _Replaying(Boundaries):
    """Records each stage of ``stages`` (stage -> option, ``None``: the whole stage) as the
    executor records a stage it re-runs: its calls, its input and, re-run in part, its kept
    ops' outputs."""

    def __init__(self, L: int, tracker: UnitTracker, device: torch.device, stages: dict[int, str | None]) -> None:
        super().__init__(L, lambda: None, tracker)
        self.device, self.stages = device, stages
        self.running: tuple[StageRecorder, KeptOutputs | None, torch.Tensor | None] | None = None
        self.recorded: dict[int, tuple[StageProgram, KeptOutputs | None, torch.Tensor | None]] = {}

    def forward_start(self) -> None:
        self._start(1, None)

    def stage_output(self, k: int, x: torch.Tensor) -> None:
        if self.running is not None:
            recorder, kept, checkpoint = self.running
            self._stop_keeping()
            self.recorded[k] = (recorder.finish(x), kept, checkpoint)
        self._start(k + 1, x)

    def _start(self, k: int, x: torch.Tensor | None) -> None:
        if k in self.stages:
            kept = KeptOutputs(k, self.stages[k]) if self.stages[k] is not None else None
            self.running = (StageRecorder(k, x, self.device, self.tracker.excluded), kept,
                            x.detach() if x is not None else None)
            if kept is not None:
                kept.__enter__()

    def _stop_keeping(self) -> None:
        if self.running[1] is not None:
            self.running[1].__exit__(None, None, None)
        self.running = None

    def close(self) -> None:
        if self.running is not None:
            self.running[0].close()
            self._stop_keeping()


def _replayed(runner: StepRunner, stages: dict[int, str | None], metered: bool) -> dict[int, float]:
    """Each stage of ``stages`` (stage -> option, ``None``: whole) recorded in one forward
    (autograd keeping nothing), then replayed, latest first, from its checkpoint with its
    kept outputs served, what it saves kept as the executor keeps the rebuilt unit.  Per
    stage, ``metered``: the most bytes its replay holds over its checkpoint and kept outputs;
    else its seconds (its Python code, the serving mode and the ops it re-runs; a GPU
    synchronized around it)."""
    persistent = persistent_tensors(runner.spec.module, runner.optimizer, runner.device)
    tracker = UnitTracker(runner.device, persistent)
    listener = _Replaying(runner.L, tracker, runner.device, stages)
    meter = make_meter(runner.device) if metered else None
    out: dict[int, float] = {}
    with meter if meter is not None else contextlib.nullcontext():
        if meter is not None:
            meter.track(persistent)
        with runner.batch() as (args, kwargs):
            tracker.exclude(tensors_in((args, kwargs)))
            if meter is not None:
                meter.track(tensors_in((args, kwargs)))
            try:
                loss = runner.forward(args, kwargs, listener, lambda t: None)  # nothing saved: no backward
            finally:
                listener.close()
            del loss
            for k in sorted(listener.recorded, reverse=True):
                program, kept, checkpoint = listener.recorded.pop(k)
                rebuilt: list[torch.Tensor] = []
                start = meter.boundary()[1] if meter is not None else _now(runner.device)
                with kept.serving() if kept is not None else contextlib.nullcontext():
                    y = program.run(checkpoint, runner.device, rebuilt.append)
                out[k] = max(0, meter.boundary()[0] - start) if meter is not None else _now(runner.device) - start
                del program, kept, checkpoint, rebuilt, y
    if meter is not None:
        meter.close()
    return out


def _now(device: torch.device) -> float:
    """The host clock, once the device has done what it was given."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
