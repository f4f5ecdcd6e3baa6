"""Offloaded checkpoints (docs/model.md, "Offloaded checkpoints"): a recomputed run of one
stage copies its checkpoint to the host after its forward and back before its rebuild.
The simulator by hand, the class's rules, the file format, the MILP exact over the class
(loading any such schedule satisfies its rows; brute force equality), and the baselines
that offload checkpoints.  The executor's side is in test_executor_options.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.errors import ScheduleRejected
from offload.solver.ilp import Model
from offload.solver.methods import Options, solve
from offload.step.actions import Recompute, first_checkpoint_release
from offload.step.chain import StageOption
from offload.step.recompute import moved_checkpoint_bytes
from offload.step.schedule import make_schedule
from offload.step.schedulefile import schedule_from_dict, schedule_to_dict
from offload.step.simulate import simulate
from tests.brute import brute_force
from tests.conftest import assert_loads_exactly
from tests.strategies import chain_and_budget
from tests.test_recompute import small_chain

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
JOINT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02, recompute=True)


@pytest.fixture
def movable():
    """``small_chain`` (1 ms forward, 2 ms backward, 100-byte units, 30-byte inputs, 10 kB/s
    both ways: 3 ms a checkpoint's copy) whose inputs' own storages are all the checkpoint."""
    chain = small_chain()
    return replace(chain, stages=tuple(replace(s, input_own_bytes=30) for s in chain.stages))


@pytest.mark.parametrize("run, memory, makespan_ms", [
    # kept: the 30-byte checkpoint from F3 to the rebuild at B2
    (Recompute(2, 2), [120, 220, 350, 350, 380, 280, 250, 150], 13.0),
    # copied as F2 ends (2..5 ms), released at the end of F3 (F4 waits until 5 ms for the
    # copy), fetched as B2 starts (10..13 ms): the rebuild waits for it
    (Recompute(2, 2, release=3, prefetch=2), [120, 220, 350, 320, 350, 250, 250, 150], 18.0),
    # fetched as B3 starts (8..11 ms): resident during B3, the rebuild waits 1 ms
    (Recompute(2, 2, release=3, prefetch=3), [120, 220, 350, 320, 350, 280, 250, 150], 16.0),
    # released at the turn and fetched at B4 (5..8 ms): never away, the copies hidden
    (Recompute(2, 2, release=4, prefetch=4), [120, 220, 350, 350, 380, 280, 250, 150], 14.0),
])
def test_the_simulator_by_hand(movable, run, memory, makespan_ms):
    sim = simulate(movable, [], recompute=[run])
    assert sim.memory.tolist() == memory
    assert sim.makespan_s == pytest.approx(makespan_ms / 1e3)
    assert [c.nbytes for c in sim.copies] == ([30, 30] if run.moves else [])
    assert all(c.checkpoint for c in sim.copies)


def test_an_option_moves_what_it_keeps_too():
    chain = small_chain(input_own_bytes=20, options=[{"name": "matmuls", "kept_bytes": 40, "recompute_s": 0.0005}])
    run = Recompute(2, 2, "matmuls", release=3, prefetch=2)
    assert moved_checkpoint_bytes(chain, run) == 60
    kept = simulate(chain, [], recompute=[run.kept_on_device()])
    sim = simulate(chain, [], recompute=[run])
    assert [c.nbytes for c in sim.copies] == [60, 60]
    assert sim.memory[3] == kept.memory[3] - 60  # F4: the input's own storage and the kept outputs away
    assert sim.memory[5] == kept.memory[5] - 60  # B3: not fetched yet


@pytest.mark.parametrize("stage_two, run, words", [
    ({"input_own_bytes": 30}, Recompute(2, 3, release=4, prefetch=3), "a run of several stages keeps"),
    ({}, Recompute(2, 2, release=3, prefetch=2), "no input_own_bytes"),
    ({"input_own_bytes": 30, "held_bytes": 40, "held_until": 4, "carry_bytes": 50, "input_carried_bytes": 10,
      "input_held_bytes": 10}, Recompute(2, 2, release=3, prefetch=2),
     r"release point 3 not in \[4, 4\] \(the model's code holds its input through F4\)"),
    ({"input_own_bytes": 30}, Recompute(2, 2, release=2, prefetch=2), r"release point 2 not in \[3, 4\]"),
    ({"input_own_bytes": 30}, Recompute(2, 2, release=3, prefetch=1), r"prefetch point 1 not in \[2, 4\]"),
    ({"input_own_bytes": 30}, Recompute(2, 2, prefetch=2), "release point 0"),
])
def test_outside_the_class_is_refused(stage_two, run, words):
    with pytest.raises(ScheduleRejected, match=words):
        simulate(small_chain(**stage_two), [], recompute=[run])


def test_the_file_keeps_the_points(movable):
    run = Recompute(2, 2, release=4, prefetch=3)
    schedule = make_schedule(movable, [], method="test", recompute=[run, Recompute(1, 1)])
    doc = schedule_to_dict(schedule, movable)
    assert doc["recompute"] == [{"first": 1, "last": 1}, {"first": 2, "last": 2,
                                                         "checkpoint": {"release": "turn", "prefetch": 3}}]
    assert schedule_from_dict(doc, movable).recompute == (Recompute(1, 1), run)
    doc["recompute"][1]["checkpoint"] = {"release": 3}
    with pytest.raises(Exception, match="exactly 'release' and 'prefetch'"):
        schedule_from_dict(doc, movable)


def test_the_milp_moves_checkpoints_where_that_pays(movable):
    """At 260 bytes the best schedule that keeps its checkpoints takes 31 ms (brute force);
    moving them, 18 ms: the MILP finds that optimum."""
    best = brute_force(movable, 260, recompute=True)
    assert best == pytest.approx(0.018)
    assert brute_force(small_chain(), 260, recompute=True) == pytest.approx(0.031)  # no input_own_bytes
    res = solve(movable, 260, "ilp", JOINT)
    assert res.status == "optimal" and res.simulation.makespan_s == pytest.approx(best, rel=1e-9)
    assert any(r.moves for r in res.schedule.recompute)


@settings(max_examples=15, **SETTINGS)
@given(chain_and_budget(min_stages=2, max_stages=6, inputs=True), st.randoms(use_true_random=False))
def test_every_schedule_moving_checkpoints_is_a_point_of_the_milp(cb, rnd):
    """Runs of one stage (some in part) that move their checkpoints, at random points, beside kept ones:
    loading the schedule (budget: its own peak) satisfies every row, objective = makespan."""
    chain, _ = cb
    runs = []
    for i in sorted(chain.recomputable):
        if rnd.random() < 0.6:
            options = [o.name for o in chain.stage(i).options]
            run = Recompute(i, i, rnd.choice(options) if options and rnd.random() < 0.5 else "")
            if moved_checkpoint_bytes(chain, run) and rnd.random() < 0.7:
                n = int(chain.need[i])
                first = first_checkpoint_release(chain, run)
                run = replace(run, release=rnd.randint(first, chain.L), prefetch=rnd.randint(n, chain.L))
            runs.append(run)
    sim = simulate(chain, [], recompute=runs)
    assert_loads_exactly(Model(chain, sim.peak_bytes, max_run=8), [], runs=runs)


@pytest.mark.parametrize("method, option", [("checkpoint-blocks-offload", ""), ("checkpoint-matmuls-offload", "matmuls")])
def test_torchtunes_offloaded_checkpointing(movable, method, option):
    """Every block checkpointed, its checkpoint released as soon as that frees it and fetched
    one op ahead of its rebuild; the kept outputs of an option move with it."""
    chain = replace(movable, stages=tuple(
        replace(s, options=(StageOption("matmuls", 40, 0.0005),)) for s in movable.stages))
    for options in (JOINT, replace(JOINT, in_stage=False)):  # the policy's own option, whatever the search may use
        res = solve(chain, 10_000, method, options)
        assert res.schedule.recompute == tuple(Recompute(i, i, option, release=i + 1, prefetch=i + 1) for i in (1, 2, 3))
        assert res.simulation.d2h_bytes == 3 * (30 + (40 if option else 0))


def test_recompute_only_is_not_warm_started_from_a_policy_that_moves(movable):
    """The offloading policies fit where recompute-only is solved; its MILP moves nothing, and
    a warm start that does is refused by name, not a KeyError deep in the model."""
    res = solve(movable, 10_000, "recompute-only", JOINT)
    assert res.simulation.d2h_bytes == 0
    with pytest.raises(ValueError, match="offload checkpoints, which this model does not"):
        Model(movable, 10_000, max_run=8, offload=False).load([], runs=[Recompute(1, 1, release=2, prefetch=1)])
