"""The problem and its solvers: chain + platform model, schedules, the simulator (the
single source of truth), an exact ILP, relaxation heuristics, the literature's baselines
and lower bounds.  Pure Python (pulp, networkx, numpy): never imports torch.

Typical use::

    from solver import load_chain, solve
    chain = load_chain("chain.json")
    result = solve(chain, budget=4 * 2**30, method="ilp")
    print(result.status, result.simulation.makespan_s, result.gap)
"""
from .chain import Chain, Platform, Stage, chain_from_dict, load_chain, save_chain
from .errors import (ChainMismatch, FormatError, InfeasibleBudget, OffloadError, ScheduleRejected,
                     SolverFailure)
from .memory import no_offload_peak, smallest_feasible_budget
from .methods import METHODS, Options, Result, solve
from .schedule import Offload, Schedule, load_schedule, save_schedule
from .simulate import Simulation, simulate

__all__ = [
    "Chain", "Platform", "Stage", "chain_from_dict", "load_chain", "save_chain",
    "ChainMismatch", "FormatError", "InfeasibleBudget", "OffloadError", "ScheduleRejected", "SolverFailure",
    "no_offload_peak", "smallest_feasible_budget", "METHODS", "Options", "Result", "solve",
    "Offload", "Schedule", "load_schedule", "save_schedule", "Simulation", "simulate",
]
