"""The pipeline the engine calls: :class:`Augmentation` runs its steps in order on a normalized
batch, un-normalizing before the first photometric step, and :func:`make_augmentation` builds
one from a spec."""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from ._checks import check_batch, check_generator, check_size
from .registry import STEPS
from .spec import parse_augmentation_spec
from .step import PipelineContext, Step


def _fuse_neighbours(steps: Sequence[Step]) -> list[Step]:
    """``steps`` with each step that can fuse with the one after it (:meth:`Step.fuse`) merged with it."""
    runs: list[Step] = []
    for step in steps:
        fused = runs[-1].fuse(step) if runs else None
        if fused is None:
            runs.append(step)
        else:
            runs[-1] = fused
    return runs


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
        self.image_size = check_size(image_size)
        self._steps: list[Step] = []
        for name, options in steps:
            if name not in STEPS:
                raise ValueError(f"unknown augmentation step {name!r}; valid steps: {', '.join(STEPS)}")
            self._steps.append(STEPS[name](**options))
        # What __call__ runs: a crop directly followed by a flip becomes one gather.
        self._runs = _fuse_neighbours(self._steps)
        self._stats: dict[tuple, tuple[Tensor, Tensor]] = {}

    @property
    def steps(self) -> list[tuple[str, dict]]:
        """The steps as [(name, options with the defaults filled in)], in order."""
        return [(step.name, dict(step.options)) for step in self._steps]

    @property
    def spec(self) -> str:
        """The pipeline as a spec string (options that differ from the defaults written out);
        ``make_augmentation(aug.spec, ...)`` builds the same pipeline."""
        return ",".join(step.spec for step in self._steps)

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
        photometric ones on pixels (see the package docstring); a crop directly followed by a
        flip runs as one gather (the same draws and values as the two steps)."""
        check_batch(x)
        check_generator(generator)
        if self.mean is not None and x.shape[1] != len(self.mean):
            raise ValueError(f"the augmentation's mean/std have {len(self.mean)} values but the batch has "
                             f"{x.shape[1]} channels (x of shape {tuple(x.shape)}): build it with the dataset's "
                             "mean and std")
        if x.shape[0] == 0:
            return x
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()
        normalized = self.mean is not None
        mean, std = self._mean_std(work) if normalized else (None, None)
        on_pixels = PipelineContext(mean=None, std=None, image_size=self.image_size)
        for step in self._runs:
            if step.photometric and normalized:
                work, normalized = work * std + mean, False
            context = PipelineContext(mean=mean, std=std, image_size=self.image_size) if normalized else on_pixels
            work = step.run(work, generator, context)
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
