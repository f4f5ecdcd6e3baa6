"""Every method behind one call: ``solve(chain, budget, method)``.

The call checks the budget against the smallest feasible one first (a clear answer, not
a solver failure), runs the method, replays its schedule in the simulator (refusing it if
it breaks the budget), and attaches the lower bounds so that every result carries its gap.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from offload.errors import InfeasibleBudget, SolverFailure
from offload.io.text import format_bytes, told_apart
from offload.step import encoding
from offload.step.actions import Choice, Offload, Recompute
from offload.step.budget import Budget
from offload.step.chain import Chain
from offload.step.memory import op_name, op_transients
from offload.step.schedule import Schedule, make_schedule
from offload.step.simulate import Simulation, simulate

from . import baselines, checkpointing, lns, relax
from . import encoded_floor
from .bounds import fluid_lp
from .casts import keep_casts
from .deadline import Deadline, OutOfTime
from .ilp import solve_ilp


LP_BOUND_MAX_STAGES = 2000  # above, the fluid LP's solve grows past seconds: cheaper bounds only
FULL_MILP_MAX_STAGES = 120  # above, the ILP re-optimizes windows of the MILP (solver.lns)


@dataclass
class Options:
    """Knobs of the solvers; the defaults are what the CLI uses."""

    time_limit_s: float = 60.0  # wall time of the whole solve (heuristics, bounds, build, solver, replay)
    gap: float = 1e-4
    threads: int | None = None
    solver: str = "highs"
    heuristic_time_s: float = 1.0
    verbose: bool = False
    encodings: str = "lossless"  # which encodings ilp, relax-*, gist* may choose (offload.step.encoding.MODES)
    recompute: bool = False  # whether ilp and relax-* may recompute runs of stages as well
    max_run: int = 8  # the longest recomputed run they consider
    in_stage: bool = True  # whether ilp, relax-* and recompute-only may re-run a stage in part (its in-stage options)


@dataclass
class Result:
    schedule: Schedule
    simulation: Simulation
    status: str  # optimal | feasible | timed-out (heuristic kept) | heuristic
    bound_s: float
    gap: float
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Planned:
    """What a method chose: the offloads, the encodings, notes for ``solver`` info, the
    recomputed runs, the stages whose weight casts are kept."""

    offloads: list[Offload]
    encode: Choice = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    recompute: tuple[Recompute, ...] = ()
    casts_kept: tuple[int, ...] = ()

    def simulate(self, chain: Chain, budget: Budget | int | None = None) -> Simulation:
        """This plan replayed on ``chain`` (refused over ``budget``, if given)."""
        return simulate(chain, self.offloads, budget, encode=self.encode, recompute=self.recompute,
                        casts_kept=self.casts_kept)


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    run: Callable[["_Context"], Planned | None]


@dataclass
class _Context:
    chain: Chain
    budget: int
    options: Options
    lp_bound_s: float
    lp: Any
    deadline: Deadline

    @property
    def mode(self) -> str:
        return self.options.encodings

    @property
    def max_run(self) -> int:
        """The longest recomputed run the joint methods consider (0: none)."""
        return self.options.max_run if self.options.recompute else 0

    @property
    def heuristic_s(self) -> float:
        """Local-search time of one relax heuristic: its option, within a quarter of what is left."""
        return min(self.options.heuristic_time_s, self.deadline.share(0.25))


def _fixed(name: str) -> Callable[[_Context], Planned | None]:
    def run(ctx: _Context) -> Planned | None:
        plan = baselines.FIXED_PLANS[name](ctx.chain)
        return Planned(plan) if baselines.fits(ctx.chain, plan, ctx.budget) else None
    return run


def _adaptive(policy: Callable[[Chain, int], list[Offload] | None]) -> Callable[[_Context], Planned | None]:
    def run(ctx: _Context) -> Planned | None:
        plan = policy(ctx.chain, ctx.budget)
        return Planned(plan) if plan is not None else None
    return run


def _torch_offload(ctx: _Context) -> Planned | None:
    """The units our ILP offloads (and its recomputed runs), placed by PyTorch's rules
    (``baselines.torch_placement``); ``None`` where that placement does not fit."""
    ours = _ilp(ctx)
    units = sorted(o.stage for o in ours.offloads)
    plan = baselines.torch_placement(ctx.chain, units, ctx.budget)
    if simulate(ctx.chain, plan, recompute=ours.recompute).peak_bytes > ctx.budget:
        return None
    return Planned(plan, info={"units_from": "ilp", "ilp_status": ours.info.get("status")}, recompute=ours.recompute)


def _found(ctx: _Context, found: relax.Found) -> Planned | None:
    """The heuristic's schedule, with the weight casts it has room for, ``None`` if it does not
    fit (below the offloading floor, where only some recomputations can, the search may find
    none)."""
    offloads, encode, runs = found
    if simulate(ctx.chain, offloads, encode=encode, recompute=runs).peak_bytes > ctx.budget:
        return None
    return Planned(offloads, encode, recompute=tuple(runs),
                   casts_kept=keep_casts(ctx.chain, ctx.budget, offloads, encode, runs))


def _relax_lp(ctx: _Context, until: Deadline | None = None) -> Planned | None:
    """``until``: the end of this heuristic's every phase (default: the solve's)."""
    return _found(ctx, relax.relax_lp(ctx.chain, ctx.budget, ctx.lp, ctx.heuristic_s, ctx.mode, LP_BOUND_MAX_STAGES,
                                      ctx.max_run, until or ctx.deadline))


def _relax_bw(ctx: _Context, until: Deadline | None = None) -> Planned | None:
    return _found(ctx, relax.relax_bw(ctx.chain, ctx.budget, ctx.heuristic_s, ctx.mode, ctx.max_run,
                                      until or ctx.deadline))


def _gist(with_swap: bool) -> Callable[[_Context], Planned | None]:
    """Gist: every unit stored with its smallest allowed encoding; then no offloading, or
    Zhang et al.'s swap (size x idle ranking) on the encoded chain."""
    def run(ctx: _Context) -> Planned | None:
        choice = encoding.smallest(ctx.chain, ctx.mode)
        derived = encoding.apply(ctx.chain, choice)
        plan = baselines.swap_ranked(derived, ctx.budget, by_size=True) if with_swap else []
        if plan is None or simulate(derived, plan).peak_bytes > ctx.budget:
            return None
        return Planned(plan, choice)
    return run


def _span(chain: Chain, p: Planned) -> float:
    return p.simulate(chain).makespan_s


def _ilp(ctx: _Context) -> Planned:
    chain, budget, opt = ctx.chain, ctx.budget, ctx.options
    warm_start = Deadline(ctx.deadline.share(0.5))  # both heuristics, every phase: the MILP gets the rest
    fitting = [p for p in (_relax_lp(ctx, warm_start), _relax_bw(ctx, warm_start)) if p is not None]
    if not fitting:  # below the offloading floor with no recomputation found that fits: the MILP decides
        return _milp(ctx, None, offload=True)
    warm = min(fitting, key=lambda p: _span(chain, p))
    if ctx.max_run and chain.optional and chain.L <= FULL_MILP_MAX_STAGES:
        # the per-block optimum, a smaller MILP, is a point of the options' class: the larger
        # MILP starts from it, so its schedule is never worse than deciding per block
        alone = replace(ctx, chain=chain.without_options(), deadline=Deadline(ctx.deadline.share(0.3)))
        per_block = _milp(alone, None if any(r.option for r in warm.recompute) else warm, offload=True)
        if per_block is not None and _span(chain, per_block) < _span(chain, warm):
            warm = per_block
    warm_span = _span(chain, warm)
    options = encoding.allowed(chain, ctx.mode)
    base = {"backend": opt.solver, "time_limit_s": opt.time_limit_s, "gap_limit": opt.gap, "warm_start_s": warm_span}
    if chain.L > FULL_MILP_MAX_STAGES:
        if warm.recompute:  # the windows re-optimize offloads and encodings only
            return replace(warm, info={**base, "status": "feasible", "note": f"{chain.L} stages with recomputation: "
                                       "the best relax-* schedule is returned (the window search does not move runs)"})
        return _ilp_windows(ctx, warm, warm_span, options, base)
    target = budget
    for _ in range(3):  # a solver tolerance may round a binary onto the wrong side by a few bytes
        try:
            res = solve_ilp(chain, target, warm=warm.offloads, warm_encode=warm.encode, options=options,
                            lower_bound_s=ctx.lp_bound_s, solver=opt.solver, time_limit=None, gap=opt.gap,
                            threads=opt.threads, msg=opt.verbose, deadline=ctx.deadline, max_run=ctx.max_run,
                            warm_runs=warm.recompute, warm_casts=warm.casts_kept)
        except OutOfTime:
            return replace(warm, info={**base, "status": "timed-out", "note": "the time limit passed while the "
                                       "MILP was built; the warm start (best heuristic) is returned"})
        out = res.outcome
        info = {**base, "solver_seconds": round(out.seconds, 3), "build_seconds": round(res.build_s, 3),
                "variables": res.variables, "constraints": res.constraints, "nodes": out.nodes,
                "solver_stop": out.stop, "objective_s": res.objective_s, "solver_bound_s": res.dual_bound_s}
        if res.offloads is None:
            if out.stop != "time-limit":
                raise SolverFailure(f"the MILP solver stopped without a schedule ({out.stop})",
                                    "try --solver cbc, or report the chain: the warm start proves one exists")
            return replace(warm, info={**info, "status": "timed-out",
                                       "note": "the solver found no schedule in time; the warm start (best heuristic) is returned"})
        found = Planned(res.offloads, res.encode, recompute=tuple(res.recompute), casts_kept=tuple(res.casts_kept))
        peak = found.simulate(chain).peak_bytes
        if peak <= budget:
            break
        target -= peak - budget + 1
    else:
        raise SolverFailure("the ILP's schedules exceed the budget after 3 tightened solves (numerical trouble)")
    if _span(chain, found) > warm_span * (1 + 1e-9):  # worse, not a rounding of the same time
        return replace(warm, info={**info, "status": "feasible", "note": "the solver's incumbent was worse than the warm start; the warm start is returned"})
    return replace(found, info={**info, "status": "optimal" if out.proven and target == budget else "feasible"})


def _checkpointing(name: str) -> Callable[[_Context], Planned | None]:
    def run(ctx: _Context) -> Planned | None:
        planned = Planned([], recompute=tuple(checkpointing.POLICIES[name](ctx.chain)))
        return planned if planned.simulate(ctx.chain).peak_bytes <= ctx.budget else None
    return run


def _recompute_only(ctx: _Context) -> Planned | None:
    """The best recompute-only schedule: the MILP with offloading turned off, warm-started
    from the checkpointing policy that fits, if one does."""
    chain, opt = ctx.chain, ctx.options
    fitting = [p for p in (_checkpointing(n)(ctx) for n in checkpointing.RECOMPUTE_ONLY)
               if p is not None and all(len(r.stages) <= opt.max_run for r in p.recompute)]
    return _milp(ctx, min(fitting, key=lambda p: _span(chain, p), default=None), offload=False)


def _milp(ctx: _Context, warm: Planned | None, offload: bool) -> Planned | None:
    """The MILP over the class (``offload``: offloading and encodings allowed, else recomputation
    only), warm-started from ``warm`` if given; ``None`` if it proves that nothing fits."""
    opt = ctx.options
    try:
        res = solve_ilp(ctx.chain, ctx.budget, warm=list(warm.offloads) if warm else None,
                        warm_runs=warm.recompute if warm else (),
                        options=encoding.allowed(ctx.chain, ctx.mode) if offload else None,
                        solver=opt.solver, time_limit=None, gap=opt.gap, threads=opt.threads, msg=opt.verbose,
                        deadline=ctx.deadline, max_run=opt.max_run, offload=offload)
    except OutOfTime:
        return replace(warm, info={"status": "timed-out"}) if warm else None
    out = res.outcome
    if res.offloads is None:
        return replace(warm, info={"status": "timed-out"}) if warm and out.stop == "time-limit" else None
    info = {"backend": opt.solver, "solver_seconds": round(out.seconds, 3), "solver_stop": out.stop,
            "solver_bound_s": res.dual_bound_s, "status": "optimal" if out.proven else "feasible"}
    return Planned(list(res.offloads), dict(res.encode or {}), recompute=tuple(res.recompute), info=info,
                   casts_kept=tuple(res.casts_kept))


def _ilp_windows(ctx: _Context, warm: Planned, warm_span: float, options: dict, base: dict) -> Planned:
    """The ILP on a long chain: the warm start improved window by window (``solver.lns``)."""
    opt = ctx.options
    start = lns.Incumbent(list(warm.offloads), dict(warm.encode), warm_span, warm.casts_kept)
    best = lns.improve(ctx.chain, ctx.budget, start, options=options, deadline=ctx.deadline, solver=opt.solver,
                       threads=opt.threads, msg=opt.verbose)
    gained = sum(e.get("gain_s", 0.0) for e in best.log)
    info = {**base, "status": "feasible", "windows": len(best.log), "windows_improved": sum("gain_s" in e for e in best.log),
            "note": f"{ctx.chain.L} stages: the MILP was solved window by window (large-neighbourhood search, "
                    f"{len(best.log)} windows), improving the best heuristic by {100 * gained / warm_span:.2f}%"}
    return Planned(best.offloads, best.encode, info, casts_kept=best.casts_kept)


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("ilp", "exact MILP (PuLP; HiGHS, or CBC with --solver cbc), warm-started from the best relax-* schedule; proves optimality or reports its gap", _ilp),
    Method("relax-lp", "fluid LP relaxation (fractional offload, divisible copies) rounded at several thresholds, repaired and improved by local search", _relax_lp),
    Method("relax-bw", "infinite-bandwidth relaxation (least-volume memory cover), then stalls repaired by local search", _relax_bw),
    Method("none", "no offloading (feasible only above the no-offload peak)", _fixed("none")),
    Method("vdnn-all", "vDNN_all: offload every unit, per-layer sync, prefetch one op ahead", _fixed("vdnn-all")),
    Method("vdnn-conv", "vDNN_conv: offload units of conv stages only, per-layer sync, prefetch one op ahead", _fixed("vdnn-conv")),
    Method("vdnn-dyn", "vDNN_dyn (reduced): first of none, vdnn-conv, vdnn-all that fits the budget", _adaptive(baselines.vdnn_dyn)),
    Method("layrub", "Layrub inter-layer: offload all but the first and last three stages, per-layer sync, one-op lookahead", _fixed("layrub")),
    Method("swap-idle", "Zhang et al.: swap units by longest idle time until memory fits, stick-to-limit timing", _adaptive(lambda c, b: baselines.swap_ranked(c, b, by_size=False))),
    Method("swap-size-idle", "Zhang et al.: swap units by (idle time - transfer time) x size until memory fits, stick-to-limit timing", _adaptive(lambda c, b: baselines.swap_ranked(c, b, by_size=True))),
    Method("save-on-cpu", "torch save_on_cpu: offload everything, release at once, fetch on demand (exposed)", _fixed("save-on-cpu")),
    Method("torch-offload", "PyTorch's activation offloading under torch.compile placing the units the ilp offloads: a wait right after each copy (per-layer sync), reloads hoisted by transfer time", _torch_offload),
    Method("gist", "Gist: every unit stored with its smallest allowed encoding (lossless unless --encodings lossy), no offloading", _gist(with_swap=False)),
    Method("gist-swap", "Gist's encodings, then swap-size-idle on the encoded chain (encode before offloading)", _gist(with_swap=True)),
    Method("recompute-only", "the optimal recompute-only schedule over the class (the MILP with offloading off: rotor's role)", _recompute_only),
    Method("checkpoint-sqrt", "torch checkpoint_sequential: runs of ceil(sqrt L) stages recomputed, the last segment kept", _checkpointing("checkpoint-sqrt")),
    Method("checkpoint-blocks", "per-block activation checkpointing: every stage but the last recomputed from its own input", _checkpointing("checkpoint-blocks")),
    Method("checkpoint-matmuls", "op-level selective checkpointing (torchtitan's \"save the matmuls\"): checkpoint-blocks, each block keeping its matmul and attention outputs", _checkpointing("checkpoint-matmuls")),
    Method("checkpoint-every-other-matmul", "torchtitan's default op-level policy: checkpoint-matmuls, every second matmul of a block re-run too", _checkpointing("checkpoint-every-other-matmul")),
    Method("checkpoint-blocks-offload", "torchtune's OffloadActivations with per-block checkpointing: checkpoint-blocks, each block's input offloaded as soon as that frees it, fetched one op ahead of its rebuild", _checkpointing("checkpoint-blocks-offload")),
    Method("checkpoint-matmuls-offload", "torchtune's OffloadActivations with op-level selective checkpointing: checkpoint-matmuls, each block's input and kept outputs offloaded alike", _checkpointing("checkpoint-matmuls-offload")),
]}
RECOMPUTING = {"recompute-only", *checkpointing.POLICIES}  # methods that recompute whatever the options
RETIMED = {"torch-offload"}  # methods that solve the ILP first and time its choice their own way


def _refuse_below_floor(chain: Chain, budget: Budget, mode: str, recompute: bool) -> int:
    """The smallest feasible activation budget with ``mode``'s encodings (with ``recompute``, a
    lower bound on it); ``InfeasibleBudget`` naming the op that holds it when ``budget`` is below."""
    memory, _ = encoded_floor.floor_by_op(chain, mode, recompute)
    floor = int(memory.max())
    if budget.excess(chain, floor) > 0:
        o = int(memory.argmax())
        smallest, base = budget.counted(chain, floor), budget.base(chain)
        asked, least = told_apart(budget.nbytes, smallest)
        own = _own_share(chain, o, floor)
        raise InfeasibleBudget(
            f"budget {asked} ({budget.scope}) is below the smallest feasible budget {least}: even with every "
            f"unit offloaded at once and fetched on demand{' or recomputed' if recompute else ''}, {op_name(chain, o)} "
            f"holds {format_bytes(floor)} of activations"
            + (f" on top of {format_bytes(base)} of weights, gradients, optimizer state and the batch" if base else "")
            + own,
            f"use --budget {smallest} or more, or a smaller batch"
            + (" (where the op's own memory follows the batch: a weight's gradient does not)" if own else ""),
            smallest_bytes=smallest)
    return floor


def _own_share(chain: Chain, o: int, floor: int) -> str:
    """Where most of the floor is the op's own temporary memory, say so: a user then knows that
    no schedule of activations lowers it (a backward's weight gradient before it is added to
    ``.grad``, a large kernel's workspace), and what to look at instead."""
    own = min(int(op_transients(chain)[o]), floor)
    if 2 * own <= floor:  # not most of it
        return ""
    return (f"; {format_bytes(own)} of it is {op_name(chain, o)}'s own temporary memory (what its kernels "
            "allocate and free within it, measured: no schedule moves it; in a backward, the gradients it makes)")


def _bounds(ctx: _Context, encoded: bool, info: dict[str, Any]) -> dict[str, float]:
    """Every lower bound that holds for this solve, by name."""
    bounds = {"ideal_s": ctx.chain.ideal_makespan_s}
    if encoded:  # the fluid LP knows neither encodings nor recomputation: no bound then
        pass
    elif ctx.lp is not None and ctx.lp.proven:
        bounds["lp_s"] = ctx.lp_bound_s
    elif ctx.chain.L > LP_BOUND_MAX_STAGES:
        info.setdefault("bound_note", f"fluid LP bound skipped above {LP_BOUND_MAX_STAGES} stages (its solve grows "
                                      "past seconds); the gap is to the ideal makespan")
    else:
        info.setdefault("bound_note", "the fluid LP bound was not solved within its share of the time limit; the gap "
                                      "is to the ideal makespan")
    if info.get("solver_bound_s") is not None:
        bounds["solver_s"] = info["solver_bound_s"]
    return bounds


def solve(chain: Chain, budget: Budget | int, method: str = "ilp", options: Options | None = None) -> Result:
    """Schedule ``chain`` under ``budget`` (an ``int``: activation bytes) with ``method``;
    raises ``InfeasibleBudget`` when it cannot."""
    if method not in METHODS:
        raise SolverFailure(f"unknown method {method!r}", f"choose one of: {', '.join(METHODS)} (offload solve --list-methods)")
    budget = Budget.of(budget)
    options = options or Options()
    t0 = time.perf_counter()
    deadline = Deadline(options.time_limit_s)
    floor = _refuse_below_floor(chain, budget, options.encodings, options.recompute or method in RECOMPUTING)
    act = budget.activations(chain)
    encoded = bool(encoding.allowed(chain, options.encodings))
    lp = fluid_lp(chain, act, Deadline(deadline.share(0.3))) if chain.L <= LP_BOUND_MAX_STAGES else None
    # the fluid LP knows neither encodings nor recomputation: with them it is no lower bound, the ideal still is
    unbounded = encoded or options.recompute or method in RECOMPUTING
    lp_bound = lp.makespan_s if lp is not None and lp.proven and not unbounded else chain.ideal_makespan_s
    # without in-stage options the methods search the chain without them (their schedules are the chain's)
    searched = chain if options.in_stage or method in checkpointing.WITH_OPTIONS else chain.without_options()
    ctx = _Context(searched, act, options, lp_bound, lp, deadline)
    planned = METHODS[method].run(ctx)
    if planned is None:
        own = baselines.own_smallest_budget(chain, method)
        smallest = budget.counted(chain, floor)
        raise InfeasibleBudget(
            f"method {method} cannot meet the budget {budget}"
            + (f": it needs at least {format_bytes(budget.counted(chain, own))}" if own is not None else ""),
            (f"no schedule with recomputation meets less than {format_bytes(smallest)} (a lower bound; the "
             f"exact MILP decides above it)" if options.recompute or method in RECOMPUTING else
             f"the smallest budget any schedule meets is {format_bytes(smallest)}")
            + ("" if method == "ilp" else ": try --method ilp or relax-lp"),
            smallest_bytes=smallest)
    info = dict(planned.info)
    sim = planned.simulate(chain, budget)
    bounds = _bounds(ctx, unbounded, info)
    span = sim.makespan_s
    status = info.pop("status", "heuristic")
    broken = sorted(name for name, b in bounds.items() if b > span * (1 + 1e-6))
    if broken:  # a bound above a schedule the simulator replayed: that bound's model is wrong, not the schedule
        warnings.warn(f"{', '.join(broken)} lies above the replayed makespan of a {method} schedule: a defect of "
                      "that bound's model (please report the chain); it is left out and nothing is called optimal")
        info["broken_bounds"] = {name: bounds.pop(name) for name in broken}
        status = "feasible" if status == "optimal" else status
    bound = min(max(bounds.values()), span)  # above it by the solver's tolerance at most (else broken)
    if span <= bound * (1 + 1e-9) and not broken:
        status = "optimal"  # meets a lower bound: proven whatever the method
    gap = max(0.0, (span - bound) / span) if span > 0 else 0.0
    seconds = time.perf_counter() - t0
    solver_info = {"status": status, "gap": gap, "seconds": round(seconds, 3), "bound_s": bound, "bounds": bounds,
                   "encodings": options.encodings, "recompute": options.recompute or method in RECOMPUTING, **info}
    predicted = {"makespan_s": span, "peak_bytes": budget.counted(chain, sim.peak_bytes), "stall_s": sim.stall_s,
                 "ideal_makespan_s": chain.ideal_makespan_s, "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes,
                 "encoded_units": len(planned.encode), "lossy": bool(encoding.lossy_stages(chain, planned.encode)),
                 "recomputed_units": sum(len(r.stages) for r in planned.recompute), "recompute_s": sim.recomputed_s}
    schedule = make_schedule(chain, planned.offloads, planned.recompute, planned.casts_kept, budget=budget, method=method,
                             solver=solver_info, encode=dict(planned.encode), predicted=predicted)
    return Result(schedule, sim, status, bound, gap, seconds, solver_info)
