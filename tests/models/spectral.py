"""A model whose blocks multiply a spectrum by another's conjugate, as transformers' Autoformer
correlates its queries and keys: ``torch.conj`` is a view with the conjugate bit set over the
same bytes, and the product saves it for the backward."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = torch.fft.rfft(self.q(x), dim=1), torch.fft.rfft(self.k(x), dim=1)
        corr = torch.fft.irfft(q * torch.conj(k), n=x.shape[1], dim=1)  # saves conj(k), a conjugate view
        return x + torch.tanh(corr)


def build(batch: int, width: int = 16, blocks: int = 3, seq: int = 12):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, width), *(Block(width) for _ in range(blocks)), nn.Linear(width, 4))
    return net, torch.randn(batch, seq, 8)
