"""Recomputation joined with offloading (docs/model.md, "Recomputation"): the simulator's
semantics by hand, the MILP exact over the extended class, the methods, the file format,
the CLI, and the refusal of stages the profiler found the executor cannot re-run (the
executor's own tests are in test_executor.py)."""
from __future__ import annotations

import json
from dataclasses import replace
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.reproduce import link_bound
from offload.cli import main as offload
from offload.errors import InfeasibleBudget, ScheduleRejected
from offload.executor.plan import StepPlan
from offload.solver import encoded_floor, relax
from offload.solver.floors import joint_floor
from offload.solver.ilp import Model, solve_ilp
from offload.solver.methods import Options, solve
from offload.solver.policy import floor_memory
from offload.step import encoding
from offload.step.actions import Offload, Recompute
from offload.step.chain import Chain, StageOption
from offload.step.chainfile import chain_from_dict, load_chain, save_chain
from offload.step.memory import floor_offloads, late_parts, memory_profile, no_offload_peak, smallest_feasible_budget
from offload.step.schedule import make_schedule
from offload.step.schedulefile import schedule_from_dict, schedule_to_dict
from offload.step.simulate import simulate
from tests.brute import assert_joint_ilp_is_brute_force, brute_force
from tests.conftest import assert_loads_exactly, chain_doc
from tests.runs import none_over, without_late_parts, without_shared_checkpoints
from tests.strategies import chain_and_budget

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXACT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02)
JOINT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02, recompute=True)
REL = 1e-7


def small_chain(**stage_two) -> Chain:
    """Four stages: 1 ms forward, 2 ms backward, 100-byte units, forward transient 120,
    backward 50, every input 30 bytes (``stage_two``: fields of stage 2 changed)."""
    stages = [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 100, "fwd_peak_bytes": 120, "bwd_peak_bytes": 50,
               "input_bytes": 30} for _ in range(4)]
    stages[1].update(stage_two)
    return chain_from_dict({"format": "offload-chain/2", "name": "small", "stages": stages,
                            "platform": {"d2h_bytes_per_s": 1e4, "h2d_bytes_per_s": 1e4}})


@pytest.fixture(scope="module")
def resnet18() -> Chain:
    """A ResNet-18 (batch 2, image 32) profiled on the CPU, whose meter is exact per op."""
    from offload.profiler.profile import ProfileOptions, profile

    return profile("resnet18", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options={"image": 32})).chain


@pytest.fixture
def small():
    return small_chain()


@pytest.mark.parametrize("runs, memory, rerun, makespan", [
    # nothing recomputed: U1..U4 build up to B4
    ((), [120, 220, 320, 420, 450, 350, 250, 150], [], 0.012),
    # U1 gone after F2, its 30-byte checkpoint kept from F2 (F1's own memory holds its input) to
    # B1, where F1 re-runs first (reading it)
    ((Recompute(1, 1),), [120, 250, 250, 350, 380, 280, 180, 150], [(1, 1, 150)], 0.013),
    # one run 1..2, rebuilt at B2 from stage 1's input: R1 (reading it) then R2 (holding U1)
    ((Recompute(1, 2),), [120, 250, 250, 250, 280, 180, 250, 150], [(1, 2, 150), (2, 2, 220)], 0.014),
    # the same stages as two runs: each its own checkpoint, each rebuilt just before its backward
    ((Recompute(1, 1), Recompute(2, 2)), [120, 250, 280, 280, 310, 210, 180, 150], [(2, 2, 180), (1, 1, 150)], 0.014),
])
def test_simulator_semantics_by_hand(small, runs, memory, rerun, makespan):
    sim = simulate(small, [], recompute=runs)
    assert sim.memory.tolist() == memory
    assert [(r.stage, r.op_stage, r.mem_bytes) for r in sim.recomputes] == rerun
    assert sim.makespan_s == pytest.approx(makespan)
    assert sim.stall_s == pytest.approx(0.0, abs=1e-15)
    assert sim.recomputed_s == pytest.approx(makespan - 0.012)


@pytest.mark.parametrize("offloads, run, less, rerun_less", [
    # unit 2 kept: the 20 shared bytes count once from F4 through B4 (the rebuild is at B3) and in R3
    ([], Recompute(3, 3), [0, 0, 0, 20, 20, 0, 0, 0], 20),
    # unit 2 offloaded at once: only its held part (through F4) holds 10 of them
    ([Offload(2, 3, 2)], Recompute(3, 3), [0, 0, 0, 10, 0, 0, 0, 0], 0),
    # an offloaded checkpoint shares nothing: its release frees none of what unit 2 holds
    ([], Recompute(3, 3, release=4, prefetch=3), [0] * 8, 0),
])
def test_a_checkpoint_shared_with_the_unit_before_by_hand(offloads, run, less, rerun_less):
    """Stage 3's 30-byte input: 20 bytes of it are storages of unit 2 (``input_prev_bytes``),
    10 of those in the part the model's code holds through ``F4`` (``input_prev_held_bytes``)."""
    shared = small_chain(held_bytes=40, held_until=4)
    shared = replace(shared, stages=shared.stages[:2] + (replace(shared.stages[2], input_prev_bytes=20,
                                                                   input_prev_held_bytes=10, input_own_bytes=30),)
                     + shared.stages[3:])
    (mem, rebuilt), (whole, rebuilt_whole) = (memory_profile(c, offloads, [run])
                                              for c in (shared, without_shared_checkpoints(shared)))
    assert list(whole - mem) == less
    assert [b[2] - a[2] for a, b in zip(rebuilt, rebuilt_whole)] == [rerun_less]


@pytest.mark.parametrize("next_held", [-40, 25])
def test_a_re_run_after_an_encoded_unit_keeps_its_raw_bound(next_held):
    """An encoding of unit 2 changes what ``F3`` holds (``next_held_bytes``: a covered raw
    storage that dies early, or the raw output beside the encoded copy), not what re-running
    stage 3 holds in the backward, which reads nothing of unit 2: without a measured re-run
    transient ``R3`` holds ``F3``'s raw 120 over its checkpoint either way (the simulator read
    the encoded ``F3``'s bound there, and the MILP the raw one: a random schedule the MILP
    could not load)."""
    chain = small_chain(encodings=[{"name": "half", "lossless": True, "encode_s": 0, "decode_s": 0,
                                    "tensors": [{"index": 0, "encoder": "sign-mask", "bytes": 50, "encoded_bytes": 10}],
                                    "fwd_held_bytes": 10, "next_held_bytes": next_held, "bwd_held_bytes": [0]}])
    chain = replace(chain, stages=chain.stages[:2] + (replace(chain.stages[2], options=(
        StageOption("matmuls", kept_bytes=40, recompute_s=0.0005),)),) + chain.stages[3:])
    for run in (Recompute(3, 3), Recompute(3, 3, "matmuls")):  # the option's re-run: F3's raw bound too
        plain, encoded = (memory_profile(encoding.apply(chain, e), [], [run])[1] for e in ({}, {2: "half"}))
        # units 1 and 2 (raw 100, encoded 60), F3's raw transient, the checkpoint (with the kept outputs)
        checkpoint = 30 + (40 if run.option else 0)
        assert plain == [(3, 3, 100 + 100 + 120 + checkpoint)] and encoded == [(3, 3, 100 + 60 + 120 + checkpoint)]
        sim = simulate(chain, [], encode={2: "half"}, recompute=[run])
        assert_loads_exactly(Model(chain, sim.peak_bytes, options=encoding.allowed(chain), max_run=8), [], {2: "half"},
                             [run])


def test_what_a_recomputed_stage_holds_as_measured():
    """Stage 2 recomputed, with what the profiler measures of it: its forward transient when
    autograd keeps nothing (40, not 120), the part of its unit alive into F3 (30 bytes: its
    input, which its checkpoint holds too, so counted once), and the gradient live as B2
    starts (20), which the rebuild there holds besides U1 and the re-run's transient."""
    chain = small_chain(recomputed_fwd_peak_bytes=40, carry_bytes=30, input_carried_bytes=30, bwd_start_bytes=20)
    sim = simulate(chain, [], recompute=[Recompute(2, 2)])
    assert sim.memory.tolist() == [120, 140, 250, 350, 380, 280, 270, 150]
    assert [(r.stage, r.op_stage, r.mem_bytes) for r in sim.recomputes] == [(2, 2, 270)]


@pytest.mark.parametrize("runs, stage_two, rerun", [
    # R2 holds U1, the checkpoint (30) and its measured re-run transient (50), not F2's (120)
    ((Recompute(2, 2),), {"rerun_peak_bytes": 50}, [(2, 2, 180)]),
    # a later stage of a run: its input, which R1 made, counts beside its transient: its own
    # storage (10), and the rest of its input_bytes, tensors made before the run that its
    # replay holds (20: position ids the first stage reads too) ...
    ((Recompute(1, 2),), {"rerun_peak_bytes": 50, "input_own_bytes": 10}, [(1, 2, 150), (2, 2, 180)]),
    # ... or its whole input_bytes where that is not known
    ((Recompute(1, 2),), {"rerun_peak_bytes": 50}, [(1, 2, 150), (2, 2, 180)]),
])
def test_a_rerun_holds_its_measured_transient(runs, stage_two, rerun):
    """``rerun_peak_bytes``: what re-running a stage holds over its checkpoint, measured by
    replaying it (no weight cast held past its reader), in place of its forward's transient."""
    sim = simulate(small_chain(**stage_two), [], recompute=runs)
    assert [(r.stage, r.op_stage, r.mem_bytes) for r in sim.recomputes] == rerun


def test_rebuild_overlaps_the_prefetch_it_issued(small):
    """B2 issues U1's prefetch, then re-runs F2 while the copy runs, then waits for it."""
    sim = simulate(small, [Offload(1, 2, 2)], recompute=[Recompute(2, 2)])
    h2d = next(c for c in sim.copies if c.direction == "H2D")
    r2 = sim.recomputes[0]
    assert h2d.issue == pytest.approx(r2.start) and h2d.end > r2.end
    b1 = sim.ops[-1]
    assert b1.start == pytest.approx(max(h2d.end, sim.ops[-2].end))


@pytest.mark.parametrize("runs, offloads, words", [
    ([Recompute(4, 4)], [], "within stages 1..3"),
    ([Recompute(2, 1)], [], "its first stage comes after its last"),  # was "runs lie within 1..3": true, unhelpful
    ([Recompute(1, 2), Recompute(2, 3)], [], "stage 2 is in two recomputed runs"),
    ([Recompute(1, 2)], [Offload(2, 3, 2)], "stage 2 is recomputed and offloaded"),
])
def test_runs_outside_the_class_are_refused(small, runs, offloads, words):
    with pytest.raises(ScheduleRejected, match=words):
        simulate(small, offloads, recompute=runs)


@settings(max_examples=30, **SETTINGS)
@given(chain_and_budget(max_stages=4, inputs=True))
def test_joint_ilp_equals_brute_force(cb):
    chain, budget = cb
    res = solve(chain, budget, "ilp", JOINT)
    assert res.status == "optimal"
    assert res.simulation.makespan_s == pytest.approx(brute_force(chain, budget, recompute=True), rel=REL)


@pytest.mark.slow  # make test-all; the tests above draw up to four stages, some with in-stage options
@settings(max_examples=6, **SETTINGS)
@given(chain_and_budget(min_stages=5, max_stages=5, inputs=True, casts=False))
def test_joint_ilp_equals_brute_force_on_five_stages(cb):
    """Five stages: 3^4 sets of runs, each with every offload of the stages it leaves (a
    fraction of a second per chain, so a few chains; without weight casts, which would
    multiply that by up to 2^5: test_casts.py has them with runs on four stages)."""
    chain, budget = cb
    res = solve(chain, budget, "ilp", JOINT)
    assert res.status == "optimal"
    assert res.simulation.makespan_s == pytest.approx(brute_force(chain, budget, recompute=True), rel=REL)


BELOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@settings(max_examples=10, **BELOW)
@given(chain_and_budget(min_stages=2, max_stages=4, inputs=True, below=True, casts=False))  # casts: test_casts.py
def test_joint_ilp_equals_brute_force_below_the_offload_floor(cb):
    """Under the offloading floor: the MILP's optimum is the brute force's, and where nothing
    fits both say so."""
    assert_joint_ilp_is_brute_force(*cb, JOINT)


@pytest.mark.slow  # make test-all: five stages' every run, option and offloaded checkpoint take seconds a chain
@settings(max_examples=10, **BELOW)
@given(chain_and_budget(min_stages=5, max_stages=5, inputs=True, below=True, casts=False))
def test_joint_ilp_equals_brute_force_below_the_offload_floor_on_five_stages(cb):
    assert_joint_ilp_is_brute_force(*cb, JOINT)


@settings(max_examples=15, **SETTINGS)
@given(chain_and_budget(min_stages=2, max_stages=6, inputs=True))
def test_joint_objective_is_the_simulated_makespan_and_loads_exactly(cb):
    """The MILP's optimum replays to its objective; loading any joint schedule satisfies
    every row with the simulated makespan (the rows say what the simulator does)."""
    chain, budget = cb
    res = solve_ilp(chain, budget, gap=0.0, max_run=8)
    assert res.outcome.proven
    assert res.objective_s == pytest.approx(simulate(chain, res.offloads, recompute=res.recompute, casts_kept=res.casts_kept).makespan_s, rel=1e-6)
    plan = solve(chain, budget, "relax-bw", JOINT).schedule
    model = Model(chain, budget, max_run=8)
    assert_loads_exactly(model, plan.offloads, runs=plan.recompute)


@settings(max_examples=25, **SETTINGS)
@given(chain_and_budget(min_stages=2, max_stages=6, encodings=True, inputs=True), st.randoms(use_true_random=False))
def test_every_joint_schedule_with_encodings_is_a_point_of_the_milp(cb, rnd):
    """Recomputed runs beside units stored encoded, kept or offloaded: loading such a schedule
    (budget: its own peak) satisfies every row, objective = simulated makespan.  (A unit
    offloaded encoded was counted twice in its one-fate row, so the joint MILP with
    encodings could not offload encoded units of recomputable stages, and its "optimum" was
    above schedules the heuristics found.)"""
    chain, _ = cb
    stages = sorted(chain.recomputable)
    runs = [Recompute(i, i) for i in stages if rnd.random() < 0.4]
    rebuilt = {r.first for r in runs}
    options = encoding.allowed(chain, "lossless")
    encode = {i: rnd.choice(es).name for i, es in options.items() if i not in rebuilt and rnd.random() < 0.7}
    offloads = [o if o.stage not in encode else replace(o, restore=0)
                for o in floor_offloads(chain, runs) if o.stage not in rebuilt and rnd.random() < 0.6]
    sim = simulate(chain, offloads, encode=encode, recompute=runs)
    model = Model(chain, sim.peak_bytes, options=options, max_run=8)
    assert_loads_exactly(model, offloads, encode, runs)


def test_a_unit_recomputed_is_not_also_encoded_in_the_joint_floors_bound():
    """The bound below which ``solve --recompute`` refuses a budget (encodings allowed) was the
    recomputation bound of the chain with the offload floor's encodings applied, as if a unit
    could be encoded and recomputed at once: here 3 B, while recomputing stage 1 (encoding
    nothing) peaks at 2 B, a budget the solve refused.  It is now the least over each unit's
    one fate (``encoded_floor.floor`` with ``recompute``)."""
    sign = {"index": 0, "encoder": "sign-mask", "bytes": 1, "encoded_bytes": 0, "output": False, "workspace_bytes": 0}
    sparse = {"index": 1, "encoder": "sparse", "bytes": 1, "encoded_bytes": 1, "output": False, "workspace_bytes": 0}
    stage = dict(kind="conv", fwd_s=0.001, bwd_s=0.001, fwd_peak_bytes=2, bwd_peak_bytes=0, carry_bytes=0)
    chain = chain_from_dict(chain_doc(base_bytes=0, stages=[
        {**stage, "name": "s1", "saved_bytes": 2, "need_from": 1, "rerun_output": False,
         "encodings": [{"name": "lossless", "lossless": True, "encode_s": 0.0, "decode_s": 0.0,
                        "tensors": [sign, sparse]}]},
        {**stage, "name": "s2", "saved_bytes": 0, "need_from": 2, "recomputable": False}]))
    assert simulate(chain, [], recompute=[Recompute(1, 1)]).peak_bytes == 2
    assert encoded_floor.floor(chain, "lossless", recompute=True)[0] == 2
    assert solve(chain, 2, "ilp", Options(recompute=True)).schedule.recompute == (Recompute(1, 1),)


@settings(max_examples=60, **SETTINGS)
@given(chain_and_budget(min_stages=2, max_stages=6, encodings=True, inputs=True), st.randoms(use_true_random=False))
def test_no_joint_schedule_with_encodings_holds_less_than_the_joint_floors_bound(cb, rnd):
    """Units recomputed, stored encoded, offloaded at once: no such schedule peaks below the
    bound, which is no higher than either family's own floor."""
    chain, _ = cb
    runs = [Recompute(i, i) for i in sorted(chain.recomputable) if rnd.random() < 0.5]
    rebuilt = {r.first for r in runs}
    encode = {i: rnd.choice(es).name for i, es in encoding.allowed(chain, "lossless").items()
              if i not in rebuilt and rnd.random() < 0.7}
    offloads = [o if o.stage not in encode else replace(o, restore=0)
                for o in floor_offloads(chain, runs) if o.stage not in rebuilt]
    bound = encoded_floor.floor(chain, "lossless", recompute=True)[0]
    assert bound <= simulate(chain, offloads, encode=encode, recompute=runs).peak_bytes
    assert bound <= min(smallest_feasible_budget(chain, recompute=True), encoded_floor.floor(chain, "lossless")[0])


@settings(max_examples=6, **SETTINGS)
@given(chain_and_budget(min_stages=2, max_stages=4, encodings=True, inputs=True))
def test_the_joint_floor_is_bisected_in_the_class_its_encodings_name(cb):
    """``joint_floor`` searches the class its ``encodings`` allow: with none, never below the
    lower bound without encodings (``experiments.recompute`` set that bound beside floors of
    the lossless class, which went below it once the chains measured their encodings);
    allowing encodings, never above the floor without them by more than its resolution."""
    chain, _ = cb
    step = max(1, int(0.05 * no_offload_peak(chain)))
    plain = joint_floor(chain, 2.0, 0.05, encodings="none")
    assert plain >= smallest_feasible_budget(chain, recompute=True)
    assert joint_floor(chain, 2.0, 0.05, encodings="lossless") <= plain + step


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(min_stages=2, max_stages=6, inputs=True), st.randoms(use_true_random=False))
def test_each_memory_row_of_a_loaded_joint_schedule_is_its_ops_memory(cb, rnd):
    """Recomputed runs (some of one stage re-run in part, a rebuild keeping less of its unit
    live: ``rebuilt_bytes``) beside offloads: each memory row of the MILP, loaded with the
    schedule, reads exactly what the simulator's op holds, the re-run ops' rows included
    (rows only bound the memory, so a row counting too much still loads; this reads them).
    An op whose first reading holds a late part (``memory.late_parts``) is never above
    the op before it, whose last reading that is: the row of that op bounds it, its own row
    reads the op without it."""
    chain, _ = cb
    starts = sorted(chain.recomputable)
    runs = [Recompute(i, i, rnd.choice([""] + [o.name for o in chain.stage(i).options])) for i in starts
            if rnd.random() < 0.5]
    rebuilt = {r.first for r in runs}
    offloads = [o for o in floor_offloads(chain, runs) if o.stage not in rebuilt and rnd.random() < 0.6]
    memory, reruns = memory_profile(chain, offloads, runs)
    bare, _ = memory_profile(without_late_parts(chain), offloads, runs)
    late = {f"F{j}" for j in late_parts(chain, offloads, runs)}
    model = Model(chain, 0, options={}, max_run=8)  # budget 0: no re-run op's row left out as never binding
    model.load(offloads, {}, runs)
    chosen = {f"recompute_{r.first}_{r.last}" + (f"_{r.option}" if r.option else "") for r in runs}
    own: dict[str, float] = {}  # per op (F1 .. B1) with a row of its own (one whose variables are all fixed has none)
    rebuilds: dict[str, list[float]] = {}  # per Bn, its re-run ops' rows
    for name, row in model.lp.constraints.items():
        op, rerun = re.fullmatch(r"memory_([FB]\d+)", name), re.fullmatch(r"memory_R(\d+)_(.*)", name)
        if row.value() is None:  # a row no decision satisfies (its op over the budget 0 whatever the schedule)
            continue
        if op:
            own[op.group(1)] = (row.value() + model.B) * model.mu
        elif rerun and rerun.group(2) in chosen:
            n = next(n for n, j, _ in reruns if j == int(rerun.group(1)))
            rebuilds.setdefault(f"B{n}", []).append((row.value() + model.B) * model.mu)
    for o, nbytes in enumerate(bare):
        name = f"F{o + 1}" if o < chain.L else f"B{2 * chain.L - o}"
        if name in late:
            assert nbytes <= memory[o] <= max(nbytes, memory[o - 1]), name
        elif memory[o] != nbytes:
            raise AssertionError(f"{name}: a late carry changed an op that does not start after it")
        if name in own:  # Bn's memory is the largest of its own and its re-run ops'
            assert max([own[name], *rebuilds.get(name, [])]) == pytest.approx(int(nbytes), abs=1e-6), name


@settings(max_examples=12, **SETTINGS)
@given(chain_and_budget(min_stages=2, max_stages=6, inputs=True))
def test_joint_is_never_worse_than_either_family_and_every_method_replays(cb):
    chain, budget = cb
    joint = solve(chain, budget, "ilp", JOINT)
    assert joint.simulation.makespan_s <= solve(chain, budget, "ilp", EXACT).simulation.makespan_s * (1 + REL)
    for method in ("recompute-only", "checkpoint-sqrt", "checkpoint-blocks", "checkpoint-blocks-offload", "relax-lp",
                   "relax-bw"):
        try:
            res = solve(chain, budget, method, JOINT)
        except Exception as exc:  # a recompute-only policy may not fit this budget
            assert method in ("recompute-only", "checkpoint-sqrt", "checkpoint-blocks", "checkpoint-blocks-offload"), exc
            continue
        s = res.schedule
        replay = s.simulate(chain, budget)
        assert s.predicted["makespan_s"] == replay.makespan_s
        assert joint.simulation.makespan_s <= replay.makespan_s * (1 + REL), method
        assert res.bound_s <= replay.makespan_s * (1 + REL)


def test_joint_floor_is_the_offload_floor_when_units_are_carried_whole(small):
    """With every unit alive through the next forward (no ``carry_bytes``), a re-run forward op
    holds its stage's working set again: nothing goes below the all-offloaded floor."""
    floor = smallest_feasible_budget(small)
    assert smallest_feasible_budget(small, recompute=True) == floor
    assert solve(small, floor, "ilp", JOINT).simulation.peak_bytes <= floor
    with pytest.raises(Exception, match="below the smallest feasible budget"):
        solve(small, floor - 1, "ilp", JOINT)


def test_a_rebuild_keeping_less_of_its_unit_lowers_the_bound_in_the_backward():
    """A compiled backward's rebuild keeps less of the unit live than the floor fetches
    (``rebuilt_bytes``): the bound takes that off the backward ops too.  It counted the whole
    unit in ``B1`` and refused a budget the recomputed schedule meets."""
    stages = [{"fwd_s": 0.001, "bwd_s": 0.001, "saved_bytes": 10, "fwd_peak_bytes": 10, "bwd_peak_bytes": 10,
               "carry_bytes": 0, "rebuilt_bytes": 0}] + [
        {"fwd_s": 0.001, "bwd_s": 0.001, "saved_bytes": 0, "fwd_peak_bytes": 0, "bwd_peak_bytes": 0,
         "recomputable": False} for _ in range(2)]
    chain = chain_from_dict({"format": "offload-chain/2", "name": "rebuilt", "stages": stages,
                             "platform": {"d2h_bytes_per_s": 1e4, "h2d_bytes_per_s": 1e4}})
    assert simulate(chain, [], recompute=[Recompute(1, 1)]).peak_bytes == 10  # B1 holds its transient alone
    assert smallest_feasible_budget(chain, recompute=True) == 10
    assert solve(chain, 10, "ilp", JOINT).schedule.recompute == (Recompute(1, 1),)


def test_recomputation_goes_below_the_offload_floor():
    """A transformer-like chain: the forward's own code drops most of a unit at its stage's end
    (``carry_bytes``), an offloaded unit stays until its copy is done after the next forward."""
    stages = [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 1000, "fwd_peak_bytes": 1000, "bwd_peak_bytes": 100,
               "input_bytes": 50, "carry_bytes": 50} for _ in range(5)]
    chain = chain_from_dict({"format": "offload-chain/2", "name": "carry", "stages": stages,
                             "platform": {"d2h_bytes_per_s": 1e6, "h2d_bytes_per_s": 1e6}})
    floor = smallest_feasible_budget(chain)
    with pytest.raises(Exception, match="below the smallest feasible budget"):
        solve(chain, floor - 1, "ilp", EXACT)
    joint = solve(chain, floor - 1, "ilp", JOINT)
    assert joint.schedule.recompute and joint.simulation.peak_bytes <= floor - 1
    assert joint.status == "optimal"
    assert smallest_feasible_budget(chain, recompute=True) <= joint.simulation.peak_bytes


def test_recomputation_beats_offloading_on_a_slow_link():
    """Cheap forwards, big units, a slow link: recomputing hides what copies cannot."""
    stages = [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 1000, "fwd_peak_bytes": 1000, "bwd_peak_bytes": 100,
               "input_bytes": 100} for _ in range(6)]
    chain = chain_from_dict({"format": "offload-chain/2", "name": "slow", "stages": stages,
                             "platform": {"d2h_bytes_per_s": 1e5, "h2d_bytes_per_s": 1e5}})
    budget = 3600
    offload_only = solve(chain, budget, "ilp", EXACT).simulation.makespan_s
    joint = solve(chain, budget, "ilp", JOINT)
    assert joint.schedule.recompute and joint.simulation.makespan_s < offload_only
    assert joint.simulation.makespan_s <= solve(chain, budget, "recompute-only", EXACT).simulation.makespan_s


ZOO = Path(__file__).resolve().parent.parent / "experiments" / "chains"


@pytest.mark.slow  # 4 s: a search's quality, not a rule; make test-all
def test_relax_trades_a_recomputation_for_an_offload_nearby():
    """ViT on the link-bound platform at 35% of its peak: the optimum recomputes stages 4, 5, 7
    and 8 and offloads 3 and 6; from recomputing 3, 5..9 no single move goes downhill (offload
    3 instead costs 0.1%, then offload 6 instead 13%).  The kicks that give a few nearby
    stages another option find it."""
    chain = link_bound(load_chain(ZOO / "vit-b4-64px-cpu.json"))
    budget = int(0.35 * no_offload_peak(chain))
    best = solve(chain, budget, "ilp", Options(time_limit_s=60, recompute=True))
    assert best.status == "optimal"
    found = solve(chain, budget, "relax-lp", Options(heuristic_time_s=1.5, recompute=True))
    assert found.simulation.makespan_s <= best.simulation.makespan_s * 1.01


def test_the_searchs_run_starts_fit_below_single_stage_runs():
    """ResNet-101 at 25% of its peak: every stage its own run cannot fit (each run holds its
    checkpoint until its backward), longer or fewer runs can; every start the search fits
    leaves a schedule within the budget once the other units are offloaded."""
    chain = link_bound(load_chain(ZOO / "resnet101-b4-128px-cpu.json"))
    budget = int(0.25 * no_offload_peak(chain))
    singles = [Recompute(i, i) for i in sorted(chain.recomputable)]
    rest = [i for i in chain.offloadable if i not in chain.recomputable]
    assert floor_memory(chain, rest, singles).max() > budget
    fitted = [relax._fit_runs(chain, budget, runs, 8, float("inf")) for runs in relax._run_starts(chain, 8)]
    assert sum(1 for runs in fitted if runs) >= 10
    for runs in filter(None, fitted):
        rebuilt = {i for r in runs for i in r.stages}
        assert all(len(r.stages) <= 8 and chain.can_recompute(r.first, r.last) for r in runs)
        assert floor_memory(chain, [i for i in chain.offloadable if i not in rebuilt], runs).max() <= budget


def test_schedule_format_2_round_trips_and_1_still_loads(small):
    s = make_schedule(small, [Offload(3, 4, 3)], [Recompute(1, 2)], method="test")
    doc = json.loads(json.dumps(schedule_to_dict(s, small)))
    assert doc["format"] == "offload-schedule/2" and doc["recompute"] == [{"first": 1, "last": 2}]
    again = schedule_from_dict(doc, small)
    assert again.recompute == (Recompute(1, 2),) and again.offloads == s.offloads
    old = {k: v for k, v in doc.items() if k != "recompute"} | {"format": "offload-schedule/1"}
    assert schedule_from_dict(old, small).recompute == ()
    with pytest.raises(Exception, match="unknown field"):
        schedule_from_dict(old | {"recompute": []}, small)
    doc["recompute"] = [{"first": 2, "last": 3}]
    with pytest.raises(ScheduleRejected, match="stage 3 is recomputed and offloaded"):
        schedule_from_dict(doc, small)


def test_stages_the_executor_cannot_rerun_are_never_recomputed():
    """``recomputable: false`` (the profiler's verdict): refused in a schedule, and left alone by
    every recomputing method."""
    chain = small_chain(recomputable=False)
    assert chain.recomputable == {1, 3} and chain.stage(2).recomputable is False
    with pytest.raises(ScheduleRejected, match="stage 2 .* cannot re-run"):
        simulate(chain, [], recompute=[Recompute(1, 2)])
    for method in ("ilp", "recompute-only", "checkpoint-sqrt", "checkpoint-blocks", "relax-lp"):
        runs = solve(chain, 10 ** 6, method, JOINT).schedule.recompute
        assert all(2 not in r.stages for r in runs) and (runs or not method.startswith("checkpoint")), method
    plan = StepPlan.from_schedule(chain, make_schedule(chain, [], [Recompute(1, 1), Recompute(3, 3)]))
    assert plan.recomputed == {1, 3} and plan.run_starts == {1, 3}


def test_show_bisects_the_exact_floor_with_recomputation(tmp_path, capsys):
    """``offload show --exact-floor``: the least budget the joint MILP meets, between the
    lower bound and offloading's floor, met at that budget and not half a percent below."""
    stages = [{"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 1000, "fwd_peak_bytes": 1000, "bwd_peak_bytes": 100,
               "input_bytes": 50, "carry_bytes": 50} for _ in range(5)]
    chain = chain_from_dict({"format": "offload-chain/2", "name": "carry", "stages": stages,
                             "platform": {"d2h_bytes_per_s": 1e6, "h2d_bytes_per_s": 1e6}})
    save_chain(chain, tmp_path / "c.json")
    assert offload(["show", str(tmp_path / "c.json"), "--exact-floor", "0.5"]) == 0
    exact = int(re.search(r"with recomputation, exact: .*?\((\d+) B", capsys.readouterr().out).group(1))
    assert smallest_feasible_budget(chain, recompute=True) <= exact < smallest_feasible_budget(chain)
    assert solve(chain, exact, "ilp", JOINT).simulation.peak_bytes <= exact
    with pytest.raises(InfeasibleBudget):
        solve(chain, exact - int(0.005 * no_offload_peak(chain)) - 1, "ilp", JOINT)


def test_cli_solves_with_recompute_and_replays(tmp_path, capsys):
    chain = chain_from_dict(chain_doc(stages=[
        {"fwd_s": 0.001, "bwd_s": 0.002, "saved_bytes": 1000, "fwd_peak_bytes": 1000, "bwd_peak_bytes": 100,
         "input_bytes": 100} for _ in range(6)], platform={"d2h_bytes_per_s": 1e5, "h2d_bytes_per_s": 1e5}))
    save_chain(chain, tmp_path / "c.json")
    out = tmp_path / "s.json"
    assert offload(["solve", str(tmp_path / "c.json"), "--budget", "3600", "--recompute", "-o", str(out)]) == 0
    assert "recomputed" in capsys.readouterr().out
    assert json.loads(out.read_text())["recompute"]
    assert offload(["simulate", str(tmp_path / "c.json"), str(out), "--timeline"]) == 0
    printed = capsys.readouterr().out
    assert "re-run" in printed and "recomputed" in printed
    assert offload(["show", str(tmp_path / "c.json")]) == 0
    assert "with recomputation" in capsys.readouterr().out
    trace = tmp_path / "t.json"
    assert offload(["trace", str(tmp_path / "c.json"), str(out), "-o", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "R" and e["name"].startswith("R") for e in events)  # re-run ops on the compute lane
    assert offload(["plot", "--timeline", str(tmp_path / "c.json"), str(out), "-o", str(tmp_path / "t.png")]) == 0


def test_a_replay_lets_go_of_what_it_rebuilt():
    """What a re-run hands to ``saved`` goes once its holder drops it: the replay's graph keeps
    its pack hook, and a hook that still reached the holder made a cycle through autograd that
    Python cannot collect (the profiler's timed replays kept every rebuilt tensor: out of
    memory on an H200 profiling a 16-layer bf16 Llama)."""
    import gc
    import weakref

    import torch
    from torch import nn

    from offload.core.rerun import StageRecorder

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    recorder = StageRecorder(1, x, torch.device("cpu"), {})
    y = block(x)
    program = recorder.finish(y)
    rebuilt: list[torch.Tensor] = []
    out = program.run(x, torch.device("cpu"), rebuilt.append)
    assert len(rebuilt) >= 3 and any(t.grad_fn is not None for t in rebuilt)
    gone = [weakref.ref(t) for t in rebuilt]
    del rebuilt, out
    gc.collect()
    assert all(ref() is None for ref in gone)


def test_the_recorders_flattening_is_pytrees():
    """The recorder flattens and copies a call's arguments by hand where they are leaves in a
    tuple, list or dict (``rerun._leaves``, ``rerun._mapped``): the same leaves in the same
    order and the same containers, new ones, as pytree's; anything else is pytree's own."""
    from collections import OrderedDict, namedtuple

    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    from offload.core.rerun import _leaves, _mapped

    t, u = torch.zeros(2), torch.nn.Parameter(torch.ones(1))
    Pair = namedtuple("Pair", "a b")
    trees = [t, (t, 1, None), ((t, u), {"dim": 1, "x": t}), ([t, t], {}), ((), {"a": [t, 2.5]}),
             ((t, torch.Size([2, 3])), {}), (Pair(t, 1),), OrderedDict(a=t), {"b": (t, "s", torch.float16)},
             ([[t]], {}), (t, torch.device("cpu"), True)]
    for tree in trees:
        mine, theirs = _leaves(tree), tree_flatten(tree)[0]
        assert len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs))
        mine, theirs = _mapped(lambda v: ("leaf", id(v)), tree), tree_map(lambda v: ("leaf", id(v)), tree)
        assert mine == theirs and type(mine) is type(theirs)
    given = ([t], {"k": t})  # a call may empty a list it is handed: the copy's containers are its own
    copied = _mapped(lambda v: v, given)
    assert copied[0] is not given[0] and copied[1] is not given[1] and copied[0][0] is t
    # no reference cycle keeps what the function holds past the call (a re-run's outputs)
    import gc
    import weakref
    held = torch.zeros(3)
    gone = weakref.ref(held)
    gc.disable()
    try:
        _mapped(lambda v, h=held: v, given)
        del held
        assert gone() is None
    finally:
        gc.enable()


def test_a_boundary_module_registered_twice_holds_both_parents_calls_open():
    """A module registered under two parents (T5's shared embedding, its encoder's
    ``embed_tokens`` too) may be called from under either: the modules whose calls hold the
    stage's end are both parents' (a recorder opens the calls inside them)."""
    from torch import nn

    from offload.core.staging import Site, Staging

    shared = nn.Linear(4, 4)
    root = nn.Module()
    root.shared, root.encoder = shared, nn.Module()
    root.encoder.embed_tokens = shared
    staging = Staging(root, [Site.parse("shared")])
    assert staging.enclosing == [frozenset({root, root.encoder})]
    staging.remove()


def test_calls_inside_a_call_that_ends_in_the_stage_are_not_opened_and_one_it_ends_inside_is_told():
    """A call of a module none of the boundary's ancestors (``code``) completes within the
    stage, so the recorder does not open the calls inside it (a block's dozen, for a counter
    each): the program holds the block's call alone and re-runs it bit for bit.  A call of
    such a module that the stage ends inside, after calls of its own began (the boundary's
    module called from outside its parent, a reference hidden from the module tree), makes the
    stage one that cannot be re-run, saying why: those calls were not recorded."""
    import torch
    from torch import nn

    from offload.core.rerun import NotRerunnable, StageRecorder

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    model = nn.Sequential(block, nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    recorder = StageRecorder(1, x, torch.device("cpu"), {}, code=frozenset({model}))
    y = block(x)
    program = recorder.finish(y)
    assert [call.fn for call in program.calls] == [block]
    rebuilt: list[torch.Tensor] = []
    assert torch.equal(program.run(x, torch.device("cpu"), rebuilt.append), y) and len(rebuilt) >= 3

    class Caller(nn.Module):  # calls a module it does not own
        def __init__(self, target: nn.Module) -> None:
            super().__init__()
            self.pre, self.target = nn.Linear(8, 8), [target]

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            self.target[0](self.pre(t))  # the stage ends as the target returns, inside this call
            return t

    boundary = nn.Linear(8, 8)
    caller = Caller(boundary)
    recorder = StageRecorder(1, x, torch.device("cpu"), {}, code=frozenset({model}))
    told: list[str] = []

    def stage_ends(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        try:
            recorder.finish(out)
        except NotRerunnable as exc:
            told.append(str(exc))
    handle = boundary.register_forward_hook(stage_ends)
    try:
        caller(x)
    finally:
        handle.remove()
        recorder.close()
    assert len(told) == 1 and "ends inside a call of a module that is none of its boundary's ancestors" in told[0]


def test_a_recorded_stage_lets_go_of_what_only_a_completed_calls_inner_calls_read():
    """A call's own code makes a tensor its inner call reads (an attention's key states, made
    contiguous before its projection): held while the inner call is a call of the stage, no
    longer once the outer call completes (its re-run makes it again).  The recorder's alias of
    it held its storage past that, until another tensor took the dead one's ``id``: a moment
    that follows Python's garbage collections, so a Whisper's recorded stages read 32 KiB more
    or less from run to run, and its gradient test failed one run in twenty."""
    import torch
    from torch import nn

    from offload.core.meters import CpuMeter
    from offload.core.rerun import StageRecorder

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8).requires_grad_(False)  # saves its weight, not what it reads

        def forward(self, x):
            return self.inner(x * 2)

    outer = Outer()
    x = torch.randn(4, 8, requires_grad=True)
    with CpuMeter() as meter:
        recorder = StageRecorder(1, x, torch.device("cpu"), {})
        y = outer(x)
        assert meter.live == y.untyped_storage().nbytes()  # ``x * 2`` gone as the call returned
        program = recorder.finish(y)
    meter.close()
    assert [type(c.fn) for c in program.calls] == [Outer] and not program.held


def test_a_replay_under_autocast_holds_one_weight_cast_at_a_time():
    """The replay runs without autocast's cache of weight casts: each cast dies with its reader
    (the forward's cache held every cast of a bf16 Llama block through its re-run, more bytes
    than the block saves), and the replay saves the same bits as the forward."""
    import torch
    from torch import nn

    from offload.core import casts
    from offload.core.meters import CpuMeter
    from offload.core.rerun import StageRecorder

    torch.manual_seed(0)
    block = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    x = torch.randn(2, 256, requires_grad=True)
    cast = 256 * 256 * 2  # one weight in bf16
    saved: list[torch.Tensor] = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        recorder = StageRecorder(1, x, torch.device("cpu"), {})
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = block(x)
        program = recorder.finish(y)
    forward = [t for t in saved if casts.recast(t) is None]
    rebuilt: list = []
    meter = CpuMeter()
    with meter:
        meter.track([x, *block.parameters()])
        _, before = meter.boundary()
        program.run(x, torch.device("cpu"), lambda t: rebuilt.append(casts.pack(t)))
        peak, _ = meter.boundary()
    kept = [t for t in rebuilt if isinstance(t, torch.Tensor)]
    assert [torch.equal(a, b) for a, b in zip(kept, forward)] == [True] * len(forward) == [True] * len(kept)
    activations = sum(t.untyped_storage().nbytes() for t in kept if t.untyped_storage().data_ptr() != x.data_ptr())
    assert peak - before < activations + 2 * cast  # the cache would hold six


def test_recording_leaves_no_global_hook_behind():
    """The recorder's global module hooks go with it, their ``with_kwargs`` marks too (torch
    keeps those in a dict the handle does not clean: a leak per recorded stage per step)."""
    import torch
    import torch.nn.modules.module as module_hooks
    from offload.core.rerun import StageRecorder

    before = {name: len(getattr(module_hooks, name)) for name in dir(module_hooks) if name.startswith("_global_")
              and isinstance(getattr(module_hooks, name), dict)}
    for _ in range(3):
        StageRecorder(1, None, torch.device("cpu"), {}).close()
    after = {name: len(getattr(module_hooks, name)) for name in before}
    assert after == before


def test_the_models_own_functions_between_blocks_are_re_run_with_them():
    """The model's own code applies ``F.gelu`` and ``F.dropout`` between its blocks (each saves
    a tensor outside any module call: no stage after the first could be re-run, BART's and
    Whisper's embeddings' stages neither) and scales the dropout's output in place: recorded
    as calls of the stage, in order with the block's, every stage re-runs, gradients bit for
    bit with dropout, bytes moved and every op's memory as predicted."""
    from offload.profiler.profile import ProfileOptions, profile
    from tests.runs import ROOT, check_run, recomputing

    chain = profile(str(ROOT / "tests" / "models" / "functional.py") + ":build",
                    ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    assert chain.recomputable == set(range(1, chain.L)) and all(chain.stage(i).rerun_output for i in chain.recomputable)
    for name, sched in recomputing(chain).items():
        check_run(chain, sched, "cpu-lazy", f"functional/{name}")


def test_the_recorders_mode_sees_no_torch_call_inside_a_block(monkeypatch):
    """While a call whose own code is not recorded runs (a block, hundreds of torch calls in a
    transformer layer), the recorder's mode is off the stack: it sees only the model's own
    code between the calls (a bf16 Llama's host time per recomputed stage is what it adds)."""
    from offload.core import rerun
    from offload.executor import Offloaded
    from offload.models import resolve
    from offload.profiler.profile import ProfileOptions, profile
    from tests.runs import ROOT

    seen = []
    handle = rerun._StageCode.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(self.recorder().recording[-1])
        return handle(self, func, types, args, kwargs)
    monkeypatch.setattr(rerun._StageCode, "__torch_function__", counted)
    model = str(ROOT / "tests" / "models" / "functional.py") + ":build"
    chain = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    spec = resolve(model, 2, {})
    run = Offloaded(spec.module, chain, make_schedule(chain, [], recompute=[Recompute(i, i) for i in chain.recomputable]))
    seen.clear()
    spec.loss(run(*spec.args)).backward()
    assert seen and all(seen), (len(seen), seen.count(False))


def test_a_recorders_mode_leaves_the_stack_and_anothers_stays():
    """The recorder's mode is on the torch function mode stack while the stage runs; closed,
    it leaves, and a mode the model entered in the stage and left open stays."""
    import torch
    from torch.overrides import TorchFunctionMode

    from offload.core.rerun import StageRecorder

    depth = torch._C._len_torch_function_stack()
    recorder = StageRecorder(1, None, torch.device("cpu"), {}, code=frozenset())
    assert torch._C._len_torch_function_stack() == depth + 1
    theirs = TorchFunctionMode()
    theirs.__enter__()
    recorder.close()
    assert torch._C._len_torch_function_stack() == depth + 1
    assert torch._C._get_function_stack_at(depth) is theirs
    theirs.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == depth


def test_a_forward_that_fails_in_a_recorded_stage_leaves_no_mode_and_no_hook():
    """A forward that raises inside a stage the schedule recomputes: its recorder lets go of
    the model (mode and hooks), and the next forward runs."""
    import torch
    import torch.nn.modules.module as module_hooks

    from offload.executor import Offloaded
    from offload.models import resolve
    from offload.profiler.profile import ProfileOptions, profile
    from tests.runs import ROOT

    model = str(ROOT / "tests" / "models" / "functional.py") + ":build"
    chain = profile(model, ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    spec = resolve(model, 2, {})
    run = Offloaded(spec.module, chain, make_schedule(chain, [], recompute=[Recompute(3, 3)]))
    hooks = len(module_hooks._global_forward_hooks)
    fail = spec.module.blocks[1].register_forward_pre_hook(lambda *_: 1 / 0)  # inside stage 3
    with pytest.raises(ZeroDivisionError):
        run(*spec.args)
    assert torch._C._len_torch_function_stack() == 0 and len(module_hooks._global_forward_hooks) == hooks
    fail.remove()
    spec.loss(run(*spec.args)).backward()


def test_no_code_is_recorded_under_a_compiled_module():
    """Under ``torch.compile`` the stages' own code is not watched (Dynamo would trace the
    recorder's mode and compile the model again): a block compiled in place, after the
    boundaries were added, is enough."""
    from torch import nn

    from offload.core.staging import Site, Staging

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    staging = Staging(model, [Site("0", 0), Site("1", 0)])
    assert staging.enclosing == [frozenset({model}), frozenset({model})]
    model[1].compile()
    assert staging.enclosing is None
    staging.remove()


def test_an_op_over_the_budget_whatever_the_schedule_makes_the_milp_infeasible():
    """Hypothesis's find: F3 holds U2 (released at the turn, the last boundary) and its own
    byte whatever is chosen, over a 1-byte budget. The MILP's row for F3 has no variable left;
    it was dropped as if it held, and the MILP returned a schedule over the budget."""
    from offload.step.chain import Platform, Stage

    def stage(name, saved, peak, inputs, recomputable):
        return Stage(name=name, kind="conv", fwd_s=0.001, bwd_s=0.001, saved_bytes=saved, fwd_peak_bytes=peak,
                     bwd_peak_bytes=0, need_from=int(name[-1]), input_bytes=inputs, recomputable=recomputable,
                     carry_bytes=0)
    chain = Chain(name="random", stages=(stage("stage1", 0, 0, 0, False), stage("stage2", 1, 1, 1, True),
                                         stage("stage3", 0, 1, 0, False)),
                  platform=Platform(d2h_bytes_per_s=4000.0, h2d_bytes_per_s=4000.0, latency_s=0.0))
    assert_joint_ilp_is_brute_force(chain, 1, JOINT)


def test_a_unit_its_model_lets_go_after_the_next_stage_counts_in_the_reading_after_it():
    """DenseNet's transitions (``tests/models/transition.py``): the outer ``Sequential`` holds
    the transition's input, the unit of its norm's stage, until the transition returns, after
    the reading that ends the stage after the norm; the next stage's first reading holds it.
    With the norm recomputed inside a run, or offloaded and released at the next stage, and
    the narrow block after the transition recomputed too (it grows by less than the input's
    bytes), that block's op read 768 B over its prediction (DenseNet-121: 5 KiB).  The profile
    measures the late part (``carried_late_bytes``, here the input itself) and the forward's
    transient live as it starts; every op is at or above its measure, the block's exact."""
    from offload.profiler.profile import ProfileOptions, profile
    from tests.runs import ROOT

    chain = profile(str(ROOT / "tests" / "models" / "transition.py") + ":build",
                    ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False)).chain
    norm = next(i for i, s in enumerate(chain.stages, 1) if s.name == "2.0")
    block = norm + 2
    assert chain.stage(block).name.startswith("3") and chain.cl[norm] == chain.xl[norm] == chain.x[norm] > 0
    for offloads, runs in (([], [Recompute(norm - 1, norm), Recompute(block, block)]),
                           ([Offload(norm, norm + 1, int(chain.need[norm]))], [Recompute(block, block)])):
        m, p = none_over(chain, offloads, runs)
        assert m[f"F{block}"] == p[f"F{block}"] > memory_profile(without_late_parts(chain), offloads, runs)[0][block - 1]


def test_a_held_part_its_model_lets_go_after_its_last_reader_counts_in_the_reading_after_it(resnet18):
    """ResNet's ``forward`` holds ``layer1``'s output (saved by its last block's ReLU, that
    block's unit) in a local until ``layer2`` returns: it dies as ``layer3`` starts, after the
    reading that ends ``layer2``.  With that block offloaded and released at once and
    ``layer3.0`` recomputed (it grows by less than the output's bytes), ``layer3.0``'s op read
    6 KiB over its prediction; the profile measures the late part of the held part
    (``held_late_bytes``) and the op is exact."""
    chain = resnet18
    block, reader = (next(i for i, s in enumerate(chain.stages, 1) if s.name == name) for name in ("layer1.1", "layer3.0"))
    assert chain.held_until[block] == reader - 1 and chain.hl[block] == chain.held[block] > 0
    offloads, runs = [Offload(block, block + 1, int(chain.need[block]))], [Recompute(reader, reader)]
    m, p = none_over(chain, offloads, runs)
    assert m[f"F{reader}"] == p[f"F{reader}"] > memory_profile(without_late_parts(chain), offloads, runs)[0][reader - 1]


def test_a_later_re_run_op_holds_the_tensors_the_runs_first_stage_read_too():
    """A GPT-2's blocks read tensors the model made before them (position ids, 128 B here),
    which the embedding's unit holds: a run's later re-runs read them too, beside their
    input, and with that unit offloaded nothing resident held them.  ``R4`` of a run of
    blocks 2..ln_f counted none of them (``rerun_held_bytes`` counts only what a stage reads
    and the stage before does not), and its ``B5`` read 128 B over; now every op is within."""
    from offload.profiler.profile import ProfileOptions, profile

    chain = profile("gpt2", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False,
                                           options={"layers": 3, "width": 64, "seq": 16})).chain
    first, last = (next(i for i, s in enumerate(chain.stages, 1) if s.name == name)
                   for name in ("transformer.h.1", "transformer.ln_f"))
    held = int(chain.x[first + 1] - chain.xo[first + 1])
    assert held > 0 and chain.xn[first + 1] == 0 and chain.need[1] == 1
    none_over(chain, [Offload(1, 2, 1)], [Recompute(first, last)])


def test_a_checkpoint_the_unit_before_holds_too_counts_once(resnet18):
    """A ResNet block's output is saved by its last ReLU (its unit) and is the next block's
    input (a run's checkpoint there): one storage.  With that unit kept, the checkpoint was
    counted on top of it from the op after the run's forward to its rebuild (a whole
    activation map: ``layer2.0``'s 32 KiB at image 32); with it offloaded, on top of the part
    the model's code holds (ResNet's ``forward`` holds each layer's output until the next
    layer returns).  The profile measures what the checkpoint shares (``input_prev_bytes``,
    ``input_prev_held_bytes``): the op after the forward is exact either way, the prediction
    lower by those bytes."""
    chain = resnet18
    kept, held = (next(i for i, s in enumerate(chain.stages, 1) if s.name == name) for name in ("layer2.1", "layer3.0"))
    assert chain.xp[kept] == chain.x[kept] > 0 and 0 < chain.xph[held] == chain.xp[held]
    for offloads, run, shared in (([], Recompute(kept, kept), chain.xp[kept]),
                                  ([Offload(held - 1, held, int(chain.need[held - 1]))], Recompute(held, held),
                                   chain.xph[held])):
        m, p = none_over(chain, offloads, [run])
        after = f"F{run.first + 1}"
        counted_twice = memory_profile(without_shared_checkpoints(chain), offloads, [run])[0][run.first]
        assert m[after] == p[after] == counted_twice - shared


def test_a_carried_part_let_go_as_the_next_stage_starts_counts_in_its_first_reading_only(resnet18):
    """ResNet's stem ends in a pool whose input (the ReLU's output, saved by the pool: the
    stem's unit) is still the pool's argument when the boundary fires, and dies as
    ``layer1.0`` starts.  With the stem recomputed it was booked through all of ``layer1.0``
    (``carry_bytes``: 128 KiB over its measure at image 32); the profile now puts it in
    ``carried_early_bytes``, counted in that op's first reading only (``memory.late_parts``),
    and the op is exact."""
    chain = resnet18
    stem = next(i for i, s in enumerate(chain.stages, 1) if s.name == "bn1")
    assert chain.ce[stem] > 0
    booked = replace(chain, stages=tuple(replace(s, carry_bytes=s.carry_bytes + s.carried_early_bytes,
                                                  carried_early_bytes=0) for s in chain.stages))
    runs = [Recompute(stem, stem)]
    m, p = none_over(chain, [], runs)
    after = f"F{stem + 1}"
    assert m[after] == p[after] == memory_profile(booked, [], runs)[0][stem] - chain.ce[stem]
