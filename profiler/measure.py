"""Measure a staged model's training step, stage by stage (DESIGN section 3).

One *memory pass* and several *timing passes* of the same step (forward, loss, backward;
the optimizer's update is outside the chain and timed apart):

* memory pass: a meter (``meters``) is read at every stage boundary, and a
  ``saved_tensors_hooks`` pack hook records every storage saved for backward with the
  stage that saved it.  Storages are deduplicated across the whole model; a unit belongs
  to the first stage that saves it, and its ``need_from`` is the last stage that saves it
  (the first backward to read it).  Parameters, buffers and the input batch are never part
  of a unit.
  With ``M0`` the bytes live when the step starts (weights, gradients, optimizer state)
  and ``U_j`` the units, the transients are ``fwd_peak_i = peak(F_i) − M0 − Σ_{j<i} U_j``
  and ``bwd_peak_i = peak(B_i) − M0 − Σ_{j≤i} U_j``: exactly what the chain model adds on
  top of the resident units;
* timing passes: warm-up steps, then ``repeats`` steps timed at the boundaries (CUDA events
  or ``perf_counter``); each stage's time is the median over the repeats.

Gradients are kept allocated between steps (``zero_grad(set_to_none=False)``), so that
they are part of the constant ``base_bytes`` as the chain model assumes.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .meters import Clock, make_meter
from .staged import StagedModel, StageListener
from .zoo import ModelSpec

OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-4),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
    "none": None,
}


@dataclass
class StageMeasurement:
    fwd_s: float
    bwd_s: float
    saved_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    need_from: int
    fwd_spread: float = 0.0  # (max - min) / median over the repeats
    bwd_spread: float = 0.0


@dataclass
class Measurement:
    stages: list[StageMeasurement]
    base_bytes: int
    base_parts: dict[str, int]
    step_s: list[float]  # forward + backward of each timed repeat
    optimizer_step_s: float
    notes: list[str] = field(default_factory=list)


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (shared by all its views)."""
    return t.untyped_storage()._cdata


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def persistent_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                       device: torch.device) -> list[torch.Tensor]:
    """Every tensor that lives across steps on ``device``: weights, buffers, gradients, optimizer
    state and plain tensor attributes (the constant ``base_bytes``, never part of a unit)."""
    out = list(module.parameters()) + list(module.buffers())
    out += [p.grad for p in module.parameters() if p.grad is not None]
    if optimizer is not None:
        out += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for sub in module.modules():
        out += [v for v in vars(sub).values() if isinstance(v, torch.Tensor)]
    return [t for t in out if t.device.type == device.type]


class _Recorder(StageListener):
    """Tracks the current stage; reads the meter/clock at boundaries; records saved storages."""

    def __init__(self, L: int, on_boundary: Callable[[], None], excluded: set[int] | None = None) -> None:
        self.L, self.stage = L, 1
        self.on_boundary = on_boundary
        self.excluded = excluded if excluded is not None else set()
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}

    def forward_boundary(self, k: int) -> None:
        self.on_boundary()
        self.stage = k + 1

    def backward_boundary(self, k: int) -> None:
        self.on_boundary()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.excluded:
            self.first.setdefault(key, self.stage)
            self.last[key] = self.stage
            self.nbytes[key] = t.untyped_storage().nbytes()
        return t

    def units(self) -> tuple[list[int], list[int]]:
        saved, need = [0] * (self.L + 1), list(range(self.L + 1))
        for key, i in self.first.items():
            saved[i] += self.nbytes[key]
            need[i] = max(need[i], self.last[key])
        return saved[1:], need[1:]


class StepRunner:
    """One model on one device with its optimizer: runs and measures training steps."""

    def __init__(self, staged: StagedModel, spec: ModelSpec, device: torch.device, optimizer: str) -> None:
        self.staged, self.spec, self.device = staged, spec, device
        self.params = [p for p in spec.module.parameters() if p.requires_grad]
        make = OPTIMIZERS[optimizer]
        self.optimizer = make(self.params) if make and self.params else None

    def run_step(self, listener: StageListener | None, pack: Callable | None = None,
                 exclude: set[int] | None = None) -> tuple[Any, torch.Tensor]:
        """Forward and loss of one step on a fresh copy of the batch; its storages are added
        to ``exclude``: the batch belongs to the training loop, which holds it through the
        step, so it is never part of a unit (offloading it would free nothing)."""
        inputs = tuple(t.clone() for t in self.spec.inputs)
        if exclude is not None:
            exclude.update(storage_key(t) for t in inputs)
        ctx = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack else contextlib.nullcontext())
        if listener is None:
            out = self.staged(*inputs)
            return out, self.spec.loss(out)
        with self.staged.listening(listener), ctx:
            out = self.staged(*inputs)
            loss = self.spec.loss(out)
        return out, loss

    def zero_grads(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def warmup(self, steps: int) -> float:
        """Full steps (optimizer included) so that gradients and optimizer state exist.

        Returns the seconds of the last optimizer update (outside the chain, reported apart)."""
        update_s = 0.0
        for _ in range(max(1, steps)):
            _, loss = self.run_step(None)
            loss.backward()
            if self.optimizer is not None:
                self.sync()
                t = time.perf_counter()
                self.optimizer.step()
                self.sync()
                update_s = time.perf_counter() - t
            self.zero_grads()
        return update_s

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def base_parts(self) -> dict[str, int]:
        m = self.spec.module
        parts = {"parameters": _tensor_bytes(m.parameters()), "buffers": _tensor_bytes(m.buffers()),
                 "gradients": _tensor_bytes(p.grad for p in self.params if p.grad is not None)}
        if self.optimizer is not None:
            parts["optimizer"] = _tensor_bytes(v for st in self.optimizer.state.values() for v in st.values()
                                               if isinstance(v, torch.Tensor) and v.dim() > 0)
        return parts

    def memory_pass(self) -> tuple[int, list[int], list[int], list[int], list[int]]:
        """(M0, peak of each F_i, peak of each B_i, saved bytes, need_from) from one step."""
        L = self.staged.L
        meter = make_meter(self.device)
        readings: list[tuple[int, int]] = []
        # never part of a unit: constant memory, counted in M0
        persistent = persistent_tensors(self.spec.module, self.optimizer, self.device)
        rec = _Recorder(L, lambda: readings.append(meter.boundary()), {storage_key(t) for t in persistent})
        with meter:
            meter.track(persistent)
            meter.boundary()
            m0 = meter.live
            loss = self.run_step(rec, rec.pack, rec.excluded)[1]  # the output is not held (a loop holds the loss)
            readings.append(meter.boundary())
            loss.backward()
            readings.append(meter.boundary())
            del loss
        meter.close()
        self.zero_grads()
        if len(readings) != 2 * L:
            raise RuntimeError(f"expected {2 * L} stage boundaries in a step, saw {len(readings)}")
        saved, need = rec.units()
        return m0, [p for p, _ in readings[:L]], [p for p, _ in readings[L:]][::-1], saved, need

    def timing_pass(self) -> tuple[list[float], list[float]]:
        """(forward seconds of each stage, backward seconds of each stage) of one step."""
        fwd, bwd = Clock(self.device), Clock(self.device)
        rec = _Recorder(self.staged.L, lambda: (bwd if bwd.marks else fwd).mark())
        self.sync()
        fwd.mark()
        out, loss = self.run_step(rec)
        fwd.mark()
        bwd.mark()
        loss.backward()
        bwd.mark()
        f, b = fwd.intervals(), bwd.intervals()[::-1]
        del out, loss
        self.zero_grads()
        return f, b


def _spread(values: list[float]) -> float:
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


def measure(runner: StepRunner, repeats: int, warmup: int, tick: Callable[[str], None] = lambda _: None) -> Measurement:
    """Warm up, take the memory pass, then ``repeats`` timing passes (``tick(phase)`` as each ends)."""
    update_s = runner.warmup(warmup)
    tick("warm-up")
    m0, peak_f, peak_b, saved, need = runner.memory_pass()
    tick("memory pass")
    times = []
    for _ in range(repeats):
        times.append(runner.timing_pass())
        tick("timed steps")
    L = runner.staged.L
    stages = []
    resident = 0
    for i in range(L):
        fwd = [t[0][i] for t in times]
        bwd = [t[1][i] for t in times]
        fwd_peak = peak_f[i] - m0 - resident
        bwd_peak = peak_b[i] - m0 - resident - saved[i]
        resident += saved[i]
        stages.append(StageMeasurement(statistics.median(fwd), statistics.median(bwd), saved[i], fwd_peak, bwd_peak,
                                       need[i], _spread(fwd), _spread(bwd)))
    step = [sum(f) + sum(b) for f, b in times]
    return Measurement(stages, m0, runner.base_parts(), step, update_s)
