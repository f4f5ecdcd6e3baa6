"""The literature's policies, each adapted to the chain model (docs/model.md, "Heuristics and baselines").

Each returns a schedule or ``None`` when it cannot meet the budget; what it would need
then is its own business (``methods`` reports the smallest budget it can meet).

* ``none``           keep everything.
* ``vdnn-all``       vDNN_all (Rhu et al. 2016): offload every unit, per-layer sync (the op
                     after ``F(i+1)`` waits for the copy), prefetch one op ahead of need.
* ``vdnn-conv``      vDNN_conv: the same for units of stages whose ``kind`` mentions conv.
* ``vdnn-dyn``       vDNN_dyn, reduced: the first of none, vdnn-conv, vdnn-all that fits
                     (the chain has no per-layer algorithm variants to choose from).
* ``layrub``         Layrub's inter-layer migration (Liu et al. 2018): every unit but the
                     first stage and the last three, per-layer sync, one-op lookahead.
* ``swap-idle``      Zhang et al. 2019, DOA ranking: repeatedly take the unit with the
                     longest idle time (end of its last forward use to its backward need, on
                     the ideal timeline) among those absent at the current peak op, until
                     memory fits; "stick-to-limit" timing: releases as soon as copies end,
                     prefetches as late as serialized copies allow, both moved where
                     memory forces it.
* ``swap-size-idle`` the same ranked by AOA: (idle time - transfer time) x size.
* ``save-on-cpu``    torch.autograd.graph.save_on_cpu: everything offloaded, released at
                     once, fetched on demand (fully exposed).  Real save_on_cpu copies on
                     the compute stream, so the model (D2H overlapping one stage) is
                     optimistic for it.
* ``torch-offload``  PyTorch's own activation offloading under torch.compile
                     (``torch._functorch._activation_offloading``, 2.13) placing the copies
                     of the units our ILP offloads (``torch_placement``): what our timing
                     buys over its placement.  It waits for each copy right after the op
                     that made it (its ``sink_wait`` option holds the tensors to the
                     forward's end instead, which frees nothing before the forward's peak),
                     the unit model's nearest being per-layer sync (optimistic for it: the
                     next stage's forward still overlaps the copy), and hoists each reload,
                     in order of need, by the compute time its transfer takes (the swap
                     papers' "no-overhead" prefetch, ``prefetch_latest``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from offload.step.actions import Offload
from offload.step.chain import Chain
from offload.step.simulate import simulate

from .policy import (combine, with_restores, cover_peaks, prefetch_latest, prefetch_lookahead, prefetch_on_demand,
                     release_asap, release_next)

Plan = list[Offload]


def _fixed(chain: Chain, units: list[int], prefetch=prefetch_lookahead) -> Plan:
    return combine(release_next(chain, units), prefetch(chain, units))


def _is_conv(chain: Chain, i: int) -> bool:
    return "conv" in chain.stage(i).kind.lower()


def vdnn_all_plan(chain: Chain) -> Plan:
    return _fixed(chain, list(chain.offloadable))


def vdnn_conv_plan(chain: Chain) -> Plan:
    return _fixed(chain, [i for i in chain.offloadable if _is_conv(chain, i)])


def layrub_plan(chain: Chain) -> Plan:
    return _fixed(chain, [i for i in chain.offloadable if 2 <= i <= chain.L - 3])


def save_on_cpu_plan(chain: Chain) -> Plan:
    return _fixed(chain, list(chain.offloadable), prefetch_on_demand)


FIXED_PLANS: dict[str, Callable[[Chain], Plan]] = {
    "none": lambda chain: [],
    "vdnn-all": vdnn_all_plan,
    "vdnn-conv": vdnn_conv_plan,
    "layrub": layrub_plan,
    "save-on-cpu": save_on_cpu_plan,
}


def torch_placement(chain: Chain, units: list[int], budget: int) -> Plan:
    """``units`` timed as PyTorch's activation offloading would time them (module docstring)."""
    return combine(release_next(chain, units), prefetch_latest(chain, units, budget))


def fits(chain: Chain, plan: Plan, budget: int) -> bool:
    return simulate(chain, plan).peak_bytes <= budget


def own_smallest_budget(chain: Chain, name: str) -> int | None:
    """Smallest budget a fixed-set policy meets (its own peak); ``None`` for adaptive ones."""
    if name == "vdnn-dyn":
        return min(simulate(chain, p).peak_bytes for p in ([], vdnn_conv_plan(chain), vdnn_all_plan(chain)))
    if name in FIXED_PLANS:
        return simulate(chain, FIXED_PLANS[name](chain)).peak_bytes
    return None


def vdnn_dyn(chain: Chain, budget: int) -> Plan | None:
    for plan in ([], vdnn_conv_plan(chain), vdnn_all_plan(chain)):
        if fits(chain, plan, budget):
            return plan
    return None


def _idle_times(chain: Chain) -> np.ndarray:
    """Ideal-timeline time from the end of ``F(i+1)`` (last forward use) to the start of
    ``B(need_i)`` (next use), per stage."""
    L = chain.L
    starts = np.concatenate([[0.0], np.cumsum(np.concatenate([chain.f[1:], chain.b[1:][::-1]]))])
    idle = np.zeros(L + 1)
    for i in chain.offloadable:
        last_fwd_end = starts[i + 1]  # end of F(i+1) = start of op index i+1
        idle[i] = starts[2 * L - int(chain.need[i])] - last_fwd_end
    return idle


def swap_ranked(chain: Chain, budget: int, by_size: bool) -> Plan | None:
    """Zhang et al.'s swap selection with DOA (``by_size=False``) or AOA ranking."""
    idle = _idle_times(chain)
    score = {}
    for i in chain.offloadable:
        if by_size:
            adjusted = idle[i] - chain.d2h_s(i) - chain.h2d_s(i)
            score[i] = adjusted * chain.a[i] if adjusted > 0 else idle[i] / chain.a[i]
        else:
            score[i] = idle[i]
    ranked = np.array([score.get(i, -np.inf) for i in range(chain.L + 1)])
    chosen = cover_peaks(chain, budget, lambda cands, _: cands[np.lexsort((-cands, ranked[cands]))[-1]])
    if chosen is None:
        return None
    units = sorted(chosen)
    release = release_asap(chain, units, budget)
    if release is None:
        return None
    return with_restores(chain, combine(release, prefetch_latest(chain, units, budget)))
