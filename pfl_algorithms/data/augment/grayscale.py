"""The ``grayscale`` step: torchvision ``RandomGrayscale(p)``, one draw per sample."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from ._checks import check_batch, check_colour_channels, check_generator, check_probability
from .colour import rgb_to_grayscale
from .step import Step, draw_bernoulli


def draw_grayscale(batch: int, p: float, generator: torch.Generator) -> Tensor:
    """bool [batch] on the CPU, True where the image turns grey: ``torch.rand(batch) < p`` (float64)."""
    return draw_bernoulli(batch, p, generator)


def random_grayscale(x: Tensor, generator: torch.Generator, *, p: float = 0.2) -> Tensor:
    """torchvision ``RandomGrayscale(p)`` on the pixel-scale batch ``x`` [B, C, H, W] (C = 1 or 3):
    the chosen RGB images (:func:`draw_grayscale`) become their luma repeated on 3 channels.

    Grey (1-channel) images are returned as they are (the draw still happens, so the generator
    advances the same way whatever the channels).
    """
    check_batch(x)
    check_generator(generator)
    check_colour_channels(x, "grayscale")
    grey = draw_grayscale(x.shape[0], p, generator)
    if x.shape[1] == 1:
        return x
    return torch.where(grey.to(x.device)[:, None, None, None], rgb_to_grayscale(x).expand_as(x), x)


class Grayscale(Step):
    """:func:`random_grayscale` as a step (photometric)."""

    name = "grayscale"
    description = "luma on all channels with probability p (RandomGrayscale(0.2))"
    defaults = {"p": 0.2}
    photometric = True

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_probability("grayscale p", options["p"])

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return random_grayscale(x, generator, **self.options)
