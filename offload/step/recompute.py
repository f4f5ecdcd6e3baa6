"""Recomputed runs (docs/model.md, "Recomputation"): where each one runs and what it costs.

A run ``s..e`` is rebuilt at the start of ``Bn``, ``n`` the latest ``need_from`` among its
units (the first backward op that reads one of them), after the prefetches issued there
and before ``Bn`` waits for its copies: ``Fs .. Fe`` re-run one after another on the
compute stream.  Runs rebuilt at the same op go later stages first.
"""
from __future__ import annotations

from typing import Iterable

from .actions import Recompute
from .chain import Chain


def run_op(chain: Chain, run: Recompute) -> int:
    """The stage ``n`` whose backward op ``Bn`` starts by rebuilding ``run``."""
    return max(int(chain.need[j]) for j in run.stages)


def run_seconds(chain: Chain, run: Recompute) -> float:
    """Compute time of rebuilding ``run``: its forward ops again."""
    return float(sum(chain.f[j] for j in run.stages))


def by_op(chain: Chain, runs: Iterable[Recompute]) -> dict[int, list[Recompute]]:
    """Per stage ``n``, the runs rebuilt at the start of ``Bn``, in execution order."""
    out: dict[int, list[Recompute]] = {}
    for run in sorted(runs, key=lambda r: -r.first):
        out.setdefault(run_op(chain, run), []).append(run)
    return out
