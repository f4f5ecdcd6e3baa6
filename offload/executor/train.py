"""``offload train`` as a function: train a chain's model with a schedule; measured vs predicted.

The model is rebuilt from the chain's recipe (model, options, batch, dtype, seed) and
staged at the recipe's cut sites (``api.stage_like_chain``); each step runs forward, loss,
backward and the optimizer on the same synthetic batch (``trainer``).  The report puts the
measured step time, peak and bytes moved next to the simulator's prediction, with the
gradient check and the baselines of ``checks`` when asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offload.core.devices import DTYPES, make_optimizer, pick_device, running
from offload.errors import BudgetExceeded, ChainMismatch, HostMemoryShortfall, OffloadError
from offload.models import ModelSpec, resolve
from offload.step.chain import Chain
from offload.step.encoding import lossy_stages
from offload.step.schedule import Schedule
from offload.step.simulate import Simulation, simulate

from . import distributed
from .api import stage_like_chain
from .backends import make_backend
from .checks import GradCheck, compare_baselines, trace_step
from .plan import StepPlan
from .runtime import OffloadRuntime
from .trainer import Run, Trainer


@dataclass
class TrainOptions:
    steps: int = 5
    device: str | None = None
    backend: str | None = None  # cuda | cpu-eager | cpu-lazy (default: from the device)
    optimizer: str | None = None  # default: the one the chain was profiled with
    lr: float = 1e-4
    check_grads: bool = False
    compare: bool = False  # also time the same steps without offloading and under save_on_cpu
    trace: str | None = None  # write a torch.profiler Chrome trace of one more step here
    op_memory: bool = False  # read memory at every stage boundary of the first step (per-op peaks)


def build_like_chain(chain: Chain, device: torch.device, model: str | None = None) -> ModelSpec:
    """The chain's model as its recipe builds it, on ``device``; ``model``, when given, must be the
    recipe's."""
    r = chain.recipe
    if r is None:
        raise ChainMismatch(f"chain {chain.name!r} has no recipe (profiled by an older version, or not from a "
                            "model): it cannot say which model to train", "profile the model again with `offload profile`")
    if model is not None and model != r.model:
        raise ChainMismatch(f"the chain was profiled from {r.model!r}, not {model!r}",
                            "train the model the chain was made from, or profile this one")
    spec = resolve(r.model, r.batch, dict(r.options), r.seed)
    spec.autocast, spec.set_to_none = r.autocast, r.set_to_none
    with running(f"running {r.model}"):
        spec.place(device, DTYPES[r.dtype])
    return spec


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
          batch: int | None = None) -> tuple[dict[str, Any], OffloadError | None]:
    """Train ``opts.steps`` steps with ``schedule``: the run report (JSON-able) and the error to raise
    once the report is written (a step over the budget, out of GPU or host memory), if any."""
    if batch is not None and chain.recipe is not None and batch != chain.recipe.batch:
        raise ChainMismatch(f"the chain was profiled at batch {chain.recipe.batch}, not {batch}",
                            f"use --batch {chain.recipe.batch}, or profile and solve again at batch {batch}")
    device = pick_device(opts.device)
    ranks = distributed.world_size()
    if ranks > 1:
        device = distributed.start(device)
    backend = make_backend(opts.backend, device)
    spec = _rank_model(chain, device, model)
    staging = stage_like_chain(spec.module if ranks == 1 else distributed.wrap(spec.module), chain)
    params = _with_grads(spec)
    optimizer = make_optimizer(opts.optimizer or chain.recipe.optimizer, params, opts.lr)
    check = None
    if opts.check_grads:
        reference = _rank_model(chain, device)
        if ranks > 1:  # all-reduced like ours
            reference.module = distributed.wrap(reference.module)
        check = GradCheck(reference, params, device)
    base = schedule.budget.base(chain) if schedule.budget else 0
    trainer = Trainer(spec, params, optimizer, device)
    runtime, error = None, None
    try:
        runtime = OffloadRuntime(staging, StepPlan.from_schedule(chain, schedule), backend, device)
        run, error = trainer.measure(opts.steps, runtime.forward, hooks=check, runtime=runtime, probe=opts.op_memory)
    except HostMemoryShortfall as exc:
        run, error = Run(), exc
    completed = error is None  # every step ran (it may still have gone over the budget)
    if completed and schedule.budget is not None:
        error = _over_budget(run, schedule, base)
    moved = _moved(runtime, run)  # before the baselines and the traced step
    compare = compare_baselines(trainer, opts.steps, run, base) if completed and opts.compare else None
    trace = trace_step(opts.trace, trainer, runtime) if completed and opts.trace else None
    sim = simulate(chain, schedule.offloads, encode=schedule.encode, recompute=schedule.recompute)
    report = _report(chain, schedule, opts, backend.name, device, run, runtime, moved, sim, base, check)
    report.update(compare=compare, trace=trace, error=str(error) if error else None)
    return report, error


def _over_budget(run: Run, schedule: Schedule, base: int) -> OffloadError | None:
    over = [(n, p) for n, p in enumerate(run.peaks, 1) if p + base > schedule.budget.nbytes]
    if not over:
        return None
    n, peak = over[0]
    return BudgetExceeded(f"step {n} used {peak + base} B, over the budget of {schedule.budget}",
                          "solve again with a lower budget to leave room for allocator slack, or check that the chain "
                          "was profiled on this machine")


def _moved(runtime: OffloadRuntime | None, run: Run) -> dict[str, int]:
    done = max(1, run.steps_run)
    if runtime is None:
        return {"d2h_bytes_per_step": 0, "h2d_bytes_per_step": 0, "encoded_bytes_per_step": 0}
    return {"d2h_bytes_per_step": runtime.d2h_bytes // done, "h2d_bytes_per_step": runtime.h2d_bytes // done,
            "encoded_bytes_per_step": runtime.encoded_bytes // done}


def _report(chain: Chain, schedule: Schedule, opts: TrainOptions, backend: str, device: torch.device, run: Run,
            runtime: OffloadRuntime | None, moved: dict[str, int], sim: Simulation, base: int,
            check: GradCheck | None) -> dict[str, Any]:
    arena = runtime.arena if runtime else None
    return {
        "model": chain.recipe.model, "chain": {"name": chain.name, "sha256": chain.sha256}, "method": schedule.method,
        "backend": backend, "device": str(device), "ranks": distributed.world_size(), "steps": opts.steps, "steps_done": len(run.peaks),
        "budget_bytes": schedule.budget.nbytes if schedule.budget else None,
        "budget_scope": schedule.budget.scope if schedule.budget else None,
        "measured": {
            **run.summary(base), **moved,
            **({"op_peak_bytes": {op: b + base for op, b in run.op_peaks.items()}} if run.op_peaks else {}),
            "host_arena_bytes": arena.nbytes if arena else 0, "host_allocations": run.allocations,
        },
        "predicted": {"makespan_s": sim.makespan_s, "peak_bytes": sim.peak_bytes + base, "stall_s": sim.stall_s,
                      "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes,
                      **({"op_bytes": {o.name: o.mem_bytes + base for o in sim.ops}} if opts.op_memory else {})},
        "grads_match": (not any(check.mismatches)) if check is not None and run.peaks else None,
        "grad_mismatches": check.mismatches if check is not None else None,
        # lossy encodings change gradients on purpose: by how much, per step, from the same weights
        "grad_rel_diff": check.rel_diffs if check is not None else None,
        "encoded_units": {str(i): name for i, name in sorted(schedule.encode.items())},
        "lossy": bool(lossy_stages(chain, schedule.encode)),
    }
