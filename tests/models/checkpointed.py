"""A model as users write activation checkpointing: every ``every``-th residual block runs
under ``torch.utils.checkpoint`` (non-reentrant by default), with dropout on."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int, every: int, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 10)
        self.every, self.reentrant = every, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.every and i % self.every == 0 else block(x)
        return self.out(x)


def build(batch: int, width: int = 64, blocks: int = 6, every: int = 2, reentrant: int = 0):
    """``every=0``: no checkpointing."""
    return Net(width, blocks, every, bool(reentrant)), torch.randn(batch, 32)
