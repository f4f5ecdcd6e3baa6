"""``offload train`` as a function: train a model with a schedule and report measured vs predicted.

The model is staged exactly as its chain was (same capture method, the cuts recorded in
``chain.source``), and refused if its stages differ.  Each step runs forward, loss,
backward and the optimizer on the same synthetic batch; gradients stay allocated between
steps (``base_bytes``, as profiled).  Memory is read by the profiler's meters (the CUDA
allocator, or exact accounting on the CPU); activation memory is the reading minus the
bytes live at the step's start.  With ``check_grads`` a second copy of the model (same
seed) trains without offloading and every gradient is compared bit for bit.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from profiler.capture import capture
from profiler.linearize import stage_model
from profiler.measure import OPTIMIZERS, persistent_tensors
from profiler.meters import CpuMeter, make_meter
from profiler.models import resolve
from profiler.profile import DTYPES, pick_device, place, running
from solver.chain import Chain
from solver.errors import ChainMismatch, OffloadError
from solver.schedule import Schedule
from solver.simulate import simulate

from .backends import make_backend
from .plan import StepPlan
from .runtime import OffloadRuntime


class BudgetExceeded(OffloadError):
    """A measured step went over the schedule's budget (the report is still written)."""

    exit_code = 6


@dataclass
class TrainOptions:
    steps: int = 5
    device: str | None = None
    backend: str | None = None  # cuda | cpu-eager | cpu-lazy (default: from the device)
    optimizer: str | None = None  # default: the one the chain was profiled with
    lr: float = 1e-4
    check_grads: bool = False


def stage_like_chain(model: str, chain: Chain, device: torch.device) -> tuple[Any, Any]:
    """(ModelSpec, StagedModel) of ``model`` built and cut exactly as ``chain`` was profiled, or ``ChainMismatch``."""
    src = chain.source
    spec = resolve(model, int(src.get("batch", 0)), dict(src.get("options", {})), int(src.get("seed", 0)))
    with running(f"running {model}"):
        place(spec, device, DTYPES[src.get("dtype", "float32")])
        cap = capture(spec.module, spec.inputs, src.get("capture", "auto"))
    cuts = list(src.get("cuts", []))
    missing = [c for c in cuts if c not in cap.candidates]
    if missing or len(cuts) != chain.L - 1:
        raise ChainMismatch(f"{model} cannot be staged like chain {chain.name!r}: cut point(s) {missing[:3]} not found",
                            "profile this model again (`offload profile`) and solve on the new chain")
    staged = stage_model(cap, cuts)
    names = [s.name for s in staged.stages]
    if names != [s.name for s in chain.stages]:
        raise ChainMismatch(f"{model}'s stages differ from chain {chain.name!r}'s",
                            "the chain was profiled from another model or version: profile it again")
    return spec, staged


def _check_model_matches(model: str, batch: int | None, chain: Chain) -> None:
    src = chain.source
    if src.get("model") != model:
        raise ChainMismatch(f"the chain was profiled from {src.get('model')!r}, not {model!r}",
                            "train the model the chain was made from, or profile this one")
    if batch is not None and int(src.get("batch", -1)) != batch:
        raise ChainMismatch(f"the chain was profiled at batch {src.get('batch')}, not {batch}",
                            f"use --batch {src.get('batch')}, or profile and solve again at batch {batch}")


def train(model: str, chain: Chain, schedule: Schedule, opts: TrainOptions,
          batch: int | None = None) -> tuple[dict[str, Any], OffloadError | None]:
    """Train ``opts.steps`` steps with ``schedule``: the run report (JSON-able) and the error to raise
    once the report is written (a step over the budget), if any."""
    _check_model_matches(model, batch, chain)
    device = pick_device(opts.device)
    backend = make_backend(opts.backend or ("cuda" if device.type == "cuda" else "cpu-eager"), device)
    spec, staged = stage_like_chain(model, chain, device)
    optimizer_name = opts.optimizer or chain.source.get("optimizer", "adam")
    params = _with_grads(spec.module)
    optimizer = _optimizer(optimizer_name, params, opts.lr)
    reference = None
    if opts.check_grads:
        ref_spec, ref_staged = stage_like_chain(model, chain, device)
        ref_params = _with_grads(ref_spec.module)
        reference = (ref_spec, ref_staged, ref_params, _optimizer(optimizer_name, ref_params, opts.lr))

    plan = StepPlan.from_schedule(chain, schedule)
    runtime = OffloadRuntime(staged, plan, backend, list(spec.module.parameters()) + list(spec.module.buffers()))
    sim = simulate(chain, schedule.offloads)
    base = chain.base_bytes if schedule.budget_scope == "total" else 0
    steps, peaks, leaks, allocations, mismatches = [], [], [], [], []
    error: OffloadError | None = None
    for step in range(opts.steps):
        persistent = persistent_tensors(spec.module, optimizer, device)
        meter = make_meter(device)
        if isinstance(meter, CpuMeter):
            meter.ignore(runtime.arena.chunks)
        with running(f"training step {step + 1}"):
            backend.synchronize()
            t0 = time.perf_counter()
            with meter:
                meter.track(persistent)
                meter.boundary()
                m0 = meter.live
                inputs = tuple(t.clone() for t in spec.inputs)
                with runtime.step():
                    loss = spec.loss(runtime.forward(*inputs))
                    loss.backward()
                del loss, inputs
                gc.collect()  # reference cycles (closures over tensors) are only freed by the collector
                peak, live = meter.boundary()
            backend.synchronize()
            steps.append(time.perf_counter() - t0)
            meter.close()
        peaks.append(peak - m0)
        leaks.append(live - m0)
        allocations.append(runtime.arena.allocations)
        if reference is not None:
            mismatches.append(_reference_step(reference, params))
        if optimizer is not None:
            optimizer.step()
        for p in params:
            p.grad.zero_()
        if schedule.budget_bytes is not None and peaks[-1] + base > schedule.budget_bytes and error is None:
            error = BudgetExceeded(f"step {step + 1} used {peaks[-1] + base} B, over the budget of "
                                   f"{schedule.budget_bytes} B", "solve again with a lower budget to leave room "
                                   "for allocator slack, or check that the chain was profiled on this machine")
    report = {
        "model": model, "chain": {"name": chain.name, "sha256": chain.sha256}, "method": schedule.method,
        "backend": backend.name, "device": str(device), "steps": opts.steps,
        "budget_bytes": schedule.budget_bytes, "budget_scope": schedule.budget_scope,
        "measured": {
            "step_s": {"median": statistics.median(steps), "min": min(steps), "max": max(steps), "all": steps},
            "peak_bytes": max(peaks) + base, "peak_activation_bytes": max(peaks),
            "d2h_bytes_per_step": runtime.d2h_bytes // opts.steps, "h2d_bytes_per_step": runtime.h2d_bytes // opts.steps,
            "leaked_bytes_after_step": max(leaks), "leaked_by_step": leaks,
            "host_arena_bytes": runtime.arena.nbytes, "host_allocations": allocations,
        },
        "predicted": {"makespan_s": sim.makespan_s, "peak_bytes": sim.peak_bytes + base, "stall_s": sim.stall_s,
                      "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes},
        "grads_match": (not any(mismatches)) if reference is not None else None,
        "grad_mismatches": mismatches if reference is not None else None,
        "error": str(error) if error else None,
    }
    return report, error


def _optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer | None:
    make = OPTIMIZERS[name]
    if make is None:
        return None
    optimizer = make(params)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return optimizer


def _with_grads(module: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable parameters, their gradients allocated (constant ``base_bytes``, as profiled)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


def _reference_step(reference: tuple, params: list[torch.Tensor]) -> int:
    """One step of the reference model without offloading; how many gradients differ."""
    spec, staged, ref_params, ref_opt = reference
    loss = spec.loss(staged(*(t.clone() for t in spec.inputs)))
    loss.backward()
    differ = sum(not torch.equal(a.grad, b.grad) for a, b in zip(params, ref_params))
    if ref_opt is not None:
        ref_opt.step()
    for p in ref_params:
        p.grad.zero_()
    return differ

