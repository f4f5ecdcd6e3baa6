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


class ComplexBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return c * torch.sigmoid(self.gate(c.real))  # saves its input, a conjugate view


class Rotating(nn.Module):
    """Between its blocks the model's own code views the real features as complex pairs and
    conjugates them, as rotary embeddings view queries (``view_as_complex``): each block's
    argument is a view of the previous block's output in another dtype, with the conjugate
    bit set, which a re-run must rebuild as that, not as the bytes read as the output reads
    them."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.width = width
        self.inp = nn.Linear(8, 2 * width)
        self.blocks = nn.ModuleList(ComplexBlock(width) for _ in range(blocks))
        self.out = nn.Linear(2 * width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            c = torch.view_as_complex(h.unflatten(-1, (self.width, 2)))
            h = torch.view_as_real(block(c.conj())).flatten(-2)
        return self.out(h)


def build_rotating(batch: int, width: int = 8, blocks: int = 4, seq: int = 6):
    torch.manual_seed(0)
    return Rotating(width, blocks), torch.randn(batch, seq, 8)
