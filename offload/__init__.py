"""Optimal activation offloading for PyTorch training.

The packages, from the bottom up (docs/architecture.md draws them): ``offload.io`` (files
and text), ``offload.step`` (the torch-free model of one training step: chains, schedules,
budgets, memory, the events of a step and the simulator that replays them, the file
formats), ``offload.solver`` (the algorithms that choose a schedule), ``offload.analysis``
(sweeps, plots, timelines), and on the torch side ``offload.core`` (what the profiler and
the executor share), ``offload.models``, ``offload.profiler`` (a model in, a measured chain
out) and ``offload.executor`` (``Offloaded`` applies a schedule in your own training loop).
The names below are imported on first use, so that ``import offload`` (and the command
line) does not load torch::

    from offload import Offloaded, load_chain, solve, Budget
"""
from importlib import import_module
from typing import Any

__version__ = "0.2.0"

_HOMES = {
    "Budget": "offload.step.budget", "Chain": "offload.step.chain", "Schedule": "offload.step.schedule",
    "load_chain": "offload.step.chainfile", "save_chain": "offload.step.chainfile",
    "load_schedule": "offload.step.schedulefile", "save_schedule": "offload.step.schedulefile",
    "simulate": "offload.step.simulate", "Options": "offload.solver.methods", "solve": "offload.solver.methods",
    "Offloaded": "offload.executor.api", "profile": "offload.profiler.profile",
    "compile_scheduled": "offload.executor.compiled",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
