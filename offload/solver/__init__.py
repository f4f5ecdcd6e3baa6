"""The problem and its solvers: the chain and platform model, schedules, the simulator (the
single source of truth), an exact ILP, relaxation heuristics, the literature's baselines
and lower bounds.  Pure Python (pulp, networkx, numpy): never imports torch.

Typical use::

    from offload.solver import Budget, load_chain, solve
    chain = load_chain("chain.json")
    result = solve(chain, Budget.parse("60%", chain), method="ilp")
    print(result.status, result.simulation.makespan_s, result.gap)
"""
from .budget import Budget
from .chain import Chain, Platform, Recipe, Stage
from .chainfile import chain_from_dict, load_chain, make_chain, save_chain
from .memory import no_offload_peak, smallest_feasible_budget
from .methods import METHODS, Options, Result, solve
from .schedule import Offload, Schedule
from .schedulefile import load_schedule, save_schedule
from .simulate import Simulation, simulate

__all__ = [
    "Budget", "Chain", "Platform", "Recipe", "Stage", "chain_from_dict", "load_chain", "make_chain", "save_chain",
    "no_offload_peak", "smallest_feasible_budget", "METHODS", "Options", "Result", "solve",
    "Offload", "Schedule", "load_schedule", "save_schedule", "Simulation", "simulate",
]
