"""A model whose forward leaves a reference cycle holding a tensor, as a transformers
TimeSeriesTransformer's output distribution holds its scaler's outputs: the cycle is garbage
from the block's return on, and Python's collector frees it whenever it next runs."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        kept = {"scaled": h * 2}
        kept["itself"] = kept  # a cycle: nothing but the collector frees it
        return x + kept["scaled"]


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(batch: int, width: int = 32, blocks: int = 3):
    torch.manual_seed(0)
    return Net(width, blocks), torch.randn(batch, 8, 16)
