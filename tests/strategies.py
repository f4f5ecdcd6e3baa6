"""Hypothesis strategies: random chains (small integers, so the exact arithmetic is easy to
reason about) and budgets between the smallest feasible one and the no-offload peak."""
from __future__ import annotations

from hypothesis import assume, strategies as st

from offload.solver import encoded_floor
from offload.step.chain import Chain
from offload.step.chainfile import chain_from_dict
from offload.step.memory import no_offload_peak, smallest_feasible_budget


def _encodings(draw, saved: int, reads: int) -> list[dict]:
    """0-2 encodings of part of a unit: one or two storages, any size ratio, either kind; half
    of them with the op memory measured (``reads``: backward ops from the stage's to its
    ``need_from``'s), an op freeing at most the covered bytes."""
    if saved == 0 or draw(st.integers(0, 3)) == 0:
        return []
    out = []
    for n in range(draw(st.integers(1, 2))):
        first = draw(st.integers(1, saved))
        tensors = [{"index": 0, "encoder": "sign-mask", "bytes": first, "encoded_bytes": draw(st.integers(0, first)),
                    "output": draw(st.booleans()), "workspace_bytes": draw(st.sampled_from([0, 0, 5, 20]))}]
        if first < saved and draw(st.booleans()):
            rest = draw(st.integers(1, saved - first))
            tensors.append({"index": 1, "encoder": "sparse", "bytes": rest,
                            "encoded_bytes": draw(st.integers(0, rest + 5)), "output": False})
        out.append({"name": f"enc{n}", "lossless": draw(st.integers(0, 3)) > 0, "encode_s": draw(st.integers(0, 3)) / 1000,
                    "decode_s": draw(st.integers(0, 3)) / 1000, "tensors": tensors})
        if draw(st.booleans()):
            held = st.integers(-sum(t["bytes"] for t in tensors), 30)
            out[-1].update(fwd_held_bytes=draw(held), next_held_bytes=draw(held),
                           bwd_held_bytes=[draw(held) for _ in range(reads)])
    return out


@st.composite
def chains(draw, min_stages: int = 1, max_stages: int = 6, encodings: bool = False, inputs: bool = False,
           casts: bool | None = None) -> Chain:
    """``inputs``: stages carry what recomputation needs: ``input_bytes`` (a checkpoint),
    sometimes ``carry_bytes`` (less than the unit alive in the next forward; of the rest, some
    alive only as it starts) with part of the
    checkpoint in it (and in the held part), part of each alive until the next forward starts
    (``carried_late_bytes``, ``held_late_bytes``), the forward's transient live as it starts,
    another forward transient when recomputed (above the stage's own by up to its input,
    where its code would let go of its input), the gradient live as the backward starts,
    sometimes less of the unit live once rebuilt, sometimes ``recomputable: false``, in half of
    the stages the input's own storage (what an offloaded checkpoint moves), in a quarter each
    their times recorded for a re-run (``recorded_fwd_s``, ``rerun_s``, ``recorded_bwd_s``), and
    in a third of the stages an in-stage option.  ``casts``:
    stages make weight casts (``None``: a third of the chains, some of their stages).
    Without encodings, a quarter of the units' copies move less than the unit frees
    (``moved_bytes``, as a compiled graph's copies move the extent their values span)."""
    L = draw(st.integers(min_stages, max_stages))
    host = draw(st.integers(0, 2)) == 0  # a GPU whose host issues kernels slower than some stages run
    if casts is None:  # autocast: weight casts made again by the backward unless kept
        casts = draw(st.integers(0, 2)) == 0
    stages = []
    for i in range(1, L + 1):
        saved = draw(st.integers(0, 100))
        need = draw(st.integers(i, L)) if draw(st.booleans()) else i
        stages.append({
            "fwd_s": draw(st.integers(1, 10)) / 1000,
            "bwd_s": draw(st.integers(1, 20)) / 1000,
            "saved_bytes": saved,
            "fwd_peak_bytes": saved + draw(st.integers(0, 60)),
            "bwd_peak_bytes": draw(st.integers(0, 60)),
            "need_from": need,
            "kind": draw(st.sampled_from(["conv", "linear", "block"])),
            "encodings": _encodings(draw, saved, need - i + 1) if encodings else [],
            "input_bytes": draw(st.integers(0, 60)) if inputs and i > 1 else 0,
        })
        if saved and not encodings and draw(st.integers(0, 3)) == 0:  # a compiled copy: the extent its values span
            stages[-1]["moved_bytes"] = draw(st.integers(1, saved))
        if casts and draw(st.booleans()):
            stages[-1].update(cast_bytes=draw(st.integers(1, 40)),
                              recast_s=draw(st.integers(0, stages[-1]["bwd_s"] * 1000)) / 1000)
        if host:
            stages[-1].update(fwd_host_s=draw(st.integers(0, 15)) / 1000, bwd_host_s=draw(st.integers(0, 25)) / 1000)
            if saved:  # the storages a copy of the unit issues, each costing the host copy_host_s
                stages[-1]["storages"] = draw(st.integers(1, min(saved, 4)))
                # its saved tensors, each costing the host handle_host_s each way when the unit is handled
                stages[-1]["saves"] = draw(st.integers(stages[-1]["storages"], 6))
            if inputs and draw(st.booleans()):  # the executor's recording and re-run, measured
                stages[-1].update(recording_host_s=draw(st.integers(0, 5)) / 1000,
                                  rerun_host_s=draw(st.integers(0, 20)) / 1000)
        if saved and i + 2 <= L and draw(st.integers(0, 3)) == 0:  # part held by the model's own code
            stages[-1].update(held_bytes=draw(st.integers(1, saved)), held_until=draw(st.integers(i + 2, L)))
            if draw(st.booleans()):  # of it, what the model's code lets go only as F(held_until+1) starts
                stages[-1]["held_late_bytes"] = draw(st.integers(0, stages[-1]["held_bytes"]))
            if draw(st.booleans()):  # read again by a later forward: it may leave the device until then
                until = stages[-1]["held_until"]
                stages[-1].update(held_saves=[0], held_read_at=draw(st.integers(i + 2, min(until + 1, L))))
        if inputs:
            st_ = stages[-1]
            st_["bwd_start_bytes"] = draw(st.integers(0, st_["bwd_peak_bytes"]))
            st_["fwd_start_bytes"] = draw(st.integers(0, st_["fwd_peak_bytes"]))
            if draw(st.booleans()):
                st_["recomputed_fwd_peak_bytes"] = draw(st.integers(0, st_["fwd_peak_bytes"] + st_["input_bytes"]))
            if draw(st.booleans()):  # its whole re-run, measured by replaying it
                st_["rerun_peak_bytes"] = draw(st.integers(0, st_["fwd_peak_bytes"]))
            if draw(st.integers(0, 3)) == 0:  # a compiled backward's rebuild keeps less of the unit live
                st_["rebuilt_bytes"] = draw(st.integers(0, saved))
        if inputs and draw(st.integers(0, 2)) == 0:
            st_ = stages[-1]
            st_["carry_bytes"] = draw(st.integers(0, saved))
            if draw(st.booleans()):  # of the rest, what the model's code lets go as F(i+1) starts
                st_["carried_early_bytes"] = draw(st.integers(0, saved - st_["carry_bytes"]))
            st_["input_carried_bytes"] = draw(st.integers(0, min(st_["carry_bytes"], st_["input_bytes"])))
            if "held_bytes" in st_:
                st_["input_held_bytes"] = draw(st.integers(0, min(st_["input_carried_bytes"], st_["held_bytes"])))
                st_["input_held_late_bytes"] = draw(st.integers(0, min(st_["input_held_bytes"],
                                                                      st_.get("held_late_bytes", 0))))
            if i + 2 <= L and draw(st.booleans()):  # of it, what the model's code lets go only as F(i+2) starts
                late = draw(st.integers(0, max(0, st_["carry_bytes"] - st_.get("held_bytes", 0))))
                st_.update(carried_late_bytes=late,
                           input_late_bytes=draw(st.integers(0, min(late, st_["input_carried_bytes"]))))
        st_ = stages[-1]
        if inputs and st_["input_bytes"] and draw(st.booleans()):
            st_["input_own_bytes"] = draw(st.integers(1, st_["input_bytes"]))  # its checkpoint may move
        if inputs and st_["input_bytes"] and stages[-2:-1] and draw(st.integers(0, 2)) == 0:  # the unit before holds it too
            st_["input_prev_bytes"] = draw(st.integers(0, min(stages[-2]["saved_bytes"],
                                                              st_["input_bytes"] - st_.get("input_carried_bytes", 0))))
            st_["input_prev_held_bytes"] = draw(st.integers(0, min(st_["input_prev_bytes"],
                                                                   stages[-2].get("held_bytes", 0))))
        if inputs and stages[-1]["input_bytes"] and draw(st.integers(0, 3)) == 0:  # read by its re-run alone
            stages[-1]["rerun_held_bytes"] = draw(st.integers(1, stages[-1]["input_bytes"]))
        if inputs and draw(st.integers(0, 4)) == 0:
            stages[-1]["recomputable"] = False
        elif inputs and draw(st.integers(0, 5)) == 0:  # its re-run can only end a run
            stages[-1]["rerun_output"] = False
        if inputs:  # recorded for a re-run, measured so: the recording's and the replay's work, other kernels
            st_ = stages[-1]
            for key, least in (("recorded_fwd_s", st_["fwd_s"]), ("rerun_s", 0.0), ("recorded_bwd_s", st_["bwd_s"])):
                if draw(st.integers(0, 3)) == 0:
                    st_[key] = least + draw(st.integers(0, 12)) / 1000
        if inputs and draw(st.integers(0, 2)) == 0:  # an in-stage option: part kept, the rest re-run
            st_ = stages[-1]
            recorded, rerun = st_.get("recorded_fwd_s", st_["fwd_s"]), st_.get("rerun_s", st_["fwd_s"])
            st_["options"] = [{"name": "matmuls", "kept_bytes": draw(st.integers(0, saved)),
                               "recompute_s": draw(st.integers(0, round(rerun * 1000))) / 1000}]
            if host:  # the storages an offloaded checkpoint copies besides its input, each costing the host
                st_["options"][0]["kept_storages"] = draw(st.integers(0, min(3, st_["options"][0]["kept_bytes"])))
            if draw(st.booleans()):  # measured: its forward and re-run transients
                st_["options"][0].update(fwd_peak_bytes=draw(st.integers(0, st_["fwd_peak_bytes"] + saved)),
                                         rerun_peak_bytes=draw(st.integers(0, st_["fwd_peak_bytes"])),
                                         fwd_s=recorded + draw(st.integers(0, 3)) / 1000)
    return chain_from_dict({
        "format": "offload-chain/2",
        "name": "random",
        "platform": {
            "d2h_bytes_per_s": draw(st.sampled_from([4e3, 1e4, 3e4, 1e5])),
            "h2d_bytes_per_s": draw(st.sampled_from([4e3, 1e4, 3e4, 1e5])),
            "latency_s": draw(st.sampled_from([0.0, 1e-4])),
            **({"copy_host_s": draw(st.sampled_from([0.0, 1e-3, 4e-3])),
                "handle_host_s": draw(st.sampled_from([0.0, 5e-4, 2e-3])),
                # the same works on a host that runs the ops (a CPU): charged to them
                "copy_device_s": draw(st.sampled_from([0.0, 0.0, 1e-3, 4e-3])),
                "handle_device_s": draw(st.sampled_from([0.0, 0.0, 5e-4, 2e-3]))} if host else {}),
        },
        "base_bytes": draw(st.integers(0, 1000)),
        "stages": stages,
    })


@st.composite
def chain_and_budget(draw, min_stages: int = 1, max_stages: int = 6, encodings: bool = False,
                     mode: str = "lossless", inputs: bool = False, below: bool = False,
                     casts: bool | None = None) -> tuple[Chain, int]:
    """A chain and a budget from the smallest feasible one (with ``mode``'s encodings) to
    the no-offload peak with every weight cast kept; ``below``: under the offloading floor,
    from the lower bound with recomputation."""
    chain = draw(chains(min_stages, max_stages, encodings, inputs, casts))
    lo, hi = encoded_floor.floor(chain, mode)[0], no_offload_peak(chain) + int(chain.cb.sum())
    if below:  # where only recomputation may fit (if anything does)
        lo, hi = smallest_feasible_budget(chain, recompute=True), lo - 1
        assume(lo <= hi)
    return chain, draw(st.integers(lo, max(lo, hi)))
