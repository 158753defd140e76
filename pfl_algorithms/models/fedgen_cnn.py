"""FedGen's MNIST/EMNIST network, the one Fed-CMA reuses (shared/papers/README.md):
conv 1→6 k3 s2 p1 + BN + ReLU, conv 6→16 k3 s2 p1 + BN + ReLU, flatten (784 at 28x28),
linear 784→32, linear 32→classes.

The body ends at the 32-d embedding.  ``embedding_activation`` is applied to it: 'relu' by
default (two linear layers back to back would collapse into one), 'sigmoid' bounds the
embedding in [0, 1] as Fed-CMA's analysis assumes, None leaves the linear output as is.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..option_types import PositiveInt
from .base import Activation, BodyHeadModel, check_num_classes, image_shape, make_activation


class FedGenCNN(BodyHeadModel):
    """FedGen's CNN with an ``embedding_dim``-wide (32) embedding; needs inputs of at least 1x1."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *,
                 embedding_activation: Activation = "relu", embedding_dim: PositiveInt = 32):
        channels, height, width = image_shape("fedgen-cnn", input_shape, 1)
        # k3 s2 p1 maps n to ceil(n / 2); twice.
        flat_h = (((height + 1) // 2) + 1) // 2
        flat_w = (((width + 1) // 2) + 1) // 2
        body = nn.Sequential(
            nn.Conv2d(channels, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=False),
            nn.Conv2d(6, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=False),
            nn.Flatten(),
            nn.Linear(16 * flat_h * flat_w, embedding_dim),
            make_activation(embedding_activation, what="embedding_activation"),
        )
        super().__init__(body, embedding_dim, check_num_classes(num_classes))
