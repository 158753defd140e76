"""pFedMB's LeNet-5 CNN: conv 3→6 k5, maxpool 2, conv 6→16 k5, maxpool 2, fc 400→120,
fc 120→84, fc 84→10, ReLU between (shared/papers/README.md).

The input channels and the flatten size (400 at 32x32) follow ``input_shape``; the body ends
after fc 84 + ReLU and the head is fc 84→classes.  ``embedding_activation`` replaces that last
ReLU ('sigmoid': Fed-CMA's bounded embedding; None: linear).  ``norm='batch'`` puts BatchNorm
after each convolution (the normalized model of the demo), 'group' GroupNorm; None (the
default) neither, as the paper's network.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .base import Activation, BodyHeadModel, Norm, check_num_classes, conv_block, image_shape, make_activation


class LeNet5(BodyHeadModel):
    """LeNet-5 with an 84-d embedding; needs inputs of at least 16x16."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, embedding_activation: Activation = "relu",
                 norm: Norm = None):
        channels, height, width = image_shape("lenet5", input_shape, 16)
        # Each stage: valid 5x5 conv (-4), then 2x2 max pool (floor halving); the second conv needs
        # (H - 4) // 2 >= 5 and the flatten (H - 4) // 2 - 4 >= 2, so H >= 16.
        flat_h = ((height - 4) // 2 - 4) // 2
        flat_w = ((width - 4) // 2 - 4) // 2
        body = nn.Sequential(
            *conv_block(nn.Conv2d(channels, 6, 5), norm), nn.MaxPool2d(2),
            *conv_block(nn.Conv2d(6, 16, 5), norm), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * flat_h * flat_w, 120), nn.ReLU(inplace=False),
            nn.Linear(120, 84), make_activation(embedding_activation, what="embedding_activation"),
        )
        super().__init__(body, 84, check_num_classes(num_classes))
