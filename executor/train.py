"""``offload train`` as a function: train a model with a schedule and report measured vs predicted.

The model is staged exactly as its chain was (same capture method, the cuts recorded in
``chain.source``), and refused if its stages differ.  Each step runs forward, loss,
backward and the optimizer on the same synthetic batch; gradients stay allocated between
steps (``base_bytes``, as profiled).  Memory is read by the profiler's meters (the CUDA
allocator, or exact accounting on the CPU); activation memory is the reading minus the
bytes live at the step's start.  On the CPU exact accounting slows every op down several
times, so step times come from as many steps again without the meter (on a GPU the
allocator's counters cost nothing and every step gives both).  With ``check_grads`` a second copy of the model (same
seed) trains without offloading and every gradient is compared bit for bit.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch

from profiler.measure import OPTIMIZERS, persistent_tensors
from profiler.meters import CpuMeter, make_meter
from profiler.profile import pick_device, running
from solver.chain import Chain
from solver.errors import ChainMismatch, OffloadError
from solver.fileio import write_atomic
from solver.encoding import lossy_stages
from solver.schedule import Schedule
from solver.simulate import simulate

from .arena import HostArena
from .backends import make_backend
from .errors import BudgetExceeded, HostMemoryShortfall, OutOfMemory
from .overlap import copy_overlap
from .plan import StepPlan
from .runtime import OffloadRuntime
from .staging import stage_like_chain


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
    once the report is written (a step over the budget, out of GPU or host memory), if any."""
    _check_model_matches(model, batch, chain)
    device = pick_device(opts.device)
    backend = make_backend(opts.backend, device)
    spec, staged = stage_like_chain(model, chain, device)
    optimizer_name = opts.optimizer or chain.source.get("optimizer", "adam")
    params = _with_grads(spec.module)
    optimizer = _optimizer(optimizer_name, params, opts.lr)
    check, mismatches, diffs = None, [], []
    if opts.check_grads:
        ref_spec, ref_staged = stage_like_chain(model, chain, device)
        ref_params = _with_grads(ref_spec.module)
        reference = (ref_spec, ref_staged, ref_params)
        def check() -> None:
            differ, rel = _reference_step(reference, params)
            mismatches.append(differ)
            diffs.append(rel)

    sim = simulate(chain, schedule.offloads, encode=schedule.encode)
    base = chain.base_bytes if schedule.budget_scope == "total" else 0
    trainer = _Trainer(spec, params, optimizer, device)
    plan = StepPlan.from_schedule(chain, schedule)
    runtime, error, trace = None, None, None
    try:
        runtime = OffloadRuntime(staged, plan, backend)
        run, error = trainer.measure(opts.steps, runtime.step, runtime.forward, after_backward=check,
                                     arena=runtime.arena, probe=runtime if opts.op_memory else None)
    except HostMemoryShortfall as exc:
        run, error = _Run(), exc
    completed = error is None  # every step ran (it may still have gone over the budget)
    done = max(1, run.steps_run)
    moved = (runtime.d2h_bytes // done, runtime.h2d_bytes // done) if runtime else (0, 0)  # before the traced step
    encoded = runtime.encoded_bytes // done if runtime else 0
    if completed and schedule.budget_bytes is not None:
        over = [(n, p) for n, p in enumerate(run.peaks, 1) if p + base > schedule.budget_bytes]
        if over:
            n, peak = over[0]
            error = BudgetExceeded(f"step {n} used {peak + base} B, over the budget of {schedule.budget_bytes} B",
                                   "solve again with a lower budget to leave room for allocator slack, or check "
                                   "that the chain was profiled on this machine")
    compare = None
    if completed and opts.compare:
        compare = _compare(trainer, staged, opts.steps, run, base)
    if completed and opts.trace:
        trace = _trace_step(opts.trace, trainer, runtime)
    arena = runtime.arena if runtime else None
    report = {
        "model": model, "chain": {"name": chain.name, "sha256": chain.sha256}, "method": schedule.method,
        "backend": backend.name, "device": str(device), "steps": opts.steps, "steps_done": len(run.peaks),
        "budget_bytes": schedule.budget_bytes, "budget_scope": schedule.budget_scope,
        "measured": {
            **run.summary(base),
            "d2h_bytes_per_step": moved[0], "h2d_bytes_per_step": moved[1], "encoded_bytes_per_step": encoded,
            **({"op_peak_bytes": {op: b + base for op, b in run.op_peaks.items()}} if run.op_peaks else {}),
            "host_arena_bytes": arena.nbytes if arena else 0, "host_allocations": run.allocations,
        },
        "predicted": {"makespan_s": sim.makespan_s, "peak_bytes": sim.peak_bytes + base, "stall_s": sim.stall_s,
                      "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes,
                      **({"op_bytes": {o.name: o.mem_bytes + base for o in sim.ops}} if opts.op_memory else {})},
        "grads_match": (not any(mismatches)) if check is not None and run.peaks else None,
        "grad_mismatches": mismatches if check is not None else None,
        # lossy encodings change gradients on purpose: by how much (||ours - reference|| / ||reference||)
        # (per step, from the same weights)
        "grad_rel_diff": diffs if check is not None else None,
        "encoded_units": {str(i): name for i, name in sorted(schedule.encode.items())},
        "lossy": bool(lossy_stages(chain, schedule.encode)),
        "compare": compare,
        "trace": trace,
        "error": str(error) if error else None,
    }
    return report, error


@dataclass
class _Run:
    """What the measured steps of one way of training left behind."""

    step_s: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)  # activation bytes: the step's peak over its start
    leaks: list[int] = field(default_factory=list)  # bytes still live after the step, over its start
    allocations: list[int] = field(default_factory=list)  # host arena buffers so far, after each step
    op_peaks: dict[str, int] = field(default_factory=dict)  # first step, per op (with TrainOptions.op_memory)
    metered_step_s: list[float] = field(default_factory=list)  # CPU: the metered steps' times (not step_s)

    @property
    def steps_run(self) -> int:
        return len(self.step_s) + len(self.metered_step_s)

    def summary(self, base: int) -> dict[str, Any]:
        if not self.peaks:
            return {"step_s": None, "peak_bytes": None, "peak_activation_bytes": None,
                    "leaked_bytes_after_step": None, "leaked_by_step": []}
        times = {"median": statistics.median(self.step_s), "min": min(self.step_s), "max": max(self.step_s),
                 "all": self.step_s} if self.step_s else None
        return {"step_s": times, **({"metered_step_s": self.metered_step_s} if self.metered_step_s else {}),
                "peak_bytes": max(self.peaks) + base, "peak_activation_bytes": max(self.peaks),
                "leaked_bytes_after_step": max(self.leaks), "leaked_by_step": self.leaks}


class _Trainer:
    """Runs measured training steps of one model, whatever wraps the step (offloading or a baseline)."""

    def __init__(self, spec: Any, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                 device: torch.device) -> None:
        self.spec, self.params, self.optimizer, self.device = spec, params, optimizer, device

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream, the copy streams included

    def one_step(self, wrap: Callable[[], ContextManager], forward: Callable[..., torch.Tensor]) -> None:
        inputs = tuple(t.clone() for t in self.spec.inputs)
        with wrap():
            loss = self.spec.loss(forward(*inputs))
            loss.backward()
        del loss, inputs

    def finish_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
        for p in self.params:
            p.grad.zero_()

    def measure(self, steps: int, wrap: Callable[[], ContextManager], forward: Callable[..., torch.Tensor],
                after_backward: Callable[[], None] | None = None, arena: HostArena | None = None,
                probe: OffloadRuntime | None = None) -> tuple[_Run, OffloadError | None]:
        """``steps`` steps with memory metered; on the CPU, where exact accounting slows every op
        down several times, ``steps`` more without the meter give the step times.  On running out
        of memory: the steps before it, and the error.  With a ``probe`` runtime, the first step's
        memory is read at every op's end too (``run.op_peaks``)."""
        run, error = self._metered(steps, wrap, forward, after_backward, arena, probe)
        if error is None and self.device.type != "cuda":
            run.metered_step_s = run.step_s
            run.step_s, error = self._timed(steps, wrap, forward)
        return run, error

    def _timed(self, steps: int, wrap: Callable[[], ContextManager],
               forward: Callable[..., torch.Tensor]) -> tuple[list[float], OffloadError | None]:
        times: list[float] = []
        for step in range(1, steps + 1):
            try:
                with _step_errors(f"timed step {step}"):
                    self.synchronize()
                    t0 = time.perf_counter()
                    self.one_step(wrap, forward)
                    self.synchronize()
                    times.append(time.perf_counter() - t0)
                    gc.collect()  # outside the timed window: a full collection costs ~0.15 s
            except OffloadError as exc:
                return times, exc
            self.finish_step()
        return times, None

    def _metered(self, steps: int, wrap: Callable[[], ContextManager], forward: Callable[..., torch.Tensor],
                 after_backward: Callable[[], None] | None, arena: HostArena | None,
                 probe: OffloadRuntime | None = None) -> tuple[_Run, OffloadError | None]:
        run = _Run()
        for step in range(1, steps + 1):
            persistent = persistent_tensors(self.spec.module, self.optimizer, self.device)
            meter = make_meter(self.device)
            if isinstance(meter, CpuMeter) and arena is not None:
                meter.ignore(arena.chunks)
            try:
                with _step_errors(f"training step {step}"):
                    self.synchronize()
                    t0 = time.perf_counter()
                    with meter:
                        meter.track(persistent)
                        meter.boundary()
                        m0 = meter.live
                        if probe is not None and step == 1:
                            probe.meter = meter
                        self.one_step(wrap, forward)
                        self.synchronize()
                        elapsed = time.perf_counter() - t0
                        gc.collect()  # reference cycles (closures over tensors) are only freed by the collector
                        peak, live = meter.boundary()
                        if probe is not None and step == 1:
                            probe.op_peaks["B1"] = peak
                            run.op_peaks = {op: p - m0 for op, p in probe.op_peaks.items()}
                            peak = max(probe.op_peaks.values())
            except OffloadError as exc:
                return run, exc
            finally:
                meter.close()
                if probe is not None:
                    probe.meter = None
            run.step_s.append(elapsed)
            run.peaks.append(peak - m0)
            run.leaks.append(live - m0)
            run.allocations.append(arena.allocations if arena else 0)
            if after_backward is not None:
                after_backward()
            self.finish_step()
        return run, None


@contextlib.contextmanager
def _step_errors(what: str) -> Iterator[None]:
    with running(what):
        try:
            yield
        except torch.cuda.OutOfMemoryError as exc:
            raise OutOfMemory(f"{what}: out of GPU memory ({str(exc).splitlines()[0][:200]})",
                              "the step needs more than the chain predicts: solve again with a lower budget to "
                              "leave room for allocator slack and other processes (`nvidia-smi` shows them), "
                              "or profile the chain again on this machine") from None


def _compare(trainer: _Trainer, staged: Any, steps: int, ours: _Run, base: int) -> dict[str, Any]:
    """The same steps without offloading and under ``save_on_cpu``, and our step time against both."""
    pin = trainer.device.type == "cuda"
    ways = {"no_offload": contextlib.nullcontext,
            "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)}
    out: dict[str, Any] = {}
    for name, wrap in ways.items():
        run, error = trainer.measure(steps, wrap, staged)
        out[name] = {**run.summary(base), "error": str(error) if error else None}
        if run.step_s and ours.step_s:
            out[f"step_time_vs_{name}"] = statistics.median(ours.step_s) / statistics.median(run.step_s)
    return out


def _trace_step(path: str, trainer: _Trainer, runtime: OffloadRuntime) -> dict[str, Any]:
    """One more step with offloading under ``torch.profiler``: a Chrome trace, and how much of its
    copy time overlaps GPU compute (``None`` on the CPU, where there are no GPU copies)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with _step_errors("the traced step"), torch.profiler.profile(activities=activities) as prof:
        trainer.one_step(runtime.step, runtime.forward)
        trainer.synchronize()
    gc.collect()
    trainer.finish_step()
    with tempfile.TemporaryDirectory() as scratch:  # the profiler exports to a path, not a file object
        exported = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(exported))
        text = exported.read_text()
    write_atomic(path, lambda fh: fh.write(text))
    return {"path": str(path), "copy_overlap": copy_overlap(json.loads(text)["traceEvents"])}


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


def _reference_step(reference: tuple, params: list[torch.Tensor]) -> tuple[int, float]:
    """The same step without offloading, from our model's weights of this step: how many
    gradients differ, and the relative L2 distance of all of them (``||ours - ref|| / ||ref||``).

    The reference takes our weights each step instead of training alongside: PyTorch's CPU
    optimizers are not bit-reproducible from run to run here (two identical models updated by
    identical Adam steps drift apart in about one process in six), which would be blamed on
    the offloading."""
    spec, staged, ref_params = reference
    with torch.no_grad():
        for mine, ref in zip(params, ref_params):
            ref.copy_(mine)
    loss = spec.loss(staged(*(t.clone() for t in spec.inputs)))
    loss.backward()
    differ = sum(not torch.equal(a.grad, b.grad) for a, b in zip(params, ref_params))
    diff = sum(float((a.grad.double() - b.grad.double()).square().sum()) for a, b in zip(params, ref_params))
    norm = sum(float(b.grad.double().square().sum()) for b in ref_params)
    rel = (diff / norm) ** 0.5 if norm > 0 else 0.0
    for p in ref_params:
        p.grad.zero_()
    return differ, rel

