"""Timing rules that turn a set of offloaded units into a schedule.

Which units to offload is the hard, NP-hard part; once the set ``S`` is chosen, these
rules pick the release and prefetch points, around recomputed ``runs`` fixed beforehand
(their memory is part of what the rules fit into the budget).  Heuristics and baselines
share them:

* ``release_asap``: at every forward boundary release each unit whose D2H copy is done
  (free), and wait for more copies, in FIFO order, only when the next op would not fit.
  Because memory and waits only ever shrink when copies end earlier, this is optimal for
  the forward phase given ``S`` (an exchange argument: every feasible schedule must wait at
  least as long at each boundary).
* ``prefetch_earliest``: issue prefetches in order of need, each as early as memory allows
  over its whole residency.  Given that issue order it is optimal: an earlier issue frees
  the channel earlier and only takes memory that later-issued units could not use yet.
* ``prefetch_latest``: the "no-overhead" rule of the swap papers: as late as the ideal
  timeline allows with serialized copies, earlier never, later if memory forces it.
* fixed rules of the literature: release at ``i+1`` (vDNN/Layrub per-layer sync), prefetch
  one op ahead or on demand;
* ``with_restores``: where ``release_asap`` releases a unit whose held part the chain lets
  leave the device, it leaves and comes back at its reader (``restores``); the floor these
  rules fit to (``floor_memory``) counts it so.  Not the best restore point (the MILP's),
  the one with the least memory: its copy is exposed before the reader.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Iterable

import numpy as np

from offload.step.actions import Offload, Recompute
from offload.step.chain import Chain
from offload.step.events import prefetch_order
from offload.step.memory import floor_offloads, floor_restore, floor_savings, forward_checkpoint_changes, op_memory
from offload.step.recompute import forward_peak, moved_checkpoint_bytes
from offload.step.simulate import copied_out, op_seconds

Points = dict[int, int]


def floor_memory(chain: Chain, units: Iterable[int], runs: Iterable[Recompute] = ()) -> np.ndarray:
    """Per-op memory when ``units`` are released at once and fetched on demand: the least
    any schedule offloading exactly these units (and recomputing ``runs``) can hold."""
    units = set(units)
    return op_memory(chain, [o for o in floor_offloads(chain, runs) if o.stage in units], runs)


def cover_peaks(chain: Chain, budget: int, pick: Callable[[np.ndarray, int], int],
                start: Iterable[int] = (), runs: Iterable[Recompute] = (),
                until: float = math.inf) -> set[int] | None:
    """Grow a set (from ``start``) until it fits: at each step the op with the most excess
    memory is covered by ``pick(candidates, excess)``, a unit absent from it (``candidates``:
    an array of stage indices).  ``None`` if none can be, or not by ``until``
    (``time.perf_counter()``).  Incremental: O(L) array work per unit added."""
    L = chain.L
    runs = tuple(runs)
    rebuilt = {i for r in runs for i in r.stages}
    units = np.array([i for i in chain.offloadable if i not in rebuilt], dtype=np.int64)
    first = units + 1  # a unit released at once is absent from op i+1 ...
    stop = 2 * L - chain.need[units]  # ... to op 2L - need_i (excluded): ``memory.floor_savings``
    chosen = set(start)
    left = ~np.isin(units, list(chosen))
    where = {int(u): n for n, u in enumerate(units)}
    mem = floor_memory(chain, chosen, runs)
    while True:
        o = int(mem.argmax())
        excess = int(mem[o]) - budget
        if excess <= 0:
            return chosen
        if time.perf_counter() > until:
            return None
        cands = units[left & (first <= o) & (o < stop)]
        if not len(cands):
            return None
        i = int(pick(cands, excess))
        chosen.add(i)
        left[where[i]] = False
        for lo, hi, saved in floor_savings(chain, i, restore=i + 1 not in rebuilt):
            mem[lo:hi] -= saved


def set_fits(chain: Chain, units: Iterable[int], budget: int, runs: Iterable[Recompute] = ()) -> bool:
    """Whether some schedule offloading exactly ``units`` (recomputing ``runs``) meets the budget."""
    return bool(floor_memory(chain, units, runs).max() <= budget)


# ----------------------------------------------------------------------- release rules
def release_asap(chain: Chain, units: Iterable[int], budget: int, runs: Iterable[Recompute] = ()) -> Points | None:
    """Forward greedy (optimal for a fixed set and runs); ``None`` if the set cannot fit.
    A recomputed unit holds its carried part through ``F(i+1)`` and goes at its end (its
    held part through ``F(held_until)``); a run's checkpoint stays."""
    S = set(units)
    runs = tuple(runs)
    recomputed = {i for r in runs for i in r.stages}
    L = chain.L
    a = chain.a
    f, _ = op_seconds(chain, (), S | recomputed, runs)  # as recorded for a re-run, with the units' handling
    f += copied_out(chain, S, ())  # and the D2H copies of the units its forward issues
    fp = [int(x) for x in chain.fp]  # F_j's own transient
    for r in runs:
        for j in r.stages:
            fp[j] = forward_peak(chain, r, j)
    release: Points = {}
    pending: list[int] = []  # offloaded, not yet released, stage order == D2H FIFO order
    held: dict[int, int] = {}  # boundary -> bytes the model's code stops holding there
    head = 0

    def free(i: int, boundary: int, resident_bytes: int) -> int:
        """Bytes a release of ``i`` (``resident_bytes`` of it on the GPU) at ``boundary`` frees
        now (the held part frees at held_until; restored, ``restores``, it goes now and comes
        back before its reader)."""
        until = int(chain.held_until[i])
        if until > boundary and restores(chain, i, boundary, recomputed):
            back = floor_restore(chain, i) - 1
            held[back] = held.get(back, 0) - int(chain.held[i])
            held[until] = held.get(until, 0) + int(chain.held[i])
            return resident_bytes
        if until > boundary:
            held[until] = held.get(until, 0) + int(chain.held[i])
            return resident_bytes - int(chain.held[i])
        return resident_bytes
    d2h_end: dict[int, float] = {}
    d2h_free = 0.0
    resident = 0  # bytes of units of earlier stages still on the GPU
    checkpoints = _checkpoint_changes(chain, runs)
    t = 0.0
    for j in range(1, L + 1):
        resident += int(checkpoints[j])
        if j >= 2:  # boundary j-1, before F_j: units i <= j-2 may be released
            resident -= held.pop(j - 1, 0)
            if j - 2 in recomputed:
                resident -= free(j - 2, j - 1, int(chain.carry[j - 2]))
            while head < len(pending) and pending[head] <= j - 2 and d2h_end[pending[head]] <= t:
                release[pending[head]] = j - 1
                resident -= free(pending[head], j - 1, int(a[pending[head]]))
                head += 1
            while resident + fp[j] > budget:
                if head == len(pending) or pending[head] > j - 2:
                    return None
                i = pending[head]
                t = max(t, d2h_end[i])
                release[i] = j - 1
                resident -= free(i, j - 1, int(a[i]))
                head += 1
        elif resident + fp[1] > budget:
            return None
        t += f[j]
        resident += int(chain.carry[j] if j in recomputed else a[j])
        if j in S:
            d2h_free = max(t, d2h_free) + chain.d2h_s(j)
            d2h_end[j] = d2h_free
            pending.append(j)
    for i in pending[head:]:
        release[i] = L
    return release


def _checkpoint_changes(chain: Chain, runs: Iterable[Recompute]) -> np.ndarray:
    """Per forward op ``Fj``, how much the checkpoints of ``runs`` hold more than during
    ``F(j-1)`` (an offloaded one less from the op after its release): O(L + runs), not O(L x runs)."""
    change = np.zeros(chain.L + 2, dtype=np.int64)
    for run in runs:
        for j, delta in forward_checkpoint_changes(chain, run):
            change[j] += delta
        if run.moves:
            change[run.release + 1] -= moved_checkpoint_bytes(chain, run)
    return change


def restores(chain: Chain, i: int, release: int, recomputed: set[int]) -> bool:
    """Whether our heuristics take unit ``i``'s held part off the device at its release, to come
    back at its reader (``memory.floor_restore``): where the class allows it after that
    release (a unit offloaded, not recomputed, the next stage not recomputed either)."""
    back = floor_restore(chain, i)
    return bool(back) and release + 2 <= back and not {i, i + 1} & recomputed


def with_restores(chain: Chain, offloads: Iterable[Offload], runs: Iterable[Recompute] = ()) -> list[Offload]:
    """``offloads`` with the restores ``restores`` chooses (what ``release_asap`` counted)."""
    rebuilt = {i for r in runs for i in r.stages}
    return [replace(o, restore=floor_restore(chain, o.stage)) if restores(chain, o.stage, o.release, rebuilt) else o
            for o in offloads]


def release_next(chain: Chain, units: Iterable[int]) -> Points:
    """vDNN/Layrub per-layer sync: the op after ``F(i+1)`` waits for the copy of ``Ui``."""
    return {i: i + 1 for i in units}


# ---------------------------------------------------------------------- prefetch rules
def _backward_memory(chain: Chain, units: Iterable[int], runs: Iterable[Recompute] = ()) -> np.ndarray:
    """Memory per backward op ``B_j`` (index j) with every unit in its must-reside window."""
    L = chain.L
    mem = floor_memory(chain, units, runs)
    return np.concatenate([[0], mem[L:][::-1]])  # mem[2L - j] is B_j


def prefetch_earliest(chain: Chain, units: Iterable[int], budget: int, runs: Iterable[Recompute] = ()) -> Points:
    """In need order, each prefetch as early as memory allows (assumes the set fits)."""
    L = chain.L
    mem = _backward_memory(chain, units, runs)
    points: Points = {}
    cap = L
    for u in prefetch_order(chain, units):
        n, au = int(chain.need[u]), int(chain.a[u])
        window = mem[n + 1: cap + 1] + au > budget
        k = n + int(np.argmax(window)) if window.any() else cap
        mem[n + 1: k + 1] += au
        points[u] = cap = k
    return points


def prefetch_latest(chain: Chain, units: Iterable[int], budget: int) -> Points:
    """"No-overhead" prefetch: as late as serialized copies on the ideal timeline allow,
    later still where memory forces it ("stick to the limit")."""
    L = chain.L
    order = prefetch_order(chain, units)
    # ideal start time of B_j, measured from the start of B_L
    t_b = np.zeros(L + 2)
    for j in range(L - 1, 0, -1):
        t_b[j] = t_b[j + 1] + chain.b[j + 1]
    latest: dict[int, float] = {}
    nxt = np.inf
    for u in reversed(order):
        dur = chain.h2d_s(u)
        latest[u] = min(t_b[int(chain.need[u])], nxt) - dur
        nxt = latest[u]
    mem = _backward_memory(chain, units)
    points: Points = {}
    cap = L
    for u in order:
        n, au = int(chain.need[u]), int(chain.a[u])
        k = n
        while k < cap and t_b[k] > latest[u]:
            k += 1
        while k > n and (mem[n + 1: k + 1] + au > budget).any():
            k -= 1
        mem[n + 1: k + 1] += au
        points[u] = cap = k
    return points


def prefetch_lookahead(chain: Chain, units: Iterable[int]) -> Points:
    """vDNN/Layrub: issue the copy one op before the unit is needed."""
    return {i: min(chain.L, int(chain.need[i]) + 1) for i in units}


def prefetch_on_demand(chain: Chain, units: Iterable[int]) -> Points:
    """save_on_cpu: fetch when the backward asks for it (fully exposed)."""
    return {i: int(chain.need[i]) for i in units}


def combine(release: Points, prefetch: Points) -> list[Offload]:
    return [Offload(i, release[i], prefetch[i]) for i in sorted(release)]


def plan_greedy(chain: Chain, units: Iterable[int], budget: int,
                runs: Iterable[Recompute] = ()) -> list[Offload] | None:
    """The best timing our rules know for a fixed set (and runs): ``release_asap`` +
    ``prefetch_earliest``."""
    units, runs = sorted(units), tuple(runs)
    release = release_asap(chain, units, budget, runs)
    if release is None or not set_fits(chain, units, budget, runs):
        return None
    return with_restores(chain, combine(release, prefetch_earliest(chain, units, budget, runs)), runs)

