"""The body/head split every model of ``pfl_algorithms`` follows, and the shape checks they share.

Algorithms address a model's parts by name: parameters under ``body.`` produce the embedding,
parameters under ``head.`` form the classifier (FedPer/FedRep keep it local, Fed-CMA shares
only it, Factorized-FL never sends it in the permuted settings).
"""
from __future__ import annotations

from typing import Annotated, Optional, Sequence

import torch
from torch import nn

from ..option_types import OneOf


class BodyHeadModel(nn.Module):
    """A classifier made of ``body`` (input -> embedding [N, E]) and ``head`` (Linear E -> classes).

    Attributes:
        body: any module mapping a batch of inputs to [N, embedding_dim].
        head: ``nn.Linear(embedding_dim, num_classes)``.
        embedding_dim: E, the width of the body's output.
        num_classes: the head's output width.
    """

    def __init__(self, body: nn.Module, embedding_dim: int, num_classes: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(embedding_dim, num_classes)
        self.embedding_dim = int(embedding_dim)
        self.num_classes = int(num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The body's output for ``x``: [N, embedding_dim]."""
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits [N, num_classes] = head(body(x))."""
        return self.head(self.body(x))


def head_parameter_names(model: nn.Module) -> list[str]:
    """Qualified names (as in ``model.named_parameters()``) of the classifier's parameters.

    They all start with ``"head."``; the names stay valid after ``pfl_kernels.nn.factorize`` /
    ``multibranch`` convert the model (then they name the converted layers' parameters).
    """
    _check_body_head(model)
    return [name for name, _ in model.named_parameters() if name.startswith("head.")]


def body_parameter_names(model: nn.Module) -> list[str]:
    """Qualified names of every parameter outside the head (the feature extractor), in order."""
    _check_body_head(model)
    return [name for name, _ in model.named_parameters() if not name.startswith("head.")]


def _check_body_head(model: nn.Module) -> None:
    if not (isinstance(getattr(model, "body", None), nn.Module) and isinstance(getattr(model, "head", None), nn.Module)):
        raise TypeError(f"{type(model).__name__} has no 'body' and 'head' child modules; "
                        "build it with pfl_algorithms.models.build_model")


def image_shape(name: str, input_shape: Sequence[int], min_size: int) -> tuple[int, int, int]:
    """Check that ``input_shape`` is (C, H, W) with H, W >= ``min_size``; return it as ints.

    Raises:
        ValueError: naming the model, the shape it got and what it needs.
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"{name} needs input_shape (C, H, W), got {tuple(input_shape)}")
    if min(shape[1:]) < min_size:
        raise ValueError(f"{name} needs inputs of at least {min_size}x{min_size}, got input_shape {shape}")
    return shape


def check_num_classes(num_classes: int) -> int:
    """``num_classes`` as an int >= 1, else ValueError."""
    if int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    return int(num_classes)


NORMS = ("batch", "group")
Norm = Optional[Annotated[str, OneOf(NORMS)]]  # the declared type of a model's ``norm`` option (None: none)


def conv_block(conv: nn.Conv2d, norm: str) -> list[nn.Module]:
    """``conv`` followed by its normalization, then a ReLU: 'batch' is BatchNorm2d (as after
    every convolution of the papers' ResNet-9), 'group' GroupNorm of 4 channels a group (no
    running statistics: nothing but parameters to average or generate, as pFedHN needs), None
    adds no module, so a model's parameter names (and checkpoints) are those it had before the
    option existed."""
    if norm is not None and norm not in NORMS:
        raise ValueError(f"norm must be one of 'batch', 'group' or None, got {norm!r}")
    width = conv.out_channels
    layer = {None: [], "batch": [nn.BatchNorm2d(width)], "group": [nn.GroupNorm(max(1, width // 4), width)]}[norm]
    return [conv, *layer, nn.ReLU(inplace=False)]


ACTIVATIONS = ("relu", "sigmoid", "tanh")
Activation = Optional[Annotated[str, OneOf(ACTIVATIONS)]]  # the declared type of an activation option


def make_activation(name, *, what: str) -> nn.Module:
    """'relu' / 'sigmoid' / 'tanh' / None (identity) as a module; never in place, so the
    models stay usable under ``torch.func.functional_call`` and ``vmap``."""
    table = {"relu": lambda: nn.ReLU(inplace=False), "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, None: nn.Identity}
    assert set(table) == {*ACTIVATIONS, None}
    if name not in table:
        raise ValueError(f"{what} must be one of 'relu', 'sigmoid', 'tanh' or None, got {name!r}")
    return table[name]()
