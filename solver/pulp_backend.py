"""Running a PuLP model on HiGHS (default, through highspy) or CBC, honestly.

PuLP 3.3 traps handled here (research/solvers.md sections 2-4): after a time limit PuLP
reports status "Optimal" for both HiGHS and CBC, so only ``sol_status == 1`` counts as
proven; values are never read without an incumbent; HiGHS gets its MIP start through
``setSolution`` after the model is built (PuLP 3.3 has no HiGHS warm start).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import pulp

from .errors import SolverFailure

SOLVERS = ("highs", "cbc")


@dataclass
class SolveOutcome:
    proven: bool  # optimal within the requested gap
    has_solution: bool
    objective: float | None
    dual_bound: float | None  # solver's best bound (HiGHS only)
    seconds: float
    nodes: int | None
    backend: str


class _HighsWithStart(pulp.HiGHS):
    """HiGHS that loads the variables' initial values as a MIP start."""

    warm = False

    def buildSolverModel(self, lp):  # noqa: N802 (PuLP's name)
        super().buildSolverModel(lp)
        if self.warm:
            cols = [v for v in lp.variables() if v.varValue is not None]
            lp.solverModel.setSolution(len(cols), [v.index for v in cols], [float(v.varValue) for v in cols])


def run(prob: pulp.LpProblem, solver: str = "highs", time_limit: float | None = None, gap: float | None = None,
        threads: int | None = None, warm: bool = False, msg: bool = False) -> SolveOutcome:
    """Solve ``prob``; ``warm`` uses the variables' ``setInitialValue`` values as a start."""
    if solver == "highs":
        s = _HighsWithStart(msg=msg, timeLimit=time_limit, gapRel=gap, threads=threads,
                            gapAbs=0.0 if gap == 0 else None)
        s.warm = warm
    elif solver == "cbc":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, gapRel=gap, threads=threads, warmStart=warm,
                                  **({"gapAbs": 0.0} if gap == 0 else {}))
        if not s.available():
            raise SolverFailure("CBC is not available in this PuLP installation", "use --solver highs")
    else:
        raise SolverFailure(f"unknown solver {solver!r}", f"choose one of {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    try:
        prob.solve(s)
    except pulp.PulpSolverError as exc:
        raise SolverFailure(f"{solver} failed: {exc}") from None
    seconds = time.perf_counter() - t0
    sol = prob.sol_status
    has = sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    bound = nodes = None
    if solver == "highs" and prob.solverModel is not None:
        info = prob.solverModel.getInfo()
        # PuLP passes HiGHS the objective's coefficients but not its constant term
        constant = float(prob.objective.constant)
        if prob.isMIP():
            bound, nodes = float(info.mip_dual_bound) + constant, int(info.mip_node_count)
        elif has:
            bound = float(info.objective_function_value) + constant
    return SolveOutcome(
        proven=sol == pulp.LpSolutionOptimal,
        has_solution=has,
        objective=float(pulp.value(prob.objective)) if has else None,
        dual_bound=bound,
        seconds=seconds,
        nodes=nodes,
        backend=solver,
    )
