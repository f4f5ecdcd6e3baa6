"""Weight casts are never saved: the profiler and the executor drop them at pack, recast at unpack.

Under ``torch.autocast`` a layer's matmul saves the low-precision cast of its fp32 weight for
the backward (a ``ToCopyBackward0`` of the parameter, or a view of it: ``addmm`` saves the
transpose).  Autograd would hold every layer's cast from its forward to its backward,
about the parameters' bytes in the low dtype on top of the activations, in no unit (a
schedule can neither move nor drop them: ``units.is_weight``).  But a cast is a pure
function of a parameter that lives through the step: this module saves the parameter and
the cast's dtype and layout instead, and casts again when the backward reads it.  The same
cast of the same weight gives the same bits, so gradients are unchanged; what it costs is a
cast (a read of the weight, a write of the cast) in the backward op that reads it, measured
there by the profiler, which runs the same hooks, and timed on its own (``recast_s``): a
schedule may keep a stage's casts instead, where it has the memory (docs/model.md,
"Weight casts"; the executor then saves them as autograd would).

Autocast's own cache would still hold each cast until the autocast region exits (the end of
the forward, in a training loop): it is off while the module's forward runs
(``Staging.uncache_casts``, the chain's ``Recipe.casts_uncached``), so each cast dies with
its reader.  Not where a weight is cast twice (read by two ops: a layer called again, tied
projections): without the cache it would be cast again, and its gradient summed in fp32
from two casts instead of in the low dtype before one cast, other bits.  There the stage
boundaries clear the cache instead (``Staging.clear_casts``, ``Recipe.casts_cleared``), so
a layer's casts die with its stage; not where the two reads are in two stages, where the
cache is kept.  The profiler finds such weights (``measure._CastsMade``).  A re-run
(``offload.core.rerun``) replays without the cache: its graph never runs backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .units import cast_parameter


@dataclass(frozen=True)
class Recast:
    """What a saved weight cast becomes: enough to make it again."""

    parameter: torch.nn.Parameter
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """The cast's storage: the parameter's elements in the cast's dtype."""
        return self.parameter.numel() * self.dtype.itemsize

    def tensor(self) -> torch.Tensor:
        """The saved tensor again: the same cast, viewed as it was saved."""
        with torch.no_grad():
            return self.parameter.to(self.dtype).as_strided(self.size, self.stride, self.offset)


def recast(t: torch.Tensor) -> Recast | None:
    """``t`` as a ``Recast`` when it is a weight's cast (or a view of one), else ``None``."""
    base = t if t._base is None else t._base
    parameter = cast_parameter(base)
    if parameter is None or not parameter.is_contiguous() or base.stride() != parameter.stride():
        return None  # a cast made with another layout than the parameter's: keep it as saved
    return Recast(parameter, base.dtype, t.size(), t.stride(), t.storage_offset())


def pack(t: torch.Tensor) -> Any:
    """A saved tensor as it is kept: a ``Recast`` for a weight's cast, else itself (``kept``)."""
    return recast(t) or kept(t)


def kept(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as it is, by a pack hook: detached where it is an op's output.

    The node that saves its own output would otherwise hold, through what the hook returned,
    a tensor whose ``grad_fn`` is that node: a reference cycle through autograd that Python's
    collector cannot free (PyTorch's own saved outputs keep their data alone for this).  A
    backward that runs the node breaks it; one that never reaches it does not: the graph of
    an output the loss does not read (a pooler beside a language-model head) stayed alive
    after every step, one more each step.  Unpacking gives the tensor its place in the graph
    back, so nothing else changes."""
    return t.detach() if t.grad_fn is not None else t


def unpack(packed: Any) -> torch.Tensor:
    """The inverse of ``pack``."""
    return packed.tensor() if isinstance(packed, Recast) else packed

