"""What ``offload train`` compares a run with: the same model trained without offloading
(gradients, bit for bit), the same steps without offloading and under ``save_on_cpu``
(step time and peak), and a ``torch.profiler`` trace of one more step (copy overlap).

The gradient check is exact with dropout on: before each of our steps the random state
(CPU and CUDA generators) is saved; the reference step replays it, so it draws the same
dropout masks, and the state after our step is then put back, so training goes on as if
the reference had not run.  The reference takes our weights each step instead of training
alongside: PyTorch's CPU optimizers are not bit-reproducible from run to run (two
identical models updated by identical Adam steps drift apart in about one process in
six), which would be blamed on the offloading.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from offload.io.files import write_atomic
from offload.models.spec import ModelSpec
from offload.step.chain import Chain

from .api import Offloaded
from .overlap import copy_overlap
from .report import Baseline
from .trainer import Run, StepHooks, Trainer, step_errors


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class GradCheck(StepHooks):
    """After each step, the same step of ``reference`` (a copy of the model, without offloading)
    from our weights and our random numbers: how many gradients differ, and by how much."""

    def __init__(self, reference: ModelSpec, params: list[torch.Tensor], device: torch.device) -> None:
        self.reference, self.params, self.device = reference, params, device
        self.ref_params = [p for p in reference.module.parameters() if p.requires_grad]
        for p in self.ref_params:
            p.grad = torch.zeros_like(p)
        self.mismatches: list[int] = []
        self.rel_diffs: list[float] = []  # ||ours - reference|| / ||reference||, per step

    def before_step(self) -> None:
        self.state = _rng_state(self.device)

    def after_step(self) -> None:
        after = _rng_state(self.device)
        _set_rng_state(self.state, self.device)
        with torch.no_grad():
            for mine, ref in zip(self.params, self.ref_params):
                ref.copy_(mine)
        args, kwargs = self.reference.batch()
        with self.reference.autocasting():
            loss = self.reference.loss(self.reference.module(*args, **kwargs))
        loss.backward()
        _set_rng_state(after, self.device)
        pairs = list(zip(self.params, self.ref_params))
        self.mismatches.append(sum(not torch.equal(a.grad, b.grad) for a, b in pairs))
        diff = sum(float((a.grad.double() - b.grad.double()).square().sum()) for a, b in pairs)
        norm = sum(float(b.grad.double().square().sum()) for _, b in pairs)
        self.rel_diffs.append((diff / norm) ** 0.5 if norm > 0 else 0.0)
        for p in self.ref_params:
            p.grad.zero_()


def compare_baselines(trainer: Trainer, steps: int, ours: Run, chain: Chain) -> dict[str, Baseline]:
    """The same steps without offloading and under ``save_on_cpu``, and our step time against both."""
    pin = trainer.device.type == "cuda"
    ways = {"no_offload": contextlib.nullcontext,
            "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)}
    module = trainer.spec.module
    out: dict[str, Baseline] = {}
    for name, wrap in ways.items():
        run, error = trainer.measure(steps, lambda args, kwargs: module(*args, **kwargs), wrap)
        peak = max(run.peaks) if run.peaks else None
        step_s = statistics.median(run.step_s) if run.step_s else None
        out[name] = Baseline(step_s, run.step_s, peak, None if peak is None else peak + chain.base_bytes,
                             str(error) if error else None,
                             statistics.median(ours.step_s) / step_s if step_s and ours.step_s else None)
    return out


def trace_step(path: str, trainer: Trainer, run: Offloaded) -> dict[str, Any]:
    """One more step with offloading under ``torch.profiler``: a Chrome trace, and how much of its
    copy time overlaps GPU compute (``None`` on the CPU, where there are no GPU copies)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with step_errors("the traced step"), torch.profiler.profile(activities=activities) as prof:
        trainer.one_step(lambda args, kwargs: run(*args, **kwargs), trainer.spec.batch(), contextlib.nullcontext)
        trainer.synchronize()
    gc.collect()
    trainer.finish_step()
    with tempfile.TemporaryDirectory() as scratch:  # the profiler exports to a path, not a file object
        exported = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(exported))
        text = exported.read_text()
    write_atomic(path, lambda fh: fh.write(text))
    return {"path": str(path), "copy_overlap": copy_overlap(json.loads(text)["traceEvents"])}
