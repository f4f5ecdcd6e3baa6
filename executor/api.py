"""The executor in your own training loop: ``Offloaded`` wraps the module a chain was profiled from.

``offload train`` runs synthetic steps of a named model; a real job has its own data,
loss, optimizer, scheduler and logging.  ``Offloaded`` gives it the schedule and nothing
else to learn::

    model = build_model().cuda()                  # the module `offload profile` measured
    run = Offloaded(model, example_batch, "chain.json", "schedule.json")
    for x, y in loader:
        with run.step():                          # forward, loss and backward inside
            loss = loss_fn(run(x), y)
            loss.backward()
        optimizer.step(); optimizer.zero_grad()  # outside: parameters are never offloaded

The module is staged like the chain (``executor.staging``) and the schedule is checked to
belong to that chain, both before the first step.  The module keeps its own parameters: an
optimizer made from ``model.parameters()`` trains the module the wrapper runs.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from solver.chain import Chain, load_chain
from solver.errors import ChainMismatch
from solver.schedule import Schedule, load_schedule

from .backends import make_backend
from .plan import StepPlan
from .runtime import OffloadRuntime
from .staging import stage_module

PathLike = str | os.PathLike


class Offloaded:
    """``module`` with ``schedule`` applied at every ``step()``.

    ``example_inputs``: one batch (a tensor or a tuple of them) of the shape profiled; it is
    run once, to capture the graph.  ``chain`` and ``schedule``: objects or JSON paths.
    ``backend``: ``cuda`` (side streams; the default on a GPU), ``cpu-eager`` (the default on
    the CPU) or ``cpu-lazy`` (the checking backend of the tests).  ``run.module`` is the
    module itself, for evaluation under ``torch.no_grad()``."""

    def __init__(self, module: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor],
                 chain: Chain | PathLike, schedule: Schedule | PathLike, backend: str | None = None) -> None:
        self.chain = chain if isinstance(chain, Chain) else load_chain(chain)
        self.schedule = schedule if isinstance(schedule, Schedule) else load_schedule(schedule, self.chain)
        if self.schedule.chain_sha256 != self.chain.sha256:
            raise ChainMismatch(f"the schedule was made for chain {self.schedule.chain_name!r}, not for "
                                f"{self.chain.name!r} (sha256 differs)", "solve again on this chain")
        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        self.module = module
        staged = stage_module(module, inputs, self.chain)
        self.runtime = OffloadRuntime(staged, StepPlan.from_schedule(self.chain, self.schedule),
                                      make_backend(backend, inputs[0].device))
        self._in_step = False

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step: call the model, compute the loss and run ``backward()`` inside."""
        self._in_step = True
        try:
            with self.runtime.step():
                yield
        finally:
            self._in_step = False

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """The module's forward, offloading as scheduled; only inside ``step()``."""
        if not self._in_step:
            raise RuntimeError("call the offloaded model inside `with run.step():` (the schedule spans the forward "
                               "and the backward of one step); for evaluation, call the module itself under "
                               "torch.no_grad()")
        return self.runtime.forward(*inputs)

    @property
    def moved_bytes(self) -> tuple[int, int]:
        """Bytes copied so far: (device to host, host to device)."""
        return self.runtime.d2h_bytes, self.runtime.h2d_bytes
