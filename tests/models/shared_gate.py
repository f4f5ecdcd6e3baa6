"""A model whose first block makes a tensor that every block's backward reads (as a causal
mask made once is read by every attention's backward): its unit is the first block's, but it
is needed from the last block's backward on."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * gate


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        gate = torch.sigmoid(x.detach().sum(-1, keepdim=True)).expand_as(x).contiguous()
        for block in self.blocks:
            x = block(x, gate)
        return self.out(x)


def build(batch: int, width: int = 64, blocks: int = 3):
    return Net(width, blocks), torch.randn(batch, 16)
