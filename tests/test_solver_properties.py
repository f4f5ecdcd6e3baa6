"""Property tests over random chains: the simulator is the truth, the ILP is exact."""
import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings

from offload.errors import InfeasibleBudget
from offload.solver.bounds import fluid_lp
from offload.solver.ilp import Model, solve_ilp
from offload.solver.methods import METHODS, RECOMPUTING, RETIMED, Options, solve
from offload.step.simulate import simulate
from tests.brute import brute_force
from tests.conftest import assert_loads_exactly
from tests.strategies import chain_and_budget

EXACT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
REL = 1e-7
FIXED_POLICIES = {"none", "vdnn-all", "vdnn-conv", "vdnn-dyn", "layrub", "save-on-cpu", "gist", "gist-swap"}


@settings(max_examples=12, **SETTINGS)  # 2.4-12.6 s with 40: a few chains take HiGHS seconds (make test-all explores)
@given(chain_and_budget(max_stages=5))
def test_ilp_equals_brute_force(cb):
    chain, budget = cb
    res = solve(chain, budget, "ilp", EXACT)
    assert res.status == "optimal"
    assert res.simulation.makespan_s == pytest.approx(brute_force(chain, budget), rel=REL)


@settings(max_examples=25, **SETTINGS)
@given(chain_and_budget(max_stages=7))
def test_every_method_replays_within_budget_and_ilp_is_best(cb):
    chain, budget = cb
    ilp = solve(chain, budget, "ilp", EXACT)
    lp = fluid_lp(chain, budget)
    assert lp.makespan_s <= ilp.simulation.makespan_s * (1 + REL)
    assert chain.ideal_makespan_s <= ilp.simulation.makespan_s * (1 + REL)
    for name in METHODS.keys() - RECOMPUTING - RETIMED:  # a larger class: tests/test_recompute.py; the ILP again: below
        try:
            res = solve(chain, budget, name, EXACT)
        except InfeasibleBudget:
            assert name in FIXED_POLICIES
            continue
        replay = res.schedule.simulate(chain, budget)  # raises if over budget
        assert res.schedule.predicted["makespan_s"] == replay.makespan_s
        assert res.schedule.predicted["peak_bytes"] == replay.peak_bytes <= budget
        assert ilp.simulation.makespan_s <= replay.makespan_s * (1 + REL), name
        assert 0 <= res.gap <= 1


@settings(max_examples=10, **SETTINGS)
@given(chain_and_budget(max_stages=6))
def test_pytorchs_placement_moves_the_ilps_units_and_is_never_faster(cb):
    """``torch-offload``: the units the ILP offloads, released per layer and prefetched as late
    as the serialized copies allow; within the budget when it meets it, never faster than
    the ILP (the same units, timed within the same class)."""
    chain, budget = cb
    ilp = solve(chain, budget, "ilp", EXACT)
    try:
        res = solve(chain, budget, "torch-offload", EXACT)
    except InfeasibleBudget:
        return  # per-layer sync holds a unit one stage longer than the ILP may
    assert {o.stage for o in res.schedule.offloads} == {o.stage for o in ilp.schedule.offloads}
    assert all(o.release == o.stage + 1 for o in res.schedule.offloads)
    replay = res.schedule.simulate(chain, budget)
    assert res.schedule.predicted["makespan_s"] == replay.makespan_s
    assert ilp.simulation.makespan_s <= replay.makespan_s * (1 + REL)


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=7))
def test_ilp_objective_equals_simulated_makespan(cb):
    chain, budget = cb
    res = solve_ilp(chain, budget, gap=0.0)
    assert res.outcome.proven
    assert res.objective_s == pytest.approx(simulate(chain, res.offloads, casts_kept=res.casts_kept).makespan_s, rel=1e-6)
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


@pytest.mark.slow  # make test-all; make test solves with CBC in tests/test_solver_limits.py
@settings(max_examples=25, **SETTINGS)
@given(chain_and_budget(min_stages=3, max_stages=6))
def test_cbc_agrees_with_highs(cb):
    chain, budget = cb
    assume(chain.offloadable)
    highs = solve(chain, budget, "ilp", EXACT).simulation.makespan_s
    cbc = solve(chain, budget, "ilp", dataclasses.replace(EXACT, solver="cbc")).simulation.makespan_s
    assert cbc == pytest.approx(highs, rel=1e-6)


@settings(max_examples=25, **SETTINGS)
@given(chain_and_budget(min_stages=3, max_stages=6))
def test_a_window_with_the_other_units_decided_is_exact(cb):
    """The large-neighbourhood search's sub-MILP (``solver.lns``): every unit but one decided as
    in the optimum, that one free; its objective is the simulated makespan of what it returns,
    the host lane's waits for copies still running at ``L`` included."""
    from offload.solver.ilp import Decided
    chain, budget = cb
    best = solve_ilp(chain, budget, gap=0.0)
    assume(best.offloads is not None and chain.offloadable)
    by = {o.stage: o for o in best.offloads}
    free = chain.offloadable[len(chain.offloadable) // 2]
    decided = {i: Decided(offload=by.get(i)) for i in range(1, chain.L + 1) if i != free}
    res = solve_ilp(chain, budget, gap=0.0, decided=decided, warm=best.offloads)
    assert res.outcome.proven
    assert res.objective_s == pytest.approx(simulate(chain, res.offloads, casts_kept=res.casts_kept).makespan_s, rel=1e-6)


def test_a_decided_release_at_L_waits_for_a_copy_the_host_delayed():
    """F1's kernels take the host 3 ms to issue, so U1's 3 ms copy starts at 3 ms, not at 1 ms
    when F1's device time ends, and is still running when F3 ends at 5 ms: B3 waits for it to
    6 ms.  No boundary before L is sure to find the copy done, so the release at L is modelled
    as a wait, for a decided unit as for a free one: the window's objective is the replay's."""
    from offload.solver.ilp import Decided
    from offload.step.actions import Offload
    from offload.step.chainfile import chain_from_dict
    stage = {"fwd_s": 0.001, "bwd_s": 0.001, "bwd_peak_bytes": 0}
    chain = chain_from_dict({"format": "offload-chain/2", "name": "host-bound", "platform": {
        "d2h_bytes_per_s": 4000.0, "h2d_bytes_per_s": 4000.0, "latency_s": 0.0}, "stages": [
        {**stage, "saved_bytes": 12, "fwd_peak_bytes": 12, "fwd_host_s": 0.003},
        {**stage, "saved_bytes": 2, "fwd_peak_bytes": 2},
        {**stage, "saved_bytes": 0, "fwd_peak_bytes": 0, "bwd_peak_bytes": 3}]})
    # the forward holds at most 14 whatever moves; B3 holds 17 unless U1 is gone by then
    for decided in ({1: Decided(offload=Offload(1, 3, 1)), 3: Decided()}, {}):
        res = solve_ilp(chain, 14, gap=0.0, decided=decided)
        replay = simulate(chain, res.offloads, 14, casts_kept=res.casts_kept)
        assert res.objective_s == pytest.approx(replay.makespan_s, rel=1e-9)
        assert replay.copies[0].end == pytest.approx(0.006)
