"""Two ResNet-9s.

``ResNet9``, of the Factorized-FL released code (layer list in shared/papers/README.md):
conv 3→64 k3 p1; conv 64→128 k5 s2 p2; residual(two 128→128 k3); conv 128→256 k3 p1;
maxpool 2; residual(two 256→256 k3); conv 256→256 k3 p0; adaptive max pool 1; flatten;
linear 256→classes.

``ResNet9DAWNBench``, of widths 64-128-256-512 (FedDAF's CIFAR-10 network in the README of
shared/papers; the widths are those of Page's DAWNBench ResNet-9, which this follows): conv
3→64; conv 64→128, maxpool 2, residual(two 128→128); conv 128→256, maxpool 2; conv 256→512,
maxpool 2, residual(two 512→512); adaptive max pool 1; flatten; linear 512→classes.  Every
conv is k3 p1.  (Page's network also multiplies the logits by 0.125; the paper does not say
that FedDAF did, so this keeps the plain linear head of the other models.)

Every conv is conv (no bias) + BatchNorm + ReLU.  ``width`` narrows either for CPU-scale
runs: the widths 64, 128, 256 (, 512) become width, 2·width, 4·width (, 8·width); the papers'
networks are width 64.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import BodyHeadModel, check_num_classes, image_shape


def conv_bn_relu(cin: int, cout: int, kernel: int = 3, stride: int = 1, padding: int = 1) -> nn.Sequential:
    """Conv2d without bias (BatchNorm's shift makes it redundant) + BatchNorm2d + ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=False))


def _check_width(model: str, width) -> int:
    """``width`` if it is a positive integer (not a bool), else ValueError naming the model."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"{model} option width must be a positive integer, got {width!r}")
    return width


class Residual(nn.Module):
    """x + two conv-BN-ReLU blocks (k3 p1, same width) applied to x."""

    def __init__(self, channels: int):
        super().__init__()
        self.res = nn.Sequential(conv_bn_relu(channels, channels), conv_bn_relu(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + res(x); out of place so autograd and functional_call see a pure function."""
        return x + self.res(x)


class ResNet9(BodyHeadModel):
    """ResNet-9 with a 4·width-d embedding (256 at the paper's width 64); needs inputs of at
    least 11x11 (the p0 conv needs 3x3)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, width: int = 64):
        channels, _, _ = image_shape("resnet9", input_shape, 11)
        w1, w2, w4 = (k * _check_width("resnet9", width) for k in (1, 2, 4))
        body = nn.Sequential(
            conv_bn_relu(channels, w1),
            conv_bn_relu(w1, w2, kernel=5, stride=2, padding=2),
            Residual(w2),
            conv_bn_relu(w2, w4),
            nn.MaxPool2d(2),
            Residual(w4),
            conv_bn_relu(w4, w4, padding=0),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        super().__init__(body, w4, check_num_classes(num_classes))


class ResNet9DAWNBench(BodyHeadModel):
    """ResNet-9 of widths 64-128-256-512 with a 8·width-d embedding (512 at width 64); needs
    inputs of at least 8x8 (three 2x2 max pools)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, width: int = 64):
        channels, _, _ = image_shape("resnet9-dawnbench", input_shape, 8)
        w1, w2, w4, w8 = (k * _check_width("resnet9-dawnbench", width) for k in (1, 2, 4, 8))
        body = nn.Sequential(
            conv_bn_relu(channels, w1),
            conv_bn_relu(w1, w2), nn.MaxPool2d(2), Residual(w2),
            conv_bn_relu(w2, w4), nn.MaxPool2d(2),
            conv_bn_relu(w4, w8), nn.MaxPool2d(2), Residual(w8),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        super().__init__(body, w8, check_num_classes(num_classes))
