"""The ``Step`` interface every augmentation transform implements, and what steps share:
the pipeline context a step sees inside :class:`~.pipeline.Augmentation` and the uniform draw.

A step is a registered name, a one-line description (what ``pfl list`` prints), its options
with their defaults and checks, and whether it is photometric (defined on pixels: the pipeline
un-normalizes before it) or geometric (commutes with the per-channel normalization: it runs
on the normalized values).  Calling it applies it to a batch [B, C, H, W] with one draw per
sample from the given CPU generator; each step's draw is also a public ``draw_*`` function.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional

import torch
from torch import Tensor

from ._checks import check_option_names, check_probability


def draw_uniform(shape, generator: torch.Generator) -> Tensor:
    """Uniform [0, 1) draws in float64 on the CPU (float64: integer offsets floor(u * n) stay uniform)."""
    return torch.rand(shape, generator=generator, dtype=torch.float64)


def draw_bernoulli(batch: int, p: float, generator: torch.Generator) -> Tensor:
    """bool [batch] on the CPU, True with probability ``p`` per sample: ``torch.rand(batch) < p``
    (float64 draws), the coin of torchvision's ``Random*(p)`` transforms."""
    p = check_probability("p", p)
    return draw_uniform(batch, generator) < p


@dataclass(frozen=True)
class PipelineContext:
    """What a step inside a pipeline knows beyond its batch (see :meth:`Step.run`).

    Attributes:
        mean, std: the dataset's normalization as [C, 1, 1] tensors of the batch's dtype and
            device when the batch is normalized, ``(pixels - mean) / std``; None when it is on
            the pixel scale.
        image_size: the pipeline's output (height, width) for steps that resize; None: the input's.
    """

    mean: Optional[Tensor]
    std: Optional[Tensor]
    image_size: Optional[tuple[int, int]]


def _format_value(value) -> str:
    return repr(tuple(value)) if isinstance(value, list) else repr(value)


class Step(ABC):
    """One augmentation transform: ``step(x, generator) -> x'`` on a batch [B, C, H, W].

    Class attributes each transform sets: ``name`` (its name in specs and :data:`AUGMENTATIONS`),
    ``description`` (one line), ``defaults`` (its options and their default values, read-only)
    and ``photometric``.  ``Step(**options)`` fills in the defaults and checks every option
    (ValueError naming it), so a bad spec fails when it is built, not at the first batch.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    defaults: ClassVar[Mapping[str, Any]]
    photometric: ClassVar[bool] = False  # defined on pixels: the pipeline un-normalizes before it

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Read-only, so no instance can change what another one (or `pfl list`) takes as default.
        cls.defaults = MappingProxyType(dict(cls.defaults))

    def __init__(self, **options):
        check_option_names(self.name, options, self.defaults)
        self.options: dict[str, Any] = {**self.defaults, **options}
        self.check_options(self.options)

    @classmethod
    @abstractmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise ValueError for a bad value among ``options`` (every option given)."""

    @abstractmethod
    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        """The batch ``x`` [B, C, H, W] transformed, each sample with its own draws from the CPU
        ``generator``; ``x`` on whichever scale the step is defined on (photometric: pixels)."""

    def run(self, x: Tensor, generator: torch.Generator, context: PipelineContext) -> Tensor:
        """The step inside a pipeline: ``x`` is normalized when ``context.mean`` is set (never
        for a photometric step).  By default ``self(x, generator)``; a step whose options
        depend on the scale (the crop's black padding) or on the pipeline (the output size)
        overrides this."""
        return self(x, generator)

    def fuse(self, following: Step) -> Optional[Step]:
        """One step doing ``self`` then ``following`` with the same draws and the same values,
        cheaper than the two; None (the default) when there is none."""
        return None

    @property
    def spec(self) -> str:
        """The step in the spec language, options that differ from the defaults written out."""
        changed = {k: v for k, v in self.options.items() if v != self.defaults[k]}
        return self.name + (f"({', '.join(f'{k}={_format_value(v)}' for k, v in changed.items())})"
                            if changed else "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"
