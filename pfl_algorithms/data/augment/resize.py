"""The ``resized-crop`` step: torchvision ``RandomResizedCrop(size, scale, ratio)``, a random
box per sample (torchvision's box sampling) resized with the antialiased bilinear filter."""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from ._checks import check_batch, check_generator, check_range, check_size
from .step import PipelineContext, Step, draw_uniform


def draw_resized_crop_boxes(batch: int, height: int, width: int, *, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                            generator: torch.Generator, attempts: int = 10) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The boxes (top, left, box height, box width) of a random resized crop, int64 [batch] each, on the CPU.

    torchvision's ``RandomResizedCrop.get_params`` per sample: up to ``attempts`` tries of an
    area fraction uniform in ``scale`` and an aspect ratio log-uniform in ``ratio``, giving
    ``w = round(sqrt(area * aspect))``, ``h = round(sqrt(area / aspect))`` (round half to even,
    as Python's ``round``); the first try with 0 < w <= width and 0 < h <= height wins, and its
    offsets are uniform on [0, height - h] x [0, width - w].  When no try fits, the central
    crop of the largest box whose aspect ratio is clipped into ``ratio``.

    Draws, in this order: ``torch.rand(batch, attempts, 2, dtype=float64)`` (per try: the
    area fraction's and the log-aspect's uniforms), then ``torch.rand(batch, 2, dtype=float64)``
    (the top's and the left's uniforms u: offset = floor(u * (room + 1))).  Every try is drawn
    even where an earlier one fits, so a sample's box does not depend on the others.
    """
    scale = check_range("scale", scale, positive=True)
    ratio = check_range("ratio", ratio, positive=True)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    tries = draw_uniform((batch, attempts, 2), generator)
    place = draw_uniform((batch, 2), generator)
    area = float(height * width) * (scale[0] + (scale[1] - scale[0]) * tries[..., 0])
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_low + (log_high - log_low) * tries[..., 1])
    box_w = torch.round(torch.sqrt(area * aspect))
    box_h = torch.round(torch.sqrt(area / aspect))
    fits = (box_w > 0) & (box_w <= width) & (box_h > 0) & (box_h <= height)
    first = fits.to(torch.int8).argmax(1, keepdim=True)  # the first fitting try (argmax returns the first max)
    box_h = box_h.gather(1, first).squeeze(1).to(torch.int64)
    box_w = box_w.gather(1, first).squeeze(1).to(torch.int64)
    top = torch.floor(place[:, 0] * (height - box_h + 1)).to(torch.int64)
    left = torch.floor(place[:, 1] * (width - box_w + 1)).to(torch.int64)
    # torchvision's fallback: the whole image, its aspect ratio clipped into ``ratio``, centred.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fallback_w, fallback_h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        fallback_w, fallback_h = int(round(height * ratio[1])), height
    else:
        fallback_w, fallback_h = width, height
    missed = ~fits.any(1)
    box_h = box_h.masked_fill(missed, fallback_h)
    box_w = box_w.masked_fill(missed, fallback_w)
    top = top.masked_fill(missed, (height - fallback_h) // 2)
    left = left.masked_fill(missed, (width - fallback_w) // 2)
    return top, left, box_h, box_w


def _resize_weights(start: Tensor, length: Tensor, out_size: int, in_size: int, dtype: torch.dtype) -> Tensor:
    """[B, out_size, in_size] weights resizing, per sample, the span [start, start + length) of
    an axis of in_size pixels to out_size pixels: bilinear with antialiasing, align_corners=False.

    The filter of torch's ``interpolate(..., mode='bilinear', antialias=True)`` (itself Pillow's):
    output pixel o sits at ``center = (o + 0.5) * s`` in the span (s = length / out_size); its
    weights are the triangle ``max(0, 1 - |j + 0.5 - center| / max(s, 1))`` over the span's
    pixels j, normalized to sum to 1.  Upsampling (s <= 1) this is exactly plain bilinear
    interpolation with the edge pixels repeated; downsampling, the triangle widens by s, which
    averages instead of skipping pixels (the antialiasing).
    """
    stretch = length.to(dtype)[:, None] / out_size  # [B, 1]
    center = (torch.arange(out_size, device=start.device, dtype=dtype)[None, :] + 0.5) * stretch  # [B, out]
    local = (torch.arange(in_size, device=start.device)[None, :] - start[:, None])  # [B, in]: j in the span
    distance = (local.to(dtype)[:, None, :] + 0.5 - center[:, :, None]).abs() / stretch.clamp_min(1.0)[:, :, None]
    in_span = ((local >= 0) & (local < length[:, None]))[:, None, :]
    weights = torch.where(in_span, (1.0 - distance).clamp_min(0.0), 0.0)
    return weights / weights.sum(2, keepdim=True)


def resized_crop(x: Tensor, top: Tensor, left: Tensor, box_h: Tensor, box_w: Tensor,
                 size: Optional[tuple[int, int]] = None) -> Tensor:
    """Crop each image of ``x`` [B, C, H, W] to its box and resize it to ``size`` (default:
    (H, W)) with the antialiased bilinear filter of :func:`_resize_weights`.

    Separable, so one batched product per axis: ``out[b, c] = Wy[b] @ x[b, c] @ Wx[b]^T``.
    The dense weight matrices cost O(C * H * W * (H_out + W_out)) per image, cheap at the
    papers' 28 to 32 pixels (and a single GEMM-shaped launch on a GPU).
    """
    check_batch(x)
    out_h, out_w = check_size(size) or tuple(x.shape[2:])
    # Weights in float64 (float32 where a device has no float64), then in x's dtype.
    wdtype = torch.float32 if x.device.type == "mps" else torch.float64
    boxes = torch.stack((top, left, box_h, box_w)).to(device=x.device, dtype=torch.int64)
    rows = _resize_weights(boxes[0], boxes[2], out_h, x.shape[2], wdtype).to(x.dtype)  # [B, out_h, H]
    cols = _resize_weights(boxes[1], boxes[3], out_w, x.shape[3], wdtype).to(x.dtype)  # [B, out_w, W]
    batch, channels, height, width = x.shape
    # Columns first as one bmm over [B, C*H, W] (a broadcast matmul would expand cols C times).
    resized_cols = torch.bmm(x.reshape(batch, channels * height, width), cols.transpose(1, 2))
    return torch.matmul(rows[:, None], resized_cols.view(batch, channels, height, out_w))


def random_resized_crop(x: Tensor, generator: torch.Generator, *, size=None, scale=(0.08, 1.0),
                        ratio=(3 / 4, 4 / 3)) -> Tensor:
    """torchvision ``RandomResizedCrop(size, scale, ratio)`` (bilinear, antialias=True) on every
    image of ``x`` [B, C, H, W], each with its own box (:func:`draw_resized_crop_boxes`).

    ``size``: the output's (height, width), or one int for a square (default: the input's).

    Interpolation: exactly torch's ``interpolate(bilinear, align_corners=False,
    antialias=True)`` of the box, which is torchvision's tensor path and Pillow's bilinear
    resize (that of the released code, which works on PIL images) up to Pillow's uint8
    rounding.  When the output is no larger than the box (upsampling, always the case for
    32x32 CIFAR cropped back to 32x32), antialiasing changes nothing.
    """
    check_batch(x)
    check_generator(generator)
    size = check_size(size)
    boxes = draw_resized_crop_boxes(x.shape[0], x.shape[2], x.shape[3], scale=scale, ratio=ratio,
                                    generator=generator)
    return resized_crop(x, *boxes, size=size)


class ResizedCrop(Step):
    """:func:`random_resized_crop` as a step (geometric: each output pixel is a weighted mean
    of input pixels whose weights sum to 1, which commutes with the normalization)."""

    name = "resized-crop"
    description = ("random box (area in scale, aspect in ratio) resized bilinearly to size "
                   "(RandomResizedCrop(size, (0.08, 1), (3/4, 4/3)); size: image_size or the input's)")
    defaults = {"size": None, "scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3)}

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_size(options["size"])
        check_range("scale", options["scale"], positive=True)
        check_range("ratio", options["ratio"], positive=True)

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return random_resized_crop(x, generator, **self.options)

    def run(self, x: Tensor, generator: torch.Generator, context: PipelineContext) -> Tensor:
        """A size in the spec wins over the pipeline's ``image_size``."""
        options = dict(self.options)
        if options["size"] is None:
            options["size"] = context.image_size
        return random_resized_crop(x, generator, **options)
