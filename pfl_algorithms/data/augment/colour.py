"""Colour maths on pixel-scale images, torchvision's tensor formulas: the luma and the four
``adjust_*`` functions of the colour jitter, each with one factor per sample."""
from __future__ import annotations

import torch
from torch import Tensor

# ITU-R 601-2 luma, as torchvision's tensor rgb_to_grayscale (and Pillow's "L" conversion).
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)


def rgb_to_grayscale(rgb: Tensor) -> Tensor:
    """Luma [..., 1, H, W] of RGB images [..., 3, H, W]: 0.2989 R + 0.587 G + 0.114 B."""
    r, g, b = rgb.unbind(-3)
    return (GRAY_WEIGHTS[0] * r + GRAY_WEIGHTS[1] * g + GRAY_WEIGHTS[2] * b).unsqueeze(-3)


def _per_sample(factor: Tensor, img: Tensor) -> Tensor:
    """One factor per sample, shaped [B, 1, 1, 1] to broadcast over an image, in img's dtype and device."""
    factor = torch.as_tensor(factor, dtype=img.dtype).to(img.device)
    if factor.dim() == 0:
        return factor.expand(img.shape[0]).reshape(-1, 1, 1, 1)
    if factor.shape != (img.shape[0],):
        raise ValueError(f"factor must be a number or one per sample [{img.shape[0]}], got shape {tuple(factor.shape)}")
    return factor.reshape(-1, 1, 1, 1)


def _blend(img: Tensor, other: Tensor, factor: Tensor) -> Tensor:
    """torchvision's blend for float images, ``factor * img + (1 - factor) * other``, clamped to [0, 1]
    (computed as ``other + factor * (img - other)``: one ``lerp``)."""
    return torch.lerp(other, img, factor).clamp_(0.0, 1.0)


def adjust_brightness(img: Tensor, factor) -> Tensor:
    """``factor * img`` clamped to [0, 1] (torchvision: a blend with black), per sample.

    ``img``: pixel-scale [B, C, H, W]; ``factor``: a number or [B], >= 0.  Likewise for the
    other ``adjust_*`` functions.
    """
    return (img * _per_sample(factor, img)).clamp_(0.0, 1.0)


def adjust_contrast(img: Tensor, factor) -> Tensor:
    """Blend each image with its mean luma (its own mean when grey), clamped to [0, 1]."""
    luma = rgb_to_grayscale(img) if img.shape[1] == 3 else img
    return _blend(img, luma.mean(dim=(1, 2, 3), keepdim=True), _per_sample(factor, img))


def adjust_saturation(img: Tensor, factor) -> Tensor:
    """Blend each RGB image with its luma image, clamped to [0, 1] (grey images: unchanged)."""
    if img.shape[1] == 1:
        return img
    return _blend(img, rgb_to_grayscale(img), _per_sample(factor, img))


def adjust_hue(img: Tensor, shift) -> Tensor:
    """Rotate the hue of each RGB image by ``shift`` (a fraction of a turn in [-0.5, 0.5]; a
    number or [B]), keeping HSV's saturation and value (grey images: unchanged).

    torchvision converts to HSV (Pillow's formulas: v = max, s = (max - min) / max, the hue
    from the channel holding the max, red first, then green, on ties, 0 for grey pixels),
    adds the shift modulo 1 and converts back with the sector formula.  Here the same map,
    without building HSV: a hue rotation keeps each pixel's max and min, so with the hue in
    sixths of a turn h6 (shifted, modulo 6) and the chroma c = max - min, channel n (5 for
    red, 3 for green, 1 for blue) is ``max - c * clamp(min(k, 4 - k), 0, 1)`` with
    k = (n + h6) mod 6, the sector formula written without its case split.  For pixels in
    [0, 1] this equals torchvision's, whose clamps of p, q, t to [0, 1] then never act.
    """
    if img.shape[1] == 1:
        return img
    r, g, b = img.unbind(1)
    top = torch.maximum(torch.maximum(r, g), b)
    chroma = top - torch.minimum(torch.minimum(r, g), b)
    # Grey pixels divide by 1 instead of 0: their hue terms are 0 / 1 = 0, no NaN to clean up.
    inverse = torch.where(chroma == 0, 1.0, chroma).reciprocal_()
    sixths = torch.where(top == r, (g - b) * inverse,
                         torch.where(top == g, (b - r) * inverse + 2.0, (r - g) * inverse + 4.0))
    sixths = torch.remainder(sixths + 6.0 * _per_sample(shift, img)[:, 0], 6.0)
    channels = []
    for n in (5.0, 3.0, 1.0):
        k = torch.remainder(sixths + n, 6.0)
        channels.append(top - chroma * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0))
    return torch.stack(channels, dim=1)
