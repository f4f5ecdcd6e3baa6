"""The two relaxation heuristics (the seed paper's approach: relax, solve, round back, repair).

Both choose *which* units to offload (and, when allowed, which to store encoded) through a
relaxation, then let ``policy.plan_greedy`` pick the release and prefetch points (optimal
for the forward given the set, need-order optimal for the backward), and finish with the
same search, every candidate scored by the simulator.  The result is always a
simulator-checked schedule within budget (the all-offload floor schedule is the
fallback), never a guess.

``relax-lp``  relaxes integrality, copy granularity and order: the fluid LP of
              ``bounds.fluid_lp`` (O(L) variables) gives a fractional offload share per
              unit; rounding thresholds turn it into sets, repaired to fit memory.
              Guarantee: the LP value is a lower bound, so the printed gap is certified.
              Beyond ``max_lp_stages`` the LP of the coarsened chain guides the rounding
              (``bounds.rounding_lp``).
``relax-bw``  relaxes bandwidth (copies take no time): then every set that fits memory
              with instant release and on-demand fetch reaches the ideal makespan, and
              the relaxed problem is a covering problem over the op sequence (unit ``i``
              covers the ops from ``F(i+2)`` to ``B(need_i + 1)``), solved greedily for the
              least moved volume, earlier stages first on ties (more time to hide).

The search (``iterated_search``): a state is a set of offloaded units, a choice of
encodings and, when recomputation is allowed, a set of recomputed runs.  First-improvement
descent over drop / add / swap of a unit, toggling one unit's encoding, and recomputing a
stage instead (a run of one), undoing a run (its units kept or offloaded), merging two
adjacent runs, splitting one, extending one by a neighbour or shrinking it by an end
stage; then, until the time budget is spent, a kick (drop one to three units, or with
recomputation ``_reassign``; cover the peaks again with random, preferably small, units)
and another descent.  With recomputation the starts include structured runs
(``_run_starts``, made to fit by ``_fit_runs``), and each of the three best is descended
first: link-bound ResNet-101 at 35% of its peak, 1.23x the joint MILP's schedule before
these, 1.007x with them (1 s of search; ``make recompute``).  The
kick matters on link-bound chains: several small copies can hide where the least volume,
a few large copies, cannot (DenseNet-121, link-bound, 85%: 1.34x the optimum before the
kick, the optimum with it).  With encodings, the starts are the relaxation on the derived
chains of three choices (none, Gist's smallest everywhere, the floor's).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from offload.step import encoding
from offload.step.actions import Offload, Recompute, first_checkpoint_release
from offload.step.chain import Chain
from offload.step.memory import floor_offloads, floor_savings, smallest_feasible_budget
from offload.step.recompute import moved_checkpoint_bytes, run_op
from offload.step.simulate import simulate

from . import encoded_floor
from .bounds import FluidLP, rounding_lp
from .checkpointing import recomputable_parts, sqrt_runs
from .deadline import Deadline
from .policy import cover_peaks, floor_memory, plan_greedy

MAX_RUN_START_STAGES = 200  # longer chains start from the relaxation and from every stage its own run

# offloaded units, encodings (sorted), recomputed runs
State = tuple[frozenset[int], tuple[tuple[int, str], ...], frozenset[Recompute]]


def _state(units: set[int] | frozenset[int], choice: dict[int, str], runs: frozenset[Recompute] = frozenset()) -> State:
    return frozenset(units), tuple(sorted(choice.items())), frozenset(runs)


class _Scorer:
    """Memoized makespan of the greedy plan for a state (``inf`` if it cannot fit)."""

    def __init__(self, chain: Chain, budget: int) -> None:
        self.chain, self.budget = chain, budget
        self.cache: dict[State, tuple[float, list[Offload] | None]] = {}
        self.derived: dict[tuple, Chain] = {}

    def derive(self, choice: tuple[tuple[int, str], ...]) -> Chain:
        """The chain with these encodings applied (``encoding.apply``), cached."""
        if choice not in self.derived:
            self.derived[choice] = encoding.apply(self.chain, dict(choice))
        return self.derived[choice]

    def __call__(self, state: State) -> float:
        if state not in self.cache:
            chain = self.derive(state[1])
            plan = plan_greedy(chain, state[0], self.budget, state[2])
            span = np.inf
            if plan is not None:
                sim = simulate(chain, plan, recompute=state[2])
                span = sim.makespan_s if sim.peak_bytes <= self.budget else np.inf
            self.cache[state] = (span, plan)
        return self.cache[state][0]

    def plan(self, state: State) -> list[Offload] | None:
        self(state)
        return self.cache[state][1]


def _fill(chain: Chain, budget: int, units: set[int], order: list[int]) -> set[int]:
    """Add units in ``order`` until the set fits memory (the floor schedule always does).

    Incremental: adding unit ``i`` lowers the floor memory by its ``floor_savings``."""
    units = set(units)
    mem = floor_memory(chain, units)
    for i in order:
        if mem.max() <= budget:
            break
        if i not in units:
            units.add(i)
            for lo, hi, saved in floor_savings(chain, i):
                mem[lo:hi] -= saved
    return units


class _Moves:
    """Neighbours of a state: drop, add or swap one unit (swaps between nearby stages on
    long chains, so that a pass fits the time budget), change one unit's encoding, and with
    ``max_run``: recompute one more stage (a run of one, the unit no longer offloaded),
    undo a run (its units kept, or offloaded), merge two adjacent runs (up to ``max_run``
    stages) or split one, re-run a run of one stage whole or in part (its in-stage options),
    offload its checkpoint (released as early as that frees it, fetched on demand or one op
    ahead) or keep it.

    Held as small descriptions and built into states one at a time when read: on a chain of
    10,000 stages there are ~10^5 moves, each a set of thousands of units once built."""

    def __init__(self, chain: Chain, state: State, opts: dict[int, tuple], max_run: int = 0) -> None:
        self.units, self.choice, self.runs = state[0], dict(state[1]), state[2]
        rebuilt = {i for r in self.runs for i in r.stages}
        U = [i for i in chain.offloadable if i not in rebuilt]
        radius = len(U) if len(U) <= 80 else 8
        inside = sorted(self.units)
        outside = [i for i in U if i not in self.units]
        self.moves: list[tuple] = [("drop", u) for u in inside] + [("add", v) for v in outside]
        for u in inside:
            lo, hi = bisect.bisect_left(outside, u - radius), bisect.bisect_right(outside, u + radius)
            self.moves += [("swap", u, v) for v in outside[lo:hi]]
        for i, es in opts.items():
            if i not in rebuilt:
                self.moves += [("encode", i, name) for name in [None] + [e.name for e in es] if name != self.choice.get(i)]
        if max_run:
            self.moves += [("recompute", i) for i in sorted(chain.recomputable) if i not in rebuilt and i not in self.choice]
            self.moves += [("undo", r) for r in self.runs] + [("offload", r) for r in self.runs]
            self.moves += [("split", r) for r in self.runs if r.last > r.first]
            self.moves += [("option", r, name) for r in self.runs if r.last == r.first
                           for name in ["", *(o.name for o in chain.stage(r.first).options)] if name != r.option]
            self.moves += [("checkpoint", r, moved) for r in self.runs for moved in _checkpoint_places(chain, r)]
            self.moves += [("shrink", r, i) for r in self.runs if r.last > r.first for i in (r.first, r.last)]
            self.moves += [("extend", r, i) for r in self.runs if len(r.stages) < max_run for i in (r.first - 1, r.last + 1)
                           if i not in rebuilt and i not in self.choice and chain.can_recompute(min(r.first, i), max(r.last, i))]
            ends = {r.last: r for r in self.runs}
            self.moves += [("merge", ends[r.first - 1], r) for r in self.runs
                           if r.first - 1 in ends and r.last - ends[r.first - 1].first < max_run
                           and chain.can_recompute(ends[r.first - 1].first, r.last)]

    def __len__(self) -> int:
        return len(self.moves)

    def __getitem__(self, k: int) -> State:
        kind, *args = self.moves[k]
        units, choice, runs = self.units, self.choice, self.runs
        if kind == "drop":
            units = units - {args[0]}
        elif kind == "add":
            units = units | {args[0]}
        elif kind == "swap":
            units = (units - {args[0]}) | {args[1]}
        elif kind == "encode":
            i, name = args
            choice = {k: v for k, v in choice.items() if k != i} | ({i: name} if name else {})
        elif kind == "recompute":
            units, runs = units - {args[0]}, runs | {Recompute(args[0], args[0])}
        elif kind == "undo":
            runs = runs - {args[0]}
        elif kind == "offload":  # the run's units offloaded instead (``recompute``'s inverse)
            units, runs = units | set(args[0].stages), runs - {args[0]}
        elif kind == "shrink":  # an end stage kept instead
            r, i = args
            runs = (runs - {r}) | {Recompute(r.first + (i == r.first), r.last - (i == r.last))}
        elif kind == "extend":  # a neighbouring stage joins the run
            r, i = args
            units, runs = units - {i}, (runs - {r}) | {Recompute(min(r.first, i), max(r.last, i))}
        elif kind == "option":  # a run of one stage re-run whole or in part (an in-stage option)
            r, name = args
            runs = (runs - {r}) | {Recompute(r.first, r.last, name)}
        elif kind == "checkpoint":  # the run's checkpoint kept or offloaded at other points
            runs = (runs - {args[0]}) | {args[1]}
        elif kind == "split":
            runs = (runs - {args[0]}) | {Recompute(i, i) for i in args[0].stages}
        else:  # merge
            runs = (runs - set(args)) | {Recompute(args[0].first, args[1].last)}
        return _state(units, choice, runs)


def _checkpoint_places(chain: Chain, run: Recompute) -> list[Recompute]:
    """``run`` with its checkpoint kept, or offloaded (released as soon as that frees it,
    fetched on demand or one op ahead), less ``run`` itself: none for a checkpoint that
    cannot move."""
    if not moved_checkpoint_bytes(chain, run):
        return []
    first, need = first_checkpoint_release(chain, run), run_op(chain, run)
    places = {run.kept_on_device()} | {replace(run, release=first, prefetch=k) for k in {need, min(chain.L, need + 1)}}
    return sorted(places - {run})


def local_search(chain: Chain, score: _Scorer, start: State, deadline: float, opts: dict[int, tuple],
                 max_run: int = 0) -> State:
    """First-improvement descent over ``_Moves`` until a whole round of moves finds nothing
    better or time is up.  After an improvement the scan goes on from where it stopped (a
    restart from the first move would try the same early moves again and again)."""
    ideal = chain.ideal_makespan_s
    best, best_s = start, score(start)
    moves, at, tried = _Moves(chain, best, opts, max_run), 0, 0
    while tried < len(moves) and best_s > ideal * (1 + 1e-12) and time.perf_counter() < deadline:
        cand = moves[at % len(moves)]
        at, tried = at + 1, tried + 1
        s = score(cand)
        if s < best_s * (1 - 1e-12):
            best, best_s = cand, s
            moves, tried = _Moves(chain, best, opts, max_run), 0
            at %= max(1, len(moves))
    return best


def _recover(score: _Scorer, units: set[int], choice: tuple, runs: frozenset[Recompute],
             rng: np.random.Generator) -> set[int]:
    """Cover the peaks again after units were dropped: each pick a random unit absent from the
    worst op, smaller units more likely (several small copies hide where one large one cannot)."""
    chain = score.derive(choice)

    def pick(cands: np.ndarray, excess: int) -> int:
        weight = 1.0 / chain.a[cands].astype(float)
        return int(rng.choice(cands, p=weight / weight.sum()))
    chosen = cover_peaks(chain, score.budget, pick, start=units, runs=runs)
    return chosen if chosen is not None else set(chain.offloadable) - {i for r in runs for i in r.stages}


def _reassign(chain: Chain, state: State, rng: np.random.Generator) -> tuple[set[int], dict[int, str], frozenset[Recompute]]:
    """A kick over the three options of a stage: one to three stages among four neighbours
    each get another of keep / offload / recompute (a run of one), the runs they leave split
    around them.  The optimum often trades a recomputation for an offload nearby (ViT,
    link-bound, 35%: recompute 4 and offload 6 rather than recompute 6), which no single
    move reaches downhill."""
    units, choice, runs = set(state[0]), dict(state[1]), set(state[2])
    offloadable, recomputable = set(chain.offloadable), set(chain.recomputable)
    stages = sorted(offloadable | recomputable)
    if not stages:  # nothing to reassign
        return units, choice, frozenset(runs)
    at = int(rng.integers(len(stages)))
    window = stages[at:at + 4]
    for s in rng.choice(window, size=int(rng.integers(1, min(3, len(window)) + 1)), replace=False).tolist():
        inside = [r for r in runs if s in r.stages]
        now = "offload" if s in units else "recompute" if inside else "keep"
        options = [o for o in ("keep", "offload", "recompute") if o != now
                   and (o != "offload" or s in offloadable) and (o != "recompute" or s in recomputable)]
        units.discard(s)
        for r in inside:
            runs.remove(r)
            runs |= {Recompute(a, b) for a, b in ((r.first, s - 1), (s + 1, r.last)) if a <= b}
        new = options[int(rng.integers(len(options)))]
        if new == "offload":
            units.add(s)
        elif new == "recompute":
            runs.add(Recompute(s, s))
            choice.pop(s, None)
    return units, choice, frozenset(runs)


def iterated_search(chain: Chain, score: _Scorer, start: State, deadline: float, opts: dict[int, tuple],
                    max_run: int = 0) -> State:
    """``local_search``, then until time is up a kick and another descent: drop one to three
    units of the current state (each losing its encoding half the time; a quarter of the
    kicks drop every encoding), or, with recomputation, half the time ``_reassign``; then
    cover the peaks again at random (``_recover``).  Move to the result when it is no
    worse, keep the best.  Seeded, so a run is reproducible unless time cuts it short."""
    ideal = chain.ideal_makespan_s
    rng = np.random.default_rng(0)
    best = current = local_search(chain, score, start, deadline, opts, max_run)
    while time.perf_counter() < deadline and score(best) > ideal * (1 + 1e-12) and (current[0] or max_run):
        if max_run and (not current[0] or rng.random() < 0.5):
            units, choice, runs = _reassign(chain, current, rng)
        else:
            units, runs = set(current[0]), current[2]
            dropped = set(rng.choice(sorted(units), size=int(rng.integers(1, min(3, len(units)) + 1)), replace=False).tolist())
            choice = {} if rng.random() < 0.25 else {i: e for i, e in current[1] if i not in dropped or rng.random() < 0.5}
            units -= dropped
        kept = _state(set(), choice)[1]
        kicked = _state(_recover(score, units, kept, runs, rng), choice, runs)
        cand = local_search(chain, score, kicked, deadline, opts, max_run)
        if score(cand) <= score(current):
            current = cand
        if score(cand) < score(best):
            best = cand
    return best


Found = tuple[list[Offload], dict[int, str], list[Recompute]]


def _search(chain: Chain, budget: int, mode: str, time_budget_s: float,
            start_sets: Callable[[Chain], list[set[int]]], max_run: int = 0, until: Deadline | None = None) -> Found:
    """Starts from ``start_sets(derived)`` for a few encoding choices, then ``iterated_search``
    (recomputing runs of up to ``max_run`` stages where that helps), for ``time_budget_s`` and
    never past ``until``."""
    deadline = min(time.perf_counter() + time_budget_s, until.end if until is not None else math.inf)
    score = _Scorer(chain, budget)
    opts = encoding.allowed(chain, mode)
    choices = [{}] + ([encoding.smallest(chain, mode), encoded_floor.floor(chain, mode)[1]] if opts else [])
    starts = []
    for choice in {tuple(sorted(c.items())): c for c in choices}.values():
        derived = score.derive(tuple(sorted(choice.items())))
        if smallest_feasible_budget(derived) <= budget:
            starts += [_state(units, choice) for units in start_sets(derived)]
    if max_run or not starts:  # below the offloading floor only recomputation can fit: every stage its own run
        runs = frozenset(Recompute(i, i) for i in chain.recomputable) if max_run else frozenset()
        starts.append(_state(set(chain.offloadable) - {r.first for r in runs}, {}, runs))
    if max_run and chain.L <= MAX_RUN_START_STAGES:  # at most a quarter of the time
        until = time.perf_counter() + time_budget_s / 4
        for runs in _run_starts(chain, max_run):
            runs = _fit_runs(chain, budget, runs, max_run, until)
            units = cover_peaks(chain, budget, _smallest_enough(chain), runs=runs) if runs else None
            if units is not None:
                starts.append(_state(units, {}, frozenset(runs)))
    if max_run:  # run structures differ in kind: a descent from each of the three best starts
        ranked = sorted(dict.fromkeys(starts), key=score)[:3]
        starts = [local_search(chain, score, s, deadline, opts, max_run) for s in ranked]
    best = iterated_search(chain, score, min(starts, key=score), deadline, opts, max_run)
    plan = score.plan(best)
    if plan is None or score(best) == np.inf:  # unreachable: every start fits, so its floor schedule does
        derived = score.derive(best[1])
        return floor_offloads(derived), dict(best[1]), []
    return plan, dict(best[1]), sorted(best[2])


def _lp_sets(derived: Chain, budget: int, lp: FluidLP | None) -> list[set[int]]:
    """The fluid LP's fractional offload rounded at several thresholds, each repaired to fit."""
    U = derived.offloadable
    if lp is None:
        return [set(U)]
    by_share = sorted(U, key=lambda i: (-lp.fraction[i], i))
    return [_fill(derived, budget, {i for i in U if lp.fraction[i] >= theta}, by_share)
            for theta in (0.999, 0.9, 0.75, 0.5, 0.25, 0.1, 0.01)]


def relax_lp(chain: Chain, budget: int, lp: FluidLP | None = None, time_budget_s: float = 1.0,
             mode: str = "none", max_lp_stages: int = 2000, max_run: int = 0, until: Deadline | None = None) -> Found:
    """Round the fluid LP's fractional offload and search from there (module docstring);
    ``lp`` is the plain chain's LP when the caller has it.  Nothing runs past ``until``: an LP
    not solved by then leaves every unit offloaded as the start."""
    def sets(derived: Chain) -> list[set[int]]:
        own = lp if derived is chain and lp is not None else rounding_lp(derived, budget, max_lp_stages, until)
        return _lp_sets(derived, budget, own)
    return _search(chain, budget, mode, time_budget_s, sets, max_run, until)


def _run_starts(chain: Chain, max_run: int) -> list[list[Recompute]]:
    """Sets of runs to start from, their peaks then covered by offloads: runs of one to four
    stages at every offset over the first quarter, half, or all of the chain (early stages
    hold the most activations per second of forward; every run holds its checkpoint until
    its backward, so where single-stage runs cannot fit, longer ones can), and sqrt(L)-stage
    runs."""
    starts = []
    for part in (0.25, 0.5, 1.0):  # the fewest runs, the quickest to fit, first
        end = min(int(part * chain.L), chain.L - 1)
        for size in range(1, min(4, max_run) + 1):
            for offset in range(size):
                starts.append([r for first in range(1 + offset, end + 1, size)
                               for r in recomputable_parts(chain, first, min(first + size - 1, end))])
    return [s for s in starts if s] + [[r for r in sqrt_runs(chain) if len(r.stages) <= max_run]]


def _fit_runs(chain: Chain, budget: int, runs: list[Recompute], max_run: int, deadline: float) -> list[Recompute]:
    """``runs`` changed until offloading every other unit fits: each step takes, of removing
    one run or merging two adjacent ones (one checkpoint less), the change that leaves the
    least excess memory.  Nothing when the deadline passes first."""
    def excess(runs: list[Recompute]) -> int:
        rebuilt = {i for r in runs for i in r.stages}
        return int(floor_memory(chain, [i for i in chain.offloadable if i not in rebuilt], runs).max()) - budget
    runs = sorted(runs)
    while runs and excess(runs) > 0:
        if time.perf_counter() > deadline:
            return []
        options = [runs[:k] + runs[k + 1:] for k in range(len(runs))]
        options += [runs[:k] + [Recompute(a.first, b.last)] + runs[k + 2:] for k, (a, b) in enumerate(zip(runs, runs[1:]))
                    if a.last + 1 == b.first and b.last - a.first < max_run and chain.can_recompute(a.first, b.last)]
        runs = min(options, key=excess)
    return runs


def _smallest_enough(chain: Chain) -> Callable[[np.ndarray, int], int]:
    """``cover_peaks``' pick of the least volume: the smallest unit that covers the peak's
    excess alone, else the largest."""
    def pick(cands: np.ndarray, excess: int) -> int:
        sizes = chain.a[cands]
        enough = sizes >= excess
        if enough.any():  # smallest such, ties: earlier stage
            return int(cands[enough][np.lexsort((cands[enough], sizes[enough]))[0]])
        return int(cands[np.lexsort((-cands, sizes))[-1]])  # largest, ties: earlier stage
    return pick


def cover_without_bandwidth(chain: Chain, budget: int, until: float = math.inf) -> set[int]:
    """Least-volume set that fits memory when copies are instant (greedy interval cover); every
    unit when it is not done by ``until``."""
    chosen = cover_peaks(chain, budget, _smallest_enough(chain), until=until)
    return chosen if chosen is not None else set(chain.offloadable)


def relax_bw(chain: Chain, budget: int, time_budget_s: float = 1.0, mode: str = "none", max_run: int = 0,
             until: Deadline | None = None) -> Found:
    """Solve the infinite-bandwidth relaxation, then search from there (module docstring);
    nothing runs past ``until``."""
    def sets(derived: Chain) -> list[set[int]]:
        # second start: the same volume taken from the earliest stages (most time to hide copies)
        end = until.end if until is not None else math.inf
        return [cover_without_bandwidth(derived, budget, end), _fill(derived, budget, set(), sorted(derived.offloadable))]
    return _search(chain, budget, mode, time_budget_s, sets, max_run, until)
