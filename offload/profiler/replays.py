"""The profiler's replays of stages, as the executor replays them (``offload.core.rerun``).

What a recomputation costs is measured on the executor's own mechanism, not inferred from
the forward: one forward (autograd keeping nothing) records the stages as the executor
records a stage it re-runs (``recorded``: its calls, its input, and, for an in-stage option,
its kept ops' outputs), and each recorded stage is then replayed as the executor replays it.
The in-stage options' ratios and peaks (``profiler.selective``) are read on these replays,
and so are what a stage's re-run holds (``rerun_peaks``: its ``rerun_peak_bytes``, whole or
with an option) and the host's share of a recomputation on a GPU (``host_seconds``):

* ``rerun_host_s``: the host's seconds to issue a stage's re-run whole (the device
  synchronized before it, the clock read as the replay returns, before its kernels are
  done): the Python of the stage's code again, the replay's own bookkeeping, the launches.
  On an H200 a 16-layer bf16 Llama's per-block checkpointing measured 9-19% over the
  prediction that charged a re-run its forward's host time;
* ``recording_host_s``: the host's seconds the executor's recording adds to the stage's
  forward (module hooks on every call): a recorded forward's host time per stage less a
  plain one's, both forward-only.

Each is the median of three passes (``HOST_PASSES``; fewer where the profile times fewer
steps, ``--repeats``), as the forward's host time is the
median of the timed steps: the least of two charged a re-run less than its forward's host
time on the same footing; latest stage first, each timed replay after an untimed one
(``timed_replay``).
On a CPU the host is the device: its ops run as they are issued, and these are the
stages' recorded times (below), not the host's.

What a stage recorded for a re-run takes on the device, where that is not what the timed
steps measured (``recorded_times``: the chain's ``recorded_fwd_s``, ``rerun_s`` and
``recorded_bwd_s``):

* on a CPU, whose host is the device, the recording's work is the forward's time
  (``fwd_s`` plus what ``host_seconds`` finds recording adds) and the replay's own work is
  the re-run's (its timed replay): per-block checkpointing of a 4-layer GPT of width 64
  measured 2.87x its no-offload step, predicted 1.51x where neither was charged, 2.27x now;
* where the model is compiled per stage by a compiler whose kernels are not the eager
  model's (Inductor), a recorded stage runs eagerly (``rerun._EagerWhileRecording``): its
  forward, its re-run and its backward, timed as the timed steps time the compiled ones but
  under ``torch.compiler.set_stance("force_eager")`` (``eager_seconds``).

Each recorded op is charged at least what the timed steps measured (the solver's bounds take
those as each op's shortest).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

import torch

from offload.core import casts
from offload.core.devices import persistent_tensors
from offload.core.meters import Clock, make_meter
from offload.core.rerun import StageProgram, StageRecorder
from offload.core.selective import KeptOutputs
from offload.core.units import UnitTracker
from offload.models.spec import tensors_in

from .measure import Boundaries, StepRunner

Recorded = tuple[StageProgram, KeptOutputs | None, torch.Tensor | None]  # the program, what it keeps, its checkpoint
HOST_PASSES = 3  # passes of the host's clocks (``host_seconds``): their median is taken


class _Replaying(Boundaries):
    """Records each stage of ``stages`` (stage -> its option, ``None``: re-run whole) as the
    executor records a stage it re-runs: its calls, its input, its kept ops' outputs."""

    def __init__(self, L: int, tracker: UnitTracker, device: torch.device, stages: dict[int, str | None],
                 on_boundary: Callable[[], None]) -> None:
        super().__init__(L, on_boundary, tracker)
        self.device, self.stages = device, stages
        self.running: tuple[StageRecorder, KeptOutputs | None, torch.Tensor | None] | None = None
        self.recorded: dict[int, Recorded] = {}

    def forward_start(self) -> None:
        self.on_boundary()
        self._start(1, None)

    def stage_output(self, k: int, x: torch.Tensor, opening: bool) -> None:
        if self.running is not None:
            recorder, kept, checkpoint = self.running
            if kept is not None:
                kept.__exit__(None, None, None)
            self.running = None
            self.recorded[k] = (recorder.finish(x), kept, checkpoint)
        self._start(k + 1, x, opening)

    def _start(self, k: int, x: torch.Tensor | None, opening: bool = False) -> None:
        if k in self.stages:
            option = self.stages[k]
            kept = KeptOutputs(k, option) if option is not None else None
            recorder = StageRecorder(k, x, self.device, self.tracker.excluded, opening=opening, code=self.encloses(k))
            self.running = (recorder, kept, x.detach() if x is not None else None)
            if kept is not None:
                kept.__enter__()

    def pack(self, _: torch.Tensor) -> None:
        """The pack hook (autograd keeps nothing): the running recorder records what its own
        code saves with, as the executor's does."""
        if self.running is not None:
            self.running[0].saved()

    def close(self) -> None:
        if self.running is not None:
            self.running[0].close()
            if self.running[1] is not None:
                self.running[1].__exit__(None, None, None)
            self.running = None


@contextlib.contextmanager
def recorded(runner: StepRunner, stages: dict[int, str | None], meter: Any = None,
             on_boundary: Callable[[], None] = lambda: None) -> Iterator[dict[int, Recorded]]:
    """Each stage of ``stages`` (stage -> its option, or ``None``) recorded in one forward
    (autograd keeping nothing) as the executor records a stage it re-runs: in this block,
    ``{stage: (program, kept outputs, checkpoint)}``, the batch alive (and ``meter``, if
    given, entered and tracking what persists).  ``on_boundary`` is called as the forward
    starts and as each stage but the last ends."""
    persistent = persistent_tensors(runner.spec.module, runner.optimizer, runner.device)
    tracker = runner.tracker(persistent)
    listener = _Replaying(runner.L, tracker, runner.device, stages, on_boundary)
    with meter if meter is not None else contextlib.nullcontext():
        if meter is not None:
            meter.track(persistent)
        with runner.batch() as (args, kwargs):
            tracker.exclude(tensors_in((args, kwargs)))
            if meter is not None:
                meter.track(tensors_in((args, kwargs)))
            runner.sync()
            try:
                loss = runner.forward(args, kwargs, listener, listener.pack)  # nothing kept: no backward
            finally:
                listener.close()
            del loss
            yield listener.recorded


def _keeping(rebuilt: list[Any]) -> Callable[[torch.Tensor], None]:
    """What a replay saves, kept in ``rebuilt`` as the executor keeps a rebuilt unit: a weight's
    cast is not kept (it is made again when the backward reads it, ``offload.core.casts``)."""
    return lambda t: rebuilt.append(casts.pack(t))


def rerun_peaks(runner: StepRunner, stages: dict[int, str | None]) -> dict[int, int]:
    """Per stage of ``stages`` (stage -> its option, ``None``: re-run whole), the most bytes its
    re-run holds over its checkpoint (its input, the held tensors it reads) and, with an
    option, the kept outputs: each replayed as the executor replays it, latest first, under
    the meter, what it saves kept as the executor keeps the rebuilt unit."""
    meter = make_meter(runner.device)
    peaks: dict[int, int] = {}
    with recorded(runner, stages, meter) as programs:
        for k in sorted(programs, reverse=True):
            program, kept, checkpoint = programs.pop(k)
            rebuilt: list[Any] = []
            _, before = meter.boundary()
            with kept.serving() if kept is not None else contextlib.nullcontext():
                y = program.run(checkpoint, runner.device, _keeping(rebuilt))
            peak, _ = meter.boundary()
            peaks[k] = max(0, peak - before)
            del program, kept, checkpoint, rebuilt, y
    meter.close()
    return peaks


Times = tuple[float | None, float | None, float | None]  # recorded_fwd_s, rerun_s, recorded_bwd_s (None: as timed)


def recorded_times(runner: StepRunner, stages: list[int], timed: list[tuple[float, float]], repeats: int,
                   eager_kernels: bool) -> dict[int, Times]:
    """Per stage of ``stages`` (each re-runnable, not the last), its times recorded for a
    re-run where they are not ``timed`` (per stage, its forward's and backward's seconds from
    the timed steps; module docstring).  ``repeats``: the profile's timed steps (as many timed
    eagerly; at most ``HOST_PASSES`` passes of the host's clocks).  ``eager_kernels``: the
    model runs the eager model's kernels (uncompiled, or compiled by a backend that keeps them)."""
    out: dict[int, list[float | None]] = {k: [None, None, None] for k in stages}
    if not eager_kernels:
        eager = eager_seconds(runner, repeats)
        for k in stages:
            f, b = eager[k - 1]
            out[k] = [max(f, timed[k - 1][0]), f, max(b, timed[k - 1][1])]
    if runner.device.type == "cpu":
        rerun, added = host_seconds(runner, stages, min(HOST_PASSES, repeats))
        for k in stages:
            out[k][:2] = [timed[k - 1][0] + added[k], rerun[k]]
    return {k: (f, r, b) for k, (f, r, b) in out.items() if (f, r, b) != (None, None, None)}


def eager_seconds(runner: StepRunner, repeats: int) -> list[tuple[float, float]]:
    """Per stage, its forward's and its backward's seconds run eagerly, as the executor runs a
    stage it records for a re-run under a per-stage compile (module docstring): the medians of
    ``repeats`` timed steps of the model with every compile ignored, after one untimed."""
    with torch.compiler.set_stance("force_eager"):
        runner.timing_pass()
        passes = [runner.timing_pass() for _ in range(repeats)]
    return [(statistics.median(p[0][k] for p in passes), statistics.median(p[1][k] for p in passes))
            for k in range(runner.L)]


def now(device: torch.device) -> float:
    """The host clock, once the device has done what it was given."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed_replay(program: StageProgram, checkpoint: torch.Tensor | None, device: torch.device,
                 within: Callable[[], Any] = contextlib.nullcontext, issued: bool = False) -> float:
    """Seconds of one replay of ``program`` as the executor replays it (what it saves kept as
    the executor keeps the rebuilt unit; ``within`` a mode), the device synchronized before
    it and after it, or (``issued``) until the host has issued it.  It comes right after an
    untimed plain replay: on the development machine a replay that follows a timed one ran
    up to 4x slower, whatever it ran."""
    program.run(checkpoint, device, lambda t: None)  # untimed
    rebuilt: list[Any] = []
    start = now(device)
    with within():
        y = program.run(checkpoint, device, _keeping(rebuilt))
    end = time.perf_counter() if issued else now(device)
    now(device)
    del y, rebuilt
    return end - start


def host_seconds(runner: StepRunner, stages: list[int],
                 passes: int = HOST_PASSES) -> tuple[dict[int, float], dict[int, float]]:
    """Per stage of ``stages`` (each re-runnable, not the last): the host's seconds to issue
    the executor's re-run of it whole, and those that recording it adds to its forward
    (module docstring; on a CPU, whose host is the device, the re-run's time and what
    recording adds to the forward's: ``recorded_times`` charges them as the device's)."""
    if not stages:
        return {}, {}
    reruns: dict[int, list[float]] = {k: [] for k in stages}
    plain, recording = [], []
    for _ in range(passes):
        plain.append(_forward_host(runner, {}))
        clock = Clock(runner.device)
        with recorded(runner, dict.fromkeys(stages), on_boundary=clock.mark) as programs:
            recording.append(_issued(clock))
            for k in sorted(programs, reverse=True):
                program, _, checkpoint = programs.pop(k)
                reruns[k].append(timed_replay(program, checkpoint, runner.device, issued=True))
                del program, checkpoint
    base, rec = [statistics.median(c) for c in zip(*plain)], [statistics.median(c) for c in zip(*recording)]
    return ({k: statistics.median(t) for k, t in reruns.items() if t},
            {k: max(0.0, rec[k - 1] - base[k - 1]) for k in stages})


def _forward_host(runner: StepRunner, stages: dict[int, str | None]) -> list[float]:
    """The host's seconds to issue each stage's forward but the last's, ``stages`` recorded."""
    clock = Clock(runner.device)
    with recorded(runner, stages, on_boundary=clock.mark):
        return _issued(clock)


def _issued(clock: Clock) -> list[float]:
    """The host's seconds to issue each interval's work: on a CPU, whose host is the device, its time."""
    return clock.host_intervals() if clock.cuda else clock.intervals()
