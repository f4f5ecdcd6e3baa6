"""Encoded units: what choosing an encoding does to the chain (Gist, Layrub; docs/encodings.md).

Per unit the schedule chooses keep / keep-encoded / offload / offload-encoded.  Choosing
encoding ``e`` of stage ``i`` (covering raw bytes ``P`` of the unit ``A``, of which ``Pout``
are the stage's output, encoded into ``Q`` bytes) means:

* the unit is ``E = A - P + Q`` bytes from then on: what stays resident, and what crosses
  the bus when it is offloaded;
* ``Fi`` runs the encoders after its ops (``+ encode_s``) and holds the encoded copy on top
  of its raw peak, with the codec's workspace ``W`` (``+ Q + W``);
* during ``F(i+1)`` the raw stage output is still alive as that stage's input (``+ Pout``),
  recomputed or not (its ``recomputed_fwd_peak_bytes`` and its options' measured forward
  peaks too), while the raw storages internal to stage ``i`` are already gone (a re-run of
  stage ``i + 1`` in the backward keeps its own bound: ``rerun_peak_bytes``, else its raw
  forward's peak);
* the first backward reader ``B(need_i)`` decodes (``+ decode_s``), and from ``B(need_i)``
  to ``Bi`` the decoded storages live next to the encoded unit, with the workspace
  (``+ P + W``).

Those three are bounds; where the profiler measured what the ops held with the encoding on
(``offload.profiler.encoded_memory``) the measured bytes replace them (``Encoding.
fwd_extra_bytes``, ``next_extra_bytes``, ``bwd_extra``).

Each of these is a change of the stage fields, so a choice of encodings turns a chain into
a plain derived chain (``apply``) on which the simulator, the timing rules and the
heuristics run unchanged; the ILP chooses encodings jointly (``offload.solver.ilp``), and its
objective is checked against the simulator on the derived chain.  The smallest budget with
encodings is a MILP of its own (``offload.solver.encoded_floor``).
"""
from __future__ import annotations

from dataclasses import replace

from .actions import Choice, check_choice
from .chain import Chain, Encoding

MODES = ("none", "lossless", "lossy")
MODE_HELP = ("which encodings the solver may choose: none; lossless (bit-exact gradients, the default); "
             "lossy (also lower precision: gradients change)")


def encoded_bytes(chain: Chain, i: int, e: Encoding) -> int:
    """The unit ``Ui`` once encoded with ``e``."""
    return int(chain.a[i]) - e.covered_bytes + e.encoded_bytes


def allowed(chain: Chain, mode: str = "lossless") -> dict[int, tuple[Encoding, ...]]:
    """Per stage, the encodings ``mode`` lets a solver choose that make the unit smaller
    (any other one only costs time and memory)."""
    if mode not in MODES:
        raise ValueError(f"unknown encoding mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return {}
    out = {}
    for i, s in enumerate(chain.stages, start=1):
        opts = tuple(e for e in s.encodings if (e.lossless or mode == "lossy") and encoded_bytes(chain, i, e) < s.saved_bytes)
        if opts:
            out[i] = opts
    return out


def smallest(chain: Chain, mode: str = "lossless") -> dict[int, str]:
    """Gist's rule: every unit encoded with its smallest allowed encoding (ties: cheaper)."""
    return {i: min(opts, key=lambda e: (encoded_bytes(chain, i, e), e.encode_s + e.decode_s)).name
            for i, opts in allowed(chain, mode).items()}


def lossy_stages(chain: Chain, choice: Choice) -> list[int]:
    return sorted(i for i, name in choice.items() if not chain.stage(i).encoding(name).lossless)


def _add(fields: dict, key: str, seconds: float) -> None:
    """Add ``seconds`` to an op's time ``key``, and to its recorded time where it has one."""
    fields[key] += seconds
    if fields[f"recorded_{key}"] is not None:
        fields[f"recorded_{key}"] += seconds


def apply(chain: Chain, choice: Choice) -> Chain:
    """The plain chain equivalent to ``chain`` with the encodings of ``choice`` (module doc)."""
    if not choice:
        return chain
    check_choice(chain, choice)
    st = [dict(fwd_s=s.fwd_s, bwd_s=s.bwd_s, saved_bytes=s.saved_bytes, fwd_peak_bytes=s.fwd_peak_bytes,
               bwd_peak_bytes=s.bwd_peak_bytes, recorded_fwd_s=s.recorded_fwd_s, recorded_bwd_s=s.recorded_bwd_s)
          for s in chain.stages]
    for i, name in choice.items():
        e = chain.stage(i).encoding(name)
        need = chain.stage(i).need_from
        me = st[i - 1]
        me["saved_bytes"] = encoded_bytes(chain, i, e)
        me["fwd_peak_bytes"] += e.fwd_extra_bytes
        _add(me, "fwd_s", e.encode_s)
        if i < chain.L:  # the raw output, the next stage's input: in its forward, recomputed or not
            st[i]["fwd_peak_bytes"] += e.next_extra_bytes
            after = chain.stage(i + 1)
            if after.recomputed_fwd_peak_bytes is not None:
                st[i]["recomputed_fwd_peak_bytes"] = after.recomputed_fwd_peak_bytes + e.next_extra_bytes
            if after.rerun_peak_bytes is None:  # a re-run in the backward reads no raw storage of U_i: its bound stays
                st[i]["rerun_peak_bytes"] = after.fwd_peak_bytes
            st[i]["options"] = tuple(replace(o, fwd_peak_bytes=None if o.fwd_peak_bytes is None
                                             else o.fwd_peak_bytes + e.next_extra_bytes,
                                             rerun_peak_bytes=after.fwd_peak_bytes if o.rerun_peak_bytes is None
                                             else o.rerun_peak_bytes)
                                     for o in after.options)
            st[i].update(input_prev_bytes=0, input_prev_held_bytes=0)  # a checkpoint shares no storage with an encoded unit
        for j in range(i, need + 1):
            st[j - 1]["bwd_peak_bytes"] += e.bwd_extra(j - i)
        _add(st[need - 1], "bwd_s", e.decode_s)  # a rebuilt stage decodes too
    raw = {"held_saves": (), "held_read_at": 0}  # an encoded unit's held part stays (``actions.check_restores``)
    stages = tuple(replace(s, encodings=(), held_bytes=min(s.held_bytes, fields["saved_bytes"]), **fields,
                           **(raw if i in choice else {}))
                   for i, (s, fields) in enumerate(zip(chain.stages, st), start=1))
    return replace(chain, stages=stages)
