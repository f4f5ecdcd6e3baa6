"""Stage boundaries inside a running model: the seam the profiler and the executor share.

A linearized model is the user's module with one *boundary* call on each cut value (the
output of stages ``1..L-1``).  A boundary is an identity autograd function, so it fires in
the forward when stage ``k`` ends and in the backward when stage ``k+1``'s backward ends,
which is where the profiler takes its timestamps and memory readings and where the executor
releases and prefetches.  An identity function fires reliably where a ``grad_fn`` hook may
not (research/executor.md, section 3.1).  It returns ``x.detach()`` rather than a view, so a
later in-place op on the cut value (``ReLU(inplace=True)``) stays legal.

Boundaries do nothing unless a listener is active (``StagedModel.listening``), so the
instrumented module trains exactly like the original.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import networkx as nx
import torch
from torch import nn


class StageListener:
    """Told where the computation is: subclass and override what you need.

    ``forward_boundary(k)`` runs when the forward of stage ``k`` has ended (``1 ≤ k < L``),
    ``backward_boundary(k)`` when the backward of stage ``k+1`` has ended, just before
    the backward of stage ``k`` starts.
    """

    def forward_boundary(self, k: int) -> None:  # pragma: no cover - default no-op
        pass

    def backward_boundary(self, k: int) -> None:  # pragma: no cover - default no-op
        pass

    def stage_output(self, k: int, x: torch.Tensor) -> None:
        """The value stage ``k`` hands to stage ``k+1`` (called just before ``forward_boundary``)."""


_active = threading.local()


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, listener: StageListener) -> torch.Tensor:
        ctx.k, ctx.listener = k, listener
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.listener.backward_boundary(ctx.k)
        return grad, None, None


def stage_boundary(x: torch.Tensor, k: int) -> torch.Tensor:
    """The end of stage ``k``'s forward on its output ``x``; identity without a listener."""
    listener = getattr(_active, "listener", None)
    if listener is None:
        return x
    listener.stage_output(k, x)
    listener.forward_boundary(k)
    if not x.requires_grad:  # nothing flows back through here (a frozen prefix)
        return x
    return _Boundary.apply(x, k, listener)


@dataclass
class StageInfo:
    """One stage of the linearized model: what it is called, what it contains."""

    name: str
    kind: str
    ops: list[str]
    has_params: bool


@dataclass
class StagedModel:
    """A module instrumented with stage boundaries, plus the graph it was cut from.

    ``graph`` is the op-level data-flow graph (networkx) with each op's ``stage``;
    ``capture`` says how it was obtained (``fx`` or ``hooks``); ``cuts`` name the ops the
    boundaries follow, recorded in the chain so that the executor stages the model the
    same way.
    """

    module: nn.Module
    stages: list[StageInfo]
    graph: nx.DiGraph
    capture: str
    cuts: list[str] = field(default_factory=list)  # the op ending each stage but the last
    notes: list[str] = field(default_factory=list)

    @property
    def L(self) -> int:
        return len(self.stages)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.module(*inputs)

    @contextlib.contextmanager
    def listening(self, listener: StageListener) -> Iterator[None]:
        """Route this thread's boundaries to ``listener`` for the duration of the block."""
        previous = getattr(_active, "listener", None)
        _active.listener = listener
        try:
            yield
        finally:
            _active.listener = previous
