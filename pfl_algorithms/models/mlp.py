"""A multilayer perceptron over flattened inputs, for feature vectors and small images.

``hidden=(2, 2)`` with ``activation=None`` on 2-d inputs is Fed-CMA's toy network
Linear(2, 2) → Linear(2, 2) → Linear(2, 4); ``hidden=()`` is logistic regression.
``embedding_activation`` is the last hidden layer's activation: 'same' (the default) is
``activation``; 'sigmoid' bounds the embedding in [0, 1] as Fed-CMA's analysis assumes.
"""
from __future__ import annotations

import math
from typing import Annotated, Optional, Sequence, Union

from torch import nn

from ..option_types import OneOf, PositiveInt
from .base import ACTIVATIONS, Activation, BodyHeadModel, check_num_classes, make_activation

EmbeddingActivation = Optional[Annotated[str, OneOf((*ACTIVATIONS, "same"))]]


class MLP(BodyHeadModel):
    """Flatten, then Linear + activation for each width in ``hidden``; the head maps the last
    width (or the flattened input when ``hidden`` is empty) to the classes."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *,
                 hidden: Union[PositiveInt, Sequence[PositiveInt]] = (128,), activation: Activation = "relu",
                 embedding_activation: EmbeddingActivation = "same"):
        shape = tuple(int(s) for s in input_shape)
        if not shape or min(shape) < 1:
            raise ValueError(f"mlp needs a non-empty input_shape of positive sizes, got {tuple(input_shape)}")
        widths = [int(h) for h in (hidden if not isinstance(hidden, int) else (hidden,))]
        if any(w < 1 for w in widths):
            raise ValueError(f"hidden widths must be positive, got {tuple(hidden)}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(shape)
        last = activation if embedding_activation == "same" else embedding_activation
        for i, out in enumerate(widths):
            layers += [nn.Linear(width, out), make_activation(last if i == len(widths) - 1 else activation,
                                                              what="embedding_activation" if i == len(widths) - 1
                                                              else "activation")]
            width = out
        super().__init__(nn.Sequential(*layers), width, check_num_classes(num_classes))
