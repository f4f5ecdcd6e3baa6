"""Activation memory per op (docs/model.md, "Schedules"), and the two reference peaks.

Ops are indexed ``0..2L-1`` in execution order: ``Fj`` is ``j-1``, ``Bj`` is ``2L-j``.
During ``Fj`` the resident units of earlier stages count plus ``fwd_peak_bytes`` of ``Fj``
(which includes ``Uj``; ``recomputed_fwd_peak_bytes`` when ``Uj`` is recomputed, autograd
keeping none of it, and an in-stage option's kept outputs on top: ``recompute.forward_peak``); during ``Bj`` the resident units of stages ``<= j`` count plus
``bwd_peak_bytes``.  A recomputed unit counts its carried part during the next forward op
(its held part after); what of either the model's code lets go only as the next forward
op starts (``carried_late_bytes``, ``held_late_bytes``; of an offloaded unit released by then
too: ``late_parts``) is live in that op's first reading, with its ``fwd_start_bytes``: the
last reading of the op before, so never above that op's memory; a run's checkpoint (with
what its option keeps: ``recompute.checkpoint_bytes``) counts from the op after its first forward op until it is
rebuilt, less what an offloaded one moves between its release and its prefetch point
and what the unit before holds too (``recompute.shared_checkpoint_bytes``),
and its units from their rebuild (``rebuilt_bytes`` of each); each re-run forward op ``Rj`` of it holds what ``Bn`` holds before its own transient
(units and the gradient flowing in, ``bwd_start_bytes``), less the units not rebuilt yet, plus ``fwd_peak_bytes`` of ``Fj`` (an option's measured re-run transient:
``recompute.rerun_peak``; and ``Rs`` the checkpoint it reads), and
``Bn``'s memory is the largest of those and its own.  A stage whose weight casts are kept
counts them from ``Fi`` through ``Bi``: an upper bound during ``Fi`` (whose transient holds
them as far as autocast's cache does) and ``Bi`` (which frees them as it reads them).
Memory depends only on the schedule's decisions, never on timing, which is what lets the
ILP separate memory from time.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .actions import Offload, Recompute
from .chain import Chain
from .recompute import (by_op, checkpoint_bytes, forward_peak, kept_bytes, later_held_bytes, moved_checkpoint_bytes,
                        rerun_checkpoint, rerun_peak, shared_checkpoint_bytes)


def op_name(chain: Chain, o: int) -> str:
    L = chain.L
    return f"F{o + 1}" if o < L else f"B{2 * L - o}"


def op_transients(chain: Chain) -> np.ndarray:
    """Per op (``F1..FL, BL..B1``), the bytes its own kernels allocate and free within it
    (``fwd_peak_bytes``, ``bwd_peak_bytes``): its temporary memory, which no schedule moves."""
    return np.concatenate([chain.fp[1:], chain.bp[1:][::-1]])


def forward_checkpoint(chain: Chain, run: Recompute, j: int) -> int:
    """Bytes the checkpoint of ``run`` adds during ``Fj``: none through its first stage ``Fs``
    (the stage's own memory counts its input), then ``input_bytes`` less the storages of ``Us``
    that its carried part (``F(s+1)``) and held part (through ``F(held_until)``) count too,
    plus what its later stages' re-runs read (``recompute.later_held_bytes``) and what its
    option keeps (``recompute.kept_bytes``)."""
    s = run.first
    if j <= s:
        return 0
    beside = later_held_bytes(chain, run) + kept_bytes(chain, run)
    if j == s + 1:
        return int(chain.x[s] - chain.xc[s]) + beside
    return int(chain.x[s] - (chain.xh[s] if j <= chain.held_until[s] else 0)) + beside


def forward_checkpoint_changes(chain: Chain, run: Recompute) -> list[tuple[int, int]]:
    """``(j, bytes)``: where the checkpoint of ``run`` (first stage ``s``) changes in the forward
    (by how much as ``Fj`` starts).  ``forward_checkpoint`` changes only where ``F(s+1)``,
    ``F(s+2)`` and ``F(held_until+1)`` start, so a walk over these is O(1) per run, not O(L)."""
    s = run.first
    out, counted = [], 0
    for j in sorted({s + 1, s + 2, int(chain.held_until[s]) + 1}):
        if j <= chain.L:
            now = forward_checkpoint(chain, run, j)
            out.append((j, now - counted))
            counted = now
    return out


def kept_units(chain: Chain, offloads: Iterable[Offload], runs: Iterable[Recompute]) -> set[int]:
    """The stages whose units stay on the device from their forward through their backward:
    neither offloaded nor recomputed."""
    return set(range(1, chain.L + 1)) - {o.stage for o in offloads} - {i for r in runs for i in r.stages}


def _resident(chain: Chain, offloads: Iterable[Offload], runs: Iterable[Recompute],
              casts_kept: Iterable[int], stay: set[int]) -> np.ndarray:
    """Per op, the bytes of units, checkpoints and kept casts resident, without the
    recomputations' own (``stay``: ``kept_units``)."""
    L = chain.L
    diff = np.zeros(2 * L + 1, dtype=np.int64)

    def away(i: int, release: int, back: int, first: int, restore: int = 0, a: int | None = None) -> None:
        """Unit ``i`` resident through ``F(release)`` (``first`` bytes of it; its held part
        through ``F(held_until)``, or from ``F(restore)`` when it is taken off the device
        meanwhile), then again from ``B(back)`` to the end of ``Bi`` (``a`` bytes of it: all
        of it unless given)."""
        a = chain.a[i] if a is None else a
        diff[i] += first  # F_{i+1} .. F_r
        diff[release] -= first
        held_from = restore - 1 if restore else release  # the op index of F_{r+1}, or of F_restore
        if chain.held_until[i] > held_from:  # the part the model's code holds: from there .. F_held_until
            diff[held_from] += chain.held[i]
            diff[chain.held_until[i]] -= chain.held[i]
        diff[2 * L - back] += a  # B_back .. B_i
        diff[2 * L - i + 1] -= a

    def checkpoint(run: Recompute, n: int) -> None:
        """``run``'s checkpoint until its rebuild at ``Bn``: ``forward_checkpoint`` in the
        forward, then ``checkpoint_bytes``, less what a kept unit before it holds too
        (``shared_checkpoint_bytes``); an offloaded one less what it moves from the op after
        its release to its prefetch point."""
        counted, whole = 0, checkpoint_bytes(chain, run)
        always, held = shared_checkpoint_bytes(chain, run, stay)
        diff[run.first] -= always + held  # from F(s+1) .. through B(n+1)
        diff[2 * L - n] += always
        diff[chain.held_until[run.first - 1]] += held  # .. through F(held_until) of the unit before
        for j, change in forward_checkpoint_changes(chain, run):
            diff[j - 1] += change
            counted += change
        diff[L] += whole - counted
        diff[2 * L - n] -= whole
        if run.moves:
            moved = moved_checkpoint_bytes(chain, run)
            diff[run.release] -= moved  # F(release+1), or B_L for a release at the turn
            diff[2 * L - run.prefetch] += moved

    for o in offloads:
        away(o.stage, o.release, o.prefetch, chain.a[o.stage], o.restore)
    for n, at_n in by_op(chain, runs).items():
        for run in at_n:
            for i in run.stages:
                away(i, i + 1, n, chain.carry[i], a=chain.rb[i])  # F_{i+1}: what the model's code still holds
            checkpoint(run, n)
    idx = np.array(sorted(stay), dtype=np.int64)
    np.add.at(diff, idx, chain.a[idx])  # kept: F_{i+1} .. B_i
    np.add.at(diff, 2 * L - idx + 1, -chain.a[idx])
    casts = np.array(sorted(casts_kept), dtype=np.int64)
    np.add.at(diff, casts - 1, chain.cb[casts])  # F_i .. B_i
    np.add.at(diff, 2 * L - casts + 1, -chain.cb[casts])
    return np.cumsum(diff[:-1])


def _recompute_memory(chain: Chain, resident: np.ndarray, runs: Iterable[Recompute],
                      stay: set[int]) -> list[tuple[int, int, int]]:
    """``(n, j, bytes)`` per re-run forward op ``Rj`` (rebuilt at the start of ``Bn``), in
    execution order; ``resident`` is ``_resident``'s per-op residency (``stay``: ``kept_units``,
    whose storages a checkpoint shares count once)."""
    L, a = chain.L, chain.rb  # a rebuilt unit: what its rebuild keeps live
    out = []
    for n, at_n in sorted(by_op(chain, runs).items(), reverse=True):
        # what B_n holds before its transient, with the runs at n rebuilt and their checkpoints gone
        base = int(resident[2 * L - n])
        # each run's checkpoint as it counts until its rebuild: less what a kept unit before it holds too
        held = [checkpoint_bytes(chain, r) - shared_checkpoint_bytes(chain, r, stay)[0] for r in at_n]
        pending = [int(sum(a[j] for j in r.stages)) - h for r, h in zip(at_n, held)]
        for m, run in enumerate(at_n):
            later = sum(pending[m + 1:])
            for j in run.stages:
                missing = int(sum(a[l] for l in range(j, run.last + 1)))
                checkpoint = held[m] if j == run.first else rerun_checkpoint(chain, run, j)
                out.append((n, j, base - later - missing + rerun_peak(chain, run, j) + checkpoint + int(chain.bs[n])))
    return out


def late_parts(chain: Chain, offloads: Iterable[Offload], runs: Iterable[Recompute]) -> dict[int, int]:
    """``{j: bytes}``: of the units autograd no longer holds as ``Fj`` starts, the storages the
    model counts through ``F(j-1)`` and the model's code lets go only as ``Fj`` starts: unit
    ``j-1``'s ``carried_early_bytes`` (recomputed: its ``Fj`` carries only ``carry_bytes``),
    unit ``j-2``'s ``carried_late_bytes`` (recomputed, or offloaded and released at ``j-1``) and the
    ``held_late_bytes`` of units held through ``F(j-1)`` (recomputed, or offloaded and released
    by then), less the input's where a run starting at the unit holds them as its checkpoint."""
    out: dict[int, int] = {}

    def late(j: int, nbytes: int) -> None:
        if j <= chain.L and nbytes > 0:
            out[j] = out.get(j, 0) + nbytes

    for run in runs:
        for i in run.stages:
            first = i == run.first
            late(i + 1, int(chain.ce[i]))
            late(i + 2, int(chain.cl[i]) - (int(chain.xl[i]) if first else 0))
            late(int(chain.held_until[i]) + 1, int(chain.hl[i]) - (int(chain.xhl[i]) if first else 0))
    for o in offloads:
        if o.release == o.stage + 1:
            late(o.stage + 2, int(chain.cl[o.stage]))
        if o.release <= chain.held_until[o.stage]:
            late(int(chain.held_until[o.stage]) + 1, int(chain.hl[o.stage]))
    return out


def memory_profile(chain: Chain, offloads: Iterable[Offload], runs: Iterable[Recompute] = (),
                   casts_kept: Iterable[int] = ()) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Activation bytes held during each op (int64 array of length ``2L``; ``Bn`` counts the
    recomputations at its start) and, per re-run forward op, ``(n, j, bytes)``."""
    offloads, runs = tuple(offloads), tuple(runs)
    stay = kept_units(chain, offloads, runs)
    resident = _resident(chain, offloads, runs, casts_kept, stay)
    mem = resident + op_transients(chain)
    for run in runs:  # a recomputed stage's forward: autograd keeps none of its unit
        for j in run.stages:
            mem[j - 1] += forward_peak(chain, run, j) - int(chain.fp[j])
    for j, late in sorted(late_parts(chain, offloads, runs).items()):  # Fj's first reading: F(j-1)'s last one
        mem[j - 1] = max(mem[j - 1], min(mem[j - 2], resident[j - 1] + late + int(chain.fs[j])))
    rebuilt = _recompute_memory(chain, resident, runs, stay)
    for n, _, nbytes in rebuilt:
        mem[2 * chain.L - n] = max(mem[2 * chain.L - n], nbytes)
    return mem, rebuilt


def op_memory(chain: Chain, offloads: Iterable[Offload], runs: Iterable[Recompute] = (),
              casts_kept: Iterable[int] = ()) -> np.ndarray:
    """Activation bytes held during each op (``memory_profile``'s first part)."""
    return memory_profile(chain, offloads, runs, casts_kept)[0]


def floor_restore(chain: Chain, i: int) -> int:
    """Where the floor schedule brings unit ``i``'s held part back: at its reader, when that
    leaves a forward without it after the release at ``i + 1`` (0: it stays)."""
    at = int(chain.held_read[i])
    return at if at >= i + 3 else 0


def floor_savings(chain: Chain, i: int, restore: bool = True) -> list[tuple[int, int, int]]:
    """``(first op, stop op, bytes)``: what offloading unit ``i`` at once (released at ``i+1``,
    fetched on demand, with ``restore`` its held part off the device until its reader:
    ``floor_offloads``) saves against keeping it, per run of ops (execution order); the
    part the model's own code holds is saved only before ``F(restore)`` and from
    ``F(held_until + 1)``."""
    first, stop, a = i + 1, 2 * chain.L - int(chain.need[i]), int(chain.a[i])
    until = int(chain.held_until[i])
    back = max(first, floor_restore(chain, i) - 1) if restore else first  # where the held part counts again
    if until > i + 1:  # (a run may be empty)
        return [(first, min(back, stop), a), (min(back, stop), min(until, stop), a - int(chain.held[i])),
                (min(until, stop), stop, a)]
    return [(first, stop, a)]


def floor_offloads(chain: Chain, runs: Iterable[Recompute] = ()) -> list[Offload]:
    """Every offloadable unit, released at once (``r = i+1``), its held part off the device
    until its reader (``floor_restore``; not where ``runs`` recompute the next stage), fetched
    on demand.

    It holds the least memory at every op simultaneously, so its peak is the smallest
    budget any schedule of the class can meet."""
    rebuilt = {i for run in runs for i in run.stages}
    return [Offload(i, i + 1, int(chain.need[i]), 0 if i + 1 in rebuilt else floor_restore(chain, i))
            for i in chain.offloadable]


def relieve(chain: Chain, memory: np.ndarray, units: Iterable[int]) -> None:
    """Take off ``memory`` (per op, in place) the most that recomputing each of ``units`` takes
    off what the all-offloaded floor schedule holds: during ``Fi`` what autograd would keep of
    ``Ui``, during ``F(i+1)`` what it does not carry into it, and from ``B(need_from)``, where
    the floor fetches the unit, through ``Bi`` what a rebuild does not keep live
    (``rebuilt_bytes``: a recomputation's checkpoint and re-run ops only add)."""
    L = chain.L
    for i in units:
        memory[i - 1] -= max(0, int(chain.fp[i]) - int(chain.rfp[i]))  # a checkpoint held through Fi may add
        memory[i] -= max(0, int(chain.a[i]) - int(chain.carry[i]))
        memory[2 * L - int(chain.need[i]):2 * L - i + 1] -= int(chain.a[i]) - int(chain.rb[i])


def floor_bound_memory(chain: Chain, recompute: bool) -> np.ndarray:
    """Per op, the least any schedule can hold: the all-offloaded floor schedule's memory, and
    with ``recompute`` less what recomputing each recomputable stage relieves (``relieve``: a
    lower bound)."""
    mem = op_memory(chain, floor_offloads(chain))
    if recompute:
        relieve(chain, mem, chain.recomputable)
    return mem


def no_offload_peak(chain: Chain) -> int:
    """Activation peak when nothing is offloaded."""
    return int(op_memory(chain, ()).max())


def smallest_feasible_budget(chain: Chain, recompute: bool = False) -> int:
    """Smallest activation budget met by any schedule of the class (without recomputation);
    with ``recompute``, a lower bound on it for the joint class (``floor_bound_memory``)."""
    return int(floor_bound_memory(chain, recompute).max())
