"""Activation memory per op (docs/model.md, "Schedules"), and the two reference peaks.

Ops are indexed ``0..2L-1`` in execution order: ``Fj`` is ``j-1``, ``Bj`` is ``2L-j``.
During ``Fj`` the resident units of earlier stages count plus ``fwd_peak_bytes`` of ``Fj``
(which includes ``Uj``); during ``Bj`` the resident units of stages ``<= j`` count plus
``bwd_peak_bytes``.  Memory depends only on the schedule's decisions, never on timing,
which is what lets the ILP separate memory from time.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .chain import Chain
from .schedule import Offload


def op_name(chain: Chain, o: int) -> str:
    L = chain.L
    return f"F{o + 1}" if o < L else f"B{2 * L - o}"


def _transient(chain: Chain) -> np.ndarray:
    return np.concatenate([chain.fp[1:], chain.bp[1:][::-1]])


def op_memory(chain: Chain, offloads: Iterable[Offload]) -> np.ndarray:
    """Activation bytes held during each op (int64 array of length ``2L``)."""
    L = chain.L
    diff = np.zeros(2 * L + 1, dtype=np.int64)
    kept = np.ones(L + 1, dtype=bool)
    kept[0] = False
    for o in offloads:
        i, a = o.stage, chain.a[o.stage]
        kept[i] = False
        diff[i] += a  # F_{i+1} .. F_r
        diff[o.release] -= a
        if chain.held_until[i] > o.release:  # the part the model's code holds: F_{r+1} .. F_held_until
            diff[o.release] += chain.held[i]
            diff[chain.held_until[i]] -= chain.held[i]
        diff[2 * L - o.prefetch] += a  # B_k .. B_i
        diff[2 * L - i + 1] -= a
    idx = np.nonzero(kept)[0]
    np.add.at(diff, idx, chain.a[idx])  # kept: F_{i+1} .. B_i
    np.add.at(diff, 2 * L - idx + 1, -chain.a[idx])
    return np.cumsum(diff[:-1]) + _transient(chain)


def floor_savings(chain: Chain, i: int) -> list[tuple[int, int, int]]:
    """``(first op, stop op, bytes)``: what offloading unit ``i`` at once (released at ``i+1``,
    fetched on demand) saves against keeping it, per run of ops (execution order); the part
    the model's own code holds is saved only from ``F(held_until + 1)``."""
    first, stop, a = i + 1, 2 * chain.L - int(chain.need[i]), int(chain.a[i])
    until = int(chain.held_until[i])
    if until > i + 1:
        return [(first, min(until, stop), a - int(chain.held[i])), (min(until, stop), stop, a)]
    return [(first, stop, a)]


def floor_offloads(chain: Chain) -> list[Offload]:
    """Every offloadable unit, released at once (``r = i+1``), fetched on demand.

    It holds the least memory at every op simultaneously, so its peak is the smallest
    budget any schedule of the class can meet."""
    return [Offload(i, i + 1, int(chain.need[i])) for i in chain.offloadable]


def no_offload_peak(chain: Chain) -> int:
    """Activation peak when nothing is offloaded."""
    return int(op_memory(chain, ()).max())


def smallest_feasible_budget(chain: Chain) -> int:
    """Smallest activation budget met by any schedule of the class."""
    return int(op_memory(chain, floor_offloads(chain)).max())
