"""Feature shifts: deterministic changes of a client's inputs that make a new domain out of one
dataset (multi-domain scenarios on digits) or a noisy target (FedDAF's synthetic setting).

A shift is named by a string (recorded in the partition manifest):

- ``identity``: unchanged.
- ``rotate-<degrees>``: counter-clockwise rotation.  Multiples of 90 are exact (``rot90``;
  90 and 270 need square images); other angles resample bilinearly about the centre, with
  black (pixel 0) outside the source image.
- ``invert``: colour inversion, pixel ↦ 1 − pixel.
- ``blur-<sigma>``: Gaussian blur with standard deviation sigma (pixels), kernel radius
  ceil(3·sigma), edges replicated.
- ``noise-<sigma>``: additive Gaussian noise of standard deviation sigma, not clipped (as
  FedDAF adds it to the image tensor).

Shifts act on the pixel scale ([0, 1]): the normalized inputs are mapped back with the
dataset's ``mean``/``std``, shifted, and normalized again with the same statistics, so the
shift is visible to the model.  On data that are not images (``mean`` is None) only
``identity`` and ``noise-<sigma>`` apply, directly to the feature vectors.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F

from .datasets import ArrayDataset

SHIFT_FORMS = ("identity", "rotate-<degrees>", "invert", "blur-<sigma>", "noise-<sigma>")


def parse_shift(name: str) -> tuple[str, float]:
    """(kind, parameter) of a shift name (parameter 0.0 for kinds without one).

    Raises:
        ValueError: an unknown form or a bad parameter, listing the valid forms.
    """
    if not isinstance(name, str):
        raise ValueError(f"a shift must be a string such as 'rotate-90', got {name!r}; valid forms: {SHIFT_FORMS}")
    kind, _, text = name.partition("-")
    if kind in ("identity", "invert") and not text:
        return kind, 0.0
    if kind in ("rotate", "blur", "noise") and text:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if math.isfinite(value) and (kind == "rotate" or value > 0):
            return kind, value
        raise ValueError(f"shift {name!r}: {kind} needs a {'finite angle' if kind == 'rotate' else 'positive sigma'}")
    raise ValueError(f"unknown shift {name!r}; valid forms: {', '.join(SHIFT_FORMS)}")


def shift_pixels(pixels: Tensor, name: str, *, seed: int = 0) -> Tensor:
    """Apply shift ``name`` to pixel-scale images [N, C, H, W] (or features [N, F] for
    ``identity``/``noise``); ``seed`` seeds the noise (drawn on the CPU, float32, in the
    order of the rows, so every device gets the same noise)."""
    kind, value = parse_shift(name)
    if kind == "identity":
        return pixels.clone()
    if kind == "noise":
        gen = torch.Generator().manual_seed(int(seed))
        noise = torch.randn(pixels.shape, generator=gen, dtype=torch.float32)
        return pixels + value * noise.to(device=pixels.device, dtype=pixels.dtype)
    if pixels.dim() != 4:
        raise ValueError(f"shift {name!r} needs images [N, C, H, W], got shape {tuple(pixels.shape)}")
    if kind == "invert":
        return 1.0 - pixels
    if kind == "blur":
        return _gaussian_blur(pixels, value)
    return _rotate(pixels, value)


def _rotate(pixels: Tensor, degrees: float) -> Tensor:
    quarter = degrees / 90.0
    if quarter == int(quarter):
        k = int(quarter) % 4
        if k % 2 and pixels.shape[-1] != pixels.shape[-2]:
            raise ValueError(f"rotate-{degrees:g} needs square images, got {pixels.shape[-2]}x{pixels.shape[-1]}")
        return torch.rot90(pixels, k, dims=(-2, -1)).contiguous()
    # grid_sample's grid maps output to input coordinates: rotating the image by +θ
    # (counter-clockwise on screen, y pointing down) samples the input at R(θ)·(x, y).
    theta = math.radians(degrees)
    c, s = math.cos(theta), math.sin(theta)
    matrix = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=pixels.dtype, device=pixels.device)
    grid = F.affine_grid(matrix.expand(pixels.shape[0], 2, 3), list(pixels.shape), align_corners=False)
    return F.grid_sample(pixels, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _gaussian_blur(pixels: Tensor, sigma: float) -> Tensor:
    radius = max(1, math.ceil(3 * sigma))
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = (kernel / kernel.sum()).to(dtype=pixels.dtype, device=pixels.device)
    channels = pixels.shape[1]
    out = F.pad(pixels, (radius, radius, radius, radius), mode="replicate")
    # Separable: one depthwise pass along the rows, one along the columns.
    out = F.conv2d(out, kernel.reshape(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    return F.conv2d(out, kernel.reshape(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


def apply_transform(dataset: ArrayDataset, inputs: Tensor, transform: dict) -> Tensor:
    """``inputs`` (normalized, rows of ``dataset``) with the manifest ``transform``
    ``{"shift": name, "seed": int, ...}`` applied on the pixel scale."""
    name, seed = transform["shift"], int(transform.get("seed", 0))
    if dataset.mean is None:
        if parse_shift(name)[0] not in ("identity", "noise"):
            raise ValueError(f"shift {name!r} needs image data with a recorded normalization; "
                             f"dataset {dataset.name!r} has none (only identity and noise-<sigma> apply)")
        return shift_pixels(inputs, name, seed=seed)
    return dataset.from_pixels(shift_pixels(dataset.to_pixels(inputs), name, seed=seed))
