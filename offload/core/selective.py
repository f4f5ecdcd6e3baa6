"""Op-level selective activation checkpointing, torchtitan's "save the matmuls" policy.

The ops that cost the most to run again are the matmuls, the convolutions and the attention
kernels; the rest of a block (norms, activations, elementwise products, dropout) is cheap
and, in a SwiGLU MLP, holds the largest tensors.  ``EXPENSIVE`` names them once: the
profiler measures what keeping their outputs and re-running the rest would cost per stage
(``offload.profiler.selective``), and ``selective_checkpointing`` runs exactly that the way
users do today, with PyTorch's own mechanism (``torch.utils.checkpoint`` with a selective
checkpoint policy around each block), as a baseline that ``offload train --compare``
measures next to our schedule.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
EXPENSIVE = frozenset(getattr(aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward") if hasattr(aten, name))


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in EXPENSIVE else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def selective_checkpointing(module: nn.Module, blocks: Iterable[str]) -> Iterator[None]:
    """In this block, each submodule of ``module`` at these paths runs under
    ``torch.utils.checkpoint`` keeping what its expensive ops output and recomputing the rest
    in the backward; the modules are as they were afterwards.

    Args:
        module: the user's module.
        blocks: paths of its submodules to checkpoint (``model.layers.0``, …).
    """
    context = functools.partial(create_selective_checkpoint_contexts, _policy)
    patched = []
    try:
        for path in blocks:
            sub = module.get_submodule(path)
            patched.append((sub, "forward" in vars(sub)))
            sub.forward = functools.partial(checkpoint, sub.forward, use_reentrant=False, context_fn=context)
        yield
    finally:
        for sub, own in reversed(patched):
            if own:
                sub.forward = sub.forward.args[0]
            else:
                del sub.forward
