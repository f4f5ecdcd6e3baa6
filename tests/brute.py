"""Brute force over the schedule class: the reference the MILP's exactness is tested against."""
from __future__ import annotations

import itertools
from typing import Iterator

import pytest

from offload.errors import InfeasibleBudget
from offload.solver.methods import Options, solve
from offload.step.actions import Offload, Recompute
from offload.step.chain import Chain
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
    """``runs``, and each variant where runs of one stage re-run it in part (its in-stage options)."""
    choices = [[r] + [Recompute(r.first, r.last, o.name) for o in chain.stage(r.first).options]
               if r.first == r.last else [r] for r in runs]
    return (list(c) for c in itertools.product(*choices))


def kept_casts(chain: Chain, rebuilt: set[int]) -> Iterator[tuple[int, ...]]:
    """Every set of stages that may keep their weight casts (none recomputed)."""
    free = [i for i in chain.castable if i not in rebuilt]
    return itertools.chain.from_iterable(itertools.combinations(free, n) for n in range(len(free) + 1))


def brute_force(chain: Chain, budget: int, recompute: bool = False) -> float | None:
    """Best makespan over every schedule (offloads, kept weight casts, and with ``recompute``
    every set of runs, in-stage options included)."""
    def options(i: int, rebuilt: set[int]) -> Iterator[Offload | None]:
        yield None
        if i in rebuilt:
            return
        for r in range(i + 1, chain.L + 1):
            for k in range(int(chain.need[i]), chain.L + 1):
                yield Offload(i, r, k)
    best = None
    every = (v for runs in all_runs(chain.L) for v in with_options(chain, runs)) if recompute else [[]]
    for runs in every:
        if not all(chain.can_recompute(r.first, r.last) for r in runs):
            continue
        rebuilt = {i for r in runs for i in r.stages}
        for combo in itertools.product(*[list(options(i, rebuilt)) for i in chain.offloadable]):
            for kept in kept_casts(chain, rebuilt):
                sim = simulate(chain, [o for o in combo if o], recompute=runs, casts_kept=kept)
                if sim.peak_bytes <= budget and (best is None or sim.makespan_s < best):
                    best = sim.makespan_s
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
