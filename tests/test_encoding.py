"""Encoded units: the model, the joint ILP, the heuristics and the formats."""
import copy
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import FormatError, InfeasibleBudget, ScheduleRejected
from offload.solver import encoded_floor
from offload.solver.ilp import Model, solve_ilp
from offload.solver.methods import METHODS, RECOMPUTING, RETIMED, Options, solve
from offload.step import encoding
from offload.step.actions import Offload, Recompute
from offload.step.chainfile import chain_from_dict
from offload.step.memory import floor_offloads, no_offload_peak, op_memory, smallest_feasible_budget
from offload.step.schedulefile import load_schedule, save_schedule
from offload.step.simulate import simulate
from tests.brute import kept_casts
from tests.conftest import assert_loads_exactly, chain_doc
from tests.strategies import chain_and_budget
from tests.test_solver_properties import FIXED_POLICIES, REL, SETTINGS

EXACT = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02)
LOSSY = Options(gap=0.0, time_limit_s=60, heuristic_time_s=0.02, encodings="lossy")


def mask(nbytes=80, encoded=10, output=False, lossless=True, name="mask", enc_s=0.5, dec_s=0.25):
    return {"name": name, "lossless": lossless, "encode_s": enc_s, "decode_s": dec_s,
            "tensors": [{"index": 0, "encoder": "sign-mask", "bytes": nbytes, "encoded_bytes": encoded, "output": output}]}


@pytest.fixture
def encoded_four():
    """``four`` (conftest) where stage 2 offers a lossless encoding of 80 of its 100 bytes
    into 10 (an internal storage), and stage 3 a lossy one."""
    doc = chain_doc()
    doc["stages"][1]["encodings"] = [mask()]
    doc["stages"][2]["encodings"] = [mask(nbytes=100, encoded=50, lossless=False, name="bf16")]
    return chain_from_dict(doc)


def test_derived_chain_follows_the_model(encoded_four):
    c = encoded_four
    d = encoding.apply(c, {2: "mask"})
    s1, s2, s3 = d.stage(1), d.stage(2), d.stage(3)
    assert s2.saved_bytes == 100 - 80 + 10  # what stays resident and what moves
    assert s2.fwd_peak_bytes == 150 + 10  # raw and encoded copy live together in F2 (no workspace here)
    assert s3.fwd_peak_bytes == 150  # internal storage: nothing raw left in F3
    assert s2.bwd_peak_bytes == 50 + 80  # decoded storages next to the encoded unit in B2
    assert s2.fwd_s == 1.5 and s2.bwd_s == 2.25
    assert s1 == c.stage(1) and d.stage(4) == c.stage(4)
    out = chain_from_dict({**chain_doc(), "stages": [dict(st, encodings=[mask(output=True)]) if n == 1 else st
                                                     for n, st in enumerate(chain_doc()["stages"])]})
    assert encoding.apply(out, {2: "mask"}).stage(3).fwd_peak_bytes == 150 + 80  # the raw output is F3's input


def test_the_raw_output_of_an_encoded_unit_counts_in_the_next_forward_recomputed_too():
    """Stage 3 recomputed after stage 2's output was encoded: ``F3`` still reads the raw
    output, so its recomputed transient (and an option's measured one) holds it too, as the
    MILP's row does.  The derived chain counted it only in ``fwd_peak_bytes``, and the
    simulator booked ``F3`` 80 B low."""
    stages = [dict(st, input_bytes=30, recomputed_fwd_peak_bytes=120) for st in chain_doc()["stages"]]
    stages[1]["encodings"] = [mask(output=True)]
    stages[2]["options"] = [{"name": "half", "kept_bytes": 40, "recompute_s": 0.5, "fwd_peak_bytes": 140,
                             "rerun_peak_bytes": 100, "fwd_s": 1.0}]
    derived = encoding.apply(chain_from_dict({**chain_doc(), "stages": stages}), {2: "mask"})
    s3 = derived.stage(3)
    assert (s3.fwd_peak_bytes, s3.recomputed_fwd_peak_bytes, s3.options[0].fwd_peak_bytes) == (230, 200, 220)
    assert op_memory(derived, [], [Recompute(3, 3)])[2] - op_memory(derived, [])[2] == 200 - 230  # F3 keeps no U3


def test_keep_encoded_lowers_memory_between_the_raw_windows(encoded_four):
    plain = op_memory(encoded_four, [])
    enc = simulate(encoded_four, [], encode={2: "mask"}).memory
    # F2 holds the encoded copy too (+Q), F3..B3 only the encoded unit (E - A), B2 decodes (+Q)
    assert list(enc - plain) == [0, 10, -70, -70, -70, -70, 10, 0]


def test_lossy_encodings_only_with_the_flag(encoded_four):
    assert set(encoding.allowed(encoded_four)) == {2}
    assert set(encoding.allowed(encoded_four, "lossy")) == {2, 3}
    assert encoding.allowed(encoded_four, "none") == {}
    budget = no_offload_peak(encoded_four) - 100
    lossless = solve(encoded_four, budget, "ilp", EXACT)
    assert 3 not in lossless.schedule.encode and not lossless.schedule.predicted["lossy"]
    gist = solve(encoded_four, no_offload_peak(encoded_four) - 60, "gist", LOSSY)
    assert gist.schedule.encode == {2: "mask", 3: "bf16"} and gist.schedule.predicted["lossy"]


def test_measured_op_memory_replaces_the_bound(encoded_four):
    """What the profiler measured an encoded unit's ops to hold (``encoded_memory``) is what the
    derived chain adds, op by op, in place of the bound; it survives the chain file."""
    doc = encoded_four.document()
    doc["stages"][1]["encodings"][0].update(fwd_held_bytes=-30, next_held_bytes=5, bwd_held_bytes=[-70])
    measured = chain_from_dict(doc)
    assert chain_from_dict(measured.document()) == measured and measured.sha256 != encoded_four.sha256
    bound, exact = encoding.apply(encoded_four, {2: "mask"}), encoding.apply(measured, {2: "mask"})
    assert exact.stage(2).fwd_peak_bytes == bound.stage(2).fwd_peak_bytes - 10 - 30  # the blob of 10 B was the bound
    assert exact.stage(3).fwd_peak_bytes == bound.stage(3).fwd_peak_bytes + 5
    assert exact.stage(2).bwd_peak_bytes == bound.stage(2).bwd_peak_bytes - 80 - 70


def test_old_chains_keep_their_hash_and_files(four):
    assert "encodings" not in four.document()["stages"][0]
    doc = chain_doc()
    doc["stages"][1]["encodings"] = []
    assert chain_from_dict(doc).sha256 == four.sha256


@pytest.mark.parametrize("mutate, message", [
    (lambda e: e["tensors"][0].update(bytes=101), "more than the unit's saved_bytes"),
    (lambda e: e.update(tensors=[]), "non-empty list"),
    (lambda e: e["tensors"][0].update(index=-1), "index.* must be in"),
    (lambda e: e.update(lossless="yes"), "must be true or false"),
    (lambda e: e.update(encode_s=-1), r"encode_s. must be in \[0"),
    (lambda e: e.update(colour=1), "unknown field"),
    (lambda e: e.update(fwd_held_bytes=-101), r"fwd_held_bytes. must be in \[-100,"),
    (lambda e: e.update(bwd_held_bytes=[0, 0]), "one value per backward op from this stage's to its need_from's"),
    (lambda e: e.update(bwd_held_bytes=[0.5]), "must be a whole number"),
])
def test_bad_encodings_are_refused_with_the_field(mutate, message):
    doc = chain_doc()
    e = mask(nbytes=100)
    mutate(e)
    doc["stages"][0]["encodings"] = [e]
    with pytest.raises(FormatError, match=message):
        chain_from_dict(doc)


@pytest.mark.parametrize("option, message", [
    ({"name": "matmuls", "kept_bytes": 101, "recompute_s": 0.5}, r"kept_bytes. must be in \[0, 100\]"),
    ({"name": "matmuls", "kept_bytes": 40, "recompute_s": 1.5}, r"recompute_s \(1.5\) > the stage's fwd_s \(1.0\)"),
    ({"name": "matmuls", "kept_bytes": 40}, "recompute_s"),
])
def test_bad_in_stage_options_are_refused_with_the_field(option, message):
    doc = chain_doc()
    doc["stages"][1]["options"] = [option]
    with pytest.raises(FormatError, match=message):
        chain_from_dict(doc)
    doc["stages"][1]["options"] = [{"name": "matmuls", "kept_bytes": 40, "recompute_s": 0.5}] * 2
    with pytest.raises(FormatError, match="used twice"):
        chain_from_dict(doc)


def test_schedule_file_keeps_encodings_and_refuses_unknown_ones(encoded_four, tmp_path):
    res = solve(encoded_four, no_offload_peak(encoded_four) - 60, "gist", EXACT)
    path = tmp_path / "s.json"
    save_schedule(res.schedule, encoded_four, path)
    assert load_schedule(path, encoded_four).encode == {2: "mask"}
    text = path.read_text().replace('"mask"', '"nope"')
    path.write_text(text)
    with pytest.raises(ScheduleRejected, match="stage 2 has no encoding 'nope'"):
        load_schedule(path, encoded_four)


def brute_force(chain, budget, mode):
    """Best makespan over encodings x offloads x kept casts, by enumeration."""
    opts = encoding.allowed(chain, mode)

    def offloads(i):
        yield None
        if i in chain.offloadable:
            for r in range(i + 1, chain.L + 1):
                for k in range(int(chain.need[i]), chain.L + 1):
                    yield Offload(i, r, k)
    best = None
    choices = [[None] + [e.name for e in opts.get(i, ())] for i in range(1, chain.L + 1)]
    for choice in itertools.product(*choices):
        enc = {i: n for i, n in enumerate(choice, start=1) if n}
        for combo in itertools.product(*[list(offloads(i)) for i in chain.offloadable]):
            for kept in kept_casts(chain, set()):
                sim = simulate(chain, [o for o in combo if o], encode=enc, casts_kept=kept)
                if sim.peak_bytes <= budget and (best is None or sim.makespan_s < best):
                    best = sim.makespan_s
    return best


@settings(max_examples=30, **SETTINGS)
@given(chain_and_budget(max_stages=3, encodings=True, mode="lossy"))
def test_ilp_equals_brute_force_with_encodings(cb):
    chain, budget = cb
    res = solve(chain, budget, "ilp", LOSSY)
    assert res.simulation.makespan_s == pytest.approx(brute_force(chain, budget, "lossy"), rel=REL)


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=6, encodings=True))
def test_ilp_objective_is_the_simulated_makespan_with_encodings(cb):
    chain, budget = cb
    res = solve_ilp(chain, budget, gap=0.0, options=encoding.allowed(chain))
    assert res.outcome.proven
    sim = simulate(chain, res.offloads, encode=res.encode, casts_kept=res.casts_kept)
    assert sim.peak_bytes <= budget + 1  # solver tolerance; methods.solve tightens it away
    assert res.objective_s == pytest.approx(sim.makespan_s, rel=1e-6)


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=6, encodings=True, mode="lossy"))
def test_warm_start_is_the_least_solution_with_encodings(cb):
    chain, budget = cb
    planned = solve(chain, budget, "relax-bw", LOSSY).schedule
    model = Model(chain, budget, options=encoding.allowed(chain, "lossy"))
    assert_loads_exactly(model, planned.offloads, planned.encode)


@settings(max_examples=20, **SETTINGS)
@given(chain_and_budget(max_stages=6, encodings=True))
def test_every_method_with_encodings_replays_within_budget_and_ilp_is_best(cb):
    chain, budget = cb
    ilp = solve(chain, budget, "ilp", EXACT)
    assert chain.ideal_makespan_s <= ilp.simulation.makespan_s * (1 + REL)
    for name in METHODS.keys() - RECOMPUTING - RETIMED:  # a larger class: tests/test_recompute.py; the ILP again: below
        try:
            res = solve(chain, budget, name, EXACT)
        except InfeasibleBudget as exc:  # fixed policies, and plain ones below the plain floor
            assert name in FIXED_POLICIES or (name not in {"ilp", "relax-lp", "relax-bw"}
                                              and budget < smallest_feasible_budget(chain)), (name, exc)
            continue
        s = res.schedule
        assert not encoding.lossy_stages(chain, s.encode)
        replay = s.simulate(chain, budget)
        assert s.predicted["makespan_s"] == replay.makespan_s
        assert s.predicted["peak_bytes"] == replay.peak_bytes <= budget
        assert ilp.simulation.makespan_s <= replay.makespan_s * (1 + REL), name


@settings(max_examples=15, **SETTINGS)
@given(chain_and_budget(max_stages=6, encodings=True))
def test_encodings_never_hurt_the_optimum(cb):
    chain, budget = cb
    if budget < smallest_feasible_budget(chain):
        return  # only feasible with encodings
    plain = solve(chain, budget, "ilp", Options(gap=0.0, heuristic_time_s=0.02, encodings="none")).simulation.makespan_s
    assert solve(chain, budget, "ilp", EXACT).simulation.makespan_s <= plain * (1 + REL)


@settings(max_examples=40, **SETTINGS)
@given(chain_and_budget(max_stages=5, encodings=True))
def test_encoded_floor_is_the_least_floor_peak(cb):
    chain, _ = cb
    value, choice = encoded_floor.floor(chain)
    opts = encoding.allowed(chain)
    best = min(
        int(op_memory(d, floor_offloads(d)).max())
        for combo in itertools.product(*[[None] + [e.name for e in opts[i]] for i in opts])
        for d in [encoding.apply(chain, {i: n for i, n in zip(opts, combo) if n})]
    ) if opts else smallest_feasible_budget(chain)
    assert value == best <= smallest_feasible_budget(chain)
    derived = encoding.apply(chain, choice)
    assert int(op_memory(derived, floor_offloads(derived)).max()) == value
    solve(chain, value, "relax-lp", EXACT)  # feasible exactly from the floor


def test_budget_below_the_encoded_floor_is_refused(encoded_four):
    value, _ = encoded_floor.floor(encoded_four)
    with pytest.raises(InfeasibleBudget) as err:
        solve(encoded_four, value - 1, "ilp", EXACT)
    assert err.value.smallest_bytes == value


def test_chain_copy_with_encodings_round_trips(encoded_four):
    doc = encoded_four.document()
    again = chain_from_dict(copy.deepcopy(doc))
    assert again == encoded_four and again.sha256 == encoded_four.sha256


def test_codec_workspace_counts_where_the_codec_runs():
    doc = chain_doc()
    e = mask()
    e["tensors"][0]["workspace_bytes"] = 7
    doc["stages"][1]["encodings"] = [e]
    d = encoding.apply(chain_from_dict(doc), {2: "mask"})
    assert d.stage(2).fwd_peak_bytes == 150 + 10 + 7  # the encoder runs in F2
    assert d.stage(2).bwd_peak_bytes == 50 + 80 + 7  # the decoder in B2
    assert d.stage(3).fwd_peak_bytes == 150 and d.stage(3).bwd_peak_bytes == 50


@settings(max_examples=60, **SETTINGS)
@given(chain_and_budget(max_stages=6, encodings=True), st.data())
def test_every_schedule_satisfies_every_row_of_the_model(cb, data):
    """Any schedule at all (random units, release and prefetch points, encodings) loaded as
    its least solution meets every time row and valid cut of the MILP, memory aside (a
    budget nothing exceeds): no row cuts off a real schedule, so none can cut off the optimum."""
    chain, _ = cb
    opts = encoding.allowed(chain, "lossy")
    encode = {i: data.draw(st.sampled_from([e.name for e in es])) for i, es in opts.items() if data.draw(st.booleans())}
    offloads = [Offload(i, data.draw(st.integers(i + 1, chain.L)), data.draw(st.integers(int(chain.need[i]), chain.L)))
                for i in chain.offloadable if data.draw(st.booleans())]
    model = Model(chain, 10 * no_offload_peak(chain) + 10**6, options=opts)
    assert_loads_exactly(model, offloads, encode)


def test_a_start_that_highs_presolve_misreads_is_solved_again():
    """HiGHS 1.16, started from the warm start (nothing offloaded, 10 ms) with presolve on,
    declared it optimal with a dual bound far below it; the best schedule offloads U1 and
    keeps its casts (9 ms).  pulp_backend solves such a contradictory claim again."""
    sign = {"lossless": False, "encode_s": 0.0, "decode_s": 0.0,
            "tensors": [{"index": 0, "encoder": "sign-mask", "bytes": 1, "encoded_bytes": 0}]}
    chain = chain_from_dict({"format": "offload-chain/2", "name": "misread",
                             "platform": {"d2h_bytes_per_s": 1e5, "h2d_bytes_per_s": 1e5}, "stages": [
        {"fwd_s": .001, "bwd_s": .001, "saved_bytes": 81, "fwd_peak_bytes": 81, "bwd_peak_bytes": 0,
         "encodings": [{"name": "enc0", **sign}, {"name": "enc1", **sign}], "cast_bytes": 7, "recast_s": .001},
        {"fwd_s": .001, "bwd_s": .005, "saved_bytes": 69, "fwd_peak_bytes": 69, "bwd_peak_bytes": 0},
        {"fwd_s": .001, "bwd_s": .001, "saved_bytes": 1, "fwd_peak_bytes": 1, "bwd_peak_bytes": 49}]})
    res = solve(chain, 202, "ilp", LOSSY)
    assert res.status == "optimal" and res.simulation.makespan_s == pytest.approx(0.009)
    assert res.simulation.makespan_s == pytest.approx(brute_force(chain, 202, "lossy"))


def test_a_peak_above_its_prediction_within_what_sparse_blobs_may_vary_says_so(encoded_four):
    """A ``sparse`` blob's size follows the data, so a step may hold a little more than the
    profiled blob: the report allows an eighth of each (``blob_slack_bytes``) and says so when
    an excess is within it; fixed-size encoders allow nothing."""
    from offload.executor.report import Report
    from offload.step.schedule import make_schedule

    doc = encoded_four.document()
    doc["stages"][1]["encodings"].append({**mask(name="sparse"), "tensors": [
        {"index": 0, "encoder": "sparse", "bytes": 80, "encoded_bytes": 40}]})
    chain = chain_from_dict(doc)
    for name, slack in (("mask", 0), ("sparse", 5)):
        report = Report.start(chain, make_schedule(chain, [], encode={2: name}), "cpu-eager", "cpu")
        assert report.predicted.blob_slack_bytes == slack
        for over in (1, 6):
            report.measured.activation_peak_bytes = report.predicted.activation_peak_bytes + over
            with pytest.warns(UserWarning, match="above the predicted"):
                report.judge_peak()
            assert ("sparse: its size follows the data" in report.over_prediction) == (over <= slack), (name, over)
