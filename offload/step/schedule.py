"""Schedules (docs/model.md): a chain's actions (``offload.step.actions``) bound to that chain by
its name and sha256, with the budget they were solved for, the method and what it
predicted.  The file format is ``schedulefile``; what happens when, in a step, is
``events``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .actions import Offload, Recompute
from .budget import Budget
from .chain import Chain
from .simulate import Simulation, simulate


@dataclass(frozen=True)
class Schedule:
    """A schedule bound to one chain (by name and sha256)."""

    chain_name: str
    chain_sha256: str
    offloads: tuple[Offload, ...]
    budget: Budget | None = None
    method: str = ""
    solver: Mapping[str, Any] = field(default_factory=dict)
    predicted: Mapping[str, Any] = field(default_factory=dict)
    encode: Mapping[int, str] = field(default_factory=dict)  # stage -> encoding name
    recompute: tuple[Recompute, ...] = ()
    casts_kept: tuple[int, ...] = ()  # stages whose weight casts are kept (docs/model.md, "Weight casts")

    def simulate(self, chain: Chain, budget: Budget | int | None = None) -> Simulation:
        """This schedule replayed on ``chain`` (refused over ``budget``, if given)."""
        return simulate(chain, self.offloads, budget, encode=self.encode, recompute=self.recompute,
                        casts_kept=self.casts_kept)


def make_schedule(chain: Chain, offloads: Iterable[Offload], recompute: Iterable[Recompute] = (),
                  casts_kept: Iterable[int] = (), **meta: Any) -> Schedule:
    """A schedule for ``chain`` (sorted by stage), with optional metadata fields."""
    return Schedule(chain.name, chain.sha256, tuple(sorted(offloads)), recompute=tuple(sorted(recompute)),
                    casts_kept=tuple(sorted(casts_kept)), **meta)
