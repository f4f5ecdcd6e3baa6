"""A model whose backward reads saved tensors no copy engine can move as bytes, as real
kernels save them: a 0-dim tensor on another device than the model (CUDA's flash attention
keeps its random seed on the CPU; here the model is on the CPU and the stand-in is a
``meta`` tensor), a sparse tensor and a tensor subclass.  The executor must leave all three
where they are and move the rest."""
from __future__ import annotations

import torch
from torch import nn


class Tagged(torch.Tensor):
    """A tensor subclass (DTensor and float8 tensors are others)."""


class OddSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        mask = (x > 0).to(x.dtype)
        ctx.save_for_backward(x, mask.to_sparse(), mask.as_subclass(Tagged), torch.empty((), device="meta"))
        return x * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        x, sparse, tagged, seed = ctx.saved_tensors
        assert seed.device.type == "meta" and type(tagged) is Tagged and sparse.layout == torch.sparse_coo
        return grad * sparse.to_dense() * tagged.as_subclass(torch.Tensor) * (x == x)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OddSaves.apply(self.fc(x))


def build(batch: int, width: int = 64, blocks: int = 4):
    return nn.Sequential(*(Block(width) for _ in range(blocks)), nn.Linear(width, 10)), torch.randn(batch, width)
