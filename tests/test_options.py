"""In-stage options chosen by the solver (docs/model.md, "In-stage options"): a recomputed run
of one stage that keeps what its option keeps and re-runs the rest.  The simulator's
semantics by hand, the MILP exact over the class with options (brute force), the file
format and its refusals (the executor's own tests are in test_executor_options.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from offload.errors import FormatError, ScheduleRejected
from offload.solver.methods import Options, solve
from offload.step.actions import Recompute
from offload.step.chain import Chain, StageOption
from offload.step.chainfile import chain_from_dict
from offload.step.schedule import make_schedule
from offload.step.schedulefile import schedule_from_dict, schedule_to_dict
from offload.step.simulate import simulate
from tests.brute import assert_joint_ilp_is_brute_force
from tests.strategies import chain_and_budget

JOINT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02, recompute=True)
MATMULS = {"name": "matmuls", "kept_bytes": 40, "recompute_s": 0.0004}


def small_chain(every: bool = False) -> Chain:
    """Four stages as in test_recompute.py (1 ms forward, 2 ms backward, 100-byte units,
    transients 120 and 50, inputs 30 bytes); stage 1 (``every``: each stage) offers an option
    keeping 40 bytes and re-running 0.4 ms of its forward."""
    stages = [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 100, "fwd_peak_bytes": 120, "bwd_peak_bytes": 50,
               "input_bytes": 30} for _ in range(4)]
    for st in stages if every else stages[:1]:
        st["options"] = [dict(MATMULS)]
    return chain_from_dict({"format": "offload-chain/2", "name": "small", "stages": stages,
                            "platform": {"d2h_bytes_per_s": 1e4, "h2d_bytes_per_s": 1e4}})


def test_an_option_by_hand():
    """Stage 1 re-run in part: its forward holds the 40 kept bytes on top of its transient
    (autograd keeps none of its unit, the kept outputs are held: an upper bound), the
    checkpoint holds them with its input from F2 to the rebuild at B1, which re-runs 0.4 ms,
    not 1 ms, and holds the whole checkpoint and F1's transient."""
    plain = simulate(small_chain(), [], recompute=[Recompute(1, 1)])
    part = simulate(small_chain(), [], recompute=[Recompute(1, 1, "matmuls")])
    assert plain.memory.tolist() == [120, 250, 250, 350, 380, 280, 180, 150]
    assert part.memory.tolist() == [160, 290, 290, 390, 420, 320, 220, 190]
    assert [(r.stage, r.op_stage, r.mem_bytes) for r in part.recomputes] == [(1, 1, 190)]
    assert part.makespan_s == pytest.approx(0.0124) and plain.makespan_s == pytest.approx(0.013)
    assert part.recomputed_s == pytest.approx(0.0004)


def test_the_solver_chooses_an_option_where_it_is_faster():
    """With room for the 40 kept bytes the option beats recomputing the whole stage; with
    none, only the whole stage fits."""
    chain = small_chain()
    roomy = solve(chain, 420, "ilp", JOINT)
    assert Recompute(1, 1, "matmuls") in roomy.schedule.recompute
    tight = solve(chain, 400, "ilp", JOINT)
    assert all(not r.option for r in tight.schedule.recompute)
    assert tight.simulation.makespan_s > roomy.simulation.makespan_s


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain_and_budget(min_stages=2, max_stages=4, inputs=True, casts=False))
def test_joint_ilp_with_options_equals_brute_force(cb):
    """Every stage offering an option: brute force over every set of runs, each run of one
    stage whole or in part, and every offload of the rest."""
    chain, budget = cb
    stages = tuple(replace(s, options=s.options or (StageOption("matmuls", s.saved_bytes // 3, s.fwd_s / 2,
                                                                 s.fwd_peak_bytes // 2, s.fwd_peak_bytes // 3),))
                   for s in chain.stages)
    assert_joint_ilp_is_brute_force(replace(chain, stages=stages), budget, JOINT)


def test_measured_option_transients_replace_the_bounds():
    """Measured, the option's forward holds 130 (not 120 + 40) and its re-run 60 over the
    checkpoint and kept outputs (not F1's whole 120)."""
    doc = small_chain().document()
    doc["stages"][0]["options"][0].update(fwd_peak_bytes=130, rerun_peak_bytes=60)
    sim = simulate(chain_from_dict(doc), [], recompute=[Recompute(1, 1, "matmuls")])
    assert sim.memory.tolist() == [130, 290, 290, 390, 420, 320, 220, 150]
    assert [(r.stage, r.op_stage, r.mem_bytes) for r in sim.recomputes] == [(1, 1, 130)]
    assert chain_from_dict(doc).document()["stages"][0]["options"][0]["rerun_peak_bytes"] == 60


def test_the_schedule_file_carries_the_option():
    chain = small_chain(every=True)
    s = make_schedule(chain, [], [Recompute(1, 1, "matmuls"), Recompute(2, 3)], method="test")
    doc = schedule_to_dict(s, chain)
    assert doc["recompute"] == [{"first": 1, "last": 1, "option": "matmuls"}, {"first": 2, "last": 3}]
    assert schedule_from_dict(doc, chain).recompute == s.recompute


@pytest.mark.parametrize("run, words", [
    (Recompute(1, 2, "matmuls"), "an in-stage option re-runs one stage"),
    (Recompute(2, 2, "matmuls"), r"stage 2 has no in-stage option 'matmuls' \(it offers: none\)"),
    (Recompute(1, 1, "everything"), r"no in-stage option 'everything' \(it offers: matmuls\)"),
])
def test_options_outside_the_class_are_refused(run, words):
    with pytest.raises(ScheduleRejected, match=words):
        simulate(small_chain(), [], recompute=[run])


@pytest.mark.parametrize("method", ["relax-lp", "relax-bw", "recompute-only"])
def test_the_heuristics_find_the_option(method):
    """The local search re-runs a run of one stage in part where that is faster."""
    res = solve(small_chain(), 420, method, Options(heuristic_time_s=0.5, recompute=True))
    assert Recompute(1, 1, "matmuls") in res.schedule.recompute
    assert res.simulation.makespan_s == pytest.approx(0.0124)


def test_selective_checkpointing_is_per_block_checkpointing_keeping_the_matmuls():
    """checkpoint-matmuls re-runs every stage that offers ``matmuls`` in part and the other
    recomputable ones whole; its floor lies above per-block checkpointing's by what it keeps."""
    chain = small_chain()
    sac = solve(chain, 1000, "checkpoint-matmuls", JOINT)
    assert sac.schedule.recompute == (Recompute(1, 1, "matmuls"), Recompute(2, 2), Recompute(3, 3))
    blocks = solve(chain, 1000, "checkpoint-blocks", JOINT)
    assert sac.simulation.makespan_s == pytest.approx(blocks.simulation.makespan_s - 0.0006)
    assert sac.simulation.peak_bytes == blocks.simulation.peak_bytes + 40


def test_torchtitans_default_policy_re_runs_every_other_matmul_too():
    """checkpoint-every-other-matmul: each block offering ``every-other-matmul`` re-runs with it,
    the rest whole; where a block offers only ``matmuls`` it is re-run whole (a policy, not a
    search), so on a chain offering only ``matmuls`` it is per-block checkpointing."""
    chain = small_chain()
    assert solve(chain, 1000, "checkpoint-every-other-matmul", JOINT).schedule.recompute == (
        Recompute(1, 1), Recompute(2, 2), Recompute(3, 3))
    every = small_chain(every=True)
    half = StageOption("every-other-matmul", 20, 0.0007)
    every = replace(every, stages=tuple(replace(s, options=s.options + (half,)) if i < 2 else s
                                        for i, s in enumerate(every.stages)))
    titan = solve(every, 1000, "checkpoint-every-other-matmul", JOINT)
    assert titan.schedule.recompute == (Recompute(1, 1, "every-other-matmul"), Recompute(2, 2, "every-other-matmul"),
                                        Recompute(3, 3))
    sac = solve(every, 1000, "checkpoint-matmuls", JOINT)
    assert titan.simulation.peak_bytes < sac.simulation.peak_bytes  # it keeps half as much
    assert titan.simulation.makespan_s > sac.simulation.makespan_s  # and re-runs more


def test_without_in_stage_options_the_solver_decides_per_stage():
    """``in_stage=False`` (``--no-in-stage``): the stage is kept or recomputed whole, and the
    schedule is still the chain's own."""
    chain = small_chain()
    res = solve(chain, 420, "ilp", replace(JOINT, in_stage=False))
    assert all(not r.option for r in res.schedule.recompute)
    assert res.schedule.chain_sha256 == chain.sha256
    assert res.simulation.makespan_s > solve(chain, 420, "ilp", JOINT).simulation.makespan_s


def test_stalls_are_never_negative():
    """A rebuild's start less its ready time and its rebuild time rounds a hair below 0 on
    these durations (-1.3e-18 s): a stall is 0 there, not negative (a sweep CSV refuses it)."""
    fwd, bwd = [0.0014302060167127723, 0.002625183354820275, 0.006550770429955354, 0.0003806400175678625], \
        [0.008489593995678604, 0.005004807362210216, 0.007908361176241581, 0.00837407452880671]
    rerun = [0.0010923550554728584, 0.001179996461423837, 0.0006148526056084866, 0.00016472846433017186]
    stages = [{"fwd_s": f, "bwd_s": b, "saved_bytes": 100, "fwd_peak_bytes": 120, "bwd_peak_bytes": 50,
               "input_bytes": 30, "options": [{"name": "matmuls", "kept_bytes": 40, "recompute_s": r}]}
              for f, b, r in zip(fwd, bwd, rerun)]
    chain = chain_from_dict({"format": "offload-chain/2", "name": "rounding", "stages": stages,
                             "platform": {"d2h_bytes_per_s": 1e9, "h2d_bytes_per_s": 1e9}})
    sim = simulate(chain, [], recompute=[Recompute(i, i, "matmuls") for i in (1, 2, 3)])
    assert sim.stalls.min() >= 0.0 and sim.stall_s == pytest.approx(0.0, abs=1e-15)


def test_an_options_forward_records_what_it_keeps():
    """Measured ``fwd_s`` (the forward under the recording mode, 1.3 ms here against 1 ms):
    F1 ends 0.3 ms later and everything after it; the solver weighs it (at 420 bytes the
    option still gains 0.3 ms net of it, at 0.7 ms it is whole recomputation again)."""
    slow = small_chain()
    stages = (replace(slow.stage(1), options=(replace(slow.stage(1).options[0], fwd_s=0.0013),)), *slow.stages[1:])
    chain = replace(slow, stages=stages)
    part = simulate(chain, [], recompute=[Recompute(1, 1, "matmuls")])
    assert part.makespan_s == pytest.approx(0.0127) and part.end[0] == pytest.approx(0.0013)
    assert Recompute(1, 1, "matmuls") in solve(chain, 420, "ilp", JOINT).schedule.recompute
    slower = (replace(slow.stage(1), options=(replace(slow.stage(1).options[0], fwd_s=0.0017),)), *slow.stages[1:])
    assert all(not r.option for r in solve(replace(slow, stages=slower), 420, "ilp", JOINT).schedule.recompute)


def test_an_option_faster_than_its_stage_forward_is_refused():
    stages = [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 100, "fwd_peak_bytes": 120, "bwd_peak_bytes": 50,
               "options": [dict(MATMULS, fwd_s=0.0005)]}, {"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 100,
                                                          "fwd_peak_bytes": 120, "bwd_peak_bytes": 50}]
    with pytest.raises(FormatError, match=r"options\[0\]\.fwd_s \(0\.0005\) < the stage's fwd_s \(0\.001\)"):
        chain_from_dict({"format": "offload-chain/2", "name": "bad", "stages": stages,
                         "platform": {"d2h_bytes_per_s": 1e4, "h2d_bytes_per_s": 1e4}})


def test_torchs_selective_checkpointing_of_a_model_changing_a_kept_output_in_place_says_why_it_failed():
    """SqueezeNet's ``ReLU(inplace=True)`` changes the convolution's output that the "save the
    matmuls" policy keeps: torch's backward refuses the changed tensor, and ``--compare``'s
    row printed only torch's words (which tensor, not why).  The error now says why first."""
    import torch
    from torch import nn

    from offload.core.selective import selective_checkpointing

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3)))
    with pytest.raises(RuntimeError, match=r"^torch's selective checkpointing kept an op's output that the model "
                                           r"then changed in place .* torch said: "):
        with selective_checkpointing(model, ["0"]):
            model(torch.randn(2, 3, 8, 8, requires_grad=True)).sum().backward()
    model[0][1].inplace = False  # the same model without it trains
    with selective_checkpointing(model, ["0"]):
        model(torch.randn(2, 3, 8, 8, requires_grad=True)).sum().backward()
