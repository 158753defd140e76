"""A small CNN for scikit-learn's 8x8 digits: conv 1→16 k3 p1 + ReLU, conv 16→32 k3 p1 + ReLU,
maxpool 2, flatten (512 at 8x8), linear 512→64 + ReLU; head 64→classes.

``embedding_activation`` replaces the last ReLU: 'sigmoid' bounds the embedding in [0, 1] as
Fed-CMA's analysis assumes (the default of a mixed-architecture federation), None leaves it linear.

``norm='group'`` (the default) puts GroupNorm after each convolution, 'batch' BatchNorm (the
demo's), None neither (the model as it was before the option existed).  Unnormalized, 20
digits clients at lr 0.05 stayed at chance for the first rounds (FedAvg 10.6, 8.3, 5.0% over
three rounds); GroupNorm has no running statistics, so every algorithm can share or generate
the whole model (pFedHN refuses BatchNorm's).

Sized so that a 20-client federation trains in seconds on a CPU.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..option_types import PositiveInt
from .base import Activation, BodyHeadModel, Norm, check_num_classes, conv_block, image_shape, make_activation


class DigitsCNN(BodyHeadModel):
    """The digits CNN with a 64-d embedding; needs inputs of at least 2x2."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, embedding_dim: PositiveInt = 64,
                 embedding_activation: Activation = "relu", norm: Norm = "group"):
        channels, height, width = image_shape("digits-cnn", input_shape, 2)
        body = nn.Sequential(
            *conv_block(nn.Conv2d(channels, 16, 3, padding=1), norm),
            *conv_block(nn.Conv2d(16, 32, 3, padding=1), norm),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * (height // 2) * (width // 2), embedding_dim),
            make_activation(embedding_activation, what="embedding_activation"),
        )
        super().__init__(body, embedding_dim, check_num_classes(num_classes))
