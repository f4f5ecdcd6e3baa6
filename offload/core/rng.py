"""The random state a step draws from, taken and put back whole: what a recomputed stage
replays and what the gradient check's reference step draws again.

Torch's CPU generator and the device's are not all of it: models draw from the global
generators of NumPy and of Python's ``random`` module too (transformers' Hubert and Wav2Vec2
pick the spans SpecAugment masks with ``np.random``).  Replaying torch's alone, the gradient
check's reference masked other spans than our step (its gradients 0.29 apart, called
nondeterministic kernels), and a re-run stage that masks would rebuild other tensors than
its forward saved.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch


class RngState(NamedTuple):
    """Every generator's state at one moment."""

    cpu: torch.Tensor
    device: torch.Tensor | None  # CUDA's, on a CUDA device
    numpy: Any  # ``np.random.get_state()``
    python: Any  # ``random.getstate()``


def rng_state(device: torch.device) -> RngState:
    """The state of every generator a step on ``device`` may draw from."""
    return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                    np.random.get_state(), random.getstate())


def torch_draws(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Torch's generators as they stand, to tell whether a call drew from them (``drew``)."""
    return (torch.get_rng_state(),) + ((torch.cuda.get_rng_state(device),) if device.type == "cuda" else ())


def drew(before: tuple[torch.Tensor, ...], device: torch.device) -> bool:
    """Whether torch's generators moved since ``before`` (``torch_draws``): the states are host
    bytes, compared as arrays (no torch op, which a step's sync detector would take for a
    read of the device)."""
    return not all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(before, torch_draws(device)))


def set_rng_state(state: RngState, device: torch.device) -> None:
    """Put every generator back to ``state``."""
    torch.set_rng_state(state.cpu)
    if state.device is not None:
        torch.cuda.set_rng_state(state.device, device)
    np.random.set_state(state.numpy)
    random.setstate(state.python)


@contextlib.contextmanager
def forked_rng(device: torch.device) -> Iterator[None]:
    """Whatever the block draws, every generator is as it was when the block ends."""
    before = rng_state(device)
    try:
        yield
    finally:
        set_rng_state(before, device)
