"""A model cut into stages exactly as its chain was profiled, or a clear refusal.

The schedule names units by stage, so the executor must see the same stages the profiler
measured: the same capture method and the cuts recorded in ``chain.source``.  Both ways in
(a model named like ``offload train`` takes it, or a module a user built in their own
script) end in ``stage_module``, which checks the cut points and the stage names.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from profiler.capture import capture
from profiler.linearize import stage_model
from profiler.models import resolve
from profiler.profile import DTYPES, place, running
from profiler.staged import StagedModel
from solver.chain import Chain
from solver.errors import ChainMismatch


def stage_module(module: nn.Module, inputs: Sequence[torch.Tensor], chain: Chain) -> StagedModel:
    """``module`` (run on ``inputs``) staged as ``chain`` was, or ``ChainMismatch``."""
    src = chain.source
    with running("capturing the model"):
        cap = capture(module, inputs, src.get("capture", "auto"))
    cuts = list(src.get("cuts", []))
    missing = [c for c in cuts if c not in cap.candidates]
    if missing or len(cuts) != chain.L - 1:
        raise ChainMismatch(f"the model cannot be staged like chain {chain.name!r}: cut point(s) {missing[:3]} not found",
                            "profile this model again (`offload profile`) and solve on the new chain")
    staged = stage_model(cap, cuts)
    if [s.name for s in staged.stages] != [s.name for s in chain.stages]:
        raise ChainMismatch(f"the model's stages differ from chain {chain.name!r}'s",
                            "the chain was profiled from another model or version: profile it again")
    return staged


def stage_like_chain(model: str, chain: Chain, device: torch.device) -> tuple[Any, StagedModel]:
    """(ModelSpec, StagedModel) of the model named ``model``, built with the batch, options,
    seed and dtype ``chain`` was profiled with, on ``device``."""
    src = chain.source
    spec = resolve(model, int(src.get("batch", 0)), dict(src.get("options", {})), int(src.get("seed", 0)))
    with running(f"running {model}"):
        place(spec, device, DTYPES[src.get("dtype", "float32")])
    return spec, stage_module(spec.module, spec.inputs, chain)
