"""The smallest budget a method meets, found by bisection on its solves.

Offloading's floor has a closed form (``memory.smallest_feasible_budget``: every unit
offloaded at once, fetched on demand).  With recomputation it has none: a recomputation's
checkpoint and re-run forward add memory where it saves some, so only a lower bound is
cheap, and the exact floor is the least budget at which the joint MILP finds a schedule.
"""
from __future__ import annotations

from offload.errors import InfeasibleBudget
from offload.step.chain import Chain
from offload.step.memory import no_offload_peak, smallest_feasible_budget

from .encoded_floor import floor
from .methods import Options, solve


def bisect_budget(chain: Chain, method: str, options: Options, below: int, met: int, resolution: int) -> int:
    """The smallest budget in ``(below, met]``, to ``resolution`` bytes, at which ``method`` finds
    a schedule, given that it finds none at ``below`` and one at ``met`` (a method that may run
    out of time before finding one makes the result an upper bound)."""
    while met - below > resolution:
        mid = (below + met) // 2
        try:
            solve(chain, mid, method, options)
            met = mid
        except InfeasibleBudget:
            below = mid
    return met


def joint_floor(chain: Chain, time_limit_s: float = 10.0, resolution: float = 0.005, met: int | None = None,
                encodings: str = Options.encodings) -> int:
    """The smallest activation budget at which the joint MILP (``ilp --recompute``, choosing
    among ``encodings``) finds a schedule, bisected to ``resolution`` of the no-offload peak
    between the joint lower bound and ``met``, a budget known to be met (default: offloading's
    floor, which offloading alone meets); an upper bound where a solve runs out of
    ``time_limit_s`` before finding one."""
    options = Options(time_limit_s=time_limit_s, heuristic_time_s=min(1.0, time_limit_s / 4), recompute=True,
                      encodings=encodings)
    low = floor(chain, options.encodings, recompute=True)[0]
    met = smallest_feasible_budget(chain) if met is None else met
    step = max(1, int(resolution * no_offload_peak(chain)))
    return bisect_budget(chain, "ilp", options, low - 1, met, step)
