"""Property tests over random chains: the simulator is the truth, the ILP is exact."""
import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings

from offload.errors import InfeasibleBudget
from offload.solver.bounds import fluid_lp
from offload.solver.ilp import Model, solve_ilp
from offload.solver.methods import METHODS, RECOMPUTING, Options, solve
from offload.step.simulate import simulate
from tests.brute import brute_force
from tests.conftest import assert_loads_exactly
from tests.strategies import chain_and_budget

EXACT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
REL = 1e-7
FIXED_POLICIES = {"none", "vdnn-all", "vdnn-conv", "vdnn-dyn", "layrub", "save-on-cpu", "gist", "gist-swap"}


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=5))
def test_ilp_equals_brute_force(cb):
    chain, budget = cb
    res = solve(chain, budget, "ilp", EXACT)
    assert res.status == "optimal"
    assert res.simulation.makespan_s == pytest.approx(brute_force(chain, budget), rel=REL)


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=7))
def test_every_method_replays_within_budget_and_ilp_is_best(cb):
    chain, budget = cb
    ilp = solve(chain, budget, "ilp", EXACT)
    lp = fluid_lp(chain, budget)
    assert lp.makespan_s <= ilp.simulation.makespan_s * (1 + REL)
    assert chain.ideal_makespan_s <= ilp.simulation.makespan_s * (1 + REL)
    for name in METHODS.keys() - RECOMPUTING:  # those are a larger class: tests/test_recompute.py
        try:
            res = solve(chain, budget, name, EXACT)
        except InfeasibleBudget:
            assert name in FIXED_POLICIES
            continue
        replay = simulate(chain, res.schedule.offloads, budget)  # raises if over budget
        assert res.schedule.predicted["makespan_s"] == replay.makespan_s
        assert res.schedule.predicted["peak_bytes"] == replay.peak_bytes <= budget
        assert ilp.simulation.makespan_s <= replay.makespan_s * (1 + REL), name
        assert 0 <= res.gap <= 1


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=7))
def test_ilp_objective_equals_simulated_makespan(cb):
    chain, budget = cb
    res = solve_ilp(chain, budget, gap=0.0)
    assert res.outcome.proven
    assert res.objective_s == pytest.approx(simulate(chain, res.offloads).makespan_s, rel=1e-6)
    assert res.dual_bound_s <= res.objective_s * (1 + 1e-6)


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=7))
def test_warm_start_is_the_least_solution_of_the_model(cb):
    """Loading any schedule sets every variable so that all rows hold and the objective is
    the simulated makespan: the MILP's rows say exactly what the simulator does."""
    chain, budget = cb
    plan = solve(chain, budget, "relax-bw", EXACT).schedule.offloads
    model = Model(chain, budget)
    assert_loads_exactly(model, plan)


@settings(max_examples=30, **SETTINGS)
@given(chain_and_budget(max_stages=6))
def test_optimum_never_worse_with_more_budget_or_bandwidth(cb):
    chain, budget = cb
    base = solve(chain, budget, "ilp", EXACT).simulation.makespan_s
    more_mem = solve(chain, budget + max(1, budget // 4), "ilp", EXACT).simulation.makespan_s
    p = chain.platform
    faster = dataclasses.replace(chain, platform=dataclasses.replace(p, d2h_bytes_per_s=p.d2h_bytes_per_s * 2,
                                                                     h2d_bytes_per_s=p.h2d_bytes_per_s * 1.5))
    more_bw = solve(faster, budget, "ilp", EXACT).simulation.makespan_s
    assert more_mem <= base * (1 + REL)
    assert more_bw <= base * (1 + REL)


@settings(max_examples=25, **SETTINGS)
@given(chain_and_budget(min_stages=3, max_stages=6))
def test_cbc_agrees_with_highs(cb):
    chain, budget = cb
    assume(chain.offloadable)
    highs = solve(chain, budget, "ilp", EXACT).simulation.makespan_s
    cbc = solve(chain, budget, "ilp", dataclasses.replace(EXACT, solver="cbc")).simulation.makespan_s
    assert cbc == pytest.approx(highs, rel=1e-6)
