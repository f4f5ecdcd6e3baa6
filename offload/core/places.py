"""Where a tensor sits in its storage, and the tensor again from that place: one rule for the
executor, which moves storages as bytes, and for a stage's re-run, which rebuilds views of
the values it makes again.

A tensor is its storage's bytes read at a place: a dtype, a size, strides and an offset (in
elements of that dtype), and two lazy bits, conjugate and negative, that change how the
bytes read without changing them (``torch.conj`` of a complex tensor is a view with the
conjugate bit set; Autoformer's autocorrelation saves one).  Dropping the bits or the dtype
rebuilds other values from the same bytes: silently off gradients (3e-8 on an Autoformer),
or a stage that no longer runs the same way twice.
"""
from __future__ import annotations

import torch

Place = tuple[torch.dtype, torch.Size, tuple[int, ...], int, bool, bool]  # dtype, size, stride, offset, conj, neg


def place_of(t: torch.Tensor) -> Place:
    """``t``'s place in its storage's bytes, with its lazy bits.  A plain tuple: the executor
    makes one per handled tensor (a named one cost 0.7 us more, measured on the CPU)."""
    return t.dtype, t.size(), t.stride(), t.storage_offset(), t.is_conj(), t.is_neg()


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``t``, as bytes (no autograd history)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _with_bits(out: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    if conj:
        out = out.conj()
    return torch._neg_view(out) if neg else out


def at(place: Place, raw: torch.Tensor) -> torch.Tensor:
    """The tensor again, in ``raw``: its storage's bytes (``bytes_of``), or the same bytes elsewhere."""
    dtype, size, stride, offset, conj, neg = place
    return _with_bits(raw.view(dtype).as_strided(size, stride, offset), conj, neg)


def view_at(place: Place, base: torch.Tensor) -> torch.Tensor:
    """The tensor at ``place`` in ``base``'s storage, as a view of ``base`` that autograd
    follows (a re-run's ops save what the stage's did only where the same values require
    grad): a complex view of real values through ``view_as_complex``, a real one of complex
    values through ``view_as_real`` (the dtype changes a model makes between its calls, as
    rotary embeddings do); any other dtype change is not differentiable, in the stage either."""
    dtype, size, stride, offset, conj, neg = place
    raw = _with_bits(base, base.is_conj(), base.is_neg())  # the bytes as they are: the bits cleared
    if dtype != raw.dtype and raw.is_complex() and dtype == raw.dtype.to_real():
        raw = torch.view_as_real(raw)
    if dtype != raw.dtype and dtype.is_complex and raw.dtype == dtype.to_real():
        pairs = raw.as_strided((*size, 2), (*(2 * s for s in stride), 1), 2 * offset)
        return _with_bits(torch.view_as_complex(pairs), conj, neg)
    # not ``at``: viewed to its own dtype, the re-run's ops saved other storages
    if dtype != raw.dtype:
        raw = raw.view(dtype)
    return _with_bits(raw.as_strided(size, stride, offset), conj, neg)
