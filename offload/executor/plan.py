"""A schedule as the runtime reads it: the step's events (``offload.step.events``), and what
the runtime needs to know of the units they act on.

The runtime runs ``events.after_forward(k)`` at the end of ``Fk`` (``k < L``) and
``events.before_backward(k)`` at the start of ``Bk``: the same list, in the same order,
that the simulator replays.  ``encoders`` says, for each encoded unit, which of its
storages (by their index in first-save order) are stored with which encoder;
``unit_bytes`` what each stage saved when profiled; ``casts_kept`` the stages whose weight
casts are saved as autograd saves them (the others' are made again: ``offload.core.casts``);
``evicted`` which storages of a unit that restores its held part leave the device at its
release (its ``held_saves``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from offload.step.chain import Chain, EncodedTensor
from offload.step.encoding import encoded_bytes
from offload.step.events import D2H, ENCODE, EVICT, RECOMPUTE, StepEvents, step_events
from offload.step.recompute import moved_checkpoint_bytes
from offload.step.schedule import Schedule


@dataclass(frozen=True)
class StepPlan:
    events: StepEvents
    planned_bytes: int  # all offloaded units' and checkpoints' bytes, encoded ones as encoded (the host arena's size)
    encoders: dict[int, dict[int, EncodedTensor]]  # encoded unit -> storage index -> its encoding, as profiled
    unit_bytes: tuple[int, ...]  # per stage 0..L, the bytes its unit saves, as profiled
    casts_kept: frozenset[int] = frozenset()
    staying: dict[int, tuple[int, ...]] = field(default_factory=dict)  # stage -> its saves in no unit (``Stage.staying``)
    evicted: dict[int, frozenset[int]] = field(default_factory=dict)  # restoring unit -> its held storages' indices

    @property
    def L(self) -> int:
        return self.events.L

    @cached_property
    def offloaded(self) -> frozenset[int]:
        """Stages whose units are copied to the host and back."""
        return frozenset(e.stage for e in self.events.of(D2H) if e.run is None)

    @cached_property
    def recomputed(self) -> frozenset[int]:
        """Stages whose units are dropped and rebuilt."""
        return frozenset(i for e in self.events.of(RECOMPUTE) for i in e.run.stages)

    @cached_property
    def in_part(self) -> dict[int, str]:
        """Recomputed stages re-run in part, each with its in-stage option (which ops' outputs it keeps)."""
        return {e.stage: e.run.option for e in self.events.of(RECOMPUTE) if e.run.option}

    @cached_property
    def run_starts(self) -> frozenset[int]:
        """The first stage of each recomputed run (its input is the run's checkpoint)."""
        return frozenset(e.stage for e in self.events.of(RECOMPUTE))

    @classmethod
    def from_schedule(cls, chain: Chain, schedule: Schedule) -> "StepPlan":
        events = step_events(chain, schedule.offloads, schedule.recompute, schedule.encode)
        chosen = {e.stage: chain.stage(e.stage).encoding(e.encoding) for e in events.of(ENCODE)}
        moved = [e.stage for e in events.of(D2H) if e.run is None]
        checkpoints = [e.run for e in events.of(D2H) if e.run is not None]
        return cls(
            events=events,
            planned_bytes=sum(encoded_bytes(chain, i, chosen[i]) if i in chosen else chain.stage(i).saved_bytes
                              for i in moved) + sum(moved_checkpoint_bytes(chain, r) for r in checkpoints),
            encoders={i: {t.index: t for t in e.tensors} for i, e in chosen.items()},
            unit_bytes=tuple(int(a) for a in chain.a),
            casts_kept=frozenset(schedule.casts_kept),
            staying={k: s.staying for k, s in enumerate(chain.stages, 1) if s.staying},
            evicted={e.stage: frozenset(chain.stage(e.stage).held_saves) for e in events.of(EVICT)},
        )
