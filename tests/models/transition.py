"""Blocks nested as DenseNet nests its transitions: ``features`` is a ``Sequential`` whose
transition is a ``Sequential`` too (a norm, then an activation and a narrowing linear layer),
so the outer loop's ``input`` holds the transition's input until the transition returns.
Cut at each inner layer, the norm's stage saves that input (its unit); when the norm is
recomputed or offloaded the input dies only as the stage after the transition starts, after
the reading that ends it, so that stage's first reading holds it.  That stage is a deep
narrow block (its layers joined by residual sums, so no cut inside it): it saves far more
than the input's bytes, and when it is recomputed itself it grows by less than them."""
from __future__ import annotations

import torch
from torch import nn


class Deep(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


def build(batch: int, width: int = 128, narrow: int = 16, layers: int = 6, seq: int = 6):
    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Linear(8, width),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)),
        nn.Sequential(nn.LayerNorm(width), nn.GELU(), nn.Linear(width, narrow)),  # the transition
        Deep(narrow, layers),
        nn.Linear(narrow, 4),
    )
    return features, torch.randn(batch, seq, 8)
