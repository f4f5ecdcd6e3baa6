"""An encoder as transformers' speech and translation models write theirs: positions added
and a functional dropout applied in the model's own code before the first block, outside any
module call, and every block called with keyword arguments only (the hidden state among
them, after a tensor that carries no gradient), so a cut at the first block's start falls on
an input that is not the call's first value (``Site.before`` with a leaf: ``layers.0:in[1]``)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, *, bias: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.drop(self.fc2(F.gelu(self.fc1(self.norm(hidden))))) + bias


class Encoder(nn.Module):
    def __init__(self, width: int, blocks: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.positions = nn.Parameter(torch.randn(seq, width) * 0.02)
        self.layers = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.embed(x) + self.positions, p=0.1, training=self.training)
        bias = torch.zeros(h.shape[-1], device=h.device)  # no gradient: no cut is blocked by it
        for layer in self.layers:
            h = layer(bias=bias, hidden=h)
        return self.head(h.mean(1))


def build(batch: int, width: int = 32, blocks: int = 3, seq: int = 8):
    torch.manual_seed(0)
    return Encoder(width, blocks, seq), torch.randn(batch, seq, 16)
