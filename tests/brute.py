"""Brute force over the schedule class: the reference the MILP's exactness is tested against."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator

import pytest

from offload.errors import InfeasibleBudget
from offload.solver.methods import Options, solve
from offload.step.actions import Offload, Recompute, first_checkpoint_release
from offload.step.chain import Chain
from offload.step.recompute import moved_checkpoint_bytes, run_op
from offload.step.simulate import simulate


def all_runs(L: int) -> Iterator[list[Recompute]]:
    """Every set of runs over stages 1..L-1: each stage kept, starting a run, or extending one."""
    for marks in itertools.product("-sc", repeat=max(0, L - 1)):
        if marks and marks[0] == "c" or any(m == "c" and p == "-" for p, m in zip(marks, marks[1:])):
            continue
        runs: list[list[int]] = []
        for i, m in enumerate(marks, start=1):
            if m == "s":
                runs.append([i, i])
            elif m == "c":
                runs[-1][1] = i
        yield [Recompute(a, b) for a, b in runs]


def with_options(chain: Chain, runs: list[Recompute]) -> Iterator[list[Recompute]]:
    """``runs``, and each variant where runs of one stage re-run it in part (its in-stage
    options) or offload their checkpoint (every release and prefetch point)."""
    choices = [list(_variants(chain, r)) for r in runs]
    return (list(c) for c in itertools.product(*choices))


def _variants(chain: Chain, run: Recompute) -> Iterator[Recompute]:
    if run.first != run.last:
        yield run
        return
    n = run_op(chain, run)
    for r in [run] + [Recompute(run.first, run.last, o.name) for o in chain.stage(run.first).options]:
        yield r
        if moved_checkpoint_bytes(chain, r):
            for release in range(first_checkpoint_release(chain, r), chain.L + 1):
                for prefetch in range(n, chain.L + 1):
                    yield replace(r, release=release, prefetch=prefetch)


def kept_casts(chain: Chain, rebuilt: set[int]) -> Iterator[tuple[int, ...]]:
    """Every set of stages that may keep their weight casts (none recomputed)."""
    free = [i for i in chain.castable if i not in rebuilt]
    return itertools.chain.from_iterable(itertools.combinations(free, n) for n in range(len(free) + 1))


def brute_force(chain: Chain, budget: int, recompute: bool = False) -> float | None:
    """Best makespan over every schedule (offloads with their restores, kept weight casts, and with ``recompute``
    every set of runs, in-stage options and offloaded checkpoints included)."""
    return brute_force_each(chain, [budget], recompute)[0]


def brute_force_each(chain: Chain, budgets: list[int], recompute: bool = False) -> list[float | None]:
    """``brute_force`` for each budget, every schedule replayed once."""
    def options(i: int, rebuilt: set[int]) -> Iterator[Offload | None]:
        yield None
        if i in rebuilt:
            return
        restores = i in chain.restorable and i + 1 not in rebuilt
        for r in range(i + 1, chain.L + 1):
            for k in range(int(chain.need[i]), chain.L + 1):
                yield Offload(i, r, k)
                for p in range(r + 2, int(chain.held_read[i]) + 1) if restores else ():
                    yield Offload(i, r, k, p)
    best: list[float | None] = [None] * len(budgets)
    every = (v for runs in all_runs(chain.L) for v in with_options(chain, runs)) if recompute else [[]]
    for runs in every:
        if not all(chain.can_recompute(r.first, r.last) for r in runs):
            continue
        rebuilt = {i for r in runs for i in r.stages}
        for combo in itertools.product(*[list(options(i, rebuilt)) for i in chain.offloadable]):
            for kept in kept_casts(chain, rebuilt):
                sim = simulate(chain, [o for o in combo if o], recompute=runs, casts_kept=kept)
                for n, budget in enumerate(budgets):
                    if sim.peak_bytes <= budget and (best[n] is None or sim.makespan_s < best[n]):
                        best[n] = sim.makespan_s
    return best


def assert_joint_ilp_is_brute_force(chain: Chain, budget: int, options: Options) -> None:
    """The MILP with recomputation finds the brute force's optimum, and where nothing fits
    both say so (``options``: exact, with ``recompute``)."""
    best = brute_force(chain, budget, recompute=True)
    if best is None:
        with pytest.raises(InfeasibleBudget):
            solve(chain, budget, "ilp", options)
        return
    res = solve(chain, budget, "ilp", options)
    assert res.status == "optimal" and res.simulation.makespan_s == pytest.approx(best, rel=1e-7)
