"""``offload train`` as a function: train a chain's model with a schedule; measured vs predicted.

The model is rebuilt from the chain's recipe (model, options, batch, dtype, seed) and
wrapped in ``Offloaded``, the same front door a user's own loop goes through (the schedule
checked to be the chain's, the module staged at the recipe's cut sites, every batch checked
against the profiled one); each step runs forward, loss, backward and the optimizer on the
same synthetic batch (``trainer``).  The ``Report`` puts the measured step time, peaks and
bytes moved next to the simulator's prediction, with the gradient check and the baselines
of ``checks`` when asked for.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from offload.core.devices import DTYPES, deterministic_kernels, make_optimizer, pick_device, running
from offload.errors import BudgetExceeded, ChainMismatch, HostMemoryShortfall, ModelError, OffloadError
from offload.models import ModelSpec, resolve
from offload.models.resolve import file_reference, file_sha256
from offload.models.spec import cache_off
from offload.step.chain import Chain
from offload.step.schedule import Schedule

from . import distributed
from .api import Offloaded
from .backends import default_backend
from .checks import EAGER_REFERENCE, GradCheck, compare_baselines, compare_steps, compiled_reference, trace_step
from .compiled import SchedulePartitioner, compile_scheduled
from .marked import WARM_STEPS, MarkedRun
from .report import Report
from .trainer import Run, Trainer, young_heap


@dataclass
class TrainOptions:
    steps: int = 5
    device: str | None = None
    backend: str | None = None  # cuda | cpu-eager | cpu-lazy (default: from the device)
    optimizer: str | None = None  # default: the one the chain was profiled with
    lr: float = 1e-4
    check_grads: bool = False
    compare: bool = False  # also time the same steps without offloading, under save_on_cpu, with selective checkpointing
    trace: str | None = None  # write a torch.profiler Chrome trace of one more step here
    op_memory: bool = False  # read memory at every stage boundary of the first step (per-op peaks)
    progress: Callable[[str, int], None] | None = None  # (what is done, steps in all) after each step


def _recipe_model(chain: Chain, model: str | None) -> ModelSpec:
    """The chain's model as its recipe builds it (not placed yet); ``model``, when given, must be
    the recipe's."""
    r = chain.recipe
    if r is None:
        raise ChainMismatch(f"chain {chain.name!r} has no recipe (profiled by an older version, or not from a "
                            "model): it cannot say which model to train", "profile the model again with `offload profile`")
    spec = resolve(_model_to_build(chain, model), r.batch, dict(r.options), r.seed)
    spec.autocast, spec.set_to_none = r.autocast, r.set_to_none
    if r.cache_off:
        cache_off(spec.module)
    return spec


def _model_to_build(chain: Chain, model: str | None) -> str:
    """The ``MODEL`` to build the chain's model from: the recipe's; for a file, found from the
    working directory or else where it was profiled (the chain's ``source.model_file``); or
    ``model``, which must name the recipe's model (for a file: the same function of the same
    file, however its path is written, or of a copy of it: ``source.model_file_sha256``)."""
    r = chain.recipe
    ours = file_reference(r.model)
    recorded, digest = chain.source.get("model_file"), chain.source.get("model_file_sha256")
    profiled = [p for p in ([ours[0]] if ours else []) + ([Path(recorded)] if isinstance(recorded, str) else [])
                if p.is_file()]
    if model is not None and model != r.model:
        theirs = file_reference(model)
        same_function = bool(ours and theirs and ours[1] == theirs[1] and theirs[0].is_file())
        if not (same_function and (any(os.path.samefile(theirs[0], p) for p in profiled)
                                   or file_sha256(theirs[0]) == digest)):
            raise ChainMismatch(f"the chain was profiled from {r.model!r}"
                                + (f" ({recorded})" if isinstance(recorded, str) else "") + f", not {model!r}"
                                + (f": {theirs[0]} is another file, its bytes differ" if same_function else ""),
                                "train the model the chain was made from, or profile this one")
        return model
    if ours and not ours[0].is_file():
        if not profiled:
            raise ModelError(f"model file not found: {ours[0]}, relative to {os.getcwd()}"
                             + (f"; it was profiled from {recorded}, gone too" if isinstance(recorded, str) else ""),
                             "give the file: offload train path/to/file.py:" + ours[1] + " --chain ...")
        return f"{profiled[0]}:{ours[1]}"
    return r.model


def build_like_chain(chain: Chain, device: torch.device, model: str | None = None) -> ModelSpec:
    """The chain's model as its recipe builds it, on ``device``."""
    spec = _recipe_model(chain, model)
    with running(f"running {chain.recipe.model}"):
        spec.place(device, DTYPES[chain.recipe.dtype])
    if chain.recipe.compile and not chain.recipe.whole_graph:  # as profiled (a graph break at each boundary)
        spec.module = torch.compile(spec.module, backend=chain.recipe.compile)
    return spec


def check_as_profiled(chain: Chain, batch: int | None = None, options: dict[str, Any] | None = None) -> None:
    """A batch size and model options asked for must be the chain's: the model is built from
    its recipe, as profiled (an option the recipe does not name was the model's default)."""
    r = chain.recipe
    if r is None:
        return
    if batch is not None and batch != r.batch:
        raise ChainMismatch(f"the chain was profiled at batch {r.batch}, not {batch}",
                            f"use --batch {r.batch}, or profile and solve again at batch {batch}")
    for key, value in (options or {}).items():
        if key not in r.options or r.options[key] != value:
            was = f"{key}={r.options[key]}" if key in r.options else f"no {key} option (the model's default)"
            raise ChainMismatch(f"the chain was profiled with {was}, not {key}={value}",
                                "train builds the model from the chain's recipe: drop -O, or profile and solve again "
                                f"with -O {key}={value}")


def check_data_parallel(chain: Chain, model: str | None = None, batch: int | None = None,
                        options: dict[str, Any] | None = None) -> None:
    """Before any rank of ``offload train --nproc`` starts: the batch and options, and the chain's
    model builds (on the ``meta`` device: no memory) and has weights to all-reduce."""
    check_as_profiled(chain, batch, options)
    with torch.device("meta"):
        spec = _recipe_model(chain, model)
    distributed.check_trainable(spec.module)


def _rank_model(chain: Chain, device: torch.device, model: str | None = None) -> ModelSpec:
    """The chain's model with this rank's batch (``offload train --nproc``; rank 0: the recipe's)."""
    spec = build_like_chain(chain, device, model)
    spec.args, spec.kwargs = distributed.own_batch(spec.args, spec.kwargs)
    return spec


def _with_grads(spec: ModelSpec) -> list[torch.Tensor]:
    """The trainable parameters, their gradients allocated (constant ``base_bytes``, as profiled;
    with ``set_to_none`` the backward allocates them)."""
    params = [p for p in spec.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None if spec.set_to_none else torch.zeros_like(p)
    return params


def train(model: str | None, chain: Chain, schedule: Schedule, opts: TrainOptions,
          batch: int | None = None, options: dict[str, Any] | None = None) -> tuple[Report, OffloadError | None]:
    """Train ``opts.steps`` steps with ``schedule``: the run's report and the error to raise once
    the report is written (a step over the budget, out of GPU or host memory), if any.
    ``batch`` and ``options``, where given, must be the chain's (``check_as_profiled``)."""
    check_as_profiled(chain, batch, options)
    _check_whole_graph(chain, opts)
    device = pick_device(opts.device)
    ranks = distributed.world_size()
    if ranks > 1:
        device = distributed.start(device)
    spec = _rank_model(chain, device, model)
    params = _with_grads(spec)
    optimizer = make_optimizer(opts.optimizer or chain.recipe.optimizer, params, opts.lr)
    backend = opts.backend or default_backend(device)
    report = Report.start(chain, schedule, backend, device, op_memory=opts.op_memory)
    report.ranks, report.steps = ranks, opts.steps
    kernels = deterministic_kernels(device) if opts.check_grads else contextlib.nullcontext(None)
    with kernels as report.deterministic, young_heap():  # both runs of a step give the same bits on CUDA too
        error = _steps(report, chain, schedule, opts, device, spec, params, optimizer, backend)
    return report, error


def _check_whole_graph(chain: Chain, opts: TrainOptions) -> None:
    """A chain of the compiled graph trains under ``compile_scheduled``: what that run cannot do
    yet is refused before anything runs."""
    if chain.recipe is None or not chain.recipe.whole_graph:  # (no recipe: refused where the model is built)
        return
    if distributed.world_size() > 1:
        raise ChainMismatch(f"chain {chain.name!r} was profiled as one compiled graph, whose run offload train does not "
                            "give --nproc yet", "train it without --nproc, or profile without --whole-graph")


def _run_whole_graph(chain: Chain, schedule: Schedule, spec: ModelSpec, backend: str, trainer: Trainer) -> nn.Module:
    """The model compiled as one graph with ``schedule`` in it, compiled by a first step (not
    measured: it compiles, and it makes the host arena)."""
    run = compile_scheduled(spec.module, chain, schedule, backend=chain.recipe.compile, copy_backend=backend,
                            fullgraph=False)  # as profiled: a loss compiled apart is allowed
    trainer.warm_up_step(lambda args, kwargs: run(*args, **kwargs), "compiling the first step")
    return run


def _marked_op_peaks(chain: Chain, schedule: Schedule, spec: ModelSpec, device: torch.device,
                     backend: str) -> dict[str, int]:
    """``--op-memory`` on a chain of the compiled graph: each op's peak in a step of the schedule
    compiled again with the profiler's marks at its stage boundaries (``marked.MarkedRun``: the
    step after ``WARM_STEPS``), as the profile read
    the chain's.  A second compile: the marks are ops of its graph, not of the run's."""
    with running("compiling the schedule again with marks at its stage boundaries (--op-memory)"):
        run = MarkedRun(spec, SchedulePartitioner(chain, schedule, copy_backend=backend, marks=True), device,
                        chain.recipe.compile)
        for _ in range(WARM_STEPS):
            run.step()
        return run.op_peaks(chain)


def _steps(report: Report, chain: Chain, schedule: Schedule, opts: TrainOptions, device: torch.device,
           spec: ModelSpec, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
           backend: str) -> OffloadError | None:
    """The training steps of ``train``, and what ``opts`` asks for beside them, into ``report``."""
    ranks = report.ranks
    check = None
    whole = chain.recipe.whole_graph
    if opts.check_grads:
        reference = _rank_model(chain, device)
        if ranks > 1:  # all-reduced like ours
            reference.module = distributed.wrap(reference.module)
        report.grad_reference = EAGER_REFERENCE
        if chain.recipe is not None and chain.recipe.compile:  # compiled as ours is, boundaries included
            plain, report.grad_reference = compiled_reference(chain, schedule, chain.recipe.compile)
            with warnings.catch_warnings():  # (ours says it: the reference recomputes what ours does)
                warnings.filterwarnings("ignore", "the schedule recomputes")
                reference.module = (compile_scheduled(reference.module, chain, plain, backend=chain.recipe.compile,
                                                      fullgraph=False) if whole
                                    else Offloaded(reference.module, chain, plain, backend))
        check = GradCheck(reference, params, device)
    trainer = Trainer(spec, params, optimizer, device, workspace_bytes=chain.workspace_bytes,
                      elsewhere=check.tensors() if check is not None else None, compiled=whole)
    warm_ups = 0 if whole else distributed.warm_up_steps(ranks)  # compiled whole: its compiling step warmed it up
    if opts.progress is not None:
        total = (trainer.steps_per_measure(opts.steps) + warm_ups + bool(opts.trace)
                 + (compare_steps(trainer, opts.steps, whole) if opts.compare else 0))
        trainer.tick = lambda what: opts.progress(what, total)
    run = None
    try:  # the front door of every user's loop: the schedule is the chain's, the batch the profiled one
        if whole:
            run = _run_whole_graph(chain, schedule, spec, backend, trainer)
        else:
            run = Offloaded(spec.module if ranks == 1 else distributed.wrap(spec.module), chain, schedule, backend)
        steps, error = trainer.measure(opts.steps, lambda args, kwargs: run(*args, **kwargs), hooks=check,
                                       runtime=None if whole else run.runtime, probe=opts.op_memory and not whole,
                                       label="offloaded" + (" (and the reference)" if check else ""),
                                       warm_up=warm_ups)
    except HostMemoryShortfall as exc:  # the host arena: nothing ran
        steps, error = Run(), exc
    completed = error is None  # every step ran (it may still have gone over the budget)
    if completed and whole and opts.op_memory:
        steps.op_peaks = _marked_op_peaks(chain, schedule, spec, device, backend)
    if completed and schedule.budget is not None:
        error = _over_budget(steps, schedule, chain)
    _measured(report, steps, run, chain)
    if completed and opts.compare:
        report.set_compare(*compare_baselines(trainer, opts.steps, steps, lambda args, kwargs: run(*args, **kwargs),
                                              chain, chain.recipe.compile if whole else None))
    if completed and opts.trace:
        report.trace = trace_step(opts.trace, trainer, run)
    if check is not None:
        report.grads_match = not any(check.mismatches) if steps.peaks else None
        report.grads_within_noise = check.within_noise if steps.peaks else None
        report.grad_mismatches, report.grad_rel_diff = check.mismatches, check.rel_diffs
        report.grad_noise_floor = check.noise_floors
        report.grads_reseeded = check.reseeded
    report.error = str(error) if error else None
    return error


def _over_budget(run: Run, schedule: Schedule, chain: Chain) -> OffloadError | None:
    over = [(n, p) for n, p in enumerate(run.peaks, 1) if schedule.budget.excess(chain, p) > 0]
    if not over:
        return None
    n, peak = over[0]
    return BudgetExceeded(f"step {n} used {schedule.budget.counted(chain, peak)} B, over the budget of {schedule.budget}",
                          "solve again with a lower budget to leave room for allocator slack, or check that the chain "
                          "was profiled on this machine")


def _measured(report: Report, steps: Run, run: nn.Module | None, chain: Chain) -> None:
    """What the steps measured, into ``report.measured``; bytes moved per step the runtime ran
    (the warm-up and the metered steps alike)."""
    m = report.measured
    report.steps_done = len(steps.peaks)
    m.set_times(steps.step_s)
    m.warmup_s, m.metered_step_s, m.reserved_peak_bytes = steps.warmup_s, steps.metered_step_s, steps.reserved_peak
    m.set_peak(max(steps.peaks) if steps.peaks else None, chain, steps.base_growth)
    m.op_peak_bytes = steps.op_peaks or None
    m.leaked_by_step, m.host_allocations = steps.leaks, steps.allocations
    m.cpu_wait_share = steps.cpu_wait_share
    if isinstance(run, Offloaded):
        runtime = run.runtime
        done = max(1, runtime.steps)
        m.host_arena_bytes, m.host_arena_grown_bytes = runtime.arena.nbytes, runtime.arena.grown
        m.d2h_bytes_per_step, m.h2d_bytes_per_step = runtime.d2h_bytes // done, runtime.h2d_bytes // done
        m.encoded_bytes_per_step = runtime.encoded_bytes // done
    elif run is not None:  # one compiled graph: its copies' runtime
        copies = run.partitioner.runtime
        done = max(1, copies.steps)
        if copies.arena is not None:
            m.host_arena_bytes, m.host_arena_grown_bytes = copies.arena.nbytes, copies.arena.grown
        m.d2h_bytes_per_step, m.h2d_bytes_per_step = copies.d2h_bytes // done, copies.h2d_bytes // done
    report.judge_peak(warn=False)  # the arena's growth known: a cause it may name
