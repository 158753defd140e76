"""The ``jitter`` step: torchvision ``RandomApply([ColorJitter(brightness, contrast, saturation,
hue)], p)`` with a draw per sample (whether it applies, the order of the four adjustments and
their factors), the adjustments batched by position (the maths: :mod:`.colour`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from ._checks import check_batch, check_colour_channels, check_generator, check_probability, check_range
from .colour import adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation
from .step import Step, draw_bernoulli, draw_uniform

# The jitter's adjustments, in the index order of JitterParams.order / .factors.
JITTER_ADJUSTMENTS = ("brightness", "contrast", "saturation", "hue")
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
        low, high = check_range(name, value, positive=False)
        if low < bound[0] or high > bound[1]:
            raise ValueError(f"{name} range {value!r} must lie inside [{bound[0]}, {bound[1]}]")
    return None if low == high == center else (low, high)


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
    p = check_probability("p", p)
    ranges = _jitter_ranges(brightness, contrast, saturation, hue)
    apply = draw_bernoulli(batch, p, generator)
    order = draw_uniform((batch, 4), generator).argsort(1)
    uniforms = draw_uniform((batch, 4), generator)
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
    check_batch(pixels, name="pixels")
    check_colour_channels(pixels, "color jitter")
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
    check_batch(x)
    check_generator(generator)
    check_colour_channels(x, "color jitter")
    params = draw_jitter_params(x.shape[0], brightness=brightness, contrast=contrast, saturation=saturation,
                                hue=hue, p=p, generator=generator)
    return apply_color_jitter(x, params)


class ColorJitter(Step):
    """:func:`color_jitter` as a step (photometric)."""

    name = "jitter"
    description = ("colour jitter with probability p, the 4 adjustments in a random order per sample "
                   "(RandomApply([ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8))")
    defaults = {"brightness": 0.4, "contrast": 0.4, "saturation": 0.2, "hue": 0.1, "p": 0.8}
    photometric = True

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_probability("jitter p", options["p"])
        _jitter_ranges(options["brightness"], options["contrast"], options["saturation"], options["hue"])

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return color_jitter(x, generator, **self.options)
