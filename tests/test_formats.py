import json

import pytest

from solver.chain import chain_from_dict, load_chain, save_chain, to_dict
from solver.errors import ChainMismatch, FormatError, ScheduleRejected
from solver.schedule import Offload, load_schedule, make_schedule, save_schedule, schedule_from_dict, schedule_to_dict
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


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(format="nope"), "format"),
    (lambda d: d["stages"][1].pop("fwd_s"), "stages[2].fwd_s"),
    (lambda d: d["stages"][0].update(bwd_s=-1), "stages[1].bwd_s"),
    (lambda d: d["stages"][0].update(saved_bytes=1.5), "whole number"),
    (lambda d: d["stages"][2].update(fwd_peak_bytes=10), "fwd_peak_bytes"),
    (lambda d: d["stages"][2].update(need_from=2), "need_from"),
    (lambda d: d["stages"][0].update(speed=1), "speed"),
    (lambda d: d["platform"].update(channels="triplex"), "channels"),
    (lambda d: d["platform"].update(d2h_bytes_per_s=0), "d2h_bytes_per_s"),
    (lambda d: d.update(stages=[]), "stages"),
])
def test_malformed_chain_names_the_field(mutate, words):
    doc = chain_doc()
    mutate(doc)
    with pytest.raises(FormatError, match=words.replace("[", r"\[").replace("]", r"\]")):
        chain_from_dict(doc)


def test_not_json_names_file_and_position(write):
    p = write("bad.json", "{ not json")
    with pytest.raises(FormatError, match=r"bad.json.*not valid JSON.*line 1"):
        load_chain(p)


def test_missing_file(tmp_path):
    with pytest.raises(FormatError, match="not found"):
        load_chain(tmp_path / "nowhere.json")


def test_schedule_round_trip_writes_turn(four, tmp_path):
    s = make_schedule(four, [Offload(1, 2, 4), Offload(2, 4, 2)], budget_bytes=300, method="test")
    doc = schedule_to_dict(s, four)
    assert doc["offload"][0]["prefetch"] == "turn" and doc["offload"][1]["release"] == "turn"
    p = tmp_path / "s.json"
    save_schedule(s, four, p)
    again = load_schedule(p, four)
    assert again.offloads == s.offloads and again.budget_bytes == 300


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


def test_to_dict_is_loadable(four):
    assert chain_from_dict(to_dict(four)) == four
