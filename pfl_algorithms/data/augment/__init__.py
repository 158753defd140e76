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

Layout.  :mod:`.step` holds the :class:`Step` interface every transform implements (name,
one-line description, options with defaults and checks, photometric or geometric, and
``step(x, generator)``); one module per transform holds its ``draw_*`` function, its batched
functional form and its ``Step``: :mod:`.crop`, :mod:`.flip`, :mod:`.resize` (resized crop),
:mod:`.jitter` (its pixel maths, shared with grayscale, in :mod:`.colour`) and
:mod:`.grayscale`.  :mod:`.registry` lists the steps (:data:`STEPS`; a new transform is its
module plus one line there), :mod:`.spec` the spec language and presets, :mod:`.pipeline`
:class:`Augmentation` and :func:`make_augmentation`; :mod:`._checks` the shared argument checks.
"""
from __future__ import annotations

from .colour import (GRAY_WEIGHTS, adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation,
                     rgb_to_grayscale)
from .crop import Crop, CropFlip, Fill, crop_padded, draw_crop_offsets, random_crop
from .flip import Flip, draw_flips, horizontal_flip
from .grayscale import Grayscale, draw_grayscale, random_grayscale
from .jitter import (JITTER_ADJUSTMENTS, ColorJitter, JitterParams, apply_color_jitter, color_jitter,
                     draw_jitter_params)
from .pipeline import Augmentation, make_augmentation
from .registry import STEPS
from .resize import ResizedCrop, draw_resized_crop_boxes, random_resized_crop, resized_crop
from .spec import AUGMENTATIONS, PRESETS, AugmentationSpec, parse_augmentation_spec
from .step import PipelineContext, Step, draw_bernoulli, draw_uniform

__all__ = [
    "AUGMENTATIONS", "Augmentation", "AugmentationSpec", "JitterParams", "make_augmentation",
    "parse_augmentation_spec",
    "draw_crop_offsets", "draw_flips", "draw_resized_crop_boxes", "draw_jitter_params", "draw_grayscale",
    "random_crop", "crop_padded", "horizontal_flip", "random_resized_crop", "resized_crop", "color_jitter",
    "apply_color_jitter", "random_grayscale", "rgb_to_grayscale", "adjust_brightness", "adjust_contrast",
    "adjust_saturation", "adjust_hue",
    "Step", "PipelineContext", "STEPS", "PRESETS", "Crop", "CropFlip", "Flip", "ResizedCrop", "ColorJitter",
    "Grayscale", "draw_uniform", "draw_bernoulli",
]
