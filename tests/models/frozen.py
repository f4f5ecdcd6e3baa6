"""A frozen backbone (its parameters need no gradient) under a small trainable head: the
fine-tuning setup where only the head trains.  The backbone saves nothing for the backward
(no gradient flows into it); the head's blocks do."""
from __future__ import annotations

import torch
from torch import nn


def build(batch: int, width: int = 128, backbone: int = 6, head: int = 3, seq: int = 64):
    torch.manual_seed(0)
    trunk = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(backbone)))
    trunk.requires_grad_(False)
    top = nn.Sequential(*(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                          for _ in range(head)), nn.Linear(width, 10))
    return nn.Sequential(trunk, top), torch.randn(batch, seq, width)
