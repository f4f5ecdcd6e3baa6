"""Running a PuLP model on HiGHS (default, through highspy) or CBC, honestly.

What "honestly" takes with PuLP 3.3 and highspy 1.16:

* **Threads.** HiGHS keeps one task scheduler per calling thread, sized by the first
  solve made on that thread; a later solve asking for another thread count is refused
  (``Option 'threads' is set to 1 but the scheduler has already been initialized``) and
  PuLP reads that refusal as "no solution in time".  Every solve here runs on a fresh
  thread (highspy's ``startSolve``), so each one gets the scheduler it asks for, in any
  process, whatever ran before.  The thread is this module's own, not highspy's
  ``startSolve``: highspy keeps that one's "a solve is running" lock on its class, so one
  abandoned solve (below) made every later solve in the process fail.  A solve HiGHS
  refuses to run raises ``SolverFailure``.
* **Statuses.** After a time limit PuLP reports "Optimal" for any incumbent; here
  ``proven`` is HiGHS's own ``kOptimal``, a solution exists only when HiGHS says its
  primal solution is feasible, and ``stop`` says why the solver stopped.  Values are
  never read without a solution.
* **Wall time and Ctrl-C.** The solve thread is cancelled through HiGHS's interrupt
  callbacks when the caller's ``Deadline`` passes or Ctrl-C arrives.  Ctrl-C propagates as
  ``KeyboardInterrupt`` at once: HiGHS's MIP presolve (seconds on large models) looks at no
  callback, so the cancelled thread may run on briefly, holding its own reference.  For the
  same reason a solve still running ``_CANCEL_GRACE_S`` after its deadline is abandoned
  (stop ``time-limit``, no solution read from it) and left to finish on its own thread.
* **Transfer.** The model goes to HiGHS in one ``passModel`` call (row-wise arrays)
  instead of PuLP's column-by-column and row-by-row loop; the MIP start is set after it
  (``setSolution``; PuLP 3.3 has no HiGHS warm start).
* **Sub-MIP heuristics.** HiGHS's RINS and RENS (sub-MIPs around the LP and the incumbent)
  are turned off for a warm-started offload-only model (``sub_mips=False``): there the warm
  start (the best relax-* schedule) is already within a fraction of a percent, and the
  sub-MIPs spent 14 of 30 s at the root re-finding it.  Measured on this 2-core machine:
  the 50-stage synthetic benchmark chain proven in 19 s instead of 73 s; link-bound
  ResNet-101 at 30/40/60% of its peak proven sooner or with a smaller gap within 60 s, the
  same at 50 and 80% (``experiments/results/README.md``).  With encodings or
  recomputation the start is further off and the sub-MIPs find better schedules (link-bound
  ResNet-101 with recomputation: 0.7% better within 20 s): they stay on there.
* **A start and presolve.** On some small models HiGHS 1.16 with a MIP start and presolve
  on declares the start optimal at the root with a dual bound far below it (the start's
  objective "in the reduced space" misread: a 3-stage chain with an encoding and weight
  casts, ``tests/test_encoding.py``).  A proven solve whose bound does not meet its
  objective within the gap asked for is solved again with presolve off.
* **No MIP start for CBC.** CBC 2.10 given the warm start (PuLP's ``warmStart``) closed a
  4-stage offload model at the root with the start's objective, proven, 5% above the
  optimum it finds without one (and HiGHS finds with one): a chain hypothesis drew,
  ``tests/test_solver_limits.py``.  CBC starts cold; the caller keeps the warm start
  when the solver's schedule is worse (``solver.methods``).
* **Output.** HiGHS prints a banner on the first instance of a process, on stdout, among
  the tool's results; it is discarded.  The solver log (``msg``) goes to stderr.
"""
from __future__ import annotations

import sys
import threading
import time
import warnings
from dataclasses import dataclass

import highspy
import numpy as np
import pulp

from .deadline import Deadline
from ..io.text import native_output_discarded
from ..errors import SolverFailure

SOLVERS = ("highs", "cbc")
_POLL_S = 0.02  # how often the waiting thread looks at the deadline
_CANCEL_GRACE_S = 1.0  # how long a cancelled solve may take to stop before it is abandoned


@dataclass
class SolveOutcome:
    proven: bool  # optimal within the requested gap
    has_solution: bool
    objective: float | None
    dual_bound: float | None  # solver's best bound (HiGHS only)
    seconds: float
    nodes: int | None
    backend: str
    stop: str  # optimal | infeasible | time-limit | other (the solver's own words)


_banner_shown = False


def new_highs() -> highspy.Highs:
    """A ``highspy.Highs``; the banner HiGHS prints on a process's first one is discarded
    (it went to stdout, among the tool's results; ``--verbose`` shows the solver's log)."""
    global _banner_shown
    if _banner_shown:
        return highspy.Highs()
    with native_output_discarded(1):
        h = highspy.Highs()
    _banner_shown = True
    return h


class _Highs(pulp.HiGHS):
    """PuLP's HiGHS interface with the fixes listed in the module docstring."""

    def __init__(self, deadline: Deadline | None, warm: bool, presolve: bool = True, sub_mips: bool = True,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.deadline, self.warm, self.presolve, self.sub_mips = deadline, warm, presolve, sub_mips
        self.run_status: highspy.HighsStatus | None = None
        self.abandoned = False

    def createAndConfigureSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (PuLP's names)
        h = new_highs()
        h.setOptionValue("output_flag", bool(self.msg))
        if self.msg:  # the log is a diagnostic: stderr, so that stdout keeps the tool's results
            h.setOptionValue("log_to_console", False)
            h.cbLogging += lambda event: sys.stderr.write(event.message)
        for name, value in (("mip_rel_gap", self.gapRel), ("mip_abs_gap", self.gapAbs), ("threads", self.threads),
                            ("time_limit", None if self.timeLimit is None else float(self.timeLimit))):
            if value is not None:
                h.setOptionValue(name, value)
        if not self.presolve:
            h.setOptionValue("presolve", "off")
        for heuristic in ("mip_heuristic_run_rins", "mip_heuristic_run_rens"):
            h.setOptionValue(heuristic, self.sub_mips)
        lp.solverModel = h

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:  # noqa: N802
        variables = lp.variables()
        for n, v in enumerate(variables):
            v.index = n
        sense = -1.0 if lp.sense == pulp.LpMaximize else 1.0
        cost = np.array([sense * lp.objective.get(v, 0.0) for v in variables], dtype=float)
        lower = np.array([-highspy.kHighsInf if v.lowBound is None else v.lowBound for v in variables], dtype=float)
        upper = np.array([highspy.kHighsInf if v.upBound is None else v.upBound for v in variables], dtype=float)
        integral = np.array([int(v.cat == pulp.LpInteger and self.mip) for v in variables], dtype=np.int32)
        starts, index, value, row_lo, row_hi = [0], [], [], [], []
        for n, row in enumerate(lp._constraints.values()):
            row.index = n
            for v, a in row.items():
                if a:
                    index.append(v.index)
                    value.append(a)
            starts.append(len(index))
            lo, hi = row.getLb(), row.getUb()
            row_lo.append(-highspy.kHighsInf if lo is None else lo)
            row_hi.append(highspy.kHighsInf if hi is None else hi)
        status = lp.solverModel.passModel(
            len(variables), len(row_lo), len(index), int(highspy.MatrixFormat.kRowwise), int(highspy.ObjSense.kMinimize),
            sense * float(lp.objective.constant), cost, lower, upper, np.array(row_lo, dtype=float),
            np.array(row_hi, dtype=float), np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
            np.array(value, dtype=float), integral)
        if status == highspy.HighsStatus.kError:
            raise SolverFailure("HiGHS refused the model (passModel failed)", "run with --verbose to see HiGHS's message")
        if self.warm:
            cols = [v for v in variables if v.varValue is not None]
            lp.solverModel.setSolution(len(cols), np.array([v.index for v in cols], dtype=np.int32),
                                       np.array([float(v.varValue) for v in cols], dtype=float))

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802
        """Solve on a fresh thread (its own scheduler); cancel at the deadline or on Ctrl-C."""
        h = lp.solverModel
        h.HandleUserInterrupt = True  # HiGHS's interrupt callback reads the flag ``cancelSolve`` sets
        finished = threading.Event()
        outcome: dict[str, highspy.HighsStatus] = {}

        def solve() -> None:
            try:
                outcome["status"] = h.run()  # the C++ solve itself (highspy's ``solve`` wraps it in its lock)
                highspy.Highs.resetThreadScheduler(False)  # this thread's scheduler ends with it
            finally:
                finished.set()
        threading.Thread(target=solve, name="highs-solve", daemon=True).start()
        cancelled_at = None
        try:
            while not finished.wait(_POLL_S):
                if cancelled_at is None and self.deadline is not None and self.deadline.expired():
                    h.cancelSolve()
                    cancelled_at = time.perf_counter()
                elif cancelled_at is not None and time.perf_counter() - cancelled_at > _CANCEL_GRACE_S:
                    self.abandoned = True  # deaf to the interrupt (presolve): left to finish
                    break
        except KeyboardInterrupt:  # the solve thread stops at its next callback (not inside presolve);
            h.cancelSolve()  # it holds its own reference to ``h``, so nothing here waits for it
            raise
        self.run_status = outcome.get("status", highspy.HighsStatus.kWarning if self.abandoned else
                                      highspy.HighsStatus.kError)

    def findSolutionValues(self, lp: pulp.LpProblem) -> tuple[int, int]:  # noqa: N802
        if self.abandoned:  # its thread still runs: nothing of it may be read
            for v in lp.variables():
                v.varValue = None
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
        h = lp.solverModel
        model = h.getModelStatus()
        has = h.getInfo().primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
        values = list(h.getSolution().col_value) if has else None
        for v in lp.variables():
            v.varValue = values[v.index] if values is not None else None
        if model == highspy.HighsModelStatus.kOptimal:
            return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
        if model in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
            return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
        if has:
            return pulp.LpStatusNotSolved, pulp.LpSolutionIntegerFeasible
        return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


_STOPS = {
    highspy.HighsModelStatus.kOptimal: "optimal",
    highspy.HighsModelStatus.kInfeasible: "infeasible",
    highspy.HighsModelStatus.kUnboundedOrInfeasible: "infeasible",
    highspy.HighsModelStatus.kTimeLimit: "time-limit",
    highspy.HighsModelStatus.kInterrupt: "time-limit",  # cancelled by us: the deadline (Ctrl-C raises instead)
}


def _run_highs(prob: pulp.LpProblem, time_limit: float | None, gap: float | None, threads: int | None,
               warm: bool, msg: bool, deadline: Deadline | None, presolve: bool, sub_mips: bool) -> SolveOutcome:
    s = _Highs(deadline, warm, presolve, sub_mips, msg=msg, timeLimit=time_limit, gapRel=gap, threads=threads,
               gapAbs=0.0 if gap == 0 else None)
    t0 = time.perf_counter()
    prob.solve(s)
    seconds = time.perf_counter() - t0
    if s.abandoned:
        return SolveOutcome(proven=False, has_solution=False, objective=None, dual_bound=None, seconds=seconds,
                            nodes=None, backend="highs", stop="time-limit")
    h = prob.solverModel
    model = h.getModelStatus()
    if s.run_status == highspy.HighsStatus.kError and model not in _STOPS:
        raise SolverFailure(f"HiGHS did not solve the model: {h.modelStatusToString(model)}",
                            "run with --verbose to see HiGHS's log")
    info = h.getInfo()
    has = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    bound = nodes = None
    if prob.isMIP():
        nodes = int(info.mip_node_count)
        if np.isfinite(info.mip_dual_bound) and abs(info.mip_dual_bound) < highspy.kHighsInf:
            bound = float(info.mip_dual_bound)
    elif model == highspy.HighsModelStatus.kOptimal:
        bound = float(info.objective_function_value)
    return SolveOutcome(proven=model == highspy.HighsModelStatus.kOptimal, has_solution=has,
                        objective=float(pulp.value(prob.objective)) if has else None, dual_bound=bound,
                        seconds=seconds, nodes=nodes, backend="highs",
                        stop=_STOPS.get(model, h.modelStatusToString(model)))


def _run_cbc(prob: pulp.LpProblem, time_limit: float | None, gap: float | None, threads: int | None,
             msg: bool) -> SolveOutcome:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        s = pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, gapRel=gap, threads=threads,
                              **({"gapAbs": 0.0} if gap == 0 else {}))
    if not s.available():
        raise SolverFailure("CBC is not available in this PuLP installation", "use --solver highs")
    t0 = time.perf_counter()
    prob.solve(s)
    seconds = time.perf_counter() - t0
    sol = prob.sol_status
    has = sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    stop = {pulp.LpSolutionOptimal: "optimal", pulp.LpSolutionInfeasible: "infeasible"}.get(sol, "time-limit")
    return SolveOutcome(proven=sol == pulp.LpSolutionOptimal, has_solution=has,
                        objective=float(pulp.value(prob.objective)) if has else None, dual_bound=None,
                        seconds=seconds, nodes=None, backend="cbc", stop=stop)


def _bound_misses(out: SolveOutcome, gap: float | None) -> bool:
    """A solve proven optimal whose dual bound lies below its objective by more than the gap."""
    if not out.proven or out.objective is None or out.dual_bound is None:
        return False
    allowed = 1e-4 if gap is None else gap  # HiGHS's own default when none is asked for
    return out.objective - out.dual_bound > allowed * abs(out.objective) + 1e-6 * max(1.0, abs(out.objective))


def run(prob: pulp.LpProblem, solver: str = "highs", time_limit: float | None = None, gap: float | None = None,
        threads: int | None = None, warm: bool = False, msg: bool = False,
        deadline: Deadline | None = None, presolve: bool = True, sub_mips: bool = True) -> SolveOutcome:
    """Solve ``prob``; ``warm`` uses the variables' ``setInitialValue`` values as a start (HiGHS
    only: module docstring).
    ``time_limit`` is the solver's own; ``deadline`` (wall time) cancels it from outside.
    ``presolve=False`` for models whose presolve costs more than it saves (HiGHS's MIP
    presolve ignores the interrupt; on the window models of a 10,000-stage chain it ran 100 s).
    ``sub_mips=False`` turns HiGHS's RINS and RENS off (module docstring); CBC ignores it."""
    if deadline is not None:
        left = deadline.remaining()
        time_limit = left if time_limit is None else min(time_limit, left)
    if time_limit is not None:
        time_limit = max(time_limit, 1e-3)
    try:
        if solver == "highs":
            out = _run_highs(prob, time_limit, gap, threads, warm, msg, deadline, presolve, sub_mips)
            if presolve and _bound_misses(out, gap):  # HiGHS's claim contradicts itself (module docstring)
                if deadline is not None:
                    time_limit = max(1e-3, deadline.remaining())
                return _run_highs(prob, time_limit, gap, threads, warm, msg, deadline, False, sub_mips)
            return out
        if solver == "cbc":
            return _run_cbc(prob, time_limit, gap, threads, msg)
    except pulp.PulpSolverError as exc:
        raise SolverFailure(f"{solver} failed: {exc}") from None
    raise SolverFailure(f"unknown solver {solver!r}", f"choose one of {', '.join(SOLVERS)}")
