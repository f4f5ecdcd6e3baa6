"""Optimal activation offloading for PyTorch training.

``offload.solver`` (torch-free): chains, budgets, the simulator, the ILP, heuristics and
baselines.  ``offload.profiler``: a model in, a measured chain out.  ``offload.executor``:
``Offloaded`` applies a schedule in your own training loop.  The names below are imported
on first use, so that ``import offload`` (and the command line) does not load torch::

    from offload import Offloaded, load_chain, solve, Budget
"""
from typing import Any

__version__ = "0.2.0"

_SOLVER = {"Budget", "Chain", "Options", "Schedule", "load_chain", "load_schedule", "save_chain", "save_schedule",
           "simulate", "solve"}
__all__ = sorted(_SOLVER | {"Offloaded", "profile"})


def __getattr__(name: str) -> Any:
    if name in _SOLVER:
        from . import solver
        return getattr(solver, name)
    if name == "Offloaded":
        from .executor.api import Offloaded
        return Offloaded
    if name == "profile":
        from .profiler.profile import profile
        return profile
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
