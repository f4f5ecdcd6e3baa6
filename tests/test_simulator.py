import dataclasses

import pytest
from hypothesis import given, settings

from offload.errors import FormatError, ScheduleRejected
from offload.solver.ilp import solve_ilp
from offload.step.actions import Offload, Recompute
from offload.step.budget import Budget
from offload.step.chainfile import chain_from_dict
from offload.step.memory import no_offload_peak, smallest_feasible_budget
from offload.step.simulate import simulate
from tests.conftest import chain_doc
from tests.strategies import chain_and_budget


def test_no_offload_runs_at_the_ideal_makespan(four):
    sim = simulate(four, [])
    assert sim.makespan_s == four.ideal_makespan_s == 12.0
    assert sim.stall_s == 0
    assert list(sim.memory) == [150, 250, 350, 450, 450, 350, 250, 150]
    assert no_offload_peak(four) == 450


def test_release_and_prefetch_stalls_by_hand():
    doc = chain_doc()
    doc["platform"]["d2h_bytes_per_s"] = 50.0  # D2H takes 2 s, H2D 1 s
    chain = chain_from_dict(doc)
    sim = simulate(chain, [Offload(1, 2, 1)])
    ops = {o.name: o for o in sim.ops}
    assert (ops["F3"].ready, ops["F3"].start) == (2.0, 3.0)  # waits for U1's D2H [1, 3]
    assert (ops["B1"].ready, ops["B1"].start, ops["B1"].end) == (11.0, 12.0, 14.0)  # on-demand H2D [11, 12]
    assert sim.makespan_s == 14.0 and sim.stall_s == 2.0
    assert list(sim.memory) == [150, 250, 250, 350, 350, 250, 150, 150]
    d2h, h2d = sim.copies
    assert (d2h.direction, d2h.start, d2h.end) == ("D2H", 1.0, 3.0)
    assert (h2d.direction, h2d.issue, h2d.end) == ("H2D", 11.0, 12.0)


def test_prefetch_issue_order_and_fifo(four):
    # both prefetched at the turn: U2 is needed first so its copy goes first
    sim = simulate(four, [Offload(1, 2, 4), Offload(2, 3, 4)])
    h2d = [c for c in sim.copies if c.direction == "H2D"]
    assert [(c.stage, c.start, c.end) for c in h2d] == [(2, 4.0, 5.0), (1, 5.0, 6.0)]
    assert sim.stall_s == 0 and sim.makespan_s == 12.0


def test_budget_refusal_names_op_and_excess(four):
    with pytest.raises(ScheduleRejected, match=r"F4 at t=3 s holds 450 bytes.*over by 50 bytes; 2 ops"):
        simulate(four, [], 400)
    with pytest.raises(ScheduleRejected, match="total"):
        simulate(four, [], Budget(1400, "total"))


def test_held_bytes_stay_until_held_until(four):
    """40 of unit 1's 100 bytes are held by the model's code through F3: a release at 2 frees 60."""
    stages = list(four.stages)
    stages[0] = dataclasses.replace(stages[0], held_bytes=40, held_until=3)
    held = dataclasses.replace(four, stages=tuple(stages))
    plain, kept = simulate(four, [Offload(1, 2, 1)]).memory, simulate(held, [Offload(1, 2, 1)]).memory
    assert list(kept - plain) == [0, 0, 40, 0, 0, 0, 0, 0]  # F3 only (F1, F2: resident anyway)
    assert list(simulate(held, [Offload(1, 3, 1)]).memory - plain) == [0, 0, 100, 0, 0, 0, 0, 0]


def test_floor_is_the_smallest_budget(four):
    floor = smallest_feasible_budget(four)
    assert floor == 250  # F2..: the previous unit plus the op's own 150
    with pytest.raises(ScheduleRejected):
        simulate(four, [Offload(i, i + 1, i) for i in (1, 2, 3)], floor - 1)


@settings(max_examples=150, deadline=None)
@given(chain_and_budget(max_stages=8))
def test_only_restores_copy_beside_the_d2h_copies(cb):
    """All D2H copies end before B_L (releases are <= L) and the backward's H2D copies are
    issued at B_L or later; the one H2D copy that may run beside a D2H copy is a held part's
    restore, which ends before its forward reader, so before B_L (the model assumes the two
    directions copy at once there, as the executor's two copy streams do on a GPU)."""
    from offload.step.memory import floor_offloads
    chain, _ = cb
    sim = simulate(chain, floor_offloads(chain))
    d2h_end = max((c.end for c in sim.copies if c.direction == "D2H"), default=0.0)
    assert all(c.start >= d2h_end for c in sim.copies if c.direction == "H2D" and not c.held)
    backward = sim.start[chain.L]
    assert all(c.end <= backward for c in sim.copies if c.held)


def test_an_op_ends_no_earlier_than_the_host_has_issued_it():
    """Four stages of 1 s forward, 2 s backward on the device; the host takes 1.5 s to issue
    each forward and 1 s each backward: the forward is host-bound (it ends at 1.5, 3, 4.5,
    6), the backward device-bound again once the host is ahead (B4 ends at 8, then +2 each).
    A D2H is issued as its forward really ends, and the waits are not copy stalls."""
    doc = chain_doc()
    for s in doc["stages"]:
        s.update(fwd_host_s=1.5, bwd_host_s=1.0)
    chain = chain_from_dict(doc)
    sim = simulate(chain, [])
    assert list(sim.end) == [1.5, 3.0, 4.5, 6.0, 8.0, 10.0, 12.0, 14.0]
    assert sim.host_wait_s == pytest.approx(4 * 0.5) and sim.stall_s == 0
    moved = simulate(chain, [Offload(1, 2, 2)])
    assert moved.copies[0].issue == 1.5  # as F1 ends, not when its kernels would have on an idle host


def test_a_recomputed_stage_costs_the_host_its_recording_and_its_rerun():
    """Stage 2 recomputed on a host that issues every op in 0.5 s: recording F2 costs the host
    3 s more (F2 ends at 4, not 2, and the rest of the forward follows), and issuing its re-run
    8 s (B2 waits for the host until 14.5, where the device would have ended it at 13)."""
    doc = chain_doc()
    for s in doc["stages"]:
        s.update(fwd_host_s=0.5, bwd_host_s=0.5)
    doc["stages"][1].update(input_bytes=10, recording_host_s=3.0, rerun_host_s=8.0)
    chain = chain_from_dict(doc)
    sim = simulate(chain, [], recompute=[Recompute(2, 2)])
    assert list(sim.end) == [1.0, 4.0, 5.0, 6.0, 8.0, 10.0, 14.5, 16.5]
    assert simulate(chain, []).makespan_s == 12.0  # kept: nothing recorded, nothing re-run


def test_a_recomputed_stage_takes_its_recorded_times():
    """Stage 2 recorded for its re-run takes 1.5 s to run forward (1 s as timed plainly), 0.75 s
    to re-run and 2.5 s backward after the rebuild: F2 ends at 2.5, the rebuild at the start of
    B2 ends at 9.25, B2 at 11.75.  Kept, it runs as timed; a run with an option of its own
    re-runs the option's ops, and records its forward in the option's time."""
    doc = chain_doc()
    doc["stages"][1].update(input_bytes=10, recorded_fwd_s=1.5, rerun_s=0.75, recorded_bwd_s=2.5,
                            options=[{"name": "matmuls", "kept_bytes": 40, "recompute_s": 0.5, "fwd_s": 1.75}])
    chain = chain_from_dict(doc)
    sim = simulate(chain, [], recompute=[Recompute(2, 2)])
    assert list(sim.end) == [1.0, 2.5, 3.5, 4.5, 6.5, 8.5, 11.75, 13.75]
    assert [(r.stage, r.start, r.end) for r in sim.recomputes] == [(2, 8.5, 9.25)]
    assert simulate(chain, []).makespan_s == 12.0
    part = simulate(chain, [], recompute=[Recompute(2, 2, option="matmuls")])
    assert list(part.end) == [1.0, 2.75, 3.75, 4.75, 6.75, 8.75, 11.75, 13.75]


@pytest.mark.parametrize("fields, message", [
    ({"recorded_fwd_s": 0.5}, r"stages\[2\]\.recorded_fwd_s \(0\.5\) < fwd_s \(1\.0\)"),
    ({"recorded_bwd_s": 1.0}, r"stages\[2\]\.recorded_bwd_s \(1\.0\) < bwd_s \(2\.0\)"),
    ({"rerun_s": 1.25, "options": [{"name": "matmuls", "kept_bytes": 40, "recompute_s": 1.5}]},
     r"recompute_s \(1\.5\) > the stage's rerun_s \(1\.25\)"),
    ({"recorded_fwd_s": 1.5, "options": [{"name": "matmuls", "kept_bytes": 40, "recompute_s": 0.5, "fwd_s": 1.25}]},
     r"fwd_s \(1\.25\) < the stage's recorded_fwd_s \(1\.5\)"),
])
def test_recorded_times_below_what_they_bound_are_refused(fields, message):
    """A recorded op is charged at least the plain one (the solver's bounds take those as the
    shortest), and an option's ops sit between its stage's re-run and its recorded forward."""
    doc = chain_doc()
    doc["stages"][1].update(fields)
    with pytest.raises(FormatError, match=message):
        chain_from_dict(doc)
    assert chain_from_dict(chain_doc()).stage(2).rerun == 1.0  # none given: the ops the chain timed


def test_a_copy_is_hidden_only_while_the_device_computes():
    """The predicted overlap is read as a trace's is: the D2H of U1 (2 s, from 1.5) runs under
    F2's kernels for 1 s, then while the device waits for the host (to 3.0) and for the copy
    itself (to 3.5): exposed, though only 0.5 s of it is a stall; the H2D (2 s) runs under B2.
    3 s of 4 hidden, not the 3.5 that subtracting the stalls would say."""
    doc = chain_doc(platform={"d2h_bytes_per_s": 50.0, "h2d_bytes_per_s": 50.0, "latency_s": 0.0})
    for s in doc["stages"]:
        s.update(fwd_host_s=1.5, bwd_host_s=1.0)
    sim = simulate(chain_from_dict(doc), [Offload(1, 2, 2)])
    assert [(c.direction, c.start, c.end) for c in sim.copies] == [("D2H", 1.5, 3.5), ("H2D", 10.0, 12.0)]
    assert sim.stall_s == 0.5 and sim.copy_overlap == 0.75


def _host_doc(fwd_host_s: float, bwd_host_s: float, **platform: float) -> dict:
    """``chain_doc``'s four stages on a host that issues each forward and backward in these
    times, the platform's executor host costs as given."""
    doc = chain_doc(platform={"d2h_bytes_per_s": 100.0, "h2d_bytes_per_s": 100.0, "latency_s": 0.0, **platform})
    for s in doc["stages"]:
        s.update(fwd_host_s=fwd_host_s, bwd_host_s=bwd_host_s)
    return doc


def test_a_copy_costs_the_host_per_storage_and_starts_when_issued():
    """The executor's host time per storage copied (``copy_host_s``, 0.5 s) on a host that
    issues every op in 0.5 s: U1's four storages take the host 2 s to issue after F1 (issued
    at 0.5), so its D2H starts at 2.5, not as F1 ends at 1, F2 is issued at 3.0 and the release
    after it waits for the copy to 3.5; the H2D at B2 is issued 2 s later on the host, which
    is still ahead of the device there.  1.5 s more than the same schedule uncharged."""
    doc = _host_doc(0.5, 0.5, copy_host_s=0.5)
    doc["stages"][0]["storages"] = 4
    chain = chain_from_dict(doc)
    sim = simulate(chain, [Offload(1, 2, 2)])
    assert [(c.direction, c.start, c.end) for c in sim.copies] == [("D2H", 2.5, 3.5), ("H2D", 9.5, 10.5)]
    assert list(sim.end[:2]) == [1.0, 3.0] and sim.makespan_s == 13.5
    assert simulate(chain, []).makespan_s == 12.0  # nothing moved: nothing charged
    doc["platform"].pop("copy_host_s")
    assert simulate(chain_from_dict(doc), [Offload(1, 2, 2)]).makespan_s == 12.0
    res = solve_ilp(chain, int(simulate(chain, [Offload(1, 2, 2)]).peak_bytes), gap=0.0)
    assert res.objective_s == pytest.approx(simulate(chain, res.offloads).makespan_s, rel=1e-9)


def test_where_the_host_runs_the_ops_a_handled_unit_lengthens_them_both_ways():
    """On a CPU the executor's handling of a saved tensor is the ops' own time: with
    ``handle_device_s`` 0.25 s per save, U1's four saves make F1 and B1 1 s longer each when U1
    is offloaded (its D2H starts as the longer F1 ends, at 2), 14 s against 12; charged on the
    host lane instead (``handle_host_s``) the same work hides behind ops that have no host time
    of their own.  The MILP's objective is the replay's, and it chooses to move what costs less."""
    doc = chain_doc(platform={"d2h_bytes_per_s": 100.0, "h2d_bytes_per_s": 100.0, "handle_device_s": 0.25})
    doc["stages"][0]["saves"] = 4
    chain = chain_from_dict(doc)
    sim = simulate(chain, [Offload(1, 2, 2)])
    assert list(sim.end[:2]) == [2.0, 3.0] and sim.copies[0].start == 2.0 and sim.makespan_s == 14.0
    assert simulate(chain, []).makespan_s == 12.0  # nothing handled: nothing charged
    assert simulate(chain, [], recompute=[Recompute(1, 1)]).end[0] == 2.0  # rebuilt: charged alike
    doc["platform"]["handle_host_s"] = doc["platform"].pop("handle_device_s")
    assert simulate(chain_from_dict(doc), [Offload(1, 2, 2)]).makespan_s == 12.0
    budget = int(simulate(chain, [Offload(2, 3, 3)]).peak_bytes)
    res = solve_ilp(chain, budget, gap=0.0, max_run=1)
    chosen = simulate(chain, res.offloads, recompute=res.recompute)
    assert res.objective_s == pytest.approx(chosen.makespan_s, rel=1e-9)
    assert 1 not in {o.stage for o in res.offloads} | {j for r in res.recompute for j in r.stages}


def test_a_handled_unit_costs_the_host_per_saved_tensor_both_ways():
    """``handle_host_s`` (0.5 s) per saved tensor of a unit the executor handles, here U2's two
    rebuilt by a re-run: 1 s more host time in F2 and in B2.  The host, 0.1 s behind the
    device at each op, then issues F2 at 2.8 and B2 at 12.2, and the step ends 1.2 s later
    than uncharged; nothing handled, nothing charged; the MILP's objective is the replay's."""
    doc = _host_doc(0.9, 1.9, handle_host_s=0.5)
    doc["stages"][1]["saves"] = 2
    chain = chain_from_dict(doc)
    sim = simulate(chain, [], recompute=[Recompute(2, 2)])
    assert sim.end[1] == pytest.approx(2.8) and sim.makespan_s == pytest.approx(14.2)
    assert simulate(chain, []).makespan_s == pytest.approx(12.0)
    uncharged = {**doc, "platform": {k: v for k, v in doc["platform"].items() if k != "handle_host_s"}}
    assert simulate(chain_from_dict(uncharged), [], recompute=[Recompute(2, 2)]).makespan_s == pytest.approx(13.0)
    doc["stages"][0]["saves"] = 4  # offloading U1 instead costs F1 and B1 2 s of host time each
    chain = chain_from_dict(doc)
    res = solve_ilp(chain, int(sim.peak_bytes), gap=0.0, max_run=1)
    chosen = simulate(chain, res.offloads, recompute=res.recompute)
    assert res.outcome.proven and (res.offloads or res.recompute)  # something is handled to fit
    assert res.objective_s == pytest.approx(chosen.makespan_s, rel=1e-9)
    assert chosen.makespan_s <= simulate(chain, [], recompute=[Recompute(2, 2)]).makespan_s


@pytest.mark.parametrize("copy_host_s, restore_start, makespan", [(0.0, 3.0, 16.8), (0.5, 4.0, 17.8)])
def test_a_restore_costs_the_host_per_storage_and_starts_when_issued(copy_host_s, restore_start, makespan):
    """U1's held part leaves the device at its release (after F2) and comes back before F4,
    which reads it, on a host that issues each forward in 1 s: charged 0.5 s for U1's one
    storage each way, the D2H starts at 1.5, F3 ends at 3.5, and the restore is issued at
    4.0 (3.5 + its own 0.5), ends at 4.8, where F4 starts."""
    doc = chain_doc(platform={"d2h_bytes_per_s": 100.0, "h2d_bytes_per_s": 100.0, "latency_s": 0.0,
                              "copy_host_s": copy_host_s})
    doc["stages"].append(dict(doc["stages"][-1], name="s5"))
    for st_ in doc["stages"]:
        st_.update(fwd_host_s=1.0, bwd_host_s=0.5)
    doc["stages"][0].update(held_bytes=80, held_until=4, held_saves=[0], held_read_at=4, storages=1)
    sim = simulate(chain_from_dict(doc), [Offload(1, 2, 1, 4)])
    restore = next(c for c in sim.copies if c.held)
    assert (restore.start, restore.end) == pytest.approx((restore_start, restore_start + 0.8))
    assert sim.start[3] == pytest.approx(restore.end)  # F4 waits for it
    assert sim.makespan_s == pytest.approx(makespan)


@pytest.mark.parametrize("kept_storages, d2h_start, makespan", [(0, 2.0, 12.5), (2, 2.5, 12.7)])
def test_an_offloaded_checkpoint_costs_the_host_its_kept_storages_too(kept_storages, d2h_start, makespan):
    """Stage 2 re-run in part, its checkpoint offloaded after F2 (released at F3): the copy
    holds the input's storage and the option's ``kept_storages``, each ``copy_host_s`` (0.5 s)
    on a host issued to 1.0 s after F2; with two kept storages the D2H starts at 2.5, not as F2
    ends at 2.0, ends at 3.2 (70 bytes), and F4 waits for it after the release."""
    doc = chain_doc(platform={"d2h_bytes_per_s": 100.0, "h2d_bytes_per_s": 100.0, "latency_s": 0.0,
                              "copy_host_s": 0.5})
    for st_ in doc["stages"]:
        st_.update(fwd_host_s=0.5, bwd_host_s=0.5)
    doc["stages"][1].update(input_bytes=30, input_own_bytes=30, options=[
        {"name": "matmuls", "kept_bytes": 40, "recompute_s": 0.5, "kept_storages": kept_storages}])
    sim = simulate(chain_from_dict(doc), [], recompute=[Recompute(2, 2, "matmuls", release=3, prefetch=3)])
    d2h = sim.copies[0]
    assert (d2h.direction, d2h.issue, d2h.start) == ("D2H", 2.0, d2h_start)
    assert sim.makespan_s == pytest.approx(makespan)
