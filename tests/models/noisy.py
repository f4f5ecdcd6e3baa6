"""A model with a kernel that is not deterministic, as cuDNN's and some atomics-based CUDA
kernels are: its backward adds a tiny error that no random state the gradient check replays
governs (seeded from the operating system at every forward, so each run draws other
numbers).  Two runs of the same step differ by about 1e-6 of the gradient: noise the
gradient check must tell from a defect."""
from __future__ import annotations

import os

import torch
from torch import nn


class Jitter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(noise)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        noise, = ctx.saved_tensors
        return grad * (1 + noise), None


def _jitter() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        noise = 1e-6 * torch.randn(x.shape, generator=_jitter())
        return self.out(Jitter.apply(x, noise))


class Reseeded(Noisy):
    """Seeds the global generator from the operating system at every forward, then drops out
    (Reformer's reversible layers seed their attention with ``torch.seed()``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(torch.seed() % 2 ** 62)
        for layer in self.layers:
            x = nn.functional.dropout(torch.relu(layer(x)), 0.5, self.training)
        return self.out(x)


def build(batch: int, reseeded: int = 0):
    return (Reseeded() if reseeded else Noisy()), torch.randn(batch, 32)
