"""Op-level selective activation checkpointing, torchtitan's "save the matmuls" policy.

The ops that cost the most to run again are the matmuls, the convolutions and the attention
kernels; the rest of a block (norms, activations, elementwise products, dropout) is cheap
and, in a SwiGLU MLP, holds the largest tensors.  ``EXPENSIVE`` names them once: the
profiler measures what keeping their outputs and re-running the rest would cost per stage
(``offload.profiler.selective``), and ``selective_checkpointing`` runs exactly that the way
users do today, with PyTorch's own mechanism (``torch.utils.checkpoint`` with a selective
checkpoint policy around each block), as a baseline that ``offload train --compare``
measures next to our schedule.

An op is kept only if it draws no random numbers (``keeps``): attention with dropout is
re-run, so that the re-run draws the same numbers in the same order as the forward did.

Our own schedules run the option with ``KeptOutputs``: the executor replays a stage from
its recorded module calls (``offload.core.rerun``), at a point its schedule chooses, not
from inside ``torch.utils.checkpoint``'s frame, so it cannot use the checkpoint's caching
contexts; ``KeptOutputs`` is the same idea (a dispatch mode that records what the kept
ops output in the forward and hands it back, in order, to the re-run) with the checks a
replay needs.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from offload.step.chain import EVERY_OTHER_MATMUL, MATMULS

aten = torch.ops.aten
EXPENSIVE = frozenset(getattr(aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward") if hasattr(aten, name))


def keeps(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the option keeps what ``func`` outputs: an expensive op drawing no random
    numbers (an attention kernel's ``dropout_p`` is 0)."""
    if func.overloadpacket not in EXPENSIVE:
        return False
    for n, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            p = kwargs.get("dropout_p", args[n] if n < len(args) else arg.default_value)
            return not p
    return True


MATMUL = frozenset(getattr(aten, name) for name in ("mm", "addmm"))  # what every-other-matmul counts
OPTIONS = (MATMULS, EVERY_OTHER_MATMUL)  # the in-stage options there are rules for: each stage's candidates


class KeepRule:
    """Which op calls' outputs an in-stage option keeps, asked in call order over one run of a
    stage (the forward, then again the re-run: a fresh rule each).  ``matmuls`` keeps every
    op ``keeps`` names; ``every-other-matmul`` keeps only the first, third, ... of its matmuls
    (``mm``, ``addmm``: a linear layer), torchtitan's default op-level policy, which trades
    half the matmuls' outputs for re-running them."""

    def __init__(self, option: str) -> None:
        if option not in OPTIONS:
            raise ValueError(f"no in-stage option {option!r} (the executor runs {', '.join(OPTIONS)})")
        self.option, self.matmuls = option, 0

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> bool:
        if not keeps(func, args, kwargs):
            return False
        if self.option == EVERY_OTHER_MATMUL and func.overloadpacket in MATMUL:
            self.matmuls += 1
            return self.matmuls % 2 == 1
        return True


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if keeps(op, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE


class KeptOutputs(TorchDispatchMode):
    """While a stage's forward runs (the mode entered), records what its kept ops output, in
    order; ``serving()`` hands each back to the stage's re-run in place of running the op
    again, and lets go of it: the kept outputs live from the forward to the re-run."""

    def __init__(self, stage: int, option: str) -> None:
        super().__init__()
        self.stage, self.option, self.rule = stage, option, KeepRule(option)
        self.outputs: list[tuple[Any, Any] | None] = []  # (op, its output detached), None once served
        self.served: int | None = None  # while serving: how many were handed back

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.rule(func, args, kwargs):
            return func(*args, **kwargs)
        if self.served is None:
            out = func(*args, **kwargs)
            self.outputs.append((func, tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)))
            return out
        n = self.served
        if n >= len(self.outputs) or self.outputs[n][0] is not func:
            raise RuntimeError(f"re-running stage {self.stage} calls {func} as its kept op #{n}, where its forward "
                               f"called {self.outputs[n][0] if n < len(self.outputs) else 'no more'}: the stage does "
                               "not run the same way twice")
        out = self.outputs[n][1]
        self.outputs[n], self.served = None, n + 1
        return out

    def hand_over(self) -> list[torch.Tensor]:
        """The kept outputs' tensors, in order, let go of (an offloaded checkpoint moves them);
        ``take_back`` puts them (or copies) back in their places."""
        out = []
        for n, (func, value) in enumerate(self.outputs):
            leaves, spec = tree_flatten(value)
            out += [t for t in leaves if isinstance(t, torch.Tensor)]
            self.outputs[n] = (func, (spec, [None if isinstance(t, torch.Tensor) else (t,) for t in leaves]))
        return out

    def take_back(self, tensors: list[torch.Tensor]) -> None:
        """Undo ``hand_over`` with ``tensors`` in the same order."""
        given = iter(tensors)
        for n, (func, (spec, leaves)) in enumerate(self.outputs):
            self.outputs[n] = (func, tree_unflatten([next(given) if t is None else t[0] for t in leaves], spec))

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """In this block the stage's re-run reads the kept outputs; all of them, or it fails."""
        self.served, self.rule = 0, KeepRule(self.option)
        with self:
            yield
        if self.served != len(self.outputs):
            raise RuntimeError(f"re-running stage {self.stage} called {self.served} kept ops where its forward called "
                               f"{len(self.outputs)}: the stage does not run the same way twice")
        self.outputs = []


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
    except RuntimeError as exc:
        if not any(words in str(exc) for words in ("modified by an inplace operation", "checkpoint has been mutated")):
            raise
        # (torch's own words name the tensor, not why: SqueezeNet's ReLU(inplace=True) after each conv)
        raise RuntimeError("torch's selective checkpointing kept an op's output that the model then changed in "
                           "place (as nn.ReLU(inplace=True) after a convolution does): a limit of that policy; build "
                           f"the model without in-place ops to compare it. torch said: {exc}") from exc
    finally:
        for sub, own in reversed(patched):
            if own:
                sub.forward = sub.forward.args[0]
            else:
                del sub.forward
