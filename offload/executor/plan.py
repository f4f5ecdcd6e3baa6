"""A schedule as the runtime reads it: what to do at each stage boundary.

Boundary ``k`` in the forward (the end of ``Fk``; ``k = L`` is the model's output) issues
the D2H of ``Uk`` and performs the releases due at ``k``.  Boundary ``k`` in the backward
(the start of ``Bk``) frees the prefetched ``U(k+1)``, issues the prefetches whose point is
``k`` (larger ``need_from`` first, then larger stage: docs/model.md) and waits for the
units whose ``need_from`` is ``k``; between the two it rebuilds the recomputed runs due at
``k`` (later runs first).  ``encoders`` says, for each encoded unit, which of its storages
(by their index in first-save order) are stored with which encoder.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from offload.step.actions import Recompute
from offload.step.chain import Chain, EncodedTensor
from offload.step.encoding import encoded_bytes
from offload.step.recompute import by_op
from offload.step.schedule import Schedule


@dataclass(frozen=True)
class StepPlan:
    L: int
    offloaded: frozenset[int]
    release_at: dict[int, tuple[int, ...]]
    prefetch_at: dict[int, tuple[int, ...]]
    wait_at: dict[int, tuple[int, ...]]
    planned_bytes: int  # all offloaded units' bytes, encoded ones as encoded (the host arena's size)
    encoders: dict[int, dict[int, EncodedTensor]]  # encoded unit -> storage index -> its encoding, as profiled
    unit_bytes: tuple[int, ...]  # per stage 0..L, the bytes its unit saves, as profiled
    rebuild_at: dict[int, tuple[Recompute, ...]] = field(default_factory=dict)  # k -> runs rebuilt as B_k starts

    @cached_property
    def recomputed(self) -> frozenset[int]:
        """Stages whose units are dropped and rebuilt."""
        return frozenset(i for runs in self.rebuild_at.values() for r in runs for i in r.stages)

    @cached_property
    def run_starts(self) -> frozenset[int]:
        """The first stage of each recomputed run (its input is the run's checkpoint)."""
        return frozenset(r.first for runs in self.rebuild_at.values() for r in runs)

    @classmethod
    def from_schedule(cls, chain: Chain, schedule: Schedule) -> "StepPlan":
        release: dict[int, list[int]] = {}
        prefetch: dict[int, list[int]] = {}
        wait: dict[int, list[int]] = {}
        for o in schedule.offloads:
            release.setdefault(o.release, []).append(o.stage)
            prefetch.setdefault(o.prefetch, []).append(o.stage)
            wait.setdefault(chain.stage(o.stage).need_from, []).append(o.stage)
        need = {o.stage: chain.stage(o.stage).need_from for o in schedule.offloads}
        chosen = {i: chain.stage(i).encoding(name) for i, name in schedule.encode.items()}
        size = {i: encoded_bytes(chain, i, chosen[i]) if i in chosen else chain.stage(i).saved_bytes for i in need}
        return cls(
            L=chain.L,
            offloaded=frozenset(need),
            release_at={k: tuple(sorted(v)) for k, v in release.items()},
            prefetch_at={k: tuple(sorted(v, key=lambda i: (-need[i], -i))) for k, v in prefetch.items()},
            wait_at={k: tuple(sorted(v)) for k, v in wait.items()},
            planned_bytes=sum(size.values()),
            encoders={i: {t.index: t for t in e.tensors} for i, e in chosen.items()},
            unit_bytes=tuple(int(a) for a in chain.a),
            rebuild_at={k: tuple(runs) for k, runs in by_op(chain, schedule.recompute).items()},
        )
