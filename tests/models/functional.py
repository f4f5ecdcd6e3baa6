"""Blocks joined by the model's own functional code, as BART, Whisper and DenseNet write
theirs: between two block calls a ``F.gelu`` and a ``F.dropout`` (each saves a tensor for the
backward outside any module call) and an in-place scale of the dropout's output, then the
residual sum.  A stage is that code and the next block; its re-run replays the functions
with the block, in order."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Joined(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = F.dropout(F.gelu(block(h)), p=0.1, training=self.training).mul_(0.5) + h
        return self.head(h)


def build(batch: int, width: int = 16, blocks: int = 4, seq: int = 6):
    torch.manual_seed(0)
    return Joined(width, blocks), torch.randn(batch, seq, 8)
