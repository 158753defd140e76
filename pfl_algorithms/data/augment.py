"""Batched data augmentation on the device: the papers' training-time transforms, one batch at a time.

The simulations keep every dataset on the device as one tensor, so the per-sample
``torchvision.transforms`` pipeline of a ``DataLoader`` has no place to run.  Each step here
takes a whole batch [B, C, H, W], draws one set of random parameters PER SAMPLE (as the
DataLoader's per-sample transform would) and applies them with a few tensor ops (gathers,
batched matrix products, masked blends), with no Python loop over the samples.

Reproducibility.  Every random draw comes from the ``torch.Generator`` the caller passes (the
client's CPU generator of the round), never from the global RNG.  The parameters are drawn on
the CPU (small tensors of size B) and only then moved to the batch's device, so the CPU and a
GPU draw the same parameters and give the same images (to rounding).  Each step's draw is a
public ``draw_*`` function that documents exactly what it draws, in which order.

Scales.  The datasets hold NORMALIZED images, ``inputs = (pixels - mean) / std`` with pixels
in [0, 1] (``ArrayDataset.mean``/``std``).  The geometric steps (crop, flip, resized crop)
commute with that per-channel affine map (a gather moves values; the resize weights of a row
sum to 1), so :class:`Augmentation` runs them on the normalized values, with the crop's black
padding converted to ``-mean / std``; before the first photometric step (colour jitter,
grayscale), which is defined on pixels, it un-normalizes, and it normalizes again at the end.
The step functions themselves take batches on whichever scale the caller works in.

What the papers use, and their names here (:data:`AUGMENTATIONS`; ``pfl list`` prints them):

* ``crop``: torchvision ``RandomCrop(size, padding=4)`` (the CIFAR standard): pad 4 pixels
  of black on each side, crop back to the input's size at an offset uniform in [0, 2*padding]
  on each axis.
* ``flip``: ``RandomHorizontalFlip(p=0.5)``.
* ``resized-crop``: ``RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3))`` with
  torchvision's box sampling (10 tries, then the central-crop fallback) and its bilinear
  resize with antialiasing (see :func:`random_resized_crop`).
* ``jitter``: ``RandomApply([ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8)`` with the formulas of
  torchvision's tensor implementation (see :func:`apply_color_jitter`).
* ``grayscale``: ``RandomGrayscale(p=0.2)``.
* ``factorized-fl``: the released Factorized-FL code's training pipeline (wyjeong/Factorized-FL,
  ``data/loader.py``): ``resized-crop, flip, jitter, grayscale`` with the defaults above.

Differences from the released pipelines, all deliberate:

* The released code transforms PIL images (uint8): every step rounds to 1/255 and the colour
  adjustments are Pillow's.  Here everything stays in floating point and follows torchvision's
  tensor formulas (which torchvision documents as matching Pillow's up to that rounding).
* ``jitter`` draws the order of its four adjustments per sample; torchvision draws one order
  per call, and since the released code calls it once per sample, per sample is that
  pipeline's behaviour too.
* Single-channel (grey) images: ``jitter`` applies brightness and contrast only, saturation
  and hue are no-ops, and so is ``grayscale`` (torchvision does the same for 1-channel tensors).
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "AUGMENTATIONS", "Augmentation", "AugmentationSpec", "JitterParams", "make_augmentation",
    "parse_augmentation_spec",
    "draw_crop_offsets", "draw_flips", "draw_resized_crop_boxes", "draw_jitter_params", "draw_grayscale",
    "random_crop", "crop_padded", "horizontal_flip", "random_resized_crop", "resized_crop", "color_jitter",
    "apply_color_jitter", "random_grayscale", "rgb_to_grayscale", "adjust_brightness", "adjust_contrast",
    "adjust_saturation", "adjust_hue",
]

# ITU-R 601-2 luma, as torchvision's tensor rgb_to_grayscale (and Pillow's "L" conversion).
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)

# The jitter's adjustments, in the index order of JitterParams.order / .factors.
JITTER_ADJUSTMENTS = ("brightness", "contrast", "saturation", "hue")

Fill = Union[float, Sequence[float], Tensor]


# --------------------------------------------------------------------------------------------
# Argument checks (shared by the step functions and by make_augmentation, which checks a spec
# when it is built, not at the first batch).


def _check_probability(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
    return float(p)


def _check_padding(padding) -> int:
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an int >= 0, got {padding!r}")
    return padding


def _check_range(name: str, value, *, positive: bool) -> tuple[float, float]:
    """A (low, high) pair with low <= high, both > 0 (``positive``) or finite."""
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    if not ok or value[0] > value[1] or (positive and value[0] <= 0):
        need = "0 < low <= high" if positive else "low <= high"
        raise ValueError(f"{name} must be a pair (low, high) with {need}, got {value!r}")
    return float(value[0]), float(value[1])


def _check_size(size) -> Optional[tuple[int, int]]:
    """None, an int or an (height, width) pair of positive ints -> None or (height, width)."""
    if size is None:
        return None
    pair = (size, size) if isinstance(size, int) and not isinstance(size, bool) else size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in pair)):
        raise ValueError(f"size (image_size) must be a positive int or a (height, width) pair of them, got {size!r}")
    return int(pair[0]), int(pair[1])


def _jitter_range(name: str, value, *, center: float, bound: tuple[float, float]) -> Optional[tuple[float, float]]:
    """torchvision ColorJitter's range of one adjustment: a number v gives [center - v, center + v]
    clipped to ``bound`` (v >= 0), a pair is taken as given (inside ``bound``).  A range that is
    just the centre means "not applied" (None), as in torchvision."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a number >= 0 or a (low, high) pair, got {value!r}")
        low, high = max(center - value, bound[0]), center + value
        if name == "hue" and value > 0.5:
            raise ValueError(f"hue must be in [0, 0.5] or a pair inside [-0.5, 0.5], got {value!r}")
    else:
        low, high = _check_range(name, value, positive=False)
        if low < bound[0] or high > bound[1]:
            raise ValueError(f"{name} range {value!r} must lie inside [{bound[0]}, {bound[1]}]")
    return None if low == high == center else (low, high)


def _check_batch(x, *, name: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor [B, C, H, W], got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be a batch of images [B, C, H, W], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _check_colour_channels(x: Tensor, step: str) -> None:
    if x.shape[1] not in (1, 3):
        raise ValueError(f"{step} needs 1-channel (grey) or 3-channel (RGB) images, got {x.shape[1]} "
                         f"channels (x of shape {tuple(x.shape)})")


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        got = f"a generator on {generator.device}" if isinstance(generator, torch.Generator) else repr(generator)
        raise TypeError(f"generator must be a CPU torch.Generator (every random draw comes from it, on the CPU, "
                        f"so runs reproduce on any device); got {got}")


def _draw_uniform(shape, generator: torch.Generator) -> Tensor:
    """Uniform [0, 1) draws in float64 on the CPU (float64: integer offsets floor(u * n) stay uniform)."""
    return torch.rand(shape, generator=generator, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# Random crop with padding (torchvision RandomCrop(size, padding)).


def draw_crop_offsets(batch: int, padding: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The crop's (top, left) offsets in the padded image, int64 [batch] each, on the CPU.

    Each uniform on the integers [0, 2 * padding], independently per sample and axis, as
    torchvision's ``RandomCrop(size, padding)`` for a crop of the input's own size.  Draws one
    ``torch.randint(0, 2 * padding + 1, (2, batch))``: row 0 the tops, row 1 the lefts.
    """
    padding = _check_padding(padding)
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
    _check_batch(x)
    padding = _check_padding(padding)
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
    _check_batch(x)
    _check_generator(generator)
    top, left = draw_crop_offsets(x.shape[0], padding, generator)
    return crop_padded(x, top, left, padding=padding, fill=fill)


# --------------------------------------------------------------------------------------------
# Horizontal flip (torchvision RandomHorizontalFlip(p)).


def draw_flips(batch: int, p: float, generator: torch.Generator) -> Tensor:
    """bool [batch] on the CPU, True where the image is flipped: ``torch.rand(batch) < p``
    (float64 draws), as torchvision's ``RandomHorizontalFlip(p)`` per sample."""
    p = _check_probability("p", p)
    return _draw_uniform(batch, generator) < p


def horizontal_flip(x: Tensor, generator: torch.Generator, *, p: float = 0.5) -> Tensor:
    """Mirror each image of ``x`` [B, C, H, W] left-right with probability ``p`` (:func:`draw_flips`)."""
    _check_batch(x)
    _check_generator(generator)
    flip = draw_flips(x.shape[0], p, generator).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


# --------------------------------------------------------------------------------------------
# Random resized crop (torchvision RandomResizedCrop(size, scale, ratio), bilinear, antialiased).


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
    scale = _check_range("scale", scale, positive=True)
    ratio = _check_range("ratio", ratio, positive=True)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    tries = _draw_uniform((batch, attempts, 2), generator)
    place = _draw_uniform((batch, 2), generator)
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
    _check_batch(x)
    out_h, out_w = _check_size(size) or tuple(x.shape[2:])
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
    _check_batch(x)
    _check_generator(generator)
    size = _check_size(size)
    boxes = draw_resized_crop_boxes(x.shape[0], x.shape[2], x.shape[3], scale=scale, ratio=ratio,
                                    generator=generator)
    return resized_crop(x, *boxes, size=size)


# --------------------------------------------------------------------------------------------
# Colour: grayscale and the jitter's four adjustments (torchvision's tensor formulas).


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


_ADJUST = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)


@dataclass(frozen=True)
class JitterParams:
    """The random parameters of a colour jitter for a batch (see :func:`draw_jitter_params`).

    Attributes:
        apply: bool [B], whether the jitter applies to the sample (``RandomApply``'s p).
        order: int64 [B, 4], per sample the order of the adjustments (indices into
            ``JITTER_ADJUSTMENTS``: 0 brightness, 1 contrast, 2 saturation, 3 hue).
        factors: float64 [B, 4], the brightness, contrast and saturation factors and the hue shift.
        enabled: per adjustment, whether the jitter has it (a range collapsed to its centre: no).
    """

    apply: Tensor
    order: Tensor
    factors: Tensor
    enabled: tuple[bool, bool, bool, bool]


def _jitter_ranges(brightness, contrast, saturation, hue) -> tuple[Optional[tuple[float, float]], ...]:
    return (_jitter_range("brightness", brightness, center=1.0, bound=(0.0, math.inf)),
            _jitter_range("contrast", contrast, center=1.0, bound=(0.0, math.inf)),
            _jitter_range("saturation", saturation, center=1.0, bound=(0.0, math.inf)),
            _jitter_range("hue", hue, center=0.0, bound=(-0.5, 0.5)))


def draw_jitter_params(batch: int, *, brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1, p: float = 0.8,
                       generator: torch.Generator) -> JitterParams:
    """The parameters of ``RandomApply([ColorJitter(brightness, contrast, saturation, hue)], p)``
    per sample, on the CPU.

    Ranges as torchvision's: brightness b gives factors uniform in [max(0, 1 - b), 1 + b]
    (same for contrast and saturation), hue h gives shifts uniform in [-h, h]; a (low, high)
    pair is taken as given; 0 (or a pair (1, 1), (0, 0) for hue) leaves that adjustment out.

    Draws, in this order (float64): ``torch.rand(batch)`` (applied where < p), ``torch.rand(batch, 4)``
    (each row's argsort is the sample's order), ``torch.rand(batch, 4)`` (the four factors, scaled
    to their ranges; drawn for every adjustment, used only by those enabled).
    """
    p = _check_probability("p", p)
    ranges = _jitter_ranges(brightness, contrast, saturation, hue)
    apply = _draw_uniform(batch, generator) < p
    order = _draw_uniform((batch, 4), generator).argsort(1)
    uniforms = _draw_uniform((batch, 4), generator)
    low = torch.tensor([r[0] if r else (0.0 if k == 3 else 1.0) for k, r in enumerate(ranges)], dtype=torch.float64)
    high = torch.tensor([r[1] if r else (0.0 if k == 3 else 1.0) for k, r in enumerate(ranges)], dtype=torch.float64)
    factors = low + (high - low) * uniforms
    return JitterParams(apply=apply, order=order, factors=factors, enabled=tuple(r is not None for r in ranges))


def apply_color_jitter(pixels: Tensor, params: JitterParams) -> Tensor:
    """Apply the drawn colour jitter to pixel-scale images [B, C, H, W] (C = 1 or 3).

    Each sample with ``params.apply`` gets the enabled adjustments in its own ``params.order``,
    with torchvision's formulas for float images, each result clamped to [0, 1]:

    * brightness f: ``f * img`` (a blend with black);
    * contrast f: blend with the image's mean luma, ``f * img + (1 - f) * mean(gray(img))``;
    * saturation f: blend with the luma image, ``f * img + (1 - f) * gray(img)``;
    * hue shift d: in HSV, h <- (h + d) mod 1 (:func:`adjust_hue`).

    Single-channel images get brightness and contrast only (saturation and hue are no-ops on
    grey, as in torchvision).  Samples without ``apply`` are returned unchanged.

    Batched by position: for each of the 4 positions and each adjustment, the samples that do
    that adjustment at that position are gathered (``index_select``), adjusted together and
    written back in place (``index_copy_``), so the work is that of one pass per adjustment
    over the applied samples.  The sample lists are computed on the CPU from the CPU-drawn
    parameters and reach the device in one copy: no device sync.
    """
    _check_batch(pixels, name="pixels")
    _check_colour_channels(pixels, "color jitter")
    batch = pixels.shape[0]
    if params.order.shape != (batch, 4) or params.factors.shape != (batch, 4) or params.apply.shape != (batch,):
        raise ValueError(f"params were drawn for another batch size: apply {tuple(params.apply.shape)}, order "
                         f"{tuple(params.order.shape)}, factors {tuple(params.factors.shape)}; "
                         f"pixels {tuple(pixels.shape)}")
    enabled = list(params.enabled)
    if pixels.shape[1] == 1:
        enabled[2] = enabled[3] = False
    apply, order = params.apply.cpu(), params.order.cpu()
    # Which samples do which adjustment at each position, in application order; the lists
    # travel to the device in one copy.
    work = [(adjustment, (apply & (order[:, position] == adjustment)).nonzero().squeeze(1))
            for position in range(4) for adjustment in range(4) if enabled[adjustment]]
    work = [(adjustment, chosen) for adjustment, chosen in work if chosen.numel()]
    out = pixels.clone()
    if not work:
        return out
    factors = params.factors.to(device=pixels.device, dtype=pixels.dtype)
    indices = torch.cat([chosen for _, chosen in work]).to(pixels.device)
    for (adjustment, _), chosen in zip(work, indices.split([len(c) for _, c in work])):
        adjusted = _ADJUST[adjustment](out.index_select(0, chosen), factors[chosen, adjustment])
        out.index_copy_(0, chosen, adjusted)
    return out


def color_jitter(x: Tensor, generator: torch.Generator, *, brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1,
                 p: float = 0.8) -> Tensor:
    """``RandomApply([ColorJitter(brightness, contrast, saturation, hue)], p)`` on every image of the
    pixel-scale batch ``x`` [B, C, H, W] (:func:`draw_jitter_params`, then :func:`apply_color_jitter`).

    The defaults are the released Factorized-FL code's.
    """
    _check_batch(x)
    _check_generator(generator)
    _check_colour_channels(x, "color jitter")
    params = draw_jitter_params(x.shape[0], brightness=brightness, contrast=contrast, saturation=saturation,
                                hue=hue, p=p, generator=generator)
    return apply_color_jitter(x, params)


def draw_grayscale(batch: int, p: float, generator: torch.Generator) -> Tensor:
    """bool [batch] on the CPU, True where the image turns grey: ``torch.rand(batch) < p`` (float64)."""
    p = _check_probability("p", p)
    return _draw_uniform(batch, generator) < p


def random_grayscale(x: Tensor, generator: torch.Generator, *, p: float = 0.2) -> Tensor:
    """torchvision ``RandomGrayscale(p)`` on the pixel-scale batch ``x`` [B, C, H, W] (C = 1 or 3):
    the chosen RGB images (:func:`draw_grayscale`) become their luma repeated on 3 channels.

    Grey (1-channel) images are returned as they are (the draw still happens, so the generator
    advances the same way whatever the channels).
    """
    _check_batch(x)
    _check_generator(generator)
    _check_colour_channels(x, "grayscale")
    grey = draw_grayscale(x.shape[0], p, generator)
    if x.shape[1] == 1:
        return x
    return torch.where(grey.to(x.device)[:, None, None, None], rgb_to_grayscale(x).expand_as(x), x)


# --------------------------------------------------------------------------------------------
# Specs: names, presets, parsing, and the pipeline the engine calls.


@dataclass(frozen=True)
class AugmentationSpec:
    """A name of :data:`AUGMENTATIONS`: one step (with its options and their defaults) or a
    preset (``steps``: the step names it stands for, with their defaults)."""

    name: str
    description: str
    defaults: Mapping[str, Any]
    steps: tuple[str, ...] = ()
    photometric: bool = False  # the step is defined on pixels (the pipeline un-normalizes before it)

    @property
    def is_preset(self) -> bool:
        return bool(self.steps)


AUGMENTATIONS: dict[str, AugmentationSpec] = {spec.name: spec for spec in (
    AugmentationSpec("crop", "random crop back to the input size after zero (black) padding, offsets uniform in "
                     "[0, 2*padding] (RandomCrop(size, padding=4))", {"padding": 4, "fill": 0.0}),
    AugmentationSpec("flip", "horizontal flip with probability p (RandomHorizontalFlip(0.5))", {"p": 0.5}),
    AugmentationSpec("resized-crop", "random box (area in scale, aspect in ratio) resized bilinearly to size "
                     "(RandomResizedCrop(size, (0.08, 1), (3/4, 4/3)); size: image_size or the input's)",
                     {"size": None, "scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3)}),
    AugmentationSpec("jitter", "colour jitter with probability p, the 4 adjustments in a random order per sample "
                     "(RandomApply([ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8))",
                     {"brightness": 0.4, "contrast": 0.4, "saturation": 0.2, "hue": 0.1, "p": 0.8}, photometric=True),
    AugmentationSpec("grayscale", "luma on all channels with probability p (RandomGrayscale(0.2))", {"p": 0.2},
                     photometric=True),
    AugmentationSpec("factorized-fl", "the released Factorized-FL code's training transforms: "
                     "resized-crop, flip, jitter, grayscale", {},
                     steps=("resized-crop", "flip", "jitter", "grayscale")),
)}

_STEP_FUNCTIONS: dict[str, Callable[..., Tensor]] = {
    "crop": random_crop, "flip": horizontal_flip, "resized-crop": random_resized_crop,
    "jitter": color_jitter, "grayscale": random_grayscale,
}

_NONE = ("", "none")


def _valid_names() -> str:
    return ", ".join(AUGMENTATIONS)


def _split_top_level(text: str, spec: str) -> list[str]:
    """Split ``text`` at the commas outside parentheses (options hold tuples such as scale=(0.2, 1))."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced parentheses in augmentation spec {spec!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced parentheses in augmentation spec {spec!r}")
    parts.append(text[start:])
    return [part.strip() for part in parts]


def _check_step_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise ValueError for a bad option of step ``name`` now, not at the first batch."""
    if name == "crop":
        _check_padding(options["padding"])
        fill = options["fill"]
        if not (isinstance(fill, (int, float)) and not isinstance(fill, bool)
                or isinstance(fill, (tuple, list)) and all(isinstance(v, (int, float)) for v in fill)):
            raise ValueError(f"crop fill must be a number or one number per channel, got {fill!r}")
    elif name in ("flip", "grayscale"):
        _check_probability(f"{name} p", options["p"])
    elif name == "resized-crop":
        _check_size(options["size"])
        _check_range("scale", options["scale"], positive=True)
        _check_range("ratio", options["ratio"], positive=True)
    elif name == "jitter":
        _check_probability("jitter p", options["p"])
        _jitter_ranges(options["brightness"], options["contrast"], options["saturation"], options["hue"])


def _parse_step(text: str, spec: str) -> list[tuple[str, dict]]:
    """One ``name`` or ``name(key=value, ...)`` of a spec -> [(step name, options)] (a preset: its steps)."""
    name, _, rest = text.partition("(")
    name = name.strip()
    if name not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {name!r} in spec {spec!r}; valid names: {_valid_names()} "
                         "(comma-separated, options as name(key=value, ...); 'none' for no augmentation)")
    entry = AUGMENTATIONS[name]
    overrides: dict[str, Any] = {}
    if rest:
        if not rest.rstrip().endswith(")"):
            raise ValueError(f"malformed step {text!r} in augmentation spec {spec!r}: expected name(key=value, ...)")
        body = rest.rstrip()[:-1]
        for item in (_split_top_level(body, spec) if body.strip() else []):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"malformed option {item!r} of {name!r} in augmentation spec {spec!r}: "
                                 "expected key=value")
            if key not in entry.defaults:
                valid = ", ".join(entry.defaults) or "none (a preset takes no options)"
                raise ValueError(f"unknown option {key!r} of augmentation {name!r}; its options: {valid}")
            try:
                overrides[key] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise ValueError(f"option {key}={value.strip()!r} of {name!r} is not a number or tuple "
                                 f"(augmentation spec {spec!r})") from None
    if entry.is_preset:
        return [(step, dict(AUGMENTATIONS[step].defaults)) for step in entry.steps]
    options = {**entry.defaults, **overrides}
    _check_step_options(name, options)
    return [(name, options)]


def parse_augmentation_spec(spec: Union[None, str, Sequence[str]]) -> list[tuple[str, dict]]:
    """The steps of a spec: [(step name, options with defaults filled in)], presets expanded.

    ``spec``: None, ``""`` or ``"none"`` (no steps); a comma-separated string such as
    ``"crop,flip"``, ``"crop(padding=2), flip(p=0.3)"`` or ``"factorized-fl"``; or a sequence
    of such strings.  Unknown names or options and bad values raise ValueError.
    """
    if spec is None:
        return []
    texts = [spec] if isinstance(spec, str) else list(spec)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError(f"augmentation spec must be a string or a sequence of strings, got {spec!r}")
    steps: list[tuple[str, dict]] = []
    parts = [part for text in texts for part in _split_top_level(text.strip(), str(spec))]
    if all(part.lower() in _NONE for part in parts):
        return []
    for part in parts:
        if not part:
            raise ValueError(f"empty step in augmentation spec {spec!r} (two commas in a row, or a trailing comma)")
        if part.lower() in _NONE:
            raise ValueError(f"'none' cannot be combined with other augmentations (spec {spec!r})")
        steps.extend(_parse_step(part, str(spec)))
    return steps


def _format_value(value) -> str:
    return repr(tuple(value)) if isinstance(value, list) else repr(value)


class Augmentation:
    """A pipeline of augmentation steps for normalized image batches: ``aug(x, generator) -> x'``.

    ``x``: [B, C, H, W] images normalized with ``mean``/``std`` (one value per channel; None
    for both: ``x`` is already on the pixel scale), floating point, on any device; the result
    has its dtype and device (float16/bfloat16 batches are computed in float32).  Every random
    draw comes from ``generator`` (a CPU ``torch.Generator``), in step order.
    Build one with :func:`make_augmentation`.
    """

    def __init__(self, steps: Sequence[tuple[str, Mapping[str, Any]]], *, mean: Optional[Sequence[float]],
                 std: Optional[Sequence[float]], image_size=None):
        if (mean is None) != (std is None):
            raise ValueError("mean and std must be given together (or neither, for pixel-scale inputs)")
        if mean is not None:
            mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
            if len(mean) != len(std) or not mean:
                raise ValueError(f"mean and std need one value per channel each, got {len(mean)} and {len(std)}")
            if not all(math.isfinite(m) for m in mean) or not all(math.isfinite(s) and s > 0 for s in std):
                raise ValueError(f"mean must be finite and std finite and > 0, got mean={mean}, std={std}")
        self.mean, self.std = mean, std
        self.image_size = _check_size(image_size)
        self.steps: list[tuple[str, dict]] = []
        for name, options in steps:
            if name not in _STEP_FUNCTIONS:
                raise ValueError(f"unknown augmentation step {name!r}; valid steps: {', '.join(_STEP_FUNCTIONS)}")
            options = {**AUGMENTATIONS[name].defaults, **options}
            _check_step_options(name, options)
            self.steps.append((name, options))
        self._stats: dict[tuple, tuple[Tensor, Tensor]] = {}

    @property
    def spec(self) -> str:
        """The pipeline as a spec string (options that differ from the defaults written out);
        ``make_augmentation(aug.spec, ...)`` builds the same pipeline."""
        parts = []
        for name, options in self.steps:
            changed = {k: v for k, v in options.items() if v != AUGMENTATIONS[name].defaults[k]}
            parts.append(name + (f"({', '.join(f'{k}={_format_value(v)}' for k, v in changed.items())})"
                                 if changed else ""))
        return ",".join(parts)

    def __repr__(self) -> str:
        return f"Augmentation({self.spec!r}, mean={self.mean}, std={self.std}, image_size={self.image_size})"

    def _mean_std(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """mean and std as [C, 1, 1] tensors of x's dtype on x's device, made once per (device, dtype)."""
        key = (x.device, x.dtype)
        if key not in self._stats:
            as_tensor = lambda v: torch.tensor(v, dtype=x.dtype).reshape(-1, 1, 1).to(x.device)
            self._stats[key] = (as_tensor(self.mean), as_tensor(self.std))
        return self._stats[key]

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        """The augmented batch: each step in order, geometric steps on the normalized values,
        photometric ones on pixels (see the module docstring); a crop directly followed by a
        flip runs as one gather (the same draws and values as the two steps)."""
        _check_batch(x)
        _check_generator(generator)
        if self.mean is not None and x.shape[1] != len(self.mean):
            raise ValueError(f"the augmentation's mean/std have {len(self.mean)} values but the batch has "
                             f"{x.shape[1]} channels (x of shape {tuple(x.shape)}): build it with the dataset's "
                             "mean and std")
        if x.shape[0] == 0:
            return x
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()
        normalized = self.mean is not None
        mean, std = self._mean_std(work) if normalized else (None, None)
        position = 0
        while position < len(self.steps):
            name, options = self.steps[position]
            position += 1
            kwargs = dict(options)
            if AUGMENTATIONS[name].photometric and normalized:
                work, normalized = work * std + mean, False
            if name == "crop" and normalized:
                # Padding is black on the pixel scale: per channel (fill - mean) / std once normalized.
                kwargs["fill"] = (_channel_values(kwargs["fill"], work.shape[1], work, "fill") - mean) / std
            if name == "resized-crop" and kwargs["size"] is None:
                kwargs["size"] = self.image_size
            if name == "crop" and position < len(self.steps) and self.steps[position][0] == "flip":
                # crop then flip in one gather; the same draws in the same order as the two steps.
                top, left = draw_crop_offsets(work.shape[0], kwargs["padding"], generator)
                flip = draw_flips(work.shape[0], self.steps[position][1]["p"], generator)
                work = crop_padded(work, top, left, padding=kwargs["padding"], fill=kwargs["fill"], flip=flip)
                position += 1
                continue
            work = _STEP_FUNCTIONS[name](work, generator, **kwargs)
        if self.mean is not None and not normalized:
            work = (work - mean) / std
        return work.to(x.dtype)


def make_augmentation(spec: Union[None, str, Sequence[str]], *, mean: Optional[Sequence[float]],
                      std: Optional[Sequence[float]], image_size=None) -> Optional[Augmentation]:
    """The augmentation named by ``spec`` for images normalized with ``mean``/``std``, or None.

    Args:
        spec: None, ``""`` or ``"none"`` (no augmentation: returns None); names of
            :data:`AUGMENTATIONS`, comma-separated (``"crop,flip"``, ``"factorized-fl"``) or as
            a sequence, each optionally with options (``"crop(padding=2),flip(p=0.3)"``,
            ``"resized-crop(scale=(0.2, 1.0))"``); unknown names and options raise ValueError
            listing the valid ones.
        mean, std: the dataset's per-channel normalization (``ArrayDataset.mean``/``std``):
            ``inputs = (pixels - mean) / std``; None for both when the inputs are pixels.
        image_size: the output size of ``resized-crop`` (an int or (height, width)); default
            the input's.  The other steps keep the input's size.

    Returns:
        a callable ``(x [B, C, H, W], generator) -> augmented x`` (an :class:`Augmentation`), or
        None for no augmentation.  A batch whose channels differ from len(mean) raises
        ValueError at the first call.
    """
    steps = parse_augmentation_spec(spec)
    if not steps:
        return None
    return Augmentation(steps, mean=mean, std=std, image_size=image_size)
