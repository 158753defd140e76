"""The ``flip`` step: torchvision ``RandomHorizontalFlip(p)``, one draw per sample."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from ._checks import check_batch, check_generator, check_probability
from .step import Step, draw_bernoulli


def draw_flips(batch: int, p: float, generator: torch.Generator) -> Tensor:
    """bool [batch] on the CPU, True where the image is flipped: ``torch.rand(batch) < p``
    (float64 draws), as torchvision's ``RandomHorizontalFlip(p)`` per sample."""
    return draw_bernoulli(batch, p, generator)


def horizontal_flip(x: Tensor, generator: torch.Generator, *, p: float = 0.5) -> Tensor:
    """Mirror each image of ``x`` [B, C, H, W] left-right with probability ``p`` (:func:`draw_flips`)."""
    check_batch(x)
    check_generator(generator)
    flip = draw_flips(x.shape[0], p, generator).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


class Flip(Step):
    """:func:`horizontal_flip` as a step (geometric)."""

    name = "flip"
    description = "horizontal flip with probability p (RandomHorizontalFlip(0.5))"
    defaults = {"p": 0.5}

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_probability("flip p", options["p"])

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return horizontal_flip(x, generator, **self.options)
