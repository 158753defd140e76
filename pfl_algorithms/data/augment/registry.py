"""The registry of augmentation steps, name -> :class:`~.step.Step` class, in the order ``pfl
list`` shows them.  A new transform is one module with its ``Step`` subclass plus its line here."""
from __future__ import annotations

from .crop import Crop
from .flip import Flip
from .grayscale import Grayscale
from .jitter import ColorJitter
from .resize import ResizedCrop
from .step import Step

STEPS: dict[str, type[Step]] = {step.name: step for step in (
    Crop,
    Flip,
    ResizedCrop,
    ColorJitter,
    Grayscale,
)}
