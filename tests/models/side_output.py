"""A model that computes outputs its loss does not read, as transformers' BigBird does: each
block builds a side output (BigBird's attention probabilities) whose graph saves an index
made inside the block and dies when the block returns, and a pooler beside the head whose
weights get no gradient.  Each block also makes a table on its first call and keeps it, as
BEiT caches its relative position index, and stores a state on itself each call, its autograd
history with it, as RecurrentGemma's recurrent layer does."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.table: torch.Tensor | None = None  # made on the first call and kept, as BEiT caches its position index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0, 1, 16 * x.shape[-1]).view(16, -1)[: x.shape[-2]]
        h = torch.tanh(self.fc(x) + self.table)
        order = (torch.arange(h.numel()) % h.shape[-1]).view_as(h).flip(-1)  # new storage, saved by the gather
        probs = torch.gather(h, -1, order)  # the side output: let go as the block returns
        del probs
        self.state = torch.tanh(h.sum(-2))  # kept on the module, its history with it (RecurrentGemma's last state)
        return x + h


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)
        self.pooler = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return {"loss": self.head(x).square().mean(), "pooled": torch.tanh(self.pooler(x[:, 0]))}


def build(batch: int, width: int = 32, blocks: int = 3, seq: int = 8):
    torch.manual_seed(0)
    return Net(width, blocks), torch.randn(batch, seq, 16)
