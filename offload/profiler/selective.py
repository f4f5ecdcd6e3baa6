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
* ``recompute_s``: the stage's whole re-run (``rerun_s`` where measured, else ``fwd_s``, the
  timed steps' median) times the ratio of the stage's re-run with the option to its whole
  re-run, both timed as the executor replays them (``rerun_ratios``: from one recording,
  each right after an untimed whole replay, the faster of two passes; a GPU synchronized
  around each).
  Both run the stage's Python code again whole; the option serves the kept ops and re-runs
  the rest under its dispatch mode, which every op passes through (about 11 us per op on
  the development machine's CPU, 124 ops in a Llama block).  A share of the forward's op
  time would leave the Python and the mode out: on a CPU a small block's re-run in part
  measures slower than the whole (width 64: 1.7x), and no option is offered (it would be
  worse than recomputing the stage whole); at width 1024 it takes 0.35x;
* ``fwd_s``: the stage's forward while the option records what it keeps, its recorded forward
  (``recorded_fwd_s`` where measured, else ``fwd_s``) times the ratio of a replay under a
  recording ``KeptOutputs`` to a plain one (timed with the others; at least 1: the mode only adds);
* ``fwd_peak_bytes``: the stage's forward transient when autograd keeps none of its unit and
  the kept outputs are held, as the executor runs it (the holding pass with ``KeptOutputs``);
* ``rerun_peak_bytes``: what re-running it from its checkpoint, the kept outputs handed back,
  holds over the checkpoint and the kept outputs (``replays.rerun_peaks``: each such stage
  replayed as the executor replays it, metered).

A stage's menu (``_menu``) holds the candidates of a stage that can be re-run
(``recomputable``, not the last) that keep less than the whole unit and re-run less than
the whole forward (else keeping or recomputing the stage whole does as well), and that no
other candidate beats in both (the Pareto front).  The chain carries it (``StageOption``),
``offload show`` prints it, the solver may choose an option as a recomputed run of the
stage, and the executor runs it (``offload.core.selective.KeptOutputs``).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from offload.core.devices import persistent_tensors
from offload.core.selective import OPTIONS, KeepRule, KeptOutputs
from offload.core.units import UnitTracker, plain, storage_key
from offload.step.chain import StageOption

from .measure import Boundaries, StageMeasurement, StepRunner, holding_pass
from .replays import Times, recorded, rerun_peaks, timed_replay


class _KeptBytes(TorchDispatchMode):
    """Per stage and option, the bytes of what the option keeps of the stage's forward, and its
    storages (an offloaded checkpoint copies each)."""

    def __init__(self, tracker: UnitTracker, L: int) -> None:
        super().__init__()
        self.tracker = tracker
        self.kept = [[0] * len(OPTIONS) for _ in range(L)]  # per stage, per option
        self.storages = [[0] * len(OPTIONS) for _ in range(L)]
        self.rules: dict[int, list[KeepRule]] = {}  # per stage, each option's rule over its forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stage = self.tracker.stage
        rules = self.rules.setdefault(stage, [KeepRule(o) for o in OPTIONS])
        kept = [rule(func, args, kwargs or {}) for rule in rules]
        out = func(*args, **(kwargs or {}))
        if any(kept):
            storages = {storage_key(t): t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and plain(t)}
            for n, k in enumerate(kept):
                self.kept[stage - 1][n] += sum(storages.values()) if k else 0
                self.storages[stage - 1][n] += len(storages) if k else 0
        return out


def _menu(candidates: dict[str, tuple[int, float]], saved: int, fwd_s: float) -> dict[str, tuple[int, float]]:
    """The options worth offering, ``name -> (kept bytes, re-run seconds)``: each keeps less
    than the unit and re-runs less than the forward (else keeping or recomputing the stage
    whole is as good), and no other keeps no more and re-runs no more (the Pareto front)."""
    inside = {n: c for n, c in candidates.items() if 0 < c[0] < saved and c[1] < fwd_s}
    return {n: c for n, c in inside.items()
            if not any(o != c and o[0] <= c[0] and o[1] <= c[1] for o in inside.values())}


def selective_pass(runner: StepRunner, stages: list[StageMeasurement],
                   recorded: dict[int, Times]) -> list[tuple[StageOption, ...]]:
    """Per stage, its menu of in-stage options (``_menu``), each measured (module docstring;
    ``recorded``: the stages' times recorded for a re-run, ``replays.recorded_times``)."""
    tracker = runner.tracker(persistent_tensors(runner.spec.module, runner.optimizer, runner.device))
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
    forward, whole = {}, {}  # per stage, its forward recorded and its whole re-run
    for k, s in enumerate(stages, 1):
        f, r, _ = recorded.get(k, (None, None, None))
        forward[k], whole[k] = s.fwd_s if f is None else f, s.fwd_s if r is None else r
    menus = {k: _menu({o: (kept, whole[k] * ratios[k, o][0]) for (j, o), kept in candidates.items() if j == k},
                      s.saved_bytes, whole[k]) for k, s in enumerate(stages, 1)}
    measured: dict[tuple[int, str], tuple[int, int]] = {}
    for option in OPTIONS:  # one forward holding and one replaying each option's stages, metered
        keeping = {k: option for k, menu in menus.items() if option in menu}
        if keeping:
            fwd = holding_pass(runner, None, [], [], keeping=keeping)
            rerun = rerun_peaks(runner, keeping)
            measured.update({(k, option): (fwd[k - 1].recomputed_fwd_peak_bytes, rerun[k]) for k in keeping})
    return [tuple(StageOption(o, *menus[k][o], *measured[k, o], forward[k] * max(1.0, ratios[k, o][1]),
                              kept_storages=sizes.storages[k - 1][OPTIONS.index(o)])
                  for o in OPTIONS if o in menus[k]) for k, s in enumerate(stages, 1)]


def rerun_ratios(runner: StepRunner, candidates: list[tuple[int, str]]) -> dict[tuple[int, str], tuple[float, float]]:
    """Per ``(stage, option)``, over the time of re-running the stage whole: the time of
    re-running it with the option, and of running it while the option records what it keeps
    (its forward's share of the mode).  All timed as the executor replays a stage, from one
    recording (``_rerun_times``), in two passes; the faster of each."""
    times: dict[tuple[int, str], list[tuple[float, float, float]]] = {c: [] for c in candidates}
    for option in OPTIONS:
        stages = {k: option for k, o in candidates if o == option}
        for n in range(2 if stages else 0):
            for k, timed in _rerun_times(runner, stages, reverse=n % 2 == 1).items():
                times[k, option].append(timed)
    out = {}
    for c, t in times.items():
        whole, part, recording = (min(column) for column in zip(*t))
        out[c] = (part / whole, recording / whole) if whole > 0 else (1.0, 1.0)
    return out


def _rerun_times(runner: StepRunner, stages: dict[int, str], reverse: bool) -> dict[int, tuple[float, float, float]]:
    """Per stage of ``stages``, the seconds of three replays from one recording: with its
    option (the kept ops served; once, before anything else can serve them), whole, and whole
    while a fresh ``KeptOutputs`` records (what the option's forward pays), the two whole ones
    in this order or ``reverse``, each after an untimed whole one (``replays.timed_replay``):
    the stage's Python code and its ops, a GPU synchronized around each."""
    out: dict[int, tuple[float, float, float]] = {}
    with recorded(runner, stages) as programs:
        for k in sorted(programs, reverse=True):
            program, kept, checkpoint = programs.pop(k)
            modes = {"part": kept.serving, "whole": contextlib.nullcontext,
                     "recording": lambda: KeptOutputs(k, stages[k])}
            order = ["part", *(["recording", "whole"] if reverse else ["whole", "recording"])]
            seconds = {name: timed_replay(program, checkpoint, runner.device, modes[name]) for name in order}
            out[k] = (seconds["whole"], seconds["part"], seconds["recording"])
            del program, kept, checkpoint, modes
    return out
