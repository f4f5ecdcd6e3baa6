"""The encoders of saved activations (Gist, ISCA 2018; Layrub, PPoPP 2018): real byte formats.

Each encoder turns one whole storage, seen as a flat tensor of its dtype, into one ``uint8``
blob (one storage: what stays resident or crosses the bus), and back.  The profiler sizes
and times them on the model's own tensors; the executor runs them in its pack and unpack
hooks.

* ``sign-mask`` (Gist's Binarize; Layrub keeps the same mask in a byte): one bit per element,
  ``x > 0``, decoded as 1.0 / 0.0.  Lossless only for storages whose every backward reader
  needs the sign alone (ReLU's saved output, max-pool's saved input, which its backward
  reads only for the shape): the profiler checks who reads each storage.
* ``sparse`` (Gist's sparse storage, dense compute): the non-zero elements (zero tested on
  the bits, so ``-0.0`` is kept) after a one-bit presence mask.  Lossless for any storage;
  smaller once about a thirtieth of a float32 storage is zero.  Gist's CSR (a one-byte
  column per non-zero, rows of 256) is larger below ~88% zeros and decodes through index
  arrays of 8 bytes per non-zero, which the mask avoids.
* ``bf16`` (Gist's delayed precision reduction): bfloat16 for the backward use only.
  Lossy: gradients change, and the executor reports by how much.

``sign-mask`` and ``bf16`` never synchronize the device; ``sparse`` does once per storage
(the number of non-zeros sizes its blob, so the host must read it back).  On a GPU such a
read makes the thread that launches the step's kernels wait for the device: the pipeline
drains at every one (an H100 ran a Qwen2 step 34-37% slower than its schedule predicted, 40
waits per step).  So a step on CUDA may use only the encoders that never synchronize
(``usable_on``): the profiler offers no other there, and the executor refuses a schedule
that asks for one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from offload.step import names

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Encoder:
    """One byte format: its functions, and what the profiler and the executor must know of it."""

    name: str
    lossless: bool  # for the storages the profiler allows it on
    encode: Callable[[torch.Tensor], torch.Tensor]  # flat tensor -> uint8 blob
    decode: Callable[[torch.Tensor, torch.dtype, int], torch.Tensor]  # blob, dtype, numel -> flat tensor
    applies: Callable[[torch.dtype], bool]
    size: Callable[[torch.Tensor], int]  # flat tensor -> bytes of its blob
    variable_size: bool = False  # the blob's size follows the data: read back on the host (a GPU synchronizes)
    round_trips: bool = False  # decode(encode(x)) is x bit for bit, whatever x holds

    def spare_bytes(self, nbytes: int) -> int:
        """How much a blob profiled at ``nbytes`` may grow in another step: an eighth where its
        size follows the data (dropout draws other zeros every step, training moves a ReLU's),
        which the host arena keeps spare and the run's report allows for; else 0."""
        return nbytes // 8 if self.variable_size else 0


@functools.lru_cache(maxsize=None)
def _bits(device: torch.device) -> torch.Tensor:
    """Bit weights, made once per device: built from a Python list at every call it would be
    a host-to-device copy (a synchronization) in every pack and unpack hook."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def _mask_encode(flat: torch.Tensor) -> torch.Tensor:
    n = flat.numel()
    bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=flat.device)
    bits[:n] = flat > 0
    return (bits.view(-1, 8) * _bits(flat.device)).sum(1, dtype=torch.uint8)


def _mask_decode(blob: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    bits = (blob.unsqueeze(1) & _bits(blob.device)) != 0
    return bits.view(-1)[:numel].to(dtype)


def _as_bits(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_INT_OF[flat.element_size()])


def _sparse_encode(flat: torch.Tensor) -> torch.Tensor:
    nonzero = _as_bits(flat) != 0
    values = flat[nonzero].view(torch.uint8)
    mask = _mask_encode(nonzero)
    return torch.cat([mask, values])


def _sparse_decode(blob: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    head = -(-numel // 8)
    nonzero = _mask_decode(blob[:head], torch.bool, numel)
    raw = blob[head:]
    size = torch.empty(0, dtype=dtype).element_size()
    values = (raw if head % size == 0 else raw.clone()).view(dtype)
    out = torch.zeros(numel, dtype=dtype, device=blob.device)
    out[nonzero] = values
    return out


def _bf16_encode(flat: torch.Tensor) -> torch.Tensor:
    return flat.to(torch.bfloat16).view(torch.uint8)


def _bf16_decode(blob: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return blob.view(torch.bfloat16).to(dtype)


def _mask_size(flat: torch.Tensor) -> int:
    return -(-flat.numel() // 8)


def _sparse_size(flat: torch.Tensor) -> int:
    return _mask_size(flat) + int((_as_bits(flat) != 0).sum()) * flat.element_size()


ENCODERS: dict[str, Encoder] = names.table(names.ENCODERS, {e.name: e for e in [
    Encoder("sign-mask", True, _mask_encode, _mask_decode, lambda dt: dt.is_floating_point, _mask_size),
    Encoder("sparse", True, _sparse_encode, _sparse_decode, lambda dt: dt.itemsize in _INT_OF, _sparse_size,
            variable_size=True, round_trips=True),
    Encoder("bf16", False, _bf16_encode, _bf16_decode, lambda dt: dt in (torch.float32, torch.float64),
            lambda flat: 2 * flat.numel()),
]}, "encoders")


def usable_on(gpu: bool) -> tuple[str, ...]:
    """The encoders a step may run: on a GPU only those that never make the host wait for the
    device (module docstring)."""
    return tuple(name for name, e in ENCODERS.items() if not (gpu and e.variable_size))


def flat_storage(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``t`` as a flat tensor of ``t``'s dtype."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))

