"""A model that draws its masks from NumPy's global generator, as transformers' Hubert and
Wav2Vec2 pick the spans SpecAugment masks: each block masks a third of its positions,
picked at random, written in place into its input's projection (as many every step: the
memory its backward takes is the same)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.masked = nn.Linear(width, width), nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        picked = np.zeros(h.shape[:-1], dtype=bool).reshape(-1)  # a third of the positions, at random
        picked[np.random.permutation(picked.size)[:picked.size // 3]] = True
        spans = torch.from_numpy(picked.reshape(h.shape[:-1]))
        h[spans] = self.masked  # as SpecAugment writes its masked embedding
        return x + torch.tanh(h)


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(batch: int, width: int = 32, blocks: int = 3, seq: int = 16):
    torch.manual_seed(0)
    return Net(width, blocks), torch.randn(batch, seq, 16)
