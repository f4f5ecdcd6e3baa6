"""Blocks with dropout whose model draws one random number before each block while it trains,
outside any module call, as transformers' encoder-decoders before 5.2x drew their LayerDrop
probability (``torch.rand([])``) even at a rate of 0 (Whisper in transformers 5.17, the GPU
machines'): a re-run of a block that does not draw it again draws other dropout masks than
its forward did."""
from __future__ import annotations

import torch
from torch import nn


class LayerDraws(nn.Module):
    def __init__(self, width: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout))
                                    for _ in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.training:
                torch.rand([])  # the LayerDrop draw, its rate 0: every block runs
            x = block(x)
        return self.head(x)


def build(batch: int, width: int = 32, layers: int = 3, dropout: float = 0.1):
    torch.manual_seed(0)
    return LayerDraws(width, layers, dropout), torch.randn(batch, width)
