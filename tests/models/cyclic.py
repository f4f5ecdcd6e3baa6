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


def build(batch: int, width: int = 32, blocks: int = 3):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, width), *(Block(width) for _ in range(blocks)), nn.Linear(width, 4))
    return net, torch.randn(batch, 8, 16)
