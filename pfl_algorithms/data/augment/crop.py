"""The ``crop`` step: torchvision ``RandomCrop(size, padding)``, a crop of the input's own size
from the image padded on every side, at offsets drawn per sample; and the crop-then-flip that
the pipeline runs as one gather when ``flip`` directly follows ``crop``."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from ._checks import check_batch, check_generator
from .flip import Flip, draw_flips
from .step import PipelineContext, Step

Fill = Union[float, Sequence[float], Tensor]


def check_padding(padding) -> int:
    """``padding`` unchanged, or ValueError unless it is an int >= 0."""
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an int >= 0, got {padding!r}")
    return padding


def draw_crop_offsets(batch: int, padding: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The crop's (top, left) offsets in the padded image, int64 [batch] each, on the CPU.

    Each uniform on the integers [0, 2 * padding], independently per sample and axis, as
    torchvision's ``RandomCrop(size, padding)`` for a crop of the input's own size.  Draws one
    ``torch.randint(0, 2 * padding + 1, (2, batch))``: row 0 the tops, row 1 the lefts.
    """
    padding = check_padding(padding)
    offsets = torch.randint(0, 2 * padding + 1, (2, batch), generator=generator)
    return offsets[0], offsets[1]


def _channel_values(value: Fill, channels: int, like: Tensor, name: str) -> Tensor:
    """A scalar or one value per channel, as a [C, 1, 1] tensor of ``like``'s dtype and device."""
    values = torch.as_tensor(value, dtype=like.dtype).to(like.device).reshape(-1)
    if values.numel() not in (1, channels):
        raise ValueError(f"{name} must be a number or one value per channel ({channels}), got {values.numel()} values")
    return values.expand(channels).reshape(channels, 1, 1)


def crop_padded(x: Tensor, top: Tensor, left: Tensor, *, padding: int, fill: Fill = 0.0,
                flip: Optional[Tensor] = None) -> Tensor:
    """Crop each image of ``x`` [B, C, H, W], padded by ``padding`` on every side with ``fill``
    (a number or one per channel), back to H x W at its own (``top[b]``, ``left[b]``) in the
    padded image.  ``flip``: optional bool [B], mirror those crops left-right (the same as a
    flip after the crop, done in the same gather).

    The padded batch is built once, then one gather reads each sample's window: output pixel
    (i, j) of sample b is padded pixel (top[b] + i, left[b] + j) (or left[b] + W - 1 - j when
    flipped).  Pure data movement: the values are copied exactly.
    """
    check_batch(x)
    padding = check_padding(padding)
    batch, channels, height, width = x.shape
    padded_w = width + 2 * padding
    padded = x.new_empty(batch, channels, height + 2 * padding, padded_w)
    padded.copy_(_channel_values(fill, channels, x, "fill").expand_as(padded))
    padded[:, :, padding:padding + height, padding:padding + width] = x
    offsets = torch.stack((top, left)).to(device=x.device, dtype=torch.int64)
    rows = offsets[0, :, None] + torch.arange(height, device=x.device)  # [B, H]
    steps = torch.arange(width, device=x.device).expand(batch, width)
    if flip is not None:
        steps = torch.where(flip.to(x.device)[:, None], width - 1 - steps, steps)
    cols = offsets[1, :, None] + steps  # [B, W]
    flat = (rows[:, :, None] * padded_w + cols[:, None, :]).reshape(batch, 1, height * width)
    out = padded.reshape(batch, channels, -1).gather(2, flat.expand(batch, channels, height * width))
    return out.view(batch, channels, height, width)


def random_crop(x: Tensor, generator: torch.Generator, *, padding: int = 4, fill: Fill = 0.0) -> Tensor:
    """torchvision ``RandomCrop((H, W), padding=padding, fill=fill)`` on every image of ``x``
    [B, C, H, W], each at its own offsets (:func:`draw_crop_offsets`).

    ``fill`` is on ``x``'s scale: 0 is black for pixel-scale images; for normalized images
    black is ``-mean / std`` per channel (what :class:`Augmentation` passes).
    """
    check_batch(x)
    check_generator(generator)
    top, left = draw_crop_offsets(x.shape[0], padding, generator)
    return crop_padded(x, top, left, padding=padding, fill=fill)


def _fill_on_scale(fill: Fill, x: Tensor, context: PipelineContext) -> Fill:
    """The pixel-scale ``fill`` on ``x``'s scale: per channel ``(fill - mean) / std`` once normalized."""
    if context.mean is None:
        return fill
    return (_channel_values(fill, x.shape[1], x, "fill") - context.mean) / context.std


class Crop(Step):
    """:func:`random_crop` as a step (geometric; its ``fill`` is on the pixel scale)."""

    name = "crop"
    description = ("random crop back to the input size after zero (black) padding, offsets uniform in "
                   "[0, 2*padding] (RandomCrop(size, padding=4))")
    defaults = {"padding": 4, "fill": 0.0}

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_padding(options["padding"])
        fill = options["fill"]
        if not (isinstance(fill, (int, float)) and not isinstance(fill, bool)
                or isinstance(fill, (tuple, list)) and all(isinstance(v, (int, float)) for v in fill)):
            raise ValueError(f"crop fill must be a number or one number per channel, got {fill!r}")

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return random_crop(x, generator, **self.options)

    def run(self, x: Tensor, generator: torch.Generator, context: PipelineContext) -> Tensor:
        return random_crop(x, generator, padding=self.options["padding"],
                           fill=_fill_on_scale(self.options["fill"], x, context))

    def fuse(self, following: Step) -> Optional[Step]:
        if isinstance(following, Flip):
            return CropFlip(**self.options, p=following.options["p"])
        return None


class CropFlip(Step):
    """``crop`` then ``flip`` in one gather: the same draws in the same order (the offsets,
    then the flips) and the same values as the two steps.  Made by :meth:`Crop.fuse`; not a
    name of the spec language."""

    name = "crop+flip"
    description = "crop then flip, in one gather"
    defaults = {**Crop.defaults, **Flip.defaults}

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        Crop.check_options(options)
        Flip.check_options(options)

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return self._crop_flip(x, generator, self.options["fill"])

    def run(self, x: Tensor, generator: torch.Generator, context: PipelineContext) -> Tensor:
        return self._crop_flip(x, generator, _fill_on_scale(self.options["fill"], x, context))

    def _crop_flip(self, x: Tensor, generator: torch.Generator, fill: Fill) -> Tensor:
        check_batch(x)
        check_generator(generator)
        top, left = draw_crop_offsets(x.shape[0], self.options["padding"], generator)
        flip = draw_flips(x.shape[0], self.options["p"], generator)
        return crop_padded(x, top, left, padding=self.options["padding"], fill=fill, flip=flip)
