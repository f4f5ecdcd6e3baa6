"""Recompute-only policies of the checkpointing literature, on this project's model.

``checkpoint-sqrt`` is ``torch.utils.checkpoint.checkpoint_sequential`` with about ``sqrt(L)``
segments: runs of ``ceil(sqrt(L))`` stages, the segment holding the last stage not
recomputed (Chen et al., 2016).  ``checkpoint-blocks`` is the per-block policy of PyTorch
users and of torchtune/Megatron's "full" activation checkpointing: every stage but the last
its own run, each rebuilt from its own input just before its backward needs it.  The
optimal recompute-only schedule over the class (the role that Beaumont et al.'s rotor
dynamic program plays in its own model) is the MILP with offloading turned off
(``methods``, ``recompute-only``).  ``checkpoint-matmuls`` is op-level selective activation
checkpointing (torchtitan's "op" policy, "save the matmuls"): per-block checkpointing
where each block keeps what its matmuls and attention kernel output, its ``matmuls``
in-stage option (docs/model.md, "In-stage options"); a stage without that option (the
profiler offers it where it keeps less than the unit and re-runs less than the forward)
is recomputed whole.  ``checkpoint-every-other-matmul`` is torchtitan's default "op" policy:
the same with each block's ``every-other-matmul`` option (every second matmul re-run too).
``checkpoint-blocks-offload`` and ``checkpoint-matmuls-offload`` are what users combine with
them today, torchtune's ``OffloadActivations`` around checkpointed blocks: each block's
checkpoint (its input, and what its option keeps) offloaded as its forward ends, released
as soon as that frees it and fetched one op ahead of its rebuild (docs/model.md,
"Offloaded checkpoints").
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from offload.step.actions import Recompute, first_checkpoint_release
from offload.step.chain import EVERY_OTHER_MATMUL, MATMULS, Chain
from offload.step.recompute import moved_checkpoint_bytes, run_op


def sqrt_runs(chain: Chain) -> list[Recompute]:
    """Runs of ``ceil(sqrt(L))`` stages from stage 1; the segment with stage ``L`` is not recomputed.
    A stage the executor cannot re-run (``Stage.recomputable``) is kept, splitting its segment."""
    L = chain.L
    size = max(1, math.ceil(math.sqrt(L)))
    runs = []
    for s in range(1, L + 1, size):
        if s + size - 1 < L:
            runs += recomputable_parts(chain, s, s + size - 1)
    return runs


def block_runs(chain: Chain) -> list[Recompute]:
    """Every stage but the last (and those the executor cannot re-run), each its own run."""
    return [Recompute(i, i) for i in sorted(chain.recomputable)]


def option_runs(option: str) -> Callable[[Chain], list[Recompute]]:
    """``block_runs``, each stage offering in-stage ``option`` re-run in part (keeping what the
    option keeps), the others whole."""
    def runs(chain: Chain) -> list[Recompute]:
        return [Recompute(r.first, r.last, option if (r.first, option) in chain.optional else "")
                for r in block_runs(chain)]
    return runs


def recomputable_parts(chain: Chain, first: int, last: int) -> list[Recompute]:
    """The maximal runs of recomputable stages within ``first..last`` (one ends at a stage whose
    re-run does not rebuild its output)."""
    parts: list[Recompute] = []
    start = None
    for i in range(first, last + 1):
        if i in chain.recomputable:
            start = i if start is None else start
            if not chain.stage(i).rerun_output or i == last:
                parts.append(Recompute(start, i))
                start = None
        elif start is not None:
            parts.append(Recompute(start, i - 1))
            start = None
    return parts


def checkpoints_offloaded(policy: Callable[[Chain], list[Recompute]]) -> Callable[[Chain], list[Recompute]]:
    """``policy``'s runs, each run of one stage offloading its checkpoint (torchtune's
    ``OffloadActivations``): released as soon as that frees it, fetched one op ahead."""
    def runs(chain: Chain) -> list[Recompute]:
        return [replace(r, release=first_checkpoint_release(chain, r), prefetch=min(chain.L, run_op(chain, r) + 1))
                if moved_checkpoint_bytes(chain, r) else r for r in policy(chain)]
    return runs


IN_STAGE = {"checkpoint-matmuls": MATMULS, "checkpoint-every-other-matmul": EVERY_OTHER_MATMUL}  # policy -> its option
RECOMPUTE_ONLY = {"checkpoint-sqrt": sqrt_runs, "checkpoint-blocks": block_runs,
                  **{name: option_runs(option) for name, option in IN_STAGE.items()}}  # they move nothing
POLICIES = {**RECOMPUTE_ONLY, "checkpoint-blocks-offload": checkpoints_offloaded(block_runs),
            "checkpoint-matmuls-offload": checkpoints_offloaded(option_runs(MATMULS))}
WITH_OPTIONS = {*IN_STAGE, "checkpoint-matmuls-offload"}  # policies that re-run blocks in part
