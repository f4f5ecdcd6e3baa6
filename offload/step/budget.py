"""A memory budget and what it covers.

Users think in GPU memory ("my card has 24 GiB"); the model thinks in activation memory
(the chain's constant ``base_bytes``, weights, gradients and optimizer state, is there
either way).  A ``Budget`` is the number of bytes with its scope, and the one place that
converts between the two, so that no caller re-derives it: ``of`` makes one from a bare
number, ``counted`` says what of a step's memory counts against it, ``excess`` by how much
a step goes over it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from offload.io.text import format_bytes, parse_budget

from .chain import Chain
from .memory import no_offload_peak

SCOPES = ("activations", "total")

Bytes = TypeVar("Bytes")  # an int, or a numpy array of them (per op)


@dataclass(frozen=True)
class Budget:
    """``nbytes`` for the activations alone (``scope="activations"``), or for everything the
    step keeps on the GPU (``"total"``: the chain's ``base_bytes`` too)."""

    nbytes: int
    scope: str = "activations"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"budget scope must be one of {SCOPES}, got {self.scope!r}")

    @property
    def total(self) -> bool:
        return self.scope == "total"

    def base(self, chain: Chain) -> int:
        """What the budget counts besides activations: ``base_bytes`` for a total budget, else 0."""
        return chain.base_bytes if self.total else 0

    def activations(self, chain: Chain) -> int:
        """The bytes left for activations."""
        return self.nbytes - self.base(chain)

    def counted(self, chain: Chain, activation_bytes: Bytes) -> Bytes:
        """What counts against this budget when a step holds ``activation_bytes`` of activations
        (a number, or an array per op): those, plus ``base_bytes`` for a total budget."""
        return activation_bytes + self.base(chain)

    def excess(self, chain: Chain, activation_bytes: Bytes) -> Bytes:
        """By how many bytes ``activation_bytes`` of activations go over this budget (at most 0:
        within it)."""
        return self.counted(chain, activation_bytes) - self.nbytes

    @classmethod
    def of(cls, budget: "Budget | int") -> "Budget":
        """``budget`` as a ``Budget``: a bare number is bytes of activations."""
        return budget if isinstance(budget, Budget) else cls(int(budget))

    def __str__(self) -> str:
        return f"{format_bytes(self.nbytes)} ({self.scope})"

    @classmethod
    def parse(cls, text: str, chain: Chain, total: bool = False) -> "Budget":
        """``6GiB``, ``4000000000`` or ``60%`` (of the no-offload peak, plus ``base_bytes`` when
        ``total``), as a budget of that scope for ``chain``."""
        scope = "total" if total else "activations"
        reference = no_offload_peak(chain) + (chain.base_bytes if total else 0)
        return cls(parse_budget(text, reference), scope)
