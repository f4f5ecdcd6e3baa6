"""A model that fills a cache on its first call and reads it in every block, as transformers'
Wav2Vec2-Conformer makes its rotary table once (an attribute that is ``None`` until then) and
every layer's attention multiplies by it (each saves it for its backward)."""
from __future__ import annotations

import torch
from torch import nn


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cached: torch.Tensor | None = None  # filled by the first call, kept from then on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cached is None:
            self.cached = torch.linspace(0.5, 1.5, x.shape[-2] * x.shape[-1]).view(x.shape[-2:])
        return self.cached


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * table  # saves the table


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.table = Table()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        table = self.table(x)
        for block in self.blocks:
            x = block(x, table)
        return self.head(x)


def build(batch: int, width: int = 32, blocks: int = 3, seq: int = 8):
    torch.manual_seed(0)
    return Net(width, blocks), torch.randn(batch, seq, 16)
