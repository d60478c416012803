"""A compact UNet: the catalog's segmentation model.

DVABatch's paper serves UNet beside classifiers because its shape is unlike
theirs: the encoder's early levels are wide in space and narrow in channels,
the bottleneck the reverse, and the decoder needs tensors the encoder made
long before (the skip connections).  A stage cut in the middle of it hands
the next stage several live tensors, not one, which is what makes it a test
of the segment mechanism as much as a workload.

This is the architecture of Ronneberger et al., "U-Net: Convolutional
Networks for Biomedical Image Segmentation" (MICCAI 2015) with padded
convolutions (so the output map has the input's size) and batch norm, at a
width a 2-core machine serves in a few hundred milliseconds: ``base`` channels
at the first level, doubling at each of ``depth`` levels down.  The output is
one logit per class per pixel, ``[B, classes, H, W]``; H and W must be
divisible by ``2**depth``.
"""

from __future__ import annotations

import torch
from torch import nn


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, classes: int = 2, base: int = 32, depth: int = 4) -> None:
        super().__init__()
        if depth < 1 or base < 1 or classes < 1:
            raise ValueError(f"UNet needs depth, base and classes ≥ 1, got {depth}, {base}, {classes}")
        self.depth = depth
        widths = [base * 2**level for level in range(depth + 1)]
        self.down = nn.ModuleList([_double_conv(in_channels, widths[0])])
        self.down.extend(_double_conv(widths[i], widths[i + 1]) for i in range(depth))
        self.pool = nn.MaxPool2d(2)
        levels = list(reversed(range(depth)))
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in levels)
        self.merge = nn.ModuleList(_double_conv(2 * widths[i], widths[i]) for i in levels)
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        skips = []
        x = self.down[0](pixels)
        for block in self.down[1:]:
            skips.append(x)
            x = block(self.pool(x))
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([skip, up(x)], dim=1))
        return self.head(x)
