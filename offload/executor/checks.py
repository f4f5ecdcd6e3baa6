"""What ``offload train`` compares a run with: the same model trained without offloading
(gradients, bit for bit), the same steps without offloading, under ``save_on_cpu`` and
with selective checkpointing (step time, in rounds interleaved with ours, and peak), and a
``torch.profiler`` trace of one more step (copy overlap).

The gradient check is exact with dropout on: before each of our steps the random state
(torch's CPU and CUDA generators, NumPy's and Python's: ``offload.core.rng``) is saved; the
reference step replays it, so it draws the same dropout masks, and the state after our
step is then put back, so training goes on as if the reference had not run.  The
reference takes our weights each step instead of training alongside: PyTorch's CPU
optimizers are not bit-reproducible from run to run (two identical models updated by
identical Adam steps drift apart in about one process in six), which would be blamed on
the offloading.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
from typing import Any, Callable

import torch

from offload.core.devices import persistent_tensors
from offload.core.selective import selective_checkpointing
from offload.core.meters import QuietProfile, chrome_trace
from offload.core.rng import rng_state, set_rng_state
from offload.core.staging import Site
from offload.io.files import write_atomic
from offload.models.spec import ModelSpec
from offload.step.chain import Chain
from offload.step.names import other_kernels
from offload.step.schedule import Schedule, make_schedule

from .api import Offloaded
from .compiled import plain_compile
from .report import BASELINES, Baseline, total
from .traces import copy_overlap, device_time
from .trainer import Run, StepHooks, Trainer, step_errors


# Ours is within the noise when it differs from the reference by at most NOISE_MARGIN times the
# floor, the most that NOISE_SAMPLES more reference runs differ from the first.  Where the noise
# has few degrees of freedom (one atomic sum, one scalar) the floor of a few samples is often
# small by luck: with 2 samples and a margin of 2, a run without defect failed 11% of steps
# (1-d Gaussian noise; 0.15% on tests/models/noisy.py); with 3 and 10, 0.06% (1-d) and none in
# 400,000 draws from 4-d on.  A defect (a missing wait, other random numbers) is off by far more.
# Some nondeterminism shows in few runs (CPU Inductor's: the reference differed from itself in
# one step of four in a GPT-2): where NOISE_SAMPLES more runs all agree with the first and ours
# does not, the reference runs again, up to NOISE_SAMPLES_MAX in all, until one differs.
NOISE_MARGIN = 10.0
NOISE_SAMPLES = 3
NOISE_SAMPLES_MAX = 8


Grads = list[torch.Tensor | None]  # a step's gradients, one per trained weight: None where it got none


def _square(g: torch.Tensor | None) -> float:
    """||g||^2 in float64 (0 for no gradient)."""
    return float(g.double().square().sum()) if g is not None else 0.0


def _relative(a: Grads, b: Grads) -> float:
    """||a - b|| / ||b|| over all the tensors, in float64 (a weight without a gradient
    counts as zeros)."""
    diff = sum(_square(y if x is None else x if y is None else x.double() - y.double()) for x, y in zip(a, b))
    norm = sum(_square(y) for y in b)
    return (diff / norm) ** 0.5 if norm > 0 else 0.0


def _differs(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two gradients of one weight are not the same bits: a weight that got no
    gradient (a pooler the loss does not read) matches one that got none either."""
    if a is None or b is None:
        return a is not b
    return not torch.equal(a, b)


def _seeds(device: torch.device) -> tuple[int, int | None]:
    """The seeds the generators were last given: the same after each run of one step from one
    state, unless the model seeds them anew from the operating system (``torch.seed()``, as
    Reformer's reversible layers do), which no replay of their states can follow."""
    return torch.initial_seed(), torch.cuda.initial_seed() if device.type == "cuda" else None


class GradCheck(StepHooks):
    """After each step, the same step of ``reference`` (a copy of the model, without offloading)
    from our weights and our random numbers: how many gradients differ, and by how much.

    Where they differ, the reference runs the step again (``NOISE_SAMPLES`` times, up to
    ``NOISE_SAMPLES_MAX`` while it agrees with itself) from the same weights and random
    numbers: if it disagrees with itself, some kernel is not deterministic, and the most it
    disagrees is that step's *noise floor*; ours is then judged against it (within
    ``NOISE_MARGIN`` times the floor).  With a floor of 0 the reference is exact, and any
    difference is ours."""

    def __init__(self, reference: ModelSpec, params: list[torch.Tensor], device: torch.device) -> None:
        self.reference, self.params, self.device = reference, params, device
        self.ref_params = [p for p in reference.module.parameters() if p.requires_grad]
        self.mismatches: list[int] = []
        self.rel_diffs: list[float] = []  # ||ours - reference|| / ||reference||, per step
        self.noise_floors: list[float | None] = []  # per step: measured where the gradients differ
        self.reseeded = False  # the reference's runs of one step left its generators seeded apart

    @property
    def within_noise(self) -> bool:
        """Every step bit for bit, or within its noise floor (a floor of 0: bit for bit).  A
        step whose gradients differ by nothing measurable (a weight with no gradient where the
        reference has zeros, a NaN) is not noise: no kernel's rounding makes that."""
        return all(not n or 0 < d <= NOISE_MARGIN * (floor or 0.0)
                   for n, d, floor in zip(self.mismatches, self.rel_diffs, self.noise_floors))

    def tensors(self) -> list[torch.Tensor]:
        """The device memory the check keeps between steps: the reference's weights and batch."""
        return persistent_tensors(self.reference.module, None, self.device) + self.reference.tensors()

    def before_step(self) -> None:
        self.state = rng_state(self.device)

    def _reference_step(self) -> Grads:
        """The reference's gradients for our weights and our step's random numbers (its own
        ``.grad`` tensors: the next reference step replaces them)."""
        set_rng_state(self.state, self.device)
        with torch.no_grad():
            for mine, ref in zip(self.params, self.ref_params):
                ref.copy_(mine)
                ref.grad = None
        args, kwargs = self.reference.batch()
        with self.reference.autocasting():
            loss = self.reference.loss(self.reference.module(*args, **kwargs))
        loss.backward()
        return [p.grad for p in self.ref_params]

    def after_step(self) -> None:
        after = rng_state(self.device)
        ours, ref = [p.grad for p in self.params], self._reference_step()
        mismatches = sum(_differs(a, b) for a, b in zip(ours, ref))
        floor = None
        if mismatches:  # the reference again, its first gradients kept aside: copies only where they differ
            ref = [g.clone() if g is not None else None for g in ref]
            seeds = {_seeds(self.device)}
            floor, runs = 0.0, 0
            while runs < NOISE_SAMPLES or (floor == 0 and runs < NOISE_SAMPLES_MAX):
                floor, runs = max(floor, _relative(self._reference_step(), ref)), runs + 1
                seeds.add(_seeds(self.device))
            self.reseeded |= len(seeds) > 1
        set_rng_state(after, self.device)
        self.mismatches.append(mismatches)
        self.rel_diffs.append(_relative(ours, ref))
        self.noise_floors.append(floor)
        for p in self.ref_params:
            p.grad = None


EAGER_REFERENCE = "the same model trained without offloading"


def compiled_reference(chain: Chain, schedule: Schedule, backend: str) -> tuple[Schedule, str]:
    """What the gradient check's reference runs with where ours is ``schedule`` compiled under
    ``backend``: the same compile with nothing moved (compiled whole, ``compile_scheduled``;
    or per stage, ``Offloaded`` around the compiled model: a graph break at each boundary,
    which plain ``torch.compile`` of the model does not have, and Inductor fuses its kernels
    otherwise across them, 2.3e-7 relative on a GPT), and that reference in words.

    Under Inductor it recomputes what ``schedule`` recomputes: a recomputed run's kernels are
    not the forward's (compiled whole, Inductor fuses them otherwise; per stage, a recorded
    stage runs eagerly, ``rerun._EagerWhileRecording``), which changes the gradients by
    rounding (2e-7 relative on a Llama block, offloaded or not), so that against a reference
    that recomputes nothing the check would judge the kernels, at its noise floor, and not
    the offloading; against this one, ours is bit for bit.  Under ``aot_eager`` (and
    ``eager``) the kernels are the eager ones and the reference recomputes nothing: the
    recomputation is checked too."""
    if other_kernels(backend) and schedule.recompute:
        why = ("Inductor fuses recomputed kernels otherwise" if chain.recipe.whole_graph
               else "a recomputed stage runs eagerly, not Inductor's kernels")
        return (make_schedule(chain, [], recompute=schedule.recompute),
                f"the same compile without offloading, recomputing what the schedule recomputes ({why}: rounding)")
    return make_schedule(chain, []), "the same compile without the schedule"


def _blocks(chain: Chain) -> list[str]:
    """The modules whose calls end the chain's stages, innermost ones only (a decoder layer,
    not the decoder that holds them all): the blocks that users wrap in
    ``torch.utils.checkpoint``."""
    paths = sorted({Site.parse(text).module for text in chain.recipe.cuts} - {""}) if chain.recipe else []
    return [p for p in paths if not any(q.startswith(p + ".") for q in paths)]


OURS = "offloaded"  # our way's name among the interleaved ones


def compare_steps(trainer: Trainer, steps: int, compiled: bool) -> int:
    """The steps ``compare_baselines`` runs (for the progress bar)."""
    if compiled:
        return len(BASELINES) * trainer.steps_per_measure(steps)
    return len(BASELINES) * trainer.steps_per_measure(steps, timed=False) + (1 + len(BASELINES)) * steps


def compare_baselines(trainer: Trainer, steps: int, ours: Run, ours_forward: Callable[[tuple, dict], Any],
                      chain: Chain, compiled: str | None = None) -> tuple[dict[str, Baseline], list[float]]:
    """The same steps without offloading, under ``save_on_cpu`` and with op-level selective
    checkpointing of the chain's blocks (``offload.core.selective``), and our step time
    against each.

    Each way's memory is metered in ``steps`` steps of its own; then ``steps`` rounds each
    time one step of ours (``ours_forward``) and of every way, in an order rotated each round
    (``Trainer.interleaved``): a way's step time is the median of its rounds, and our ratio to
    it the median of the rounds' ratios, so that a slow moment of the machine, which one way
    after another would put on one of them only, falls on all alike.  ``compiled``: on a
    chain of the compiled graph, its backend: each way runs the model compiled as ours is
    without the schedule (``plain_compile``), after a step that compiles it (not measured),
    one way after the other, each way's context entered once for all its steps (the
    checkpointed blocks patched anew at each step would be compiled anew at each), and our
    ratio is to ``ours``' timed steps.

    Returns:
        The baselines by ``BASELINES`` key, and our step times in the rounds (empty where the
        ways ran one after the other)."""
    pin = trainer.device.type == "cuda"
    module = trainer.spec.module
    run = module if compiled is None else plain_compile(module, compiled)
    ways = {"no_offload": contextlib.nullcontext,
            "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin),
            "selective_checkpoint": lambda: selective_checkpointing(module, _blocks(chain))}

    def forward(args: tuple, kwargs: dict) -> Any:
        return run(*args, **kwargs)
    runs: dict[str, Run] = {}
    errors: dict[str, Exception | None] = {}
    for name, wrap in ways.items():
        if compiled is None:
            runs[name], errors[name] = trainer.measure(steps, forward, wrap, label=BASELINES[name], timed=False)
        else:
            with wrap():
                runs[name], errors[name] = _compiled_way(trainer, steps, forward, BASELINES[name])
    ours_times: list[float] = []
    if compiled is None:
        fine = [name for name in ways if errors[name] is None]
        times, failed = trainer.interleaved({OURS: (ours_forward, contextlib.nullcontext),
                                             **{BASELINES[name]: (forward, ways[name]) for name in fine}}, steps)
        ours_times = times[OURS]
        for name in fine:
            runs[name].step_s, errors[name] = times[BASELINES[name]], failed.get(BASELINES[name])
    out: dict[str, Baseline] = {}
    for name in ways:
        result = runs[name]
        peak = max(result.peaks) if result.peaks else None
        step_s = statistics.median(result.step_s) if result.step_s else None
        if ours_times and result.step_s:
            ratio = statistics.median(o / b for o, b in zip(ours_times, result.step_s))
        else:
            ratio = statistics.median(ours.step_s) / step_s if step_s and ours.step_s else None
        out[name] = Baseline(step_s, result.step_s, peak, total(peak, chain),
                             str(errors[name]) if errors[name] else None, ratio)
    return out, ours_times


def _compiled_way(trainer: Trainer, steps: int, forward: Callable[[tuple, dict], Any], label: str
                  ) -> tuple[Run, Exception | None]:
    """A step that compiles (not measured), then ``steps`` measured ones."""
    try:
        trainer.warm_up_step(forward, f"compiling {label}")
    except Exception as exc:  # that way's failure is its row's, as a measured step's is
        return Run(), exc
    return trainer.measure(steps, forward, label=label)


def trace_step(path: str, trainer: Trainer, run: Offloaded) -> dict[str, Any]:
    """One more step with offloading under ``torch.profiler``: a Chrome trace, how much of its
    copy time overlaps GPU compute, and where the compute stream's time went
    (``offload.executor.traces``; both ``None`` on the CPU, where there is no GPU work)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with step_errors("the traced step"), QuietProfile(activities=activities) as prof:
        trainer.one_step(lambda args, kwargs: run(*args, **kwargs), trainer.spec.batch(), contextlib.nullcontext)
        trainer.synchronize()
    gc.collect()
    trainer.finish_step()
    trainer.tick("traced step")
    text = chrome_trace(prof)
    write_atomic(path, lambda fh: fh.write(text))
    events = json.loads(text)["traceEvents"]
    return {"path": str(path), "copy_overlap": copy_overlap(events), "device_time": device_time(events)}
