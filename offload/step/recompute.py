"""Recomputed runs (docs/model.md, "Recomputation"): where each one runs and what it costs.

A run ``s..e`` is rebuilt at the start of ``Bn``, ``n`` the latest ``need_from`` among its
units (the first backward op that reads one of them), after the prefetches issued there
and before ``Bn`` waits for its copies: ``Fs .. Fe`` re-run one after another on the
compute stream.  Runs rebuilt at the same op go later stages first.

A stage recorded for a re-run takes its measured times where they differ from the ops the
chain timed: its forward ``recorded_fwd_s``, its re-run ``rerun_s``, its backward after the
rebuild ``recorded_bwd_s`` (``Chain.fr``, ``rr``, ``br``): on a CPU the recording's and the
replay's own work, under a per-stage ``torch.compile`` by Inductor the eager model's kernels.

A run with an in-stage option (``Recompute.option``, docs/model.md, "In-stage options")
re-runs its one stage in ``recompute_s``: what the option keeps (``kept_bytes``) stays on
the device with the checkpoint from the end of the stage's forward until the rebuild, and
the forward takes the option's ``fwd_s`` (recording what it keeps) where measured.

A run of one stage may *offload* its checkpoint (``Recompute.release``/``prefetch``,
docs/model.md, "Offloaded checkpoints"): the input's own storage and what an option keeps
(``moved_checkpoint_bytes``) are copied to the host after the stage's forward, freed at the
release point and copied back from the prefetch point; the rebuild waits for that copy.  The
held tensors its re-run reads stay on the device.

On a GPU the host's share (docs/model.md, "The host's share"): a recomputed stage's forward
costs the host ``recording_host_s`` more (the executor records its calls), and its re-run
``rerun_host_s`` (the executor's replay, measured; the forward's ``fwd_host_s`` where not).
"""
from __future__ import annotations

from typing import Any, Container, Iterable

import numpy as np

from .actions import Recompute, checkpoint_moves
from .chain import Chain


def run_op(chain: Chain, run: Recompute) -> int:
    """The stage ``n`` whose backward op ``Bn`` starts by rebuilding ``run``."""
    return max(int(chain.need[j]) for j in run.stages)


def run_seconds(chain: Chain, run: Recompute) -> float:
    """Compute time of rebuilding ``run``: its stages' re-runs (an option's: the ops it re-runs)."""
    if run.option:
        return float(chain.stage(run.first).option(run.option).recompute_s)
    return float(sum(chain.rr[j] for j in run.stages))


def recording_host(chain: Chain, runs: Iterable[Recompute]) -> np.ndarray:
    """Per stage (index 0 unused), the host time its forward adds because ``runs`` re-run it:
    the executor records a recomputed stage's calls as it runs (``recording_host_s``)."""
    out = np.zeros(chain.L + 1)
    for run in runs:
        out[list(run.stages)] = chain.rech[list(run.stages)]
    return out


def _measured(chain: Chain, run: Recompute, j: int, key: str) -> Any:
    """What ``run``'s option measured for stage ``j`` under ``key`` (``None``: no option, or not measured)."""
    return getattr(chain.stage(j).option(run.option), key) if run.option else None


def forward_seconds(chain: Chain, run: Recompute, j: int) -> float:
    """Stage ``j``'s forward time in ``run``: an option's, which records what it keeps, where
    measured; the stage's as recorded for a re-run otherwise (``recorded_fwd_s``)."""
    measured = _measured(chain, run, j, "fwd_s")
    return float(chain.fr[j]) if measured is None else measured


def kept_bytes(chain: Chain, run: Recompute) -> int:
    """What ``run``'s option keeps beside its checkpoint until the rebuild (0 without one)."""
    return chain.stage(run.first).option(run.option).kept_bytes if run.option else 0


def later_held_bytes(chain: Chain, run: Recompute) -> int:
    """What the re-runs of ``run``'s later stages read beside what the first one's checkpoint
    holds (tensors made inside the run before them, a rotary table): held from ``F(s+1)``
    until the rebuild, like the checkpoint (an upper bound while the model's code holds them
    too)."""
    return int(chain.xn[run.first + 1:run.last + 1].sum())


def checkpoint_bytes(chain: Chain, run: Recompute) -> int:
    """All that ``run`` holds from its forward until its rebuild: its first stage's input,
    what its later stages' re-runs read besides, and what its option keeps."""
    return int(chain.x[run.first]) + later_held_bytes(chain, run) + kept_bytes(chain, run)


def shared_checkpoint_bytes(chain: Chain, run: Recompute, kept: Container[int]) -> tuple[int, int]:
    """``(always, held)``: of ``run``'s checkpoint, the storages the unit before it holds too,
    which count once while both are on the device (``input_prev_bytes``: a ResNet block's
    output, saved by its last ReLU, is the next block's input).  Where that unit is among
    ``kept`` (neither offloaded nor recomputed), ``always``: all of them, wherever the
    checkpoint counts (the unit is resident from ``Fs`` through ``B(s-1)``, the checkpoint
    from ``F(s+1)`` through its rebuild); otherwise ``held``: those its held part counts
    (``input_prev_held_bytes``), from ``F(s+1)`` through ``F(held_until)`` of the unit before,
    where the model's code holds them whatever the schedule does.  None for an offloaded
    checkpoint (whose release frees nothing the unit before holds: counted whole, an upper
    bound) or an encoded unit before (``encoding.apply`` sets both to 0)."""
    s = run.first
    if run.moves:
        return 0, 0
    return (int(chain.xp[s]), 0) if s - 1 in kept else (0, int(chain.xph[s]))


def moved_checkpoint_bytes(chain: Chain, run: Recompute) -> int:
    """What offloading ``run``'s checkpoint moves: the input's own storage and the option's
    kept outputs; 0 where it cannot be offloaded (``actions.checkpoint_moves``)."""
    return int(chain.xo[run.first]) + kept_bytes(chain, run) if checkpoint_moves(chain, run) else 0


def _input_storage(chain: Chain, j: int) -> int:
    """Of stage ``j``'s ``input_bytes``, its input's own storage: what a later stage's re-run
    finds made by the re-run before (all of ``input_bytes`` where that is not known)."""
    return int(chain.xo[j] or chain.x[j])


def rerun_checkpoint(chain: Chain, run: Recompute, j: int) -> int:
    """What ``run``'s checkpoint still holds while ``Rj`` runs: all of it for ``Rs`` (which reads
    it); for a later stage, the held tensors the re-runs from ``Rj`` on read (the executor
    drops each stage's replay once it has run): ``Rj``'s own, its ``input_bytes`` less its
    input's storage, which the re-run before made (position ids the run's first stage read
    too, which the runs' ``rerun_held_bytes`` do not count again, and which no resident unit
    may hold: GPT-2's, of the embedding's unit offloaded, 128 B over at a rebuild's ``R4``),
    and what each stage after reads besides the stage before it (``rerun_held_bytes``)."""
    if j == run.first:
        return checkpoint_bytes(chain, run)
    return int(chain.x[j]) - _input_storage(chain, j) + int(chain.xn[j + 1:run.last + 1].sum())


def forward_peak(chain: Chain, run: Recompute, j: int) -> int:
    """Stage ``j``'s forward transient in ``run``: autograd keeps none of its unit; an option
    holds its kept outputs too (measured, or bounded by all of them on top)."""
    measured = _measured(chain, run, j, "fwd_peak_bytes")
    return int(chain.rfp[j]) + kept_bytes(chain, run) if measured is None else measured


def rerun_peak(chain: Chain, run: Recompute, j: int) -> int:
    """The transient of re-running stage ``j`` in ``run``, over its checkpoint (and its kept
    outputs): measured by replaying it (``rerun_peak_bytes``, the option's or the stage's),
    with, for a later stage of the run, its input, which the re-run before made (its own
    storage; the stage's whole ``input_bytes`` where that is not known); its forward's where
    not measured (an upper bound: the replay keeps no weight cast past its reader)."""
    measured = _measured(chain, run, j, "rerun_peak_bytes") if run.option else chain.stage(j).rerun_peak_bytes
    if measured is None:
        return int(chain.fp[j])
    return measured if j == run.first else measured + _input_storage(chain, j)


def by_op(chain: Chain, runs: Iterable[Recompute]) -> dict[int, list[Recompute]]:
    """Per stage ``n``, the runs rebuilt at the start of ``Bn``, in execution order."""
    out: dict[int, list[Recompute]] = {}
    for run in sorted(runs, key=lambda r: -r.first):
        out.setdefault(run_op(chain, run), []).append(run)
    return out
