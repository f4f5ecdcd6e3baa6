"""A schedule of a chain of the compiled graph, compiled and metered before it is written.

A chain profiled from the model compiled whole (``profiler/compiled.py``) books what the
compiles it sampled held; a schedule that recomputes a combination of stages none of them
sampled may hold more at an op than the chain books: a U-Net under aot_eager, its stage 3
recomputed alone, held 64 KiB over at ``B3`` (a value near its skip connection that the
partition holds through one op or the next as the runs around it change). Sampling more
cannot promise every schedule; measuring the one that will train can. So ``offload solve
--verify`` (``solve_verified``) compiles the schedule it solved with the profiler's marks, as
the profile and ``offload train --op-memory`` do, meters a step op by op on the device the
chain was profiled on, and where an op held more than the budget, solves again for a budget
that much under the schedule's predicted peak, until a compiled schedule holds the budget at
every op. The schedule written keeps the budget asked for (the simulator's prediction is
within it), and ``solver["verified"]`` says how it was verified: the rounds, the budget the
last solve was given, the measured peak, and the op that held most over its prediction.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from offload.core.devices import pick_device
from offload.errors import ChainMismatch, InfeasibleBudget, ModelError
from offload.executor.train import build_like_chain
from offload.io.text import format_bytes
from offload.solver.methods import Options, Result, solve
from offload.step.budget import Budget
from offload.step.chain import Chain
from offload.step.memory import op_name
from offload.step.schedule import Schedule

from .compiled import metered

ROUNDS = 4  # solves at most: each one more compile of the model


@dataclass(frozen=True)
class Metered:
    """A schedule's step compiled with marks: per op, in step order, the bytes it held beyond
    the step's start and the simulator's prediction of them; and the bytes its copies move
    each way, as the compiled graph placed them and as the simulator moves them (a chain that
    books other bytes than the copies move predicts the step's copy time wrong: a Qwen2
    block's offloaded checkpoint moved twice what the chain booked, before it booked its
    dropout masks too)."""

    measured: tuple[int, ...]
    predicted: tuple[int, ...]
    moved_bytes: int = 0
    booked_moved_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return max(self.measured)

    def most_over(self) -> tuple[int, int]:
        """How much the op that held most over its prediction held over it (at most 0: none
        did), and that op (the first such, by its index in step order)."""
        over = [m - p for m, p in zip(self.measured, self.predicted)]
        op = over.index(max(over))
        return over[op], op


def verifying_device(chain: Chain) -> torch.device:
    """Where ``chain`` was profiled: its schedule is metered there (an op's memory on the CPU
    is no measure of it on a GPU)."""
    where = str(chain.source.get("device", "cpu"))
    device = pick_device("cpu" if where.startswith("cpu") else None)
    if device.type == "cpu" and not where.startswith("cpu"):
        raise ModelError(f"chain {chain.name!r} was profiled on {where}; --verify compiles and meters its schedule "
                         "there, and this PyTorch sees no CUDA GPU",
                         "run offload solve --verify on the machine the chain was profiled on, or solve without it")
    return device


def check_verifiable(chain: Chain) -> None:
    """Only a chain of the compiled graph is verified by compiling its schedule."""
    if chain.recipe is None or not chain.recipe.whole_graph:
        raise ChainMismatch(
            f"chain {chain.name!r} is not a chain of the model compiled whole: --verify compiles the schedule as one "
            "graph and meters it against such a chain",
            "profile it with --compile inductor --whole-graph to verify; a schedule of this chain is checked op by op "
            "by offload train --op-memory")


def meter(chain: Chain, schedule: Schedule, device: torch.device) -> Metered:
    """One step of ``schedule`` compiled whole with the profiler's marks, on ``device``."""
    spec = build_like_chain(chain, device)
    measured, partitioner = metered(chain, schedule, spec, device)
    sim = schedule.simulate(chain)
    return Metered(tuple(measured), tuple(int(o.mem_bytes) for o in sim.ops), partitioner.runtime.planned_bytes,
                   int(sim.d2h_bytes))


def solve_verified(chain: Chain, budget: Budget | int, method: str = "ilp", options: Options | None = None,
                   tick: Callable[[str], None] = lambda _: None) -> Result:
    """``solve``, its schedule then compiled and metered op by op (module docstring), solved
    again for less where an op held more than ``budget``.

    Args:
        chain: a chain of the model compiled whole (``offload profile --whole-graph``).
        budget: as ``solve`` takes it; the schedule written keeps it.
        method, options: as ``solve`` takes them.
        tick: called with a line as each solve begins and after each metered compile
            (``offload solve --verify`` prints them).

    Returns:
        The last solve's result, its schedule's budget ``budget`` and its ``solver`` info
        with ``verified``.

    Raises:
        InfeasibleBudget: no schedule held ``budget`` compiled within ``ROUNDS`` solves, or the
        budget left to solve for is below the smallest any schedule meets.
        ChainMismatch: ``chain`` is not a chain of the compiled graph.
    """
    check_verifiable(chain)
    budget = Budget.of(budget)
    device = verifying_device(chain)
    limit = budget.activations(chain)
    solved_for = budget
    why = ""
    for round_ in range(1, ROUNDS + 1):
        tick(f"solving with {method} for {format_bytes(solved_for.activations(chain))}…")
        try:
            result = solve(chain, solved_for, method, options)
        except InfeasibleBudget as exc:
            if not why:  # the first solve: the budget asked for is refused as solve refuses it
                raise
            raise InfeasibleBudget(f"{why}; solved again for {format_bytes(solved_for.activations(chain))}: {exc}",
                                   exc.hint, exc.smallest_bytes) from None
        step = meter(chain, result.schedule, device)
        over, op = step.most_over()
        tick(f"compiled with marks: peak {format_bytes(step.peak_bytes)} for {format_bytes(limit)}, "
             + (f"{op_name(chain, op)} {format_bytes(over)} over its prediction" if over > 0
                else "every op within its prediction"))
        held = step.peak_bytes - limit  # over the budget asked for, if > 0
        if held <= 0:
            return _verified(result, budget, solved_for, step, chain, round_)
        why = (f"compiled, the schedule solved for {format_bytes(solved_for.activations(chain))} held "
               f"{format_bytes(step.peak_bytes)}, {format_bytes(held)} over the budget of {format_bytes(limit)} "
               f"({op_name(chain, op)} {format_bytes(over)} over its prediction)")
        # less than this schedule's predicted peak by what it held over: it is not chosen again
        solved_for = Budget(budget.base(chain) + min(limit, result.simulation.peak_bytes) - held, budget.scope)
    raise InfeasibleBudget(f"no schedule held the budget {budget} compiled in {ROUNDS} solves: {why}",
                           "solve for a larger budget, or without --verify and check with offload train --op-memory")


def _verified(result: Result, budget: Budget, solved_for: Budget, step: Metered, chain: Chain, rounds: int) -> Result:
    over, op = step.most_over()
    verified = {"rounds": rounds, "solved_for_bytes": solved_for.activations(chain),
                "measured_peak_bytes": step.peak_bytes,
                "most_over": {"op": op_name(chain, op), "bytes": over} if over > 0 else None,
                "moved_bytes": step.moved_bytes, "booked_moved_bytes": step.booked_moved_bytes}
    info = {**result.info, "verified": verified}
    schedule = replace(result.schedule, budget=budget, solver={**result.schedule.solver, "verified": verified})
    return replace(result, schedule=schedule, info=info)
