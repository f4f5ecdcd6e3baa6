"""What a schedule may do to a unit (docs/model.md, "Schedules"): the actions and the rules of
the class.

Per offloaded unit ``Ui``, an ``Offload``: a release point ``r`` (``i < r <= L``: at the end
of ``Fr`` the next op waits for the D2H copy, then ``Ui`` is freed) and a prefetch point
``k`` (``need_from <= k <= L``: the H2D copy is issued at the start of ``Bk``); per
recomputed *run* of stages ``s..e`` (``e < L``), a ``Recompute``: their units are dropped at
the end of the next forward op and rebuilt by re-running ``Fs..Fe`` from ``Fs``'s input at
the start of ``B(max need_from)``; a run of one stage may re-run it *in part*, keeping what
its in-stage option keeps (``Recompute.option``, docs/model.md, "In-stage options"), and
may offload its checkpoint (``Recompute.release``/``prefetch``: copied after ``Fs``, freed
at the end of ``F(release)``, copied back from the start of ``B(prefetch)``; "Offloaded
checkpoints"); a ``Choice`` names, per encoded unit (kept or
offloaded), the stage's encoding it uses; the stages whose weight casts are *kept* (saved
as autograd would, not made again by ``Bi``) are a set of their own (``check_casts``).
``check_*`` refuse what lies outside the class, naming the unit and the rule.  When each
of these happens in a step is ``offload.step.events``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from offload.errors import ScheduleRejected

from .chain import Chain

Choice = Mapping[int, str]  # stage -> name of the encoding its unit uses


@dataclass(frozen=True, order=True)
class Offload:
    """One offloaded unit: its stage, release point and prefetch point (1-based), and where
    its held part comes back (``restore > 0``: the part the model's own code holds leaves the
    device at the release too, and an H2D copy issued at the start of ``F(restore)`` brings
    it back for its next forward reader, ``held_read_at``; docs/model.md, "Held parts")."""

    stage: int
    release: int
    prefetch: int
    restore: int = 0  # 0: the held part stays on the device until the model's code drops it


@dataclass(frozen=True, order=True)
class Recompute:
    """A run of recomputed stages ``first..last`` (1-based, ``last < L``), rebuilt together
    from ``first``'s input (its *checkpoint*, kept on the device until then).  With an
    ``option`` (one of the stage's ``StageOption`` names; runs of one stage only) the stage
    is re-run in part: the option's kept outputs join the checkpoint and the re-run serves
    them instead of computing them again.  With ``release`` (> 0) a run of one stage offloads
    its checkpoint: the D2H copy is issued as ``Fs`` ends, the checkpoint freed at the end of
    ``F(release)``, copied back from the start of ``B(prefetch)``, and the rebuild waits for
    that copy."""

    first: int
    last: int
    option: str = ""
    release: int = 0  # 0: the checkpoint stays on the device
    prefetch: int = 0

    @property
    def moves(self) -> bool:
        """Whether the run offloads its checkpoint."""
        return self.release > 0

    def kept_on_device(self) -> "Recompute":
        """The same run with its checkpoint kept on the device."""
        return Recompute(self.first, self.last, self.option)

    @property
    def stages(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def text(self) -> str:
        """``3`` for a run of one stage, ``3..5`` otherwise, ``3:matmuls`` for an in-stage option;
        ``3 (checkpoint offloaded F4->B3)`` when the checkpoint is offloaded (released at the end
        of ``F4``, fetched from the start of ``B3``)."""
        text = f"{self.first}:{self.option}" if self.option else (
            f"{self.first}..{self.last}" if self.last > self.first else str(self.first))
        return f"{text} (checkpoint offloaded F{self.release}->B{self.prefetch})" if self.moves else text


def check_recompute(chain: Chain, runs: Iterable[Recompute], offloads: Iterable[Offload] = (),
                    encode: Mapping[int, str] | None = None) -> None:
    """Refuse recomputed runs outside the class: stages ``1..L-1``, no stage in two runs,
    none also offloaded or encoded."""
    L = chain.L
    taken = {o.stage: "offloaded" for o in offloads}
    taken.update({i: "encoded" for i in (encode or {})})
    for run in runs:
        if run.first > run.last:
            raise ScheduleRejected(f"recomputed run {run.first}..{run.last}: its first stage comes after its last",
                                   f"write it {run.last}..{run.first}")
        if not 1 <= run.first <= run.last < L:
            raise ScheduleRejected(f"recomputed run {run.first}..{run.last}: runs lie within stages 1..{L - 1} "
                                   f"(stage {L}'s backward runs right after its forward)")
        if run.option:
            _check_option(chain, run)
        if run.moves or run.prefetch:
            _check_moved_checkpoint(chain, run)
        for i in run.stages:
            if i not in chain.recomputable:
                raise ScheduleRejected(f"stage {i} ({chain.stage(i).name}) is recomputed, but the profiler found that "
                                       "the executor cannot re-run its forward (its chain stage says recomputable: "
                                       "false; docs/executor.md, \"Recomputation\")")
            if i < run.last and not chain.stage(i).rerun_output:
                raise ScheduleRejected(f"stage {i} ({chain.stage(i).name}) is recomputed within run {run.first}.."
                                       f"{run.last}, but its re-run does not rebuild its output (its chain stage says "
                                       "rerun_output: false): it can only end a run")
            if i in taken:
                raise ScheduleRejected(f"stage {i} is in two recomputed runs" if taken[i] == "recomputed" else
                                       f"stage {i} is recomputed and {taken[i]}: a unit has one fate")
            taken[i] = "recomputed"


def _check_option(chain: Chain, run: Recompute) -> None:
    """An in-stage option re-runs one stage, and one the stage offers."""
    if run.last != run.first:
        raise ScheduleRejected(f"recomputed run {run.first}..{run.last} with option {run.option!r}: an in-stage option "
                               "re-runs one stage", "give the option to a run of one stage")
    try:
        chain.stage(run.first).option(run.option)
    except KeyError:
        offered = ", ".join(o.name for o in chain.stage(run.first).options) or "none"
        raise ScheduleRejected(f"stage {run.first} has no in-stage option {run.option!r} (it offers: {offered})") from None


def first_checkpoint_release(chain: Chain, run: Recompute) -> int:
    """The earliest release point of ``run``'s offloaded checkpoint: the end of the next
    forward (the model's code still holds the input as it starts: ``input_carried_bytes``),
    or, where the model's code holds part of the input longer (``input_held_bytes``), the
    last forward that holds it (``held_until``): an earlier release would free nothing."""
    s = run.first
    return max(s + 1, int(chain.held_until[s])) if chain.xh[s] else s + 1


def checkpoint_moves(chain: Chain, run: Recompute) -> bool:
    """Whether ``run`` may offload its checkpoint: a run of one stage that saves something (its
    copies take its unit's place) and whose input's own storage the profile knows
    (``input_own_bytes``; what it moves: ``recompute.moved_checkpoint_bytes``)."""
    s = run.first
    return run.last == s and bool(chain.xo[s]) and s in chain.offloadable


def _check_moved_checkpoint(chain: Chain, run: Recompute) -> None:
    """An offloaded checkpoint belongs to a run whose checkpoint can move, with a release point
    after its forward and a prefetch point no earlier than its rebuild (at ``B(need_from)``:
    the run has one stage)."""
    s, L = run.first, chain.L
    if not checkpoint_moves(chain, run):
        why = ("a run of several stages keeps its checkpoint on the device" if run.last > s else
               "its chain stage has no input_own_bytes (profile it again)" if not chain.xo[s] else
               "the stage saves nothing (its copies would take its unit's place)")
        raise ScheduleRejected(f"recomputed run {run.text} offloads its checkpoint, but it cannot: {why}")
    first = first_checkpoint_release(chain, run)
    if not first <= run.release <= L:
        held = f" (the model's code holds its input through F{first})" if first > s + 1 else ""
        raise ScheduleRejected(f"recomputed run {run.text}: checkpoint release point {run.release} not in "
                               f"[{first}, {L}]{held}")
    n = int(chain.need[s])
    if not n <= run.prefetch <= L:
        raise ScheduleRejected(f"recomputed run {run.text}: checkpoint prefetch point {run.prefetch} not in [{n}, {L}] "
                               f"(it is rebuilt at B{n})")


def check_offloads(chain: Chain, offloads: Iterable[Offload]) -> None:
    """Refuse actions outside the schedule class, naming the unit and the rule it breaks."""
    seen: set[int] = set()
    L = chain.L
    for o in offloads:
        i = o.stage
        if not 1 <= i <= L:
            raise ScheduleRejected(f"offload of stage {i}: the chain has stages 1..{L}")
        if i in seen:
            raise ScheduleRejected(f"stage {i} is offloaded twice")
        seen.add(i)
        if i == L:
            raise ScheduleRejected(f"stage {L} cannot be offloaded: its backward runs right after its forward "
                                   "(a release point r > i must exist)")
        if not i < o.release <= L:
            raise ScheduleRejected(f"stage {i}: release point {o.release} not in [{i + 1}, {L}]")
        need = chain.stage(i).need_from
        if not need <= o.prefetch <= L:
            raise ScheduleRejected(f"stage {i}: prefetch point {o.prefetch} not in [{need}, {L}] (need_from={need})")
        if o.restore:
            _check_restore(chain, o)


def _check_restore(chain: Chain, o: Offload) -> None:
    """A held part leaves the device only where its chain stage says who reads it next, and comes
    back after at least one forward without it, no later than that reader."""
    i, at = o.stage, int(chain.held_read[o.stage])
    if not at:
        raise ScheduleRejected(f"stage {i} restores its held part, but its chain stage names no later forward that "
                               "reads it (no held_read_at): the held part stays on the device",
                               "solve again, or profile the model again to measure held_read_at")
    if not o.release + 2 <= o.restore <= at:
        raise ScheduleRejected(f"stage {i}: restore point {o.restore} not in [{o.release + 2}, {at}] (two forwards "
                               f"after its release at {o.release}, at most its reader F{at})")


def check_restores(offloads: Iterable[Offload], runs: Iterable[Recompute], encode: Mapping[int, str]) -> None:
    """A unit whose held part leaves the device is stored raw (its copies are the held storages
    themselves), and the stage after it is not recomputed (a re-run of it may read the held part)."""
    rebuilt = {i for run in runs for i in run.stages}
    for o in offloads:
        if o.restore and o.stage in encode:
            raise ScheduleRejected(f"stage {o.stage} restores its held part and is stored encoded: a held part leaves "
                                   "the device raw")
        if o.restore and o.stage + 1 in rebuilt:
            raise ScheduleRejected(f"stage {o.stage} restores its held part, but stage {o.stage + 1} is recomputed: "
                                   "its re-run may read the held part while it is off the device")


def check_choice(chain: Chain, choice: Choice) -> None:
    """Refuse a choice naming a stage or an encoding the chain does not have."""
    for i, name in choice.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= chain.L:
            raise ScheduleRejected(f"encoding of stage {i!r}: the chain has stages 1..{chain.L}")
        try:
            chain.stage(i).encoding(name)
        except KeyError:
            offered = ", ".join(e.name for e in chain.stage(i).encodings) or "none"
            raise ScheduleRejected(f"stage {i} has no encoding {name!r} (it offers: {offered})") from None


def check_casts(chain: Chain, kept: Iterable[int], runs: Iterable[Recompute] = ()) -> None:
    """Refuse kept weight casts outside the class: a stage that makes none, or one that is
    recomputed (its re-run forward makes them again, kept or not)."""
    rebuilt = {i for run in runs for i in run.stages}
    for i in kept:
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= chain.L:
            raise ScheduleRejected(f"kept casts of stage {i!r}: the chain has stages 1..{chain.L}")
        if i not in chain.castable:
            raise ScheduleRejected(f"stage {i} ({chain.stage(i).name}) keeps its weight casts, but it makes none "
                                   "(its chain stage has no cast_bytes)")
        if i in rebuilt:
            raise ScheduleRejected(f"stage {i} keeps its weight casts and is recomputed: the recomputation makes them "
                                   "again")
