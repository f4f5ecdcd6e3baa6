"""A schedule as the runtime reads it: what to do at each stage boundary.

Boundary ``k`` in the forward (the end of ``Fk``; ``k = L`` is the model's output) issues
the D2H of ``Uk`` and performs the releases due at ``k``.  Boundary ``k`` in the backward
(the start of ``Bk``) frees the prefetched ``U(k+1)``, issues the prefetches whose point is
``k`` (larger ``need_from`` first, then larger stage: DESIGN's order) and waits for the
units whose ``need_from`` is ``k``.
"""
from __future__ import annotations

from dataclasses import dataclass

from solver.chain import Chain
from solver.schedule import Schedule


@dataclass(frozen=True)
class StepPlan:
    L: int
    offloaded: frozenset[int]
    release_at: dict[int, tuple[int, ...]]
    prefetch_at: dict[int, tuple[int, ...]]
    wait_at: dict[int, tuple[int, ...]]
    planned_bytes: int  # all offloaded units' bytes (the host arena's size)

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
        return cls(
            L=chain.L,
            offloaded=frozenset(need),
            release_at={k: tuple(sorted(v)) for k, v in release.items()},
            prefetch_at={k: tuple(sorted(v, key=lambda i: (-need[i], -i))) for k, v in prefetch.items()},
            wait_at={k: tuple(sorted(v)) for k, v in wait.items()},
            planned_bytes=sum(chain.stage(i).saved_bytes for i in need),
        )
