"""A linear layer called at the start and again at the end of the forward (a weight shared by
two stages, as tied input and output projections are): under autocast its cached cast is
read by both, and a second cast would round its gradient differently.  ``shared=0``: the
last call goes to a layer of its own."""
from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int, blocks: int, shared: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = self.proj if shared else nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(batch: int, width: int = 32, blocks: int = 3, shared: int = 1):
    return Net(width, blocks, bool(shared)), torch.randn(batch, width)
