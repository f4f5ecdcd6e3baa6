"""Weight casts kept or made again (docs/model.md, "Weight casts"): the simulator's semantics
by hand, the files, the greedy fill the heuristics end with, the MILP exact with the choice,
and a bf16 Llama trained bit for bit with its casts kept (the profile's side is in
test_stacks.py)."""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.errors import FormatError, ScheduleRejected
from offload.executor.train import TrainOptions, train
from offload.profiler.profile import ProfileOptions, profile
from offload.solver.casts import keep_casts
from offload.solver.ilp import Model
from offload.solver.methods import Options, solve
from offload.step.actions import Offload, Recompute
from offload.step.chainfile import chain_from_dict
from offload.step.memory import floor_offloads, late_parts, no_offload_peak, op_memory
from offload.step.schedule import make_schedule
from offload.step.schedulefile import schedule_from_dict, schedule_to_dict
from offload.step.simulate import simulate
from tests.brute import assert_joint_ilp_is_brute_force
from tests.conftest import assert_loads_exactly
from tests.strategies import chain_and_budget
from tests.test_solver_properties import REL, SETTINGS

EXACT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02, recompute=True)


def three(link: float = 1e5, **stage_two) -> object:
    """Three stages: 1 ms forward, 2 ms backward, 100-byte units, no transients; stage 2
    makes 40 bytes of casts, 0.5 ms to make again (``stage_two`` overrides); copies at
    ``link`` bytes/s (100 bytes: 1 ms)."""
    stages = [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 100, "fwd_peak_bytes": 100, "bwd_peak_bytes": 0,
               "input_bytes": 10} for _ in range(3)]
    stages[1].update({"cast_bytes": 40, "recast_s": 0.0005, **stage_two})
    return chain_from_dict({"format": "offload-chain/2", "name": "three", "stages": stages,
                            "platform": {"d2h_bytes_per_s": link, "h2d_bytes_per_s": link}})


def test_kept_casts_by_hand():
    """Kept: 40 bytes more from F2 through B2, and B2 0.5 ms shorter; the ideal makespan is
    the step with every cast kept."""
    chain = three()
    dropped, kept = simulate(chain, []), simulate(chain, [], casts_kept=[2])
    assert list(dropped.memory) == [100, 200, 300, 300, 200, 100]
    assert list(kept.memory) == [100, 240, 340, 340, 240, 100]
    assert dropped.makespan_s == pytest.approx(0.009) and kept.makespan_s == pytest.approx(0.0085)
    assert chain.ideal_makespan_s == pytest.approx(0.0085)


@pytest.mark.parametrize("kept, runs, words", [
    ([1], [], "stage 1 .* keeps its weight casts, but it makes none"),
    ([2], [Recompute(2, 2)], "stage 2 keeps its weight casts and is recomputed"),
    ([4], [], "the chain has stages 1..3"),
])
def test_kept_casts_outside_the_class_are_refused(kept, runs, words):
    with pytest.raises(ScheduleRejected, match=words):
        simulate(three(), [], recompute=runs, casts_kept=kept)


def test_schedule_files_keep_the_casts_and_old_ones_keep_none():
    chain = three()
    sched = make_schedule(chain, [Offload(1, 2, 1)], casts_kept=[2])
    doc = schedule_to_dict(sched, chain)
    assert doc["casts_kept"] == [2] and schedule_from_dict(doc, chain).casts_kept == (2,)
    del doc["casts_kept"]
    assert schedule_from_dict(doc, chain).casts_kept == ()
    with pytest.raises(ScheduleRejected, match="keeps its weight casts, but it makes none"):
        schedule_from_dict({**doc, "casts_kept": [3]}, chain)
    with pytest.raises(FormatError, match="casts_kept"):
        schedule_from_dict({**doc, "casts_kept": [2, 2]}, chain)


def test_a_recast_longer_than_its_backward_is_refused():
    with pytest.raises(FormatError, match=r"stages\[2\].recast_s .* > bwd_s"):
        three(recast_s=0.003)


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=7, inputs=True, casts=True), st.randoms(use_true_random=False))
def test_kept_casts_add_their_bytes_to_the_ops_they_span(cb, rnd):
    """What ``keep_casts`` relies on: whatever the other actions, keeping stage i's casts adds
    exactly its bytes to Fi..Bi (re-run ops included) and nothing elsewhere, but where an op's
    memory is its first moment's (``Fj`` as ``F(j-1)`` lets go of a late part, no more than
    ``F(j-1)`` held): there at most its bytes; the fill it makes fits the budget and never
    lengthens the step."""
    chain, budget = cb
    runs = [Recompute(i, i) for i in sorted(chain.recomputable) if rnd.random() < 0.4]
    rebuilt = {r.first for r in runs}
    offloads = [o for o in floor_offloads(chain, runs) if o.stage not in rebuilt and rnd.random() < 0.6]
    kept = [i for i in chain.castable if i not in rebuilt and rnd.random() < 0.5]
    spans = np.zeros(2 * chain.L, dtype=np.int64)
    for i in kept:
        spans[i - 1: 2 * chain.L - i + 1] += chain.cb[i]
    added = op_memory(chain, offloads, runs, kept) - op_memory(chain, offloads, runs)
    first_moments = [j - 1 for j in late_parts(chain, offloads, runs)]
    assert list(np.delete(added, first_moments)) == list(np.delete(spans, first_moments))
    assert all(0 <= added[o] <= spans[o] for o in first_moments)
    if simulate(chain, offloads, recompute=runs).peak_bytes <= budget:
        fill = keep_casts(chain, budget, offloads, runs=runs)
        sim = simulate(chain, offloads, budget, recompute=runs, casts_kept=fill)  # raises if over
        assert sim.makespan_s <= simulate(chain, offloads, recompute=runs).makespan_s * (1 + REL)


@settings(max_examples=30, **SETTINGS)
@given(chain_and_budget(max_stages=6, inputs=True, casts=True), st.randoms(use_true_random=False))
def test_every_schedule_with_kept_casts_is_a_point_of_the_milp(cb, rnd):
    """Loading any schedule with kept casts (budget: its own peak) satisfies every row, and the
    objective is the simulated makespan."""
    chain, _ = cb
    runs = [Recompute(i, i) for i in sorted(chain.recomputable) if rnd.random() < 0.4]
    rebuilt = {r.first for r in runs}
    offloads = [o for o in floor_offloads(chain, runs) if o.stage not in rebuilt and rnd.random() < 0.6]
    kept = [i for i in chain.castable if i not in rebuilt and rnd.random() < 0.6]
    sim = simulate(chain, offloads, recompute=runs, casts_kept=kept)
    assert_loads_exactly(Model(chain, sim.peak_bytes, max_run=8), offloads, None, runs, kept)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.booleans().flatmap(lambda below: chain_and_budget(min_stages=2, max_stages=4, inputs=True, casts=True,
                                                            below=below)))
def test_joint_ilp_with_casts_equals_brute_force(cb):
    """Stages that make casts, budgets above or below the offloading floor: the MILP's optimum
    is the best of every (runs x offloads x kept casts) schedule, and where none fits both
    say so."""
    assert_joint_ilp_is_brute_force(*cb, EXACT)


def test_the_milp_keeps_casts_where_it_has_the_room():
    """At the no-offload peak plus the casts, the casts kept.  At the no-offload peak, kept
    too where offloading U1 under F2 (1 ms) makes the room for free; not where the link is
    too slow for that and recomputing U1 (1 ms) costs more than the recast (0.5 ms)."""
    for link, kept, step in ((1e5, (2,), 0.0085), (1e3, (), 0.009)):
        chain = three(link)
        roomy = solve(chain, no_offload_peak(chain) + 40, "ilp", EXACT)
        assert roomy.schedule.casts_kept == (2,) and roomy.status == "optimal"
        assert roomy.simulation.makespan_s == pytest.approx(chain.ideal_makespan_s)
        tight = solve(chain, no_offload_peak(chain), "ilp", EXACT)
        assert tight.schedule.casts_kept == kept and tight.simulation.makespan_s == pytest.approx(step)
        for method in ("relax-lp", "relax-bw"):  # the heuristics' fill
            assert solve(chain, no_offload_peak(chain) + 40, method, EXACT).schedule.casts_kept == (2,)


@pytest.fixture(scope="module")
def bf16_llama():
    return profile("llama", ProfileOptions(batch=2, repeats=1, warmup=1, autocast="bfloat16", options={
        "layers": 3, "width": 64, "heads": 4, "kv_heads": 2, "seq": 32, "vocab": 64, "dropout": 0.1})).chain


def test_a_bf16_llama_trains_bit_exact_with_its_casts_kept(bf16_llama):
    """The executor saves a kept stage's casts as autograd would: gradients bit for bit, no
    op above its prediction, and the step holds more than with the casts made again (by
    at least the casts of the stage that peaks)."""
    chain = bf16_llama
    assert len(chain.castable) >= 3
    peaks = {}
    for kept in ((), chain.castable):
        report, error = train(None, chain, make_schedule(chain, [], casts_kept=kept),
                              TrainOptions(steps=1, check_grads=True, op_memory=True))
        assert error is None and report.grads_match is True, report.grad_mismatches
        m, p = report.measured, report.predicted
        assert all(b <= p.op_bytes[op] for op, b in m.op_peak_bytes.items()), (kept, m.op_peak_bytes, p.op_bytes)
        peaks[kept] = m.activation_peak_bytes
    assert peaks[chain.castable] - peaks[()] >= min(chain.cb[i] for i in chain.castable)
