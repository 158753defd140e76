"""CPU benchmark of the batched augmentation (``pfl_algorithms/data/augment/``) against a per-sample loop.

Two cases, on a batch of 256 CIFAR-shaped images (3x32x32, float32):

* ``crop_flip``: the CIFAR standard, ``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip()``.
* ``factorized_fl``: the released Factorized-FL code's training transforms,
  ``RandomResizedCrop(32)``, ``RandomHorizontalFlip()``, ``RandomApply([ColorJitter(0.4, 0.4,
  0.2, 0.1)], p=0.8)``, ``RandomGrayscale(p=0.2)``.

Sides:

* ours (``batched``): ``make_augmentation(spec, mean, std)`` on the normalized batch, as local
  training calls it (parameters drawn per sample on the CPU, applied with batched tensor ops).
* baseline (``per-sample-loop``): what a torchvision-style ``DataLoader`` transform does, one
  image at a time in a Python loop: the same parameter draws per sample from the generator
  (``torch.randint``/``torch.rand``/``torch.randperm`` calls of size 1, as torchvision's
  ``get_params``), the same tensor ops on [3, 32, 32] (``F.pad`` + slice, ``flip``,
  ``F.interpolate(antialias=True)`` of the box, torchvision's blend / HSV formulas), then
  ``Normalize``, then ``torch.stack``.  It starts from pixel-scale images, as a DataLoader's
  dataset stores them, and normalizes each sample at the end; ours starts from the normalized
  batch the engine stores.  Both return the normalized augmented batch.  (The real DataLoader
  adds PIL conversions, collation and worker overhead on top: the baseline is a lower bound
  on its cost.)

ratio = baseline / ours (speed-up).  No target: the issue asks for batched device-side
augmentation; the ratio shows what the per-sample Python loop it replaces would cost.

Run through the report (once ``report.py`` lists the suite)::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite augment [--quick]

or as a smoke check that runs each benchmarked function once::

    python -m pytest benchmarks/bench_augment.py -p no:cacheprovider --benchmark-disable

``PFL_BENCH_QUICK=1``: a batch of 16 (a smoke run), one repeat of fewer rounds.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks import _common as common
from benchmarks._common import Shape
from pfl_algorithms.data import augment
from pfl_algorithms.data.augment import make_augmentation

BATCH = 16 if common.QUICK else 256
SHAPES = (Shape(f"cifar-{BATCH}x3x32x32", (BATCH, 3, 32, 32)),)
MEAN, STD = (0.491, 0.482, 0.447), (0.247, 0.243, 0.262)  # CIFAR-10's, as the released code
SPECS = {"crop_flip": "crop,flip", "factorized_fl": "factorized-fl"}
SIDES = (("ours", "batched"), ("baseline", "per-sample-loop"))

pytestmark = common.benchmark_mark(max_time=1.0, quick_max_time=0.2)


# ---------------------------------------------------------------------------------------------
# The baseline: torchvision's per-sample transforms, written with the same tensor ops.


def _uniform(low: float, high: float, generator: torch.Generator) -> float:
    return float(torch.empty(1).uniform_(low, high, generator=generator))


def _crop(img, generator, padding=4):
    _, height, width = img.shape
    padded = F.pad(img, (padding, padding, padding, padding), value=0.0)
    top = int(torch.randint(0, 2 * padding + 1, (1,), generator=generator))
    left = int(torch.randint(0, 2 * padding + 1, (1,), generator=generator))
    return padded[:, top:top + height, left:left + width]


def _flip(img, generator, p=0.5):
    return img.flip(-1) if float(torch.rand(1, generator=generator)) < p else img


def _resized_crop(img, generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """RandomResizedCrop.get_params (10 tries, then the central crop), crop, antialiased bilinear resize."""
    _, height, width = img.shape
    box = None
    for _ in range(10):
        area = height * width * _uniform(*scale, generator)
        aspect = math.exp(_uniform(math.log(ratio[0]), math.log(ratio[1]), generator))
        w, h = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            box = top, left, h, w
            break
    if box is None:  # the input is square here, so the fallback is the whole image
        box = 0, 0, height, width
    top, left, h, w = box
    crop = img[None, :, top:top + h, left:left + w]
    return F.interpolate(crop, size=(height, width), mode="bilinear", align_corners=False, antialias=True)[0]


# The same adjustment functions as ours (torchvision's formulas), here on one image at a time.
ADJUSTMENTS = (augment.adjust_brightness, augment.adjust_contrast, augment.adjust_saturation, augment.adjust_hue)


def _jitter(img, generator, p=0.8, brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1):
    """RandomApply([ColorJitter(...)], p): one order and four factors per call (per image)."""
    if p < float(torch.rand(1, generator=generator)):
        return img
    order = torch.randperm(4, generator=generator).tolist()
    b = _uniform(1 - brightness, 1 + brightness, generator)
    c = _uniform(1 - contrast, 1 + contrast, generator)
    s = _uniform(1 - saturation, 1 + saturation, generator)
    h = _uniform(-hue, hue, generator)
    factors = (b, c, s, h)
    for k in order:
        img = ADJUSTMENTS[k](img[None], factors[k])[0]
    return img


def _grayscale(img, generator, p=0.2):
    return augment.rgb_to_grayscale(img).expand_as(img) if float(torch.rand(1, generator=generator)) < p else img


BASELINE_STEPS = {"crop_flip": (_crop, _flip), "factorized_fl": (_resized_crop, _flip, _jitter, _grayscale)}


def per_sample_loop(pixels: torch.Tensor, generator: torch.Generator, case: str, mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """The transforms of ``case`` one image at a time, each then normalized, stacked into a batch."""
    out = []
    for img in pixels:
        for step in BASELINE_STEPS[case]:
            img = step(img, generator)
        out.append((img - mean) / std)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------


def _batch(shape: Shape):
    """Random pixels in (0, 1) (never zeros) and their normalized version."""
    pixels = 0.02 + 0.96 * torch.rand(shape.weight, generator=torch.Generator().manual_seed(0))
    mean, std = torch.tensor(MEAN).reshape(-1, 1, 1), torch.tensor(STD).reshape(-1, 1, 1)
    return pixels, (pixels - mean) / std, mean, std


@pytest.mark.parametrize("case", list(SPECS))
@pytest.mark.parametrize("shape, side, impl, repeat", common.params(SHAPES, SIDES))
def test_augment(benchmark, case: str, shape: Shape, side: str, impl: str, repeat: int):
    """One augmented batch: the batched pipeline against the per-sample loop.

    Each side keeps one generator across rounds (as a client's generator advances through
    its batches), so the rounds see different draws with the same distribution.
    """
    pixels, inputs, mean, std = _batch(shape)
    generator = torch.Generator().manual_seed(1)
    if impl == "batched":
        aug = make_augmentation(SPECS[case], mean=MEAN, std=STD)

        def fn():
            return aug(inputs, generator)
    else:
        def fn():
            return per_sample_loop(pixels, generator, case, mean, std)
    out = common.run(benchmark, case, fn, {"spec": SPECS[case], "batch": BATCH})
    assert out.shape == shape.weight and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
