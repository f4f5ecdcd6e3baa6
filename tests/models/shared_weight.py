"""A linear layer called at the start and again at the end of the forward (a weight shared by
two stages, as tied input and output projections are): under autocast its cached cast is
read by both, and a second cast would round its gradient differently.  ``shared=0``: the
last call goes to a layer of its own.  ``twice=1``: each block reads its linear layer's
weight twice (a weight read by two ops of one stage: a cache cleared at the boundaries
still casts it once, no cache at all would cast it twice)."""
from __future__ import annotations

import torch
from torch import nn


class Twice(nn.Module):
    """A linear layer's weight read by two ops, with no module call between them to cut at."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = nn.functional.gelu(nn.functional.linear(x, self.linear.weight, self.linear.bias))
        return x


class Net(nn.Module):
    def __init__(self, width: int, blocks: int, shared: bool, twice: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = self.proj if shared else nn.Linear(width, width)
        self.blocks = nn.ModuleList(Twice(width) if twice else nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(batch: int, width: int = 32, blocks: int = 3, shared: int = 1, twice: int = 0):
    return Net(width, blocks, bool(shared), bool(twice)), torch.randn(batch, width)
