"""Measured training steps of one model, whatever runs its forward (offloading or a baseline).

Each step: a fresh batch (held through the step, as a training loop holds it), forward,
loss, backward, the optimizer, gradients zeroed in place (kept allocated: ``base_bytes``).
Memory is read by the shared meters (the CUDA allocator, or exact accounting on the CPU);
a step's activation memory is the reading over the bytes live when it starts, the batch
included there, as the profiler counts it.  On CUDA the allocator also holds memory no
tensor does (cuBLAS/cuDNN workspaces, made on their first use and kept): the chain's
``workspace_bytes`` of its base.  A step is judged over that base, not over its own start:
step 1, in which the workspaces appear, counts them only beyond the profiled ones, and
every step counts whatever more the run holds without a tensor (an executor's buffers, a
workspace the profile did not see), unless it was there before the run's first step (an
earlier run's workspaces in the same process) or appeared between two steps: the
optimizer's first update makes its state, whose tensors the allocator may round up to its
blocks (on an H200 an fp32 Llama's runs held 22.3 MB without a tensor from step 2 on, where
the only memory a smaller run of it made between its steps was Adam's state; charged to
every step as activations, it put one run 8.6 MB over its budget).  What a step leaves
behind is still charged to every step after it.  On the CPU exact accounting slows every op
down several times, so step times come from as many steps again without the meter (on a
GPU the allocator's counters cost nothing and every step gives both).
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

from offload.core.devices import persistent_tensors, running
from offload.core.meters import CpuMeter, make_meter
from offload.errors import OffloadError, OutOfMemory, first_line, offload_cause
from offload.io.contention import CpuWait
from offload.models.spec import ModelSpec, tensors_in

from .runtime import OffloadRuntime

Forward = Callable[[tuple, dict], Any]  # (args, kwargs) -> the model's output


@dataclass
class Run:
    """What the measured steps of one way of training left behind."""

    step_s: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)  # activation bytes: the step's peak over its start
    leaks: list[int] = field(default_factory=list)  # bytes still live after the step, over its start
    allocations: list[int] = field(default_factory=list)  # host arena buffers so far, after each step
    op_peaks: dict[str, int] = field(default_factory=dict)  # first step, per op (with the probe)
    metered_step_s: list[float] = field(default_factory=list)  # CPU: the metered steps' times (not step_s)
    warmup_s: float | None = None  # GPU: step 1, left out of step_s (kernel selection, allocator growth)
    reserved_peak: int | None = None  # GPU: the most the allocator reserved over the steps so far
    base_growth: int = 0  # held by no tensor, made between its steps (the base's, beyond the chain's)
    cpu_wait_share: float | None = None  # its threads' wait for a CPU over their run (other processes' load)



@contextlib.contextmanager
def young_heap() -> Iterator[None]:
    """The objects that exist before the steps moved out of the collector's sight
    (``gc.freeze``) until the block ends: every step ends with a full ``gc.collect()``
    (reference cycles over tensors are freed by nothing else, and would count as memory held),
    which then scans what the steps made, not every object of the process (0.2 s a collection
    with transformers imported, here)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def step_errors(what: str) -> Iterator[None]:
    """A failing step becomes one ``OffloadError``: out of GPU memory, or the model's failure."""
    with running(what):
        try:
            yield
        except torch.cuda.OutOfMemoryError as exc:
            raise OutOfMemory(f"{what}: out of GPU memory ({first_line(exc)})",
                              "the step needs more than the chain predicts: solve again with a lower budget to "
                              "leave room for allocator slack and other processes (`nvidia-smi` shows them), "
                              "or profile the chain again on this machine") from None


class StepHooks:
    """Called around each metered step (the gradient check replays the step's random numbers)."""

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass


class Trainer:
    """Runs measured training steps of one model."""

    def __init__(self, spec: ModelSpec, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                 device: torch.device, tick: Callable[[str], None] = lambda _: None, workspace_bytes: int = 0,
                 elsewhere: list[torch.Tensor] | None = None, compiled: bool = False) -> None:
        self.spec, self.params, self.optimizer, self.device = spec, params, optimizer, device
        self.compiled = compiled  # one compiled graph: on the CPU its allocations are metered (AllocationMeter)
        self.tick = tick  # told each step done: "<what> step <n>/<steps>"
        self.workspace_bytes = workspace_bytes  # the chain's: device memory of its base that no tensor holds
        # memory no tensor holds that every step is judged over: the chain's workspaces, what was there before
        # the first step, and what appeared between steps (``_Metering.step``); and such memory as the last step ended
        self.base_untracked: int | None = None
        self.untracked_after: int | None = None
        self.elsewhere = list(elsewhere or [])  # device tensors the run keeps beside the model (a reference copy)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream, the copy streams included

    def one_step(self, forward: Forward, batch: tuple[tuple, dict], wrap: Callable[[], ContextManager]) -> None:
        args, kwargs = batch
        with wrap():
            with self.spec.autocasting():
                loss = self.spec.loss(forward(args, kwargs))
            loss.backward()
        del loss

    def warm_up_step(self, forward: Forward, what: str) -> None:
        """A step not measured, its gradients dropped, before the measured ones, as the profile
        warmed the model up before it measured: the one that compiles ``forward``, and the one
        in which the model makes what it keeps from its first call on (transformers' BEiT
        caches its relative position index, 2.3 KiB: made in the first metered step, every op
        from there on read it over its prediction) and the executor its host arena.

        A gradient allocated before it (``offload train`` allocates them all, as profiled) that
        its backward did not write (the same tensor, its version unchanged) is set to ``None``,
        as plain PyTorch leaves the ``.grad`` of a weight the loss does not read: the optimizer
        skips that weight (AdamW would decay it), and the gradient check finds ``None`` where
        the reference does."""
        allocated = [(p, p.grad, p.grad._version) for p in self.params if p.grad is not None]
        with step_errors(what):
            try:
                self.one_step(forward, self.spec.batch(), contextlib.nullcontext)
            except Exception as exc:  # our partitioner's refusal, handed back by the compiler as its own
                raise offload_cause(exc) or exc
        for p, grad, version in allocated:
            if p.grad is grad and grad._version == version:
                p.grad = None
        self.spec.zero_grads(self.params)

    def finish_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
        self.spec.zero_grads(self.params)

    def steps_per_measure(self, steps: int, timed: bool = True) -> int:
        """The steps one ``measure`` of ``steps`` runs (on the CPU the timed ones come on top)."""
        return steps if self.device.type == "cuda" or not timed else 2 * steps

    def measure(self, steps: int, forward: Forward, wrap: Callable[[], ContextManager] = contextlib.nullcontext,
                hooks: StepHooks | None = None, runtime: OffloadRuntime | None = None,
                probe: bool = False, label: str = "", timed: bool = True,
                warm_up: int = 0) -> tuple[Run, OffloadError | None]:
        """``steps`` steps with memory metered, then (on the CPU, unless not ``timed``) ``steps``
        more timed without the meter, after the metered ones warmed up; on a GPU the metered
        steps are timed, the first left out as a warm-up (``warmup_s``).  ``warm_up`` steps not
        measured come first (``warm_up_step``).  On running out of memory: the steps
        before it, and the error.  With ``probe``, the first metered step's memory is read at
        every op's end too (``run.op_peaks``, from ``runtime``).  ``label`` names the way of
        training in ``tick``.  ``run.cpu_wait_share`` says how much the machine's other
        processes held its CPUs meanwhile (``offload.io.contention``)."""
        for step in range(1, warm_up + 1):
            which = f" {step}/{warm_up}" if warm_up > 1 else ""
            try:
                self.warm_up_step(forward, f"the warm-up step{which}")
            except OffloadError as exc:  # the step's error, as a metered step's is
                return Run(), exc
            self.tick(f"{label} warm-up step{which}".strip())
        waited = CpuWait()
        run, error = self._metered(steps, forward, wrap, hooks or StepHooks(), runtime, probe, label)
        if self.device.type == "cuda":
            if len(run.step_s) > 1:  # the first step is a warm-up (kernel choice, allocator growth)
                run.warmup_s, run.step_s = run.step_s[0], run.step_s[1:]
        elif error is None and timed:
            run.metered_step_s = run.step_s
            run.step_s, error = self._timed(steps, forward, wrap, label)
        run.cpu_wait_share = waited.share()
        return run, error

    def interleaved(self, ways: dict[str, tuple[Forward, Callable[[], ContextManager]]], rounds: int
                    ) -> tuple[dict[str, list[float]], dict[str, OffloadError]]:
        """``rounds`` rounds of one timed step of each way (name -> forward, context), the order
        rotated each round, so that a slow moment of the machine falls on every way alike: the
        ratio of two ways' steps in one round is what it measures (``checks.compare_baselines``).
        Returns each way's step times, in round order, and the error of a way that failed (it
        runs no more rounds)."""
        times: dict[str, list[float]] = {name: [] for name in ways}
        errors: dict[str, OffloadError] = {}
        names = list(ways)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in errors:
                    continue
                forward, wrap = ways[name]
                try:
                    times[name].append(self._time_step(forward, wrap, f"{name}: interleaved round {r + 1}"))
                except OffloadError as exc:
                    errors[name] = exc
                    continue
                self.finish_step()
                self.tick(f"{name} interleaved round {r + 1}/{rounds}")
        return times, errors

    def _time_step(self, forward: Forward, wrap: Callable[[], ContextManager], what: str) -> float:
        """One step timed without a meter (``OffloadError`` where it fails); the optimizer not run."""
        with step_errors(what):
            batch = self.spec.batch()
            self.synchronize()
            t0 = time.perf_counter()
            self.one_step(forward, batch, wrap)
            self.synchronize()
            elapsed = time.perf_counter() - t0
            del batch
            gc.collect()  # outside the timed window (under young_heap it scans the steps' own objects)
        return elapsed

    def _timed(self, steps: int, forward: Forward, wrap: Callable[[], ContextManager],
               label: str) -> tuple[list[float], OffloadError | None]:
        times: list[float] = []
        for step in range(1, steps + 1):
            try:
                times.append(self._time_step(forward, wrap, f"timed step {step}"))
            except OffloadError as exc:
                return times, exc
            self.finish_step()
            self.tick(f"{label} timed step {step}/{steps}".strip())
        return times, None

    def _metered(self, steps: int, forward: Forward, wrap: Callable[[], ContextManager], hooks: StepHooks,
                 runtime: OffloadRuntime | None, probe: bool, label: str) -> tuple[Run, OffloadError | None]:
        run = _Metering(self, runtime, probe)
        for step in range(1, steps + 1):
            try:
                with step_errors(f"training step {step}"):
                    hooks.before_step()
                    run.step(step == 1, lambda batch: self.one_step(forward, batch, wrap))
            except OffloadError as exc:
                return run.run, exc
            with torch.compiler.set_stance("force_eager") if run.eager else contextlib.nullcontext():
                hooks.after_step()  # (the gradient check's reference step runs as ours ran)
            self.finish_step()
            self.tick(f"{label} {'metered ' if self.device.type != 'cuda' else ''}step {step}/{steps}".strip())
        return run.run, None


class _Metering:
    """One metered step at a time, its readings added to ``run``."""

    def __init__(self, trainer: Trainer, runtime: OffloadRuntime | None, probe: bool) -> None:
        self.trainer, self.runtime, self.probe = trainer, runtime, probe and runtime is not None
        self.run = Run()
        self.eager = False  # whether the meter ran the step's compiled code eagerly (``CpuMeter``)

    def step(self, first: bool, body: Callable[[tuple[tuple, dict]], None]) -> None:
        t = self.trainer
        meter = make_meter(t.device, t.compiled)
        self.eager = isinstance(meter, CpuMeter)
        if self.runtime is not None:
            meter.ignore(self.runtime.arena.chunks)
        probing = self.probe and first
        try:
            with meter, (self.runtime.reading(meter) if probing else contextlib.nullcontext({})) as op_peaks:
                batch = t.spec.batch()  # the loop's batch: live before the step, like the weights
                meter.track(persistent_tensors(t.spec.module, t.optimizer, t.device) + tensors_in(batch))
                meter.ignore(t.spec.tensors() + t.elsewhere)  # the example batches are copied from; a reference
                gc.collect()  # earlier garbage freed by the collector inside the step would read as its memory falling
                t.synchronize()
                meter.boundary()
                if t.base_untracked is None:  # an earlier run's workspaces, the user's: not this run's
                    t.base_untracked = max(t.workspace_bytes, meter.untracked)
                elif t.untracked_after is not None:  # made between steps (the optimizer's new state, rounded up to
                    grown = max(0, meter.untracked - t.untracked_after)  # the allocator's blocks): the base's
                    t.base_untracked += grown
                    self.run.base_growth += grown
                m0 = meter.live - meter.untracked + t.base_untracked  # the chain's base
                t0 = time.perf_counter()
                body(batch)
                t.synchronize()
                elapsed = time.perf_counter() - t0
                gc.collect()  # reference cycles (closures over tensors) are only freed by the collector
                peak, live = meter.boundary()  # the batch still alive: it is in m0
                t.untracked_after = meter.untracked
                if probing:
                    op_peaks["B1"] = max(peak, op_peaks.get("B1", 0))
                    self.run.op_peaks = {op: p - m0 for op, p in op_peaks.items()}
                    peak = max(op_peaks.values())
        finally:
            meter.close()
        self.run.step_s.append(elapsed)
        self.run.peaks.append(peak - m0)
        self.run.leaks.append(live - m0)
        self.run.allocations.append(self.runtime.arena.allocations if self.runtime else 0)
        self.run.reserved_peak = meter.reserved_peak
