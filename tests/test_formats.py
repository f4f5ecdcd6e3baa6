import json

import pytest

from offload.errors import ChainMismatch, FormatError, ScheduleRejected
from offload.step.actions import Offload
from offload.step.budget import Budget
from offload.step.chainfile import chain_from_dict, load_chain, save_chain
from offload.step.schedule import make_schedule
from offload.step.schedulefile import load_schedule, save_schedule, schedule_from_dict, schedule_to_dict
from offload.step.simulate import simulate
from tests.conftest import chain_doc


def test_chain_round_trip_keeps_hash(four, tmp_path):
    p = tmp_path / "c.json"
    save_chain(four, p)
    again = load_chain(p)
    assert again == four and again.sha256 == four.sha256
    assert again.stage(2).need_from == 2  # default written out


def test_hash_ignores_source_but_not_content():
    a = chain_from_dict(chain_doc())
    b = chain_from_dict(chain_doc(source={"model": "other"}))
    doc = chain_doc()
    doc["stages"][0]["fwd_s"] = 1.5
    assert a.sha256 == b.sha256
    assert a.sha256 != chain_from_dict(doc).sha256


def test_workspace_bytes_round_trip_and_count_in_the_identity_only_when_there():
    plain = chain_from_dict(chain_doc(base_bytes=1000))
    doc = chain_doc(base_bytes=1000, workspace_bytes=300)
    cuda = chain_from_dict(doc)
    assert cuda.workspace_bytes == 300 and chain_from_dict(cuda.document()) == cuda
    assert plain.sha256 == chain_from_dict(chain_doc(base_bytes=1000, workspace_bytes=0)).sha256 != cuda.sha256
    assert "workspace_bytes" not in plain.document()  # chains from before it keep their sha256


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(format="nope"), "format"),
    (lambda d: d["stages"][1].pop("fwd_s"), "stages[2].fwd_s"),
    (lambda d: d["stages"][0].update(bwd_s=-1), "stages[1].bwd_s"),
    (lambda d: d["stages"][0].update(saved_bytes=1.5), "whole number"),
    (lambda d: d["stages"][2].update(fwd_peak_bytes=10), "fwd_peak_bytes"),
    (lambda d: d["stages"][2].update(need_from=2), "need_from"),
    (lambda d: d["stages"][0].update(speed=1), "speed"),
    (lambda d: d["platform"].update(channels="duplex"), "channels"),
    (lambda d: d["platform"].update(d2h_bytes_per_s=0), "d2h_bytes_per_s"),
    (lambda d: d["platform"].update(d2h_bytes_per_s=1e-300), "d2h_bytes_per_s"),
    (lambda d: d["stages"][0].update(fwd_s=1e300), "stages[1].fwd_s"),
    (lambda d: d["stages"][0].update(saved_bytes=2 ** 63 - 1), "stages[1].saved_bytes"),
    (lambda d: d["stages"][0].update(held_bytes=500, held_until=3), "stages[1].held_bytes"),
    (lambda d: d["stages"][0].update(held_bytes=50, held_until=2), "stages[1].held_until"),
    (lambda d: d.update(recipe={"model": "m", "batch": 0}), "recipe.batch"),
    (lambda d: d.update(recipe={"model": "m", "batch": 2, "dtype": "float64"}), "recipe.dtype"),
    (lambda d: d.update(recipe={"model": "m", "batch": 2, "cuts": ["a@b"]}), "recipe.cuts"),
    (lambda d: d["stages"][0].update(encodings=[{"name": "x", "encode_s": 0, "decode_s": 0, "tensors": [
        {"index": 0, "encoder": "zip", "bytes": 10, "encoded_bytes": 5}]}]), "encoder 'zip'"),
    (lambda d: d["stages"][0].update(encodings=[{"name": "x", "encode_s": 0, "decode_s": 0, "tensors": [
        {"index": 0, "encoder": "sparse", "bytes": 10, "encoded_bytes": 10 ** 6}]}]), "far above"),
    (lambda d: d["stages"][0].update(shared_saves=[3, 1]), "distinct indices in increasing order"),
    (lambda d: d["stages"][0].update(shared_saves=[-1]), "shared_saves"),
    (lambda d: d["stages"][0].update(shared_saves=[0], encodings=[{"name": "x", "encode_s": 0, "decode_s": 0, "tensors": [
        {"index": 0, "encoder": "sparse", "bytes": 10, "encoded_bytes": 5}]}]), "encoded and in shared_saves"),
    (lambda d: d["stages"][0].update(dropped_saves=[0], encodings=[{"name": "x", "encode_s": 0, "decode_s": 0, "tensors": [
        {"index": 0, "encoder": "sparse", "bytes": 10, "encoded_bytes": 5}]}]), "encoded and in shared_saves or dropped"),
    (lambda d: d["stages"][0].update(dropped_saves=[2, 2]), "dropped_saves must hold distinct"),
    (lambda d: d["stages"][0].update(shared_saves=[1], dropped_saves=[1]), "in shared_saves and in dropped_saves"),
    (lambda d: d.update(stages=[]), "stages"),
    (lambda d: d.update(base_bytes=100, workspace_bytes=101), "workspace_bytes"),  # a part of the base
    (lambda d: d["stages"][0].update(held_saves=[0], held_read_at=3), "held_read_at needs held_bytes"),
    (lambda d: d["stages"][0].update(held_bytes=50, held_until=3, held_read_at=3), "go together"),
    (lambda d: d["stages"][0].update(held_bytes=50, held_until=3, held_saves=[0], held_read_at=2), "held_read_at"),
    (lambda d: d["stages"][0].update(held_bytes=50, held_until=3, held_saves=[], held_read_at=3), "name the held"),
    (lambda d: d["stages"][0].update(held_bytes=50, held_until=3, held_saves=[1], held_read_at=3, shared_saves=[1]),
     "in held_saves and in shared_saves"),
    (lambda d: d["stages"][0].update(moved_bytes=d["stages"][0]["saved_bytes"] + 1), "moved_bytes' must be in [1, "),
    (lambda d: d["stages"][0].update(moved_bytes=0), "moved_bytes' must be in [1, "),
    # a part of the input that is a storage of the unit before: none for the first stage, no more than that unit
    (lambda d: d["stages"][0].update(input_bytes=40, input_prev_bytes=10), "stages[1].input_prev_bytes' must be in [0, 0]"),
    (lambda d: d["stages"][1].update(input_bytes=400, input_prev_bytes=101), "stages[2].input_prev_bytes' must be in [0, 100]"),
    (lambda d: d["stages"][1].update(input_bytes=40, input_prev_bytes=10, input_prev_held_bytes=5),
     "stages[2].input_prev_held_bytes' must be in [0, 0]"),  # the unit before holds nothing in the model's code
])
def test_malformed_chain_names_the_field(mutate, words):
    doc = chain_doc()
    mutate(doc)
    with pytest.raises(FormatError, match=words.replace("[", r"\[").replace("]", r"\]")):
        chain_from_dict(doc)


def test_shared_saves_round_trip_and_count_in_the_identity_only_when_there():
    doc = chain_doc()
    doc["stages"][1]["shared_saves"] = [0, 4]
    chain = chain_from_dict(doc)
    assert chain.stage(2).shared_saves == (0, 4) and chain_from_dict(chain.document()) == chain
    assert chain.sha256 != chain_from_dict(chain_doc()).sha256
    assert "shared_saves" not in chain_from_dict(chain_doc()).document()["stages"][1]  # older chains keep their sha256


def test_moved_bytes_round_trip_and_time_the_copies_only_when_there():
    """A unit whose copies move less than it frees (a compiled graph's extents): its copies
    are timed by what they move, its memory by the unit."""
    doc = chain_doc()
    doc["stages"][0]["moved_bytes"] = doc["stages"][0]["saved_bytes"] // 2
    chain, plain = chain_from_dict(doc), chain_from_dict(chain_doc())
    assert chain_from_dict(chain.document()) == chain and chain.sha256 != plain.sha256
    assert "moved_bytes" not in plain.document()["stages"][0]  # older chains keep their sha256
    assert chain.d2h_s(1) == plain.platform.d2h_s(doc["stages"][0]["moved_bytes"]) < plain.d2h_s(1)
    sim, before = simulate(chain, [Offload(1, 2, 3)]), simulate(plain, [Offload(1, 2, 3)])
    assert sim.d2h_bytes == doc["stages"][0]["moved_bytes"] and list(sim.memory) == list(before.memory)


def test_held_reads_and_restores_round_trip_and_old_files_read_as_before(four, tmp_path):
    doc = chain_doc()
    doc["stages"][0].update(held_bytes=50, held_until=3, held_saves=[0], held_read_at=4)
    chain = chain_from_dict(doc)
    assert chain.stage(1).held_read_at == 4 and chain.restorable == (1,) and chain_from_dict(chain.document()) == chain
    assert "held_read_at" not in four.document()["stages"][0]  # older chains keep their sha256
    s = make_schedule(chain, [Offload(1, 2, 1, 4), Offload(2, 3, 2)])
    doc = schedule_to_dict(s, chain)
    assert doc["offload"][0]["restore"] == 4 and "restore" not in doc["offload"][1]
    save_schedule(s, chain, tmp_path / "s.json")
    assert load_schedule(tmp_path / "s.json", chain).offloads == s.offloads
    doc["offload"][0]["restore"] = 3  # one forward after the release at 2: nothing off the device
    with pytest.raises(ScheduleRejected, match="restore point 3 not in"):
        schedule_from_dict(doc, chain)
    doc["offload"][0]["restore"] = 4
    with pytest.raises(ScheduleRejected, match="no held_read_at"):
        schedule_from_dict(schedule_to_dict(make_schedule(four, [Offload(1, 2, 1, 4)]), four), four)


def test_byte_counts_that_would_overflow_are_refused():
    doc = chain_doc()
    for st in doc["stages"][:2]:
        st.update(saved_bytes=2 ** 53, fwd_peak_bytes=2 ** 53)
    doc["stages"] = doc["stages"] * 200
    with pytest.raises(FormatError, match="add up to"):
        chain_from_dict(doc)


def test_format_1_files_still_load_for_solving():
    doc = chain_doc(format="offload-chain/1")
    doc["platform"]["channels"] = "shared"
    chain = chain_from_dict(doc)
    assert chain.recipe is None and chain.L == 4


def test_recipe_round_trips_and_is_part_of_the_identity(four):
    recipe = {"model": "resnet18", "batch": 8, "options": {"image": 32}, "dtype": "float32", "seed": 0,
              "optimizer": "adam", "cuts": ["layer1.0", "relu@2", "block@0[1]", "layers.0:in", "layers.1@1:in[2]"],
              "inputs": ["0:float32[8,3,32,32]"]}
    a = chain_from_dict(chain_doc(recipe=recipe))
    assert chain_from_dict(a.document()) == a
    b = chain_from_dict(chain_doc(recipe={**recipe, "batch": 2}))
    assert a.sha256 != b.sha256 != four.sha256


def test_deeply_nested_json_is_refused(write):
    p = write("deep.json", "[" * 100000)
    with pytest.raises(FormatError, match="deeper than"):
        load_chain(p)


def test_not_json_names_file_and_position(write):
    p = write("bad.json", "{ not json")
    with pytest.raises(FormatError, match=r"bad.json.*not valid JSON.*line 1"):
        load_chain(p)


def test_missing_file(tmp_path):
    with pytest.raises(FormatError, match="not found"):
        load_chain(tmp_path / "nowhere.json")


def test_schedule_round_trip_writes_turn(four, tmp_path):
    s = make_schedule(four, [Offload(1, 2, 4), Offload(2, 4, 2)], budget=Budget(300), method="test")
    doc = schedule_to_dict(s, four)
    assert doc["offload"][0]["prefetch"] == "turn" and doc["offload"][1]["release"] == "turn"
    p = tmp_path / "s.json"
    save_schedule(s, four, p)
    again = load_schedule(p, four)
    assert again.offloads == s.offloads and again.budget == Budget(300)


def test_schedule_for_another_chain_is_refused(four):
    other = chain_from_dict(chain_doc(name="other"))
    doc = schedule_to_dict(make_schedule(other, [Offload(1, 2, 1)]), other)
    with pytest.raises(ChainMismatch, match="made for chain 'other'"):
        schedule_from_dict(doc, four)


@pytest.mark.parametrize("offload, words", [
    (Offload(1, 1, 1), "release point 1 not in"),
    (Offload(4, 4, 4), "cannot be offloaded"),
    (Offload(2, 3, 1), "prefetch point 1 not in"),
    (Offload(9, 10, 10), "stages 1..4"),
])
def test_schedule_actions_outside_the_class_are_refused(four, offload, words):
    doc = schedule_to_dict(make_schedule(four, []), four)
    doc["offload"] = [{"stage": offload.stage, "release": offload.release, "prefetch": offload.prefetch}]
    with pytest.raises(ScheduleRejected, match=words):
        schedule_from_dict(doc, four)


def test_schedule_with_bad_fields(four):
    doc = schedule_to_dict(make_schedule(four, []), four)
    doc["offload"] = [{"stage": 1, "release": "soon", "prefetch": 1}]
    with pytest.raises(FormatError, match="release"):
        schedule_from_dict(doc, four)
    doc = json.loads(json.dumps(schedule_to_dict(make_schedule(four, []), four)))
    doc["format"] = "offload-schedule/0"
    with pytest.raises(FormatError, match="not a schedule file"):
        schedule_from_dict(doc, four)
    doc = schedule_to_dict(make_schedule(four, []), four)
    doc["extra"] = 1
    with pytest.raises(FormatError, match="unknown field"):
        schedule_from_dict(doc, four)


def test_to_dict_is_loadable(four):
    assert chain_from_dict(four.document()) == four
