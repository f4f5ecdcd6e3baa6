"""What happens at each point of a step, in order: the one reading of a schedule (docs/model.md).

A training step runs ``F1 .. FL`` then ``BL .. B1`` on the compute stream; the schedule's
actions (``actions``) happen between them.  ``step_events`` lists all of it in the order it
happens, by these rules:

* ``Fi`` runs (``FORWARD``), ends by encoding its unit when the schedule stores it encoded
  (``ENCODE``: the encoders run at the end of ``Fi``), then issues the D2H copy of its unit
  when it is offloaded (``D2H``), or of its checkpoint when a recomputed run of that one
  stage offloads it (``D2H`` of the run: the run's events carry it, ``stage`` its stage, and
  its checkpoint takes the place of the unit in every rule below but the ``WAIT``);
* then each unit whose release point is ``i`` is released (``RELEASE``, in stage order: the
  next op waits for its D2H copy, then the unit is freed); the releases at ``L`` ("turn")
  come before ``BL``; then those of them that restore their held part take it off the
  device (``EVICT``, stage order: the storages the model's own code still holds);
* before ``Fj``: the held parts whose restore point is ``j`` are copied back into their
  storages (``RESTORE``, an H2D copy, stage order), then ``Fj`` waits for the copies of the
  held parts it is the next to read (``RESTORED``, those whose ``held_read_at`` is ``j``);
* before ``Bk``, ``k < L``: the device copies of ``U(k+1)`` are dropped (``FREE``: its
  moved, encoded or rebuilt storages, read for the last time by ``B(k+1)``);
* then the prefetches whose point is ``k`` are issued (``H2D``) in ``prefetch_key`` order:
  the unit needed latest first (larger ``need_from``), ties the larger stage;
* then the recomputed runs due at ``Bk`` re-run their forward ops (``RECOMPUTE``, later runs
  first: ``recompute.by_op``), each after waiting for the H2D copy of its checkpoint when it
  offloads it (``WAIT`` of the run);
* then ``Bk`` waits for the H2D copies of the units it is the first to read (``WAIT``, those
  whose ``need_from`` is ``k``, in stage order) and decodes the encoded units it is the first
  to read (``DECODE``), and runs (``BACKWARD``).

The simulator replays this list with times (``simulate``), the executor runs it at the
stage boundaries of the user's module (``offload.executor.plan``), the timeline draws it
(``offload.analysis.timeline``), and the ILP orders its H2D slots by ``prefetch_key``, the
order in which this list issues prefetches.  Memory is not an event: it depends only on
the actions (``memory``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping

from .actions import Offload, Recompute
from .chain import Chain
from .recompute import by_op

FORWARD, BACKWARD = "forward", "backward"  # an op's compute
ENCODE, D2H, RELEASE, EVICT = "encode", "d2h", "release", "evict"
RESTORE, RESTORED = "restore", "restored"  # a held part's H2D copy before a forward, and that forward's wait for it
FREE, H2D, RECOMPUTE, WAIT, DECODE = "free", "h2d", "recompute", "wait", "decode"
CLOSING = frozenset({RELEASE, FREE})  # the backward boundary's events that end the op before it


@dataclass(frozen=True)
class Event:
    """One thing that happens in a step: an op's compute (``stage``: the op's), an action on
    a unit (``stage``: the unit's), a run's recomputation (``run``; ``stage``: its first), or
    an action on a run's offloaded checkpoint (``run``; ``stage``: its stage)."""

    kind: str
    stage: int
    run: Recompute | None = None
    encoding: str | None = None  # ENCODE, DECODE: the encoding's name


def prefetch_key(chain: Chain, i: int) -> tuple[int, int]:
    """Where unit ``i`` comes in the H2D order of one prefetch point: the unit needed latest
    first (larger ``need_from``), ties the larger stage."""
    return -int(chain.need[i]), -i


def prefetch_order(chain: Chain, units: Iterable[int]) -> list[int]:
    """``units`` in the order the H2D copies of one point are issued (``prefetch_key``)."""
    return sorted(units, key=lambda i: prefetch_key(chain, i))


@dataclass(frozen=True)
class StepEvents:
    """The events of one step in execution order; ``before(o)`` are those between the compute
    of op ``o - 1`` and that of op ``o`` (ops in execution order: ``Fj`` is ``j - 1``, ``Bj``
    is ``2L - j``; ``before(2L)``: after ``B1``)."""

    L: int
    sequence: tuple[Event, ...]

    @cached_property
    def _between(self) -> tuple[tuple[Event, ...], ...]:
        points: list[list[Event]] = [[]]
        for e in self.sequence:
            if e.kind in (FORWARD, BACKWARD):
                points.append([])
            else:
                points[-1].append(e)
        return tuple(tuple(p) for p in points)

    def before(self, o: int) -> tuple[Event, ...]:
        return self._between[o]

    def after_forward(self, k: int) -> tuple[Event, ...]:
        """At the end of ``Fk``, ``k < L``: before ``F(k+1)``."""
        return self.before(k)

    def before_backward(self, k: int) -> tuple[Event, ...]:
        """At the start of ``Bk`` (for ``k = L``, right after ``FL``)."""
        return self.before(2 * self.L - k)

    def of(self, *kinds: str) -> list[Event]:
        """The events of these kinds, in order."""
        return [e for e in self.sequence if e.kind in kinds]


def step_events(chain: Chain, offloads: Iterable[Offload], runs: Iterable[Recompute] = (),
                encode: Mapping[int, str] | None = None) -> StepEvents:
    """The events of one step of ``chain`` under these actions (checked elsewhere: ``simulate``
    and the file formats refuse actions outside the class)."""
    L = chain.L
    encode = dict(encode or {})
    offloads = sorted(offloads)
    rebuilt = by_op(chain, runs)
    moved = {o.stage for o in offloads}
    held = moved | set(encode) | {i for at in rebuilt.values() for r in at for i in r.stages}
    copied = {r.first: r for at in rebuilt.values() for r in at if r.moves}  # stage -> run offloading its checkpoint
    released: dict[int, list[Event]] = {}
    fetched: dict[int, list[Event]] = {}
    waited: dict[int, list[int]] = {}
    decoded: dict[int, list[int]] = {}
    restored: dict[int, list[Event]] = {}  # forward j -> the held parts copied back before it, and then waited for
    for o in offloads:
        released.setdefault(o.release, []).append(Event(RELEASE, o.stage))
        fetched.setdefault(o.prefetch, []).append(Event(H2D, o.stage))
        waited.setdefault(int(chain.need[o.stage]), []).append(o.stage)
        if o.restore:
            released[o.release].append(Event(EVICT, o.stage))
            restored.setdefault(o.restore, []).append(Event(RESTORE, o.stage))
            restored.setdefault(int(chain.held_read[o.stage]), []).append(Event(RESTORED, o.stage))
    for i, r in copied.items():
        released.setdefault(r.release, []).append(Event(RELEASE, i, run=r))
        fetched.setdefault(r.prefetch, []).append(Event(H2D, i, run=r))
    for i in sorted(encode):
        decoded.setdefault(int(chain.need[i]), []).append(i)
    seq: list[Event] = []
    by_kind = {RELEASE: 0, EVICT: 1, RESTORE: 0, RESTORED: 1}  # at one boundary: every release before an eviction
    for j in range(1, L + 1):
        seq += sorted(restored.get(j, ()), key=lambda e: (by_kind[e.kind], e.stage))
        seq.append(Event(FORWARD, j))
        if j in encode:
            seq.append(Event(ENCODE, j, encoding=encode[j]))
        if j in moved or j in copied:
            seq.append(Event(D2H, j, run=copied.get(j)))
        if j < L:
            seq += sorted(released.get(j, ()), key=lambda e: (by_kind[e.kind], e.stage))
    for k in range(L, 0, -1):
        if k == L:
            seq += sorted(released.get(L, ()), key=lambda e: e.stage)
        elif k + 1 in held:
            seq.append(Event(FREE, k + 1))
        seq += sorted(fetched.get(k, ()), key=lambda e: prefetch_key(chain, e.stage))
        for r in rebuilt.get(k, ()):
            if r.moves:
                seq.append(Event(WAIT, r.first, run=r))
            seq.append(Event(RECOMPUTE, r.first, run=r))
        seq += [Event(WAIT, i) for i in waited.get(k, ())]
        seq += [Event(DECODE, i, encoding=encode[i]) for i in decoded.get(k, ())]
        seq.append(Event(BACKWARD, k))
    return StepEvents(L, tuple(seq))
