"""A U-Net as diffusion and segmentation models build it: an encoder of ``depth`` down
blocks, a middle block, and a decoder whose up blocks concatenate the encoder's features of
the same resolution (skip connections), so that several feature maps cross every boundary
between the first down block and the last up block."""
from __future__ import annotations

import torch
from torch import nn


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())


class Up(nn.Module):
    """An up block handed the list of skip features, from which it takes its own (``pop``), as
    many U-Nets' code does: its call changes an argument, the list, which a re-run of it must
    be given as it was."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.block = _block(cin, cout)

    def forward(self, x: torch.Tensor, skips: list[torch.Tensor]) -> torch.Tensor:
        x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.block(torch.cat([x, skips.pop()], dim=1))


class UNet(nn.Module):
    def __init__(self, width: int, depth: int, pop_in_blocks: bool = False) -> None:
        super().__init__()
        chans = [width * 2 ** d for d in range(depth + 1)]
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.down = nn.ModuleList(_block(chans[d], chans[d + 1]) for d in range(depth))
        self.middle = _block(chans[depth], chans[depth])
        up = Up if pop_in_blocks else _block
        self.up = nn.ModuleList(up(2 * chans[d + 1], chans[d]) for d in reversed(range(depth)))
        self.pop_in_blocks = pop_in_blocks
        self.head = nn.Conv2d(width, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = nn.functional.avg_pool2d(x, 2)
        x = self.middle(x)
        for block in self.up:
            if self.pop_in_blocks:
                x = block(x, skips)
                continue
            x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)


def build(batch: int, width: int = 16, depth: int = 3, image: int = 64, pop_in_blocks: int = 0):
    torch.manual_seed(0)
    return UNet(width, depth, bool(pop_in_blocks)), torch.randn(batch, 3, image, image)
