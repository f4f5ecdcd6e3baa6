"""Which weight casts a schedule keeps: the ones it has room for, most time saved per byte first.

Keeping stage ``i``'s weight casts (docs/model.md, "Weight casts") adds ``cast_bytes`` to
every op from ``Fi`` through ``Bi`` (the ops re-run at those ``B``'s included:
``offload.step.memory``) and takes ``recast_s`` off ``Bi``.  With the other actions fixed,
each op's memory is then its memory without the casts plus the kept casts spanning it, and
no op ends later for a shorter op before it, so the makespan never grows: filling the room
left under the budget greedily is sound.  The heuristics finish their schedules with it;
the MILP chooses the casts exactly (``solver.ilp``) and starts from this.
"""
from __future__ import annotations

from typing import Iterable

from offload.step import encoding
from offload.step.actions import Choice, Offload, Recompute
from offload.step.chain import Chain
from offload.step.memory import op_memory


def keep_casts(chain: Chain, budget: int, offloads: Iterable[Offload], encode: Choice | None = None,
               runs: Iterable[Recompute] = ()) -> tuple[int, ...]:
    """The stages whose casts to keep under an activation ``budget``, the other actions given.

    Args:
        chain: the chain the actions are for.
        budget: activation bytes no op may exceed (the actions alone must meet it).
        offloads, encode, runs: the schedule's other actions.

    Returns:
        The stages, ascending: never a recomputed one, nor one whose recast costs nothing.
    """
    runs = tuple(runs)
    L = chain.L
    mem = op_memory(encoding.apply(chain, dict(encode or {})), offloads, runs)
    rebuilt = {i for run in runs for i in run.stages}
    worth = [i for i in chain.castable if i not in rebuilt and chain.rc[i] > 0]
    kept = []
    for i in sorted(worth, key=lambda i: (-chain.rc[i] / chain.cb[i], i)):
        span = slice(i - 1, 2 * L - i + 1)  # Fi .. Bi
        if int(mem[span].max()) + int(chain.cb[i]) <= budget:
            mem[span] += chain.cb[i]
            kept.append(i)
    return tuple(sorted(kept))
