"""pFedHN's CIFAR target network (``CNNTarget`` in ``experiments/pfedhn/models.py`` of
github.com/AvivSham/pFedHN): conv in→n_kernels k5, ReLU, maxpool 2, conv n_kernels→2·n_kernels
k5, ReLU, maxpool 2, flatten (2·n_kernels·5·5 at 32x32), fc →120 + ReLU, fc 120→84, fc
84→classes; n_kernels = 16 (the code's ``--nkernels``).  No BatchNorm: the hypernetwork
generates every weight, and there are no statistics for it to generate.

The body ends at the 84-d embedding (``CNNTargetPC``'s output, on which pFedHN-PC's local
``LocalLayer`` classifier sits).  ``embedding_activation`` is applied to it: 'relu' by default
(the code's ``F.relu(self.fc2(x))``), 'sigmoid' bounds it in [0, 1] as Fed-CMA's analysis
assumes, None leaves the linear output as is.  The flatten size follows ``input_shape``.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..option_types import PositiveInt
from .base import Activation, BodyHeadModel, check_num_classes, image_shape, make_activation


class PFedHNCNN(BodyHeadModel):
    """pFedHN's CNNTarget with an 84-d embedding; needs inputs of at least 16x16."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, n_kernels: PositiveInt = 16,
                 embedding_activation: Activation = "relu"):
        channels, height, width = image_shape("pfedhn-cnn", input_shape, 16)
        # Each stage: valid 5x5 conv (-4), then 2x2 max pool (floor halving); the second conv needs
        # (H - 4) // 2 >= 5 and the flatten (H - 4) // 2 - 4 >= 2, so H >= 16.
        flat_h = ((height - 4) // 2 - 4) // 2
        flat_w = ((width - 4) // 2 - 4) // 2
        body = nn.Sequential(
            nn.Conv2d(channels, n_kernels, 5), nn.ReLU(inplace=False), nn.MaxPool2d(2, 2),
            nn.Conv2d(n_kernels, 2 * n_kernels, 5), nn.ReLU(inplace=False), nn.MaxPool2d(2, 2),
            nn.Flatten(),
            nn.Linear(2 * n_kernels * flat_h * flat_w, 120), nn.ReLU(inplace=False),
            nn.Linear(120, 84),
            make_activation(embedding_activation, what="embedding_activation"),
        )
        super().__init__(body, 84, check_num_classes(num_classes))
